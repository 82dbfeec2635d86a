"""The models the training benchmarks measure: dres models against plain PyTorch implementations of
the same architectures (benchmarks/baselines.py), their synthetic batch and their training loss.

A model is a name of ``MODELS`` plus two options that apply to the dres models: ``ops_backend``
(``"cuda"``: every fused op on the csrc kernels, which need ``DRES_BUILD_CUDA=1 pip install -e .``;
``"torch"``: the ops' plain PyTorch code, which torch.compile fuses with its neighbours itself)
``fused_branches`` (``True``/``False``: the fused MLP and MAE loss forced on or off; ``None``: the
models' own choice, fused in eager mode only) and ``attention`` (``"sdpa"``: every attention on SDPA, the
short-sequence kernel off, the other ops as they are); and ``fp8``, which applies to every model: the
attention and MLP Linear layers of its transformer blocks as torchao ``Float8Linear`` (dynamic
tensorwise scaling, as torchtitan converts its models; the same four layers per block in every model, so
the comparison stays like for like; needs torchao and a GPU of compute capability >= 8.9).
"""

from __future__ import annotations

import argparse

import torch

# benchmark -> model name -> description; "timm"/"plain" are the baselines of their benchmark
MODELS = {
    "mae": {
        "timm": "timm-style MAE ViT-B/16 (facebookresearch/mae structure, timm Block)",
        "dres_baseline": "dres MAE ViT-B/16, variant baseline (alpha 1)",
        "dres_official": "dres MAE ViT-B/16, variant official, alpha_min 0.6",
    },
    "uvit": {
        "plain": "plain PyTorch U-ViT-S/2 (baofff/U-ViT structure, SDPA)",
        "dres": "dres U-ViT-S/2 (alpha 1)",
        "dres_decayed": "dres U-ViT-S/2, alpha_min 0.7",
    },
}
BASELINE = {"mae": "timm", "uvit": "plain"}
DEFAULT_BATCH = {"mae": 256, "uvit": 128}
OPS_BACKENDS = ("triton", "cuda", "torch")
FUSED_BRANCHES = {"auto": None, "on": True, "off": False}
ATTENTION = ("auto", "sdpa")


def is_dres_model(name: str) -> bool:
    return name.startswith("dres")


def build_model(bench: str, name: str, ops_backend: str | None = None,
                fused_branches: bool | None = None, fp8: bool = False, attention: str | None = None) -> torch.nn.Module:
    """``MODELS[bench][name]``, with the dres models' ops on ``ops_backend``, their branch fusions
    forced to ``fused_branches`` and their attention on SDPA (``attention="sdpa"``) when given (the
    baselines have none of these); ``fp8``: float8 block matmuls."""
    model = _build_plain(bench, name)
    if fp8:
        convert_to_float8(model)
    if not is_dres_model(name):
        return model
    if ops_backend is not None:
        from dres.nn import set_backend
        from dres.ops import csrc_backend

        if ops_backend == "cuda" and not csrc_backend.available():
            raise RuntimeError("--ops-backend cuda needs the csrc extension: DRES_BUILD_CUDA=1 pip install -e .")
        set_backend(model, ops_backend)
    if fused_branches is not None:
        from dres.nn import set_fused_mlp

        set_fused_mlp(model, fused_branches)
        if hasattr(model, "fused_loss"):
            model.fused_loss = fused_branches
    if attention == "sdpa":
        from dres.nn.transformer import Attention

        for m in model.modules():
            if isinstance(m, Attention):
                m.backend = "torch"  # the Attention's own backend: "torch" keeps every shape on SDPA
    return model


def block_linears(model: torch.nn.Module) -> set[str]:
    """The attention (qkv, projection) and MLP Linear layers of every transformer block whose sizes a
    float8 matmul takes (multiples of 16); embeddings, heads and U-ViT skip projections stay."""
    names = set()
    for name, m in model.named_modules():
        parts = name.split(".")
        if (isinstance(m, torch.nn.Linear) and len(parts) >= 2 and parts[-2] in ("attn", "mlp")
                and m.in_features % 16 == 0 and m.out_features % 16 == 0):
            names.add(name)
    return names


def convert_to_float8(model: torch.nn.Module) -> int:
    """:func:`block_linears` of ``model`` as torchao ``Float8Linear`` (in place, before compiling); the number
    converted. A dres MLP takes its plain path, since the fused MLP reads ``fc1.weight`` itself."""
    from torchao.float8 import convert_to_float8_training

    from dres.nn import set_fused_mlp

    names = block_linears(model)
    convert_to_float8_training(model, module_filter_fn=lambda m, fqn: fqn in names)
    set_fused_mlp(model, False)
    return len(names)


def _build_plain(bench: str, name: str) -> torch.nn.Module:
    if bench == "mae":
        if name == "timm":
            from benchmarks.baselines import timm_mae_vit_base_patch16

            return timm_mae_vit_base_patch16()
        from dres.models import mae_vit_base_patch16

        if name == "dres_baseline":
            return mae_vit_base_patch16(variant="baseline")
        if name == "dres_official":
            return mae_vit_base_patch16(variant="official", alpha_min=0.6)
    if bench == "uvit":
        if name == "plain":
            from benchmarks.baselines import plain_uvit_small_2

            return plain_uvit_small_2()
        from dres.models import uvit_small_2

        if name == "dres":
            return uvit_small_2()
        if name == "dres_decayed":
            return uvit_small_2(alpha_min=0.7)
    raise ValueError(f"unknown model {name!r} for {bench}")


def model_label(record: dict) -> str:
    """A record's model with its options: ``dres_baseline [ops cuda, fused branches on]``."""
    options = []
    if record.get("ops_backend"):
        options.append(f"ops {record['ops_backend']}")
    if record.get("fused_branches") is not None:
        options.append(f"fused branches {'on' if record['fused_branches'] else 'off'}")
    if record.get("attention"):
        options.append(f"{record['attention']} attention")
    if record.get("fp8"):
        options.append("fp8")
    if isinstance(record.get("overrides"), list):  # a trainer run's model keys (its preset's variant changed)
        options += [kv for kv in record["overrides"] if kv.startswith("model.")]
    return record["model"] + (f" [{', '.join(options)}]" if options else "")


def make_batch(bench: str, batch: int, device) -> torch.Tensor:
    size = 224 if bench == "mae" else 32
    return torch.randn(batch, 3, size, size, device=device).clamp_(-1, 1)


def loss_fn(bench: str, model, images: torch.Tensor) -> torch.Tensor:
    """The training loss: MAE's own (norm-pix MSE on masked patches); for U-ViT, the trainer's
    noise-prediction MSE at a random time of the VP-SDE (dres.eval.noise_prediction_loss)."""
    if bench == "mae":
        return model(images)[0]
    from dres.eval import VPSDE, noise_prediction_loss

    return noise_prediction_loss(model, images, VPSDE())


def models_for(bench: str, spec: str | None) -> list[str]:
    """The models of ``bench`` named in the comma list ``spec`` (all of them when empty); a name that
    is no benchmark's model is an error naming the known ones."""
    if not spec:
        return list(MODELS[bench])
    wanted = [m for m in spec.split(",") if m]
    known = {m for models in MODELS.values() for m in models}
    unknown = [m for m in wanted if m not in known]
    if unknown:
        raise SystemExit(f"--models: unknown {unknown}; known: " + "; ".join(
            f"{b}: {', '.join(models)}" for b, models in MODELS.items()))
    return [m for m in wanted if m in MODELS[bench]]


def add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ops-backend", choices=OPS_BACKENDS,
                        help="the dres models' fused ops on this backend (default: the ops' own choice; "
                             "cuda needs DRES_BUILD_CUDA=1 pip install -e .; torch: plain PyTorch code, "
                             "which torch.compile fuses itself)")
    parser.add_argument("--fused-branches", choices=list(FUSED_BRANCHES), default="auto",
                        help="the dres models' fused MLP and MAE loss: on, off, or auto (eager mode only)")
    parser.add_argument("--attention", choices=ATTENTION, default="auto",
                        help="the dres models' attention: auto (short-sequence kernel where it applies) or sdpa")
    parser.add_argument("--fp8", action="store_true",
                        help="every model's transformer-block Linear layers as torchao float8 matmuls (needs torchao)")


def model_options(args) -> dict:
    """``build_model``'s keyword options from ``add_model_options``' arguments."""
    return {"ops_backend": args.ops_backend, "fused_branches": FUSED_BRANCHES[args.fused_branches], "fp8": args.fp8,
            "attention": None if args.attention == "auto" else args.attention}
