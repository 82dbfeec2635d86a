"""The run's optimizer, built in one place from ``cfg.optim``.

* ``adamw`` (default): ``torch.optim.AdamW`` with ``optim.betas`` / ``optim.eps``, the MAE, U-ViT and
  ViT recipes.
* ``sgd``: what timm's ``create_optimizer_v2(opt="sgd")`` builds, the optimizer of timm's train.py
  defaults (the ResNet recipe the ResidualDroppath paper cites): ``torch.optim.SGD`` with Nesterov
  momentum ``optim.momentum`` and L2 weight decay added to the gradient, no dampening.

Both take the trainer's parameter groups as they are (no weight decay on 1-D tensors, tokens and
position embeddings: timm's ``weight_decay_exclude_1d`` for a ResNet). On CUDA ``optim.fused`` picks
the fused kernels; those read a learning rate held in a device tensor on the device, which is what
the whole-step CUDA graph (:mod:`dres.train.step`) needs.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn


def peak_lr(cfg) -> float:
    """``optim.lr``, or ``optim.blr`` scaled linearly by the global batch over 256 (MAE's and timm's
    ``lr_base`` convention)."""
    o = cfg.optim
    return o.lr if o.lr > 0 else o.blr * cfg.batch_size / 256


def uses_fused_kernel(cfg, device: torch.device) -> bool:
    """Whether the optimizer runs its fused CUDA kernel: asked for (``optim.fused``), on CUDA, and for SGD
    not on FSDP2's DTensors (the fused SGD kernel has no sharding rule for them)."""
    o = cfg.optim
    return o.fused and device.type == "cuda" and not (o.name == "sgd" and cfg.dist == "fsdp")


def capture_blocker(cfg, device: torch.device, precision: str) -> Optional[str]:
    """Why this optimizer's step cannot be captured in a CUDA graph, or None."""
    if uses_fused_kernel(cfg, device):
        return None
    if cfg.optim.name == "sgd":
        return "SGD reads a device learning rate only in its fused kernel (foreach SGD calls .item() on it)"
    if precision == "fp16":
        return "fp16 loss scaling skips overflowed steps without a host sync only with the fused AdamW"
    return None


def build_optimizer(cfg, param_groups, device: torch.device, precision: str, capturable: bool) -> torch.optim.Optimizer:
    """The optimizer ``cfg.optim.name`` names over ``param_groups`` (each with its ``weight_decay``) at
    :func:`peak_lr`; ``capturable``: the step will be captured in a CUDA graph (AdamW keeps its step
    count on the device; SGD has none, and its fused kernel needs nothing more), refused where
    :func:`capture_blocker` says at ``precision`` that it cannot be."""
    o = cfg.optim
    if capturable and (why := capture_blocker(cfg, device, precision)) is not None:  # graph_plan refuses it first
        raise ValueError(why)
    fused = uses_fused_kernel(cfg, device)
    if o.name == "adamw":
        return torch.optim.AdamW(param_groups, lr=peak_lr(cfg), betas=tuple(o.betas), eps=o.eps,
                                 **({"fused": True} if fused else {}),
                                 **({"capturable": True} if capturable else {}))
    if o.name == "sgd":
        return torch.optim.SGD(param_groups, lr=peak_lr(cfg), momentum=o.momentum, nesterov=True,
                               **({"fused": True} if fused else {}))
    raise ValueError(f"optim.name must be one of adamw, sgd; got {o.name!r}")


def param_groups(model: nn.Module, weight_decay: float):
    """AdamW groups: no weight decay on biases, norms (all 1-D tensors), tokens and position
    embeddings (MAE / timm convention)."""
    decay, no_decay, names = [], [], []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        leaf = n.split(".")[-1]
        if p.ndim < 2 or "token" in leaf or "pos_embed" in leaf or leaf in ("cls", "pos", "alpha"):
            no_decay.append(p)
            names.append(n)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}], names


def lr_lambda(total: int, warmup: int, schedule: str, min_ratio: float):
    """Per-iteration factor of the peak lr: linear warmup, then half-cycle cosine to ``min_ratio``
    (MAE) or constant (U-ViT)."""

    def f(step):
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        t = (step - warmup) / max(1, total - warmup)
        return min_ratio + (1 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(t, 1.0)))

    return f


def build_schedule(cfg, optimizer: torch.optim.Optimizer, total_steps: int, epoch_steps: int):
    """The LR schedule of a run of ``total_steps`` (``epoch_steps`` a data epoch, for ``optim.warmup_epochs``) and
    its warm-up steps: :func:`lr_lambda` of :func:`peak_lr` (``optim.min_lr`` its floor)."""
    o, lr = cfg.optim, peak_lr(cfg)
    warmup = o.warmup_steps if o.warmup_steps >= 0 else int(round(o.warmup_epochs * epoch_steps))
    warmup = min(warmup, total_steps)
    schedule = lr_lambda(total_steps, warmup, o.schedule, o.min_lr / lr if lr else 0)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule), warmup

