"""Faults a run meets and what survives them (docs/faults.md is the matrix these tests check): two trainers
into one folder, SIGTERM / SIGINT (one process and two gloo processes, DDP and FSDP2), a full disk, a
resume of a finished run, metrics.jsonl after a kill, hyper-parameters changed on resume, and refused
starts (CPU, a tiny MAE on 8x8 digits)."""

from __future__ import annotations

import builtins
import errno
import gc
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path
from unittest import mock

import pytest
import torch
from helpers import SignalledTask, process_group, signal_after_the_handler

from dres.train import checkpoint
from dres.train import cli, rundir
from dres.train.config import build_config
from dres.train.loop import Trainer
from dres.train.resume import RESUME_APPLIED
from dres.train.stop import EXIT_INTERRUPTED, Interrupted
from dres.train.mae import TASK

REPO = Path(__file__).resolve().parent.parent

TINY = ["device=cpu", "data.img_size=8", "model.img_size=8", "model.patch_size=4", "model.embed_dim=32", "model.depth=1",
        "model.num_heads=2", "model.decoder_embed_dim=32", "model.decoder_depth=1", "model.decoder_num_heads=2",
        "batch_size=32", "optim.warmup_steps=1", "ckpt.every=2", "ckpt.keep=0", "log.every=1", "log.progress=false",
        "log.tensorboard=false", "eval.probe=false", "eval.knn=false", "eval.effective_rank=false",
        "eval.recon=false", "threads=1"]


def _args(out, *extra, steps=4):
    return ["mae", "--preset", "quickstart", "--out", str(out), "--set", f"steps={steps}",
            *[a for kv in TINY for a in ("--set", kv)], *extra]


# two processes train a tiny classifier (all its parameters take part in the loss, as DDP requires)
CLASSIFY = ["device=cpu", "data.name=synthetic", "data.synthetic_size=64", "data.img_size=8", "data.in_chans=1", "data.mean=[0.5]",
            "data.std=[0.25]", "data.aug=none", "model.img_size=8", "model.patch_size=4", "model.in_chans=1",
            "model.embed_dim=16", "model.depth=1", "model.num_heads=2", "model.num_classes=10", "batch_size=16",
            "optim.lr=1e-3", "optim.warmup_steps=0", "log.progress=false", "log.tensorboard=false", "threads=1",
            "compile=false"]


def _classify_args(out, *extra, steps=8):
    return ["classify", "--preset", "classify_cifar10", "--out", str(out), "--set", f"steps={steps}",
            *[a for kv in CLASSIFY for a in ("--set", kv)], *extra]


def _train(out, *extra, steps=4):
    return cli.main(_args(out, *extra, steps=steps))


def _one_line_error(capsys):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def _files(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


# ------------------------------------------------------------------------------------------- run lock
def test_second_trainer_into_a_locked_folder_refuses_and_changes_nothing(tmp_path, capsys):
    """A live holder on this machine, and one on another machine sharing the folder: one line each."""
    out = tmp_path / "run"
    lock = rundir.RunLock(out).acquire(log=lambda m: None)  # this process: a trainer that is running
    try:
        assert _train(out) == 2
        err = _one_line_error(capsys)
        assert f"run directory {out} is in use by process {os.getpid()} on {socket.gethostname()}" in err, err
        assert _files(out) == {"run.lock": (out / "run.lock").read_bytes()}
        assert _train(out, "--overwrite") == 2 and "is in use by" in _one_line_error(capsys)
    finally:
        lock.release()
    assert not (out / "run.lock").exists()
    other = {"host": "node-b", "pid": 4242, "process_start": "1", "boot_id": "x", "started": "2026-01-01 00:00:00"}
    (out / "run.lock").write_text(json.dumps(other))
    assert _train(out) == 2
    err = _one_line_error(capsys)
    assert "in use by process 4242 on node-b" in err and f"if the run there is gone, delete {out / 'run.lock'}" in err
    (out / "run.lock").unlink()
    assert _train(out) == 0 and not (out / "run.lock").exists()  # released at the end of the run


def test_run_directory_that_cannot_hold_a_lock_is_one_line(tmp_path, capsys):
    (tmp_path / "afile").write_text("user data")
    assert _train(tmp_path / "afile") == 2
    assert f"run directory {tmp_path / 'afile'} is a file" in _one_line_error(capsys)
    assert (tmp_path / "afile").read_text() == "user data"
    assert _train(tmp_path / "afile" / "run") == 2  # a file where a parent folder should be
    assert f"cannot create the run lock {tmp_path / 'afile' / 'run' / 'run.lock'}" in _one_line_error(capsys)


def test_stale_lock_of_a_dead_process_is_taken_over_and_reported(tmp_path, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "run"
    out.mkdir()
    record = {"host": socket.gethostname(), "pid": dead.pid, "process_start": "1", "boot_id": rundir._boot_id(),
              "started": "2026-01-01 00:00:00"}
    (out / "run.lock").write_text(json.dumps(record))
    assert _train(out) == 0
    said = capsys.readouterr().out
    assert f"took over the run lock of process {dead.pid} on {socket.gethostname()}" in said
    assert "no longer running" in said and not (out / "run.lock").exists()
    # a reused pid is no holder either: this process's pid with another start time
    (out / "run.lock").write_text(json.dumps(dict(record, pid=os.getpid(), process_start="1")))
    assert _train(out, "--resume", "auto", steps=6) == 0
    assert f"took over the run lock of process {os.getpid()}" in capsys.readouterr().out


def test_two_trainers_started_together_one_refuses(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    code = "import sys; from dres.train import cli; sys.exit(cli.main(sys.argv[1:]))"
    procs = [subprocess.Popen([sys.executable, "-c", code, *_args(out, steps=40)], env=env, cwd=str(tmp_path),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=600), p.stdout.read(), p.stderr.read()) for p in procs]
    codes = sorted(r[0] for r in results)
    assert codes == [0, 2], results
    err = [r[2] for r in results if r[0] == 2][0].strip()
    assert len(err.splitlines()) == 1 and ("is in use by" in err or "is not empty" in err), err
    assert _steps(out / "metrics.jsonl") == list(range(1, 41))  # one run's history, not two interleaved


# ---------------------------------------------------------------------------- SIGTERM / SIGINT
# The trainer's CLI with the task wrapped: at its step SIGNAL_AT the listed ranks send themselves SIGNAL
# (COUNT times), from inside the step, as a scheduler's signal would arrive while it runs.
ENTRY = textwrap.dedent('''
    import faulthandler, os, signal, sys
    from unittest import mock

    from dres.train import cli
    from helpers import SignalledTask

    faulthandler.dump_traceback_later(300, exit=True)  # a rank that hangs fails the test with its threads' stacks

    at, name, count, ranks = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4].split(",")
    signals = [getattr(signal, name)] * count if os.environ.get("RANK", "0") in ranks else []
    real_get_task = cli.get_task
    with mock.patch.object(cli, "get_task", lambda n: SignalledTask(real_get_task(n), at, signals)):
        sys.exit(cli.main(sys.argv[5:]))
''')


def _start_ranks(tmp_path, group, world, at, name, count, ranks, args) -> list[subprocess.Popen]:
    """ENTRY in ``world`` processes (gloo, joining through ``group``: :func:`helpers.process_group`), output piped."""
    entry = tmp_path / "entry.py"
    entry.write_text(ENTRY)
    procs = []
    for rank in range(world):
        env = dict(os.environ, OMP_NUM_THREADS="1",  # ENTRY imports helpers
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "tests"), os.environ.get("PYTHONPATH")])))
        if world > 1:
            env.update(group, RANK=str(rank), LOCAL_RANK=str(rank))
        procs.append(subprocess.Popen([sys.executable, str(entry), str(at), name, str(count), ranks, *args], env=env,
                                      cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def _signalled(tmp_path, at, name, count, args, world=1, ranks="0"):
    """Run ENTRY in ``world`` processes (gloo) and return [(returncode, stdout, stderr)] by rank."""
    with process_group(world) as group:
        procs = _start_ranks(tmp_path, group, world, at, name, count, ranks, args)
        try:
            outs = [p.communicate(timeout=600) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    return [(p.returncode, o, e) for p, (o, e) in zip(procs, outs)]


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_signal_finishes_the_step_saves_and_exits_with_its_own_status(tmp_path, name, capsys):
    out = tmp_path / "run"
    (code, stdout, stderr), = _signalled(tmp_path, 3, name, 1, _args(out, "--set", "ckpt.every=0", steps=8))
    assert code == EXIT_INTERRUPTED, (stdout, stderr)
    assert stderr.strip() == (f"dres-train: stopped by {name} after step 3 of 8: checkpoint "
                              f"{out / 'checkpoints' / 'step_00000003.pt'} written; continue with --resume auto "
                              f"(exit status {EXIT_INTERRUPTED})")
    assert f"[dres] {name}: stopping after this step with a checkpoint" in stdout
    assert [p.name for p in checkpoint.list_checkpoints(out / "checkpoints")] == ["step_00000003.pt"]
    assert _steps(out / "metrics.jsonl") == [1, 2, 3]
    assert not (out / "summary.json").exists() and not (out / "run.lock").exists()
    assert (out / "log.txt").read_text().splitlines()[-1] == "[dres] " + stderr.strip().split(": ", 1)[1]
    assert _train(out, "--set", "ckpt.every=0", "--resume", "auto", steps=8) == 0
    assert "resumed from" in capsys.readouterr().out and _steps(out / "metrics.jsonl") == list(range(1, 9))


def test_second_signal_stops_at_once_without_saving(tmp_path):
    out = tmp_path / "run"
    (code, stdout, stderr), = _signalled(tmp_path, 3, "SIGTERM", 2, _args(out, "--set", "ckpt.every=0", steps=8))
    assert code == -signal.SIGTERM, (stdout, stderr)
    assert "a second signal stops at once, unsaved" in stdout
    assert checkpoint.list_checkpoints(out / "checkpoints") == []


def test_signal_during_the_final_evaluation_stops_at_once(tmp_path, capsys, monkeypatch):
    """No step to finish: the training's checkpoint is already written, so the stop is immediate."""
    def signalled_evaluate(trainer):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("the evaluation went on after SIGTERM")

    monkeypatch.setattr(TASK, "evaluate", signalled_evaluate)
    out = tmp_path / "run"
    assert _train(out) == EXIT_INTERRUPTED
    err = _one_line_error(capsys)
    assert err == (f"dres-train: stopped by SIGTERM during the evaluation after step 4; the checkpoint "
                   f"{out / 'checkpoints' / 'step_00000004.pt'} is written, evaluate it with dres-eval {out} "
                   f"(exit status {EXIT_INTERRUPTED})")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and not (out / "run.lock").exists()


def test_forked_loader_workers_keep_their_own_signal_behaviour():
    """A data-loader worker forked while the handlers are installed dies of SIGTERM as it would without
    them (its parent stops it); only the trainer's process turns the signal into a stop request."""
    from dres.train.stop import StopOnSignal

    asked = []
    with StopOnSignal(asked.append):
        pid = os.fork()
        if pid == 0:
            os.kill(os.getpid(), signal.SIGTERM)
            os._exit(0)  # reached only if the signal was swallowed
        _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
    assert asked == []


# the command line as its console script runs it
CONSOLE_SCRIPT = "import sys; from dres.train.cli import main; sys.exit(main())"


def test_a_signal_at_any_moment_of_start_up_is_one_line_and_its_own_status(tmp_path):
    """SIGTERM / SIGINT to the process group at delays that fall from the moment the command installs its handler
    (its imports under way) through the trainer's setup and its first steps: each run ends with one line and status
    75, or finishes (status 0), never with a traceback; a run stopped before it saved a step leaves no folder, so the
    same command starts it again, and one stopped after a step leaves its checkpoint for --resume auto."""
    delays = [0.0, 0.8, 2.3, 4.3, 7.3]  # from the handler's installation; started together, the sweep takes the longest
    procs = []
    for i, delay in enumerate(delays):
        args = _args(tmp_path / f"run{i}", "--set", "log.tensorboard=true", steps=30)
        procs.append(subprocess.Popen([sys.executable, "-c", CONSOLE_SCRIPT, *args], cwd=str(tmp_path),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1")))
    signal_after_the_handler(procs, delays)
    for i, proc in enumerate(procs):
        stdout, stderr = proc.communicate(timeout=300)
        out = tmp_path / f"run{i}"
        assert proc.returncode in (EXIT_INTERRUPTED, 0), (delays[i], proc.returncode, stderr)
        assert "Traceback" not in stderr, (delays[i], stderr)
        if proc.returncode == 0:
            assert (out / "summary.json").exists()
            continue
        line = stderr.strip()
        assert len(line.splitlines()) == 1 and line.startswith("dres-train: stopped by SIG"), (delays[i], stderr)
        if "before training started" in line:
            assert not out.exists(), (delays[i], sorted(p.name for p in out.rglob("*")))
        else:
            assert " after step " in line and checkpoint.list_checkpoints(out / "checkpoints"), (delays[i], line)
            assert not (out / "run.lock").exists()


def test_a_signal_at_any_moment_of_dres_evals_start_is_one_line_and_its_own_status(tmp_path):
    """dres-eval installs the handler as it starts, as dres-train does: SIGTERM / SIGINT to its process group while
    it imports, reads the run's config or builds the model ends it with one line and status 75, or it finishes
    (status 0), never with a traceback."""
    out = tmp_path / "run"
    assert _train(out, steps=2) == 0
    script = "import sys; from dres.train.cli import eval_main; sys.exit(eval_main())"
    delays = [0.0, 0.7, 1.7, 3.2]  # from the handler's installation
    procs = [subprocess.Popen([sys.executable, "-c", script, str(out)], cwd=str(tmp_path), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1")) for _ in delays]
    signal_after_the_handler(procs, delays)
    stopped = 0
    for delay, proc in zip(delays, procs):
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode in (EXIT_INTERRUPTED, 0) and "Traceback" not in stderr, (delay, proc.returncode, stderr)
        if proc.returncode == EXIT_INTERRUPTED:
            stopped += 1
            line = stderr.strip()
            assert len(line.splitlines()) == 1 and line.startswith("dres-eval: stopped by SIG"), (delay, stderr)
    assert stopped, "every evaluation ended before its signal"


def test_a_signal_during_dres_evals_evaluation_is_one_line_and_its_own_status(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    assert _train(out, steps=2) == 0
    capsys.readouterr()

    def signalled(trainer):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the handler ends the evaluation before this does
        pytest.fail("the signal did not stop the evaluation")

    monkeypatch.setattr(Trainer, "evaluate", signalled)
    assert cli.eval_main([str(out)]) == EXIT_INTERRUPTED
    assert _one_line_error(capsys) == (f"dres-eval: stopped by SIGTERM during the evaluation of {out}; evaluate "
                                       f"again with dres-eval {out} (exit status {EXIT_INTERRUPTED})")
    assert not (out / "eval.json").exists()


def test_a_signal_handed_on_inside_a_readers_error_is_still_the_stop(tmp_path, capsys, monkeypatch):
    """A signal while the checkpoint is read, whose stop the reader turns into an error of its own (as code that
    catches every exception does): the stop's one line and status, not an unreadable checkpoint, nor a fall back
    to the older checkpoint beside it."""
    out = tmp_path / "run"
    assert _train(out, steps=2) == 0
    (newest,) = checkpoint.list_checkpoints(out / "checkpoints")
    shutil.copy(newest, newest.with_name("step_00000001.pt"))
    capsys.readouterr()

    reads, real_load = [], torch.load

    def wrapping_load(*args, **kwargs):
        reads.append(args[0])
        if len(reads) > 1:  # one signal: a second read is the fall back this test refuses
            return real_load(*args, **kwargs)
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # the handler raises before this ends
        except Exception as e:
            raise RuntimeError(e.args) from None
        pytest.fail("the signal did not reach the reader")

    monkeypatch.setattr(checkpoint.torch, "load", wrapping_load)
    assert cli.eval_main([str(out)]) == EXIT_INTERRUPTED
    assert len(reads) == 1, reads
    logged = capsys.readouterr()
    assert "unreadable" not in logged.out and not (out / "eval.json").exists(), logged.out
    line = logged.err.strip()
    assert len(line.splitlines()) == 1 and line.startswith("dres-eval: stopped by SIGTERM"), line


@pytest.mark.slow
@pytest.mark.parametrize("dist", ["ddp", "fsdp"])
def test_two_processes_agree_to_stop_when_one_rank_is_signalled(tmp_path, dist):
    """Only rank 1 gets SIGTERM, during step 3; both ranks learn it from the next log step's (4) record, which
    they read after issuing step 5, stop after step 5, write one checkpoint together and exit with the
    interrupted status."""
    out = tmp_path / "run"
    args = _classify_args(out, "--set", f"dist={dist}", "--set", "log.every=2", "--set", "ckpt.every=0")
    results = _signalled(tmp_path, 3, "SIGTERM", 1, args, world=2, ranks="1")
    assert [r[0] for r in results] == [EXIT_INTERRUPTED] * 2, results
    assert "stopped by a signal to another rank after step 5 of 8" in results[0][2], results[0][2]
    assert "stopped by SIGTERM after step 5 of 8" in results[1][2], results[1][2]
    (ckpt,) = checkpoint.list_checkpoints(out / "checkpoints")
    assert checkpoint.step_of(ckpt) == 5 and ckpt.is_dir() == (dist == "fsdp")  # FSDP2: a DCP directory of both shards
    extra = checkpoint.read_file(ckpt / "extra.pt" if ckpt.is_dir() else ckpt)
    assert extra["step"] == 5 and len(extra["rng"]) == 2
    assert _steps(out / "metrics.jsonl") == [2, 4] and not (out / "run.lock").exists()


def test_a_stopped_runs_trainer_is_freed_before_its_process_group_ends(tmp_path, monkeypatch, capsys):
    """A stop leaves the trainer in reference cycles (its loader logs through it); left to the collector at
    interpreter exit, its DDP model met gloo's threads there and a rank aborted (status -6) after its stop line.
    With the collector off, no Trainer outlives ``cli.main``."""
    real_get_task = cli.get_task
    monkeypatch.setattr(cli, "get_task", lambda name: SignalledTask(real_get_task(name), 2, [signal.SIGTERM]))
    gc.collect()
    gc.disable()
    try:
        code = cli.main(_classify_args(tmp_path / "run", "--set", "dist=ddp", "--set", "ckpt.every=0", steps=4))
        alive = [o for o in gc.get_objects() if type(o) is Trainer]
    finally:
        gc.enable()
    assert code == EXIT_INTERRUPTED, capsys.readouterr().err
    assert not alive


@pytest.mark.slow
def test_two_processes_both_refuse_a_locked_folder(tmp_path):
    """Only rank 0 takes the lock; rank 1 learns the refusal from it and does not wait for it forever."""
    out = tmp_path / "run"
    lock = rundir.RunLock(out).acquire(log=lambda m: None)
    try:
        results = _signalled(tmp_path, 0, "SIGTERM", 0, _classify_args(out, "--set", "dist=ddp"), world=2)
    finally:
        lock.release()
    assert [r[0] for r in results] == [2, 2], results
    for _, _, err in results:
        assert len(err.strip().splitlines()) == 1 and "is in use by" in err


@pytest.mark.slow
def test_a_lost_rank_is_one_line_naming_it_and_the_last_checkpoint(tmp_path):
    """Rank 1 is killed during step 5: rank 0's collective meets the closed connection (gloo says so at once) and
    it ends with one line, not gloo's traceback, naming rank 1 and the step 4 checkpoint; neither 2 nor 75."""
    out = tmp_path / "run"
    args = _classify_args(out, "--set", "dist=ddp", "--set", "log.every=1", "--set", "ckpt.every=2")
    (code, stdout, stderr), (lost_code, _, _) = _signalled(tmp_path, 5, "SIGKILL", 1, args, world=2, ranks="1")
    assert lost_code == -signal.SIGKILL
    assert code == 1, (stdout, stderr)
    err = stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith("dres-train: error: lost rank 1 of 2: "), err
    assert err.endswith(f"; its process ended, or its host stopped answering; the last checkpoint is "
                        f"{out / 'checkpoints' / 'step_00000004.pt'}; continue with --resume auto once every rank "
                        "can start"), err
    assert not (out / "run.lock").exists()


@pytest.mark.slow
def test_a_rank_that_stops_answering_is_lost_after_dist_timeout_s(tmp_path):
    """A host that vanishes without closing its connections (here: rank 1 stopped with SIGSTOP) is noticed only
    when the process group's timeout runs out: dist_timeout_s (default 30 minutes), then the same one line."""
    out = tmp_path / "run"
    args = _classify_args(out, "--set", "dist=ddp", "--set", "log.every=1", "--set", "ckpt.every=2", "--set",
                          "dist_timeout_s=20")
    with process_group(2) as group:
        procs = _start_ranks(tmp_path, group, 2, 5, "SIGSTOP", 1, "1", args)
        started = time.monotonic()
        try:
            stdout, stderr = procs[0].communicate(timeout=600)
        finally:
            for p in procs:
                p.kill()
                p.communicate()
    assert procs[0].returncode == 1, (stdout, stderr)
    assert time.monotonic() - started > 20  # it waited out the timeout
    err = stderr.strip()  # gloo's reason: "Timed out waiting 20000ms ..." or "Application timeout caused pair closure"
    assert len(err.splitlines()) == 1 and err.startswith("dres-train: error: lost rank 1 of 2: "), err
    assert ("(dist_timeout_s); its process ended, or its host stopped answering; the last checkpoint is "
            f"{out / 'checkpoints' / 'step_00000004.pt'}") in err, err


def test_only_a_collective_that_lost_its_peer_is_a_lost_rank():
    """The gloo errors the lost-rank tests meet, found under the teardown's errors and in a DCP checkpoint's
    per-rank failures; an error that merely says "timed out" is not one."""
    from dres.train import distributed

    reset = RuntimeError("[/x/gloo/transport/tcp/pair.cc:545] Read error [10.0.0.2]:3931: Connection reset by peer.")
    try:
        try:
            raise reset
        finally:
            raise RuntimeError("Application timeout caused pair closure")  # the barrier of run()'s teardown
    except RuntimeError as e:
        assert distributed._lost_peer_errors(e)[-1] is reset
    saved = type("CheckpointException", (BaseException,), {})("save failed")
    saved.failures = {1: (reset, None)}
    assert distributed._lost_peer_errors(saved) == [reset]
    for other in (RuntimeError("DataLoader timed out after 5 seconds"), ValueError("Connection reset by peer"),
                  RuntimeError("[enforce fail at /x/gloo/allreduce.cc:10] sizes differ")):
        assert distributed._lost_peer_errors(other) == []


# ----------------------------------------------------------------------------------------- disk full
def _disk_fills_on(fragment: str, after: int = 64):
    """``open`` where files whose name contains ``fragment`` take ``after`` bytes in all (however often they
    are opened) and then raise ENOSPC."""
    real_open = builtins.open
    written = [0]

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, b):
            written[0] += len(b)
            if written[0] > after:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(b)

        def __getattr__(self, attr):
            return getattr(self.f, attr)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def fake_open(file, mode="r", *a, **k):
        f = real_open(file, mode, *a, **k)
        return Full(f) if fragment in os.path.basename(str(file)) and ("w" in mode or "a" in mode) else f

    return mock.patch.object(builtins, "open", fake_open)


def test_full_disk_during_a_checkpoint_is_one_line_and_keeps_the_previous_one(tmp_path, capsys):
    out = tmp_path / "run"
    assert _train(out, steps=2) == 0
    before = (out / "checkpoints" / "step_00000002.pt").read_bytes()
    with _disk_fills_on("step_00000004"):
        assert _train(out, "--resume", "auto", steps=4) == 2
    err = _one_line_error(capsys)
    assert f"no space left on the device of {out / 'checkpoints' / 'step_00000004.pt'}: it needs about " in err, err
    assert re.search(r"\d\.\d [KMG]iB free", err) and "removed the partial .step_00000004.pt.tmp" in err
    assert f"the previous checkpoint {out / 'checkpoints' / 'step_00000002.pt'} is intact" in err
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_00000002.pt"]  # no partial file left
    assert (out / "checkpoints" / "step_00000002.pt").read_bytes() == before
    assert _train(out, "--resume", "auto", steps=4) == 0  # space freed: the run goes on from step 2
    assert "resumed from" in capsys.readouterr().out and (out / "checkpoints" / "step_00000004.pt").exists()


@pytest.mark.parametrize("where", ["shards", "extra.pt"])
def test_full_disk_during_a_dcp_checkpoint_is_disk_full_and_keeps_the_previous_one(tmp_path, where):
    """torch.distributed.checkpoint (the FSDP2 format) reports a failed write of its shards as a
    CheckpointException, a BaseException holding each rank's (exception, traceback): a full disk there is
    DiskFull too, as it is while the trainer state (extra.pt) is added before the rename."""
    import torch
    import torch.distributed.checkpoint.filesystem as dcp_filesystem

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    checkpoint.save(tmp_path, 2, model, optimizer, {}, dcp_format=True)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    fills = mock.patch.object(dcp_filesystem, "_write_item", full) if where == "shards" else _disk_fills_on(where, 0)
    with fills, pytest.raises(rundir.DiskFull) as raised:
        checkpoint.save(tmp_path, 4, model, optimizer, {}, dcp_format=True)
    assert f"no space left on the device of {tmp_path / 'step_00000004'}" in str(raised.value)
    assert f"the previous checkpoint {tmp_path / 'step_00000002'} is intact" in str(raised.value)
    assert "removed the partial .step_00000004.tmp" in str(raised.value)
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000002"]


def test_full_disk_while_writing_eval_json_leaves_no_partial_file(tmp_path, capsys):
    out = tmp_path / "run"
    assert _train(out, steps=2) == 0
    summary = (out / "summary.json").read_bytes()
    with _disk_fills_on("eval.json", after=2):
        assert cli.eval_main([str(out), "--set", "threads=1"]) == 2
    err = _one_line_error(capsys)
    assert f"no space left on the device of {out / 'eval.json'}" in err and "eval.json was not written" in err, err
    assert not (out / "eval.json").exists() and not list(out.glob(".*.tmp"))
    assert (out / "summary.json").read_bytes() == summary
    assert cli.eval_main([str(out), "--set", "threads=1"]) == 0 and json.loads((out / "eval.json").read_text())


def test_full_disk_while_logging_metrics_is_one_line_and_the_resume_repairs_the_log(tmp_path, capsys):
    out = tmp_path / "run"
    with _disk_fills_on("metrics.jsonl", after=500):  # fills during the metrics of step 4
        assert _train(out, steps=6) == 2
    err = _one_line_error(capsys)
    assert f"no space left on the device of {out / 'metrics.jsonl'}" in err, err
    assert f"the last good checkpoint is {out / 'checkpoints' / 'step_00000002.pt'}" in err
    assert _train(out, "--resume", "auto", steps=6) == 0
    assert _steps(out / "metrics.jsonl") == list(range(1, 7))


def test_full_disk_while_recording_a_start_is_one_line_and_resume_auto_starts_the_run(tmp_path, capsys):
    out = tmp_path / "run"
    with _disk_fills_on(rundir.START_FILE, after=10):
        assert _train(out, steps=2) == 2
    err = _one_line_error(capsys)
    assert f"no space left on the device of {out / rundir.START_FILE}" in err, err
    assert err.endswith("free space, then continue with --resume auto"), err
    assert (out / "config.yaml").exists() and (out / rundir.START_FILE).read_text() == ""
    assert _train(out, "--resume", "auto", steps=2) == 0  # what the message says works
    assert len((out / rundir.START_FILE).read_text().splitlines()) == 1


def test_write_atomic_keeps_the_old_file_when_the_disk_is_full(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text('{"final_loss": 0.5}')
    with _disk_fills_on("summary.json", after=4), pytest.raises(rundir.DiskFull, match="previous summary.json is unchanged"):
        rundir.write_atomic(path, json.dumps({"final_loss": 0.25, "pad": "x" * 100}))
    assert path.read_text() == '{"final_loss": 0.5}' and os.listdir(tmp_path) == ["summary.json"]


# --------------------------------------------------------------------------------- finished runs
def test_resuming_a_finished_run_changes_nothing_and_says_how_to_extend_it(tmp_path, capsys):
    out = tmp_path / "run"
    assert _train(out, steps=4) == 0
    before = _files(out)
    capsys.readouterr()
    assert _train(out, "--resume", "auto", steps=4) == 0
    said = capsys.readouterr().out
    assert f"the run in {out} is finished (step 4 of 4" in said and "--resume auto --set steps=N with N > 4" in said
    assert _files(out) == before
    assert _train(out, "--resume", "auto", steps=6) == 0  # extended on request
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["step"] == 6 and summary["final_loss"] is not None
    assert _steps(out / "metrics.jsonl") == list(range(1, 7))
    assert _train(out, "--resume", "auto", steps=5) == 2
    assert "is at step 6, past this run's length (5 steps)" in _one_line_error(capsys)


# ------------------------------------------------------------------------ metrics after a kill
def test_resume_cuts_the_records_past_the_checkpoint(tmp_path):
    """As after kill -9 at step 6: the step 6 checkpoint never landed, metrics.jsonl holds steps 5-6 and a torn line."""
    out = tmp_path / "run"
    assert _train(out, steps=6) == 0
    (out / "checkpoints" / "step_00000006.pt").unlink()
    (out / "summary.json").unlink()
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "lo')
    assert _train(out, "--resume", "auto", steps=6) == 0
    assert _steps(out / "metrics.jsonl") == list(range(1, 7))
    superseded = (out / "metrics.superseded.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in superseded[:2]] == [5, 6] and superseded[2] == '{"step": 7, "lo'


# --------------------------------------------------------------- hyper-parameters changed on resume
BASE = ["optim.lr=1e-3", "optim.warmup_steps=2", "optim.min_lr=1e-5", "optim.clip_grad=1.0"]
# each key of RESUME_APPLIED that acts through the optimizer's groups or the lr schedule, with a new value
CHANGES = {"optim.lr": ["optim.lr=3e-3"], "optim.blr": ["optim.lr=0", "optim.blr=0.02"],
           "optim.min_lr": ["optim.min_lr=5e-4"], "optim.weight_decay": ["optim.weight_decay=0.2"],
           "optim.betas": ["optim.betas=[0.8,0.9]"], "optim.eps": ["optim.eps=1e-6"],
           "optim.schedule": ["optim.schedule=constant"], "optim.warmup_steps": ["optim.warmup_steps=6"],
           "optim.warmup_epochs": ["optim.warmup_steps=-1", "optim.warmup_epochs=0.1"],
           "steps": ["steps=12"], "epochs": ["steps=0", "epochs=1"],
           "optim.momentum": ["optim.name=sgd", "optim.momentum=0.5"]}
# keys the step reads from the config every time (nothing of theirs is in the checkpoint)
READ_EACH_STEP = {"optim.clip_grad", "optim.label_smoothing", "accum_steps", "optim.fused"}


def test_every_key_a_resume_may_change_is_tested():
    assert set(CHANGES) | READ_EACH_STEP == set(RESUME_APPLIED)


def _tr(out, extra, log=lambda m: None):
    cfg = build_config("mae", "quickstart", TINY + BASE + [f"out={out}", "steps=8"] + extra)
    return Trainer(cfg, TASK, log=log).setup()


def _hyper(trainer):
    return [{k: v for k, v in g.items() if k != "params"} for g in trainer.optimizer.param_groups]


@pytest.mark.parametrize("key", sorted(CHANGES))
def test_changed_hyper_parameters_are_applied_on_resume(tmp_path, key):
    sgd = [o for o in CHANGES[key] if o.startswith("optim.name")]
    first = _tr(tmp_path, sgd)
    first.fit(until=4)  # a run of 8 steps, stopped after 4
    lines = []
    resumed = _tr(tmp_path, CHANGES[key], log=lines.append)
    assert resumed.resume("auto") and resumed.step == 4
    assert any("settings changed since the checkpoint" in m and key in m for m in lines), lines
    # what a fresh run with the new config has at step 4: the same groups and lr
    ref = _tr(tmp_path / "ref", CHANGES[key])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # stepping the schedule without optimizer steps
        for _ in range(4):
            ref.scheduler.step()
    assert _hyper(resumed) == _hyper(ref)
    assert resumed.scheduler.get_last_lr() == ref.scheduler.get_last_lr()
    assert first.optimizer.param_groups[0]["lr"] != resumed.optimizer.param_groups[0]["lr"] or key in (
        "optim.weight_decay", "optim.betas", "optim.eps", "optim.momentum")
    resumed.fit(until=5)  # the lr logged is the one the optimizer used for that step
    assert resumed.history[-1]["lr"] == resumed.optimizer.param_groups[0]["lr"]


def test_clip_grad_changed_on_resume_is_read_by_the_step(tmp_path):
    first = _tr(tmp_path, [])
    first.fit(until=2)
    assert "grad_norm" in first.history[-1]
    resumed = _tr(tmp_path, ["optim.clip_grad=0"])
    assert resumed.resume("auto")
    resumed.fit(until=3)
    assert "grad_norm" not in resumed.history[-1]  # clipping (and its norm) off, as the config now says


def test_seed_change_on_resume_is_refused_in_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    assert _train(out, steps=2) == 0
    before = _files(out)
    assert _train(out, "--resume", "auto", "--set", "seed=1", steps=4) == 2
    err = _one_line_error(capsys)
    assert "seed cannot change on resume" in err and "--set seed=0" in err, err
    assert _files(out) == before


# --------------------------------------------------------------------------------- refused starts
@pytest.mark.parametrize("extra, message", [
    (["--resume", "/missing/step_00000002.pt"], "checkpoint not found: /missing/step_00000002.pt"),
    (["--set", "steps=0", "--set", "epochs=0"], "training length is zero"),
    (["--resume", "auto", "--overwrite"], "exclude each other"),
])
def test_a_refused_start_leaves_nothing_behind(tmp_path, capsys, extra, message):
    out = tmp_path / "new" / "run"
    assert cli.main(_args(out, *extra)) == 2
    assert message in _one_line_error(capsys)
    assert not (tmp_path / "new").exists()


def test_the_fault_matrix_names_only_tests_that_exist():
    """docs/faults.md names the test of each row: every row names one, each is defined, and each test of this file is
    named there."""
    matrix = (REPO / "docs" / "faults.md").read_text()
    rows = [line for line in matrix.splitlines() if line.startswith("| ") and not line.startswith(("| Fault", "|---"))]
    untested = [row.split(" | ")[0] for row in rows if not re.search(r"`[\w.:]*test_\w+", row.rsplit(" | ", 1)[-1])]
    assert rows and not untested, untested
    named = set(re.findall(r"\b(test_[a-z0-9_]+)\b(?!\.py)", matrix))  # test functions, not test files
    defined = {m for f in (REPO / "tests").glob("test_*.py") for m in re.findall(r"^def (test_\w+)", f.read_text(), re.M)}
    assert named and named <= defined, sorted(named - defined)
    here = set(re.findall(r"^def (test_\w+)", Path(__file__).read_text(), re.M)) - {
        "test_the_fault_matrix_names_only_tests_that_exist"}
    assert here <= named, sorted(here - named)


def test_sizes_in_messages_take_the_unit_that_shows_them():
    assert [rundir.byte_size(n) for n in (200, 3 * 2**10, 5.5 * 2**20, 2**31)] == ["200 bytes", "3.0 KiB", "5.5 MiB",
                                                                                 "2.0 GiB"]


def test_a_signal_while_a_checkpoint_is_read_is_the_stop_not_a_damaged_file(tmp_path):
    out = tmp_path / "run"
    assert _train(out, steps=2) == 0
    model = torch.nn.Linear(2, 2)  # the patched calls stop before its shapes matter

    def stopped(*args, **kwargs):
        raise Interrupted("stopped by SIGTERM while reading")

    with mock.patch("torch.load", stopped), pytest.raises(Interrupted, match="while reading"):
        checkpoint.load(out / "checkpoints", model, None)
    with mock.patch.object(type(model), "load_state_dict", stopped), pytest.raises(Interrupted, match="while reading"):
        checkpoint.load(out / "checkpoints", model, None)
