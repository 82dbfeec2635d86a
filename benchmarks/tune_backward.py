"""Sweep the backward kernel's launch config: how ``kernels/residual_norm.py:backward_config`` was chosen.

    python -m benchmarks.tune_backward                                   # the shapes below, default sweep
    python -m benchmarks.tune_backward --shapes 262144x384:bf16,262144x512:fp32 --stages 0,1,2,3,4
    python -m benchmarks.tune_backward --dry-run                         # the plan, no GPU needed

About 100 configs per shape at ~1 s each (one compilation per config): narrow with --shapes.

For each shape (rows x D, residual dtype; the branch is bf16) it times the backward alone
(``residual_norm_backward`` with dweight and dbias, do_bench median) over BLOCK_M x num_warps x
programs-per-SM x num_stages (0 = Triton's default pipelining), around the current config, and
prints the current time and the best ones as a fraction of the backward's bytes at the copy ceiling
measured in the same run (bytes: g_out, g_y and out read, dx and dh written).

The launcher reads its config from ``dres.kernels.residual_norm.backward_config`` at every launch;
:func:`backward_config_replaced` swaps that function for one returning the config under test.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sys
from unittest import mock
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks import measure

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DEFAULT_SHAPES = "12800x768:bf16,262144x768:bf16,262144x768:fp32,262144x384:bf16,262144x512:bf16,65536x1024:bf16"


def parse_shapes(text: str) -> list[tuple[int, int, str]]:
    shapes = []
    for item in filter(None, text.split(",")):
        try:
            size, dtype = item.split(":")
            rows, dim = (int(v) for v in size.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--shapes: {item!r} is not ROWSxD:DTYPE (e.g. 262144x384:bf16)") from None
        if dtype not in DTYPES:
            raise SystemExit(f"--shapes: dtype {dtype!r} in {item!r}; choose from {sorted(DTYPES)}")
        shapes.append((rows, dim, dtype))
    return shapes


def candidates(dim: int, stages: list[int]) -> list[tuple[int, int, int, int]]:
    """(BLOCK_M, num_warps, programs per SM, num_stages) around backward_config(dim); configs whose
    threads would hold fewer than 2 or more than 64 values of a tile are left out."""
    from dres.kernels.residual_norm import backward_config

    block_m, block_d, warps, per_sm, _ = backward_config(dim)
    out = []
    for bm, nw, pps, st in itertools.product(sorted({max(1, block_m // 2), block_m, block_m * 2}),
                                             sorted({max(1, warps // 4), max(1, warps // 2), warps, warps * 2}),
                                             (2, 4, 8, 16), stages):
        per_thread = bm * block_d / (nw * 32)
        if 2 <= per_thread <= 64:
            out.append((bm, nw, pps, st))
    return out


@contextlib.contextmanager
def backward_config_replaced(dim: int, block_m: int, num_warps: int, programs_per_sm: int, num_stages: int = 0):
    """The residual-norm backward launched with this config while the context lasts (num_stages 0:
    Triton's default), through the launcher's documented hook ``backward_config``."""
    from dres.kernels import residual_norm

    block_d = residual_norm.backward_config(dim)[1]
    config = (block_m, block_d, num_warps, programs_per_sm, num_stages or None)
    with mock.patch.object(residual_norm, "backward_config", lambda _dim: config):
        yield


def sweep(rows: int, dim: int, dtype: str, stages: list[int], ceiling_gbps: float) -> str:
    from dres.kernels import residual_norm_backward, residual_norm_forward
    from dres.kernels.residual_norm import backward_config

    dev = "cuda"
    x = torch.randn(rows, dim, device=dev, dtype=DTYPES[dtype])
    h = torch.randn(rows, dim, device=dev, dtype=torch.bfloat16)
    w, b = torch.ones(dim, device=dev), torch.zeros(dim, device=dev)
    g_out, g_y = torch.randn_like(x), torch.randn_like(h)
    out, y = torch.empty_like(x), torch.empty_like(h)
    mean, rstd = torch.empty(rows, device=dev), torch.empty(rows, device=dev)
    residual_norm_forward(x, h, w, b, None, 0.9, 1e-6, None, 1, out, y, mean, rstd, 0.0, None)
    dx, dh = torch.empty_like(x), torch.empty_like(h)
    at_ceiling_us = measure.us_at_ceiling(rows * dim * (3 * x.element_size() + 2 * h.element_size()), ceiling_gbps)

    def time_config(config):
        with backward_config_replaced(dim, *config):
            return measure.do_bench_median_us(lambda: residual_norm_backward(
                g_out, g_y, out, None, w, mean, rstd, None, 0.9, None, 1, dx, dh, True, True, False, 0.0, None),
                warmup_ms=5, rep_ms=30)

    block_m, _, warps, per_sm, _ = backward_config(dim)
    current = time_config((block_m, warps, per_sm))
    def label(config):
        bm, nw, pps, st = config
        return f"bm{bm} w{nw} p{pps} s{st or 'default'}"

    results = measure.time_configs(time_config, candidates(dim, stages), label)
    best = "; ".join(f"{t:.0f} us {label(config)} ({100 * at_ceiling_us / t:.0f}%)" for t, config in results[:4])
    return (f"{rows}x{dim} x={dtype}: at ceiling {at_ceiling_us:.0f} us; current {current:.0f} us "
            f"({100 * at_ceiling_us / current:.0f}%); best: {best}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma list of ROWSxD:DTYPE (residual dtype)")
    p.add_argument("--stages", default="0", help="comma list of num_stages to try (0: Triton's default)")
    p.add_argument("--dry-run", action="store_true", help="print the configs per shape and exit")
    args = p.parse_args(argv)
    shapes = parse_shapes(args.shapes)
    try:
        stages = [int(s) for s in args.stages.split(",") if s]
    except ValueError:
        raise SystemExit(f"--stages: {args.stages!r} is not a comma list of integers") from None
    if args.dry_run:
        for rows, dim, dtype in shapes:
            print(f"{rows}x{dim} x={dtype}: {len(candidates(dim, stages))} configs")
        return 0
    ceiling = measure.sweep_ceiling_gbps("tune_backward")
    if ceiling is None:
        return 2
    for rows, dim, dtype in shapes:
        print(sweep(rows, dim, dtype, stages, ceiling), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
