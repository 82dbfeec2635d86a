"""data.name=mnist_tv: MNIST in torchvision's folder layout, read from its idx files (plain or gzip),
on a small synthetic data set written here in the exact idx format."""

import gzip
import json
import struct

import numpy as np
import pytest
import torch

from dres.data import DataError, build_loader, normalize
from dres.train.config import DataConfig

N_TRAIN, N_TEST = 50, 20
FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
         "t10k": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


def idx_bytes(arr: np.ndarray, magic: int | None = None) -> bytes:
    """The idx encoding of a uint8 array: magic 0x0000 08 ndim, big-endian uint32 dims, the bytes."""
    magic = 0x800 + arr.ndim if magic is None else magic
    return struct.pack(f">I{arr.ndim}I", magic, *arr.shape) + arr.astype(np.uint8).tobytes()


def write(path, data: bytes, gz: bool):
    if gz:
        path = path.with_name(path.name + ".gz")
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)
    return path


def make_mnist(root, layout="MNIST/raw", gz=True, seed=0):
    """A tiny MNIST in torchvision's layout: ``{split: (images (N,28,28) uint8, labels (N,))}``; the
    training files gzip'd when ``gz``, the test files plain (torchvision keeps both forms)."""
    rng = np.random.default_rng(seed)
    d = root / layout if layout else root
    d.mkdir(parents=True, exist_ok=True)
    out = {}
    for split, n in (("train", N_TRAIN), ("t10k", N_TEST)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, n).astype(np.uint8)
        for name, arr in zip(FILES[split], (images, labels)):
            write(d / name, idx_bytes(arr), gz and split == "train")
        out[split] = (images, labels)
    return d, out


def mnist_cfg(path, **kw):
    base = dict(name="mnist_tv", path=str(path), img_size=28, in_chans=1, num_classes=10, aug="none",
                normalize=False, gpu_resident=True)
    return DataConfig(**{**base, **kw})


@pytest.mark.parametrize("layout", ["MNIST/raw", "raw", ""])
@pytest.mark.parametrize("gz", [True, False])
def test_mnist_tv_reads_torchvision_layouts_exactly(tmp_path, layout, gz):
    _, data = make_mnist(tmp_path, layout, gz)
    for split, name in (("train", "train"), ("val", "t10k")):
        ld = build_loader(mnist_cfg(tmp_path), split, 10, train=split == "train")
        images, labels = data[name]
        assert ld.images.dtype == torch.uint8 and ld.images.shape == (len(images), 1, 28, 28)
        assert torch.equal(ld.images[:, 0], torch.from_numpy(images))
        assert ld.labels.dtype == torch.int64 and torch.equal(ld.labels, torch.from_numpy(labels).long())
        assert ld.counter.count == 0
        batches = list(ld.eval_batches(7))
        x = torch.cat([b["image"] for b in batches])
        assert x.dtype == torch.float32 and x.shape == (len(images), 1, 28, 28)
        torch.testing.assert_close(x[:, 0], torch.from_numpy(images).float() / 255, rtol=0, atol=1e-6)
        assert torch.equal(torch.cat([b["label"] for b in batches]), ld.labels)


def test_mnist_tv_training_batches_are_normalised_samples_with_their_labels(tmp_path):
    _, data = make_mnist(tmp_path)
    mean, std = [0.1307], [0.3081]
    ld = build_loader(mnist_cfg(tmp_path, normalize=True, mean=mean, std=std), "train", 10, seed=3)
    images, labels = data["train"]
    by_image = {images[i].tobytes(): int(labels[i]) for i in range(len(images))}
    seen = set()
    for _ in range(len(ld)):
        b = ld.next()
        assert b["image"].shape == (10, 1, 28, 28) and b["label"].shape == (10,)
        raw = (b["image"][:, 0] * std[0] + mean[0]) * 255  # undo the normalisation
        pixels = raw.round().clamp(0, 255).to(torch.uint8).numpy()
        torch.testing.assert_close(raw, torch.from_numpy(pixels).float(), rtol=0, atol=1e-3)
        for img, label in zip(pixels, b["label"].tolist()):
            assert by_image[img.tobytes()] == label
            seen.add(img.tobytes())
    assert len(seen) == len(ld) * 10  # one epoch: no sample twice


def test_mnist_tv_replicates_grey_to_three_channels_and_resizes(tmp_path):
    _, data = make_mnist(tmp_path)
    mean, std = [0.1307] * 3, [0.3081] * 3
    ld = build_loader(mnist_cfg(tmp_path, in_chans=3, img_size=32, normalize=True, mean=mean, std=std), "val", 10,
                      train=False)
    images = torch.from_numpy(data["t10k"][0])
    assert ld.images.shape == (N_TEST, 3, 28, 28)
    for c in range(3):
        assert torch.equal(ld.images[:, c], images)
    x = next(ld.eval_batches(N_TEST))["image"]
    assert x.shape == (N_TEST, 3, 32, 32)
    # resized and normalised by the loaders' shared path, each channel the same
    torch.testing.assert_close(x, normalize(images[:, None], 32, mean[:1], std[:1]).expand(-1, 3, -1, -1))
    # the training path resizes too, augmentation or none
    for aug in ("none", "rrc_flip"):
        ld = build_loader(mnist_cfg(tmp_path, in_chans=3, img_size=32, aug=aug), "train", 10)
        b = ld.next()["image"]
        assert b.shape == (10, 3, 32, 32) and torch.equal(b[:, 0], b[:, 2])


def test_mnist_tv_limit_and_val_path(tmp_path):
    make_mnist(tmp_path / "a")
    _, other = make_mnist(tmp_path / "b", seed=1)
    cfg = mnist_cfg(tmp_path / "a", val_path=str(tmp_path / "b"), limit=30, val_limit=12)
    assert len(build_loader(cfg, "train", 10).images) == 30
    val = build_loader(cfg, "val", 4, train=False)
    assert torch.equal(val.images[:, 0], torch.from_numpy(other["t10k"][0][:12]))


def _one_line_error(cfg, split="train") -> str:
    with pytest.raises(DataError) as e:
        build_loader(cfg, split, 10)
    msg = str(e.value)
    assert len(msg.splitlines()) == 1, msg
    return msg


@pytest.mark.parametrize("gz", [True, False])
def test_mnist_tv_truncated_file_is_a_one_line_error_naming_it(tmp_path, gz):
    d, _ = make_mnist(tmp_path, gz=gz)
    name = FILES["train"][0] + (".gz" if gz else "")
    f = d / name
    f.write_bytes(f.read_bytes()[:-100])  # the last 100 bytes of the (compressed) file lost
    msg = _one_line_error(mnist_cfg(tmp_path))
    assert str(f) in msg
    assert ("is truncated or corrupt (EOFError" in msg) if gz else ("truncated" in msg and "50x28x28" in msg)
    f.write_bytes(f.read_bytes()[:10] if not gz else gzip.compress(b"\0\0\x08\x03\0\0"))  # inside the header
    assert str(f) in _one_line_error(mnist_cfg(tmp_path))


def test_mnist_tv_wrong_magic_and_mismatched_files_are_one_line_errors(tmp_path):
    d, data = make_mnist(tmp_path, gz=False)
    images, labels = data["t10k"]
    # the images and labels files swapped: each has the other's magic number
    (d / FILES["t10k"][0]).write_bytes(idx_bytes(labels))
    msg = _one_line_error(mnist_cfg(tmp_path), "val")
    assert str(d / FILES["t10k"][0]) in msg and "magic number 0x00000801, expected 0x00000803" in msg
    # a non-uint8 idx type (0x0D: float32) is not MNIST's format either
    (d / FILES["t10k"][0]).write_bytes(idx_bytes(images, magic=0x0D03))
    assert "magic number 0x00000d03" in _one_line_error(mnist_cfg(tmp_path), "val")
    # trailing bytes after the data the header announces
    (d / FILES["t10k"][0]).write_bytes(idx_bytes(images) + b"\0" * 5)
    assert "trailing bytes" in _one_line_error(mnist_cfg(tmp_path), "val")
    # fewer labels than images
    (d / FILES["t10k"][0]).write_bytes(idx_bytes(images))
    (d / FILES["t10k"][1]).write_bytes(idx_bytes(labels[:-1]))
    msg = _one_line_error(mnist_cfg(tmp_path), "val")
    assert f"holds {N_TEST} images but" in msg and f"{N_TEST - 1} labels" in msg
    # plain idx bytes under a .gz name
    (d / FILES["train"][1]).unlink()
    (d / (FILES["train"][1] + ".gz")).write_bytes(idx_bytes(data["train"][1]))
    msg = _one_line_error(mnist_cfg(tmp_path))
    assert f"{d / FILES['train'][1]}.gz is truncated or corrupt (BadGzipFile" in msg


def test_mnist_tv_missing_data_says_where_to_put_it(tmp_path):
    assert "torchvision's MNIST/ folder (MNIST/raw/train-images-idx3-ubyte" in _one_line_error(mnist_cfg(""))
    assert f"data path not found: {tmp_path / 'nope'}" in _one_line_error(mnist_cfg(tmp_path / "nope"))
    (tmp_path / "MNIST" / "raw").mkdir(parents=True)
    assert "no MNIST idx files under" in _one_line_error(mnist_cfg(tmp_path))
    make_mnist(tmp_path)
    assert "data.in_chans must be 1 or 3" in _one_line_error(mnist_cfg(tmp_path, in_chans=2))
    assert "data.num_classes=5" in _one_line_error(mnist_cfg(tmp_path, num_classes=5))


def test_mnist_preset_keeps_the_cifar_recipe():
    """classify_resnet50d_mnist differs from classify_resnet50d_cifar10 in its data only."""
    from dres.train.config import build_config, to_dict

    mnist, cifar = (to_dict(build_config(None, f"classify_resnet50d_{d}")) for d in ("mnist", "cifar10"))
    assert {k for k in mnist if mnist[k] != cifar[k]} == {"preset", "data", "model"}
    assert {k for k in mnist["data"] if mnist["data"][k] != cifar["data"][k]} == {"name", "img_size", "mean", "std"}
    assert {k for k in mnist["model"] if mnist["model"][k] != cifar["model"][k]} == {"img_size"}
    assert mnist["data"]["mean"] == [0.1307] * 3 and mnist["data"]["std"] == [0.3081] * 3


def test_mnist_preset_trains_resnet_on_the_cpu(tmp_path, capsys):
    from dres.train import cli

    make_mnist(tmp_path / "data")
    common = ["classify", "--preset", "classify_resnet50d_mnist", "--set", "compile=false", "--set", "log.progress=false",
              "--set", "log.tensorboard=false"]
    # the preset's empty data.path: one line that says where torchvision's MNIST folder goes
    assert cli.main(common + ["--out", str(tmp_path / "nodata")]) == 2
    err = capsys.readouterr().err.strip()
    assert "needs data.path: the folder holding torchvision's MNIST/ folder" in err and len(err.splitlines()) == 1, err
    overrides = [f"data.path={tmp_path / 'data'}", "model.arch=resnet18", "batch_size=10", "steps=3",
                 "optim.warmup_steps=1", "ckpt.every=0"]
    out = tmp_path / "run"
    assert cli.main(common + ["--out", str(out)] + sum([["--set", o] for o in overrides], [])) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and 0.0 <= summary["eval"]["top1"] <= 1.0
    assert summary["lost_data"]["corrupt_samples"] == 0


@pytest.mark.gpu
def test_mnist_tv_is_gpu_resident(tmp_path):
    make_mnist(tmp_path)
    cfg = mnist_cfg(tmp_path, in_chans=3, img_size=32, normalize=True, mean=[0.1307] * 3, std=[0.3081] * 3)
    gpu, cpu = build_loader(cfg, "train", 10, device="cuda"), build_loader(cfg, "train", 10)
    assert gpu.images.is_cuda and gpu.images.shape == (N_TRAIN, 3, 28, 28)
    b_gpu, b_cpu = gpu.next(), cpu.next()
    assert b_gpu["image"].is_cuda
    torch.testing.assert_close(b_gpu["image"].cpu(), b_cpu["image"], rtol=1e-5, atol=1e-5)
    assert torch.equal(b_gpu["label"].cpu(), b_cpu["label"])
