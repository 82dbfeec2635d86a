"""The run's optimizer, built in one place from ``cfg.optim``.

* ``adamw`` (default): ``torch.optim.AdamW`` with ``optim.betas`` / ``optim.eps``, the MAE, U-ViT and
  ViT recipes.
* ``sgd``: what timm's ``create_optimizer_v2(opt="sgd")`` builds, the optimizer of timm's train.py
  defaults (the ResNet recipe the ResidualDroppath paper cites): ``torch.optim.SGD`` with Nesterov
  momentum ``optim.momentum`` and L2 weight decay added to the gradient, no dampening.

Both take the trainer's parameter groups as they are (no weight decay on 1-D tensors, tokens and
position embeddings: timm's ``weight_decay_exclude_1d`` for a ResNet). On CUDA ``optim.fused`` picks
the fused kernels; those read a learning rate held in a device tensor on the device, which is what
the whole-step CUDA graph (:mod:`dres.train.graph_step`) needs.
"""

from __future__ import annotations

import torch


def peak_lr(cfg) -> float:
    """``optim.lr``, or ``optim.blr`` scaled linearly by the global batch over 256 (MAE's and timm's
    ``lr_base`` convention)."""
    o = cfg.optim
    return o.lr if o.lr > 0 else o.blr * cfg.batch_size / 256


def build_optimizer(cfg, param_groups, device: torch.device, capturable: bool) -> torch.optim.Optimizer:
    """The optimizer ``cfg.optim.name`` names over ``param_groups`` (each with its ``weight_decay``) at
    :func:`peak_lr`; ``capturable``: the step will be captured in a CUDA graph (AdamW keeps its step
    count on the device; SGD has none, and its fused kernel needs nothing more)."""
    o = cfg.optim
    fused = o.fused and device.type == "cuda"
    if o.name == "adamw":
        return torch.optim.AdamW(param_groups, lr=peak_lr(cfg), betas=tuple(o.betas), eps=o.eps,
                                 **({"fused": True} if fused else {}),
                                 **({"capturable": True} if capturable else {}))
    if o.name == "sgd":
        # DTensor (FSDP2) has no sharding rule for the fused SGD kernel: foreach there
        fused = fused and cfg.dist != "fsdp"
        if capturable and not fused:  # graph_plan's rule: foreach SGD calls .item() on a tensor lr
            raise ValueError("a CUDA-graphed SGD step needs the fused kernel (optim.fused=true, CUDA, no FSDP2)")
        return torch.optim.SGD(param_groups, lr=peak_lr(cfg), momentum=o.momentum, nesterov=True,
                               **({"fused": True} if fused else {}))
    raise ValueError(f"optim.name must be one of adamw, sgd; got {o.name!r}")
