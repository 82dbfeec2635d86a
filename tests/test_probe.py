"""The linear probe's progress: its epochs counted on the trainers' bar (dres.train.common.progress),
on stderr, in dres.eval.linear_probe and in the MAE and U-ViT evaluations; silent without a bar."""

import json
import math

import pytest
import torch

from dres.eval import knn_accuracy, linear_probe
from dres.train.common import progress
from test_eval import _blobs


def _probe_lines(err: str) -> list[str]:
    """The linear-probe progress's states: a tqdm bar's (which rewrites its line with carriage returns) on a
    terminal, whole ``[dres] linear probe ...`` lines elsewhere (as under pytest, whose stderr is a pipe)."""
    states = [s.removeprefix("[dres] ") for line in err.splitlines() for s in line.split("\r")]
    return [s for s in states if s.startswith("linear probe")]


def test_linear_probe_counts_its_epochs_on_the_bar(capsys):
    x, y = _blobs(n=96, d=8, c=3)
    silent = linear_probe(x[:64], y[:64], x[64:], y[64:], epochs=3, batch_size=16)
    assert capsys.readouterr().err == ""
    shown = linear_probe(x[:64], y[:64], x[64:], y[64:], epochs=3, batch_size=16, progress=progress)
    assert shown == silent  # the bar changes nothing of the probe
    lines = _probe_lines(capsys.readouterr().err)
    assert lines and "3/3" in lines[-1] and "epoch" in lines[-1], lines


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

    representation_metrics, probe_wds = dres.eval.representation_metrics_per_head, []

    def recording_metrics(*args, probe_wd, **kwargs):
        probe_wds.append(probe_wd)
        return representation_metrics(*args, probe_wd=probe_wd, **kwargs)

    monkeypatch.setattr(dres.eval, "representation_metrics_per_head", recording_metrics)
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
    from dres.train.config import ConfigError
    from dres.train.tasks import config_for
    from test_eval import TINY_DIGITS_8

    settings = TINY_DIGITS_8 + ["data.mean=[0.5]", "data.std=[0.5]", "model.patch_size=2", "batch_size=32", "steps=1",
                                "eval.steps=1", "eval.n_samples=4", "eval.probe_epochs=2", "eval.max_train=128",
                                "eval.max_test=64", "ckpt.every=0", "eval.probe_grid_blocks=[0, 1, 2]",
                                "eval.probe_grid_ts=[0.1, 0.5]"]
    out = tmp_path / "run"
    args = ["uvit", "--preset", "uvit_cifar10", "--out", str(out)] + sum([["--set", s] for s in settings], [])
    assert cli.main(args) == 0
    res = json.loads((out / "summary.json").read_text())["eval"]
    grid = res["probe_grid"]
    assert [(r["block"], r["t"]) for r in grid] == [(b, t) for t in (0.1, 0.5) for b in (0, 1, 2)]
    # one pass serves every block of a noise level: the mid block's cell is the single probe (block -1, t 0.1)
    assert (grid[1]["linear_probe_acc"], grid[1]["knn_acc"]) == (res["probe_t0.1_linear_probe_acc"],
                                                                 res["probe_t0.1_knn_acc"])
    assert all(0 <= r["linear_probe_acc"] <= 1 and 0 <= r["knn_acc"] <= 1 for r in grid)
    assert Path(res["probe_grid_png"]).is_file() and "probe_t0.1_linear_probe_acc" in res
    with pytest.raises(ConfigError, match="eval.probe_grid_blocks' and eval.probe_grid_ts are given together"):
        config_for("uvit", "uvit_cifar10", ["eval.probe_grid_blocks=[0]"])
    with pytest.raises(ConfigError, match=r"eval.probe_grid_blocks' must be block indices in \[0, 12\]"):
        config_for("uvit", "uvit_cifar10", ["eval.probe_grid_blocks=[13]", "eval.probe_grid_ts=[0.1]"])
    with pytest.raises(ConfigError, match=r"eval.probe_grid_ts' must be in \[0, 1\]"):
        config_for("uvit", "uvit_cifar10", ["eval.probe_grid_blocks=[1]", "eval.probe_grid_ts=[1.5]"])


# ------------------------------------------------------------------------------------------------
# The decayed-shortcut authors' evaluation (MAE/util/misc.py::eval_model on models_mae.forward_feat)


def _tiny_mae(variant):
    from dres.models import MAE

    torch.manual_seed(0)
    return MAE(img_size=8, patch_size=4, embed_dim=32, depth=2, num_heads=2, decoder_embed_dim=32, decoder_depth=1,
               decoder_num_heads=2, variant=variant, alpha_min=0.6, zero_init=False).eval()


@pytest.mark.parametrize("variant", ["official", "baseline"])
def test_stream_mean_is_the_raw_last_stream_averaged_over_every_token(variant):
    """forward_feat's x after the last block, written out block by block as the authors' Block does
    (x = a0 x + attn(norm1 x); x = a1 x + mlp(norm2 x)), averaged over all tokens with the class token,
    and never final-normed (baseline has a final LayerNorm, official none)."""
    mae = _tiny_mae(variant)
    enc = mae.encoder
    imgs = torch.randn(3, 3, 8, 8)
    with torch.no_grad():
        got = mae.forward_features(imgs)
        x = enc.add_cls(enc.embed(imgs))
        alphas = enc.transformer.alphas.tolist()
        for k, blk in enumerate(enc.transformer.blocks):
            x = alphas[2 * k] * x + blk.attn(blk.norm1(x))
            x = alphas[2 * k + 1] * x + blk.mlp(blk.norm2(x))
    torch.testing.assert_close(got["stream_mean"], x.mean(dim=1), rtol=1e-5, atol=1e-5)
    patches = x[:, 1:] if enc.transformer.norm is None else enc.transformer.norm(x)[:, 1:]
    torch.testing.assert_close(got["mean"], patches.mean(dim=1), rtol=1e-5, atol=1e-5)  # unchanged


def test_authors_probe_runs_eval_models_settings(monkeypatch):
    """AdamW(params, 1e-2) (torch's weight decay 0.01), the lr set after each epoch to
    1e-2 * (1 + cos(pi * epoch / epochs)) / 2, the last partial batch dropped, raw features."""
    from dres.eval import AUTHORS_PROBE, authors_linear_probe

    assert AUTHORS_PROBE == {"epochs": 200, "lr": 1e-2, "weight_decay": 0.01, "batch_size": 1024}
    steps = []

    class RecordingAdamW(torch.optim.AdamW):
        def step(self, closure=None):
            g = self.param_groups[0]
            steps.append((g["lr"], g["weight_decay"], self.param_groups[0]["params"][0].grad.shape))
            return super().step(closure)

    monkeypatch.setattr(torch.optim, "AdamW", RecordingAdamW)
    x, y = _blobs(n=60, d=8, c=3)
    authors_linear_probe(x[:40], y[:40], x[40:], y[40:], epochs=4, batch_size=16)
    lrs = [lr for lr, _, _ in steps]
    want = [1e-2 * 0.5 * (1 + math.cos(math.pi * ep / 4)) for ep in (-0.0, 0, 1, 2)]  # epoch 0 at the initial lr
    assert len(steps) == 4 * 2  # 40 samples, batches of 16: two a epoch, the last 8 dropped
    assert lrs == pytest.approx([w for w in want for _ in range(2)])
    assert {wd for _, wd, _ in steps} == {0.01}


def test_authors_probe_reads_raw_features_and_standardised_knn_ignores_a_loud_channel():
    """The authors' probe separates blobs from raw features; loud noise channels (100x the blobs' scale) decide
    cosine kNN on raw features, not on standardised ones."""
    from dres.eval import authors_linear_probe

    x, y = _blobs(n=600, d=8, c=3)
    assert authors_linear_probe(x[:400], y[:400], x[400:], y[400:], epochs=30, batch_size=64)["authors_probe_acc"] > 0.95
    g = torch.Generator().manual_seed(1)
    loud = torch.cat([x, 100 * torch.randn(len(x), 4, generator=g)], 1)
    raw = knn_accuracy(loud[:400], y[:400], loud[400:], y[400:], k=20)
    std = knn_accuracy(loud[:400], y[:400], loud[400:], y[400:], k=20, standardize_first=True)
    assert raw < 0.6 < 0.95 < std


def test_score_feature_kinds_prefixes_the_other_kinds_and_ranks_once():
    from dres.eval.features import score_feature_kinds

    x, y = _blobs(n=300, d=8, c=3)
    kinds = {"cls": x[:200], "stream_mean": x[:200] * 2}
    test = {"cls": x[200:], "stream_mean": x[200:] * 2}
    res = score_feature_kinds(kinds, y[:200], test, y[200:], primary="cls", probe_epochs=2, probe_batch=64,
                              authors_probe=True, knn_standardized=True)
    assert {"linear_probe_acc", "knn_acc", "knn_std_acc", "authors_probe_acc", "effective_rank",
            "stream_mean_linear_probe_acc", "stream_mean_knn_acc", "stream_mean_knn_std_acc",
            "stream_mean_authors_probe_acc"} <= set(res)
    assert not any(k.startswith("stream_mean_effective") for k in res)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_mae_final_evaluation_scores_both_kinds_both_protocols_and_keeps_the_features(tmp_path, device):
    """One evaluation pass: cls (unprefixed) and stream_mean (prefixed), each with the project's probe,
    the authors' probe, kNN raw and standardised; the features file holds both kinds of both splits."""
    from dres.eval.features import FEATURES_FILE, load_features
    from dres.train import cli

    settings = ["steps=1", "log.every=1", "model.depth=1", "model.decoder_depth=1", "batch_size=32",
                "eval.probe_epochs=2", "eval.max_train=128", "eval.max_test=64", "eval.recon=false",
                "eval.feature=cls", "eval.also_features=stream_mean", "eval.authors_probe=true", "eval.knn_standardized=true",
                "eval.save_features=true", "log.tensorboard=false", "optim.warmup_steps=1", "ckpt.every=0",
                f"device={device}"]
    out = tmp_path / "run"
    args = ["mae", "--preset", "quickstart", "--out", str(out)] + sum([["--set", s] for s in settings], [])
    assert cli.main(args) == 0
    ev = json.loads((out / "summary.json").read_text())["eval"]
    for prefix in ("", "stream_mean_"):
        for key in ("linear_probe_acc", "authors_probe_acc", "knn_acc", "knn_std_acc"):
            assert 0 <= ev[prefix + key] <= 1, (prefix + key, ev)
    assert "effective_rank_entropy" in ev and "stream_mean_effective_rank" not in ev
    state = load_features(out / FEATURES_FILE)
    assert set(state["train"]) == {"cls", "stream_mean"} and state["train"]["cls"].dtype == torch.float16
    assert state["train"]["cls"].shape[0] == len(state["train_labels"]) == 128
    assert state["test"]["stream_mean"].shape[0] == len(state["test_labels"]) == 64


def test_a_file_that_is_not_a_features_file_is_one_line(tmp_path):
    from dres.eval.features import load_features

    (tmp_path / "notes.pt").write_text("not a torch file")
    torch.save({"train": {"cls": torch.zeros(2, 3)}}, tmp_path / "partial.pt")
    for name in ("notes.pt", "partial.pt"):
        with pytest.raises(ValueError, match=f"{name}: not a features file"):
            load_features(tmp_path / name)


def test_linear_probe_on_raw_features_reads_them_as_given():
    """standardized=False probes the features as given: on features standardised beforehand it is the default
    probe (standardised by the train split) of the raw ones; on features of a tiny scale, which the standardisation
    removes, the raw probe's bias decides and it falls to chance."""
    from dres.eval.probe import standardize

    x, y = _blobs(n=300, d=8, c=3)
    options = {"epochs": 3, "batch_size": 32}
    train, test = standardize(x[:200], x[200:])
    assert (linear_probe(train, y[:200], test, y[200:], standardized=False, **options)
            == linear_probe(x[:200], y[:200], x[200:], y[200:], **options))
    tiny = x * 1e-4
    raw = linear_probe(tiny[:200], y[:200], tiny[200:], y[200:], standardized=False, **options)["linear_probe_acc"]
    standardised = linear_probe(tiny[:200], y[:200], tiny[200:], y[200:], **options)["linear_probe_acc"]
    assert raw < 0.6 < 0.95 < standardised, (raw, standardised)
