"""dres.data: data sources and resumable, rank-split loaders (see :mod:`dres.data.loaders`).

``build_loader(data_cfg, split, global_batch, ...)`` (:mod:`dres.data.factory`) picks the reader from
``data_cfg.name`` (its table names the sources) and builds the loader.

A loader is three parts, each chosen once in the factory from the config:

* **where the bytes come from**: memory (``gpu_resident``, the default, for sets that fit: decoded once,
  :class:`InMemoryLoader`), an ImageFolder tree read file by file (:class:`FolderLoader`) or shards
  streamed (:class:`ShardLoader`: local files, ``pipe:`` commands, HTTP(S) URLs);
* **how they become pixels** (:mod:`dres.data.decode`, ``data.decode``): ``cpu`` decodes, crops and
  resizes in the DataLoader workers; ``gpu`` has the workers only read the bytes and decodes each batch
  on the GPU (nvJPEG or nvImageCodec) with its crop and resize in one kernel; ``auto`` decodes on the CPU
  where the process has :data:`~dres.data.factory.CPU_DECODE_MIN_CORES` cores or more (or no GPU decoder),
  else on the GPU; ``num_workers=-1`` gives each way its workers;
* **the augmentation on the device** (:mod:`dres.data.augment`): for data in memory, the batched
  RandomResizedCrop, flip, jitter and normalisation; streamed data arrives cropped and is normalised there.

Data accounting: every unreadable sample or shard is logged as it happens (one line each,
rate-limited) and counted in the loader's ``counter`` (:class:`CorruptCounter`, which the trainer
writes to ``summary.json``), a shard that ends before its manifest's count included, each lost sample named by
its source file where known (``dres-prep``'s ``sources.json``); when more than ``data.max_corrupt_frac`` of the
samples or shards is lost, loading stops with a :class:`DataError`. Shards listed in their folder's ``manifest.json`` are
checked against its sha256 before use (``data.verify_manifest``). Labels must be below
``data.num_classes``.
"""

from __future__ import annotations

from dres.data.augment import color_jitter, crop_theta, device_augment, jitter_params, normalize, rrc_params
from dres.data.decode import BatchFinisher, SamplePrep
from dres.data.factory import build_loader, decode_backend, load_arrays, widen_hardware_queues
from dres.data.loaders import FolderLoader, InMemoryLoader, ShardLoader, check_split
from dres.data.sources import (CorruptCounter, DataError, cifar10_pattern, default_cifar10_dir, expand_shards,
                               iter_shard, lost_data_line, manifest_samples, read_digits, read_shards, verify_manifest)

__all__ = ["build_loader", "decode_backend", "load_arrays", "widen_hardware_queues", "BatchFinisher", "SamplePrep", "DataError", "InMemoryLoader", "FolderLoader", "ShardLoader",
           "color_jitter", "crop_theta", "device_augment", "jitter_params", "normalize", "rrc_params", "read_shards", "read_digits", "iter_shard",
           "expand_shards", "default_cifar10_dir", "cifar10_pattern", "check_split", "CorruptCounter",
           "verify_manifest", "manifest_samples", "lost_data_line"]
