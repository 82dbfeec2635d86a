"""Helpers shared by the tests: for the op tests (test_ops, test_csrc, test_mae_loss, test_bias_gelu) per-dtype
tolerances against float64, the drop-path modes of the op table, random cases, gradient plumbing,
CUDA-graph capture and CUDA dispatch forced on CPU tensors; the aten ops a step runs (:class:`LaunchCounts`); for
the tests that start ranks of their own, the process group's rendezvous (:func:`process_group`). Imported as
``helpers`` (pytest puts tests/ on sys.path), so any one test file collects on its own."""

from __future__ import annotations

import collections
import contextlib
import math
import os
from typing import Callable

import torch
import torch._functorch.config
import torch._inductor.config
from torch.utils._python_dispatch import TorchDispatchMode

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

# Relative error bound ||kernel - ref|| / ||ref|| by the dtype a result is stored in. fp32 results
# differ from float64 only by fp32 rounding and summation order; bf16 and fp16 results carry one
# rounding of their own (unit roundoff 2**-8 and 2**-11), so the bound is a few units of that.
TOLERANCE = {F32: 1e-5, F16: 2e-3, BF16: 1.2e-2}

MODES = ["plain", "drop_path", "rdp_even", "rdp_odd"]


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    assert torch.isfinite(a).all(), "non-finite values in the result"
    denom = ref.norm().item()
    return (a - ref).norm().item() / (denom if denom > 0 else 1.0)


def assert_close(name: str, a: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert a.shape == ref.shape, f"{name}: shape {tuple(a.shape)} != {tuple(ref.shape)}"
    err = rel_err(a, ref)
    assert err <= TOLERANCE[dtype], f"{name}: relative error {err:.2e} above {TOLERANCE[dtype]:.0e} ({dtype})"


def assert_sum_close(name: str, a: torch.Tensor, ref: torch.Tensor, terms_rss: torch.Tensor, dtype: torch.dtype) -> None:
    """A sum of N terms of both signs (a dalpha) against its float64 reference, relative to the terms'
    root-sum-square: at N > 2**20 the sum may cancel to a few % of it by chance, while fp32 rounding
    errors of fixed-order tree sums scale with it (times about sqrt(log2 N)), not with the result."""
    assert a.shape == ref.shape, f"{name}: shape {tuple(a.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(a).all(), f"{name}: non-finite values in the result"
    err = (a.double() - ref.double()).norm().item() / max(terms_rss.item(), 1e-300)
    assert err <= TOLERANCE[dtype], f"{name}: error {err:.2e} of its terms' root-sum-square above {TOLERANCE[dtype]:.0e} ({dtype})"


def mode_scales(mode: str, batch: int, device, drop_prob: float = 0.4, generator=None):
    """(row_scale, grad_scale) for each row of docs/ops.md's drop-path table; masks drawn fresh each call."""
    if mode == "plain":
        return None, None
    m = (torch.rand(batch, generator=generator) >= drop_prob).float()
    m[0], m[-1] = 1.0, 0.0  # both kinds of sample present whatever the draw
    m = m.to(device)
    keep = 1.0 - drop_prob
    if mode == "drop_path":
        return m / keep, m / keep
    if mode == "rdp_even":
        return m, m
    if mode == "rdp_odd":
        return None, 1.0 - m
    raise ValueError(mode)


def make_case(shape, x_dtype, h_dtype, device, weight=True, bias=True):
    """(x, h, weight, bias) of a residual_layer_norm call, drawn fresh."""
    dim = shape[-1]
    x = torch.randn(shape, device=device).to(x_dtype)
    h = torch.randn(shape, device=device).to(h_dtype)
    w = (1.0 + 0.5 * torch.randn(dim, device=device)) if weight else None
    b = 0.5 * torch.randn(dim, device=device) if bias else None
    return x, h, w, b


def leaves(*ts):
    return [None if t is None else t.detach().clone().requires_grad_(True) for t in ts]


def as_f64(*ts):
    return [None if t is None else t.detach().double().requires_grad_(True) for t in ts]


def f64(t):
    return None if t is None else t.detach().double()


def grads(outputs, cotangents, inputs):
    """torch.autograd.grad over the inputs that are not None; None stays None in the result."""
    present = [t for t in inputs if t is not None]
    it = iter(torch.autograd.grad(outputs, present, cotangents))
    return [None if t is None else next(it) for t in inputs]


def assert_direct_launch_equals_tritons_own(run: Callable, cases: list, launches: list) -> None:
    """``run(*case)`` for every case gives bit-equal results through Triton's own launch and through
    ``CachedLaunch``'s direct call of the compiled kernel (a first pass may compile and cache, a second
    calls the cache), and every one of ``launches`` (CachedLaunch objects) cached a compiled kernel."""
    from unittest import mock

    from dres.kernels import utils

    with mock.patch.object(utils, "_raw_stream", None):  # Triton's own launch on every call
        want = [run(*case) for case in cases]
    for _ in range(2):
        for case, expected in zip(cases, want):
            for a, c in zip(run(*case), expected):
                assert torch.equal(a, c)
    assert all(launch.compiled for launch in launches), "the direct launch was never taken"


def capture_graph(step: Callable):
    """Capture ``step`` in a CUDA graph after warming it on a side stream (PyTorch's CUDA-graph
    docs); returns the graph and the captured outputs, which the replays overwrite."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    torch.cuda.synchronize()
    return graph, outs


def recording_backend(forward_targets: set, backward_targets: set):
    """aot_eager that also records the targets of the forward and backward graphs it compiles."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def recorder(targets):
        def compiler(gm, example_inputs):
            targets.update(node.target for node in gm.graph.nodes)
            return make_boxed_func(gm.forward)

        return compiler

    return aot_autograd(fw_compiler=recorder(forward_targets), bw_compiler=recorder(backward_targets))


def assert_graph_runs(targets: set, op_names: list, device: torch.device) -> None:
    """On CUDA, torch.compile traces through the dres ops to their Triton launches (no dres op left
    in the graph); on the CPU interpreter the ops stay opaque graph nodes."""
    from torch._higher_order_ops.triton_kernel_wrap import triton_kernel_wrapper_functional

    dres_ops = {getattr(torch.ops.dres, name).default for name in op_names}
    if device.type == "cuda":
        assert not dres_ops & targets, dres_ops & targets
        assert triton_kernel_wrapper_functional in targets
    else:
        assert dres_ops <= targets, dres_ops - targets


@contextlib.contextmanager
def inductor_caches_off():
    """Inductor without its FX-graph and AOTAutograd caches (a cache hit skips lowering), through
    the configs' own ``patch``: monkeypatch's undo deletes config keys under pytest 9."""
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield


@contextlib.contextmanager
def fp32_on_cuda():
    """Full fp32 convolutions and matmuls on CUDA while the context lasts: TF32 (cuDNN's default for
    convolutions) rounds their inputs to 10 mantissa bits, far above what an fp32 comparison allows."""
    matmul_tf32 = torch.backends.cuda.matmul.allow_tf32  # a property: mock.patch cannot delete it afterwards
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.backends.cudnn.flags(allow_tf32=False):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul_tf32


@contextlib.contextmanager
def cuda_dispatch_forced():
    """CPU tensors dispatched to CUDA kernels while the context lasts (the CUDA key in the thread's
    included dispatch keys), the thread's keys restored exactly on leaving. On torch 2.11
    ``_IncludeDispatchKeyGuard(DispatchKey.CUDA)`` alone leaves CUDA's backend bit set on exit (the
    included keys' raw form goes from 0x804000000 to 0x804000002), after which every CPU op of the
    process dispatches to its CUDA kernel and fails ("CUDAGuardImpl initialized with non-CUDA
    DeviceType: cpu"); ``_PreserveDispatchKeyGuard`` saves the whole key set and puts it back."""
    with torch._C._PreserveDispatchKeyGuard(), torch._C._IncludeDispatchKeyGuard(torch._C.DispatchKey.CUDA):
        yield


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler of its own for ``signum`` (the SigCgt mask of /proc/<pid>/status)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (FileNotFoundError, ProcessLookupError):
        return False
    return bool(mask >> (signum - 1) & 1)


def signal_after_the_handler(procs: list, delays: list, timeout: float = 120.0) -> None:
    """Send each process's group SIGTERM, or SIGINT every second one, ``delay`` seconds after the process first
    catches SIGTERM: a signal sooner meets the interpreter's own start-up, which no code of the command can answer
    (on a loaded machine that lasts past any fixed delay). A process that ends first is not signalled."""
    import os
    import signal
    import time

    caught = [None] * len(procs)
    pending = set(range(len(procs)))
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        now = time.monotonic()
        for i in sorted(pending):
            if procs[i].poll() is not None:
                pending.discard(i)
            elif caught[i] is None:
                caught[i] = now if catches(procs[i].pid, signal.SIGTERM) else None
            elif now >= caught[i] + delays[i]:
                os.killpg(procs[i].pid, signal.SIGINT if i % 2 else signal.SIGTERM)
                pending.discard(i)
        time.sleep(0.005)
    assert not pending, f"processes {sorted(pending)} never caught SIGTERM in {timeout} s"


def free_port() -> int:
    """A port free now, for torchrun's agent to bind (it serves the store itself; ranks the test starts on their own
    take :func:`process_group`, whose port is never let go)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def process_group(world: int):
    """The environment variables with which ``world`` processes join one process group (``env://``, every rank a
    client, as under torchrun's agent) at a store this process serves while the block runs. Its port is bound
    before any rank starts: a port found free and let go can be taken meanwhile by another test's process (the
    suites run in several at once), whose listener a rank would then wait on forever."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        yield {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "WORLD_SIZE": str(world),
               "TORCHELASTIC_USE_AGENT_STORE": "True"}
    finally:
        del store


def philox_kept(shape, p: float, seed: int) -> torch.Tensor:
    """The kernels' dropout mask (1 kept) in plain int64 torch, the stream written out: element i of the flat
    (rows, D) tensor takes word i % 4 of Philox-4x32-10 at counter (i // 4 low word, high word, 0, 0) with key
    (seed low word, high word), as Triton's ``uint_to_uniform_float``, and is kept when that is >= p."""
    mask32 = 0xFFFFFFFF
    index = torch.arange(math.prod(shape), dtype=torch.int64)
    c = [(index // 4) & mask32, (index // 4) >> 32, torch.zeros_like(index), torch.zeros_like(index)]
    k0, k1 = seed & mask32, (seed >> 32) & mask32
    def mul_hi_lo(a: int, x: torch.Tensor):  # a * x of 32-bit words in 16-bit halves: no int64 overflow
        high, low = a * (x >> 16), a * (x & 0xFFFF)
        low_sum = ((high & 0xFFFF) << 16) + low
        return (high >> 16) + (low_sum >> 32), low_sum & mask32

    for _ in range(10):
        hi_b, lo_b = mul_hi_lo(0xCD9E8D57, c[2])
        hi_a, lo_a = mul_hi_lo(0xD2511F53, c[0])
        c = [hi_b ^ c[1] ^ k0, lo_b, hi_a ^ c[3] ^ k1, lo_a]
        k0, k1 = (k0 + 0x9E3779B9) & mask32, (k1 + 0xBB67AE85) & mask32
    word = torch.stack(c, -1).gather(-1, (index % 4)[:, None])[:, 0]
    as_int32 = torch.where(word >= 1 << 31, word - (1 << 32), word)
    uniform = torch.where(as_int32 < 0, -as_int32 - 1, as_int32).to(torch.float32) * 4.6566127342e-10
    return (uniform >= p).reshape(shape)


class LaunchCounts(TorchDispatchMode):
    """The aten ops that do work (all but views and reshapes), by op."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func is not torch.ops.aten._unsafe_view.default:
            self.counts[func] += 1
        return func(*args, **(kwargs or {}))


class SignalledTask:
    """A trainer's task whose loss sends this process ``signals`` in its ``at``-th call: a signal in the middle of a
    known step."""

    def __init__(self, task, at: int, signals: list):
        self.task, self.at, self.signals, self.calls = task, at, signals, 0

    def __getattr__(self, attr):
        return getattr(self.task, attr)

    def loss(self, model, batch, cfg):
        self.calls += 1
        if self.calls == self.at:
            for signum in self.signals:
                os.kill(os.getpid(), signum)
        return self.task.loss(model, batch, cfg)
