"""Convert Hugging Face transformers encoders in place to the fused residual ops, keeping their weights.

``convert_hf_vit(model)`` (the pre-LN ViTs: ViTModel, DeiTModel, ViTMAEModel, Dinov2Model and the
models built on them, ViTMAEForPreTraining's decoder included; the pre-LN towers CLIPVisionModel,
CLIPTextModel and SiglipVisionModel). Every layer (``ViTLayer``, ``DeiTLayer``, ``ViTMAELayer``,
``Dinov2Layer`` with its LayerScale and DropPath, ``CLIPEncoderLayer``, ``SiglipEncoderLayer``)
computes its two residual adds as :func:`dres.ops.residual_layer_norm` calls, each fused with the
LayerNorm that follows it (ViT's names below; DINOv2's are ``norm1``/``norm2``, CLIP's
``layer_norm1``/``layer_norm2``)::

    mid, y      = residual_layer_norm(x,   attention(layernorm_before(x)), layernorm_after, a_2k)
    out, y_next = residual_layer_norm(mid, mlp(y),                        next_norm,       a_2k+1)

``next_norm`` is the next layer's ``layernorm_before`` (the model's final ``layernorm`` after the
last layer, the decoder's ``decoder_norm`` after the decoder's; none after a CLIP or SigLIP tower's
last layer, whose ``post_layernorm`` CLIP applies to the pooled token alone, so that add is a
:func:`dres.ops.residual_add`), so the residual stream is carried across layers with one op per add, as in
:class:`dres.nn.TransformerStack`. The model's own loop stays in charge (it differs between
transformers versions and records hidden states and attentions): layer k returns ``out`` and leaves
``y_next`` with ``next_norm``; layer k+1 takes it when called on that very ``out`` tensor (else, and
in a stack's first layer, it normalises its input with :func:`dres.ops.layer_norm`), and the final
norm's forward returns it likewise, an ordinary LayerNorm on any other input. Under gradient
checkpointing in training (which recomputes layers one at a time) layers end with a plain
:func:`dres.ops.residual_add` instead.

``convert_hf_bert(model)`` (BertModel and its heads; RoBERTa-style encoders with the same modules
too: post-LN). A BERT layer computes ``a = LN1(x + attn(x))`` and ``out = LN2(a + ffn(a))``: each add
is followed by its own LayerNorm inside the same submodule (``BertSelfOutput``, ``BertOutput``), and
the normalised value is the stream the next sub-layer and the next layer receive. That is exactly the
fused op's ``y``; its ``out`` (the un-normalised sum) is needed only by the backward. So both adds of
every layer are fused and nothing is carried across layers: there is no pending add between layers
of a post-LN encoder. (The embeddings' LayerNorm, after a sum of three embeddings, stays PyTorch's.)

``convert_hf_gpt2(model)`` (GPT2Model and the models built on it: GPT2LMHeadModel, ...). A GPT2Block
is pre-LN, ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``, and the model ends with ``ln_f``: both adds
are fused with the norm that follows and carried across blocks as in the ViTs (the last block's with
``ln_f``, whose output is the model's). Attention stays HF's own: its q/k/v is already one GEMM (the
``c_attn`` Conv1D), SDPA applies the causal mask itself, and the block hands it every argument as
HF's block does, so the key/value cache (generation), padding masks and attention probabilities
work unchanged. A GELU MLP (``c_fc``, ``gelu_new`` or another GELU, ``c_proj``; Conv1D, whose (in, out)
weights go to :func:`dres.ops.fused_mlp` transposed) is one fused MLP. Cross-attention blocks
(``add_cross_attention``) are refused.

Residual dropout (HF's ``nn.Dropout`` ending a branch: BERT's and GPT-2's ``hidden_dropout_prob`` /
``resid_pdrop``, ViT's ``hidden_dropout_prob``) is drawn inside the fused add after the branch
(``residual_layer_norm(..., dropout_p=p)``, p while the module trains, 0 in eval), never as kernels of
its own; GPT-2's attention ends in its own ``resid_dropout``, which the converter re-classes
:class:`DropoutInNextAdd` (HF's call of it is then the identity). The masks are the kernels' Philox
stream, not torch's: a converted model drops other elements than the original for one seed.

The branches run on the fused ops too. Every converted self-attention (the module holding the
``query``/``key``/``value`` or ``q_proj``/``k_proj``/``v_proj`` Linears, which stay) computes q, k and v
as one GEMM, ``F.linear(x, cat(weights), cat(biases))``, and attends from that qkv output:
:func:`dres.ops.short_attention` where :func:`dres.nn.transformer.takes_short_attention` allows it
(no mask, no active attention dropout), SDPA otherwise (with BERT's padding mask and the attention
dropout in training). It takes the place of HF's SDPA implementation (``attn_implementation="sdpa"``,
the default); other implementations (``"eager"``, which HF asks for to return attention
probabilities, flash, flex), calls that want the probabilities (``output_attentions``), a
``head_mask``, cross-attention, caches and causal attention (decoders, CLIP's text tower) run HF's
own forward. An MLP with an exact, tanh or sigmoid GELU (HF's ``"gelu"``, ``"gelu_new"``, ``"gelu_pytorch_tanh"``,
and CLIP's ``"quick_gelu"``) runs
:func:`dres.ops.fused_mlp`, which recomputes GELU in the backward: one (tokens x hidden) activation
fewer (``fused_mlp=False`` keeps HF's). A DINOv2 LayerScale after a converted branch is folded under
torch.compile into the branch's last Linear (the attention's ``o_proj`` where the fused module holds it, the
fused MLP's ``fc2``: :func:`dres.convert.scaled_weights`), as in the timm converter; eager keeps HF's multiply;
a layer's ``_dres_layer_scale_folded`` names those branches. ViTMAEForPreTraining's loss is :func:`dres.ops.mae_loss`,
read straight from the pixels. A vision model's patch embedding (a ``Conv2d`` whose kernel is its stride) runs
as one GEMM over the patches (:class:`dres.convert.PatchConv2d`), as in the timm converter.

A language model's head (``get_output_embeddings()``: BERT's and RoBERTa's masked-LM decoder, GPT-2's
``lm_head``) whose vocabulary leaves its output rows unaligned (30,522; 50,257) runs as
:class:`dres.convert.AlignedLinear` in eager: the weight padded to a multiple of 8 rows at each call and the logits a
view of the padded product, so its three GEMMs take cuBLAS's fast kernels (``aligned_head=False`` keeps HF's).

Under autocast the pre-LN stream stays in its dtype (float32) and each normalised value that feeds a
branch comes out in the autocast dtype, so q/k/v and fc1 cast nothing; the encoder's final
``layernorm`` returns what torch's LayerNorm does (float32 under autocast: it is the model's output),
the decoder's ``decoder_norm``, which feeds only ``decoder_pred``, the autocast dtype.

The converters keep parameters, their names and the ``state_dict``; ``alpha_min=1`` (the default)
keeps the function: outputs and gradients equal the unconverted model's. ``backend`` is that of
:mod:`dres.ops` (:func:`dres.nn.set_backend` changes it later). A model is converted once.
"""

from __future__ import annotations

import functools
import inspect
from typing import Optional

import torch
from torch import nn

from dres import ops
from dres.convert import (align_output_head, attention_from_qkv, check_norm, float32_alphas, fused_mlp_of,
                          gelu_approximate, gemm_patch_embeddings, scaled_weights)
from dres.nn.transformer import add_and_norm, autocast_dtype

__all__ = ["convert_hf_vit", "convert_hf_bert", "convert_hf_gpt2"]


def _refuse_second_conversion(modules, what: str) -> None:
    if any(getattr(m, "_dres_fused", False) for m in modules):
        raise ValueError(f"{what} is already converted")


def _fused_add_norm(x: torch.Tensor, h: torch.Tensor, norm: nn.LayerNorm, alpha: float, backend: Optional[str],
                    out_dtype: Optional[torch.dtype] = None, dropout_p: float = 0.0):
    """``(alpha*x + dropout(h), norm(...))`` in one op; the normalised value in ``out_dtype`` (default the
    branch's: the autocast dtype under autocast)."""
    return ops.residual_layer_norm(x, h, norm.weight, norm.bias, alpha=alpha, eps=norm.eps, out_dtype=out_dtype,
                                   dropout_p=dropout_p, backend=backend)


class DropoutInNextAdd(nn.Dropout):
    """The ``nn.Dropout`` at the end of a branch inside an HF module (GPT-2's attention ``resid_dropout``),
    re-classed: the module's call is the identity, and the fused residual add after the branch draws the
    mask with the ``p`` it reads here (:func:`_deferred_dropout_p`)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return input


def _deferred_dropout_p(dropout: Optional[nn.Module]) -> float:
    return dropout.p if isinstance(dropout, DropoutInNextAdd) and dropout.training else 0.0


def _branch_end(tail: nn.Module, h: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``(h, p)``: a plain ``nn.Dropout`` ending a branch is left to the fused add after it (p, 0 outside
    training); any other tail (LayerScale, DropPath, ...) is applied here (p = 0)."""
    if type(tail) is nn.Dropout:
        return h, tail.p if tail.training else 0.0
    return tail(h), 0.0


def _layer_norm_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype torch's LayerNorm returns for ``x``: float32 (or wider) under autocast, else x's."""
    return x.dtype if autocast_dtype(x) is None else torch.promote_types(x.dtype, torch.float32)


# ---------------------------------------------------------------------------------------------
# The branches: q/k/v as one GEMM, the fused MLP

_QKV_NAMES = (("query", "key", "value"), ("q_proj", "k_proj", "v_proj"))
# arguments that ask HF's attention for more than self-attention of the hidden states
_HF_ONLY_ARGUMENTS = ("head_mask", "encoder_hidden_states", "past_key_value", "past_key_values", "cache",
                      "causal_attention_mask")


def _qkv_linears(module: nn.Module) -> Optional[tuple[nn.Linear, nn.Linear, nn.Linear]]:
    """The query, key and value Linears of an HF self-attention module (v4's ``query``..., v5's
    ``q_proj``...), all with biases or none; None if it has no such three."""
    for names in _QKV_NAMES:
        linears = tuple(getattr(module, name, None) for name in names)
        if all(isinstance(lin, nn.Linear) for lin in linears) and len({lin.bias is None for lin in linears}) == 1:
            return linears
    return None


def _self_attention_module(attention: nn.Module) -> Optional[nn.Module]:
    """The module holding q/k/v in a layer's ``attention``: itself (transformers 5's ViTs), its
    ``attention`` (4.x ViTs) or ``self`` (BERT)."""
    for module in (attention, getattr(attention, "attention", None), getattr(attention, "self", None)):
        if isinstance(module, nn.Module) and _qkv_linears(module) is not None:
            return module
    return None


def _attention_dropout(module: nn.Module) -> float:
    """The attention-probability dropout HF's SDPA path applies in training (named per version)."""
    for name in ("attention_dropout", "dropout_prob", "attention_probs_dropout_prob", "dropout"):
        if isinstance(getattr(module, name, None), float):
            return getattr(module, name)
    return module.dropout.p


def _projection(module: nn.Module) -> Optional[nn.Linear]:
    """The output projection a self-attention module holds (``o_proj``, ``out_proj``), if any."""
    return getattr(module, "o_proj", None) or getattr(module, "out_proj", None)


def _fused_attention_forward(module: nn.Module, hidden_states: torch.Tensor, *args,
                             layer_scale: Optional[torch.Tensor] = None, **kwargs):
    """HF's SDPA self-attention with q, k and v from one GEMM (short attention where it can); what
    needs more (module docstring) runs HF's own forward. Returns what HF's SDPA path does:
    (output, None), the output projected where the module holds the projection (:func:`_projection`),
    times ``layer_scale`` where given (a DINOv2 LayerScale's gamma, folded into the projection)."""
    named = dict(zip(module._dres_arg_names, args), **kwargs)
    if module._dres_user_mask.absent:  # the mask HF built without one from the caller: all True
        named["attention_mask"] = None
    config = module._dres_config
    if (config._attn_implementation != "sdpa" or named.get("output_attentions") or config.output_attentions
            or getattr(module, "is_causal", False) or named.get("is_causal")
            or any(named.get(n) is not None for n in _HF_ONLY_ARGUMENTS)):
        out = type(module).forward(module, hidden_states, *args, **kwargs)
        return out if layer_scale is None else (out[0] * layer_scale, *out[1:])
    q, k, v = _qkv_linears(module)
    bias = None if q.bias is None else torch.cat((q.bias, k.bias, v.bias))
    qkv = nn.functional.linear(hidden_states, torch.cat((q.weight, k.weight, v.weight)), bias)
    dropout_p = _attention_dropout(module) if module.training else 0.0
    num_heads = getattr(module, "num_attention_heads", None) or module.num_heads  # CLIP's, SigLIP's name
    out = attention_from_qkv(qkv, num_heads, module.backend, named.get("attention_mask"), dropout_p)
    projection = _projection(module)
    if projection is None:
        return out, None
    return nn.functional.linear(out, *scaled_weights(projection, layer_scale)), None


def _fuse_attention(attention: nn.Module, config, backend: Optional[str]) -> None:
    """Give a layer's self-attention module the one-GEMM forward (it then goes with set_backend)."""
    module = _self_attention_module(attention)
    if module is None or getattr(module, "is_decoder", False):  # causal, with caches: HF's own
        return
    module._dres_arg_names = tuple(inspect.signature(type(module).forward).parameters)[2:]
    module._dres_config = getattr(module, "config", None) or config
    module._dres_user_mask = _UserMask()  # replaced by the base model's (_drop_built_masks)
    module.backend = backend
    module._dres_fused = True
    module.forward = functools.partial(_fused_attention_forward, module)


class _UserMask:
    """Whether the running call of a base model (``model.vit``, ``model.bert``, ...) was given no
    ``attention_mask``. HF then builds a bidirectional mask that is all True: none in eager, but a
    materialised (B, 1, N, N) tensor while Dynamo traces with torch 2.11, which would send the fused
    attention to SDPA's masked math path. The converted attention ignores that mask."""

    __slots__ = ("absent",)

    def __init__(self):
        self.absent = False


def _forward_noting_mask(base: nn.Module, user_mask: _UserMask, mask_index: int, *args, **kwargs):
    """The base model's own forward, with ``user_mask`` saying whether this call passed an attention mask."""
    mask = args[mask_index] if len(args) > mask_index else kwargs.get("attention_mask")
    user_mask.absent = mask is None
    try:
        return type(base).forward(base, *args, **kwargs)
    finally:
        user_mask.absent = False


def _drop_built_masks(model: nn.Module) -> None:
    """Let the converted attentions of ``model``'s base model ignore the masks HF builds when the caller
    gave none (:class:`_UserMask`); a base model without an ``attention_mask`` argument builds none."""
    base = _base_model(model)
    arg_names = list(inspect.signature(type(base).forward).parameters)[1:]
    if "attention_mask" not in arg_names:
        return
    user_mask = _UserMask()
    for module in base.modules():
        if hasattr(module, "_dres_user_mask"):
            module._dres_user_mask = user_mask
    base.forward = functools.partial(_forward_noting_mask, base, user_mask, arg_names.index("attention_mask"))


@functools.cache
def _hf_gelu_types() -> dict:
    """HF's GELU activations by class, read from its ACT2FN table (class names differ between versions)."""
    from transformers.activations import ACT2FN

    return {type(ACT2FN[name]): approximate for name, approximate in
            (("gelu", "none"), ("gelu_new", "tanh"), ("gelu_pytorch_tanh", "tanh"), ("quick_gelu", "quick"))}


def _mlp_parts(layer: nn.Module) -> Optional[tuple[nn.Linear, nn.Linear, str]]:
    """(fc1, fc2, GELU approximate) of a layer's MLP: ``mlp`` with ``fc1``/``fc2`` and its activation
    (``activation_fn`` or ``activation``), or 4.x ViT's and BERT's ``intermediate.dense`` with its
    ``intermediate_act_fn`` and ``output.dense``; None when it is no Linear-GELU-Linear MLP (DINOv2's SwiGLU)."""
    mlp = getattr(layer, "mlp", None)
    if mlp is not None:
        fc1, fc2 = getattr(mlp, "fc1", None), getattr(mlp, "fc2", None)
        act = getattr(mlp, "activation_fn", None) or getattr(mlp, "activation", None)
    else:
        fc1, fc2 = getattr(layer.intermediate, "dense", None), getattr(layer.output, "dense", None)
        act = getattr(layer.intermediate, "intermediate_act_fn", None)
    approximate = gelu_approximate(act, _hf_gelu_types()) if isinstance(act, nn.Module) else None
    if approximate is None or not (isinstance(fc1, nn.Linear) and isinstance(fc2, nn.Linear)):
        return None
    return fc1, fc2, approximate


def _mlp(layer: nn.Module, y: torch.Tensor, layer_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The layer's MLP on y, up to its fc2 (no dropout after): fused where conversion found it fusable, then
    times ``layer_scale`` where given (folded into fc2: only a fused MLP is given one)."""
    if layer._dres_mlp is not None:
        fc1, fc2, approximate = layer._dres_mlp
        return fused_mlp_of(y, fc1, fc2, approximate, layer.backend, layer_scale)
    if hasattr(layer, "mlp"):
        return layer.mlp(y)
    return layer.output.dense(layer.intermediate(y))


# ---------------------------------------------------------------------------------------------
# ViT (pre-LN): the carry across layers


def _take_pending(norm: nn.LayerNorm, x: torch.Tensor) -> Optional[torch.Tensor]:
    """The value the previous layer computed fused with its last add, when ``x`` is that layer's
    output; taken once. None otherwise (and when nothing was left)."""
    pending = getattr(norm, "_dres_pending", None)
    if pending is None:
        return None
    norm._dres_pending = None  # taken once (torch 2.11's Dynamo cannot trace a pop of the module's __dict__)
    return pending[1] if pending[0] is x else None


def _handed_norm_forward(norm: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """A final LayerNorm (called by the model) that returns the value the last layer computed fused
    with its last add, when called on that layer's output; otherwise its ordinary forward."""
    y = _take_pending(norm, x)
    return nn.LayerNorm.forward(norm, x) if y is None else y


def _unchanged(h: torch.Tensor) -> torch.Tensor:
    return h


def _pre_ln_parts(layer: nn.Module):
    """(norm before the attention, the attention module, its branch tail, norm after it, MLP branch
    tail) of a pre-LN layer; the MLP itself is :func:`_mlp`. ViT's names (DeiT, ViTMAE): transformers
    5 has ``mlp`` and a layer ``dropout``, 4.x ``intermediate`` and ``output`` (whose forward also adds
    the residual); DINOv2's: ``norm1``/``norm2`` with LayerScale and DropPath ending each branch;
    CLIP's and SigLIP's: ``layer_norm1``, ``self_attn``, ``layer_norm2``, ``mlp``, bare branches."""
    if hasattr(layer, "norm1"):
        return (layer.norm1, layer.attention, lambda h: layer.drop_path(layer.layer_scale1(h)), layer.norm2,
                lambda h: layer.drop_path(layer.layer_scale2(h)))
    if hasattr(layer, "layer_norm1"):
        return layer.layer_norm1, layer.self_attn, _unchanged, layer.layer_norm2, _unchanged
    if hasattr(layer, "mlp"):
        return layer.layernorm_before, layer.attention, layer.dropout, layer.layernorm_after, layer.dropout
    return layer.layernorm_before, layer.attention, _unchanged, layer.layernorm_after, layer.output.dropout


# each layout: its modules, the names of its two norms
_PRE_LN_LAYOUTS = ((("layernorm_before", "attention", "layernorm_after", "mlp", "dropout"),
                    ("layernorm_before", "layernorm_after")),
                   (("layernorm_before", "attention", "layernorm_after", "intermediate", "output"),
                    ("layernorm_before", "layernorm_after")),
                   (("norm1", "attention", "layer_scale1", "drop_path", "norm2", "mlp", "layer_scale2"),
                    ("norm1", "norm2")),
                   (("layer_norm1", "self_attn", "layer_norm2", "mlp"), ("layer_norm1", "layer_norm2")))


def _check_pre_ln_layer(where: str, layer: nn.Module) -> None:
    norms = next((names for parts, names in _PRE_LN_LAYOUTS if all(hasattr(layer, p) for p in parts)), None)
    if norms is None:
        raise TypeError(f"{where} ({type(layer).__name__}) is not a pre-LN ViT, DINOv2, CLIP or SigLIP layer: it "
                        f"lacks {[p for p in _PRE_LN_LAYOUTS[0][0] if not hasattr(layer, p)]}")
    for name in norms:
        check_norm(f"{where}.{name}", getattr(layer, name))


def _checkpointing(layer: nn.Module, owner: nn.Module) -> bool:
    """Whether the model's loop recomputes this layer (the flag is the layer's in recent transformers
    versions, the encoder's in older ones)."""
    return layer.training and (getattr(layer, "gradient_checkpointing", False)
                               or getattr(owner, "gradient_checkpointing", False))


def _normalised_input(layer: nn.Module, norm_before: nn.LayerNorm, hidden_states: torch.Tensor) -> torch.Tensor:
    """``norm_before(hidden_states)``: the value the previous layer handed over, else (the stack's first
    layer, or a layer the loop recomputes alone) a layer_norm in the autocast dtype."""
    y = _take_pending(norm_before, hidden_states)
    return add_and_norm(hidden_states, None, norm_before, 1.0, backend=layer.backend)[1] if y is None else y


def _end_layer(layer: nn.Module, mid: torch.Tensor, h: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """The layer's last add, ``alpha * mid + dropout(h)``, fused with the next norm, which keeps the
    normalised value for the next layer (or the final norm); a plain residual_add where nothing follows
    or the loop recomputes the layer alone."""
    owner, next_norm, next_is_output = layer._dres_stream
    a_mlp = layer._dres_alphas[1]
    if next_norm is None or _checkpointing(layer, owner):
        return ops.residual_add(mid, h, alpha=a_mlp, dropout_p=dropout_p, backend=layer.backend)
    out_dtype = _layer_norm_dtype(mid) if next_is_output else None
    out, y_next = _fused_add_norm(mid, h, next_norm, a_mlp, layer.backend, out_dtype, dropout_p)
    next_norm._dres_pending = (out, y_next)
    return out


def _foldable_layer_scales(layer: nn.Module) -> tuple[int, ...]:
    """The branches (1: attention, 2: MLP) of a DINOv2 layer whose LayerScale the converted branch folds into its
    last Linear under torch.compile: the attention where the fused module holds its projection (transformers
    5), the MLP where it is the fused one."""
    if not hasattr(layer, "layer_scale1"):
        return ()
    foldable = []
    if getattr(layer.attention, "_dres_fused", False) and _projection(layer.attention) is not None:
        foldable.append(1)
    if layer._dres_mlp is not None:
        foldable.append(2)
    return tuple(k for k in foldable if isinstance(getattr(getattr(layer, f"layer_scale{k}"), "lambda1", None),
                                                   nn.Parameter))


def _fused_vit_layer_forward(layer: nn.Module, hidden_states: torch.Tensor, *args, **kwargs):
    """The forward of a converted pre-LN layer (``args``/``kwargs``: the attention's, as the model passes them).
    Compiled, a DINOv2 LayerScale the layer folds (``_dres_layer_scale_folded``) scales the branch's last
    Linear's weights, not its output (as :func:`dres.convert_timm_vit` does: eager keeps the multiply, fewer
    launches)."""
    norm_before, attention_module, attention_tail, norm_after, mlp_tail = _pre_ln_parts(layer)
    folded = layer._dres_layer_scale_folded if torch.compiler.is_compiling() else ()
    if 1 in folded:
        kwargs["layer_scale"], attention_tail = layer.layer_scale1.lambda1, layer.drop_path
    mlp_scale = None
    if 2 in folded:
        mlp_scale, mlp_tail = layer.layer_scale2.lambda1, layer.drop_path
    attention = attention_module(_normalised_input(layer, norm_before, hidden_states), *args, **kwargs)
    attention_out = attention[0] if isinstance(attention, tuple) else attention
    h, dropout_p = _branch_end(attention_tail, attention_out)
    mid, y = _fused_add_norm(hidden_states, h, norm_after, layer._dres_alphas[0], layer.backend, dropout_p=dropout_p)
    out = _end_layer(layer, mid, *_branch_end(mlp_tail, _mlp(layer, y, mlp_scale)))
    # transformers < 4.56 returns (hidden_states, attentions...) from a layer; later versions the tensor
    return (out,) + tuple(attention[1:]) if layer._dres_returns_tuple else out


@functools.cache
def _fused_layer_class(cls: type, forward=_fused_vit_layer_forward) -> type:
    """A subclass of the layer's class with the fused ``forward``. A subclass, not a forward set on the
    instance: transformers 5 checkpoints a layer by wrapping its class's forward (as it does for
    FSDP2's subclasses), 4.x in ``__call__``; both then checkpoint the fused forward. The layers of
    the versions that take ``output_attentions`` return a tuple."""
    returns_tuple = "output_attentions" in inspect.signature(cls.forward).parameters
    return type(f"Fused{cls.__name__}", (cls,), {"forward": forward, "_dres_fused": True,
                                                 "_dres_returns_tuple": returns_tuple})


def _base_model(model: nn.Module) -> nn.Module:
    """The base model of a transformers model with a head (``model.vit``, ``model.bert``, ...), else the model."""
    return getattr(model, getattr(model, "base_model_prefix", ""), model)


def _pre_ln_stacks(model: nn.Module) -> list[tuple[nn.Module, nn.ModuleList, Optional[nn.LayerNorm]]]:
    """(the module holding the layer list, the layers, the norm after the last layer) of each stack:
    the encoder's (its norm's output is the model's), and ViTMAEForPreTraining's decoder (its norm
    feeds only ``decoder_pred``)."""
    base = _base_model(model)
    # CLIP's and SigLIP's towers in transformers 4.x
    tower = getattr(base, "vision_model", None) or getattr(base, "text_model", None) or base
    if isinstance(getattr(base, "layers", None), nn.ModuleList):  # transformers 5
        owner, layers = base, base.layers
    elif isinstance(getattr(getattr(base, "encoder", None), "layer", None), nn.ModuleList):
        owner, layers = base.encoder, base.encoder.layer
    elif isinstance(getattr(getattr(tower, "encoder", None), "layers", None), nn.ModuleList):
        # CLIP's post_layernorm sees only the pooled token, so the last add cannot fuse with it (nor,
        # to keep one rule, SigLIP's)
        return [(tower.encoder, tower.encoder.layers, None)]
    else:
        raise TypeError("expected a Hugging Face ViTModel, DeiTModel, ViTMAEModel, Dinov2Model, CLIPVisionModel, "
                        "CLIPTextModel or SiglipVisionModel (or a model with one as its base model), got "
                        f"{type(model).__name__}")
    final_norm = getattr(base, "layernorm", None)
    stacks = [(owner, layers, final_norm if isinstance(final_norm, nn.LayerNorm) else None)]
    decoder = getattr(model, "decoder", None)
    if isinstance(getattr(decoder, "decoder_layers", None), nn.ModuleList):
        stacks.append((decoder, decoder.decoder_layers, decoder.decoder_norm))
    return stacks


def convert_hf_vit(model: nn.Module, alpha_min: float = 1.0, schedule: str = "linspace", per_block: bool = False,
                   backend: Optional[str] = None, fused_mlp: bool = True) -> nn.Module:
    """Make ``model`` (a transformers ViTModel, DeiTModel, ViTMAEModel, Dinov2Model or a model built
    on one: ViTForImageClassification, DeiTForImageClassification, ViTMAEForPreTraining, ...; or a
    CLIPVisionModel, CLIPTextModel, SiglipVisionModel) run its
    residual adds on the fused ops, carrying the stream across layers, q/k/v as one GEMM and the GELU
    MLPs fused; returns the same object. ViTMAEForPreTraining's decoder is converted too, and its
    loss runs :func:`dres.ops.mae_loss`.

    alpha_min / schedule / per_block: decayed shortcuts, :func:`dres.nn.decay_schedule` over the
    encoder's ``2 * num_layers`` residuals (attention, MLP, attention, ...); a decoder's residuals
    keep alpha 1 (MAE decays its encoder). fused_mlp: False keeps HF's MLPs. Weights are not touched.
    """
    stacks = _pre_ln_stacks(model)
    for s, (_, layers, _) in enumerate(stacks):
        if len(layers) == 0:
            raise TypeError(f"{type(model).__name__} has no layers to convert")
        for i, layer in enumerate(layers):
            _check_pre_ln_layer(f"{'decoder ' if s else ''}layer {i}", layer)
        _refuse_second_conversion(layers, "this model")
    for s, (owner, layers, final_norm) in enumerate(stacks):
        next_norms = [_pre_ln_parts(layer)[0] for layer in layers[1:]] + [final_norm]
        alphas = float32_alphas(2 * len(layers), alpha_min if s == 0 else 1.0, schedule, per_block, 2)
        if final_norm is not None:
            final_norm.forward = functools.partial(_handed_norm_forward, final_norm)
        for i, (layer, next_norm) in enumerate(zip(layers, next_norms)):
            layer._dres_alphas = (alphas[2 * i], alphas[2 * i + 1])
            # tuples: not registered as submodules a second time
            layer._dres_stream = (owner, next_norm, s == 0 and i == len(layers) - 1)
            layer._dres_mlp = _mlp_parts(layer) if fused_mlp else None
            layer.backend = backend
            layer.__class__ = _fused_layer_class(type(layer))
            _fuse_attention(_pre_ln_parts(layer)[1], getattr(owner, "config", None) or model.config, backend)
            layer._dres_layer_scale_folded = _foldable_layer_scales(layer)
    _drop_built_masks(model)
    if hasattr(model, "decoder") and hasattr(model, "patchify"):
        _fuse_mae_loss(model)
    gemm_patch_embeddings(model)
    return model


# ---------------------------------------------------------------------------------------------
# ViTMAEForPreTraining's loss


def _mae_forward_loss(model: nn.Module, backend_of: nn.Module, pixel_values: torch.Tensor, pred: torch.Tensor,
                      mask: torch.Tensor, interpolate_pos_encoding: bool = False) -> torch.Tensor:
    """HF's ``forward_loss`` (same patch order, per-patch unbiased norm-pix with eps 1e-6, masked mean)
    as one :func:`dres.ops.mae_loss` read from the pixels, in the backend of ``backend_of`` (an
    encoder layer: set_backend reaches it). Images HF refuses get HF's error; images that need a
    gradient (the op takes them as data) get the loss written out."""
    patch_size, (channels, height, width) = model.config.patch_size, pixel_values.shape[1:]
    if (channels != model.config.num_channels or height % patch_size or width % patch_size
            or (not interpolate_pos_encoding and height != width)):
        model.patchify(pixel_values, interpolate_pos_encoding=interpolate_pos_encoding)  # raises HF's error
    if pixel_values.requires_grad and torch.is_grad_enabled():
        return ops.reference.mae_loss(pred, pixel_values, mask, patch_size, model.config.norm_pix_loss)
    return ops.mae_loss(pred, pixel_values, mask, patch_size, model.config.norm_pix_loss, backend=backend_of.backend)


def _mae_forward(model: nn.Module, pixel_values: Optional[torch.Tensor] = None, noise: Optional[torch.Tensor] = None,
                 interpolate_pos_encoding: Optional[bool] = None, **kwargs):
    """ViTMAEForPreTraining's forward where HF writes the loss inside it (transformers 5): the same
    calls, the loss from ``forward_loss``; ``return_dict`` as HF's ``can_return_tuple`` takes it."""
    return_dict = kwargs.pop("return_dict", None)
    outputs = model.vit(pixel_values, noise=noise, interpolate_pos_encoding=interpolate_pos_encoding, **kwargs)
    logits = model.decoder(outputs.last_hidden_state, outputs.ids_restore,
                           interpolate_pos_encoding=interpolate_pos_encoding).logits
    loss = model.forward_loss(pixel_values, logits, outputs.mask, bool(interpolate_pos_encoding))
    result = inspect.getmodule(type(model)).ViTMAEForPreTrainingOutput(
        loss=loss, logits=logits, mask=outputs.mask, ids_restore=outputs.ids_restore,
        hidden_states=outputs.hidden_states, attentions=outputs.attentions)
    return result if (model.config.return_dict if return_dict is None else return_dict) else result.to_tuple()


def _fuse_mae_loss(model: nn.Module) -> None:
    """Point ViTMAEForPreTraining's loss at :func:`_mae_forward_loss` (instance attributes: its class,
    which transformers keys registries by, stays)."""
    model.forward_loss = functools.partial(_mae_forward_loss, model, _pre_ln_stacks(model)[0][1][0])
    if not hasattr(type(model), "forward_loss"):
        model.forward = functools.partial(_mae_forward, model)


# ---------------------------------------------------------------------------------------------
# BERT (post-LN): each add fused with its own LayerNorm


def _fused_post_ln_forward(module: nn.Module, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
    """``LayerNorm(input_tensor + dropout(dense(hidden_states)))`` (BertSelfOutput, BertOutput) in one op."""
    return _post_ln_add_norm(module, module.dense(hidden_states), input_tensor)


def _post_ln_add_norm(module: nn.Module, h: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
    """``LayerNorm(input_tensor + dropout(h))`` in one op. The normalised value is the stream itself
    (the next sub-layer's input and the layer's output), so it keeps the stream's dtype."""
    h, dropout_p = _branch_end(module.dropout, h)
    return _fused_add_norm(input_tensor, h, module.LayerNorm, module._dres_alpha, module.backend, input_tensor.dtype,
                           dropout_p)[1]


def _fused_feed_forward(layer: nn.Module, fc1: nn.Linear, fc2: nn.Linear, approximate: str,
                        attention_output: torch.Tensor) -> torch.Tensor:
    """A BertLayer's ``feed_forward_chunk`` with ``intermediate`` and ``output.dense`` as one fused MLP."""
    return _post_ln_add_norm(layer.output, fused_mlp_of(attention_output, fc1, fc2, approximate, layer.output.backend),
                             attention_output)


def _bert_residual_modules(layer: nn.Module) -> list[nn.Module]:
    """A BertLayer's add-and-norm modules in execution order: self-attention, cross-attention, FFN."""
    attentions = [getattr(layer, name, None) for name in ("attention", "crossattention")]
    return [a.output for a in attentions if a is not None] + [layer.output]


def convert_hf_bert(model: nn.Module, alpha_min: float = 1.0, schedule: str = "linspace", per_block: bool = False,
                    backend: Optional[str] = None, fused_mlp: bool = True, aligned_head: bool = True) -> nn.Module:
    """Make ``model`` (a transformers BertModel, BertForMaskedLM, ...) compute every residual add and
    the LayerNorm after it in one fused op, q/k/v as one GEMM and a GELU feed-forward as the fused
    MLP; returns the same object.

    alpha_min / schedule / per_block: decayed shortcuts ``LN(alpha*x + f(x))``,
    :func:`dres.nn.decay_schedule` over the residuals in execution order (per_block: one alpha per
    layer). fused_mlp: False keeps HF's feed-forward. aligned_head: the masked-LM head's output rows
    aligned (:class:`dres.convert.AlignedLinear`); False keeps HF's Linear. Weights are not touched.
    """
    base = _base_model(model)
    layers = getattr(getattr(base, "encoder", None), "layer", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise TypeError(f"expected a Hugging Face BertModel (or a model with one as `bert`), got {type(model).__name__}")
    residuals = []
    for i, layer in enumerate(layers):
        if not (hasattr(layer, "attention") and hasattr(layer, "output")):
            raise TypeError(f"layer {i} ({type(layer).__name__}) is not a BertLayer: lacks attention or output")
        for module in _bert_residual_modules(layer):
            where = f"layer {i} {type(module).__name__}"
            missing = [p for p in ("dense", "dropout", "LayerNorm") if not hasattr(module, p)]
            if missing:
                raise TypeError(f"{where} lacks {missing}: not a post-LN add-and-norm module")
            check_norm(f"{where}.LayerNorm", module.LayerNorm)
            residuals.append(module)
    _refuse_second_conversion(residuals, "this model")
    alphas = float32_alphas(len(residuals), alpha_min, schedule, per_block, len(residuals) // len(layers))
    for module, alpha in zip(residuals, alphas):
        module._dres_alpha = alpha
        module.backend = backend
        module._dres_fused = True  # dres.nn.set_backend finds the module by this
        module.forward = functools.partial(_fused_post_ln_forward, module)
    for layer in layers:
        _fuse_attention(layer.attention, model.config, backend)
        mlp = _mlp_parts(layer) if fused_mlp else None
        if mlp is not None:
            layer.feed_forward_chunk = functools.partial(_fused_feed_forward, layer, *mlp)
    _drop_built_masks(model)
    if aligned_head:
        align_output_head(model)
    return model


# ---------------------------------------------------------------------------------------------
# GPT-2 (pre-LN, causal): the carry across blocks around HF's own attention

_GPT2_BLOCK_PARTS = ("ln_1", "attn", "ln_2", "mlp")
_GPT2_MLP_PARTS = ("c_fc", "act", "c_proj", "dropout")


def _gpt2_stack(model: nn.Module) -> tuple[nn.Module, nn.ModuleList, nn.LayerNorm]:
    """(GPT2Model, its blocks ``h``, its final norm ``ln_f``) of a GPT2Model or a model built on one."""
    base = _base_model(model)
    blocks, final_norm = getattr(base, "h", None), getattr(base, "ln_f", None)
    if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0 or final_norm is None:
        raise TypeError(f"expected a Hugging Face GPT2Model (or a model with one as `transformer`), got "
                        f"{type(model).__name__}")
    return base, blocks, final_norm


def _check_gpt2_block(i: int, block: nn.Module) -> None:
    mlp = getattr(block, "mlp", None)
    missing = ([p for p in _GPT2_BLOCK_PARTS if not hasattr(block, p)]
               + [f"mlp.{p}" for p in _GPT2_MLP_PARTS if not hasattr(mlp, p)])
    if missing:
        raise TypeError(f"block {i} ({type(block).__name__}) is not a GPT2Block: it lacks {missing}")
    if hasattr(block, "crossattention"):
        raise TypeError(f"block {i} has cross-attention (add_cross_attention=True), which convert_hf_gpt2 does "
                        f"not convert")
    for name in ("ln_1", "ln_2"):
        check_norm(f"block {i}.{name}", getattr(block, name))


def _gpt2_mlp_approximate(mlp: nn.Module) -> Optional[str]:
    """The GELU (``F.gelu``'s ``approximate``) of a GPT2MLP whose c_fc and c_proj are HF's Conv1D; None
    when the fused MLP cannot compute it (another activation)."""
    from transformers.pytorch_utils import Conv1D

    if not (isinstance(mlp.c_fc, Conv1D) and isinstance(mlp.c_proj, Conv1D) and isinstance(mlp.act, nn.Module)):
        return None
    return gelu_approximate(mlp.act, _hf_gelu_types())


def _gpt2_mlp(block: nn.Module, y: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``(h, p)``: the block's GPT2MLP on y, c_fc, GELU and c_proj as one fused MLP where conversion found
    it fusable (a Conv1D weight is (in, out): its transpose is the op's (out, in)), its dropout left to
    the add after it (:func:`_branch_end`)."""
    mlp = block.mlp
    if block._dres_mlp is None:
        return mlp(y), 0.0
    h = ops.fused_mlp(y, mlp.c_fc.weight.t(), mlp.c_fc.bias, mlp.c_proj.weight.t(), mlp.c_proj.bias,
                      backend=block.backend, approximate=block._dres_mlp)
    return _branch_end(mlp.dropout, h)


def _fused_gpt2_block_forward(block: nn.Module, hidden_states: torch.Tensor, *args, **kwargs):
    """The forward of a converted GPT2Block (``args``/``kwargs``: the block's, named per transformers
    version): HF's attention on the handed-over ``ln_1`` value with every argument but the encoder's
    (cache, mask, ``output_attentions``), its add fused with ``ln_2``, the MLP's add with the next norm."""
    named = dict(zip(block._dres_arg_names, args), **kwargs)
    if named.pop("encoder_hidden_states", None) is not None:  # HF's block refuses them too
        raise ValueError("encoder_hidden_states given, but this GPT-2 has no cross-attention layers")
    named.pop("encoder_attention_mask", None)
    attention = block.attn(_normalised_input(block, block.ln_1, hidden_states), **named)
    mid, y = _fused_add_norm(hidden_states, attention[0], block.ln_2, block._dres_alphas[0], block.backend,
                             dropout_p=_deferred_dropout_p(getattr(block.attn, "resid_dropout", None)))
    out = _end_layer(block, mid, *_gpt2_mlp(block, y))
    if not block._dres_returns_tuple:  # transformers 5
        return out
    if "layer_past" in block._dres_arg_names:  # 4.46: (output, present, probabilities...), present with use_cache
        return (out,) + attention[1 if named.get("use_cache") else 2:]
    return (out, attention[1]) if named.get("output_attentions") else (out,)


def convert_hf_gpt2(model: nn.Module, alpha_min: float = 1.0, schedule: str = "linspace", per_block: bool = False,
                    backend: Optional[str] = None, fused_mlp: bool = True, aligned_head: bool = True) -> nn.Module:
    """Make ``model`` (a transformers GPT2Model, GPT2LMHeadModel or another model built on one) run its
    residual adds on the fused ops, carrying the stream across blocks (the last add fused with
    ``ln_f``), and its GELU MLPs as :func:`dres.ops.fused_mlp`; returns the same object. Attention
    stays HF's (module docstring); models with cross-attention are refused.

    alpha_min / schedule / per_block: decayed shortcuts, :func:`dres.nn.decay_schedule` over the
    ``2 * n_layer`` residuals (attention, MLP, attention, ...). fused_mlp: False keeps HF's MLPs.
    aligned_head: the LM head's output rows aligned (:class:`dres.convert.AlignedLinear`); False keeps HF's
    Linear. Weights are not touched. The residual dropout of each branch (the attention's ``resid_dropout``,
    re-classed :class:`DropoutInNextAdd`, and the MLP's) is drawn inside the fused add after it.
    """
    base, blocks, final_norm = _gpt2_stack(model)
    for i, block in enumerate(blocks):
        _check_gpt2_block(i, block)
    check_norm("ln_f", final_norm)
    _refuse_second_conversion(blocks, "this model")
    alphas = float32_alphas(2 * len(blocks), alpha_min, schedule, per_block, 2)
    final_norm.forward = functools.partial(_handed_norm_forward, final_norm)
    next_norms = [block.ln_1 for block in blocks[1:]] + [final_norm]
    for i, (block, next_norm) in enumerate(zip(blocks, next_norms)):
        block._dres_alphas = (alphas[2 * i], alphas[2 * i + 1])
        block._dres_stream = (base, next_norm, i == len(blocks) - 1)  # a tuple: no second registration
        block._dres_mlp = _gpt2_mlp_approximate(block.mlp) if fused_mlp else None
        block._dres_arg_names = tuple(inspect.signature(type(block).forward).parameters)[2:]
        block.backend = backend
        if type(getattr(block.attn, "resid_dropout", None)) is nn.Dropout:  # its mask drawn by the add after it
            block.attn.resid_dropout.__class__ = DropoutInNextAdd
        block.__class__ = _fused_layer_class(type(block), _fused_gpt2_block_forward)
    if aligned_head:
        align_output_head(model)
    return model
