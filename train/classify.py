"""Supervised classification with a ViT or a timm ResNet (decayed shortcuts, drop path or
ResidualDroppath), e.g. the CIFAR-10 comparison of standard / drop path / ResidualDroppath training.

    dres-train classify --preset classify_cifar10 --set model.droppath_mode=residual_droppath
    dres-train classify --preset classify_resnet50d_cifar10 --set model.droppath_mode=none
"""

from __future__ import annotations

import torch.nn.functional as F

from dres.train.common import eval_loader, model_kwargs, run_as_command
from dres.train.config import need, need_branches_held


class ClassifyTask:
    name = "classify"
    eval_keys = ("every",)

    model_choice_keys = ("arch",)  # model.* keys that pick one of model_classes

    @staticmethod
    def model_classes() -> list:
        from dres.models import ResNetClassifier, ViTClassifier

        return [ViTClassifier, ResNetClassifier]

    @staticmethod
    def validate(cfg) -> None:
        """The checks of a classifier run's config beyond those of every run (:func:`dres.train.config.validate`)."""
        m, d = cfg.model, cfg.data
        need(cfg, cfg.dist != "fsdp" or m.arch == "vit", "dist",
             f"fsdp shards the transformer models; model.arch={m.arch} keeps its convolution weights channels_last, "
             "which FSDP2 cannot shard: use dist=ddp")
        need_branches_held(cfg, m.arch != "vit")  # the ResNet converter runs a branch again on held weights
        need(cfg, m.num_classes == d.num_classes, "model.num_classes", f"must equal data.num_classes ({d.num_classes})")

    @staticmethod
    def plots(cfg) -> list:
        """The plots a run draws besides t-SNE's and curves.png (config.need_plots asks for those): none."""
        return []

    def build_model(self, cfg):
        from dres.models import ResNetClassifier, ViTClassifier

        cls = ViTClassifier if cfg.model.arch == "vit" else ResNetClassifier
        kwargs = model_kwargs(cls, cfg)
        if cfg.model.droppath_mode == "none":  # the standard arm: no drop path whatever model.drop_path says
            kwargs.update(drop_path=0.0, droppath_mode="drop_path")
        return cls(**kwargs)

    def loss(self, model, batch, cfg):
        logits = model(batch["image"])
        loss = F.cross_entropy(logits.float(), batch["label"], label_smoothing=cfg.optim.label_smoothing)
        acc = (logits.argmax(1) == batch["label"]).float().mean()
        return loss, {"train_acc": acc}

    def evaluate(self, trainer) -> dict:
        model = trainer.full_state_copy()
        if not trainer.main:
            return {}
        model.eval()
        val = eval_loader(trainer, "val", 512)
        if val is None:
            return {}
        correct = n = 0
        loss = 0.0
        with trainer.autocast():
            for b in val.eval_batches(512):
                logits = model(b["image"]).float()
                loss += F.cross_entropy(logits, b["label"], reduction="sum").item()
                correct += (logits.argmax(1) == b["label"]).sum().item()
                n += len(b["label"])
        return {"top1": correct / n, "val_loss": loss / n, **self._final_epoch_training(trainer)}

    @staticmethod
    def _final_epoch_training(trainer) -> dict:
        """Training loss and accuracy of the last epoch, from the run's whole metrics.jsonl (a resumed
        run's log is one history): ``final_epoch_loss``, ``final_epoch_train_acc``."""
        from dres.eval.curves import METRICS_JSONL, final_epoch_means, read_points

        path = trainer.out / METRICS_JSONL
        return final_epoch_means(read_points(path)) if path.exists() else {}

    def curve(self, trainer) -> dict:
        """The eval.every point: top-1 on the val split (already cheap)."""
        res = self.evaluate(trainer)
        return {k: v for k, v in res.items() if not k.startswith("final_epoch_")}


TASK = ClassifyTask()


def load_trained(path, device="cpu"):
    """A trained classifier from a classify run directory (its newest readable checkpoint) or one
    checkpoint of it, in eval mode on ``device``, with the run's config (for its input normalisation).
    Building it leaves the caller's random state as it was."""
    from dres.train.checkpoint import read_run

    model, cfg, _ = read_run(path, TASK.build_model, device=device, task=TASK.name)
    return model, cfg


if __name__ == "__main__":
    run_as_command(TASK.name)
