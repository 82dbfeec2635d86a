"""Several GPUs: the bare step under the trainer's DDP and FSDP2 wrappings on every rank of a torchrun
launch (one per GPU count of ``--scaling``), and the torchrun commands themselves. On one GPU DDP is
the unwrapped model (the trainer wraps nothing there) and FSDP2 runs on a one-GPU mesh."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from benchmarks import measure
from benchmarks.train_models import MODELS, build_model, make_batch
from benchmarks.train_report import record_dist_label, write_outputs
from benchmarks.train_step import first_training_step, free_memory, warm_and_time


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
    from dres.train import distributed

    if kind == "ddp":
        if variant in TRAINER_CUDA_GRAPHS:
            raise SystemExit(f"--dist ddp:{variant} is the trainer's cuda_graphs setting: use it with --trainer PRESET")
        return distributed.apply_ddp(model, info, bucket_view=variant == "bucket_view")
    if kind == "fsdp":
        policy, blocks = fsdp_variant_parts(variant)
        prefetch = policy == "prefetch"
        return distributed.apply_fsdp(model, info, "bf16", prefetch=prefetch, reshard="auto" if prefetch else policy,
                            blocks_per_unit=blocks)
    return model


def first_wrapped_step(bench: str, name: str, options: dict, mode: str, batch: int, kind: str, variant: str, info):
    """``(step, optimizer kind, model, wrapped model, images)`` after the first step of ``name`` built afresh:
    its blocks compiled one by one (``mode == "compile"``) before wrapping, the trainer's order."""
    from dres.train.distributed import apply_compile

    torch._dynamo.reset()
    free_memory()
    model = build_model(bench, name, **options).to(info.device)
    if mode == "compile":
        apply_compile(model)
    wrapped = wrap_model(model, kind, variant, info).train()
    images = make_batch(bench, batch, info.device)
    step, optimizer_kind = first_training_step(bench, wrapped, images, sharded=kind == "fsdp")
    return step, optimizer_kind, model, wrapped, images


def run_dist(bench: str, name: str, mode: str, batch: int, options: dict, *, steps: int, warmup: int, env: dict,
             card: str, info, kind: str, variant: str) -> dict:
    """One (model with ``options``, mode, wrapping) on every rank of the process group: the blocks
    compiled one by one before wrapping (the trainer's order), ``batch`` images per GPU; the step time
    is the slowest rank's median."""
    import torch.distributed as dist

    t0 = time.time()
    step, optimizer_kind, model, wrapped, images = first_wrapped_step(bench, name, options, mode, batch, kind,
                                                                       variant, info)
    times, warm_s, peak = warm_and_time(step, warmup, steps, t0)
    slowest = torch.tensor([statistics.median(times), peak], device=info.device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    ms, peak_max = slowest.tolist()
    world = info.world
    rec = {
        "kind": "dist", "bench": bench, "model": name, "description": MODELS[bench][name], **options,
        "mode": mode, "batch": batch, "world_size": world, "dist": kind, "checkpointing": False,
        "fsdp_variant": (variant or None) if kind == "fsdp" else None,
        "ddp_variant": (variant or None) if kind == "ddp" else None,
        "compile_scope": None if mode == "eager" else "per_block",
        "images_per_s": world * batch / (ms / 1e3), "images_per_s_per_gpu": batch / (ms / 1e3), "step_ms": ms,
        "step_ms_min": min(times), "step_ms_max": max(times), "steps": len(times), "warmup_s": warm_s,
        "peak_mem_gib": peak_max, "card": card, "gpus": world, "torch": env["torch"], "triton": env["triton"],
        "date": measure.today(), "optimizer": optimizer_kind,
    }
    del model, wrapped, step, images
    free_memory()
    return rec


def dist_worker(plan: list[tuple[str, str, str, int]], options: dict, *, dists: str, steps: int, warmup: int,
                out: Path) -> int:
    """Runs under torchrun: every (bench, model, mode, batch per GPU) of ``plan`` in every wrapping of
    ``dists`` on all ranks; rank 0 writes after each, so a run stopped at its time limit keeps what it
    measured."""
    import torch.distributed as dist

    from dres.train import distributed

    info = distributed.init("auto", "ddp")
    env, card = measure.versions(), measure.card_name()
    wraps = dists_at(info.world, parse_dists(dists))
    for bench, name, mode, batch in plan:
        for kind, variant in wraps:
            dist.barrier()
            t0 = time.time()
            try:
                rec = run_dist(bench, name, mode, batch, options, steps=steps, warmup=warmup, env=env,
                               card=card, info=info, kind=kind, variant=variant)
            except Exception as e:  # one configuration failing must not lose the others
                if info.main:
                    print(f"FAILED {bench} {name} {mode} {kind} {variant} on {info.world} GPU(s): "
                          f"{type(e).__name__}: {e}", flush=True)
                    traceback.print_exc()
                free_memory()
                continue
            if info.main:
                print(f"{bench} {name} {mode} {record_dist_label(rec)} x{info.world}: "
                      f"{rec['images_per_s']:.0f} img/s ({rec['images_per_s_per_gpu']:.0f}/GPU), "
                      f"peak {rec['peak_mem_gib']:.1f} GiB [{time.time() - t0:.0f}s]", flush=True)
                write_outputs(out, card, [rec])
    dist.barrier()
    distributed.cleanup()
    return 0


def without_option(argv: list[str], name: str) -> list[str]:
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


def scaling_commands(scaling: str, argv: list[str]) -> list[list[str]]:
    """One torchrun per GPU count of ``--scaling``, each measuring every wrapping of ``--dist``."""
    rest = ["--dist-worker", *without_option(argv, "--scaling")]
    return [torchrun_cmd(w, "benchmarks.bench_train", *rest) for w in parse_worlds(scaling)]


def launch(cmd: list[str]) -> int:
    print("#", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, cwd=str(measure.REPO_ROOT), env=dict(os.environ, **NCCL_ENV))
    try:
        return proc.wait()
    except KeyboardInterrupt:  # a time limit's SIGINT: let torchrun stop its workers (own sessions) first
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        raise
