"""Training-loss curves of several runs of one recipe side by side: whether a switch that changes the
arithmetic (float8 matmuls, another kernel backend, a new commit) trains as the reference run does.

    python -m benchmarks.compare_runs bf16=runs/uvit-bf16 fp8=runs/uvit-fp8 --out curves.png

The first run is the reference. Each run's ``metrics.jsonl`` loss is smoothed over ``--window`` logged
points; printed (and written beside the figure as JSON) per run: its final smoothed loss, and against the
reference over the common logged steps after ``--skip`` of them, the mean and the largest relative
difference of the smoothed curves. Two runs of the same recipe and seed on different arithmetic drift
apart like runs of different seeds; a switch that trains as well stays within that.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dres.eval.curves import METRICS_JSONL, plot_curves, read_points


def smoothed(points: list[dict], window: int) -> dict[int, float]:
    """``step -> mean loss`` of the ``window`` logged points ending at that step (fewer at the start)."""
    steps = [p["step"] for p in points]
    losses = [p["loss"] for p in points]
    return {s: sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1])
            for i, s in enumerate(steps)}


def compare(curves: dict[str, dict[int, float]], skip: int) -> dict[str, dict]:
    """Per run: its final smoothed loss and, against the first run, the mean and largest relative
    difference over the common steps after the first ``skip``."""
    (ref_label, ref), *_ = curves.items()
    out = {}
    for label, curve in curves.items():
        common = sorted(set(ref) & set(curve))[skip:]
        rel = [abs(curve[s] - ref[s]) / abs(ref[s]) for s in common if ref[s]]
        out[label] = {"final_loss": curve[max(curve)], "final_step": max(curve), "steps_compared": len(rel),
                      "mean_rel_diff": sum(rel) / len(rel) if rel else None, "max_rel_diff": max(rel) if rel else None,
                      "reference": ref_label}
    return out


def parse_run(text: str) -> tuple[str, Path]:
    label, sep, path = text.partition("=")
    run = Path(path if sep else label)
    if not (run / METRICS_JSONL).is_file():
        raise argparse.ArgumentTypeError(f"{text!r}: no {METRICS_JSONL} in {run}")
    return (label if sep else run.name), run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=parse_run, metavar="[LABEL=]RUN_DIR", help="the reference run first")
    p.add_argument("--out", required=True, help="the figure (PNG); the numbers go beside it as .json")
    p.add_argument("--window", type=int, default=5, help="logged points the loss is averaged over")
    p.add_argument("--skip", type=int, default=5, help="logged points left out at the start (warm-up)")
    args = p.parse_args(argv)
    if len(args.runs) < 2:
        p.error("runs: give at least two run folders (the reference first)")
    if args.window < 1 or args.skip < 0:
        p.error("--window must be >= 1 and --skip >= 0")
    series = {label: [r for r in read_points(run / METRICS_JSONL) if isinstance(r.get("loss"), (int, float))]
              for label, run in args.runs}
    result = compare({label: smoothed(points, args.window) for label, points in series.items()}, args.skip)
    out = Path(args.out)
    plot_curves(series, out, keys=["loss"], x="step", title="training loss: " + " vs ".join(series))
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    for label, r in result.items():
        diff = "" if r["mean_rel_diff"] is None else \
            f", vs {r['reference']}: mean {100 * r['mean_rel_diff']:.2f}%, max {100 * r['max_rel_diff']:.2f}%"
        print(f"{label}: final loss {r['final_loss']:.4f} at step {r['final_step']}{diff} ({r['steps_compared']} points)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
