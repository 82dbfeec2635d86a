"""Run-directory ownership: a run directory belongs to one run, and to one process at a time.

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

A folder that cannot hold a run is refused before anything is created or moved in it, whatever the flags
(:func:`check_run_directory`): a file; the current directory or one that holds it (moving it aside or
filling it would take the user's own files along); a non-empty folder that holds no dres run
(:func:`holds_a_run`). ``--out`` is normalised first (:func:`normal_path`), so ``a/../b`` creates no ``a``.

The run lock (:class:`RunLock`, ``<out>/run.lock``) is taken before that and held until the run
ends, by the main rank only: it is created with ``O_CREAT | O_EXCL``, which is atomic on local
file systems and on NFSv3+ and the other shared file systems that run folders of several machines
live on, so of two trainers started into one folder, on one machine or on two, exactly one gets it.
It names the holder's host, pid, process start time and boot, so that a lock left by a process that
died (``kill -9``, a lost node) is recognised on its own host and taken over with a one-line report;
a lock of another host cannot be checked from here, so it is reported with its holder and the
command that removes it.

Files the run writes for readers (``config.yaml``, ``summary.json``, ``eval.json``, checkpoints) are
replaced atomically (:func:`publish`), its logs (``starts.jsonl``, ``metrics.jsonl``) appended a line at a
time (:func:`append_line`); a full disk is :class:`DiskFull`, one line naming the path and the space it
needed, with a replacement's partial temporary removed.
"""

from __future__ import annotations

import errno
import json
import os
import dataclasses
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from dres.records import replace_atomic
from dres.train.config import TASKS, dotted_value, to_dict, without_retired_keys

FINGERPRINT_FILE = "fingerprint.json"
LOCK_FILE = "run.lock"

# Keys that decide the shapes of the model, optimizer state and data position: a checkpoint saved
# under other values cannot continue this run. lr, steps, seed and eval settings may change.
FINGERPRINT_KEYS = ("task", "batch_size", "data.img_size", "data.in_chans", "data.num_classes", "optim.name",
                    "optim.ema_decay")
# keys added to the fingerprint later: a record without one was made under this value
_FINGERPRINT_BEFORE = {"optim.name": "adamw", "model.drop_rate": 0.0, "model.gelu_approximate": "none"}
_MODEL_KEYS_NOT_IN_FINGERPRINT = ("backend",)  # an implementation choice, same parameters


def fingerprint(cfg) -> dict:
    """The flat ``{dotted key: value}`` of :data:`FINGERPRINT_KEYS` and the model's keys, from a
    :class:`Config` or its dict (a saved ``config.yaml``)."""
    d = to_dict(cfg) if dataclasses.is_dataclass(cfg) else without_retired_keys(cfg)
    fp = {k: dotted_value(d, k) for k in FINGERPRINT_KEYS}
    fp.update({f"model.{k}": v for k, v in sorted((d.get("model") or {}).items())
               if k not in _MODEL_KEYS_NOT_IN_FINGERPRINT})
    return fp


def fingerprint_diff(saved: dict, now: dict) -> str:
    """'' when equal, else one line naming each differing key with both values."""
    saved = {**saved, **{k: v for k, v in _FINGERPRINT_BEFORE.items() if saved.get(k) is None}}
    keys = sorted(set(saved) | set(now))
    return ", ".join(f"{k} {saved.get(k)!r} (saved) vs {now.get(k)!r} (now)" for k in keys if saved.get(k) != now.get(k))


class RunDirError(RuntimeError):
    """A one-line, user-facing problem with the run directory."""


class DiskFull(RunDirError):
    """A write failed for want of space (or quota); the partial file is already removed."""


def is_disk_full(e: BaseException) -> bool:
    """Whether ``e`` or an exception it was raised from is ENOSPC / EDQUOT (torch.save reports a
    failed write as a RuntimeError raised during the OSError), or, for torch.distributed.checkpoint's
    CheckpointException, any rank's failure ({rank: (exception, traceback)})."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict):
        return any(is_disk_full(f[0] if isinstance(f, tuple) else f) for f in failures.values())
    while isinstance(e, BaseException):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        e = e.__cause__ or e.__context__
    return False


def byte_size(n: float) -> str:
    """``n`` bytes in the unit that shows it: bytes, KiB, MiB or GiB (a metrics line is not "0.0 MiB")."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} bytes"


def disk_full(path: Path, needed: int, kept: str) -> DiskFull:
    """The one-line :class:`DiskFull` for a failed write of about ``needed`` bytes to ``path``."""
    try:
        free = byte_size(shutil.disk_usage(Path(path).parent).free) + " free"
    except OSError:
        free = "free space unknown"
    return DiskFull(f"no space left on the device of {path}: it needs about {byte_size(needed)} ({free}); {kept}")


# what a run stopped by a full disk does next (its folder holds config.yaml, so a fresh start would be refused)
FREE_SPACE_AND_RESUME = "free space, then continue with --resume auto"


def temporary(path: Path) -> Path:
    """Where :func:`publish` writes ``path`` before the rename: ``.<name>.tmp`` beside it."""
    return path.with_name(f".{path.name}.tmp")


def publish(path, write, needed: int | Callable[[], int] | None = None, kept: str | None = None) -> None:
    """Replace ``path`` as a whole by what ``write(tmp)`` writes to :func:`temporary`
    (:func:`dres.records.replace_atomic`). A full disk is :class:`DiskFull`, with the temporary removed: ``needed``
    is the bytes it takes where known (a function is called only then), ``kept`` what the message says is left
    (default: the previous file)."""
    path = Path(path)
    written = []  # the temporary's size once write returned or failed, for the message

    def write_measured(tmp):
        try:
            write(tmp)
        finally:
            written.append(tmp.stat().st_size if tmp.exists() else 0)

    try:
        replace_atomic(path, write_measured, temporary(path))
    except Exception as e:  # torch.save reports a failed write as a RuntimeError
        size = written[0] if written else 0
        if not is_disk_full(e):
            raise
        if kept is None:
            kept = f"the previous {path.name} is unchanged" if path.exists() else f"{path.name} was not written"
        raise disk_full(path, max((needed() if callable(needed) else needed) or 0, size), kept) from e


def append_line(path, text: str, kept: str) -> None:
    """Append ``text`` as one line to the log ``path``. A full disk is :class:`DiskFull` naming ``path``;
    ``kept``: what is left and what to do."""
    line = text + "\n"
    try:
        with open(path, "a") as f:
            f.write(line)
    except OSError as e:
        if not is_disk_full(e):
            raise
        raise disk_full(Path(path), len(line), kept) from e


def write_atomic(path, text: str) -> None:
    """:func:`publish` ``text``."""
    data = text.encode()

    def write(tmp):
        with open(tmp, "wb") as f:
            f.write(data)

    publish(path, write, len(data))


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
    write_atomic(out / FINGERPRINT_FILE, json.dumps(fp, indent=1, sort_keys=True))


def aside_name(out: Path) -> Path:
    base = f"{out}.old-{time.strftime('%Y%m%d-%H%M%S')}"
    dest, n = Path(base), 1
    while dest.exists():
        dest, n = Path(f"{base}-{n}"), n + 1
    return dest


def contents(out: Path) -> list[Path]:
    """What ``out`` holds besides the run lock."""
    return [p for p in out.iterdir() if p.name != LOCK_FILE] if out.is_dir() else []


def normal_path(out: str) -> str:
    """``out`` without ``.`` and ``..`` parts, worked out before anything is created (making ``a/../b``
    would leave an empty ``a``). A ``..`` goes up from what the path before it names on disk, a symbolic
    link's target included, as the kernel resolves it; a relative path stays relative."""
    parts = Path(out).parts
    if ".." not in parts:
        return os.path.normpath(out)
    after = len(parts) - parts[::-1].index("..")  # the parts after the last '..' stay as written
    path = os.path.join(os.path.realpath(os.path.join(*parts[:after])), *parts[after:])
    return os.path.normpath(path if os.path.isabs(out) else os.path.relpath(path))


def holds_the_working_directory(out: Path) -> bool:
    """Whether ``out`` is the current directory or one of the folders above it."""
    here, there = Path.cwd().resolve(), Path(out).resolve()
    return there == here or there in here.parents


def _names_a_task(record: dict | None) -> bool:
    return isinstance(record, dict) and record.get("task") in TASKS


def holds_a_run(out: Path) -> bool:
    """Whether ``out`` holds a dres run: the record a run writes as its training starts (``fingerprint.json``,
    or ``config.yaml`` of runs older than it), readable and naming a dres task, or the lock of a run
    (``run.lock`` with its holder's record: a start under way, or one that was killed)."""
    if read_record(out / LOCK_FILE).get("pid") is not None:
        return True
    for name, parse in ((FINGERPRINT_FILE, json.loads), ("config.yaml", yaml.safe_load)):
        try:
            if _names_a_task(parse((out / name).read_text())):
                return True
        except (OSError, ValueError, yaml.YAMLError):  # missing or damaged: not this record
            continue
    return False


def check_run_directory(out: Path) -> None:
    """Refuse (:class:`RunDirError`, one line) a run directory that cannot hold a run, before anything is
    created or moved in it: a file, the current directory or one above it, or a folder of files that holds
    no dres run (``--overwrite`` would move those files aside, ``--resume`` train among them)."""
    if out.exists() and not out.is_dir():
        raise RunDirError(f"run directory {out} is a file")
    if holds_the_working_directory(out):
        raise RunDirError(f"run directory {out} is the current directory or holds it; a run needs a folder of its "
                          "own: give --out a folder below this one (e.g. runs/NAME) or run from elsewhere")
    if contents(out) and not holds_a_run(out):
        raise RunDirError(f"run directory {out} holds files but no dres run (no {FINGERPRINT_FILE} or config.yaml "
                          "of one); nothing was moved: give --out a new or empty folder")


def claim(out: Path, cfg, *, resume=None, overwrite=False, log=print) -> None:
    """Check and prepare (the move aside) ``out`` for a training run; the trainer calls it on the main
    rank, holding the run lock (whose :meth:`RunLock.acquire` has refused, through
    :func:`check_run_directory`, folders that cannot hold a run), and shares the outcome with the other ranks."""
    if resume and overwrite:
        raise RunDirError("--resume and --overwrite exclude each other (continue the run, or move it aside)")
    if not contents(out):
        return
    if overwrite:  # entry by entry, so that the run lock this run holds stays in place
        dest = aside_name(out)
        dest.mkdir()
        for p in contents(out):
            os.rename(p, dest / p.name)
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


# ---------------------------------------------------------------------------------------------- lock
def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _process_start(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (Linux), or None where unknown:
    with the boot id it tells a live holder from a later process that reuses its pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22, counted after the command name


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def _holder_record() -> dict:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "process_start": _process_start(pid), "boot_id": _boot_id(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %z")}


def _describe(h: dict) -> str:
    return f"process {h.get('pid')} on {h.get('host')} (since {h.get('started')})"


def _stale(h: dict) -> bool:
    """Whether the holder recorded in ``h`` is certainly gone: only decidable on its own host."""
    if h.get("host") != socket.gethostname():
        return False
    if h.get("boot_id") and _boot_id() and h["boot_id"] != _boot_id():
        return True  # the machine rebooted since
    pid = h.get("pid")
    if not isinstance(pid, int) or not _alive(pid):
        return True
    start = _process_start(pid)
    return bool(h.get("process_start")) and start is not None and start != h["process_start"]


def read_record(p: Path) -> dict:
    """A lock file's holder record; {} when it is missing, empty or torn (a holder killed while writing it)."""
    try:
        h = json.loads(p.read_text() or "{}")
    except (ValueError, OSError):
        return {}
    return h if isinstance(h, dict) else {}


class RunLock:
    """``<out>/run.lock``, held by this process from :meth:`acquire` to :meth:`release`."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.path = self.out / LOCK_FILE
        self.record: dict | None = None

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.record, f)
        except OSError:
            self.path.unlink(missing_ok=True)  # an empty lock would stall the next start for a while
            raise
        return True

    def _read(self) -> dict:
        return read_record(self.path)

    def acquire(self, log=print) -> RunLock:
        """Take the lock (``out`` is created if missing); :class:`RunDirError` while another live process
        holds it, or where ``out`` cannot hold a run (:func:`check_run_directory`: nothing is created there).
        A lock whose holder is gone is taken over, saying whose it was."""
        check_run_directory(self.out)
        self.record = _holder_record()
        for _ in range(3):  # a holder may release between our look and our try
            try:
                self.out.mkdir(parents=True, exist_ok=True)
                if self._create():
                    return self
            except OSError as e:  # a read-only or full file system, a missing permission
                raise RunDirError(f"cannot create the run lock {self.path} ({e.strerror or e})") from e
            holder = self._read()
            if not holder and self.path.exists() and time.time() - self.path.stat().st_mtime < 10:
                time.sleep(0.5)  # a holder that is writing its record just now
                holder = self._read()
            if holder and not _stale(holder):
                where = "" if holder.get("host") == socket.gethostname() else (
                    f"; that host's processes cannot be checked from {socket.gethostname()}: if the run there is "
                    f"gone, delete {self.path}")
                raise RunDirError(f"run directory {self.out} is in use by {_describe(holder)} (lock {self.path}); "
                                  f"wait for it to end, or use another --out{where}")
            if self._take_over(holder):
                log(f"[dres] took over the run lock of {_describe(holder) if holder else 'an unknown process'}, "
                    f"which is no longer running (it ended without releasing {self.path})")
                return self
        raise RunDirError(f"could not take the run lock {self.path}: other processes keep taking it")

    def _take_over(self, stale: dict) -> bool:
        """Replace a stale lock: renamed away first (atomic), kept only if it is still the one judged stale."""
        grabbed = self.path.with_name(f".{LOCK_FILE}.stale-{os.getpid()}")
        try:
            os.replace(self.path, grabbed)
        except FileNotFoundError:
            return self._create()
        if read_record(grabbed) != stale:  # another process took the stale lock over in between: its lock
            try:
                os.link(grabbed, self.path)  # back, unless a third process holds the name now
            except FileExistsError:
                pass
            grabbed.unlink(missing_ok=True)
            return False
        grabbed.unlink(missing_ok=True)
        return self._create()

    def release(self) -> None:
        """Remove the lock if it is still this process's."""
        if self.record is not None and self._read() == self.record:
            self.path.unlink(missing_ok=True)
        self.record = None


def first_missing(path: Path) -> Path | None:
    """The outermost directory of ``path`` (itself included) that does not exist yet, or None."""
    path = Path(path).absolute()
    missing = None
    while not path.exists():
        missing, path = path, path.parent
    return missing


def remove_created(out: Path, top: Path | None) -> None:
    """Remove ``out`` and its parents up to ``top`` (as :func:`first_missing` gave it before the run made
    them) where they are empty: a start that was refused leaves nothing behind."""
    if top is None:
        return
    p = Path(out).absolute()
    while True:
        try:
            p.rmdir()
        except OSError:
            return
        if p == top:
            return
        p = p.parent


def empty(out: Path) -> None:
    """Remove what ``out`` holds besides the run lock: a start stopped before it saved or logged a step, in a
    folder that was empty when it claimed it (so all of it is that start's own record)."""
    for p in contents(out):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def superseded_name(name: str) -> str:
    """Where the records cut from log ``name`` on a resume go: ``metrics.jsonl`` -> ``metrics.superseded.jsonl``."""
    stem, _, ext = name.rpartition(".")
    return f"{stem}.superseded.{ext}"


def cut_records(path: Path, step: int) -> tuple[list[dict], int]:
    """Keep the records of the JSON-lines log ``path`` up to ``step`` (a resume goes on from there), in
    order; the others (later steps of the run that was interrupted, a line torn by a kill) are appended to
    :func:`superseded_name`, never deleted. Returns (the records kept, how many lines were moved)."""
    path = Path(path)
    if not path.exists():
        return [], 0
    kept, kept_lines, cut = [], [], []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= step:
            kept.append(rec)
            kept_lines.append(line)
        else:
            cut.append(line)
    if cut:
        with open(path.with_name(superseded_name(path.name)), "a") as f:
            f.write("".join(line + "\n" for line in cut))
        write_atomic(path, "".join(line + "\n" for line in kept_lines))
    return kept, len(cut)


START_FILE = "starts.jsonl"


def git_state(repo: Path) -> dict:
    """The commit of the git checkout ``repo`` and whether tracked files differ from it; None where it is
    no checkout (an installed wheel) or git is missing."""
    def git(*args):
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return {"git_commit": None}
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return {"git_commit": head.stdout.strip(), "git_dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": None}


def describe_device(device) -> str:
    import torch

    if device.type == "cuda":
        return f"{device} {torch.cuda.get_device_name(device)}"
    return f"{device} ({torch.get_num_threads()} threads)"


def record_start(out: Path, device, world: int, step: int) -> dict:
    """Append to ``<out>/starts.jsonl`` what made this start of the run (a fresh one or a resume): the
    resolved run directory, command, host, device, process count, the step it starts from, and the
    versions of Python, dres, torch, triton and CUDA with dres' git commit when dres runs from a checkout."""
    import platform

    import torch

    import dres

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    rec = {"started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "from_step": step, "out": str(Path(out).resolve()),
           "command": sys.argv, "host": socket.gethostname(), "device": describe_device(device), "world": world,
           "python": platform.python_version(), "dres": dres.__version__, "torch": torch.__version__,
           "triton": triton_version, "cuda": torch.version.cuda,
           **git_state(Path(dres.__file__).resolve().parent.parent)}
    append_line(Path(out) / START_FILE, json.dumps(rec), FREE_SPACE_AND_RESUME)
    return rec
