"""Evaluation pieces: probes, kNN, effective rank (eq. 6), samplers, FID message, PNG grids."""

import json
import math
import sys

import numpy as np
import pytest
import torch

from dres.eval import (VPSDE, FIDUnavailable, dpm_solver, effective_rank, euler_maruyama, frechet_distance,
                       knn_accuracy, linear_probe, load_inception, make_grid, save_grid, tsne_plot)


def _blobs(n=600, d=16, c=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(c, d, generator=g) * 3
    y = torch.randint(0, c, (n,), generator=g)
    return centers[y] + torch.randn(n, d, generator=g), y


def test_linear_probe_and_knn_separate_blobs_and_fail_on_noise():
    x, y = _blobs()
    r = linear_probe(x[:400], y[:400], x[400:], y[400:], epochs=30, batch_size=128)
    assert r["linear_probe_acc"] > 0.95
    assert knn_accuracy(x[:400], y[:400], x[400:], y[400:], k=20) > 0.95
    noise = torch.randn_like(x)
    r = linear_probe(noise[:400], y[:400], noise[400:], y[400:], epochs=30, batch_size=128)
    assert r["linear_probe_acc"] < 0.45  # chance is 0.2


def test_effective_rank_eq6():
    g = torch.Generator().manual_seed(0)
    iso = torch.randn(20000, 8, generator=g)
    assert effective_rank(iso)["effective_rank"] == pytest.approx(8, rel=0.05)
    one = torch.randn(500, 1, generator=g) * torch.randn(1, 8, generator=g)
    assert effective_rank(one)["effective_rank"] == pytest.approx(1.0, abs=1e-3)
    # two equal directions: entropy log 2
    two = torch.cat([torch.randn(20000, 2, generator=g), torch.zeros(20000, 6)], 1)
    assert effective_rank(two)["entropy"] == pytest.approx(math.log(2), rel=0.02)


class _GaussianEps(torch.nn.Module):
    """The exact noise prediction for data x0 ~ N(mu, s^2 I): eps = sigma_t (x - a_t mu) / (a_t^2 s^2 + sigma_t^2)."""

    def __init__(self, sde, mu, s):
        super().__init__()
        self.sde, self.mu, self.s = sde, mu, s

    def forward(self, x, t999):
        t = t999[0].item() / 999
        a, sig = self.sde.alpha_sigma(t)
        return sig * (x - a * self.mu) / (a ** 2 * self.s ** 2 + sig ** 2)


@pytest.mark.parametrize("sampler,steps", [(dpm_solver, 20), (euler_maruyama, 200)])
def test_samplers_recover_gaussian_data_distribution(sampler, steps):
    sde = VPSDE()
    net = _GaussianEps(sde, mu=0.7, s=0.3)
    x = sampler(net, (4000, 1, 2, 2), sde, steps=steps, generator=torch.Generator().manual_seed(0))
    assert x.mean().item() == pytest.approx(0.7, abs=0.03)
    assert x.std().item() == pytest.approx(0.3, abs=0.04)


def test_vpsde_log_snr_inverse():
    sde = VPSDE()
    for t in (1e-3, 0.1, 0.5, 1.0):
        assert sde.t_of_lambda(sde.lam(t)) == pytest.approx(t, rel=1e-6)


def test_fid_needs_weights_path_with_clear_message(tmp_path):
    with pytest.raises(FIDUnavailable, match="no Inception weights given"):
        load_inception("")
    with pytest.raises(FIDUnavailable, match="not found"):
        load_inception(str(tmp_path / "inception.pt"))
    import numpy as np

    mu, cov = np.zeros(3), np.eye(3)
    assert frechet_distance(mu, cov, mu, cov) == pytest.approx(0.0, abs=1e-6)
    assert frechet_distance(mu, cov, mu + 1, cov) == pytest.approx(3.0, abs=1e-6)


def test_grids_and_tsne_png(tmp_path):
    imgs = torch.randint(0, 256, (10, 3, 8, 8), dtype=torch.uint8)
    g = make_grid(imgs, nrow=4, pad=1)
    assert g.shape == (3 * 9 + 1, 4 * 9 + 1, 3)
    assert (g[1:9, 1:9] == imgs[0].permute(1, 2, 0).numpy()).all()
    p = save_grid(imgs, tmp_path / "g.png")
    from PIL import Image

    assert Image.open(p).size == ((8 * 9 + 1) * 8, (2 * 9 + 1) * 8)  # 8 per row, 8x8 tiles enlarged 8x
    x, y = _blobs(200)
    tsne_plot(x, y, tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 1000


# ------------------------------------------------------------------ curves over training, FD

def test_curve_points_keep_the_last_record_of_a_step_and_plot_several_runs(tmp_path):
    from dres.eval import plot_curves, read_points, record_point

    record_point(tmp_path / "run", {"step": 2, "epoch": 0.5, "knn_acc": 0.3})
    record_point(tmp_path / "run", {"step": 4, "epoch": 1.0, "knn_acc": 0.4, "note": "text is not drawn"})
    png = record_point(tmp_path / "run", {"step": 2, "epoch": 0.5, "knn_acc": 0.35})  # a resumed run repeats step 2
    assert [(p["step"], p["knn_acc"]) for p in read_points(tmp_path / "run" / "curves.jsonl")] == [(2, 0.35), (4, 0.4)]
    assert (tmp_path / "run" / "curves.png").stat().st_size > 1000 and png.endswith("curves.png")
    pts = read_points(tmp_path / "run" / "curves.jsonl")
    plot_curves({"a": pts, "b": [{"step": 1, "epoch": 0.2, "knn_acc": 0.1}]}, tmp_path / "two.png", ["knn_acc"])
    assert (tmp_path / "two.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="no numeric metric"):
        plot_curves({"a": [{"step": 1, "epoch": 0.1}]}, tmp_path / "none.png")


def test_probes_trained_together_end_where_lone_probes_end(monkeypatch):
    """linear_probes on (N, H, D): each head's final weights, bias and accuracies are those of linear_probe
    on its slot alone (same first draw, same batches, its own loss and AdamW state), with weight decay."""
    import dres.eval.probe as probe

    trained = []

    class RecordedHeads(probe.LinearHeads):
        def __init__(self, *args):
            super().__init__(*args)
            trained.append(self)

    monkeypatch.setattr(probe, "LinearHeads", RecordedHeads)
    g = torch.Generator().manual_seed(3)
    x, y = _blobs(n=300, d=12, c=4)
    slots = torch.stack([x, torch.randn(300, 12, generator=g), 3 * x.flip(1) + 1], dim=1)  # (300, 3, 12)
    kw = dict(epochs=4, batch_size=64, weight_decay=0.05, num_classes=4, seed=7)
    together = probe.linear_probes(slots[:200], y[:200], slots[200:], y[200:], **kw)
    joint = trained.pop()
    assert joint.weight.shape == (3, 4, 12)
    for h in range(3):
        alone = probe.linear_probe(slots[:200, h], y[:200], slots[200:, h], y[200:], **kw)
        lone = trained.pop()
        assert together[h] == alone
        torch.testing.assert_close(joint.weight[h], lone.weight[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(joint.bias[h], lone.bias[0], rtol=1e-5, atol=1e-6)
    assert together[0]["linear_probe_acc"] > 0.9 and together[1]["linear_probe_acc"] < 0.6  # blobs vs noise


def test_a_series_keeps_its_colour_in_every_panel(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    from dres.eval import plot_curves

    drawn, plot = [], Axes.plot
    monkeypatch.setattr(Axes, "plot", lambda ax, *a, **kw: drawn.append((kw["label"], kw["color"])) or plot(ax, *a, **kw))
    series = {"first": [{"epoch": 1, "acc": 0.5}], "second": [{"epoch": 1, "acc": 0.6, "fd": 30.0}]}
    plot_curves(series, tmp_path / "c.png", ["acc", "fd"])  # "first" has no fd: "second" keeps its colour there
    assert drawn == [("first", "C0"), ("second", "C1"), ("second", "C1")]


def test_seed_bands_are_shaded_and_many_series_get_distinct_colours(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    from dres.eval import plot_curves

    shaded, fill = [], Axes.fill_between
    monkeypatch.setattr(Axes, "fill_between", lambda ax, *a, **kw: shaded.append((a, kw["color"])) or fill(ax, *a, **kw))
    series = {"a": [{"epoch": 1, "acc": 0.5}, {"epoch": 2, "acc": 0.6}], "b": [{"epoch": 1, "acc": 0.4}]}
    plot_curves(series, tmp_path / "c.png", ["acc"], bands={"a": {"acc": ([1, 2], [0.4, 0.5], [0.6, 0.7])}})
    assert shaded == [(([1, 2], [0.4, 0.5], [0.6, 0.7]), "C0")]  # under its own line, in its colour
    scattered, scatter = [], Axes.scatter
    monkeypatch.setattr(Axes, "scatter", lambda ax, *a, **kw: scattered.append((a, kw["color"])) or scatter(ax, *a, **kw))
    plot_curves(series, tmp_path / "d.png", ["acc"], dots={"b": {"acc": ([1, 1], [0.3, 0.5])}})
    assert scattered == [(([1, 1], [0.3, 0.5]), "C1")]  # the seeds as points, in their series' colour
    drawn, plot = [], Axes.plot
    monkeypatch.setattr(Axes, "plot", lambda ax, *a, **kw: drawn.append(kw["color"]) or plot(ax, *a, **kw))
    plot_curves({f"s{i}": [{"epoch": 1, "acc": i}] for i in range(12)}, tmp_path / "many.png", ["acc"])
    assert len(set(drawn)) == 12  # the default cycle would repeat after ten


def test_knn_runs_on_the_features_device():
    x, y = _blobs()
    acc = knn_accuracy(x[:400].double(), y[:400], x[400:].double(), y[400:], k=5)
    assert acc == knn_accuracy(x[:400], y[:400], x[400:], y[400:], k=5) and acc > 0.95


def test_quickstart_records_curves_every_eval_every_steps(tmp_path):
    """MAE on the digits with eval.every: one point per eval.every steps and one at the end, with
    the probe / kNN / effective-rank keys, a PNG beside them, the final full evaluation kept."""
    import json

    from dres.train import cli

    out = tmp_path / "qs"
    assert cli.main(["mae", "--preset", "quickstart", "--out", str(out)] + sum([["--set", o] for o in [
        "steps=7", "eval.every=3", "log.every=7", "model.depth=2", "model.decoder_depth=1", "batch_size=64",
        "eval.probe_epochs=2", "eval.curve_probe_epochs=2", "eval.recon=false", "log.progress=false",
        "log.tensorboard=false", "optim.warmup_steps=1"]], [])) == 0
    points = [json.loads(l) for l in (out / "curves.jsonl").read_text().splitlines()]
    assert [p["step"] for p in points] == [3, 6, 7]
    for p in points:
        assert {"epoch", "linear_probe_acc", "linear_probe_train_acc", "knn_acc", "effective_rank"} <= set(p)
        assert 0 <= p["knn_acc"] <= 1 and p["effective_rank"] >= 1
    assert (out / "curves.png").stat().st_size > 1000
    final = json.loads((out / "summary.json").read_text())["eval"]
    assert {"linear_probe_acc", "knn_acc", "effective_rank"} <= set(final)


TINY_DIGITS_8 = ["data.name=digits", "data.img_size=8", "data.in_chans=1", "data.aug=none", "model.img_size=8",
                 "model.in_chans=1", "model.embed_dim=32", "model.depth=2", "model.num_heads=2",
                 "log.progress=false", "log.tensorboard=false", "optim.warmup_steps=1", "compile=false"]


def _tiny_classifier(out):
    from dres.train import cli

    assert cli.main(["classify", "--preset", "classify_cifar10", "--out", str(out)] + sum([["--set", o] for o in
                    TINY_DIGITS_8 + ["data.mean=[0.3]", "data.std=[0.4]", "model.patch_size=4", "batch_size=64",
                                     "steps=4"]], [])) == 0
    return out


def test_classifier_frechet_distance_of_a_trained_dres_classifier(tmp_path):
    import numpy as np

    from dres.eval import ClassifierFeatures, classifier_frechet_distance
    from dres.train.classify import load_trained

    run = _tiny_classifier(tmp_path / "clf")
    model, cfg = load_trained(run)
    ckpt = sorted((run / "checkpoints").glob("step_*"))[-1]
    again, _ = load_trained(ckpt)  # one checkpoint of the run reads the same weights
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values())
               if torch.is_tensor(a))
    state = torch.get_rng_state()
    load_trained(run)
    assert torch.equal(state, torch.get_rng_state())  # building it leaves the caller's random state alone
    net = ClassifierFeatures(model, cfg.data.mean, cfg.data.std)
    g = torch.Generator().manual_seed(0)
    real = torch.randint(0, 256, (300, 1, 8, 8), generator=g, dtype=torch.uint8)
    assert net(real[:5]).shape == (5, 32)
    # pre_logits is the head's input: the classifier's logits from it
    x = (real[:5].float() / 255 - 0.3) / 0.4
    torch.testing.assert_close(model.head(model.pre_logits(x)), model(x))
    assert classifier_frechet_distance(net, real, real) == pytest.approx(0.0, abs=1e-6)
    other = (real.float() * 0.3).to(torch.uint8)
    fd = classifier_frechet_distance(net, other, real)
    from dres.eval.fid import batched_features, frechet_distance, stats

    f1, f2 = batched_features(net, other), batched_features(net, real)
    assert fd == pytest.approx(frechet_distance(*stats(f1), *stats(f2))) and fd > 0
    assert np.isfinite(fd)
    with pytest.raises(FileNotFoundError, match="neither a dres run folder nor a checkpoint"):
        load_trained(tmp_path)


def _tiny_uvit_run(tmp_path, extra):
    """A 4-step U-ViT run on digits with curve points at steps 2 and 4 and the classifier FD of 40 samples."""
    from dres.train import cli

    run = _tiny_classifier(tmp_path / "clf")
    out = tmp_path / "uvit"
    assert cli.main(["uvit", "--preset", "uvit_cifar10", "--out", str(out)] + sum([["--set", o] for o in
                    TINY_DIGITS_8 + ["data.mean=[0.5]", "data.std=[0.5]", "model.patch_size=2", "batch_size=32",
                                     "steps=4", "eval.every=2", "eval.steps=2", "eval.n_samples=8",
                                     "eval.probe_epochs=2", "eval.curve_probe_epochs=2", "eval.max_train=128",
                                     "eval.max_test=64", "eval.fid_samples=40", f"eval.fd_classifier={run}"]
                    + extra], [])) == 0
    return out


def test_uvit_evaluation_reports_fd_cifar_classifier(tmp_path, capsys):
    import json

    from dres.train.config import ConfigError, build_config

    out = _tiny_uvit_run(tmp_path, ["log.progress=true"])
    ev = json.loads((out / "summary.json").read_text())["eval"]
    assert ev["fd_cifar_classifier_dpm2"] > 0 and not any(k.startswith("fid") for k in ev)
    # the noise reference: the sampler's starting noise in the same features, a different distance
    assert ev["fd_noise_cifar_classifier"] > 0 and ev["fd_noise_cifar_classifier"] != ev["fd_cifar_classifier_dpm2"]
    assert (out / ev["samples_png"].split("/")[-1]).exists()
    assert {"probe_t0.1_linear_probe_acc", "probe_t0.1_knn_acc", "probe_t0.1_effective_rank"} <= set(ev)
    points = [json.loads(l) for l in (out / "curves.jsonl").read_text().splitlines()]
    assert [p["step"] for p in points] == [2, 4] and "probe_t0.1_linear_probe_acc" in points[0]
    printed = capsys.readouterr()
    assert "FID skipped: no Inception weights given" in printed.out
    assert "FID samples" in printed.err and "40/40" in printed.err  # the sampling shows its progress
    with pytest.raises(ConfigError, match="eval.fd_classifier' must be a classify run directory"):
        build_config("uvit", "uvit_cifar10", [f"eval.fd_classifier={tmp_path / 'missing'}"])


def test_uvit_fd_over_sample_draws_with_the_real_floor_and_along_training(tmp_path):
    """eval.fd_draws draws, their mean as fd_cifar_classifier (each draw and the sd beside it); the real-vs-real
    floor (train against test images) below the noise reference; eval.curve_fd_samples puts a classifier FD
    on every curve point."""
    import json
    import statistics

    out = _tiny_uvit_run(tmp_path, ["eval.fd_draws=2", "eval.fd_real_floor=true", "eval.curve_fd_samples=16",
                                    "log.progress=false"])
    ev = json.loads((out / "summary.json").read_text())["eval"]
    draws = [ev["fd_cifar_classifier_dpm2_draw0"], ev["fd_cifar_classifier_dpm2_draw1"]]
    assert draws[0] != draws[1] and ev["fd_cifar_classifier_dpm2"] == pytest.approx(statistics.fmean(draws))
    assert ev["fd_cifar_classifier_dpm2_sd"] == pytest.approx(statistics.stdev(draws))
    assert 0 < ev["fd_real_cifar_classifier"] < ev["fd_noise_cifar_classifier"]
    points = [json.loads(l) for l in (out / "curves.jsonl").read_text().splitlines()]
    assert all(p["fd_cifar_classifier_curve"] > 0 for p in points) and len(points) == 2


def _run_dir(tmp_path, overrides=()):
    from dres.train.config import build_config, save_config

    run = tmp_path / "run"
    run.mkdir()
    save_config(build_config("mae", "quickstart", list(overrides)), run / "config.yaml")
    return run


@pytest.mark.parametrize("args,msg", [
    (["--set", "eval.tsne=true"], "eval.tsne=true (t-SNE plot) needs matplotlib, which is not installed: "
                                  "pip install 'dres[plots]' (or set eval.tsne=false)"),
    (["--set", "eval.tsne=true", "--set", "eval.every=5"],
     "eval.tsne=true (t-SNE plot) and eval.every=5 (curves.png) need matplotlib, which is not installed: "
     "pip install 'dres[plots]' (or set eval.tsne=false and eval.every=0)"),
])
def test_plots_without_matplotlib_are_one_line_naming_the_extra(args, msg, tmp_path, capsys, monkeypatch):
    from dres.train import cli

    run = _run_dir(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed: importing it fails
    assert cli.eval_main([str(run)] + args) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"dres-eval: error: {msg}", err
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml"]  # refused before anything ran
    assert cli.main(["mae", "--preset", "quickstart", "--out", str(tmp_path / "new")] + args) == 2
    assert capsys.readouterr().err.strip() == f"dres-train: error: {msg}" and not (tmp_path / "new").exists()
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'dres\[plots\]'"):
        tsne_plot(torch.randn(20, 4), torch.arange(20) % 2, tmp_path / "t.png")


def test_pictures_are_labelled_and_tensorboard_gets_images_hparams_and_curve_points(tmp_path, monkeypatch):
    """The recon grid names its columns, the t-SNE title says run / model / step / scores, curves.png
    has the training loss, and TensorBoard holds the images, the hyper-parameters and the curve points."""
    pytest.importorskip("tensorboard")
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import dres.train.mae
    from dres.eval import viz
    from dres.train import cli

    titles = []
    monkeypatch.setattr(dres.train.mae, "tsne_plot", lambda *a, **k: titles.append(k["title"]) or viz.tsne_plot(*a, **k))
    out = tmp_path / "qs"
    assert cli.main(["mae", "--preset", "quickstart", "--out", str(out)] + sum([["--set", o] for o in [
        "steps=4", "eval.every=2", "log.every=2", "model.depth=2", "model.decoder_depth=1", "batch_size=64",
        "eval.probe_epochs=2", "eval.curve_probe_epochs=2", "eval.tsne=true", "eval.max_test=60",
        "log.progress=false", "optim.warmup_steps=1"]], [])) == 0
    summary = json.loads((out / "summary.json").read_text())["eval"]
    # a white strip of column names above the 8 x 4 tiles of 16 px enlarged 4x
    recon = np.asarray(Image.open(summary["recon_png"]))
    assert recon.shape[0] > 8 * 65 + 1 and (recon[:3] == 255).all() and (recon[3:12] < 128).any()
    assert titles[0].startswith("qs: MAE official, alpha_min 0.6, step 4\nmean features of block -1 on the val split; "
                                "linear probe 0.") and ", kNN 0." in titles[0]
    events = EventAccumulator(str(out / "tb"), size_guidance={"images": 0, "scalars": 0, "tensors": 0}).Reload()
    tags = events.Tags()
    assert {"eval/recon", "eval/tsne"} <= set(tags["images"])
    assert [e.step for e in events.Scalars("curve/knn_acc")] == [2, 4]
    assert {"eval/knn_acc", "train/loss"} <= set(tags["scalars"])
    assert "_hparams_/session_start_info" in events.PluginTagToContent("hparams")
    assert "hparams/knn_acc" in tags["scalars"] and "hparams/final_loss" in tags["scalars"]


def test_curves_png_draws_the_training_loss_first(tmp_path, monkeypatch):
    from dres.eval import curves

    drawn = {}
    monkeypatch.setattr(curves, "plot_curves", lambda series, path, keys, x, title: drawn.update(
        series=series, keys=keys, x=x) or str(path))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "epoch": s / 10, "loss": 1 / s, "lr": 0.1})
                                                    + "\n" for s in range(1, 7)))
    curves.record_point(tmp_path, {"step": 3, "epoch": 0.3, "knn_acc": 0.5})
    assert drawn["keys"] == ["loss", "knn_acc"] and drawn["x"] == "epoch"
    points = drawn["series"][tmp_path.name]
    assert [p["step"] for p in points if "loss" in p] == list(range(1, 7))
    assert [p for p in points if "knn_acc" in p] == [{"step": 3, "epoch": 0.3, "knn_acc": 0.5}]
    assert all("lr" not in p for p in points)


def test_tensorboard_missing_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    from dres.train.runlog import open_tensorboard

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    lines = []
    assert open_tensorboard(tmp_path / "tb", str, lines.append) is None
    assert len(lines) == 1 and "pip install 'dres[tensorboard]'" in lines[0] and "log.tensorboard=false" in lines[0]
