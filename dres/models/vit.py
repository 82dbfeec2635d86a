"""ViT encoder on the fused residual stream: patch embedding, class token, position embedding and a
:class:`~dres.nn.TransformerStack` with decayed shortcuts and optional (Residual)Droppath.

Both MAE's encoder and the supervised :class:`~dres.models.ViTClassifier` are built on it.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch
from torch import nn

from dres.nn import (PatchEmbed, ResidualDroppath, TransformerStack, build_droppath, decay_schedule,
                     describe_schedule, droppath_scales, init_vit_weights, sincos_2d)

log = logging.getLogger("dres")


class ViTEncoder(nn.Module):
    """Pre-LN ViT with ``x_{l+1} = alpha_l x_l + f_l(x_l)`` per sub-layer.

    alpha_min / schedule / per_block: the decay (:func:`dres.nn.decay_schedule`); alpha_min = 1 is a
        plain ViT.
    final_norm: a final LayerNorm (MAE's ``norm``); the official decayed-MAE encoder has none.
    pos_embed: ``"sincos"`` (fixed, MAE) or ``"learned"`` (timm, trunc-normal 0.02).
    drop_path / droppath_mode / droppath: a :class:`~dres.nn.ResidualDroppath` controller given, or
        built from the rate and mode (``"drop_path"``: timm; ``"residual_droppath"``: Park);
        exposed as ``self.droppath`` (None when the rate is 0).
    zero_init: zero the last Linear of every branch; None means ``alpha_min < 1``.
    backend: the :mod:`dres.ops` backend (None: its choice by device and size, docs/ops.md).
    gelu_approximate: every MLP's GELU, "none" (exact erf GELU) or "tanh" (``nn.GELU``'s ``approximate``).
    """

    def __init__(self, img_size: int = 224, patch_size: int = 16, in_chans: int = 3, embed_dim: int = 768,
                 depth: int = 12, num_heads: int = 12, mlp_ratio: float = 4.0, qkv_bias: bool = True,
                 alpha_min: float = 1.0, schedule: str = "linspace", per_block: bool = False,
                 final_norm: bool = True, pos_embed: str = "sincos", drop_path: float = 0.0,
                 droppath_mode: str = "drop_path", droppath: Optional[ResidualDroppath] = None,
                 droppath_seed: int = 0, zero_init: Optional[bool] = None,
                 backend: Optional[str] = None, gelu_approximate: str = "none"):
        super().__init__()
        self.embed_dim, self.depth = embed_dim, depth
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        num_patches = self.patch_embed.num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        if pos_embed == "sincos":
            self.register_buffer("pos_embed", sincos_2d(embed_dim, self.patch_embed.grid_size, cls_token=True)[None])
        elif pos_embed == "learned":
            self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, embed_dim))
        else:
            raise ValueError(f"pos_embed must be 'sincos' or 'learned', got {pos_embed!r}")
        alphas = decay_schedule(2 * depth, alpha_min, schedule, per_block)
        log.info(describe_schedule(alphas, schedule, alpha_min, per_block, "ViT encoder"))
        self.transformer = TransformerStack(embed_dim, depth, num_heads, mlp_ratio, qkv_bias, alphas,
                                            final_norm=final_norm, backend=backend, gelu_approximate=gelu_approximate)
        self.droppath = build_droppath(droppath, drop_path, droppath_mode, 2 * depth, droppath_seed)

        init_vit_weights(self)
        self.patch_embed.init_like_linear()
        nn.init.normal_(self.cls_token, std=0.02)
        if pos_embed == "learned":
            nn.init.trunc_normal_(self.pos_embed, std=0.02)
        if (alpha_min < 1.0) if zero_init is None else zero_init:
            self.transformer.zero_init_branch_ends()

    def embed(self, imgs: torch.Tensor, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Patch tokens plus their position embedding (no class token): (B, N, D), or (B, n, D) of the
        patches ``keep`` (B, n) names."""
        pos = self.pos_embed[:, 1:, :]
        if keep is None:
            return self.patch_embed(imgs) + pos
        pos = torch.gather(pos.expand(keep.shape[0], -1, -1), 1, keep.unsqueeze(-1).expand(-1, -1, pos.shape[-1]))
        return self.patch_embed(imgs, keep) + pos

    def add_cls(self, x: torch.Tensor) -> torch.Tensor:
        cls = (self.cls_token + self.pos_embed[:, :1, :]).expand(x.shape[0], -1, -1)
        return torch.cat((cls.to(x.dtype), x), dim=1)

    def parallel_units(self) -> list[nn.Module]:
        return self.transformer.parallel_units()

    def run_blocks(self, tokens: torch.Tensor, collect: Sequence[int] = (), hooks=None):
        """The stack on ``tokens`` (class token first): ``(y, {block: stream after it})``."""
        return self.transformer.forward_intermediates(tokens, collect, droppath_scales(self.droppath, tokens), hooks)

    def forward(self, imgs: torch.Tensor, collect: Sequence[int] = ()):
        """All patches (no masking): ``(y, outputs)`` as :meth:`TransformerStack.forward_intermediates`."""
        return self.run_blocks(self.add_cls(self.embed(imgs)), collect=collect)

    def layer_index(self, layer: int) -> int:
        if not -self.depth <= layer < self.depth:
            raise IndexError(f"layer {layer} out of range for an encoder of depth {self.depth}")
        return layer % self.depth

    def forward_features(self, imgs: torch.Tensor, layer: int = -1) -> dict[str, torch.Tensor]:
        """Class token and mean patch token of encoder block ``layer`` (no masking), for probes, and
        ``stream_mean``: the mean over all tokens, class token included, of the block's raw stream (the
        decayed-shortcut authors' ``forward_feat(x).mean(dim=1)``, never final-normed).

        Intermediate layers give the raw residual stream; the last layer gives the final-normed
        output when the encoder has a final norm (the raw stream otherwise).
        """
        k = self.layer_index(layer)
        tokens = self.add_cls(self.embed(imgs))
        y, outputs = self.run_blocks(tokens, collect=(k,))
        x = y if (k == self.depth - 1 and self.transformer.norm is not None) else outputs[k]
        return {"cls": x[:, 0], "mean": x[:, 1:].mean(dim=1), "stream_mean": outputs[k].mean(dim=1)}


def build_from_config(cls, configs: dict, kind: str, name: str, overrides: dict):
    """``cls(**configs[name], **overrides)``: the ``create_*`` functions of every model; an unknown
    ``name`` raises KeyError listing the known ones."""
    if name not in configs:
        raise KeyError(f"unknown {kind} config {name!r}; known: {sorted(configs)}")
    return cls(**{**configs[name], **overrides})
