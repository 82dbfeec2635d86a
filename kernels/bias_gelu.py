"""Triton kernels for the MLP activation ``act = gelu(pre + bias)`` (exact erf GELU, its tanh
approximation, or the sigmoid one, CLIP's QuickGELU), and launchers.

``pre`` is the output of an MLP's first matmul run without its bias, shape (M, N) with N the hidden
width (3072 for ViT-B). The forward adds the bias and applies GELU in one pass. The backward
*recomputes* GELU from ``pre`` instead of reading a stored activation, so an MLP needs to keep only
``pre`` for its backward (one (M, N) tensor fewer than ``fc2(gelu(fc1(x)))`` under plain autograd)::

    v    = pre + bias                                   (fp32 registers)
    act  = gelu(v)     = v * cdf(v)
    dpre = g * gelu'(v),  gelu'(v) = cdf(v) + v * cdf'(v)
    dbias = column sums of dpre in fp32: per-program partial sums, then a fixed-order reduction

    approximate="none":  cdf = Phi, the standard normal CDF; cdf' = phi, its density
    approximate="tanh":  cdf = 0.5 * (1 + tanh(u)) = sigmoid(2u),  u = sqrt(2/pi) * (v + 0.044715 v^3)
                         cdf' = 2 sigmoid(2u) sigmoid(-2u) * du/dv
    approximate="quick": cdf = sigmoid(1.702 v)  (QuickGELU: CLIP's, timm's and HF's ``quick_gelu``)
                         cdf' = 1.702 sigmoid(1.702 v) sigmoid(-1.702 v)

The ``GELU`` constexpr (:data:`GELU_KINDS`) picks the formula; everything else is one kernel. The backward optionally
writes ``act`` again (the caller's fc2 weight gradient needs it). All arithmetic is fp32 whatever
the storage dtypes. Kernels and launchers only: no autograd here (that lives in
``dres.ops.bias_gelu``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .utils import CachedLaunch, cdiv, persistent_programs, rows_of, scratch_buffer, sum_partials


GELU_KINDS = {"none": 0, "tanh": 1, "quick": 2}  # the kernels' GELU constexpr for each ``approximate``


@triton.jit
def _tanh_gelu_arg2(v):
    """2u, u = sqrt(2/pi) * (v + 0.044715 v^3): the tanh GELU's cdf 0.5 * (1 + tanh(u)) is sigmoid(2u)."""
    return 1.5957691216057308 * (v + 0.044715 * v * v * v)


@triton.jit
def _sigmoid_pair(z):
    """(sigmoid(z), sigmoid(z) * sigmoid(-z)) from e = e^-|z| in (0, 1], which never overflows, and r = 1 / (1 + e) as
    the square of the hardware's reciprocal square root of 1 + e in [1, 2]: sigmoid(z) is r or e r and the product
    e r^2, no division and no cancellation in either tail (where 1 - sigmoid(z) would lose its digits)."""
    e = tl.math.exp2(-1.4426950408889634 * tl.abs(z))
    r = tl.math.rsqrt(1.0 + e)
    r = r * r
    return tl.where(z >= 0, r, e * r), e * r * r


@triton.jit
def _normal_cdf(v):
    """Phi(v) = erfc(-v / sqrt(2)) / 2 with erfc(z) = t e^(P(t) - z^2), t = 1 / (1 + z / 2) for z = |v| / sqrt(2) >= 0
    (Numerical Recipes' Chebyshev fit ``erfcc``, relative error below 1.2e-7 at every z), in base 2 with the 1/2 folded
    into P's constant term. No erf: 1 + erf(z) loses Phi's digits where v is negative, and this form takes about half
    of libdevice erff's instructions, which bound the forward (the exponential and reciprocal square root are the
    hardware's approximations, flushing denormals: a relative error near 1e-7 either way)."""
    t = tl.math.rsqrt(1.0 + 0.35355339059327373 * tl.abs(v))
    t = t * t
    p = -1.1861149072647095 + t * 0.24651730060577393
    p = 2.147474527359009 + t * p
    p = -1.6377531290054321 + t * p
    p = 0.40232157707214355 + t * p
    p = -0.2687568664550781 + t * p
    p = 0.1396300494670868 + t * p
    p = 0.5397006273269653 + t * p
    p = 1.4427292346954346 + t * p
    p = -2.8257482051849365 + t * p
    half_erfc = t * tl.math.exp2(p - 0.7213475204444817 * v * v)
    return tl.where(v >= 0, 1.0 - half_erfc, half_erfc)


@triton.jit
def _gelu_cdf(v, GELU: tl.constexpr):
    """cdf(v), gelu(v) = v * cdf(v) (``GELU``: :data:`GELU_KINDS`): Phi(v) = 0.5 * (1 + erf(v / sqrt(2))),
    nn.GELU's default; the tanh form as sigmoid(2u), which has no cancellation where tanh(u) nears -1; or
    QuickGELU's sigmoid(1.702 v)."""
    if GELU == 1:
        return _sigmoid_pair(_tanh_gelu_arg2(v))[0]
    elif GELU == 2:
        return _sigmoid_pair(1.702 * v)[0]
    else:
        return _normal_cdf(v)


@triton.jit
def _gelu_cdf_slope(v, GELU: tl.constexpr):
    """cdf'(v), gelu'(v) = cdf(v) + v * cdf'(v): phi(v) = exp(-v^2 / 2) / sqrt(2 pi); for the tanh form
    2 sigmoid(z) sigmoid(-z) * du/dv (z = 2u, du/dv = sqrt(2/pi) * (1 + 3 * 0.044715 v^2)); for QuickGELU
    1.702 sigmoid(z) sigmoid(-z) (z = 1.702 v), the sigmoids' product from :func:`_sigmoid_pair`."""
    if GELU == 1:
        # v * v overflows fp32 from |v| = 1.8e19, where the sigmoids' product is 0 already: capped, no 0 * inf
        du = 1.5957691216057308 * (1.0 + 0.134145 * tl.minimum(v * v, 1e4))
        return du * _sigmoid_pair(_tanh_gelu_arg2(v))[1]
    elif GELU == 2:
        return 1.702 * _sigmoid_pair(1.702 * v)[1]
    else:
        return 0.3989422804014327 * tl.math.exp2(-0.7213475204444817 * v * v)  # e^(-v^2 / 2) as 2^(-log2(e) v^2 / 2)


@triton.jit
def _bias_gelu_fwd_kernel(
    PRE, BIAS, ACT,
    stride_pre, stride_act,
    M, N,
    HAS_BIAS: tl.constexpr,
    GELU: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # A 2-D grid of (BLOCK_M x BLOCK_N) tiles: hidden widths run to thousands of columns, so a row
    # is split across programs instead of being held whole in registers.
    # int64 row offsets: M * N passes 2**31 at ViT-B's 3072 columns from 700k rows on.
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    mask = (rows < M)[:, None] & col_ok[None, :]
    v = tl.load(PRE + rows[:, None] * stride_pre + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        v += tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    act = v * _gelu_cdf(v, GELU)
    tl.store(ACT + rows[:, None] * stride_act + cols[None, :], act.to(ACT.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_bwd_kernel(
    G, PRE, BIAS, DPRE, ACT, DBIAS_PART,
    stride_g, stride_pre, stride_dpre, stride_act,
    M, N, rows_per_strip,
    HAS_BIAS: tl.constexpr,
    STORE_ACT: tl.constexpr,
    NEED_DBIAS: tl.constexpr,
    GELU: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Program (j, s) owns column block j of the row strip s (rows_per_strip rows, a multiple of
    # BLOCK_M) and walks it tile by tile, keeping its dbias partial sums in registers. It writes one
    # row of partials, DBIAS_PART[s, cols]; the strips' partials are then added in a fixed order,
    # so dbias is bit-identical from run to run (no atomics).
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    strip = tl.program_id(1)
    if HAS_BIAS:
        bias = tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)
    # A 2-D accumulator: one cross-thread column reduction at the end instead of one per tile.
    dbias_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first_row = strip.to(tl.int64) * rows_per_strip
    for start in range(0, rows_per_strip, BLOCK_M):
        rows = first_row + start + tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None] & col_ok[None, :]
        v = tl.load(PRE + rows[:, None] * stride_pre + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            v += bias[None, :]
        # Masked elements load g = 0, so they add nothing to the partial sums.
        g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        cdf = _gelu_cdf(v, GELU)
        dpre = g * (cdf + v * _gelu_cdf_slope(v, GELU))
        tl.store(DPRE + rows[:, None] * stride_dpre + cols[None, :], dpre.to(DPRE.dtype.element_ty), mask=mask)
        if STORE_ACT:
            tl.store(ACT + rows[:, None] * stride_act + cols[None, :], (v * cdf).to(ACT.dtype.element_ty), mask=mask)
        if NEED_DBIAS:
            dbias_acc += dpre  # the fp32 products, not the rounded stored dpre
    if NEED_DBIAS:
        tl.store(DBIAS_PART + strip * N + cols, tl.sum(dbias_acc, axis=0), mask=col_ok)


# ----------------------------------------------------------------------------------------------
# Launch configuration: a pure function of N, cached, so choosing it costs nothing per call and
# never autotunes at run time.


@functools.lru_cache(maxsize=None)
def forward_config(n: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the forward for rows of ``n`` columns.

    Tiles of 4096 elements, up to 256 columns by 16 rows for wide hidden layers and more rows when N
    is small, so that a tile is never mostly padding columns (``benchmarks.bench_branch_ops``' tile sweep,
    record ``h200-2026-11-26-branch-ops``).
    """
    block_n = min(256, triton.next_power_of_2(max(n, 16)))
    return 4096 // block_n, block_n, 4


@functools.lru_cache(maxsize=None)
def backward_config(n: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, programs per SM) of the backward for rows of ``n`` columns.

    Column blocks of 128 by 16 rows, 8 warps, 4 programs per SM: the best of ``benchmarks.tune_bias_gelu``'s 45
    configs or within 1% of it at the MLP shapes swept (erf GELU at 25,216 x 3,072 and 50,432 x 2,048, QuickGELU at
    25,216 x 3,072; 19% faster than 32 rows for QuickGELU; record ``h200x2-2026-11-29-mlp-kernels-and-gpu-suites``).
    """
    block_n = min(128, triton.next_power_of_2(max(n, 16)))
    return 2048 // block_n, block_n, 8, 4


_FORWARD = CachedLaunch(_bias_gelu_fwd_kernel)
_BACKWARD = CachedLaunch(_bias_gelu_bwd_kernel)


def bias_gelu_forward(pre: torch.Tensor, bias: torch.Tensor | None, act: torch.Tensor, approximate: str) -> None:
    """Write ``act = gelu(pre + bias)``: ``pre`` (..., N) with evenly spaced rows (others are copied:
    ``rows_of``), ``act`` contiguous of pre's shape and the output dtype; ``bias`` (N,) or None;
    ``approximate`` "none" (erf) or "tanh", as ``F.gelu`` names them, or "quick" (QuickGELU)."""
    N = pre.shape[-1]
    M = pre.numel() // N if N else 0
    if M == 0:
        return
    pre, stride_pre = rows_of(pre)
    # int(): a symbolic size (a dynamic-shape compile) is specialised here, the tile depends on it
    block_m, block_n, num_warps = forward_config(int(N))
    _FORWARD((cdiv(M, block_m), cdiv(N, block_n)), (
        pre, bias if bias is not None else pre, act, stride_pre, N, M, N,
        bias is not None, GELU_KINDS[approximate], block_m, block_n,
    ), num_warps)


def bias_gelu_backward(
    g: torch.Tensor,
    pre: torch.Tensor,
    bias: torch.Tensor | None,
    dpre: torch.Tensor,
    act: torch.Tensor | None,
    need_dbias: bool,
    approximate: str,
) -> torch.Tensor | None:
    """Write ``dpre = g * gelu'(pre + bias)`` and, when ``act`` is given, ``act = gelu(pre + bias)``;
    return ``dbias`` (fp32, (N,)) when ``need_dbias``, else None. ``approximate``: as the forward's.

    ``g``, ``pre``: (..., N) with evenly spaced rows (others are copied: ``rows_of``; ``g`` may have
    row stride 0, an expanded gradient); ``dpre``, ``act``: contiguous, of pre's shape.
    """
    N = pre.shape[-1]
    M = pre.numel() // N if N else 0
    device = pre.device
    f32 = dict(dtype=torch.float32, device=device)
    if M == 0 or N == 0:
        return torch.zeros((N,), **f32) if need_dbias else None
    block_m, block_n, num_warps, programs_per_sm = backward_config(int(N))
    col_blocks = cdiv(N, block_n)
    row_tiles = cdiv(M, block_m)
    # Enough programs to fill the GPU (a few per SM) split between the column blocks; each row
    # strip then holds whole tiles. On the CPU interpreter persistent_programs gives 4, so small
    # test shapes still run several strips and the partials' reduction.
    programs = persistent_programs(device, col_blocks * row_tiles, programs_per_sm)
    strips = max(1, min(row_tiles, programs // col_blocks))
    rows_per_strip = cdiv(row_tiles, strips) * block_m
    strips = cdiv(M, rows_per_strip)  # rounding up rows_per_strip may leave a strip empty
    partials = None
    if need_dbias and strips == 1:  # one strip: its partial sums are dbias itself, the output
        partials = torch.empty((1, N), **f32)
    elif need_dbias:  # in reusable scratch: no allocation per call
        partials = scratch_buffer(pre, strips * N).view(strips, N)
    g, stride_g = rows_of(g)
    pre, stride_pre = rows_of(pre)
    _BACKWARD((col_blocks, strips), (
        g, pre, bias if bias is not None else pre, dpre, act if act is not None else dpre,
        partials if need_dbias else dpre,
        stride_g, stride_pre, N, N,
        M, N, rows_per_strip, bias is not None, act is not None, need_dbias, GELU_KINDS[approximate],
        block_m, block_n,
    ), num_warps)
    if not need_dbias:
        return None
    if strips == 1:
        return partials.view(N)
    dbias = torch.empty((N,), **f32)
    sum_partials(partials.view(1, strips, N), [dbias])
    return dbias
