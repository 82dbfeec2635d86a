"""Images from files: the crop-resize kernel against roi_align in float64, the workers' half (crop draws,
formats that stay on the CPU), the folder loader (exact resume, ranks, workers, lost files, FIFOs) and, on a
GPU, the batched GPU decode against the CPU decode."""

import io
import os
import random

import numpy as np
import pytest
import torch

from dres.data import DataError, build_loader
from dres.data.decode import (BatchFinisher, SamplePrep, collate_prepared, crop_box, gpu_decode_backend, prepare,
                              read_file)
from dres.data.loaders import FolderLoader
from dres.kernels.crop_resize import crop_resize_forward
from dres.train.config import DataConfig

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def _reference(image_chw, box, flip, size):
    """torchvision's roi_align (aligned, adaptive sampling) in float64, then the flip and the normalisation."""
    import torchvision

    left, top, w, h = box
    roi = torch.tensor([[0, left, top, left + w, top + h]], dtype=torch.float64)
    out = torchvision.ops.roi_align(image_chw[None].double(), roi, size, 1.0, -1, True)[0]
    out = out.flip(-1) if flip else out
    mean, std = torch.tensor(MEAN, dtype=torch.float64), torch.tensor(STD, dtype=torch.float64)
    return (out / 255 - mean[:, None, None]) / std[:, None, None]


@pytest.mark.parametrize("size", [7, 16])
def test_crop_resize_kernel_matches_roi_align_in_float64(triton_device, size):
    """Odd and even sizes, HWC and CHW memory, downscales (several samples a bin) and upscales, flips, a
    crop on the image's edge, every output element written (the output starts as NaN)."""
    g = torch.Generator().manual_seed(random.randrange(1 << 30))
    shapes = [(37, 50), (9, 13), (64, 64), (5, 40)]
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g) for h, w in shapes]
    hwc = [False, True, True, False]
    boxes = [(3, 5, 40, 30), (0, 0, 13, 9), (40, 50, 24, 14), (10, 0, 30, 5)]
    flips = [0, 1, 1, 0]
    meta, chunks, offset = [], [], 0
    for im, is_hwc, flip in zip(images, hwc, flips):
        c, h, w = im.shape
        stored = im.permute(1, 2, 0).contiguous() if is_hwc else im
        meta.append((offset, h, w, *((w * c, c, 1) if is_hwc else (w, 1, h * w)), flip))
        chunks.append(stored.reshape(-1))
        offset += stored.numel()
    std, mean = torch.tensor(STD), torch.tensor(MEAN)
    out = crop_resize_forward(torch.cat(chunks).to(triton_device), torch.tensor(meta).to(triton_device),
                              torch.tensor(boxes, dtype=torch.float32).to(triton_device),
                              (1 / (255 * std)).to(triton_device), (-mean / std).to(triton_device), size).cpu()
    assert out.shape == (4, 3, size, size) and torch.isfinite(out).all()
    for i, im in enumerate(images):
        ref = _reference(im, boxes[i], flips[i], size)
        assert (out[i].double() - ref).abs().max() < 1e-4, i


def test_crop_draws_depend_on_the_seed_alone_and_fit_the_image():
    for seed in range(200):
        w, h = random.Random(seed).randint(20, 900), random.Random(seed + 1).randint(20, 900)
        box, flip = crop_box(w, h, random.Random(seed), "rrc_flip", (0.2, 1.0))
        assert (box, flip) == crop_box(w, h, random.Random(seed), "rrc_flip", (0.2, 1.0))
        left, top, bw, bh = box
        assert 0 <= left and 0 <= top and left + bw <= w and top + bh <= h and bw > 0 and bh > 0
    box, flip = crop_box(500, 300, random.Random(0), "none")
    assert box == (100, 0, 300, 300) and not flip


def _encode(kind, w=60, h=40, seed=0):
    from PIL import Image

    rng = np.random.default_rng(seed)
    im = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    buf = io.BytesIO()
    if kind == "grey":
        im.convert("L").save(buf, "JPEG", quality=90)
    elif kind == "cmyk":
        im.convert("CMYK").save(buf, "JPEG", quality=90)
    elif kind == "png":
        im.save(buf, "PNG")
    else:
        im.save(buf, "JPEG", quality=90, progressive=kind == "progressive")
    return buf.getvalue()


@pytest.mark.parametrize("kind", ["jpeg", "progressive", "grey", "cmyk", "png"])
def test_workers_keep_jpegs_for_the_gpu_and_decode_the_rest(kind):
    gpu = SamplePrep(16, gpu=True)(_encode(kind), seed=3)
    cpu = SamplePrep(16, gpu=False)(_encode(kind), seed=3)
    assert gpu[2:] == cpu[2:]  # the same crop and flip either way
    assert cpu[0] == "pixels" and cpu[1].shape == (3, 16, 16) and cpu[1].dtype == torch.uint8
    assert gpu[0] == ("jpeg" if kind in ("jpeg", "progressive", "grey") else "pixels")


def test_a_damaged_image_is_a_lost_sample_and_the_batch_keeps_its_order():
    prep = SamplePrep(8)
    samples = [prepare(prep, _encode("jpeg", seed=i), i, i, f"f{i}") for i in range(3)]
    samples.insert(1, prepare(prep, b"not an image", 9, 7, "bad.jpg"))
    batch = collate_prepared(samples)
    assert batch["lost"] == ["bad.jpg: UnidentifiedImageError"] and batch["labels"].tolist() == [0, 1, 2]
    lost = []
    out = BatchFinisher("cpu", 8, 3)(batch, lost)
    assert out["image"].shape == (3, 3, 8, 8) and out["label"].tolist() == [0, 1, 2] and lost == []
    # pixels alone: the CPU-made crops, normalised in the finisher (scale 1/255 without statistics)
    assert torch.allclose(out["image"][0], samples[0][1].float() / 255)


def test_read_file_refuses_what_is_not_a_regular_file_without_blocking(tmp_path):
    fifo = tmp_path / "x.jpg"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        read_file(str(fifo))


def _folder(root, n=24, classes=3, bad=()):
    for i in range(n):
        d = root / f"c{i % classes}"
        d.mkdir(exist_ok=True)
        (d / f"{i:03d}.JPEG").write_bytes(b"broken" if i in bad else _encode("jpeg", 30 + i, 24 + i, seed=i))
    return str(root)


def _batches(loader, n):
    return [loader.next() for _ in range(n)]


@pytest.mark.parametrize("workers", [0, 2])
def test_folder_loader_resumes_exactly_and_ranks_split_the_global_batch(tmp_path, workers):
    root = _folder(tmp_path)
    d = DataConfig(name="imagefolder", path=root, img_size=8, num_classes=3, gpu_resident=False, decode="cpu",
                   num_workers=workers, max_corrupt_frac=0.5)
    full = _batches(build_loader(d, "train", 8, seed=5), 7)  # past an epoch (3 steps of 8 images)
    cut = build_loader(d, "train", 8, seed=5)
    _batches(cut, 4)
    state = cut.state_dict()
    resumed = build_loader(d, "train", 8, seed=5)
    resumed.load_state_dict(state)
    for a, b in zip(full[4:], _batches(resumed, 3)):
        assert torch.equal(a["image"], b["image"]) and torch.equal(a["label"], b["label"])
    halves = [build_loader(d, "train", 8, seed=5, rank=r, world=2) for r in range(2)]
    for step in full[:4]:
        parts = [h.next() for h in halves]
        assert torch.equal(torch.cat([p["image"] for p in parts]), step["image"])


def test_folder_loader_counts_a_lost_file_once_and_skips_fifos(tmp_path):
    root = _folder(tmp_path, bad=(4,))
    os.mkfifo(tmp_path / "c0" / "pipe.JPEG")  # would block a read forever
    lines = []
    d = DataConfig(name="imagefolder", path=root, img_size=8, num_classes=3, gpu_resident=False, decode="cpu",
                   num_workers=0, max_corrupt_frac=0.5)
    loader = build_loader(d, "train", 8, log=lines.append)
    assert len(loader.ds) == 24  # the FIFO is not listed
    _batches(loader, 9)  # three epochs
    assert loader.counter.count == 1 and len(lines) == 1, lines
    assert "shard" not in lines[0] and "c1/004.JPEG: UnidentifiedImageError" in lines[0]


def test_decode_gpu_without_a_gpu_is_a_one_line_error(tmp_path):
    d = DataConfig(name="imagefolder", path=_folder(tmp_path), img_size=8, num_classes=3, gpu_resident=False,
                   decode="gpu")
    with pytest.raises(DataError, match="data.decode=gpu needs a CUDA device"):
        build_loader(d, "train", 8, device="cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["nvimgcodec", "torchvision"])
def test_gpu_decode_matches_the_cpu_decode_of_the_same_crops(tmp_path, backend):
    if backend == "nvimgcodec":
        pytest.importorskip("nvidia.nvimgcodec")
    kinds = ["jpeg", "progressive", "grey", "cmyk", "png", "jpeg"]
    blobs = [_encode(k, 120 + 7 * i, 90 + 5 * i, seed=i) for i, k in enumerate(kinds)] + [b"broken"]
    batches = {}
    for gpu in (True, False):
        prep = SamplePrep(32, gpu=gpu)
        batch = collate_prepared([prepare(prep, b, i, i, f"f{i}") for i, b in enumerate(blobs)])
        finisher = BatchFinisher("cuda", 32, 3, MEAN, STD, backend if gpu else None)
        lost = []
        batches[gpu] = finisher(batch, lost)
        assert batch["lost"] == ["f6: UnidentifiedImageError"] and lost == []
    gpu, cpu = batches[True], batches[False]
    assert gpu["label"].tolist() == cpu["label"].tolist() == list(range(6))
    # decoders and resize filters differ (nvJPEG vs libjpeg-turbo, roi_align vs antialiased bilinear): close, not equal
    diff = ((gpu["image"] - cpu["image"]) * torch.tensor(STD, device="cuda").view(1, 3, 1, 1) * 255).abs()
    assert diff.mean() < 6 and torch.isfinite(gpu["image"]).all()


@pytest.mark.gpu
def test_gpu_decode_is_the_default_where_a_decoder_is_there(tmp_path):
    d = DataConfig(name="imagefolder", path=_folder(tmp_path), img_size=16, num_classes=3, gpu_resident=False,
                   num_workers=2)
    loader = build_loader(d, "train", 8, device="cuda")
    assert loader.prep.gpu == (gpu_decode_backend("cuda") is not None)
    batch = loader.next()
    assert batch["image"].is_cuda and batch["image"].shape == (8, 3, 16, 16)
