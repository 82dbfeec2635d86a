"""dres-launch (``python -m dres.train.launch``), torchrun with the ranks' 75 as its exit status: two gloo ranks on
the CPU, signalled through the launcher's process group (as Slurm, Kubernetes and ``timeout`` signal a job) and
exiting with each status themselves; any other outcome keeps torchrun's status."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import free_port, signal_after_the_handler

from dres.train import checkpoint
from dres.train.launch import STATUS_DIR_ENV, every_rank_stopped, record_stop
from dres.train.stop import EXIT_INTERRUPTED

# a tiny DDP classifier run of the real CLI, long enough to be signalled while it trains
CLASSIFY = ["device=cpu", "data.name=synthetic", "data.synthetic_size=64", "data.img_size=8", "data.in_chans=1", "data.mean=[0.5]",
            "data.std=[0.25]", "data.aug=none", "model.img_size=8", "model.patch_size=4", "model.in_chans=1",
            "model.embed_dim=16", "model.depth=1", "model.num_heads=2", "model.num_classes=10", "batch_size=16",
            "optim.lr=1e-3", "optim.warmup_steps=0", "log.progress=false", "log.tensorboard=false", "threads=1",
            "compile=false", "dist=ddp", "log.every=1", "ckpt.every=0", "steps=100000"]


def _launch(tmp_path, *command):
    """dres-launch of two ranks running ``command``, in a process group of its own."""
    cmd = [sys.executable, "-m", "dres.train.launch", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), *command]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", STATUS_DIR_ENV):
        env.pop(key, None)
    return subprocess.Popen(cmd, cwd=str(tmp_path), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _script(tmp_path, code: str) -> str:
    path = tmp_path / "rank.py"
    path.write_text(textwrap.dedent(code))
    return str(path)


def _finish(p, timeout=300):
    try:
        out, err = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    return p.returncode, out, err


@pytest.mark.slow
def test_a_signal_to_the_launchers_process_group_saves_and_the_launch_exits_75(tmp_path):
    """torchrun starts each rank in a session of its own, so a group's SIGTERM reaches torchrun alone: it
    forwards it, the ranks finish the step, save together and exit 75, and torchrun raises a SignalException
    that carries no exit status; the ranks' records make it 75."""
    out = tmp_path / "run"
    p = _launch(tmp_path, "-m", "dres.train", "classify", "--preset", "classify_cifar10", "--out", str(out),
                *[a for kv in CLASSIFY for a in ("--set", kv)])
    metrics, t0 = out / "metrics.jsonl", time.time()
    while p.poll() is None and time.time() - t0 < 300:  # training, with a few steps behind it
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    assert p.poll() is None, p.communicate()
    os.killpg(p.pid, signal.SIGTERM)
    code, stdout, stderr = _finish(p)
    assert code == EXIT_INTERRUPTED, stderr[-3000:]
    (ckpt,) = checkpoint.list_checkpoints(out / "checkpoints")
    step = checkpoint.step_of(ckpt)
    said = [line for line in stderr.splitlines() if line.startswith("dres-")]
    assert said.count(f"dres-train: stopped by SIGTERM after step {step} of 100000: checkpoint {ckpt} written; "
                      f"continue with --resume auto (exit status {EXIT_INTERRUPTED})") == 2, stderr[-3000:]
    assert said[-1] == ("dres-launch: SIGTERM: every rank of this node stopped with the run's checkpoint written; "
                        f"continue with --resume auto (exit status {EXIT_INTERRUPTED})")
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == list(range(1, step + 1))


# Rank 0 exits with its status once rank 1 is ready; torchrun then stops rank 1 with SIGTERM, on which it exits
# with its own status, or dies of the signal ("killed").
RANKS_EXIT = """
    import os, pathlib, signal, sys, time
    rank, ready = os.environ["RANK"], pathlib.Path(sys.argv[1], "ready")
    status = sys.argv[2 + int(rank)]
    if rank == "1":
        if status != "killed":
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(int(status)))
        ready.touch()
        time.sleep(120)
    while not ready.exists():
        time.sleep(0.05)
    sys.exit(int(status))
"""


def _ranks_exit(tmp_path, *statuses):
    return _finish(_launch(tmp_path, _script(tmp_path, RANKS_EXIT), str(tmp_path), *statuses))


@pytest.mark.parametrize("statuses", [("75", "75"), ("75", "killed")])
def test_ranks_that_exit_75_make_the_launch_exit_75(tmp_path, statuses):
    """The ranks were signalled, not torchrun: its ChildFailedError carries their exit statuses, 75, or for
    a rank that torchrun stopped after the first one exited, SIGTERM's."""
    code, _, err = _ranks_exit(tmp_path, *statuses)
    assert code == EXIT_INTERRUPTED, err[-3000:]
    assert err.strip().splitlines()[-1] == ("dres-launch: the ranks stopped on a signal with the run's checkpoint "
                                            f"written; continue with --resume auto (exit status {EXIT_INTERRUPTED})")


@pytest.mark.parametrize("statuses", [("75", "3"), ("3", "75"), ("2", "killed")])
def test_a_rank_that_fails_otherwise_keeps_torchruns_exit_status_and_report(tmp_path, statuses):
    code, _, err = _ranks_exit(tmp_path, *statuses)
    assert code == 1, err[-3000:]  # torchrun's own
    assert "ChildFailedError" in err and "dres-launch:" not in err, err[-3000:]
    for status in statuses:
        assert (f"exitcode  : {status} " if status != "killed" else "(SIGTERM)") in err


def test_a_signalled_launch_whose_ranks_did_not_save_keeps_torchruns_exit_status(tmp_path):
    """The ranks die of the forwarded SIGTERM (no handler, no record of a stop): not 75."""
    started = tmp_path / "started"
    script = _script(tmp_path, f"""
        import os, pathlib, time
        pathlib.Path({str(started)!r}, os.environ["LOCAL_RANK"]).touch()
        time.sleep(300)
    """)
    started.mkdir()
    p = _launch(tmp_path, script)
    t0 = time.time()
    while len(list(started.iterdir())) < 2 and time.time() - t0 < 120:
        time.sleep(0.1)
    os.killpg(p.pid, signal.SIGTERM)
    code, _, err = _finish(p)
    assert code == 1 and "SignalException" in err and "dres-launch:" not in err, err[-3000:]


def test_a_signal_while_the_launcher_starts_is_one_line_and_exit_75(tmp_path):
    """dres-launch installs the stop handler as it starts: SIGTERM / SIGINT to its process group while it imports
    torchrun (about a second) ends it with one line and status 75, before any rank started; or, past that, the
    launch ends as it would (its one rank exits at once, status 0). Never a traceback."""
    started = tmp_path / "started"
    started.mkdir()
    script = _script(tmp_path, f"""
        import os, pathlib
        pathlib.Path({str(started)!r}, str(os.getpid())).touch()
    """)
    delays = [0.0, 0.3]  # from the handler's installation
    launches = []
    for _ in delays:
        cmd = [sys.executable, "-c", "import sys; from dres.train.launch import main; sys.exit(main())",
               "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(free_port()), script]
        env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", STATUS_DIR_ENV)}
        launches.append(subprocess.Popen(cmd, cwd=str(tmp_path), env=dict(env, OMP_NUM_THREADS="1"), text=True,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True))
    signal_after_the_handler(launches, delays)
    results = [_finish(p) for p in launches]
    for delay, (code, _, err) in zip(delays, results):
        assert code in (EXIT_INTERRUPTED, 0) and "Traceback" not in err, (delay, code, err[-3000:])
        if code == EXIT_INTERRUPTED:
            assert err.strip() in (f"dres-launch: stopped by {name} before the ranks started (exit status "
                                   f"{EXIT_INTERRUPTED})" for name in ("SIGTERM", "SIGINT")), (delay, err)
    stopped = sum(code == EXIT_INTERRUPTED for code, _, _ in results)
    assert stopped and len(list(started.iterdir())) == len(delays) - stopped, results


def test_every_rank_stopped_reads_the_latest_start_of_this_nodes_ranks(tmp_path, monkeypatch):
    def stop(restart, local_rank, world):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(restart))
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world))
        record_stop()

    monkeypatch.delenv(STATUS_DIR_ENV, raising=False)
    stop(0, 0, 2)  # no launcher: nothing is recorded anywhere
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv(STATUS_DIR_ENV, str(tmp_path))
    assert not every_rank_stopped(tmp_path)
    stop(0, 0, 2)
    assert not every_rank_stopped(tmp_path)  # rank 1 was killed before it saved
    stop(0, 1, 2)
    assert every_rank_stopped(tmp_path)
    stop(1, 1, 2)  # torchrun restarted the ranks; of this start only local rank 1 stopped with a checkpoint
    assert not every_rank_stopped(tmp_path)
    assert sorted(p.name for p in Path(tmp_path).iterdir()) == ["0.0.2", "0.1.2", "1.1.2"]
