"""Supervised ViT classifier (CIFAR-size by default) for decayed shortcuts and ResidualDroppath.

The :class:`~dres.models.ViTEncoder` with a final norm, then a Linear head on the class token
(``global_pool="cls"``) or on the mean patch token (``"avg"``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from dres.models.vit import ViTEncoder, build_from_config
from dres.nn import ResidualDroppath


class ViTClassifier(nn.Module):
    def __init__(self, img_size: int = 32, patch_size: int = 4, num_classes: int = 10, in_chans: int = 3,
                 embed_dim: int = 384, depth: int = 12, num_heads: int = 6, mlp_ratio: float = 4.0,
                 alpha_min: float = 1.0, schedule: str = "linspace", per_block: bool = False,
                 drop_path: float = 0.0, droppath_mode: str = "drop_path",
                 droppath: Optional[ResidualDroppath] = None, droppath_seed: int = 0, global_pool: str = "cls",
                 pos_embed: str = "learned", zero_init: Optional[bool] = None,
                 backend: Optional[str] = None, gelu_approximate: str = "none"):
        super().__init__()
        if global_pool not in ("cls", "avg"):
            raise ValueError(f"global_pool must be 'cls' or 'avg', got {global_pool!r}")
        self.global_pool = global_pool
        self.encoder = ViTEncoder(img_size, patch_size, in_chans, embed_dim, depth, num_heads, mlp_ratio,
                                  qkv_bias=True, alpha_min=alpha_min, schedule=schedule, per_block=per_block,
                                  final_norm=True, pos_embed=pos_embed, drop_path=drop_path,
                                  droppath_mode=droppath_mode, droppath=droppath, droppath_seed=droppath_seed,
                                  zero_init=zero_init, backend=backend, gelu_approximate=gelu_approximate)
        self.head = nn.Linear(embed_dim, num_classes)
        nn.init.trunc_normal_(self.head.weight, std=0.02)
        nn.init.zeros_(self.head.bias)

    @property
    def droppath(self) -> Optional[ResidualDroppath]:
        return self.encoder.droppath

    def parallel_units(self) -> list[nn.Module]:
        return self.encoder.parallel_units()

    def forward_features(self, imgs: torch.Tensor, layer: int = -1) -> dict[str, torch.Tensor]:
        return self.encoder.forward_features(imgs, layer)

    def pre_logits(self, imgs: torch.Tensor) -> torch.Tensor:
        """The head's input (B, embed_dim): the final-normed class token or mean patch token."""
        y, _ = self.encoder(imgs)
        return y[:, 0] if self.global_pool == "cls" else y[:, 1:].mean(dim=1)

    def forward(self, imgs: torch.Tensor) -> torch.Tensor:
        """Logits (B, num_classes)."""
        return self.head(self.pre_logits(imgs))


CLASSIFIER_CONFIGS: dict[str, dict] = {
    "vit_tiny_cifar": dict(img_size=32, patch_size=4, embed_dim=192, depth=12, num_heads=3),
    "vit_small_cifar": dict(img_size=32, patch_size=4, embed_dim=384, depth=12, num_heads=6),
}


def create_classifier(name: str, **overrides) -> ViTClassifier:
    return build_from_config(ViTClassifier, CLASSIFIER_CONFIGS, "classifier", name, overrides)
