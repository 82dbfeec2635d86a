"""The linear probe's progress: its epochs counted on the trainers' bar (dres.train.common.progress),
on stderr, in dres.eval.linear_probe and in the MAE and U-ViT evaluations; silent without a bar."""

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


def test_uvit_evaluation_shows_the_probe_epochs(tmp_path, capsys, monkeypatch):
    """A one-step U-ViT run with log.progress on: its feature probe reports eval.probe_epochs on the bar
    and trains its head with eval.probe_wd."""
    import dres.eval
    from dres.train import cli
    from test_eval import TINY_DIGITS_8

    representation_metrics, probe_wds = dres.eval.representation_metrics, []

    def recording_metrics(*args, probe_wd, **kwargs):
        probe_wds.append(probe_wd)
        return representation_metrics(*args, probe_wd=probe_wd, **kwargs)

    monkeypatch.setattr(dres.eval, "representation_metrics", recording_metrics)
    settings = TINY_DIGITS_8 + ["data.mean=[0.5]", "data.std=[0.5]", "model.patch_size=2", "batch_size=32", "steps=1",
                                "eval.steps=1", "eval.n_samples=4", "eval.probe_epochs=3", "eval.probe_wd=0.01",
                                "eval.max_train=128", "eval.max_test=64", "log.progress=true", "ckpt.every=0"]
    args = ["uvit", "--preset", "uvit_cifar10", "--out", str(tmp_path / "run")] + sum([["--set", s] for s in settings], [])
    assert cli.main(args) == 0
    lines = _probe_lines(capsys.readouterr().err)
    assert lines and "3/3" in lines[-1] and "epoch" in lines[-1], lines
    assert probe_wds == [0.01]


def test_uvit_probe_grid_reports_every_block_and_noise_level(tmp_path):
    """eval.probe_grid_blocks x eval.probe_grid_ts: a row per pair (linear probe and kNN accuracy), the
    picture beside the run, the single probe unchanged; the grid's keys are checked before the run."""
    import json
    from pathlib import Path

    import pytest

    from dres.train import cli
    from dres.train.config import ConfigError, build_config
    from test_eval import TINY_DIGITS_8

    settings = TINY_DIGITS_8 + ["data.mean=[0.5]", "data.std=[0.5]", "model.patch_size=2", "batch_size=32", "steps=1",
                                "eval.steps=1", "eval.n_samples=4", "eval.probe_epochs=2", "eval.max_train=128",
                                "eval.max_test=64", "ckpt.every=0", "eval.probe_grid_blocks=[0, 2]",
                                "eval.probe_grid_ts=[0.1, 0.5]"]
    out = tmp_path / "run"
    args = ["uvit", "--preset", "uvit_cifar10", "--out", str(out)] + sum([["--set", s] for s in settings], [])
    assert cli.main(args) == 0
    res = json.loads((out / "summary.json").read_text())["eval"]
    grid = res["probe_grid"]
    assert [(r["block"], r["t"]) for r in grid] == [(0, 0.1), (2, 0.1), (0, 0.5), (2, 0.5)]
    assert all(0 <= r["linear_probe_acc"] <= 1 and 0 <= r["knn_acc"] <= 1 for r in grid)
    assert Path(res["probe_grid_png"]).is_file() and "probe_t0.1_linear_probe_acc" in res
    with pytest.raises(ConfigError, match="eval.probe_grid_blocks' and eval.probe_grid_ts are given together"):
        build_config("uvit", "uvit_cifar10", ["eval.probe_grid_blocks=[0]"])
    with pytest.raises(ConfigError, match=r"eval.probe_grid_blocks' must be block indices in \[0, 12\]"):
        build_config("uvit", "uvit_cifar10", ["eval.probe_grid_blocks=[13]", "eval.probe_grid_ts=[0.1]"])
    with pytest.raises(ConfigError, match=r"eval.probe_grid_ts' must be in \[0, 1\]"):
        build_config("uvit", "uvit_cifar10", ["eval.probe_grid_blocks=[1]", "eval.probe_grid_ts=[1.5]"])
