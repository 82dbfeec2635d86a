"""Reproduce the papers' claims at CIFAR scale: the arm matrix, a runner that trains a chosen subset
of arms in parallel (one per GPU) and writes one JSON record per finished arm, a planner for a
device-time budget, and the report (RESULTS.md and curve figures) built from the records alone: an
arm without a record is "not run yet", never a number.

    python -m experiments.repro --list
    python -m experiments.repro --plan --epochs 50 --gpus 2 --budget-min 9 --img-per-s mae=40000,classify=20000,uvit=8000
    python -m experiments.repro --run A.2x2 --epochs 50 --gpus 2 --root /tmp/dres-repro --records "$OUT/repro" \
        --commit <sha>
    python -m experiments.repro --run C.resnet50d.s1@100,A.sweep@50 --gpus 4 ...  # one queue, a length per word
    python -m experiments.repro --run decisive --dry-run --gpus 4 --img-per-s mae=31000,classify=43000,uvit=3600
    python -m experiments.repro --report    # records/experiments/*/*.json -> RESULTS.md + experiments/figures/

Records are kept under ``records/experiments/<card>-<YYYY-MM-DD>-<what>/`` (records/README.md);
the report reads the arm records of every such folder (the latest record of an arm wins).

Two stages per claim: the short runs (one seed, lengths that fitted the first device budgets) and the
decisive runs (the papers' recipes at full length, with seeds; experiments/README.md, "The decisive
runs"); the report never mixes them. An arm trains for its word's ``@EPOCHS``, else its own length (the
decisive arms'), else ``--epochs`` (a claim's arms must share it: the report shows the epochs of every
row); nothing is tuned per arm. Runs go to ``--root/<arm>`` with
``--resume auto``, so a call killed at its time limit continues in the next call on the same machine;
an arm with a record is skipped unless ``--force``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
RECORDS_ROOT = REPO_ROOT / "records" / "experiments"
FIGURES_DIR = REPO_ROOT / "experiments" / "figures"  # the report's curve figures
NOTES_MD = REPO_ROOT / "experiments" / "notes.md"  # the hand-written verdict per claim ("## A", "## B", "## C")
RESULTS_MD = REPO_ROOT / "RESULTS.md"
CURVE_POINTS = 10  # curve points per run: every ~10% of it
TRAIN_SIZES = {"cifar10_wds": 50000, "cifar_tv": 50000}  # to turn epochs into the eval.every step count
# a record keeps this many train and this many test features of every class (float16, each feature kind): a
# ViT-S/4 arm's cls and stream_mean, 2 x 10,000 x 384 x 2 bytes = 15.4 MB
RECORD_FEATURES_PER_CLASS = 500


@dataclass(frozen=True)
class Arm:
    name: str
    claim: str                      # A | B | C
    group: str                      # one setting; its seeds are averaged in the report
    task: str
    preset: str
    overrides: tuple[str, ...]
    seed: int
    tags: tuple[str, ...]           # selectors for --run, e.g. "A.2x2"
    needs: tuple[str, ...] = ()     # arms whose run directory this one reads (B: the FD classifier)
    paper: tuple[tuple[str, float], ...] = ()  # (what, value) from the papers, for the report
    labels: dict = field(default_factory=dict, compare=False, hash=False)  # table columns of the setting
    stage: str = "short"            # short (the first runs, at lengths that fit) | decisive (the papers' recipes)
    epochs: float = 0               # the arm's length when neither --epochs nor @EPOCHS gives one (0: none)


# ------------------------------------------------------------------------------------------------
# The matrix. Papers' numbers: the decayed-shortcut, U-ViT and ResidualDroppath papers.

MAE_PAPER = {
    ("official", 1.0): (("IN-100 ViT-B/16 probe", 76.5), ("IN-100 ViT-S/16 probe", 69.2)),
    ("baseline", 1.0): (("IN-1K ViT-B/16 probe, vanilla MAE", 67.8), ("IN-1K ViT-B/16 kNN, vanilla MAE", 27.4)),
    ("official", 0.8): (("IN-100 ViT-B/16 probe", 79.8),),
    ("official", 0.7): (("IN-100 ViT-B/16 probe", 81.8),),
    ("official", 0.6): (("IN-100 ViT-B/16 probe", 83.6), ("IN-100 ViT-S/16 probe", 78.5),
                        ("IN-1K ViT-B/16 probe", 72.7), ("IN-1K ViT-B/16 kNN", 63.9)),
    ("official", 0.5): (("IN-100 ViT-B/16 probe", 82.3),),
    ("baseline", 0.6): (("IN-100 ViT-B/16 probe, decayed without encoder-decoder skips", 61.5),),
}
UVIT_PAPER = {1.0: (("CIFAR-100 probe", 62.5), ("CIFAR-100 FID (Inception)", 14.3)),
              0.7: (("CIFAR-100 probe", 66.9), ("CIFAR-100 FID (Inception)", 9.0))}
RDP_PAPER = {("resnet50d", "none"): 89.55, ("resnet50d", "drop_path"): 89.84,
             ("resnet50d", "residual_droppath"): 90.84, ("resnet50", "none"): 88.07}
CLASSIFY_PRESETS = {"resnet50d": "classify_resnet50d_cifar10", "resnet50": "classify_resnet50_cifar10",
                    "vit": "classify_cifar10"}
MODES = ("none", "drop_path", "residual_droppath")
FD_CLASSIFIER_ARM = "C-vit-none-s0"


def _mae_arm(variant, alpha, seed, tag):
    # the authors' code zero-initialises every branch end even at alpha_min 1 with skips
    zero_init = "true" if (variant, alpha) == ("official", 1.0) else "auto"
    group = f"A-{variant}-a{alpha}"
    return Arm(f"{group}-s{seed}", "A", group, "mae", "mae_cifar10",
               (f"model.variant={variant}", f"model.alpha_min={alpha}", f"model.zero_init={zero_init}"), seed,
               (tag,), paper=MAE_PAPER.get((variant, alpha), ()),
               labels={"variant": variant, "alpha_min": alpha, "zero_init": zero_init})


def _classify_arm(arch, mode, seed):
    group = f"C-{arch}-{mode}"
    paper = ((f"CIFAR-10 {arch} top-1", RDP_PAPER[(arch, mode)]),) if (arch, mode) in RDP_PAPER else ()
    return Arm(f"{group}-s{seed}", "C", group, "classify", CLASSIFY_PRESETS[arch], (f"model.droppath_mode={mode}",),
               seed, (f"C.{arch}.s{seed}", f"C.{arch}"), paper=paper, labels={"arch": arch, "mode": mode})


def _uvit_arm(alpha, seed):
    # the records of these arms were made with the preset's EMA 0.9999 (override-free), at 10 epochs
    group = f"B-uvit-a{alpha}"
    return Arm(f"{group}-s{seed}", "B", group, "uvit", "uvit_cifar10", (f"model.alpha_min={alpha}",), seed,
               ("B.short",), needs=(FD_CLASSIFIER_ARM,), paper=UVIT_PAPER[alpha], labels={"alpha_min": alpha})


# The decisive runs: the papers' recipes at full length, with seeds.
MAE_DECISIVE_EPOCHS = 400     # mae_cifar10's own length
MAE_DECISIVE_BATCH = 1024     # every A arm the same; lr = blr x 1024 / 256
PROBE_EPOCHS_PAPER = 200      # the decayed-shortcut paper's linear probe: 200 epochs, lr 1e-2, batch 1024
# 64 x 390 = 24,960 steps of 128: ~15 minutes at 3.6k img/s, so an arm ends within one device lease
UVIT_DECISIVE_EPOCHS = 64
# the final evaluation's probe grid (the paper picks the best block and noise level): 13 blocks in uvit_cifar10;
# seed 0 probed 3 / 6 / 9 x 0.05 / 0.1 / 0.3, the later seeds every block at the low noise levels the paper favours
UVIT_PROBE_GRID = ("eval.probe_grid_blocks=[3, 6, 9]", "eval.probe_grid_ts=[0.05, 0.1, 0.3]")
UVIT_PROBE_GRID_FULL = ("eval.probe_grid_blocks=[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]",
                        "eval.probe_grid_ts=[0.01, 0.02, 0.05, 0.1]")
# the later seeds' generation measure: three sample draws, the real-vs-real floor (train against test images) and a
# 2,000-sample classifier FD at every curve point (does it rank the model along training?)
UVIT_FD = ("eval.fd_draws=3", "eval.fd_real_floor=true", "eval.curve_fd_samples=2000")
UVIT_EMA_DECAY = 0.9998       # 0.9998 ** 24,960 = 0.68% of the initial weights left (the paper's 0.9999: 8.2%)
EMA_INITIAL_WEIGHT_MAX = 0.01
RDP_DECISIVE_EPOCHS = 300     # timm's train.py default
RDP_PILOT_EPOCHS = 30         # the 224 px pilot: what fits one device call of about 10 minutes at ~3k img/s
RDP_SEEDS = (0, 1, 2)
TIMM_PRESET = "classify_resnet50d_cifar10_timm"
TIMM_PRESET_224 = "classify_resnet50d_cifar10_timm224"


def ema_initial_weight(decay: float, steps: int) -> float:
    """The weight of the initial parameters in an EMA of decay ``decay`` after ``steps`` updates."""
    return decay ** steps


def _mae_decisive_arm(variant, alpha, seed, tag, zero_init):
    group = f"A400-{variant}-a{alpha}" + ("-zi" if (variant, zero_init) == ("baseline", "true") else "")
    # the seed pairs of official 0.6 vs 1.0 that decide the claim, every seed (A.pairs: retrain and rescore them all)
    pair = ("A.pairs",) if variant == "official" and alpha in (0.6, 1.0) else ()
    return Arm(f"{group}-s{seed}", "A", group, "mae", "mae_cifar10",
               (f"model.variant={variant}", f"model.alpha_min={alpha}", f"model.zero_init={zero_init}",
                f"batch_size={MAE_DECISIVE_BATCH}", f"eval.probe_epochs={PROBE_EPOCHS_PAPER}"), seed,
               (tag, *pair, "A.decisive", "decisive"),
               paper=() if group.endswith("-zi") else MAE_PAPER.get((variant, alpha), ()),
               labels={"variant": variant, "alpha_min": alpha, "zero_init": zero_init}, stage="decisive",
               epochs=MAE_DECISIVE_EPOCHS)


def _uvit_decisive_arm(alpha, seed):
    group = f"B64-uvit-a{alpha}"
    evaluation = UVIT_PROBE_GRID if seed == 0 else UVIT_PROBE_GRID_FULL + UVIT_FD  # seed 0's record keeps its recipe
    return Arm(f"{group}-s{seed}", "B", group, "uvit", "uvit_cifar10",
               (f"model.alpha_min={alpha}", "model.zero_init=true", f"optim.ema_decay={UVIT_EMA_DECAY}",
                *evaluation), seed,
               (f"B.decisive.s{seed}", "B.decisive", "decisive"), needs=(FD_CLASSIFIER_ARM,),
               paper=UVIT_PAPER[alpha], labels={"alpha_min": alpha}, stage="decisive", epochs=UVIT_DECISIVE_EPOCHS)


def _classify_decisive_arm(arch, mode, seed, pilot=False, head_dropout=True):
    """A C arm of timm's recipe; ``head_dropout=False``: without the preset's dropout 0.1 before the classifier
    (timm's ``--drop`` default is 0)."""
    prefix = "C224" if pilot else "C300" if head_dropout else "C300d0"
    group = f"{prefix}-{arch}-{mode}"
    paper = ((f"CIFAR-10 {arch} top-1", RDP_PAPER[(arch, mode)]),) if (arch, mode) in RDP_PAPER else ()
    if pilot:
        tags = ("C.pilot224", "decisive")
    elif not head_dropout:
        tags = (f"C.d0.s{seed}", "C.d0", "decisive")
    elif mode == "residual_droppath_literal":
        tags = (f"C.literal.s{seed}", "C.literal", "decisive")
    else:
        tags = (f"C.timm.{arch}.s{seed}", f"C.timm.{arch}", "C.timm", "decisive")
    overrides = ((f"model.droppath_mode={mode}",) + (() if arch == "resnet50d" else (f"model.arch={arch}",))
                 + (() if head_dropout else ("model.drop_rate=0",)))
    return Arm(f"{group}-s{seed}", "C", group, "classify", TIMM_PRESET_224 if pilot else TIMM_PRESET, overrides,
               seed, tags, paper=paper, labels={"arch": arch, "mode": mode, "px": 224 if pilot else 32,
                                                "drop_rate": 0.1 if head_dropout else 0.0},
               stage="decisive", epochs=RDP_PILOT_EPOCHS if pilot else RDP_DECISIVE_EPOCHS)


def build_matrix() -> list[Arm]:
    """Every arm, in priority order (what a budget should buy first comes first)."""
    arms = [_mae_arm(v, a, 0, "A.2x2") for v in ("baseline", "official") for a in (1.0, 0.6)]
    arms += [_classify_arm("resnet50d", m, 0) for m in MODES]
    arms += [_mae_arm("official", a, 0, "A.sweep") for a in (0.5, 0.7, 0.8)]
    arms += [_mae_arm("baseline", 1.0, 1, "A.seeds"), _mae_arm("official", 0.6, 1, "A.seeds")]
    arms += [_classify_arm("vit", m, 0) for m in MODES]
    arms += [_uvit_arm(a, 0) for a in (1.0, 0.7)]
    arms += [_classify_arm("resnet50d", m, 1) for m in MODES]
    arms += [_classify_arm("resnet50", m, 0) for m in MODES]
    # the decisive runs, in the order a budget should buy them (an arm with a record is skipped): what decides
    # claim A first (its seed pairs, then the alpha sweep), then B's seeds, then C's open questions
    arms += [_mae_decisive_arm("official", a, 0, "A.decisive.s0", "true") for a in (0.6, 1.0)]
    arms += [_mae_decisive_arm("baseline", a, 0, "A.decisive.s0", "auto") for a in (1.0, 0.6)]
    arms += [_mae_decisive_arm("official", a, 1, "A.decisive.s1", "true") for a in (0.6, 1.0)]
    arms += [_mae_decisive_arm("official", a, s, f"A.decisive.s{s}", "true") for s in (2, 3) for a in (0.6, 1.0)]
    arms += [_mae_decisive_arm("official", a, 0, "A.decisive.sweep", "true") for a in (0.5, 0.7, 0.8)]
    arms += [_mae_decisive_arm("baseline", 1.0, 0, "A.decisive.zi", "true")]  # the skips without the init change
    arms += [_classify_decisive_arm("resnet50d", m, s) for s in RDP_SEEDS for m in MODES]
    arms += [_classify_decisive_arm("resnet50d", m, 0, pilot=True) for m in MODES]
    arms += [_uvit_decisive_arm(a, s) for s in (0, 1, 2) for a in (1.0, 0.7)]
    arms += [_classify_decisive_arm("resnet50d", m, s, head_dropout=False) for s in RDP_SEEDS for m in MODES]
    arms += [_classify_decisive_arm("resnet50d", "residual_droppath_literal", s) for s in RDP_SEEDS]
    arms += [_classify_decisive_arm("resnet50", m, 0) for m in MODES]
    return arms


MATRIX = build_matrix()
BY_NAME = {a.name: a for a in MATRIX}


def _named(word: str, arm: Arm) -> bool:
    return word in ("all", arm.name, arm.group, arm.claim) or word in arm.tags


def select(spec: str, matrix=MATRIX) -> list[Arm]:
    """Arms named by a comma list of arm names, group names, tags (``A.2x2``, ``C.resnet50d.s0``),
    claims (``A``) or ``all``, in matrix order; the arms they need are added before them."""
    want: set[str] = set()
    for word in (w.strip() for w in spec.split(",") if w.strip()):
        hits = [a.name for a in matrix if _named(word, a)]
        if not hits:
            raise ValueError(f"--run: no arm, group, tag or claim named {word!r} (see --list)")
        want.update(hits)
    by_name = {a.name: a for a in matrix}
    for name in list(want):
        want.update(by_name[name].needs)
    return [a for a in matrix if a.name in want]


def select_epochs(spec: str, default: float, matrix=MATRIX) -> list[tuple[Arm, float, bool]]:
    """``select`` with a length per word: ``"C.resnet50d.s1@100,A.sweep@50,B.short"`` trains the ResNet arms
    for 100 epochs, the sweep for 50 and B's short arms for ``default``, as ``(arm, epochs, named)``. A word
    without ``@EPOCHS`` gives an arm its own length (``Arm.epochs``, the decisive runs' recipe) or else
    ``default``; an arm another needs (``named`` False) gets that one's length unless it is named itself.
    One queue, so several GPUs stay busy however the lengths differ."""
    named: dict[str, float] = {}
    implied: dict[str, float] = {}
    for word in (w.strip() for w in spec.split(",") if w.strip()):
        word, _, length = word.partition("@")
        given = parse_epochs(length, f"--run {word}@") if length else None
        for arm in select(word, matrix):
            epochs = given if given is not None else (arm.epochs or default)
            if _named(word, arm):
                if epochs <= 0:
                    raise ValueError(f"--epochs: give a positive --epochs or {word}@EPOCHS (every arm of a claim "
                                     "the same)")
                if named.get(arm.name, epochs) != epochs:
                    raise ValueError(f"--run: {arm.name} is given {named[arm.name]:g} and {epochs:g} epochs")
                named[arm.name] = epochs
            else:  # 0: only its record's length can rebuild it (run_arms)
                implied.setdefault(arm.name, epochs)
    lengths = {**implied, **named}
    return [(a, lengths[a.name], a.name in named) for a in matrix if a.name in lengths]


def parse_epochs(text: str, what: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{what}: {text!r} is not a number of epochs") from None


# ------------------------------------------------------------------------------------------------
# Running


def parse_task_map(text: str, what: str, cast=str) -> dict:
    """``"mae=quickstart,uvit=x"`` -> dict; a bare value applies to every task (key ``"*"``)."""
    out = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        key, _, value = part.rpartition("=")
        try:
            out[key or "*"] = cast(value)
        except ValueError:
            raise ValueError(f"{what}: {value!r} is not a valid value") from None
    return out


def curve_every(epochs: float, batch: int, data_name: str, given: int) -> int:
    """The eval.every step count for ~CURVE_POINTS points over the run."""
    if given:
        return given
    if data_name not in TRAIN_SIZES:
        raise ValueError(f"--curve-every: data {data_name!r} has no known size; give the step count")
    steps = int(round(epochs * (TRAIN_SIZES[data_name] // batch)))
    return max(1, steps // CURVE_POINTS)


def arm_command(arm: Arm, *, epochs: float, root: Path, presets: dict, extra: list[str], every: int) -> list[str]:
    cmd = [sys.executable, "-m", f"dres.train.{arm.task}", "--preset", presets.get(arm.task, arm.preset),
           "--out", str(root / arm.name), "--resume", "auto", "--set", f"seed={arm.seed}",
           "--set", f"epochs={epochs:g}", "--set", "steps=0", "--set", f"eval.every={every}",
           "--set", f"ckpt.every={every}",  # a call cut by the device's time limit resumes from the last point
           "--set", "log.progress=false"]
    sets = list(arm.overrides)
    if FD_CLASSIFIER_ARM in arm.needs:
        sets.append(f"eval.fd_classifier={root / FD_CLASSIFIER_ARM}")
    for s in sets + list(extra):
        cmd += ["--set", s]
    return cmd


def planned_command(arm: Arm, *, epochs: float, root: Path, presets: dict, extra: list[str], every: int) -> list[str]:
    """The arm's training command with its eval.every (and ckpt.every) from its resolved config."""
    cfg = resolved_config(arm, presets, extra)
    return arm_command(arm, epochs=epochs, root=root, presets=presets, extra=extra,
                       every=curve_every(epochs, cfg.batch_size, cfg.data.name, every))


@dataclass(frozen=True)
class ArmAction:
    """What ``--run`` does with an arm (:func:`arm_actions`)."""
    what: str                  # skip (it has a record) | resume (from its run folder's checkpoint) | start
    epochs: float              # the length it trains for
    keep_record: bool = False  # it reruns only for the arms that read its run folder: its record stays


def arm_actions(queue: list[tuple[Arm, float, bool]], *, root: Path, records: Path,
                force: bool) -> dict[str, ArmAction]:
    """What ``--run`` does with each ``(arm, epochs, named)`` of ``queue`` (:func:`select_epochs`); the runner
    and the dry run both follow it. An arm with a record in ``records`` is skipped, unless ``force`` reruns it
    (a named arm) or other arms of the queue read its run folder under ``root`` and that holds no finished run
    (a fresh machine): then it is rebuilt for its record's length, which is kept. An arm that runs resumes
    from its run folder's newest checkpoint (``--resume auto``), else starts."""
    from dres.train.checkpoint import list_checkpoints

    needed = {n for a, _, _ in queue for n in a.needs}
    actions = {}
    for arm, epochs, named in queue:
        recorded = (Path(records) / f"{arm.name}.json").exists()
        forced = named and force
        if recorded and not forced and (arm.name not in needed or (root / arm.name / "summary.json").exists()):
            actions[arm.name] = ArmAction("skip", epochs)
            continue
        actions[arm.name] = ArmAction("resume" if list_checkpoints(root / arm.name / "checkpoints") else "start",
                                      epochs if named else need_epochs(arm.name, epochs, records),
                                      keep_record=recorded and not forced)
    return actions


def dry_run(queue: list[tuple[Arm, float, bool]], *, gpus: int, root: Path, records: Path, presets: dict,
            extra: list[str], every: int, force: bool, img_per_s: dict, overhead_s: float, log=print) -> None:
    """What ``--run`` would do (:func:`arm_actions`), without running anything: each arm's exact command (each
    starts on the first free of ``gpus`` GPUs, under its CUDA_VISIBLE_DEVICES) and whether it starts or
    resumes, or why it is skipped, with an estimate of its minutes where ``img_per_s`` has a rate for its task."""
    root = root.resolve()
    log(f"[repro] dry run: {len(queue)} arm(s), one at a time on each of {max(gpus, 1)} "
        f"{'GPU' if gpus else 'CPU slot'}(s), run folders under {root}, records to {records}")
    actions = arm_actions(queue, root=root, records=records, force=force)
    committed = load_records(RECORDS_ROOT)
    for arm, _, named in queue:
        action = actions[arm.name]
        if action.what == "skip":
            log(f"# {arm.name}: has a record in {records}; skipped" + ("" if named else " (read by other arms)"))
            continue
        cmd = planned_command(arm, epochs=action.epochs, root=root, presets=presets, extra=extra, every=every)
        rate = arm_rate(arm, img_per_s)
        if rate:
            est = f", ~{estimate_s(arm, action.epochs, img_per_s, overhead_s) / 60:.0f} min at {rate:g} img/s"
        else:
            recorded = recorded_minutes(arm, action.epochs, committed)
            est = f", ~{recorded[0]:.1f} min on one {recorded[1]} (its records' wall time)" if recorded else ""
        how = (f"resumes its run in {root / arm.name} from its newest checkpoint" if action.what == "resume"
               else f"starts in {root / arm.name}")
        kept = (f"; rebuilt for the arms that read its run folder, its record in {records} kept"
                if action.keep_record else "")
        log(f"# {arm.name}: {action.epochs:g} epochs{est}; {how}{kept}")
        log(shlex.join(["python"] + cmd[1:]))


def recorded_minutes(arm: Arm, epochs: float, recs: dict) -> tuple[float, str] | None:
    """The arm's minutes from start to record as its committed records measured them: the median wall time of
    the records of its group (else of its preset at its stage), scaled to ``epochs``, and their card; None
    without such a record."""
    def alike(match):
        return [r for r in recs.values() if match(r) and r["train"].get("wall_s_last_process") and r["epochs"]]
    rows = (alike(lambda r: r["group"] == arm.group)
            or alike(lambda r: BY_NAME[r["arm"]].preset == arm.preset and BY_NAME[r["arm"]].stage == arm.stage))
    if not rows:
        return None
    minutes = statistics.median(r["train"]["wall_s_last_process"] * epochs / r["epochs"] for r in rows) / 60
    return minutes, statistics.mode(r["card"] for r in rows)


def resolved_config(arm: Arm, presets: dict, extra: list[str]):
    from dres.train.config import build_config

    return build_config(arm.task, presets.get(arm.task, arm.preset), list(arm.overrides) + list(extra))


def git_commit() -> str:
    """The checkout's commit, ``+dirty`` when tracked files differ from it, or ``unknown``."""
    from dres.train.rundir import git_state

    state = git_state(REPO_ROOT)
    if state["git_commit"] is None:
        return "unknown"
    return state["git_commit"] + ("+dirty" if state["git_dirty"] else "")


def card_of(gpu: int | None) -> str:
    if gpu is None:
        import platform

        return f"cpu ({platform.processor() or platform.machine()})"
    import torch

    return torch.cuda.get_device_name(gpu)


def make_record(arm: Arm, run_dir: Path, *, epochs: float, command: str, card: str, commit: str,
                records: Path, arms_per_device: int = 1) -> dict:
    """The arm's record from its finished run directory; its PNGs copied to ``records/figs``.
    ``arms_per_device``: how many arms shared its device (its img/s is per arm)."""
    from dres.eval.curves import CURVES_JSONL, METRICS_JSONL, final_epoch_means, read_points
    from dres.eval.features import FEATURES_FILE

    summary = json.loads((run_dir / "summary.json").read_text())
    ev = summary.get("eval", {})
    # the numbers, and U-ViT's probe grid (a list of {block, t, accuracies}) that the report tabulates
    metrics = {k: v for k, v in ev.items()
               if (isinstance(v, (int, float)) and not isinstance(v, bool)) or k == "probe_grid"}
    curves = read_points(run_dir / CURVES_JSONL) if (run_dir / CURVES_JSONL).exists() else []
    figs = records / "figs"
    artifacts = {}
    for key, value in ev.items():
        if isinstance(value, str) and value.endswith(".png") and Path(value).exists():
            figs.mkdir(parents=True, exist_ok=True)
            dest = figs / f"{arm.name}_{key.removesuffix('_png')}.png"
            shutil.copyfile(value, dest)
            artifacts[key] = str(dest.relative_to(records))
    if (run_dir / "curves.png").exists():
        figs.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(run_dir / "curves.png", figs / f"{arm.name}_curves.png")
        artifacts["curves_png"] = f"figs/{arm.name}_curves.png"
    if (run_dir / FEATURES_FILE).exists():
        kept = keep_features(run_dir / FEATURES_FILE, records / "features" / f"{arm.name}.pt")
        artifacts["features"] = str(kept.relative_to(records))
    history = read_points(run_dir / METRICS_JSONL) if (run_dir / METRICS_JSONL).exists() else []
    # from the log windows, not summary.json: a resumed run's summary covers only its last process
    rates = [h["img_per_s"] for h in history[1:] if h.get("img_per_s")]
    train = {"img_per_s": statistics.median(rates) if rates else None,
             "final_loss": history[-1].get("loss") if history else None,
             "wall_s_last_process": summary.get("wall_s"), "peak_mem_gib": summary.get("peak_mem_gib"),
             "arms_per_device": arms_per_device, **final_epoch_means(history)}
    return {"arm": arm.name, "claim": arm.claim, "group": arm.group, "task": arm.task, "seed": arm.seed,
            "epochs": epochs, "steps": history[-1]["step"] if history else None,
            "overrides": list(arm.overrides), "metrics": metrics, "curves": curves, "train": train,
            "artifacts": artifacts, "card": card, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"), "commit": commit, "command": command}


def keep_features(run_features: Path, dest: Path, per_class: int = RECORD_FEATURES_PER_CLASS) -> Path:
    """A class-balanced part of a run's final features (``per_class`` of each split's classes, float16) at
    ``dest``, small enough to travel with the record, so the encoder can be rescored without retraining."""
    import torch

    from dres.eval.features import load_features, subset_features
    from dres.train.rundir import publish

    dest.parent.mkdir(parents=True, exist_ok=True)
    part = subset_features(load_features(run_features), per_class)
    publish(dest, lambda tmp: torch.save(part, tmp))
    return dest


def rescore(folder: Path, out: Path, *, force: bool, log=print) -> dict[str, str]:
    """Score every features file kept in ``folder`` (a records folder's ``features/<arm>.pt``, or a run root's
    ``<arm>/features.pt``) with both feature kinds, the project's probe and the authors', kNN raw and
    standardised, at its arm's evaluation settings; one JSON per arm in ``out`` (an existing one is kept unless
    ``force``). Returns ``{arm: "rescored" | "kept"}``."""
    import torch

    from dres.eval.features import FEATURES_FILE, load_features, score_feature_kinds
    from dres.records import write_json_atomic

    found = {p.stem: p for p in sorted(Path(folder).glob("features/*.pt")) if p.stem in BY_NAME}
    found.update({p.parent.name: p for p in sorted(Path(folder).glob(f"*/{FEATURES_FILE}")) if p.parent.name in BY_NAME})
    if not found:
        raise ValueError(f"--rescore: no features file of an arm in {folder} (features/<arm>.pt or <arm>/{FEATURES_FILE})")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    status = {}
    for name, path in found.items():
        dest = Path(out) / f"{name}.json"
        if dest.exists() and not force:
            log(f"[repro] {name}: {dest} exists; kept (--force rescores)")
            status[name] = "kept"
            continue
        arm, state = BY_NAME[name], load_features(path)
        e = resolved_config(arm, {}, []).eval
        protocol = {"probe_epochs": e.probe_epochs, "probe_lr": e.probe_lr, "probe_batch": e.probe_batch,
                    "probe_wd": e.probe_wd, "knn_k": e.knn_k, "authors_probe": True, "knn_standardized": True,
                    "seed": arm.seed}
        metrics = score_feature_kinds(state["train"], state["train_labels"], state["test"], state["test_labels"],
                                      primary=state.get("meta", {}).get("primary", e.feature), device=device,
                                      **protocol)
        write_json_atomic(dest, {"arm": name, "features": str(path), "per_class": state["meta"].get("per_class"),
                                 "n_train": len(state["train_labels"]), "n_test": len(state["test_labels"]),
                                 "protocol": protocol, "metrics": metrics, "commit": git_commit(),
                                 "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})
        log(f"[repro] rescored {name} ({len(state['train_labels'])} train / {len(state['test_labels'])} test "
            f"features of {path}): {metrics}")
        status[name] = "rescored"
    return status


def need_epochs(name: str, epochs: float, records: Path) -> float:
    """The length an arm that others need is (re)built for: its record's in ``records``, else ``epochs``
    when given (> 0), else its committed record's (a fresh device's records folder is empty)."""
    here = Path(records) / f"{name}.json"
    if here.exists():
        return json.loads(here.read_text())["epochs"]
    if epochs > 0:
        return epochs
    committed = load_records(RECORDS_ROOT).get(name)
    if committed is None:
        raise ValueError(f"--run: {name} (needed by other arms) has no record; name it with {name}@EPOCHS or "
                         "give --epochs")
    return committed["epochs"]


def run_arms(queue: list[tuple[Arm, float, bool]], *, gpus: int, jobs: int, root: Path, records: Path,
             presets: dict, extra: list[str], every: int, commit: str, force: bool, deadline_min: float,
             log=print) -> dict:
    """Train the ``(arm, epochs, named)`` of ``queue`` (:func:`select_epochs`) in order (needs first),
    ``jobs`` at a time on each of ``gpus`` GPUs (0: on the CPU), each starting on the first free slot;
    ``force`` reruns the named arms that have a record. Returns
    ``{arm: "done" | "skipped" | "failed" | "blocked" | "not started"}``."""
    from dres.records import write_json_atomic

    arms = [a for a, _, _ in queue]
    root, records = root.resolve(), records.resolve()
    actions = arm_actions(queue, root=root, records=records, force=force)
    (root / "logs").mkdir(parents=True, exist_ok=True)
    status = {a.name: "skipped" if actions[a.name].what == "skip" else "pending" for a in arms}
    slots = [g for g in range(gpus) for _ in range(max(1, jobs))] if gpus > 0 else [None] * max(1, jobs)
    # a slot is an index into this process's visible GPUs; its child sees that one device only
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if visible and gpus > len(visible):
        raise ValueError(f"--gpus {gpus}: CUDA_VISIBLE_DEVICES={','.join(visible)} shows {len(visible)}")
    free = list(range(len(slots)))
    running: dict[int, tuple] = {}
    t0 = time.time()

    def ready(a):
        return all(status.get(n) in ("done", "skipped") for n in a.needs)

    while True:
        for a in arms:
            if status[a.name] == "pending" and any(status.get(n) in ("failed", "blocked") for n in a.needs):
                status[a.name] = "blocked"
                log(f"[repro] {a.name}: blocked (needs {', '.join(a.needs)})")
        late = deadline_min and time.time() - t0 > deadline_min * 60
        while free and not late:
            nxt = next((a for a in arms if status[a.name] == "pending" and ready(a)), None)
            if nxt is None:
                break
            k = free.pop(0)
            cmd = planned_command(nxt, epochs=actions[nxt.name].epochs, root=root, presets=presets, extra=extra,
                                  every=every)
            env = dict(os.environ)
            # arms share the host: a share of its cores each, as torchrun does for its workers (intra-op
            # threads that spin between steps starved four graphed arms to 4% GPU use on a 64-core host)
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // len(slots))))
            prefix = ""
            if slots[k] is not None:
                env["CUDA_VISIBLE_DEVICES"] = visible[slots[k]] if visible else str(slots[k])
                prefix = f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} "
            logf = open(root / "logs" / f"{nxt.name}.log", "a")
            proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
            command = prefix + shlex.join(["python"] + cmd[1:])
            running[k] = (nxt, proc, logf, command)
            status[nxt.name] = "running"
            log(f"[repro] {actions[nxt.name].what} {nxt.name} on "
                f"{'GPU ' + str(slots[k]) if slots[k] is not None else 'CPU'}: {command}")
        if not running:
            break
        time.sleep(1.0)
        for k, (a, proc, logf, command) in list(running.items()):
            if proc.poll() is None:
                continue
            logf.close()
            del running[k]
            free.append(k)
            if proc.returncode == 0:
                status[a.name] = "done"
                if actions[a.name].keep_record:
                    log(f"[repro] done {a.name} (rerun for the arms that read it; its earlier record is kept)")
                    continue
                rec = make_record(a, root / a.name, epochs=actions[a.name].epochs, command=command,
                                  card=card_of(slots[k]), commit=commit, records=records,
                                  arms_per_device=max(1, jobs))
                write_json_atomic(records / f"{a.name}.json", rec)
                log(f"[repro] done {a.name}: {rec['metrics']}")
            else:
                status[a.name] = "failed"
                tail = (root / "logs" / f"{a.name}.log").read_text().splitlines()[-5:]
                log(f"[repro] FAILED {a.name} (exit {proc.returncode}); log {root / 'logs' / (a.name + '.log')}:\n  "
                    + "\n  ".join(tail))
    return {n: ("not started" if s == "pending" else s) for n, s in status.items()}


# ------------------------------------------------------------------------------------------------
# Planning


def arm_rate(arm: Arm, img_per_s: dict) -> float | None:
    """The arm's rate from a ``{preset or task or "*": img/s}`` map: its preset's, else its task's."""
    return img_per_s.get(arm.preset, img_per_s.get(arm.task, img_per_s.get("*")))


def estimate_s(arm: Arm, epochs: float, img_per_s: dict, overhead_s: float) -> float:
    rate = arm_rate(arm, img_per_s)
    if not rate:
        raise ValueError(f"--img-per-s: no rate for task {arm.task!r} (give {arm.task}=R or one number)")
    return epochs * TRAIN_SIZES["cifar10_wds"] / rate + overhead_s


def plan(arms: list[Arm], *, epochs: float, gpus: int, budget_min: float, img_per_s: dict,
         overhead_s: float) -> tuple[list[tuple[Arm, int, float]], list[Arm]]:
    """Arms in priority order onto the least-loaded GPU while the wall time stays within the budget
    (an arm's needs first), each for its own length or else ``epochs``: ``([(arm, gpu, est_s)], [arms left out])``."""
    load = [0.0] * max(1, gpus)
    chosen, names, left = [], set(), []
    for a in arms:
        if not all(n in names for n in a.needs):
            left.append(a)
            continue
        est = estimate_s(a, a.epochs or epochs, img_per_s, overhead_s)  # a decisive arm's own length
        g = min(range(len(load)), key=load.__getitem__)
        if load[g] + est > budget_min * 60:
            left.append(a)
            continue
        load[g] += est
        chosen.append((a, g, est))
        names.add(a.name)
    return chosen, left


# ------------------------------------------------------------------------------------------------
# Report


def load_records(records: Path, other_recipe: list | None = None) -> dict[str, dict]:
    """The arm records (files named after an arm of the matrix) in ``records`` and its subfolders,
    in matrix order, the latest by date where an arm has several; artifact paths made absolute. A record
    made with other overrides than its arm's today (another recipe under the same name) is not the arm's:
    it is left out, and its path appended to ``other_recipe`` when given."""
    found = {}
    for path in sorted(Path(records).glob("*.json")) + sorted(Path(records).glob("*/*.json")):
        if path.stem not in BY_NAME:
            continue
        rec = json.loads(path.read_text())
        if rec.get("overrides") != list(BY_NAME[path.stem].overrides):
            if other_recipe is not None:
                other_recipe.append(path)
            continue
        rec["artifacts"] = {k: str(path.parent.resolve() / v) for k, v in rec.get("artifacts", {}).items()}
        if path.stem not in found or rec["date"] >= found[path.stem]["date"]:
            found[path.stem] = rec
    return {a.name: found[a.name] for a in MATRIX if a.name in found}


def stat(values: list[float], scale=1.0, digits=1) -> str:
    """``mean ± sd (n)`` over seeds (the sample standard deviation), or the one value."""
    v = [x * scale for x in values]
    if len(v) == 1:
        return f"{v[0]:.{digits}f}"
    return f"{statistics.fmean(v):.{digits}f} ± {statistics.stdev(v):.{digits}f} (n={len(v)})"


def metric(rec: dict, name: str):
    """A metric by name or, for names that carry a sampler suffix (``fd_cifar_classifier``), prefix."""
    m = rec["metrics"]
    if name in m:
        return m[name]
    if name == "effective_rank_entropy" and m.get("effective_rank"):  # recorded as exp(H) only before
        return math.log(m["effective_rank"])
    hits = [v for k, v in m.items() if k.startswith(name)]
    return hits[0] if hits else None


def group_cells(group: str, recs: dict, columns: list[tuple[str, float, int]]) -> tuple[list[str], list[dict]]:
    """Cells of one setting's row: epochs, seeds and each (metric, scale, digits) over its records."""
    rows = [r for r in recs.values() if r["group"] == group]
    if not rows:
        return ["not run yet"] + ["—"] * (1 + len(columns)), []
    epochs = sorted({r["epochs"] for r in rows})
    seeds = ",".join(str(r["seed"]) for r in sorted(rows, key=lambda r: r["seed"]))
    cells = ["/".join(f"{e:g}" for e in epochs), seeds]
    for name, scale, digits in columns:
        vals = [metric(r, name) for r in rows]
        vals = [v for v in vals if v is not None]
        cells.append(stat(vals, scale, digits) if vals else "—")
    return cells, rows


def probe_grid_lines(recs: dict, group_prefix: str) -> list[str]:
    """Per record of the groups starting with ``group_prefix`` that carries a ``probe_grid`` (U-ViT): a table of
    linear-probe accuracy (%) by noise level (rows) and block (columns), best cell in bold."""
    lines = []
    for name, r in sorted(recs.items()):
        grid = r["group"].startswith(group_prefix) and r["metrics"].get("probe_grid")
        if not grid:
            continue
        blocks, ts = sorted({g["block"] for g in grid}), sorted({g["t"] for g in grid})
        acc = {(g["t"], g["block"]): g["linear_probe_acc"] for g in grid}
        best = max(acc, key=acc.get)
        rows = [[f"{t:g}"] + [(f"**{100 * acc[t, b]:.1f}**" if (t, b) == best else f"{100 * acc[t, b]:.1f}")
                              if (t, b) in acc else "—" for b in blocks] for t in ts]
        lines += [f"`{name}` (seed {r['seed']}): linear-probe accuracy % by noise level t and block", ""]
        lines += _table(["t"] + [f"block {b}" for b in blocks], rows) + [""]
    return lines


def delta_line(recs: dict, a: str, b: str, name: str, scale: float, what: str) -> str | None:
    va = [metric(r, name) for r in recs.values() if r["group"] == a]
    vb = [metric(r, name) for r in recs.values() if r["group"] == b]
    va, vb = [v for v in va if v is not None], [v for v in vb if v is not None]
    if not va or not vb:
        return None
    d = (statistics.fmean(va) - statistics.fmean(vb)) * scale
    return f"- {what}: {d:+.2f} ({a} {len(va)} seed(s) vs {b} {len(vb)} seed(s))"


def paired_line(recs: dict, a: str, b: str, name: str, scale: float, what: str) -> str | None:
    """``a − b`` paired by seed: the mean difference with its 95% t confidence interval over the pairs."""
    by_seed = {g: {r["seed"]: metric(r, name) for r in recs.values() if r["group"] == g} for g in (a, b)}
    seeds = sorted(s for s in by_seed[a] if s in by_seed[b] and None not in (by_seed[a][s], by_seed[b][s]))
    if not seeds:
        return None
    d = [(by_seed[a][s] - by_seed[b][s]) * scale for s in seeds]
    seed_list = ",".join(str(s) for s in seeds)
    if len(d) == 1:
        return f"- {what}: {d[0]:+.2f} (seed {seed_list}; one pair, no interval)"
    from scipy.stats import t

    half = t.ppf(0.975, len(d) - 1) * statistics.stdev(d) / math.sqrt(len(d))
    return (f"- {what}: {statistics.fmean(d):+.2f} ± {half:.2f} (95% CI over {len(d)} seed pairs {seed_list}; "
            f"per seed {', '.join(f'{x:+.2f}' for x in d)})")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def _paper(arm: Arm) -> str:
    return "; ".join(f"{v} ({w})" for w, v in arm.paper) or "—"


def _groups(claim: str, stage: str) -> list[Arm]:
    """The first arm of every group of ``claim`` at ``stage`` (matrix order)."""
    seen, out = set(), []
    for a in MATRIX:
        if a.claim == claim and a.stage == stage and a.group not in seen:
            seen.add(a.group)
            out.append(a)
    return out


def _notes(f: Path) -> dict[str, str]:
    f = Path(f)
    if not f.exists():
        return {}
    out, key = {}, None
    for line in f.read_text().splitlines():
        if line.startswith("## "):
            key = line[3:].strip().split()[0]
            out[key] = ""
        elif key:
            out[key] += line + "\n"
    return {k: v.strip() for k, v in out.items()}


def claim_figure(claim: str, stage: str, recs: dict, figures: Path, keys: list[str], name: str,
                 draw: bool) -> Path | None:
    """``figures/name``: the curves of every arm of ``claim`` at ``stage`` that has some (drawn when ``draw``)."""
    from dres.eval.curves import plot_curves

    series = {r["arm"]: r["curves"] for r in recs.values()
              if r["claim"] == claim and BY_NAME[r["arm"]].stage == stage and r["curves"]}
    keys = [k for k in keys if any(any(k in p for p in pts) for pts in series.values())]
    if not series or not keys:
        return None
    if draw:
        Path(figures).mkdir(parents=True, exist_ok=True)
        plot_curves(series, Path(figures) / name, keys, title=f"claim {claim} ({stage} runs): metrics over training")
    return Path(figures) / name


def report(records: Path = RECORDS_ROOT, out: Path = RESULTS_MD, figures: Path = FIGURES_DIR,
           notes: Path = NOTES_MD) -> str:
    """Write ``out`` (and the claims' curve figures under ``figures``) from the records and the
    verdicts in ``notes``; returns the text."""
    text = render(records, Path(out).resolve().parent, figures=figures, notes=notes)
    Path(out).write_text(text)
    return text


A_COLUMNS = [("linear_probe_acc", 100, 1), ("knn_acc", 100, 1), ("effective_rank_entropy", 1, 2),
             ("effective_rank", 1, 1)]
A_HEADER = ["probe %", "kNN %", "H (eq. 6)", "exp(H)"]
A_CURVES = ["linear_probe_acc", "knn_acc", "effective_rank_entropy", "effective_rank"]
# (group a, group b, metric, scale, label) of a − b, the same in both stages of A
A_COMPARISONS = [("official-a0.6", "official-a1.0", "linear_probe_acc", 100,
                  "probe, official 0.6 − official 1.0 (points)"),
                 ("official-a0.6", "official-a1.0", "knn_acc", 100, "kNN, official 0.6 − official 1.0 (points)"),
                 ("baseline-a0.6", "baseline-a1.0", "linear_probe_acc", 100,
                  "probe, baseline 0.6 − baseline 1.0 (points; zero-init on at 0.6 only)")]
C_COLUMNS = [("top1", 100, 2), ("final_epoch_train_acc", 100, 1), ("final_epoch_loss", 1, 3)]
# (mode a, mode b) of a − b in top-1, both stages of C: the claim against drop path, then each against none
C_COMPARISONS = [("residual_droppath", "drop_path"), ("residual_droppath", "none"), ("drop_path", "none")]


def render(records: Path, base: Path, figures: Path = FIGURES_DIR, notes: Path = NOTES_MD, draw: bool = True) -> str:
    """The Markdown of the records and the verdicts in ``notes``, paths relative to ``base``; the
    curve figures go to ``figures`` and are drawn when ``draw``."""
    records, base, figures = Path(records).resolve(), Path(base).resolve(), Path(figures).resolve()
    other_recipe: list[Path] = []
    recs = load_records(records, other_recipe)
    verdicts = _notes(notes)

    def rel(p) -> str:
        p = Path(p).resolve()
        return p.relative_to(base).as_posix() if p.is_relative_to(base) else str(p)
    L = ["# Reproducing the papers' claims at CIFAR scale", "",
         "Generated by `python -m experiments.repro --report` from the records in "
         f"`{rel(records)}/` (one JSON per finished arm: metrics, seed, epochs, card, date, commit, command). "
         "An arm without a record reads *not run yet*. Values are mean ± standard deviation over seeds (n seeds), "
         "or the single run's value; differences of the decisive runs are paired by seed, with a 95% t "
         "interval. The papers' numbers are on other data and models (ImageNet, CIFAR-100, ViT-B/16): compare "
         "directions, not absolute values. Each claim has its decisive runs (the papers' recipes at full length, "
         "with seeds) and the earlier short runs (one seed, shorter, other settings), never mixed in one table.",
         ""]
    pending = [a.name for a in MATRIX if a.name not in recs]

    def block(claim, stage, title, intro, header, rows, curve_keys, figure, deltas):
        fig = claim_figure(claim, stage, recs, figures, curve_keys, figure, draw)
        curves = f"![claim {claim} {stage} curves]({rel(fig)})" if fig else "Curves: none yet (no record)."
        deltas = [d for d in deltas if d]
        tail = ["Differences (from the records):", ""] + deltas + [""] if deltas else []
        return [f"### {title}", "", intro, ""] + _table(header, rows) + ["", curves, ""] + tail

    def verdict(claim):
        return [verdicts.get(claim) or f"Verdict: pending — write it under `## {claim}` in {rel(notes)} and rebuild.",
                ""]

    # A
    def a_rows(stage):
        rows = []
        for a in _groups("A", stage):
            cells, _ = group_cells(a.group, recs, A_COLUMNS)
            rows.append([a.labels["variant"], f"{a.labels['alpha_min']:g}", a.labels["zero_init"]] + cells
                        + [_paper(a)])
        return rows
    a_header = ["variant", "alpha_min", "zero_init", "epochs", "seeds"] + A_HEADER + ["papers (ImageNet)"]
    L += ["## A. Decayed identity shortcuts, MAE on CIFAR-10 (preset `mae_cifar10`, ViT-S/4)", "",
          "Linear probe (on frozen cls features, eval.probe_epochs) and kNN (k=20, cosine) on the 10k test split; "
          "effective rank of the last-layer cls features as eq. 6 defines it, the entropy H of the normalised "
          "singular values of their covariance, and as exp(H). The IN-1K numbers are vanilla MAE's, on the "
          "baseline 1.0 row.", ""]
    L += block("A", "decisive", f"Decisive runs: {MAE_DECISIVE_EPOCHS} epochs, batch {MAE_DECISIVE_BATCH}, "
               f"probe {PROBE_EPOCHS_PAPER} epochs",
               f"Preset `mae_cifar10` at its {MAE_DECISIVE_EPOCHS} epochs (20 warm-up), batch {MAE_DECISIVE_BATCH} "
               f"(lr = blr x batch / 256) in every arm; the linear probe at the paper's protocol ({PROBE_EPOCHS_PAPER} "
               "epochs, lr 1e-2, batch 1024, AdamW; the paper's BatchNorm in front of the head is the "
               "standardisation by the train features' mean and std). Official 0.6 vs 1.0 both with "
               "`model.zero_init=true`, so initialisation is not confounded with alpha; baseline 1.0 is vanilla "
               "MAE (no zero-init), baseline 1.0 zi the same with zero-init, to separate the skips from the init.",
               a_header, a_rows("decisive"), A_CURVES, "mae_decisive_curves.png",
               [paired_line(recs, f"A400-{x}", f"A400-{y}", m, scale, what) for x, y, m, scale, what in A_COMPARISONS]
               + [paired_line(recs, "A400-official-a1.0", "A400-baseline-a1.0-zi", "linear_probe_acc", 100,
                              "probe, official 1.0 − baseline 1.0 zi (points; the skips alone, both zero-init)"),
                  paired_line(recs, "A400-official-a0.6", "A400-official-a1.0", "effective_rank_entropy", 1,
                              "H, official 0.6 − official 1.0"),
                  paired_line(recs, "A400-baseline-a1.0-zi", "A400-baseline-a1.0", "linear_probe_acc", 100,
                              "probe, baseline 1.0 zi − baseline 1.0 (points; zero-init alone)")])
    L += block("A", "short", "Earlier short runs: 50 epochs, batch 512, probe 100 epochs, one seed",
               "The first runs: 40% of the 50 epochs warm-up; official 1.0 with `model.zero_init=true`, the other "
               "arms `auto` (zero-init where alpha_min < 1), so official 1.0 − baseline 1.0 changes the skips and "
               "the initialisation together.",
               a_header, a_rows("short"), A_CURVES, "mae_curves.png",
               [delta_line(recs, f"A-{x}", f"A-{y}", m, scale, what) for x, y, m, scale, what in A_COMPARISONS]
               + [delta_line(recs, "A-official-a1.0", "A-baseline-a1.0", "linear_probe_acc", 100,
                             "probe, official 1.0 − baseline 1.0 (points; the skips and zero-init together)")])
    L += verdict("A")

    # B
    def b_rows(stage):
        rows = []
        for a in _groups("B", stage):
            cells, recs_b = group_cells(a.group, recs, [("probe_t0.1_linear_probe_acc", 100, 1),
                                                        ("probe_t0.1_knn_acc", 100, 1),
                                                        ("fd_cifar_classifier", 1, 2),
                                                        ("fd_noise_cifar_classifier", 1, 2), ("fid_", 1, 2)])
            grid = next((r["artifacts"].get("samples_png") for r in recs_b if r["artifacts"].get("samples_png")),
                        None)
            rows.append([f"{a.labels['alpha_min']:g}"] + cells + [f"![samples]({rel(grid)})" if grid else "—",
                                                                  _paper(a)])
        return rows
    b_header = ["alpha_min", "epochs", "seeds", "mid-block probe %", "mid-block kNN %", "fd_cifar_classifier",
                "same for noise", "FID", "samples", "paper (CIFAR-100)"]
    steps_b = UVIT_DECISIVE_EPOCHS * (TRAIN_SIZES["cifar10_wds"] // 128)
    L += ["## B. U-ViT, decayed through the whole network (preset `uvit_cifar10`, U-ViT-S/2, CIFAR-10)", "",
          "The paper's numbers are on CIFAR-100, which cannot be had offline here: B runs on CIFAR-10. Probe of "
          "the mid-block features at t=0.1 (eval.probe_epochs), and `fd_cifar_classifier`: the Frechet "
          "distance between generated and test images in the penultimate features of a CIFAR-10 ViT classifier "
          f"trained by dres (arm `{FD_CLASSIFIER_ARM}`), beside the same distance for the sampler's starting noise "
          "(samples of a trained model must be far below it). **It is not FID** and not comparable to published FID "
          "values (the Inception weights cannot be downloaded here; with `eval.fid_inception=...` the same command "
          "reports real FID).", ""]
    L += block("B", "decisive", f"Decisive runs: {steps_b:,} steps, EMA {UVIT_EMA_DECAY}",
               f"{UVIT_DECISIVE_EPOCHS} epochs of batch 128 ({steps_b:,} steps; the paper trains 500k), EMA decay "
               f"{UVIT_EMA_DECAY} chosen for that length: the initial weights weigh {UVIT_EMA_DECAY}^{steps_b} = "
               f"{ema_initial_weight(UVIT_EMA_DECAY, steps_b):.2%} of the evaluated model (the paper's 0.9999 would "
               f"leave {ema_initial_weight(0.9999, steps_b):.1%}). `model.zero_init=true` in both arms (matched).",
               b_header, b_rows("decisive"), ["probe_t0.1_linear_probe_acc", "probe_t0.1_knn_acc"],
               "uvit_decisive_curves.png",
               [paired_line(recs, "B64-uvit-a0.7", "B64-uvit-a1.0", "probe_t0.1_linear_probe_acc", 100,
                            "mid-block probe, 0.7 − 1.0 (points)"),
                paired_line(recs, "B64-uvit-a0.7", "B64-uvit-a1.0", "fd_cifar_classifier", 1,
                            "fd_cifar_classifier, 0.7 − 1.0")])
    grids = probe_grid_lines(recs, "B64-uvit")
    L += ["Probe grids of the decisive arms (`eval.probe_grid_blocks` x `eval.probe_grid_ts`, the final evaluation; "
          "the paper picks the best block and noise level):", ""] + (grids or ["Not run yet.", ""])
    L += block("B", "short", "Earlier short runs: 3,900 steps, the preset's EMA 0.9999",
               f"10 epochs of batch 128: the EMA still held 0.9999^3900 = {ema_initial_weight(0.9999, 3900):.0%} "
               "of the initial weights, so these evaluate mostly-initial networks; zero-init `auto` (on at 0.7 only).",
               b_header, b_rows("short"), ["probe_t0.1_linear_probe_acc", "probe_t0.1_knn_acc"], "uvit_curves.png",
               [delta_line(recs, "B-uvit-a0.7", "B-uvit-a1.0", "probe_t0.1_linear_probe_acc", 100,
                           "mid-block probe, 0.7 − 1.0 (points)"),
                delta_line(recs, "B-uvit-a0.7", "B-uvit-a1.0", "fd_cifar_classifier", 1,
                           "fd_cifar_classifier, 0.7 − 1.0")])
    L += verdict("B")

    # C
    def c_rows(stage, columns):
        rows = []
        for a in _groups("C", stage):
            cells, _ = group_cells(a.group, recs, columns)
            px = [str(a.labels["px"])] if stage == "decisive" else []
            rows.append([a.labels["arch"]] + px + [a.labels["mode"]] + cells + [_paper(a)])
        return rows
    L += ["## C. ResidualDroppath on CIFAR-10 (timm ResNet50d / ResNet50, dres ViT-Ti/4)", "",
          "Top-1 on the 10k test split; the three modes differ only in `model.droppath_mode` (drop path 0.1, "
          "linear in depth); train accuracy and loss are the final epoch's (from the training log).", ""]
    L += block("C", "decisive", f"Decisive runs: timm's train.py recipe, {RDP_DECISIVE_EPOCHS} epochs, "
               f"{len(RDP_SEEDS)} seeds; 224 px pilot",
               f"Preset `{TIMM_PRESET}` (its comments give the recipe and where dres departs from timm's): batch 128, "
               "lr 0.05, RandomResizedCrop 0.08-1, colour jitter 0.4, evaluation resize by crop_pct 0.875 then "
               f"centre crop, dropout 0.1 before the classifier, 32 px; the pilot `{TIMM_PRESET_224}` at 224 px, "
               "one seed, as many epochs as its row says.",
               ["model", "px", "mode", "epochs", "seeds", "top-1 %", "train acc % (last epoch)",
                "train loss (last epoch)", "paper (CIFAR-10)"], c_rows("decisive", C_COLUMNS), ["top1"],
               "classify_decisive_curves.png",
               [paired_line(recs, f"{prefix}-{arch}-{x}", f"{prefix}-{arch}-{y}", "top1", 100,
                            f"{arch} {px} px: {x} − {y} (points)")
                for prefix, px in (("C300", 32), ("C224", 224)) for arch in ("resnet50d", "resnet50")
                for x, y in C_COMPARISONS])
    L += block("C", "short", "Earlier short runs: 100 epochs (ResNet50d), 50 (ViT), one seed",
               "Presets `classify_resnet50d_cifar10`, `classify_resnet50_cifar10` (batch 256, lr 0.1, crop 0.35-1, "
               "no colour jitter) and `classify_cifar10`.",
               ["model", "mode", "epochs", "seeds", "top-1 %", "paper (CIFAR-10)"], c_rows("short", [("top1", 100, 2)]),
               ["top1"], "classify_curves.png",
               [delta_line(recs, f"C-{arch}-{x}", f"C-{arch}-{y}", "top1", 100, f"{arch}: {x} − {y} (points)")
                for arch in CLASSIFY_PRESETS for x, y in C_COMPARISONS])
    L += verdict("C")

    # provenance
    L += ["## Runs", ""]
    if recs:
        L += _table(["arm", "epochs", "steps", "card", "date", "commit", "img/s (arms sharing the GPU)", "command"],
                    [[r["arm"], f"{r['epochs']:g}", r["steps"], r["card"], r["date"], r["commit"][:12],
                      (f"{r['train']['img_per_s']:.0f} ({r['train'].get('arms_per_device', 1)})"
                       if r["train"].get("img_per_s") else "—"),
                      f"`{r['command']}`"] for r in recs.values()])
    else:
        L += ["No arm has run yet."]
    if other_recipe:
        L += ["", "Not counted (made with other overrides than their arm's today): "
              + ", ".join(f"`{rel(p)}`" for p in other_recipe) + "."]
    L += ["", "Not run yet: " + (", ".join(f"`{n}`" for n in pending) if pending else "none") + ".", "",
          "The decisive runs (experiments/README.md, \"The decisive runs\", gives the device calls); see the "
          "commands, then rebuild this file:", "",
          "```bash",
          "python -m experiments.repro --run decisive --dry-run --gpus 4 --img-per-s mae=31000,classify=43000,uvit=3600",
          "python -m experiments.repro --run decisive --gpus 4 --root /tmp/dres-repro "
          "--records records/experiments/CARD-DATE-WHAT",
          "python -m experiments.repro --report", "```", ""]
    return "\n".join(L)


# ------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.repro", description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--list", action="store_true", help="print the arm matrix")
    mode.add_argument("--plan", action="store_true", help="which arms fit --budget-min on --gpus")
    mode.add_argument("--run", metavar="ARMS", help="arm names, groups, tags (A.2x2, A.sweep, A.seeds, B, "
                      "C.resnet50d.s0, C.vit, ...), claims or 'all', comma-separated, each optionally @EPOCHS")
    mode.add_argument("--report", action="store_true", help="write RESULTS.md and the curve figures from the records")
    mode.add_argument("--rescore", metavar="FOLDER", type=Path, help="score the features kept in FOLDER (a records "
                      "folder's features/<arm>.pt or a run root's <arm>/features.pt) with both probes and kNN "
                      "raw and standardised; JSON per arm to --records (default FOLDER/rescored)")
    p.add_argument("--epochs", type=float, default=0, help="training length of every arm (--plan; --run: of the "
                   "words without @EPOCHS)")
    p.add_argument("--gpus", type=int, default=1, help="GPUs (0: the CPU)")
    p.add_argument("--jobs", type=int, default=1, help="arms at a time on each GPU (or on the CPU); processes sharing a GPU are "
                   "time-sliced, so more than 1 rarely adds throughput (experiments/README.md)")
    p.add_argument("--root", type=Path, default=Path("/tmp/dres-repro"), help="run directories (local disk)")
    p.add_argument("--records", type=Path, help="--run: the folder the JSON records go to (required); --report: "
                   "the folder read, with its subfolders (default records/experiments)")
    p.add_argument("--figures", type=Path, default=FIGURES_DIR, help="--report: where the curve figures go")
    p.add_argument("--notes", type=Path, default=NOTES_MD, help="--report: the verdicts (## A, ## B, ## C)")
    p.add_argument("--out", type=Path, default=RESULTS_MD, help="--report: the Markdown file")
    p.add_argument("--preset", default="", help="task=preset replacements, e.g. mae=quickstart (smoke tests)")
    p.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every arm (data paths, smoke-test sizes); recorded in each command")
    p.add_argument("--curve-every", type=int, default=0, help="eval.every in steps (default: ~10%% of the run)")
    p.add_argument("--commit", default="", help="the commit the tree was copied from (default: git rev-parse HEAD)")
    p.add_argument("--force", action="store_true", help="rerun the named arms that already have a record (not "
                   "the arms they need)")
    p.add_argument("--deadline-min", type=float, default=0, help="start no arm after this many minutes")
    p.add_argument("--dry-run", action="store_true", help="--run: print each arm's exact command (or why it is "
                   "skipped) and, with --img-per-s, its estimated minutes; run nothing")
    p.add_argument("--budget-min", type=float, default=9.0, help="--plan: wall minutes")
    p.add_argument("--img-per-s", default="", help="--plan, --dry-run: task=rate or preset=rate list "
                   "(or one rate for all)")
    p.add_argument("--overhead-s", type=float, default=120.0, help="--plan: start, compile and evaluation per arm")
    a = p.parse_args(argv)
    try:
        if a.list:
            for arm in MATRIX:
                print(f"{arm.name:28s} {','.join(arm.tags):22s} {arm.preset:28s} {' '.join(arm.overrides)}"
                      + (f"  needs {','.join(arm.needs)}" if arm.needs else ""))
            return 0
        if a.report:
            report(a.records or RECORDS_ROOT, a.out, figures=a.figures, notes=a.notes)
            print(f"[repro] wrote {a.out}")
            return 0
        if a.rescore:
            rescore(a.rescore, a.records or a.rescore / "rescored", force=a.force)
            return 0
        if a.plan:
            if a.epochs <= 0:
                raise ValueError("--epochs must be positive (the same for every arm)")
            chosen, left = plan(MATRIX, epochs=a.epochs, gpus=a.gpus, budget_min=a.budget_min,
                                img_per_s=parse_task_map(a.img_per_s, "--img-per-s", float), overhead_s=a.overhead_s)
            for arm, g, est in chosen:
                print(f"fits  {arm.name:28s} gpu {g}  ~{est / 60:.1f} min")
            for arm in left:
                print(f"left  {arm.name}")
            if chosen:
                print(f"\npython -m experiments.repro --run {','.join(x[0].name for x in chosen)} --epochs {a.epochs:g} "
                      f"--gpus {a.gpus} --root /tmp/dres-repro --records records/experiments/CARD-DATE-WHAT")
            return 0
        if a.dry_run:
            dry_run(select_epochs(a.run, a.epochs), gpus=a.gpus, root=a.root,
                    records=a.records or Path("records/experiments/CARD-DATE-WHAT"),
                    presets=parse_task_map(a.preset, "--preset"), extra=a.extra, every=a.curve_every, force=a.force,
                    img_per_s=parse_task_map(a.img_per_s, "--img-per-s", float), overhead_s=a.overhead_s)
            return 0
        if a.records is None:
            raise ValueError("--run needs --records FOLDER (a new records/experiments/<card>-<YYYY-MM-DD>-<what>, "
                             "or a scratch folder on the device)")
        status = run_arms(select_epochs(a.run, a.epochs), gpus=a.gpus, jobs=a.jobs, root=a.root, records=a.records,
                          presets=parse_task_map(a.preset, "--preset"), extra=a.extra, every=a.curve_every,
                          commit=a.commit or git_commit(), force=a.force, deadline_min=a.deadline_min)
    except ValueError as e:
        print(f"repro: error: {e}", file=sys.stderr)
        return 2
    for name, s in status.items():
        print(f"[repro] {name}: {s}")
    return 0 if all(s in ("done", "skipped") for s in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
