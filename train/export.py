"""``dres-export RUN --to timm|hf|safetensors [--out DIR] [--ckpt PATH]``: the model of a ``dres-train`` run
folder (its newest readable checkpoint, or ``ckpt``) written by :func:`dres.export.export_model` into one folder
(default ``<run>/export/<to>``). Reading a run folder is the trainer's side (its config, task and checkpoints);
the formats are ``dres.export``'s."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from dres.export import FORMATS, ExportError, export_model


def load_run(path, ckpt=None, *, device="cpu", task: Optional[str] = None):
    """``(model, cfg, run folder)``: the model of a run folder at its newest readable checkpoint (or ``ckpt``),
    in eval mode on ``device``. ``path`` may also be a checkpoint inside a run's ``checkpoints/``; ``task``,
    when given, is the task the run must have trained. Building the model leaves the caller's random state
    as it was."""
    from dres.train.checkpoint import read_run
    from dres.train.tasks import get_task

    return read_run(path, lambda cfg: get_task(cfg.task).build_model(cfg), ckpt, device=device, task=task)


def export_run(run, to: str, out=None, ckpt=None) -> Path:
    """:func:`dres.export.export_model` of :func:`load_run`'s model into ``out`` (default ``<run>/export/<to>``)."""
    model, _, run = load_run(run, ckpt)
    return export_model(model, to, Path(out) if out else run / "export" / to)


def main(argv=None) -> int:
    """One line naming the folder written; a user error is one line on stderr and exit status 2."""
    from dres.train.cli import _debug_flag, _user_errors

    p = argparse.ArgumentParser(prog="dres-export", description=__doc__.split("\n\n")[0])
    p.add_argument("run", metavar="RUN", help="a dres-train run folder (it holds config.yaml and checkpoints/)")
    p.add_argument("--to", required=True, choices=FORMATS, help="timm: config.json + pytorch_model.bin for "
                   "timm.create_model('local-dir:DIR'); hf: a save_pretrained folder; safetensors: model.safetensors")
    p.add_argument("--out", default=None, metavar="DIR", help="the folder to write (default RUN/export/<to>)")
    p.add_argument("--ckpt", default=None, metavar="PATH", help="export this checkpoint instead of the newest")
    _debug_flag(p)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        out = export_run(args.run, args.to, args.out, args.ckpt)
    except (ExportError,) + _user_errors() as e:
        if args.debug:
            raise
        sys.stderr.write(f"dres-export: error: {' '.join(str(e).split())}\n")
        return 2
    print(f"dres-export: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
