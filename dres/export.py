"""A trained dres ViT classifier or MAE out to timm, Hugging Face transformers or safetensors.

``export_model(model, to, out)`` writes a model into one folder; a ``dres-train`` run folder's model goes out
with ``dres-export RUN --to timm|hf|safetensors`` or :func:`dres.train.export.export_run` (the trainer's side,
which reads the run):

* ``timm``: timm's folder layout, ``config.json`` (``architecture`` and the ``model_args`` of the
  ``VisionTransformer`` that :func:`dres.convert.timm_vit_kwargs` gives) and ``pytorch_model.bin`` (the
  weights under timm's names, :func:`dres.convert.export_timm_state_dict`): ``timm.create_model("local-dir:DIR")``
  builds and loads it. An MAE exports its encoder (any variant; the official one without a final norm).
* ``hf``: a ``save_pretrained`` folder that ``from_pretrained`` loads: ``ViTForImageClassification`` (a
  ViTModel with a head on the class token) for a classifier, ``ViTMAEForPreTraining`` for the MAE variant HF
  has, ``baseline``; the ``official`` and ``paper`` decoders (skip layers from the encoder) are refused.
* ``safetensors``: ``model.safetensors``, the dres model's own ``state_dict`` (every variant, decoder and
  skips included; the drop-path controller's state left out), which ``load_state_dict`` takes back into
  the model built with the same arguments; its metadata names the class and the alphas.

timm's and HF's models add their residuals with alpha 1: a model with decayed shortcuts (an alpha below 1)
is refused for those two formats, since neither config can express it (safetensors keeps it).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from dres.convert import export_timm_state_dict, timm_vit_kwargs
from dres.optional import import_optional

FORMATS = ("timm", "hf", "safetensors")
TIMM_WEIGHTS, SAFETENSORS_FILE = "pytorch_model.bin", "model.safetensors"


class ExportError(ValueError):
    """A model, format or folder that the export cannot take: one line naming what."""


def _stacks(model: nn.Module) -> list[nn.Module]:
    """The model's transformer stacks: the encoder's, and an MAE's decoder."""
    from dres.models import MAE, ViTClassifier

    if isinstance(model, (MAE, ViTClassifier)):
        return [model.encoder.transformer] + ([model.decoder] if isinstance(model, MAE) else [])
    raise ExportError(f"model: expected a dres ViTClassifier or MAE, got {type(model).__name__}")


def _alphas(model: nn.Module) -> list[float]:
    return [a for stack in _stacks(model) for a in stack.alphas.tolist()]


def _refuse_decayed(model: nn.Module, to: str) -> None:
    low = min(_alphas(model))
    if low < 1.0:
        raise ExportError(f"--to {to}: the model has decayed shortcuts (alphas down to {low:.4g}), which "
                          f"{'timm' if to == 'timm' else 'Hugging Face'}'s config cannot express (its residuals add "
                          "with alpha 1); --to safetensors keeps them")


# ---------------------------------------------------------------------------------------------
# timm


def _encoder(model: nn.Module) -> nn.Module:
    """What timm's VisionTransformer holds: a classifier whole, an MAE's encoder."""
    from dres.models import MAE

    return model.encoder if isinstance(model, MAE) else model


def _write_timm(model: nn.Module, out: Path) -> None:
    _refuse_decayed(model, "timm")
    vit = _encoder(model)
    kwargs = timm_vit_kwargs(vit)
    config = {"architecture": "vit_base_patch16_224",  # an entry point of timm's ViT; model_args set every size
              "num_classes": kwargs["num_classes"], "num_features": kwargs["embed_dim"],
              "global_pool": kwargs["global_pool"], "model_args": kwargs,
              "pretrained_cfg": {"input_size": [kwargs["in_chans"], kwargs["img_size"], kwargs["img_size"]],
                                 "fixed_input_size": True, "num_classes": kwargs["num_classes"]}}
    torch.save(export_timm_state_dict(vit), out / TIMM_WEIGHTS)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------
# Hugging Face transformers


def _hf_blocks(state: dict, dres_prefix: str, hf_prefix: str, depth: int) -> dict[str, torch.Tensor]:
    """A dres stack's blocks under transformers 5's names of a pre-LN ViT layer (qkv split in three)."""
    out = {}
    for i in range(depth):
        src, dst = f"{dres_prefix}{i}.", f"{hf_prefix}{i}."
        for kind in ("weight", "bias"):
            q, k, v = state[f"{src}attn.qkv.{kind}"].chunk(3)
            out.update({f"{dst}attention.q_proj.{kind}": q, f"{dst}attention.k_proj.{kind}": k,
                        f"{dst}attention.v_proj.{kind}": v,
                        f"{dst}attention.o_proj.{kind}": state[f"{src}attn.proj.{kind}"],
                        f"{dst}layernorm_before.{kind}": state[f"{src}norm1.{kind}"],
                        f"{dst}layernorm_after.{kind}": state[f"{src}norm2.{kind}"],
                        f"{dst}mlp.fc1.{kind}": state[f"{src}mlp.fc1.{kind}"],
                        f"{dst}mlp.fc2.{kind}": state[f"{src}mlp.fc2.{kind}"]})
    return out


# transformers 4.x names of the same parameters (its from_pretrained reads only those)
_HF4_NAMES = (("vit.layers.", "vit.encoder.layer."), (".attention.q_proj.", ".attention.attention.query."),
              (".attention.k_proj.", ".attention.attention.key."), (".attention.v_proj.", ".attention.attention.value."),
              (".attention.o_proj.", ".attention.output.dense."), (".mlp.fc1.", ".intermediate.dense."),
              (".mlp.fc2.", ".output.dense."))


def _in_hf_names(state: dict[str, torch.Tensor], hf_model: nn.Module) -> dict[str, torch.Tensor]:
    """``state`` (transformers 5's names) under the names of the installed version's model."""
    if "vit.layers.0.layernorm_before.weight" in hf_model.state_dict():
        return state
    renamed = {}
    for key, value in state.items():
        for new, old in _HF4_NAMES:
            key = key.replace(new, old)
        renamed[key] = value
    return renamed


def _hf_encoder_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The encoder of a classifier or MAE (``model.encoder``) under HF's ViT names."""
    state = model.state_dict()
    prefix = "encoder."
    encoder = {"vit.embeddings.cls_token": state[prefix + "cls_token"],
               "vit.embeddings.position_embeddings": state[prefix + "pos_embed"],
               "vit.embeddings.patch_embeddings.projection.weight": state[prefix + "patch_embed.proj.weight"],
               "vit.embeddings.patch_embeddings.projection.bias": state[prefix + "patch_embed.proj.bias"],
               "vit.layernorm.weight": state[prefix + "transformer.norm.weight"],
               "vit.layernorm.bias": state[prefix + "transformer.norm.bias"]}
    encoder.update(_hf_blocks(state, prefix + "transformer.blocks.", "vit.layers.", model.encoder.depth))
    return encoder


def _hf_common_config(encoder: nn.Module) -> dict:
    """The ViTConfig / ViTMAEConfig arguments of a dres ViTEncoder."""
    blk = encoder.transformer.blocks[0]
    return dict(hidden_size=encoder.embed_dim, num_hidden_layers=encoder.depth, num_attention_heads=blk.attn.num_heads,
                intermediate_size=blk.mlp.fc1.out_features, image_size=encoder.patch_embed.img_size,
                patch_size=encoder.patch_embed.patch_size, num_channels=encoder.patch_embed.proj.in_channels,
                qkv_bias=blk.attn.qkv.bias is not None, layer_norm_eps=blk.norm1.eps,
                hidden_act="gelu_pytorch_tanh" if blk.mlp.act.approximate == "tanh" else "gelu",
                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _hf_classifier(model: nn.Module, transformers) -> tuple[nn.Module, dict]:
    if model.global_pool != "cls":
        raise ExportError("--to hf: the classifier pools the mean patch token (global_pool='avg'); "
                          "ViTForImageClassification reads the class token")
    config = transformers.ViTConfig(**_hf_common_config(model.encoder), num_labels=model.head.out_features)
    state = _hf_encoder_state(model)
    state.update({"classifier.weight": model.head.weight, "classifier.bias": model.head.bias})
    return transformers.ViTForImageClassification(config), state


def _hf_mae(model: nn.Module, transformers) -> tuple[nn.Module, dict]:
    if model.variant != "baseline":
        raise ExportError(f"--to hf: the MAE variant {model.variant!r} has skip layers from the encoder into the "
                          "decoder, which ViTMAEForPreTraining lacks; only 'baseline' exports (--to safetensors "
                          "keeps every variant)")
    blk = model.decoder.blocks[0]
    config = transformers.ViTMAEConfig(
        **_hf_common_config(model.encoder), decoder_hidden_size=blk.norm1.normalized_shape[0],
        decoder_num_hidden_layers=len(model.decoder.blocks), decoder_num_attention_heads=blk.attn.num_heads,
        decoder_intermediate_size=blk.mlp.fc1.out_features, mask_ratio=model.mask_ratio,
        norm_pix_loss=model.norm_pix_loss)
    state = _hf_encoder_state(model)
    dres_state = model.state_dict()
    state.update({"decoder.mask_token": dres_state["mask_token"],
                  "decoder.decoder_pos_embed": dres_state["decoder_pos_embed"],
                  "decoder.decoder_embed.weight": dres_state["decoder_embed.weight"],
                  "decoder.decoder_embed.bias": dres_state["decoder_embed.bias"],
                  "decoder.decoder_norm.weight": dres_state["decoder.norm.weight"],
                  "decoder.decoder_norm.bias": dres_state["decoder.norm.bias"],
                  "decoder.decoder_pred.weight": dres_state["decoder_pred.weight"],
                  "decoder.decoder_pred.bias": dres_state["decoder_pred.bias"]})
    state.update(_hf_blocks(dres_state, "decoder.blocks.", "decoder.decoder_layers.", len(model.decoder.blocks)))
    return transformers.ViTMAEForPreTraining(config), state


def _write_hf(model: nn.Module, out: Path) -> None:
    from dres.models import MAE

    _stacks(model)  # refuses anything else
    _refuse_decayed(model, "hf")
    transformers = import_optional("transformers", "hf", "dres-export --to hf")
    hf_model, state = (_hf_mae if isinstance(model, MAE) else _hf_classifier)(model, transformers)
    hf_model.load_state_dict(_in_hf_names({k: v.detach() for k, v in state.items()}, hf_model), strict=True)
    hf_model.save_pretrained(out)


# ---------------------------------------------------------------------------------------------
# safetensors


def _write_safetensors(model: nn.Module, out: Path) -> None:
    safetensors_torch = import_optional("safetensors.torch", "hf", "dres-export --to safetensors")
    tensors = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    metadata = {"format": "pt", "dres_model": type(model).__name__, "dres_alphas": json.dumps(_alphas(model))}
    safetensors_torch.save_file(tensors, str(out / SAFETENSORS_FILE), metadata=metadata)


_WRITERS = {"timm": _write_timm, "hf": _write_hf, "safetensors": _write_safetensors}


def export_model(model: nn.Module, to: str, out) -> Path:
    """Write ``model`` (a dres ViTClassifier or MAE) in format ``to`` ("timm", "hf", "safetensors") into the
    folder ``out`` (created; it must not hold files yet); returns ``out``."""
    if to not in FORMATS:
        raise ExportError(f"to: expected one of {', '.join(FORMATS)}, got {to!r}")
    _stacks(model)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"out: {out} already exists and is not an empty folder")
    out.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        _WRITERS[to](model.cpu(), out)
    return out
