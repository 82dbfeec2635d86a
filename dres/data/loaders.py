"""Step-indexed, resumable loaders.

Every loader hands the trainer one *step batch* at a time: this rank's share of the global batch
of one optimizer step (the trainer splits it into micro-batches for gradient accumulation). The
order of samples is a pure function of ``(seed, epoch, position)``, so the data position saved in a
checkpoint (``epoch``, ``batch``) resumes exactly, and the global batch of a step is the same set
of samples whatever the world size (each rank takes its slice) — which is what lets one process
and N processes produce the same losses. The file loaders' state also holds what they counted of lost data
by then (counted as batches are handed over, not as they are finished ahead), and their DataLoaders draw
nothing from the global generator, whose stream (the step's masks and noise) the checkpoint resumes too.

* :class:`InMemoryLoader`: the whole data set as a uint8 tensor on the device (CIFAR, digits):
  decoded once, augmented on the device (:mod:`dres.data.augment`), so the loader never limits throughput;
  its unaugmented passes can use timm's evaluation transform (``crop_pct``). The crop parameters of a step are
  drawn for the *global* batch from a generator seeded by (seed, epoch, batch).
* :class:`FolderLoader`: ImageFolder trees (ImageNet) read file by file in DataLoader workers that live for the
  run, each sample's crop seeded by (seed, epoch, index); same global-batch slicing.
* :class:`ShardLoader`: WebDataset shards streamed (for data too large for memory): shards split
  by rank and worker, a seeded shuffle buffer, corrupt samples skipped and counted; resume reads the epoch
  again up to its position (the shuffle buffers are refilled in the same order) and drops those batches
  unfinished.

Both file loaders make pixels the way :mod:`dres.data.decode` says (in the workers, or on the GPU), and
finish each batch (its GPU decode, crop kernel and normalisation) ``ahead`` batches early in a thread of the
training process, or in ``threads`` threads finishing several batches at once (:class:`_Ahead`), so the step's
thread only queues steps; at the end of each epoch of known
length they log where its images were decoded (:func:`~dres.data.decode.decode_paths_line`). A step batch that
lost samples (an unreadable file, a JPEG no decoder took) is made up to its size with its own samples
(:func:`made_up`): every step of a run has one shape, which a captured step, a compiled model and DDP's ranks need.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import math
import os
import random
import threading
import time
import weakref
from collections import Counter

import numpy as np
import torch

from dres.data.augment import augment_params, channel_stats, gather_augment, normalize, to_device
from dres.data.decode import (BatchFinisher, SamplePrep, collate_prepared, cores_per_process, decode_paths_line,
                              import_cpu_decoder, lost_sample, prepare, read_file, worker_init)
from dres.data.sources import (CorruptCounter, DataError, check_labels, expand_shards, iter_shard,
                               list_image_folder, prep_dropped, sample_sources)


PREFETCH_FACTOR = 4  # batches each DataLoader worker prepares ahead: a decode's uneven batches evened out
_FORKING = threading.Lock()  # gc.freeze() is process-wide: one loader's workers start at a time


def _mix(*xs) -> int:
    """A stable 63-bit seed from integers (not Python's salted hash)."""
    h = 0x9E3779B97F4A7C15
    for x in xs:
        h = (h ^ (int(x) + 0x9E3779B97F4A7C15 + (h << 6) + (h >> 2))) & ((1 << 63) - 1)
    return h


def made_up(batch: dict, size: int) -> dict:
    """A step batch that lost samples, made up to ``size`` by repeating its own samples in their order (the
    first ones twice); the same on a resume. The samples lost are counted apart, not these."""
    n = len(batch["label"])
    if n == size:
        return batch
    rows = torch.arange(size, device=batch["label"].device) % n
    return {k: v[rows] if isinstance(v, torch.Tensor) and v.shape[:1] == (n,) else v for k, v in batch.items()}


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

    def describe(self) -> str:
        """Where the batches come from, for the run's log."""
        return f"{len(self.images)} images in memory on {self.images.device}"

    def eval_batches(self, batch_size):
        """Unaugmented pass over all samples (for features), in order."""
        for i in range(0, len(self.images), batch_size):
            x = normalize(self.images[i:i + batch_size], self.size, self.mean, self.std, self.eval_crop_pct)
            yield {"image": x, "label": self.labels[i:i + batch_size]}


class _StreamingLoader(_Position):
    """What the two file-reading loaders share: the training process's half of the decode
    (:class:`dres.data.decode.BatchFinisher`) and the accounting of lost samples."""

    def __init__(self, global_batch, *, rank, world, accum, seed, device, prep: SamplePrep, finisher: BatchFinisher | None,
                 num_workers, max_corrupt_frac, log, unit, where, ahead, threads):
        self.local = check_split(global_batch, world, accum)
        self.global_batch, self.rank, self.world, self.seed, self.device = global_batch, rank, world, seed, device
        # without a finisher: CPU-decoded pixels, unnormalised
        self.finisher = finisher or BatchFinisher(device, prep.size, prep.in_chans)
        self.prep, self.num_workers = prep, num_workers
        if num_workers:
            import_cpu_decoder()
        self.max_corrupt_frac, self.where, self.log = max_corrupt_frac, where, log
        self.counter = CorruptCounter(log, unit=unit)
        # images each path decoded (dres.data.decode.DECODE_PATHS) in the batches handed over, over the process's
        # life, and the same at the last epoch's end (its line says the difference); the finishing times of each
        # batch handed over since then (finish_s, decode_s, finish_cpu_s)
        self.decoded, self._decoded_before = Counter(), Counter()
        self.finishing: list[dict] = []
        self._read, self._expected, self.ahead = 0, 0, ahead
        if threads < 1 or (threads > 1 and not ahead):
            raise ValueError(f"threads={threads}: at least 1, and 1 with ahead=0 (the step's thread finishes "
                             "each batch)")
        # the threads finishing batches ahead at once; each past the first finishes with a replica of the finisher
        # (a stream and decoders of its own), made once and kept
        self.threads, self._replicas = threads, []
        # the batches to come (handed over from an _Ahead, or finished in this thread with ahead=0) and the DataLoader
        # iterator whose workers run; the workers ignore SIGTERM, so they are stopped by message, at the latest
        # when the loader is collected or the process exits (before multiprocessing's own exit handler)
        self._running: list = []
        self._batches_to_come = None
        weakref.finalize(self, _stop_workers, self._running)

    @property
    def batches_ahead(self) -> int:
        """The most batches made ahead of the step: the workers' prefetched ones and those finished ahead
        (:class:`_Ahead`). They fill while the step compiles, so a rate timed from then on reads them first."""
        return self.num_workers * PREFETCH_FACTOR + (self.ahead + self.threads if self.ahead else 0)

    def describe(self) -> str:
        """How the pixels are made, for the run's log."""
        backend = self.finisher.backend
        queues = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8")  # what the process's CUDA context was given
        share = f"; {self.prep.cpu_share:.0%} of its JPEGs on the CPU by the workers" if self.prep.cpu_share else ""
        where = f"GPU ({backend}; {queues} hardware queues{share})" if backend else "CPU"
        threads = f", {self.threads} threads finishing batches" if self.threads > 1 else ""
        return (f"decoded on the {where}, {self.num_workers} workers ({cores_per_process()} cores a process){threads}, "
                f"up to {self.batches_ahead} batches made ahead of the step")

    def next(self):
        """This rank's next step batch on the device; the data position moves as batches are handed over."""
        if self._batches_to_come is None:
            # the work holds the loader weakly: one dropped without close() still stops its threads and workers
            loader = weakref.proxy(self)
            work = type(self)._to_finish(loader, self.epoch, self.batch)
            finish = functools.partial(type(self)._finish, loader)
            self._replicas += [self.finisher.replica() for _ in range(self.threads - 1 - len(self._replicas))]
            finisher = self.finisher
            finished = (_Ahead(work, finish, [finisher, *self._replicas], self.ahead, self._running) if self.ahead
                        else (finish(item, finisher) for item in work))
            self._batches_to_come = _handed_over(finished)
        out, losses, self.epoch, self.batch = next(self._batches_to_come)
        self._count(losses)
        if self.batch == 0 or self.batch == len(self):  # the epoch's last batch (ShardLoader: the next's position)
            self._epoch_line(self.epoch + (self.batch != 0))  # counted from 1
        return made_up(out, self.local)

    def _epoch_line(self, epoch: int):
        """Log where the images of the batches handed over since the last epoch's end were decoded."""
        since, finishing = self.decoded - self._decoded_before, self.finishing
        self._decoded_before, self.finishing = self.decoded.copy(), []
        if self.log is not None and since:
            self.log(decode_paths_line(epoch, since, finishing))

    def _open(self, dataset, **kw):
        """A fresh DataLoader iterator over ``dataset``, the workers of the previous one stopped first (this
        runs in the thread finishing batches ahead, which stays)."""
        _stop_workers(self._running, keep=_Ahead)
        self._running.append(start_workers(self._loader(dataset, **kw)))
        return self._running[-1]

    def close(self):
        """Stop the batches under way and the workers (the next batch starts new ones)."""
        _stop_workers(self._running)
        self._batches_to_come = None

    def _loader(self, dataset, **kw):
        # a DataLoader draws its workers' base seed from the global generator unless given its own: drawn from the
        # step's randomness (masks, noise), it would shift that stream wherever a loader opens (a resume, an epoch)
        return torch.utils.data.DataLoader(
            dataset, num_workers=self.num_workers, pin_memory=torch.device(self.device).type == "cuda",
            worker_init_fn=worker_init if self.num_workers else None,
            prefetch_factor=PREFETCH_FACTOR if self.num_workers else None,
            generator=torch.Generator().manual_seed(_mix(self.seed, self.rank, 5)), **kw)

    def _finish(self, item: tuple, finisher: BatchFinisher) -> tuple:
        """A work item of :meth:`_to_finish`, ``(collated batch, epoch, batch, hand_over)``, finished by ``finisher``
        -> ``(the batch on the device (None: nothing of it survived), its losses, epoch, batch, hand_over)``: the
        losses ``(loss events, lost samples' names, samples read, images each decode path made, its finishing
        times)``, which :meth:`_count` counts when the batch is handed over."""
        prepared = item[0]
        lost, paths = list(prepared["lost"]), Counter()
        check_labels(prepared["labels"], self.num_classes, self.where)  # on the host: no wait for the GPU
        decode_before, start, cpu_start = finisher.decode_s, time.perf_counter(), time.thread_time()
        out = finisher(prepared, lost, paths) if len(prepared["labels"]) else None
        finishing = {"finish_s": time.perf_counter() - start, "decode_s": finisher.decode_s - decode_before,
                     "finish_cpu_s": time.thread_time() - cpu_start}
        return (out, (tuple(prepared.get("events", ())), tuple(lost), 0 if out is None else len(out["label"]), paths,
                      finishing), *item[1:])

    def _count(self, losses: list):
        """Count the losses of :meth:`_finish` as their batches are handed over, not as they are finished ahead:
        the count saved with the position is then that of the batches taken, and a resume goes on from it."""
        for events, lost, read, paths, finishing in losses:
            self.decoded.update(paths)
            self.finishing.append(finishing)
            self.counter.replay(events)
            for name in lost:
                source = name.rsplit(": ", 1)[0]  # "<file or shard:key>: <error>"
                file = self._source_file(source)
                self.counter.add(name if file in (None, source) else f"{name} ({file})", source, key=source,
                                 files=[file] if file else [])
            self._read += read
            if lost or events:
                self.counter.check(self._read, self.max_corrupt_frac, self.where, self._expected)

    def _source_file(self, source: str) -> str | None:
        """The source file of a lost sample named ``source`` (a folder's file)."""
        return source

    def state_dict(self):
        """The position and what this rank counted of the batches taken before it (samples read and lost)."""
        return {**super().state_dict(), "rank": self.rank, "read": self._read, "lost": self.counter.state_dict()}

    def load_state_dict(self, s):
        super().load_state_dict(s)
        if s.get("rank") == self.rank and "lost" in s:  # another rank's count is not this rank's: it counts afresh
            self._read = int(s["read"])
            self.counter.load_state_dict(s["lost"])
        self.close()


def start_workers(dataloader: torch.utils.data.DataLoader):
    """``iter(dataloader)``, its workers forked with every object of the training process frozen out of their
    garbage collection: a CUDA graph left in a reference cycle (a step captured earlier in the process) and
    collected in a worker calls CUDA there from its destructor, and the worker aborts."""
    with _FORKING:
        gc.freeze()
        try:
            return iter(dataloader)
        finally:
            gc.unfreeze()


def _stop_workers(running: list, keep=()):
    """Stop what ``running`` holds but the instances of ``keep``: the thread finishing batches ahead first (it
    reads from the workers), then the DataLoader iterators' workers."""
    for it in running:
        if isinstance(it, _Ahead) and not isinstance(it, keep):
            it.stop()
    for it in running:
        shutdown = getattr(it, "_shutdown_workers", None)  # absent without workers
        if shutdown is not None:
            shutdown()
    running[:] = [it for it in running if isinstance(it, keep)]


def _handed_over(finished):
    """The finished work items, in order, ``(batch on the device or None, losses, epoch, batch, hand_over)`` -> the
    batches handed over, ``(batch, losses, epoch, batch)``: each with the losses of the items finished since the
    last one (a rest of a shard slot, a batch that lost every sample)."""
    losses = []
    for out, lost, epoch, batch, hand_over in finished:
        losses.append(lost)
        if hand_over and out is not None:
            yield out, losses, epoch, batch
            losses = []


class _Ahead:
    """The items of ``work`` (the loaders' ``_to_finish``), each finished (``finish(item, finisher)``) ``depth``
    batches ahead by threads of the training process, one a finisher of ``finishers``, and handed over in the
    order of ``work``: the GPU decode (which waits on the decoders with the GIL released), the crop kernel and
    the copies of the next batches run while the step's thread queues the step, several batches at once with
    several threads (each finisher has its decoders and stream). One thread at a time takes the next item of
    ``work``. A thread's GPU work runs on a stream of its own, of its finisher's priority; a batch handed over is
    ready on the taker's current stream through an event (the taker's stream waits for it, the host does not),
    its memory kept from reuse until the taker's stream has read it, and an exception the work or a finish raised
    is raised where its batch would have come. At most ``depth`` + one a thread batches are under way or wait."""

    def __init__(self, work, finish, finishers: list, depth: int, running: list):
        self.device, self.depth = finishers[0].device, depth  # the device with its index (BatchFinisher.device)
        self.stopping = threading.Event()
        self.changed = threading.Condition()  # guards the sequence numbers and the finished entries
        self.issued = self.taken = 0  # sequence numbers: of the items taken from the work, and of those handed over
        # sequence number -> ("batch", finished item, ready event) or ("raise", exception, None)
        self.entries: dict = {}
        self.reading = threading.Lock()  # held while a thread takes the next item of the work
        self.ended = False  # the work ended or raised, or a finish raised: no item is taken after
        self.threads = [threading.Thread(target=self._run, args=(work, finish, finisher), daemon=True,
                                         name=f"dres-batches-ahead-{i}") for i, finisher in enumerate(finishers)]
        running.append(self)  # stopped with the workers (_stop_workers)
        for thread in self.threads:
            thread.start()

    def _run(self, work, finish, finisher):
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.set_device(self.device)  # the current device is the thread's own
        stream = torch.cuda.Stream(self.device, priority=finisher.priority) if cuda else None
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            while True:
                with self.reading:
                    with self.changed:  # room for another batch: depth waiting, and one a thread under way
                        while not self.stopping.is_set() and self.issued - self.taken >= self.depth + len(self.threads):
                            self.changed.wait(0.1)
                        if self.ended or self.stopping.is_set():
                            return
                        seq = self.issued
                        self.issued += 1
                    try:
                        item = next(work)
                    except BaseException as e:  # handed over in order, StopIteration included
                        return self._end(seq, e)
                try:
                    finished = finish(item, finisher)
                except BaseException as e:
                    return self._end(seq, e)
                ready = None
                if cuda:
                    ready = torch.cuda.Event()
                    ready.record(stream)
                self._deliver(seq, ("batch", finished, ready))

    def _end(self, seq: int, error: BaseException):
        """No item is taken after ``seq``, whose batch raises ``error`` where it would have come."""
        self.ended = True
        self._deliver(seq, ("raise", error, None))

    def _deliver(self, seq: int, entry: tuple):
        with self.changed:
            if not self.stopping.is_set():
                self.entries[seq] = entry
            self.changed.notify_all()

    def __next__(self):
        with self.changed:
            while self.taken not in self.entries:
                if not any(thread.is_alive() for thread in self.threads):
                    raise RuntimeError("the threads finishing batches ahead have stopped")
                self.changed.wait(1.0)
            kind, item, ready = self.entries.pop(self.taken)
            self.taken += 1
            self.changed.notify_all()
        if kind == "raise":
            raise item
        if ready is not None:
            taker = torch.cuda.current_stream(self.device)
            taker.wait_event(ready)
            for t in (item[0] or {}).values():
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(taker)  # made on a finishing thread's stream, read on the taker's
        return item

    def __iter__(self):
        return self

    def stop(self, timeout: float = 60.0):
        """End the threads after the batches they are finishing (the workers must still run to let them finish)."""
        self.stopping.set()
        with self.changed:
            self.entries.clear()
            self.changed.notify_all()
        for thread in self.threads:
            if thread is not threading.current_thread():  # the loader's finalizer may run in a thread itself
                thread.join(timeout)


class _FolderSamples(torch.utils.data.Dataset):
    """ImageFolder files, read by key ``(index, seed)`` and prepared (:class:`SamplePrep`) in a worker."""

    def __init__(self, paths, labels, prep: SamplePrep):
        self.paths, self.labels, self.prep = paths, labels, prep

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, key):
        idx, seed = key
        path = self.paths[idx]
        try:
            data = read_file(path)
        except (OSError, ValueError) as e:
            return lost_sample(self.labels[idx], path, e)
        return prepare(self.prep, data, seed, self.labels[idx], path)


def folder_batches(n, global_batch, rank, local, seed, epoch, batch):
    """This rank's keys of every step batch from ``(epoch, batch)`` on, epoch after epoch: an epoch's order
    is a permutation seeded by ``(seed, epoch)``, a sample's crop seed ``(seed, epoch, index)``."""
    steps = n // global_batch
    while True:
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(_mix(seed, epoch, 1)))
        for b in range(batch, steps):
            mine = perm[b * global_batch:(b + 1) * global_batch][rank * local:(rank + 1) * local].tolist()
            yield [(i, _mix(seed, epoch, i)) for i in mine]
        epoch, batch = epoch + 1, 0


class FolderLoader(_StreamingLoader):
    """ImageFolder trees read file by file in DataLoader workers that live for the whole run (one sampler
    over every epoch), each rank its slice of every global batch."""

    def __init__(self, root, global_batch, *, rank=0, world=1, accum=1, seed=0, device="cpu", prep: SamplePrep,
                 finisher: BatchFinisher | None = None, num_workers=8, limit=0, num_classes=0, max_corrupt_frac=1.0, log=None,
                 ahead=2, threads=1):
        super().__init__(global_batch, rank=rank, world=world, accum=accum, seed=seed, device=device, prep=prep,
                         finisher=finisher, num_workers=num_workers, max_corrupt_frac=max_corrupt_frac, log=log,
                         unit="file", where=root, ahead=ahead, threads=threads)
        paths, labels, self.classes = list_image_folder(root)
        if limit:
            paths, labels = paths[:limit], labels[:limit]
        check_labels(torch.tensor(labels), num_classes, root)
        self.num_classes = num_classes
        self.counter.shards_total = len(paths)
        self.ds = _FolderSamples(paths, labels, prep)
        self._expected = len(paths) // world
        self.steps_per_epoch = len(paths) // global_batch
        if self.steps_per_epoch == 0:
            raise DataError(f"batch_size {global_batch} is larger than the data set ({len(paths)} images in {root})")

    def __len__(self):
        return self.steps_per_epoch

    def _to_finish(self, epoch, batch):
        """The collated batches from position ``(epoch, batch)`` on, each with the position after it, to finish
        and hand over (:func:`_handed_over`)."""
        keys = folder_batches(len(self.ds), self.global_batch, self.rank, self.local, self.seed, epoch, batch)
        for prepared in self._open(self.ds, batch_sampler=keys, collate_fn=collate_prepared):
            if batch >= self.steps_per_epoch:
                epoch, batch = epoch + 1, 0
            batch += 1
            yield prepared, epoch, batch, True


def slot_shards(shards: list, slot: int, nslots: int) -> list[tuple[str, tuple[int, int] | None]]:
    """Slot ``slot``'s part of ``shards`` among ``nslots`` (ranks x workers), as ``(shard, share)`` pairs: whole
    shards dealt one a slot per round while every slot gets one, then one of the r shards left over, read by the
    slots that share it (slot mod r) and split between them by sample (``share=(keep, n)``: every n-th sample, of
    :func:`~dres.data.sources.iter_shard`). So the slots' sample counts differ by half a shard at most (20 shards
    over 15 workers: 1 and a third each, not 1 or 2), and a slot reads at most one shard beyond its whole ones."""
    whole = len(shards) - len(shards) % nslots
    mine = [(s, None) for s in shards[slot:whole:nslots]]
    left = shards[whole:]
    if left:
        r = len(left)
        sharing = len(range(slot % r, nslots, r))  # the slots reading the same leftover shard
        mine.append((left[slot % r], (slot // r, sharing)))
    return mine


class _ShardStream(torch.utils.data.IterableDataset):
    """Shards split by rank, then by DataLoader worker (:func:`slot_shards`). A slot yields collated batches of
    ``local`` samples (:func:`collate_prepared`), each with the loss events met while reading it, and the rest at
    the end."""

    def __init__(self, shards, rank, world, seed, epoch, prep: SamplePrep, train, buffer, local):
        self.shards, self.rank, self.world, self.seed, self.epoch = shards, rank, world, seed, epoch
        self.prep, self.train, self.buffer, self.local = prep, train, buffer, local

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        slot, nslots = self.rank * nw + wid, self.world * nw
        shards = list(self.shards)
        rng = random.Random(_mix(self.seed, self.epoch, slot, 3))
        if self.train:
            random.Random(_mix(self.seed, self.epoch, 4)).shuffle(shards)
        mine = slot_shards(shards, slot, nslots)
        counter = CorruptCounter(collect=True)  # its events travel with the batches to the training process

        def read():
            for s, share in mine:
                for sample in iter_shard(s, counter, share):
                    yield (s, *sample)

        def shuffled():
            buf = []
            for n, sample in enumerate(read()):
                sample = (*sample, _mix(self.seed, self.epoch, slot, n))
                if not (self.train and self.buffer > 1):
                    yield sample
                    continue
                buf.append(sample)
                if len(buf) >= self.buffer:
                    yield buf.pop(rng.randrange(len(buf)))
            rng.shuffle(buf)
            yield from buf

        batch = []
        for shard, key, data, label, seed in shuffled():
            batch.append(prepare(self.prep, data, seed, label, f"{os.path.basename(shard)}:{key}"))
            if len(batch) == self.local:
                yield self._collated(batch, counter)
                batch = []
        if batch or counter.pending:
            yield self._collated(batch, counter)

    @staticmethod
    def _collated(samples, counter):
        out = collate_prepared(samples)
        out["events"] = counter.drain()
        return out


class ShardLoader(_StreamingLoader):
    """Streaming WebDataset shards. An epoch ends when any rank runs out (ranks stay in step)."""

    def __init__(self, pattern, global_batch, *, rank=0, world=1, accum=1, seed=0, device="cpu", prep: SamplePrep,
                 finisher: BatchFinisher | None = None, train=True, num_workers=4, buffer=2000, samples_per_epoch=None,
                 num_classes=0, max_corrupt_frac=1.0, log=None, ahead=2, threads=1):
        self.shards = expand_shards(pattern)
        super().__init__(global_batch, rank=rank, world=world, accum=accum, seed=seed, device=device, prep=prep,
                         finisher=finisher, num_workers=num_workers, max_corrupt_frac=max_corrupt_frac, log=log,
                         unit="shard", where=f"{len(self.shards)} shard(s)", ahead=ahead, threads=threads)
        self.num_classes, self.train, self.buffer = num_classes, train, buffer
        self.counter.shards_total = len(self.shards)
        self.counter.dropped_by_prep = prep_dropped(self.shards)
        # the fraction's denominator: this rank's share of an epoch, or enough samples to judge it
        self._expected = (samples_per_epoch // world if samples_per_epoch else
                          math.ceil(1 / max_corrupt_frac) if max_corrupt_frac > 0 else 0)
        self.steps_per_epoch = (samples_per_epoch // global_batch) if samples_per_epoch else None

    def __len__(self):
        return self.steps_per_epoch or 0

    def _source_file(self, source: str) -> str | None:
        """The source file of the lost sample ``<shard>:<key>``, by dres-prep's sources.json (None: unknown)."""
        shard, _, key = source.partition(":")
        path = next((s for s in self.shards if os.path.basename(s) == shard), None)
        return sample_sources(path).get(key) if path else None

    def _to_finish(self, epoch, batch):
        """The collated batches from position ``(epoch, batch)`` on, each with the position after it, to finish
        and hand over (:func:`_handed_over`); a batch of fewer than ``local`` samples (a slot's rest at its end)
        only has losses to count. Resume drops what the epoch already consumed, unfinished and uncounted: the
        batches up to the position and the rests met before its last one, whose losses the count saved with the
        position holds."""
        while True:
            ds = _ShardStream(self.shards, self.rank, self.world, self.seed, epoch, self.prep, self.train,
                              self.buffer, self.local)
            skip = batch
            for prepared in self._open(ds, batch_size=None):
                full = len(prepared["labels"]) == self.local
                if skip:
                    skip -= full
                    continue
                if not full:
                    yield prepared, epoch, batch, False
                    continue
                last = bool(self.steps_per_epoch) and batch + 1 >= self.steps_per_epoch  # ranks stay in step
                epoch, batch = (epoch + 1, 0) if last else (epoch, batch + 1)
                yield prepared, epoch, batch, True
                if last:
                    break
            else:
                if batch == 0:
                    raise DataError(f"no samples for rank {self.rank} in {len(self.shards)} shard(s)")
                epoch, batch = epoch + 1, 0

    def eval_batches(self, batch_size):
        """Every sample once, in order, unaugmented, in batches of ``batch_size`` (in this process)."""
        prep = dataclasses.replace(self.prep, aug="none", crop_min=0.0, jitter=0.0)
        for prepared in _ShardStream(self.shards, self.rank, self.world, self.seed, 0, prep, False, 0, batch_size):
            out, lost = self._finish((prepared,), self.finisher)
            self._count([lost])
            if out is not None:
                yield out
