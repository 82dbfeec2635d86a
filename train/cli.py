"""Command line: ``dres-train {mae,uvit,classify} --preset NAME [--set key=value ...]`` and
``dres-eval RUN_DIR`` (or ``python -m dres.train.<task>``; under ``torchrun`` for several GPUs).

User errors (unknown preset or key, an impossible value, missing or corrupt data, a run directory
that holds another run, an unreadable or incompatible checkpoint, non-finite loss) end with one line
on stderr and exit status 2; ``--debug`` (or ``DRES_DEBUG=1``) shows the traceback instead.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

TASK_MODULES = {"mae": "dres.train.mae", "uvit": "dres.train.uvit", "classify": "dres.train.classify"}


def get_task(name):
    import importlib

    return importlib.import_module(TASK_MODULES[name]).TASK


def _parser(prog="dres-train"):
    from dres.train.config import list_presets

    p = argparse.ArgumentParser(prog=prog, description="Train MAE / U-ViT / ViT classifiers with decayed "
                                "shortcuts and ResidualDroppath.", epilog="presets: " + ", ".join(list_presets()))
    p.add_argument("task", choices=sorted(TASK_MODULES))
    p.add_argument("--preset", default=None, help="a preset name (train/presets/*.yaml) or a .yaml path")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set optim.blr=1e-3 --set data.path=/data/in1k/train")
    p.add_argument("--out", default=None, help="run directory (default runs/<task>_<preset>)")
    p.add_argument("--resume", default=None, help="'auto' (newest readable checkpoint in the run directory; none: "
                   "start fresh) or a checkpoint path; the config must match the one it was saved with")
    p.add_argument("--overwrite", action="store_true", help="start a fresh run in a non-empty run directory, "
                   "moving its old contents to <out>.old-<time> (nothing is deleted)")
    p.add_argument("--eval-only", action="store_true", help="evaluate the newest checkpoint (or --ckpt) and exit")
    p.add_argument("--ckpt", default=None, help="checkpoint file/directory for --eval-only")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    _debug_flag(p)
    return p


def _debug_flag(p):
    p.add_argument("--debug", action="store_true", default=os.environ.get("DRES_DEBUG", "") not in ("", "0"),
                   help="show tracebacks of user errors (also DRES_DEBUG=1)")


def _user_errors():
    from dres.data import DataError
    from dres.train.checkpoint import CheckpointError
    from dres.train.config import ConfigError
    from dres.train.loop import NonFiniteLoss
    from dres.train.rundir import RunDirError

    return (ConfigError, DataError, NonFiniteLoss, FileNotFoundError, CheckpointError, RunDirError)


def _run(args, overrides=()):
    import yaml

    from dres.train.config import ConfigError, build_config, list_presets, to_dict
    from dres.train.loop import run

    if not args.preset:
        raise ConfigError(f"no --preset given: one of {', '.join(list_presets())}, or a path to a .yaml file")
    cfg = build_config(args.task, args.preset, list(args.overrides) + list(overrides))
    if args.out:
        cfg.out = args.out
    if args.print_config:
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        return {}
    return run(cfg, get_task(cfg.task), resume=args.resume, eval_only=args.eval_only, ckpt=args.ckpt,
               overwrite=args.overwrite)


def _guarded(prog: str, fn, args) -> int:
    """Run ``fn(args)``; a user error becomes one line on stderr and exit status 2 (the traceback
    with ``args.debug``), and the process group (if any) is torn down either way."""
    try:
        fn(args)
    except _user_errors() as e:
        if args.debug:
            raise
        print(f"{prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    finally:
        from dres.train import distributed as D

        D.cleanup()
    return 0


def main(argv=None):
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    return _guarded("dres-train", _run, args)


def eval_main(argv=None):
    """``dres-eval RUN_DIR [--ckpt PATH] [--set eval.tsne=true ...]``: evaluate a finished run with
    its saved config; the results go to ``RUN_DIR/eval.json`` (the training summary.json is kept)."""
    p = argparse.ArgumentParser(prog="dres-eval", description="Evaluate a run directory's newest checkpoint.")
    p.add_argument("run_dir")
    p.add_argument("--ckpt", default=None)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    _debug_flag(p)
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    return _guarded("dres-eval", _evaluate, a)


def _evaluate(a) -> None:
    from dres.train.config import build_config, load_config, to_dict
    from dres.train.loop import run

    cfgf = Path(a.run_dir) / "config.yaml"
    if not cfgf.exists():
        raise FileNotFoundError(f"no config.yaml in {a.run_dir} (is it a dres run directory?)")
    base = to_dict(load_config(cfgf))
    cfg = build_config(None, None, a.overrides, base=base)
    cfg.out = a.run_dir
    run(cfg, get_task(cfg.task), eval_only=True, ckpt=a.ckpt)


if __name__ == "__main__":
    sys.exit(main())
