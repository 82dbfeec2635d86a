"""The linear probes of the U-ViT probe grid at one noise level: the probes of H blocks' features trained one at a
time (``dres.eval.linear_probe`` on each block's slot) against together (``dres.eval.linear_probes``), side by side
in one process, in wall-clock seconds from CPU features to accuracies, as the trainer's evaluation runs them; and
the largest difference of their accuracies (the same probes, up to rounding).

    python -m benchmarks.bench_probe          # the full grid's shape: 50,000 x 13 x 512 features, 10 classes, 100 epochs
    python -m benchmarks.bench_probe --rows 4096 --heads 4 --dim 64 --epochs 3 --device cpu --json probe.json

Features: Gaussian around a random mean per class and slot (so the probes learn), float32 on the CPU, where the
evaluation keeps them. Steady state: a 1-epoch run of each kind comes first (CUDA context, kernels, allocator).
Prints a line and writes JSON (``--json``, default ``$OUT/probe.json`` or ./probe.json).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks import measure
from dres.eval import linear_probe, linear_probes


def make_features(rows: int, heads: int, dim: int, classes: int, seed: int = 0):
    """(rows, heads, dim) features and their labels: each class a random mean per slot plus unit noise."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (rows,), generator=g)
    means = torch.randn(classes, heads, dim, generator=g) * 0.3
    return means[labels] + torch.randn(rows, heads, dim, generator=g), labels


def one_at_a_time(train_x, train_y, test_x, test_y, **kw) -> list[dict]:
    return [linear_probe(train_x[:, h], train_y, test_x[:, h], test_y, **kw) for h in range(train_x.shape[1])]


def timed(fn, *args, **kw) -> tuple[float, list[dict]]:
    if kw["device"].type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    found = fn(*args, **kw)  # the accuracies come back as floats: the GPU's work is done
    return time.perf_counter() - start, found


def measure_probes(rows: int, heads: int, dim: int, classes: int, epochs: int, batch: int,
                   device: torch.device) -> dict:
    x, y = make_features(rows + max(rows // 5, classes), heads, dim, classes)  # one draw of the class means
    x, x_test, y, y_test = x[:rows], x[rows:], y[:rows], y[rows:]
    kw = dict(batch_size=batch, num_classes=classes, device=device)
    for fn in (one_at_a_time, linear_probes):  # warm-up
        fn(x[:batch], y[:batch], x_test, y_test, epochs=1, **kw)
    apart_s, apart = timed(one_at_a_time, x, y, x_test, y_test, epochs=epochs, **kw)
    together_s, together = timed(linear_probes, x, y, x_test, y_test, epochs=epochs, **kw)
    return {"rows": rows, "heads": heads, "dim": dim, "classes": classes, "epochs": epochs, "batch": batch,
            "one_at_a_time_s": round(apart_s, 3), "together_s": round(together_s, 3),
            "speedup": round(apart_s / together_s, 2),
            "max_acc_diff": max(abs(a["linear_probe_acc"] - b["linear_probe_acc"]) for a, b in zip(apart, together)),
            "acc": [round(r["linear_probe_acc"], 4) for r in together]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=50_000, help="training features (the test split: a fifth)")
    p.add_argument("--heads", type=int, default=13, help="feature slots (blocks)")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    for name in ("rows", "heads", "dim", "classes", "epochs", "batch"):
        if getattr(args, name) < (2 if name == "classes" else 1):
            print(f"bench_probe: --{name} must be at least {2 if name == 'classes' else 1}, got {getattr(args, name)}",
                  file=sys.stderr)
            return 2
    device = torch.device(args.device)
    rec = measure_probes(args.rows, args.heads, args.dim, args.classes, args.epochs, args.batch, device)
    print(f"{rec['heads']} probes of {rec['rows']} x {rec['dim']} features, {rec['epochs']} epochs on {device}: "
          f"one at a time {rec['one_at_a_time_s']:.2f} s, together {rec['together_s']:.2f} s "
          f"({rec['speedup']}x); largest accuracy difference {rec['max_acc_diff']:.4f}")
    out = args.json or Path(os.environ.get("OUT", ".")) / "probe.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    measure.write_json_atomic(out, {"card": measure.card_name() if device.type == "cuda" else "cpu",
                                   "versions": measure.versions(), "date": measure.today(), "records": [rec]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
