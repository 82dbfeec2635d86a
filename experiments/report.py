"""The report: RESULTS.md and the claims' curve figures, built from the arm records alone (an arm without a
record is "not run yet", never a number) and the hand-written verdicts of experiments/notes.md.
"""

from __future__ import annotations

import math
import re
import statistics
from pathlib import Path

from experiments.arms import (BY_NAME, CLASSIFY_PRESETS, FD_CLASSIFIER_ARM, MAE_DECISIVE_BATCH, MAE_DECISIVE_EPOCHS,
                              MAE_LENGTHS, MATRIX, PROBE_EPOCHS_PAPER, RDP_DECISIVE_EPOCHS, RDP_SEEDS, READINGS, TIMM_PRESET,
                              TIMM_PRESET_224, TRAIN_SIZES, UVIT_DECISIVE_EPOCHS, UVIT_EMA_DECAY, Arm,
                              ema_initial_weight)
from experiments.probe_sweep import SWEPT_METRIC, load_sweeps
from experiments.runner import RECORDS_ROOT, REPO_ROOT, load_records

FIGURES_DIR = REPO_ROOT / "experiments" / "figures"  # the report's curve figures
NOTES_MD = REPO_ROOT / "experiments" / "notes.md"  # the hand-written verdict per claim ("## A", "## B", "## C")
RESULTS_MD = REPO_ROOT / "RESULTS.md"
CLAIM_TITLES = {"A": "Decayed identity shortcuts, MAE on CIFAR-10 (preset `mae_cifar10`, ViT-S/4)",
                "B": "U-ViT, decayed through the whole network (preset `uvit_cifar10`, U-ViT-S/2, CIFAR-10)",
                "C": "ResidualDroppath on CIFAR-10 (timm ResNet50d / ResNet50, dres ViT-Ti/4)"}


def stat(values: list[float], scale=1.0, digits=1) -> str:
    """``mean ± sd (n)`` over seeds (the sample standard deviation), or the one value."""
    v = [x * scale for x in values]
    if len(v) == 1:
        return f"{v[0]:.{digits}f}"
    return f"{statistics.fmean(v):.{digits}f} ± {statistics.stdev(v):.{digits}f} (n={len(v)})"


def metric(rec: dict, name: str):
    """A metric by name or, for names that carry a sampler suffix (``fd_cifar_classifier``), prefix."""
    m = rec["metrics"]
    if name in m:
        return m[name]
    if name == "effective_rank_entropy" and m.get("effective_rank"):  # recorded as exp(H) only before
        return math.log(m["effective_rank"])
    hits = [v for k, v in m.items() if k.startswith(name)]
    return hits[0] if hits else None


def group_cells(group: str, recs: dict, columns: list[tuple[str, float, int]]) -> tuple[list[str], list[dict]]:
    """Cells of one setting's row: epochs, seeds and each (metric, scale, digits) over its records."""
    rows = [r for r in recs.values() if r["group"] == group]
    if not rows:
        planned = next((a.epochs for a in MATRIX if a.group == group and a.epochs), 0)  # the decisive arms' length
        return [f"not run yet ({planned:g} epochs)" if planned else "not run yet"] + ["—"] * (1 + len(columns)), []
    epochs = sorted({r["epochs"] for r in rows})
    seeds = ",".join(str(r["seed"]) for r in sorted(rows, key=lambda r: r["seed"]))
    cells = ["/".join(f"{e:g}" for e in epochs), seeds]
    for name, scale, digits in columns:
        vals = [metric(r, name) for r in rows]
        vals = [v for v in vals if v is not None]
        cells.append(stat(vals, scale, digits) if vals else "—")
    return cells, rows


def probe_grid_lines(recs: dict, group_prefix: str) -> list[str]:
    """Per record of the groups starting with ``group_prefix`` that carries a ``probe_grid`` (U-ViT): a table of
    linear-probe accuracy (%) by noise level (rows) and block (columns), best cell in bold."""
    lines = []
    for name, r in sorted(recs.items()):
        grid = r["group"].startswith(group_prefix) and r["metrics"].get("probe_grid")
        if not grid:
            continue
        blocks, ts = sorted({g["block"] for g in grid}), sorted({g["t"] for g in grid})
        acc = {(g["t"], g["block"]): g["linear_probe_acc"] for g in grid}
        best = max(acc, key=acc.get)
        rows = [[f"{t:g}"] + [(f"**{100 * acc[t, b]:.1f}**" if (t, b) == best else f"{100 * acc[t, b]:.1f}")
                              if (t, b) in acc else "—" for b in blocks] for t in ts]
        lines += [f"`{name}` (seed {r['seed']}): linear-probe accuracy % by noise level t and block", ""]
        lines += _table(["t"] + [f"block {b}" for b in blocks], rows) + [""]
    return lines


def delta_line(recs: dict, a: str, b: str, name: str, scale: float, what: str) -> str | None:
    va = [metric(r, name) for r in recs.values() if r["group"] == a]
    vb = [metric(r, name) for r in recs.values() if r["group"] == b]
    va, vb = [v for v in va if v is not None], [v for v in vb if v is not None]
    if not va or not vb:
        return None
    d = (statistics.fmean(va) - statistics.fmean(vb)) * scale
    return f"- {what}: {d:+.2f} ({a} {len(va)} seed(s) vs {b} {len(vb)} seed(s))"


def paired_line(recs: dict, a: str, b: str, name: str, scale: float, what: str) -> str | None:
    """``a − b`` paired by seed: the mean difference with its 95% t confidence interval over the pairs."""
    by_seed = {g: {r["seed"]: metric(r, name) for r in recs.values() if r["group"] == g} for g in (a, b)}
    return paired_seed_line(by_seed[a], by_seed[b], scale, what)


def grid_best_line(recs: dict, a: str, b: str, what: str, largest: bool = False) -> str | None:
    """``a − b`` in each record's best probe-grid cell, paired by seed, the best taken over the cells that every
    record compared probed: all records of the two groups, or (``largest``) those that probed the largest grid."""
    grids = {n: {(g["block"], g["t"]): g["linear_probe_acc"] for g in r["metrics"].get("probe_grid") or []}
             for n, r in recs.items() if r["group"] in (a, b)}
    grids = {n: g for n, g in grids.items() if g}
    if largest:
        most = max(map(len, grids.values()), default=0)
        grids = {n: g for n, g in grids.items() if len(g) == most}
    cells = set.intersection(*(set(g) for g in grids.values())) if grids else set()
    if not cells:
        return None
    best = {x: {recs[n]["seed"]: max(g[c] for c in cells) for n, g in grids.items() if recs[n]["group"] == x}
            for x in (a, b)}
    blocks = ", ".join(str(k) for k in sorted({k for k, _ in cells}))
    ts = ", ".join(f"{t:g}" for t in sorted({t for _, t in cells}))
    where = "of the largest grid" if largest else "every record probed"
    return paired_seed_line(best[a], best[b], 100, f"{what} (the best of the {len(cells)} cells {where}: "
                                                   f"blocks {blocks}; t {ts})")


def seed_differences(by_seed_a: dict, by_seed_b: dict, scale: float) -> tuple[list[int], list[float]]:
    """The seeds both sides measured (None: not measured) and ``(a − b) x scale`` of each."""
    seeds = sorted(s for s in by_seed_a if s in by_seed_b and None not in (by_seed_a[s], by_seed_b[s]))
    return seeds, [(by_seed_a[s] - by_seed_b[s]) * scale for s in seeds]


def t_half_width(d: list[float], tests: int = 1) -> float:
    """The half-width of the two-sided 95% t interval of the mean of ``d`` (two or more values), Bonferroni-adjusted
    for ``tests`` intervals read together."""
    from scipy.stats import t

    return t.ppf(1 - 0.025 / tests, len(d) - 1) * statistics.stdev(d) / math.sqrt(len(d))


def paired_seed_line(by_seed_a: dict, by_seed_b: dict, scale: float, what: str) -> str | None:
    """The line of :func:`paired_line` from each side's value by seed (None: not measured)."""
    seeds, d = seed_differences(by_seed_a, by_seed_b, scale)
    if not seeds:
        return None
    seed_list = ",".join(str(s) for s in seeds)
    if len(d) == 1:
        return f"- {what}: {d[0]:+.2f} (seed {seed_list}; one pair, no interval)"
    return (f"- {what}: {statistics.fmean(d):+.2f} ± {t_half_width(d):.2f} (95% CI over {len(d)} seed pairs "
            f"{seed_list}; per seed {', '.join(f'{x:+.2f}' for x in d)})")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def _paper(arm: Arm) -> str:
    return "; ".join(f"{v} ({w})" for w, v in arm.paper) or "—"


def _groups(claim: str, stage: str) -> list[Arm]:
    """The first arm of every group of ``claim`` at ``stage`` (matrix order)."""
    seen, out = set(), []
    for a in MATRIX:
        if a.claim == claim and a.stage == stage and a.group not in seen:
            seen.add(a.group)
            out.append(a)
    return out


def _notes(f: Path) -> dict[str, str]:
    f = Path(f)
    if not f.exists():
        return {}
    out, key = {}, None
    for line in f.read_text().splitlines():
        if line.startswith("## "):
            key = line[3:].strip().split()[0]
            out[key] = ""
        elif key:
            out[key] += line + "\n"
    return {k: v.strip() for k, v in out.items()}


def seed_curves(runs: list[list[dict]], keys: list[str], x: str = "epoch") -> tuple[list[dict], dict]:
    """The curve points of several seeds of one arm (``runs``: each seed's points) as one line per key, the mean
    over the seeds that have that key at every ``x`` all of those reached, and its band, ``(xs, lows, highs)``
    over the same seeds (none where one seed has the key)."""
    if len(runs) == 1:
        return runs[0], {}
    points: dict[float, dict] = {}
    bands = {}
    for key in keys:
        having = [{p[x]: p[key] for p in pts if isinstance(p.get(key), (int, float))} for pts in runs]
        having = [h for h in having if h]
        if not having:
            continue
        xs = sorted(set.intersection(*(set(h) for h in having)))
        for v in xs:
            points.setdefault(v, {x: v})[key] = statistics.fmean(h[v] for h in having)
        if len(having) > 1:
            bands[key] = (xs, [min(h[v] for h in having) for v in xs], [max(h[v] for h in having) for v in xs])
    return [points[v] for v in sorted(points)], bands


def claim_figure(claim: str, stage: str, recs: dict, figures: Path, keys: list[str], name: str,
                 draw: bool, groups: tuple[str, ...] = ("",)) -> Path | None:
    """``figures/name``: the curves of every arm group of ``claim`` at ``stage`` whose name starts with one of
    ``groups`` and that has some, one line a group (the mean over its seeds, their range shaded:
    :func:`seed_curves`; drawn when ``draw``)."""
    from dres.eval.curves import plot_curves

    runs: dict[str, list[list[dict]]] = {}
    for r in recs.values():
        if (r["claim"] == claim and BY_NAME[r["arm"]].stage == stage and r["curves"]
                and r["group"].startswith(groups)):
            runs.setdefault(r["group"], []).append(r["curves"])
    keys = [k for k in keys if any(any(k in p for p in pts) for seeds in runs.values() for pts in seeds)]
    if not runs or not keys:
        return None
    if draw:
        series, bands = {}, {}
        for group, seeds in runs.items():
            label = group + (f" ({len(seeds)} seeds: mean, range shaded)" if len(seeds) > 1 else "")
            series[label], bands[label] = seed_curves(seeds, keys)
        Path(figures).mkdir(parents=True, exist_ok=True)
        plot_curves(series, Path(figures) / name, keys, title=f"claim {claim} ({stage} runs): metrics over training",
                    bands=bands)
    return Path(figures) / name


def report(records: Path = RECORDS_ROOT, out: Path = RESULTS_MD, figures: Path = FIGURES_DIR,
           notes: Path = NOTES_MD) -> str:
    """Write ``out`` (and the claims' curve figures under ``figures``) from the records and the
    verdicts in ``notes``; returns the text."""
    text = render(records, Path(out).resolve().parent, figures=figures, notes=notes)
    Path(out).write_text(text)
    return text


A_COLUMNS = [("linear_probe_acc", 100, 1), ("knn_acc", 100, 1), ("effective_rank_entropy", 1, 2),
             ("effective_rank", 1, 1)]
A_HEADER = ["probe %", "kNN %", "H (eq. 6)", "exp(H)"]
# the decisive arms also read the authors' way: the raw last stream's mean over all tokens, their probe
A_DECISIVE_COLUMNS = [A_COLUMNS[0], ("authors_probe_acc", 100, 1), A_COLUMNS[1], ("knn_std_acc", 100, 1),
                      ("stream_mean_authors_probe_acc", 100, 1), ("stream_mean_knn_acc", 100, 1)] + A_COLUMNS[2:]
A_DECISIVE_HEADER = [A_HEADER[0], "authors' probe % (cls; the primary readout)", A_HEADER[1], "kNN % standardised",
                     "authors' probe % (stream mean)", "kNN % (stream mean)"] + A_HEADER[2:]
A_CURVES = ["linear_probe_acc", "knn_acc", "effective_rank_entropy", "effective_rank"]
# (group a, group b, metric, scale, label) of a − b in the short runs
A_COMPARISONS = [("official-a0.6", "official-a1.0", "linear_probe_acc", 100,
                  "probe, official 0.6 − official 1.0 (points)"),
                 ("official-a0.6", "official-a1.0", "knn_acc", 100, "kNN, official 0.6 − official 1.0 (points)"),
                 ("baseline-a0.6", "baseline-a1.0", "linear_probe_acc", 100,
                  "probe, baseline 0.6 − baseline 1.0 (points; zero-init on at 0.6 only)")]
# claim A's readouts of official 0.6 − official 1.0, fixed before the runs at other lengths (experiments/notes.md):
# the primary alone gives the verdict; the secondary ones are read with the multiplicity of all of them
A_PRIMARY = ("authors_probe_acc", "the authors' probe on the class token")
A_SECONDARY = [("linear_probe_acc", "the project's probe on the class token"),
               ("stream_mean_authors_probe_acc", "the authors' probe on the stream mean"),
               ("stream_mean_linear_probe_acc", "the project's probe on the stream mean"),
               ("knn_acc", "kNN on the class token"), ("knn_std_acc", "kNN on the standardised class token"),
               ("stream_mean_knn_acc", "kNN on the stream mean"),
               ("stream_mean_knn_std_acc", "kNN on the standardised stream mean")]
# the probe sweep's best probe per arm on each feature kind (experiments.probe_sweep): secondary readouts too,
# counted where a record carries them
A_SWEPT = [(SWEPT_METRIC, "the swept probe on the class token"),
           (f"stream_mean_{SWEPT_METRIC}", "the swept probe on the stream mean")]
A_LENGTHS = tuple(sorted({*MAE_LENGTHS, MAE_DECISIVE_EPOCHS}))
B_COLUMNS = [("probe_t0.1_linear_probe_acc", 100, 1), ("probe_t0.1_knn_acc", 100, 1), ("fd_cifar_classifier", 1, 2),
             ("fd_noise_cifar_classifier", 1, 2), ("fd_real_cifar_classifier", 1, 2), ("fid_", 1, 2)]
B_HEADER = ["mid-block probe %", "mid-block kNN %", "fd_cifar_classifier", "same for noise",
            "same for real train images (floor)", "FID"]
C_COLUMNS = [("top1", 100, 2), ("final_epoch_train_acc", 100, 1), ("final_epoch_loss", 1, 3)]
# (mode a, mode b) of a − b in top-1, both stages of C: the claim against drop path, then each against none
C_COMPARISONS = [("residual_droppath", "drop_path"), ("residual_droppath", "none"), ("drop_path", "none")]
# the decisive recipes' groups: (prefix, what) for the paired lines
C_DECISIVE_PREFIXES = [("C300", "32 px"), ("C300d0", "32 px, no head dropout"), ("C600", "32 px, 600 epochs"),
                       ("C224", "224 px")]


def fd_draw_lines(recs: dict, group_prefix: str) -> list[str]:
    """Per record of the groups starting with ``group_prefix`` that measured several sample draws: each draw's
    fd_cifar_classifier, their sd and the real-vs-real floor."""
    lines = []
    for name, r in sorted(recs.items()):
        m = r["metrics"]
        draws = sorted(k for k in m if k.startswith("fd_cifar_classifier") and "_draw" in k)
        if not r["group"].startswith(group_prefix) or not draws:
            continue
        sd = next((v for k, v in m.items() if k.startswith("fd_cifar_classifier") and k.endswith("_sd")), None)
        floor = (f"; real train images against the test images {m['fd_real_cifar_classifier']:.2f}"
                        if "fd_real_cifar_classifier" in m else "")
        lines.append(f"- `{name}`: fd_cifar_classifier of {len(draws)} draws "
                     + " / ".join(f"{m[k]:.2f}" for k in draws) + (f" (sd {sd:.2f})" if sd is not None else "")
                     + floor)
    return lines + [""] if lines else []


def fd_along_training_lines(recs: dict, group_prefix: str) -> list[str]:
    """Per record with a classifier FD at its curve points (``fd_cifar_classifier_curve``): the points' FD from
    first to last and Spearman's rank correlation of FD with the step (near -1: FD ranks the model's progress)."""
    from scipy.stats import spearmanr

    lines = []
    for name, r in sorted(recs.items()):
        pts = [(p["step"], p["fd_cifar_classifier_curve"]) for p in r["curves"] if "fd_cifar_classifier_curve" in p]
        if not r["group"].startswith(group_prefix) or len(pts) < 3:
            continue
        rho = spearmanr([s for s, _ in pts], [f for _, f in pts]).statistic
        lines.append(f"- `{name}`: {len(pts)} points, FD {pts[0][1]:.1f} at step {pts[0][0]:,} to {pts[-1][1]:.1f} at "
                     f"step {pts[-1][0]:,}; Spearman's rho of FD with the step {rho:+.2f}")
    return lines + [""] if lines else []


def length_gaps(recs: dict, name: str, length: int) -> tuple[list[int], list[float]]:
    """Claim A's official 0.6 − official 1.0 in metric ``name`` (points) at ``length`` epochs: the seeds paired
    and each pair's difference."""
    by_seed = {g: {r["seed"]: metric(r, name) for r in recs.values() if r["group"] == f"A{length}-official-{g}"}
               for g in ("a0.6", "a1.0")}
    return seed_differences(by_seed["a0.6"], by_seed["a1.0"], 100)


T_INTERVAL = ", 95% t interval"  # what an interval of two pairs or more is, said after it


def interval(d: list[float], tests: int = 1) -> str:
    """Paired differences as ``mean ± half-width (low to high; n=N pairs)``, the 95% t interval Bonferroni-adjusted
    for ``tests`` readouts; one pair: its value, no interval."""
    if len(d) == 1:
        return f"{d[0]:+.2f} (n=1 pair, no interval)"
    mean, half = statistics.fmean(d), t_half_width(d, tests)
    return f"{mean:+.2f} ± {half:.2f} ({mean - half:+.2f} to {mean + half:+.2f}, n={len(d)} pairs)"


def length_trend(recs: dict, name: str) -> tuple[float, float, int, list[int]] | None:
    """The least-squares slope of metric ``name``'s per-pair gaps (:func:`length_gaps`) on log2(epochs) over the
    pairs of every length (points per doubling of the schedule), its 95% t half-width, the pairs and the lengths;
    None below two lengths or three pairs."""
    from scipy.stats import linregress, t

    xs, ys, lengths = [], [], []
    for length in A_LENGTHS:
        d = length_gaps(recs, name, length)[1]
        xs += [math.log2(length)] * len(d)
        ys += d
        lengths += [length] if d else []
    if len(lengths) < 2 or len(ys) < 3:
        return None
    fit = linregress(xs, ys)
    return fit.slope, t.ppf(0.975, len(ys) - 2) * fit.stderr, len(ys), lengths


def a_verdict(recs: dict) -> list[str]:
    """Claim A's verdict lines: the primary readout at each length with its 95% interval and n, and its trend."""
    name, what = A_PRIMARY
    lines = []
    for length in A_LENGTHS:
        seeds, d = length_gaps(recs, name, length)
        per_seed = ", ".join(f"seed {s} {x:+.2f}" for s, x in zip(seeds, d))
        lines.append(f"- primary readout ({what}), official 0.6 − official 1.0, {length} epochs: "
                     + (f"{interval(d)}{T_INTERVAL if len(d) > 1 else ''}; {per_seed}" if d else "not run yet"))
    trend = length_trend(recs, name)
    if trend:
        slope, half, n, lengths = trend
        lines.append(f"- trend of the primary readout against log length: {slope:+.2f} ± {half:.2f} points per "
                     f"doubling of the schedule (95% t interval of the least-squares slope on log2(epochs); n={n} "
                     f"pairs at {', '.join(map(str, lengths))} epochs)")
    else:
        lines.append("- trend of the primary readout against log length: not yet (pairs at two lengths or more)")
    return lines


def a_glance(recs: dict) -> str | None:
    """Claim A's primary readout at the lengths measured, in one sentence for the top of the report (None before
    any pair)."""
    name, what = A_PRIMARY
    parts = [f"{length} epochs {interval(d)}" for length in A_LENGTHS for d in [length_gaps(recs, name, length)[1]]
             if d]
    if not parts:
        return None
    trend = length_trend(recs, name)
    if trend:
        parts.append(f"slope on log2(epochs) {trend[0]:+.2f} ± {trend[1]:.2f} points per doubling (n={trend[2]} "
                     "pairs)")
    return (f"The primary readout, fixed before the runs at other lengths ({what}; one of {len(a_readouts(recs))} "
            "readouts looked at, the others secondary), official 0.6 − official 1.0 with its 95% t interval: "
            + "; ".join(parts) + ".")


def a_readouts(recs: dict) -> list[tuple[str, str]]:
    """Claim A's readouts the report shows, each ``(metric, what)``: the primary, the secondary ones and, where a
    record carries them, the probe sweep's two."""
    swept = any(name in r["metrics"] for r in recs.values() for name, _ in A_SWEPT)
    return [A_PRIMARY] + A_SECONDARY + (A_SWEPT if swept else [])


def add_sweeps(recs: dict, sweeps: dict) -> list[str]:
    """Each sweep's metrics (:func:`experiments.probe_sweep.load_sweeps`) added to its arm's record, with the sweep
    as ``sweep``, where it swept that record's run (its fixed-recipe probes are the record's); the arms of the
    others, not counted."""
    other = []
    for name, sweep in sweeps.items():
        rec, run = recs.get(name), sweep.get("run_eval") or {}
        shared = [k for k in run if rec and k in rec["metrics"]]
        if not shared or any(rec["metrics"][k] != run[k] for k in shared):
            other.append(name)
            continue
        rec["metrics"] = {**rec["metrics"], **sweep["metrics"]}
        rec["sweep"] = sweep
    return other


def a_sweep_block(page: "Page") -> list[str]:
    """Claim A's probe sweep, a secondary readout: per arm the chosen probe of each feature kind beside the
    fixed-recipe probes of its record, then official 0.6 − official 1.0 of the swept probe at each length with its
    interval; nothing before a sweep."""
    recs = page.recs
    swept = {n: r for n, r in recs.items() if "sweep" in r}
    if not swept and not page.other_run_sweeps:
        return []
    tests = len(a_readouts(recs))
    first = next((r["sweep"] for r in swept.values()), None)
    grid, held_out = "a grid of learning rate x weight decay x epochs", ""
    if first:
        grid = (f"learning rate {' / '.join(f'{v:g}' for v in first['grid']['lr'])} x weight decay "
                f"{' / '.join(f'{v:g}' for v in first['grid']['weight_decay'])} x "
                f"{' / '.join(map(str, first['grid']['epochs']))} epochs")
        held_out = f"{first['held_out_frac']:.0%}, "
    L = ["### Claim A: the probe sweep, a secondary readout", "",
         "The project's probe re-tuned per arm on the arm's kept features (`python -m experiments.probe_sweep`): "
         f"{grid}, on raw and on standardised features (AdamW, cosine per iteration, batch 1024), each trained on the "
         f"train split less a held-out part ({held_out}one draw for every arm) and scored on that part; the best "
         "setting is trained on the whole train split and scored on the test split. One of claim A's secondary "
         "readouts, fixed before the runs at other lengths (experiments/notes.md), never its verdict: with the "
         f"sweep's two the report counts {tests} readouts, and each gap below gives its 95% t interval and, beside it, "
         f"the interval Bonferroni-adjusted for the {tests}. The fixed-recipe probes are the arm's record's, of the "
         "same run.", ""]
    rows = []
    for name, r in swept.items():
        sweep = r["sweep"]
        for kind, k in sweep["kinds"].items():
            prefix = "" if kind == sweep["primary"] else f"{kind}_"
            fixed = [r["metrics"].get(f"{prefix}{m}") for m in ("linear_probe_acc", "authors_probe_acc")]
            c = k["chosen"]
            images = f"{sweep['n_train']:,} ({k['n_held_out']:,} held out) / {sweep['n_test']:,}"
            rows.append([f"`{name}`", kind, images]
                        + [f"{100 * v:.1f}" if v is not None else "—" for v in fixed]
                        + [f"**{100 * k['test_acc']:.1f}**", f"lr {c['lr']:g}, wd {c['weight_decay']:g}, "
                           f"{c['epochs']} epochs, {'standardised' if c['standardized'] else 'raw'}",
                           f"{100 * k['held_out_acc']:.1f}"])
    L += _table(["arm", "features", "train (held out) / test images", "project's probe % (fixed recipe)",
                 "authors' probe % (fixed recipe)", "swept probe % (test)", "chosen setting", "held-out %"], rows)
    gaps = []
    for name, what in A_SWEPT:
        for length in A_LENGTHS:
            d = length_gaps(recs, name, length)[1]
            if d:
                adjusted = f"; Bonferroni x{tests}: ± {t_half_width(d, tests):.2f}" if len(d) > 1 else ""
                gaps.append(f"- {what}, official 0.6 − official 1.0, {length} epochs: {interval(d)}"
                            f"{T_INTERVAL if len(d) > 1 else ''}{adjusted}")
    L += ["", "Differences (from the records and their sweeps):", ""] + (gaps or ["- no pair swept yet"]) + [""]
    if page.other_run_sweeps:
        L += ["Not counted (a sweep of another run than the arm's record, or of an arm without one): "
              + ", ".join(f"`{n}`" for n in page.other_run_sweeps) + ".", ""]
    return L


def a_length_block(page: "Page") -> list[str]:
    """Claim A by training length: the verdict (:func:`a_verdict`), every readout at every length (the secondary
    ones with their Bonferroni-adjusted intervals), the figure of the gap against length and the curves."""
    recs, tests = page.recs, len(a_readouts(page.recs))
    rows = []
    for i, (name, what) in enumerate(a_readouts(recs)):
        cells = []
        for length in A_LENGTHS:
            d = length_gaps(recs, name, length)[1]
            if not d:
                cells.append("—")
            elif i == 0 or len(d) == 1:
                cells.append(interval(d))
            else:
                cells.append(f"{interval(d)}; Bonferroni x{tests}: ± {t_half_width(d, tests):.2f}")
        rows.append([f"**primary**: {what}" if i == 0 else what] + cells)
    L = ["### Claim A by training length: the primary readout and the secondary ones", "",
         f"Official 0.6 − official 1.0 (both zero-init), the preset's recipe at batch {MAE_DECISIVE_BATCH} and its "
         f"20 warm-up epochs at every length, paired by seed. The readouts were fixed before the runs at "
         f"{', '.join(map(str, MAE_LENGTHS))} epochs (experiments/notes.md): {tests} readouts looked at, of which "
         "the primary alone gives the verdict (its 95% t interval, no adjustment); each secondary one with its 95% "
         f"t interval and, beside it, the interval Bonferroni-adjusted for the {tests} readouts read together.", ""]
    L += ["Verdict (from the records):", ""] + a_verdict(recs) + [""]
    L += _table(["readout (points)"] + [f"{length} epochs" for length in A_LENGTHS], rows) + [""]
    fig = a_length_figure(recs, page.figures, page.draw)
    L += [f"![claim A gap against length]({page.rel(fig)})" if fig else "Gap against length: no record yet.", ""]
    curves = claim_figure("A", "decisive", recs, page.figures, A_CURVES, "mae_length_curves.png", page.draw,
                          tuple(f"A{length}-" for length in MAE_LENGTHS))
    if curves:
        L += [f"![claim A curves at other lengths]({page.rel(curves)})", ""]
    return L


def a_length_figure(recs: dict, figures: Path, draw: bool) -> Path | None:
    """``figures/mae_gap_by_length.png``: every readout's mean gap against log2(epochs), the primary's 95% t
    interval shaded and its seed pairs as points (drawn when ``draw``); None without a record."""
    from dres.eval.curves import plot_curves

    x, key = "log2(epochs)", "official 0.6 − 1.0, points"
    series, bands, dots = {}, {}, {}
    for i, (name, what) in enumerate(a_readouts(recs)):
        gaps = [(math.log2(length), d) for length in A_LENGTHS for d in [length_gaps(recs, name, length)[1]] if d]
        if not gaps:
            continue
        label = f"primary: {what}" if i == 0 else what
        series[label] = [{x: lx, key: statistics.fmean(d)} for lx, d in gaps]
        spread = [(lx, statistics.fmean(d), t_half_width(d)) for lx, d in gaps if len(d) > 1]
        if i == 0 and spread:
            bands[label] = {key: ([lx for lx, _, _ in spread], [m - h for _, m, h in spread],
                                  [m + h for _, m, h in spread])}
        if i == 0:
            dots[label] = {key: ([lx for lx, d in gaps for _ in d], [g for _, d in gaps for g in d])}
    if not series:
        return None
    path = Path(figures) / "mae_gap_by_length.png"
    if draw:
        plot_curves(series, path, [key], x=x, title="claim A: the gap against the schedule's length "
                    "(the primary's 95% t interval shaded, its seed pairs as points)", bands=bands, dots=dots)
    return path


class Page:
    """What every part of the report reads: the records, the verdicts, where figures go, paths made relative."""

    def __init__(self, records: Path, base: Path, figures: Path, notes: Path, draw: bool):
        self.records, self.base = Path(records).resolve(), Path(base).resolve()
        self.figures, self.notes, self.draw = Path(figures).resolve(), notes, draw
        self.other_recipe: list[Path] = []
        self.recs = load_records(self.records, self.other_recipe)
        self.other_run_sweeps = add_sweeps(self.recs, load_sweeps(self.records))
        self.verdicts = _notes(notes)

    def rel(self, p) -> str:
        p = Path(p).resolve()
        return p.relative_to(self.base).as_posix() if p.is_relative_to(self.base) else str(p)

    def block(self, claim, stage, title, intro, header, rows, curve_keys, figure, deltas,
              groups=("",)) -> list[str]:
        """One stage of a claim: its title, intro, table, curve figure (of the groups starting with one of
        ``groups``) and differences."""
        fig = claim_figure(claim, stage, self.recs, self.figures, curve_keys, figure, self.draw, groups)
        curves = f"![claim {claim} {stage} curves]({self.rel(fig)})" if fig else "Curves: none yet (no record)."
        deltas = [d for d in deltas if d]
        tail = ["Differences (from the records):", ""] + deltas + [""] if deltas else []
        return [f"### {title}", "", intro, ""] + _table(header, rows) + ["", curves, ""] + tail

    def rows(self, claim, stage, columns, row) -> list[list[str]]:
        """A table row per setting of ``claim`` at ``stage``: ``row(its first arm, its cells, its records)``."""
        return [row(a, *group_cells(a.group, self.recs, columns)) for a in _groups(claim, stage)]

    def headline(self, claim) -> str | None:
        """The verdict's lead: its opening bold passage, on one line."""
        lead = re.match(r"\*\*(.+?)\*\*", self.verdicts.get(claim, ""), re.DOTALL)
        return " ".join(lead.group(1).split()) if lead else None

    def verdict(self, claim) -> list[str]:
        return [self.verdicts.get(claim) or f"Verdict: pending — write it under `## {claim}` in {self.rel(self.notes)} "
                "and rebuild.", ""]


def render(records: Path, base: Path, figures: Path = FIGURES_DIR, notes: Path = NOTES_MD, draw: bool = True) -> str:
    """The Markdown of the records and the verdicts in ``notes``, paths relative to ``base``; the
    curve figures go to ``figures`` and are drawn when ``draw``."""
    page = Page(records, base, figures, notes, draw)
    L = ["# Reproducing the papers' claims at CIFAR scale", "",
         "Generated by `python -m experiments.repro --report` from the records in "
         f"`{page.rel(page.records)}/` (one JSON per finished arm: metrics, seed, epochs, card, date, commit, command). "
         "An arm without a record reads *not run yet*. Values are mean ± standard deviation over seeds (n seeds), "
         "or the single run's value; differences of the decisive runs are paired by seed, with a 95% t "
         "interval. The papers' numbers are on other data and models (ImageNet, CIFAR-100, ViT-B/16): compare "
         "directions, not absolute values. Each claim has its decisive runs (the papers' recipes at full length, "
         "with seeds) and the earlier short runs (one seed, shorter, other settings), never mixed in one table.",
         ""]
    return "\n".join(L + at_a_glance(page) + claim_a(page) + claim_b(page) + claim_c(page) + runs(page))


def at_a_glance(page: Page) -> list[str]:
    """Each claim's verdict in its lead sentence, ahead of the tables."""
    leads = [(c, t, page.headline(c)) for c, t in CLAIM_TITLES.items()]
    primary = a_glance(page.recs)
    if not primary and not any(lead for _, _, lead in leads):
        return []
    return (["## At a glance", "", "Each claim's verdict as its section below opens it (the tables, the intervals and "
             "the records follow there); under A, its primary readout from the records.", ""]
            + [f"- **{c}. {t}**: {lead or 'verdict pending.'}" + (f"\n  - {primary}" if c == "A" and primary else "")
               for c, t, lead in leads] + [""])


def claim_a(page: Page) -> list[str]:
    recs = page.recs

    def a_rows(stage, columns):
        return page.rows("A", stage, columns, lambda a, cells, _: [a.labels["variant"], f"{a.labels['alpha_min']:g}",
                                                                   a.labels["zero_init"]] + cells + [_paper(a)])
    labels = ["variant", "alpha_min", "zero_init", "epochs", "seeds"]
    L = [f"## A. {CLAIM_TITLES['A']}", "",
         "Linear probe (on frozen cls features, eval.probe_epochs) and kNN (k=20, cosine) on the 10k test split; "
         "effective rank of the last-layer cls features as eq. 6 defines it, the entropy H of the normalised "
         "singular values of their covariance, and as exp(H). The IN-1K numbers are vanilla MAE's, on the "
         "baseline 1.0 row.", ""]
    L += page.block("A", "decisive", f"Decisive runs: {MAE_DECISIVE_EPOCHS} epochs (the official pair also "
                    f"{', '.join(map(str, MAE_LENGTHS))}), batch {MAE_DECISIVE_BATCH}, probe {PROBE_EPOCHS_PAPER} epochs",
                    f"Preset `mae_cifar10` at its {MAE_DECISIVE_EPOCHS} epochs (20 warm-up), batch {MAE_DECISIVE_BATCH} "
                    f"(lr = blr x batch / 256) in every arm; the official pair also at full schedules of "
                    f"{', '.join(map(str, MAE_LENGTHS))} epochs (the same 20 warm-up epochs). The project's probe: {PROBE_EPOCHS_PAPER} epochs, lr 1e-2 "
                    "cosine per iteration, batch 1024, AdamW, on cls features standardised by the train split's mean "
                    "and std (what MAE's own probe does with its affine-free BatchNorm; the decayed-shortcut paper's "
                    "code has none). The authors' evaluation (arms run since it was added; `—` before): their "
                    "`eval_model` probe (raw features, AdamW lr 1e-2 with weight decay 0.01, cosine per epoch, 200 "
                    "epochs) on the class token and on the last encoder block's stream averaged over all tokens. Official 0.6 vs 1.0 both "
                    "with `model.zero_init=true`, so initialisation is not confounded with alpha; baseline 1.0 is "
                    "vanilla MAE (no zero-init), baseline 1.0 zi the same with zero-init, to separate the official "
                    "architecture (skips, SkipLayer, decoder input, no final encoder LayerNorm) from the init.",
                    labels + A_DECISIVE_HEADER + ["papers (ImageNet)"], a_rows("decisive", A_DECISIVE_COLUMNS),
                    A_CURVES, "mae_decisive_curves.png",
                    [paired_line(recs, "A400-baseline-a0.6", "A400-baseline-a1.0", "linear_probe_acc", 100,
                                 "probe, baseline 0.6 − baseline 1.0 (points; zero-init on at 0.6 only)"),
                     paired_line(recs, "A400-official-a1.0", "A400-baseline-a1.0-zi", "linear_probe_acc", 100,
                                 "probe, official 1.0 − baseline 1.0 zi (points; official architecture vs vanilla "
                                 "MAE, both zero-init)"),
                     paired_line(recs, "A400-official-a0.6", "A400-official-a1.0", "effective_rank_entropy", 1,
                                 "H, official 0.6 − official 1.0 (the paper's mechanism, not a readout of the claim)"),
                     paired_line(recs, "A400-baseline-a1.0-zi", "A400-baseline-a1.0", "linear_probe_acc", 100,
                                 "probe, baseline 1.0 zi − baseline 1.0 (points; zero-init alone)")],
                    groups=(f"A{MAE_DECISIVE_EPOCHS}-",))
    L += a_length_block(page) + a_sweep_block(page)
    L += page.block("A", "short", "Earlier short runs: 50 epochs, batch 512, probe 100 epochs, one seed",
                    "The first runs: 40% of the 50 epochs warm-up; official 1.0 with `model.zero_init=true`, the "
                    "other arms `auto` (zero-init where alpha_min < 1), so official 1.0 − baseline 1.0 changes the "
                    "official architecture and the initialisation together.",
                    labels + A_HEADER + ["papers (ImageNet)"], a_rows("short", A_COLUMNS), A_CURVES, "mae_curves.png",
                    [delta_line(recs, f"A-{x}", f"A-{y}", m, scale, what) for x, y, m, scale, what in A_COMPARISONS]
                    + [delta_line(recs, "A-official-a1.0", "A-baseline-a1.0", "linear_probe_acc", 100,
                                  "probe, official 1.0 − baseline 1.0 (points; the official architecture and "
                                  "zero-init together)")])
    return L + page.verdict("A")


def claim_b(page: Page) -> list[str]:
    recs = page.recs

    def b_row(a, cells, recs_b):
        grid = next((r["artifacts"].get("samples_png") for r in recs_b if r["artifacts"].get("samples_png")), None)
        return [f"{a.labels['alpha_min']:g}"] + cells + [f"![samples]({page.rel(grid)})" if grid else "—", _paper(a)]

    def b_rows(stage):
        return page.rows("B", stage, B_COLUMNS, b_row)
    b_header = ["alpha_min", "epochs", "seeds"] + B_HEADER + ["samples", "paper (CIFAR-100)"]
    steps_b = UVIT_DECISIVE_EPOCHS * (TRAIN_SIZES["cifar10_wds"] // 128)
    L = [f"## B. {CLAIM_TITLES['B']}", "",
         "The paper's numbers are on CIFAR-100, which cannot be had offline here: B runs on CIFAR-10. Probe of "
         "the mid-block features at t=0.1 (eval.probe_epochs), and `fd_cifar_classifier`: the Frechet "
         "distance between generated and test images in the penultimate features of a CIFAR-10 ViT classifier "
         f"trained by dres (arm `{FD_CLASSIFIER_ARM}`), beside the same distance for the sampler's starting noise "
         "(samples of a trained model must be far below it) and, where measured, for real train images (the floor "
         "a perfect generator would reach at this sample size). **It is not FID** and not comparable to published "
         "FID values (the Inception weights cannot be downloaded here; with `eval.fid_inception=...` the same "
         "command reports real FID).", ""]
    L += page.block("B", "decisive", f"Decisive runs: {steps_b:,} steps, EMA {UVIT_EMA_DECAY}",
                    f"{UVIT_DECISIVE_EPOCHS} epochs of batch 128 ({steps_b:,} steps; the paper trains 500k), EMA decay "
                    f"{UVIT_EMA_DECAY} chosen for that length: the initial weights weigh {UVIT_EMA_DECAY}^{steps_b} = "
                    f"{ema_initial_weight(UVIT_EMA_DECAY, steps_b):.2%} of the evaluated model (the paper's 0.9999 "
                    f"would leave {ema_initial_weight(0.9999, steps_b):.1%}). `model.zero_init=true` in both arms "
                    "(matched). Seeds 1 and 2 average fd_cifar_classifier over three sample draws.",
                    b_header, b_rows("decisive"),
                    ["probe_t0.1_linear_probe_acc", "probe_t0.1_knn_acc", "fd_cifar_classifier_curve"],
                    "uvit_decisive_curves.png",
                    [paired_line(recs, "B64-uvit-a0.7", "B64-uvit-a1.0", "probe_t0.1_linear_probe_acc", 100,
                                 "mid-block probe, 0.7 − 1.0 (points)"),
                     grid_best_line(recs, "B64-uvit-a0.7", "B64-uvit-a1.0", "best probe cell, 0.7 − 1.0, points"),
                     grid_best_line(recs, "B64-uvit-a0.7", "B64-uvit-a1.0", "best probe cell, 0.7 − 1.0, points",
                                    largest=True),
                     paired_line(recs, "B64-uvit-a0.7", "B64-uvit-a1.0", "probe_t0.1_effective_rank_entropy", 1,
                                 "H of the mid-block features, 0.7 − 1.0"),
                     paired_line(recs, "B64-uvit-a0.7", "B64-uvit-a1.0", "fd_cifar_classifier", 1,
                                 "fd_cifar_classifier, 0.7 − 1.0")])
    draws, along = fd_draw_lines(recs, "B64-uvit"), fd_along_training_lines(recs, "B64-uvit")
    if draws:
        L += ["Sample draws of the classifier FD (each of the final evaluation's draws):", ""] + draws
    if along:
        L += ["The classifier FD along training (2,000 samples at each curve point):", ""] + along
    grids = probe_grid_lines(recs, "B64-uvit")
    L += ["Probe grids of the decisive arms (`eval.probe_grid_blocks` x `eval.probe_grid_ts`, the final evaluation; "
          "the paper picks the best block and noise level):", ""] + (grids or ["Not run yet.", ""])
    L += page.block("B", "short", "Earlier short runs: 3,900 steps, the preset's EMA 0.9999",
                    f"10 epochs of batch 128: the EMA still held 0.9999^3900 = {ema_initial_weight(0.9999, 3900):.0%} "
                    "of the initial weights, so these evaluate mostly-initial networks; zero-init `auto` (on at 0.7 "
                    "only).", b_header, b_rows("short"), ["probe_t0.1_linear_probe_acc", "probe_t0.1_knn_acc"],
                    "uvit_curves.png",
                    [delta_line(recs, "B-uvit-a0.7", "B-uvit-a1.0", "probe_t0.1_linear_probe_acc", 100,
                                "mid-block probe, 0.7 − 1.0 (points)"),
                     delta_line(recs, "B-uvit-a0.7", "B-uvit-a1.0", "fd_cifar_classifier", 1,
                                "fd_cifar_classifier, 0.7 − 1.0")])
    return L + page.verdict("B")


def claim_c(page: Page) -> list[str]:
    recs = page.recs

    def c_rows(stage, columns):
        def row(a, cells, _):
            recipe = [str(a.labels["px"]), f"{a.labels['drop_rate']:g}"] if stage == "decisive" else []
            return [a.labels["arch"]] + recipe + [a.labels["mode"]] + cells + [_paper(a)]
        return page.rows("C", stage, columns, row)
    L = [f"## C. {CLAIM_TITLES['C']}", "",
         "Top-1 on the 10k test split; the modes differ only in `model.droppath_mode` (drop path 0.1, "
         "linear in depth); train accuracy and loss are the final epoch's (from the training log).", ""]
    L += page.block("C", "decisive", f"Decisive runs: timm's train.py recipe, {RDP_DECISIVE_EPOCHS} epochs, "
                    f"{len(RDP_SEEDS)} seeds; 224 px pilot",
                    f"Preset `{TIMM_PRESET}` (its comments give the recipe and where dres departs from timm's): batch "
                    "128, lr 0.05, RandomResizedCrop 0.08-1, colour jitter 0.4, evaluation resize by crop_pct 0.875 "
                    "then centre crop, 32 px, and dropout 0.1 before the classifier in every arm (`model.drop_rate`; "
                    "timm's `--drop` defaults to 0, so the rows with head dropout 0 are timm's default); "
                    "`residual_droppath_literal` is Park's Algorithm 1 read literally (odd iterations detach the "
                    "never-dropped block 0 too), `residual_droppath_frozen` the abstract's reading (odd iterations "
                    "hold the kept branches' weights and pass their gradient on to the block's input). "
                    f"The pilot `{TIMM_PRESET_224}` at 224 px, one seed, a complete "
                    "schedule of as many epochs as its row says (its warm-up included).",
                    ["model", "px", "head dropout", "mode", "epochs", "seeds", "top-1 %", "train acc % (last epoch)",
                     "train loss (last epoch)", "paper (CIFAR-10)"], c_rows("decisive", C_COLUMNS), ["top1"],
                    "classify_decisive_curves.png",
                    [paired_line(recs, f"{prefix}-{arch}-{x}", f"{prefix}-{arch}-{y}", "top1", 100,
                                 f"{arch} {what}: {x} − {y} (points)")
                     for prefix, what in C_DECISIVE_PREFIXES for arch in ("resnet50d", "resnet50")
                     for x, y in C_COMPARISONS]
                    + [paired_line(recs, f"C300-resnet50d-{reading}", f"C300-resnet50d-{mode}", "top1", 100,
                                   f"resnet50d 32 px: {reading} − {mode} (points)")
                       for reading in READINGS for mode in ("residual_droppath", "none", "drop_path")])
    L += page.block("C", "short", "Earlier short runs: 100 epochs (ResNet50d), 50 (ViT), one seed",
                    "Presets `classify_resnet50d_cifar10`, `classify_resnet50_cifar10` (batch 256, lr 0.1, crop "
                    "0.35-1, no colour jitter) and `classify_cifar10`.",
                    ["model", "mode", "epochs", "seeds", "top-1 %", "paper (CIFAR-10)"],
                    c_rows("short", [("top1", 100, 2)]), ["top1"], "classify_curves.png",
                    [delta_line(recs, f"C-{arch}-{x}", f"C-{arch}-{y}", "top1", 100, f"{arch}: {x} − {y} (points)")
                     for arch in CLASSIFY_PRESETS for x, y in C_COMPARISONS])
    return L + page.verdict("C")


def runs(page: Page) -> list[str]:
    """Provenance: every counted record's arm, card, date, commit and command; what is not counted or not run."""
    recs = page.recs
    L = ["## Runs", ""]
    if recs:
        L += _table(["arm", "epochs", "steps", "card", "date", "commit", "img/s (arms sharing the GPU)", "command"],
                    [[r["arm"], f"{r['epochs']:g}", r["steps"], r["card"], r["date"], r["commit"][:12],
                      (f"{r['train']['img_per_s']:.0f} ({r['train'].get('arms_per_device', 1)}"
                       f"{', ' + r['train']['gpu_sharing'] if r['train'].get('gpu_sharing') else ''})"
                       if r["train"].get("img_per_s") else "—"),
                      f"`{r['command']}`"] for r in recs.values()])
    else:
        L += ["No arm has run yet."]
    if page.other_recipe:
        L += ["", "Not counted (made with other overrides than their arm's today): "
              + ", ".join(f"`{page.rel(p)}`" for p in page.other_recipe) + "."]
    pending = [a.name for a in MATRIX if a.name not in recs]
    L += ["", "Not run yet: " + (", ".join(f"`{n}`" for n in pending) if pending else "none") + ".", "",
          "The decisive runs (experiments/README.md, \"The decisive runs\", gives the queue of each GPU hold); see the "
          "commands, then rebuild this file:", "",
          "```bash",
          "python -m experiments.repro --run decisive --dry-run --gpus 4",
          "python -m experiments.repro --run decisive --gpus 4 --root /tmp/dres-repro "
          "--records records/experiments/CARD-DATE-WHAT",
          "python -m experiments.repro --report", "```", ""]
    return L
