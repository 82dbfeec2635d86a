"""Helpers shared by the task modules: model construction from :class:`ModelConfig`, evaluation
data and cached features."""

from __future__ import annotations

import dataclasses
import inspect

import torch

from dres.data import DataError, build_loader


def model_kwargs(cls, cfg) -> dict:
    """The ModelConfig fields that ``cls.__init__`` accepts (one config dataclass serves all tasks),
    plus the run's seed for the ResidualDroppath controller's own generator."""
    params = inspect.signature(cls.__init__).parameters
    kw = {k: v for k, v in dataclasses.asdict(cfg.model).items() if k in params}
    if "droppath_seed" in params:
        kw["droppath_seed"] = cfg.seed
    return kw


def eval_loader(tr, split, batch):
    """An unaugmented loader over ``split`` ('train' | 'val') for feature extraction, or None (with
    a message) when the data set has no such split configured."""
    cfg = tr.cfg
    try:
        ld = build_loader(cfg.data, split, 1, device=tr.device, train=False)  # batching: eval_batches()
    except DataError as e:
        tr.log(f"[dres] no {split} split for evaluation ({e}); skipping")
        return None
    if not hasattr(ld, "eval_batches"):
        return None
    return ld


def cap(batches, limit):
    n = 0
    for b in batches:
        if limit and n >= limit:
            return
        if limit and n + len(b["label"]) > limit:
            b = {k: v[:limit - n] for k, v in b.items()}
        n += len(b["label"])
        yield b


@torch.no_grad()
def features(tr, fn, loader, limit=0, batch=256):
    feats, labels = [], []
    with tr.autocast():
        for b in cap(loader.eval_batches(batch), limit):
            feats.append(fn(b["image"]).float().cpu())
            labels.append(b["label"].cpu())
    return torch.cat(feats), torch.cat(labels)
