"""Helpers shared by the task modules: model construction from :class:`ModelConfig`, evaluation
data and cached features."""

from __future__ import annotations

import dataclasses
import inspect
import os
import random
import runpy
import shutil
import sys
import time
from typing import Optional

import numpy as np
import torch

from dres.data import DataError, build_loader
from dres.train.config import ModelConfig

_NOTED: set = set()


def model_kwargs(cls, cfg) -> dict:
    """The ModelConfig fields that ``cls.__init__`` accepts (one config dataclass serves all tasks),
    plus the run's seed for the ResidualDroppath controller's own generator. Fields set away from
    their default that ``cls`` does not take are dropped with a note (once per process)."""
    params = inspect.signature(cls.__init__).parameters
    values, defaults = dataclasses.asdict(cfg.model), dataclasses.asdict(ModelConfig())
    kw = {k: v for k, v in values.items() if k in params}
    ignored = tuple(f"model.{k}" for k, v in values.items() if k not in params and v != defaults[k])
    if ignored and (cls, ignored) not in _NOTED:
        _NOTED.add((cls, ignored))
        if os.environ.get("RANK", "0") == "0":
            print(f"[dres] note: {cls.__name__} does not take {', '.join(ignored)}; ignored")
    if "droppath_seed" in params:
        kw["droppath_seed"] = cfg.seed
    if "zero_init" in kw:  # the config's words; the models take None (their own rule) / True / False
        kw["zero_init"] = {"auto": None, "true": True, "false": False}[kw["zero_init"]]
    return kw


# Dense (no sparsity) bf16 tensor-core peaks in TFLOP/s from NVIDIA's datasheets, by a part of the name
# torch.cuda.get_device_name gives; the first match wins, so a name that contains another comes first.
DENSE_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.5), ("H100", 989.4), ("H200 NVL", 835.5),
                     ("H200", 989.4), ("A100", 312.0), ("A10", 125.0), ("L40S", 362.05), ("L40", 181.05),
                     ("L4", 121.0))


def seed_all(seed: int):
    """The Python, NumPy and torch generators seeded alike (identical initial weights on every rank)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def resolve_precision(p: str, device: torch.device) -> str:
    """The ``precision`` setting with ``auto`` resolved: bf16 on CUDA, fp32 elsewhere."""
    if p == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return p


def dense_bf16_peak(device: torch.device) -> tuple[str, Optional[float]]:
    """``(name, TFLOP/s)``: the device's name and its dense bf16 peak, None for a CPU or a card not in
    :data:`DENSE_BF16_TFLOPS`."""
    if device.type != "cuda":
        return device.type, None
    name = torch.cuda.get_device_name(device)
    return name, next((tflops for part, tflops in DENSE_BF16_TFLOPS if part in name), None)


def model_flops_rate(img_per_s: float, flops_per_image: Optional[float], world: int,
                     peak_tflops: Optional[float]) -> dict:
    """``model_tflops`` (model FLOPs a second per GPU, in TFLOP/s) and ``mfu`` (their fraction of the
    card's dense bf16 peak) at ``img_per_s`` images a second over ``world`` GPUs; None where unknown."""
    tflops = img_per_s * flops_per_image / world / 1e12 if flops_per_image is not None else None
    return {"model_tflops": tflops, "mfu": tflops / peak_tflops if tflops is not None and peak_tflops else None}


def flops_rate_text(rates: dict) -> str:
    """``", 71.8 model TFLOP/s per GPU, MFU 7.3%"`` from :func:`model_flops_rate`'s fields, as far as known
    (GFLOP/s below 0.1 TFLOP/s: small models on a CPU)."""
    tflops = rates["model_tflops"]
    if tflops is None:
        text = ""
    elif tflops < 0.1:
        text = f", {tflops * 1e3:.2f} model GFLOP/s per GPU"
    else:
        text = f", {tflops:.1f} model TFLOP/s per GPU"
    return text + ("" if rates["mfu"] is None else f", MFU {rates['mfu']:.1%}")


def eval_loader(trainer, split, batch):
    """An unaugmented loader over ``split`` ('train' | 'val') for feature extraction, or None (with
    a message) when the data set has no such split configured. Built once per trainer and split:
    decoding a split into memory is the slow part, and every eval.every point reads it again."""
    if split not in trainer.eval_loaders:
        trainer.eval_loaders[split] = _build_eval_loader(trainer, split)
    return trainer.eval_loaders[split]


def _build_eval_loader(trainer, split):
    cfg = trainer.cfg
    try:
        ld = build_loader(cfg.data, split, 1, device=trainer.device, train=False, log=trainer.log)  # batching: eval_batches()
    except DataError as e:
        trainer.log(f"[dres] evaluation on the {split} split skipped: {e}")
        return None
    if not hasattr(ld, "eval_batches"):
        trainer.log(f"[dres] evaluation on the {split} split skipped: the streaming data.name={cfg.data.name} loader has "
               "no in-order pass; evaluate a subset in memory with dres-eval RUN --set data.gpu_resident=true "
               "--set data.limit=N --set data.val_limit=M")
        return None
    return ld


def cap(batches, limit):
    n = 0
    for b in batches:
        if limit and n >= limit:
            return
        if limit and n + len(b["label"]) > limit:
            b = {k: v[:limit - n] for k, v in b.items()}
        n += len(b["label"])
        yield b


class PlainProgress:
    """Progress where stderr is a file or a pipe (a batch job's log): whole lines such as ``[dres] features
    2,048/10,000 img (20%), 31 s``, at most one every ``interval`` seconds and one at the end, never the
    ``\\r``-redrawn fragments of a bar. The calls of a tqdm bar that the trainers make (``update``, ``close``)."""

    def __init__(self, *, total=None, initial=0, desc=None, unit="it", enabled=True, interval=30.0):
        self.total, self.n, self.desc, self.unit, self.enabled = total, initial, desc or "progress", unit, enabled
        self.interval, self._start = interval, time.monotonic()
        self._last, self._shown = self._start, initial

    def update(self, n=1) -> None:
        self.n += n
        now = time.monotonic()
        if self.enabled and now - self._last >= self.interval:
            self._write(now)

    def close(self) -> None:
        if self.enabled and self.n != self._shown:
            self._write(time.monotonic())
        self.enabled = False

    def _write(self, now: float) -> None:
        self._last, self._shown = now, self.n
        done = f"{self.n:,}/{self.total:,}" if self.total else f"{self.n:,}"
        share = f" ({self.n / self.total:.0%})" if self.total else ""
        sys.stderr.write(f"[dres] {self.desc} {done} {self.unit}{share}, {self._last - self._start:.0f} s\n")
        sys.stderr.flush()


def progress(*, total=None, initial=0, desc=None, unit="it", enabled=True):
    """A tqdm bar on stderr redrawn in place where stderr is a terminal; elsewhere (a file, a pipe) a
    :class:`PlainProgress` of whole lines, at most one every 30 s."""
    if not sys.stderr.isatty():
        return PlainProgress(total=total, initial=initial, desc=desc, unit=unit, enabled=enabled)
    from tqdm import tqdm

    try:
        size = os.get_terminal_size(sys.stderr.fileno())
    except (OSError, ValueError):
        size = None
    # a terminal that reports no size (a fresh pseudo-terminal, some consoles) would get a bar of no width, hidden
    # below a screen of no rows: $COLUMNS / $LINES or 100 x 24 instead
    fixed = shutil.get_terminal_size((100, 24)) if not (size and size.columns and size.lines) else None
    return tqdm(total=total, initial=initial, desc=desc, unit=unit, file=sys.stderr, disable=not enabled,
                dynamic_ncols=fixed is None, ncols=fixed and fixed.columns, nrows=fixed and fixed.lines,
                mininterval=0.1)


def features(trainer, fn, loader, limit=0, batch=256):
    """:func:`dres.eval.extract_features` over the loader's first ``limit`` samples, under the run's
    autocast, with a progress bar (main rank, ``log.progress``) counting samples."""
    from dres.eval import extract_features

    size = len(loader.images) if hasattr(loader, "images") else None  # in memory: known; streamed: counted
    total = min(size, limit) if size and limit else (size or limit or None)
    bar = progress(total=total, desc="features", unit="img", enabled=trainer.main and trainer.cfg.log.progress)

    def counted(batches):
        for b in batches:
            bar.update(len(b["label"]))
            yield b

    try:
        with trainer.autocast():
            return extract_features(fn, counted(cap(loader.eval_batches(batch), limit)))
    finally:
        bar.close()


def run_as_command(task: str) -> None:
    """``python -m dres.train.<task> ARGS`` as ``dres-train <task> ARGS``: the command line run as a script, so that
    a task module imports nothing of the command line, which reads the tasks."""
    sys.argv.insert(1, task)
    runpy.run_module("dres.train", run_name="__main__", alter_sys=True)
