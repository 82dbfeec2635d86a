"""Files written whole: :func:`replace_atomic`, the one way the project replaces a file (checkpoints, run records,
``dres-prep``'s shards, the JSON records that benchmarks and experiments keep in ``records/``), here so that every
layer can use it without importing another."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable


def remove_partial(tmp: Path) -> None:
    """Remove what a cut-short write left at ``tmp`` (a file or a directory), if anything."""
    if tmp.is_dir():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.unlink(missing_ok=True)


def replace_atomic(path, write: Callable[[Path], object], tmp) -> None:
    """Replace ``path`` as a whole by what ``write(tmp)`` writes to the temporary ``tmp`` beside it (a file, synced,
    or a directory), then renamed, so that a reader, or a run killed at its time limit, sees the old one or the new
    one, never a part; a write that fails leaves no temporary."""
    path, tmp = Path(path), Path(tmp)
    try:
        write(tmp)
        if tmp.is_dir():
            if path.exists():  # os.replace cannot replace a directory that holds files
                shutil.rmtree(path)
        else:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except Exception:
        remove_partial(tmp)
        raise


def write_json_atomic(path: Path, obj) -> None:
    """``obj`` as indented JSON, written through :func:`replace_atomic` (a temporary of this process's own, so that
    processes writing one record do not share it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1, sort_keys=False)
            f.write("\n")

    replace_atomic(path, write, path.with_name(f"{path.name}.{os.getpid()}.tmp"))
