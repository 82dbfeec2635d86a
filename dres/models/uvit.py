"""U-ViT (baofff/U-ViT, libs/uvit.py) with decayed identity shortcuts through the whole network.

Tokens ``[label?, time, patches]`` plus a learned position embedding; ``depth // 2`` in-blocks, one
mid block, ``depth // 2`` out-blocks; out-block j starts with ``Linear(2D -> D)(cat(stream, skip))``
where skip is the output of in-block ``depth//2 - 1 - j`` (the deepest first); then final LayerNorm,
``Linear(D -> p*p*C)``, unpatchify and a 3x3 convolution.

All ``2 * (2*(depth//2) + 1)`` residuals (attention and MLP of every block) decay, from the first
in-block to the last out-block (docs/design.md: U-ViT decays the whole network). The blocks run
as one :class:`~dres.nn.TransformerStack`; the skip Linear of an out-block is a stack hook that
replaces the stream (``alpha = 0``): its output is the out-block's stream, bf16 under bf16 autocast as in
the authors' code (the in-blocks' stream is float32).

Init follows U-ViT (trunc-normal 0.02 Linears and position embedding), plus zero-initialised branch
ends when ``alpha_min < 1``. ``gelu_approximate`` ("none": exact erf GELU, or "tanh") is every
block's MLP GELU. ``timesteps`` are whatever the noise schedule feeds (U-ViT's continuous
VP-SDE passes ``t * 999``); they go through the sinusoidal embedding of DDPM.
"""

from __future__ import annotations

import logging
import math
from typing import Optional

import torch
from torch import nn

from dres.models.vit import build_from_config
from dres.nn import (PatchEmbed, ResidualDroppath, TransformerStack, build_droppath, decay_schedule,
                     describe_schedule, droppath_scales)
from dres.ops.utils import unpatchify

log = logging.getLogger("dres")


def timestep_embedding(timesteps: torch.Tensor, dim: int, max_period: int = 10000) -> torch.Tensor:
    """Sinusoidal embedding (B,) -> (B, dim) float32: ``[cos(t f), sin(t f)]`` as in U-ViT."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=timesteps.device) / half)
    args = timesteps[:, None].float() * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
    return emb


class UViT(nn.Module):
    def __init__(self, img_size: int = 32, patch_size: int = 2, in_chans: int = 3, embed_dim: int = 512,
                 depth: int = 12, num_heads: int = 8, num_classes: int = 0, mlp_ratio: float = 4.0,
                 qkv_bias: bool = False, mlp_time_embed: bool = False, conv: bool = True,
                 alpha_min: float = 1.0, schedule: str = "linspace", per_block: bool = False,
                 drop_path: float = 0.0, droppath_mode: str = "drop_path",
                 droppath: Optional[ResidualDroppath] = None, droppath_seed: int = 0,
                 zero_init: Optional[bool] = None, backend: Optional[str] = None,
                 gelu_approximate: str = "none"):
        super().__init__()
        self.embed_dim, self.in_chans, self.num_classes = embed_dim, in_chans, num_classes
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        num_patches = self.patch_embed.num_patches
        self.time_embed = nn.Sequential(nn.Linear(embed_dim, 4 * embed_dim), nn.SiLU(),
                                        nn.Linear(4 * embed_dim, embed_dim)) if mlp_time_embed else nn.Identity()
        self.label_emb = nn.Embedding(num_classes, embed_dim) if num_classes > 0 else None
        self.extras = 2 if num_classes > 0 else 1  # [label?, time] before the patches
        self.pos_embed = nn.Parameter(torch.zeros(1, self.extras + num_patches, embed_dim))

        self.num_in_blocks = depth // 2
        num_blocks = 2 * self.num_in_blocks + 1  # in-blocks, mid block, out-blocks
        alphas = decay_schedule(2 * num_blocks, alpha_min, schedule, per_block)
        log.info(describe_schedule(alphas, schedule, alpha_min, per_block, "U-ViT"))
        self.transformer = TransformerStack(embed_dim, num_blocks, num_heads, mlp_ratio, qkv_bias, alphas,
                                            final_norm=True, backend=backend, gelu_approximate=gelu_approximate)
        self.skip_linears = nn.ModuleList(nn.Linear(2 * embed_dim, embed_dim) for _ in range(self.num_in_blocks))
        self.patch_dim = patch_size ** 2 * in_chans
        self.decoder_pred = nn.Linear(embed_dim, self.patch_dim)
        self.final_layer = nn.Conv2d(in_chans, in_chans, 3, padding=1) if conv else nn.Identity()
        self.droppath = build_droppath(droppath, drop_path, droppath_mode, 2 * num_blocks, droppath_seed)

        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if (alpha_min < 1.0) if zero_init is None else zero_init:
            self.transformer.zero_init_branch_ends()

    @property
    def num_blocks(self) -> int:
        return len(self.transformer.blocks)

    def skip_source(self, block: int) -> Optional[int]:
        """The in-block whose output enters ``block`` through a skip Linear (None: no skip)."""
        j = block - self.num_in_blocks - 1
        return self.num_in_blocks - 1 - j if 0 <= j < self.num_in_blocks else None

    def tokens(self, x: torch.Tensor, timesteps: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[label?, time, patches] + pos_embed``: (B, extras + N, D)."""
        patches = self.patch_embed(x)
        time = self.time_embed(timestep_embedding(timesteps, self.embed_dim)).unsqueeze(1)
        parts = [time, patches]
        if self.label_emb is not None:
            if y is None:
                raise ValueError("this U-ViT is class-conditional (num_classes > 0): pass labels y")
            parts.insert(0, self.label_emb(y).unsqueeze(1))
        elif y is not None:
            raise ValueError("this U-ViT is unconditional (num_classes = 0) but labels y were given")
        dtype = patches.dtype
        for p in parts:
            dtype = torch.promote_types(dtype, p.dtype)
        return torch.cat([p.to(dtype) for p in parts], dim=1) + self.pos_embed

    def parallel_units(self) -> list[nn.Module]:
        """The transformer blocks, each one torch.compile region, grouped into FSDP2 units (the skip
        Linears stay in the root)."""
        return self.transformer.parallel_units()

    def run_blocks(self, tokens: torch.Tensor, collect=()):
        hooks = {}
        for k in range(self.num_in_blocks + 1, self.num_blocks):
            j, src = k - self.num_in_blocks - 1, self.skip_source(k)
            hooks[k] = (lambda stream, outs, j=j, src=src:
                        (self.skip_linears[j](torch.cat([stream, outs[src]], dim=-1)), 0.0))
        collect = sorted(set(range(self.num_in_blocks)) | set(collect))
        return self.transformer.forward_intermediates(tokens, collect, droppath_scales(self.droppath, tokens), hooks)

    def forward(self, x: torch.Tensor, timesteps: torch.Tensor, y: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Prediction (noise, for noise-prediction training) of the same shape as ``x``."""
        out, _ = self.run_blocks(self.tokens(x, timesteps, y))
        out = self.decoder_pred(out)[:, self.extras:, :]
        return self.final_layer(unpatchify(out, self.in_chans))

    def features(self, x: torch.Tensor, timesteps: torch.Tensor, block: int, y: Optional[torch.Tensor] = None,
                 pool: str = "mean") -> torch.Tensor:
        """Features of the residual stream after ``block`` (0 .. num_blocks-1; in-blocks, mid, out-blocks):
        the mean over patch tokens (``pool="mean"``) or the time token (``pool="time"``), (B, D), at least float32."""
        return self.features_at(x, timesteps, [block], y, pool)[:, 0]

    def features_at(self, x: torch.Tensor, timesteps: torch.Tensor, blocks, y: Optional[torch.Tensor] = None,
                    pool: str = "mean") -> torch.Tensor:
        """:meth:`features` after each of ``blocks`` from one pass, (B, len(blocks), D)."""
        if pool not in ("mean", "time"):
            raise ValueError(f"pool must be 'mean' or 'time', got {pool!r}")
        for block in blocks:
            if not -self.num_blocks <= block < self.num_blocks:
                raise IndexError(f"block {block} out of range for {self.num_blocks} blocks")
        blocks = [block % self.num_blocks for block in blocks]
        _, outputs = self.run_blocks(self.tokens(x, timesteps, y), collect=blocks)
        pooled = []
        for block in blocks:
            h = outputs[block]
            h = h.to(torch.promote_types(h.dtype, torch.float32))  # an out-block's stream is bf16 under autocast
            pooled.append(h[:, self.extras:].mean(dim=1) if pool == "mean" else h[:, self.extras - 1])
        return torch.stack(pooled, dim=1)


UVIT_CONFIGS: dict[str, dict] = {
    # CIFAR-10/100 32x32 (U-ViT-S/2: 512 wide, 12 + mid blocks, 8 heads, patch 2; configs/cifar10_uvit.py)
    "uvit_small_2": dict(img_size=32, patch_size=2, embed_dim=512, depth=12, num_heads=8, qkv_bias=False),
    # 64x64 images or 64x64 latents (U-ViT-M/4: configs/imagenet64_uvit_mid.py; pass num_classes to condition)
    "uvit_mid": dict(img_size=64, patch_size=4, embed_dim=768, depth=16, num_heads=12, qkv_bias=False),
}


def create_uvit(name: str, **overrides) -> UViT:
    return build_from_config(UViT, UVIT_CONFIGS, "U-ViT", name, overrides)


def uvit_small_2(**overrides) -> UViT:
    return create_uvit("uvit_small_2", **overrides)


def uvit_mid(**overrides) -> UViT:
    return create_uvit("uvit_mid", **overrides)
