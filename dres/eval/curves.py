"""Metrics over training (the papers' Fig. 5 at small scale): the cheap evaluation a run records
every ``eval.every`` steps, one JSON line per point in ``<run>/curves.jsonl``, drawn to
``<run>/curves.png``; several runs' points drawn together (``experiments/repro.py --report``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from dres.eval.probe import authors_linear_probe, effective_rank, knn_accuracy, linear_probes

CURVES_JSONL = "curves.jsonl"
CURVES_PNG = "curves.png"
METRICS_JSONL = "metrics.jsonl"  # the trainer's log: one record (step, epoch, loss, lr, ...) every log.every steps
AXES = ("step", "epoch")


def representation_metrics(train_x, train_y, test_x, test_y, **options) -> dict:
    """:func:`representation_metrics_per_head` of one slot: (N, D) features, one result."""
    return representation_metrics_per_head(train_x[:, None], train_y, test_x[:, None], test_y, **options)[0]


def representation_metrics_per_head(train_x, train_y, test_x, test_y, *, rank_features=None, probe=True, knn=True,
                                    rank=True, probe_epochs=20, probe_lr=1e-2, probe_batch=1024, probe_wd=0.0,
                                    knn_k=20, authors_probe=False, knn_standardized=False, num_classes=None, seed=0,
                                    device="cpu", progress=None) -> list[dict]:
    """Linear probe (``linear_probe_acc``, ``linear_probe_train_acc``), kNN (``knn_acc``) and the
    effective rank (eq. 6) of ``rank_features`` (default the slot's ``train_x``) on frozen features, for each slot
    h of (N, H, D) features (``train_x[:, h]``): a list of H results, the H linear probes trained together
    (:func:`dres.eval.linear_probes`), the rest per slot. With ``authors_probe`` the authors' probe too
    (``authors_probe_acc``, :func:`dres.eval.authors_linear_probe`), with ``knn_standardized`` kNN on standardised
    features (``knn_std_acc``). kNN and rank run on ``device``; ``progress``: the probes' epoch bars
    (:func:`dres.eval.linear_probe`)."""
    res = [{} for _ in range(train_x.shape[1])]
    if probe:
        for r, found in zip(res, linear_probes(train_x, train_y, test_x, test_y, epochs=probe_epochs, lr=probe_lr,
                                               batch_size=probe_batch, weight_decay=probe_wd,
                                               num_classes=num_classes, seed=seed, device=device, progress=progress)):
            r.update(found)
    for h, r in enumerate(res):
        x, x_test = train_x[:, h], test_x[:, h]
        if authors_probe:
            r.update(authors_linear_probe(x, train_y, x_test, test_y, num_classes=num_classes, seed=seed,
                                          device=device, progress=progress))
        for on, key, standardized in ((knn, "knn_acc", False), (knn_standardized, "knn_std_acc", True)):
            if on:
                r[key] = knn_accuracy(x.to(device), train_y, x_test.to(device), test_y, k=knn_k,
                                      num_classes=num_classes, standardize_first=standardized)
        if rank:
            er = effective_rank((x if rank_features is None else rank_features).to(device))
            r["effective_rank"], r["effective_rank_entropy"] = er["effective_rank"], er["entropy"]
    return res


def final_epoch_means(records: list[dict], keys=("loss", "train_acc")) -> dict:
    """The training metrics of the last epoch from the log windows of ``metrics.jsonl`` (records with
    ``step``, ``epoch`` and the metrics, each the mean over the steps since the previous record): for
    each of ``keys`` present, the step-weighted mean over the windows that end in the last epoch, as
    ``final_epoch_<key>``, with ``final_epoch_steps`` (the steps they cover). {} without epochs."""
    recs = sorted((r for r in records if isinstance(r.get("epoch"), (int, float))), key=lambda r: r["step"])
    if not recs:
        return {}
    last = recs[-1]
    per_epoch = last["step"] / last["epoch"] if last["epoch"] else 0
    if not per_epoch:
        return {}
    start = last["step"] - per_epoch  # a window ending after this step lies (mostly) in the last epoch
    out, steps = {}, 0
    windows = [(r, r["step"] - (prev["step"] if prev else 0)) for prev, r in zip([None] + recs[:-1], recs)
               if r["step"] > start + 1e-9]
    for key in keys:
        pairs = [(r[key], n) for r, n in windows if isinstance(r.get(key), (int, float))]
        if pairs:
            steps = sum(n for _, n in pairs)
            out[f"final_epoch_{key}"] = sum(v * n for v, n in pairs) / steps
    if out:
        out["final_epoch_steps"] = steps
    return out


def append_point(path, point: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(point) + "\n")


def read_points(path) -> list[dict]:
    """The points of a curves file in step order; a step recorded twice (a resumed run repeats the
    steps after its last checkpoint) keeps its last record."""
    by_step = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            point = json.loads(line)
            by_step[point["step"]] = point
    return [by_step[s] for s in sorted(by_step)]


def numeric_keys(series: dict[str, list[dict]]) -> list[str]:
    """The metric names with a finite number in some point, in first-seen order (axes excluded)."""
    keys: dict[str, None] = {}
    for points in series.values():
        for p in points:
            for k, v in p.items():
                if k not in AXES and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    keys.setdefault(k)
    return list(keys)


def plot_curves(series: dict[str, list[dict]], path, keys=None, x="epoch", title=None, bands=None, dots=None) -> str:
    """One panel per metric in ``keys`` (default: every numeric one), one line per ``series`` label
    against ``x``, and under a line its ``bands[label][key]`` = ``(xs, lows, highs)`` shaded where given (the
    spread of seeds) and its ``dots[label][key]`` = ``(xs, ys)`` as points (the seeds themselves); written as PNG."""
    from dres.eval.viz import pyplot

    plt = pyplot()
    keys = list(keys) if keys is not None else numeric_keys(series)
    if not keys:
        raise ValueError("plot_curves: no numeric metric to draw in the given points")
    bands, dots = bands or {}, dots or {}
    many = len(series) > 10  # past ten lines the default cycle repeats its colours
    colours = [plt.get_cmap("tab20")(i % 20) if many else f"C{i}" for i in range(len(series))]
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.4), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for colour, (label, points) in zip(colours, series.items()):
            pts = [(p[x], p[key]) for p in points if isinstance(p.get(key), (int, float))]
            if pts:  # a series keeps its colour in every panel, also where another lacks the metric
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o" if len(xs) <= 50 else None, markersize=3, label=label, color=colour)
            if key in bands.get(label, {}):
                ax.fill_between(*bands[label][key], color=colour, alpha=0.2, linewidth=0)
            if key in dots.get(label, {}):
                ax.scatter(*dots[label][key], color=colour, s=14, zorder=3)
        ax.set_xlabel(x)
        ax.set_title(key, fontsize=9)
        ax.grid(alpha=0.3)
    handles = {}  # every series once, also one the first panel lacks
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    if len(series) > 6:  # a long legend goes beside the panels, not over the lines
        fig.legend(handles.values(), handles.keys(), fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    else:
        axes[0][0].legend(handles.values(), handles.keys(), fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return str(path)


def record_point(run_dir, point: dict) -> str:
    """Append ``point`` (with ``step`` and ``epoch``) to ``<run_dir>/curves.jsonl`` and redraw
    ``<run_dir>/curves.png`` from all points so far, the training loss of ``<run_dir>/metrics.jsonl``
    in the first panel; returns the PNG's path."""
    run_dir = Path(run_dir)
    append_point(run_dir / CURVES_JSONL, point)
    points = read_points(run_dir / CURVES_JSONL)
    metrics = run_dir / METRICS_JSONL
    losses = [{a: r.get(a) for a in (*AXES, "loss")} for r in (read_points(metrics) if metrics.exists() else [])
              if isinstance(r.get("loss"), (int, float))]
    merged = sorted(points + losses, key=lambda p: p["step"])
    x = "epoch" if all(p.get("epoch") is not None for p in merged) else "step"  # a stream of unknown size
    keys = (["loss"] if losses else []) + numeric_keys({run_dir.name: points})
    return plot_curves({run_dir.name: merged}, run_dir / CURVES_PNG, keys=keys, x=x,
                       title=f"{run_dir.name}: training loss and the eval.every evaluation")
