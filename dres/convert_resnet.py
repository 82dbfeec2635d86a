"""Convert a timm ResNet / ResNet-D in place to the fused residual with decayed shortcuts and drop
path or ResidualDroppath, keeping its weights.

``convert_timm_resnet(model, alpha_min, schedule, drop_path, droppath_mode)`` gives every residual
block (timm ``BasicBlock`` or ``Bottleneck``, the downsample shortcut included: a strided 1x1 conv, or
ResNet-D's average pool + 1x1 conv) a forward that computes

    out = act(alpha_l * shortcut(x) + scale * branch(x))        one dres.ops.residual_act call

with ``alpha_l`` from :func:`dres.nn.decay_schedule` over the blocks (shallowest first; all ones at
``alpha_min=1``) and ``scale`` the block's per-sample (row_scale, grad_scale) pair from a
:class:`dres.nn.ResidualDroppath` controller (drop path: m/keep; ResidualDroppath: m on even
iterations, the plain value with gradient 1-m on odd ones), rates linear in depth over blocks as
timm's ``drop_path_rate``. The block modules, parameters and ``state_dict`` keys are unchanged (the
alphas are non-persistent buffers); with ``drop_path > 0`` the controller is attached as
``model.droppath`` (its state, the key ``droppath._extra_state``, travels with checkpoints) and the
iteration advances once per optimizer step (:mod:`dres.nn.droppath`).

With the defaults the converted model computes the same function as before (a timm ``DropPath``
the model was created with keeps acting on the branch). A final activation other than ReLU is
applied after the fused add (``act="identity"``).

The trainers' ResNet, :class:`dres.models.ResNetClassifier`, is a timm ResNet built and converted so.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
from torch import nn

from dres import ops
from dres.nn.droppath import HELD_MODE, ResidualDroppath, refuse_two_drop_paths
from dres.nn.schedule import decay_schedule
from dres.optional import import_optional


def _bottleneck_branch(blk: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """timm ``Bottleneck.forward`` up to the residual add (conv1-3, norms, acts, anti-aliasing, SE)."""
    x = blk.act1(blk.bn1(blk.conv1(x)))
    x = blk.aa(blk.act2(blk.drop_block(blk.bn2(blk.conv2(x)))))
    x = blk.bn3(blk.conv3(x))
    return x if blk.se is None else blk.se(x)


def _basic_branch(blk: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """timm ``BasicBlock.forward`` up to the residual add."""
    x = blk.aa(blk.act1(blk.drop_block(blk.bn1(blk.conv1(x)))))
    x = blk.bn2(blk.conv2(x))
    return x if blk.se is None else blk.se(x)


class _HeldBranch(nn.Module):
    """A block's branch as a module of its own, for ``torch.func.functional_call`` with the block's weights held."""

    def __init__(self, blk: nn.Module, branch: Callable):
        super().__init__()
        self.blk, self.branch = blk, branch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.branch(self.blk, x)


def _held_branch_gradient(held_branch: _HeldBranch, x: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """Zero in value; in gradient, ``held`` (per sample) times the branch's input gradient with its weights held:
    the branch runs again on detached parameters and on copies of its buffers (BatchNorm's running statistics
    advance once, in the trained pass; the batch statistics are the same, so is the value)."""
    state = {f"blk.{n}": p.detach() for n, p in held_branch.blk.named_parameters()}
    state |= {f"blk.{n}": b.clone() for n, b in held_branch.blk.named_buffers()}
    g = torch.func.functional_call(held_branch, state, (x,))
    return (g - g.detach()) * held.view(-1, *(1,) * (g.dim() - 1))


def _fused_block_forward(blk: nn.Module, branch: Callable, last_act: nn.Module, index: int,
                         droppath: Optional[ResidualDroppath], held_branch: Optional[_HeldBranch],
                         x: torch.Tensor) -> torch.Tensor:
    row_scale, grad_scale = (None, None) if droppath is None else droppath.scales(x.shape[0], x.device)[index]
    held = None if held_branch is None else droppath.held_scales(x.shape[0], x.device)[index]  # the frozen reading
    h = branch(blk, x)
    if blk.drop_path is not None:  # timm's own DropPath (model created with drop_path_rate > 0)
        h = blk.drop_path(h)
    shortcut = x if blk.downsample is None else blk.downsample(x)
    if held is not None:
        # added to the shortcut, whose gradient is alpha times the sum's: the branch's own share is grad_scale's
        shortcut = shortcut + _held_branch_gradient(held_branch, x, held) / blk.dres_alpha
    fused_relu = isinstance(last_act, nn.ReLU)
    out = ops.residual_act(shortcut, h, blk.dres_alpha, row_scale, grad_scale,
                           act="relu" if fused_relu else "identity", backend=blk.backend)
    return out if fused_relu else last_act(out)


def residual_blocks(model: nn.Module) -> list[nn.Module]:
    """The residual blocks of a timm ResNet, in execution order (layer1 .. layer4)."""
    return [blk for name in ("layer1", "layer2", "layer3", "layer4") for blk in getattr(model, name, ())]


def convert_timm_resnet(model: nn.Module, alpha_min: float = 1.0, schedule: str = "linspace", drop_path: float = 0.0,
                        droppath_mode: str = "drop_path", backend: Optional[str] = None,
                        droppath_seed: int = 0) -> nn.Module:
    """Make ``model`` (a timm ResNet or ResNet-D) use fused, decayed residuals; returns the same object.

    alpha_min / schedule: :func:`dres.nn.decay_schedule` over the blocks (one residual each).
    drop_path: the deepest block's drop rate (0: none, whatever the mode); droppath_mode: "drop_path"
    (timm, scaled by 1/keep), "residual_droppath" (Park), "residual_droppath_literal" or
    "residual_droppath_frozen" (:mod:`dres.nn.droppath`; the last runs each branch twice). backend: of
    :func:`dres.ops.residual_act` (``dres.nn.set_backend`` changes it later). Weights are not touched.
    """
    timm_resnet = import_optional("timm.models.resnet", "timm", "convert_timm_resnet")
    blocks = residual_blocks(model)
    if not blocks:
        raise TypeError(f"expected a timm ResNet with blocks in layer1..layer4, got {type(model).__name__}")
    branches = {timm_resnet.Bottleneck: (_bottleneck_branch, "act3"), timm_resnet.BasicBlock: (_basic_branch, "act2")}
    for i, blk in enumerate(blocks):
        if type(blk) not in branches:
            kind = type(blk)
            raise TypeError(f"block {i} is a {kind.__module__}.{kind.__qualname__}; only timm's "
                            "timm.models.resnet.BasicBlock and Bottleneck can be converted")
        if getattr(blk, "_dres_fused", False):
            raise ValueError(f"block {i} is already converted")
    refuse_two_drop_paths(drop_path, blocks, lambda blk: blk.drop_path is not None)
    droppath = (ResidualDroppath(drop_path, len(blocks), mode=droppath_mode, residuals_per_block=1, seed=droppath_seed)
                if drop_path > 0 else None)
    alphas = decay_schedule(len(blocks), alpha_min, schedule)
    if droppath is not None and droppath.mode == HELD_MODE and min(alphas) == 0:
        raise ValueError("droppath_mode residual_droppath_frozen passes the held branches' gradient through the "
                         "shortcut: it needs alpha_min > 0")
    for i, (blk, alpha) in enumerate(zip(blocks, alphas)):
        branch, last_act = branches[type(blk)]
        blk.dres_alpha = float(alpha)  # a number: at 1 with no drop path the eager op is PyTorch's add and ReLU
        blk.backend = backend
        blk._dres_fused = True  # dres.nn.set_backend finds the block by this
        # the held branch lives in the partial, not in the block: no second path to the block's parameters
        held_branch = _HeldBranch(blk, branch) if droppath is not None and droppath.mode == HELD_MODE else None
        blk.forward = functools.partial(_fused_block_forward, blk, branch, getattr(blk, last_act), i, droppath,
                                        held_branch)
    if droppath is not None:
        model.droppath = droppath.to(next(model.parameters()).device)
    return model
