"""Representation metrics on cached (frozen) features: linear probe, kNN, effective rank.

* :func:`linear_probe` — the paper's ImageNet-100 protocol: a linear classifier on frozen features,
  AdamW, lr 1e-2 with per-iteration cosine decay, batch 1024, 200 epochs, no augmentation. The
  features are standardised with the training set's mean/std first (what the MAE repo's affine-free
  BatchNorm in front of the head does at evaluation). ``progress`` counts its epochs on a bar (the
  trainers pass ``dres.train.common.progress``).
* :func:`knn_accuracy` — k=20 nearest neighbours by cosine similarity, votes weighted by
  ``exp(sim / 0.07)`` (the DINO / InstDisc weighted kNN).
* :func:`effective_rank` — eq. 6 of the paper: the Shannon entropy of the normalised singular values
  of the covariance of the class tokens (reported as ``effective_rank_entropy``); the effective rank
  ``effective_rank`` is its exponential.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


@torch.no_grad()
def extract_features(fn, batches, device=None):
    """Run ``fn(images) -> (B, D)`` over an iterable of ``{"image", "label"}`` batches."""
    feats, labels = [], []
    for b in batches:
        feats.append(fn(b["image"]).float().cpu())
        labels.append(b["label"].cpu())
    return torch.cat(feats), torch.cat(labels)


def linear_probe(train_x, train_y, test_x, test_y, *, epochs=200, lr=1e-2, batch_size=1024, weight_decay=0.0,
                 num_classes=None, seed=0, device="cpu", progress=None):
    """Top-1 test accuracy (and train accuracy) of a linear classifier on frozen features.

    ``progress``: None (silent), or what makes the bar the epochs are counted on, called as
    ``progress(total=epochs, desc="linear probe", unit="epoch")`` and returning an object with
    ``update(n)`` and ``close()`` (a tqdm bar: ``dres.train.common.progress``).
    """
    g = torch.Generator().manual_seed(seed)
    train_x, test_x = train_x.float(), test_x.float()
    mu, sd = train_x.mean(0, keepdim=True), train_x.std(0, keepdim=True) + 1e-6
    train_x, test_x = ((train_x - mu) / sd).to(device), ((test_x - mu) / sd).to(device)
    train_y, test_y = train_y.long().to(device), test_y.long().to(device)
    c = num_classes or int(max(train_y.max(), test_y.max())) + 1
    head = torch.nn.Linear(train_x.shape[1], c).to(device)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=g) * 0.01)
    torch.nn.init.zeros_(head.bias)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=weight_decay)
    n = len(train_x)
    steps_per_epoch = max(1, math.ceil(n / batch_size))
    total = epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / total)))
    bar = None if progress is None else progress(total=epochs, desc="linear probe", unit="epoch")
    try:
        with torch.enable_grad():  # callers usually evaluate under no_grad
            _train_head(head, opt, sched, train_x, train_y, epochs, batch_size, g, device, bar)
    finally:
        if bar is not None:
            bar.close()
    with torch.no_grad():
        acc = (head(test_x).argmax(1) == test_y).float().mean().item()
        train_acc = (head(train_x).argmax(1) == train_y).float().mean().item()
    return {"linear_probe_acc": acc, "linear_probe_train_acc": train_acc}


def _train_head(head, opt, sched, train_x, train_y, epochs, batch_size, g, device, bar):
    n = len(train_x)
    for _ in range(epochs):
        perm = torch.randperm(n, generator=g).to(device)
        for i in range(0, n, batch_size):
            idx = perm[i:i + batch_size]
            loss = F.cross_entropy(head(train_x[idx]), train_y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        if bar is not None:
            bar.update(1)


@torch.no_grad()
def knn_accuracy(train_x, train_y, test_x, test_y, k=20, temperature=0.07, num_classes=None, chunk=1024):
    """Weighted kNN top-1 accuracy with cosine similarity, on the features' device."""
    train_x, test_x = F.normalize(train_x.float(), dim=1), F.normalize(test_x.float(), dim=1)
    c = num_classes or int(max(train_y.max(), test_y.max())) + 1
    k = min(k, len(train_x))
    correct = 0
    for i in range(0, len(test_x), chunk):
        sim = test_x[i:i + chunk] @ train_x.T
        s, idx = sim.topk(k, dim=1)
        w = (s / temperature).exp()
        votes = torch.zeros(len(s), c, device=s.device).scatter_add_(1, train_y.to(s.device)[idx].long(), w)
        correct += (votes.argmax(1) == test_y[i:i + chunk].to(s.device)).sum().item()
    return correct / len(test_x)


@torch.no_grad()
def effective_rank(cls_tokens: torch.Tensor) -> dict:
    """Eq. 6: ``H = -sum_i p_i log p_i`` with ``p = sigma / sum(sigma)`` the normalised singular values
    of the (D, D) covariance of the class tokens; effective rank ``exp(H)`` (1 .. D)."""
    z = cls_tokens.double()
    z = z - z.mean(0, keepdim=True)
    cov = z.T @ z / max(len(z) - 1, 1)
    s = torch.linalg.svdvals(cov)
    p = s / s.sum().clamp_min(1e-300)
    p = p[p > 0]
    h = -(p * p.log()).sum().item()
    return {"entropy": h, "effective_rank": math.exp(h)}
