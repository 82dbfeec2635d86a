"""What the Triton launchers share: a cached direct launch of compiled kernels (recorded into the
graph instead when torch.compile traces the launch), tensors as rows, the persistent-grid size,
reusable fp32 scratch, and the fixed-order column sum that finishes partial reductions.

Kernels and launchers only, like the rest of ``dres.kernels``: no autograd.
"""

from __future__ import annotations

import functools
import threading

import torch
import triton
import triton.language as tl
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.library import wrap_triton


def is_traced(t: torch.Tensor) -> bool:
    """Whether ``t`` is a tensor of torch.compile's functional tracing (AOTAutograd), on which a
    launch is recorded into the graph for Inductor to run rather than run now."""
    return isinstance(t, FunctionalTensor)


class CachedLaunch:
    """Launch a ``@triton.jit`` kernel, calling its compiled binary directly once compiled.

    ``JITFunction.run`` re-derives the specialisation of every argument, looks the kernel up, builds
    launch metadata for profiler hooks and binds its launcher on each call (tens of microseconds of
    Python, more than a small kernel's GPU time). Here the first launch of each specialisation goes
    through Triton as usual and keeps the ``CompiledKernel`` it returns; later launches with the
    same key call ``CompiledKernel.run`` (the signature triton 3.6 and 3.8 share) with no launch
    metadata and no hooks, which is what Triton's launcher does when no hook is registered. The key
    holds what Triton specialises on: constexpr values, tensor dtypes and 16-byte alignment, integer
    width, divisibility by 16 and equality to 1, launch options and the device. Where no compiled
    kernel comes back (the CPU interpreter, another Triton) or a hook is registered (a profiler such
    as proton, a kernel's ``pre_run_hooks``), every launch takes Triton's own path.

    Under torch.compile's tracing (``is_traced`` arguments) the launch is recorded through
    ``torch.library.wrap_triton``: Inductor then launches the kernel from its own generated code.

    ``test_gpu_cached_launch_equals_tritons_own_launch`` checks the results equal Triton's own launch
    bit for bit on a GPU.

    ``args``: every kernel parameter in signature order, constexprs included.
    """

    def __init__(self, kernel: triton.runtime.JITFunction):
        self.kernel = kernel
        self.num_args = len(kernel.arg_names)
        # The CPU interpreter's kernels have no parameter metadata (and nothing compiled to cache).
        params = getattr(kernel, "params", None)
        self.constexpr = None if params is None else tuple(p.is_constexpr for p in params)
        self.pre_run_hooks = getattr(kernel, "pre_run_hooks", ())  # the kernel's own list: later additions show
        self.compiled: dict[tuple, object] = {}

    def key(self, args: tuple, device_index: int, options: tuple) -> tuple:
        spec = [device_index, options]
        append = spec.append
        for a, is_constexpr in zip(args, self.constexpr):
            kind = type(a)  # exact types first: this runs for every argument of every eager launch
            if is_constexpr:
                append(a)
            elif kind is int:
                append((a % 16 == 0, a == 1, "i32" if _I32_MIN <= a <= _I32_MAX else _int_width(a)))  # i32 inline: hot
            elif isinstance(a, torch.Tensor):
                append((a.dtype, a.data_ptr() % 16 == 0))
            elif kind is bool:
                append(bool)
            elif isinstance(a, int):  # an int subclass (bool is caught above)
                append((a % 16 == 0, a == 1, _int_width(a)))
            else:
                append(kind)
        return tuple(spec)

    def __call__(self, grid: tuple, args: tuple, num_warps: int, num_stages: int | None = None) -> None:
        if is_traced(args[0]):
            self._launch(grid, args, num_warps, num_stages, wrap_triton(self.kernel))
            return
        if self.constexpr is None or not args[0].is_cuda or _raw_stream is None or _hooks_set() or self.pre_run_hooks:
            self._launch(grid, args, num_warps, num_stages)
            return
        device_index = torch.cuda.current_device()  # where Triton launches, as in JITFunction.run
        key = self.key(args, device_index, (num_warps, num_stages))
        compiled = self.compiled.get(key)
        if compiled is None:
            compiled = self._launch(grid, args, num_warps, num_stages)
            if all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
                self.compiled[key] = compiled
            return
        # Argument order as in JITFunction.run: launch metadata, enter and exit hooks (None: none).
        compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                     _raw_stream(device_index), compiled.function, compiled.packed_metadata, None, None, None, *args)

    def _launch(self, grid, args, num_warps, num_stages, kernel=None):
        if len(args) != self.num_args:
            raise TypeError(f"{self.kernel.fn.__name__} takes {self.num_args} arguments, got {len(args)}")
        options = {"num_warps": num_warps}
        if num_stages is not None:
            options["num_stages"] = num_stages
        return (kernel or self.kernel)[grid](*args, **options)


_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1


def _int_width(value: int) -> str:
    """The integer type Triton gives a non-constexpr int argument."""
    if _I32_MIN <= value <= _I32_MAX:
        return "i32"
    return "i64" if value < 2**63 else "u64"


# The current CUDA stream as a raw handle, what a compiled kernel's launcher takes (private torch
# API, also what Triton itself calls); without it every launch takes Triton's own path.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _hooks_set() -> bool:
    """A launch hook (a profiler such as proton) wants Triton's own launch path and its metadata.

    In triton 3.6 and 3.8 the hooks are ``HookChain`` objects, never None: a chain counts when it holds calls.
    """
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None:  # a Triton without knobs: its launcher's signature is not known here
        return True
    return _hook_registered(runtime.launch_enter_hook) or _hook_registered(runtime.launch_exit_hook)


def _hook_registered(hook) -> bool:
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)  # a HookChain; anything else set there is a hook itself
    return bool(calls) if calls is not None else True


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch grids (``triton.cdiv`` is a ConstexprFunction: microseconds per call)."""
    return -(-a // b)


def rows_of(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``t`` read as (rows, D) rows of its last dimension: ``(t, row stride)`` without a copy when its
    rows are evenly spaced with unit stride along D, else ``(contiguous copy, D)``.

    The kernels take a base pointer and a row stride, so N-D tensors need no (rows, D) view: gradients
    may arrive with any strides (a slice of a larger tensor, an expanded tensor with row stride 0)
    and are read in place.
    """
    shape, strides = t.shape, t.stride()
    if strides[-1] == 1 or shape[-1] == 1:
        row_stride = expected = None
        for size, stride in zip(reversed(shape[:-1]), reversed(strides[:-1])):
            if size == 1:
                continue
            if row_stride is None:
                row_stride = stride
            elif stride != expected:
                break
            expected = stride * size
        else:
            return t, shape[-1] if row_stride is None else row_stride
    return t.contiguous(), shape[-1]


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def persistent_programs(device: torch.device, num_tiles: int, programs_per_sm: int = 4) -> int:
    """Programs for a persistent grid: a few per SM, never more than tiles."""
    if device.type == "cuda":
        slots = programs_per_sm * _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    else:  # the Triton interpreter on CPU: a handful of programs exercises the strided loop
        slots = 4
    return max(1, min(num_tiles, slots))


# Scratch for partial sums, kept between calls: one buffer per (device, stream, thread), grown to
# the largest request. Reuse is safe because kernels on one stream run in launch order, so a later
# call cannot overwrite partials an earlier one has yet to reduce; the thread is in the key because
# two threads launching on one stream could interleave. During CUDA-graph capture and torch.compile's
# tracing the scratch is allocated per call: the graph keeps its own copy in its pool (Inductor plans
# it as a buffer), and a cached buffer must not be baked into a graph.
_SCRATCH: dict[tuple, torch.Tensor] = {}
SCRATCH_MAX_BYTES = 64 << 20  # larger requests (very wide rows) are allocated per call


def scratch_buffer(like: torch.Tensor, numel: int) -> torch.Tensor:
    """A float32 buffer of ``numel`` elements on ``like``'s device that the caller may overwrite until
    it returns."""
    device = like.device
    if numel * 4 > SCRATCH_MAX_BYTES or is_traced(like):
        return torch.empty((numel,), dtype=torch.float32, device=device)
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return torch.empty((numel,), dtype=torch.float32, device=device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = _raw_stream(index) if _raw_stream is not None else torch.cuda.current_stream(index).stream_id
        key = (device.type, index, stream, threading.get_ident())
    else:
        key = (device.type, device.index, 0, threading.get_ident())
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < numel:
        buf = _SCRATCH[key] = torch.empty((numel,), dtype=torch.float32, device=device)
    return buf[:numel]


@triton.jit
def _sum_partials_kernel(PART, OUT0, OUT1, num_rows, D, TWO_OUTPUTS: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_C: tl.constexpr):
    """OUTk[:] = sum over rows of PART[k, :, :] (k = 0, 1), rows added in a fixed order (deterministic)."""
    k = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < D
    acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    base = PART + k * num_rows * D
    for start in range(0, num_rows, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        mask = (rows < num_rows)[:, None] & col_ok[None, :]
        acc += tl.load(base + rows[:, None] * D + cols[None, :], mask=mask, other=0.0)
    total = tl.sum(acc, axis=0)
    if k == 0:
        tl.store(OUT0 + cols, total, mask=col_ok)
    elif TWO_OUTPUTS:
        tl.store(OUT1 + cols, total, mask=col_ok)


_SUM_PARTIALS = CachedLaunch(_sum_partials_kernel)


@functools.lru_cache(maxsize=None)
def _sum_partials_block(dim: int) -> int:
    return min(32, triton.next_power_of_2(dim))


def sum_partials(partials: torch.Tensor, outs: list[torch.Tensor]) -> None:
    """``outs[k][:] = partials[k].sum(0)`` in a fixed order, for one or two (rows, D) fp32 partials
    stacked in ``partials`` (k, rows, D), contiguous: one launch for both."""
    num, rows, dim = partials.shape
    # Narrow column strips, so that many programs share the partials; each walks all rows in order.
    block_c = _sum_partials_block(int(dim))
    # one output: OUT1 is the (read-only) partials, never outs[0] again: under torch.compile a
    # kernel's written arguments must not alias, or the functionalized copy of one is lost
    two = len(outs) == 2
    _SUM_PARTIALS((cdiv(dim, block_c), num),
                  (partials, outs[0], outs[1] if two else partials, rows, dim, two, 128, block_c), num_warps=4)
