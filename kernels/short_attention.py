"""Triton kernels for multi-head self-attention over short sequences (N <= 256 tokens), and launchers.

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
into a real row.

Above 128 tokens (the ViT-B/16 MAE decoder's 197) a square tile of a whole sequence would not fit in
registers; there one program takes one (sequence, head): all its keys and values in one KEYS-row tile (the next
power of two, padding keys masked out of the softmax), its queries in blocks of BLOCK_M rows, each
block's softmax row whole in registers as above. The backward walks the query blocks, writing each
block's dq and summing dk and dv in registers, so it too needs no atomics and no log-sum-exp.

Products run on the tensor cores from the storage dtype with fp32 accumulation; fp32 inputs use IEEE
fp32 products (no TF32), so fp32 results match a float64 reference to fp32 rounding. Kernels and launchers only: no autograd here (that lives in ``dres.ops.short_attention``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .utils import CachedLaunch, cdiv, rows_of

MAX_SEQ_LEN = 256
PACKED_MAX_SEQ_LEN = 128  # up to here several whole sequences share a tile; above, a program per sequence
HEAD_DIMS = (16, 32, 64, 128)
SEQUENCE_HEAD_DIMS = (16, 32, 64)  # above PACKED_MAX_SEQ_LEN: 128-wide heads' dk and dv would not fit in registers


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
def _probabilities(q, k, allowed, scale):
    """P = softmax(q k^T * scale) over the keys ``allowed`` (a boolean tile or one that broadcasts to it), fp32."""
    scores = tl.dot(q, tl.trans(k), input_precision="ieee") * (scale * 1.4426950408889634)  # log2(e): exp2 below
    scores = tl.where(allowed, scores, float("-inf"))
    p = tl.exp2(scores - tl.max(scores, axis=1)[:, None])
    return p / tl.sum(p, axis=1)[:, None]


@triton.jit
def _same_sequence(rows, SEQ: tl.constexpr):
    """The packed tile's block diagonal: row i may attend to row j of its own sequence only."""
    seq = rows // SEQ
    return seq[:, None] == seq[None, :]


@triton.jit
def _gradients(p, q, k, v, dout, scale):
    """(dq, dk, dv), fp32, of out = P v with P from :func:`_probabilities`, for the output gradient ``dout``."""
    dv = tl.dot(tl.trans(p.to(q.dtype)), dout, input_precision="ieee")
    dp = tl.dot(dout, tl.trans(v), input_precision="ieee")
    ds = (p * (dp - tl.sum(p * dp, axis=1)[:, None])).to(q.dtype)
    dq = tl.dot(ds, k, input_precision="ieee") * scale
    dk = tl.dot(tl.trans(ds), q, input_precision="ieee") * scale
    return dq, dk, dv


@triton.jit
def _short_attention_fwd_kernel(
    QKV, OUT, stride_qkv, stride_out, num_rows, C, scale,
    SEQ: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows, tokens, mask, cols, q, k, v = _load_tile(QKV, stride_qkv, num_rows, C, SEQ, HEAD_DIM, BLOCK)
    p = _probabilities(q, k, _same_sequence(rows, SEQ), scale)
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
    p = _probabilities(q, k, _same_sequence(rows, SEQ), scale)
    dq, dk, dv = _gradients(p, q, k, v, dout, scale)
    dq_ptrs = DQKV + tokens[:, None] * stride_dqkv + cols[None, :]
    tl.store(dq_ptrs, dq.to(DQKV.dtype.element_ty), mask=mask)
    tl.store(dq_ptrs + C, dk.to(DQKV.dtype.element_ty), mask=mask)
    tl.store(dq_ptrs + 2 * C, dv.to(DQKV.dtype.element_ty), mask=mask)


@triton.jit
def _load_keys(QKV, stride_qkv, C, SEQ: tl.constexpr, HEAD_DIM: tl.constexpr, KEYS: tl.constexpr):
    """This program's sequence and head: (first token index, feature columns of the head, key index,
    k, v), KEYS rows of keys with the rows past SEQ loaded as zeros."""
    seq_start = tl.program_id(0).to(tl.int64) * SEQ
    cols = tl.program_id(1) * HEAD_DIM + tl.arange(0, HEAD_DIM)
    keys = tl.arange(0, KEYS)
    k_ptrs = QKV + (seq_start + keys)[:, None] * stride_qkv + C + cols[None, :]
    mask = (keys < SEQ)[:, None]
    return seq_start, cols, keys, tl.load(k_ptrs, mask=mask, other=0.0), tl.load(k_ptrs + C, mask=mask, other=0.0)


@triton.jit
def _load_queries(QKV, stride_qkv, seq_start, first, cols, SEQ: tl.constexpr, BLOCK_M: tl.constexpr):
    """Query rows first .. first + BLOCK_M - 1 of the sequence: (token index, mask of real rows, q)."""
    tokens = seq_start + first + tl.arange(0, BLOCK_M)
    mask = (tokens < seq_start + SEQ)[:, None]
    return tokens, mask, tl.load(QKV + tokens[:, None] * stride_qkv + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _sequence_attention_fwd_kernel(
    QKV, OUT, stride_qkv, stride_out, C, scale,
    SEQ: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    KEYS: tl.constexpr,
):
    seq_start, cols, keys, k, v = _load_keys(QKV, stride_qkv, C, SEQ, HEAD_DIM, KEYS)
    for first in range(0, SEQ, BLOCK_M):
        tokens, mask, q = _load_queries(QKV, stride_qkv, seq_start, first, cols, SEQ, BLOCK_M)
        p = _probabilities(q, k, (keys < SEQ)[None, :], scale)
        out = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        tl.store(OUT + tokens[:, None] * stride_out + cols[None, :], out.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _sequence_attention_bwd_kernel(
    QKV, DOUT, DQKV, stride_qkv, stride_dout, stride_dqkv, C, scale,
    SEQ: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    KEYS: tl.constexpr,
):
    seq_start, cols, keys, k, v = _load_keys(QKV, stride_qkv, C, SEQ, HEAD_DIM, KEYS)
    dk = tl.zeros((KEYS, HEAD_DIM), dtype=tl.float32)
    dv = tl.zeros((KEYS, HEAD_DIM), dtype=tl.float32)
    # Padding query rows load q = dout = 0: their dS is zero, so they add nothing to dk and dv.
    for first in range(0, SEQ, BLOCK_M):
        tokens, mask, q = _load_queries(QKV, stride_qkv, seq_start, first, cols, SEQ, BLOCK_M)
        dout = tl.load(DOUT + tokens[:, None] * stride_dout + cols[None, :], mask=mask, other=0.0).to(q.dtype)
        p = _probabilities(q, k, (keys < SEQ)[None, :], scale)
        dq, dk_block, dv_block = _gradients(p, q, k, v, dout, scale)
        dk += dk_block
        dv += dv_block
        tl.store(DQKV + tokens[:, None] * stride_dqkv + cols[None, :], dq.to(DQKV.dtype.element_ty), mask=mask)
    dk_ptrs = DQKV + (seq_start + keys)[:, None] * stride_dqkv + C + cols[None, :]
    key_mask = (keys < SEQ)[:, None]
    tl.store(dk_ptrs, dk.to(DQKV.dtype.element_ty), mask=key_mask)
    tl.store(dk_ptrs + C, dv.to(DQKV.dtype.element_ty), mask=key_mask)


# ----------------------------------------------------------------------------------------------
# Launch configuration: a pure function of (N, d), cached, never autotuned at run time.


@functools.lru_cache(maxsize=None)
def attention_config(seq_len: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK, num_warps): 64-row tiles up to N = 64 (three sequences at N = 17), 128 rows above; 4 warps,
    2 where a 64-row tile holds one sequence of 64-wide heads (the ViT-B/16 encoder's 50 tokens): the fastest
    of ``python -m benchmarks.tune_attention``'s sweep at the presets' shapes on an H100 (BENCHMARKS.md)."""
    block = 64 if seq_len <= 64 else PACKED_MAX_SEQ_LEN
    return block, (2 if block == 64 and seq_len > 32 and head_dim == 64 else 4)


@functools.lru_cache(maxsize=None)
def sequence_attention_config(seq_len: int, head_dim: int) -> tuple[int, int, int, int]:
    """(KEYS, BLOCK_M, num_warps, num_stages) above PACKED_MAX_SEQ_LEN: every key in one power-of-two tile,
    query blocks small enough that a block's fp32 scores, the keys and, in the backward, dk and dv fit in
    registers: 64 queries, 4 warps and 2 stages for heads up to 32 wide (the fastest at the ViT-B/16 decoder's
    197 tokens in the sweep over 1-3 stages, BENCHMARKS.md), 32 queries, 8 warps and Triton's default 3 stages
    above (not yet swept)."""
    if head_dim <= 32:
        return triton.next_power_of_2(seq_len), 64, 4, 2
    return triton.next_power_of_2(seq_len), 32, 8, 3


_FORWARD = CachedLaunch(_short_attention_fwd_kernel)
_BACKWARD = CachedLaunch(_short_attention_bwd_kernel)
_SEQUENCE_FORWARD = CachedLaunch(_sequence_attention_fwd_kernel)
_SEQUENCE_BACKWARD = CachedLaunch(_sequence_attention_bwd_kernel)


def _dims(qkv: torch.Tensor, num_heads: int) -> tuple:
    """(B, N, C, d) of ``qkv`` (B, N, 3C); N and d as ints: a symbolic size (a dynamic-shape compile) is
    specialised here, since the tile depends on them."""
    B, N, three_c = qkv.shape
    C = three_c // 3
    return B, int(N), C, int(C // num_heads)


def short_attention_forward(qkv: torch.Tensor, out: torch.Tensor, num_heads: int, scale: float) -> None:
    """Write ``out`` (B, N, C), contiguous, the attention of each (sequence, head) of ``qkv``
    (B, N, 3C) in timm's layout, N <= MAX_SEQ_LEN, d = C / num_heads in ``HEAD_DIMS``; qkv with evenly
    spaced rows and unit feature stride (others are copied: ``rows_of``)."""
    B, N, C, head_dim = _dims(qkv, num_heads)
    if B * N == 0:
        return
    qkv, stride_qkv = rows_of(qkv)
    if N > PACKED_MAX_SEQ_LEN:
        keys, block_m, num_warps, num_stages = sequence_attention_config(N, head_dim)
        _SEQUENCE_FORWARD((B, num_heads), (
            qkv, out, stride_qkv, C, C, scale, N, head_dim, block_m, keys,
        ), num_warps, num_stages)
        return
    block, num_warps = attention_config(N, head_dim)
    _FORWARD((cdiv(B, block // N), num_heads), (
        qkv, out, stride_qkv, C, B * N, C, scale, N, head_dim, block,
    ), num_warps)


def short_attention_backward(dout: torch.Tensor, qkv: torch.Tensor, dqkv: torch.Tensor, num_heads: int,
                             scale: float) -> None:
    """Write ``dqkv`` (B, N, 3C), contiguous, in qkv's layout, from the output gradient ``dout``
    (B, N, C), any strides (copied unless its rows are evenly spaced with unit feature stride)."""
    B, N, C, head_dim = _dims(qkv, num_heads)
    if B * N == 0:
        return
    qkv, stride_qkv = rows_of(qkv)
    dout, stride_dout = rows_of(dout)
    if N > PACKED_MAX_SEQ_LEN:
        keys, block_m, num_warps, num_stages = sequence_attention_config(N, head_dim)
        _SEQUENCE_BACKWARD((B, num_heads), (
            qkv, dout, dqkv, stride_qkv, stride_dout, 3 * C, C, scale, N, head_dim, block_m, keys,
        ), num_warps, num_stages)
        return
    block, num_warps = attention_config(N, head_dim)
    _BACKWARD((cdiv(B, block // N), num_heads), (
        qkv, dout, dqkv, stride_qkv, stride_dout, 3 * C, B * N, C, scale, N, head_dim, block,
    ), num_warps)
