"""Sweep the launch configs of the fused MLP's bias + GELU kernels: how ``kernels/bias_gelu.py``'s
``forward_config`` and ``backward_config`` are chosen.

    python -m benchmarks.tune_bias_gelu                                  # the MLP shapes below
    python -m benchmarks.tune_bias_gelu --shapes 25216x3072 --gelu none,quick
    python -m benchmarks.tune_bias_gelu --dry-run                        # the plan, no GPU needed

For each shape (rows x hidden, bf16, the pre-activation of an MLP's first matmul) and GELU it times the forward
(``act = gelu(pre + bias)``: pre read, act written) and the backward as the MLP runs it (``dpre`` and the
recomputed ``act`` written, ``dbias`` summed: g and pre read), do_bench median, over the tile (rows x columns),
num_warps and, for the backward, programs per SM, around the current config; it prints the current time and the
best ones as a fraction of the pass's bytes at the copy ceiling measured in the same run, and PyTorch's own GELU
at the same bytes (``F.gelu`` forward, ``torch.ops.aten.gelu_backward``) as the yardstick eager users have.

The launchers read their config from ``forward_config`` / ``backward_config`` at every launch;
:func:`configs_replaced` swaps those functions for ones returning the config under test.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sys
from pathlib import Path
from unittest import mock

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from benchmarks import measure

# Hidden activations of the own-model benchmark's MLPs: ViT-B/16 and CLIP at batch 128 (197 tokens) and the MAE
# ViT-B/16 decoder at batch 256 (197 tokens, 512 -> 2048); DINOv2 ViT-S/14 is 32896x1536, BERT 16384x3072.
DEFAULT_SHAPES = "25216x3072,50432x2048"
GELUS = ("none", "tanh", "quick")


def parse_gelus(text: str) -> list[str]:
    gelus = [g for g in text.split(",") if g]
    bad = [g for g in gelus if g not in GELUS]
    if bad or not gelus:
        raise ValueError(f"--gelu: {text!r} is not a comma list of {', '.join(GELUS)}")
    return gelus


def forward_candidates(n: int) -> list[tuple[int, int, int]]:
    """(BLOCK_M, BLOCK_N, num_warps) around forward_config(n): tiles of 2048 to 16384 values, 64 to 512 columns
    (not wider than n needs), 4 or 8 warps, each thread holding 8 to 64 values."""
    from dres.kernels.bias_gelu import forward_config

    widest = 1 << max(4, (n - 1).bit_length())
    out = {forward_config(n)}
    for tile, bn, nw in itertools.product((2048, 4096, 8192, 16384), (64, 128, 256, 512), (4, 8)):
        if bn <= widest and 8 <= tile / (nw * 32) <= 64:
            out.add((tile // bn, bn, nw))
    return sorted(out)


def backward_candidates(n: int) -> list[tuple[int, int, int, int]]:
    """(BLOCK_M, BLOCK_N, num_warps, programs per SM) around backward_config(n): tiles of 2048 to 8192 values,
    64 to 256 columns, 4 or 8 warps, 2 to 8 programs per SM, each thread holding 8 to 32 values of a tile."""
    from dres.kernels.bias_gelu import backward_config

    widest = 1 << max(4, (n - 1).bit_length())
    out = {backward_config(n)}
    for tile, bn, nw, pps in itertools.product((2048, 4096, 8192), (64, 128, 256), (4, 8), (2, 4, 8)):
        if bn <= widest and 8 <= tile / (nw * 32) <= 32:
            out.add((tile // bn, bn, nw, pps))
    return sorted(out)


@contextlib.contextmanager
def configs_replaced(forward: tuple | None = None, backward: tuple | None = None):
    """The bias + GELU kernels launched with these configs while the context lasts (None: the current one),
    through the launchers' documented hooks ``forward_config`` and ``backward_config``."""
    from dres.kernels import bias_gelu

    with contextlib.ExitStack() as stack:
        if forward is not None:
            stack.enter_context(mock.patch.object(bias_gelu, "forward_config", lambda _n: forward))
        if backward is not None:
            stack.enter_context(mock.patch.object(bias_gelu, "backward_config", lambda _n: backward))
        yield


def sweep(rows: int, n: int, gelu: str, ceiling_gbps: float) -> list[str]:
    from dres.kernels import bias_gelu_backward, bias_gelu_forward
    from dres.kernels.bias_gelu import backward_config, forward_config

    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    pre, g = torch.randn(rows, n, **bf16), torch.randn(rows, n, **bf16)
    bias = torch.randn(n, device="cuda") * 0.1
    act, dpre = torch.empty_like(pre), torch.empty_like(pre)
    pass_bytes = rows * n * 2 * 2  # each pass: two bf16 tensors read or written per element
    torch_gelu = "none" if gelu == "quick" else gelu  # F.gelu has no QuickGELU: the erf GELU stands in
    timers = {
        "forward": (lambda: bias_gelu_forward(pre, bias, act, gelu), pass_bytes,
                    lambda: F.gelu(pre, approximate=torch_gelu), forward_config(n), forward_candidates(n),
                    lambda c: configs_replaced(forward=c), lambda c: f"{c[0]}x{c[1]} w{c[2]}"),
        "backward": (lambda: bias_gelu_backward(g, pre, bias, dpre, act, True, gelu), 2 * pass_bytes,
                     lambda: torch.ops.aten.gelu_backward(g, pre, approximate=torch_gelu), backward_config(n),
                     backward_candidates(n), lambda c: configs_replaced(backward=c),
                     lambda c: f"{c[0]}x{c[1]} w{c[2]} p{c[3]}"),
    }
    lines = []
    for name, (run, nbytes, torch_run, current, candidates, replaced, label) in timers.items():
        def time_config(config):
            with replaced(config):
                return measure.do_bench_median_us(run, warmup_ms=5, rep_ms=30)

        at_ceiling = measure.us_at_ceiling(nbytes, ceiling_gbps)
        # PyTorch's GELU moves 3 tensors in its backward (g, pre read, dpre written), not 4: scaled to 4 here
        torch_us = measure.do_bench_median_us(torch_run, warmup_ms=5, rep_ms=30) * (4 / 3 if name == "backward" else 1)
        now = time_config(current)
        results = measure.time_configs(time_config, candidates, label)
        best = "; ".join(f"{t:.0f} us {label(c)} ({100 * at_ceiling / t:.0f}%)" for t, c in results[:4])
        lines.append(f"{rows}x{n} gelu={gelu} {name}: at ceiling {at_ceiling:.0f} us; PyTorch's GELU "
                     f"{torch_us:.0f} us ({100 * at_ceiling / torch_us:.0f}%); current {label(current)} {now:.0f} us "
                     f"({100 * at_ceiling / now:.0f}%); best: {best}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma list of ROWSxHIDDEN (bf16)")
    p.add_argument("--gelu", default="none", help=f"comma list of {', '.join(GELUS)} (as fused_mlp's approximate)")
    p.add_argument("--dry-run", action="store_true", help="print the configs per shape and exit")
    args = p.parse_args(argv)
    try:
        shapes, gelus = measure.parse_int_shapes(args.shapes, "ROWSxHIDDEN", "25216x3072"), parse_gelus(args.gelu)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    if args.dry_run:
        for rows, n in shapes:
            print(f"{rows}x{n}: {len(forward_candidates(n))} forward and {len(backward_candidates(n))} backward "
                  f"configs, GELU {', '.join(gelus)}")
        return 0
    ceiling = measure.sweep_ceiling_gbps("tune_bias_gelu")
    if ceiling is None:
        return 2
    for (rows, n), gelu in itertools.product(shapes, gelus):
        for line in sweep(rows, n, gelu, ceiling):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
