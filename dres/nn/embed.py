"""Patch embedding and the fixed 2-D sin-cos position embedding of MAE (facebookresearch/mae)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


def image_patches(x: torch.Tensor, kh: int, kw: int) -> torch.Tensor:
    """(B, C, H, W) -> the (B, (H // kh) * (W // kw), C*kh*kw) non-overlapping patches, row-major over the grid,
    each in the (C, kh, kw) order of a flattened convolution kernel; rows and columns past the last whole patch
    dropped, as a stride-(kh, kw) convolution drops them."""
    B, C, H, W = x.shape
    gh, gw = H // kh, W // kw
    return (x[:, :, :gh * kh, :gw * kw].reshape(B, C, gh, kh, gw, kw).permute(0, 2, 4, 1, 3, 5)
            .reshape(B, gh * gw, C * kh * kw))


class PatchEmbed(nn.Module):
    """Image (B, C, H, W) to patch tokens (B, N, D): a stride-p convolution (timm's parameters), computed
    as one matmul over the flattened patches, of only the patches asked for (MAE's visible quarter)."""

    def __init__(self, img_size: int, patch_size: int, in_chans: int, embed_dim: int):
        super().__init__()
        if img_size % patch_size:
            raise ValueError(f"img_size {img_size} is not divisible by patch_size {patch_size}")
        self.img_size, self.patch_size = img_size, patch_size
        self.grid_size = img_size // patch_size
        self.num_patches = self.grid_size ** 2
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Tokens of every patch in row-major order, or with ``keep`` (B, n) of those patches only."""
        if x.shape[-2:] != (self.img_size, self.img_size):
            raise ValueError(f"expected images of {self.img_size}x{self.img_size}, got {tuple(x.shape[-2:])}")
        # a strided convolution is this matmul, without cuDNN's layout conversions of the image
        patches = image_patches(x, self.patch_size, self.patch_size)
        if keep is not None:
            patches = torch.gather(patches, 1, keep.unsqueeze(-1).expand(-1, -1, patches.shape[-1]))
        return F.linear(patches, self.proj.weight.flatten(1), self.proj.bias)

    def init_like_linear(self) -> None:
        """MAE initialises the patch projection like a Linear (xavier over the flattened kernel)."""
        w = self.proj.weight.data
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.zeros_(self.proj.bias)


def sincos_1d(embed_dim: int, pos: torch.Tensor) -> torch.Tensor:
    omega = torch.arange(embed_dim // 2, dtype=torch.float64) / (embed_dim / 2.0)
    omega = 1.0 / 10000 ** omega
    out = pos.reshape(-1).to(torch.float64)[:, None] * omega[None, :]
    return torch.cat([torch.sin(out), torch.cos(out)], dim=1)


def sincos_2d(embed_dim: int, grid_size: int, cls_token: bool = False) -> torch.Tensor:
    """(grid_size**2 [+1], embed_dim) float32, row-major over the patch grid; a zero row first for cls.

    Same values as MAE's numpy ``get_2d_sincos_pos_embed`` (first half encodes the column index).
    """
    if embed_dim % 4:
        raise ValueError(f"the 2-D sin-cos embedding needs embed_dim divisible by 4, got {embed_dim}")
    coords = torch.arange(grid_size, dtype=torch.float64)
    grid_w, grid_h = torch.meshgrid(coords, coords, indexing="xy")  # numpy's meshgrid(w, h)
    emb = torch.cat([sincos_1d(embed_dim // 2, grid_w), sincos_1d(embed_dim // 2, grid_h)], dim=1)
    if cls_token:
        emb = torch.cat([torch.zeros(1, embed_dim, dtype=torch.float64), emb], dim=0)
    return emb.float()
