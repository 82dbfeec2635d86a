"""The training benchmarks' records: the ratios the comparisons are stated in, the Markdown tables,
and the merge into ``<out>/<card>-train.json`` (+ ``.md``)."""

from __future__ import annotations

from pathlib import Path

from benchmarks import measure
from benchmarks.train_models import BASELINE, model_label


TRAIN_KEY = ("card", "bench", "model", "ops_backend", "fused_branches", "attention", "fp8", "mode", "batch", "world_size", "checkpointing",
             "kind", "dist", "fsdp_variant", "ddp_variant", "compile_scope", "overrides")


def model_options(record: dict) -> tuple:
    return record.get("ops_backend"), record.get("fused_branches"), record.get("attention"), bool(record.get("fp8"))


def add_ratios(records: list[dict]) -> None:
    """Ratios the comparisons are stated in, within one card: images/s and peak memory against the
    benchmark's baseline under torch.compile at the same batch and matmul precision (``fp8``); dres_official against dres_baseline
    (same mode and model options); FSDP per-GPU rate at world size N against world size 1 (same model and mode).
    Several GPUs (kinds "dist" and "trainer"): ``scaling_efficiency`` = per-GPU rate on N GPUs / the
    same wrapping's on one GPU (DDP's one-GPU run is the unwrapped model); ``fsdp_vs_ddp`` = an
    FSDP2 run's rate / DDP's at the same GPU count and batch per GPU, i.e. the same global batch
    (on one GPU: FSDP2 / no FSDP2)."""
    thr = [r for r in records if r.get("kind") == "throughput"]
    base = {(r["card"], r["bench"], r["batch"], bool(r.get("fp8"))): r for r in thr
            if r["model"] == BASELINE[r["bench"]] and r["mode"] == "compile"}
    for r in thr:
        b = base.get((r["card"], r["bench"], r["batch"], bool(r.get("fp8"))))
        r["speedup_vs_baseline_compile"] = r["images_per_s"] / b["images_per_s"] if b else None
        r["mem_vs_baseline_compile"] = r["peak_mem_gib"] / b["peak_mem_gib"] if b else None
    by = {(r["card"], r["bench"], r["model"], model_options(r), r["mode"], r["batch"]): r for r in thr}
    for r in thr:
        if r["model"] == "dres_official":
            b = by.get((r["card"], r["bench"], "dres_baseline", model_options(r), r["mode"], r["batch"]))
            r["vs_dres_baseline"] = r["images_per_s"] / b["images_per_s"] if b else None
    fs = [r for r in records if r.get("kind") == "fsdp"]
    one = {(r["card"], r["bench"], r["model"], r["mode"], r["batch"]): r for r in fs if r["world_size"] == 1}
    for r in fs:
        b = one.get((r["card"], r["bench"], r["model"], r["mode"], r["batch"]))
        r["scaling_efficiency"] = r["images_per_s_per_gpu"] / b["images_per_s_per_gpu"] if b else None
    multi = [r for r in records if r.get("kind") in ("dist", "trainer")]
    at = {(r["kind"], r["card"], r["bench"], r["model"], model_options(r), r["mode"], r["batch"], r["world_size"],
           r["dist"], r.get("fsdp_variant"), r.get("ddp_variant")): r for r in multi}
    for r in multi:
        group = (r["kind"], r["card"], r["bench"], r["model"], model_options(r), r["mode"], r["batch"])
        one_dist = "none" if r["dist"] == "ddp" else r["dist"]
        b = at.get(group + (1, one_dist, r.get("fsdp_variant"), None))
        r["scaling_efficiency"] = r["images_per_s_per_gpu"] / b["images_per_s_per_gpu"] if b else None
        d = at.get(group + (r["world_size"], "ddp" if r["world_size"] > 1 else "none", None, None))
        r["fsdp_vs_ddp"] = r["images_per_s"] / d["images_per_s"] if (d and r["dist"] == "fsdp") else None


def cell(v, fmt):
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
            for r in sorted(thr, key=lambda r: (r["bench"], r["batch"], model_label(r), r["mode"])):
                mfu = ""
                if r.get("mfu_pct") is not None:
                    mfu = f"{r['mfu_pct']:.1f} (of {r['matmul_tflops']:.0f})"
                lines.append(f"| {r['bench']} | {model_label(r)} | {r['mode']} | {r['batch']} | {r['images_per_s']:.0f} | "
                             f"{cell(r.get('speedup_vs_baseline_compile'), '.2f')} | {r['peak_mem_gib']:.1f} | "
                             f"{cell(r.get('mem_vs_baseline_compile'), '.2f')} | {cell(r.get('gflop_per_image'), '.1f')} | "
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
                lines.append(f"| {r['bench']} | {model_label(r)} | {r['mode']} | {r['batch']} | {r['world_size']} | "
                             f"{r['images_per_s_per_gpu']:.0f} | {cell(r.get('scaling_efficiency'), '.2f')} | "
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
                lines.append(f"| {r['bench']} | {model_label(r)} | {'yes' if r['checkpointing'] else 'no'} | "
                             f"{r['max_batch']}{'+' if r.get('at_cap') else ''} | {r['gpu_mem_gib']:.0f} |")
            lines.append("")
    return "\n".join(lines) if lines else "No measurements.\n"


def dist_label(kind: str, variant: str | None) -> str:
    """``--dist`` spelling of a wrapping: "ddp", "ddp:bucket_view", "fsdp" (the trainer's default,
    "auto"), "fsdp:never:4"."""
    return f"{kind}:{variant}" if variant and not (kind == "fsdp" and variant == "auto") else kind


def record_dist_label(r: dict) -> str:
    return dist_label(r["dist"], r.get("fsdp_variant") if r["dist"] == "fsdp" else r.get("ddp_variant"))


def dist_markdown(records: list[dict], replay: bool = False) -> list[str]:
    """Table rows of "dist"/"trainer" records: one per (bench, model, mode, wrapping, GPUs); ``replay``
    adds the trainer's graph replay GPU ms per step and its step time against it."""
    head = "| model | mode | wrapping | GPUs | batch/GPU | img/s (all GPUs) | img/s per GPU | scaling vs 1 GPU | " \
           "FSDP2 / DDP (same GPUs) | peak GiB |"
    if replay:
        head += " replay GPU ms/step | trainer / replay |"
    lines = [head, "|---" * head.count(" | ") + "|---|"]
    # the unwrapped one-GPU run first, as DDP's first row
    for r in sorted(records, key=lambda r: (r["bench"], model_label(r), r["mode"], record_dist_label(r).replace("none", "ddp"),
                                            r["world_size"])):
        peak = r.get("peak_mem_gib")
        mode = r["mode"] + (" (whole model)" if r.get("compile_scope") == "model" else "")
        lines.append(f"| {r['bench']} {model_label(r)} | {mode} | {record_dist_label(r)} | {r['world_size']} | {r['batch']} | "
                     f"{r['images_per_s']:.0f} | {r['images_per_s_per_gpu']:.0f} | "
                     f"{cell(r.get('scaling_efficiency'), '.1%')} | {cell(r.get('fsdp_vs_ddp'), '.2f')} | "
                     f"{cell(peak, '.1f')} |" + (f" {cell(r.get('graph_gpu_ms_per_step'), '.2f')} | "
                                               f"{cell(r.get('trainer_vs_replay'), '.3f')} |" if replay else ""))
    return lines


def write_outputs(out_dir: Path, card: str, new_records: list[dict]) -> Path:
    path = out_dir / f"{card}-train.json"
    records = measure.merge_records(measure.load_records(path), new_records, TRAIN_KEY)
    add_ratios(records)
    measure.write_json_atomic(path, records)
    (out_dir / f"{card}-train.md").write_text(f"# Training benchmarks: {card}\n\n" + train_markdown(records))
    return path
