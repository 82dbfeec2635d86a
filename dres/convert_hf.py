"""Convert Hugging Face transformers encoders in place to the fused residual ops, keeping their weights.

``convert_hf_vit(model)`` (the pre-LN ViTs: ViTModel, DeiTModel, ViTMAEModel, Dinov2Model and the
models built on them, ViTMAEForPreTraining's decoder included). Every layer (``ViTLayer``,
``DeiTLayer``, ``ViTMAELayer``, ``Dinov2Layer`` with its LayerScale and DropPath) computes its two
residual adds as :func:`dres.ops.residual_layer_norm` calls, each fused with the LayerNorm that
follows it (ViT's names below; DINOv2's are ``norm1``/``norm2``)::

    mid, y      = residual_layer_norm(x,   attention(layernorm_before(x)), layernorm_after, a_2k)
    out, y_next = residual_layer_norm(mid, mlp(y),                        next_norm,       a_2k+1)

``next_norm`` is the next layer's ``layernorm_before`` (the model's final ``layernorm`` after the
last layer, the decoder's ``decoder_norm`` after the decoder's), so the residual stream is carried across layers with one op per add, as in
:class:`dres.nn.TransformerStack`. The model's own loop stays in charge (it differs between
transformers versions and records hidden states and attentions): layer k returns ``out`` and leaves
``y_next`` with ``next_norm``, whose forward returns it when called on that very ``out`` tensor and
is an ordinary LayerNorm on any other input. Under gradient checkpointing in training (which
recomputes layers one at a time) layers end with a plain :func:`dres.ops.residual_add` instead.

``convert_hf_bert(model)`` (BertModel and its heads; RoBERTa-style encoders with the same modules
too: post-LN). A BERT layer computes ``a = LN1(x + attn(x))`` and ``out = LN2(a + ffn(a))``: each add
is followed by its own LayerNorm inside the same submodule (``BertSelfOutput``, ``BertOutput``), and
the normalised value is the stream the next sub-layer and the next layer receive. That is exactly the
fused op's ``y``; its ``out`` (the un-normalised sum) is needed only by the backward. So both adds of
every layer are fused and nothing is carried across layers: there is no pending add between layers
of a post-LN encoder. (The embeddings' LayerNorm, after a sum of three embeddings, stays PyTorch's.)

Both converters keep parameters, their names and the ``state_dict``; ``alpha_min=1`` (the default)
keeps the function: outputs and gradients equal the unconverted model's. ``y`` takes the stream's
dtype, as torch's LayerNorm does under autocast. ``backend`` is that of :mod:`dres.ops`
(:func:`dres.nn.set_backend` changes it later). A model is converted once.
"""

from __future__ import annotations

import functools
import inspect
from typing import Optional

import torch
from torch import nn

from dres import ops
from dres.convert import check_norm, float32_alphas

__all__ = ["convert_hf_vit", "convert_hf_bert"]


def _refuse_second_conversion(modules, what: str) -> None:
    if any(getattr(m, "_dres_fused", False) for m in modules):
        raise ValueError(f"{what} is already converted")


def _fused_add_norm(x: torch.Tensor, h: torch.Tensor, norm: nn.LayerNorm, alpha: float, backend: Optional[str]):
    """``(alpha*x + h, norm(alpha*x + h))`` in one op; the normalised value in the stream's dtype."""
    return ops.residual_layer_norm(x, h, norm.weight, norm.bias, alpha=alpha, eps=norm.eps, out_dtype=x.dtype,
                                   backend=backend)


# ---------------------------------------------------------------------------------------------
# ViT (pre-LN): the carry across layers


def _handed_norm_forward(norm: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """A LayerNorm that returns the value the previous layer computed fused with its last add, when
    called on that layer's output; otherwise (and when nothing was left) its ordinary forward."""
    pending = getattr(norm, "_dres_pending", None)
    if pending is not None:
        norm._dres_pending = None  # taken once (torch 2.11's Dynamo cannot trace a pop of the module's __dict__)
        if pending[0] is x:
            return pending[1]
    return nn.LayerNorm.forward(norm, x)


def _pre_ln_parts(layer: nn.Module):
    """(norm before the attention, attention branch tail, norm after it, MLP branch) of a pre-LN layer.
    ViT's names (DeiT, ViTMAE): transformers 5 has ``mlp`` and a layer ``dropout``, 4.x ``intermediate``
    and ``output`` (whose forward also adds the residual); DINOv2's: ``norm1``/``norm2`` with
    LayerScale and DropPath ending each branch."""
    if hasattr(layer, "norm1"):
        return (layer.norm1, lambda h: layer.drop_path(layer.layer_scale1(h)), layer.norm2,
                lambda y: layer.drop_path(layer.layer_scale2(layer.mlp(y))))
    if hasattr(layer, "mlp"):
        return layer.layernorm_before, layer.dropout, layer.layernorm_after, lambda y: layer.dropout(layer.mlp(y))
    return (layer.layernorm_before, lambda h: h, layer.layernorm_after,
            lambda y: layer.output.dropout(layer.output.dense(layer.intermediate(y))))


_PRE_LN_LAYOUTS = (("layernorm_before", "attention", "layernorm_after", "mlp", "dropout"),
                   ("layernorm_before", "attention", "layernorm_after", "intermediate", "output"),
                   ("norm1", "attention", "layer_scale1", "drop_path", "norm2", "mlp", "layer_scale2"))


def _check_pre_ln_layer(where: str, layer: nn.Module) -> None:
    if not any(all(hasattr(layer, part) for part in layout) for layout in _PRE_LN_LAYOUTS):
        raise TypeError(f"{where} ({type(layer).__name__}) is not a pre-LN ViT or DINOv2 layer: it lacks "
                        f"{[p for p in _PRE_LN_LAYOUTS[0] if not hasattr(layer, p)]}")
    for name in ("norm1", "norm2") if hasattr(layer, "norm1") else ("layernorm_before", "layernorm_after"):
        check_norm(f"{where}.{name}", getattr(layer, name))


def _checkpointing(layer: nn.Module, owner: nn.Module) -> bool:
    """Whether the model's loop recomputes this layer (the flag is the layer's in recent transformers
    versions, the encoder's in older ones)."""
    return layer.training and (getattr(layer, "gradient_checkpointing", False)
                               or getattr(owner, "gradient_checkpointing", False))


def _fused_vit_layer_forward(layer: nn.Module, hidden_states: torch.Tensor, *args, **kwargs):
    """The forward of a converted pre-LN layer (``args``/``kwargs``: the attention's, as the model passes them)."""
    owner, next_norm = layer._dres_stream
    a_attention, a_mlp = layer._dres_alphas
    norm_before, attention_tail, norm_after, mlp_branch = _pre_ln_parts(layer)
    attention = layer.attention(norm_before(hidden_states), *args, **kwargs)
    attention_out = attention[0] if isinstance(attention, tuple) else attention
    mid, y = _fused_add_norm(hidden_states, attention_tail(attention_out), norm_after, a_attention, layer.backend)
    h = mlp_branch(y)
    if next_norm is None or _checkpointing(layer, owner):
        out = ops.residual_add(mid, h, alpha=a_mlp, backend=layer.backend)
    else:
        out, y_next = _fused_add_norm(mid, h, next_norm, a_mlp, layer.backend)
        next_norm._dres_pending = (out, y_next)
    # transformers < 4.56 returns (hidden_states, attentions...) from a layer; later versions the tensor
    return (out,) + tuple(attention[1:]) if layer._dres_returns_tuple else out


@functools.cache
def _fused_layer_class(cls: type) -> type:
    """A subclass of the layer's class with the fused forward. A subclass, not a forward set on the
    instance: transformers 5 checkpoints a layer by wrapping its class's forward (as it does for
    FSDP2's subclasses), 4.x in ``__call__``; both then checkpoint the fused forward. The layers of
    the versions that take ``output_attentions`` return a tuple."""
    returns_tuple = "output_attentions" in inspect.signature(cls.forward).parameters
    return type(f"Fused{cls.__name__}", (cls,), {"forward": _fused_vit_layer_forward, "_dres_fused": True,
                                                 "_dres_returns_tuple": returns_tuple})


def _base_model(model: nn.Module) -> nn.Module:
    """The base model of a transformers model with a head (``model.vit``, ``model.bert``, ...), else the model."""
    return getattr(model, getattr(model, "base_model_prefix", ""), model)


def _pre_ln_stacks(model: nn.Module) -> list[tuple[nn.Module, nn.ModuleList, Optional[nn.LayerNorm]]]:
    """(the module holding the layer list, the layers, the norm after the last layer) of each stack:
    the encoder's, and ViTMAEForPreTraining's decoder."""
    base = _base_model(model)
    if isinstance(getattr(base, "layers", None), nn.ModuleList):  # transformers 5
        owner, layers = base, base.layers
    elif isinstance(getattr(getattr(base, "encoder", None), "layer", None), nn.ModuleList):
        owner, layers = base.encoder, base.encoder.layer
    else:
        raise TypeError("expected a Hugging Face ViTModel, DeiTModel, ViTMAEModel or Dinov2Model (or a model with one "
                        f"as its base model), got {type(model).__name__}")
    final_norm = getattr(base, "layernorm", None)
    stacks = [(owner, layers, final_norm if isinstance(final_norm, nn.LayerNorm) else None)]
    decoder = getattr(model, "decoder", None)
    if isinstance(getattr(decoder, "decoder_layers", None), nn.ModuleList):
        stacks.append((decoder, decoder.decoder_layers, decoder.decoder_norm))
    return stacks


def convert_hf_vit(model: nn.Module, alpha_min: float = 1.0, schedule: str = "linspace", per_block: bool = False,
                   backend: Optional[str] = None) -> nn.Module:
    """Make ``model`` (a transformers ViTModel, DeiTModel, ViTMAEModel, Dinov2Model or a model built
    on one: ViTForImageClassification, DeiTForImageClassification, ViTMAEForPreTraining, ...) run its
    residual adds on the fused ops, carrying the stream across layers; returns the same object.
    ViTMAEForPreTraining's decoder is converted too.

    alpha_min / schedule / per_block: decayed shortcuts, :func:`dres.nn.decay_schedule` over the
    encoder's ``2 * num_layers`` residuals (attention, MLP, attention, ...); a decoder's residuals
    keep alpha 1 (MAE decays its encoder). Weights are not touched.
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
        for i, (layer, next_norm) in enumerate(zip(layers, next_norms)):
            if next_norm is not None:
                next_norm.forward = functools.partial(_handed_norm_forward, next_norm)
            layer._dres_alphas = (alphas[2 * i], alphas[2 * i + 1])
            layer._dres_stream = (owner, next_norm)  # a tuple: not registered as submodules a second time
            layer.backend = backend
            layer.__class__ = _fused_layer_class(type(layer))
    return model


# ---------------------------------------------------------------------------------------------
# BERT (post-LN): each add fused with its own LayerNorm


def _fused_post_ln_forward(module: nn.Module, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
    """``LayerNorm(input_tensor + dropout(dense(hidden_states)))`` (BertSelfOutput, BertOutput) in one op."""
    h = module.dropout(module.dense(hidden_states))
    return _fused_add_norm(input_tensor, h, module.LayerNorm, module._dres_alpha, module.backend)[1]


def _bert_residual_modules(layer: nn.Module) -> list[nn.Module]:
    """A BertLayer's add-and-norm modules in execution order: self-attention, cross-attention, FFN."""
    attentions = [getattr(layer, name, None) for name in ("attention", "crossattention")]
    return [a.output for a in attentions if a is not None] + [layer.output]


def convert_hf_bert(model: nn.Module, alpha_min: float = 1.0, schedule: str = "linspace", per_block: bool = False,
                    backend: Optional[str] = None) -> nn.Module:
    """Make ``model`` (a transformers BertModel, BertForMaskedLM, ...) compute every residual add and
    the LayerNorm after it in one fused op; returns the same object.

    alpha_min / schedule / per_block: decayed shortcuts ``LN(alpha*x + f(x))``,
    :func:`dres.nn.decay_schedule` over the residuals in execution order (per_block: one alpha per
    layer). Weights are not touched.
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
    return model
