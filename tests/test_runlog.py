"""The outputs of a log step (dres.train.runlog.RunLog): metrics.jsonl's line, TensorBoard scalars and the
progress bar, written on the main rank only."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dres.train.runlog import ReplayTimer, RunLog

REC = {"step": 5, "loss": 0.25, "lr": 1e-3, "img_per_s": 640.0, "model_tflops": 0.5, "mfu": 0.125, "epoch": None}


class _Scalars:
    """What a SummaryWriter was given."""

    def __init__(self):
        self.added = []

    def add_scalar(self, tag, value, step):
        self.added.append((tag, value, step))


def _one_log_step(tmp_path, main):
    """What a RunLog of a rank (``main`` or not) gives a SummaryWriter for the step of :data:`REC`."""
    tb = _Scalars()
    runlog = RunLog(tmp_path / "metrics.jsonl", main=main, tb=tb, show_progress=True, total=10, initial=4,
                    kept=lambda: "no checkpoint was written", batch_size=64, rate=lambda ips: {})
    runlog.advance()
    runlog.step(REC)
    runlog.close()
    return tb.added


def test_a_log_step_writes_its_line_its_scalars_and_the_bar(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # a terminal: the bar, no plain line
    scalars = _one_log_step(tmp_path, True)
    assert (tmp_path / "metrics.jsonl").read_text() == json.dumps(REC) + "\n"
    # every value but the step and the unknown epoch, at the record's step
    assert scalars == [("train/loss", 0.25, 5), ("train/lr", 1e-3, 5), ("train/img_per_s", 640.0, 5),
                       ("train/model_tflops", 0.5, 5), ("train/mfu", 0.125, 5)]
    bar = capsys.readouterr().err.replace("\r", "\n").splitlines()[-1]
    assert "5/10" in bar and "img_s=640, loss=0.2500, lr=1.00e-03, mfu=12.5%" in bar, bar  # tqdm sorts them
    assert capsys.readouterr().out == ""


def test_other_ranks_write_nothing(tmp_path, capsys):
    assert _one_log_step(tmp_path, False) == []
    assert not (tmp_path / "metrics.jsonl").exists() and capsys.readouterr().err == ""


def test_piped_a_log_step_is_one_plain_line_and_no_bar(tmp_path, capsys):
    """stderr not a terminal (a pipe, a batch job's .out): one line per log step, never a \\r-redrawn bar."""
    _one_log_step(tmp_path, True)
    out, err = capsys.readouterr()
    assert err == ""
    line, = out.splitlines()
    assert line.startswith("[dres] step 5/10 loss 0.2500 lr 1.00e-03 img/s 640 mfu 12.5% eta "), line


def _window_log(tmp_path, **options):
    return RunLog(tmp_path / "metrics.jsonl", main=True, tb=None, show_progress=False, total=10, initial=0,
                  kept=lambda: "no checkpoint was written", batch_size=64,
                  rate=lambda ips: {"model_tflops": ips * 1e-3, "mfu": None}, **options)


def test_a_log_window_is_read_back_as_its_record(tmp_path, monkeypatch):
    """close_window then read_window: the window's mean loss and metrics, img/s over its wall time, the rate's
    fields and whether a rank asked to stop; written to metrics.jsonl."""
    clock = iter([100.0, 102.0])  # the window opens at construction and is read 2 s later
    monkeypatch.setattr("dres.train.runlog.time.time", lambda: next(clock))
    runlog = _window_log(tmp_path)
    window = runlog.close_window(step=8, steps=4, lr=1e-3, epoch=0.5, loss_sum=torch.tensor(3.0), n=4,
                                 metrics={"acc": torch.tensor(2.0)}, stop_asked=True, bad=torch.tensor(False))
    rec, asked = runlog.read_window(window)
    assert asked is True
    assert rec == {"step": 8, "loss": 0.75, "lr": 1e-3, "img_per_s": 128.0, "model_tflops": 0.128, "mfu": None,
                   "epoch": 0.5, "data_ms": 0.0, "acc": 0.5}  # no peak memory on a CPU
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == rec


def test_a_window_records_the_mean_wait_for_data_of_its_steps_and_starts_the_next_at_zero(tmp_path):
    runlog = _window_log(tmp_path)
    for waited in (0.002, 0.004, 0.006, 0.008):
        runlog.waited_for_data(waited)
    close = dict(lr=1e-3, epoch=None, loss_sum=torch.tensor(1.0), n=1, metrics={}, stop_asked=False, bad=None)
    rec, _ = runlog.read_window(runlog.close_window(step=4, steps=4, **close))
    assert rec["data_ms"] == pytest.approx(5.0)
    rec, _ = runlog.read_window(runlog.close_window(step=5, steps=1, **close))
    assert rec["data_ms"] == 0.0


def test_the_plain_line_rounds_and_shows_data_time_and_peak_memory_where_known(tmp_path):
    runlog = _window_log(tmp_path)
    line = runlog.plain_line({**REC, "loss": 0.123456789012, "img_per_s": 5069.4, "data_ms": 1.234,
                              "peak_mem_gib": 14.43, "epoch": 0.4})
    assert line.startswith("[dres] step 5/10 epoch 0.40 loss 0.1235 lr 1.00e-03 img/s 5,069 data 1.2 ms mfu 12.5% "
                           "mem 14.4 GiB eta "), line


class _WandbModule:
    """A stand-in for the wandb package: what the run was given, no network."""

    def __init__(self):
        self.calls = []

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        return self

    def log(self, values, step):
        self.calls.append(("log", values, step))

    def finish(self):
        self.calls.append(("finish",))


def test_wandb_gets_the_log_steps_scalars_and_the_run_is_finished(tmp_path, monkeypatch):
    from dres.train.runlog import open_wandb

    wandb = _WandbModule()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    run = open_wandb(tmp_path / "my_run", {"task": "mae"})
    runlog = RunLog(tmp_path / "metrics.jsonl", main=True, tb=None, show_progress=False, total=10, initial=4,
                    kept=lambda: "", batch_size=64, rate=lambda ips: {}, wandb=run)
    runlog.step(REC)
    runlog.close()
    assert wandb.calls == [
        ("init", {"project": "dres", "name": "my_run", "dir": str(tmp_path / "my_run"), "config": {"task": "mae"}}),
        ("log", {"train/loss": 0.25, "train/lr": 1e-3, "train/img_per_s": 640.0, "train/model_tflops": 0.5,
                 "train/mfu": 0.125}, 5),
        ("finish",)]


def test_a_run_with_log_wandb_and_no_wandb_installed_is_one_line(tmp_path, monkeypatch, capsys):
    from test_optional import uninstall

    from dres.train import cli

    uninstall(monkeypatch, "wandb")
    out = tmp_path / "run"
    code = cli.main(["mae", "--preset", "quickstart", "--out", str(out), *[a for kv in TINY for a in ("--set", kv)],
                     "--set", "log.wandb=true", "--set", "steps=1"])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "dres-train: error: log.wandb=true needs wandb, which is not installed: pip install 'dres[wandb]'"]


def test_piped_progress_is_whole_lines_at_most_every_interval_and_one_at_the_end(monkeypatch, capsys):
    from dres.train.common import PlainProgress, progress

    assert isinstance(progress(total=3), PlainProgress)  # stderr is no terminal under pytest's capture
    silent = PlainProgress(total=2, enabled=False)
    silent.update(2)
    silent.close()
    assert capsys.readouterr().err == ""
    clock = iter([0.0, 10.0, 40.0, 50.0, 55.0])
    monkeypatch.setattr("dres.train.common.time.monotonic", lambda: next(clock))
    bar = PlainProgress(total=1000, desc="features", unit="img")  # starts at 0 s
    bar.update(100)   # 10 s: not yet
    bar.update(300)   # 40 s: a line
    bar.update(600)   # 50 s: within 30 s of the last
    bar.close()       # 55 s: the end
    assert capsys.readouterr().err.splitlines() == ["[dres] features 400/1,000 img (40%), 40 s",
                                                    "[dres] features 1,000/1,000 img (100%), 55 s"]


def test_a_non_finite_window_writes_no_record(tmp_path):
    runlog = _window_log(tmp_path)
    window = runlog.close_window(step=2, steps=2, lr=1e-3, epoch=None, loss_sum=torch.tensor(float("nan")), n=2,
                                 metrics={}, stop_asked=False, bad=torch.tensor(True))
    assert runlog.read_window(window) == (None, False)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_replay_timer_keeps_at_least_one_replay():
    with pytest.raises(ValueError, match="timed_replays must be >= 1"):
        ReplayTimer(0)


def test_a_terminal_that_reports_no_size_gets_a_bar_of_100_columns(monkeypatch):
    from dres.train.common import progress

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    monkeypatch.setattr(os, "get_terminal_size", lambda fd=1: os.terminal_size((0, 24)))
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.delenv("LINES", raising=False)
    bar = progress(total=3)
    assert bar.ncols == 100 and bar.nrows == 24 and not bar.dynamic_ncols
    bar.close()


REPO = Path(__file__).resolve().parent.parent
TINY = ["model.img_size=8", "model.patch_size=4", "data.img_size=8", "model.embed_dim=16", "model.depth=1",
        "model.num_heads=2", "model.decoder_embed_dim=16", "model.decoder_depth=1", "model.decoder_num_heads=2",
        "batch_size=16", "steps=4", "log.every=1", "log.tensorboard=false", "eval.probe=false", "eval.knn=false",
        "eval.effective_rank=false", "eval.recon=false", "threads=1"]


def _cli(out):
    return [sys.executable, "-m", "dres.train.mae", "--preset", "quickstart", "--out", str(out),
            *[a for kv in TINY for a in ("--set", kv)]]


def test_a_piped_run_prints_a_line_per_log_step(tmp_path):
    proc = subprocess.run(_cli(tmp_path / "run"), capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr
    steps = [line for line in proc.stdout.splitlines() if line.startswith("[dres] step ")]
    assert [line.split()[2] for line in steps] == ["1/4", "2/4", "3/4", "4/4"], proc.stdout
    assert all(" loss " in line and " img/s " in line and " data " in line and " eta " in line for line in steps)
    assert "\r" not in proc.stderr and "\r" not in proc.stdout


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_on_a_terminal_messages_never_share_the_bars_line(tmp_path):
    """In a pseudo-terminal the bar is drawn; every [dres] message starts its own line (the bar is cleared
    before it and drawn again after)."""
    import pty

    leader, follower = pty.openpty()
    proc = subprocess.Popen(_cli(tmp_path / "run"), stdin=follower, stdout=follower, stderr=follower,
                            env={k: v for k, v in dict(os.environ, OMP_NUM_THREADS="1").items()
                                 if k not in ("COLUMNS", "LINES")})
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:  # the follower side closed
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=300) == 0
    os.close(leader)
    text = b"".join(chunks).decode(errors="replace")
    assert "4/4 [" in text  # the bar was drawn (the pseudo-terminal reports no width: 100 columns)
    for line in text.splitlines():
        shown = line.split("\r")[-1]  # what a terminal shows of the line once every \r has rewound it
        if "[dres]" in shown:
            assert shown.lstrip().startswith("[dres]"), repr(line)


def test_a_full_disk_while_tensorboard_logs_is_one_line_like_the_metrics(tmp_path, capsys):
    """TensorBoard's writer thread meets the full disk; the trainer reports it in the one line (exit 2) the
    metrics path gives, naming the folder and the last good checkpoint, with no traceback."""
    pytest.importorskip("tensorboard")
    import errno
    from unittest import mock

    from tensorboard.compat.tensorflow_stub.io import gfile
    from test_faults import _one_line_error

    from dres.train import cli

    def full(self, filename, content, mode):  # TensorBoard's event files are written through its gfile
        raise OSError(errno.ENOSPC, "No space left on device")

    out = tmp_path / "run"
    args = ["mae", "--preset", "quickstart", "--out", str(out), *[a for kv in TINY for a in ("--set", kv)],
            "--set", "log.tensorboard=true", "--set", "ckpt.every=2", "--set", "steps=6"]
    with mock.patch.object(gfile.LocalFileSystem, "_write", full):
        assert cli.main(args) == 2
    err = _one_line_error(capsys)
    assert f"no space left on the device of {out / 'tb' / 'events'}" in err, err
    assert "free space, then continue with --resume auto" in err
