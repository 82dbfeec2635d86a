"""End-to-end training-step benchmarks (issue 5, targets 3-6): dres models against plain PyTorch
implementations of the same architectures (benchmarks/baselines.py), measured in one run.

    python -m benchmarks.bench_train --only mae --modes eager            # MAE ViT-B/16, batch 256
    python -m benchmarks.bench_train --only mae --modes compile --models timm,dres_baseline
    python -m benchmarks.bench_train --only uvit                         # U-ViT-S/2 32x32, batch 128
    python -m benchmarks.bench_train --only mae --max-batch              # largest batch, +/- checkpointing
    python -m benchmarks.bench_train --only mae --fsdp-scaling 2         # FSDP2 on 1 then 2 GPUs (torchrun)
    python -m benchmarks.bench_train --dry-run                           # the plan, no GPU needed

A step is forward + backward + fused AdamW step + zero_grad under bf16 autocast, on synthetic data
already on the GPU (the data pipeline is not measured). Images/s = batch / median step time (CUDA
events around each step, after warmup, which also absorbs torch.compile's compilation). Peak memory
is ``torch.cuda.max_memory_allocated`` over the timed steps after a reset (parameters, optimizer
state, activations). FLOPs per step are counted by ``torch.utils.flop_counter.FlopCounterMode`` on
one eager forward+backward of the same model and batch; model FLOP utilisation divides the achieved
rate by the bf16 matmul rate measured in the same run (8192^3 GEMM). Results merge into
``<out>/<card>-train.json`` (+ ``.md``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/bench_train.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks import common

# model name -> (benchmark, description). "timm"/"plain" are the baselines of their benchmark.
MODELS = {
    "mae": {
        "timm": "timm-style MAE ViT-B/16 (facebookresearch/mae structure, timm Block)",
        "dres_baseline": "dres MAE ViT-B/16, variant baseline (alpha 1)",
        "dres_official": "dres MAE ViT-B/16, variant official, alpha_min 0.6",
        "dres_baseline_csrc": "dres_baseline on the csrc ops (backend='cuda'; needs DRES_BUILD_CUDA=1)",
        "dres_official_csrc": "dres_official on the csrc ops (backend='cuda'; needs DRES_BUILD_CUDA=1)",
        "dres_baseline_fused": "dres_baseline with the fused MLP and MAE loss also under torch.compile",
        "dres_baseline_unfused": "dres_baseline with the plain MLP and MAE loss also in eager mode",
    },
    "uvit": {
        "plain": "plain PyTorch U-ViT-S/2 (baofff/U-ViT structure, SDPA)",
        "dres": "dres U-ViT-S/2 (alpha 1)",
        "dres_decayed": "dres U-ViT-S/2, alpha_min 0.7",
        "dres_csrc": "dres U-ViT-S/2 on the csrc ops (backend='cuda'; needs DRES_BUILD_CUDA=1)",
    },
}
BASELINE = {"mae": "timm", "uvit": "plain"}
DEFAULT_BATCH = {"mae": 256, "uvit": 128}
TRAIN_KEY = ("card", "bench", "model", "mode", "batch", "world_size", "checkpointing", "kind", "dist", "fsdp_variant",
             "ddp_variant")


# Variants named by a suffix, measured only when named (--models): "_csrc" needs the optional
# extension; "_fused"/"_unfused" force the branch fusions that are otherwise chosen per mode.
VARIANT_SUFFIXES = ("_csrc", "_fused", "_unfused")


def build_model(bench: str, name: str) -> torch.nn.Module:
    for suffix, fused in (("_unfused", False), ("_fused", True)):
        if name.endswith(suffix):  # the fused MLP and MAE loss forced on or off (default: eager only)
            from dres.nn import set_fused_mlp

            model = set_fused_mlp(build_model(bench, name[: -len(suffix)]), fused)
            model.fused_loss = fused
            return model
    if name.endswith("_csrc"):  # the same model with every fused op on the C++ kernels
        from dres.nn import set_backend
        from dres.ops import csrc_backend

        if not csrc_backend.available():
            raise RuntimeError(f"{name} needs the csrc extension: DRES_BUILD_CUDA=1 pip install -e .")
        return set_backend(build_model(bench, name[: -len("_csrc")]), "cuda")
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


# "compile_graphs": torch.compile's reduce-overhead mode (CUDA graphs over the compiled step)
MODES = ("eager", "compile", "compile_graphs")


def compile_for(model: torch.nn.Module, mode: str):
    if mode == "compile":
        return torch.compile(model)
    if mode == "compile_graphs":
        return torch.compile(model, mode="reduce-overhead")
    return model


def make_batch(bench: str, batch: int, device) -> torch.Tensor:
    size = 224 if bench == "mae" else 32
    return torch.randn(batch, 3, size, size, device=device).clamp_(-1, 1)


def loss_fn(bench: str, model, x: torch.Tensor) -> torch.Tensor:
    """The training loss: MAE's own (norm-pix MSE on masked patches); for U-ViT, the trainer's
    noise-prediction MSE at a random time of the VP-SDE (dres.eval.noise_prediction_loss)."""
    if bench == "mae":
        return model(x)[0]
    from dres.eval import VPSDE, noise_prediction_loss

    return noise_prediction_loss(model, x, VPSDE())


def apply_checkpointing(model: torch.nn.Module) -> int:
    """Activation checkpointing at branch granularity (every attention and MLP module recomputed in
    backward), the same for the baselines and dres: the residual adds and norms between branches
    (dres' fused ops) are kept, only the branches' activations are recomputed. Returns how many."""
    from torch.utils.checkpoint import checkpoint

    n = 0
    for m in model.modules():
        cls = type(m).__name__
        if cls in ("Attention", "UViTAttention", "Mlp") or (cls == "Sequential" and _is_uvit_mlp(m)):
            orig = m.forward

            def fwd(*a, _orig=orig, **k):
                return checkpoint(_orig, *a, use_reentrant=False, **k)

            m.forward = fwd
            n += 1
    return n


def _is_uvit_mlp(m) -> bool:
    return len(m) == 3 and isinstance(m[0], torch.nn.Linear) and isinstance(m[1], torch.nn.GELU)


def make_optimizer(model, fused: bool = True):
    # MAE's recipe (AdamW 0.9/0.95, wd 0.05); fused, as issue 5 asks. The hyper-parameters do not
    # change the cost of a step.
    params = [p for p in model.parameters() if p.requires_grad]
    kind = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(params, lr=1.5e-4, betas=(0.9, 0.95), weight_decay=0.05, **kind)


def count_flops(bench: str, model, x) -> int:
    """FLOPs of one forward + backward (matmuls, convolutions and SDPA; elementwise ops count 0)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as fc:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(bench, model, x)
        loss.backward()
    model.zero_grad(set_to_none=True)
    return int(fc.get_total_flops())


def free_memory() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def time_steps(step, steps: int) -> list[float]:
    """Milliseconds of each of ``steps`` steps from CUDA events, synchronising only at the end so the
    CPU runs ahead as in a real training loop (a per-step sync would add launch gaps)."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    for start, end in events:
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def first_training_step(bench: str, model: torch.nn.Module, x: torch.Tensor, compile_mode: str = "eager",
                        sharded: bool = False):
    """``(step, optimizer kind)`` after running the first step: ``step()`` is one bf16-autocast
    forward + backward + fused AdamW step + zero_grad of ``model`` (wrapped by ``compile_for(model,
    compile_mode)``; "eager" when its blocks were compiled already) on ``x``. When ``sharded``
    (FSDP2) and this torch's fused AdamW rejects DTensor parameters, the step falls back to the
    foreach kernel, the next fastest; the kind says which runs."""
    fwd = compile_for(model, compile_mode)
    opt = make_optimizer(model)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(bench, fwd, x)
        loss.backward()
        opt.step()  # `opt` is looked up at call time, so the fallback below is used
        opt.zero_grad(set_to_none=True)

    try:
        step()
        return step, "fused"
    except Exception:
        if not sharded:
            raise
        opt = make_optimizer(model, fused=False)
        step()
        return step, "foreach"


def warm_and_time(step, warmup: int, steps: int, t0: float) -> tuple[list[float], float, float]:
    """``(step milliseconds, warm-up seconds since t0, peak GiB)``: ``warmup`` - 1 more untimed steps
    after the first (compilation happens there), then ``steps`` timed ones with the peak memory reset."""
    for _ in range(max(1, warmup) - 1):
        step()
    torch.cuda.synchronize()
    warm_s = time.time() - t0
    torch.cuda.reset_peak_memory_stats()
    times = time_steps(step, steps)
    return times, warm_s, torch.cuda.max_memory_allocated() / 2**30


def run_one(bench: str, name: str, mode: str, batch: int, args, env: dict, card: str, peak_tflops: float) -> dict:
    """Images/s, peak memory, FLOPs and MFU of one (model, mode, batch) on one GPU, unwrapped."""
    device = torch.device("cuda")
    torch._dynamo.reset()
    free_memory()
    model = build_model(bench, name).to(device).train()
    x = make_batch(bench, batch, device)
    flops = None if args.no_flops else count_flops(bench, model, x)
    t0 = time.time()
    step, optimizer_kind = first_training_step(bench, model, x, compile_mode=mode)
    times, warm_s, peak = warm_and_time(step, args.warmup, args.steps, t0)
    ms = statistics.median(times)
    ips = batch / (ms / 1e3)
    rec = {
        "kind": "throughput", "bench": bench, "model": name, "description": MODELS[bench][name], "mode": mode,
        "batch": batch, "world_size": 1, "fsdp": False, "checkpointing": False,
        "compile_scope": None if mode == "eager" else "model",
        "images_per_s": ips, "images_per_s_per_gpu": ips, "step_ms": ms,
        "step_ms_min": min(times), "step_ms_max": max(times), "steps": len(times), "warmup_s": warm_s,
        "peak_mem_gib": peak, "card": card, "torch": env["torch"], "triton": env["triton"],
        "date": common.today(), "matmul_tflops": peak_tflops, "optimizer": optimizer_kind,
    }
    if flops:
        rec["flops_per_step"] = flops
        rec["gflop_per_image"] = flops / batch / 1e9
        rec["achieved_tflops"] = flops / (ms / 1e3) / 1e12
        rec["mfu_pct"] = 100 * rec["achieved_tflops"] / peak_tflops if peak_tflops else None
    del model, step, x
    free_memory()
    return rec


def fits(bench: str, name: str, batch: int, checkpointing: bool) -> bool:
    """Whether two training steps run at ``batch`` without running out of memory (eager)."""
    device = torch.device("cuda")
    model = opt = x = None
    try:
        model = build_model(bench, name).to(device).train()
        if checkpointing:
            apply_checkpointing(model)
        opt = make_optimizer(model)
        x = make_batch(bench, batch, device)
        for _ in range(2):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_fn(bench, model, x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del loss
        torch.cuda.synchronize()
        return True
    except torch.cuda.OutOfMemoryError:
        return False
    finally:
        del model, opt, x
        free_memory()


def max_batch(bench: str, name: str, checkpointing: bool, start: int, step: int, cap: int) -> tuple[int, bool]:
    """(largest multiple of ``step`` that fits, whether the search stopped at ``cap`` without a
    failure): double from ``start`` until a failure, then bisect down to ``step``."""
    lo, hi, b = 0, None, start
    while b <= cap:
        if fits(bench, name, b, checkpointing):
            lo, b = b, b * 2
        else:
            hi = b
            break
    if hi is None:
        return lo, True
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if mid <= lo:
            break
        if fits(bench, name, mid, checkpointing):
            lo = mid
        else:
            hi = mid
    return lo, False


# ---------------------------------------------------------------------------------------------
# Several GPUs: DDP and FSDP2 (the trainer's wrapping), and the trainer itself, under torchrun

# "fsdp:VARIANT[:K]" picks a candidate FSDP2 setting (dres.train.distributed.apply_fsdp): reshard_after_forward
# as the trainer's default ("auto", plain "fsdp"), for every unit ("always", FSDP2's default), all but the
# last ("except_last") or none ("never"), or "prefetch" (the trainer's fsdp_prefetch: no resharding plus
# forward prefetch); K blocks per FSDP2 unit (default: the trainer's fsdp_blocks_per_unit), e.g. "fsdp:always:1"
# is FSDP2's own default. "ddp:bucket_view": DDP with gradient_as_bucket_view (bench_train's step only);
# "ddp:graph" / "ddp:eager": the trainer with cuda_graphs=true (its whole step captured, the all-reduce
# included; what plain "ddp" runs by default) / false (--trainer only).
FSDP_VARIANTS = ("auto", "always", "except_last", "never", "prefetch")
DDP_VARIANTS = ("bucket_view", "graph", "eager")
TRAINER_CUDA_GRAPHS = {"graph": "true", "eager": "false"}
# NVLink multicast (NVLS) stays off on the lent machines; NCCL falls back to its ring/tree paths.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def parse_worlds(spec: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]`` (sorted, distinct, each >= 1)."""
    try:
        worlds = sorted({int(w) for w in spec.split(",") if w.strip()})
    except ValueError:
        raise SystemExit(f"--scaling: expected a comma list of GPU counts like 1,2,4, got {spec!r}") from None
    if not worlds or worlds[0] < 1:
        raise SystemExit(f"--scaling: GPU counts must be >= 1, got {spec!r}")
    return worlds


def fsdp_variant_parts(variant: str) -> tuple[str, int]:
    """``"never:4"`` -> ``("never", 4)`` (reshard policy or "prefetch", blocks per unit; without
    ``:K`` the trainer's default)."""
    from dres.train.config import Config

    policy, _, blocks = variant.partition(":")
    return policy, int(blocks) if blocks else Config.fsdp_blocks_per_unit


def parse_dists(spec: str) -> list[tuple[str, str]]:
    """``"ddp,fsdp,fsdp:never:4"`` -> ``[("ddp", ""), ("fsdp", "auto"), ("fsdp", "never:4")]``."""
    out = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        kind, _, variant = item.partition(":")
        if kind not in ("none", "ddp", "fsdp") or (kind == "none" and variant):
            raise SystemExit(f"--dist: unknown {item!r}; choose from none, ddp, ddp:bucket_view, fsdp, "
                             "fsdp:VARIANT[:BLOCKS]")
        if kind == "ddp" and variant not in ("", *DDP_VARIANTS):
            raise SystemExit(f"--dist: unknown DDP variant {variant!r}; choose from {', '.join(DDP_VARIANTS)}")
        if kind == "fsdp":
            variant = variant or "auto"
            policy, _, blocks = variant.partition(":")
            if policy not in FSDP_VARIANTS or (blocks and not (blocks.isdigit() and int(blocks) >= 1)):
                raise SystemExit(f"--dist: unknown FSDP2 variant {variant!r}; choose from {', '.join(FSDP_VARIANTS)}, "
                                 "optionally :BLOCKS per unit (e.g. fsdp:never:4)")
            variant = f"{policy}:{int(blocks)}" if blocks else policy
        if (kind, variant) not in out:
            out.append((kind, variant))
    if not out:
        raise SystemExit("--dist: give at least one of none, ddp, fsdp")
    return out


def dists_at(world: int, dists: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The wrappings measured on ``world`` GPUs: on one GPU, DDP is the unwrapped model ("none"), as
    the trainer wraps nothing there; "none" on several GPUs would be an unsynchronised run."""
    out = []
    for kind, variant in dists:
        if world == 1 and kind == "ddp":
            kind, variant = "none", ""
        if world > 1 and kind == "none":
            continue
        if (kind, variant) not in out:
            out.append((kind, variant))
    return out


def wrap_model(model: torch.nn.Module, kind: str, variant: str, info) -> torch.nn.Module:
    """The trainer's wrapping (dres.train.distributed): DDP (``variant`` "bucket_view": gradients as
    bucket views), or FSDP2 per block (or ``:K`` blocks) with bf16 parameters and fp32 gradient
    reduction, in the ``variant`` of FSDP_VARIANTS."""
    from dres.train import distributed as D

    if kind == "ddp":
        if variant in TRAINER_CUDA_GRAPHS:
            raise SystemExit(f"--dist ddp:{variant} is the trainer's cuda_graphs setting: use it with --trainer PRESET")
        return D.apply_ddp(model, info, bucket_view=variant == "bucket_view")
    if kind == "fsdp":
        policy, blocks = fsdp_variant_parts(variant)
        prefetch = policy == "prefetch"
        return D.apply_fsdp(model, info, "bf16", prefetch=prefetch, reshard="auto" if prefetch else policy,
                            blocks_per_unit=blocks)
    return model


def run_dist(bench: str, name: str, mode: str, batch: int, args, env: dict, card: str, info,
             kind: str, variant: str) -> dict:
    """One (model, mode, wrapping) on every rank of the process group: the blocks compiled one by
    one before wrapping (the trainer's order), ``batch`` images per GPU; the step time is the
    slowest rank's median."""
    import torch.distributed as dist

    from dres.train.distributed import apply_compile

    torch._dynamo.reset()
    free_memory()
    model = build_model(bench, name).to(info.device)
    if mode == "compile":
        apply_compile(model)
    wrapped = wrap_model(model, kind, variant, info).train()
    x = make_batch(bench, batch, info.device)
    t0 = time.time()
    step, optimizer_kind = first_training_step(bench, wrapped, x, sharded=kind == "fsdp")
    times, warm_s, peak = warm_and_time(step, args.warmup, args.steps, t0)
    ms_all = torch.tensor([statistics.median(times), peak], device=info.device)
    dist.all_reduce(ms_all, op=dist.ReduceOp.MAX)
    ms, peak_max = ms_all.tolist()
    world = info.world
    rec = {
        "kind": "dist", "bench": bench, "model": name, "description": MODELS[bench][name], "mode": mode,
        "batch": batch, "world_size": world, "dist": kind, "checkpointing": False,
        "fsdp_variant": (variant or None) if kind == "fsdp" else None,
        "ddp_variant": (variant or None) if kind == "ddp" else None,
        "compile_scope": None if mode == "eager" else "per_block",
        "images_per_s": world * batch / (ms / 1e3), "images_per_s_per_gpu": batch / (ms / 1e3), "step_ms": ms,
        "step_ms_min": min(times), "step_ms_max": max(times), "steps": len(times), "warmup_s": warm_s,
        "peak_mem_gib": peak_max, "card": card, "gpus": world, "torch": env["torch"], "triton": env["triton"],
        "date": common.today(), "optimizer": optimizer_kind,
    }
    del model, wrapped, step, x
    free_memory()
    return rec


def dist_worker(args) -> int:
    """Runs under torchrun: every (model, mode, wrapping) of the plan on all ranks; rank 0 writes
    after each, so a run stopped at its time limit keeps what it measured."""
    import torch.distributed as dist

    from dres.train import distributed as D

    info = D.init("auto", "ddp")
    env, card = common.versions(), common.card_name()
    wraps = dists_at(info.world, parse_dists(args.dist))
    for bench in benches(args):
        batch = args.batch or DEFAULT_BATCH[bench]
        for name in models_for(bench, args):
            for mode in modes(args):
                for kind, variant in wraps:
                    dist.barrier()
                    t0 = time.time()
                    try:
                        rec = run_dist(bench, name, mode, batch, args, env, card, info, kind, variant)
                    except Exception as e:  # one configuration failing must not lose the others
                        if info.main:
                            print(f"FAILED {bench} {name} {mode} {kind} {variant} on {info.world} GPU(s): "
                                  f"{type(e).__name__}: {e}", flush=True)
                            traceback.print_exc()
                        free_memory()
                        continue
                    if info.main:
                        print(f"{bench} {name} {mode} {_dist_label(rec)} x{info.world}: "
                              f"{rec['images_per_s']:.0f} img/s ({rec['images_per_s_per_gpu']:.0f}/GPU), "
                              f"peak {rec['peak_mem_gib']:.1f} GiB [{time.time() - t0:.0f}s]", flush=True)
                        write_outputs(Path(args.out), card, [rec])
    dist.barrier()
    D.cleanup()
    return 0


def _without_option(argv: list[str], name: str) -> list[str]:
    """``argv`` less ``name VALUE`` / ``name=VALUE``."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == name:
            skip = True
        elif not a.startswith(name + "="):
            out.append(a)
    return out


def torchrun_cmd(world: int, module: str, *rest: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
            "-m", module, *rest]


def scaling_commands(args, argv: list[str]) -> list[list[str]]:
    """One torchrun per GPU count of ``--scaling``, each measuring every wrapping of ``--dist``."""
    rest = ["--dist-worker", *_without_option(argv, "--scaling")]
    return [torchrun_cmd(w, "benchmarks.bench_train", *rest) for w in parse_worlds(args.scaling)]


TRAINER_EVAL_OFF = ("eval.probe=false", "eval.knn=false", "eval.effective_rank=false", "eval.recon=false",
                    "eval.tsne=false")


def trainer_plan(args) -> list[dict]:
    """The trainer runs of ``--trainer PRESET``: every GPU count x wrapping x mode, each with
    ``batch`` images per GPU, ``--trainer-steps`` steps logged every ``--trainer-log-every``, its
    evaluation off and the user's ``--set`` overrides last."""
    from dres.train.config import load_preset

    preset = load_preset(args.trainer)
    task = preset.get("task", "mae")
    batch = args.batch or DEFAULT_BATCH.get(task, 256)
    runs = []
    for world in parse_worlds(args.scaling or "1"):
        for kind, variant in dists_at(world, parse_dists(args.dist)):
            if kind == "ddp" and variant not in ("", *TRAINER_CUDA_GRAPHS):
                raise SystemExit(f"--trainer: the trainer has no variant {kind}:{variant} (its variants: ddp:graph, ddp:eager, "
                                 f"fsdp:{'|'.join(FSDP_VARIANTS)}[:BLOCKS])")
            policy, blocks = fsdp_variant_parts(variant if kind == "fsdp" else "auto")  # DDP runs: the defaults
            graphs = [f"cuda_graphs={TRAINER_CUDA_GRAPHS[variant]}"] if kind == "ddp" and variant else []
            for mode in modes(args):
                sets = [f"compile={'true' if mode == 'compile' else 'false'}", f"dist={kind}",
                        f"fsdp_prefetch={'true' if policy == 'prefetch' else 'false'}",
                        f"fsdp_reshard={'auto' if policy == 'prefetch' else policy}",
                        f"fsdp_blocks_per_unit={blocks}", *graphs,
                        f"batch_size={batch * world}", f"steps={args.trainer_steps}",
                        f"log.every={args.trainer_log_every}", "log.progress=false", "log.tensorboard=false",
                        "ckpt.every=0", *TRAINER_EVAL_OFF, *args.overrides]
                runs.append({"task": task, "preset": args.trainer, "world": world, "dist": kind,
                             "variant": variant or None, "mode": mode, "batch": batch, "sets": sets})
    return runs


def trainer_cmd(run: dict, out_dir: str) -> list[str]:
    sets = [a for kv in run["sets"] for a in ("--set", kv)]
    return torchrun_cmd(run["world"], f"dres.train.{run['task']}", "--preset", run["preset"], "--out", out_dir, *sets)


def steady_state_rate(metrics: list[dict], global_batch: int, skip: int = 1) -> tuple[float, int]:
    """``(images/s, steps)`` over the logged intervals of ``metrics.jsonl`` after the first ``skip``
    (warm-up: compilation, allocator growth): images over the summed interval times. In a graphed
    run (intervals with ``gpu_ms_per_step``) the warm-up lasts until the step is captured: the
    intervals up to the first one with graph replays (eager warm-up steps and the capture) are left
    out too, as ``trainer_vs_replay`` leaves them out."""
    recs = sorted(metrics, key=lambda r: r["step"])
    first_replay = next((i for i, r in enumerate(recs) if "gpu_ms_per_step" in r), None)
    if first_replay is not None:
        skip = max(skip, first_replay + 1)
    images = seconds = 0.0
    steps, prev = 0, 0
    for i, r in enumerate(recs):
        n = r["step"] - prev
        prev = r["step"]
        if i < skip or n <= 0:
            continue
        images += n * global_batch
        seconds += n * global_batch / r["img_per_s"]
        steps += n
    if not steps:
        raise ValueError(f"no logged interval after the first {skip}: {len(recs)} record(s); run more steps")
    return images / seconds, steps


def trainer_record(run: dict, run_dir: Path, env: dict, card: str) -> dict:
    with open(run_dir / "metrics.jsonl") as f:
        metrics = [json.loads(line) for line in f if line.strip()]
    with open(run_dir / "summary.json") as f:
        summary = json.load(f)
    world, batch = run["world"], run["batch"]
    ips, steps = steady_state_rate(metrics, batch * world)
    return {"kind": "trainer", "bench": run["task"], "model": run["preset"], "mode": run["mode"], "batch": batch,
            "world_size": world, "dist": run["dist"], "checkpointing": False,
            "fsdp_variant": run["variant"] if run["dist"] == "fsdp" else None,
            "ddp_variant": run["variant"] if run["dist"] == "ddp" else None,
            "compile_scope": None if run["mode"] == "eager" else "per_block",
            "images_per_s": ips, "images_per_s_per_gpu": ips / world, "steps": steps,
            "peak_mem_gib": summary.get("peak_mem_gib"), "final_loss": summary.get("final_loss"),
            # the whole-step graph's replay GPU time and the trainer's step against it (absent: eager step)
            "graph_gpu_ms_per_step": summary.get("graph_gpu_ms_per_step"),
            "trainer_vs_replay": summary.get("trainer_vs_replay"), "overrides": run["sets"], "card": card,
            "gpus": world, "torch": env["torch"], "triton": env["triton"], "date": common.today()}


def launch(cmd: list[str]) -> int:
    print("#", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, cwd=str(common.REPO_ROOT), env=dict(os.environ, **NCCL_ENV))
    try:
        return proc.wait()
    except KeyboardInterrupt:  # a time limit's SIGINT: let torchrun stop its workers (own sessions) first
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        raise


def run_trainer(args, out: Path, card: str) -> int:
    import tempfile

    env, rc = common.versions(), 0
    for run in trainer_plan(args):
        with tempfile.TemporaryDirectory(prefix="dres-trainer-") as tmp:  # checkpoints are not kept
            t0 = time.time()
            code = launch(trainer_cmd(run, tmp))
            if code != 0:
                print(f"FAILED trainer {run['preset']} {run['mode']} {run['dist']} x{run['world']}: exit {code}",
                      flush=True)
                rc = 1
                continue
            rec = trainer_record(run, Path(tmp), env, card)
        replay = ("" if rec["trainer_vs_replay"] is None else f", trainer / replay {rec['trainer_vs_replay']:.3f} "
                  f"(replay {rec['graph_gpu_ms_per_step']:.2f} ms/step)")
        print(f"trainer {run['preset']} {run['mode']} {_dist_label(rec)} x{run['world']}: {rec['images_per_s']:.0f} "
              f"img/s ({rec['images_per_s_per_gpu']:.0f}/GPU) steady over {rec['steps']} steps{replay} "
              f"[{time.time() - t0:.0f}s]", flush=True)
        write_outputs(out, card, [rec])
    return rc


# ---------------------------------------------------------------------------------------------
# Results


def add_ratios(records: list[dict]) -> None:
    """Ratios the targets are stated in, within one card: images/s and peak memory against the
    benchmark's baseline under torch.compile at the same batch; dres_official against dres_baseline
    (same mode); FSDP per-GPU rate at world size N against world size 1 (same model and mode).
    Several GPUs (kinds "dist" and "trainer"): ``scaling_efficiency`` = per-GPU rate on N GPUs / the
    same wrapping's on one GPU (DDP's one-GPU run is the unwrapped model); ``fsdp_vs_ddp`` = an
    FSDP2 run's rate / DDP's at the same GPU count and batch per GPU, i.e. the same global batch
    (on one GPU: FSDP2 / no FSDP2)."""
    thr = [r for r in records if r.get("kind") == "throughput"]
    base = {(r["card"], r["bench"], r["batch"]): r for r in thr
            if r["model"] == BASELINE[r["bench"]] and r["mode"] == "compile"}
    for r in thr:
        b = base.get((r["card"], r["bench"], r["batch"]))
        r["speedup_vs_baseline_compile"] = r["images_per_s"] / b["images_per_s"] if b else None
        r["mem_vs_baseline_compile"] = r["peak_mem_gib"] / b["peak_mem_gib"] if b else None
    by = {(r["card"], r["bench"], r["model"], r["mode"], r["batch"]): r for r in thr}
    for r in thr:
        if r["model"] == "dres_official":
            b = by.get((r["card"], r["bench"], "dres_baseline", r["mode"], r["batch"]))
            r["vs_dres_baseline"] = r["images_per_s"] / b["images_per_s"] if b else None
    fs = [r for r in records if r.get("kind") == "fsdp"]
    one = {(r["card"], r["bench"], r["model"], r["mode"], r["batch"]): r for r in fs if r["world_size"] == 1}
    for r in fs:
        b = one.get((r["card"], r["bench"], r["model"], r["mode"], r["batch"]))
        r["scaling_efficiency"] = r["images_per_s_per_gpu"] / b["images_per_s_per_gpu"] if b else None
    multi = [r for r in records if r.get("kind") in ("dist", "trainer")]
    at = {(r["kind"], r["card"], r["bench"], r["model"], r["mode"], r["batch"], r["world_size"], r["dist"],
           r.get("fsdp_variant"), r.get("ddp_variant")): r for r in multi}
    for r in multi:
        group = (r["kind"], r["card"], r["bench"], r["model"], r["mode"], r["batch"])
        one_dist = "none" if r["dist"] == "ddp" else r["dist"]
        b = at.get(group + (1, one_dist, r.get("fsdp_variant"), None))
        r["scaling_efficiency"] = r["images_per_s_per_gpu"] / b["images_per_s_per_gpu"] if b else None
        d = at.get(group + (r["world_size"], "ddp" if r["world_size"] > 1 else "none", None, None))
        r["fsdp_vs_ddp"] = r["images_per_s"] / d["images_per_s"] if (d and r["dist"] == "fsdp") else None


def _f(v, fmt):
    return "" if v is None else format(v, fmt)


def train_markdown(records: list[dict]) -> str:
    lines = []
    for card in sorted({r["card"] for r in records}):
        recs = [r for r in records if r["card"] == card]
        r0 = recs[0]
        lines += [f"## {card}", "", f"torch {r0['torch']}, triton {r0['triton']}; dates "
                  f"{', '.join(sorted({r['date'] for r in recs}))}.", ""]
        thr = [r for r in recs if r["kind"] == "throughput"]
        if thr:
            lines += ["### Training step throughput (one GPU, bf16 autocast, fused AdamW)", "",
                      "| bench | model | mode | batch | images/s | vs baseline compile | peak GiB | "
                      "mem vs baseline compile | GFLOP/image | MFU % (of measured bf16 matmul TFLOP/s) |",
                      "|---|---|---|---|---|---|---|---|---|---|"]
            for r in sorted(thr, key=lambda r: (r["bench"], r["batch"], r["model"], r["mode"])):
                mfu = ""
                if r.get("mfu_pct") is not None:
                    mfu = f"{r['mfu_pct']:.1f} (of {r['matmul_tflops']:.0f})"
                lines.append(f"| {r['bench']} | {r['model']} | {r['mode']} | {r['batch']} | {r['images_per_s']:.0f} | "
                             f"{_f(r.get('speedup_vs_baseline_compile'), '.2f')} | {r['peak_mem_gib']:.1f} | "
                             f"{_f(r.get('mem_vs_baseline_compile'), '.2f')} | {_f(r.get('gflop_per_image'), '.1f')} | "
                             f"{mfu} |")
            off = [r for r in thr if r.get("vs_dres_baseline") is not None]
            if off:
                lines.append("")
                lines.append("dres official / dres baseline throughput: " + ", ".join(
                    f"{r['mode']} {r['vs_dres_baseline']:.2f}" for r in off))
            lines.append("")
        fs = [r for r in recs if r["kind"] == "fsdp"]
        if fs:
            lines += ["### FSDP2 scaling (bf16 parameters, fp32 reduction, batch per GPU)", "",
                      "| bench | model | mode | batch/GPU | GPUs | images/s per GPU | scaling efficiency | peak GiB |",
                      "|---|---|---|---|---|---|---|---|"]
            for r in sorted(fs, key=lambda r: (r["bench"], r["model"], r["mode"], r["world_size"])):
                lines.append(f"| {r['bench']} | {r['model']} | {r['mode']} | {r['batch']} | {r['world_size']} | "
                             f"{r['images_per_s_per_gpu']:.0f} | {_f(r.get('scaling_efficiency'), '.2f')} | "
                             f"{r['peak_mem_gib']:.1f} |")
            lines.append("")
        for kind, title in (("trainer", "The trainer on several GPUs (steady-state img/s from metrics.jsonl)"),
                            ("dist", "DDP and FSDP2 on several GPUs (bench_train --scaling, blocks compiled "
                                     "one by one in compile mode)")):
            ms = [r for r in recs if r["kind"] == kind]
            if ms:
                lines += [f"### {title}", "", *dist_markdown(ms, replay=kind == "trainer"), ""]
        mb = [r for r in recs if r["kind"] == "max_batch"]
        if mb:
            lines += ["### Largest batch that fits (eager, two steps without running out of memory)", "",
                      "| bench | model | activation checkpointing | max batch | GPU memory GiB |", "|---|---|---|---|---|"]
            for r in sorted(mb, key=lambda r: (r["bench"], r["checkpointing"], r["model"])):
                lines.append(f"| {r['bench']} | {r['model']} | {'yes' if r['checkpointing'] else 'no'} | "
                             f"{r['max_batch']}{'+' if r.get('at_cap') else ''} | {r['gpu_mem_gib']:.0f} |")
            lines.append("")
    return "\n".join(lines) if lines else "No measurements.\n"


def dist_label(kind: str, variant: str | None) -> str:
    """``--dist`` spelling of a wrapping: "ddp", "ddp:bucket_view", "fsdp" (the trainer's default,
    "auto"), "fsdp:never:4"."""
    return f"{kind}:{variant}" if variant and not (kind == "fsdp" and variant == "auto") else kind


def _dist_label(r: dict) -> str:
    return dist_label(r["dist"], r.get("fsdp_variant") if r["dist"] == "fsdp" else r.get("ddp_variant"))


def dist_markdown(records: list[dict], replay: bool = False) -> list[str]:
    """Table rows of "dist"/"trainer" records: one per (bench, model, mode, wrapping, GPUs); ``replay``
    adds the trainer's graph replay GPU ms per step and its step time against it (issue 14 target 3)."""
    head = "| model | mode | wrapping | GPUs | batch/GPU | img/s (all GPUs) | img/s per GPU | scaling vs 1 GPU | " \
           "FSDP2 / DDP (same GPUs) | peak GiB |"
    if replay:
        head += " replay GPU ms/step | trainer / replay |"
    lines = [head, "|---" * head.count(" | ") + "|---|"]
    # the unwrapped one-GPU run first, as DDP's first row
    for r in sorted(records, key=lambda r: (r["bench"], r["model"], r["mode"], _dist_label(r).replace("none", "ddp"),
                                            r["world_size"])):
        peak = r.get("peak_mem_gib")
        lines.append(f"| {r['bench']} {r['model']} | {r['mode']} | {_dist_label(r)} | {r['world_size']} | {r['batch']} | "
                     f"{r['images_per_s']:.0f} | {r['images_per_s_per_gpu']:.0f} | "
                     f"{_f(r.get('scaling_efficiency'), '.1%')} | {_f(r.get('fsdp_vs_ddp'), '.2f')} | "
                     f"{_f(peak, '.1f')} |" + (f" {_f(r.get('graph_gpu_ms_per_step'), '.2f')} | "
                                               f"{_f(r.get('trainer_vs_replay'), '.3f')} |" if replay else ""))
    return lines


def write_outputs(out_dir: Path, card: str, new_records: list[dict]) -> Path:
    path = out_dir / f"{card}-train.json"
    records = common.merge_records(common.load_records(path), new_records, TRAIN_KEY)
    add_ratios(records)
    common.write_json_atomic(path, records)
    (out_dir / f"{card}-train.md").write_text(f"# Training benchmarks: {card}\n\n" + train_markdown(records))
    return path


# ---------------------------------------------------------------------------------------------
# CLI


def benches(args) -> list[str]:
    return [args.only] if args.only else list(MODELS)


def models_for(bench: str, args) -> list[str]:
    if not args.models:  # the suffixed variants only when named
        return [m for m in MODELS[bench] if not m.endswith(VARIANT_SUFFIXES)]
    wanted = [m for m in args.models.split(",") if m]
    unknown = [m for m in wanted if not any(m in MODELS[b] for b in MODELS)]
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}; known: {json.dumps({b: list(v) for b, v in MODELS.items()})}")
    return [m for m in wanted if m in MODELS[bench]]


def modes(args) -> list[str]:
    if args.compile is True:
        return ["compile"]
    if args.compile is False:
        return ["eager"]
    ms = [m for m in args.modes.split(",") if m]
    for m in ms:
        if m not in MODES:
            raise SystemExit(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    return ms


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=list(MODELS), help="one benchmark (default: both)")
    p.add_argument("--models", help="comma list of model names (mae: timm, dres_baseline, dres_official; "
                                    "uvit: plain, dres, dres_decayed)")
    p.add_argument("--modes", default="eager,compile", help="comma list of eager, compile, compile_graphs")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--compile", dest="compile", action="store_true", default=None, help="only torch.compile")
    g.add_argument("--no-compile", dest="compile", action="store_false", help="only eager")
    p.add_argument("--batch", type=int, help="batch per GPU (default: mae 256, uvit 128)")
    p.add_argument("--steps", type=int, default=20, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation happens here)")
    p.add_argument("--no-flops", action="store_true", help="skip the FlopCounterMode step (no MFU)")
    p.add_argument("--max-batch", action="store_true",
                   help="instead of throughput: the largest batch that fits, without and with activation "
                        "checkpointing (slow: a few minutes per model)")
    p.add_argument("--max-batch-cap", type=int, default=8192)
    p.add_argument("--memory-gib", type=float,
                   help="cap this process's GPU memory (torch.cuda.set_per_process_memory_fraction), e.g. 80 "
                        "to search the max batch of an 80 GB card on a larger one")
    p.add_argument("--max-batch-step", type=int, default=32, help="granularity of the batch search")
    p.add_argument("--no-checkpointing-search", action="store_true",
                   help="with --max-batch: skip the activation-checkpointing search")
    p.add_argument("--scaling", metavar="N,M,...",
                   help="launch torchrun on each of these GPU counts (e.g. 1,2,4) and measure every --dist wrapping")
    p.add_argument("--dist", default="ddp,fsdp",
                   help="wrappings for --scaling/--trainer: none, ddp, fsdp, fsdp:VARIANT (VARIANT: "
                        f"{', '.join(FSDP_VARIANTS)}); on one GPU ddp is the unwrapped model")
    p.add_argument("--dist-worker", action="store_true", help=argparse.SUPPRESS)  # what --scaling launches
    p.add_argument("--trainer", metavar="PRESET",
                   help="instead of the bare step: run the trainer (torchrun -m dres.train.TASK --preset PRESET) "
                        "on each --scaling GPU count, --batch images per GPU, steady-state img/s from metrics.jsonl")
    p.add_argument("--trainer-steps", type=int, default=30, help="--trainer: optimizer steps per run")
    p.add_argument("--trainer-log-every", type=int, default=10,
                   help="--trainer: log interval; the first interval (warm-up) is left out of the rate")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="--trainer: a config override for every run, e.g. data.name=synthetic")
    p.add_argument("--out", default=str(common.RESULTS_DIR), help="results folder")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU needed)")
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.trainer_steps <= args.trainer_log_every:
        raise SystemExit("--trainer-steps must exceed --trainer-log-every (the first interval is warm-up)")
    plan = [(b, m, mode) for b in benches(args) for m in models_for(b, args) for mode in modes(args)]
    if args.dry_run:
        if args.trainer:
            for run in trainer_plan(args):
                print(" ".join(trainer_cmd(run, "<tmp>")))
            return 0
        if args.scaling:
            dists = parse_dists(args.dist)
            for world in parse_worlds(args.scaling):
                wraps = ", ".join(dist_label(k, v) for k, v in dists_at(world, dists))
                for b, m, mode in plan:
                    print(f"{b} {m} {mode} batch/GPU {args.batch or DEFAULT_BATCH[b]} on {world} GPU(s): {wraps}")
            return 0
        if args.max_batch:  # the batch search is eager only
            plan = [(b, m, "eager") for b in benches(args) for m in models_for(b, args)]
        for b, m, mode in plan:
            what = "max batch (+/- checkpointing)" if args.max_batch else f"{mode} batch {args.batch or DEFAULT_BATCH[b]}"
            print(f"{b} {m}: {MODELS[b][m]} -- {what}")
        return 0
    if not torch.cuda.is_available():
        print("bench_train needs a CUDA GPU (use --dry-run to see the plan)", file=sys.stderr)
        return 2
    common.configure_caches()
    if args.dist_worker:
        return dist_worker(args)
    if args.scaling or args.trainer:
        need = max(parse_worlds(args.scaling or "1"))
        if torch.cuda.device_count() < need:
            print(f"--scaling {args.scaling} needs {need} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
            return 2
        out, card = Path(args.out), common.card_name()
        if args.trainer:
            rc = run_trainer(args, out, card)
        else:
            rc = 0
            for cmd in scaling_commands(args, argv):
                rc |= launch(cmd)
        records = common.load_records(out / f"{card}-train.json")
        add_ratios(records)
        kind = "trainer" if args.trainer else "dist"
        today = [r for r in records if r.get("kind") == kind and r.get("date") == common.today()]
        print("\n".join(dist_markdown(today, replay=kind == "trainer")))
        return rc
    env, card = common.versions(), common.card_name()
    out = Path(args.out)
    print(f"# card {card} ({torch.cuda.get_device_name()}), torch {env['torch']}, triton {env['triton']}", flush=True)
    if args.max_batch:
        gpu_mem = torch.cuda.get_device_properties(0).total_memory / 2**30
        if args.memory_gib:
            if not 0 < args.memory_gib <= gpu_mem:
                print(f"--memory-gib {args.memory_gib} must be in (0, {gpu_mem:.1f}] (this card's memory)", file=sys.stderr)
                return 2
            torch.cuda.set_per_process_memory_fraction(args.memory_gib / gpu_mem)
            gpu_mem = args.memory_gib
        for b in benches(args):
            for m in models_for(b, args):
                for ckpt in (False, True) if not args.no_checkpointing_search else (False,):
                    t0 = time.time()
                    try:
                        mb, at_cap = max_batch(b, m, ckpt, DEFAULT_BATCH[b], args.max_batch_step,
                                               args.max_batch_cap)
                    except Exception as e:
                        print(f"FAILED max batch {b} {m} ckpt={ckpt}: {type(e).__name__}: {e}", flush=True)
                        continue
                    rec = {"kind": "max_batch", "bench": b, "model": m, "mode": "eager", "batch": None,
                           "world_size": 1, "checkpointing": ckpt, "max_batch": mb,
                           "at_cap": at_cap, "gpu_mem_gib": gpu_mem, "card": card,
                           "torch": env["torch"], "triton": env["triton"], "date": common.today()}
                    print(f"max batch {b} {m} checkpointing={ckpt}: {mb} [{time.time() - t0:.0f}s]", flush=True)
                    write_outputs(out, card, [rec])
        return 0
    peak = common.matmul_peak_tflops()
    print(f"# bf16 matmul 8192^3: {peak:.0f} TFLOP/s", flush=True)
    for b, m, mode in plan:
        batch = args.batch or DEFAULT_BATCH[b]
        t0 = time.time()
        try:
            rec = run_one(b, m, mode, batch, args, env, card, peak)
        except Exception as e:  # one model failing must not lose the others
            print(f"FAILED {b} {m} {mode}: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()
            free_memory()
            continue
        print(f"{b} {m:14s} {mode:7s} batch {batch}: {rec['images_per_s']:7.0f} img/s, step {rec['step_ms']:.1f} ms, "
              f"peak {rec['peak_mem_gib']:.1f} GiB" + (f", MFU {rec['mfu_pct']:.1f}%" if rec.get("mfu_pct") else "")
              + f" [{time.time() - t0:.0f}s]", flush=True)
        write_outputs(out, card, [rec])
    return 0


if __name__ == "__main__":
    sys.exit(main())
