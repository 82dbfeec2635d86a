"""Images from files: the crop-resize kernel against roi_align in float64, the workers' half (crop draws,
formats that stay on the CPU), the folder loader (exact resume, ranks, workers, lost files, FIFOs) and, on a
GPU, the batched GPU decode against the CPU decode."""

import dataclasses
import io
import os
import random
import re
import time
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from benchmarks.bench_data import batches_made_ahead, encode
from dres.data import DataError, build_loader
from dres.data.augment import color_jitter
from dres.data.decode import (BatchFinisher, SamplePrep, collate_prepared, crop_box, decode_paths_line,
                              gpu_decode_backend, prepare, read_file)
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
    # timm's evaluation crop: the centre crop_pct of the shorter side (resize to size / crop_pct, keep size)
    assert crop_box(500, 300, random.Random(0), "none", crop_pct=0.875) == ((119, 19, 262, 262), False)


def test_colour_jitter_is_drawn_per_sample_and_applied_in_the_finisher_before_the_statistics():
    """A worker draws each image's ColorJitter factors and order from its seed (after the crop, which stays
    the same); the finisher jitters the batch in [0, 1] as dres.data.augment.color_jitter does, then
    standardises. Evaluation preps draw none."""
    mean, std = [0.4, 0.5, 0.6], [0.2, 0.25, 0.3]
    prep, plain = SamplePrep(8, jitter=0.4), SamplePrep(8)
    samples = [prepare(prep, _encode("jpeg", seed=i), 10 + i, i, f"f{i}") for i in range(4)]
    assert [s[:4] for s in samples][0][2:] == plain(_encode("jpeg", seed=0), 10)[2:4]  # crop and flip unchanged
    assert samples[0][4] == prep(_encode("jpeg", seed=0), 10)[4]  # the seed decides the jitter
    factors = torch.tensor([s[4][:3] for s in samples])
    assert ((0.6 <= factors) & (factors <= 1.4)).all() and len({s[4] for s in samples}) == 4
    assert all(sorted(s[4][3:]) == [0, 1, 2] for s in samples)
    batch = collate_prepared(samples)
    out = BatchFinisher("cpu", 8, 3, mean, std)(batch, [])
    pixels = torch.stack([s[1] for s in samples]).float() / 255
    want = color_jitter(pixels, factors, torch.tensor([s[4][3:] for s in samples]).long())
    want = (want - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    torch.testing.assert_close(out["image"], want)
    assert collate_prepared([prepare(plain, _encode("jpeg"), 0, 0, "f")])["jitter"] is None


def test_a_folder_loader_jitters_training_batches_and_crops_evaluation_at_crop_pct(tmp_path):
    root = _folder(tmp_path)
    d = dict(name="imagefolder", path=root, img_size=8, num_classes=3, gpu_resident=False, decode="cpu",
             num_workers=0, max_corrupt_frac=0.5)
    jittered = build_loader(DataConfig(**d, color_jitter=0.4), "train", 8, seed=5)
    plain = build_loader(DataConfig(**d), "train", 8, seed=5)
    a, b = jittered.next(), plain.next()
    assert torch.equal(a["label"], b["label"]) and not torch.equal(a["image"], b["image"])
    val = build_loader(DataConfig(**d, val_path=root, color_jitter=0.4, eval_crop_pct=0.5), "val", 8, train=False)
    assert val.prep.jitter == 0.0 and val.prep.crop_pct == 0.5


def _encode(kind, w=60, h=40, seed=0):
    return encode(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8), kind)


@pytest.mark.parametrize("kind", ["jpeg", "progressive", "grey", "cmyk", "png"])
def test_workers_keep_jpegs_for_the_gpu_and_decode_the_rest(kind):
    gpu = SamplePrep(16, gpu=True)(_encode(kind), seed=3)
    cpu = SamplePrep(16, gpu=False)(_encode(kind), seed=3)
    assert gpu[2:] == cpu[2:]  # the same crop and flip either way
    assert cpu[0] == "pixels" and cpu[1].shape == (3, 16, 16) and cpu[1].dtype == torch.uint8
    assert gpu[0] == ("jpeg" if kind in ("jpeg", "grey") else "pixels")  # progressive: see decode's module doc


def test_a_cpu_share_of_the_gpus_jpegs_is_decoded_by_the_workers_each_chosen_by_its_seed():
    """data.cpu_decode_share: that share of the JPEGs the GPU would take comes as pixels, each image's choice a
    function of its seed alone, its crop and flip the same either way; 0 and 1 give every JPEG to one side."""
    blob = _encode("jpeg")
    made = {share: [SamplePrep(16, gpu=True, cpu_share=share)(blob, seed=s) for s in range(400)]
            for share in (0.0, 0.3, 1.0)}
    kinds = {share: [m[0] for m in out] for share, out in made.items()}
    assert set(kinds[0.0]) == {"jpeg"} and set(kinds[1.0]) == {"pixels"}
    assert 0.24 < kinds[0.3].count("pixels") / 400 < 0.36
    again = [SamplePrep(16, gpu=True, cpu_share=0.3)(blob, seed=s)[0] for s in range(400)]
    assert again == kinds[0.3]
    cpu = [SamplePrep(16, gpu=False)(blob, seed=s) for s in range(400)]
    for share, out in made.items():  # the same crop and flip, and the same pixels where the workers decode
        assert all(m[2:] == c[2:] for m, c in zip(out, cpu)), share
        assert all(torch.equal(m[1], c[1]) for m, c in zip(out, cpu) if m[0] == "pixels"), share
    assert SamplePrep(16, gpu=True, cpu_share=0.3)(_encode("png"), seed=1)[0] == "pixels"


def test_the_workers_follow_the_decode_unless_given(tmp_path, monkeypatch):
    from dres.data import factory as data

    monkeypatch.setattr(data, "cores_per_process", lambda: 8)
    d = DataConfig(name="imagefolder", path=_folder(tmp_path), img_size=8, num_classes=3, gpu_resident=False)
    assert data.loader_workers(d, "torchvision") == data.GPU_DECODE_WORKERS and data.loader_workers(d, None) == 7
    assert data.cpu_decode_share(d, "torchvision") == 0.0  # 8 cores: below CPU_SHARE_MIN_CORES, no share
    d.cpu_decode_share = 0.25  # the workers decode a share of the GPU's JPEGs: every core but the process's own
    assert data.loader_workers(d, "torchvision") == 7 and data.cpu_decode_share(d, None) == 0.0
    d.num_workers, d.cpu_decode_share = 3, 0.0
    assert data.loader_workers(d, "torchvision") == data.loader_workers(d, None) == 3
    d.decode, d.num_workers = "cpu", -1
    loader = build_loader(d, "train", 8, device="cpu")
    assert not loader.prep.gpu and loader.num_workers == 7
    monkeypatch.setattr("dres.data.loaders.cores_per_process", lambda: 8)
    # the workers' 4 prefetched batches each, and the 2 finished ahead with the one the finishing thread makes
    assert loader.batches_ahead == 7 * 4 + 2 + 1
    assert loader.describe() == "decoded on the CPU, 7 workers (8 cores a process), up to 31 batches made ahead of the step"
    assert batches_made_ahead([f"[dres] data: imagefolder, {loader.describe()}"]) == 31  # what bench_data times past
    loader.finisher.backend = "torchvision"
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    assert loader.describe() == ("decoded on the GPU (torchvision; 32 hardware queues), 7 workers (8 cores a process), "
                                 "up to 31 batches made ahead of the step")
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    assert "(torchvision; 8 hardware queues)" in loader.describe()  # CUDA's default
    loader.prep = dataclasses.replace(loader.prep, gpu=True, cpu_share=0.25)
    assert "(torchvision; 8 hardware queues; 25% of its JPEGs on the CPU by the workers)" in loader.describe()
    loader.close()


def test_a_gpu_decode_with_the_cores_for_it_gives_half_its_jpegs_to_the_workers(tmp_path, monkeypatch):
    """data.cpu_decode_share=-1 (the default): from CPU_SHARE_MIN_CORES cores a process a GPU decode's workers decode
    AUTO_CPU_DECODE_SHARE of its JPEGs, and are the cores less one; a worker count of the user's own gets no share
    (four byte readers would starve decoding), and a share the user sets is kept."""
    from dres.data import factory as data

    cores = data.CPU_SHARE_MIN_CORES
    monkeypatch.setattr(data, "cores_per_process", lambda: cores)
    d = DataConfig(name="imagefolder", path=_folder(tmp_path), img_size=8, num_classes=3, gpu_resident=False,
                   decode="gpu")
    assert d.cpu_decode_share == -1
    assert data.cpu_decode_share(d, "torchvision") == data.AUTO_CPU_DECODE_SHARE == 0.5
    assert data.loader_workers(d, "torchvision") == cores - 1
    cores = data.CPU_SHARE_MIN_CORES - 1
    assert data.cpu_decode_share(d, "torchvision") == 0.0 and data.loader_workers(d, "torchvision") == 4
    cores = data.CPU_SHARE_MIN_CORES
    d.num_workers = 4
    assert data.cpu_decode_share(d, "torchvision") == 0.0
    d.num_workers, d.cpu_decode_share = -1, 0.0
    assert data.cpu_decode_share(d, "torchvision") == 0.0 and data.loader_workers(d, "torchvision") == 4
    d.cpu_decode_share = 0.75
    assert data.cpu_decode_share(d, "torchvision") == 0.75


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
    lost = [line for line in lines if line.startswith("[dres] lost data")]
    assert loader.counter.count == 1 and len(lost) == 1, lines
    assert "shard" not in lost[0] and "c1/004.JPEG: UnidentifiedImageError" in lost[0]
    # each epoch's end says where its images were decoded: the lost one in none
    assert [line for line in lines if line not in lost] == [
        f"[dres] data: epoch {e}, 23 images decoded: 23 on the CPU by the workers" for e in (1, 2, 3)]


def test_an_epoch_line_says_how_long_a_batch_took_to_finish_and_its_gpu_decode_call():
    """Medians of the epoch's batches: the first one, finished while the step compiled, does not move them."""
    batches = [{"finish_s": 2.0, "decode_s": 1.5, "finish_cpu_s": 0.9}] + [
        {"finish_s": 0.05, "decode_s": 0.04, "finish_cpu_s": 0.0075}] * 3
    line = decode_paths_line(2, Counter(nvjpeg=500, workers=12), batches)
    assert line == ("[dres] data: epoch 2, 512 images decoded: 500 by torchvision's batched nvJPEG (the hardware "
                    "decoders for baseline JPEGs where the GPU has them); 12 on the CPU by the workers; a batch finished "
                    "in 50.0 ms, 40.0 of them in the GPU decode call, 7.5 on the finishing thread's CPU (median of 4 "
                    "batches)")
    no_gpu = [{"finish_s": 0.01, "decode_s": 0.0, "finish_cpu_s": 0.01}]
    assert decode_paths_line(1, Counter(workers=3), no_gpu).endswith("3 on the CPU by the workers")


def test_the_loader_counts_each_epochs_finishing_times_as_its_batches_are_handed_over(tmp_path):
    """A stand-in for the GPU decoder's call (10 ms a batch, counted in ``decode_s``) around the CPU finisher: each
    epoch's line gives the median of that epoch's batches alone."""

    class WithADecodeCall:
        def __init__(self, finisher):
            self.finisher, self.decode_s = finisher, 0.0

        def __call__(self, batch, lost, paths=None):
            time.sleep(0.01)
            self.decode_s += 0.01
            return self.finisher(batch, lost, paths)

        def __getattr__(self, name):  # the device and stream priority the thread finishing batches ahead takes
            return getattr(self.finisher, name)

    lines = []
    d = DataConfig(name="imagefolder", path=_folder(tmp_path), img_size=8, num_classes=3, gpu_resident=False,
                   decode="cpu", num_workers=0)
    loader = build_loader(d, "train", 8, log=lines.append)
    loader.finisher = WithADecodeCall(loader.finisher)
    _batches(loader, 6)  # two epochs of 3 batches
    timed = [re.search(r"a batch finished in ([\d.]+) ms, ([\d.]+) of them in the GPU decode call, ([\d.]+) on the "
                       r"finishing thread's CPU \(median of (\d) batches\)$", line) for line in lines]
    assert len(timed) == 2 and all(timed), lines
    for m in timed:
        assert m.group(4) == "3" and float(m.group(2)) == 10.0 and float(m.group(1)) >= 10.0
        assert float(m.group(3)) < float(m.group(1)) - 5.0  # the stand-in's 10 ms sleep is no CPU time
    assert loader.finishing == []  # taken by the last epoch's line


def _shards(root, n_shards=3, per_shard=10, bad=()):
    """Shards of small JPEGs (samples named in ``bad`` damaged) and their manifest's counts."""
    import io
    import json
    import tarfile

    counts = {}
    for s in range(n_shards):
        with tarfile.open(root / f"s-{s:03d}.tar", "w") as tf:
            for i in range(per_shard):
                key = f"k{s}-{i}"
                for ext, data in ((".jpg", b"broken" if key in bad else _encode("jpeg", 30 + i, 24 + s, seed=i)),
                                  (".cls", str((s + i) % 3).encode())):
                    info = tarfile.TarInfo(key + ext)
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
        counts[f"s-{s:03d}.tar"] = {"samples": per_shard}
    (root / "manifest.json").write_text(json.dumps({"shards": counts}))
    return str(root / f"s-{{000..{n_shards - 1:03d}}}.tar")


def _loader_config(source, path, ahead, **kw):
    return DataConfig(name=source, path=path, img_size=8, num_classes=3, gpu_resident=False, decode="cpu",
                      num_workers=2, max_corrupt_frac=0.5, shuffle_buffer=4, verify_manifest=False,
                      finish_ahead=ahead, **kw)


@pytest.mark.parametrize("source", ["imagefolder", "wds"])
def test_batches_finished_ahead_are_those_finished_between_steps(tmp_path, source, monkeypatch):
    """The threads finishing batches ahead, one or three at once, change no batch, no position and no resume:
    only when the work happens (a lost file among them, past two epochs; each finish pausing at random, so that
    three threads end their batches out of order)."""
    path = _folder(tmp_path, bad=(4,)) if source == "imagefolder" else _shards(tmp_path, bad=("k1-3",))
    finish, rng = BatchFinisher.__call__, random.Random(0)

    def finish_after_a_pause(self, *args, **kwargs):
        time.sleep(rng.uniform(0, 0.01))
        return finish(self, *args, **kwargs)

    monkeypatch.setattr(BatchFinisher, "__call__", finish_after_a_pause)
    runs = {}
    for ahead, threads in ((0, 1), (2, 1), (2, 3)):
        loader = build_loader(_loader_config(source, path, ahead, finish_threads=threads), "train", 8, seed=3)
        runs[ahead, threads] = [(loader.next(), loader.state_dict()) for _ in range(8)]
        assert loader.counter.count == 1
        loader.close()
    for run in (runs[2, 1], runs[2, 3]):
        for (a, state_a), (b, state_b) in zip(runs[0, 1], run):
            assert torch.equal(a["image"], b["image"]) and torch.equal(a["label"], b["label"]) and state_a == state_b
    for threads in (1, 3):
        resumed = build_loader(_loader_config(source, path, 2, finish_threads=threads), "train", 8, seed=3)
        resumed.load_state_dict(runs[2, threads][4][1])
        for (a, _), b in zip(runs[0, 1][5:], _batches(resumed, 3)):
            assert torch.equal(a["image"], b["image"])
        resumed.close()


def test_an_error_met_ahead_is_raised_at_its_batch(tmp_path):
    root = _folder(tmp_path, bad=(1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15))  # too many lost files
    taken = {}
    for ahead, threads in ((0, 1), (2, 1), (2, 2)):
        loader = build_loader(_loader_config("imagefolder", root, ahead, finish_threads=threads), "train", 8, seed=3)
        taken[ahead, threads] = 0
        with pytest.raises(DataError, match="too much unreadable data"):
            while True:
                loader.next()
                taken[ahead, threads] += 1
        loader.close()
    assert taken[0, 1] == taken[2, 1] == taken[2, 2]


@pytest.mark.parametrize("threads", [1, 2])
def test_the_threads_finishing_batches_ahead_end_with_their_loader(tmp_path, threads):
    import gc

    from dres.data.loaders import _Ahead

    def finishing_threads(loader):
        return [t for it in loader._running if isinstance(it, _Ahead) for t in it.threads]

    loader = build_loader(_loader_config("imagefolder", _folder(tmp_path), 2, finish_threads=threads), "train", 8)
    loader.next()
    first = finishing_threads(loader)
    assert len(first) == threads and all(t.is_alive() for t in first)
    assert loader.describe().endswith((", 2 threads finishing batches" if threads == 2 else "cores a process)") +
                                      f", up to {2 * 4 + 2 + threads} batches made ahead of the step")
    loader.close()  # stopped, and started again by the next batch
    assert not any(t.is_alive() for t in first)
    loader.next()
    second = finishing_threads(loader)
    del loader  # dropped without close(): the threads hold the loader weakly
    gc.collect()
    for t in second:
        t.join(30)
    assert not any(t.is_alive() for t in second)


def _numbers(n, fail_at=None):
    """An iterator of ``(i,)`` for i < n, raising ``ValueError`` at ``fail_at``, each item after a short random
    pause (the order of the thread's work and the taker's varies)."""
    rng = random.Random(n)
    for i in range(n):
        time.sleep(rng.uniform(0, 0.003))
        if i == fail_at:
            raise ValueError(f"at {i}")
        yield ({"i": torch.tensor(i)},)


def _cpu_finishers(n):
    """Stand-ins for n finishers on the CPU (what _Ahead reads of one: its device and stream priority)."""
    return [SimpleNamespace(device=torch.device("cpu"), priority=0) for _ in range(n)]


def _finish_after_a_pause(item, finisher):
    """A finish that takes a random pause (so that several threads end their items out of order) and fails on a
    negative item."""
    time.sleep(random.uniform(0, 0.003))
    if int(item[0]["i"]) < 0:
        raise ValueError(f"finishing {int(item[0]['i'])}")
    return item


@pytest.mark.parametrize("depth, threads", [(1, 1), (3, 1), (2, 3)])
def test_batches_ahead_come_in_order_then_the_sources_end(depth, threads):
    from dres.data.loaders import _Ahead

    ahead = _Ahead(_numbers(40), _finish_after_a_pause, _cpu_finishers(threads), depth, [])
    assert [int(next(ahead)[0]["i"]) for _ in range(40)] == list(range(40))
    with pytest.raises(StopIteration):
        next(ahead)
    for t in ahead.threads:
        t.join(10)
    assert not any(t.is_alive() for t in ahead.threads) and len(ahead.threads) == threads
    failing = _Ahead(_numbers(10, fail_at=6), _finish_after_a_pause, _cpu_finishers(threads), depth, [])
    assert [int(next(failing)[0]["i"]) for _ in range(6)] == list(range(6))
    with pytest.raises(ValueError, match="at 6"):
        next(failing)
    failing.stop()
    negative = (({"i": torch.tensor(i if i != 5 else -5)},) for i in range(10))  # the finish raises at the sixth
    finishing = _Ahead(negative, _finish_after_a_pause, _cpu_finishers(threads), depth, [])
    assert [int(next(finishing)[0]["i"]) for _ in range(5)] == list(range(5))
    with pytest.raises(ValueError, match="finishing -5"):
        next(finishing)
    finishing.stop()


@pytest.mark.parametrize("threads", [1, 2])
def test_stopping_the_batches_ahead_mid_epoch_ends_the_threads_waiting_for_room(threads):
    from dres.data.loaders import _Ahead, _stop_workers

    running = []
    ahead = _Ahead(_numbers(10**6), _finish_after_a_pause, _cpu_finishers(threads), 2, running)
    next(ahead)
    room = ahead.depth + threads
    deadline = time.time() + 10
    while len(ahead.entries) < room and time.time() < deadline:  # the threads now wait for room
        time.sleep(0.01)
    assert len(ahead.entries) == room and ahead.issued - ahead.taken == room
    assert all(t.is_alive() for t in ahead.threads)
    _stop_workers(running)
    assert not any(t.is_alive() for t in ahead.threads) and running == []


def test_nvimgcodec_gives_its_share_to_the_hardware_and_the_rest_and_its_refusals_to_the_cuda_cores(monkeypatch):
    """The split of a batch between nvImageCodec's two decoders and the path counted for each image, with stand-ins
    for the decoders (an image here is its first byte; the hardware refuses odd ones, the CUDA cores 255)."""
    import sys
    from types import ModuleType, SimpleNamespace

    from dres.data import decode

    calls = []

    class Decoder:
        def __init__(self, name, refuses):
            self.name, self.refuses = name, refuses

        def decode(self, streams, cuda_stream):
            calls.append((self.name, [int(s[0]) for s in streams]))
            return [None if self.refuses(int(s[0])) else np.full((2, 3, 3), s[0], dtype=np.uint8) for s in streams]

    fake = ModuleType("nvidia.nvimgcodec")
    fake.CodeStream = lambda a: a
    monkeypatch.setitem(sys.modules, "nvidia", ModuleType("nvidia"))
    monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", fake)
    monkeypatch.setattr(decode, "nvimgcodec_decoders", lambda index, hw_load: (
        Decoder("hardware", lambda v: v % 2) if hw_load > 0 else None, Decoder("cuda", lambda v: v == 255)))
    values = [2, 3, 4, 5, 6, 255, 8, 10]
    for hw_load, want_calls, want_paths in (
            (0.5, [("hardware", [2, 3, 4, 5]), ("cuda", [6, 255, 8, 10]), ("cuda", [3, 5])],
             ["hardware", "cuda", "hardware", "cuda", "cuda", None, "cuda", "cuda"]),
            (0.0, [("cuda", values)], ["cuda"] * 5 + [None, "cuda", "cuda"])):
        finisher = BatchFinisher("cpu", 4, 3, backend=None, hw_load=hw_load)
        finisher.stream = SimpleNamespace(cuda_stream=0)
        calls.clear()
        images, taken = finisher._decode_nvimgcodec([torch.tensor([v, 0], dtype=torch.uint8) for v in values])
        assert sorted(calls) == sorted(want_calls) and taken == want_paths
        assert [None if im is None else (int(im[0, 0, 0]), tuple(im.shape)) for im in images] == [
            None if v == 255 else (v, (3, 2, 3)) for v in values]  # HWC from the decoder, (C, H, W) here


def test_each_gpu_decoder_takes_its_own_hardware_share_unless_one_is_set(monkeypatch):
    """data.hw_decode_load's default, -1, is the decoder's own share of a batch for the hardware decoders (nvImageCodec
    0.65, nvjpeg 1: HW_DECODE_LOAD); a share that is set is the share, 0 included."""
    monkeypatch.setattr(torch.cuda, "Stream", lambda *args, **kwargs: SimpleNamespace(cuda_stream=0))
    assert DataConfig().hw_decode_load == -1
    shares = {b: BatchFinisher("cpu", 4, 3, backend=b).hw_load for b in ("nvimgcodec", "nvjpeg")}
    assert shares == {"nvimgcodec": 0.65, "nvjpeg": 1.0}
    assert [BatchFinisher("cpu", 4, 3, backend="nvjpeg", hw_load=s).hw_load for s in (0.0, 0.65)] == [0.0, 0.65]


def test_decode_gpu_without_a_gpu_is_a_one_line_error(tmp_path):
    d = DataConfig(name="imagefolder", path=_folder(tmp_path), img_size=8, num_classes=3, gpu_resident=False,
                   decode="gpu")
    with pytest.raises(DataError, match="data.decode=gpu needs a CUDA device"):
        build_loader(d, "train", 8, device="cpu")


def test_the_gpu_decoder_is_chosen_by_data_gpu_decoder(tmp_path, monkeypatch):
    import importlib.util

    from dres.data import decode_backend

    d = DataConfig(name="imagefolder", path=_folder(tmp_path), img_size=8, num_classes=3, gpu_resident=False,
                   decode="auto", gpu_decoder="nvimgcodec")
    assert not build_loader(d, "train", 8, device="cpu").prep.gpu  # decode=auto without a GPU: the workers decode
    d.decode, d.gpu_decoder = "gpu", "torchvision"
    with pytest.raises(DataError, match="data.gpu_decoder=torchvision is not installed, or the trainer runs on cpu"):
        build_loader(d, "train", 8, device="cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # what a GPU machine answers
    assert decode_backend(d, "cuda") == "torchvision"
    d.gpu_decoder = "nvimgcodec"
    if importlib.util.find_spec("nvidia") is None or importlib.util.find_spec("nvidia.nvimgcodec") is None:
        with pytest.raises(DataError, match=r"data.gpu_decoder=nvimgcodec is not installed \(pip install "):
            decode_backend(d, "cuda")
    d.decode = "auto"  # asked for by name, missing: an error rather than a silent switch
    monkeypatch.setattr("dres.data.factory.cores_per_process", lambda: 4)  # too few cores for the CPU decode: auto asks the GPU
    if importlib.util.find_spec("nvidia") is None or importlib.util.find_spec("nvidia.nvimgcodec") is None:
        with pytest.raises(DataError, match="data.gpu_decoder=nvimgcodec"):
            decode_backend(d, "cuda")
    d.gpu_decoder = "nvjpeg"
    if gpu_decode_backend("cuda", "nvjpeg") is None:
        with pytest.raises(DataError, match=r"data.gpu_decoder=nvjpeg is not installed \(pip install nvidia-nvjpeg\)"):
            decode_backend(d, "cuda")


def test_nvjpeg_without_its_library_says_where_it_looked_in_one_line(monkeypatch):
    from dres.data import nvjpeg

    monkeypatch.setattr(nvjpeg, "library_candidates", lambda: ["/nowhere/libnvjpeg.so.13", "libnvjpeg.so.99"])
    nvjpeg.load_nvjpeg.cache_clear()
    try:
        with pytest.raises(OSError, match=r"^data.gpu_decoder=nvjpeg needs libnvjpeg \(pip install nvidia-nvjpeg\); "
                                          r"tried /nowhere/libnvjpeg.so.13, libnvjpeg.so.99$"):
            nvjpeg.load_nvjpeg()
    finally:
        nvjpeg.load_nvjpeg.cache_clear()


def test_nvjpeg_splits_a_batch_by_the_hardware_share_in_batch_order():
    """data.hw_decode_load of the JPEGs the hardware decoders take go to them (the first, by position); every other
    decodable image to the batched call on the CUDA cores."""
    from dres.data.nvjpeg import hardware_share

    decodable, hardware_takes = [0, 1, 2, 4, 5, 6, 7], [0, 2, 4, 5, 7]
    assert hardware_share(hardware_takes, decodable, 1.0) == ([0, 2, 4, 5, 7], [1, 6])
    assert hardware_share(hardware_takes, decodable, 0.6) == ([0, 2, 4], [1, 5, 6, 7])
    assert hardware_share(hardware_takes, decodable, 0.0) == ([], decodable)
    assert hardware_share([], decodable, 0.65) == ([], decodable)  # no hardware decoders: all on the CUDA cores


def test_nvjpeg_image_struct_and_status_words_are_nvjpeg_hs():
    """nvjpegImage_t: four plane pointers then four pitches (64 bytes on a 64-bit host); a failed call names its
    status as nvjpeg.h does."""
    import ctypes

    from dres.data import nvjpeg

    assert ctypes.sizeof(nvjpeg.NvjpegImage) == 8 * nvjpeg.NVJPEG_MAX_COMPONENT * 2
    assert nvjpeg.NvjpegImage.pitch.offset == 8 * nvjpeg.NVJPEG_MAX_COMPONENT
    nvjpeg.check(0, "nvjpegDecode")
    with pytest.raises(nvjpeg.NvjpegError, match=r"^nvjpegDecodeBatched failed: NVJPEG_STATUS_BAD_JPEG$"):
        nvjpeg.check(3, "nvjpegDecodeBatched")


def test_decode_auto_takes_the_cpu_where_the_process_has_the_cores_for_it(tmp_path, monkeypatch):
    from dres.data import factory as data

    d = DataConfig(name="imagefolder", path=_folder(tmp_path), img_size=8, num_classes=3, gpu_resident=False)
    assert d.decode == "auto" and d.num_workers == -1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # what a GPU machine answers
    for cores, want in ((4, "torchvision"), (data.CPU_DECODE_MIN_CORES - 1, "torchvision"),
                        (data.CPU_DECODE_MIN_CORES, None), (64, None)):
        monkeypatch.setattr(data, "cores_per_process", lambda: cores)
        assert data.decode_backend(d, "cuda") == want, cores
        d.decode = "gpu"  # asked for by name: the GPU whatever the cores
        assert data.decode_backend(d, "cuda") == "torchvision"
        d.decode = "cpu"
        assert data.decode_backend(d, "cuda") is None
        d.decode = "auto"
    # the workers by the decode, and what was taken in words for the run's log
    monkeypatch.setattr(data, "cores_per_process", lambda: 3)
    monkeypatch.setattr("dres.data.loaders.cores_per_process", lambda: 3)
    loader = build_loader(d, "train", 8, device="cpu")
    assert loader.num_workers == 2 and not loader.prep.gpu
    assert loader.describe() == "decoded on the CPU, 2 workers (3 cores a process), up to 11 batches made ahead of the step"
    loader.close()
    d.num_workers = 1
    loader = build_loader(d, "train", 8, device="cpu")
    assert loader.num_workers == 1
    loader.close()


def test_cores_per_process_is_the_affinity_within_the_cpu_limit_shared_by_the_nodes_ranks(monkeypatch):
    from dres.data import decode

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(decode, "cgroup_cpu_limit", lambda: None)
    assert decode.cores_per_process() == 32
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert decode.cores_per_process() == 4
    monkeypatch.setattr(decode, "cgroup_cpu_limit", lambda: 6.5)  # a container limited to 6.5 CPUs
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert decode.cores_per_process() == 6
    monkeypatch.setattr(decode, "cgroup_cpu_limit", lambda: 0.5)
    assert decode.cores_per_process() == 1


@pytest.mark.parametrize("v2, v1, want", [("max 100000\n", None, None), ("400000 100000\n", None, 4.0),
                                          (None, ("-1", "100000"), None), (None, ("250000", "100000"), 2.5),
                                          (None, None, None)])
def test_the_cgroup_cpu_limit_is_read_from_v2_or_v1(monkeypatch, v2, v1, want):
    from dres.data import decode

    files = {"/sys/fs/cgroup/cpu.max": v2}
    if v1:
        files.update({"/sys/fs/cgroup/cpu/cpu.cfs_quota_us": v1[0], "/sys/fs/cgroup/cpu/cpu.cfs_period_us": v1[1]})
    real_open = open

    def fake_open(path, *args, **kwargs):
        if str(path).startswith("/sys/fs/cgroup"):
            if files.get(str(path)) is None:
                raise FileNotFoundError(path)
            return io.StringIO(files[str(path)])
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", fake_open)
    assert decode.cgroup_cpu_limit() == want


@pytest.mark.gpu
@pytest.mark.parametrize("jitter", [0.0, 0.4])
@pytest.mark.parametrize("backend, hw_load", [("nvimgcodec", 0.65), ("torchvision", 0.65), ("nvjpeg", 0.65),
                                              ("nvjpeg", 0.0)])
def test_gpu_decode_matches_the_cpu_decode_of_the_same_crops(tmp_path, backend, hw_load, jitter):
    if backend == "nvimgcodec":
        pytest.importorskip("nvidia.nvimgcodec")
    if backend == "nvjpeg" and gpu_decode_backend("cuda", "nvjpeg") is None:
        pytest.skip("libnvjpeg is not installed (pip install nvidia-nvjpeg)")
    kinds = ["jpeg", "progressive", "grey", "cmyk", "png", "jpeg"]
    blobs = [_encode(k, 120 + 7 * i, 90 + 5 * i, seed=i) for i, k in enumerate(kinds)] + [b"broken"]
    batches = {}
    for gpu in (True, False):
        prep = SamplePrep(32, gpu=gpu, jitter=jitter)  # the same seeds: the same crops and jitter either way
        batch = collate_prepared([prepare(prep, b, i, i, f"f{i}") for i, b in enumerate(blobs)])
        finisher = BatchFinisher("cuda", 32, 3, MEAN, STD, backend if gpu else None, hw_load)
        lost, paths = [], Counter()
        batches[gpu] = finisher(batch, lost, paths)
        assert batch["lost"] == ["f6: UnidentifiedImageError"] and lost == []
        # the baseline RGB and grey JPEGs by the GPU, the progressive, CMYK and PNG files by the workers
        # nvjpeg: every JPEG the GPU takes in a batched call ("cuda_one", one at a time, would say one was refused)
        gpu_paths = {"nvjpeg"} if backend == "torchvision" else {"hardware", "cuda"} if hw_load else {"cuda"}
        assert sum(paths.values()) == 6 and paths["workers"] == (3 if gpu else 6)
        assert (finisher.decode_s > 0) == gpu  # the host's time in the GPU decoder's call
        assert set(paths) - {"workers"} <= (gpu_paths | {"cpu_fallback"} if gpu else set())
    gpu, cpu = batches[True], batches[False]
    assert gpu["label"].tolist() == cpu["label"].tolist() == list(range(6))
    # decoders and resize filters differ (nvJPEG vs libjpeg-turbo, roi_align vs antialiased bilinear): close, not equal
    diff = ((gpu["image"] - cpu["image"]) * torch.tensor(STD, device="cuda").view(1, 3, 1, 1) * 255).abs()
    assert diff.mean() < 6 and torch.isfinite(gpu["image"]).all()


@pytest.mark.gpu
def test_a_cpu_share_decoded_by_the_workers_joins_the_gpus_images_in_batch_order():
    backend = gpu_decode_backend("cuda")
    if backend is None:
        pytest.skip("no GPU JPEG decoder is installed")
    blobs = [_encode("jpeg", 120 + 7 * i, 90 + 5 * i, seed=i) for i in range(8)]
    finished = {}
    for share in (0.0, 0.5):
        samples = [prepare(SamplePrep(32, gpu=True, cpu_share=share), b, i, i, f"f{i}") for i, b in enumerate(blobs)]
        on_cpu = sum(s[0] == "pixels" for s in samples)
        assert (0 < on_cpu < 8) if share else on_cpu == 0
        paths = Counter()
        finished[share] = BatchFinisher("cuda", 32, 3, MEAN, STD, backend, -1)(collate_prepared(samples), [], paths)
        assert finished[share]["label"].tolist() == list(range(8))
        assert paths["workers"] == on_cpu and sum(paths.values()) == 8
    # libjpeg-turbo and antialiased bilinear for some images, nvJPEG and roi_align for the rest: close, not equal
    diff = ((finished[0.5]["image"] - finished[0.0]["image"]) * torch.tensor(STD, device="cuda").view(1, 3, 1, 1) * 255)
    assert diff.abs().mean() < 6


@pytest.mark.gpu
@pytest.mark.parametrize("gpu_decoder", ["auto", "torchvision"])
def test_gpu_decode_is_the_default_where_a_decoder_is_there_and_few_cores(tmp_path, gpu_decoder, monkeypatch):
    from dres.data import factory as data

    monkeypatch.setattr(data, "cores_per_process", lambda: 4)
    d = DataConfig(name="imagefolder", path=_folder(tmp_path), img_size=16, num_classes=3, gpu_resident=False,
                   num_workers=2, gpu_decoder=gpu_decoder)
    loader = build_loader(d, "train", 8, device="cuda")
    assert loader.prep.gpu == (gpu_decode_backend("cuda") is not None)
    assert loader.finisher.backend == gpu_decode_backend("cuda", gpu_decoder)
    batch = loader.next()
    assert batch["image"].is_cuda and batch["image"].shape == (8, 3, 16, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("high", [True, False])
def test_the_streams_finishing_batches_run_at_the_gpus_highest_priority(tmp_path, high, monkeypatch):
    """The finisher's stream and those of the threads finishing batches ahead (two here), each made where the loader
    makes it, recorded as it is made."""
    if gpu_decode_backend("cuda") is None:
        pytest.skip("no GPU JPEG decoder")
    priorities = []

    class RecordedStream(torch.cuda.Stream):
        def __new__(cls, *args, **kwargs):
            stream = super().__new__(cls, *args, **kwargs)
            if "stream_id" not in kwargs:  # a new stream: torch.cuda.current_stream() wraps an existing one
                priorities.append(stream.priority)
            return stream

    monkeypatch.setattr(torch.cuda, "Stream", RecordedStream)
    d = DataConfig(name="imagefolder", path=_folder(tmp_path), img_size=16, num_classes=3, gpu_resident=False,
                   decode="gpu", num_workers=2, finish_high_priority=high, finish_threads=2)
    loader = build_loader(d, "train", 8, device="cuda")
    try:
        loader.next()
    finally:
        loader.close()
    want = min(torch.cuda.Stream.priority_range()) if high else 0
    assert loader.finisher.stream.priority == want
    assert priorities == [want] * 4  # the finisher's, its replica's, the two threads'
    assert want < 0 or not high  # a GPU has more than the one default priority


@pytest.mark.gpu
@pytest.mark.parametrize("decode", ["gpu", "cpu"])
def test_batches_ahead_on_a_gpu_equal_those_made_between_steps_and_are_taken_without_a_host_sync(tmp_path, decode):
    """On the GPU: the same batches in the same order with the ring as without, and (with the CPU decode, whose
    finishing thread does not sync either) the taker waits on an event, never on the host."""
    if decode == "gpu" and gpu_decode_backend("cuda") is None:
        pytest.skip("no GPU JPEG decoder")
    path = _folder(tmp_path, bad=(4,))
    runs = {}
    for ahead in (0, 2):
        d = _loader_config("imagefolder", path, ahead)
        d.decode = decode
        loader = build_loader(d, "train", 8, device="cuda", seed=3)
        runs[ahead] = [(loader.next(), loader.state_dict()) for _ in range(7)]
        if ahead and decode == "cpu":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                taken = [loader.next() for _ in range(4)]
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert all(b["image"].is_cuda for b in taken)
        loader.close()
    for (a, state_a), (b, state_b) in zip(runs[0], runs[2]):
        assert torch.equal(a["image"], b["image"]) and torch.equal(a["label"], b["label"]) and state_a == state_b
    # the folder's files are baseline JPEGs: all on the GPU with its decode, all in the workers with the CPU's
    if decode == "cpu":
        assert set(loader.decoded) == {"workers"}
    else:
        assert "workers" not in loader.decoded and {"nvjpeg", "hardware", "cuda"} & set(loader.decoded)


# ------------------------------------------------------------------ the trainer reading files, as a process
TINY_FOLDER_RUN = ["device=cpu", "data.name=imagefolder", "data.gpu_resident=false", "data.decode=cpu", "data.num_workers=2",
                   "data.img_size=8", "data.num_classes=3", "data.max_corrupt_frac=0.5", "model.img_size=8",
                   "model.patch_size=4", "model.embed_dim=32", "model.depth=1", "model.num_heads=2",
                   "model.decoder_embed_dim=32", "model.decoder_depth=1", "model.decoder_num_heads=2", "batch_size=8",
                   "optim.warmup_steps=1", "log.every=1", "log.progress=false", "log.tensorboard=false",
                   "eval.probe=false", "eval.knn=false", "eval.effective_rank=false", "eval.recon=false", "threads=1"]


def _folder_run(tmp_path, out, steps, extra=(), flags=()):
    import subprocess
    import sys

    images = tmp_path / "images"
    if not images.exists():
        images.mkdir()
        _folder(images)
    sets = [*TINY_FOLDER_RUN, f"data.path={images}", f"steps={steps}", *extra]
    cmd = [sys.executable, "-m", "dres.train.mae", "--preset", "quickstart", "--out", str(out), *flags]
    cmd += [a for kv in sets for a in ("--set", kv)]
    return subprocess.Popen(cmd, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1"))


def test_a_run_reading_files_with_workers_ends_when_it_is_done(tmp_path):
    """The workers ignore SIGTERM (a signal to the group is the trainer's), so the loader stops them itself:
    the process exits when training ends, without waiting on them."""
    proc = _folder_run(tmp_path, tmp_path / "run", steps=4)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, (out, err)
    assert "done: 4 steps" in out
    assert "[dres] data: imagefolder, decoded on the CPU, 2 workers (" in out  # what the run reads, said once


@pytest.mark.parametrize("threads", [1, 2])
def test_sigterm_to_the_process_group_with_workers_saves_and_exits_75(tmp_path, threads):
    """What Slurm, Kubernetes and timeout do: SIGTERM to every process of the group, the DataLoader workers
    included; the trainer finishes its step, saves and exits 75, and the run resumes from there (with one thread
    finishing batches ahead, and with two)."""
    _sigterm_saves_exits_75_and_resumes(tmp_path, [f"data.finish_threads={threads}"])


@pytest.mark.gpu
def test_sigterm_during_gpu_decode_saves_and_exits_75(tmp_path):
    """The same with the GPU decode finishing batches ahead on its own streams."""
    if gpu_decode_backend("cuda") is None:
        pytest.skip("no GPU JPEG decoder")
    _sigterm_saves_exits_75_and_resumes(tmp_path, ["device=cuda", "data.decode=gpu", "compile=false",
                                                   "cuda_graphs=false"])


def _sigterm_saves_exits_75_and_resumes(tmp_path, extra):
    import signal

    from dres.train import checkpoint
    from dres.train.stop import EXIT_INTERRUPTED

    out = tmp_path / "run"
    extra = ["ckpt.every=0", *extra]
    proc = _folder_run(tmp_path, out, steps=100000, extra=extra)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        metrics = out / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_INTERRUPTED, (stdout, stderr)
    assert "stopped by SIGTERM after step" in stderr and "DataLoader worker" not in stderr
    saved = checkpoint.list_checkpoints(out / "checkpoints")
    assert len(saved) == 1
    step = int(saved[0].stem.split("_")[1])
    resumed = _folder_run(tmp_path, out, steps=step + 2, extra=extra, flags=["--resume", "auto"])
    stdout, stderr = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, (stdout, stderr)
    import json

    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, step + 3)), steps  # the resumed run went on from the checkpoint's step


def test_a_stop_request_while_decoding_into_memory_is_no_lost_file(tmp_path, monkeypatch):
    """The trainer's signal handler raises its stop (a RuntimeError subclass) wherever the main thread is: while
    a folder is decoded into memory, that is a stop, never a damaged file."""
    from dres.data import sources

    class Stop(RuntimeError):
        pass

    root = _folder(tmp_path)
    calls = []

    def read_then_stop(path):
        calls.append(path)
        if len(calls) == 3:
            raise Stop("stopped by SIGTERM before training started")
        return read_file(path)

    monkeypatch.setattr(sources, "read_file", read_then_stop)
    counter = sources.CorruptCounter()
    with pytest.raises(Stop):
        sources.read_image_folder(root, counter=counter)
    assert counter.count == 0


def test_streamed_files_raise_no_warning(tmp_path):
    """Greyscale, CMYK and PNG files, workers and the main process: no NumPy or torch warning per sample."""
    import warnings

    root = tmp_path / "mixed"
    for i, kind in enumerate(["jpeg", "grey", "cmyk", "png", "progressive", "jpeg", "grey", "png"]):
        (root / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        (root / f"c{i % 2}" / f"{i}.JPEG").write_bytes(_encode(kind, 30, 20, seed=i))
    d = DataConfig(name="imagefolder", path=str(root), img_size=8, num_classes=2, gpu_resident=False, decode="cpu",
                   num_workers=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader = build_loader(d, "train", 4)
        for _ in range(4):
            assert loader.next()["image"].shape == (4, 3, 8, 8)


def test_two_ranks_train_from_a_folder_with_their_workers(tmp_path):
    """DDP from files: two gloo ranks under dres-launch, each reading its share of every batch with its own
    workers, train to the end and exit 0 (each rank's share is checked in
    test_folder_loader_resumes_exactly_and_ranks_split_the_global_batch)."""
    import socket
    import subprocess
    import sys

    images = tmp_path / "images"
    images.mkdir()
    _folder(images)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # the baseline MAE: with one encoder block the official variant's skip layers take no part in the loss
    sets = [*TINY_FOLDER_RUN, f"data.path={images}", "steps=4", "dist=ddp", "compile=false", "model.variant=baseline"]
    cmd = [sys.executable, "-m", "dres.train.launch", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(port), "-m", "dres.train.mae", "--preset", "quickstart", "--out", str(tmp_path / "run")]
    cmd += [a for kv in sets for a in ("--set", kv)]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    proc = subprocess.run(cmd, cwd=str(tmp_path), env=dict(env, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert "world 2 (ddp)" in proc.stdout and "done: 4 steps" in proc.stdout


def test_bench_data_makes_an_imagenet_like_folder_and_reads_its_rows(tmp_path):
    """The benchmark's CPU parts: the folder (layout, kinds, every file readable as the loader reads it) and the
    table, each trainer row over the same trainer on synthetic data."""
    from benchmarks.bench_data import _data_config, make_folder, markdown

    stats = make_folder(str(tmp_path / "inet"), 24, 3, procs=1)
    assert stats["images"] == 24 and sum(stats["kinds"].values()) == 24 and stats["mean_kib"] > 10
    assert _data_config(str(tmp_path / "inet"), "cpu", 0).name == "imagefolder"
    d = DataConfig(name="imagefolder", path=str(tmp_path / "inet"), img_size=16, num_classes=3, gpu_resident=False,
                   decode="cpu", num_workers=0, max_corrupt_frac=0.0)
    loader = build_loader(d, "train", 8)
    assert [len(loader.next()["label"]) for _ in range(3)] == [8, 8, 8] and loader.counter.count == 0
    rows = [{"kind": "trainer", "name": "vit", "data": ["data.name=synthetic"], "cores": None, "images_per_s": 5000.0},
            {"kind": "trainer", "name": "vit", "data": ["data.name=imagefolder", "data.decode=gpu",
                                                        "data.num_workers=4"], "cores": 4, "images_per_s": 4750.0},
            {"kind": "loader", "source": "wds", "decode": "cpu", "workers": 4, "error": "boom", "cores": 4}]
    table = markdown(rows, "h100")
    assert "| trainer vit (imagefolder) | gpu | 1 | 4 | 4 | 4,750 | 0.95x |" in table
    assert "| loader wds | cpu | 1 | 4 | 4 | failed: boom |  |" in table


def test_a_run_that_may_decode_on_the_gpu_widens_cudas_hardware_queues(tmp_path, monkeypatch):
    """CUDA_DEVICE_MAX_CONNECTIONS=32 where the decode may run on the GPU (decode=gpu, or auto with too few cores for
    the CPU decode); nothing for the CPU decode, for in-memory data, or where the environment already says."""
    from dres.data import widen_hardware_queues

    d = DataConfig(name="imagefolder", path=_folder(tmp_path), img_size=8, num_classes=3, gpu_resident=False,
                   decode="auto")

    def widened(cores=8, **values):
        monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
        monkeypatch.setattr("dres.data.factory.cores_per_process", lambda: cores)
        widen_hardware_queues(dataclasses.replace(d, **values))
        return os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")

    assert widened() == "32" and widened(cores=4) == "32" and widened(cores=64, decode="gpu") == "32"
    assert widened(cores=64) is None and widened(decode="cpu") is None
    assert widened(name="synthetic") is None and widened(gpu_resident=True) is None
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "4")
    widen_hardware_queues(d)
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "4"


def test_the_trainer_widens_the_queues_before_it_takes_its_device(tmp_path, monkeypatch):
    from dres.train.config import build_config
    from dres.train.loop import Trainer
    from dres.train.tasks import get_task

    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    monkeypatch.setattr("dres.data.factory.cores_per_process", lambda: 8)
    cfg = build_config("mae", "quickstart", ["data.name=imagefolder", f"data.path={_folder(tmp_path)}",
                                             "data.gpu_resident=false", "device=cpu"])
    seen = []

    def take_device(*args):  # where the process's CUDA context would be created: the variable must be set by then
        seen.append(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"))
        raise RuntimeError("device taken")

    monkeypatch.setattr("dres.train.distributed.init", take_device)
    with pytest.raises(RuntimeError, match="device taken"):
        Trainer(cfg, get_task("mae"))
    assert seen == ["32"]
