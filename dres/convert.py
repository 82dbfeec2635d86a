"""Convert a timm ``VisionTransformer`` (DeiT, DINOv2 and the other ViTs of timm's ``Block``) or
``Eva`` in place to decayed, fused residuals, keeping its weights.

``convert_timm_vit(model, alpha_min, schedule)`` replaces ``model.blocks`` (an ``nn.Sequential`` of
timm ``Block``, or Eva's ``nn.ModuleList`` of ``EvaBlock``) by :class:`FusedTimmBlocks`, an
``nn.Sequential`` subclass holding the very same block modules: parameters, their names and the
``state_dict`` are unchanged. Its forward is the residual-stream loop of
:class:`dres.nn.TransformerStack` (:class:`dres.nn.transformer.ResidualStream`): each block's
attention and MLP add (with the block's LayerScale and DropPath applied to the branch) is fused with
the next norm; the last add is a ``residual_add`` and the model's own ``norm`` follows.

The branches run on the fused ops too (every path): a block's timm ``Attention`` (a qkv Linear,
identity q/k norms) takes :func:`dres.ops.short_attention` straight from the qkv output where
:func:`dres.nn.transformer.takes_short_attention` allows it (no mask, no active attention dropout),
SDPA otherwise; a timm ``Mlp`` with an exact, tanh or sigmoid (QuickGELU) GELU and no active dropout between its Linears
runs :func:`dres.ops.fused_mlp` (``fused_mlp=False`` keeps timm's), which recomputes GELU in the
backward and so keeps one (tokens x hidden) activation fewer, eager and compiled alike. A timm
``LayerScale`` after such a branch (DINOv2's, DeiT III's) is folded under torch.compile into the branch's
last Linear (``proj``, ``fc2``: weight and bias rows times gamma, :func:`scaled_weights`), so the compiled
step multiplies weights, not activations, and keeps no activation for gamma's gradient (eager keeps timm's
multiply: fewer launches); the block's ``layer_scale_folded`` names those branches, and where a branch runs
timm's own forward the LayerScale is applied to its output.

The patch embedding (a ``Conv2d`` whose kernel is its stride) runs as one GEMM over the image's patches
(:class:`PatchConv2d`): the same weights and function, without cuDNN's layout transforms and convolution kernels;
its output is the (B, C, H', W') view of the GEMM's (B, H'W', C), which the model's own ``flatten(2).transpose(1, 2)``
turns back into that tensor without a copy. The Hugging Face converters do the same.

Paths that call blocks one at a time (gradient checkpointing's ``checkpoint_seq``, attention masks,
``forward_intermediates``, and every forward of Eva, whose loop hands each block its rotary
embedding) get each block's decayed forward: its attention add fused with ``norm2``, its MLP add a
``residual_add`` (the next block's ``norm1`` is its own call), so every path computes the same
function. With the defaults that function is the original model's. Only pre-LN blocks can be
converted: timm's post-norm blocks (``ResPostBlock``, ``EvaBlockPostNorm``) are refused.

``drop_path`` / ``droppath_mode``: drop path (timm's, scaled by 1/keep) or ResidualDroppath, as
:func:`dres.convert_timm_resnet` and the dres ViT have them: per-sample scales of each residual's
branch from a :class:`dres.nn.ResidualDroppath` controller attached as ``model.droppath`` (rates
linear in depth over blocks, both residuals of a block sharing its rate; its state, the key
``droppath._extra_state``, travels with checkpoints, and the original model's checkpoint, which
lacks it, still loads strictly; the iteration advances once per optimizer step,
:mod:`dres.nn.droppath`). A timm ``DropPath`` the model was created with keeps acting on the branch.

``stream_dtype``: under autocast timm's residual stream is float32 (its position embedding promotes it) and the
converter keeps it so; ``torch.bfloat16`` or ``torch.float16`` carries it in that dtype instead, every path alike,
from the blocks' entry to the model's own norm. That changes the function (the stream is rounded at each add, as
in a model trained in pure bf16) for a third fewer bytes through each fused add + LayerNorm and half the
stream's saved activations; without autocast the stream keeps the model's dtype either way.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dres import ops
from dres.nn.droppath import NO_SCALES, ResidualDroppath, build_droppath, droppath_scales, refuse_two_drop_paths
from dres.nn.embed import image_patches
from dres.nn.schedule import decay_schedule
from dres.nn.transformer import (ResidualStream, add_and_norm, autocast_dtype, block_alpha, heads_of_qkv,
                                  sdpa_from_qkv, takes_short_attention)
from dres.optional import import_optional


def _branch(blk: nn.Module, which: int, y: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """Branch ``which`` of a block (1: ``attn``, 2: ``mlp``) on the normalised ``y``, then its LayerScale (timm's
    ``ls1`` module, Eva's ``gamma_1`` parameter) and DropPath (identity where the block has none). A LayerScale
    the converted branch takes (:func:`_fuse_timm_branches`) is folded into the branch's last Linear under
    torch.compile; ``args``/``kwargs`` go to the branch module."""
    module = blk.attn if which == 1 else blk.mlp
    ls = getattr(blk, f"ls{which}", None) or nn.Identity()
    gamma = getattr(blk, f"gamma_{which}", None)
    dp = getattr(blk, f"drop_path{which}", None) or getattr(blk, "drop_path", None) or nn.Identity()
    # compiled, Inductor fuses the fold's weight-sized multiplies; eager keeps the activation multiply: four
    # launches a branch, forward and backward, where the fold's are eight
    if which in getattr(blk, "layer_scale_folded", ()) and torch.compiler.is_compiling():
        return dp(module(y, *args, layer_scale=ls, **kwargs))
    h = module(y, *args, **kwargs)
    return dp(ls(h)) if gamma is None else dp(gamma * h)


def _decayed_block_forward(stream: "FusedTimmBlocks", index: int, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """Block ``index``'s forward with decayed shortcuts and dropped paths, for paths that call blocks
    one by one: its attention add fused with norm2, its MLP add alone; ``args``/``kwargs`` go to the
    attention."""
    blk = stream[index]
    if stream.stream_dtype is not None and autocast_dtype(x) is not None:
        x = x.to(stream.stream_dtype)  # the first block's cast; the stream keeps it after
    attention_alpha, mlp_alpha = stream.block_alphas(index)
    scales = stream.droppath_scales(x)
    attention_scales, mlp_scales = (NO_SCALES, NO_SCALES) if scales is None else scales[2 * index:2 * index + 2]
    h = _branch(blk, 1, blk.norm1(x), *args, **kwargs)
    x, y = add_and_norm(h, x, blk.norm2, attention_alpha, attention_scales, stream.backend)
    h = _branch(blk, 2, y)
    return add_and_norm(h, x, None, mlp_alpha, mlp_scales, stream.backend)[0]


def _fused_block_forward(blk: nn.Module, hidden_states: torch.Tensor, residual: Optional[torch.Tensor],
                         scales=None, entering_alpha=None, *,
                         backend: Optional[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A timm Block in the fused-residual form of :meth:`dres.nn.Block.forward`; ``scales``: the
    drop-path scales of the residual entering the block and of its attention add (None: none)."""
    entering_scales, attention_scales = (NO_SCALES, NO_SCALES) if scales is None else scales
    alpha = block_alpha(blk, 0) if entering_alpha is None else entering_alpha
    entering, y = add_and_norm(hidden_states, residual, blk.norm1, alpha, entering_scales, backend)
    residual, y = add_and_norm(_branch(blk, 1, y), entering, blk.norm2, block_alpha(blk, 1), attention_scales, backend)
    return _branch(blk, 2, y), residual, entering


class FusedTimmBlocks(ResidualStream, nn.Sequential):
    """timm ViT blocks run on the fused residual stream (same children, same state_dict keys): each
    block gets the non-persistent ``alphas`` buffer of a :class:`dres.nn.Block`. ``droppath``: the
    controller of the residuals' drop-path scales (held by the model, not registered here)."""

    _dres_fused = True

    def __init__(self, blocks: Sequence[nn.Module], alphas: Sequence[float], backend: Optional[str] = None,
                 droppath: Optional[ResidualDroppath] = None, stream_dtype: Optional[torch.dtype] = None):
        super().__init__(*blocks)
        device = blocks[0].norm1.weight.device
        for blk in blocks:
            blk.register_buffer("alphas", torch.ones(2, device=device), persistent=False)
        self.register_buffer("final_alpha", torch.ones((), device=device), persistent=False)
        self.set_alphas(alphas)
        self.backend, self.stream_dtype = backend, stream_dtype
        self.droppath_scales = functools.partial(droppath_scales, droppath)  # a partial: no second registration

    def stream_blocks(self) -> Sequence[nn.Module]:
        return list(self)

    def block_alphas(self, index: int) -> tuple:
        """The alphas of block ``index``'s attention add and of its MLP add (the residual entering the
        next block, owned by it, or the stream's final one)."""
        mlp_alpha = block_alpha(self[index + 1], 0) if index + 1 < len(self) else self.final_alpha_arg()
        return block_alpha(self[index], 1), mlp_alpha

    def fused_call(self, block: nn.Module):
        return functools.partial(_fused_block_forward, block, backend=self.backend)

    def __getitem__(self, index):
        if isinstance(index, slice):  # timm slices its blocks (forward_intermediates, prune_intermediate_layers)
            return nn.Sequential(*list(self)[index])  # the blocks keep their decayed block-by-block forwards
        return super().__getitem__(index)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run_stream(x, norm=None, scales=self.droppath_scales(x))[0]  # the model's own norm follows


# ---------------------------------------------------------------------------------------------
# The branches: attention from one qkv output, the fused MLP (shared with dres.convert_hf)


class PatchConv2d(nn.Conv2d):
    """A ``Conv2d`` whose kernel is its stride (no padding, dilation or groups), a ViT's patch embedding,
    computed as one GEMM over the non-overlapping patches (:func:`patch_gemm`); parameters and ``state_dict``
    are the Conv2d's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return patch_gemm(x, self.weight, self.bias)


def patch_gemm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``F.conv2d(x, weight, bias, stride=kernel)`` for (B, C, H, W) ``x``: its patches
    (:func:`dres.nn.embed.image_patches`) times the flattened kernel -> (B, out, H', W'), a view of the
    (B, H'W', out) product."""
    kh, kw = weight.shape[-2:]
    grid = (x.shape[-2] // kh, x.shape[-1] // kw)
    return F.linear(image_patches(x, kh, kw), weight.flatten(1), bias).transpose(1, 2).unflatten(2, grid)


def gemm_patch_embeddings(model: nn.Module) -> None:
    """Every plain ``Conv2d`` of ``model`` whose kernel is its stride (a ViT's patch embedding) becomes a
    :class:`PatchConv2d`, in place."""
    for module in model.modules():
        if (type(module) is nn.Conv2d and module.kernel_size == module.stride and module.kernel_size != (1, 1)
                and module.padding in ((0, 0), "valid") and module.dilation == (1, 1) and module.groups == 1):
            module.__class__ = PatchConv2d


ROW_ALIGNMENT = 8  # elements: cuBLAS's fast bf16/fp16 GEMMs need 16-byte-aligned rows (fp32 needs 4 elements)


class AlignedLinear(nn.Linear):
    """An ``nn.Linear`` whose output rows are laid out at a multiple of :data:`ROW_ALIGNMENT` elements: a
    language model's head over a vocabulary such as 30,522 (BERT) or 50,257 (GPT-2), whose GEMMs on the unaligned
    rows fall back to cuBLAS's slow kernels, forward and backward. The weight is zero-padded at each call and the
    output is the ``[..., :out_features]`` view of the padded product: the same values, its rows strided by the
    padded width. Under ``torch.compile`` the plain ``F.linear`` (Inductor pads a GEMM itself where that pays).
    Parameters and ``state_dict`` are the Linear's (a weight tied to an embedding stays tied)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pad = -self.out_features % ROW_ALIGNMENT
        if pad == 0 or torch.compiler.is_compiling():
            return super().forward(x)
        bias = None if self.bias is None else F.pad(self.bias, (0, pad))
        return F.linear(x, F.pad(self.weight, (0, 0, 0, pad)), bias)[..., :self.out_features]


def align_output_head(model: nn.Module) -> None:
    """The model's output embeddings (transformers' ``get_output_embeddings()``: a language model's head), where it is
    a plain ``nn.Linear`` with unaligned rows, become an :class:`AlignedLinear`, in place."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if type(head) is nn.Linear and head.out_features % ROW_ALIGNMENT:
        head.__class__ = AlignedLinear


def attention_from_qkv(qkv: torch.Tensor, num_heads: int, backend: Optional[str], mask: Optional[torch.Tensor] = None,
                       dropout_p: float = 0.0) -> torch.Tensor:
    """Self-attention of a qkv output (B, N, 3C) in timm's layout (q, k, v, each heads x head_dim) ->
    (B, N, C): :func:`dres.ops.short_attention` where :func:`takes_short_attention` allows it (it has
    no mask and no dropout), else SDPA (``mask``: SDPA's ``attn_mask``)."""
    B, N, three_c = qkv.shape
    if mask is None and dropout_p == 0.0:
        if takes_short_attention(qkv, N, three_c // (3 * num_heads), backend):
            return ops.short_attention(qkv, num_heads, backend="triton")
        return sdpa_from_qkv(qkv, num_heads)
    q, k, v = heads_of_qkv(qkv, num_heads)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p).transpose(1, 2).flatten(2)


def gelu_approximate(act: nn.Module, gelu_types: dict) -> Optional[str]:
    """The GELU ``act`` computes as :func:`dres.ops.fused_mlp`'s ``approximate`` names it ("none", "tanh" as
    ``F.gelu`` does, "quick" for QuickGELU): an ``nn.GELU``'s own, else ``gelu_types[type(act)]``; None when
    ``act`` is no GELU the fused MLP computes."""
    return act.approximate if isinstance(act, nn.GELU) else gelu_types.get(type(act))


def fused_mlp_of(x: torch.Tensor, fc1: nn.Linear, fc2: nn.Linear, approximate: str, backend: Optional[str],
                 gamma: Optional[torch.Tensor] = None):
    """``fc2(gelu(fc1(x)))`` through :func:`dres.ops.fused_mlp`, times a LayerScale's ``gamma`` (folded into fc2)."""
    fc2_weight, fc2_bias = scaled_weights(fc2, gamma)
    return ops.fused_mlp(x, fc1.weight, fc1.bias, fc2_weight, fc2_bias, backend=backend, approximate=approximate)


def scaled_weights(linear: nn.Linear, gamma: Optional[torch.Tensor]):
    """The weight and bias of ``linear(x) * gamma`` as one Linear: each output row times gamma. A LayerScale
    (timm's, HF DINOv2's) after the branch's last Linear so costs a multiply of the weights, not of the
    activations, and keeps no activation for gamma's gradient."""
    if gamma is None:
        return linear.weight, linear.bias
    return linear.weight * gamma[:, None], None if linear.bias is None else linear.bias * gamma


def _layer_scaled(h: torch.Tensor, layer_scale: Optional[nn.Module]) -> torch.Tensor:
    """``layer_scale(h)`` on a path that runs timm's own branch (a mask, active dropout)."""
    return h if layer_scale is None else layer_scale(h)


@functools.cache
def _timm_gelu_types() -> dict:
    activations = import_optional("timm.layers.activations", "timm", "convert_timm_vit")
    return {activations.GELU: "none", activations.GELUTanh: "tanh", activations.QuickGELU: "quick"}


def _short_timm_attention(attn: nn.Module) -> bool:
    """Whether a timm ``Attention`` computes plain softmax attention of its qkv output: no q/k norm, no
    norm before proj, no gate (the attributes newer timm versions add)."""
    identity = all(isinstance(getattr(attn, name, None) or nn.Identity(), nn.Identity)
                   for name in ("q_norm", "k_norm", "norm"))
    return identity and getattr(attn, "gate", None) is None and isinstance(attn.qkv, nn.Linear)


def _timm_attention_forward(stream: "FusedTimmBlocks", attn: nn.Module, x: torch.Tensor,
                            attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
                            layer_scale: Optional[nn.Module] = None) -> torch.Tensor:
    """A timm Attention's function from its one qkv output, then the block's ``layer_scale`` (folded into
    proj; its dropout commutes with the scale); a mask, causality or active attention dropout go to timm's
    own forward."""
    if attn_mask is not None or is_causal or (attn.training and attn.attn_drop.p > 0):
        extra = {} if attn_mask is None and not is_causal else {"attn_mask": attn_mask, "is_causal": is_causal}
        return _layer_scaled(type(attn).forward(attn, x, **extra), layer_scale)
    attended = attention_from_qkv(attn.qkv(x), attn.num_heads, stream.backend)
    if layer_scale is None:
        return attn.proj_drop(attn.proj(attended))
    return attn.proj_drop(F.linear(attended, *scaled_weights(attn.proj, layer_scale.gamma)))


def _timm_mlp_forward(stream: "FusedTimmBlocks", mlp: nn.Module, approximate: str, x: torch.Tensor,
                      layer_scale: Optional[nn.Module] = None) -> torch.Tensor:
    """A timm Mlp through the fused MLP, then the block's ``layer_scale`` (folded into fc2); active dropout
    between its Linears goes to timm's own forward."""
    if mlp.training and mlp.drop1.p > 0:
        return _layer_scaled(type(mlp).forward(mlp, x), layer_scale)
    return mlp.drop2(fused_mlp_of(x, mlp.fc1, mlp.fc2, approximate, stream.backend,
                                  None if layer_scale is None else layer_scale.gamma))


def _fuse_timm_branches(stream: "FusedTimmBlocks", fused_mlp: bool) -> None:
    """Point each block's timm Attention and (``fused_mlp``) Mlp at the fused branch forwards above; a block's
    ``layer_scale_folded`` names the branches (1, 2) whose timm LayerScale they take."""
    vision_transformer = import_optional("timm.models.vision_transformer", "timm", "convert_timm_vit")
    attention_type, mlp_type = vision_transformer.Attention, vision_transformer.Mlp
    for blk in stream:
        attn, mlp = blk.attn, blk.mlp
        foldable = set()
        if type(attn) is attention_type and _short_timm_attention(attn):
            attn.forward = functools.partial(_timm_attention_forward, stream, attn)
            if isinstance(attn.proj, nn.Linear):
                foldable.add(1)
        approximate = gelu_approximate(mlp.act, _timm_gelu_types()) if type(mlp) is mlp_type else None
        if (fused_mlp and approximate is not None and isinstance(mlp.norm, nn.Identity)
                and isinstance(mlp.fc1, nn.Linear) and isinstance(mlp.fc2, nn.Linear)):
            mlp.forward = functools.partial(_timm_mlp_forward, stream, mlp, approximate)
            foldable.add(2)
        blk.layer_scale_folded = tuple(k for k in sorted(foldable)
                                       if type(getattr(blk, f"ls{k}", None)) is vision_transformer.LayerScale)


def float32_alphas(n: int, alpha_min: float, schedule: str, per_block: bool, per_layer: int = 2) -> list[float]:
    """:func:`dres.nn.decay_schedule` rounded to float32, as the kernels read it, so that fused and
    block-by-block paths agree exactly."""
    return torch.tensor(decay_schedule(n, alpha_min, schedule, per_block, per_layer), dtype=torch.float32).tolist()


def check_norm(where: str, norm: nn.Module) -> None:
    """The fused ops implement LayerNorm over the last dimension only."""
    if not isinstance(norm, nn.LayerNorm) or len(norm.normalized_shape) != 1:
        raise TypeError(f"{where} is {type(norm).__name__}; the fused ops implement LayerNorm over the last "
                        "dimension only")


def _pre_ln_block_types() -> tuple[type, ...]:
    """The timm blocks whose forward the converter computes: ``x + f(norm(x))`` twice, each branch
    ending with LayerScale and DropPath. timm's other blocks (post-norm, parallel) have the same
    attribute names and another function, so they are refused by type."""
    vision_transformer = import_optional("timm.models.vision_transformer", "timm", "convert_timm_vit")
    eva = import_optional("timm.models.eva", "timm", "convert_timm_vit")
    return vision_transformer.Block, eva.EvaBlock


def _check_block(i: int, blk: nn.Module, pre_ln: tuple[type, ...]) -> None:
    if "alphas" in blk._buffers:
        raise ValueError(f"block {i} is already converted")
    if type(blk) not in pre_ln:
        kind = type(blk)
        raise TypeError(f"block {i} is a {kind.__module__}.{kind.__qualname__}; only timm's pre-LN blocks "
                        "(timm.models.vision_transformer.Block, timm.models.eva.EvaBlock) can be converted")
    for name in ("norm1", "norm2"):
        check_norm(f"block {i}.{name}", getattr(blk, name))


def has_timm_drop_path(blk: nn.Module) -> bool:
    """Whether a timm ViT block drops its branches itself (the model was created with drop_path_rate > 0)."""
    return any(not isinstance(getattr(blk, name, None) or nn.Identity(), nn.Identity)
               for name in ("drop_path", "drop_path1", "drop_path2"))


def convert_timm_vit(model: nn.Module, alpha_min: float = 1.0, schedule: str = "linspace", per_block: bool = False,
                     drop_path: float = 0.0, droppath_mode: str = "drop_path", backend: Optional[str] = None,
                     droppath_seed: int = 0, fused_mlp: bool = True,
                     stream_dtype: Optional[torch.dtype] = None) -> nn.Module:
    """Make ``model`` (a timm VisionTransformer or Eva) use decayed, fused residuals; returns the same object.

    alpha_min / schedule / per_block: as :func:`dres.nn.decay_schedule` over the ``2*depth`` residuals
    (``model.blocks.set_alphas`` changes them later). drop_path: the deepest block's drop rate (0:
    none, whatever the mode); droppath_mode: "drop_path" (timm, scaled by 1/keep) or
    "residual_droppath" (Park). backend: of :mod:`dres.ops` (``dres.nn.set_backend`` changes it later).
    Weights are not touched (no zero-initialisation: the model is presumably pretrained). Each
    block's timm ``Mlp`` with an erf, tanh or QuickGELU (``act_layer``) runs :func:`dres.ops.fused_mlp`
    (``fused_mlp=False``: as timm built it; other MLPs, SwiGLU's, always so), its ``Attention`` short
    attention from the qkv output where the shape allows (module docstring). stream_dtype: None (the residual
    stream float32 under autocast: the model's function) or torch.bfloat16 / torch.float16 (the stream in that
    dtype under autocast: module docstring).
    """
    if stream_dtype not in (None, torch.bfloat16, torch.float16):
        raise ValueError(f"stream_dtype must be None, torch.bfloat16 or torch.float16, got {stream_dtype!r}")
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, FusedTimmBlocks):
        raise ValueError("model.blocks is already converted (model.blocks.set_alphas changes the alphas)")
    if not isinstance(blocks, (nn.Sequential, nn.ModuleList)) or len(blocks) == 0:
        raise TypeError(f"expected a timm VisionTransformer or Eva with `blocks` (nn.Sequential or nn.ModuleList), "
                        f"got {type(model).__name__}")
    pre_ln = _pre_ln_block_types()
    for i, blk in enumerate(blocks):
        _check_block(i, blk, pre_ln)
    refuse_two_drop_paths(drop_path, blocks, has_timm_drop_path)
    droppath = build_droppath(None, drop_path, droppath_mode, 2 * len(blocks), droppath_seed)
    alphas = float32_alphas(2 * len(blocks), alpha_min, schedule, per_block)
    if droppath is not None:
        droppath = droppath.to(blocks[0].norm1.weight.device)
    stream = FusedTimmBlocks(list(blocks), alphas, backend, droppath, stream_dtype)
    for i, blk in enumerate(stream):
        blk.forward = functools.partial(_decayed_block_forward, stream, i)
    _fuse_timm_branches(stream, fused_mlp)
    gemm_patch_embeddings(model)
    model.blocks = stream
    if droppath is not None:
        model.droppath = droppath
    return model


# ---------------------------------------------------------------------------------------------
# Export: a dres ViT (ViTClassifier, or a ViTEncoder such as MAE's) back to timm's format


def _encoder_and_head(model: nn.Module) -> tuple[nn.Module, str, Optional[nn.Linear], str]:
    """(the ViTEncoder, its key prefix, the classifier head or None, timm's global_pool)."""
    from dres.models.classifier import ViTClassifier
    from dres.models.vit import ViTEncoder

    if isinstance(model, ViTClassifier):
        return model.encoder, "encoder.", model.head, "token" if model.global_pool == "cls" else "avg"
    if isinstance(model, ViTEncoder):
        return model, "", None, "token"
    raise TypeError(f"expected a dres ViTClassifier or ViTEncoder (an MAE's `encoder`), got {type(model).__name__}")


def timm_vit_kwargs(model: nn.Module) -> dict:
    """The arguments of the timm ``VisionTransformer`` that :func:`export_timm_state_dict`'s output
    loads into, computing ``model``'s function when its alphas are all 1 (see there otherwise)."""
    encoder, _, head, global_pool = _encoder_and_head(model)
    blk = encoder.transformer.blocks[0]
    kwargs = dict(img_size=encoder.patch_embed.img_size, patch_size=encoder.patch_embed.patch_size,
                  in_chans=encoder.patch_embed.proj.in_channels, embed_dim=encoder.embed_dim, depth=encoder.depth,
                  num_heads=blk.attn.num_heads, mlp_ratio=blk.mlp.fc1.out_features / encoder.embed_dim,
                  qkv_bias=blk.attn.qkv.bias is not None, class_token=True, global_pool=global_pool,
                  fc_norm=False,  # dres normalises every token before pooling, as timm without fc_norm
                  num_classes=0 if head is None else head.out_features)
    if encoder.transformer.norm is None:
        kwargs["final_norm"] = False
    if blk.mlp.act.approximate == "tanh":
        kwargs["act_layer"] = "gelu_tanh"  # timm's name of F.gelu(approximate="tanh"); its default is erf's
    return kwargs


def export_timm_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s weights under timm ``VisionTransformer`` names (``timm_vit_kwargs(model)`` builds
    the model they load into with ``strict=True``); the drop-path controller's state is left out.

    timm's model is a plain ViT: when ``model`` has decayed shortcuts (alphas below 1), convert it
    after loading and give it the same alphas, ``dres.convert_timm_vit(vit)`` then
    ``vit.blocks.set_alphas(model.encoder.transformer.alphas.tolist())``.
    """
    encoder, prefix, head, _ = _encoder_and_head(model)
    renames = [(prefix + "transformer.blocks.", "blocks."), (prefix + "transformer.norm.", "norm."),
               (prefix + "patch_embed.", "patch_embed."), (prefix + "cls_token", "cls_token"),
               (prefix + "pos_embed", "pos_embed"), ("head.", "head.")]
    exported = {}
    for key, value in model.state_dict().items():
        if key.endswith("droppath._extra_state"):
            continue
        new = next((timm + key[len(dres_name):] for dres_name, timm in renames if key.startswith(dres_name)), None)
        if new is None:
            raise ValueError(f"state_dict key {key!r} has no timm VisionTransformer counterpart")
        exported[new] = value
    return exported
