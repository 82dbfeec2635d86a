"""Where a training step's time goes: GPU kernel time by category against wall time, the top CPU
operators and GPU kernels, and the GPU's idle fraction, for the models of ``bench_train`` side by
side, unwrapped and under DDP or FSDP2 (the profile behind the gaps in BENCHMARKS.md).

    python -m benchmarks.profile_train --bench mae --models timm,dres_baseline --mode compile
    python -m benchmarks.profile_train --models timm,dres_official --mode eager --dist none,fsdp --trace
    torchrun --nproc-per-node 2 -m benchmarks.profile_train --models timm --mode eager --dist fsdp
    python -m benchmarks.profile_train --trainer mae_cifar10 --trace          # the trainer's own step
    torchrun --nproc-per-node 2 -m benchmarks.profile_train --trainer mae_vit_b16_in1k --batch 256 \
        --set dist=ddp --set data.name=synthetic --trace     # graphed DDP, both ranks, 256 images each

Each (model, wrapping): build, (compile: each block, before wrapping, as the trainer does), wrap
(``train_distributed.wrap_model``: the trainer's DDP / FSDP2; ``fsdp:VARIANT`` as in bench_train),
warm up, then ``torch.profiler`` over ``--steps`` steps of the step ``bench_train`` times
(``train_distributed.first_wrapped_step``). One process runs FSDP2 on a one-GPU mesh (FSDP2 on one GPU
against the same model without); under torchrun every rank profiles, rank 0 reports. Kernels are grouped by name into matmul, attention, dres fused ops, Inductor norm kernels,
other Inductor kernels, optimizer, communication (NCCL) and other (eager elementwise, copies).
``gpu_busy_pct`` = the union of kernel and copy intervals / wall time (below 100% the GPU waits for
the CPU, launch overhead, or for exposed communication); ``gpu_idle_pct`` is the rest. The GPU-side
spans of ``record_function`` ranges (FSDP2's hooks, ``Optimizer.step``) are not GPU work and count
in neither.
Writes ``<out>/<card>-profile.json`` and ``.md`` and, with ``--trace``, a gzipped Chrome trace per
run (``<out>/trace-<model>-<mode>-<wrapping>-<N>gpu.json.gz``, open in chrome://tracing or Perfetto).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import dres
from benchmarks import measure
from benchmarks.train_distributed import dists_at, first_wrapped_step, parse_dists
from benchmarks.train_models import DEFAULT_BATCH, MODELS, add_model_options, model_options, models_for
from benchmarks.train_report import dist_label
from benchmarks.train_step import free_memory
from benchmarks.trainer_runs import TRAINER_EVAL_OFF

# (category, pattern on the kernel name), first match wins
CATEGORIES = [
    ("communication", r"nccl"),
    ("dres fused ops", r"_residual_norm_|_sum_partials|dres"),
    ("attention", r"flash|fmha|attention|attn"),
    ("matmul", r"gemm|xmma|cutlass|nvjet|matmul|sm90_|sm80_|_mm_|splitk"),
    ("optimizer", r"multi_tensor|adam|foreach"),
    ("inductor norm", r"triton_.*(layer_norm|native_layer_norm)"),
    ("inductor other", r"^triton_"),
]
OTHER = "other (eager pointwise, copies)"


def categorize(name: str) -> str:
    low = name.lower()
    for cat, pat in CATEGORIES:
        if re.search(pat, low):
            return cat
    return OTHER


def _device_time_us(evt) -> float:
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(evt, attr):
            return float(getattr(evt, attr))
    return 0.0


TOP = 15
PROFILE_KEY = ("card", "bench", "model", "mode", "batch", "dist", "world_size", "compile_scope", "overrides")


def profile_steps(step, steps: int, trace_path: Path | None, top: int = TOP) -> dict:
    """``torch.profiler`` over ``steps`` calls of ``step`` (warmed up by the caller): wall time, GPU
    kernel time by category, GPU busy/idle and the ``top`` kernels and CPU operators, per step."""
    prof, wall_us = measure.profiled_steps(step, steps)
    by_cat: dict[str, float] = {}
    gpu_top, cpu_top = [], []
    for evt in prof.key_averages():
        if measure.is_gpu_work(evt):
            t = _device_time_us(evt)
            if t > 0:
                cat = categorize(evt.key)
                by_cat[cat] = by_cat.get(cat, 0.0) + t / steps
                gpu_top.append((t / steps, evt.count / steps, evt.key))
        elif evt.self_cpu_time_total > 0:
            cpu_top.append((evt.self_cpu_time_total / steps, evt.count / steps, evt.key))
    busy = measure.gpu_busy_us(prof) / steps
    if trace_path is not None:
        prof.export_chrome_trace(str(trace_path))
    return {"wall_us_per_step": wall_us, "gpu_kernel_us_per_step": sum(by_cat.values()),
            "gpu_busy_us_per_step": busy, "gpu_busy_pct": 100.0 * busy / wall_us,
            "gpu_idle_pct": 100.0 * (1 - busy / wall_us),
            "categories_us": dict(sorted(by_cat.items(), key=lambda kv: -kv[1])),
            "gpu_kernels_per_step": sum(n for _, n, _ in gpu_top),
            "top_kernels": [{"us": round(t, 1), "calls": round(n, 1), "name": k[:120]}
                            for t, n, k in sorted(gpu_top, reverse=True)[:top]],
            "top_cpu_ops": [{"self_us": round(t, 1), "calls": round(n, 1), "name": k[:120]}
                            for t, n, k in sorted(cpu_top, reverse=True)[:top]],
            "trace": trace_path.name if trace_path else None}


REPO = Path(__file__).resolve().parent.parent
# where the imported package lives: this tree, site-packages, or a folder a `pip install --target` put it in
DRES_PACKAGE = Path(dres.__file__).resolve().parent
REPO_PLACES = {"dres": "dres", "kernels": "dres", "benchmarks": "the benchmark's loop"}
TORCH_PLACES = {"autograd": "torch autograd", "nn": "torch nn"}


def host_place(filename: str) -> str:
    """Where a profiled function lives: C functions (cProfile's "~": torch's ops, kernel launches, builtins), dres,
    the benchmark's own loop, torch's autograd, nn or other Python, triton, timm, transformers, other Python."""
    if filename == "~":
        return "C functions (torch ops, launches)"
    path = Path(filename)
    if DRES_PACKAGE in path.parents:
        return "dres"
    if REPO in path.parents:
        return REPO_PLACES.get(path.relative_to(REPO).parts[0], "other Python")
    parts = path.parts
    at = next((i for i, part in enumerate(parts) if part in ("site-packages", "dist-packages")), None)
    if at is None or at + 1 >= len(parts):
        return "other Python"
    package = parts[at + 1]
    if package == "torch":
        return TORCH_PLACES.get(parts[at + 2] if at + 2 < len(parts) else "", "torch other")
    return package if package in ("dres", "triton", "timm", "transformers") else "other Python"


def host_time(step, steps: int, top: int = TOP) -> dict:
    """The host's own time a step: each of ``steps`` calls of ``step`` starts with the GPU idle (synchronised
    first) and is timed until it returns, unsynchronised, so the host does not wait for the GPU (unless one step
    fills the launch queue); then ``steps`` calls more under cProfile, which adds its own cost to every Python call:
    the profiled time a step by where the code lives (:func:`host_place`, each function's own time) and the
    ``top`` functions by own and by cumulative time."""
    import cProfile
    import pstats

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    host_ms = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        step()
        host_ms.append((time.perf_counter() - t0) * 1e3)
    profiler = cProfile.Profile()
    for _ in range(steps):
        sync()
        profiler.enable()
        step()
        profiler.disable()
    sync()
    rows, places = [], {}
    for (filename, line, name), (_, calls, own, cumulative, _) in pstats.Stats(profiler).stats.items():
        place = host_place(filename)
        places[place] = places.get(place, 0.0) + own * 1e3 / steps
        where = name if filename == "~" else f"{Path(filename).parent.name}/{Path(filename).name}:{line}({name})"
        rows.append({"own_ms": round(own * 1e3 / steps, 3), "cumulative_ms": round(cumulative * 1e3 / steps, 3),
                     "calls": round(calls / steps, 1), "function": where[:120]})
    return {"host_ms_per_step": statistics.median(host_ms), "host_ms_min": min(host_ms),
            "profiled_ms_per_step": sum(places.values()),
            "by_place_ms": dict(sorted(((k, round(v, 3)) for k, v in places.items()), key=lambda kv: -kv[1])),
            "top_own": sorted(rows, key=lambda r: -r["own_ms"])[:top],
            "top_cumulative": sorted(rows, key=lambda r: -r["cumulative_ms"])[:top]}


def profile_model(bench: str, name: str, options: dict, mode: str, batch: int, steps: int, warmup: int, kind: str,
                  variant: str, info, trace_path: Path | None) -> dict:
    step, optimizer_kind, model, wrapped, images = first_wrapped_step(bench, name, options, mode, batch, kind,
                                                                       variant, info)
    for _ in range(max(1, warmup) - 1):
        step()
    r = profile_steps(step, steps, trace_path)
    del model, wrapped, images, step
    free_memory()
    label = dist_label(kind, variant)
    return {"bench": bench, "model": name, **options, "mode": mode, "batch": batch, "dist": label, "fsdp": kind == "fsdp",
            "compile_scope": None if mode == "eager" else "per_block", "optimizer": optimizer_kind,
            "world_size": info.world, **r}


def profile_trainer(preset: str, overrides: list[str], batch: int | None, steps: int, warmup: int,
                    trace_path: Path | None) -> dict | None:
    """The trainer's own step as ``fit`` runs it (the loader's next batch, augmentation included, then
    ``train_step``: the captured graph's replay where ``cuda_graphs`` captures it), after ``warmup``
    steps (at least the graph's warm-up and capture); evaluation, checkpoints and logs off. One GPU, or
    every rank under torchrun with ``dist=ddp|fsdp`` among the overrides (the graphed DDP step with its
    all-reduce): the main rank returns the record and writes the trace, the others return None."""
    import tempfile

    from dres.train import distributed
    from dres.train.cli import get_task
    from dres.train.config import build_config, load_preset
    from dres.train.loop import Trainer

    task = load_preset(preset).get("task", "mae")
    with tempfile.TemporaryDirectory(prefix="dres-profile-") as tmp:
        sets = ["log.progress=false", "log.tensorboard=false", "ckpt.every=0", f"out={tmp}", "steps=100000",
                *TRAINER_EVAL_OFF, *overrides]
        if batch:  # per GPU, as bench_train --trainer counts it
            sets.append(f"batch_size={batch * int(os.environ.get('WORLD_SIZE', '1'))}")
        cfg = build_config(task, preset, sets)
        trainer = Trainer(cfg, get_task(task), log=lambda m: print(m, flush=True)).setup()
        trainer.model.train()

        def step():
            trainer.train_step(trainer.loader.next())

        for _ in range(max(warmup, (trainer.graphed.warmup_steps + 2) if trainer.graphed else 1)):
            step()
        r = profile_steps(step, steps, trace_path if trainer.main else None)
        if trainer.graphed is not None:
            trainer.graphed.release()  # before the process group goes: NCCL waits on graphs that captured it
        mode = "trainer " + ("graphed" if trainer.graphed is not None else "eager")
        world, main = trainer.info.world, trainer.main
        del trainer, step
    distributed.barrier()
    distributed.cleanup()
    free_memory()
    if not main:
        return None
    dist = cfg.dist if world > 1 else "none"
    return {"bench": task, "model": preset, "mode": mode + (" compile" if cfg.compile else ""),
            "batch": cfg.batch_size // world, "dist": dist, "fsdp": dist == "fsdp",
            "compile_scope": ("per_block" if cfg.compile_scope == "blocks" else cfg.compile_scope) if cfg.compile else None,
            "world_size": world, "overrides": " ".join(overrides), **r}


def print_profile(r: dict) -> None:
    cats = ", ".join(f"{c} {t / 1e3:.1f}" for c, t in r["categories_us"].items())
    print(f"== {r['bench']} {r['model']} {r['mode']} {r['dist']} x{r['world_size']}: wall {r['wall_us_per_step'] / 1e3:.1f} "
          f"ms/step, GPU busy {r['gpu_busy_pct']:.0f}% / idle {r['gpu_idle_pct']:.0f}% ({cats} ms)", flush=True)
    print("   top GPU kernels (us/step, calls/step):")
    for k in r["top_kernels"]:
        print(f"   {k['us']:10.1f} {k['calls']:7.1f}  {k['name']}")
    print("   top CPU ops by self time (us/step, calls/step):")
    for k in r["top_cpu_ops"]:
        print(f"   {k['self_us']:10.1f} {k['calls']:7.1f}  {k['name']}", flush=True)


def markdown(records: list[dict], card: str) -> str:
    cats = [c for c, _ in CATEGORIES] + [OTHER]
    head = ("| model | mode | wrapping | GPUs | wall ms/step | GPU busy % | " + " | ".join(f"{c} ms" for c in cats) + " |")
    lines = [f"# Step profiles: {card}", "", head, "|" + "---|" * (6 + len(cats))]
    for r in records:
        cells = [f"{r['categories_us'].get(c, 0.0) / 1e3:.1f}" for c in cats]
        wrapping = r.get("dist") or ("fsdp" if r["fsdp"] else "none")  # records before --dist have only "fsdp"
        mode = r["mode"] + (" per block" if r.get("compile_scope") == "per_block" else "")
        model = f"{r['bench']} {r['model']}" + (f" ({r['overrides']})" if r.get("overrides") else "")
        lines.append(f"| {model} | {mode} | {wrapping} | {r['world_size']} | "
                     f"{r['wall_us_per_step'] / 1e3:.1f} | {r['gpu_busy_pct']:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_record(r: dict, out: Path, card: str) -> None:
    """Print one profile and merge it into ``<out>/<card>-profile.json`` / ``.md`` (after each run, so
    a run stopped at its time limit keeps the others)."""
    print_profile(r)
    path = out / f"{card}-profile.json"
    merged = measure.merge_records(measure.load_records(path), [r], PROFILE_KEY)
    measure.write_json_atomic(path, merged)
    (out / f"{card}-profile.md").write_text(markdown(merged, card))


def trainer_trace_name(preset: str, overrides: list[str]) -> str:
    """The trace file of a trainer profile: the preset and its overrides in letters, digits, '_' and '-' (a path
    among them would name folders), shortened with a hash of them where long (a file name's 255 bytes)."""
    tag = re.sub(r"[^A-Za-z0-9_-]+", "_", "-".join(overrides))
    if len(tag) > 80:
        tag = tag[:80] + "-" + hashlib.sha1(tag.encode()).hexdigest()[:8]
    return f"trace-trainer-{preset}{'-' + tag if tag else ''}.json.gz"


def main_trainer(args) -> int:
    if not torch.cuda.is_available():
        print("profile_train needs a CUDA GPU", file=sys.stderr)
        return 2
    measure.configure_caches()
    card = measure.card_name()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace = out / trainer_trace_name(args.trainer, args.overrides) if args.trace else None
    r = profile_trainer(args.trainer, args.overrides, args.batch, args.steps, args.warmup, trace)
    if r is not None:
        r.update(card=card, date=measure.today(), **measure.versions())
        write_record(r, out, card)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bench", choices=list(MODELS), default="mae")
    p.add_argument("--models", help="comma list (default: all of the benchmark's models)")
    add_model_options(p)
    p.add_argument("--mode", choices=("eager", "compile"), default="compile")
    p.add_argument("--batch", type=int, help="batch per GPU (default: the benchmark's; with --trainer the preset's)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=4, help="steps before profiling, the first included (at least one runs)")
    p.add_argument("--dist", default="none",
                   help="comma list of wrappings, each profiled: none, ddp, fsdp, fsdp:VARIANT (as bench_train)")
    p.add_argument("--trace", action="store_true", help="also write a gzipped Chrome trace per run into --out")
    p.add_argument("--trainer", metavar="PRESET",
                   help="profile the trainer's step of this preset instead of the bare steps (one GPU, or "
                        "every rank under torchrun with --set dist=ddp|fsdp)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="with --trainer: a config override (repeatable), e.g. cuda_graphs=false")
    p.add_argument("--out", default=measure.default_out("profile"),
                   help="record folder (default: records/benchmarks/<machine>-<today>-profile)")
    args = p.parse_args(argv)
    if args.overrides and not args.trainer:
        p.error("--set: only with --trainer")
    if args.trainer:
        return main_trainer(args)
    names = models_for(args.bench, args.models)
    if not names:
        p.error(f"--models: none of {args.models} is a {args.bench} model; known: {list(MODELS[args.bench])}")
    wraps = parse_dists(args.dist)
    if not torch.cuda.is_available():
        print("profile_train needs a CUDA GPU", file=sys.stderr)
        return 2
    from dres.train import distributed

    # a process group (one rank without torchrun) whenever a wrapping needs one
    info = distributed.init("auto", "fsdp" if any(k != "none" for k, _ in wraps) else "none")
    wraps = dists_at(info.world, wraps)
    measure.configure_caches()
    card = measure.card_name()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        for kind, variant in wraps:
            label = dist_label(kind, variant).replace(":", "-")
            trace = out / f"trace-{name}-{args.mode}-{label}-{info.world}gpu.json.gz" if args.trace and info.main else None
            r = profile_model(args.bench, name, model_options(args), args.mode, args.batch or DEFAULT_BATCH[args.bench],
                              args.steps, args.warmup, kind, variant, info, trace)
            r.update(card=card, date=measure.today(), **measure.versions())
            if info.main:
                write_record(r, out, card)
    distributed.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
