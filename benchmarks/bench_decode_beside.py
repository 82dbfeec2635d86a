"""The training process's GPU half (the decode call, the crop kernel and the batch's order:
:class:`dres.data.decode.BatchFinisher`) on batches of a JPEG folder, alone and beside a GPU load that stands in
for the running training step: in threads of the loaded process, as the trainer finishes batches ahead (one
thread, or several finishing batches at once), and in a process of its own (its own CUDA context).

    python -m benchmarks.bench_decode_beside --root DIR [--decoders torchvision,nvjpeg:1,nvjpeg:0,nvimgcodec:0.65]
        [--threads 1,2] [--priorities high,default] [--no-process] [--load-size 4096] [--load-streams default,own]
        [--load-kinds gemm,sleep] [--sleep-ms 40] [--batches 20] [--hardware-queues 32] [--out OUT]

The folder: ``python -m benchmarks.bench_data make --root DIR``. The batches are the folder's first files as the
GPU-decode workers hand them over (JPEG bytes in pinned memory, what the GPU cannot decode already pixels). The
load: square bf16 GEMMs of ``--load-size`` from a thread of their own, at most 20 queued (a trainer's step keeps
every multiprocessor busy the same way; the GEMMs a second the load ran beside each case against alone say what the
decode took from it), on the legacy default stream, where a trainer's step runs, or on a stream of its own
(``--load-streams default,own``): work that a library queues on a blocking stream of its own waits for the legacy
default stream's queue, and not for a stream created non-blocking, as PyTorch's are. ``--load-kinds sleep`` puts
in the GEMMs' place one kernel of ``--sleep-ms`` at a time, at most two queued (a single-thread kernel that only waits:
a trainer's captured step queued whole, without its use of the multiprocessors), so that a decode slowed beside it
waits for other streams' work rather than for multiprocessors. A decoder is ``torchvision``
(its batched nvJPEG), ``nvimgcodec:SHARE`` or ``nvjpeg:SHARE`` (libnvjpeg called directly with its memory pools,
:mod:`dres.data.nvjpeg`): SHARE of each batch to the hardware JPEG decoders, the rest to nvJPEG on the CUDA cores
(default 1; 0 leaves the hardware decoders unused, which says whether their path is what waits);
``--priorities`` the finishing streams' (the GPU's highest, or the default); ``--threads`` how many threads
finish batches at once, each with a finisher and a stream of its own (torchvision's decoder is one a process,
behind a lock). The process rows run one finishing thread in a child process beside the same load.
``--hardware-queues`` is ``CUDA_DEVICE_MAX_CONNECTIONS`` for the process and its child (default: the environment's,
else 32, what the trainer gives a process that may decode on the GPU: :func:`dres.data.widen_hardware_queues`; 8 is
CUDA's own default, under which the decode's stream shares a hardware queue with the load's).

Each case: ms a batch (the threads' wall time over the batches they finished, each batch waited for on its own
stream) alone and beside the load. ``--profile-calls`` adds, for each one-thread case, the CUDA runtime and driver
calls a batch makes alone and beside the load under torch's profiler (CUPTI sees every library's calls, nvJPEG's own
among them), grouped by the thread the profiler names: which calls the time beside the load goes to. Torch 2.11's
profiler puts every runtime call of the process in one group, so the load's launches and stream waits are counted
in; the load makes no event or device synchronisations. Writes ``decode_beside.json`` and
``decode_beside.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import threading
import time
from pathlib import Path

from benchmarks.bench_data import IMAGENET_MEAN, IMAGENET_STD, prepared_batches

PRIORITIES = {"high": True, "default": False}
LOAD_STREAMS = ("default", "own")  # the legacy default stream, or a stream of the load's own (non-blocking)
LOAD_KINDS = ("gemm", "sleep")  # GEMMs that fill the GPU, or kernels that only take time


def parse_decoders(spec: str) -> list[tuple[str, float]]:
    """``torchvision,nvimgcodec:0.65,nvjpeg`` -> ``[("torchvision", 0.0), ("nvimgcodec", 0.65), ("nvjpeg", 1.0)]``
    (the hardware decoders' share, ``data.hw_decode_load``, defaults to 1: every JPEG they take to them); a ValueError
    naming the flag otherwise."""
    out = []
    for item in (s for s in spec.split(",") if s):
        name, _, share = item.partition(":")
        if name == "torchvision" and not share:
            out.append((name, 0.0))
            continue
        try:
            value = float(share) if share else 1.0
        except ValueError:
            value = -1.0
        if name not in ("nvimgcodec", "nvjpeg") or not 0.0 <= value <= 1.0:
            raise ValueError(f"--decoders {spec}: each of torchvision, nvimgcodec[:SHARE] or nvjpeg[:SHARE], "
                             "SHARE in [0, 1]")
        out.append((name, value))
    if not out:
        raise ValueError(f"--decoders {spec}: at least one decoder")
    return out


class GpuLoad:
    """Work from a thread on the legacy default stream (``stream="default"``) or a stream of its own (``"own"``):
    ``kind="gemm"``, bf16 GEMMs of ``size``, at most 20 queued; ``"sleep"``, kernels that wait ``sleep_ms`` each,
    at most two queued. ``rate`` is the kernels a second of the last window it ran (a ``with`` block)."""

    def __init__(self, size: int, stream: str = "default", kind: str = "gemm", sleep_ms: float = 40.0):
        import torch

        self.stream = torch.cuda.Stream() if stream == "own" else torch.cuda.default_stream()
        self.queued = 20 if kind == "gemm" else 2
        if kind == "gemm":
            a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
            b = torch.randn_like(a)
            self.kernel = lambda: a @ b
        else:
            cycles = round(sleep_ms * _sleep_cycles_a_ms())
            self.kernel = lambda: torch.cuda._sleep(cycles)
        self.stopping, self.count, self.rate = threading.Event(), 0, 0.0

    def _run(self):
        import torch

        with torch.cuda.stream(self.stream):
            while not self.stopping.is_set():
                for _ in range(self.queued):
                    self.kernel()
                self.stream.synchronize()
                self.count += self.queued

    def __enter__(self):
        self.stopping.clear()
        self.count, self.start = 0, time.perf_counter()
        self.thread = threading.Thread(target=self._run, name="gemm-load", daemon=True)
        self.thread.start()
        time.sleep(0.3)  # the queue full before the case starts
        return self

    def __exit__(self, *exc):
        self.stopping.set()
        self.thread.join()
        self.rate = self.count / (time.perf_counter() - self.start)


def _sleep_cycles_a_ms() -> float:
    """The GPU clock's cycles a millisecond, as ``torch.cuda._sleep`` counts them (timed over a 10^8-cycle sleep)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(10 ** 6)  # the kernel loaded
    start.record()
    torch.cuda._sleep(10 ** 8)
    end.record()
    end.synchronize()
    return 10 ** 8 / start.elapsed_time(end)


def finish_ms(finishers: list, batches: list[dict], per_thread: int) -> float:
    """Wall ms a batch with each finisher in a thread of its own finishing ``per_thread`` batches on a stream of
    its own (its finisher's priority), each waited for on that stream, as the loaders' thread finishing ahead does."""
    import torch

    def run(finisher, errors):
        try:
            stream = torch.cuda.Stream(finisher.device, priority=finisher.priority)
            with torch.cuda.stream(stream):
                for k in range(per_thread):
                    finisher(batches[k % len(batches)], [])
                    stream.synchronize()
        except BaseException as e:  # raised in the caller, not lost in the thread
            errors.append(e)

    errors: list = []
    threads = [threading.Thread(target=run, args=(f, errors)) for f in finishers]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return 1e3 * (time.perf_counter() - start) / (per_thread * len(finishers))


def cuda_calls(finishers: list, batches: list[dict], count: int = 3) -> dict:
    """{thread: {call: [calls, host ms] a batch}} of the CUDA runtime and driver calls made while ``finishers``
    finish ``count`` batches each (the load's thread, when one runs, is a thread of its own here)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        finish_ms(finishers, batches, count)
    calls: dict = {}
    for event in prof.events():
        if event.device_type == DeviceType.CPU and event.name.startswith("cu") and "::" not in event.name:
            mine = calls.setdefault(str(event.thread), {}).setdefault(event.name, [0, 0.0])
            mine[0] += 1 / count
            mine[1] += event.cpu_time_total / 1e3 / count
    return calls


def calls_markdown(rows: list[dict], top: int = 6) -> str:
    """Each profiled case's calls a batch, thread by thread, the ``top`` by host time beside the load."""
    lines = ["CUDA calls a batch, alone -> beside the load, by the thread the profiler names (count, host ms; "
             "beside, the load's own launches and stream waits may be counted in: it makes no event or device "
             "synchronisations):", "",
             "| decoder | load | thread | call | alone | beside |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "calls_beside" not in r:
            continue
        name = r["decoder"] + (f", share {r['share']:g}" if r.get("share") is not None else "")
        for thread, calls in r["calls_beside"].items():
            alone = r["calls_alone"].get(thread, {})
            for call, (n, ms) in sorted(calls.items(), key=lambda kv: -kv[1][1])[:top]:
                was = alone.get(call)
                before = f"{was[0]:.1f}, {was[1]:.2f}" if was else "–"
                lines.append(f"| {name} | {r['load']} | {thread} | {call} | {before} | {n:.1f}, {ms:.2f} |")
    return "\n".join(lines) + "\n"


def make_finishers(decoder: str, share: float, high: bool, count: int) -> list:
    from dres.data.decode import BatchFinisher

    return [BatchFinisher("cuda", 224, 3, IMAGENET_MEAN, IMAGENET_STD, decoder, share, high) for _ in range(count)]


def thread_case(batches, load: GpuLoad, decoder: str, share: float, high: bool, threads: int,
                per_thread: int, profile_calls: bool = False) -> tuple[float, float, dict]:
    """ms a batch with ``threads`` finishing threads of this process, alone and beside ``load``, and with
    ``profile_calls`` the CUDA calls of each (:func:`cuda_calls`)."""
    finishers = make_finishers(decoder, share, high, threads)
    finish_ms(finishers, batches, 2)  # the decoders' buffers and the crop kernel's compile
    alone = finish_ms(finishers, batches, per_thread)
    calls = {"calls_alone": cuda_calls(finishers, batches)} if profile_calls else {}
    with load:
        beside = finish_ms(finishers, batches, per_thread)
        if profile_calls:
            calls["calls_beside"] = cuda_calls(finishers, batches)
    return alone, beside, calls


def _child(root, batch, decoder, share, high, per_thread, conn):
    """The process row's finishing process: alone first, then (when told) beside the parent's load."""
    try:
        batches = prepared_batches(root, batch, 4, pin=True)
        finishers = make_finishers(decoder, share, high, 1)
        finish_ms(finishers, batches, 2)
        conn.send(("alone", finish_ms(finishers, batches, per_thread)))
        conn.recv()
        conn.send(("beside", finish_ms(finishers, batches, per_thread)))
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}".splitlines()[0]))


def process_case(args, load: GpuLoad, decoder: str, share: float, high: bool) -> tuple[float, float]:
    """ms a batch with one finishing thread in a process of its own, alone and beside this process's ``load``."""
    ctx = multiprocessing.get_context("spawn")  # a CUDA context of its own: no fork of this one
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(args.root, args.batch, decoder, share, high, args.batches, child))
    proc.start()
    try:
        kind, alone = parent.recv()
        if kind == "error":
            raise RuntimeError(alone)
        with load:
            parent.send("go")
            kind, beside = parent.recv()
        if kind == "error":
            raise RuntimeError(beside)
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    return alone, beside


def markdown(rows: list[dict], card: str, images: int, load_size: int, sleep_ms: float, queues: int) -> str:
    lines = [f"The GPU half of {images}-image batches alone and beside a load ({card}, {queues} hardware queues): "
             f"gemm, {load_size}^3 bf16 GEMMs; sleep, kernels that wait {sleep_ms:g} ms each. ms a batch, and the "
             "load's kernels a second beside each case over alone.", "",
             "| decoder | load | load's stream | where | finishing threads | stream priority | ms a batch alone | "
             "beside the load | beside / alone | load's rate beside / alone |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        name = r["decoder"] + (f", hardware share {r['share']:g}" if r.get("share") is not None else "")
        case = f"| {name} | {r['load']} | {r['load_stream']} | {r['where']} | {r['threads']} | {r['priority']} |"
        if r.get("error"):
            lines.append(f"{case} {r['error']} | | | |")
            continue
        lines.append(f"{case} {r['ms_alone']:.1f} | "
                     f"{r['ms_beside']:.1f} | {r['ms_beside'] / r['ms_alone']:.2f}x | "
                     f"{r['load_rate_beside'] / r['load_rate_alone']:.2f} |")
    return "\n".join(lines) + "\n"


def hardware_queues(asked: int | None) -> int:
    """The CUDA_DEVICE_MAX_CONNECTIONS to run with: ``asked``, else the environment's, else the trainer's for a GPU
    decode; ValueError, naming where it came from, outside 1-32."""
    from dres.data.factory import GPU_DECODE_CONNECTIONS

    if asked is not None:
        value, where = str(asked), "--hardware-queues"
    else:
        value = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", GPU_DECODE_CONNECTIONS)
        where = "CUDA_DEVICE_MAX_CONNECTIONS in the environment"
    if not (value.isdigit() and 1 <= int(value) <= 32):
        raise ValueError(f"{where} is {value}: CUDA takes 1 to 32 hardware queues")
    return int(value)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=True, help="a JPEG folder (bench_data make)")
    ap.add_argument("--decoders", default="torchvision",
                    help="torchvision, nvimgcodec[:SHARE] and/or nvjpeg[:SHARE], comma-separated")
    ap.add_argument("--threads", default="1,2", help="finishing threads at once, comma-separated counts")
    ap.add_argument("--priorities", default="high", help="the finishing streams': high and/or default")
    ap.add_argument("--no-process", dest="process", action="store_false", help="skip the process rows")
    ap.add_argument("--batch", type=int, default=256, help="images a batch")
    ap.add_argument("--batches", type=int, default=20, help="batches a thread finishes in each timed window")
    ap.add_argument("--load-size", type=int, default=4096, help="the load's square GEMM size")
    ap.add_argument("--load-streams", default="default",
                    help="the load's streams: default (the legacy default stream) and/or own, comma-separated")
    ap.add_argument("--load-kinds", default="gemm", help="the load's kernels: gemm and/or sleep, comma-separated")
    ap.add_argument("--sleep-ms", type=float, default=40.0, help="the length of each sleep kernel (ms)")
    ap.add_argument("--profile-calls", action="store_true",
                    help="the CUDA calls a batch makes in each one-thread case, alone and beside the load")
    ap.add_argument("--hardware-queues", type=int, default=None,
                    help="CUDA_DEVICE_MAX_CONNECTIONS, 1-32 (default: the environment's, else 32, the trainer's)")
    ap.add_argument("--out", default=os.environ.get("OUT", "./device_out"))
    args = ap.parse_args(argv)
    try:
        decoders = parse_decoders(args.decoders)
    except ValueError as e:
        ap.error(str(e))
    threads = [t for t in args.threads.split(",") if t]
    if not threads or not all(t.isdigit() and int(t) >= 1 for t in threads):
        ap.error(f"--threads {args.threads}: counts of at least 1, comma-separated")
    priorities = [p for p in args.priorities.split(",") if p]
    if not priorities or set(priorities) - set(PRIORITIES):
        ap.error(f"--priorities {args.priorities}: each of {', '.join(PRIORITIES)}")
    load_streams = [s for s in args.load_streams.split(",") if s]
    if not load_streams or set(load_streams) - set(LOAD_STREAMS):
        ap.error(f"--load-streams {args.load_streams}: each of {', '.join(LOAD_STREAMS)}")
    load_kinds = [k for k in args.load_kinds.split(",") if k]
    if not load_kinds or set(load_kinds) - set(LOAD_KINDS):
        ap.error(f"--load-kinds {args.load_kinds}: each of {', '.join(LOAD_KINDS)}")
    for flag, value, least in (("--batch", args.batch, 1), ("--batches", args.batches, 1),
                               ("--load-size", args.load_size, 256), ("--sleep-ms", args.sleep_ms, 1)):
        if value < least:
            ap.error(f"{flag} {value}: at least {least}")
    if not Path(args.root).is_dir():
        ap.error(f"--root {args.root}: not a folder (make one: python -m benchmarks.bench_data make --root DIR)")
    try:
        queues = hardware_queues(args.hardware_queues)
    except ValueError as e:
        ap.error(str(e))
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = str(queues)  # before this process's CUDA context; the child inherits it
    import torch

    if not torch.cuda.is_available():
        ap.error("no CUDA device: the GPU half runs on a GPU")
    from benchmarks import measure
    from dres.data.decode import gpu_decode_backend

    batches = prepared_batches(args.root, args.batch, 4, pin=True)
    rows = []
    for kind, load_stream in ((k, s) for k in load_kinds for s in load_streams):
        load = GpuLoad(args.load_size, load_stream, kind, args.sleep_ms)
        with load:
            time.sleep(2)
        load_alone = load.rate
        for decoder, share in decoders:
            for priority in priorities:
                high = PRIORITIES[priority]
                cases = [("thread", int(t)) for t in threads] + ([("process", 1)] if args.process else [])
                for where, count in cases:
                    row = {"decoder": decoder, "share": share if decoder != "torchvision" else None,
                           "load": kind, "load_stream": load_stream, "priority": priority, "where": where,
                           "threads": count}
                    try:
                        if gpu_decode_backend("cuda", decoder) != decoder:
                            raise RuntimeError(f"{decoder} is not installed")
                        calls = {}
                        if where == "thread":
                            alone, beside, calls = thread_case(batches, load, decoder, share, high, count,
                                                               args.batches, args.profile_calls and count == 1)
                        else:
                            alone, beside = process_case(args, load, decoder, share, high)
                        row.update(ms_alone=alone, ms_beside=beside, load_rate_alone=load_alone,
                                   load_rate_beside=load.rate, **calls)
                    except Exception as e:  # one case's failure is its row; the others go on
                        row["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
                    rows.append(row)
                    print(json.dumps({k: v for k, v in row.items() if not k.startswith("calls_")}), flush=True)
    images = statistics.median(len(b["labels"]) for b in batches)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    card = measure.card_name()
    measure.write_json_atomic(out / "decode_beside.json", {
        "card": card, "date": measure.today(), **measure.versions(), "batch": args.batch,
        "load_size": args.load_size, "sleep_ms": args.sleep_ms, "batches_a_window": args.batches,
        "hardware_queues": queues, "rows": rows})
    table = markdown(rows, card, int(images), args.load_size, args.sleep_ms, queues)
    if args.profile_calls:
        table += "\n" + calls_markdown(rows)
    (out / "decode_beside.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
