"""Atomic, exact-resume checkpoints.

A checkpoint holds everything a run needs to continue as if never stopped: model (incl. the
ResidualDroppath controller's parity, masks and generator, which live in its state dict), optimizer,
LR scheduler, GradScaler, EMA weights, every rank's RNG states (python, numpy, torch CPU and CUDA),
every rank's data state (the position and what the rank counted of lost data) and the step.

Atomicity: a checkpoint is first written under a temporary name (``.step_00000100.pt.tmp`` or the
directory ``.step_00000100.tmp``) and only then renamed to its final name with ``os.replace``
(atomic on POSIX). A process killed mid-save leaves at most a temporary file, which the finder
ignores, so ``--resume auto`` picks the newest *complete* checkpoint; a final file that still fails
to load (disk trouble) is skipped with a warning in favour of the one before it.

Formats: one ``torch.save`` file (single process and DDP: rank 0 writes) or a
``torch.distributed.checkpoint`` (DCP) directory (FSDP: every rank writes its shards).

Safety: every file is read with ``torch.load(weights_only=True)``, which unpickles only tensors and
plain containers/primitives, so a crafted ``.pt`` cannot run code; everything saved here is such
plain state (the numpy RNG state is stored as a tensor for that reason). A DCP directory's
``.metadata`` is read by torch's own DCP reader: load DCP checkpoints only from directories you trust.

Errors: a file that cannot be read is *unreadable* (:class:`UnreadableCheckpoint`: corrupt,
truncated, or not plain state); one that reads but was saved for another configuration (its
fingerprint, :func:`dres.train.rundir.fingerprint`, differs, or its tensors do not fit the model) is
*incompatible* (:class:`IncompatibleCheckpoint`). Both are one-line messages.

Rotation keeps the newest ``keep`` checkpoints up to the step just written; it never deletes the
checkpoint just written nor one of a later step. A resume continues one line of checkpoints: those
of later steps than the one resumed (unreadable ones it skipped, or a branch abandoned by resuming an
older one) are moved aside into ``superseded-<time>/`` (:func:`set_aside_after`), never deleted, so
rotation and the next ``--resume auto`` see only the run that goes on.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from dres.records import remove_partial
from dres.train import distributed
from dres.train import rundir
from dres.train.rundir import fingerprint_diff
from dres.train.stop import raise_if_stopped

_NAME = re.compile(r"^step_(\d{8})(\.pt)?$")


class CheckpointError(RuntimeError):
    """A one-line, user-facing checkpoint problem."""


class UnreadableCheckpoint(CheckpointError):
    """The file is corrupt, truncated, or holds more than plain state."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason


class IncompatibleCheckpoint(CheckpointError):
    """The file reads, but was saved for another configuration."""


def rng_state(device: torch.device) -> dict:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    s = {"python": random.getstate(), "torch": torch.get_rng_state(),
         "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                   "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)}}
    if device.type == "cuda":
        s["cuda"] = torch.cuda.get_rng_state(device)
    return s


def set_rng_state(s: dict, device: torch.device):
    random.setstate(s["python"])
    n = s["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(s["torch"])
    if device.type == "cuda" and "cuda" in s:
        torch.cuda.set_rng_state(s["cuda"], device)


def gather_ranks(obj) -> list:
    """``obj`` of every rank, in rank order (this rank's alone without a process group)."""
    if distributed.is_dist() and dist.get_world_size() > 1:
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def of_rank(entries, rank: int):
    """This rank's entry of a per-rank list a checkpoint holds (``rng``, ``data``): rank 0's where the checkpoint
    was saved by fewer ranks, and the entry itself where a checkpoint of older releases holds one for all ranks."""
    if not isinstance(entries, list):
        return entries
    return entries[rank] if rank < len(entries) else entries[0]


def step_of(path) -> int:
    return int(_NAME.match(Path(path).name).group(1))


def list_checkpoints(ckpt_dir) -> list[Path]:
    """Complete checkpoints in ``ckpt_dir``, oldest first (temporaries excluded)."""
    d = Path(ckpt_dir)
    if not d.exists():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def _model_optim_state(model, optimizer, dcp_format: bool):
    m = distributed.unwrap(model)
    if dcp_format:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(m, optimizer)
        return msd, osd
    return m.state_dict(), optimizer.state_dict()


def _state_bytes(obj) -> int:
    """Bytes of the tensors in ``obj`` (this rank's shards of DTensors): about what saving it writes."""
    if isinstance(obj, torch.Tensor):
        t = obj.to_local() if hasattr(obj, "to_local") else obj
        return t.numel() * t.element_size()
    if isinstance(obj, dict):
        return sum(_state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_state_bytes(v) for v in obj)
    return 0


def _torch_save(obj, path: Path) -> None:
    with open(path, "wb") as f:  # to a path, torch.save reports a full disk without its errno
        torch.save(obj, f)


def save(ckpt_dir, step: int, model, optimizer, extra: dict, *, dcp_format: bool, keep: int = 2,
         device=torch.device("cpu"), ema=None) -> Path:
    """Write checkpoint ``step`` atomically; every rank must call it. ``extra`` holds plain trainer
    state (scheduler, scaler, this rank's data state, config, fingerprint); the data states of all ranks are
    gathered and RNG states added here, one per rank (:func:`of_rank` reads them back). A full
    disk is :class:`~dres.train.rundir.DiskFull` on every rank, with the partial write removed and the
    previous checkpoints untouched."""
    ckpt_dir = Path(ckpt_dir)
    main = not distributed.is_dist() or dist.get_rank() == 0
    if main:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    distributed.barrier()
    extra = dict(extra, step=step, rng=gather_ranks(rng_state(device)), data=gather_ranks(extra.get("data")))
    msd, osd = _model_optim_state(model, optimizer, dcp_format)
    if dcp_format:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        final = ckpt_dir / f"step_{step:08d}"
        tmp = rundir.temporary(final)
        if main and tmp.exists():
            shutil.rmtree(tmp)
        distributed.barrier()
        state = {"model": msd, "optim": osd}
        if ema is not None:
            state["ema"] = ema
        world = dist.get_world_size() if distributed.is_dist() else 1
        try:
            dcp.save(state, checkpoint_id=str(tmp))
        except (Exception, CheckpointException) as e:  # a BaseException, the same on every rank
            if not rundir.is_disk_full(e):
                raise
            if main:
                remove_partial(tmp)
            raise rundir.disk_full(final, _state_bytes(state) * world, _kept_on_full_disk(ckpt_dir, final)) from e
        distributed.on_main(lambda: rundir.publish(final, lambda t: _torch_save(extra, t / "extra.pt"),
                                                   lambda: _state_bytes(state) * world,
                                                   _kept_on_full_disk(ckpt_dir, final)), main)
    else:
        final = ckpt_dir / f"step_{step:08d}.pt"
        tmp = rundir.temporary(final)
        payload = {"model": msd, "optim": osd, "ema": ema, **extra}
        distributed.on_main(lambda: rundir.publish(final, lambda t: _torch_save(payload, t),
                                                   lambda: _state_bytes(payload),
                                                   _kept_on_full_disk(ckpt_dir, final)), main)
    if main and keep > 0:
        older = [c for c in list_checkpoints(ckpt_dir) if step_of(c) < step]
        for old in older[:max(len(older) - (keep - 1), 0)]:
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        for t in ckpt_dir.glob(".step_*tmp"):  # leftovers of killed saves
            if t.name not in (tmp.name,):
                shutil.rmtree(t, ignore_errors=True) if t.is_dir() else t.unlink(missing_ok=True)
    distributed.barrier()
    return final


def _kept_on_full_disk(ckpt_dir: Path, final: Path) -> str:
    """What the :class:`~dres.train.rundir.DiskFull` of a failed save of ``final`` says is left."""
    previous = [c for c in list_checkpoints(ckpt_dir) if c != final]
    kept = f"the previous checkpoint {previous[-1]} is intact" if previous else "no earlier checkpoint exists"
    return f"removed the partial {rundir.temporary(final).name}; {kept}; {rundir.FREE_SPACE_AND_RESUME}"


def _first_line(e: BaseException) -> str:
    """The informative line of an exception (torch's weights_only refusal is a paragraph)."""
    lines = [l.strip() for l in str(e).splitlines() if l.strip()]
    for l in lines:
        if "WeightsUnpickler error:" in l:
            why = l.split("error:", 1)[1].split(". Please use")[0].strip()
            return f"refused to unpickle it, as it holds more than plain tensors and containers: {why}"
    head = " ".join(lines[:2]) if len(lines) > 1 and lines[0].endswith(":") else (lines[0] if lines else "")
    return f"{type(e).__name__}: {head.split('. ')[0]}"


def _unreadable(path, reason: str) -> UnreadableCheckpoint:
    return UnreadableCheckpoint(f"checkpoint {path} is unreadable ({reason})", reason)


def read_file(path) -> dict:
    """``torch.load(path, weights_only=True)`` onto the CPU; any failure is an
    :class:`UnreadableCheckpoint` naming the file."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # damaged bytes surface as many exception types; all mean "unreadable"
        raise_if_stopped(e)  # a signal during the read: the stop, not a damaged file
        raise _unreadable(path, _first_line(e)) from e
    if not isinstance(obj, dict):
        raise _unreadable(path, f"holds a {type(obj).__name__}, not a dict")
    return obj


def _check_fingerprint(path, extra: dict, fingerprint):
    if fingerprint is None:
        return
    saved = extra.get("fingerprint")
    if saved is None and isinstance(extra.get("config"), dict):
        from dres.train.rundir import fingerprint as fingerprint_of

        saved = fingerprint_of(extra["config"])
    diff = fingerprint_diff(saved, fingerprint) if saved is not None else ""
    if diff:
        raise IncompatibleCheckpoint(f"checkpoint {path} was saved with another config: {diff}")


def _apply(path, fn, *args):
    """Run a ``load_state_dict``; a mismatch is an :class:`IncompatibleCheckpoint`."""
    try:
        fn(*args)
    except (RuntimeError, KeyError, ValueError) as e:
        raise_if_stopped(e)
        raise IncompatibleCheckpoint(f"checkpoint {path} does not fit this model/optimizer ({_first_line(e)})") from e


def _load_one(path: Path, model, optimizer, ema, fingerprint):
    m = distributed.unwrap(model)
    if path.is_dir():
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        extra = read_file(path / "extra.pt")
        _check_fingerprint(path, extra, fingerprint)
        msd, osd = get_state_dict(m, optimizer) if optimizer is not None else (get_state_dict(m, [])[0], None)
        state = {"model": msd}
        if osd is not None:
            state["optim"] = osd
        if ema is not None:
            state["ema"] = ema
        try:
            dcp.load(state, checkpoint_id=str(path))
        except Exception as e:  # DCP raises its own CheckpointException for missing/bad shards
            raise_if_stopped(e)
            raise _unreadable(path, _first_line(e)) from e
        _apply(path, lambda: set_state_dict(m, optimizer if optimizer is not None else [],
                                            model_state_dict=state["model"], optim_state_dict=state.get("optim", {})))
        return extra
    payload = read_file(path)
    _check_fingerprint(path, payload, fingerprint)
    if "model" not in payload:
        raise _unreadable(path, "no 'model' entry: not a dres checkpoint")
    _apply(path, m.load_state_dict, payload.pop("model"))
    osd = payload.pop("optim", None)
    if optimizer is not None:
        _apply(path, optimizer.load_state_dict, osd)
    e = payload.pop("ema", None)
    if ema is not None and e is not None:
        _apply(path, lambda: [ema[k].copy_(v) for k, v in e.items()])
    return payload


def load(path_or_dir, model, optimizer=None, *, ema=None, device=torch.device("cpu"), restore_rng=True,
         fingerprint=None, log=print):
    """Load a checkpoint file/dir, or the newest loadable one in a directory. Returns the extra
    state (step, this rank's data state, scheduler, ...), or None when the directory holds no checkpoint.

    ``fingerprint`` (of the current config) is compared with the saved one first. In a directory an
    unreadable checkpoint is skipped, saying so through ``log``, in favour of the one before it; when none is
    readable, or the one asked for is not, :class:`UnreadableCheckpoint`; an incompatible one is
    :class:`IncompatibleCheckpoint` at once (older ones of the same run would not fit either)."""
    p = Path(path_or_dir)
    single = p.is_file() or bool(_NAME.match(p.name))
    candidates = [p] if single else list(reversed(list_checkpoints(p)))
    failures = []
    for c in candidates:
        try:
            extra = _load_one(c, model, optimizer, ema, fingerprint)
        except UnreadableCheckpoint as e:
            if single:
                raise
            log(f"[dres] {e}; trying an older one")
            failures.append(f"{c.name} ({e.reason})")
            continue
        rank = dist.get_rank() if distributed.is_dist() else 0
        if restore_rng:
            set_rng_state(of_rank(extra["rng"], rank), device)
        extra["data"] = of_rank(extra.get("data"), rank)
        extra["path"] = str(c)
        return extra
    if failures:
        raise UnreadableCheckpoint(f"no readable checkpoint in {p}: " + "; ".join(failures))
    return None


def set_aside_after(ckpt_dir, step: int) -> Path | None:
    """Move the checkpoints of ``ckpt_dir`` with a step after ``step`` into ``superseded-<time>/``
    (main rank; every rank calls it). Returns that folder, or None when there were none."""
    ckpt_dir = Path(ckpt_dir)
    later = [c for c in list_checkpoints(ckpt_dir) if step_of(c) > step]
    aside = ckpt_dir / time.strftime("superseded-%Y%m%d-%H%M%S") if later else None
    if later and (not distributed.is_dist() or dist.get_rank() == 0):
        aside.mkdir(exist_ok=True)
        for c in later:
            os.replace(c, aside / c.name)
    distributed.barrier()
    return aside


def read_run(path, build_model, ckpt=None, *, device="cpu", task: str | None = None):
    """``(model, cfg, run folder)``: the model ``build_model(cfg)`` of a run folder at its newest readable checkpoint
    (or ``ckpt``), in eval mode on ``device``. ``path`` may also be a checkpoint inside a run's ``checkpoints/``;
    ``task``, when given, is the task the run must have trained. Building the model leaves the caller's random
    state as it was."""
    from dres.train.config import ConfigError, load_config
    from dres.train.rundir import fingerprint

    p = Path(path)
    run = p if (p / "config.yaml").exists() else p.parent.parent
    if not (run / "config.yaml").exists():
        raise FileNotFoundError(f"{path} is neither a dres run folder nor a checkpoint inside one (no config.yaml)")
    cfg = load_config(run / "config.yaml")
    if task is not None and cfg.task != task:
        raise ConfigError(f"{run} holds a '{cfg.task}' run, not a {task} run")
    with torch.random.fork_rng(devices=[]):
        model = build_model(cfg)
    source = Path(ckpt) if ckpt else (run / "checkpoints" if p == run else p)
    extra = load(source, model, device=torch.device(device), restore_rng=False, fingerprint=fingerprint(cfg))
    if extra is None:
        raise FileNotFoundError(f"no checkpoint in {source}")
    return model.to(device).eval(), cfg, run
