"""The augmentation on the device: batched RandomResizedCrop + flip of a batch of equal-sized uint8
images by one ``affine_grid``/``grid_sample`` resample, colour jitter and normalisation. The parameters
are drawn on the host (numpy, for the global batch) so they depend on neither the device nor the world
size; the pixels never leave the device. :class:`dres.data.loaders.InMemoryLoader` uses it.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F


def rrc_params(n, rng, scale=(0.2, 1.0), ratio=(3 / 4, 4 / 3), tries=10, aspect=1.0):
    """Batched torchvision RandomResizedCrop parameters for ``n`` images of width/height ``aspect``,
    drawn from the numpy generator ``rng``: crop width and height as fractions of the image's, and the
    crop centre in [-1, 1] grid units ``(w, h, cx, cy)`` (float64 arrays). As torchvision draws them
    (area fraction uniform in ``scale``, log aspect ratio uniform in ``log(ratio)``, the first of
    ``tries`` draws that fits, position uniform), all tries at once and without rounding to whole
    pixels; a sample with no fitting draw gets torchvision's fallback, the centred crop of the whole
    image with its ratio clipped to ``ratio``. numpy, not torch: torch's CPU ops wake the intra-op
    thread pool even at this size, and its spinning threads starve other trainers on the host."""
    area = rng.uniform(scale[0], scale[1], (n, tries))
    r = np.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1]), (n, tries)))
    w, h = np.sqrt(area * r / aspect), np.sqrt(area * aspect / r)
    ok = (w <= 1) & (h <= 1)
    fits, first = ok.any(1), ok.argmax(1)
    rows = np.arange(n)
    lo, hi = min(ratio), max(ratio)
    w = np.where(fits, w[rows, first], min(1.0, hi / aspect))  # wider than the widest ratio: width clipped
    h = np.where(fits, h[rows, first], min(1.0, aspect / lo))  # taller than the narrowest: height clipped
    u = np.where(fits[:, None], rng.random((n, 2)), 0.5)  # the fallback is centred
    cx = (u[:, 0] * (1 - w) + w / 2) * 2 - 1  # crop centre in [-1, 1] grid coordinates
    cy = (u[:, 1] * (1 - h) + h / 2) * 2 - 1
    return w, h, cx, cy


def crop_theta(n, rng, rrc=True, flip=True, scale=(0.2, 1.0), aspect=1.0):
    """The ``(n, 2, 3)`` float32 affine matrices of ``affine_grid`` for RandomResizedCrop (``rrc``)
    and a horizontal flip with probability 1/2 (``flip``), drawn from ``rng`` on the host (numpy)."""
    if rrc:
        w, h, cx, cy = rrc_params(n, rng, scale, aspect=aspect)
    else:
        w, h, cx, cy = np.ones(n), np.ones(n), np.zeros(n), np.zeros(n)
    theta = np.zeros((n, 2, 3), np.float32)
    theta[:, 0, 0] = w * np.where(rng.random(n) < 0.5, -1.0, 1.0) if flip else w
    theta[:, 0, 2], theta[:, 1, 1], theta[:, 1, 2] = cx, h, cy
    return theta


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` on ``device`` without a host sync: a CPU tensor goes to a CUDA device from pinned memory,
    asynchronously (a copy from pageable memory would wait for the stream)."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return (t if t.is_pinned() else t.pin_memory()).to(device, non_blocking=True)
    return t.to(device)


def jitter_params(n, rng, strength):
    """Batched parameters of torchvision's ``ColorJitter(strength, strength, strength)`` (timm's
    ``--color-jitter S``: brightness, contrast and saturation, no hue) for ``n`` images, drawn from the
    numpy generator ``rng``: ``(n, 3)`` factors uniform in ``[max(0, 1 - S), 1 + S]`` (brightness,
    contrast, saturation) and ``(n, 3)`` the order each image applies them in (a random permutation per
    image, as torchvision draws one per call)."""
    factors = rng.uniform(max(0.0, 1.0 - strength), 1.0 + strength, (n, 3))
    order = np.argsort(rng.random((n, 3)), axis=1)
    return factors, order


def _grey(x):
    """torchvision's ``rgb_to_grayscale`` weights; a one-channel image is its own grey."""
    if x.shape[1] == 1:
        return x
    return (0.2989 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]).unsqueeze(1)


def color_jitter(x, factors, order):
    """torchvision's ColorJitter (tensor semantics) on a float batch in [0, 1], image ``i`` with its
    own ``factors[i]`` applied in ``order[i]`` (:func:`jitter_params`; numpy arrays, or tensors on
    ``x``'s device). Every stage applies all three adjustments, with factor 1 (the identity) for the
    images whose order puts another there, so the batch needs no per-image branching."""
    f = _on_device(factors, np.float32, x.device)
    order = _on_device(order, np.int64, x.device)
    one = torch.ones((), device=x.device)
    for stage in range(3):
        for op in range(3):
            k = torch.where(order[:, stage] == op, f[:, op], one).view(-1, 1, 1, 1)
            if op == 0:  # brightness: blend with black
                x = (x * k).clamp_(0, 1)
            elif op == 1:  # contrast: blend with the mean grey level of the image
                x = (k * x + (1 - k) * _grey(x).mean(dim=(1, 2, 3), keepdim=True)).clamp_(0, 1)
            elif x.shape[1] > 1:  # saturation: blend with the grey image (torchvision skips one channel)
                x = (k * x + (1 - k) * _grey(x)).clamp_(0, 1)
    return x


def _on_device(a, np_dtype, device):
    """``a`` as a tensor on ``device``: a tensor as it is, a numpy array sent without a host sync."""
    if isinstance(a, torch.Tensor):
        return a
    return to_device(torch.from_numpy(np.ascontiguousarray(a, np_dtype)), device)


def channel_stats(mean, std, channels, device):
    """``mean`` and ``std`` (sequences, None for no normalisation) as (channels,) float32 tensors on ``device``."""
    if mean is None:
        return None, None
    return tuple(to_device(torch.tensor(v[:channels], dtype=torch.float32), device) for v in (mean, std))


def augment_params(n, rng, aspect, rrc=True, flip=True, scale=(0.2, 1.0), jitter=0.0, share=None, device="cpu"):
    """The host half of :func:`device_augment`: the crop matrices (:func:`crop_theta`; None without crop
    and flip) and the colour-jitter factors and orders (:func:`jitter_params`; None without jitter) of a
    batch of ``n`` images, drawn from ``rng`` in that order, those of images ``start:start + b`` kept
    (``share=(start, b)``, default all) and sent to ``device``."""
    start, b = share if share is not None else (0, n)
    theta = factors = order = None
    if rrc or flip:
        theta = _on_device(crop_theta(n, rng, rrc, flip, scale, aspect=aspect)[start:start + b], np.float32, device)
    if jitter > 0:  # drawn after the crop, so a run without jitter keeps its crops
        factors, order = jitter_params(n, rng, jitter)
        factors = _on_device(factors[start:start + b], np.float32, device)
        order = _on_device(order[start:start + b], np.int64, device)
    return theta, factors, order


def apply_augment(x_uint8, size, theta=None, factors=None, order=None, mean=None, std=None):
    """The device half of :func:`device_augment`: uint8 (B,C,H,W) -> float (B,C,size,size), the crop
    and flip of ``theta`` by one bilinear ``affine_grid``/``grid_sample`` resample (without it, a resize
    to ``size``), the colour jitter of ``factors``/``order``, then ``(x - mean) / std`` ((C,) tensors).
    Tensors in, no host values, so ``torch.compile`` traces it whole (:func:`gather_augment`)."""
    x = x_uint8.float().div_(255)
    if theta is not None:
        grid = F.affine_grid(theta, (x.shape[0], x.shape[1], size, size), align_corners=False)
        x = F.grid_sample(x, grid, mode="bilinear", padding_mode="reflection", align_corners=False)
    elif x.shape[-1] != size:
        x = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    if factors is not None:
        x = color_jitter(x, factors, order)
    return _standardise(x, mean, std)


def _standardise(x, mean, std):
    return x if mean is None else (x - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1)


def gather_augment(images, idx, size, theta=None, factors=None, order=None, mean=None, std=None):
    """:func:`apply_augment` of the rows ``idx`` of ``images``; compiled, the gather reads only the
    pixels the resample needs."""
    return apply_augment(images[idx], size, theta, factors, order, mean, std)


def device_augment(x_uint8, size, rng, rrc=True, flip=True, scale=(0.2, 1.0), mean=None, std=None, rows=None,
                   jitter=0.0):
    """uint8 (B,C,H,W) on any device -> float (B,C,size,size): RandomResizedCrop + horizontal flip
    for the whole batch by one ``affine_grid``/``grid_sample`` bilinear resample, then colour jitter of
    strength ``jitter`` (0: none; :func:`color_jitter`), then normalisation.
    Parameters come from the host generator ``rng`` (``numpy.random.Generator``) so that they do not
    depend on the device or on the world size; they reach the device without a host sync.
    ``rows=(start, n)``: ``x_uint8`` is rows ``start:start + B`` of a batch of ``n`` (a rank's share of
    the global batch); parameters are drawn for all ``n`` and only these rows are resampled."""
    b, c = x_uint8.shape[:2]
    start, n = rows if rows is not None else (0, b)
    params = augment_params(n, rng, x_uint8.shape[-1] / x_uint8.shape[-2], rrc, flip, scale, jitter, (start, b),
                            x_uint8.device)
    return apply_augment(x_uint8, size, *params, *channel_stats(mean, std, c, x_uint8.device))


def normalize(x_uint8, size, mean=None, std=None, crop_pct=1.0):
    """uint8 (B,C,H,W) -> float (B,C,size,size), unaugmented: the image resized to ``size``
    (``crop_pct`` 1), or timm's evaluation transform (``crop_pct`` < 1: the shorter side resized to
    ``floor(size / crop_pct)``, bicubic, then the centre ``size`` x ``size`` crop); then normalisation."""
    if crop_pct >= 1:
        return device_augment(x_uint8, size, None, rrc=False, flip=False, mean=mean, std=std)
    x = x_uint8.float().div_(255)
    h, w = x.shape[-2:]
    short = math.floor(size / crop_pct)
    # torchvision's Resize(int): the shorter side to `short`, the longer in proportion (truncated)
    hw = (short, int(short * w / h)) if h <= w else (int(short * h / w), short)
    x = F.interpolate(x, size=hw, mode="bicubic", antialias=True, align_corners=False).clamp_(0, 1)
    top, left = int(round((hw[0] - size) / 2.0)), int(round((hw[1] - size) / 2.0))
    return _standardise(x[..., top:top + size, left:left + size], *channel_stats(mean, std, x.shape[1], x.device))
