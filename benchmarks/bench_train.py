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
TRAIN_KEY = ("card", "bench", "model", "mode", "batch", "world_size", "checkpointing", "kind")


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


def vp_sde_marginal(t: torch.Tensor, beta_min: float = 0.1, beta_max: float = 20.0):
    """Mean and std of x_t given x_0 for U-ViT's continuous VP-SDE (linear beta 0.1 to 20)."""
    log_mean = -0.25 * t ** 2 * (beta_max - beta_min) - 0.5 * t * beta_min
    return torch.exp(log_mean), torch.sqrt(1.0 - torch.exp(2.0 * log_mean))


def loss_fn(bench: str, model, x: torch.Tensor) -> torch.Tensor:
    """The training loss: MAE's own (norm-pix MSE on masked patches); for U-ViT, noise prediction
    MSE at a random time of the VP-SDE (timesteps t * 999, as U-ViT feeds them)."""
    if bench == "mae":
        return model(x)[0]
    t = torch.rand(x.shape[0], device=x.device) * (1 - 1e-3) + 1e-3
    noise = torch.randn_like(x)
    mean, std = vp_sde_marginal(t)
    xt = mean[:, None, None, None] * x + std[:, None, None, None] * noise
    pred = model(xt, t * 999)
    return ((pred.float() - noise) ** 2).mean()


def apply_checkpointing(model: torch.nn.Module) -> int:
    """Activation checkpointing at branch granularity (every attention and MLP module recomputed in
    backward), the same for the baselines and dres: dres' stacks run blocks as pairs of branches
    joined by fused ops, so the branch is the unit both can checkpoint. Returns how many."""
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


def first_training_step(bench: str, model: torch.nn.Module, mode: str, x: torch.Tensor, fsdp: bool):
    """``(step, optimizer kind)`` after running the first step: ``step()`` is one bf16-autocast
    forward + backward + fused AdamW step + zero_grad of ``model`` (compiled per ``mode``) on ``x``.
    Under FSDP2, on a torch whose fused AdamW rejects DTensor parameters, the step falls back to the
    foreach kernel, the next fastest; the kind says which runs."""
    # Under FSDP2 the blocks were compiled one by one before sharding (run_one); elsewhere the model.
    fwd = model if (fsdp and mode == "compile") else compile_for(model, mode)
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
        if not fsdp:
            raise
        opt = make_optimizer(model, fused=False)
        step()
        return step, "foreach"


def run_one(bench: str, name: str, mode: str, batch: int, args, env: dict, card: str, peak_tflops: float,
            world_size: int = 1, fsdp: bool = False) -> dict:
    """Images/s, peak memory, FLOPs and MFU of one (model, mode, batch)."""
    device = torch.device("cuda")
    torch._dynamo.reset()
    free_memory()
    model = build_model(bench, name).to(device)
    if fsdp:
        if mode == "compile":  # per block, then FSDP2 over the compiled blocks: the trainer's order
            from dres.train.distributed import apply_compile

            apply_compile(model)
        shard_model(model, tuned=getattr(args, "fsdp_tuned", False))
    model.train()
    x = make_batch(bench, batch, device)
    flops = None
    if not args.no_flops and not fsdp:
        flops = count_flops(bench, model, x)
    t0 = time.time()
    step, optimizer_kind = first_training_step(bench, model, mode, x, fsdp)
    for _ in range(max(1, args.warmup) - 1):
        step()
    torch.cuda.synchronize()
    warm_s = time.time() - t0
    torch.cuda.reset_peak_memory_stats()
    times = time_steps(step, args.steps)
    peak = torch.cuda.max_memory_allocated() / 2**30
    ms = statistics.median(times)
    ips = batch / (ms / 1e3)
    rec = {
        "kind": "throughput", "bench": bench, "model": name, "description": MODELS[bench][name], "mode": mode,
        "batch": batch, "world_size": world_size, "fsdp": fsdp, "checkpointing": False,
        # what torch.compile covered: FSDP2 runs compile each block (since commit 3961519;
        # earlier FSDP2 compile records, without this field, compiled the whole wrapped model)
        "compile_scope": None if mode == "eager" else ("per_block" if fsdp and mode == "compile" else "model"),
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
# FSDP2


def shard_model(model: torch.nn.Module, tuned: bool = False) -> None:
    """FSDP2 with bf16 parameters (fp32 gradient reduction), the trainer's wrapping: one unit per
    transformer block (:func:`dres.train.distributed.parallel_units`: timm's and U-ViT's blocks, and
    dres Blocks, which run from their norm1 to their MLP), then the root (embeddings, final norms,
    heads, skip layers). Before commit 086f98d the benchmark sharded every attention and
    MLP module instead (41 units for the MAE ViT-B/16, 21 now); BENCHMARKS.md says which runs used which.
    tuned: the trainer's ``fsdp_prefetch`` (dres.train.distributed.fully_shard_units)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from dres.train.distributed import fully_shard_units, parallel_units

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard_units(model, parallel_units(model), mp, prefetch=tuned)


def fsdp_worker(args) -> int:
    """Runs under torchrun: one measurement per (model, mode), rank 0 writes."""
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    rank = dist.get_rank()
    env, card = common.versions(), common.card_name()
    records = []
    for bench in benches(args):
        batch = args.batch or DEFAULT_BATCH[bench]
        for name in models_for(bench, args):
            for mode in modes(args):
                dist.barrier()
                try:
                    rec = run_one(bench, name, mode, batch, args, env, card, 0.0, world_size=world, fsdp=True)
                    if args.fsdp_tuned:
                        rec["model"] = f"{name}_fsdp_tuned"
                except Exception as e:
                    if rank == 0:
                        print(f"FAILED fsdp {bench} {name} {mode}: {type(e).__name__}: {e}", flush=True)
                        traceback.print_exc()
                    continue
                rec["kind"] = "fsdp"
                # every rank processes `batch` images per step: per-GPU rate is batch / step time
                rec["images_per_s"] = rec["images_per_s_per_gpu"] * world
                rec.pop("matmul_tflops", None)
                if rank == 0:
                    print(f"fsdp world={world} {bench} {name} {mode}: {rec['images_per_s_per_gpu']:.0f} img/s/GPU",
                          flush=True)
                records.append(rec)
    if rank == 0:
        write_outputs(Path(args.out), card, records)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def fsdp_scaling(args, argv: list[str]) -> int:
    """Launch the FSDP2 measurement on 1 GPU, then on ``args.fsdp_scaling`` GPUs (torchrun each)."""
    n = args.fsdp_scaling
    if torch.cuda.device_count() < n:
        print(f"--fsdp-scaling {n} needs {n} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    passthrough, skip = [], False
    for a in argv:  # everything but "--fsdp-scaling N" / "--fsdp-scaling=N"
        if skip:
            skip = False
        elif a == "--fsdp-scaling":
            skip = True
        elif not a.startswith("--fsdp-scaling="):
            passthrough.append(a)
    # NVLink multicast (NVLS) stays off on the lent machines; NCCL falls back to its ring/tree paths.
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    rc = 0
    for world in (1, n):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               "-m", "benchmarks.bench_train", "--fsdp", *passthrough]
        print("#", " ".join(cmd), flush=True)
        rc |= subprocess.call(cmd, cwd=str(common.REPO_ROOT), env=env)
    return rc


# ---------------------------------------------------------------------------------------------
# Results


def add_ratios(records: list[dict]) -> None:
    """Ratios the targets are stated in, within one card: images/s and peak memory against the
    benchmark's baseline under torch.compile at the same batch; dres_official against dres_baseline
    (same mode); FSDP per-GPU rate at world size N against world size 1 (same model and mode)."""
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
        mb = [r for r in recs if r["kind"] == "max_batch"]
        if mb:
            lines += ["### Largest batch that fits (eager, two steps without running out of memory)", "",
                      "| bench | model | activation checkpointing | max batch | GPU memory GiB |", "|---|---|---|---|---|"]
            for r in sorted(mb, key=lambda r: (r["bench"], r["checkpointing"], r["model"])):
                lines.append(f"| {r['bench']} | {r['model']} | {'yes' if r['checkpointing'] else 'no'} | "
                             f"{r['max_batch']}{'+' if r.get('at_cap') else ''} | {r['gpu_mem_gib']:.0f} |")
            lines.append("")
    return "\n".join(lines) if lines else "No measurements.\n"


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
    p.add_argument("--fsdp", action="store_true", help="(under torchrun) FSDP2 throughput on all ranks")
    p.add_argument("--fsdp-scaling", type=int, metavar="N",
                   help="run the FSDP2 measurement under torchrun on 1 GPU and on N GPUs")
    p.add_argument("--fsdp-tuned", action="store_true",
                   help="FSDP2 units stay gathered from forward to backward, forward prefetch (models get a _fsdp_tuned suffix)")
    p.add_argument("--out", default=str(common.RESULTS_DIR), help="results folder")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU needed)")
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    plan = [(b, m, mode) for b in benches(args) for m in models_for(b, args) for mode in modes(args)]
    if args.dry_run:
        if args.max_batch:  # the batch search is eager only
            plan = [(b, m, "eager") for b in benches(args) for m in models_for(b, args)]
        for b, m, mode in plan:
            what = "max batch (+/- checkpointing)" if args.max_batch else f"{mode} batch {args.batch or DEFAULT_BATCH[b]}"
            fsdp = f" FSDP2 on 1 and {args.fsdp_scaling} GPUs" if args.fsdp_scaling else ""
            print(f"{b} {m}: {MODELS[b][m]} -- {what}{fsdp}")
        return 0
    if not torch.cuda.is_available():
        print("bench_train needs a CUDA GPU (use --dry-run to see the plan)", file=sys.stderr)
        return 2
    common.configure_caches()
    if args.fsdp_scaling:
        return fsdp_scaling(args, argv)
    if args.fsdp:
        return fsdp_worker(args)
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
