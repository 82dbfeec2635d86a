"""Masked autoencoder (facebookresearch/mae) with decayed identity shortcuts in the encoder.

Variants (docs/design.md, "Models"):

* ``baseline``: the original MAE. The decoder embeds the encoder's (normed) output, appends mask
  tokens, unshuffles, adds its position embedding.
* ``official``: the decayed-shortcut authors' code (xiao7199/decayed_Identity_shortcuts, MAE/models_mae.py).
  The encoder has no final norm; the outputs of encoder blocks 1, 3, 5, ... are skips. The decoder
  starts from ``decoder_embed(cat(decoder_cls_token, decoder_pos_embed[1:]))`` (no direct encoder
  output), and before decoder block k the k-th deepest skip enters through a :class:`SkipLayer`:
  stream += Linear(SiLU(Linear(cat(scatter(skip), stream)))), the last Linear zero-initialised.
  When there are more skips than decoder blocks (ViT-L: 12 skips, 8 decoder blocks) only the
  deepest ``decoder_depth`` skips are used (the official code builds unused layers; we do not).
  ``decoder_pred`` is zero-initialised, as there.
* ``paper``: the paper's text. The baseline decoder input, and before decoder block k the k-th
  deepest skip (every other encoder block), scattered among its own mask tokens, is concatenated
  channel-wise with the stream and projected back, ``stream = Linear(cat(stream, skip))`` (U-ViT's
  long-skip form); under bf16 autocast that Linear's bf16 output is the decoder block's stream, as plain
  PyTorch code carries it.

Decay applies to the encoder only; decoder residuals keep alpha = 1. With ``alpha_min < 1`` (or
``zero_init=True``) the last Linear of every branch, encoder and decoder, starts at zero.
``gelu_approximate`` ("none": exact erf GELU, or "tanh") is the GELU of every MLP, encoder and decoder.

``forward(imgs, mask_ratio=None, noise=None) -> (loss, pred, mask)``: loss is the (norm-pix) MSE on
masked patches, pred ``(B, N, p*p*C)``, mask ``(B, N)`` with 1 = masked. The loss runs as one fused
kernel reading the image directly (:func:`dres.ops.mae_loss`) outside torch.compile, and as the
unfused formula, which Inductor fuses itself, inside it (``fused_loss`` forces either).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from dres import ops
from dres.models.vit import ViTEncoder, build_from_config
from dres.nn import ResidualDroppath, TransformerStack, init_vit_weights, sincos_2d
from dres.ops.reference import mae_loss as mae_loss_reference
from dres.ops.utils import patchify, unpatchify

VARIANTS = ("baseline", "official", "paper")


def unshuffle_with_mask_tokens(x: torch.Tensor, mask_token: torch.Tensor, ids_restore: torch.Tensor) -> torch.Tensor:
    """Visible tokens ``x`` (B, 1 + n_visible, C; class token first) back in patch order with
    ``mask_token`` at the masked positions: (B, 1 + N, C)."""
    B, _, C = x.shape
    n_masked = ids_restore.shape[1] + 1 - x.shape[1]
    patches = torch.cat([x[:, 1:, :], mask_token.to(x.dtype).expand(B, n_masked, C)], dim=1)
    patches = torch.gather(patches, 1, ids_restore.unsqueeze(-1).expand(-1, -1, C))
    return torch.cat([x[:, :1, :], patches], dim=1)


def linear_of_skip_and_stream(skip: torch.Tensor, mask_token: torch.Tensor, ids_restore: torch.Tensor,
                              stream: torch.Tensor, linear: nn.Linear, skip_first: bool) -> torch.Tensor:
    """``linear(cat(unshuffle(skip), stream))`` (``cat(stream, unshuffle(skip))`` unless ``skip_first``)
    without building the concatenation: a Linear acts per token, so the skip's columns of its weight
    project the visible tokens (and the mask token) first, and the unshuffle moves those projections.
    The same function as the authors' code with ``1 - mask_ratio`` of the skip's rows and no
    (tokens x (skip + stream)) tensor."""
    skip_dim = skip.shape[-1]
    if skip_first:
        w_skip, w_stream = linear.weight[:, :skip_dim], linear.weight[:, skip_dim:]
    else:
        w_stream, w_skip = linear.weight[:, :-skip_dim], linear.weight[:, -skip_dim:]
    scattered = unshuffle_with_mask_tokens(F.linear(skip, w_skip), F.linear(mask_token, w_skip), ids_restore)
    return scattered + F.linear(stream, w_stream, linear.bias)


class SkipLayer(nn.Module):
    """Official-variant skip: a branch ``fc(cat(scatter(skip), stream))`` added to the decoder stream."""

    def __init__(self, decoder_dim: int, skip_dim: int):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(skip_dim + decoder_dim, decoder_dim), nn.SiLU(),
                                nn.Linear(decoder_dim, decoder_dim))
        self.mask_token = nn.Parameter(torch.randn(1, 1, skip_dim) * 0.02)

    def forward(self, stream: torch.Tensor, skip: torch.Tensor, ids_restore: torch.Tensor) -> torch.Tensor:
        h = linear_of_skip_and_stream(skip, self.mask_token, ids_restore, stream, self.fc[0], skip_first=True)
        return self.fc[2](self.fc[1](h))


class PaperSkip(nn.Module):
    """Paper-variant skip: the new stream ``Linear(cat(stream, scatter(skip)))``."""

    def __init__(self, decoder_dim: int, skip_dim: int):
        super().__init__()
        self.linear = nn.Linear(decoder_dim + skip_dim, decoder_dim)
        self.mask_token = nn.Parameter(torch.randn(1, 1, skip_dim) * 0.02)

    def forward(self, stream: torch.Tensor, skip: torch.Tensor, ids_restore: torch.Tensor) -> torch.Tensor:
        return linear_of_skip_and_stream(skip, self.mask_token, ids_restore, stream, self.linear, skip_first=False)


class MAE(nn.Module):
    def __init__(self, variant: str = "baseline", img_size: int = 224, patch_size: int = 16, in_chans: int = 3,
                 embed_dim: int = 1024, depth: int = 24, num_heads: int = 16, decoder_embed_dim: int = 512,
                 decoder_depth: int = 8, decoder_num_heads: int = 16, mlp_ratio: float = 4.0,
                 norm_pix_loss: bool = True, mask_ratio: float = 0.75, alpha_min: float = 1.0,
                 schedule: str = "linspace", per_block: bool = False, drop_path: float = 0.0,
                 droppath_mode: str = "drop_path", droppath: Optional[ResidualDroppath] = None,
                 droppath_seed: int = 0, zero_init: Optional[bool] = None,
                 backend: Optional[str] = None, gelu_approximate: str = "none"):
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        zero_init = alpha_min < 1.0 if zero_init is None else zero_init
        self.variant, self.in_chans, self.patch_size = variant, in_chans, patch_size
        self.norm_pix_loss, self.mask_ratio = norm_pix_loss, mask_ratio
        self.fused_loss: Optional[bool] = None  # None: the fused loss kernel outside torch.compile

        # encoder (decayed); the official variant's encoder has no final norm
        self.encoder = ViTEncoder(img_size, patch_size, in_chans, embed_dim, depth, num_heads, mlp_ratio,
                                  qkv_bias=True, alpha_min=alpha_min, schedule=schedule, per_block=per_block,
                                  final_norm=variant != "official", pos_embed="sincos", drop_path=drop_path,
                                  droppath_mode=droppath_mode, droppath=droppath, droppath_seed=droppath_seed,
                                  zero_init=zero_init, backend=backend, gelu_approximate=gelu_approximate)

        # skips: encoder blocks 1, 3, 5, ...; decoder block k takes the k-th deepest
        if variant == "baseline":
            self.skip_blocks: list[int] = []
        else:
            self.skip_blocks = list(range(1, depth, 2))[::-1][:decoder_depth]

        # decoder (alpha = 1)
        if variant == "official":
            self.decoder_cls_token = nn.Parameter(torch.zeros(1, 1, decoder_embed_dim))
            self.decoder_embed = nn.Linear(decoder_embed_dim, decoder_embed_dim)
        else:
            self.mask_token = nn.Parameter(torch.zeros(1, 1, decoder_embed_dim))
            self.decoder_embed = nn.Linear(embed_dim, decoder_embed_dim)
        self.register_buffer("decoder_pos_embed",
                             sincos_2d(decoder_embed_dim, self.encoder.patch_embed.grid_size, cls_token=True)[None])
        self.decoder = TransformerStack(decoder_embed_dim, decoder_depth, decoder_num_heads, mlp_ratio,
                                        qkv_bias=True, final_norm=True, backend=backend,
                                        gelu_approximate=gelu_approximate)
        self.decoder_pred = nn.Linear(decoder_embed_dim, patch_size ** 2 * in_chans)
        skip_cls = {"official": SkipLayer, "paper": PaperSkip}.get(variant)
        self.skips = nn.ModuleList(skip_cls(decoder_embed_dim, embed_dim) for _ in self.skip_blocks) \
            if skip_cls else nn.ModuleList()

        # init (encoder initialised itself): xavier Linears, then the zero-initialised ends
        init_vit_weights(self.decoder_embed)
        init_vit_weights(self.decoder)
        init_vit_weights(self.decoder_pred)
        for s in self.skips:
            init_vit_weights(s)
        if variant == "official":
            nn.init.normal_(self.decoder_cls_token, std=0.02)
            nn.init.zeros_(self.decoder_pred.weight)
            for s in self.skips:
                nn.init.zeros_(s.fc[-1].weight)
        else:
            nn.init.normal_(self.mask_token, std=0.02)
        if zero_init:
            self.decoder.zero_init_branch_ends()

    @property
    def droppath(self) -> Optional[ResidualDroppath]:
        return self.encoder.droppath

    def parallel_units(self) -> list[nn.Module]:
        """Encoder blocks, then decoder blocks (execution order): what FSDP2 groups into units,
        activation checkpointing wraps and (with the skip layers, :meth:`compile_units`) compile compiles."""
        return self.encoder.parallel_units() + self.decoder.parallel_units()

    def compile_units(self) -> list[nn.Module]:
        """The blocks and the decoder's skip layers, each one torch.compile region (a skip layer's
        unshuffle, adds and SiLU are memory-bound work that Inductor fuses around its matmuls)."""
        return self.parallel_units() + list(self.skips)

    # ------------------------------------------------------------------------------------------
    def patchify(self, imgs: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, N, p*p*C), MAE's layout."""
        return patchify(imgs, self.patch_size)

    def unpatchify(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, p*p*C) -> (B, C, H, W)."""
        return unpatchify(x, self.in_chans)

    @staticmethod
    def random_masking(batch: int, num_patches: int, mask_ratio: float, device: torch.device,
                       noise: Optional[torch.Tensor] = None):
        """Per-sample random masking by argsort of uniform noise (MAE's); returns (ids_keep, mask,
        ids_restore): the kept patches' indices, mask (B, N) with 1 = masked, the unshuffling order."""
        len_keep = int(num_patches * (1 - mask_ratio))
        if noise is None:
            noise = torch.rand(batch, num_patches, device=device)
        ids_shuffle = torch.argsort(noise, dim=1)  # small noise is kept
        ids_restore = torch.argsort(ids_shuffle, dim=1)
        mask = torch.ones(batch, num_patches, device=device)
        mask[:, :len_keep] = 0
        mask = torch.gather(mask, 1, ids_restore)
        return ids_shuffle[:, :len_keep], mask, ids_restore

    # ------------------------------------------------------------------------------------------
    def forward_encoder(self, imgs: torch.Tensor, mask_ratio: float, noise: Optional[torch.Tensor] = None):
        ids_keep, mask, ids_restore = self.random_masking(imgs.shape[0], self.encoder.patch_embed.num_patches,
                                                          mask_ratio, imgs.device, noise)
        x = self.encoder.embed(imgs, ids_keep)  # only the kept patches are embedded
        latent, skips = self.encoder.run_blocks(self.encoder.add_cls(x), collect=self.skip_blocks)
        return latent, mask, ids_restore, skips

    def forward_decoder(self, latent: torch.Tensor, ids_restore: torch.Tensor, skips: dict) -> torch.Tensor:
        if self.variant == "official":
            # decoder_embed(cat(cls, pos)) embedded per part: the class token's gradient is then a tensor of
            # its own, not a strided slice of the cat's (which DDP's gradient buckets warn about)
            start = [self.decoder_embed(self.decoder_cls_token), self.decoder_embed(self.decoder_pos_embed[:, 1:])]
            x = torch.cat(start, dim=1).expand(latent.shape[0], -1, -1)
        else:
            x = unshuffle_with_mask_tokens(self.decoder_embed(latent), self.mask_token, ids_restore)
            x = x + self.decoder_pos_embed
        # official: stream + branch (a = 1); paper: the stream is replaced (a = 0)
        a = 1.0 if self.variant == "official" else 0.0
        hooks = {k: (lambda stream, _, k=k, b=b: (self.skips[k](stream, skips[b], ids_restore), a))
                 for k, b in enumerate(self.skip_blocks)}
        y = self.decoder(x, hooks=hooks)
        return self.decoder_pred(y)[:, 1:, :]

    def forward_loss(self, imgs: torch.Tensor, pred: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The (norm-pix) MSE on masked patches, in at least fp32 whatever pred's dtype."""
        fused = (not torch.compiler.is_compiling()) if self.fused_loss is None else self.fused_loss
        if fused:
            return ops.mae_loss(pred, imgs, mask, self.patch_size, self.norm_pix_loss,
                                backend=self.encoder.transformer.backend)
        return mae_loss_reference(pred, imgs, mask, self.patch_size, self.norm_pix_loss)

    def forward(self, imgs: torch.Tensor, mask_ratio: Optional[float] = None, noise: Optional[torch.Tensor] = None):
        """``(loss, pred, mask)``; ``noise`` (B, N) fixes the masking (argsort order) when given."""
        mask_ratio = self.mask_ratio if mask_ratio is None else mask_ratio
        latent, mask, ids_restore, skips = self.forward_encoder(imgs, mask_ratio, noise)
        pred = self.forward_decoder(latent, ids_restore, skips)
        return self.forward_loss(imgs, pred, mask), pred, mask

    def forward_features(self, imgs: torch.Tensor, layer: int = -1) -> dict[str, torch.Tensor]:
        """``{'cls', 'mean'}`` tokens of encoder block ``layer`` on all patches (no masking)."""
        return self.encoder.forward_features(imgs, layer)


# ----------------------------------------------------------------------------------------------
# Configs: decoder 512-dim, 8 blocks, 16 heads (MAE) for ImageNet sizes; smaller ones for 32x32.

MAE_CONFIGS: dict[str, dict] = {
    "mae_vit_small_patch16": dict(img_size=224, patch_size=16, embed_dim=384, depth=12, num_heads=6,
                                  decoder_embed_dim=512, decoder_depth=8, decoder_num_heads=16),
    "mae_vit_base_patch16": dict(img_size=224, patch_size=16, embed_dim=768, depth=12, num_heads=12,
                                 decoder_embed_dim=512, decoder_depth=8, decoder_num_heads=16),
    "mae_vit_large_patch16": dict(img_size=224, patch_size=16, embed_dim=1024, depth=24, num_heads=16,
                                  decoder_embed_dim=512, decoder_depth=8, decoder_num_heads=16),
    "mae_vit_huge_patch14": dict(img_size=224, patch_size=14, embed_dim=1280, depth=32, num_heads=16,
                                 decoder_embed_dim=512, decoder_depth=8, decoder_num_heads=16),
    # 32x32 images (CIFAR): 256 patches of 2x2, or 64 of 4x4
    "mae_vit_tiny_cifar": dict(img_size=32, patch_size=2, embed_dim=192, depth=12, num_heads=3,
                               decoder_embed_dim=128, decoder_depth=8, decoder_num_heads=4),
    "mae_vit_small_cifar": dict(img_size=32, patch_size=4, embed_dim=384, depth=12, num_heads=6,
                                decoder_embed_dim=256, decoder_depth=8, decoder_num_heads=8),
}


def create_mae(name: str, **overrides) -> MAE:
    """``MAE(**MAE_CONFIGS[name], **overrides)``, e.g. ``create_mae("mae_vit_base_patch16", variant="official", alpha_min=0.6)``."""
    return build_from_config(MAE, MAE_CONFIGS, "MAE", name, overrides)


def mae_vit_small_patch16(**overrides) -> MAE:
    return create_mae("mae_vit_small_patch16", **overrides)


def mae_vit_base_patch16(**overrides) -> MAE:
    return create_mae("mae_vit_base_patch16", **overrides)


def mae_vit_large_patch16(**overrides) -> MAE:
    return create_mae("mae_vit_large_patch16", **overrides)


def mae_vit_huge_patch14(**overrides) -> MAE:
    return create_mae("mae_vit_huge_patch14", **overrides)


def mae_vit_tiny_cifar(**overrides) -> MAE:
    return create_mae("mae_vit_tiny_cifar", **overrides)


def mae_vit_small_cifar(**overrides) -> MAE:
    return create_mae("mae_vit_small_cifar", **overrides)
