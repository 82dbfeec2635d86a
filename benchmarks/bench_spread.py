"""How steady a compiled training step is from one process to the next: the bare MAE ViT-B/16 step
of ``bench_train`` (bf16 autocast, fused AdamW, random images on the GPU) for each model, each run in
a fresh Python process, models interleaved (A B A B ...), and the median and spread of images/s
over the processes.

    python -m benchmarks.bench_spread --models timm,dres_baseline --processes 5 --out $OUT
    python -m benchmarks.bench_spread --dry-run          # the commands, no GPU needed

A fresh process re-runs everything that can differ between processes: Dynamo tracing, Inductor's
code generation (or its cache), the CUDA caching allocator, kernel launches from a new host thread.
``spread_pct`` = (max - min) / median of the per-process images/s.

Each process also times the same step captured as one CUDA graph (``replay_ms``, the median replay:
the GPU's time alone, no host launch or dispatch in it; ``train_step.replay_step_ms``), and the table
gives the replay rate (batch / replay_ms) with its own median and spread, and per process its step
time over its replay (``step / replay``). A process slow in its step but not in its replay lost its
time on the host side (launches, dispatch: its step / replay is the higher); one slow in both, on the
GPU side (the kernels themselves). Results: ``<out>/<card>-spread.json`` (every process's record) and
``.md`` (the table).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

REPO_ROOT = Path(__file__).resolve().parent.parent


def child_command(model: str, mode: str, batch: int, steps: int, warmup: int, out: Path) -> list[str]:
    """One process measuring one model: ``bench_train``'s bare step, its record written under ``out``."""
    return [sys.executable, "-m", "benchmarks.bench_train", "--only", "mae", "--models", model, "--modes", mode,
            "--batch", str(batch), "--steps", str(steps), "--warmup", str(warmup), "--no-flops", "--out", str(out)]


def read_record(out: Path, model: str, mode: str) -> dict | None:
    """The throughput record a child wrote for ``model`` in ``mode`` (None if it wrote none)."""
    for path in sorted(out.glob("*train.json")):
        for rec in json.loads(path.read_text()):
            if rec.get("kind") == "throughput" and rec.get("model") == model and rec.get("mode") == mode:
                return rec
    return None


def summarize(records: list[dict]) -> list[dict]:
    """Per (model, mode): images/s of every process, their median, min, max and spread; every process's
    replay ms and step / replay (None where it has none), and the median and spread of the replay rate
    over the processes that have one (None if none has)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for rec in records:
        groups.setdefault((rec["model"], rec["mode"]), []).append(rec)
    rows = []
    for (model, mode), recs in groups.items():
        rates = [r["images_per_s"] for r in recs]
        median = statistics.median(rates)
        replay_rates = [r["batch"] / (r["replay_ms"] / 1e3) for r in recs if r.get("replay_ms")]
        replay_median = statistics.median(replay_rates) if replay_rates else None
        rows.append({"model": model, "mode": mode, "processes": len(rates), "images_per_s": rates,
                     "median": median, "min": min(rates), "max": max(rates),
                     "spread_pct": 100 * (max(rates) - min(rates)) / median,
                     "replay_ms": [r.get("replay_ms") for r in recs],
                     "step_vs_replay": [r.get("step_vs_replay") for r in recs],
                     "replay_median": replay_median,
                     "replay_spread_pct": (100 * (max(replay_rates) - min(replay_rates)) / replay_median
                                           if replay_rates else None),
                     "peak_mem_gib": statistics.median(r["peak_mem_gib"] for r in recs)})
    return rows


def markdown(rows: list[dict], card: str, batch: int) -> list[str]:
    lines = [f"Compiled MAE ViT-B/16 step, batch {batch}, one process per measurement ({card})", "",
             "| model | mode | processes | median img/s | min | max | spread (max-min)/median | vs first model | "
             "replay img/s median | replay spread | step / replay (per process) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    base = rows[0]["median"] if rows else None
    for r in rows:
        replay = "–" if r.get("replay_median") is None else f"{r['replay_median']:,.0f}"
        replay_spread = "–" if r.get("replay_spread_pct") is None else f"{r['replay_spread_pct']:.1f}%"
        ratios = ", ".join("–" if v is None else f"{v:.3f}" for v in r.get("step_vs_replay", []))
        lines.append(f"| {r['model']} | {r['mode']} | {r['processes']} | {r['median']:,.0f} | {r['min']:,.0f} | "
                     f"{r['max']:,.0f} | {r['spread_pct']:.1f}% | {r['median'] / base:.3f} | {replay} | "
                     f"{replay_spread} | {ratios} |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="timm,dres_baseline", help="comma list of bench_train's MAE models")
    p.add_argument("--modes", default="compile", help="comma list of bench_train modes (compile, compile_graphs, eager)")
    p.add_argument("--processes", type=int, default=5, help="fresh processes per model and mode")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=30, help="timed steps per process (median)")
    p.add_argument("--warmup", type=int, default=8, help="untimed steps per process (compilation happens here)")
    p.add_argument("--timeout-s", type=float, default=300, help="limit for one process")
    p.add_argument("--out", help="results folder (default: records/benchmarks/<machine>-<today>-compiled-step-spread)")
    p.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    args = p.parse_args(argv)
    if args.processes < 1:
        p.error(f"--processes must be at least 1, got {args.processes}")
    models = [m for m in args.models.split(",") if m]
    modes = [m for m in args.modes.split(",") if m]
    plan = [(k, model, mode) for k in range(args.processes) for model in models for mode in modes]
    if args.dry_run:
        for k, model, mode in plan:
            print(" ".join(child_command(model, mode, args.batch, args.steps, args.warmup, Path(f"<tmp>/{k}"))))
        return 0
    import torch

    from benchmarks import measure

    if not torch.cuda.is_available():
        print("bench_spread needs a CUDA GPU (use --dry-run to see the plan)", file=sys.stderr)
        return 2
    card = measure.card_name()
    out = Path(args.out or measure.default_out("compiled-step-spread"))
    out.mkdir(parents=True, exist_ok=True)
    records, failed = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for k, model, mode in plan:
            child_out = Path(tmp) / f"{k}-{model}-{mode}"
            t0 = time.time()
            try:
                subprocess.run(child_command(model, mode, args.batch, args.steps, args.warmup, child_out),
                               cwd=REPO_ROOT, check=True, timeout=args.timeout_s, stdout=subprocess.DEVNULL)
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
                failed.append({"process": k, "model": model, "mode": mode, "error": type(e).__name__})
                print(f"process {k} {model} {mode}: FAILED ({type(e).__name__})", flush=True)
                continue
            rec = read_record(child_out, model, mode)
            if rec is None:
                failed.append({"process": k, "model": model, "mode": mode, "error": "no record"})
                continue
            rec["process"] = k
            records.append(rec)
            replay = (f", replay {rec['replay_ms']:.2f} ms, step / replay {rec['step_vs_replay']:.3f}"
                      if rec.get("replay_ms") is not None else "")
            print(f"process {k} {model} {mode}: {rec['images_per_s']:,.0f} img/s, step {rec['step_ms']:.2f} ms"
                  f"{replay} [{time.time() - t0:.0f} s]", flush=True)
            rows = summarize(records)
            measure.write_json_atomic(out / f"{card}-spread.json", {"card": card, "batch": args.batch, "rows": rows,
                                                                    "records": records, "failed": failed,
                                                                    "date": measure.today(), **measure.versions()})
    lines = markdown(summarize(records), card, args.batch)
    (out / f"{card}-spread.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
