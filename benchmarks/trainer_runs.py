"""The trainer as users run it: ``torchrun -m dres.train.TASK --preset PRESET`` per GPU count, wrapping
and mode, with ``batch_size`` = images per GPU x GPUs, evaluation off; its steady-state images/s come
from ``metrics.jsonl`` (the logged intervals after the warm-up), its graph replay floor from
``summary.json``."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from benchmarks import measure
from benchmarks.train_distributed import (FSDP_VARIANTS, TRAINER_CUDA_GRAPHS, dists_at, fsdp_variant_parts, launch,
                                          parse_dists, parse_worlds, torchrun_cmd)
from benchmarks.train_models import DEFAULT_BATCH
from benchmarks.train_report import record_dist_label, write_outputs


TRAINER_EVAL_OFF = ("eval.probe=false", "eval.knn=false", "eval.effective_rank=false", "eval.recon=false",
                    "eval.tsne=false")


def trainer_plan(args, modes: list[str]) -> list[dict]:
    """The trainer runs of ``--trainer PRESET``: every GPU count x wrapping x mode, each with
    ``batch`` images per GPU (every ``--trainer-batches`` in turn, ascending), ``--trainer-steps`` steps
    logged every ``--trainer-log-every``, its evaluation off and the user's ``--set`` overrides last."""
    from dres.train.config import load_preset

    preset = load_preset(args.trainer)
    task = preset.get("task", "mae")
    runs = []
    for batch in args.trainer_batches or [args.batch or DEFAULT_BATCH.get(task, 256)]:
        runs += _trainer_runs_at(args, modes, task, batch)
    return runs


def _trainer_runs_at(args, modes: list[str], task: str, batch: int) -> list[dict]:
    runs = []
    for world in parse_worlds(args.scaling or "1"):
        for kind, variant in dists_at(world, parse_dists(args.dist)):
            if kind == "ddp" and variant not in ("", *TRAINER_CUDA_GRAPHS):
                raise SystemExit(f"--trainer: the trainer has no variant {kind}:{variant} (its variants: ddp:graph, ddp:eager, "
                                 f"fsdp:{'|'.join(FSDP_VARIANTS)}[:BLOCKS])")
            policy, blocks = fsdp_variant_parts(variant if kind == "fsdp" else "auto")  # DDP runs: the defaults
            graphs = [f"cuda_graphs={TRAINER_CUDA_GRAPHS[variant]}"] if kind == "ddp" and variant else []
            for mode in modes:
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


def steady_windows(metrics: list[dict], skip: int = 1, buffered: int = 0) -> list[tuple[int, dict]]:
    """``(steps, record)`` of the logged intervals of ``metrics.jsonl`` after the first ``skip`` (warm-up:
    compilation, allocator growth). In a graphed run (intervals with ``gpu_ms_per_step``) the warm-up lasts until
    the step is captured: the intervals up to the first one with graph replays (eager warm-up steps and the
    capture) are left out too, as ``trainer_vs_replay`` leaves them out. ``buffered``: the batches a loader made
    ahead during the warm-up; the intervals that begin before the warm-up's end + ``buffered`` steps are left out
    too, so that a loader slower than the step is timed at its own rate, not at its buffer's."""
    recs = sorted(metrics, key=lambda r: r["step"])
    first_replay = next((i for i, r in enumerate(recs) if "gpu_ms_per_step" in r), None)
    if first_replay is not None:
        skip = max(skip, first_replay + 1)
    windows, prev, first_timed = [], 0, None
    for i, r in enumerate(recs):
        n, start, prev = r["step"] - prev, prev, r["step"]
        if i >= skip and n > 0:
            first_timed = start if first_timed is None else first_timed
            if start >= first_timed + buffered:
                windows.append((n, r))
    if not windows:
        raise ValueError(f"no logged interval after the first {skip} and {buffered} buffered steps: {len(recs)} "
                         "record(s); run more steps")
    return windows


def steady_state_rate(metrics: list[dict], global_batch: int, skip: int = 1, buffered: int = 0) -> tuple[float, int]:
    """``(images/s, steps)`` over :func:`steady_windows`: images over the summed interval times."""
    windows = steady_windows(metrics, skip, buffered)
    steps = sum(n for n, _ in windows)
    seconds = sum(n * global_batch / r["img_per_s"] for n, r in windows)
    return steps * global_batch / seconds, steps


def steady_state_waits(metrics: list[dict], skip: int = 1, buffered: int = 0) -> dict:
    """Over :func:`steady_windows`, weighted by their steps: ``data_ms``, the host's wait a step for the loader's
    batch, and in a graphed run ``gpu_ms_per_step``, the captured step's GPU time (what is not either is the
    host's own time between steps); the keys the records have."""
    windows = steady_windows(metrics, skip, buffered)
    out = {}
    for key in ("data_ms", "gpu_ms_per_step"):
        timed = [(n, r[key]) for n, r in windows if r.get(key) is not None]
        if timed:
            out[key] = sum(n * v for n, v in timed) / sum(n for n, _ in timed)
    return out


def set_value(sets: list[str], key: str, default: str) -> str:
    """The value a run's ``--set`` overrides give ``key`` (the last one wins, as in the trainer), else ``default``."""
    return next((kv.split("=", 1)[1] for kv in reversed(sets) if kv.startswith(f"{key}=")), default)


def compile_scope(sets: list[str]) -> str:
    """The record's name for the trainer's ``compile_scope``."""
    from types import SimpleNamespace

    from dres.train.config import auto_compile_scope

    scope = set_value(sets, "compile_scope", "auto")
    if scope == "auto":  # as the trainer resolves it (the runs here always set dist)
        scope = auto_compile_scope(SimpleNamespace(dist=set_value(sets, "dist", "none"),
                                                   act_ckpt=set_value(sets, "act_ckpt", "none")))
    return "per_block" if scope == "blocks" else scope


def trainer_record(run: dict, run_dir: Path, env: dict, card: str) -> dict:
    with open(run_dir / "metrics.jsonl") as f:
        metrics = [json.loads(line) for line in f if line.strip()]
    with open(run_dir / "summary.json") as f:
        summary = json.load(f)
    world, batch = run["world"], run["batch"]
    ips, steps = steady_state_rate(metrics, batch * world)
    act_ckpt = set_value(run["sets"], "act_ckpt", "none")
    return {"kind": "trainer", "bench": run["task"], "model": run["preset"], "mode": run["mode"], "batch": batch,
            "world_size": world, "dist": run["dist"], "checkpointing": act_ckpt != "none",
            "fsdp_variant": run["variant"] if run["dist"] == "fsdp" else None,
            "ddp_variant": run["variant"] if run["dist"] == "ddp" else None,
            "compile_scope": None if run["mode"] == "eager" else compile_scope(run["sets"]),
            "images_per_s": ips, "images_per_s_per_gpu": ips / world, "steps": steps,
            "peak_mem_gib": summary.get("peak_mem_gib"), "final_loss": summary.get("final_loss"),
            # the whole-step graph's replay GPU time and the trainer's step against it (absent: eager step)
            "graph_gpu_ms_per_step": summary.get("graph_gpu_ms_per_step"),
            "trainer_vs_replay": summary.get("trainer_vs_replay"), "overrides": run["sets"], "card": card,
            "gpus": world, "torch": env["torch"], "triton": env["triton"], "date": measure.today()}


def run_trainer(args, modes: list[str], out: Path, card: str) -> int:
    """Each run of :func:`trainer_plan`; with ``--trainer-batches`` a batch that fails (out of memory) ends
    the search of its GPU count, wrapping and mode, and the largest batch that trained is printed."""
    env, rc = measure.versions(), 0
    failed, largest = set(), {}
    for run in trainer_plan(args, modes):
        search = (run["world"], run["dist"], run["variant"], run["mode"])
        if search in failed:
            continue
        with tempfile.TemporaryDirectory(prefix="dres-trainer-") as tmp:  # checkpoints are not kept
            t0 = time.time()
            code = launch(trainer_cmd(run, tmp))
            if code != 0:
                print(f"FAILED trainer {run['preset']} {run['mode']} {run['dist']} x{run['world']} batch {run['batch']}: "
                      f"exit {code}", flush=True)
                if args.trainer_batches:
                    failed.add(search)
                else:
                    rc = 1
                continue
            rec = trainer_record(run, Path(tmp), env, card)
        replay = ("" if rec["trainer_vs_replay"] is None else f", trainer / replay {rec['trainer_vs_replay']:.3f} "
                  f"(replay {rec['graph_gpu_ms_per_step']:.2f} ms/step)")
        print(f"trainer {run['preset']} {run['mode']} {record_dist_label(rec)} x{run['world']}: {rec['images_per_s']:.0f} "
              f"img/s ({rec['images_per_s_per_gpu']:.0f}/GPU) steady over {rec['steps']} steps{replay} "
              f"[{time.time() - t0:.0f}s]", flush=True)
        write_outputs(out, card, [rec])
        largest[search] = run["batch"]
    if args.trainer_batches:
        for (world, dist, variant, mode), batch in largest.items():
            print(f"largest batch that trains: {args.trainer} {mode} {dist}{':' + variant if variant else ''} x{world}: "
                  f"{batch} per GPU (tried {','.join(map(str, args.trainer_batches))})", flush=True)
        rc = rc if largest else 1
    return rc
