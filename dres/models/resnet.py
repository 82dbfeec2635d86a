"""The trainers' ResNet: a timm ResNet built and converted in place by :func:`dres.convert_resnet.convert_timm_resnet`
(decayed shortcuts, drop path or ResidualDroppath, one fused residual op per block)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from dres.convert_resnet import convert_timm_resnet, residual_blocks
from dres.nn.droppath import ResidualDroppath
from dres.optional import import_optional


RESNET_ARCHS = ("resnet18", "resnet50", "resnet50d")


class ResNetClassifier(nn.Module):
    """A timm ResNet (``arch``) on the fused residual of :func:`convert_timm_resnet`: decayed
    shortcuts, drop path or ResidualDroppath (``model.droppath``). timm's own architecture and
    initialisation are kept, ImageNet stem included (the RDP paper trains timm's models on CIFAR as
    they are); weights and activations are channels_last, the fast layout for convolutions.
    """

    def __init__(self, arch: str = "resnet50d", num_classes: int = 10, in_chans: int = 3, alpha_min: float = 1.0,
                 schedule: str = "linspace", drop_path: float = 0.0, droppath_mode: str = "drop_path",
                 droppath_seed: int = 0, zero_init: Optional[bool] = None, backend: Optional[str] = None,
                 drop_rate: float = 0.0):
        super().__init__()
        if arch not in RESNET_ARCHS:
            raise ValueError(f"arch must be one of {RESNET_ARCHS}, got {arch!r}")
        timm = import_optional("timm", "timm", f"the {arch} classifier (a timm ResNet)")
        # zero_init: timm's zero_init_last (the last BN of every block at zero); None keeps timm's default
        extra = {} if zero_init is None else {"zero_init_last": zero_init}
        # drop_rate: timm's dropout before the classifier (its train.py --drop)
        self.net = timm.create_model(arch, pretrained=False, num_classes=num_classes, in_chans=in_chans,
                                     drop_rate=drop_rate, **extra)
        convert_timm_resnet(self.net, alpha_min, schedule, drop_path, droppath_mode, backend, droppath_seed)
        self.net.to(memory_format=torch.channels_last)

    @property
    def droppath(self) -> Optional[ResidualDroppath]:
        return getattr(self.net, "droppath", None)

    # Blocks of every stage share one forward, so torch's automatic dynamic shapes would make the
    # second stage's sizes symbolic, which Inductor's BatchNorm backward fails on (torch 2.14,
    # tests/test_convert_resnet.py): each stage compiles for its own static shapes instead.
    compile_dynamic = False

    def parallel_units(self) -> list[nn.Module]:
        return residual_blocks(self.net)

    def pre_logits(self, imgs: torch.Tensor) -> torch.Tensor:
        """The head's input (B, num_features): the globally pooled last feature map."""
        x = self.net.forward_features(imgs.contiguous(memory_format=torch.channels_last))
        return self.net.forward_head(x, pre_logits=True)

    def forward(self, imgs: torch.Tensor) -> torch.Tensor:
        """Logits (B, num_classes)."""
        return self.net(imgs.contiguous(memory_format=torch.channels_last))
