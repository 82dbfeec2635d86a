"""MAE pretraining (baseline / official / paper variants, decayed encoder shortcuts) and its
evaluation: linear probe, kNN, effective rank, t-SNE, reconstruction grid.

    dres-train mae --preset quickstart
    python -m dres.train.mae --preset mae_cifar10 --set compile=true
"""

from __future__ import annotations

import functools

import torch

from dres.eval import mae_reconstruction_grid, tsne_plot
from dres.eval.features import FEATURES_FILE, features_state, score_feature_kinds
from dres.train.common import eval_loader, features, model_kwargs, progress, run_as_command
from dres.train.config import need, need_branches_held, need_no_label_smoothing
from dres.train.rundir import publish


class MAETask:
    name = "mae"
    eval_keys = ("probe", "probe_epochs", "probe_lr", "probe_batch", "probe_wd", "knn", "knn_k", "feature", "layer",
                 "effective_rank", "tsne", "recon", "max_train", "max_test", "every", "curve_probe_epochs",
                 "also_features", "authors_probe", "knn_standardized", "save_features")

    model_choice_keys = ()  # model.* keys that pick one of model_classes

    @staticmethod
    def model_classes() -> list:
        from dres.models import MAE

        return [MAE]

    @staticmethod
    def validate(cfg) -> None:
        """The checks of an MAE run's config beyond those of every run (:func:`dres.train.config.validate`)."""
        m = cfg.model
        need(cfg, m.decoder_num_heads > 0 and m.decoder_embed_dim % m.decoder_num_heads == 0, "model.decoder_num_heads",
             f"must divide model.decoder_embed_dim ({m.decoder_embed_dim})")
        patches = (m.img_size // m.patch_size) ** 2
        visible = int(patches * (1 - m.mask_ratio))  # MAE.random_masking's len_keep
        # the loss is over masked patches only: none masked is a loss of 0 that trains nothing
        need(cfg, 0 < visible < patches, "model.mask_ratio", f"must mask at least one of the model's {patches} "
             "patches and leave one visible (0 masks none: the loss, over masked patches only, is 0 and nothing "
             "trains)")
        need_branches_held(cfg, False)
        need_no_label_smoothing(cfg)

    @staticmethod
    def plots(cfg) -> list:
        """The plots a run draws besides t-SNE's and curves.png (config.need_plots asks for those): none."""
        return []

    def build_model(self, cfg):
        from dres.models import MAE

        return MAE(**model_kwargs(MAE, cfg))

    def loss(self, model, batch, cfg):
        loss, _, _ = model(batch["image"])
        return loss, {}

    def _representation(self, trainer, model, probe_epochs, tsne=False, final=False) -> dict:
        """Probe / kNN / effective rank of the encoder's features (eval.layer; eval.feature unprefixed, each kind
        of eval.also_features prefixed ``<kind>_``, all from one forward; the rank of the class token) on the
        train and val splits; in the ``final`` evaluation the authors' probe where eval.authors_probe and the
        features kept where eval.save_features; a t-SNE plot of the val features when ``tsne``; {} when either
        split is missing."""
        cfg, e = trainer.cfg, trainer.cfg.eval
        if not (e.probe or e.knn or e.effective_rank or tsne):
            return {}
        train, val = eval_loader(trainer, "train", 256), eval_loader(trainer, "val", 256)
        if train is None or val is None:
            return {}
        kinds = [e.feature] + e.extra_feature_kinds()
        read = kinds + (["cls"] if e.effective_rank and "cls" not in kinds else [])  # the rank is the cls tokens'

        def fn(x):  # every kind of one forward side by side (each embed_dim wide)
            out = model.forward_features(x, e.layer)
            return torch.cat([out[k] for k in read], dim=1)

        xtr, ytr = features(trainer, fn, train, e.max_train)
        xte, yte = features(trainer, fn, val, e.max_test)
        xtr, xte = dict(zip(read, xtr.chunk(len(read), dim=1))), dict(zip(read, xte.chunk(len(read), dim=1)))
        if final and e.save_features:
            state = features_state(xtr, ytr, xte, yte, step=trainer.step, layer=e.layer, primary=e.feature)
            publish(trainer.out / FEATURES_FILE, lambda tmp: torch.save(state, tmp))
        res = score_feature_kinds({k: xtr[k] for k in kinds}, ytr, {k: xte[k] for k in kinds}, yte,
                                  primary=e.feature, rank_features=xtr.get("cls"), probe=e.probe, knn=e.knn,
                                  rank=e.effective_rank, authors_probe=final and e.authors_probe,
                                  knn_standardized=e.knn_standardized, probe_epochs=probe_epochs,
                                  probe_lr=e.probe_lr, probe_batch=e.probe_batch, probe_wd=e.probe_wd,
                                  knn_k=e.knn_k, num_classes=cfg.data.num_classes, seed=cfg.seed,
                                  device=trainer.device,
                                  progress=functools.partial(progress, enabled=trainer.main and cfg.log.progress))
        if tsne:
            m = cfg.model
            scores = ", ".join(f"{name} {res[k]:.3f}" for k, name in (("linear_probe_acc", "linear probe"),
                                                                       ("knn_acc", "kNN")) if k in res)
            title = (f"{trainer.out.name}: MAE {m.variant}, alpha_min {m.alpha_min}, step {trainer.step}\n"
                     f"{e.feature} features of block {e.layer} on the val split" + (f"; {scores}" if scores else ""))
            res["tsne_png"] = tsne_plot(xte[e.feature], yte, trainer.out / f"tsne_step{trainer.step}.png", seed=cfg.seed,
                                        title=title)
        return res

    def curve(self, trainer) -> dict:
        """The eval.every point: the representation metrics with an eval.curve_probe_epochs probe."""
        model = trainer.full_state_copy()
        if not trainer.main:
            return {}
        model.eval()
        return self._representation(trainer, model, trainer.cfg.eval.curve_probe_epochs)

    def evaluate(self, trainer) -> dict:
        cfg, e = trainer.cfg, trainer.cfg.eval
        model = trainer.full_state_copy()
        if not trainer.main:
            return {}
        model.eval()
        res = {}
        d = cfg.data
        mean, std = (d.mean, d.std) if d.normalize else (None, None)
        val = eval_loader(trainer, "val", 256)
        if e.recon and val is not None:
            imgs = next(iter(val.eval_batches(8)))["image"]
            torch.manual_seed(cfg.seed)  # the same masks every time, for comparable grids
            with trainer.autocast():
                path = mae_reconstruction_grid(model, imgs, trainer.out / f"recon_step{trainer.step}.png", mean, std)
            res["recon_png"] = path
        res.update(self._representation(trainer, model, e.probe_epochs, tsne=e.tsne, final=True))
        return res


TASK = MAETask()


if __name__ == "__main__":
    run_as_command(TASK.name)
