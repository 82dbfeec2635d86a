"""Helpers the op modules (and the models) share. Imports no Triton, so that models can use the
patch layout without the kernels; the Triton-side helpers live in ``dres.kernels.utils``."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor


def rows_per_sample(t: Tensor, scale: Optional[Tensor]) -> int:
    """Rows of ``t`` (as (rows, D)) that share one per-sample factor of ``scale`` (B,)."""
    return 1 if scale is None else (t.numel() // t.shape[-1]) // scale.shape[0]


def alpha_args(alpha) -> tuple[Optional[Tensor], float]:
    """alpha as the ops take it, (tensor or None, float): a tensor is read by the kernel, so a new
    value needs no recompilation; a Python number is passed by value."""
    if isinstance(alpha, torch.Tensor):
        return alpha.reshape(()), 1.0
    return None, float(alpha)


def param_grad(grad: Optional[Tensor], like: Optional[Tensor], needed: bool) -> Optional[Tensor]:
    """An fp32 parameter gradient in the parameter's dtype and shape; zeros when the kernel had none
    to give (None or an empty tensor: the op's norm output got no gradient)."""
    if like is None or not needed:
        return None
    if grad is None or grad.numel() == 0:
        return torch.zeros_like(like)
    if grad.dtype != like.dtype:
        grad = grad.to(like.dtype)
    return grad if grad.shape == like.shape else grad.reshape(like.shape)


def mlp_compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype fused_mlp's matmuls run in: the autocast dtype when autocast is on for x's device
    type, else x.dtype. (A custom Function's backward does not run under autocast, so the forward
    records this dtype and casts explicitly.)"""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def patchify(imgs: Tensor, patch_size: int) -> Tensor:
    """(B, C, H, W) -> (B, L, p*p*C), MAE's and U-ViT's layout: column (pp*p + q)*C + c of patch
    (i, j) is ``imgs[b, c, i*p + pp, j*p + q]``."""
    p = patch_size
    B, C, H, W = imgs.shape
    x = imgs.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 3, 5, 1)
    return x.reshape(B, (H // p) * (W // p), p * p * C)


def unpatchify(x: Tensor, channels: int) -> Tensor:
    """(B, L, p*p*C) -> (B, C, H, W) on a square grid of patches, the inverse of :func:`patchify`."""
    B, L, P = x.shape
    p = math.isqrt(P // channels)
    h = math.isqrt(L)
    if h * h != L or p * p * channels != P:
        raise ValueError(f"cannot unpatchify {tuple(x.shape)} with {channels} channels: "
                         f"{L} patches of {P} values do not form a square grid of square patches")
    x = x.reshape(B, h, h, p, p, channels).permute(0, 5, 1, 3, 2, 4)
    return x.reshape(B, channels, h * p, h * p)
