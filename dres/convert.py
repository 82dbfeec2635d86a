"""Convert a timm ``VisionTransformer`` in place to decayed, fused residuals, keeping its weights.

``convert_timm_vit(model, alpha_min, schedule)`` replaces ``model.blocks`` (an ``nn.Sequential`` of
timm ``Block``) by :class:`FusedTimmBlocks`, an ``nn.Sequential`` subclass holding the very same
block modules: parameters, their names and the ``state_dict`` are unchanged. Its forward carries the
residual stream through :mod:`dres.ops` like :class:`dres.nn.TransformerStack`: each block's
attention and MLP add (with the block's LayerScale and DropPath applied to the branch) is fused with
the next norm; the last add is a ``residual_add`` and the model's own ``norm`` follows as before.

Paths that call blocks one at a time (gradient checkpointing's ``checkpoint_seq``, attention masks,
``forward_intermediates``) get each block's decayed but unfused forward, so every path computes the
same function. With ``alpha_min = 1`` that function is the original model's.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch
from torch import nn

from dres import ops
from dres.nn.schedule import decay_schedule
from dres.nn.transformer import autocast_dtype

_BLOCK_PARTS = ("norm1", "attn", "norm2", "mlp")


def _branch_tail(blk: nn.Module, which: int):
    """LayerScale then DropPath of branch 1 or 2 (identity when the timm version lacks them)."""
    ls = getattr(blk, f"ls{which}", None) or nn.Identity()
    dp = getattr(blk, f"drop_path{which}", None) or getattr(blk, "drop_path", None) or nn.Identity()
    return lambda h: dp(ls(h))


def _decayed_block_forward(blk: nn.Module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A timm Block's forward with decayed shortcuts, unfused (for paths that call blocks one by one)."""
    a1, a2 = blk._dres_alphas
    x = a1 * x + _branch_tail(blk, 1)(blk.attn(blk.norm1(x), *args, **kwargs))
    return a2 * x + _branch_tail(blk, 2)(blk.mlp(blk.norm2(x)))


class FusedTimmBlocks(nn.Sequential):
    """timm ViT blocks run on the fused residual stream (same children, same state_dict keys)."""

    _dres_fused = True

    def __init__(self, blocks: Sequence[nn.Module], alphas: Sequence[float], backend: Optional[str] = None):
        super().__init__(*blocks)
        self.register_buffer("alphas", torch.tensor(list(alphas), dtype=torch.float32), persistent=False)
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        branch_dtype = autocast_dtype(x)
        residual_dtype = torch.float32 if branch_dtype is not None else None
        if branch_dtype is not None:
            x = x.float()
        blocks, be = list(self), self.backend
        first = blocks[0].norm1
        residual = x
        y = ops.layer_norm(x, first.weight, first.bias, eps=first.eps, out_dtype=branch_dtype, backend=be)
        for k, blk in enumerate(blocks):
            h = _branch_tail(blk, 1)(blk.attn(y))
            residual, y = ops.residual_layer_norm(residual, h, blk.norm2.weight, blk.norm2.bias,
                                                  alpha=self.alphas[2 * k], eps=blk.norm2.eps,
                                                  residual_dtype=residual_dtype, backend=be)
            h = _branch_tail(blk, 2)(blk.mlp(y))
            if k + 1 < len(blocks):
                nxt = blocks[k + 1].norm1
                residual, y = ops.residual_layer_norm(residual, h, nxt.weight, nxt.bias, alpha=self.alphas[2 * k + 1],
                                                      eps=nxt.eps, residual_dtype=residual_dtype, backend=be)
            else:
                residual = ops.residual_add(residual, h, alpha=self.alphas[2 * k + 1], residual_dtype=residual_dtype,
                                            backend=be)
        return residual


def _check_block(i: int, blk: nn.Module) -> None:
    missing = [p for p in _BLOCK_PARTS if not hasattr(blk, p)]
    if missing:
        raise TypeError(f"block {i} ({type(blk).__name__}) lacks {missing}: only pre-LN timm Blocks "
                        "(norm1, attn, norm2, mlp) can be converted")
    for name in ("norm1", "norm2"):
        norm = getattr(blk, name)
        if not isinstance(norm, nn.LayerNorm) or len(norm.normalized_shape) != 1:
            raise TypeError(f"block {i}.{name} is {type(norm).__name__}; the fused ops implement LayerNorm over "
                            "the last dimension only")


def convert_timm_vit(model: nn.Module, alpha_min: float = 1.0, schedule: str = "linspace", per_block: bool = False,
                     backend: Optional[str] = None) -> nn.Module:
    """Make ``model`` (a timm VisionTransformer) use decayed, fused residuals; returns the same object.

    alpha_min / schedule / per_block: as :func:`dres.nn.decay_schedule` over the ``2*depth`` residuals.
    Weights are not touched (no zero-initialisation: the model is presumably pretrained).
    """
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.Sequential) or len(blocks) == 0:
        raise TypeError(f"expected a timm VisionTransformer with an nn.Sequential `blocks`, got {type(model).__name__}")
    for i, blk in enumerate(blocks):
        _check_block(i, blk)
    # rounded to float32 as the kernels read them, so fused and block-by-block paths agree exactly
    alphas = torch.tensor(decay_schedule(2 * len(blocks), alpha_min, schedule, per_block), dtype=torch.float32).tolist()
    for i, blk in enumerate(blocks):
        blk._dres_alphas = (alphas[2 * i], alphas[2 * i + 1])
        blk.forward = functools.partial(_decayed_block_forward, blk)
    model.blocks = FusedTimmBlocks(list(blocks), alphas, backend)
    model.dres_alpha_min, model.dres_schedule = alpha_min, schedule
    return model
