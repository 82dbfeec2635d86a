"""Batched GPU-style augmentation (dres.data.loaders.rrc_params / device_augment), on the CPU:
torchvision's RandomResizedCrop distribution, the crop geometry of the batched resample, flips,
determinism; colour jitter against torchvision's ColorJitter; timm's evaluation transform."""

import math

import numpy as np
import pytest
import torch
from torchvision.transforms import RandomResizedCrop

from dres.data import InMemoryLoader, color_jitter, crop_theta, device_augment, jitter_params, normalize, rrc_params


def _torchvision_crops(n, height, width, scale, seed):
    """(w, h) fractions and whether the fallback was taken, from torchvision's own sampler."""
    torch.manual_seed(seed)
    ws, hs = [], []
    for _ in range(n):
        _, _, h, w = RandomResizedCrop.get_params(torch.empty(1, height, width), list(scale), [3 / 4, 4 / 3])
        ws.append(w / width)
        hs.append(h / height)
    return torch.tensor(ws), torch.tensor(hs)


def _rrc(*args, **kw):
    return [torch.from_numpy(v) for v in rrc_params(*args, **kw)]


@pytest.mark.parametrize("aspect", [1.0, 1.6])
def test_rrc_distribution_matches_torchvision(aspect):
    # a large image, so torchvision's rounding to whole pixels is negligible
    n, height = 4000, 1000
    scale = (0.2, 1.0)
    w, h, cx, cy = _rrc(n, np.random.default_rng(0), scale, aspect=aspect)
    tw, th = _torchvision_crops(n, height, int(height * aspect), scale, seed=0)
    for ours, ref, name in ((w * h, tw * th, "area"), (torch.log(w * aspect / h), torch.log(tw * aspect / th), "log ratio"),
                            (w, tw, "width"), (h, th, "height")):
        se = math.sqrt(ours.var() / n + ref.var() / n)
        assert abs(ours.mean() - ref.mean()) < 4 * se + 2e-3, (name, ours.mean(), ref.mean())
        assert abs(ours.std() - ref.std()) < 0.1 * ref.std() + 2e-3, (name, ours.std(), ref.std())
    assert (w <= 1).all() and (h <= 1).all() and (w > 0).all() and (h > 0).all()
    drawn = (w < 1) | (h < 1)  # the whole-image fallback aside, the area lies within the scale
    assert ((w * h)[drawn] >= scale[0] - 1e-6).all()
    # the crop lies inside the image: centre +- half the size, in [-1, 1] grid units
    assert ((cx - w) >= -1 - 1e-6).all() and ((cx + w) <= 1 + 1e-6).all()
    assert ((cy - h) >= -1 - 1e-6).all() and ((cy + h) <= 1 + 1e-6).all()


def test_rrc_fallback_is_torchvisions_centre_crop():
    # a 3:1 image with area >= 0.9: no draw of ratio <= 4/3 fits, so every sample takes the fallback
    w, h, cx, cy = _rrc(256, np.random.default_rng(1), (0.9, 1.0), aspect=3.0)
    tw, th = _torchvision_crops(16, 300, 900, (0.9, 1.0), seed=1)
    assert torch.allclose(w, torch.full_like(w, (4 / 3) / 3.0)) and torch.equal(h, torch.ones_like(h))
    assert torch.equal(cx, torch.zeros_like(cx)) and torch.equal(cy, torch.zeros_like(cy))
    assert torch.allclose(tw, torch.full_like(tw, 400 / 900)) and torch.equal(th, torch.ones_like(th))
    # and a tall image: full width, height clipped to ratio 3/4
    w, h, _, _ = _rrc(64, np.random.default_rng(1), (0.9, 1.0), aspect=1 / 3)
    assert torch.equal(w, torch.ones_like(w)) and torch.allclose(h, torch.full_like(h, (1 / 3) / (3 / 4)))


def test_batched_crop_samples_the_drawn_box_and_flips():
    # each pixel holds its column index: the output's columns must read the crop box's columns
    size, width, height, n = 16, 64, 48, 256
    cols = torch.arange(width, dtype=torch.uint8).view(1, 1, 1, width).expand(n, 1, height, width).contiguous()
    out = device_augment(cols, size, np.random.default_rng(5), scale=(0.3, 1.0)) * 255
    g = np.random.default_rng(5)  # the same draws: crop parameters, then flips
    w, h, cx, _ = _rrc(n, g, (0.3, 1.0), aspect=width / height)
    flip = torch.from_numpy(g.random(n) < 0.5)
    k = torch.arange(size, dtype=torch.float64)
    u = (2 * k + 1) / size - 1  # output pixel centres in grid units
    sign = torch.where(flip, -1.0, 1.0).double()[:, None]
    gx = sign * w.double()[:, None] * u + cx.double()[:, None]  # sampled positions in grid units
    src = ((gx + 1) * width - 1) / 2  # ... in source pixel coordinates (align_corners=False)
    inside = (src >= 0) & (src <= width - 1)  # a linear ramp interpolates exactly away from the border
    got = out[:, 0].double().mean(1)  # every row reads the same columns
    assert inside.float().mean() > 0.9
    assert torch.allclose(got[inside], src[inside], atol=1e-3)
    assert 0.4 < flip.float().mean() < 0.6


def test_flips_are_half_and_exact_mirrors():
    n, size = 2000, 8
    ramp = torch.arange(size, dtype=torch.uint8).view(1, 1, 1, size).expand(n, 3, size, size).contiguous()
    out = device_augment(ramp, size, np.random.default_rng(0), rrc=False, flip=True) * 255
    same = torch.isclose(out, ramp.float(), atol=1e-3).flatten(1).all(1)
    mirrored = torch.isclose(out, ramp.float().flip(-1), atol=1e-3).flatten(1).all(1)
    assert (same ^ mirrored).all()
    assert abs(mirrored.float().mean().item() - 0.5) < 0.05  # 2000 fair coins: 4.5 standard deviations


def test_augment_shape_range_normalisation_and_determinism():
    x = torch.randint(0, 256, (32, 3, 20, 24), dtype=torch.uint8)
    mean, std = [0.4, 0.5, 0.6], [0.2, 0.25, 0.3]
    a = device_augment(x, 16, np.random.default_rng(7), mean=mean, std=std)
    b = device_augment(x, 16, np.random.default_rng(7), mean=mean, std=std)
    c = device_augment(x, 16, np.random.default_rng(8), mean=mean, std=std)
    assert a.shape == (32, 3, 16, 16) and a.dtype == torch.float32
    assert torch.equal(a, b) and not torch.equal(a, c)
    raw = a * torch.tensor(std).view(1, 3, 1, 1) + torch.tensor(mean).view(1, 3, 1, 1)
    assert raw.min() >= -1e-5 and raw.max() <= 1 + 1e-5  # bilinear samples stay within the pixel range


def test_crop_draw_runs_no_torch_operator_on_the_host():
    """The per-step crop draw is numpy: torch's CPU ops enter the intra-op thread pool even at a few
    thousand elements, and four graphed trainers on one 64-core host ran 20x slower for it."""
    from torch.overrides import TorchFunctionMode

    class Record(TorchFunctionMode):
        calls = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.calls.append(func)
            return func(*args, **(kwargs or {}))

    with Record() as rec:
        theta = crop_theta(256, np.random.default_rng(0), scale=(0.2, 1.0), aspect=1.0)
    assert rec.calls == [] and theta.shape == (256, 2, 3) and theta.dtype == np.float32
    flipped = theta[:, 0, 0] < 0
    assert 0.3 < flipped.mean() < 0.7 and np.array_equal(theta, crop_theta(256, np.random.default_rng(0)))


def test_augment_rows_of_a_batch_equal_that_batch_sliced():
    """A rank resamples only its share of the global batch, with the parameters of the whole batch."""
    x = torch.randint(0, 256, (24, 3, 20, 24), dtype=torch.uint8)
    whole = device_augment(x, 16, np.random.default_rng(4), scale=(0.3, 1.0))
    for lo, hi in ((0, 8), (8, 16), (16, 24), (5, 6)):
        part = device_augment(x[lo:hi], 16, np.random.default_rng(4), scale=(0.3, 1.0), rows=(lo, 24))
        assert torch.equal(part, whole[lo:hi])


# ------------------------------------------------------------------------------------------ colour jitter

def _image_set(n=12, size=12, seed=0):
    """A fixed set of smooth colour images in [0, 1] (ramps and blobs, not noise, so contrast and
    saturation have something to act on)."""
    g = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.linspace(0, 1, size), torch.linspace(0, 1, size), indexing="ij")
    imgs = []
    for _ in range(n):
        a, b, c = torch.rand(3, 3, 1, 1, generator=g)
        imgs.append((0.15 + 0.7 * (a * xx + b * yy + c * (xx * yy)) / (a + b + c)).clamp(0, 1))
    return torch.stack(imgs)


def test_jitter_params_are_torchvisions_factor_ranges_and_orders():
    from torchvision.transforms import ColorJitter

    factors, order = jitter_params(20000, np.random.default_rng(0), 0.4)
    assert factors.shape == (20000, 3) and factors.min() >= 0.6 and factors.max() <= 1.4
    assert np.all(np.sort(order, axis=1) == np.arange(3))  # a permutation per image
    torch.manual_seed(0)
    tv = np.array([[float(v) for v in ColorJitter.get_params([0.6, 1.4], [0.6, 1.4], [0.6, 1.4], None)[1:4]]
                   for _ in range(20000)])
    # uniform on [0.6, 1.4]: mean 1, sd 0.8 / sqrt(12) = 0.231; standard error of the mean 0.0016
    assert np.allclose(factors.mean(0), tv.mean(0), atol=0.01)
    assert np.allclose(factors.std(0), tv.std(0), atol=0.01)
    assert np.allclose(factors.std(0), 0.8 / math.sqrt(12), atol=0.01)
    # every op first equally often (torchvision's randperm(4) with hue skipped gives the same)
    assert np.allclose(np.bincount(order[:, 0], minlength=3) / len(order), 1 / 3, atol=0.015)
    assert np.array_equal(jitter_params(50, np.random.default_rng(3), 0.4)[0],
                          jitter_params(50, np.random.default_rng(3), 0.4)[0])
    low, _ = jitter_params(1000, np.random.default_rng(0), 1.5)  # strength above 1: factors from 0
    assert low.min() >= 0 and low.max() <= 2.5


@pytest.mark.parametrize("chans", [3, 1])
def test_color_jitter_is_torchvisions_functional_for_the_drawn_factors_and_order(chans):
    import torchvision.transforms.functional as TF

    x = _image_set(8)[:, :chans]
    factors, order = jitter_params(8, np.random.default_rng(1), 0.4)
    ours = color_jitter(x.clone(), factors, order)
    ops = (TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation)
    for i in range(8):
        ref = x[i]
        for op in order[i]:
            ref = ops[op](ref, float(factors[i, op]))
        assert torch.allclose(ours[i], ref, atol=1e-6), i


def test_color_jitter_distribution_matches_torchvision_colorjitter():
    """Per image of a fixed set, the distribution over draws of the output's mean and variance
    matches torchvision's ColorJitter(0.4, 0.4, 0.4) (timm's --color-jitter 0.4) applied per sample."""
    from torchvision.transforms import ColorJitter

    imgs, draws = _image_set(6), 1500
    batch = imgs.repeat(draws, 1, 1, 1)
    ours = color_jitter(batch.clone(), *jitter_params(len(batch), np.random.default_rng(5), 0.4))
    ours = ours.view(draws, 6, -1)
    torch.manual_seed(5)
    tv = ColorJitter(0.4, 0.4, 0.4)
    theirs = torch.stack([torch.stack([tv(im) for im in imgs]) for _ in range(draws)]).view(draws, 6, -1)
    for stat in (lambda t: t.mean(-1), lambda t: t.var(-1)):
        a, b = stat(ours), stat(theirs)  # (draws, images)
        se = (a.var(0) / draws + b.var(0) / draws).sqrt()
        assert ((a.mean(0) - b.mean(0)).abs() < 5 * se + 1e-6).all()  # the per-image means of the statistic
        assert torch.allclose(a.std(0), b.std(0), rtol=0.12)  # and their spread over draws
        assert (a.std(0) > 0.01).all()  # the jitter moves every image
    # and over the brightness range torchvision reaches: the extremes of the per-image mean agree
    assert torch.allclose(ours.mean(-1).amin(0), theirs.mean(-1).amin(0), atol=0.03)
    assert torch.allclose(ours.mean(-1).amax(0), theirs.mean(-1).amax(0), atol=0.03)


def test_augment_with_jitter_keeps_the_crops_and_slices_by_rows():
    x = torch.randint(0, 256, (16, 3, 20, 24), dtype=torch.uint8)
    plain = device_augment(x, 16, np.random.default_rng(2))
    jittered = device_augment(x, 16, np.random.default_rng(2), jitter=0.4)
    assert not torch.equal(plain, jittered)
    # jitter 0 draws nothing: the crops of a run without jitter are those of before
    assert torch.equal(plain, device_augment(x, 16, np.random.default_rng(2), jitter=0.0))
    part = device_augment(x[4:9], 16, np.random.default_rng(2), rows=(4, 16), jitter=0.4)
    assert torch.equal(part, jittered[4:9])
    assert jittered.min() >= 0 and jittered.max() <= 1


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_compiled_augmentation_equals_eager(device):
    """The loader's compiled gather + augmentation (compile_augment) gives the eager batches up to fp32
    rounding, with crop, flip, jitter, normalisation and a rank's share of the global batch."""
    images = torch.randint(0, 256, (40, 3, 20, 24), dtype=torch.uint8)
    labels = torch.arange(40)
    kw = dict(rank=1, world=2, seed=3, device=device, img_size=16, mean=[0.4, 0.5, 0.6], std=[0.2, 0.25, 0.3],
              jitter=0.4)
    eager = InMemoryLoader(images, labels, 16, **kw)
    compiled = InMemoryLoader(images, labels, 16, compile_augment=True, **kw)
    for _ in range(3):  # one compile, then the same kernels with the next steps' parameters
        a, b = eager.next(), compiled.next()
        assert torch.equal(a["label"], b["label"]) and b["image"].shape == (8, 3, 16, 16)
        # atol: the jitter's reductions rounded in another order, then scaled by the normalisation's 1/std (up to 5)
        torch.testing.assert_close(b["image"], a["image"], rtol=1e-5, atol=5e-5)


# --------------------------------------------------------------------------------- evaluation transform

@pytest.mark.parametrize("size,crop_pct,hw", [(32, 0.875, (32, 32)), (224, 0.875, (32, 32)), (16, 0.875, (20, 24))])
def test_eval_crop_pct_is_timms_eval_transform(size, crop_pct, hw):
    """normalize(crop_pct) against timm's own transforms_imagenet_eval (bicubic resize of the shorter side to
    size / crop_pct, centre crop) on tensors; both antialiased bicubic, so they agree to rounding."""
    from timm.data.transforms_factory import transforms_imagenet_eval

    x = (_image_set(4, size=max(hw))[..., : hw[0], : hw[1]] * 255).round().to(torch.uint8)
    ref_tf = transforms_imagenet_eval(img_size=size, crop_pct=crop_pct, interpolation="bicubic", normalize=False)
    resize, crop = ref_tf.transforms[0], ref_tf.transforms[1]
    ours = normalize(x, size, crop_pct=crop_pct)
    ref = torch.stack([crop(resize(im.float() / 255)).clamp(0, 1) for im in x])
    assert ours.shape == ref.shape == (4, 3, size, size)
    assert torch.allclose(ours, ref, atol=1e-5)
    assert torch.equal(normalize(x, size), normalize(x, size, crop_pct=1.0))
