"""Run configuration: nested dataclasses, YAML presets and ``--set key=value`` overrides.

A preset is a YAML file in ``train/presets/`` whose nested keys mirror :class:`Config`; the CLI
loads it, applies overrides (``--set optim.blr=1e-3 --set model.depth=6``) and saves the resolved
result as ``config.yaml`` in the run directory, so every run records exactly what it did.
Unknown keys are rejected with an error that names the key and the valid choices (a typo must
never silently fall back to a default).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

PRESET_DIR = Path(__file__).resolve().parent / "presets"
TASKS = ("mae", "uvit", "classify")


class ConfigError(ValueError):
    """A one-line, user-facing configuration problem (unknown key/preset, bad value)."""


def setting(default=dataclasses.MISSING, help: str = "", *, factory=dataclasses.MISSING):
    """A config field and its ``--help`` text (the field's metadata, which :func:`key_docs` reads)."""
    return field(default=default, default_factory=factory, metadata={"help": help})


@dataclass
class DataConfig:
    name: str = setting("digits", "digits | cifar10_wds | wds | imagefolder | cifar_tv | mnist_tv | synthetic")
    path: str = setting("", "train data: shard pattern (brace notation), folder, or torchvision root")
    val_path: str = setting("", "held-out split (probe test set / classification eval)")
    img_size: int = setting(32, "images are resized / cropped to this side")
    in_chans: int = setting(3, "1 (greyscale) | 3")
    num_classes: int = setting(10, "labels lie in [0, num_classes)")
    gpu_resident: bool = setting(True, "decode once into (GPU) memory and augment there; for small data sets (CIFAR, "
                                       "digits)")
    aug: str = setting("rrc_flip", "rrc_flip | flip | none  (RandomResizedCrop + horizontal flip for MAE)")
    crop_min: float = setting(0.2, "smallest RandomResizedCrop area (fraction of the image)")
    color_jitter: float = setting(0.0, "torchvision ColorJitter(s, s, s) after the crop, as timm's --color-jitter s "
                                       "(0: off; on the GPU for every loader)")
    eval_crop_pct: float = setting(1.0, "evaluation: 1 resizes the image to img_size; < 1 is timm's transform (shorter"
                                        " side to img_size / eval_crop_pct, then the centre crop; timm's default "
                                        "0.875; bicubic in memory, bilinear from files)")
    normalize: bool = setting(True, "per-channel mean/std normalisation (stats from `mean`/`std`)")
    mean: list = setting(factory=lambda: [0.485, 0.456, 0.406], help="a value per channel")
    std: list = setting(factory=lambda: [0.229, 0.224, 0.225])
    num_workers: int = setting(-1, "streaming loaders only: DataLoader workers reading (and with CPU decode decoding) "
                                   "files; -1: by the decode (CPU, or GPU with a CPU share: the cores the "
                                   "process has, less one; GPU: 4)")
    decode: str = setting("auto", "streaming loaders: cpu (workers decode, crop, resize) | gpu (workers read bytes; "
                                  "batched GPU decode and crop kernel) | auto (cpu where the process has "
                                  "dres.data.factory.CPU_DECODE_MIN_CORES (24) cores or more, or no GPU decoder is "
                                  "there; else gpu)")
    hw_decode_load: float = setting(-1.0, "decode=gpu with nvImageCodec or nvjpeg: the share of each batch's JPEGs "
                                          "for the hardware JPEG decoders (the rest, and what they cannot do, to "
                                          "nvJPEG on the CUDA cores at the same time; 0: the hardware decoders "
                                          "unused; -1: the decoder's own, dres.data.decode.HW_DECODE_LOAD: "
                                          "nvImageCodec 0.65, nvjpeg 1)")
    cpu_decode_share: float = setting(-1.0, "decode on the GPU: the share of the JPEGs it would take that the workers "
                                            "decode on the CPU instead, each image chosen by its own seed (work taken "
                                            "off the training process's finishing thread, for the cores beyond the "
                                            "GPU decode's; 0: none; -1: by the cores, half of them where the process "
                                            "has dres.data.factory.CPU_SHARE_MIN_CORES (16) or more and num_workers "
                                            "is -1, else none)")
    gpu_decoder: str = setting("auto", "GPU decode: torchvision (its batched nvJPEG) | nvimgcodec (the hardware JPEG "
                                       "decoders and nvJPEG on the CUDA cores, split by hw_decode_load) | nvjpeg "
                                       "(libnvjpeg called directly, with its memory pools, split so too: "
                                       "dres.data.nvjpeg) | auto "
                                       "(torchvision, else nvimgcodec, else nvjpeg)")
    finish_ahead: int = setting(2, "streaming loaders: batches a thread of the training process finishes (GPU decode, "
                                   "crop, normalisation, copies) ahead of the step (0: in the step's own thread, "
                                   "between steps)")
    finish_threads: int = setting(1, "streaming loaders with finish_ahead >= 1: threads finishing batches at once, "
                                     "each with its own GPU decoder and stream (torchvision's decoder takes one "
                                     "call at a time a process; nvImageCodec's decoders run side by side)")
    finish_high_priority: bool = setting(True, "streaming loaders on a GPU: the streams finishing batches (decode, crop"
                                               ", copies) at the GPU's highest priority, ahead of the step's kernels "
                                               "(false: the default priority)")
    shuffle_buffer: int = setting(2000, "streamed shards: samples shuffled in memory")
    limit: int = setting(0, "use only the first N training samples (0: all)")
    val_limit: int = setting(0, "use only the first N held-out samples (0: all)")
    synthetic_size: int = setting(4096, "data.name=synthetic: training images (a quarter as many held out)")
    max_corrupt_frac: float = setting(0.001, "stop when more than this fraction of samples (or of shards) is "
                                             "unreadable")
    verify_manifest: bool = setting(True, "check shards against their folder's manifest.json sha256 before use")
    side_stream: bool = setting(False, "make each batch (gather, augmentation, copy to the GPU) on a CUDA stream of "
                                       "its own, beside the running step")


@dataclass
class ModelConfig:
    """Keyword arguments of the model class (dres.models.MAE / UViT / ViTClassifier); one dataclass
    serves every task, so a key a model does not accept is dropped (with a note when it was set)."""

    variant: str = setting("official")
    arch: str = setting("vit", "classify: vit (dres ViT) | resnet18 | resnet50 | resnet50d (timm, convert_timm_resnet)")
    img_size: int = setting(32, "must equal data.img_size")
    patch_size: int = setting(4)
    in_chans: int = setting(3, "must equal data.in_chans")
    embed_dim: int = setting(192, "transformer width")
    depth: int = setting(12, "transformer blocks (the encoder's, for MAE)")
    num_heads: int = setting(3)
    decoder_embed_dim: int = setting(128, "MAE decoder width")
    decoder_depth: int = setting(6)
    decoder_num_heads: int = setting(4)
    mlp_ratio: float = setting(4.0, "MLP hidden width / embed_dim")
    norm_pix_loss: bool = setting(True, "MAE: loss on per-patch normalised pixels")
    mask_ratio: float = setting(0.75, "MAE: fraction of patches hidden from the encoder")
    alpha_min: float = setting(1.0, "decayed shortcuts: the last alpha (1: plain residuals)")
    schedule: str = setting("linspace", "how alpha falls with depth: linspace | paper")
    drop_path: float = setting(0.0, "drop rate of the last block (linear in depth)")
    drop_rate: float = setting(0.0, "classify, timm ResNets: dropout before the classifier (timm's --drop)")
    droppath_mode: str = setting("drop_path", "drop_path (timm) | residual_droppath (Park) | residual_droppath_literal"
                                              " (Park's Algorithm 1 as written: odd iterations detach rate-0 branches "
                                              "too) | residual_droppath_frozen (odd iterations hold the kept branches'"
                                              " weights and pass their gradient on; ResNets), active when drop_path > "
                                              "0 | none (classify: off)")
    per_block: bool = setting(False, "one alpha per block instead of per sub-layer")
    num_classes: int = setting(0, "classifier classes; U-ViT: 0 unconditional, else class-conditional")
    global_pool: str = setting("cls", "classifier head input: cls | avg")
    gelu_approximate: str = setting("none", "the GELU of every ViT MLP, as nn.GELU's approximate names it: none "
                                            "(exact, erf) | tanh (timm's gelu_tanh)")
    zero_init: str = setting("auto", "zero the last Linear of every branch (ViT: attention proj, MLP fc2; timm ResNet:"
                                     " the last BN): auto (ViTs: when alpha_min < 1; ResNets: timm's default, on) | "
                                     "true (the decayed-shortcut authors' code, also at alpha_min 1) | false. The "
                                     "official MAE's SkipLayer ends start at zero whatever this says.")
    backend: typing.Optional[str] = setting(None, "dres.ops backend: None (its choice by device and size, docs/ops.md) "
                                                  "| torch | triton")


@dataclass
class OptimConfig:
    name: str = setting("adamw", "adamw | sgd (timm's 'sgd': SGD with Nesterov momentum; dres.train.optim)")
    blr: float = setting(1.5e-4, "lr = blr * global_batch / 256 (MAE convention) unless lr > 0")
    lr: float = setting(0.0, "peak learning rate (0: from blr)")
    min_lr: float = setting(0.0, "cosine schedule's floor")
    weight_decay: float = setting(0.05, "not on 1-D tensors (norms, biases) and position embeddings")
    betas: list = setting(factory=lambda: [0.9, 0.95], help="AdamW")
    eps: float = setting(1e-8, "AdamW")
    momentum: float = setting(0.9, "sgd only (AdamW's are the betas)")
    label_smoothing: float = setting(0.0, "classify only: cross-entropy against (1 - s) one-hot + s / classes")
    schedule: str = setting("cosine", "cosine (MAE, classify) | constant (U-ViT); both after linear warmup")
    warmup_steps: int = setting(-1, "-1: derived from warmup_epochs")
    warmup_epochs: float = setting(40.0, "linear warmup length when warmup_steps is -1")
    clip_grad: float = setting(0.0, "0: off")
    ema_decay: float = setting(0.0, "0: no EMA (U-ViT uses 0.9999)")
    fused: bool = setting(True, "fused AdamW / SGD on CUDA")


@dataclass
class LogConfig:
    every: int = setting(20, "steps between metrics.jsonl records and log lines")
    progress: bool = setting(True, "where stderr is a terminal a progress bar, elsewhere (a pipe, a batch job's log) a"
                                   " plain line per log step")
    tensorboard: bool = setting(True, "<out>/tb when tensorboard is installed (the [tensorboard] extra)")
    wandb: bool = setting(False, "a Weights & Biases run of the log steps (project dres; the [wandb] extra)")


@dataclass
class CkptConfig:
    every: int = setting(1000, "steps; 0: only at the end")
    keep: int = setting(2, "newest checkpoints kept (0: keep all)")
    format: str = setting("auto", "auto (DCP under FSDP, single file otherwise) | file | dcp")


@dataclass
class EvalConfig:
    probe: bool = setting(True, "linear probe on frozen features (train split -> val split)")
    probe_epochs: int = setting(200)
    probe_lr: float = setting(1e-2)
    probe_batch: int = setting(1024)
    probe_wd: float = setting(0.0)
    knn: bool = setting(True, "k-nearest-neighbour accuracy on the same features")
    knn_k: int = setting(20)
    feature: str = setting("cls", "MAE encoder features: cls (class token) | mean (patch tokens, after the final norm "
                                  "where there is one) | stream_mean (all tokens of the raw stream, the "
                                  "decayed-shortcut authors' evaluation)")
    also_features: str = setting("", "more feature kinds, comma-separated, scored in the same evaluation pass (the "
                                     "same forward), metrics prefixed <kind>_ (e.g. stream_mean: "
                                     "stream_mean_linear_probe_acc)")
    authors_probe: bool = setting(False, "also the authors' probe (raw features, their eval_model's settings): "
                                         "authors_probe_acc")
    knn_standardized: bool = setting(False, "also kNN on features standardised by the train split's mean/std: "
                                            "knn_std_acc")
    save_features: bool = setting(False, "the final evaluation's features (float16, every kind, both splits) to "
                                         "<out>/features.pt")
    layer: int = setting(-1, "encoder block whose output is probed")
    effective_rank: bool = setting(True, "of the features' covariance (the decayed-shortcut paper's eq. 6)")
    tsne: bool = setting(False, "t-SNE plot of the val features (the [plots] extra)")
    recon: bool = setting(True, "MAE reconstruction grid")
    max_train: int = setting(0, "cap on probe train features (0: all)")
    max_test: int = setting(0, "cap on probe test features (0: all)")
    sampler: str = setting("dpm", "U-ViT samples: dpm (DPM-Solver-2, `steps` NFE) | em (Euler-Maruyama)")
    steps: int = setting(50, "sampler steps")
    n_samples: int = setting(64, "samples drawn into the sample grid")
    probe_block: int = setting(-1, "U-ViT feature probe: block index (-1: mid block)")
    probe_t: float = setting(0.1, "U-ViT feature probe: noise level (continuous time in [0, 1])")
    probe_grid_blocks: list = setting(factory=list, help="U-ViT: the final evaluation also probes every (block, noise "
                                                         "level) of these two lists (the paper picks the best layer "
                                                         "and t); a grid of linear-probe and kNN accuracy in the "
                                                         "results and probe_grid.png")
    probe_grid_ts: list = setting(factory=list)
    fid_inception: str = setting("", "path to TorchScript Inception (inception-2015-12-05.pt)")
    fid_samples: int = setting(10000, "generated (and real) images for FID and fd_cifar_classifier")
    fd_classifier: str = setting("", "Frechet distance in the penultimate features of a classifier trained by dres (a "
                                     "classify run directory or checkpoint): reported as fd_cifar_classifier, not "
                                     "comparable to published FID")
    fd_draws: int = setting(1, "independent sample draws for fd_cifar_classifier (their mean; each, and the sd, when >"
                               " 1)")
    fd_real_floor: bool = setting(False, "also fd_real_cifar_classifier: train images against the test images (the "
                                         "floor)")
    curve_fd_samples: int = setting(0, "U-ViT eval.every points: fd_cifar_classifier_curve of this many samples (0: "
                                       "none)")
    every: int = setting(0, "every N steps during training (0: never) a cheap evaluation (MAE: kNN, a "
                            "curve_probe_epochs probe, effective rank) appended to <out>/curves.jsonl and plotted to "
                            "<out>/curves.png")
    curve_probe_epochs: int = setting(20, "the eval.every probe's epochs")

    def extra_feature_kinds(self) -> list[str]:
        return [k.strip() for k in self.also_features.split(",") if k.strip()]


@dataclass
class Config:
    task: str = setting("mae")
    preset: str = setting("")
    seed: int = setting(0, "model init, data order, augmentation and masking")
    out: str = setting("", "run directory (default runs/<task>_<preset>)")
    batch_size: int = setting(256, "global batch (all ranks, all micro-batches)")
    accum_steps: int = setting(1, "micro-batches a step (gradient accumulation)")
    epochs: float = setting(0.0, "training length in epochs of the train set ...")
    steps: int = setting(0, "... or in optimizer steps (steps wins when > 0)")
    precision: str = setting("auto", "auto (bf16 on CUDA, fp32 on CPU) | bf16 | fp16 | fp32")
    compile: bool = setting(False, "torch.compile the model (per block, or whole: compile_scope) and, on CUDA, the "
                                   "in-memory augmentation")
    compile_scope: str = setting("auto", "blocks: each transformer block one region (FSDP2's units; the glue between "
                                         "them runs eager) | model: the model's forward as one graph (Inductor fuses "
                                         "the embedding, masking and loss glue too) | auto: model on one GPU and under"
                                         " DDP (measured faster there), blocks under FSDP2 and activation "
                                         "checkpointing")
    cuda_graphs: str = setting("auto", "capture the whole train step as one CUDA graph: auto (where supported) | true "
                                       "(capture or fail) | false")
    fused_mlp: str = setting("auto", "the ViT MLPs through dres.ops.fused_mlp (GELU recomputed in the backward: one "
                                     "tokens x hidden activation fewer): auto (eager steps and captured ones; a "
                                     "compiled step that is not captured leaves the MLP to Inductor, since the opaque "
                                     "op costs host time there) | true | false")
    act_ckpt: str = setting("none", "none | full | selective")
    dist: str = setting("none", "none | ddp | fsdp")
    dist_timeout_s: float = setting(1800.0, "seconds a collective waits for a rank that has stopped answering (a hung "
                                            "process, a host gone without closing its connections) before this rank "
                                            "fails: the process group's timeout")
    fsdp_param_dtype: str = setting("bf16", "bf16 | fp32 (mixed-precision policy of FSDP2)")
    fsdp_prefetch: bool = setting(False, "units keep parameters gathered to the backward + forward prefetch")
    fsdp_reshard: str = setting("auto", "which units free their gathered parameters after the forward: auto (never on "
                                        "1 GPU, else all but the last)")
    fsdp_blocks_per_unit: int = setting(4, "consecutive blocks per FSDP2 unit: its hooks cost CPU time per unit, and 4"
                                           " a unit measures fastest")
    device: str = setting("auto", "auto (cuda when available, else cpu) | cpu | cuda")
    threads: int = setting(0, "CPU intra-op threads; 0: one for models narrower than 256 (model.embed_dim: their "
                              "matrices are too small to gain from more, and threads spinning beside other work on a "
                              "busy machine cost several times the step), else torch's default (a thread per core, or "
                              "OMP_NUM_THREADS)")
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    log: LogConfig = field(default_factory=LogConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


FEATURE_KINDS = ("cls", "mean", "stream_mean")  # what ViTEncoder.forward_features returns
CHOICES = {
    "task": TASKS, "precision": ("auto", "bf16", "fp16", "fp32"), "act_ckpt": ("none", "full", "selective"),
    "cuda_graphs": ("auto", "true", "false"), "fused_mlp": ("auto", "true", "false"),
    "compile_scope": ("auto", "blocks", "model"),
    "dist": ("none", "ddp", "fsdp"), "fsdp_param_dtype": ("bf16", "fp32"),
    "fsdp_reshard": ("auto", "always", "except_last", "never"),
    "data.name": ("digits", "cifar10_wds", "wds", "imagefolder", "cifar_tv", "mnist_tv", "synthetic"),
    "data.aug": ("rrc_flip", "flip", "none"), "data.decode": ("auto", "cpu", "gpu"),
    "data.gpu_decoder": ("auto", "nvimgcodec", "nvjpeg", "torchvision"),
    "model.droppath_mode": ("drop_path", "residual_droppath", "residual_droppath_literal", "residual_droppath_frozen",
                            "none"),
    "model.arch": ("vit", "resnet18", "resnet50", "resnet50d"),
    "model.zero_init": ("auto", "true", "false"), "model.gelu_approximate": ("none", "tanh"),
    "model.variant": ("baseline", "official", "paper"), "model.schedule": ("linspace", "paper"), "optim.schedule": ("cosine", "constant"),
    "optim.name": ("adamw", "sgd"),
    "ckpt.format": ("auto", "file", "dcp"), "eval.sampler": ("dpm", "em"), "eval.feature": FEATURE_KINDS,
}


def key_docs() -> dict:
    """``{dotted key: (default, help)}`` for every config key: the help its field carries (:func:`setting`),
    plus its choices."""
    docs = {}

    def walk(cls, prefix):
        for f in dataclasses.fields(cls):
            key = prefix + f.name
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
            if dataclasses.is_dataclass(default):
                walk(type(default), key + ".")
                continue
            hint = f.metadata.get("help", "")
            if key in CHOICES and not any(c in hint for c in ("|", "one of")):
                hint = (hint + "; " if hint else "") + "one of " + " | ".join(CHOICES[key])
            docs[key] = (default, hint)

    walk(Config, "")
    return docs


def _suggest(key, valid):
    close = difflib.get_close_matches(key, valid, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _number(value, key, what="a number"):
    """A finite float from a YAML value: numbers, and strings such as '1e-3' (PyYAML reads floats
    without a dot as strings); booleans, other strings, NaN and infinities are errors naming the key."""
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise ConfigError(f"config key '{key}' expects {what}, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"config key '{key}' expects {what}, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"config key '{key}' must be a finite number; got {value}")
    return value


def _coerce(value, typ, key):
    """Convert a YAML-parsed value to the dataclass field's type; int->float is allowed, anything
    else mismatched is an error naming the key."""
    origin = typing.get_origin(typ)
    if origin is typing.Union:  # Optional[X]
        if value is None:
            return None
        typ = [a for a in typing.get_args(typ) if a is not type(None)][0]
    if typ is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{key}' expects true/false, got {value!r}")
    if typ is float:
        return float(_number(value, key))
    if typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        number = _number(value, key, "an integer")
        if float(number).is_integer():
            return int(number)
        raise ConfigError(f"config key '{key}' expects an integer, got {value!r}")
    if typ is str:
        if isinstance(value, bool):  # YAML reads true/false as booleans; str keys keep the words
            return "true" if value else "false"
        return "" if value is None else str(value)
    if typ is list:  # every list key holds numbers (betas, mean, std)
        if isinstance(value, (list, tuple)):
            return [float(_number(v, key, "a list of numbers")) for v in value]
        raise ConfigError(f"config key '{key}' expects a list like [0.9, 0.95], got {value!r}")
    return value


def set_key(cfg: Config, dotted: str, value, *, prefix=""):
    """Set ``cfg.a.b = value`` for ``dotted='a.b'``, with type coercion and unknown-key errors."""
    parts = dotted.split(".")
    obj = cfg
    for i, p in enumerate(parts):
        types = typing.get_type_hints(type(obj))
        path = ".".join(parts[: i + 1])
        if p not in types:
            valid = [f.name for f in dataclasses.fields(obj)]
            where = ".".join(parts[:i]) or "top level"
            raise ConfigError(f"unknown config key '{prefix}{path}'{_suggest(p, valid)}; valid keys at "
                              f"{where}: {', '.join(valid)}")
        if i == len(parts) - 1:
            if dataclasses.is_dataclass(getattr(obj, p)):
                if not isinstance(value, dict):
                    raise ConfigError(f"config key '{prefix}{path}' is a section; set its fields, e.g. {path}.<key>=...")
                for k, v in value.items():
                    set_key(cfg, f"{path}.{k}", v, prefix=prefix)
                return
            v = _coerce(value, types[p], prefix + path)
            choices = CHOICES.get(path)
            if choices is not None and v not in choices:
                raise ConfigError(f"config key '{path}' must be one of {', '.join(choices)}; got {v!r}")
            setattr(obj, p, v)
        else:
            obj = getattr(obj, p)
            if not dataclasses.is_dataclass(obj):
                raise ConfigError(f"config key '{path}' is not a section (cannot set '{dotted}')")


def update_from_dict(cfg: Config, d: dict, prefix=""):
    for k, v in d.items():
        set_key(cfg, k, v, prefix=prefix)
    return cfg


def list_presets():
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def preset_summaries(task: str | None = None) -> dict:
    """``{name: its leading comment as one line}`` of the presets (of ``task`` when given)."""
    out = {}
    for name in list_presets():
        text = (PRESET_DIR / f"{name}.yaml").read_text()
        if task is not None and (yaml.safe_load(text) or {}).get("task") != task:
            continue
        comment = []
        for line in text.splitlines():
            if not line.startswith("#"):
                break
            comment.append(line.lstrip("# "))
        out[name] = " ".join(comment)
    return out


SMALL_MODEL_WIDTH = 256  # model.embed_dim below which threads=0 means one thread
_TORCH_THREADS = []  # torch's own default, read before any run sets it


def cpu_threads(cfg: Config) -> int:
    """The CPU intra-op threads of a run: ``cfg.threads``, or by the model's width when it is 0."""
    import torch

    if not _TORCH_THREADS:
        _TORCH_THREADS.append(torch.get_num_threads())
    if cfg.threads:
        return cfg.threads
    return 1 if cfg.model.embed_dim < SMALL_MODEL_WIDTH else _TORCH_THREADS[0]


def _is_path(name: str) -> bool:
    return os.sep in name or "/" in name or Path(name).suffix in (".yaml", ".yml") or (
        name not in list_presets() and Path(name).exists())


def load_preset(name: str) -> dict:
    """A preset by name (``train/presets/<name>.yaml``) or by path; each way it can fail is one line."""
    if _is_path(name):
        path = Path(name).expanduser()
        if not path.exists():
            raise ConfigError(f"preset file not found: {path}")
    else:
        path = PRESET_DIR / f"{name}.yaml"
        if not path.exists():
            raise ConfigError(f"unknown preset '{name}'{_suggest(name, list_presets())}; available: "
                              f"{', '.join(list_presets())} (or a path to a .yaml file)")
    d = _read_yaml(path)
    if d is None:
        raise ConfigError(f"preset {path} is empty (expected a YAML mapping such as 'task: mae')")
    if not isinstance(d, dict):
        raise ConfigError(f"preset {path} must be a YAML mapping")
    return d


def _read_yaml(path):
    """The YAML document in ``path`` (None when it is empty); a folder, binary or malformed file is one line."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path} is a directory, not a YAML file")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path} cannot be read: {e.strerror or e}") from e
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is None or "\0" in text:
        raise ConfigError(f"{path} is a binary file, not a YAML text file")
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        raise ConfigError(f"{path} is not valid YAML{at}: {getattr(e, 'problem', None) or type(e).__name__}") from e


def parse_override(s: str):
    if "=" not in s:
        raise ConfigError(f"override '{s}' must look like key=value (e.g. optim.blr=1e-3)")
    k, v = s.split("=", 1)
    # YAML gives numbers, booleans, lists and null their natural types (a number key reads "1e-3",
    # a string to YAML 1.1, in _coerce)
    try:
        val = yaml.safe_load(v) if v != "" else ""
    except yaml.YAMLError:
        val = v
    return k.strip(), val


def build_config(task: str | None = None, preset: str | None = None, overrides=(), base: dict | None = None) -> Config:
    """Defaults <- preset YAML <- ``base`` dict <- ``key=value`` overrides; checks the task's name and the values
    (:func:`validate`; a task's own checks are :func:`dres.train.tasks.check`'s, which the trainer makes)."""
    cfg = Config()
    if preset:
        d = load_preset(preset)
        update_from_dict(cfg, d, prefix="")
        cfg.preset = Path(preset).stem
    if base:
        update_from_dict(cfg, base)
    for o in overrides:
        k, v = parse_override(o) if isinstance(o, str) else o
        set_key(cfg, k, v)
    if task is not None:
        if task not in TASKS:
            raise ConfigError(f"unknown task '{task}'; one of {', '.join(TASKS)}")
        if preset and cfg.task != task:
            raise ConfigError(f"preset '{preset}' is for task '{cfg.task}', not '{task}'")
        cfg.task = task
    if cfg.compile_scope == "auto":
        cfg.compile_scope = auto_compile_scope(cfg)
    validate(cfg)
    return cfg


def auto_compile_scope(cfg: Config) -> str:
    """``compile_scope=auto``: the whole model on one GPU and under DDP without activation checkpointing (the ViT-B/16
    MAE trainer faster so: BENCHMARKS.md, "Several GPUs"), per block under FSDP2 or with checkpointing (they work block
    by block). The field's comment, which ``--help`` shows, says the same (tested)."""
    return "model" if cfg.dist != "fsdp" and cfg.act_ckpt == "none" else "blocks"


POSITIVE_KEYS = (
    "batch_size", "accum_steps", "fsdp_blocks_per_unit", "data.img_size", "data.in_chans", "data.synthetic_size",
    "model.img_size", "model.patch_size", "model.in_chans", "model.embed_dim", "model.depth", "model.num_heads",
    "model.decoder_embed_dim", "model.decoder_num_heads", "model.mlp_ratio", "optim.eps", "log.every",
    "eval.probe_epochs", "eval.probe_lr", "eval.probe_batch", "eval.knn_k", "eval.steps", "eval.n_samples",
    "eval.fid_samples", "eval.curve_probe_epochs", "eval.fd_draws", "dist_timeout_s", "data.num_classes")
# key: what 0 means ('' when 0 is an ordinary value)
NON_NEGATIVE_KEYS = {
    "seed": "", "steps": "use epochs", "epochs": "", "threads": "by the model's width",
    "data.shuffle_buffer": "", "data.limit": "all",
    "data.val_limit": "all", "data.finish_ahead": "in the step's thread", "model.decoder_depth": "",
    "model.num_classes": "", "optim.blr": "",
    "optim.lr": "from optim.blr", "optim.min_lr": "", "optim.weight_decay": "", "optim.warmup_epochs": "",
    "optim.clip_grad": "off", "ckpt.every": "only at the end", "ckpt.keep": "keep all", "eval.probe_wd": "",
    "eval.max_train": "all", "eval.max_test": "all", "eval.every": "never", "eval.curve_fd_samples": "none"}


def _get(cfg, key):
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def need_plots(cfg: Config, more=()) -> None:
    """The plots a run draws need matplotlib, an optional dependency: say so before the run. t-SNE plots and
    curves.png, and ``more``, a task's own (``(what, the setting that turns it off)`` pairs: ``task.plots(cfg)``)."""
    wanted = [("eval.tsne=true (t-SNE plot)", "eval.tsne=false"), (f"eval.every={cfg.eval.every} (curves.png)",
                                                                      "eval.every=0")]
    wanted = [w for w, on in zip(wanted, (cfg.eval.tsne, cfg.eval.every)) if on] + list(more)
    if not wanted:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError(f"{' and '.join(w for w, _ in wanted)} need{'s' if len(wanted) == 1 else ''} matplotlib, "
                          f"which is not installed: pip install 'dres[plots]' (or set "
                          f"{' and '.join(off for _, off in wanted)})") from None


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _need_data_paths(cfg: Config) -> None:
    """A held-out split's path that does not exist: refused before training, which would end without its evaluation."""
    path = cfg.data.val_path
    if not path or path.startswith(("pipe:", "http://", "https://")) or any(c in path for c in "{*?[:"):
        return  # commands, URLs and patterns are expanded by the loader, which says what is missing
    if not Path(path).expanduser().exists():
        raise ConfigError(f"config key 'data.val_path' names {path}, which does not exist (the evaluation after "
                          "training reads it); give the held-out split's path, or leave data.val_path empty")


COMMAND_KEYS = ("data.path", "data.val_path")  # a pipe:CMD source runs CMD in a shell


def check_commands(cfg: Config, typed: dict, allowed: bool, origin: str) -> None:
    """A ``pipe:`` data source runs a shell command: only one typed in this invocation (``typed``: the
    ``--set`` values) runs, or with ``allowed`` (``--allow-pipe``); one read from ``origin`` (a preset file, a
    run's config.yaml) is one line saying how to allow it."""
    for key in COMMAND_KEYS:
        value = _get(cfg, key)
        if allowed or str(typed.get(key)) == value or not any(p.startswith("pipe:") for p in value.split("::")):
            continue
        raise ConfigError(f"config key '{key}' runs a shell command ({value}) read from {origin}, not typed on this "
                          f"command line; to run it, pass --allow-pipe (or give it with --set {key}=...)")


def typed_values(overrides) -> dict:
    """``{key: value}`` of ``--set key=value`` arguments (the last of a key wins)."""
    return dict(parse_override(o) for o in overrides)


def need(cfg: Config, ok, key: str, what: str) -> None:
    """One check of :func:`validate` or of a task's own (``task.validate``): where not ``ok``, one line naming
    ``key``, what it ``what`` and its value."""
    if not ok:
        if what == "must be positive" and isinstance(_get(cfg, key), int):
            what = "must be a positive integer"
        raise ConfigError(f"config key '{key}' {what}; got {_get(cfg, key)!r}")


def validate(cfg: Config) -> None:
    """Value checks that a type cannot express, those of every task (a task's own are its ``validate``, which
    :func:`dres.train.tasks.check` adds); each failure is one line naming the key."""
    m, d, o = cfg.model, cfg.data, cfg.optim
    for key in POSITIVE_KEYS:
        need(cfg, _get(cfg, key) > 0, key, "must be positive")
    for key, zero_means in NON_NEGATIVE_KEYS.items():
        need(cfg, _get(cfg, key) >= 0, key, f"must be >= 0{f' (0: {zero_means})' if zero_means else ''}")
    need(cfg, o.warmup_steps >= -1, "optim.warmup_steps", "must be >= 0, or -1 (from optim.warmup_epochs)")
    need(cfg, cfg.data.num_workers >= -1, "data.num_workers", "must be >= 0, or -1 (by the decode)")
    need(cfg, 0 <= cfg.eval.probe_t <= 1, "eval.probe_t", "must be in [0, 1] (continuous diffusion time)")
    e = cfg.eval
    need(cfg, bool(e.probe_grid_blocks) == bool(e.probe_grid_ts), "eval.probe_grid_blocks",
         "and eval.probe_grid_ts are given together (the grid is every pair of the two)")
    need(cfg, all(0 <= t <= 1 for t in e.probe_grid_ts), "eval.probe_grid_ts",
         "must be in [0, 1] (continuous diffusion time)")
    also = e.extra_feature_kinds()
    need(cfg, all(k in FEATURE_KINDS for k in also) and len(set(also)) == len(also) and e.feature not in also,
         "eval.also_features", f"must list distinct kinds of {FEATURE_KINDS} other than eval.feature ({e.feature})")
    need(cfg, not cfg.eval.fd_classifier or Path(cfg.eval.fd_classifier).exists(), "eval.fd_classifier",
         "must be a classify run directory or checkpoint that exists")
    need(cfg, 0 <= d.max_corrupt_frac <= 1, "data.max_corrupt_frac", "must be in [0, 1]")
    need(cfg, 0 < d.crop_min <= 1, "data.crop_min", "must be in (0, 1]")
    need(cfg, d.hw_decode_load == -1 or 0 <= d.hw_decode_load <= 1, "data.hw_decode_load",
         "must be in [0, 1], or -1 (the decoder's own)")
    need(cfg, d.cpu_decode_share == -1 or 0 <= d.cpu_decode_share <= 1, "data.cpu_decode_share",
         "must be in [0, 1], or -1 (by the cores)")
    need(cfg, d.finish_threads >= 1 and (d.finish_threads == 1 or d.finish_ahead > 0), "data.finish_threads",
         "must be a positive integer, and 1 with data.finish_ahead=0 (the step's own thread finishes each batch)")
    need(cfg, 0 <= d.color_jitter, "data.color_jitter", "must be >= 0 (0: off)")
    need(cfg, 0 < d.eval_crop_pct <= 1, "data.eval_crop_pct", "must be in (0, 1] (1: resize the whole image)")
    if d.normalize:
        for key in ("data.mean", "data.std"):
            need(cfg, len(_get(cfg, key)) == d.in_chans, key,
                 f"needs one value per channel (data.in_chans={d.in_chans})")
        need(cfg, all(s > 0 for s in d.std), "data.std", "must be positive")
    _need_data_paths(cfg)
    need(cfg, not cfg.device.startswith("cuda") or _cuda_available(), "device",
         "asks for a CUDA GPU, but this process sees none: set device=cpu (or auto)")
    need(cfg, m.img_size == d.img_size, "model.img_size", f"must equal data.img_size ({d.img_size})")
    need(cfg, m.in_chans == d.in_chans, "model.in_chans", f"must equal data.in_chans ({d.in_chans})")
    need(cfg, m.patch_size > 0 and m.img_size % m.patch_size == 0, "model.patch_size",
         f"must divide model.img_size ({m.img_size})")
    need(cfg, m.num_heads > 0 and m.embed_dim % m.num_heads == 0, "model.num_heads",
         f"must divide model.embed_dim ({m.embed_dim})")
    need(cfg, cfg.compile_scope == "blocks" or cfg.dist != "fsdp", "compile_scope",
         "must be blocks under dist=fsdp (FSDP2 shards and compiles block by block)")
    need(cfg, 0 < m.alpha_min <= 1, "model.alpha_min", "must be in (0, 1] (1: plain residuals)")
    need(cfg, 0 <= m.drop_path < 1, "model.drop_path", "must be in [0, 1)")
    need(cfg, 0 <= m.drop_rate < 1, "model.drop_rate", "must be in [0, 1)")
    need(cfg, o.blr > 0 or o.lr > 0, "optim.blr", "must be positive unless optim.lr is (optim.lr is 0)")
    need(cfg, 0 <= o.ema_decay < 1, "optim.ema_decay", "must be in [0, 1)")
    need(cfg, len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), "optim.betas", "must be two numbers in [0, 1)")
    need(cfg, 0 < o.momentum < 1, "optim.momentum", "must be in (0, 1) (optim.name=sgd: Nesterov momentum)")
    need(cfg, 0 <= o.label_smoothing < 1, "optim.label_smoothing", "must be in [0, 1)")


def need_branches_held(cfg: Config, can_hold: bool) -> None:
    """``model.droppath_mode=residual_droppath_frozen`` where the model runs a branch again on held weights
    (``can_hold``) only."""
    need(cfg, cfg.model.droppath_mode != "residual_droppath_frozen" or can_hold, "model.droppath_mode",
         "residual_droppath_frozen runs each branch a second time, which only the ResNet classifiers do (task "
         "classify, model.arch resnet18 | resnet50 | resnet50d)")


def need_no_label_smoothing(cfg: Config) -> None:
    """For a task whose loss has no class labels to smooth."""
    need(cfg, cfg.optim.label_smoothing == 0, "optim.label_smoothing",
         f"applies to task classify only (this is {cfg.task}); leave it at 0")


def dotted_value(d: dict, key: str):
    """``d["a"]["b"]`` for ``key`` "a.b" of a config dict; None where a part is missing."""
    for part in key.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path):
    with open(path, "w") as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)


def without_retired_keys(d: dict) -> dict:
    """A saved config's dict without the keys that no longer exist but held what is now the only behaviour."""
    if d.get("fp8") is False:  # configs saved while float8 matmuls were a switch (off: bf16, the only path now)
        d = {k: v for k, v in d.items() if k != "fp8"}
    data = d.get("data")
    # configs saved while the matmuls could leave multiprocessors to the GPU decode record data.decode_sms: 0 (none)
    if isinstance(data, dict) and data.get("decode_sms") == 0:
        d = {**d, "data": {k: v for k, v in data.items() if k != "decode_sms"}}
    model = d.get("model")
    # configs saved while attention had other backends record model.attn_impl; SDPA is the one left
    if isinstance(model, dict) and model.get("attn_impl") == "sdpa":
        return {**d, "model": {k: v for k, v in model.items() if k != "attn_impl"}}
    return d


def load_config(path) -> Config:
    d = _read_yaml(path)
    if not isinstance(d, dict):
        raise ConfigError(f"{path} must be a YAML mapping")
    return update_from_dict(Config(), without_retired_keys(d))
