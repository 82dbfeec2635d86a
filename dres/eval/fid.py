"""FID with the standard Inception weights — only when a path to them is given — and the same
Frechet distance in the feature space of a CIFAR classifier trained by dres (``fd_cifar_classifier``).

The expected file is the TorchScript Inception-v3 used by the StyleGAN2-ADA / EDM / ADM metric code
(``inception-2015-12-05.pt``, the TF FID graph converted): called as ``net(uint8 NCHW, return_features=True)``
it returns 2048-d pool features. dres never downloads it; without the path, FID is skipped with a
message that says so.

Trust boundary: a TorchScript file is a program, and ``torch.jit.load`` runs the code it holds (there
is no weights-only mode for it). The path given as ``eval.fid_inception`` is therefore trusted code:
use the published file (check its hash) or one you made, never an unverified download.
"""

from __future__ import annotations

import os

import numpy as np
import torch


class FIDUnavailable(RuntimeError):
    pass


def load_inception(path: str, device="cpu"):
    """The TorchScript Inception at ``path`` (trusted code: see the module docstring)."""
    if not path:
        raise FIDUnavailable("FID skipped: no Inception weights given (set eval.fid_inception=/path/to/"
                             "inception-2015-12-05.pt, the TorchScript FID Inception of StyleGAN2-ADA/EDM)")
    if not os.path.exists(path):
        raise FIDUnavailable(f"FID skipped: Inception weights not found at {path}")
    try:
        return torch.jit.load(path, map_location=device).eval()
    except Exception as e:
        raise FIDUnavailable(f"FID skipped: {path} is not a TorchScript Inception ({type(e).__name__})") from e


@torch.no_grad()
def batched_features(fn, images_uint8: torch.Tensor, batch=200, device="cpu") -> np.ndarray:
    """``fn(uint8 (b, C, H, W) on device) -> (b, D)`` over the images in batches, as float64."""
    out = []
    for i in range(0, len(images_uint8), batch):
        out.append(fn(images_uint8[i:i + batch].to(device)).double().cpu())
    return torch.cat(out).numpy()


def inception_features(net, images_uint8: torch.Tensor, batch=200, device="cpu") -> np.ndarray:
    def fn(x):
        return net(x.expand(-1, 3, -1, -1) if x.shape[1] == 1 else x, return_features=True)

    return batched_features(fn, images_uint8, batch, device)


def stats(feats: np.ndarray):
    return feats.mean(0), np.cov(feats, rowvar=False)


def frechet_distance(mu1, s1, mu2, s2) -> float:
    from scipy import linalg

    diff = mu1 - mu2
    covmean = linalg.sqrtm(s1.dot(s2))
    covmean = covmean[0] if isinstance(covmean, tuple) else covmean
    if not np.isfinite(covmean).all():
        off = np.eye(s1.shape[0]) * 1e-6
        covmean = linalg.sqrtm((s1 + off).dot(s2 + off))
        covmean = covmean[0] if isinstance(covmean, tuple) else covmean
    covmean = covmean.real
    return float(diff.dot(diff) + np.trace(s1) + np.trace(s2) - 2 * np.trace(covmean))


def fid(inception_path: str, fake_uint8: torch.Tensor, real_uint8: torch.Tensor, device="cpu") -> float:
    net = load_inception(inception_path, device)
    f1 = inception_features(net, fake_uint8, device=device)
    f2 = inception_features(net, real_uint8, device=device)
    return frechet_distance(*stats(f1), *stats(f2))


class ClassifierFeatures:
    """uint8 images -> the penultimate features (``pre_logits``) of a trained classifier, after the
    classifier's own input normalisation (``mean``/``std`` per channel)."""

    def __init__(self, model, mean, std, autocast=None):
        self.model, self.autocast = model.eval(), autocast
        c = len(mean)
        self.mean, self.std = torch.tensor(mean).view(1, c, 1, 1), torch.tensor(std).view(1, c, 1, 1)

    @torch.no_grad()
    def __call__(self, images_uint8: torch.Tensor) -> torch.Tensor:
        x = images_uint8.float() / 255
        x = (x - self.mean.to(x.device)) / self.std.to(x.device)
        if self.autocast is None:
            return self.model.pre_logits(x).float()
        with self.autocast():
            return self.model.pre_logits(x).float()


def classifier_frechet_distance(features: ClassifierFeatures, fake_uint8: torch.Tensor, real_uint8: torch.Tensor,
                                device="cpu") -> float:
    """The Frechet distance between fake and real images in a dres classifier's penultimate feature
    space: the FID formula with another network, so its values are not comparable to published FID."""
    f1 = batched_features(features, fake_uint8, device=device)
    f2 = batched_features(features, real_uint8, device=device)
    return frechet_distance(*stats(f1), *stats(f2))
