"""The loader factory: ``build_loader(data_cfg, split, global_batch, ...)`` reads ``data_cfg.name``
(:data:`READERS`, a name's reader of a whole split into memory):

==============  ==============================================================================
digits          scikit-learn's handwritten digits (no download), upsampled to ``img_size``
cifar10_wds     the shared CIFAR-10 WebDataset shards (``path`` = their folder; default
                ``../shared/data/cifar10`` beside the checkout)
wds             any WebDataset shards: ``path`` in brace notation (``/d/train-{000..099}.tar``), a folder with
                a ``manifest.json`` (``dres-prep``'s output), ``pipe:CMD`` or ``http(s)://`` URLs
imagefolder     ImageNet-layout ``root/<class>/<image>`` trees
cifar_tv        CIFAR-10/100 in torchvision's pickled format (``path`` = the root folder)
mnist_tv        MNIST in torchvision's idx files (``path`` = the folder holding ``MNIST/raw/``)
synthetic       random images (throughput runs)
==============  ==============================================================================

Sets that only come whole (:data:`IN_MEMORY`) are always decoded into memory; an ImageFolder tree and shards may
also be streamed (``data.gpu_resident=false``): read file by file, or shard by shard.
"""

from __future__ import annotations

import os

import torch

from dres.data.decode import BatchFinisher, SamplePrep, cores_per_process, gpu_decode_backend
from dres.data.loaders import FolderLoader, InMemoryLoader, ShardLoader
from dres.data.sources import (CorruptCounter, DataError, check_labels, cifar10_pattern, default_cifar10_dir,
                               expand_shards, manifest_samples, read_cifar_torchvision, read_digits, read_image_folder,
                               read_mnist_torchvision, read_shards, verify_manifest)

# what a user who brings the data runs: the command that makes shards, and the keys that read them
_MAKE_SHARDS = ("make shards with `dres-prep <train folder of class folders> <out>/train` (and the same for the "
                "validation images into <out>/val), then --set data.name=wds --set data.path=<out>/train "
                "--set data.val_path=<out>/val")


def _pattern(d, split):
    """The path of ``split`` ('train' | 'val') for shard and folder sources. Data the user must bring and has not
    named is one line saying how to make it."""
    if d.name == "cifar10_wds":
        root = (d.val_path if split == "val" and d.val_path else d.path) or str(default_cifar10_dir())
        if not os.path.isdir(root):
            if os.path.exists(root) or "{" in root or "*" in root:
                return root
            if not d.path:  # the preset's default: the shared shards beside a checkout, absent here
                raise DataError(f"this preset reads CIFAR-10 that you bring (no data.path given, no shared shards "
                                f"beside a checkout): {_MAKE_SHARDS}")
            raise DataError(f"data path not found: {root}")
        return cifar10_pattern(root, "test" if split == "val" else "train")
    p = d.val_path if split == "val" else d.path
    if not p:
        key = "val_path" if split == "val" else "path"
        raise DataError(f"no {'validation' if split == 'val' else 'training'} data path: set data.{key}=<folder of "
                        f"class folders> (data.name=imagefolder), or {_MAKE_SHARDS}")
    return p


def _head(x, y, counter, limit):
    """The first ``limit`` samples (all with 0), for the readers that read a whole split at once."""
    return (x[:limit], y[:limit], counter) if limit else (x, y, counter)


def _read_digits(d, split, limit, counter):
    x, y = read_digits("test" if split == "val" else "train", d.img_size, seed=0)
    return _head(x, y, counter, limit)


def _read_shards(d, split, limit, counter):
    return read_shards(_shard_pattern(d, split), d.in_chans, limit, counter)


def _read_cifar_tv(d, split, limit, counter):
    root = (d.val_path or d.path) if split == "val" else d.path
    if not root:
        raise DataError("no data path (set data.path=<folder holding cifar-10-batches-py>)")
    x, y = read_cifar_torchvision(root, train=split != "val")
    return _head(x, y, counter, limit)


def _read_mnist_tv(d, split, limit, counter):
    x, y = read_mnist_torchvision((d.val_path or d.path) if split == "val" else d.path, split != "val", d.in_chans)
    return _head(x, y, counter, limit)


def _read_image_folder(d, split, limit, counter):
    return read_image_folder(_pattern(d, split), d.in_chans, d.img_size, limit, counter)


def _synthetic(d, split, limit, counter):
    n = d.synthetic_size if split != "val" else max(d.synthetic_size // 4, 1)
    g = torch.Generator().manual_seed(1234 + (split == "val"))
    x = torch.randint(0, 256, (n, d.in_chans, d.img_size, d.img_size), dtype=torch.uint8, generator=g)
    return x, torch.randint(0, max(d.num_classes, 1), (n,), generator=g), counter


# decode=auto decodes on the CPU where a process has this many cores, on the GPU below: the faster path at the core
# counts measured (docs/data.md, "Which path"; BENCHMARKS.md, "Real images"; bench_data.py matrix). With CUDA's 32
# hardware queues the GPU decode held 0.96x at 4, 8 and 16 cores, where the 16-core CPU decode read 0.84-1.00x by host
CPU_DECODE_MIN_CORES = 24
GPU_DECODE_WORKERS = 4  # workers that only read bytes: 8 read no faster (BENCHMARKS.md)
# a GPU decode with this many cores a process and the workers left to the decode (num_workers=-1) has its workers
# decode a share of the JPEGs on the CPU (data.cpu_decode_share=-1): at 16 cores half of them took the ViT-B/16 MAE
# trainer from 0.97x to 0.98x its synthetic rate (three quarters, 0.98x too), work the workers keep up with on a host
# whose CPU decode alone read 0.84x (BENCHMARKS.md, "Real images")
CPU_SHARE_MIN_CORES = 16
AUTO_CPU_DECODE_SHARE = 0.5

# data.name -> its reader of a whole split into memory:
# (d, split, limit, counter) -> (uint8 (N,C,H,W), int64 (N,), counter)
READERS = {"digits": _read_digits, "cifar10_wds": _read_shards, "wds": _read_shards, "imagefolder": _read_image_folder,
           "cifar_tv": _read_cifar_tv, "mnist_tv": _read_mnist_tv, "synthetic": _synthetic}
# the sources that come only whole: decoded into memory whatever data.gpu_resident says
IN_MEMORY = ("digits", "cifar_tv", "mnist_tv", "synthetic")


def load_arrays(d, split: str, seed: int = 0, log=None):
    """Decode a whole split into memory with ``data.name``'s reader (:data:`READERS`): ``(uint8 (N,C,H,W), int64
    (N,), CorruptCounter)``; losses go to ``log`` as they happen."""
    if d.name not in READERS:
        raise DataError(f"unknown data source '{d.name}'")
    return READERS[d.name](d, split, d.val_limit if split == "val" else d.limit, CorruptCounter(log))


def _shard_pattern(d, split):
    """The shard pattern of ``split``, its shards checked against their manifest first."""
    pattern = _pattern(d, split)
    if d.verify_manifest:
        verify_manifest(expand_shards(pattern))
    return pattern


def _streams_files(d) -> bool:
    """Whether ``data`` is read from files by the loader's workers (else decoded whole into memory)."""
    return not (d.gpu_resident or d.name in IN_MEMORY)


def _cpu_decode_asked(d) -> bool:
    """``data.decode=cpu``, or ``auto`` where the process has the cores the CPU decode takes."""
    return d.decode == "cpu" or (d.decode == "auto" and cores_per_process() >= CPU_DECODE_MIN_CORES)


def decode_backend(d, device) -> str | None:
    """The GPU decoder ``data.decode`` and ``data.gpu_decoder`` ask for on ``device`` (:func:`gpu_decode_backend`),
    None for CPU decode (``decode=auto`` with enough cores for it, or without a CUDA device or GPU decoder)."""
    if _cpu_decode_asked(d) or (d.decode == "auto" and gpu_decode_backend(device) is None):
        return None
    backend = gpu_decode_backend(device, d.gpu_decoder)
    if backend is not None:
        return backend
    if d.gpu_decoder == "auto":
        raise DataError(f"data.decode=gpu needs a CUDA device and a GPU JPEG decoder (torchvision, nvImageCodec or "
                        f"libnvjpeg); the trainer runs on {device}: set data.decode=cpu or auto")
    hint = {"nvimgcodec": " (pip install nvidia-nvimgcodec-cu13)", "nvjpeg": " (pip install nvidia-nvjpeg)"}.get(
        d.gpu_decoder, "")
    raise DataError(f"data.gpu_decoder={d.gpu_decoder} is not installed{hint}, or the trainer runs on {device} "
                    f"without a CUDA device: set data.gpu_decoder=auto or data.decode=cpu")


# CUDA's most hardware work queues (its default: 8); CUDA_DEVICE_MAX_CONNECTIONS, read when a process creates its
# CUDA context.
GPU_DECODE_CONNECTIONS = "32"


def widen_hardware_queues(d) -> None:
    """CUDA_DEVICE_MAX_CONNECTIONS=32 unless the environment sets it, where ``data`` streams files whose decode may run
    on the GPU (``data.decode=gpu``, or ``auto`` with fewer cores than the CPU decode takes): with CUDA's 8 queues the
    decode's stream shares one with the step's, and nvJPEG's waits on its own events (about one an image) wait
    behind the step's kernels. The trainer calls it first, before its process creates a CUDA context."""
    if _streams_files(d) and not _cpu_decode_asked(d):
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", GPU_DECODE_CONNECTIONS)


def cpu_decode_share(d, backend: str | None) -> float:
    """The share of a GPU decode's JPEGs (``backend``; None: a CPU decode, which decodes them all on the CPU anyway)
    that the workers decode on the CPU: ``data.cpu_decode_share``, or with -1 :data:`AUTO_CPU_DECODE_SHARE` where the
    process has :data:`CPU_SHARE_MIN_CORES` cores or more and ``num_workers`` is -1, else none."""
    if backend is None:
        return 0.0
    if d.cpu_decode_share >= 0:
        return d.cpu_decode_share
    return auto_cpu_decode_share(cores_per_process()) if d.num_workers < 0 else 0.0


def auto_cpu_decode_share(cores: int) -> float:
    """The share ``data.cpu_decode_share=-1`` gives a GPU decode whose workers are by the decode, in a process with
    ``cores`` cores."""
    return AUTO_CPU_DECODE_SHARE if cores >= CPU_SHARE_MIN_CORES else 0.0


def loader_workers(d, backend: str | None) -> int:
    """``data.num_workers``, or with -1 by the decode: workers that only read bytes for the GPU decoder (4), else
    (CPU decode, or a GPU decode with a CPU share, :func:`cpu_decode_share`) the process's cores less one."""
    if d.num_workers >= 0:
        return d.num_workers
    return GPU_DECODE_WORKERS if backend and not cpu_decode_share(d, backend) else max(cores_per_process() - 1, 1)


def build_loader(d, split: str, global_batch: int, *, rank=0, world=1, accum=1, seed=0, device="cpu", train=True,
                 log=None, compile_augment=False):
    """A resumable loader of this rank's share of each global batch; ``log`` gets lost-data lines;
    ``compile_augment``: the in-memory loader's augmentation compiled (:class:`InMemoryLoader`)."""
    mean, std = (d.mean, d.std) if d.normalize else (None, None)
    aug = d.aug if train else "none"
    where = f"the {split} split of data.name={d.name}"
    if not _streams_files(d):
        x, y, counter = load_arrays(d, split, log=log)
        counter.check(len(x), d.max_corrupt_frac, where)
        check_labels(y, d.num_classes, where)
        loader = InMemoryLoader(x, y, global_batch, rank=rank, world=world, accum=accum, seed=seed, device=device,
                                img_size=d.img_size, aug=aug, crop_min=d.crop_min, mean=mean, std=std,
                                jitter=d.color_jitter if train else 0.0, eval_crop_pct=d.eval_crop_pct,
                                compile_augment=compile_augment)
        loader.counter = counter
        return loader
    backend = decode_backend(d, device)
    prep = SamplePrep(d.img_size, d.in_chans, aug, d.crop_min, gpu=backend is not None,
                      jitter=d.color_jitter if train else 0.0, crop_pct=d.eval_crop_pct,
                      cpu_share=cpu_decode_share(d, backend))
    finisher = BatchFinisher(device, d.img_size, d.in_chans, mean, std, backend, d.hw_decode_load,
                             d.finish_high_priority)
    common = dict(rank=rank, world=world, accum=accum, seed=seed, device=device, prep=prep, finisher=finisher,
                  num_workers=loader_workers(d, backend), num_classes=d.num_classes,
                  max_corrupt_frac=d.max_corrupt_frac, log=log, ahead=d.finish_ahead,
                  threads=d.finish_threads)
    if d.name == "imagefolder":
        return FolderLoader(_pattern(d, split), global_batch, limit=d.limit, **common)
    pattern = _shard_pattern(d, split)
    # an epoch's length from the manifest's counts, so epochs=E and warmup_epochs work on streamed shards
    return ShardLoader(pattern, global_batch, train=train, buffer=d.shuffle_buffer,
                       samples_per_epoch=d.limit or manifest_samples(expand_shards(pattern)), **common)
