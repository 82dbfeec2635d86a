"""dres.models: ViT encoder, MAE (baseline / official / paper), U-ViT and a ViT classifier, all on the
fused residual stream of :mod:`dres.nn`, and a timm ResNet classifier converted to it."""

from dres.models.classifier import CLASSIFIER_CONFIGS, ViTClassifier, create_classifier
from dres.models.mae import (MAE, MAE_CONFIGS, create_mae, mae_vit_base_patch16, mae_vit_huge_patch14,
                             mae_vit_large_patch16, mae_vit_small_cifar, mae_vit_small_patch16, mae_vit_tiny_cifar)
from dres.models.resnet import RESNET_ARCHS, ResNetClassifier
from dres.models.uvit import UVIT_CONFIGS, UViT, create_uvit, uvit_mid, uvit_small_2
from dres.models.vit import ViTEncoder

__all__ = [
    "ViTEncoder", "MAE", "MAE_CONFIGS", "create_mae", "mae_vit_small_patch16", "mae_vit_base_patch16",
    "mae_vit_large_patch16", "mae_vit_huge_patch14", "mae_vit_tiny_cifar", "mae_vit_small_cifar", "UViT", "UVIT_CONFIGS", "create_uvit",
    "uvit_small_2", "uvit_mid", "ViTClassifier", "CLASSIFIER_CONFIGS", "create_classifier",
    "ResNetClassifier", "RESNET_ARCHS",
]
