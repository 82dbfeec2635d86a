"""Shared test setup: GPU tests are marked ``gpu`` and skipped without CUDA; Triton kernels run on
the CPU through the interpreter (TRITON_INTERPRET=1 must be set before triton is imported)."""

import json
import os
import sys
import time
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


# DRES_TEST_TIMES=FILE: each test's start and, once it ends, its seconds appended to FILE as JSON lines, as they
# happen, so that a suite process cut at a time limit still leaves its times (and names the test it was in) for
# tests/split_tests.py; a JUnit report is written only by a process that finishes
_test_seconds: dict = {}


def _log_test_times(line: dict) -> None:
    path = os.environ.get("DRES_TEST_TIMES")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


def pytest_runtest_logstart(nodeid, location):
    _log_test_times({"test": nodeid, "started": time.time()})


def pytest_runtest_logreport(report):
    seconds, skipped = _test_seconds.get(report.nodeid, (0.0, False))
    _test_seconds[report.nodeid] = (seconds + report.duration, skipped or report.skipped)


def pytest_runtest_logfinish(nodeid, location):
    seconds, skipped = _test_seconds.pop(nodeid, (0.0, False))
    _log_test_times({"test": nodeid, "seconds": seconds, "skipped": skipped})


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


@pytest.fixture(autouse=True)
def _hardware_queues_as_found():
    """A trainer built in the test process may set CUDA_DEVICE_MAX_CONNECTIONS (``dres.data.widen_hardware_queues``):
    each test leaves it as the test found it, for the processes later tests start."""
    before = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    yield
    if before is None:
        os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    else:
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = before
