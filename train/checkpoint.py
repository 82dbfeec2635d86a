"""Atomic, exact-resume checkpoints.

A checkpoint holds everything a run needs to continue as if never stopped: model (incl. the
ResidualDroppath controller's parity, masks and generator, which live in its state dict), optimizer,
LR scheduler, GradScaler, EMA weights, every rank's RNG states (python, numpy, torch CPU and CUDA),
the data position and the step.

Atomicity: a checkpoint is first written under a temporary name (``.step_00000100.pt.tmp`` or the
directory ``.step_00000100.tmp``) and only then renamed to its final name with ``os.replace``
(atomic on POSIX). A process killed mid-save leaves at most a temporary file, which the finder
ignores, so ``--resume auto`` picks the newest *complete* checkpoint; a final file that still fails
to load (disk trouble) is skipped with a warning in favour of the one before it.

Formats: one ``torch.save`` file (single process and DDP: rank 0 writes) or a
``torch.distributed.checkpoint`` (DCP) directory (FSDP: every rank writes its shards).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from dres.train import distributed as D

_NAME = re.compile(r"^step_(\d{8})(\.pt)?$")


def rng_state(device: torch.device) -> dict:
    s = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        s["cuda"] = torch.cuda.get_rng_state(device)
    return s


def set_rng_state(s: dict, device: torch.device):
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    if device.type == "cuda" and "cuda" in s:
        torch.cuda.set_rng_state(s["cuda"], device)


def _gather(obj):
    if D.is_dist() and dist.get_world_size() > 1:
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def list_checkpoints(ckpt_dir) -> list[Path]:
    """Complete checkpoints in ``ckpt_dir``, oldest first (temporaries excluded)."""
    d = Path(ckpt_dir)
    if not d.exists():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def _is_fsdp(model) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _model_optim_state(model, optimizer, dcp_format: bool):
    m = D.unwrap(model)
    if dcp_format:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(m, optimizer)
        return msd, osd
    return m.state_dict(), optimizer.state_dict()


def save(ckpt_dir, step: int, model, optimizer, extra: dict, *, dcp_format: bool, keep: int = 2,
         device=torch.device("cpu"), ema=None, _fail_after_tmp=False) -> Path:
    """Write checkpoint ``step`` atomically; every rank must call it. ``extra`` holds picklable
    trainer state (scheduler, scaler, data position, config); RNG states are added here."""
    ckpt_dir = Path(ckpt_dir)
    main = not D.is_dist() or dist.get_rank() == 0
    if main:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    D.barrier()
    extra = dict(extra, step=step, rng=_gather(rng_state(device)))
    msd, osd = _model_optim_state(model, optimizer, dcp_format)
    if dcp_format:
        import torch.distributed.checkpoint as dcp

        tmp, final = ckpt_dir / f".step_{step:08d}.tmp", ckpt_dir / f"step_{step:08d}"
        if main and tmp.exists():
            shutil.rmtree(tmp)
        D.barrier()
        state = {"model": msd, "optim": osd}
        if ema is not None:
            state["ema"] = ema
        dcp.save(state, checkpoint_id=str(tmp))
        if main:
            torch.save(extra, tmp / "extra.pt")
            if _fail_after_tmp:
                raise RuntimeError("simulated crash during checkpoint write")
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        D.barrier()
    else:
        tmp, final = ckpt_dir / f".step_{step:08d}.pt.tmp", ckpt_dir / f"step_{step:08d}.pt"
        if main:
            payload = {"model": msd, "optim": osd, "ema": ema, **extra}
            with open(tmp, "wb") as f:
                torch.save(payload, f)
                if _fail_after_tmp:
                    raise RuntimeError("simulated crash during checkpoint write")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        D.barrier()
    if main and keep > 0:
        for old in list_checkpoints(ckpt_dir)[:-keep]:
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        for t in ckpt_dir.glob(".step_*tmp"):  # leftovers of killed saves
            if t.name not in (tmp.name,):
                shutil.rmtree(t, ignore_errors=True) if t.is_dir() else t.unlink(missing_ok=True)
    D.barrier()
    return final


def _load_one(path: Path, model, optimizer, ema, device):
    m = D.unwrap(model)
    if path.is_dir():
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        msd, osd = get_state_dict(m, optimizer) if optimizer is not None else (get_state_dict(m, [])[0], None)
        state = {"model": msd}
        if osd is not None:
            state["optim"] = osd
        if ema is not None:
            state["ema"] = ema
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(m, optimizer if optimizer is not None else [], model_state_dict=state["model"],
                       optim_state_dict=state.get("optim", {}))
        extra = torch.load(path / "extra.pt", map_location="cpu", weights_only=False)
        return extra
    payload = torch.load(path, map_location="cpu", weights_only=False)
    m.load_state_dict(payload.pop("model"))
    osd = payload.pop("optim")
    if optimizer is not None:
        optimizer.load_state_dict(osd)
    e = payload.pop("ema", None)
    if ema is not None and e is not None:
        for k, v in e.items():
            ema[k].copy_(v)
    return payload


def load(path_or_dir, model, optimizer=None, *, ema=None, device=torch.device("cpu"), restore_rng=True):
    """Load a checkpoint file/dir, or the newest loadable one in a directory. Returns the extra
    state (step, data position, scheduler, ...) or None when there is none."""
    p = Path(path_or_dir)
    candidates = [p] if _NAME.match(p.name) else list(reversed(list_checkpoints(p)))
    for c in candidates:
        try:
            extra = _load_one(c, model, optimizer, ema, device)
        except Exception as e:  # a damaged final file: fall back to the previous checkpoint
            if len(candidates) == 1:
                raise
            warnings.warn(f"checkpoint {c} is unreadable ({type(e).__name__}: {e}); trying an older one")
            continue
        rank = dist.get_rank() if D.is_dist() else 0
        if restore_rng:
            rng = extra["rng"]
            set_rng_state(rng[rank] if rank < len(rng) else rng[0], device)
        extra["path"] = str(c)
        return extra
    return None
