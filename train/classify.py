"""Supervised classification with a ViT or a timm ResNet (decayed shortcuts, drop path or
ResidualDroppath), e.g. the CIFAR-10 comparison of standard / drop path / ResidualDroppath training.

    dres-train classify --preset classify_cifar10 --set model.droppath_mode=residual_droppath
    dres-train classify --preset classify_resnet50d_cifar10 --set model.droppath_mode=none
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from dres.train.common import eval_loader, model_kwargs


class ClassifyTask:
    name = "classify"

    def build_model(self, cfg):
        from dres.models import ResNetClassifier, ViTClassifier

        cls = ViTClassifier if cfg.model.arch == "vit" else ResNetClassifier
        kwargs = model_kwargs(cls, cfg)
        if cfg.model.droppath_mode == "none":  # the standard arm: no drop path whatever model.drop_path says
            kwargs.update(drop_path=0.0, droppath_mode="drop_path")
        return cls(**kwargs)

    def loss(self, model, batch, cfg):
        logits = model(batch["image"])
        loss = F.cross_entropy(logits.float(), batch["label"])
        acc = (logits.argmax(1) == batch["label"]).float().mean()
        return loss, {"train_acc": acc}

    def evaluate(self, tr) -> dict:
        model = tr.full_state_copy()
        if not tr.main:
            return {}
        model.eval()
        val = eval_loader(tr, "val", 512)
        if val is None:
            return {}
        correct = n = 0
        loss = 0.0
        with tr.autocast():
            for b in val.eval_batches(512):
                logits = model(b["image"]).float()
                loss += F.cross_entropy(logits, b["label"], reduction="sum").item()
                correct += (logits.argmax(1) == b["label"]).sum().item()
                n += len(b["label"])
        return {"top1": correct / n, "val_loss": loss / n}


TASK = ClassifyTask()


def main(argv=None):
    from dres.train.cli import main as cli_main

    return cli_main(["classify"] + list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
