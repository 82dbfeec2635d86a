"""What every benchmark measures with: the card name, versions and where records go, the byte model
of the fused ops, timing helpers (triton.testing.do_bench median, back-to-back loops), the same-run
ceilings (copy bandwidth, bf16 matmul rate), and the JSON / Markdown record files.

Everything here that does not touch a GPU is unit-tested on the CPU in tests/test_benchmarks.py.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from dres.records import write_json_atomic  # noqa: F401 (the benchmarks write their records through it)

REPO_ROOT = Path(__file__).resolve().parent.parent
RECORDS_DIR = REPO_ROOT / "records" / "benchmarks"

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

# ---------------------------------------------------------------------------------------------
# Names, versions


def sanitize_card_name(name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"h100-80gb-hbm3"``: lower case, vendor prefix dropped, every
    run of other characters one dash, so the name is safe in a file name on any system."""
    s = name.strip().lower()
    s = re.sub(r"^nvidia\s+", "", s)
    s = re.sub(r"[^a-z0-9]+", "-", s).strip("-")
    return s or "unknown-device"


def card_name(device: int | None = None) -> str:
    if not torch.cuda.is_available():
        return "cpu"
    return sanitize_card_name(torch.cuda.get_device_name(device))


def machine_name() -> str:
    """The record folders' card word: ``h100`` for one H100 80GB HBM3, ``h100x2`` for a host of two,
    ``cpu`` without a GPU (records/README.md)."""
    if not torch.cuda.is_available():
        return "cpu"
    count = torch.cuda.device_count()
    return card_name(0).split("-")[0] + (f"x{count}" if count > 1 else "")


def default_out(what: str) -> str:
    """The record folder of a run without ``--out``: ``records/benchmarks/<machine>-<today>-<what>``."""
    return str(RECORDS_DIR / f"{machine_name()}-{today()}-{what}")


def versions() -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # CPU-only installs (macOS) have no triton
        triton_version = None
    return {"torch": torch.__version__, "triton": triton_version}


def today() -> str:
    return datetime.date.today().isoformat()


def dtype_name(dt: torch.dtype) -> str:
    return DTYPE_NAMES[dt]


def configure_caches() -> None:
    """Point Inductor's and Triton's on-disk caches inside the repo (git-ignored) unless the caller
    chose a place: the device keeps ignored files of the work tree between calls, so a second run of
    the same sweep skips compilation (minutes of a 10-minute call)."""
    cache = REPO_ROOT / "benchmarks" / ".cache"
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache / "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(cache / "triton"))


def configure_dynamo_for_many_shapes() -> None:
    """Every (op, shape, dtype, mode) gets its own ``dynamic=False`` compile. Dynamo keys its cache on
    the code object, so without raising the limits the 9th shape of one reference function would
    silently fall back to eager and the "torch.compile" column would be eager PyTorch."""
    import torch._dynamo

    cfg = torch._dynamo.config
    # Renamed across releases (cache_size_limit -> recompile_limit); set every name that exists.
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                 "accumulated_recompile_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, 100_000)
    # A guard failure on a new shape must not turn the next compile dynamic (we compare against the
    # best static-shape code Inductor makes).
    if hasattr(cfg, "automatic_dynamic_shapes"):
        cfg.automatic_dynamic_shapes = False


# ---------------------------------------------------------------------------------------------
# The byte model of the fused ops

OPS = ("residual_layer_norm", "residual_add", "layer_norm")
PASSES = ("fwd", "fwd_bwd")

# mode -> (forward reads a per-sample row_scale, backward reads a per-sample grad_scale,
#          alpha is a tensor the kernels read, alpha gets a gradient)
MODE_FLAGS = {
    "plain": (False, False, False, False),
    "alpha": (False, False, False, False),
    "drop_path": (True, True, False, False),      # row_scale = grad_scale = m / keep
    "rdp_even": (True, True, False, False),       # row_scale = m (grad_scale = row_scale)
    "rdp_odd": (False, True, False, False),       # grad_scale = 1 - m, value unscaled
    "alpha_tensor": (False, False, True, False),  # 0-dim buffer, as models keep their alphas
    "alpha_grad": (False, False, True, True),     # learnable alpha: backward also reads x for dalpha
    "dropout": (False, False, False, False),      # dropout of h (p = 0.1): its mask is drawn, not read or written
}
MODES = tuple(MODE_FLAGS)
DROPOUT_P = 0.1  # the dropout mode's p (BERT's and GPT-2's residual dropout)
# layer_norm has no residual input, so only the plain mode means anything for it.
OP_MODES = {"residual_layer_norm": MODES, "residual_add": MODES, "layer_norm": ("plain",)}


def kernel_bytes(op: str, pass_: str, rows: int, dim: int, x_dtype: torch.dtype, h_dtype: torch.dtype,
                 mode: str = "plain", batch: int = 1, param_dtype: torch.dtype = torch.float32) -> int:
    """Bytes the op must move: each input read once, each output written once (the op contract, docs/design.md).

    residual_layer_norm: out has x's dtype, y has h's dtype.
      fwd  reads x, h, weight, bias [, row_scale (B fp32)] [, alpha (fp32 scalar)]; writes out, y.
      bwd  reads g_out, g_y, out (saved), weight [, grad_scale] [, alpha] [, x for dalpha];
           writes dx, dh, dweight, dbias [, dalpha].
    residual_add: fwd reads x, h [, scale, alpha]; writes out.
      bwd reads g_out [, grad_scale, alpha, x for dalpha]; writes dx, dh [, dalpha].
    layer_norm (x = the stream, y has h_dtype): fwd reads x, weight, bias; writes y.
      bwd reads g_y, x (saved), weight; writes dx, dweight, dbias.
    The per-row mean/rstd an implementation may save (8 bytes a row) are not counted: they are
    not inputs or outputs of the op, and counting them would favour implementations that store them.
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if pass_ not in PASSES + ("bwd",):
        raise ValueError(f"pass must be fwd, bwd or fwd_bwd, got {pass_!r}")
    if mode not in OP_MODES[op]:
        raise ValueError(f"mode {mode!r} does not apply to {op}")
    if pass_ == "fwd_bwd":
        return (kernel_bytes(op, "fwd", rows, dim, x_dtype, h_dtype, mode, batch, param_dtype)
                + kernel_bytes(op, "bwd", rows, dim, x_dtype, h_dtype, mode, batch, param_dtype))
    n = rows * dim
    sx, sh = x_dtype.itemsize, h_dtype.itemsize
    sp = param_dtype.itemsize
    fwd_scale, bwd_scale, alpha_tensor, alpha_grad = MODE_FLAGS[mode]
    scale_bytes = batch * 4  # the (B,) factors are fp32
    alpha_bytes = 4 if alpha_tensor else 0
    if op == "residual_layer_norm":
        if pass_ == "fwd":
            return (n * (sx + sh) + 2 * dim * sp + (scale_bytes if fwd_scale else 0) + alpha_bytes
                    + n * (sx + sh))
        return (n * (sx + sh + sx) + dim * sp + (scale_bytes if bwd_scale else 0) + alpha_bytes
                + (n * sx if alpha_grad else 0)
                + n * (sx + sh) + 2 * dim * sp + (4 if alpha_grad else 0))
    if op == "residual_add":
        if pass_ == "fwd":
            return n * (sx + sh) + (scale_bytes if fwd_scale else 0) + alpha_bytes + n * sx
        return (n * sx + (scale_bytes if bwd_scale else 0) + alpha_bytes + (n * sx if alpha_grad else 0)
                + n * (sx + sh) + (4 if alpha_grad else 0))
    # layer_norm
    if pass_ == "fwd":
        return n * sx + 2 * dim * sp + n * sh
    return n * sh + n * sx + dim * sp + n * sx + 2 * dim * sp


def us_at_ceiling(nbytes: int, ceiling_gbps: float) -> float:
    """Microseconds to move ``nbytes`` at ``ceiling_gbps`` (GB = 1e9 bytes)."""
    return nbytes / (ceiling_gbps * 1e9) * 1e6


def gbps(nbytes: int, us: float) -> float:
    return nbytes / (us * 1e-6) / 1e9


# ---------------------------------------------------------------------------------------------
# Timing


def do_bench_median_us(fn: Callable[[], object], warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median time of ``fn`` in microseconds by ``triton.testing.do_bench`` (CUDA events around each
    call, L2 flushed before each). Keyword arguments only: the positional order is not promised
    across triton releases; ``return_mode`` exists in 3.x (3.6 and 3.8 both checked)."""
    from triton.testing import do_bench

    try:
        ms = do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    except TypeError:  # a triton without return_mode: the 0.5 quantile is the median
        ms = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5])
        ms = ms[0] if isinstance(ms, (list, tuple)) else ms
    return float(ms) * 1e3


def capture_graph(step: Callable, before_capture: Callable[[], object] | None = None):
    """Capture ``step`` (fwd or fwd+bwd) in a CUDA graph after warming it on a side stream, as the
    PyTorch CUDA-graph docs prescribe; returns the graph and the captured outputs (kept alive so the
    graph's memory stays valid). ``before_capture`` runs between the warm-up and the capture (a whole
    training step sets its gradients to None there, so backward allocates them in the graph's pool)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    if before_capture is not None:
        before_capture()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    torch.cuda.synchronize()
    return graph, outs


def graph_median_us(step: Callable[[], object], warmup_ms: float = 5, rep_ms: float = 30,
                    before_capture: Callable[[], object] | None = None) -> float:
    """Median microseconds of ``step`` replayed as a captured CUDA graph (:func:`do_bench_median_us` of the
    replay): the GPU time alone, as the trainers replay their step, whatever the host's launch cost or load.
    ``before_capture``: as in :func:`capture_graph`."""
    graph, outs = capture_graph(step, before_capture)
    us = do_bench_median_us(graph.replay, warmup_ms=warmup_ms, rep_ms=rep_ms)
    del graph, outs
    return us


def union_us(intervals) -> float:
    """Length of the union of ``(start, end)`` intervals: time the GPU ran anything, counting
    overlapping kernels (compute beside NCCL on another stream) once."""
    total, end = 0.0, None
    for lo, hi in sorted(intervals):
        if end is None or lo > end:
            total += hi - lo
            end = hi
        elif hi > end:
            total += hi - end
            end = hi
    return total


def is_gpu_work(evt) -> bool:
    """A profiler event that is a kernel, copy or memset: not the GPU-side span of a ``record_function`` range
    (FSDP's hooks, ``Optimizer.step``), which lasts from its first to its last kernel, idle time included."""
    return evt.device_type == torch.autograd.DeviceType.CUDA and not getattr(evt, "is_user_annotation", False)


def gpu_busy_us(prof) -> float:
    """Microseconds in which the GPU ran kernels or copies during ``prof`` (a finished ``torch.profiler.profile``)."""
    return union_us((e.time_range.start, e.time_range.end) for e in prof.events() if is_gpu_work(e))


def profiled_steps(step: Callable[[], object], steps: int):
    """``steps`` back-to-back calls of ``step`` (warmed up by the caller) under ``torch.profiler`` (CPU and CUDA
    activity): ``(the finished profile, wall microseconds per step)``."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t0) * 1e6 / steps
    return prof, wall_us


def time_configs(time_config: Callable[[tuple], float], configs: Iterable[tuple],
                 label: Callable[[tuple], str] = str) -> list[tuple[float, tuple]]:
    """``(microseconds, config)`` of every launch config ``time_config`` can run, fastest first, each printed
    as it ranks (``label`` names a config); a config that fails (out of shared memory or registers for its
    tile) is printed as skipped."""
    results = []
    for config in configs:
        try:
            results.append((time_config(config), config))
        except Exception as e:
            print(f"  skipped {label(config)}: {type(e).__name__}", flush=True)
    results.sort()
    for us, config in results:
        print(f"    {us:7.0f} us  {label(config)}", flush=True)
    return results


def loop_median_us(fn: Callable[[], object], target_ms: float = 30, repeats: int = 5) -> float:
    """Microseconds per call of ``fn`` issued back to back (no cache flush in between), median over
    ``repeats`` loops. do_bench launches each call right after a 256 MB cache-flush kernel, which
    hides up to ~100 us of CPU launch cost; a training loop has no such gap, so this is the number
    that shows whether a small op is launch-bound."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        fn()
    end.record()
    torch.cuda.synchronize()
    est_ms = max(start.elapsed_time(end) / 3, 1e-3)
    n = int(min(max(target_ms / est_ms, 10), 2000))
    times = []
    for _ in range(repeats):
        start.record()
        for _ in range(n):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / n * 1e3)
    return statistics.median(times)


def cpu_median_us(fn: Callable[[], object], warmup_ms: float = 0, rep_ms: float = 0, n: int = 3) -> float:
    """Wall-clock median of ``n`` calls: only for exercising the harness on a CPU (tests)."""
    import time

    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def cpu_copy_gbps(nbytes: int = 64 << 20) -> float:
    """The CPU stand-in of the copy ceiling (tests of the harness only)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return gbps(2 * nbytes, cpu_median_us(lambda: dst.copy_(src)))


def parse_int_shapes(text: str, form: str, example: str) -> list[tuple[int, ...]]:
    """A ``--shapes`` comma list of integer shapes written as ``form`` ("ROWSxHIDDEN": as many integers as ``form``
    has parts, joined by x); ValueError naming the first item that is not one."""
    parts = len(form.split("x"))
    shapes = []
    for item in filter(None, text.split(",")):
        try:
            shape = tuple(int(v) for v in item.lower().split("x"))
        except ValueError:
            shape = ()
        if len(shape) != parts:
            raise ValueError(f"--shapes: {item!r} is not {form} (e.g. {example})")
        shapes.append(shape)
    return shapes


def sweep_ceiling_gbps(tool: str) -> float | None:
    """The copy ceiling a launch-config sweep ranks its configs against, printed as its first line; None, after a
    one-line message naming ``tool``, where there is no GPU."""
    if not torch.cuda.is_available():
        print(f"{tool} needs a CUDA GPU (--dry-run shows the plan)", file=sys.stderr)
        return None
    ceiling = copy_ceiling_gbps()
    print(f"# copy ceiling {ceiling:.0f} GB/s", flush=True)
    return ceiling


def copy_ceiling_gbps(nbytes: int = 1 << 30, warmup_ms: float = 50, rep_ms: float = 300) -> float:
    """Device-to-device copy bandwidth (bytes read + written) of a ``copy_`` of ``nbytes`` (>= 1 GiB,
    far beyond L2), measured the same way as the ops (do_bench median). The 100% of every table."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    us = do_bench_median_us(lambda: dst.copy_(src), warmup_ms, rep_ms)
    result = gbps(2 * src.numel() * 4, us)
    del src, dst
    torch.cuda.empty_cache()
    return result


def matmul_peak_tflops(n: int = 8192, warmup_ms: float = 100, rep_ms: float = 500) -> float:
    """Measured dense bf16 matmul rate (n^3 GEMM, 2 n^3 FLOP), the denominator of model FLOP
    utilisation: a same-run measurement, not the datasheet figure."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    us = do_bench_median_us(lambda: a @ b, warmup_ms, rep_ms)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n**3 / (us * 1e-6) / 1e12


# ---------------------------------------------------------------------------------------------
# Result files

KERNEL_FIELDS = ("op", "rows", "dim", "x_dtype", "h_dtype", "mode", "pass", "impl", "us", "gbps",
                 "ceiling_gbps", "pct_ceiling", "card", "torch", "triton", "date")
KERNEL_KEY = ("card", "op", "rows", "dim", "x_dtype", "h_dtype", "mode", "pass", "impl")


def make_kernel_record(*, op: str, rows: int, dim: int, x_dtype: str, h_dtype: str, mode: str, pass_: str,
                       impl: str, us: float, nbytes: int, ceiling_gbps: float, card: str,
                       env: dict | None = None, date: str | None = None, **extra) -> dict:
    """One measurement. GB/s and the percentage of the same-run copy ceiling follow from the byte
    model; ``extra`` carries optional fields (bytes, us_loop, check_rel_err, batch, tokens, ...)."""
    env = env or versions()
    rate = gbps(nbytes, us)
    rec = {
        "op": op, "rows": int(rows), "dim": int(dim), "x_dtype": x_dtype, "h_dtype": h_dtype, "mode": mode,
        "pass": pass_, "impl": impl, "us": float(us), "gbps": rate, "ceiling_gbps": float(ceiling_gbps),
        "pct_ceiling": 100.0 * rate / ceiling_gbps, "card": card, "torch": env["torch"],
        "triton": env["triton"], "date": date or today(), "bytes": int(nbytes),
        "us_at_ceiling": us_at_ceiling(nbytes, ceiling_gbps),
    }
    rec.update(extra)
    return rec


def validate_kernel_record(rec: dict) -> None:
    missing = [f for f in KERNEL_FIELDS if f not in rec]
    if missing:
        raise ValueError(f"kernel record lacks {missing}")
    if rec["op"] not in OPS or rec["pass"] not in PASSES or rec["mode"] not in OP_MODES[rec["op"]]:
        raise ValueError(f"bad op/pass/mode in {rec}")
    for f in ("us", "gbps", "ceiling_gbps", "pct_ceiling"):
        if not (isinstance(rec[f], (int, float)) and math.isfinite(rec[f]) and rec[f] > 0):
            raise ValueError(f"{f} must be a positive number, got {rec[f]!r}")


def add_speedups(records: list[dict], key: Sequence[str] = KERNEL_KEY, baseline: str = "compile") -> None:
    """``speedup_vs_compile`` = torch.compile's time / this time for the same measurement (same card,
    op, shape, dtypes, mode, pass); None when torch.compile was not measured there."""
    group_key = [k for k in key if k != "impl"]
    base = {tuple(r[k] for k in group_key): r["us"] for r in records if r["impl"] == baseline}
    for r in records:
        b = base.get(tuple(r[k] for k in group_key))
        r["speedup_vs_compile"] = (b / r["us"]) if b else None


def merge_records(old: Iterable[dict], new: Iterable[dict], key: Sequence[str] = KERNEL_KEY) -> list[dict]:
    """New records replace old ones with the same key; the rest of the old file is kept, so a sweep
    split over several commands accumulates in one file."""
    def record_key(r):  # lists (a trainer run's overrides) as tuples, to be hashed
        return tuple(tuple(v) if isinstance(v, list) else v for v in (r.get(k) for k in key))

    merged = {record_key(r): r for r in old}
    for r in new:
        merged[record_key(r)] = r
    return list(merged.values())


def load_records(path: Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of records")
    return data


IMPL_ORDER = ("dres_triton", "dres_cuda", "dres_triton_graph", "dres_cuda_graph", "eager", "eager_graph",
              "compile", "compile_graph", "flash_attn", "apex", "liger")


def _impl_sort_key(impl: str):
    return (IMPL_ORDER.index(impl) if impl in IMPL_ORDER else len(IMPL_ORDER), impl)


def _fmt_cell(r: dict) -> str:
    s = f"{r['us']:.1f} ({r['pct_ceiling']:.0f}%"
    if r.get("speedup_vs_compile"):
        s += f", {r['speedup_vs_compile']:.2f}x"
    s += ")"
    if r.get("us_loop") is not None:
        s += f" loop {r['us_loop']:.1f}"
    if r.get("check_ok") is False:
        s += " MISMATCH"
    return s


def kernel_markdown(records: list[dict]) -> str:
    """One table per (card, op): a row per shape/dtypes/mode/pass, a column per implementation.
    Cell: median us (% of copy ceiling, speedup vs torch.compile) [loop us]."""
    if not records:
        return "No measurements.\n"
    lines = []
    cards = sorted({r["card"] for r in records})
    for card in cards:
        recs = [r for r in records if r["card"] == card]
        r0 = recs[0]
        ceilings = sorted({round(r["ceiling_gbps"]) for r in recs})
        dates = sorted({r["date"] for r in recs})
        lines.append(f"## {card}")
        lines.append("")
        lines.append(f"torch {r0['torch']}, triton {r0['triton']}; copy ceiling measured in each run: "
                     f"{', '.join(str(c) for c in ceilings)} GB/s; dates {', '.join(dates)}.")
        lines.append("")
        lines.append("Cell: median microseconds (percent of the copy ceiling, speedup vs torch.compile); "
                     "`loop` = microseconds per call issued back to back; `MISMATCH` = outputs differ "
                     "from eager PyTorch beyond tolerance.")
        lines.append("")
        for op in OPS:
            op_recs = [r for r in recs if r["op"] == op]
            if not op_recs:
                continue
            impls = sorted({r["impl"] for r in op_recs}, key=_impl_sort_key)
            lines.append(f"### {op}")
            lines.append("")
            lines.append("| rows x D | x / h | mode | pass | at ceiling (us) | " + " | ".join(impls) + " |")
            lines.append("|---|---|---|---|---|" + "---|" * len(impls))
            groups: dict = {}
            for r in op_recs:
                k = (r["rows"], r["dim"], r["x_dtype"], r["h_dtype"], MODES.index(r["mode"]),
                     PASSES.index(r["pass"]))
                groups.setdefault(k, {})[r["impl"]] = r
            for k in sorted(groups):
                rows, dim, xd, hd, mi, pi = k
                by_impl = groups[k]
                any_r = next(iter(by_impl.values()))
                cells = [_fmt_cell(by_impl[i]) if i in by_impl else "" for i in impls]
                lines.append(f"| {rows} x {dim} | {xd} / {hd} | {MODES[mi]} | {PASSES[pi]} | "
                             f"{any_r['us_at_ceiling']:.1f} | " + " | ".join(cells) + " |")
            lines.append("")
    return "\n".join(lines)


def kernel_plot(records: list[dict], path: Path, op: str = "residual_layer_norm", mode: str = "plain") -> bool:
    """Percent of the copy ceiling against problem size, one line per implementation, a panel per
    (pass, dtypes). Uses the Agg backend (no display on the device). Returns False when there is
    nothing to draw for ``op``/``mode`` (falls back to the first op/mode present)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sel = [r for r in records if r["op"] == op and r["mode"] == mode]
    if not sel and records:
        op, mode = records[0]["op"], records[0]["mode"]
        sel = [r for r in records if r["op"] == op and r["mode"] == mode]
    if not sel:
        return False
    dts = sorted({(r["x_dtype"], r["h_dtype"]) for r in sel})
    passes = [p for p in PASSES if any(r["pass"] == p for r in sel)]
    fig, axes = plt.subplots(len(passes), len(dts), figsize=(5 * len(dts), 3.6 * len(passes)), squeeze=False)
    for i, p in enumerate(passes):
        for j, dt in enumerate(dts):
            ax = axes[i][j]
            rs = [r for r in sel if r["pass"] == p and (r["x_dtype"], r["h_dtype"]) == dt]
            for impl in sorted({r["impl"] for r in rs}, key=_impl_sort_key):
                pts = sorted((r["rows"] * r["dim"], r["pct_ceiling"]) for r in rs if r["impl"] == impl)
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=impl)
            ax.set_xscale("log")
            ax.axhline(90, color="grey", linestyle="--", linewidth=0.8)
            ax.set_title(f"{op} {mode} {p} x/h={dt[0]}/{dt[1]}", fontsize=9)
            ax.set_xlabel("rows x D (elements)")
            ax.set_ylabel("% of copy ceiling")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    card = sel[0]["card"]
    fig.suptitle(f"{card}: percent of measured copy bandwidth (dashed: 90% target)", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
