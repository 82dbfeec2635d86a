"""U-ViT diffusion training (continuous VP-SDE, noise prediction, EMA) and evaluation: a sample
grid (DPM-Solver or Euler-Maruyama), a linear probe (and kNN, effective rank) of features at a chosen
block and noise level, FID when the Inception weights are given, and ``fd_cifar_classifier`` (the
Frechet distance in a dres-trained classifier's features, not comparable to FID) when
``eval.fd_classifier`` names a classify run, beside ``fd_noise_cifar_classifier``: the same distance for the
sampler's starting noise, which samples of a trained model must be far below.

    dres-train uvit --preset uvit_cifar10
"""

from __future__ import annotations

import functools
import statistics

import torch

from dres.eval import classifier_frechet_distance
from dres.train.common import cap, eval_loader, features, model_kwargs, progress, run_as_command
from dres.train.config import need, need_branches_held, need_no_label_smoothing


class UViTTask:
    name = "uvit"
    eval_keys = ("probe", "probe_epochs", "probe_lr", "probe_batch", "probe_wd", "knn_k", "max_train", "max_test",
                 "sampler", "steps", "n_samples", "probe_block", "probe_t", "probe_grid_blocks", "probe_grid_ts",
                 "fid_inception", "fid_samples", "fd_classifier", "fd_draws", "fd_real_floor", "curve_fd_samples",
                 "every", "curve_probe_epochs")

    model_choice_keys = ()  # model.* keys that pick one of model_classes

    @staticmethod
    def model_classes() -> list:
        from dres.models import UViT

        return [UViT]

    @staticmethod
    def validate(cfg) -> None:
        """The checks of a U-ViT run's config beyond those of every run (:func:`dres.train.config.validate`)."""
        m, d = cfg.model, cfg.data
        n_blocks = 2 * (m.depth // 2) + 1
        need(cfg, all(b == int(b) and 0 <= b < n_blocks for b in cfg.eval.probe_grid_blocks), "eval.probe_grid_blocks",
             f"must be block indices in [0, {n_blocks - 1}] (model.depth={m.depth})")
        need_branches_held(cfg, False)
        need(cfg, 0 <= m.num_classes <= d.num_classes, "model.num_classes",
             f"must be 0 (unconditional) or at most data.num_classes ({d.num_classes})")
        need_no_label_smoothing(cfg)

    @staticmethod
    def plots(cfg) -> list:
        """The plots a run draws besides t-SNE's and curves.png (config.need_plots asks for those): the probe grid's,
        as ``(what, the setting that turns it off)``."""
        grid = ("eval.probe_grid_blocks (probe_grid.png)", "eval.probe_grid_blocks=[]")
        return [grid] if cfg.eval.probe_grid_blocks else []

    def __init__(self):
        from dres.eval import VPSDE

        self.sde = VPSDE()

    def build_model(self, cfg):
        from dres.models import UViT

        return UViT(**model_kwargs(UViT, cfg))

    def _labels(self, cfg, batch):
        return batch["label"] if cfg.model.num_classes > 0 else None

    def loss(self, model, batch, cfg):
        from dres.eval import noise_prediction_loss

        return noise_prediction_loss(model, batch["image"], self.sde, y=self._labels(cfg, batch)), {}

    def _probe(self, trainer, model, probe_epochs, blocks=None, t=None) -> list[dict]:
        """Probe / kNN / effective rank of the features after each of ``blocks`` (default [eval.probe_block]; -1:
        the mid block) at noise level ``t`` (default eval.probe_t), one pass over the splits for all of them and
        their linear probes trained together; [] when a split is missing."""
        from dres.eval import representation_metrics_per_head

        cfg, e = trainer.cfg, trainer.cfg.eval
        train, val = eval_loader(trainer, "train", 256), eval_loader(trainer, "val", 256)
        if not e.probe or train is None or val is None:
            return []
        blocks = [b if b >= 0 else model.num_in_blocks for b in (blocks or [e.probe_block])]
        t = e.probe_t if t is None else t

        def fn(img):
            # a fixed noise draw per batch position keeps the probe deterministic
            gen = torch.Generator(device=img.device).manual_seed(cfg.seed + 17)
            noise = torch.randn(img.shape, generator=gen, device=img.device)
            ts = torch.full((img.shape[0],), t, device=img.device)
            return model.features_at(self.sde.perturb(img, ts, noise), ts * 999, blocks)

        xtr, ytr = features(trainer, fn, train, e.max_train)
        xte, yte = features(trainer, fn, val, e.max_test)
        return representation_metrics_per_head(xtr, ytr, xte, yte, probe_epochs=probe_epochs, probe_lr=e.probe_lr,
                                               probe_batch=e.probe_batch, probe_wd=e.probe_wd, knn_k=e.knn_k,
                                               num_classes=cfg.data.num_classes, seed=cfg.seed, device=trainer.device,
                                               progress=functools.partial(progress,
                                                                          enabled=trainer.main and cfg.log.progress))

    def _probe_at_default(self, trainer, model, probe_epochs) -> dict:
        """:meth:`_probe` at eval.probe_block / eval.probe_t, keys prefixed ``probe_t<t>_``."""
        found = self._probe(trainer, model, probe_epochs)
        return {f"probe_t{trainer.cfg.eval.probe_t}_" + k: v for k, v in (found[0] if found else {}).items()}

    def _probe_grid(self, trainer, model) -> dict:
        """Linear-probe and kNN accuracy at every (eval.probe_grid_blocks x eval.probe_grid_ts) pair (one pass over
        the splits a noise level), and its picture (probe_grid.png)."""
        from dres.eval.viz import probe_grid_plot

        e = trainer.cfg.eval
        blocks = [int(block) for block in e.probe_grid_blocks]
        rows = []
        for t in e.probe_grid_ts:
            found = self._probe(trainer, model, e.probe_epochs, blocks, t)
            if not found:
                return {}
            rows += [{"block": block, "t": t, "linear_probe_acc": r["linear_probe_acc"], "knn_acc": r.get("knn_acc")}
                     for block, r in zip(blocks, found)]
        best = max(rows, key=lambda r: r["linear_probe_acc"])
        title = (f"U-ViT probe grid, step {trainer.step}: linear-probe accuracy "
                 f"(best {best['linear_probe_acc']:.3f} at block {best['block']}, t {best['t']:g})")
        return {"probe_grid": rows,
                "probe_grid_png": probe_grid_plot(rows, trainer.out / f"probe_grid_step{trainer.step}.png", title)}

    def curve(self, trainer) -> dict:
        """The eval.every point: the feature probe with an eval.curve_probe_epochs linear head, and with
        eval.curve_fd_samples the classifier Frechet distance of that many samples (does it rank the points?)."""
        model = trainer.full_state_copy()  # EMA weights when kept
        if not trainer.main:
            return {}
        e = trainer.cfg.eval
        res = self._probe_at_default(trainer, model.eval(), e.curve_probe_epochs)
        if e.curve_fd_samples and e.fd_classifier:
            real = self._real_images(trainer, "val", e.fid_samples)
            if real is not None:
                fake = self._fake_images(trainer, model, e.curve_fd_samples, torch.Generator(device=trainer.device)
                                         .manual_seed(trainer.cfg.seed))
                res["fd_cifar_classifier_curve"] = classifier_frechet_distance(
                    self._fd_features(trainer), fake, real, trainer.device)
        return res

    def _real_images(self, trainer, split, n):
        """The first ``n`` images of ``split`` as uint8, or None without the split."""
        from dres.eval import to_uint8

        d = trainer.cfg.data
        loader = eval_loader(trainer, split, 500)
        if loader is None:
            return None
        mean, std = (d.mean, d.std) if d.normalize else (None, None)
        return torch.cat([to_uint8(b["image"], mean, std) for b in cap(loader.eval_batches(500), n)])[:n]

    def _fake_images(self, trainer, model, n, generator=None):
        """``n`` samples of the eval.sampler as uint8, in batches of 500 (``generator``: the draw)."""
        from dres.eval import dpm_solver, euler_maruyama, to_uint8

        d, e = trainer.cfg.data, trainer.cfg.eval
        mean, std = (d.mean, d.std) if d.normalize else (None, None)
        sampler = dpm_solver if e.sampler == "dpm" else euler_maruyama
        bar = progress(total=n, desc="FID samples", unit="img", enabled=trainer.main and trainer.cfg.log.progress)
        fakes = []
        for k in range(0, n, 500):
            fakes.append(to_uint8(self._sample(trainer, model, min(500, n - k), sampler, generator), mean, std))
            bar.update(len(fakes[-1]))
        bar.close()
        return torch.cat(fakes)

    def _fd_features(self, trainer):
        """The eval.fd_classifier's penultimate features, for the classifier Frechet distance."""
        from dres.eval import ClassifierFeatures
        from dres.train.classify import load_trained

        clf, ccfg = load_trained(trainer.cfg.eval.fd_classifier, trainer.device)
        cd = ccfg.data
        c = cd.in_chans
        return ClassifierFeatures(clf, cd.mean[:c] if cd.normalize else [0.0] * c,
                                  cd.std[:c] if cd.normalize else [1.0] * c, autocast=trainer.autocast)

    def _sample(self, trainer, model, n, sampler, generator=None):
        cfg, e, d = trainer.cfg, trainer.cfg.eval, trainer.cfg.data
        y = (torch.arange(n, device=trainer.device) % cfg.model.num_classes) if cfg.model.num_classes > 0 else None
        with trainer.autocast():
            return sampler(model, (n, d.in_chans, d.img_size, d.img_size), self.sde, steps=e.steps, y=y,
                           device=trainer.device, generator=generator)

    def evaluate(self, trainer) -> dict:
        from dres.eval import FIDUnavailable, dpm_solver, euler_maruyama, save_grid, to_uint8
        from dres.eval import fid as fid_fn

        cfg, e, d = trainer.cfg, trainer.cfg.eval, trainer.cfg.data
        model = trainer.full_state_copy()  # EMA weights when kept
        if not trainer.main:
            return {}
        model.eval()
        res = {}
        mean, std = (d.mean, d.std) if d.normalize else (None, None)
        g = torch.Generator(device=trainer.device).manual_seed(cfg.seed)
        sampler = dpm_solver if e.sampler == "dpm" else euler_maruyama
        x = self._sample(trainer, model, e.n_samples, sampler, g)
        res["samples_png"] = save_grid(to_uint8(x, mean, std), trainer.out / f"samples_step{trainer.step}_{e.sampler}{e.steps}.png")
        res.update(self._probe_at_default(trainer, model, e.probe_epochs))
        if e.probe_grid_blocks:
            res.update(self._probe_grid(trainer, model))
        if not e.fid_inception:
            trainer.log("[dres] FID skipped: no Inception weights given (set eval.fid_inception=/path/to/"
                   "inception-2015-12-05.pt, the TorchScript FID Inception of StyleGAN2-ADA/EDM)")
        if not (e.fid_inception or e.fd_classifier):
            return res
        real = self._real_images(trainer, "val", e.fid_samples)
        if real is None:
            return res
        # eval.fd_draws independent sample draws (draw k from seed + k); FID reads the first
        fakes = [self._fake_images(trainer, model, e.fid_samples,
                                   torch.Generator(device=trainer.device).manual_seed(cfg.seed + k))
                 for k in range(e.fd_draws if e.fd_classifier else 1)]
        fake = fakes[0]
        if e.fd_classifier:
            net = self._fd_features(trainer)
            name = f"fd_cifar_classifier_{e.sampler}{e.steps}"
            fds = [classifier_frechet_distance(net, f, real, trainer.device) for f in fakes]
            res[name] = sum(fds) / len(fds)
            if len(fds) > 1:
                res.update({f"{name}_draw{k}": v for k, v in enumerate(fds)})
                res[f"{name}_sd"] = statistics.stdev(fds)
            # the sampler's own starting point, as images: the distance a model that learnt nothing would reach
            noise = to_uint8(torch.randn(fake.shape, generator=torch.Generator().manual_seed(cfg.seed)), mean, std)
            res["fd_noise_cifar_classifier"] = classifier_frechet_distance(net, noise, real, trainer.device)
            if e.fd_real_floor:  # real against real: train images against the test images, the floor
                train_real = self._real_images(trainer, "train", e.fid_samples)
                if train_real is not None:
                    res["fd_real_cifar_classifier"] = classifier_frechet_distance(net, train_real, real, trainer.device)
        if e.fid_inception:
            try:
                res[f"fid_{e.sampler}{e.steps}"] = fid_fn(e.fid_inception, fake, real, device=trainer.device)
            except FIDUnavailable as err:
                trainer.log(f"[dres] {err}")
        return res


TASK = UViTTask()


if __name__ == "__main__":
    run_as_command(TASK.name)
