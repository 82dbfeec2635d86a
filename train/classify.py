"""Supervised ViT classification (decayed shortcuts, drop path or ResidualDroppath), e.g. the
CIFAR-10 comparison of standard / drop path / ResidualDroppath training.

    dres-train classify --preset classify_cifar10 --set model.droppath_mode=residual_droppath
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from dres.train.common import eval_loader, model_kwargs


class ClassifyTask:
    name = "classify"

    def build_model(self, cfg):
        from dres.models import ViTClassifier

        return ViTClassifier(**model_kwargs(ViTClassifier, cfg))

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
