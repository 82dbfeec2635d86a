"""The linear probe's progress: its epochs counted on the trainers' bar (dres.train.common.progress),
on stderr, in dres.eval.linear_probe and in the MAE evaluation; silent without a bar."""

from dres.eval import linear_probe
from dres.train.common import progress
from test_eval import _blobs


def _probe_lines(err: str) -> list[str]:
    """The linear-probe bar's states (tqdm rewrites its line with carriage returns)."""
    return [s for line in err.splitlines() for s in line.split("\r") if s.startswith("linear probe")]


def test_linear_probe_counts_its_epochs_on_the_bar(capsys):
    x, y = _blobs(n=96, d=8, c=3)
    silent = linear_probe(x[:64], y[:64], x[64:], y[64:], epochs=3, batch_size=16)
    assert capsys.readouterr().err == ""
    shown = linear_probe(x[:64], y[:64], x[64:], y[64:], epochs=3, batch_size=16, progress=progress)
    assert shown == silent  # the bar changes nothing of the probe
    lines = _probe_lines(capsys.readouterr().err)
    assert lines and "0/3" in lines[0] and "3/3" in lines[-1] and "epoch" in lines[-1], lines


def test_mae_evaluation_shows_the_probe_epochs(tmp_path, capsys):
    """A one-step MAE run with log.progress on: its final evaluation's probe reports eval.probe_epochs."""
    from dres.train import cli

    settings = ["steps=1", "log.every=1", "model.depth=1", "model.decoder_depth=1", "batch_size=32",
                "eval.probe_epochs=3", "eval.max_train=128", "eval.max_test=64", "eval.knn=false",
                "eval.effective_rank=false", "eval.recon=false", "log.progress=true", "log.tensorboard=false",
                "optim.warmup_steps=1", "ckpt.every=0"]
    args = ["mae", "--preset", "quickstart", "--out", str(tmp_path / "run")] + sum([["--set", s] for s in settings], [])
    assert cli.main(args) == 0
    lines = _probe_lines(capsys.readouterr().err)
    assert lines and "3/3" in lines[-1] and "epoch" in lines[-1], lines
