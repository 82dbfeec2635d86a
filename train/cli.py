"""Command line: ``dres-train {mae,uvit,classify} --preset NAME [--set key=value ...]`` and
``dres-eval RUN_DIR`` (or ``python -m dres.train.<task>``; under ``torchrun`` for several GPUs).

User errors (unknown preset or key, an impossible value, missing or corrupt data, a run directory
that holds another run, an unreadable or incompatible checkpoint, non-finite loss, an optional
dependency not installed) end with one line on stderr and exit status 2; a rank lost under several
processes with one line and status 1 (the survivors'); ``--debug`` (or ``DRES_DEBUG=1``) shows the
traceback instead.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from dres.train import stop
from dres.train.tasks import config_for, get_task


def _common_arguments(p):
    p.add_argument("--preset", default=None, metavar="NAME", help="a preset name (listed below) or a path to a .yaml file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (listed below), e.g. --set optim.blr=1e-3 --set data.path=/data/in1k/train")
    p.add_argument("--out", default=None, metavar="DIR", help="run directory (default runs/<task>_<preset>)")
    p.add_argument("--resume", default=None, metavar="auto|PATH", help="'auto' (newest readable checkpoint in the run directory; none: "
                   "start fresh) or a checkpoint path; the config must match the one it was saved with")
    p.add_argument("--overwrite", action="store_true", help="start a fresh run in a non-empty run directory, "
                   "moving its old contents to <out>.old-<time> (nothing is deleted)")
    p.add_argument("--eval-only", action="store_true", help="evaluate the newest checkpoint (or --ckpt) and exit")
    p.add_argument("--ckpt", default=None, metavar="PATH", help="checkpoint file/directory for --eval-only")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    _allow_pipe_flag(p, "the preset file")
    _debug_flag(p)


def _version_flag(p):
    import dres

    p.add_argument("--version", action="version", version=f"%(prog)s {dres.__version__}")


class _HelpWithKeys(argparse.Action):
    """-h/--help whose listing of presets and config keys is built only when asked for."""

    def __init__(self, option_strings, dest, epilog, **kw):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="show this help and exit", **kw)
        self.epilog = epilog

    def __call__(self, parser, namespace, values, option_string=None):
        parser.epilog = self.epilog()
        parser.print_help()
        parser.exit()


def _table(rows, width: int = 100) -> str:
    """``(head, text)`` rows as an indented two-column listing, the text wrapped beside its head."""
    import textwrap

    lines = []
    for head, text in rows:
        head = f"  {head}"
        pad = 34 if len(head) < 33 else len(head) + 1
        body = textwrap.wrap(text, width - pad) or [""]
        lines.append((head.ljust(pad) + body[0]).rstrip())
        lines.extend(" " * pad + b for b in body[1:])
    return "\n".join(lines)


def _yaml_value(v) -> str:
    """A default as --set takes it (true/false, null, [0.9, 0.95])."""
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def _keys_text(keys: list, docs: dict) -> str:
    return _table((f"{key}={_yaml_value(docs[key][0])}", docs[key][1]) for key in keys)


def _task_epilog(task: str) -> str:
    from dres.train.config import key_docs, preset_summaries
    from dres.train.tasks import model_keys

    docs, spec = key_docs(), get_task(task)
    models = model_keys(spec) | set(spec.model_choice_keys)
    keys = [k for k in docs if k not in ("task", "preset", "out")
            and not (k.startswith("model.") and k[6:] not in models)
            and not (k.startswith("eval.") and k[5:] not in spec.eval_keys)]
    presets = _table(preset_summaries(task).items())
    return (f"presets of {task} (--preset NAME; `--print-config` shows one resolved):\n{presets}\n\n"
            f"config keys of {task} (--set KEY=VALUE; shown with their defaults, which a preset may change):\n"
            f"{_keys_text(keys, docs)}")


def _parser(prog="dres-train"):
    from dres.train.config import TASKS, list_presets

    p = argparse.ArgumentParser(
        prog=prog, description="Train MAE / U-ViT / ViT classifiers with decayed shortcuts and ResidualDroppath.",
        epilog=f"presets: {', '.join(list_presets())}. `{prog} TASK --help` lists a task's presets and config keys; "
               "`dres-eval --help` describes evaluation.")
    _version_flag(p)
    tasks = p.add_subparsers(dest="task", metavar="TASK", required=True)
    for name in sorted(TASKS):
        doc = _task_doc(name)
        sp = tasks.add_parser(name, help=doc.split("\n\n")[0].replace("\n", " "), description=doc, add_help=False,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
        sp.add_argument("-h", "--help", action=_HelpWithKeys, epilog=lambda name=name: _task_epilog(name))
        _common_arguments(sp)
    return p


def _task_doc(name: str) -> str:
    """The first paragraph and the examples of the task module's docstring, read without importing it."""
    import ast
    import importlib.util

    origin = importlib.util.find_spec(f"dres.train.{name}").origin  # a task's module is named after it
    with open(origin) as f:
        return (ast.get_docstring(ast.parse(f.read())) or name).strip()


def _allow_pipe_flag(p, origin: str):
    p.add_argument("--allow-pipe", action="store_true",
                   help=f"run a pipe:CMD data source (data.path, data.val_path) read from {origin}; without it only "
                        "one given with --set on this command line runs")


def _debug_flag(p):
    p.add_argument("--debug", action="store_true", default=os.environ.get("DRES_DEBUG", "") not in ("", "0"),
                   help="show tracebacks of user errors (also DRES_DEBUG=1)")


def _user_errors():
    from dres.data import DataError
    from dres.optional import MissingExtra
    from dres.train.checkpoint import CheckpointError
    from dres.train.config import ConfigError
    from dres.train.step import NonFiniteLoss
    from dres.train.rundir import RunDirError

    return (ConfigError, DataError, NonFiniteLoss, FileNotFoundError, CheckpointError, RunDirError, MissingExtra)


def _run(args, overrides=()):
    import yaml

    from dres.train.config import ConfigError, check_commands, list_presets, to_dict, typed_values
    from dres.train.driver import run
    from dres.train.rundir import normal_path

    if not args.preset:
        raise ConfigError(f"no --preset given: one of {', '.join(list_presets())}, or a path to a .yaml file")
    cfg = config_for(args.task, args.preset, list(args.overrides) + list(overrides))
    if args.out:
        cfg.out = args.out
    if cfg.out:
        cfg.out = normal_path(cfg.out)
    if args.print_config:
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        return {}
    check_commands(cfg, typed_values(args.overrides), args.allow_pipe, f"the preset {args.preset}")
    with _lost_rank_in_one_line(cfg, "continue with --resume auto once every rank can start"):
        return run(cfg, get_task(cfg.task), resume=args.resume, eval_only=args.eval_only, ckpt=args.ckpt,
                   overwrite=args.overwrite)


@contextlib.contextmanager
def _lost_rank_in_one_line(cfg, then: str):
    """A collective that failed because another rank was lost becomes :class:`~dres.train.distributed.LostRank`,
    naming the rank, the newest checkpoint of the run directory (``cfg.out``, as the trainer resolved it) and
    ``then``, what to do once the ranks can run again."""
    from dres.train import checkpoint, distributed

    try:
        yield
    except Exception as e:
        lost = distributed.lost_rank(e)
        if lost is None:
            raise
        saved = checkpoint.list_checkpoints(Path(cfg.out) / "checkpoints") if cfg.out else []
        last = f"the last checkpoint is {saved[-1]}; {then}" if saved else f"no checkpoint was written; {then}"
        raise distributed.LostRank(f"{lost}; {last}") from e


def _say(line: str) -> None:
    """One line on stderr in one write: the ranks of a job share their stderr, and a line written in two parts
    (print's text, then its newline) can have another rank's line land in the middle."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _guarded(prog: str, fn, args) -> int:
    """Run ``fn(args)``; a user error becomes one line on stderr and exit status 2 (the traceback
    with ``args.debug``), a lost rank one line and status 1, a stop on SIGTERM/SIGINT one line and
    status 75 (recorded for dres-launch; also when a reader handed it on inside an error of its own), and the
    process group (if any) is torn down either way."""
    from dres.train.distributed import LostRank

    try:
        fn(args)
    except stop.Interrupted as e:  # stopped on a signal, its checkpoint saved: a status of its own, for requeueing
        return _stopped(prog, e)
    except LostRank as e:  # not the user's error, and no checkpoint of this moment: neither 2 nor 75
        if args.debug:
            raise
        _say(f"{prog}: error: {e}")
        return 1
    except _user_errors() as e:
        stopped = stop.raised_stop()
        if stopped is not None:  # a signal's stop that came out inside another error is the stop
            return _stopped(prog, stopped)
        if args.debug:
            raise
        _say(f"{prog}: error: {' '.join(str(e).split())}")
        return 2
    finally:
        from dres.train import distributed

        distributed.cleanup()
    return 0


def _stopped(prog: str, e: stop.Interrupted) -> int:
    """A stop on SIGTERM/SIGINT: its one line, recorded for dres-launch, and its exit status."""
    from dres.train.launch import record_stop

    _say(f"{prog}: {e}")
    record_stop()
    return stop.EXIT_INTERRUPTED


def main(argv=None):
    # from the command line's first line to the process's end a signal is a stop in one line (or the run's end)
    return stop.run_command(lambda: _guarded("dres-train", _run, _parser().parse_args(_argv(argv))),
                            lambda e: _stopped("dres-train", e), "training started")


def _argv(argv) -> list:
    return sys.argv[1:] if argv is None else argv


TRAINING_EVAL_KEYS = ("eval.every", "eval.curve_probe_epochs", "eval.curve_fd_samples")  # act during training, not in dres-eval


def _eval_epilog() -> str:
    import textwrap

    from dres.train.config import key_docs
    from dres.train.tasks import all_tasks

    docs = key_docs()
    keys = [k for k in docs if k.startswith("eval.") and k not in TRAINING_EVAL_KEYS]
    for key in keys:
        default, hint = docs[key]
        tasks = [name for name, task in all_tasks().items() if key[5:] in task.eval_keys]
        docs[key] = (default, f"[{', '.join(tasks)}] {hint}".strip())
    head = ("evaluation keys (--set KEY=VALUE; [the tasks that read it]; the run's config.yaml holds its values, "
            "the defaults are shown):")
    tail = ("Any other config key may be set as well (e.g. --set data.val_path=... --set data.val_limit=N); "
            "`dres-train TASK --help` lists them.")
    return f"{textwrap.fill(head, 100)}\n{_keys_text(keys, docs)}\n\n{textwrap.fill(tail, 100)}"


def eval_main(argv=None):
    """``dres-eval RUN_DIR [--ckpt PATH] [--set eval.tsne=true ...]``: evaluate a finished run with
    its saved config; the results go to ``RUN_DIR/eval.json`` (the training summary.json is kept). A signal from
    its first line on is a stop in one line, as in dres-train."""
    return stop.run_command(lambda: _eval_command(argv), lambda e: _stopped("dres-eval", e), "the evaluation started")


def _eval_command(argv) -> int:
    import textwrap

    p = argparse.ArgumentParser(
        prog="dres-eval", add_help=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.fill(
            "Evaluate a run directory's newest checkpoint with the run's own config.yaml: MAE (linear probe, kNN, "
            "effective rank, reconstruction grid, t-SNE), U-ViT (samples, feature probe, FID), classify (top-1). "
            "Results go to RUN_DIR/eval.json; the training summary.json is kept.", 100))
    p.add_argument("-h", "--help", action=_HelpWithKeys, epilog=_eval_epilog)
    _version_flag(p)
    p.add_argument("run_dir", metavar="RUN_DIR", help="a dres-train run directory (it holds config.yaml)")
    p.add_argument("--ckpt", default=None, metavar="PATH", help="evaluate this checkpoint (a step_*.pt file or a DCP directory) "
                   "instead of the run's newest readable one")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="change a key of the run's config for this evaluation, e.g. --set eval.tsne=true "
                        "--set eval.layer=6 (keys below)")
    _allow_pipe_flag(p, "the run's config.yaml")
    _debug_flag(p)
    return _guarded("dres-eval", _evaluate, p.parse_args(_argv(argv)))


def _evaluate(a) -> None:
    from dres.train.config import check_commands, load_config, to_dict, typed_values
    from dres.train.driver import run
    from dres.train.rundir import normal_path

    run_dir = normal_path(a.run_dir)
    cfgf = Path(run_dir) / "config.yaml"
    if not cfgf.exists():
        raise FileNotFoundError(f"no config.yaml in {run_dir} (is it a dres run directory?)")
    base = to_dict(load_config(cfgf))
    cfg = config_for(None, None, a.overrides, base=base)
    check_commands(cfg, typed_values(a.overrides), a.allow_pipe, str(cfgf))
    cfg.out = run_dir
    with _lost_rank_in_one_line(cfg, f"evaluate again with dres-eval {run_dir} once every rank can start"):
        run(cfg, get_task(cfg.task), eval_only=True, ckpt=a.ckpt)


if __name__ == "__main__":
    sys.exit(main())
