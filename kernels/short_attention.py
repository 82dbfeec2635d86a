"""Triton kernels for multi-head self-attention over short sequences (N <= 128 tokens), and launchers.

The input is the qkv Linear's output (B, N, 3C), laid out as timm's Attention reshapes it,
(B, N, 3, H, d): q, k, v of head h sit at columns h*d, C + h*d and 2C + h*d of each token's row.
For one head the flattened token index t = b*N + n addresses them at a uniform row stride, so a
program takes one head and S = BLOCK // N whole sequences, rows t0 .. t0 + S*N - 1 of a BLOCK-row
tile (the rest padding), and works on the tile's block diagonal::

    scores = q k^T * scale                  (BLOCK x BLOCK, fp32)
    P      = softmax over the keys j of row i's own sequence (i // N == j // N), the others -inf
    out    = P v                            -> out[t, h*d:(h+1)*d]
    backward, P recomputed from q and k:
    dv = P^T dout,  dP = dout v^T,  dS = P * (dP - rowsum(P * dP)),  dq = dS k * scale,  dk = dS^T q * scale

One tile per (sequence group, head) instead of one per (sequence, head) padded to 64-128 rows, the
padding that keeps the SDPA backends several times above the memory-traffic floor at N = 17 or 65.
Every key of a sequence is in its tile, so the backward needs no atomics and no second pass, and it
recomputes P rather than reading a saved log-sum-exp: the whole row fits in the tile, so the one
extra q k^T costs less than writing and reading an (H, B*N) buffer. Padding rows (past S*N, or past
the last sequence) load zeros and form sequences of their own: finite, never stored, never mixed
into a real row. Products run on the tensor cores from the storage dtype with fp32 accumulation;
fp32 inputs use IEEE fp32 products (no TF32), so fp32 results match a float64 reference to fp32
rounding. Kernels and launchers only: no autograd here (that lives in ``dres.ops.short_attention``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .utils import CachedLaunch, cdiv, rows_of

MAX_SEQ_LEN = 128
HEAD_DIMS = (16, 32, 64, 128)


@triton.jit
def _load_tile(QKV, stride_qkv, num_rows, C, SEQ: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """This program's tile: (tile row index, token index t, the mask of real tokens' elements, feature
    columns of this head, q, k, v), padding rows loaded as zeros."""
    rows = tl.arange(0, BLOCK)
    tokens = tl.program_id(0).to(tl.int64) * ((BLOCK // SEQ) * SEQ) + rows
    mask = ((rows < (BLOCK // SEQ) * SEQ) & (tokens < num_rows))[:, None]
    cols = tl.program_id(1) * HEAD_DIM + tl.arange(0, HEAD_DIM)
    q_ptrs = QKV + tokens[:, None] * stride_qkv + cols[None, :]
    q = tl.load(q_ptrs, mask=mask, other=0.0)
    k = tl.load(q_ptrs + C, mask=mask, other=0.0)
    v = tl.load(q_ptrs + 2 * C, mask=mask, other=0.0)
    return rows, tokens, mask, cols, q, k, v


@triton.jit
def _probabilities(q, k, rows, scale, SEQ: tl.constexpr):
    """P = softmax(q k^T * scale) over the keys of each row's own sequence (the block diagonal), fp32."""
    scores = tl.dot(q, tl.trans(k), input_precision="ieee") * (scale * 1.4426950408889634)  # log2(e): exp2 below
    seq = rows // SEQ
    scores = tl.where(seq[:, None] == seq[None, :], scores, float("-inf"))
    p = tl.exp2(scores - tl.max(scores, axis=1)[:, None])
    return p / tl.sum(p, axis=1)[:, None]


@triton.jit
def _short_attention_fwd_kernel(
    QKV, OUT, stride_qkv, stride_out, num_rows, C, scale,
    SEQ: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows, tokens, mask, cols, q, k, v = _load_tile(QKV, stride_qkv, num_rows, C, SEQ, HEAD_DIM, BLOCK)
    p = _probabilities(q, k, rows, scale, SEQ)
    out = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    tl.store(OUT + tokens[:, None] * stride_out + cols[None, :], out.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _short_attention_bwd_kernel(
    QKV, DOUT, DQKV, stride_qkv, stride_dout, stride_dqkv, num_rows, C, scale,
    SEQ: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows, tokens, mask, cols, q, k, v = _load_tile(QKV, stride_qkv, num_rows, C, SEQ, HEAD_DIM, BLOCK)
    # The products take one dtype: dout in qkv's (they are the same but for an fp32 gradient of a 16-bit output)
    dout = tl.load(DOUT + tokens[:, None] * stride_dout + cols[None, :], mask=mask, other=0.0).to(q.dtype)
    p = _probabilities(q, k, rows, scale, SEQ)
    dv = tl.dot(tl.trans(p.to(q.dtype)), dout, input_precision="ieee")
    dp = tl.dot(dout, tl.trans(v), input_precision="ieee")
    ds = (p * (dp - tl.sum(p * dp, axis=1)[:, None])).to(q.dtype)
    dq = tl.dot(ds, k, input_precision="ieee") * scale
    dk = tl.dot(tl.trans(ds), q, input_precision="ieee") * scale
    dq_ptrs = DQKV + tokens[:, None] * stride_dqkv + cols[None, :]
    tl.store(dq_ptrs, dq.to(DQKV.dtype.element_ty), mask=mask)
    tl.store(dq_ptrs + C, dk.to(DQKV.dtype.element_ty), mask=mask)
    tl.store(dq_ptrs + 2 * C, dv.to(DQKV.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Launch configuration: a pure function of (N, d), cached, never autotuned at run time.


@functools.lru_cache(maxsize=None)
def attention_config(seq_len: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK, num_warps): 64-row tiles up to N = 64 (three sequences at N = 17), 128 rows above, 4 warps:
    the fastest in a sweep of tiles and warps on an H100 (bf16) whose record is not yet in BENCHMARKS.md;
    bench_attention's dres column is the measurement to rerun."""
    return (64 if seq_len <= 64 else MAX_SEQ_LEN), 4


_FORWARD = CachedLaunch(_short_attention_fwd_kernel)
_BACKWARD = CachedLaunch(_short_attention_bwd_kernel)


def short_attention_forward(qkv: torch.Tensor, out: torch.Tensor, num_heads: int, scale: float) -> None:
    """Write ``out`` (B, N, C), contiguous, the attention of each (sequence, head) of ``qkv``
    (B, N, 3C) in timm's layout, N <= 128, d = C / num_heads in ``HEAD_DIMS``; qkv with evenly
    spaced rows and unit feature stride (others are copied: ``rows_of``)."""
    B, N, three_c = qkv.shape
    if B * N == 0:
        return
    C = three_c // 3
    qkv, stride_qkv = rows_of(qkv)
    # int(): a symbolic size (a dynamic-shape compile) is specialised here, the tile depends on it
    block, num_warps = attention_config(int(N), int(C // num_heads))
    _FORWARD((cdiv(B, block // N), num_heads), (
        qkv, out, stride_qkv, C, B * N, C, scale, N, C // num_heads, block,
    ), num_warps)


def short_attention_backward(dout: torch.Tensor, qkv: torch.Tensor, dqkv: torch.Tensor, num_heads: int,
                             scale: float) -> None:
    """Write ``dqkv`` (B, N, 3C), contiguous, in qkv's layout, from the output gradient ``dout``
    (B, N, C), any strides (copied unless its rows are evenly spaced with unit feature stride)."""
    B, N, three_c = qkv.shape
    if B * N == 0:
        return
    C = three_c // 3
    qkv, stride_qkv = rows_of(qkv)
    dout, stride_dout = rows_of(dout)
    block, num_warps = attention_config(int(N), int(C // num_heads))
    _BACKWARD((cdiv(B, block // N), num_heads), (
        qkv, dout, dqkv, stride_qkv, stride_dout, three_c, B * N, C, scale, N, C // num_heads, block,
    ), num_warps)
