"""Triton kernel for MAE's reconstruction loss, reading the target patches straight from the image.

MAE (facebookresearch/mae, ``forward_loss``) compares the decoder's prediction ``pred`` (B, L, P),
P = p*p*C, with ``patchify(imgs)``: column k = (pp*p + q)*C + c of patch (i, j) of image b is pixel
``imgs[b, c, i*p + pp, j*p + q]``. Per patch row r, with w_r = mask[r] / mask_sum::

    t       = patchify(imgs)[r]                                  (gathered, never materialised)
    t_n     = (t - mean(t)) / sqrt(var(t) + eps)   if norm_pix   (var unbiased, as torch.var)
    loss_r  = mean over P of (pred[r] - t_n)^2
    out[r]  = w_r * loss_r                                       (the loss is sum_r out[r])
    dpred   = w_r * 2 * (pred[r] - t_n) / P                      (gradient of the loss)

The caller sums the (B*L,) row terms. Computing the gradient in the forward is the point: one pass
over pred and imgs replaces the patchify copy, the normalisation, the loss and their backward
(about ten passes); folding the mask and 1/mask_sum into the row terms leaves one reduction.

All arithmetic is fp32 in registers. This module holds the kernel and its launcher only: no
autograd (that lives in ``dres.ops.mae_loss``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .residual_norm import MAX_DIM
from .utils import CachedLaunch

# A patch row is held in registers like a LayerNorm row: the same limit applies.
MAX_PATCH_DIM = MAX_DIM


@triton.jit
def _mae_loss_kernel(
    PRED, IMGS, MASK, MASK_SUM, ROW_TERMS, DPRED,
    stride_pred_b, stride_pred_l,
    stride_img_b, stride_img_c, stride_img_h, stride_img_w,
    stride_mask_b, stride_mask_l,
    M, L, grid_w, eps,
    PATCH: tl.constexpr,
    CHANNELS: tl.constexpr,
    NORM_PIX: tl.constexpr,
    NEED_DPRED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    P = PATCH * PATCH * CHANNELS  # a constexpr: the divisions below by P, C and p are by constants
    pid = tl.program_id(0)
    # int64 offsets: a batch of 224px fp32 images passes 2**31 bytes at B = 3424.
    rows = (pid * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK_P)
    row_ok = rows < M
    col_ok = cols < P
    mask = row_ok[:, None] & col_ok[None, :]

    # Row r is patch (i, j) of image b; column k is pixel (pp, q) of channel c (MAE's (p, q, c) order).
    # The image address separates into a per-row and a per-column part.
    b = rows // L
    patch = rows - b * L
    i = patch // grid_w
    j = patch - i * grid_w
    img_row = b * stride_img_b + (i * PATCH) * stride_img_h + (j * PATCH) * stride_img_w
    k = cols.to(tl.int64)
    c = k % CHANNELS
    q = (k // CHANNELS) % PATCH
    pp = k // (CHANNELS * PATCH)
    img_col = c * stride_img_c + pp * stride_img_h + q * stride_img_w

    target = tl.load(IMGS + img_row[:, None] + img_col[None, :], mask=mask, other=0.0).to(tl.float32)
    pred_row = b * stride_pred_b + patch * stride_pred_l
    pred = tl.load(PRED + pred_row[:, None] + k[None, :], mask=mask, other=0.0).to(tl.float32)

    if NORM_PIX:
        mean = tl.sum(target, axis=1) / P
        centered = tl.where(mask, target - mean[:, None], 0.0)
        var = tl.sum(centered * centered, axis=1) / (P - 1)  # unbiased, as torch.var
        target = centered * (1.0 / tl.sqrt(var + eps))[:, None]

    diff = tl.where(mask, pred - target, 0.0)
    # A row with mask 0 gets weight 0 and so exactly zero loss term and gradient (0 * finite).
    weight = tl.load(MASK + b * stride_mask_b + patch * stride_mask_l, mask=row_ok, other=0.0).to(tl.float32)
    mask_sum = tl.load(MASK_SUM).to(tl.float32)
    # An all-zero mask counts no patch: loss 0 and zero gradient rather than 0 / 0.
    counted = mask_sum != 0.0
    weight = tl.where(counted, weight / tl.where(counted, mask_sum, 1.0), 0.0)
    tl.store(ROW_TERMS + rows, weight * (tl.sum(diff * diff, axis=1) / P), mask=row_ok)

    if NEED_DPRED:
        dpred = (diff * (weight * (2.0 / P))[:, None]).to(DPRED.dtype.element_ty)
        tl.store(DPRED + rows[:, None] * P + k[None, :], dpred, mask=mask)


@functools.lru_cache(maxsize=None)
def mae_loss_config(patch_dim: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_P, num_warps) for patches of ``patch_dim`` values.

    Small tiles won ``benchmarks.bench_branch_ops``' tile sweep (record ``h200-2026-11-26-branch-ops``):
    about 2048 elements and 32 values per thread; the widest patches (p = 32) take one 4096-value row
    on 4 warps.
    """
    block_p = triton.next_power_of_2(max(patch_dim, 16))
    block_m = max(1, min(64, 2048 // block_p))
    num_warps = max(2, min(16, block_m * block_p // 1024))
    return block_m, block_p, num_warps


_MAE_LOSS = CachedLaunch(_mae_loss_kernel)


def mae_loss_forward(
    pred: torch.Tensor,
    imgs: torch.Tensor,
    mask: torch.Tensor,
    mask_sum: torch.Tensor,
    patch_size: int,
    norm_pix: bool,
    eps: float,
    row_terms: torch.Tensor,
    dpred: torch.Tensor | None,
) -> None:
    """Launch the kernel: writes ``row_terms`` (B*L,) fp32, whose sum is the loss, and, unless None,
    ``dpred``.

    pred (B, L, P) with unit stride along P (any batch and patch strides); imgs (B, C, H, W) with
    any strides; mask (B, L) with any strides; mask_sum a one-element fp32 tensor, read by the
    kernel so that nothing waits on the host; dpred contiguous (B, L, P).
    """
    B, L, P = pred.shape
    channels = imgs.shape[1]
    M = B * L
    if M == 0:
        return
    # int(): a symbolic size (a dynamic-shape compile) is specialised here, the tile depends on it
    block_m, block_p, num_warps = mae_loss_config(int(P))
    _MAE_LOSS((triton.cdiv(M, block_m),), (
        pred, imgs, mask, mask_sum, row_terms, dpred if dpred is not None else row_terms,
        pred.stride(0), pred.stride(1),
        imgs.stride(0), imgs.stride(1), imgs.stride(2), imgs.stride(3),
        mask.stride(0), mask.stride(1),
        M, L, imgs.shape[3] // patch_size, eps,
        patch_size, channels, norm_pix, dpred is not None, block_m, block_p,
    ), num_warps)
