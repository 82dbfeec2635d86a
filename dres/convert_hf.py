"""Convert Hugging Face transformers encoders in place to the fused residual ops, keeping their weights.

``convert_hf_vit(model)`` (ViTModel and the ViT heads built on it: pre-LN). Every ``ViTLayer``
computes its two residual adds as :func:`dres.ops.residual_layer_norm` calls, each fused with the
LayerNorm that follows it::

    mid, y      = residual_layer_norm(x,   attention(layernorm_before(x)), layernorm_after, a_2k)
    out, y_next = residual_layer_norm(mid, mlp(y),                        next_norm,       a_2k+1)

``next_norm`` is the next layer's ``layernorm_before`` (the model's final ``layernorm`` after the
last layer), so the residual stream is carried across layers with one op per add, as in
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
    pending = norm.__dict__.pop("_dres_pending", None)
    if pending is not None and pending[0] is x:
        return pending[1]
    return nn.LayerNorm.forward(norm, x)


def _vit_branches(layer: nn.Module):
    """(attention branch tail, MLP branch) of a ViTLayer: transformers 5 has ``mlp`` and a layer
    ``dropout``; 4.x has ``intermediate`` and ``output`` (whose forward also adds the residual)."""
    if hasattr(layer, "mlp"):
        return layer.dropout, lambda y: layer.dropout(layer.mlp(y))
    return (lambda h: h), lambda y: layer.output.dropout(layer.output.dense(layer.intermediate(y)))


def _checkpointing(layer: nn.Module, owner: nn.Module) -> bool:
    """Whether the model's loop recomputes this layer (the flag is the layer's in recent transformers
    versions, the encoder's in older ones)."""
    return layer.training and (getattr(layer, "gradient_checkpointing", False)
                               or getattr(owner, "gradient_checkpointing", False))


def _fused_vit_layer_forward(layer: nn.Module, hidden_states: torch.Tensor, *args, **kwargs):
    """The forward of a converted ViTLayer (``args``/``kwargs``: the attention's, as the model passes them)."""
    owner, next_norm = layer._dres_stream
    a_attention, a_mlp = layer._dres_alphas
    attention_tail, mlp_branch = _vit_branches(layer)
    attention = layer.attention(layer.layernorm_before(hidden_states), *args, **kwargs)
    attention_out = attention[0] if isinstance(attention, tuple) else attention
    mid, y = _fused_add_norm(hidden_states, attention_tail(attention_out), layer.layernorm_after, a_attention,
                             layer.backend)
    h = mlp_branch(y)
    if next_norm is None or _checkpointing(layer, owner):
        out = ops.residual_add(mid, h, alpha=a_mlp, backend=layer.backend)
    else:
        out, y_next = _fused_add_norm(mid, h, next_norm, a_mlp, layer.backend)
        next_norm._dres_pending = (out, y_next)
    # transformers < 4.56 returns (hidden_states, attentions...) from a layer; later versions the tensor
    if isinstance(attention, tuple) and not hasattr(layer, "mlp"):
        return (out,) + tuple(attention[1:])
    return out


@functools.cache
def _fused_layer_class(cls: type) -> type:
    """A subclass of the layer's class with the fused forward. A subclass, not a forward set on the
    instance: transformers 5 checkpoints a layer by wrapping its class's forward (as it does for
    FSDP2's subclasses), 4.x in ``__call__``; both then checkpoint the fused forward."""
    return type(f"Fused{cls.__name__}", (cls,), {"forward": _fused_vit_layer_forward, "_dres_fused": True})


def _vit_layers(model: nn.Module) -> tuple[nn.Module, nn.Module, nn.ModuleList]:
    """(the ViTModel, the module holding the layer list, the layers)."""
    vit = getattr(model, "vit", model)
    if isinstance(getattr(vit, "layers", None), nn.ModuleList):  # transformers 5
        return vit, vit, vit.layers
    encoder = getattr(vit, "encoder", None)
    if isinstance(getattr(encoder, "layer", None), nn.ModuleList):
        return vit, encoder, encoder.layer
    raise TypeError(f"expected a Hugging Face ViTModel (or a model with one as `vit`), got {type(model).__name__}")


def convert_hf_vit(model: nn.Module, alpha_min: float = 1.0, schedule: str = "linspace", per_block: bool = False,
                   backend: Optional[str] = None) -> nn.Module:
    """Make ``model`` (a transformers ViTModel, ViTForImageClassification, ...) run its residual adds
    on the fused ops, carrying the stream across layers; returns the same object.

    alpha_min / schedule / per_block: decayed shortcuts, :func:`dres.nn.decay_schedule` over the
    ``2 * num_layers`` residuals (attention, MLP, attention, ...). Weights are not touched.
    """
    vit, owner, layers = _vit_layers(model)
    if len(layers) == 0:
        raise TypeError(f"{type(model).__name__} has no layers to convert")
    for i, layer in enumerate(layers):
        missing = [p for p in ("layernorm_before", "attention", "layernorm_after") if not hasattr(layer, p)]
        if missing or not (hasattr(layer, "mlp") or hasattr(layer, "intermediate")):
            raise TypeError(f"layer {i} ({type(layer).__name__}) is not a pre-LN ViTLayer: lacks "
                            f"{missing or ['mlp or intermediate/output']}")
        check_norm(f"layer {i}.layernorm_before", layer.layernorm_before)
        check_norm(f"layer {i}.layernorm_after", layer.layernorm_after)
    _refuse_second_conversion(layers, "this model")
    final_norm = getattr(vit, "layernorm", None)
    next_norms = [layer.layernorm_before for layer in layers[1:]]
    next_norms.append(final_norm if isinstance(final_norm, nn.LayerNorm) else None)
    alphas = float32_alphas(2 * len(layers), alpha_min, schedule, per_block, 2)
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
    base = getattr(model, getattr(model, "base_model_prefix", ""), model)
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
