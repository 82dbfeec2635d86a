"""The "your model" benchmark: models built by timm and Hugging Face transformers, converted in one line
(``dres.convert_timm_vit``, ``convert_timm_resnet``, ``convert_hf_vit``, ``convert_hf_bert``), trained
side by side with their plain originals, one process per arm.

    python -m benchmarks.bench_own_model --gpus 0,1,2,3 --max-minutes 8 --out $OUT   # everything, 4 GPUs
    python -m benchmarks.bench_own_model --models vit_b16,hf_bert --arms plain_eager,converted_eager
    python -m benchmarks.bench_own_model --repeats 3 --models resnet50d_224          # median and spread
    python -m benchmarks.bench_own_model --no-csrc --arms plain_eager,converted_eager # Triton kernels alone
    python -m benchmarks.bench_own_model --no-fused-mlp --models vit_b16 --arms converted_step  # the models' MLPs
    python -m benchmarks.bench_own_model --repeats 3 --models dinov2_s14 --arms \
        plain_compiled,converted_compiled,converted_compiled_inductor,converted_compiled_kernels  # whose code
    python -m benchmarks.bench_own_model --tiny --gpus 0,1 --steps 8 --warmup 4      # smoke run, tiny configs
    python -m benchmarks.bench_own_model --dry-run                                   # the plan, no GPU

Models (:data:`MODELS`), each from its library's constructor with random weights drawn from one seed, so
every arm starts from the same weights: timm ``vit_base_patch16_224`` (drop path 0.1: timm's own in the
plain arms, the converter's controller in the converted ones, which create the model without it), timm
DINOv2 ViT-S/14 at 224 px, HF ``Dinov2ForImageClassification`` (small: 384 wide, 6 heads, patch 14, 224 px),
HF ``ViTMAEForPreTraining`` (base; one fixed ``noise``, so every step masks
alike in every arm), HF ``ViTForImageClassification`` (base, 1000 labels), HF ``BertForMaskedLM`` (base,
sequence 128, 15% of the tokens labelled), HF ``GPT2LMHeadModel`` (small, sequence 1024), HF
``CLIPVisionModel`` (base, patch 32 as ``CLIPVisionConfig()`` has it, 224 px; the loss: its pooled output's mean square), timm ``resnet50d`` at
224 and at 32 px (channels_last).
``--tiny`` puts a small config of the same constructor in place of each (the CPU test, a GPU smoke run).

Arms (:data:`ARMS`): plain and converted model, each eager, ``torch.compile(model)`` (default mode, as a
new user writes it) and through ``dres.compile_step`` (the one-line step: compiled forward, the whole step
captured in a CUDA graph); ``converted_compiled_inductor`` and ``converted_compiled_kernels`` (named in ``--arms``,
not run by default): the converted model compiled with every dres op on its PyTorch formula (as ``--backend torch``
below) or on the dres kernels (``--backend triton``), so that one command times ``backend=None``'s choice under
compile (launch-bound ops on Inductor's code, the rest on the kernels: ``dres.ops.checks.resolve_backend_by_work``)
beside either extreme. Every arm trains with bf16 autocast and fused AdamW (lr 1e-4) on
``NUM_BATCHES`` synthetic batches drawn once from a fixed seed, already on the device, cycled: the same
batches, in the same order, in every arm.

Per arm, in a process of its own (no compile cache or allocator state passes between arms): ``--steps``
optimizer steps, the loss of each recorded (the loss track, from step 0); the first ``--warmup`` are
untimed (compilation and capture happen there), the rest timed with CUDA events around each step, no
synchronisation in between: samples/s = batch / median step time. Peak memory:
``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` over the timed steps, reset after the
warm-up; the one-line steps compare the reserved peak (:data:`PEAK_KEY`), the others the allocated one. Where
the arms draw random masks (the ViT's drop path, BERT's dropout), plain and converted draw different ones, and
their loss difference holds that too. ``--gpus`` runs one arm per GPU at a time, each
child pinned to its share of the host's cores (``OMP_NUM_THREADS`` capped to it), model by model (a run cut by
``--max-minutes`` leaves whole models), each model's slowest arms first;
``--repeats N`` runs every arm N times, the compared arms in alternating order, and reports the median and
spread over the N processes, and each ratio also round by round (the arms of one round ran back to back, so a
round's ratio leaves out what the host did between rounds). Where the csrc extension is built (``DRES_BUILD_CUDA=1``), the fused residual ops'
eager calls run its kernels and C++ autograd (``backend=None``'s choice); ``--no-csrc`` runs every arm without
it (``dres._C`` not loaded in the arm's process: the Triton kernels and Python autograd alone), and each arm
record says which (``csrc_extension``). ``--no-fused-mlp`` converts with ``fused_mlp=False`` (the models'
own MLPs, Inductor's under torch.compile: its MLP at ViT-B's widths is faster than the fused one, which keeps half
the activations; ``fused_mlp`` in each record). ``--stream-dtype bf16`` converts the timm ViTs with
``stream_dtype=torch.bfloat16`` (their residual stream carried in bf16 under autocast, a change of function whose
loss track the record shows; ``stream_dtype`` in each record). ``--no-aligned-head`` converts the language models
with ``aligned_head=False`` (their vocabulary heads as HF has them; ``aligned_head`` in each record).
``--backend torch`` points the converted models' dres ops at their PyTorch formulas (``dres.nn.set_backend``), which
Inductor fuses in its own code under torch.compile: the converted arms then keep the conversion's other changes (one
q/k/v GEMM, HF's mask left out, the patch GEMM) without a dres kernel; ``backend`` in each record (``--backend``
leaves the two arms that force a backend on theirs).

The record folder (default ``records/benchmarks/<machine>-<today>-own-models``): ``arms/<model>-<arm>-<repeat>.json``
(one a process, a failed arm with its one-line error), ``logs/`` (each process's output), ``summary.json``,
``own-models.md`` (the table), ``loss-tracks.png`` and, with ``--profile-steps`` or ``--host-steps``, ``profiles.md``
(each arm's step by kernel category and its top kernels; the host's own time a step, by where its Python lives:
dres, torch's autograd, the model's library, the C functions that run the ops and launch the kernels).
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

if __package__ in (None, ""):  # `python benchmarks/bench_own_model.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from benchmarks import measure
from benchmarks.train_step import time_steps

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_SEED = 0  # the weights of every arm
DATA_SEED = 1  # the batches and labels
NOISE_SEED = 2  # MAE's masking noise, one tensor for every step
NUM_BATCHES = 4  # distinct batches, cycled
LR = 1e-4
MLM_PROBABILITY = 0.15


# ---------------------------------------------------------------------------------------------
# The models


@dataclass(frozen=True)
class Size:
    """One configuration of a model: ``image`` is the image side (the sequence length for BERT),
    ``classes`` the labels (the vocabulary for BERT), ``kwargs`` the rest of its constructor's arguments."""

    batch: int
    image: int
    classes: int
    kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ModelSpec:
    title: str
    unit: str  # what one sample is, as a rate
    build: Callable[[Size, bool, dict], torch.nn.Module]  # (size, converted, conversion) -> the model, weights from
    # the seed set before; conversion: the converter's keyword arguments (fused_mlp, aligned_head, stream_dtype:
    # each where it takes them)
    inputs: Callable[[Size, torch.Generator], tuple]  # one synthetic batch on the CPU
    loss: Callable[..., torch.Tensor]  # (model, *batch) -> 0-dim loss
    full: Size
    tiny: Size
    channels_last: bool = False


def timm_vit(variant: str, drop_path: float, size: Size, converted: bool, conversion: dict) -> torch.nn.Module:
    """timm's ``variant``; its drop path is timm's own when plain, the converter's controller when converted."""
    import timm

    import dres

    model = timm.create_model(variant, img_size=size.image, num_classes=size.classes,
                              drop_path_rate=0.0 if converted else drop_path, **size.kwargs)
    return dres.convert_timm_vit(model, drop_path=drop_path, **taken(dres.convert_timm_vit, conversion)) if converted \
        else model


def timm_resnet(size: Size, converted: bool, conversion: dict) -> torch.nn.Module:
    import timm

    import dres

    model = timm.create_model("resnet50d", num_classes=size.classes, **size.kwargs)
    return dres.convert_timm_resnet(model) if converted else model


def hf_model(model_class: str, config_class: str, converter: str, config_args: Callable[[Size], dict], size: Size,
             converted: bool, conversion: dict) -> torch.nn.Module:
    """transformers' ``model_class(config_class(...))``, converted by ``dres.<converter>``."""
    import transformers

    import dres

    config = getattr(transformers, config_class)(**config_args(size), **size.kwargs)
    model = getattr(transformers, model_class)(config)
    convert = getattr(dres, converter)
    return convert(model, **taken(convert, conversion)) if converted else model


def taken(converter: Callable, conversion: dict) -> dict:
    """The keyword arguments of ``conversion`` that ``converter`` takes (``aligned_head`` only the language
    models' converters)."""
    return {k: v for k, v in conversion.items() if k in inspect.signature(converter).parameters}


def images(size: Size, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(size.batch, 3, size.image, size.image, generator=gen)


def image_batch(size: Size, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Images and class labels."""
    return images(size, gen), torch.randint(0, size.classes, (size.batch,), generator=gen)


def mae_batch(size: Size, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Images and the masking noise, the same noise in every batch (its own generator)."""
    patches = (size.image // size.kwargs.get("patch_size", 16)) ** 2  # ViTMAEConfig's default patch is 16
    noise = torch.rand(size.batch, patches, generator=torch.Generator().manual_seed(NOISE_SEED))
    return images(size, gen), noise


def mlm_batch(size: Size, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and masked-LM labels: ``MLM_PROBABILITY`` of the positions labelled, the rest ignored (-100)."""
    ids = torch.randint(0, size.classes, (size.batch, size.image), generator=gen)
    labelled = torch.rand(ids.shape, generator=gen) < MLM_PROBABILITY
    return ids, torch.where(labelled, ids, torch.full_like(ids, -100))


def image_only_batch(size: Size, gen: torch.Generator) -> tuple[torch.Tensor]:
    return (images(size, gen),)


def lm_batch(size: Size, gen: torch.Generator) -> tuple[torch.Tensor]:
    """Token ids of ``size.image`` positions (a causal LM's inputs and its labels)."""
    return (torch.randint(0, size.classes, (size.batch, size.image), generator=gen),)


def classification_loss(model, images, labels) -> torch.Tensor:
    out = model(images)
    return F.cross_entropy(getattr(out, "logits", out), labels)  # transformers models return an output object


def mae_loss(model, images, noise) -> torch.Tensor:
    return model(pixel_values=images, noise=noise).loss


def mlm_loss(model, ids, labels) -> torch.Tensor:
    return model(input_ids=ids, labels=labels).loss


def lm_loss(model, ids) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def pooled_feature_loss(model, images) -> torch.Tensor:
    """A vision tower without a head (CLIP's): the mean square of its pooled output."""
    return model(pixel_values=images).pooler_output.float().square().mean()


STREAM_DTYPES = {"bf16": torch.bfloat16}  # --stream-dtype: the converter's stream_dtype
SMALL_VIT = dict(embed_dim=64, depth=2, num_heads=2)
SMALL_HF = dict(patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
SMALL_RESNET = dict(layers=(1, 1, 1, 1))
TINY_BATCH = 4

MODELS = {
    "vit_b16": ModelSpec(
        "timm vit_base_patch16_224, drop path 0.1", "img/s", functools.partial(timm_vit, "vit_base_patch16_224", 0.1),
        image_batch, classification_loss, Size(128, 224, 1000),
        Size(TINY_BATCH, 32, 10, dict(patch_size=8, **SMALL_VIT))),
    "dinov2_s14": ModelSpec(
        "timm vit_small_patch14_dinov2, 224 px", "img/s", functools.partial(timm_vit, "vit_small_patch14_dinov2", 0.0),
        image_batch, classification_loss, Size(128, 224, 1000), Size(TINY_BATCH, 28, 10, SMALL_VIT)),
    "hf_dinov2_s14": ModelSpec(
        "HF Dinov2ForImageClassification, small, 224 px", "img/s",
        functools.partial(hf_model, "Dinov2ForImageClassification", "Dinov2Config", "convert_hf_vit",
                          lambda size: {"image_size": size.image, "num_labels": size.classes}),
        image_batch, classification_loss, Size(128, 224, 1000, dict(hidden_size=384, num_attention_heads=6, patch_size=14)),
        Size(TINY_BATCH, 32, 10, dict(patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      mlp_ratio=2))),
    "hf_vitmae": ModelSpec(
        "HF ViTMAEForPreTraining, base", "img/s",
        functools.partial(hf_model, "ViTMAEForPreTraining", "ViTMAEConfig", "convert_hf_vit",
                          lambda size: {"image_size": size.image}),
        mae_batch, mae_loss, Size(256, 224, 0),
        Size(TINY_BATCH, 32, 0, dict(SMALL_HF, decoder_hidden_size=32, decoder_num_hidden_layers=1,
                                     decoder_num_attention_heads=2, decoder_intermediate_size=64))),
    "hf_vit": ModelSpec(
        "HF ViTForImageClassification, base", "img/s",
        functools.partial(hf_model, "ViTForImageClassification", "ViTConfig", "convert_hf_vit",
                          lambda size: {"image_size": size.image, "num_labels": size.classes}),
        image_batch, classification_loss, Size(128, 224, 1000), Size(TINY_BATCH, 32, 10, SMALL_HF)),
    "hf_bert": ModelSpec(
        "HF BertForMaskedLM, base, sequence 128", "seq/s",
        functools.partial(hf_model, "BertForMaskedLM", "BertConfig", "convert_hf_bert",
                          lambda size: {"vocab_size": size.classes, "max_position_embeddings": max(512, size.image)}),
        mlm_batch, mlm_loss, Size(128, 128, 30522),
        Size(TINY_BATCH, 16, 100, {k: v for k, v in SMALL_HF.items() if k != "patch_size"})),
    "hf_gpt2": ModelSpec(
        "HF GPT2LMHeadModel, small, sequence 1024", "seq/s",
        functools.partial(hf_model, "GPT2LMHeadModel", "GPT2Config", "convert_hf_gpt2",
                          lambda size: {"vocab_size": size.classes, "n_positions": max(1024, size.image)}),
        lm_batch, lm_loss, Size(16, 1024, 50257), Size(TINY_BATCH, 16, 100, dict(n_embd=32, n_layer=2, n_head=2))),
    "hf_clip_vision": ModelSpec(
        "HF CLIPVisionModel, base patch 32 (CLIPVisionConfig()), 224 px", "img/s",
        functools.partial(hf_model, "CLIPVisionModel", "CLIPVisionConfig", "convert_hf_vit",
                          lambda size: {"image_size": size.image}),
        image_only_batch, pooled_feature_loss, Size(128, 224, 1),
        Size(TINY_BATCH, 32, 1, SMALL_HF)),
    "resnet50d_224": ModelSpec(
        "timm resnet50d, 224 px, channels_last", "img/s", timm_resnet, image_batch, classification_loss,
        Size(256, 224, 1000), Size(TINY_BATCH, 32, 10, SMALL_RESNET), channels_last=True),
    "resnet50d_32": ModelSpec(
        "timm resnet50d, 32 px, channels_last", "img/s", timm_resnet, image_batch, classification_loss,
        Size(256, 32, 1000), Size(TINY_BATCH, 16, 10, SMALL_RESNET), channels_last=True),
}


# ---------------------------------------------------------------------------------------------
# The arms


@dataclass(frozen=True)
class Arm:
    converted: bool
    mode: str  # "eager", "compiled" (torch.compile(model)) or "step" (dres.compile_step)
    label: str
    backend: Optional[str] = None  # the converted model's dres.ops backend whatever --backend says


# slowest first (the order in which a run starts a model's arms), plain and converted of each mode side by side
ARMS = {
    "converted_step": Arm(True, "step", "converted, one-line step"),
    "plain_step": Arm(False, "step", "plain, one-line step"),
    "converted_compiled": Arm(True, "compiled", "converted, torch.compile"),
    "converted_compiled_inductor": Arm(True, "compiled", "converted, torch.compile, the ops on Inductor's code",
                                       "torch"),
    "converted_compiled_kernels": Arm(True, "compiled", "converted, torch.compile, every op on the dres kernels",
                                      "triton"),
    "plain_compiled": Arm(False, "compiled", "plain, torch.compile"),
    "converted_eager": Arm(True, "eager", "converted, eager"),
    "plain_eager": Arm(False, "eager", "plain, eager"),
}
# every arm but those that force a backend: the A/B arms run when named
DEFAULT_ARMS = [name for name, arm in ARMS.items() if arm.backend is None]
MODE_ORDER = list(dict.fromkeys(arm.mode for arm in ARMS.values()))
# the peak memory a mode's arms compare: a replayed graph's memory is its pool's, reserved at the capture and
# never allocated again, so a captured step's allocated peak holds its parameters and optimizer state alone
PEAK_KEY = {"eager": "peak_mem_gib", "compiled": "peak_mem_gib", "step": "peak_reserved_gib"}
PROFILE_TOP = 40  # kernels and CPU operators kept of each profiled arm
STEP_WARMUP = 3  # dres.compile_step's eager steps before its capture (its default warmup_steps)
REFERENCE_ARM = "plain_eager"  # the loss tracks' reference
NOISE_ARM = "plain_compiled"  # its own difference to the reference is the noise to read the others against
# The ratios the table quotes: each key's arm's rate over the rate of the arm it is compared with.
RATIOS = {
    "eager_ratio": ("converted_eager", "plain_eager"),
    "compiled_ratio": ("converted_compiled", "plain_compiled"),
    "compiled_inductor_ratio": ("converted_compiled_inductor", "plain_compiled"),
    "compiled_kernels_ratio": ("converted_compiled_kernels", "plain_compiled"),
    "step_vs_plain_compiled": ("converted_step", "plain_compiled"),
    "plain_step_vs_plain_compiled": ("plain_step", "plain_compiled"),
}


def autocast_loss(loss: Callable, device_type: str, model, *batch) -> torch.Tensor:
    """The model's loss under bf16 autocast: the ``loss_fn(model, *batch)`` every arm trains with."""
    with torch.autocast(device_type, dtype=torch.bfloat16):
        return loss(model, *batch)


def training_step(mode: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  loss_fn: Callable) -> Callable[..., torch.Tensor]:
    """``step(*batch) -> loss``: one optimizer step of ``mode`` (:class:`Arm`), as a user's loop writes it."""
    if mode == "step":
        import dres

        return dres.compile_step(model, optimizer, loss_fn, warmup_steps=STEP_WARMUP)
    forward = torch.compile(model) if mode == "compiled" else model

    def step(*batch):
        loss = loss_fn(forward, *batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def make_batches(spec: ModelSpec, size: Size, device: torch.device) -> list[tuple]:
    """``NUM_BATCHES`` batches drawn from ``DATA_SEED`` on the CPU (the same on every device), moved to ``device``."""
    gen = torch.Generator().manual_seed(DATA_SEED)
    batches = []
    for _ in range(NUM_BATCHES):
        batch = tuple(t.to(device) for t in spec.inputs(size, gen))
        if spec.channels_last:
            batch = (batch[0].contiguous(memory_format=torch.channels_last),) + batch[1:]
        batches.append(batch)
    return batches


def cpu_step_ms(run_step: Callable[[], None], steps: int) -> list[float]:
    """Wall milliseconds of each of ``steps`` calls (the CPU's stand-in of :func:`time_steps`)."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        run_step()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def library_versions() -> dict:
    """torch and triton (:func:`measure.versions`), timm and transformers where installed."""
    from importlib import metadata

    found = measure.versions()
    for package in ("timm", "transformers"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None
    return found


def dynamo_graphs() -> dict:
    """The graphs Dynamo compiled in this process and the graph breaks it met: each break splits a compiled
    step in two graphs with Python between them (host time, no fusion across)."""
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values())}


def one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


def measure_arm(model_name: str, arm_name: str, *, device: torch.device, tiny: bool, steps: int,
                warmup: int, profile_steps: int = 0, host_steps: int = 0, fused_mlp: bool = True,
                aligned_head: bool = True, stream_dtype: Optional[str] = None, backend: Optional[str] = None) -> dict:
    """Train ``model_name`` in arm ``arm_name`` for ``steps`` steps (the first ``warmup`` untimed), then
    ``profile_steps`` more under ``torch.profiler`` (on a GPU) and twice ``host_steps`` more for the host's own time
    (:func:`benchmarks.profile_train.host_time`): the figures of the record (:func:`run_arm`)."""
    spec, arm = MODELS[model_name], ARMS[arm_name]
    size = spec.tiny if tiny else spec.full
    t0 = time.time()
    torch.manual_seed(MODEL_SEED)
    conversion = {"fused_mlp": fused_mlp, "aligned_head": aligned_head,
                  **({"stream_dtype": STREAM_DTYPES[stream_dtype]} if stream_dtype else {})}
    model = spec.build(size, arm.converted, conversion).to(device).train()
    if arm.converted and backend is not None:
        from dres.nn import set_backend

        set_backend(model, backend)
    if spec.channels_last:
        model = model.to(memory_format=torch.channels_last)
    batches = make_batches(spec, size, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    step = training_step(arm.mode, model, optimizer, functools.partial(autocast_loss, spec.loss, device.type))
    extra = profile_steps + 2 * host_steps
    losses = torch.zeros(steps + extra, device=device)  # the profiled steps' losses are not kept
    done = iter(range(steps + extra))

    def run_step():
        i = next(done)
        losses[i] = step(*batches[i % NUM_BATCHES])  # a copy on the device: no synchronisation per step

    for _ in range(warmup):
        run_step()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    warmup_s = time.time() - t0
    graphs = dynamo_graphs() if arm.mode != "eager" else {"graphs": None, "graph_breaks": None}
    times = time_steps(run_step, steps - warmup) if cuda else cpu_step_ms(run_step, steps - warmup)
    ms = statistics.median(times)
    peaks = {"peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
             "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None}
    profile = None
    if profile_steps and cuda:
        from benchmarks.profile_train import profile_steps as profiled

        profile = profiled(run_step, profile_steps, None, top=PROFILE_TOP)
    host = None
    if host_steps:
        from benchmarks.profile_train import host_time

        host = host_time(run_step, host_steps, top=PROFILE_TOP)
    return {
        "samples_per_s": size.batch / (ms / 1e3), "step_ms": ms, "step_ms_min": min(times),
        "step_ms_max": max(times), "warmup_s": warmup_s, "losses": losses[:steps].tolist(), "profile": profile,
        "host": host,
        **peaks, **graphs,
        "captured": getattr(step, "captured", None), "why_eager": getattr(step, "why_eager", None),
    }


def arm_identity(model_name: str, arm_name: str, repeat: int, tiny: bool) -> dict:
    """What an arm record says it measured, whether it finished or not."""
    spec, arm = MODELS[model_name], ARMS[arm_name]
    return {"model": model_name, "title": spec.title + (" (tiny config)" if tiny else ""), "unit": spec.unit,
            "arm": arm_name, "repeat": repeat, "converted": arm.converted, "mode": arm.mode, "tiny": tiny,
            "batch": (spec.tiny if tiny else spec.full).batch, "date": measure.today()}


def run_arm(model_name: str, arm_name: str, repeat: int, *, device: torch.device, tiny: bool, steps: int,
            warmup: int, profile_steps: int = 0, host_steps: int = 0, fused_mlp: bool = True,
            aligned_head: bool = True, stream_dtype: Optional[str] = None, backend: Optional[str] = None) -> dict:
    """The record of one arm: what ran, where, with which versions, and its figures or its one-line error."""
    spec = MODELS[model_name]
    backend = ARMS[arm_name].backend or backend
    rec = {
        **arm_identity(model_name, arm_name, repeat, tiny), "image": (spec.tiny if tiny else spec.full).image,
        "steps": steps, "warmup": warmup, "num_batches": NUM_BATCHES, "autocast": "bf16", "optimizer": "AdamW fused",
        "lr": LR, "peak_mem": "max_memory_allocated (reserved) over the timed steps, reset after the warm-up",
        "device": device.type, "card": measure.card_name() if device.type == "cuda" else "cpu",
        "gpu": os.environ.get("CUDA_VISIBLE_DEVICES"), "cores": len(os.sched_getaffinity(0)), **library_versions(),
        "fused_mlp": fused_mlp, "aligned_head": aligned_head, "stream_dtype": stream_dtype,
        "backend": backend or "auto",
    }
    t0 = time.time()
    try:
        rec.update(measure_arm(model_name, arm_name, device=device, tiny=tiny, steps=steps, warmup=warmup,
                               profile_steps=profile_steps, host_steps=host_steps, fused_mlp=fused_mlp,
                               aligned_head=aligned_head, stream_dtype=stream_dtype, backend=backend), error=None)
    except Exception as e:  # an import error, out of memory, a failed compile: recorded, the other arms go on
        rec["error"] = one_line(e)
    rec["wall_s"] = time.time() - t0
    from dres.ops import csrc_backend

    rec["csrc_extension"] = csrc_backend.available()
    return rec


# ---------------------------------------------------------------------------------------------
# The summary


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def max_loss_diff(track: Optional[list], reference: Optional[list]) -> Optional[float]:
    """max |track - reference| over the steps both have."""
    if not track or not reference:
        return None
    return max(abs(a - b) for a, b in zip(track, reference))


def arm_figures(records: list[dict]) -> dict:
    """One arm's repeats: the median samples/s and its spread ((max - min) / median, percent) over the
    processes that finished, their median peak memories; the errors of those that failed."""
    ok = [r for r in records if not r.get("error")]
    figures = {"processes": len(ok), "errors": [r["error"] for r in records if r.get("error")]}
    if not ok:
        return figures
    rates = [r["samples_per_s"] for r in ok]
    median = statistics.median(rates)

    def median_of(key):
        values = [r[key] for r in ok if r.get(key) is not None]
        return statistics.median(values) if values else None

    figures.update(samples_per_s=median, spread_pct=100 * (max(rates) - min(rates)) / median,
                   peak_mem_gib=median_of("peak_mem_gib"), peak_reserved_gib=median_of("peak_reserved_gib"),
                   graphs=median_of("graphs"), graph_breaks=median_of("graph_breaks"),
                   captured=ok[0].get("captured"), why_eager=ok[0].get("why_eager"))
    return figures


def loss_diffs(records: list[dict]) -> dict[str, Optional[float]]:
    """Per arm: max |loss - the reference arm's loss| over the steps, each repeat against the reference's
    same repeat, the largest over the repeats (None where no repeat of the two finished)."""
    reference = {r["repeat"]: r["losses"] for r in records if r["arm"] == REFERENCE_ARM and not r.get("error")}
    per_arm: dict[str, list[float]] = {}
    for r in records:
        if r["arm"] != REFERENCE_ARM:
            d = None if r.get("error") else max_loss_diff(r["losses"], reference.get(r["repeat"]))
            per_arm.setdefault(r["arm"], []).extend([] if d is None else [d])
    return {arm: max(diffs) if diffs else None for arm, diffs in per_arm.items()}


def ratios_by_round(records: list[dict], arm: str, base: str) -> list[float]:
    """``arm``'s rate over ``base``'s in each round (repeat) where both finished: the arms of a round ran one
    after the other, so these pairs leave out what the host did between rounds."""
    def rates(name):
        return {r["repeat"]: r["samples_per_s"] for r in records
                if r["arm"] == name and not r.get("error") and r.get("samples_per_s")}

    mine, theirs = rates(arm), rates(base)
    return [mine[k] / theirs[k] for k in sorted(mine) if k in theirs]


def summarize(records: list[dict]) -> list[dict]:
    """A row per model (in :data:`MODELS`' order) of the arms' figures and the ratios the table quotes
    (:data:`RATIOS`: each converted arm against the plain arm of its mode, the one-line steps against plain
    torch.compile), medians' ratios and, under ``by_round``, each round's; peak memory converted / plain per
    mode, and each arm's max |loss difference| to plain eager."""
    rows = []
    for model in [m for m in MODELS if any(r["model"] == m for r in records)]:
        mine = [r for r in records if r["model"] == model]
        arms = {a: arm_figures([r for r in mine if r["arm"] == a]) for a in ARMS if any(r["arm"] == a for r in mine)}

        def figure(arm, key="samples_per_s"):
            return arms.get(arm, {}).get(key)

        def peak_ratio(mode):
            key = PEAK_KEY[mode]
            return ratio(figure(f"converted_{mode}", key), figure(f"plain_{mode}", key))

        diffs = loss_diffs(mine)
        rows.append({
            "model": model, "title": mine[0]["title"], "unit": mine[0]["unit"], "batch": mine[0]["batch"],
            "arms": arms,
            **{key: ratio(figure(arm), figure(base)) for key, (arm, base) in RATIOS.items()},
            "by_round": {key: ratios_by_round(mine, arm, base) for key, (arm, base) in RATIOS.items()},
            "peak_mem_ratio": {mode: peak_ratio(mode) for mode in ("eager", "compiled", "step")},
            "loss_diff": diffs,
            "loss_noise": diffs.get(NOISE_ARM),
        })
    return rows


def _rate(row: dict, arm: str, unit: bool = False) -> str:
    figures = row["arms"].get(arm)
    if figures is None:
        return "not run"
    if figures.get("samples_per_s") is None:
        return "failed"
    return f"{figures['samples_per_s']:,.0f}" + (f" {row['unit']}" if unit else "")


def _times(x: Optional[float]) -> str:
    return "–" if x is None else f"{x:.2f}x"


def _ratio(row: dict, key: str) -> str:
    """A ratio, and each round's where more than one round has it."""
    rounds = row["by_round"][key]
    by_round = f"; by round {', '.join(_times(x) for x in rounds)}" if len(rounds) > 1 else ""
    return _times(row[key]) + by_round


def _pair(row: dict, mode: str, ratio_key: str) -> str:
    return f"{_rate(row, f'plain_{mode}')} -> {_rate(row, f'converted_{mode}')} ({_ratio(row, ratio_key)})"


def _compiled_pair(row: dict) -> str:
    """The compiled pair, and each compiled arm that forces a backend where it ran, named by its label's last
    clause ("the ops on Inductor's code")."""
    forced = "".join(f"; {ARMS[arm].label.rpartition(', ')[2]} {_rate(row, arm)} ({_ratio(row, key)})"
                     for key, (arm, _) in RATIOS.items()
                     if ARMS[arm].mode == "compiled" and ARMS[arm].backend and arm in row["arms"])
    return _pair(row, "compiled", "compiled_ratio") + forced


def _number(x: Optional[float], fmt: str = ".2f") -> str:
    return "–" if x is None else format(x, fmt)


def markdown(rows: list[dict], *, header: list[str], failed: list[dict], not_run: list[str]) -> str:
    """The table BENCHMARKS.md quotes (a row a model), then every arm's figures, then the failed arms with
    their errors and the arms that were not run."""
    lines = header + [
        "", "| model | unit | eager plain -> converted (ratio) | compiled plain -> converted (ratio) | "
            "one-line step (converted) vs plain compiled | peak memory converted/plain | max \\|loss diff\\| |",
        "|---|---|---|---|---|---|---|"]
    for row in rows:
        peak = ", ".join(f"{mode} {_number(r)}" for mode, r in row["peak_mem_ratio"].items() if r is not None) or "–"
        converted_diffs = [d for a, d in row["loss_diff"].items() if ARMS[a].converted and d is not None]
        loss = (f"{_number(max(converted_diffs) if converted_diffs else None, '.2g')} "
                f"(noise {_number(row['loss_noise'], '.2g')})")
        step = f"{_ratio(row, 'step_vs_plain_compiled')} (plain step {_ratio(row, 'plain_step_vs_plain_compiled')})"
        lines.append(f"| {row['title']}, batch {row['batch']} | {row['unit']} | {_pair(row, 'eager', 'eager_ratio')} | "
                     f"{_compiled_pair(row)} | {step} | {peak} | {loss} |")
    lines += ["", "| model | arm | rate (median) | processes | spread | peak GiB allocated | reserved | "
                  "max \\|loss diff\\| to plain eager | graphs (breaks) | captured / why eager |", "|---" * 10 + "|"]
    for row in rows:
        for arm, figures in row["arms"].items():
            how = "" if ARMS[arm].mode != "step" else (
                "captured" if figures.get("captured") else f"eager: {figures.get('why_eager')}")
            spread = _number(figures.get("spread_pct"), ".1f") + "%" if figures["processes"] > 1 else "–"
            peaks = f"{_number(figures.get('peak_mem_gib'))} | {_number(figures.get('peak_reserved_gib'))}"
            graphs = ("–" if figures.get("graphs") is None else
                      f"{figures['graphs']:.0f} ({figures['graph_breaks']:.0f})")
            lines.append(f"| {row['model']} | {arm} | {_rate(row, arm, unit=True)} | {figures['processes']} | "
                         f"{spread} | {peaks} | {_number(row['loss_diff'].get(arm), '.2g')} | {graphs} | {how} |")
    if failed:
        lines += ["", "Failed:"] + [f"- {r['model']} {r['arm']} (repeat {r['repeat']}): {r['error']}" for r in failed]
    if not_run:
        lines += ["", "Not run: " + ", ".join(not_run)]
    return "\n".join(lines) + "\n"


def profile_markdown(records: list[dict]) -> str:
    """Each profiled arm's step: wall and GPU-busy time, GPU time by kernel category, and its top kernels; and each
    arm's host time a step, by where its Python lives, with its top functions."""
    from benchmarks.profile_train import CATEGORIES, OTHER

    profiled = [r for r in records if r.get("profile")]
    cats = [c for c, _ in CATEGORIES if c != "communication"] + [OTHER]
    lines = host_markdown([r for r in records if r.get("host")])
    if not profiled:
        return "\n".join(lines)
    lines += markdown_table(
        "# Where each arm's step goes (torch.profiler, ms per step)", ["model", "arm", "wall", "GPU busy", "kernels", *cats],
        [[r["model"], r["arm"], f"{p['wall_us_per_step'] / 1e3:.1f}", f"{p['gpu_busy_pct']:.0f}%",
          f"{p['gpu_kernels_per_step']:.0f}", *(f"{p['categories_us'].get(c, 0.0) / 1e3:.1f}" for c in cats)]
         for r, p in ((r, r["profile"]) for r in profiled)])
    for r in profiled:
        lines += ["", f"## {r['model']} {r['arm']}: top GPU kernels (us a step, calls a step)", ""]
        lines += [f"    {k['us']:9.1f} {k['calls']:6.1f}  {k['name']}" for k in r["profile"]["top_kernels"]]
    return "\n".join(lines) + "\n"


def markdown_table(title: str, columns: list[str], rows: list[list[str]]) -> list[str]:
    return [title, "", "| " + " | ".join(columns) + " |", "|---" * len(columns) + "|",
            *("| " + " | ".join(row) + " |" for row in rows)]


def host_markdown(records: list[dict]) -> list[str]:
    """The host-time section of profiles.md (records with a ``host`` figure)."""
    if not records:
        return []
    places = list(dict.fromkeys(p for r in records for p in r["host"]["by_place_ms"]))
    lines = markdown_table(
        "# The host's time a step (ms): unprofiled from an idle GPU; under cProfile by where the code lives",
        ["model", "arm", "host (median)", "min", "under cProfile", *places],
        [[r["model"], r["arm"], f"{h['host_ms_per_step']:.1f}", f"{h['host_ms_min']:.1f}",
          f"{h['profiled_ms_per_step']:.1f}", *(f"{h['by_place_ms'].get(p, 0.0):.1f}" for p in places)]
         for r, h in ((r, r["host"]) for r in records)])
    for r in records:
        lines += ["", f"## {r['model']} {r['arm']}: top functions by own time (ms a step, cumulative ms, calls a step)",
                  ""]
        lines += [f"    {f['own_ms']:8.3f} {f['cumulative_ms']:8.3f} {f['calls']:7.1f}  {f['function']}"
                  for f in r["host"]["top_own"]]
    return lines + [""]


def plot_loss_tracks(records: list[dict], path: Path) -> Optional[str]:
    """One panel per model, a line per arm (its first finished repeat); None without matplotlib."""
    from dres.eval.curves import plot_curves
    from dres.optional import MissingExtra

    series: dict[str, dict[int, dict]] = {}
    for r in sorted(records, key=lambda r: r["repeat"], reverse=True):  # the first repeat written last wins
        if not r.get("error"):
            points = series.setdefault(ARMS[r["arm"]].label, {})
            for i, loss in enumerate(r["losses"]):
                points.setdefault(i, {"step": i})[r["model"]] = loss
    if not series:
        return None
    try:
        return plot_curves({label: [points[i] for i in sorted(points)] for label, points in series.items()}, path,
                           keys=[m for m in MODELS if any(r["model"] == m for r in records)], x="step",
                           title="loss of every step, the same batches in every arm")
    except MissingExtra:
        return None


# ---------------------------------------------------------------------------------------------
# The run: one process per arm, one arm per GPU at a time


@dataclass(frozen=True)
class Job:
    model: str
    arm: str
    repeat: int

    @property
    def name(self) -> str:
        return f"{self.model}-{self.arm}-{self.repeat}"


def arm_path(out: Path, job: Job) -> Path:
    return out / "arms" / f"{job.name}.json"


def plan_jobs(models: list[str], arms: list[str], repeats: int) -> list[Job]:
    """Every (model, arm, repeat), repeat by repeat; in a repeat model by model (in the given order), so that a
    run cut by ``--max-minutes`` leaves whole models with both arms of each ratio; a model's slowest arms first
    (steps, compiled, eager), plain and converted of a mode in turn first from one repeat to the next."""
    jobs = []
    for repeat in range(repeats):
        order = [a for a in ARMS if a in arms]
        if repeat % 2:
            order.sort(key=lambda a: (MODE_ORDER.index(ARMS[a].mode), ARMS[a].converted))  # plain first
        jobs += [Job(m, a, repeat) for m in models for a in order]
    return jobs


def worker_command(job: Job, args, cores: Optional[list[int]] = None) -> list[str]:
    """The command of ``job``'s process, held to ``cores`` where given."""
    cmd = [sys.executable, "-m", "benchmarks.bench_own_model", "--models", job.model, "--arms", job.arm,
           "--worker", str(job.repeat), "--device", args.device, "--steps", str(args.steps), "--warmup",
           str(args.warmup), "--profile-steps", str(args.profile_steps), "--host-steps", str(args.host_steps),
           "--out", str(args.out)]
    flags = [flag for flag, on in (("--tiny", args.tiny), ("--no-csrc", args.no_csrc),
                                   ("--no-fused-mlp", args.no_fused_mlp),
                                   ("--no-aligned-head", args.no_aligned_head)) if on]
    flags += ["--backend", args.backend] if args.backend else []
    flags += ["--stream-dtype", args.stream_dtype] if args.stream_dtype else []
    return cmd + flags + (["--cores", ",".join(map(str, cores))] if cores else [])


def core_shares(slots: int) -> list[list[int]]:
    """This process's cores split into ``slots`` contiguous shares (at least one core each)."""
    cores = sorted(os.sched_getaffinity(0))
    share = max(1, len(cores) // slots)
    return [cores[(k * share) % len(cores):][:share] for k in range(slots)]


def last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()] if path.exists() else []
    return lines[-1].strip()[:300] if lines else "no output"


def load_arm_records(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((out / "arms").glob("*.json"))]


def write_summary(out: Path, args, jobs: list[Job], slots: int, *, plot: bool) -> str:
    """summary.json and the Markdown table from every arm record in ``out`` (earlier calls' included);
    the loss-track figure when ``plot``. Returns the table."""
    records = load_arm_records(out)
    rows = summarize(records)
    failed = [r for r in records if r.get("error")]
    not_run = [j.name for j in jobs if not arm_path(out, j).exists()]
    # the versions the arms ran with (this process's where no arm says)
    env = {k: ", ".join(sorted({str(r[k]) for r in records if r.get(k)})) or v for k, v in library_versions().items()}
    cards = sorted({r["card"] for r in records if r.get("card")})
    csrc = sorted({r["csrc_extension"] for r in records if "csrc_extension" in r})
    kernels = {(True,): "the csrc extension's kernels and C++ autograd", (False,): "the Triton kernels alone"}.get(
        tuple(csrc), "the csrc extension in some arms only")
    fused = sorted({r["fused_mlp"] for r in records if "fused_mlp" in r})
    conversion = {(False,): "; the converted models keep their own MLPs (--no-fused-mlp)",
                  (False, True): "; dres's fused MLP in some converted arms only"}.get(tuple(fused), "")
    if any(r.get("aligned_head") is False for r in records):
        conversion += "; the language models' heads left as HF has them (--no-aligned-head)"
    if any(r.get("stream_dtype") for r in records):
        conversion += "; the converted timm ViTs' residual stream in bf16 under autocast (--stream-dtype bf16)"
    backends = sorted({r.get("backend", "auto") for r in records if ARMS[r["arm"]].backend is None})
    if backends not in ([], ["auto"]):
        conversion += f"; the converted models' dres.ops backend: {', '.join(backends)}"
    header = [f"Converted timm / Hugging Face models against their plain originals "
              f"({', '.join(cards) or 'no arm finished'}; torch {env['torch']}, triton {env['triton']}, "
              f"timm {env['timm']}, transformers {env['transformers']}; the residual ops' eager calls on "
              f"{kernels}{conversion}).",
              f"Each arm {args.steps} steps ({args.warmup} warm-up, untimed), bf16 autocast, fused AdamW; rates are "
              f"batch / median step time, the median over each arm's processes (with repeats, each ratio "
              f"also by round: the arms of a round ran back to back); "
              + (f"{slots} arms at a time, one per GPU, each on its share of the cores" if slots > 1
                 else "one arm at a time")
              + "; peak memory over the timed steps (converted/plain: allocated, reserved for the one-line steps, "
              "whose captured graph's memory is reserved, not allocated); loss diff: max over the steps against plain "
              "eager, the largest over the converted arms (noise: plain torch.compile against plain eager; drop path "
              "and dropout masks differ between arms)."]
    summary = {"date": measure.today(), "machine": measure.machine_name(), "cards": cards, **env,
               "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats, "tiny": args.tiny,
               "arms_at_a_time": slots, "csrc_extension": csrc,
               "fused_mlp": fused, "aligned_head": sorted({r["aligned_head"] for r in records if "aligned_head" in r}),
               "stream_dtype": sorted({r["stream_dtype"] for r in records if r.get("stream_dtype")}),
               "backend": backends, "rows": rows,
               "failed": [{k: r[k] for k in ("model", "arm", "repeat", "error")} for r in failed], "not_run": not_run}
    measure.write_json_atomic(out / "summary.json", summary)
    table = markdown(rows, header=header, failed=failed, not_run=not_run)
    (out / "own-models.md").write_text(table)
    if any(r.get("profile") or r.get("host") for r in records):
        (out / "profiles.md").write_text(profile_markdown(records))
    if plot:
        plot_loss_tracks(records, out / "loss-tracks.png")
    return table


def progress(job: Job, rec: dict, seconds: float) -> str:
    if rec.get("error"):
        return f"[own-models] FAILED {job.name}: {rec['error']} [{seconds:.0f} s]"
    peak = (f", peak {rec['peak_mem_gib']:.1f} GiB (reserved {rec['peak_reserved_gib']:.1f})"
            if rec.get("peak_mem_gib") is not None else "")
    step = ("" if rec["mode"] != "step" else
            ", captured" if rec.get("captured") else f", eager: {rec.get('why_eager')}")
    return (f"[own-models] finished {job.name}: {rec['samples_per_s']:,.0f} {rec['unit']}{peak}{step} "
            f"[{seconds:.0f} s]")


def run_jobs(jobs: list[Job], args, out: Path) -> int:
    """Run every job in its own process, one per ``--gpus`` GPU at a time (else one at a time), each on its
    share of the cores; stop starting new ones after ``--max-minutes``. Returns how many arms failed."""
    gpus = args.gpus or [None]
    shares = core_shares(len(gpus))
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    (out / "logs").mkdir(parents=True, exist_ok=True)
    pending, running, failures = list(jobs), {}, 0
    free = list(range(len(gpus)))
    t0 = time.time()
    while pending or running:
        late = args.max_minutes is not None and time.time() - t0 > args.max_minutes * 60
        while free and pending and not late:
            k, job = free.pop(0), pending.pop(0)
            threads = min(len(shares[k]), int(os.environ.get("OMP_NUM_THREADS", len(shares[k]))))
            env = dict(os.environ, OMP_NUM_THREADS=str(threads))
            where = "CPU" if args.device == "cpu" else "the GPU"
            if gpus[k] is not None:
                env["CUDA_VISIBLE_DEVICES"] = visible[gpus[k]] if visible else str(gpus[k])
                where = f"GPU {env['CUDA_VISIBLE_DEVICES']}"
            log = open(out / "logs" / f"{job.name}.log", "w")
            arm_path(out, job).unlink(missing_ok=True)  # a rerun's record replaces the earlier one
            proc = subprocess.Popen(worker_command(job, args, shares[k]), cwd=REPO_ROOT, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            running[k] = (job, proc, log, time.time())
            print(f"[own-models] started {job.name} on {where}, cores {shares[k][0]}-{shares[k][-1]}", flush=True)
        if late and pending:
            print(f"[own-models] --max-minutes {args.max_minutes:g} reached; not started: "
                  f"{', '.join(j.name for j in pending)}", flush=True)
            pending = []
        time.sleep(0.2)
        for k, (job, proc, log, started) in list(running.items()):
            timed_out = time.time() - started > args.arm_timeout_s
            if proc.poll() is None and not timed_out:
                continue
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # the arm's process and the compile workers it started
                proc.wait()
            log.close()
            del running[k]
            free.append(k)
            path = arm_path(out, job)
            if not path.exists():
                error = (f"timed out after {args.arm_timeout_s:g} s" if timed_out
                         else f"exit {proc.returncode}: {last_line(out / 'logs' / f'{job.name}.log')}")
                identity = arm_identity(job.model, job.arm, job.repeat, args.tiny)
                measure.write_json_atomic(path, {**identity, "error": error})
            rec = json.loads(path.read_text())
            failures += bool(rec.get("error"))
            print(progress(job, rec, time.time() - started), flush=True)
            write_summary(out, args, jobs, len(gpus), plot=False)
    return failures


# ---------------------------------------------------------------------------------------------
# The command line


def names_of(choices) -> Callable[[str], list[str]]:
    """An argparse type: a comma list of names of ``choices``."""
    def parse(text: str) -> list[str]:
        names = [n for n in text.split(",") if n]
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown) or 'empty list'}; "
                                             f"choose from {', '.join(choices)}")
        return names
    return parse


def core_list(text: str) -> list[int]:
    try:
        return [int(c) for c in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects core indices like 0,1,2; got {text!r}") from None


def gpu_list(text: str) -> list[int]:
    try:
        gpus = [int(g) for g in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects GPU indices like 0,1,2,3; got {text!r}") from None
    if min(gpus) < 0 or len(set(gpus)) != len(gpus):
        raise argparse.ArgumentTypeError(f"GPU indices must be distinct and >= 0; got {text!r}")
    return gpus


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=names_of(MODELS), default=list(MODELS), help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--arms", type=names_of(ARMS), default=DEFAULT_ARMS,
                   help=f"comma list of {', '.join(ARMS)} (default: all but the arms that force a backend)")
    p.add_argument("--gpus", type=gpu_list, help="run arms in parallel, one per GPU at a time, e.g. 0,1,2,3 "
                                                 "(default: one at a time on the visible GPU)")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per arm, the loss of each recorded")
    p.add_argument("--warmup", type=int, default=20, help="the first steps, untimed (compilation, capture)")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="then profile this many more steps per arm (torch.profiler, GPU only): the step's GPU time by "
                        "kernel category and its top kernels, in the arm's record and the table")
    p.add_argument("--host-steps", type=int, default=0,
                   help="then time this many more steps' host time, each from an idle GPU, and as many under cProfile: "
                        "the host's ms a step, by where the Python lives (dres, torch, timm, ...) and its top functions")
    p.add_argument("--repeats", type=int, default=1, help="processes per arm (median and spread)")
    p.add_argument("--max-minutes", type=float, help="start no arm after this many minutes")
    p.add_argument("--arm-timeout-s", type=float, default=540, help="an arm still running after this is killed")
    p.add_argument("--skip-existing", action="store_true",
                   help="do not rerun an arm whose record in --out finished (failed ones run again)")
    p.add_argument("--out", help="record folder (default: records/benchmarks/<machine>-<today>-own-models)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the harness alone, no figures")
    p.add_argument("--tiny", action="store_true", help="a tiny config of each model's family")
    p.add_argument("--no-csrc", action="store_true",
                   help="run every arm without the csrc extension (the Triton kernels and Python autograd alone)")
    p.add_argument("--no-fused-mlp", action="store_true",
                   help="convert with fused_mlp=False: the models' own MLPs (Inductor's under torch.compile)")
    p.add_argument("--no-aligned-head", action="store_true",
                   help="convert the language models (BERT, GPT-2) with aligned_head=False: their output heads as "
                        "HF has them, whose GEMMs over the vocabulary's unaligned rows take cuBLAS's slow kernels")
    p.add_argument("--stream-dtype", choices=tuple(STREAM_DTYPES),
                   help="convert the timm ViTs with their residual stream in this dtype under autocast (a change of "
                        "function; --models of timm ViTs only)")
    p.add_argument("--backend", choices=("triton", "torch"),
                   help="the converted models' dres.ops backend (default: each op's own choice); torch: the ops' "
                        "PyTorch formulas, which Inductor fuses in its own code under torch.compile")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU needed)")
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)  # a repeat of the one --models / --arms arm
    p.add_argument("--cores", type=core_list, help=argparse.SUPPRESS)  # the cores an arm's process keeps to
    return p


def takes_stream_dtype(model_name: str) -> bool:
    """Whether the model's converter takes ``stream_dtype`` (dres.convert_timm_vit's)."""
    return getattr(MODELS[model_name].build, "func", None) is timm_vit


def check_args(p: argparse.ArgumentParser, args) -> None:
    if args.warmup < 1:
        p.error(f"--warmup must be at least 1, got {args.warmup}")
    if args.warmup <= STEP_WARMUP and any(ARMS[a].mode == "step" for a in args.arms):
        p.error(f"--warmup must exceed {STEP_WARMUP} with the one-line step arms (their eager steps and the capture "
                f"come first), got {args.warmup}")
    if args.steps <= args.warmup:
        p.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}): the steps after it are timed")
    for name in ("profile_steps", "host_steps"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be 0 or more, got {getattr(args, name)}")
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.gpus and args.device == "cpu":
        p.error("--gpus needs --device cuda")
    others = [m for m in args.models if not takes_stream_dtype(m)] if args.stream_dtype else []
    if others:
        p.error(f"--stream-dtype {args.stream_dtype}: only the timm ViTs' converter takes it "
                f"({', '.join(filter(takes_stream_dtype, MODELS))}), not {', '.join(others)}")
    if args.max_minutes is not None and args.max_minutes <= 0:
        p.error(f"--max-minutes must be positive, got {args.max_minutes}")


def print_plan(jobs: list[Job], args, out: Path) -> None:
    slots = len(args.gpus) if args.gpus else 1
    recorded = finished_jobs(jobs, out) if args.skip_existing else []
    print(f"# {len(jobs)} arm process(es), {slots} at a time, {args.steps} steps each ({args.warmup} warm-up); "
          f"records to {out}")
    for job in jobs:
        command = shlex.join(["python", *worker_command(job, args)[1:]])
        print(f"{job.name}: {MODELS[job.model].title}, {ARMS[job.arm].label}"
              + (" (recorded; skipped)" if job in recorded else f"\n  {command}"))


def finished_jobs(jobs: list[Job], out: Path) -> list[Job]:
    """The jobs whose arm record in ``out`` finished without an error."""
    return [j for j in jobs if arm_path(out, j).exists() and not json.loads(arm_path(out, j).read_text()).get("error")]


def run_worker(args) -> int:
    """One arm's process: the arm of ``--models`` and ``--arms`` (one each), repeat ``--worker``."""
    job = Job(args.models[0], args.arms[0], args.worker)
    if args.no_csrc:
        sys.modules["dres._C"] = None  # before dres.ops is first imported: `import dres._C` then fails
    if args.cores:
        os.sched_setaffinity(0, args.cores)  # before the first parallel region starts torch's thread pool
    measure.configure_caches()
    rec = run_arm(job.model, job.arm, job.repeat, device=torch.device(args.device), tiny=args.tiny, steps=args.steps,
                  warmup=args.warmup, profile_steps=args.profile_steps, host_steps=args.host_steps,
                  fused_mlp=not args.no_fused_mlp, aligned_head=not args.no_aligned_head,
                  stream_dtype=args.stream_dtype, backend=args.backend)
    measure.write_json_atomic(arm_path(Path(args.out), job), rec)
    print(json.dumps({k: v for k, v in rec.items() if k != "losses"}), flush=True)
    return 1 if rec["error"] else 0


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    check_args(p, args)
    if args.worker is not None:
        return run_worker(args)
    args.out = Path(args.out or measure.default_out("own-models"))
    jobs = plan_jobs(args.models, args.arms, args.repeats)
    if args.dry_run:
        print_plan(jobs, args, args.out)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA GPU here (--device cpu runs the harness, --dry-run shows the plan)",
              file=sys.stderr)
        return 2
    if args.gpus and max(args.gpus) >= torch.cuda.device_count():
        print(f"--gpus {','.join(map(str, args.gpus))}: this host shows {torch.cuda.device_count()} GPU(s)",
              file=sys.stderr)
        return 2
    to_run = [j for j in jobs if j not in finished_jobs(jobs, args.out)] if args.skip_existing else jobs
    if len(to_run) < len(jobs):
        print(f"[own-models] --skip-existing: {len(jobs) - len(to_run)} arm(s) recorded already", flush=True)
    failures = run_jobs(to_run, args, args.out)
    print(write_summary(args.out, args, jobs, len(args.gpus or [None]), plot=True))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
