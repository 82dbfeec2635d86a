"""Where a training step's time goes: GPU kernel time by category against wall time, for the models
of ``bench_train`` side by side (the profile behind the gaps of targets 3-5 in BENCHMARKS.md).

    python -m benchmarks.profile_train --bench mae --models timm,dres_baseline --mode compile
    torchrun --nproc-per-node 2 -m benchmarks.profile_train --bench mae --models timm --mode eager --fsdp

Each model: build, (compile,) warm up, then ``torch.profiler`` over ``--steps`` steps of exactly the
step ``bench_train`` times (``bench_train.first_training_step``: fused AdamW, foreach where FSDP2's
DTensors need it; the record says which). Kernels are
grouped by name into matmul, attention, dres fused ops, Inductor norm kernels (the unfused add +
LayerNorm as Inductor fuses it), other Inductor kernels, optimizer, communication (NCCL) and other
(eager elementwise, copies). ``gpu_busy_pct`` = summed kernel time / wall time: below 100% the GPU
waits for the CPU (launch overhead) or, under FSDP, for exposed communication. Writes
``<out>/<card>-profile.json`` and ``.md`` (rank 0 only under torchrun).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks import bench_train, common

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


def profile_model(bench: str, name: str, mode: str, batch: int, steps: int, warmup: int, fsdp: bool) -> dict:
    device = torch.device("cuda")
    torch._dynamo.reset()
    bench_train.free_memory()
    model = bench_train.build_model(bench, name).to(device)
    if fsdp:
        bench_train.shard_model(model)
    model.train()
    x = bench_train.make_batch(bench, batch, device)
    step, optimizer_kind = bench_train.first_training_step(bench, model, mode, x, fsdp)  # the benchmark's step
    for _ in range(max(1, warmup) - 1):
        step()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t0) * 1e6 / steps
    by_cat: dict[str, float] = {}
    top: list[tuple[float, str]] = []
    for evt in prof.key_averages():
        t = _device_time_us(evt)
        if t <= 0 or evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        cat = categorize(evt.key)
        by_cat[cat] = by_cat.get(cat, 0.0) + t / steps
        top.append((t / steps, evt.key))
    busy = sum(by_cat.values())
    del model, x, step
    bench_train.free_memory()
    return {"bench": bench, "model": name, "mode": mode, "batch": batch, "fsdp": fsdp, "optimizer": optimizer_kind,
            "world_size": int(os.environ.get("WORLD_SIZE", "1")), "wall_us_per_step": wall_us,
            "gpu_kernel_us_per_step": busy, "gpu_busy_pct": 100.0 * busy / wall_us,
            "categories_us": dict(sorted(by_cat.items(), key=lambda kv: -kv[1])),
            "top_kernels": [{"us": round(t, 1), "name": k[:120]} for t, k in sorted(top, reverse=True)[:12]]}


def markdown(records: list[dict], card: str) -> str:
    cats = [c for c, _ in CATEGORIES] + [OTHER]
    head = "| model | mode | GPUs | wall ms/step | GPU busy % | " + " | ".join(f"{c} ms" for c in cats) + " |"
    lines = [f"# Step profiles: {card}", "", head, "|" + "---|" * (5 + len(cats))]
    for r in records:
        cells = [f"{r['categories_us'].get(c, 0.0) / 1e3:.1f}" for c in cats]
        lines.append(f"| {r['bench']} {r['model']} | {r['mode']}{' FSDP2' if r['fsdp'] else ''} | {r['world_size']} | "
                     f"{r['wall_us_per_step'] / 1e3:.1f} | {r['gpu_busy_pct']:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bench", choices=list(bench_train.MODELS), default="mae")
    p.add_argument("--models", help="comma list (default: all of the benchmark's models)")
    p.add_argument("--mode", choices=bench_train.MODES, default="compile")
    p.add_argument("--batch", type=int, help="batch per GPU (default: the benchmark's)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=4, help="steps before profiling, the first included (at least one runs)")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 as bench_train shards it (run under torchrun)")
    p.add_argument("--out", default=str(common.RESULTS_DIR))
    args = p.parse_args(argv)
    names = bench_train.models_for(args.bench, args)  # as bench_train: csrc variants only when named
    if not names:
        p.error(f"--models: none of {args.models} is a {args.bench} model; known: {list(bench_train.MODELS[args.bench])}")
    if not torch.cuda.is_available():
        print("profile_train needs a CUDA GPU", file=sys.stderr)
        return 2
    rank = 0
    if args.fsdp:
        import torch.distributed as dist

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
        rank = dist.get_rank()
    common.configure_caches()
    card = common.card_name()
    records = []
    for name in names:
        r = profile_model(args.bench, name, args.mode, args.batch or bench_train.DEFAULT_BATCH[args.bench],
                          args.steps, args.warmup, args.fsdp)
        r.update(card=card, date=common.today(), **common.versions())
        records.append(r)
        if rank == 0:
            cats = ", ".join(f"{c} {t / 1e3:.1f}" for c, t in r["categories_us"].items())
            print(f"{args.bench} {name} {args.mode}: wall {r['wall_us_per_step'] / 1e3:.1f} ms/step, GPU busy "
                  f"{r['gpu_busy_pct']:.0f}% ({cats} ms)", flush=True)
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        key = ("card", "bench", "model", "mode", "batch", "fsdp", "world_size")
        path = out / f"{card}-profile.json"
        merged = common.merge_records(common.load_records(path), records, key)
        common.write_json_atomic(path, merged)
        (out / f"{card}-profile.md").write_text(markdown(merged, card))
    if args.fsdp:
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
