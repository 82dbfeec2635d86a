"""Representation metrics on cached (frozen) features: linear probe, kNN, effective rank.

* :func:`linear_probe` — the paper's ImageNet-100 protocol: a linear classifier on frozen features,
  AdamW, lr 1e-2 with per-iteration cosine decay, batch 1024, 200 epochs, no augmentation. The
  features are standardised with the training set's mean/std first (what the MAE repo's affine-free
  BatchNorm in front of the head does at evaluation; ``standardized=False`` probes the raw features).
  ``progress`` counts its epochs on a bar (the trainers pass ``dres.train.common.progress``).
  :func:`linear_probes` trains one such probe per feature slot of (N, H, D) features together, on the same
  batches: each head's loss, gradient and AdamW update are its own, so each ends where a lone probe of its slot
  would (up to rounding), for one training's launches.
* :func:`authors_linear_probe` — the decayed-shortcut authors' probe as their released code runs it
  (``MAE/util/misc.py::eval_model``): raw features (no standardisation, no BatchNorm), the default-initialised
  ``nn.Linear``, ``AdamW(lr=1e-2)`` with torch's default weight decay 0.01, a cosine learning rate set per
  epoch after each epoch, 200 epochs, the last partial batch dropped (:data:`AUTHORS_PROBE`).
* :func:`knn_accuracy` — k=20 nearest neighbours by cosine similarity, votes weighted by
  ``exp(sim / 0.07)`` (the DINO / InstDisc weighted kNN); ``standardize_first`` standardises the features first
  with the training set's mean/std, so no channel's scale alone decides the cosine.
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


def standardize(train_x, test_x):
    """Both feature sets standardised with the training set's per-channel mean and std (float32)."""
    train_x, test_x = train_x.float(), test_x.float()
    mu, sd = train_x.mean(0, keepdim=True), train_x.std(0, keepdim=True) + 1e-6
    return (train_x - mu) / sd, (test_x - mu) / sd


def linear_probe(train_x, train_y, test_x, test_y, **options) -> dict:
    """:func:`linear_probes` of one slot: top-1 test accuracy (and train accuracy) of a linear classifier on frozen
    (N, D) features."""
    return linear_probes(train_x[:, None], train_y, test_x[:, None], test_y, **options)[0]


def linear_probes(train_x, train_y, test_x, test_y, *, epochs=200, lr=1e-2, batch_size=1024, weight_decay=0.0,
                  standardized=True, num_classes=None, seed=0, device="cpu", progress=None) -> list[dict]:
    """Top-1 test accuracy (and train accuracy) of a linear classifier on each slot h of frozen (N, H, D) features,
    ``train_x[:, h]``, the H classifiers trained together: a list of H results. Every head starts from the draw a
    lone probe makes and sees the same batches. ``standardized``: on features standardised by the train split's
    mean and std (:func:`standardize`), else on the raw features.

    ``progress``: None (silent), or what makes the bar the epochs are counted on, called as
    ``progress(total=epochs, desc="linear probe", unit="epoch")`` and returning an object with
    ``update(n)`` and ``close()`` (a tqdm bar: ``dres.train.common.progress``).
    """
    g = torch.Generator().manual_seed(seed)
    train_x, test_x = standardize(train_x, test_x) if standardized else (train_x.float(), test_x.float())
    heads, d = train_x.shape[1:]
    weight = torch.randn(_classes(train_y, test_y, num_classes), d, generator=g) * 0.01
    head = LinearHeads(weight.expand(heads, -1, -1).clone(), torch.zeros(heads, weight.shape[0])).to(device)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=weight_decay)
    total = epochs * max(1, math.ceil(len(train_x) / batch_size))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / total)))
    acc, train_acc = _fit_head(head, opt, train_x, train_y, test_x, test_y, epochs=epochs, batch_size=batch_size,
                               g=g, device=device, bar_name="linear probe", progress=progress,
                               after_step=sched.step)
    return [{"linear_probe_acc": a, "linear_probe_train_acc": t} for a, t in zip(acc, train_acc)]


class LinearHeads(torch.nn.Module):
    """H linear classifiers, one per feature slot: (B, H, D) -> (B, H, C) with weight (H, C, D), bias (H, C)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor):
        super().__init__()
        self.weight, self.bias = torch.nn.Parameter(weight), torch.nn.Parameter(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bhd,hcd->bhc", x, self.weight) + self.bias


# eval_model's probe: its AdamW is built as AdamW(params, 1e-2), so torch's default weight decay applies;
# 256 samples a GPU, the paper's 1024 on four GPUs
AUTHORS_PROBE = {"epochs": 200, "lr": 1e-2, "weight_decay": 0.01, "batch_size": 1024}


def authors_linear_probe(train_x, train_y, test_x, test_y, *, num_classes=None, seed=0, device="cpu",
                         progress=None, epochs=AUTHORS_PROBE["epochs"], batch_size=AUTHORS_PROBE["batch_size"]):
    """Top-1 test accuracy (and train accuracy) of the authors' probe (:data:`AUTHORS_PROBE`) on raw features:
    ``authors_probe_acc``, ``authors_probe_train_acc``. ``epochs`` and ``batch_size`` are the protocol's unless
    a caller shrinks them (tests)."""
    g = torch.Generator().manual_seed(seed)
    train_x, test_x = train_x.float()[:, None], test_x.float()[:, None]
    d, classes = train_x.shape[-1], _classes(train_y, test_y, num_classes)
    weight, bias = torch.empty(1, classes, d), torch.empty(1, classes)
    # nn.Linear's own initialisation, drawn on the CPU from the probe's generator
    torch.nn.init.kaiming_uniform_(weight[0], a=math.sqrt(5), generator=g)
    torch.nn.init.uniform_(bias, -1 / math.sqrt(d), 1 / math.sqrt(d), generator=g)
    head = LinearHeads(weight, bias).to(device)
    lr = AUTHORS_PROBE["lr"]
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=AUTHORS_PROBE["weight_decay"])
    batch_size = min(batch_size, len(train_x))  # fewer samples than a batch: one batch (eval_model would train none)

    def after_epoch(ep):  # adjust_learning_rate(optimizer, ep) after epoch ep: the next one at cos(pi ep / epochs)
        for group in opt.param_groups:
            group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * ep / epochs))
    (acc,), (train_acc,) = _fit_head(head, opt, train_x, train_y, test_x, test_y, epochs=epochs,
                                     batch_size=batch_size, g=g, device=device, bar_name="authors' probe",
                                     progress=progress, after_epoch=after_epoch, drop_last=True)
    return {"authors_probe_acc": acc, "authors_probe_train_acc": train_acc}


def _classes(train_y, test_y, num_classes):
    return num_classes or int(max(train_y.max(), test_y.max())) + 1


def _fit_head(head, opt, train_x, train_y, test_x, test_y, *, epochs, batch_size, g, device, bar_name, progress,
              after_step=None, after_epoch=None, drop_last=False) -> tuple[list[float], list[float]]:
    """Train ``head`` (:class:`LinearHeads`) on the (N, H, D) features in shuffled batches (``g`` draws the order),
    each head on the sum of its own mean loss, then each head's (test, train) top-1 accuracy;
    ``after_step`` / ``after_epoch(epoch)`` set the learning rate."""
    train_x, test_x = train_x.to(device), test_x.to(device)
    train_y, test_y = train_y.long().to(device), test_y.long().to(device)
    n = len(train_x) // batch_size * batch_size if drop_last else len(train_x)
    bar = None if progress is None else progress(total=epochs, desc=bar_name, unit="epoch")
    try:
        with torch.enable_grad():  # callers usually evaluate under no_grad
            for ep in range(epochs):
                perm = torch.randperm(len(train_x), generator=g)[:n].to(device)
                for i in range(0, n, batch_size):
                    idx = perm[i:i + batch_size]
                    logits = head(train_x[idx])  # (B, H, C): a loss per sample and head, mean over samples
                    loss = F.cross_entropy(logits.transpose(1, 2), train_y[idx, None].expand(-1, logits.shape[1]),
                                           reduction="none").mean(0).sum()
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    if after_step is not None:
                        after_step()
                if after_epoch is not None:
                    after_epoch(ep)
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    with torch.no_grad():
        acc = (head(test_x).argmax(-1) == test_y[:, None]).float().mean(0).tolist()
        train_acc = (head(train_x).argmax(-1) == train_y[:, None]).float().mean(0).tolist()
    return acc, train_acc


@torch.no_grad()
def knn_accuracy(train_x, train_y, test_x, test_y, k=20, temperature=0.07, num_classes=None, chunk=1024,
                 standardize_first=False):
    """Weighted kNN top-1 accuracy with cosine similarity, on the features' device; ``standardize_first``:
    on features standardised by the training set's mean/std (:func:`standardize`)."""
    if standardize_first:
        train_x, test_x = standardize(train_x, test_x)
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
