"""Triton kernels for the scaled residual add fused with LayerNorm, and their launchers.

One forward kernel and one backward kernel serve the three ops of dres (``residual_layer_norm``,
``residual_add``, ``layer_norm``); ``tl.constexpr`` flags remove the parts an op does not use, so
each op compiles to its own specialised kernel.

Forward, per row r of an (M, D) problem, sample b = r // rows_per_sample::

    out = alpha * x + row_scale[b] * drop(h)    (stored in out's dtype)
    y   = (out - mean) * rstd * weight + bias   (normalises the *stored*, rounded out)

drop(h) is h where no dropout is asked for, else h * keep / (1 - p): element i = r*D + c is kept when word
i % 4 of Triton's Philox at counter i // 4 (seed: a tensor of one int64), as a uniform float, is >= p.
One Philox call serves four elements (where D % 4 == 0; else each element runs its own), and the
backward draws the mask again instead of storing it; the csrc kernels compute the same stream, so a
seed gives one mask whichever backend runs.

Backward, with g_out the gradient of ``out`` from its later uses and g_y the gradient of ``y``::

    g  = g_out + LayerNorm_backward(g_y)
    dx = alpha * g,  dh = grad_scale[b] * keep / (1 - p) * g
    dweight, dbias: fp32 partial sums per program, reduced afterwards in a fixed order

All arithmetic is fp32 in registers whatever the storage dtypes. This module holds kernels and
launchers only: no autograd, no modules (those live in ``dres.ops``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .utils import CachedLaunch, cdiv, persistent_programs, rows_of, scratch_buffer, sum_partials

# The largest row length the kernels keep in registers in one tile.
MAX_DIM = 16384


@triton.jit
def _dropout_factor(SEED, rows, cols, D, dropout_p, dropout_scale, BY_QUADS: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    """keep / (1 - p) of each element of a (BLOCK_M, BLOCK_D) tile: 0 or dropout_scale (module docstring)."""
    seed = tl.load(SEED)
    if BY_QUADS:  # D % 4 == 0: a row's quads are whole, one Philox call for each, its words laid side by side
        quads = rows[:, None] * (D // 4) + tl.arange(0, BLOCK_D // 4)[None, :]
        w0, w1, w2, w3 = tl.randint4x(seed, quads)
        # join stacks on a new last axis: [quad, (w0 w2 | w1 w3)] flattens row-major to w0 w1 w2 w3 a quad
        words = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (BLOCK_M, BLOCK_D))
    else:
        index = rows[:, None] * D + cols[None, :]
        w0, w1, w2, w3 = tl.randint4x(seed, index // 4)
        word = index % 4
        words = tl.where(word == 0, w0, tl.where(word == 1, w1, tl.where(word == 2, w2, w3)))
    return tl.where(tl.uint_to_uniform_float(words) >= dropout_p, dropout_scale, 0.0)


@triton.jit
def _residual_norm_fwd_kernel(
    X, H, OUT, Y, WEIGHT, BIAS, ALPHA, ROW_SCALE, MEAN, RSTD, SEED,
    stride_x, stride_h, stride_out, stride_y,
    M, D, rows_per_sample, alpha_value, eps, dropout_p, dropout_scale,
    HAS_H: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ALPHA_IS_PTR: tl.constexpr,
    HAS_ROW_SCALE: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    DROPOUT_BY_QUADS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    # int64 row offsets: M * D can pass 2**31 at D = 8192.
    rows = (pid * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < M
    col_ok = cols < D
    mask = row_ok[:, None] & col_ok[None, :]

    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_H:
        if ALPHA_IS_PTR:
            alpha = tl.load(ALPHA).to(tl.float32)
        else:
            alpha = alpha_value
        h = tl.load(H + rows[:, None] * stride_h + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_DROPOUT:
            h = h * _dropout_factor(SEED, rows, cols, D, dropout_p, dropout_scale, DROPOUT_BY_QUADS, BLOCK_M, BLOCK_D)
        if HAS_ROW_SCALE:
            scale = tl.load(ROW_SCALE + rows // rows_per_sample, mask=row_ok, other=0.0).to(tl.float32)
            h = h * scale[:, None]
        out = (alpha * x + h).to(OUT.dtype.element_ty)
        tl.store(OUT + rows[:, None] * stride_out + cols[None, :], out, mask=mask)
        # Normalise the value actually stored, so fused and unfused code agree bit for bit
        # on what the next layer sees.
        v = out.to(tl.float32)
    else:
        v = x

    if HAS_NORM:
        mean = tl.sum(v, axis=1) / D
        diff = tl.where(mask, v - mean[:, None], 0.0)
        var = tl.sum(diff * diff, axis=1) / D
        rstd = 1.0 / tl.sqrt(var + eps)
        tl.store(MEAN + rows, mean, mask=row_ok)
        tl.store(RSTD + rows, rstd, mask=row_ok)
        y = diff * rstd[:, None]
        if HAS_WEIGHT:
            w = tl.load(WEIGHT + cols, mask=col_ok, other=0.0).to(tl.float32)
            y = y * w[None, :]
        if HAS_BIAS:
            b = tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)
            y = y + b[None, :]
        tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _residual_norm_bwd_kernel(
    G_OUT, G_Y, NORMED, X, WEIGHT, MEAN, RSTD, ALPHA, GRAD_SCALE, SEED,
    DX, DH, DWEIGHT_PART, DBIAS_PART, DALPHA_ROW,
    stride_gout, stride_gy, stride_normed, stride_x, stride_dx, stride_dh,
    M, D, rows_per_sample, alpha_value, dropout_p, dropout_scale, num_tiles,
    HAS_G_OUT: tl.constexpr,
    HAS_G_Y: tl.constexpr,
    HAS_H: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    NEED_DWEIGHT: tl.constexpr,
    NEED_DBIAS: tl.constexpr,
    ALPHA_IS_PTR: tl.constexpr,
    HAS_GRAD_SCALE: tl.constexpr,
    NEED_DALPHA: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    DROPOUT_BY_QUADS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Persistent grid: program p handles tiles p, p + P, p + 2P, ... and keeps its dweight/dbias
    # partial sums in registers, writing one row of partials at the end. The partials are then
    # summed in a fixed order, so weight gradients are bit-identical from run to run.
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    if ALPHA_IS_PTR:
        alpha = tl.load(ALPHA).to(tl.float32)
    else:
        alpha = alpha_value
    if HAS_WEIGHT:
        w = tl.load(WEIGHT + cols, mask=col_ok, other=0.0).to(tl.float32)
    dweight_acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    dbias_acc = tl.zeros((BLOCK_D,), dtype=tl.float32)

    for tile in range(pid, num_tiles, num_programs):
        rows = (tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        g = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        if HAS_G_OUT:
            g += tl.load(G_OUT + rows[:, None] * stride_gout + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_G_Y:
            v = tl.load(NORMED + rows[:, None] * stride_normed + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
            rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
            xhat = tl.where(mask, (v - mean[:, None]) * rstd[:, None], 0.0)
            gy = tl.load(G_Y + rows[:, None] * stride_gy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_WEIGHT:
                wgy = gy * w[None, :]
            else:
                wgy = gy
            c1 = tl.sum(xhat * wgy, axis=1) / D
            c2 = tl.sum(wgy, axis=1) / D
            g += (wgy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
            if NEED_DWEIGHT:
                dweight_acc += tl.sum(gy * xhat, axis=0)
            if NEED_DBIAS:
                dbias_acc += tl.sum(gy, axis=0)
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], (alpha * g).to(DX.dtype.element_ty), mask=mask)
        if HAS_H:
            if HAS_GRAD_SCALE:
                gscale = tl.load(GRAD_SCALE + rows // rows_per_sample, mask=row_ok, other=0.0).to(tl.float32)
                dh = g * gscale[:, None]
            else:
                dh = g
            if HAS_DROPOUT:
                dh = dh * _dropout_factor(SEED, rows, cols, D, dropout_p, dropout_scale, DROPOUT_BY_QUADS, BLOCK_M,
                                          BLOCK_D)
            tl.store(DH + rows[:, None] * stride_dh + cols[None, :], dh.to(DH.dtype.element_ty), mask=mask)
        if NEED_DALPHA:
            x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(DALPHA_ROW + rows, tl.sum(g * x, axis=1), mask=row_ok)

    if NEED_DWEIGHT:
        tl.store(DWEIGHT_PART + pid * D + cols, dweight_acc, mask=col_ok)
    if NEED_DBIAS:
        tl.store(DBIAS_PART + pid * D + cols, dbias_acc, mask=col_ok)


# ----------------------------------------------------------------------------------------------
# Launch configuration: a pure function of (D, element size), cached, so choosing it costs no
# time per call and never autotunes at run time.


@functools.lru_cache(maxsize=None)
def forward_config(dim: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_D, num_warps) for rows of length ``dim``.

    A tile holds about 4096 elements (several rows per program when D is small), so each thread
    keeps 8-32 fp32 values per tensor in registers; wide rows get more warps.
    """
    block_d = triton.next_power_of_2(max(dim, 16))
    block_m = max(1, min(64, 4096 // block_d))
    tile = block_m * block_d
    num_warps = max(4, min(16, tile // 512))
    return block_m, block_d, num_warps


@functools.lru_cache(maxsize=None)
def backward_config(dim: int) -> tuple[int, int, int, int, int | None]:
    """(BLOCK_M, BLOCK_D, num_warps, programs per SM, num_stages) for the backward; num_stages None
    is Triton's default software pipelining of the tile loop.

    :func:`residual_norm_backward` looks this function up at every launch: ``benchmarks.tune_backward``
    times other configs by replacing it for the duration of a sweep (``backward_config_replaced``).

    For BLOCK_D 512-1024: 8-row tiles, 64 values of a tile per thread, 8 warps per SM in all, as the
    ``benchmarks.tune_backward`` sweep picked them.
    Other widths keep tiles of ~4096 elements, 32 values per thread, 8 programs per SM.
    """
    block_d = triton.next_power_of_2(max(dim, 16))
    if 512 <= block_d <= 1024:
        block_m = 8
        num_warps = block_m * block_d // (64 * 32)
        return block_m, block_d, num_warps, max(1, 8 // num_warps), None
    block_m = max(1, min(64, 4096 // block_d))
    num_warps = max(2, min(16, block_m * block_d // 1024))
    return block_m, block_d, num_warps, 8, None


def dropout_scale(dropout_p: float) -> float:
    """1 / (1 - p), the factor of a kept element (torch's dropout's)."""
    return 1.0 / (1.0 - float(dropout_p))


_FORWARD = CachedLaunch(_residual_norm_fwd_kernel)
_BACKWARD = CachedLaunch(_residual_norm_bwd_kernel)


def residual_norm_forward(
    x: torch.Tensor,
    h: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    alpha: torch.Tensor | None,
    alpha_value: float,
    eps: float,
    row_scale: torch.Tensor | None,
    rows_per_sample: int,
    out: torch.Tensor | None,
    y: torch.Tensor | None,
    mean: torch.Tensor | None,
    rstd: torch.Tensor | None,
    dropout_p: float,
    seed: torch.Tensor | None,
) -> None:
    """Launch the forward kernel. Writes out/y/mean/rstd.

    x, h: (..., D) with evenly spaced rows (any other layout is copied: ``rows_of``); out, y:
    contiguous, x's shape; mean, rstd: (rows,). ``h is None`` means layer_norm only (``out``
    unused); ``y is None`` means residual_add only. alpha: a 0-dim tensor the kernel reads, or None
    for ``alpha_value`` passed by value. dropout_p > 0: h is dropped with the Philox stream of ``seed``
    (an int64 tensor of one value, read by the kernel).
    """
    D = x.shape[-1]
    M = x.numel() // D
    if M == 0:
        return
    x, stride_x = rows_of(x)
    has_h = h is not None
    h, stride_h = rows_of(h) if has_h else (x, 0)
    has_norm = y is not None
    alpha_is_ptr = alpha is not None
    # int(): a symbolic size (a dynamic-shape compile) is specialised here, the tile depends on it
    block_m, block_d, num_warps = forward_config(int(D))
    dummy = x
    has_dropout = dropout_p > 0
    _FORWARD((cdiv(M, block_m),), (
        x, h, out if has_h else dummy, y if has_norm else dummy,
        weight if weight is not None else dummy, bias if bias is not None else dummy,
        alpha if alpha_is_ptr else dummy, row_scale if row_scale is not None else dummy,
        mean if has_norm else dummy, rstd if has_norm else dummy, seed if has_dropout else dummy,
        stride_x, stride_h, D, D,
        M, D, rows_per_sample, float(alpha_value), eps, float(dropout_p), dropout_scale(dropout_p),
        has_h, has_norm, weight is not None, bias is not None, alpha_is_ptr, row_scale is not None, has_dropout,
        has_dropout and D % 4 == 0, block_m, block_d,  # the quads' switch only where dropout runs: no second build
    ), num_warps)


def residual_norm_backward(
    g_out: torch.Tensor | None,
    g_y: torch.Tensor | None,
    normed: torch.Tensor | None,
    x: torch.Tensor | None,
    weight: torch.Tensor | None,
    mean: torch.Tensor | None,
    rstd: torch.Tensor | None,
    alpha: torch.Tensor | None,
    alpha_value: float,
    grad_scale: torch.Tensor | None,
    rows_per_sample: int,
    dx: torch.Tensor,
    dh: torch.Tensor | None,
    need_dweight: bool,
    need_dbias: bool,
    need_dalpha: bool,
    dropout_p: float,
    seed: torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Launch the backward kernel; returns (dweight fp32, dbias fp32, dalpha fp32) where asked.

    ``normed`` is the tensor the norm normalised (the stored ``out``, or x for layer_norm);
    ``x`` is needed only for dalpha. Inputs (..., D) with evenly spaced rows (others are copied:
    ``rows_of``; a gradient with row stride 0 is read in place); dx, dh contiguous. alpha, alpha_value:
    as :func:`residual_norm_forward`'s; dropout_p and seed: the forward's (dh gets its mask). The launch
    parameters are :func:`backward_config`'s.
    """
    D = dx.shape[-1]
    M = dx.numel() // D
    device = dx.device
    need_dweight = need_dweight and g_y is not None
    need_dbias = need_dbias and g_y is not None
    block_m, block_d, num_warps, programs_per_sm, num_stages = backward_config(int(D))
    f32 = dict(dtype=torch.float32, device=device)
    if M == 0:  # nothing to launch; parameter gradients of no rows are zero
        zeros = lambda shape: torch.zeros(shape, **f32)  # noqa: E731
        return (zeros((D,)) if need_dweight else None, zeros((D,)) if need_dbias else None,
                zeros(()) if need_dalpha else None)
    num_tiles = cdiv(M, block_m)
    programs = persistent_programs(device, num_tiles, programs_per_sm)
    # dweight and dbias partials share one buffer so that one reduction launch sums both; with
    # dalpha's per-row sums they live in reusable scratch (every program writes its whole row of
    # partials before the reduction reads it, and every row's dalpha term is written).
    num_partials = int(need_dweight) + int(need_dbias)
    partials_numel = num_partials * programs * D
    scratch_numel = partials_numel + (M if need_dalpha else 0)
    scratch = scratch_buffer(dx, scratch_numel) if scratch_numel else None
    partials = scratch[:partials_numel].view(num_partials, programs, D) if num_partials else None
    dalpha_row = scratch[partials_numel:] if need_dalpha else None
    alpha_is_ptr = alpha is not None
    dummy = dx
    has_g_out, has_g_y = g_out is not None, g_y is not None
    g_out, stride_gout = rows_of(g_out) if g_out is not None else (dummy, 0)
    g_y, stride_gy = rows_of(g_y) if g_y is not None else (dummy, 0)
    normed, stride_normed = rows_of(normed) if normed is not None else (dummy, 0)
    x, stride_x = rows_of(x) if x is not None else (dummy, 0)
    has_dropout = dh is not None and dropout_p > 0
    _BACKWARD((programs,), (
        g_out, g_y, normed, x,
        weight if weight is not None else dummy,
        mean if mean is not None else dummy, rstd if rstd is not None else dummy,
        alpha if alpha_is_ptr else dummy, grad_scale if grad_scale is not None else dummy,
        seed if has_dropout else dummy,
        dx, dh if dh is not None else dummy,
        partials[0] if need_dweight else dummy, partials[num_partials - 1] if need_dbias else dummy,
        dalpha_row if need_dalpha else dummy,
        stride_gout, stride_gy, stride_normed, stride_x, D, D,
        M, D, rows_per_sample, float(alpha_value), float(dropout_p), dropout_scale(dropout_p), num_tiles,
        has_g_out, has_g_y, dh is not None, weight is not None, need_dweight, need_dbias,
        alpha_is_ptr, grad_scale is not None, need_dalpha, has_dropout, has_dropout and D % 4 == 0, block_m, block_d,
    ), num_warps, num_stages)
    dweight = dbias = None
    if num_partials:
        # Separate outputs (not views of one buffer): the backward op's results must not alias.
        sums = [torch.empty((D,), **f32) for _ in range(num_partials)]
        sum_partials(partials, sums)
        dweight = sums[0] if need_dweight else None
        dbias = sums[-1] if need_dbias else None
    # torch's sum over a fixed shape uses a fixed reduction order: deterministic.
    dalpha = dalpha_row.sum() if need_dalpha else None
    return dweight, dbias, dalpha
