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
