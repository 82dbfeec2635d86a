"""Running the arms: each arm's training command, what ``--run`` does with it (skip, resume, start), a queue
that trains arms one per GPU slot and writes one JSON record per finished arm (with a class-balanced part of its
final features), the rescoring of kept features, and a planner for a budget of GPU minutes.
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from experiments.arms import BY_NAME, FD_CLASSIFIER_ARM, MATRIX, TRAIN_SIZES, Arm

REPO_ROOT = Path(__file__).resolve().parent.parent
RECORDS_ROOT = REPO_ROOT / "records" / "experiments"  # every records folder the report and the runner read
CURVE_POINTS = 10  # curve points per run: every ~10% of it
# a record keeps this many train and this many test features of every class (float16, each feature kind): a
# ViT-S/4 arm's cls and stream_mean, 2 x 1,000 x 384 x 2 bytes = 1.5 MB; records travel with the tree to GPU
# hosts (64 MiB with the carried wheels), so ten decisive arms may not take more than a few MB each
RECORD_FEATURES_PER_CLASS = 50


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
           "--set", f"ckpt.every={every}",  # an arm cut short resumes from its last curve point
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
    (a fresh host): then it is rebuilt for its record's length, which is kept. An arm that runs resumes
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
            extra: list[str], every: int, force: bool, img_per_s: dict, overhead_s: float, jobs: int = 1,
            log=print) -> None:
    """What ``--run`` would do (:func:`arm_actions`), without running anything: each arm's exact command (each
    starts on the first free of ``gpus`` GPUs, under its CUDA_VISIBLE_DEVICES) and whether it starts or
    resumes, or why it is skipped, with an estimate of its minutes where ``img_per_s`` has a rate for its task."""
    root = root.resolve()
    at_a_time = "one at a time" if jobs <= 1 else f"{jobs} at a time"
    on = f" (devices {', '.join(dict.fromkeys(slot_devices(gpus, jobs)))})" if gpus else ""
    log(f"[repro] dry run: {len(queue)} arm(s), {at_a_time} on each of {max(gpus, 1)} "
        f"{'GPU' if gpus else 'CPU slot'}(s){on}, run folders under {root}, records to {records}")
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
            if recorded:
                minutes, card, every_eval, sharing = recorded
                est = (f", ~{minutes:.1f} min on one {card}{f' shared by {sharing} arms' if sharing > 1 else ''} "
                       f"(its records' wall time"
                       f"{'' if every_eval else ', without the final evaluation where they did not measure it'})")
            else:
                est = ""
        how = (f"resumes its run in {root / arm.name} from its newest checkpoint" if action.what == "resume"
               else f"starts in {root / arm.name}")
        kept = (f"; rebuilt for the arms that read its run folder, its record in {records} kept"
                if action.keep_record else "")
        log(f"# {arm.name}: {action.epochs:g} epochs{est}; {how}{kept}")
        log(shlex.join(["python"] + cmd[1:]))


def recorded_minutes(arm: Arm, epochs: float, recs: dict) -> tuple[float, str, bool, int] | None:
    """The arm's minutes from start to record as its committed records measured them: the median of the records
    of its group (else of its preset at its stage) of their training's wall time scaled to ``epochs`` plus their
    final evaluation's; their card; whether every one of them measured its evaluation (records made before
    ``eval_wall_s`` count training alone); and how many arms shared a GPU in them: records of arms alone on
    their GPU where there are any (an arm sharing one takes longer), else the shared ones. None without such a
    record."""
    def alike(match):
        return [r for r in recs.values() if match(r) and r["train"].get("wall_s_last_process") and r["epochs"]]
    rows = (alike(lambda r: r["group"] == arm.group)
            or alike(lambda r: BY_NAME[r["arm"]].preset == arm.preset and BY_NAME[r["arm"]].stage == arm.stage))
    if not rows:
        return None
    rows = [r for r in rows if r["train"].get("arms_per_device", 1) == 1] or rows
    minutes = statistics.median(r["train"]["wall_s_last_process"] * epochs / r["epochs"]
                                + (r["train"].get("eval_wall_s") or 0) for r in rows) / 60
    return (minutes, statistics.mode(r["card"] for r in rows),
            all(r["train"].get("eval_wall_s") is not None for r in rows),
            max(r["train"].get("arms_per_device", 1) for r in rows))


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


def mps_running() -> bool:
    """Whether an MPS daemon serves this host's CUDA processes: its ``control`` endpoint (a socket, or a named
    pipe) where clients look for it."""
    control = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"), "control")
    return control.is_socket() or control.is_fifo()


def card_of(gpu: int | None) -> str:
    if gpu is None:
        import platform

        return f"cpu ({platform.processor() or platform.machine()})"
    import torch

    return torch.cuda.get_device_name(gpu)


def make_record(arm: Arm, run_dir: Path, *, epochs: float, command: str, card: str, commit: str,
                records: Path, arms_per_device: int = 1, gpu_sharing: str | None = None) -> dict:
    """The arm's record from its finished run directory; its PNGs copied to ``records/figs``.
    ``arms_per_device``: how many arms shared its device (its img/s is per arm); ``gpu_sharing``: how they
    shared a GPU ("mps" or "time-sliced"; None for one arm a device)."""
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
             "wall_s_last_process": summary.get("wall_s"), "eval_wall_s": summary.get("eval_wall_s"),
             "peak_mem_gib": summary.get("peak_mem_gib"),
             "arms_per_device": arms_per_device, "gpu_sharing": gpu_sharing, **final_epoch_means(history)}
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


def not_written(found: dict, out: Path, *, force: bool, status: dict, log, who: str, again: str):
    """``(name, path, out/<name>.json)`` of each ``found`` file whose JSON is not written yet (every one with
    ``force``); the others are logged as kept and marked so in ``status``."""
    for name, path in found.items():
        dest = Path(out) / f"{name}.json"
        if dest.exists() and not force:
            log(f"[{who}] {name}: {dest} exists; kept (--force {again})")
            status[name] = "kept"
            continue
        yield name, path, dest


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
        raise ValueError(f"--rescore: no features file of an arm in {folder} (features/<arm>.pt or <arm>/{FEATURES_FILE}; "
                         "a record's kept features are in git history: records/IN_HISTORY.md)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    status = {}
    for name, path, dest in not_written(found, out, force=force, status=status, log=log, who="repro",
                                        again="rescores"):
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
    when given (> 0), else its committed record's (a fresh host's records folder is empty)."""
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


def gpu_slots(gpus: int, jobs: int) -> list[int | None]:
    """The slots arms run in: ``jobs`` on each of ``gpus`` GPUs, the GPUs taken in turn, so that a queue shorter
    than the slots spreads over every GPU; ``jobs`` slots of None on the CPU (``gpus`` 0)."""
    return [g for _ in range(max(1, jobs)) for g in range(gpus)] if gpus > 0 else [None] * max(1, jobs)


def slot_devices(gpus: int, jobs: int) -> list[str | None]:
    """The CUDA_VISIBLE_DEVICES of each slot (:func:`gpu_slots`): slot g is this process's g-th visible GPU, so
    ``--gpus 2`` under CUDA_VISIBLE_DEVICES=2,3 runs on devices 2 and 3; None on the CPU."""
    visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if visible and gpus > len(visible):
        raise ValueError(f"--gpus {gpus}: CUDA_VISIBLE_DEVICES={','.join(visible)} shows {len(visible)}")
    return [None if g is None else visible[g] if visible else str(g) for g in gpu_slots(gpus, jobs)]


def sweep_command(run_dir: Path, records: Path) -> list[str] | None:
    """The probe sweep of a finished arm's full features into ``records``' ``probe_sweep/`` (experiments/README.md,
    "The probe sweep of claim A"), or None where the arm is not claim A's or kept no features."""
    from dres.eval.features import FEATURES_FILE
    from experiments.probe_sweep import SWEEP_FOLDER

    arm = BY_NAME.get(run_dir.name)
    if arm is None or arm.claim != "A" or not (run_dir / FEATURES_FILE).exists():
        return None
    return [sys.executable, "-m", "experiments.probe_sweep", str(run_dir), "--out", str(records / SWEEP_FOLDER)]


def run_arms(queue: list[tuple[Arm, float, bool]], *, gpus: int, jobs: int, root: Path, records: Path,
             presets: dict, extra: list[str], every: int, commit: str, force: bool, deadline_min: float,
             probe_sweep: bool = True, log=print) -> dict:
    """Train the ``(arm, epochs, named)`` of ``queue`` (:func:`select_epochs`) in order (needs first),
    ``jobs`` at a time on each of ``gpus`` GPUs (0: on the CPU), each starting on the first free slot
    (:func:`gpu_slots`);
    ``force`` reruns the named arms that have a record. ``probe_sweep``: a claim-A arm's slot then sweeps its
    probe on its full features (:func:`sweep_command`) before the slot takes the next arm, while the others train
    (on the host that has the features; a failed sweep is logged and leaves the arm done). Returns
    ``{arm: "done" | "skipped" | "failed" | "blocked" | "not started"}``."""
    from dres.records import write_json_atomic

    arms = [a for a, _, _ in queue]
    root, records = root.resolve(), records.resolve()
    actions = arm_actions(queue, root=root, records=records, force=force)
    (root / "logs").mkdir(parents=True, exist_ok=True)
    status = {a.name: "skipped" if actions[a.name].what == "skip" else "pending" for a in arms}
    slots, devices = gpu_slots(gpus, jobs), slot_devices(gpus, jobs)  # each child sees its slot's device only
    gpu_sharing = ("mps" if mps_running() else "time-sliced") if gpus > 0 and jobs > 1 else None
    free = list(range(len(slots)))
    running: dict[int, tuple] = {}
    t0 = time.time()

    def ready(a):
        return all(status.get(n) in ("done", "skipped") for n in a.needs)

    def slot_env(k):
        """The environment of slot ``k``'s processes: its device, and a share of the host's cores, as torchrun
        gives its workers (intra-op threads that spin between steps starved four graphed arms to 4% GPU use on a
        64-core host)."""
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // len(slots))))
        if devices[k] is not None:
            env["CUDA_VISIBLE_DEVICES"] = devices[k]
        return env

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
            env = slot_env(k)
            prefix = f"CUDA_VISIBLE_DEVICES={devices[k]} " if devices[k] is not None else ""
            logf = open(root / "logs" / f"{nxt.name}.log", "a")
            proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
            command = prefix + shlex.join(["python"] + cmd[1:])
            running[k] = (nxt, proc, logf, command)
            status[nxt.name] = "running"
            log(f"[repro] {actions[nxt.name].what} {nxt.name} on "
                f"{'GPU ' + devices[k] if devices[k] is not None else 'CPU'}: {command}")
        if not running:
            break
        time.sleep(1.0)
        for k, (a, proc, logf, command) in list(running.items()):
            if proc.poll() is None:
                continue
            logf.close()
            del running[k]
            if command is None:  # the arm's probe sweep ended
                free.append(k)
                log(f"[repro] swept {a.name}" if proc.returncode == 0 else
                    f"[repro] the probe sweep of {a.name} failed (exit {proc.returncode}); log "
                    f"{root / 'logs' / (a.name + '.sweep.log')}")
                continue
            if proc.returncode != 0:
                free.append(k)
                status[a.name] = "failed"
                tail = (root / "logs" / f"{a.name}.log").read_text().splitlines()[-5:]
                log(f"[repro] FAILED {a.name} (exit {proc.returncode}); log {root / 'logs' / (a.name + '.log')}:\n  "
                    + "\n  ".join(tail))
                continue
            status[a.name] = "done"
            if actions[a.name].keep_record:
                free.append(k)
                log(f"[repro] done {a.name} (rerun for the arms that read it; its earlier record is kept)")
                continue
            rec = make_record(a, root / a.name, epochs=actions[a.name].epochs, command=command,
                              card=card_of(slots[k]), commit=commit, records=records,
                              arms_per_device=max(1, jobs), gpu_sharing=gpu_sharing)
            write_json_atomic(records / f"{a.name}.json", rec)
            log(f"[repro] done {a.name}: {rec['metrics']}")
            sweep = sweep_command(root / a.name, records) if probe_sweep else None
            if sweep is None:
                free.append(k)
                continue
            logf = open(root / "logs" / f"{a.name}.sweep.log", "a")
            running[k] = (a, subprocess.Popen(sweep, stdout=logf, stderr=subprocess.STDOUT, env=slot_env(k),
                                              cwd=REPO_ROOT), logf, None)
            log(f"[repro] sweep {a.name}: {shlex.join(['python'] + sweep[1:])}")
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
