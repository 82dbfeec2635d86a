"""Shared test setup: GPU tests are marked ``gpu`` and skipped without CUDA; Triton kernels run on
the CPU through the interpreter (TRITON_INTERPRET=1 must be set before triton is imported)."""

import os
import sys
from pathlib import Path

import torch as _torch

# benchmarks/ and experiments/ are not installed: the repository root on sys.path for every test file
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if not _torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (runs on the device: benchmarks/device_check.sh)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def triton_device():
    """Where the Triton kernels run in this session: the GPU, or the CPU under the interpreter."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


@pytest.fixture
def poisoned_allocations(monkeypatch):
    """Every floating-point ``torch.empty`` starts filled with NaN while the test runs: a kernel that
    skips an element of an output leaves a NaN behind."""
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned_empty)
