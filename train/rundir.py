"""Run-directory ownership: a run directory belongs to one run.

A training run records the fingerprint of its config (:func:`dres.train.config.fingerprint`: the
keys that decide model, optimizer and data shapes) in ``<out>/fingerprint.json`` beside
``config.yaml``. Before anything is written, :func:`claim` decides what may happen to ``<out>``:

* empty or missing: a fresh run;
* not empty, ``--resume`` given: continue it, but only when the recorded fingerprint matches the
  current config (else a one-line error naming the differing keys);
* not empty, ``--overwrite``: the old contents are moved aside to ``<out>.old-<time>`` (never deleted)
  and a fresh run starts;
* not empty, neither: a one-line error (a second run would mix its checkpoints and metrics with the
  first one's).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import yaml

from dres.train.config import fingerprint, fingerprint_diff

FINGERPRINT_FILE = "fingerprint.json"


class RunDirError(RuntimeError):
    """A one-line, user-facing problem with the run directory."""


def recorded_fingerprint(out: Path) -> dict | None:
    """The fingerprint a run directory records (older runs: derived from their config.yaml)."""
    f = out / FINGERPRINT_FILE
    try:
        if f.exists():
            return json.loads(f.read_text())
        if (out / "config.yaml").exists():
            return fingerprint(yaml.safe_load((out / "config.yaml").read_text()) or {})
    except (ValueError, yaml.YAMLError, OSError) as e:
        raise RunDirError(f"cannot read the run record in {out} ({type(e).__name__}: {e}); "
                          "move the directory aside with --overwrite or use another --out") from e
    return None


def write_fingerprint(out: Path, fp: dict) -> None:
    (out / FINGERPRINT_FILE).write_text(json.dumps(fp, indent=1, sort_keys=True))


def aside_name(out: Path) -> Path:
    base = f"{out}.old-{time.strftime('%Y%m%d-%H%M%S')}"
    dest, n = Path(base), 1
    while dest.exists():
        dest, n = Path(f"{base}-{n}"), n + 1
    return dest


def claim(out: Path, cfg, *, resume=None, overwrite=False, main=True, log=print) -> None:
    """Check (every rank) and prepare (main rank: the move aside) ``out`` for a training run."""
    if resume and overwrite:
        raise RunDirError("--resume and --overwrite exclude each other (continue the run, or move it aside)")
    if out.exists() and not out.is_dir():
        raise RunDirError(f"run directory {out} is a file")
    if not out.exists() or not any(out.iterdir()):
        return
    if overwrite:
        if main:
            dest = aside_name(out)
            os.rename(out, dest)
            log(f"[dres] moved the previous contents of {out} to {dest}")
        return
    if not resume:
        raise RunDirError(f"run directory {out} is not empty; continue its run with --resume auto, or start a new "
                          f"one with --overwrite (moves the old contents to {out}.old-<time>) or another --out")
    saved = recorded_fingerprint(out)
    diff = fingerprint_diff(saved, fingerprint(cfg)) if saved is not None else ""
    if diff:
        raise RunDirError(f"run directory {out} holds a run with another config ({diff}); resume it with its own "
                          f"config, or start a new run with --overwrite or another --out")
