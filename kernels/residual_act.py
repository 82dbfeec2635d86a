"""Triton kernels for the convolutional residual ``out = act(alpha * x + row_scale[b] * h)`` and launchers.

The tensors are flat, 1-D views of N elements in their physical order (NCHW or channels_last: both
store the batch outermost), with ``per_sample`` elements per sample, so element e belongs to sample
``e // per_sample`` whatever the feature-map size (computed without a 64-bit division per element). act is ReLU or the identity::

    forward:   out = act(alpha * x + row_scale[b] * h)            (stored in out's dtype)
    backward:  g'  = g * act'(out)      act' = (out > 0) for ReLU, 1 for the identity
               dx  = alpha * g',  dh = grad_scale[b] * g'
               dalpha = sum(g' * x): one fp32 partial sum per program, added afterwards in order

The ReLU backward reads the stored ``out`` (as torch's relu backward does), so x and h need not be
kept. All arithmetic is fp32 whatever the storage dtypes. Kernels and launchers only: the autograd
lives in ``dres.ops.residual_act``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .utils import CachedLaunch, cdiv

# Elements per program and warps: 16 values a thread, enough bytes in flight for a streaming kernel.
BLOCK = 4096
NUM_WARPS = 8


@triton.jit
def _sample_index(start, per_sample, BLOCK: tl.constexpr, WIDE_SAMPLES: tl.constexpr):
    """The sample of each element start .. start + BLOCK - 1. One int64 division per program, none
    per element when samples are at least BLOCK long (the block then spans at most two samples),
    else an int32 division of offsets local to the block's first sample."""
    first = start // per_sample
    local = start - first * per_sample  # < per_sample
    if WIDE_SAMPLES:
        return first + ((local + tl.arange(0, BLOCK)) >= per_sample).to(tl.int64)
    return first + (local.to(tl.int32) + tl.arange(0, BLOCK)) // per_sample  # i32: per_sample < BLOCK


@triton.jit
def _program_elements(N, ALPHA, alpha_value, ALPHA_IS_PTR: tl.constexpr, BLOCK: tl.constexpr):
    """(first element, offsets, in-bounds mask, alpha in fp32) of this program's block."""
    # int64 offsets: a ResNet50 stage at batch 256 holds 2**29 elements, and larger batches pass 2**31.
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    alpha = alpha_value
    if ALPHA_IS_PTR:
        alpha = tl.load(ALPHA).to(tl.float32)
    return start, offs, offs < N, alpha


@triton.jit
def _residual_act_fwd_kernel(
    X, H, OUT, ALPHA, ROW_SCALE,
    N, per_sample, alpha_value,
    ALPHA_IS_PTR: tl.constexpr,
    HAS_ROW_SCALE: tl.constexpr,
    RELU: tl.constexpr,
    WIDE_SAMPLES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    start, offs, mask, alpha = _program_elements(N, ALPHA, alpha_value, ALPHA_IS_PTR, BLOCK)
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    h = tl.load(H + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_ROW_SCALE:
        sample = _sample_index(start, per_sample, BLOCK, WIDE_SAMPLES)
        h = h * tl.load(ROW_SCALE + sample, mask=mask, other=0.0).to(tl.float32)
    v = alpha * x + h
    if RELU:
        v = tl.where(v < 0.0, 0.0, v)  # NaN stays NaN, as in torch.relu
    tl.store(OUT + offs, v.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _residual_act_bwd_kernel(
    G, OUT, X, DX, DH, ALPHA, GRAD_SCALE, DALPHA_PART,
    N, per_sample, alpha_value,
    ALPHA_IS_PTR: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr,
    RELU: tl.constexpr,
    HAS_DH: tl.constexpr,
    NEED_DALPHA: tl.constexpr,
    WIDE_SAMPLES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    start, offs, mask, alpha = _program_elements(N, ALPHA, alpha_value, ALPHA_IS_PTR, BLOCK)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    if RELU:
        out = tl.load(OUT + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.where(out <= 0.0, 0.0, g)  # torch's threshold_backward on the relu result
    tl.store(DX + offs, (alpha * g).to(DX.dtype.element_ty), mask=mask)
    if HAS_DH:
        dh = g
        if HAS_GRAD_SCALE:
            sample = _sample_index(start, per_sample, BLOCK, WIDE_SAMPLES)
            dh = g * tl.load(GRAD_SCALE + sample, mask=mask, other=0.0).to(tl.float32)
        tl.store(DH + offs, dh.to(DH.dtype.element_ty), mask=mask)
    if NEED_DALPHA:
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(DALPHA_PART + tl.program_id(0), tl.sum(g * x, axis=0))


_FORWARD = CachedLaunch(_residual_act_fwd_kernel)
_BACKWARD = CachedLaunch(_residual_act_bwd_kernel)


def residual_act_forward(x: torch.Tensor, h: torch.Tensor, alpha: torch.Tensor | None, alpha_value: float,
                         row_scale: torch.Tensor | None, per_sample: int, relu: bool, out: torch.Tensor) -> None:
    """Write ``out = act(alpha * x + row_scale[e // per_sample] * h)``; x, h, out are 1-D and contiguous.
    alpha: a 0-dim tensor the kernel reads, or None for ``alpha_value`` passed by value."""
    n = x.numel()
    if n == 0:
        return
    alpha_is_ptr = alpha is not None
    _FORWARD((cdiv(n, BLOCK),), (
        x, h, out, alpha if alpha_is_ptr else x, row_scale if row_scale is not None else x,
        n, per_sample, float(alpha_value),
        alpha_is_ptr, row_scale is not None, relu, per_sample >= BLOCK, BLOCK,
    ), NUM_WARPS)


def residual_act_backward(g: torch.Tensor, out: torch.Tensor | None, x: torch.Tensor | None,
                          alpha: torch.Tensor | None, alpha_value: float, grad_scale: torch.Tensor | None,
                          per_sample: int,
                          dx: torch.Tensor, dh: torch.Tensor | None) -> torch.Tensor | None:
    """Write dx (and dh when given) from g; ``out`` given means ReLU; returns dalpha (fp32, 0-dim)
    when ``x`` is given. All tensors are 1-D and contiguous, in one physical order."""
    n = g.numel()
    need_dalpha = x is not None
    if n == 0:
        return g.new_zeros((), dtype=torch.float32) if need_dalpha else None
    programs = cdiv(n, BLOCK)
    partials = torch.empty((programs,), dtype=torch.float32, device=g.device) if need_dalpha else None
    alpha_is_ptr = alpha is not None
    _BACKWARD((programs,), (
        g, out if out is not None else g, x if need_dalpha else g, dx, dh if dh is not None else dx,
        alpha if alpha_is_ptr else g, grad_scale if grad_scale is not None else g,
        partials if need_dalpha else dx,
        n, per_sample, float(alpha_value),
        alpha_is_ptr, grad_scale is not None, out is not None, dh is not None, need_dalpha, per_sample >= BLOCK,
        BLOCK,
    ), NUM_WARPS)
    # torch's sum over a fixed shape uses a fixed reduction order: deterministic.
    return partials.sum() if need_dalpha else None
