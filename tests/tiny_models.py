"""The tests' tiny models (8x8 images, two blocks 32 wide), built from the model classes with these settings;
``overrides`` replace or add constructor arguments, as ``dres.models.create_*`` take them."""

from __future__ import annotations

from dres.models import MAE, UViT, ViTClassifier

TINY_MAE = dict(img_size=8, patch_size=4, embed_dim=32, depth=2, num_heads=2, decoder_embed_dim=32, decoder_depth=2,
                decoder_num_heads=2)
TINY_UVIT = dict(img_size=8, patch_size=2, embed_dim=32, depth=2, num_heads=2, qkv_bias=False)
TINY_CLASSIFIER = dict(img_size=8, patch_size=4, embed_dim=32, depth=2, num_heads=2)


def tiny_mae(**overrides) -> MAE:
    return MAE(**{**TINY_MAE, **overrides})


def tiny_uvit(**overrides) -> UViT:
    return UViT(**{**TINY_UVIT, **overrides})


def tiny_classifier(**overrides) -> ViTClassifier:
    return ViTClassifier(**{**TINY_CLASSIFIER, **overrides})
