"""Sweep the short-attention kernels' launch configs: how ``kernels/short_attention.py`` picks its tiles.

    python -m benchmarks.tune_attention                                  # the presets' shapes up to 256 tokens
    python -m benchmarks.tune_attention --shapes 256x16x197x32,1024x6x17x64
    python -m benchmarks.tune_attention --dry-run                        # the plan, no GPU needed

For each shape (batch x heads x tokens x head dim, bf16) it times :func:`dres.ops.short_attention`
forward+backward from the qkv layout (as ``bench_attention``'s dres column does) with each candidate
config, beside torch's own SDPA choice on the same values from contiguous (B, H, N, d) tensors for scale
and the models' SDPA path from qkv with its permute copies (``sdpa_from_qkv``: what a model pays where it
does not take short attention, the figure the models' token limit is decided against). Every timing is the
median replay of a captured CUDA graph (``measure.graph_median_us``): the GPU time alone, as the trainers
replay their step, so neither the host's launch cost nor its load ranks the configs.
Up to 128 tokens the config is ``attention_config``'s (BLOCK rows a tile, num_warps), above it
``sequence_attention_config``'s (KEYS, BLOCK_M query rows, num_warps, num_stages); the launchers read them
at every launch, and :func:`config_replaced` swaps the function for one returning the config under test.
About a second per config (one compilation each).
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
from benchmarks.bench_attention import SHAPES, dres_fwd_bwd, packed
from dres.kernels.short_attention import (HEAD_DIMS, MAX_SEQ_LEN, PACKED_MAX_SEQ_LEN, SEQUENCE_HEAD_DIMS,
                                         attention_config, sequence_attention_config)
from dres.nn.transformer import sdpa_from_qkv

DEFAULT_SHAPES = ",".join(f"{B}x{H}x{N}x{d}" for _, B, H, N, d in SHAPES if N <= MAX_SEQ_LEN)


def parse_shapes(text: str) -> list[tuple[int, int, int, int]]:
    shapes = []
    for item in filter(None, text.split(",")):
        try:
            (B, H, N, d), = measure.parse_int_shapes(item, "BxHxNxD", "256x16x197x32")
        except ValueError as e:
            raise SystemExit(str(e)) from None
        heads = SEQUENCE_HEAD_DIMS if N > PACKED_MAX_SEQ_LEN else HEAD_DIMS
        if min(B, H, N) < 1 or N > MAX_SEQ_LEN or d not in heads:
            raise SystemExit(f"--shapes: {item!r} is outside what the kernels take: N 1..{MAX_SEQ_LEN}, d in "
                             f"{HEAD_DIMS} up to {PACKED_MAX_SEQ_LEN} tokens, in {SEQUENCE_HEAD_DIMS} above")
        shapes.append((B, H, N, d))
    return shapes


def candidates(seq_len: int) -> list[tuple[int, ...]]:
    """The configs to time: (BLOCK, num_warps) packed tiles that hold a whole sequence up to
    PACKED_MAX_SEQ_LEN tokens, (KEYS, BLOCK_M, num_warps, num_stages) above it (KEYS: the next power of two;
    the stages pipeline the loop over query blocks)."""
    if seq_len <= PACKED_MAX_SEQ_LEN:
        return [(block, warps) for block, warps in itertools.product((32, 64, 128), (2, 4, 8)) if block >= seq_len]
    keys = 1 << (seq_len - 1).bit_length()
    return [(keys, block_m, warps, stages)
            for block_m, warps, stages in itertools.product((16, 32, 64, 128), (4, 8), (1, 2, 3))]


@contextlib.contextmanager
def config_replaced(seq_len: int, config: tuple[int, ...]):
    """Every short-attention launch takes ``config`` while the context lasts."""
    from dres.kernels import short_attention

    name = "attention_config" if seq_len <= PACKED_MAX_SEQ_LEN else "sequence_attention_config"
    with mock.patch.object(short_attention, name, lambda _seq_len, _head_dim: config):
        yield


def current_config(seq_len: int, head_dim: int) -> tuple[int, ...]:
    return (attention_config if seq_len <= PACKED_MAX_SEQ_LEN else sequence_attention_config)(seq_len, head_dim)


def sweep(B: int, H: int, N: int, d: int) -> str:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, grad = (torch.randn(B, H, N, d, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(4))
    qkv, grad_bnc = packed(q, k, v), grad.transpose(1, 2).reshape(B, N, H * d)
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))

    def sdpa():
        out = F.scaled_dot_product_attention(q, k, v)
        return torch.autograd.grad(out, (q, k, v), grad)

    def model_sdpa():  # the models' path above the short-attention limit, from qkv with its permute copies
        out = sdpa_from_qkv(qkv, H)
        return torch.autograd.grad(out, (qkv,), grad_bnc)

    def time_config(config):
        with config_replaced(N, config):  # the config is read at launch, so at capture
            return measure.graph_median_us(lambda: dres_fwd_bwd(qkv, H, grad_bnc))

    sdpa_us = measure.graph_median_us(sdpa)
    model_sdpa_us = measure.graph_median_us(model_sdpa)
    current = current_config(N, d)
    results = measure.time_configs(time_config, candidates(N),
                                   lambda config: f"{config}{'  (current)' if config == current else ''}")
    now = next((us for us, config in results if config == current), float("nan"))
    best = "; ".join(f"{us:.0f} us {config}" for us, config in results[:3])
    return (f"{B}x{H}x{N}x{d}: torch's SDPA {sdpa_us:.0f} us (the models' SDPA path from qkv, copies included: "
            f"{model_sdpa_us:.0f} us); current {current} {now:.0f} us; best: {best}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma list of BxHxNxD (batch, heads, tokens, head dim)")
    p.add_argument("--dry-run", action="store_true", help="print the configs per shape and exit")
    args = p.parse_args(argv)
    shapes = parse_shapes(args.shapes)
    if args.dry_run:
        for B, H, N, d in shapes:
            print(f"{B}x{H}x{N}x{d}: current {current_config(N, d)}; {len(candidates(N))} configs")
        return 0
    if not torch.cuda.is_available():
        print("tune_attention needs a CUDA GPU (--dry-run shows the plan)", file=sys.stderr)
        return 2
    for B, H, N, d in shapes:
        print(sweep(B, H, N, d), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
