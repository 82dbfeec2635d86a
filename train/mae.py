"""MAE pretraining (baseline / official / paper variants, decayed encoder shortcuts) and its
evaluation: linear probe, kNN, effective rank, t-SNE, reconstruction grid.

    dres-train mae --preset quickstart
    python -m dres.train.mae --preset mae_cifar10 --set compile=true
"""

from __future__ import annotations

import sys

import torch

from dres.train.common import eval_loader, features, model_kwargs


class MAETask:
    name = "mae"

    def build_model(self, cfg):
        from dres.models import MAE

        return MAE(**model_kwargs(MAE, cfg))

    def loss(self, model, batch, cfg):
        loss, _, _ = model(batch["image"])
        return loss, {}

    def evaluate(self, tr) -> dict:
        from dres.eval import effective_rank, knn_accuracy, linear_probe, mae_reconstruction_grid, tsne_plot

        cfg, e = tr.cfg, tr.cfg.eval
        model = tr.full_state_copy()
        if not tr.main:
            return {}
        model.eval()
        res = {}
        d = cfg.data
        mean, std = (d.mean, d.std) if d.normalize else (None, None)
        val = eval_loader(tr, "val", 256)
        if e.recon and val is not None:
            imgs = next(iter(val.eval_batches(8)))["image"]
            torch.manual_seed(cfg.seed)  # the same masks every time, for comparable grids
            with tr.autocast():
                path = mae_reconstruction_grid(model, imgs, tr.out / f"recon_step{tr.step}.png", mean, std)
            res["recon_png"] = path
        if not (e.probe or e.knn or e.effective_rank or e.tsne):
            return res
        train = eval_loader(tr, "train", 256)
        if train is None or val is None:
            return res

        def fn(x):
            return model.forward_features(x, e.layer)[e.feature]

        xtr, ytr = features(tr, fn, train, e.max_train)
        xte, yte = features(tr, fn, val, e.max_test)
        if e.probe:
            res.update(linear_probe(xtr, ytr, xte, yte, epochs=e.probe_epochs, lr=e.probe_lr, batch_size=e.probe_batch,
                                    weight_decay=e.probe_wd, num_classes=d.num_classes, seed=cfg.seed, device=tr.device))
        if e.knn:
            res["knn_acc"] = knn_accuracy(xtr, ytr, xte, yte, k=e.knn_k, num_classes=d.num_classes)
        if e.effective_rank:
            cls = xtr if e.feature == "cls" else features(tr, lambda x: model.forward_features(x, e.layer)["cls"],
                                                          train, e.max_train)[0]
            res["effective_rank"] = effective_rank(cls)["effective_rank"]
        if e.tsne:
            res["tsne_png"] = tsne_plot(xte, yte, tr.out / f"tsne_step{tr.step}.png", seed=cfg.seed)
        return res


TASK = MAETask()


def main(argv=None):
    from dres.train.cli import main as cli_main

    return cli_main(["mae"] + list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
