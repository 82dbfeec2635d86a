"""Step-indexed, resumable loaders.

Every loader hands the trainer one *step batch* at a time: this rank's share of the global batch
of one optimizer step (the trainer splits it into micro-batches for gradient accumulation). The
order of samples is a pure function of ``(seed, epoch, position)``, so the data position saved in a
checkpoint (``epoch``, ``batch``) resumes exactly, and the global batch of a step is the same set
of samples whatever the world size (each rank takes its slice) — which is what lets one process
and N processes produce the same losses.

* :class:`InMemoryLoader`: the whole data set as a uint8 tensor on the device (CIFAR, digits):
  decoded once, augmented on the device (batched RandomResizedCrop + flip through one
  ``affine_grid``/``grid_sample``, then optionally torchvision's ColorJitter per image), so the loader
  never limits throughput; its unaugmented passes can use timm's evaluation transform (``crop_pct``). The crop parameters of a
  step are drawn for the *global* batch from a generator seeded by (seed, epoch, batch).
* :class:`FolderLoader`: ImageFolder trees (ImageNet) decoded in DataLoader workers with a
  per-sample seeded RandomResizedCrop; same global-batch slicing.
* :class:`ShardLoader`: WebDataset shards streamed (for data too large for memory): shards split
  by rank and worker, a seeded shuffle buffer, corrupt samples skipped and counted; resume skips
  the batches already consumed in the epoch.
"""

from __future__ import annotations

import math
import random

import numpy as np
import torch
import torch.nn.functional as F

from dres.data.sources import (CorruptCounter, DataError, check_labels, expand_shards, iter_shard,
                               list_image_folder)


def _mix(*xs) -> int:
    """A stable 63-bit seed from integers (not Python's salted hash)."""
    h = 0x9E3779B97F4A7C15
    for x in xs:
        h = (h ^ (int(x) + 0x9E3779B97F4A7C15 + (h << 6) + (h >> 2))) & ((1 << 63) - 1)
    return h


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
        return t.pin_memory().to(device, non_blocking=True)
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


def check_split(global_batch, world, accum):
    if global_batch % (world * accum):
        raise DataError(f"batch_size {global_batch} cannot be split over {world} rank(s) x {accum} "
                        f"accumulation step(s); it must be a multiple of {world * accum}")
    return global_batch // world


class _Position:
    """The resumable data position: epoch and batch within the epoch."""

    epoch = 0
    batch = 0

    def state_dict(self):
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, s):
        self.epoch, self.batch = int(s["epoch"]), int(s["batch"])


class InMemoryLoader(_Position):
    """``compile_augment``: the gather and the augmentation of a step run as ``torch.compile`` of
    :func:`gather_augment` (a few fused kernels instead of an eager kernel per operation, equal to them up to
    fp32 rounding); the batches' parameters are the same either way."""

    def __init__(self, images, labels, global_batch, *, rank=0, world=1, accum=1, seed=0, device="cpu",
                 img_size=None, aug="rrc_flip", crop_min=0.2, mean=None, std=None, jitter=0.0,
                 eval_crop_pct=1.0, compile_augment=False):
        self.local = check_split(global_batch, world, accum)
        if len(images) < global_batch:
            raise DataError(f"batch_size {global_batch} is larger than the data set ({len(images)} samples)")
        self.images = images.to(device)
        self.labels = labels.to(device)
        self.global_batch, self.rank, self.world, self.seed = global_batch, rank, world, seed
        self.size = img_size or images.shape[-1]
        self.aug, self.crop_min, self.mean, self.std = aug, crop_min, mean, std
        self.jitter, self.eval_crop_pct = jitter, eval_crop_pct
        self.stats = channel_stats(mean, std, images.shape[1], self.images.device)
        self.augment = torch.compile(gather_augment, dynamic=False) if compile_augment else gather_augment
        self.steps_per_epoch = len(images) // global_batch
        self.counter = CorruptCounter()  # build_loader hands over the reader's
        self._epoch_perm = None  # (epoch, its sample order on the device)

    def __len__(self):
        return self.steps_per_epoch

    def _perm(self, epoch):
        """The epoch's sample order on the data's device: drawn on the CPU (the same on any device),
        sent once per epoch."""
        if self._epoch_perm is None or self._epoch_perm[0] != epoch:
            g = torch.Generator().manual_seed(_mix(self.seed, epoch, 1))
            self._epoch_perm = (epoch, to_device(torch.randperm(len(self.images), generator=g), self.images.device))
        return self._epoch_perm[1]

    def next(self):
        if self.batch >= self.steps_per_epoch:
            self.epoch, self.batch = self.epoch + 1, 0
        perm = self._perm(self.epoch)
        lo = self.rank * self.local
        idx = perm[self.batch * self.global_batch:(self.batch + 1) * self.global_batch][lo:lo + self.local]
        rng = np.random.default_rng(_mix(self.seed, self.epoch, self.batch, 2))
        # augmentation drawn for the whole global batch, applied to this rank's share only
        if self.aug != "none":
            params = augment_params(self.global_batch, rng, self.images.shape[-1] / self.images.shape[-2],
                                    rrc=self.aug == "rrc_flip", flip=True, scale=(self.crop_min, 1.0),
                                    jitter=self.jitter, share=(lo, self.local), device=self.images.device)
            x = self.augment(self.images, idx, self.size, *params, *self.stats)
        else:
            x = normalize(self.images[idx], self.size, self.mean, self.std)
        self.batch += 1
        return {"image": x, "label": self.labels[idx]}

    def eval_batches(self, batch_size):
        """Unaugmented pass over all samples (for features), in order."""
        for i in range(0, len(self.images), batch_size):
            x = normalize(self.images[i:i + batch_size], self.size, self.mean, self.std, self.eval_crop_pct)
            yield {"image": x, "label": self.labels[i:i + batch_size]}


def pil_rrc(im, size, rng: random.Random, scale=(0.2, 1.0), ratio=(3 / 4, 4 / 3), flip=True, rrc=True):
    """torchvision's RandomResizedCrop + flip on a PIL image, drawing from ``rng`` (per sample)."""
    from PIL import Image

    W, H = im.size
    box = None
    if rrc:
        for _ in range(10):
            area = W * H * rng.uniform(*scale)
            r = math.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1])))
            w, h = int(round(math.sqrt(area * r))), int(round(math.sqrt(area / r)))
            if 0 < w <= W and 0 < h <= H:
                i, j = rng.randint(0, H - h), rng.randint(0, W - w)
                box = (j, i, j + w, i + h)
                break
    if box is None:  # centre crop (eval, or no valid draw)
        s = min(W, H)
        box = ((W - s) // 2, (H - s) // 2, (W - s) // 2 + s, (H - s) // 2 + s)
    im = im.resize((size, size), Image.BICUBIC, box=box)
    if flip and rrc and rng.random() < 0.5:
        im = im.transpose(Image.FLIP_LEFT_RIGHT)
    return im


def _pil_to_uint8(im, in_chans):
    a = np.asarray(im.convert("L" if in_chans == 1 else "RGB"), dtype=np.uint8)
    return torch.from_numpy(a[None] if a.ndim == 2 else a.transpose(2, 0, 1).copy())


class _FolderDataset(torch.utils.data.Dataset):
    def __init__(self, paths, labels, size, in_chans, train, crop_min):
        self.paths, self.labels, self.size, self.in_chans = paths, labels, size, in_chans
        self.train, self.crop_min = train, crop_min

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, key):
        idx, seed = key
        from PIL import Image

        try:
            with Image.open(self.paths[idx]) as im:
                im = pil_rrc(im.convert("RGB"), self.size, random.Random(seed), (self.crop_min, 1.0),
                             rrc=self.train, flip=self.train)
                return _pil_to_uint8(im, self.in_chans), self.labels[idx], ""
        except Exception as e:  # any decode failure is one lost sample, not a fatal error
            return None, -1, f"{self.paths[idx]}: {type(e).__name__}"


def _collate_skip(batch):
    """Drop corrupt samples (None); the third item lists their paths and errors."""
    good = [b for b in batch if b[0] is not None]
    lost = [b[2] for b in batch if b[0] is None]
    if not good:
        return None, None, lost
    return torch.stack([g[0] for g in good]), torch.tensor([g[1] for g in good]), lost


class FolderLoader(_Position):
    def __init__(self, root, global_batch, *, rank=0, world=1, accum=1, seed=0, device="cpu", img_size=224,
                 in_chans=3, train=True, crop_min=0.2, mean=None, std=None, num_workers=8, limit=0,
                 num_classes=0, max_corrupt_frac=1.0, log=None):
        self.local = check_split(global_batch, world, accum)
        paths, labels, self.classes = list_image_folder(root)
        if limit:
            paths, labels = paths[:limit], labels[:limit]
        check_labels(torch.tensor(labels), num_classes, root)
        self.root, self.max_corrupt_frac = root, max_corrupt_frac
        self.counter = CorruptCounter(log)
        self.counter.shards_total, self._read = len(paths), 0
        self.ds = _FolderDataset(paths, labels, img_size, in_chans, train, crop_min)
        self.global_batch, self.rank, self.world, self.seed, self.device = global_batch, rank, world, seed, device
        self.mean, self.std, self.size, self.num_workers = mean, std, img_size, num_workers
        self.steps_per_epoch = len(paths) // global_batch
        self._it = None

    def __len__(self):
        return self.steps_per_epoch

    def _batches(self, epoch, start):
        perm = torch.randperm(len(self.ds), generator=torch.Generator().manual_seed(_mix(self.seed, epoch, 1)))
        for b in range(start, self.steps_per_epoch):
            g = perm[b * self.global_batch:(b + 1) * self.global_batch]
            mine = g[self.rank * self.local:(self.rank + 1) * self.local].tolist()
            yield [(i, _mix(self.seed, epoch, i)) for i in mine]

    def _start(self):
        self._it = iter(torch.utils.data.DataLoader(
            self.ds, batch_sampler=list(self._batches(self.epoch, self.batch)), num_workers=self.num_workers,
            collate_fn=_collate_skip, pin_memory=str(self.device).startswith("cuda"),
            persistent_workers=False, prefetch_factor=4 if self.num_workers else None))

    def load_state_dict(self, s):
        super().load_state_dict(s)
        self._it = None

    def next(self):
        if self.batch >= self.steps_per_epoch:
            self.epoch, self.batch, self._it = self.epoch + 1, 0, None
        if self._it is None:
            self._start()
        x, y, lost = next(self._it)
        self.batch += 1
        self._read += 0 if x is None else len(x)
        if lost:
            for what in lost:
                self.counter.add(what, what.rsplit(": ", 1)[0])
            self.counter.check(self._read, self.max_corrupt_frac, self.root, expected=len(self.ds) // self.world)
        if x is None:
            return self.next()
        return {"image": normalize(x.to(self.device, non_blocking=True), self.size, self.mean, self.std),
                "label": y.to(self.device)}


class _ShardStream(torch.utils.data.IterableDataset):
    """Shards split by rank, then by DataLoader worker; when there are fewer shards than
    rank x worker slots, every slot reads all shards and keeps every n-th sample instead."""

    def __init__(self, shards, rank, world, seed, epoch, size, in_chans, train, crop_min, buffer):
        self.shards, self.rank, self.world, self.seed, self.epoch = shards, rank, world, seed, epoch
        self.size, self.in_chans, self.train, self.crop_min, self.buffer = size, in_chans, train, crop_min, buffer

    def __iter__(self):
        from PIL import Image

        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        slot, nslots = self.rank * nw + wid, self.world * nw
        shards = list(self.shards)
        rng = random.Random(_mix(self.seed, self.epoch, slot, 3))
        if self.train:
            random.Random(_mix(self.seed, self.epoch, 4)).shuffle(shards)
        if len(shards) >= nslots:
            mine, share = shards[slot::nslots], None
        else:
            mine, share = shards, (slot, nslots)
        counter = CorruptCounter(collect=True)  # its events travel with the samples to the main process
        buf = []

        def decoded():
            index = 0
            for s in mine:
                index = yield from iter_shard(s, counter, self.in_chans, share, index)

        def samples():
            for key, img, label in decoded():
                im = Image.fromarray(img[0] if img.shape[0] == 1 else img.transpose(1, 2, 0))
                im = pil_rrc(im, self.size, rng, (self.crop_min, 1.0), rrc=self.train, flip=self.train)
                yield _pil_to_uint8(im, self.in_chans), label

        for s in samples():
            if self.train and self.buffer > 1:
                buf.append(s)
                if len(buf) < self.buffer:
                    continue
                s = buf.pop(rng.randrange(len(buf)))
            yield s[0], s[1], counter.drain()
        rng.shuffle(buf)
        for s in buf:
            yield s[0], s[1], counter.drain()
        if counter.pending:
            yield None, -1, counter.drain()


class ShardLoader(_Position):
    """Streaming WebDataset shards. An epoch ends when any rank runs out (ranks stay in step)."""

    def __init__(self, pattern, global_batch, *, rank=0, world=1, accum=1, seed=0, device="cpu", img_size=32,
                 in_chans=3, train=True, crop_min=0.2, mean=None, std=None, num_workers=4, buffer=2000,
                 samples_per_epoch=None, num_classes=0, max_corrupt_frac=1.0, log=None):
        self.local = check_split(global_batch, world, accum)
        self.shards = expand_shards(pattern)
        self.num_classes, self.max_corrupt_frac = num_classes, max_corrupt_frac
        self.counter = CorruptCounter(log)
        self.counter.shards_total, self._read = len(self.shards), 0
        # the fraction's denominator: this rank's share of an epoch, or enough samples to judge it
        self._expected = (samples_per_epoch // world if samples_per_epoch else
                          math.ceil(1 / max_corrupt_frac) if max_corrupt_frac > 0 else 0)
        self.global_batch, self.rank, self.world, self.seed, self.device = global_batch, rank, world, seed, device
        self.size, self.in_chans, self.train, self.crop_min, self.buffer = img_size, in_chans, train, crop_min, buffer
        self.mean, self.std, self.num_workers = mean, std, num_workers
        self.steps_per_epoch = (samples_per_epoch // global_batch) if samples_per_epoch else None
        self._it = None

    def __len__(self):
        return self.steps_per_epoch or 0

    def _samples(self):
        ds = _ShardStream(self.shards, self.rank, self.world, self.seed, self.epoch, self.size, self.in_chans,
                          self.train, self.crop_min, self.buffer)
        dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=self.num_workers)
        for img, label, lost in dl:
            self._account(lost, img is not None)
            if img is not None:
                yield img, label

    def _account(self, lost, read: bool):
        self._read += read
        if lost:
            self.counter.replay(lost)
            self.counter.check(self._read, self.max_corrupt_frac, f"{len(self.shards)} shard(s)", self._expected)

    def _batches(self):
        xs, ys = [], []
        for img, label in self._samples():
            xs.append(img)
            ys.append(int(label))
            if len(xs) == self.local:
                check_labels(torch.tensor(ys), self.num_classes, f"{len(self.shards)} shard(s)")
                yield torch.stack(xs), torch.tensor(ys)
                xs, ys = [], []

    def load_state_dict(self, s):
        super().load_state_dict(s)
        self._it = None

    def next(self):
        if self._it is None:
            self._it = self._batches()
            for _ in range(self.batch):  # resume: skip what this epoch already consumed
                next(self._it)
        try:
            x, y = next(self._it)
        except StopIteration:
            if self.batch == 0:
                raise DataError(f"no samples for rank {self.rank} in {len(self.shards)} shard(s)")
            self.epoch, self.batch, self._it = self.epoch + 1, 0, None
            return self.next()
        if self.steps_per_epoch and self.batch + 1 >= self.steps_per_epoch:
            self.epoch, self.batch, self._it = self.epoch + 1, 0, None  # keep ranks in step
        else:
            self.batch += 1
        return {"image": normalize(x.to(self.device), self.size, self.mean, self.std), "label": y.to(self.device)}

    def eval_batches(self, batch_size):
        ds = _ShardStream(self.shards, self.rank, self.world, self.seed, 0, self.size, self.in_chans, False, 0, 0)
        xs, ys = [], []
        for img, label, lost in ds:
            self._account(lost, img is not None)
            if img is None:
                continue
            xs.append(img)
            ys.append(label)
            if len(xs) == batch_size:
                yield {"image": normalize(torch.stack(xs).to(self.device), self.size, self.mean, self.std),
                       "label": torch.tensor(ys, device=self.device)}
                xs, ys = [], []
        if xs:
            yield {"image": normalize(torch.stack(xs).to(self.device), self.size, self.mean, self.std),
                   "label": torch.tensor(ys, device=self.device)}
