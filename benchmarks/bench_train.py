"""End-to-end training benchmarks: dres models against plain PyTorch implementations of the same
architectures, measured in one run (the CLI; the measurement lives in train_models, train_step,
train_memory, train_distributed, trainer_runs and train_report).

    python -m benchmarks.bench_train --only mae --modes eager            # MAE ViT-B/16, batch 256
    python -m benchmarks.bench_train --only mae --modes compile --models timm,dres_baseline
    python -m benchmarks.bench_train --only mae --models dres_baseline --fused-branches on --modes compile
    python -m benchmarks.bench_train --only mae --models dres_baseline --ops-backend cuda   # csrc ops
    python -m benchmarks.bench_train --only uvit                         # U-ViT-S/2 32x32, batch 128
    python -m benchmarks.bench_train --only mae --max-batch              # largest batch, +/- checkpointing
    python -m benchmarks.bench_train --only mae --scaling 1,2 --dist ddp,fsdp   # torchrun per GPU count
    python -m benchmarks.bench_train --trainer mae_vit_b16_in1k --scaling 1,2   # the trainer itself
    python -m benchmarks.bench_train --dry-run                           # the plan, no GPU needed

Results merge into ``<out>/<card>-train.json`` (+ ``.md``); ``--out`` defaults to a new record folder
``records/benchmarks/<machine>-<today>-train`` (records/README.md).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/bench_train.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks import measure
from benchmarks.train_distributed import (FSDP_VARIANTS, dist_worker, dists_at, launch, parse_dists, parse_worlds,
                                          scaling_commands, without_option)
from benchmarks.train_memory import max_batch
from benchmarks.train_models import (DEFAULT_BATCH, MODELS, add_model_options, model_label, model_options,
                                     models_for)
from benchmarks.train_report import add_ratios, dist_label, dist_markdown, write_outputs
from benchmarks.train_step import MODES, free_memory, run_one
from benchmarks.trainer_runs import run_trainer, trainer_cmd, trainer_plan


def benches(args) -> list[str]:
    return [args.only] if args.only else list(MODELS)


def modes(args) -> list[str]:
    if args.compile is True:
        return ["compile"]
    if args.compile is False:
        return ["eager"]
    chosen = [m for m in args.modes.split(",") if m]
    for m in chosen:
        if m not in MODES:
            raise SystemExit(f"--modes: unknown {m!r}; choose from {', '.join(MODES)}")
    return chosen


def plan_of(args) -> list[tuple[str, str, str, int]]:
    """(bench, model, mode, batch per GPU) of every measurement the arguments ask for."""
    return [(b, m, mode, args.batch or DEFAULT_BATCH[b]) for b in benches(args) for m in models_for(b, args.models)
            for mode in modes(args)]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=list(MODELS), help="one benchmark (default: both)")
    p.add_argument("--models", help="comma list of model names (mae: timm, dres_baseline, dres_official; "
                                    "uvit: plain, dres, dres_decayed)")
    add_model_options(p)
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
    p.add_argument("--trainer-batches", type=batch_list, metavar="B1,B2,...",
                   help="--trainer: the largest batch per GPU that trains: these batches in ascending order for each "
                        "GPU count, wrapping and mode, until one fails (out of memory)")
    p.add_argument("--trainer-steps", type=int, default=30, help="--trainer: optimizer steps per run")
    p.add_argument("--trainer-log-every", type=int, default=10,
                   help="--trainer: log interval; the first interval (warm-up) is left out of the rate")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="--trainer: a config override for every run, e.g. data.name=synthetic")
    p.add_argument("--out", help="record folder (default: records/benchmarks/<machine>-<today>-train)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU needed)")
    return p


def print_plan(args, plan) -> int:
    """``--dry-run``: the trainer commands, the torchrun plan or the one-GPU measurements."""
    if args.trainer:
        for run in trainer_plan(args, modes(args)):
            print(" ".join(trainer_cmd(run, "<tmp>")))
        return 0
    if args.scaling:
        dists = parse_dists(args.dist)
        for world in parse_worlds(args.scaling):
            wraps = ", ".join(dist_label(k, v) for k, v in dists_at(world, dists))
            for bench, name, mode, batch in plan:
                print(f"{bench} {name} {mode} batch/GPU {batch} on {world} GPU(s): {wraps}")
        return 0
    options = model_options(args)
    for bench, name, mode, batch in plan:
        label = model_label({"model": name, **options}) if name.startswith("dres") else name
        what = "max batch (+/- checkpointing)" if args.max_batch else f"{mode} batch {batch}"
        print(f"{bench} {label}: {MODELS[bench][name]} -- {what}")
    return 0


def run_several_gpus(args, argv: list[str], out: Path, card: str) -> int:
    """``--scaling`` (one torchrun per GPU count, every ``--dist`` wrapping) or ``--trainer``; then the
    table of today's records of that kind."""
    need = max(parse_worlds(args.scaling or "1"))
    if torch.cuda.device_count() < need:
        print(f"--scaling {args.scaling} needs {need} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    if args.trainer:
        rc = run_trainer(args, modes(args), out, card)
    else:
        rc = 0
        worker_argv = [*without_option(argv, "--out"), "--out", str(out)]  # the ranks write where this reads
        for cmd in scaling_commands(args.scaling, worker_argv):
            rc |= launch(cmd)
    records = measure.load_records(out / f"{card}-train.json")
    add_ratios(records)
    kind = "trainer" if args.trainer else "dist"
    today = [r for r in records if r.get("kind") == kind and r.get("date") == measure.today()]
    print("\n".join(dist_markdown(today, replay=kind == "trainer")))
    return rc


def run_max_batch(args, out: Path, card: str, env: dict) -> int:
    """``--max-batch``: the largest batch of each model without and with activation checkpointing."""
    gpu_mem = torch.cuda.get_device_properties(0).total_memory / 2**30
    if args.memory_gib:
        if not 0 < args.memory_gib <= gpu_mem:
            print(f"--memory-gib {args.memory_gib} must be in (0, {gpu_mem:.1f}] (this card's memory)", file=sys.stderr)
            return 2
        torch.cuda.set_per_process_memory_fraction(args.memory_gib / gpu_mem)
        gpu_mem = args.memory_gib
    options = model_options(args)
    for bench in benches(args):
        for name in models_for(bench, args.models):
            for checkpointing in (False, True) if not args.no_checkpointing_search else (False,):
                t0 = time.time()
                try:
                    found, at_cap = max_batch(bench, name, checkpointing, DEFAULT_BATCH[bench], args.max_batch_step,
                                              args.max_batch_cap, options)
                except Exception as e:
                    print(f"FAILED max batch {bench} {name} checkpointing={checkpointing}: {type(e).__name__}: {e}",
                          flush=True)
                    continue
                rec = {"kind": "max_batch", "bench": bench, "model": name, **options, "mode": "eager", "batch": None,
                       "world_size": 1, "checkpointing": checkpointing, "max_batch": found, "at_cap": at_cap,
                       "gpu_mem_gib": gpu_mem, "card": card, "torch": env["torch"], "triton": env["triton"],
                       "date": measure.today()}
                print(f"max batch {bench} {name} checkpointing={checkpointing}: {found} [{time.time() - t0:.0f}s]",
                      flush=True)
                write_outputs(out, card, [rec])
    return 0


def run_throughput(args, plan, out: Path, card: str, env: dict) -> int:
    """Images/s, memory and MFU of every (bench, model, mode, batch) of ``plan`` on one GPU."""
    peak = measure.matmul_peak_tflops()
    print(f"# bf16 matmul 8192^3: {peak:.0f} TFLOP/s", flush=True)
    options = model_options(args)
    for bench, name, mode, batch in plan:
        t0 = time.time()
        try:
            rec = run_one(bench, name, mode, batch, options, steps=args.steps, warmup=args.warmup,
                          flops=not args.no_flops, env=env, card=card, peak_tflops=peak)
        except Exception as e:  # one model failing must not lose the others
            print(f"FAILED {bench} {name} {mode}: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()
            free_memory()
            continue
        print(f"{bench} {model_label(rec):14s} {mode:7s} batch {batch}: {rec['images_per_s']:7.0f} img/s, "
              f"step {rec['step_ms']:.1f} ms, peak {rec['peak_mem_gib']:.1f} GiB"
              + (f", MFU {rec['mfu_pct']:.1f}%" if rec.get("mfu_pct") else "") + f" [{time.time() - t0:.0f}s]",
              flush=True)
        write_outputs(out, card, [rec])
    return 0


def batch_list(text: str) -> list[int]:
    """``--trainer-batches``: positive integers, comma-separated, returned in ascending order."""
    try:
        batches = sorted({int(b) for b in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects batches like 64,128,256; got {text!r}") from None
    if not batches or batches[0] <= 0:
        raise argparse.ArgumentTypeError(f"batches must be positive; got {text!r}")
    return batches


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.trainer_steps <= args.trainer_log_every:
        raise SystemExit("--trainer-steps must exceed --trainer-log-every (the first interval is warm-up)")
    plan = plan_of(args)
    if args.max_batch:  # the batch search is eager only
        plan = sorted({(bench, name, "eager", batch) for bench, name, _, batch in plan}, key=plan.index)
    if args.dry_run:
        return print_plan(args, plan)
    if not torch.cuda.is_available():
        print("bench_train needs a CUDA GPU (use --dry-run to see the plan)", file=sys.stderr)
        return 2
    measure.configure_caches()
    out = Path(args.out or measure.default_out("train"))
    if args.dist_worker:
        return dist_worker(plan, model_options(args), dists=args.dist, steps=args.steps, warmup=args.warmup, out=out)
    card = measure.card_name()
    if args.scaling or args.trainer:
        return run_several_gpus(args, argv, out, card)
    env = measure.versions()
    print(f"# card {card} ({torch.cuda.get_device_name()}), torch {env['torch']}, triton {env['triton']}", flush=True)
    if args.max_batch:
        return run_max_batch(args, out, card, env)
    return run_throughput(args, plan, out, card, env)


if __name__ == "__main__":
    sys.exit(main())
