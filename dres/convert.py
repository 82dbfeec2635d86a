"""Convert a timm ``VisionTransformer`` in place to decayed, fused residuals, keeping its weights.

``convert_timm_vit(model, alpha_min, schedule)`` replaces ``model.blocks`` (an ``nn.Sequential`` of
timm ``Block``) by :class:`FusedTimmBlocks`, an ``nn.Sequential`` subclass holding the very same
block modules: parameters, their names and the ``state_dict`` are unchanged. Its forward is the
residual-stream loop of :class:`dres.nn.TransformerStack` (:class:`dres.nn.transformer.ResidualStream`):
each block's attention and MLP add (with the block's LayerScale and DropPath applied to the branch)
is fused with the next norm; the last add is a ``residual_add`` and the model's own ``norm`` follows.

Paths that call blocks one at a time (gradient checkpointing's ``checkpoint_seq``, attention masks,
``forward_intermediates``) get each block's decayed but unfused forward, so every path computes the
same function. With ``alpha_min = 1`` that function is the original model's.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch
from torch import nn

from dres.nn.schedule import decay_schedule
from dres.nn.transformer import ResidualStream, add_and_norm

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


def _fused_block_forward(blk: nn.Module, hidden_states: torch.Tensor, residual: Optional[torch.Tensor],
                         scales=None, *, backend: Optional[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """A timm Block in the fused-residual form of :meth:`dres.nn.Block.forward`. ``scales`` (from the
    shared loop) are all None here: the block's own DropPath modules drop its branches."""
    entering, y = add_and_norm(hidden_states, residual, blk.norm1, blk.alphas[0], backend=backend)
    residual, y = add_and_norm(_branch_tail(blk, 1)(blk.attn(y)), entering, blk.norm2, blk.alphas[1], backend=backend)
    return _branch_tail(blk, 2)(blk.mlp(y)), residual


class FusedTimmBlocks(ResidualStream, nn.Sequential):
    """timm ViT blocks run on the fused residual stream (same children, same state_dict keys): each
    block gets the non-persistent ``alphas`` buffer of a :class:`dres.nn.Block`."""

    _dres_fused = True

    def __init__(self, blocks: Sequence[nn.Module], alphas: Sequence[float], backend: Optional[str] = None):
        super().__init__(*blocks)
        device = blocks[0].norm1.weight.device
        for blk in blocks:
            blk.register_buffer("alphas", torch.ones(2, device=device), persistent=False)
        self.register_buffer("final_alpha", torch.ones((), device=device), persistent=False)
        self.set_alphas(alphas)
        self.backend = backend

    def stream_blocks(self) -> Sequence[nn.Module]:
        return list(self)

    def fused_call(self, block: nn.Module):
        return functools.partial(_fused_block_forward, block, backend=self.backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run_stream(x, norm=None)[0]  # the model's own norm follows, as before


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
    return model
