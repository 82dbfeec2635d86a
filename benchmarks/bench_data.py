"""Real images at the GPU's rate: an ImageNet-like JPEG folder made on the machine, then the loaders alone and
the trainers from it against the same trainers on synthetic data, each with every core and with the process
held to fewer cores (``taskset``, which its DataLoader workers inherit).

    python -m benchmarks.bench_data make --root DIR [--images 20000 --classes 100]
    python -m benchmarks.bench_data loader --root DIR --decode gpu --workers 4
    python -m benchmarks.bench_data all --root DIR [--cores 16,4] [--shards] [--out OUT]
        [--gpus 2] [--first-core 32] [--trainer-set compile_scope=model] [--no-decoders]
        [--variant finish_ahead=0 --variant hw_decode_load=1,num_workers=8]
    python -m benchmarks.bench_data matrix --root DIR [--devices 0,1,2,3] [--cores 4,8,16] [--steps 80]
        [--trainers mae_vit_b16_baseline,resnet50d_224] [--variant decode=gpu,gpu_decoder=nvimgcodec ...]
        [--all-variants-for mae_vit_b16_baseline] [--ddp mae_vit_b16_baseline:8] [--budget-s 450] [--out OUT]

``--gpus N`` runs every trainer as DDP on N GPUs (``dres.train.launch``), 256 images a GPU, and ``--cores``
then counts cores a GPU (the workers' count is a rank's). Every ``taskset`` range starts at ``--first-core``:
two runs on one host, given their GPUs by ``CUDA_VISIBLE_DEVICES``, are held to disjoint cores that way (the GPU
half alone runs in this process: ``--no-decoders``, or ``taskset`` on the whole command).

The folder is like ImageNet's train split: landscape and portrait photos of 500 x 375 / 333 mostly, some of
other sizes, JPEG quality 90 at about ImageNet's mean file size, 1% greyscale, 0.2% CMYK and 0.1% PNGs named
.JPEG (as ImageNet has), 2% progressive. ``all`` writes ``data.json`` and ``data.md`` under OUT: each installed
GPU decoder's own rate (torchvision, nvImageCodec, libnvjpeg: the training process's half alone, on batches read
once, with what one batch made the host wait for: :func:`host_waits`), each loader's images/s, and each
trainer's steady-state images/s from files over its rate on synthetic data (with the largest ``--cores``, the
same GPUs and ``--trainer-set`` overrides). Each ``--variant`` (data settings, comma-separated) adds the loader
and trainer rows from files once more with those settings: the levers side by side in one run.

``matrix`` runs trainers only, several at once, each on its own GPU of ``--devices`` (``CUDA_VISIBLE_DEVICES``)
and held to its own cores (``taskset``: the cores from ``--first-core`` on are split into one block a GPU, and a
run takes ``--cores`` of each of its GPUs' blocks): each trainer on synthetic data (the most cores), then from
the folder at each core count with each ``--variant`` (default :data:`MATRIX_VARIANTS`: the CPU decode, the GPU
decode (with the CPU share its cores give it: ``data.cpu_decode_share=-1``), the GPU decode with its streams at the
default priority, nvImageCodec where installed; the trainers not
in ``--all-variants-for`` take the first two), and ``--ddp TRAINER:CORES`` from the folder on two GPUs with
CORES each (the product's default decode), which the table puts over twice one GPU's synthetic rate. It prints
its plan's time first; a run that would start past ``--budget-s`` is left out (a row that says so). Each row is
written as it ends to ``OUT/data_matrix/ROW.json`` (with the run's ``[dres] data:`` lines: the decode it took
and where each epoch's images were decoded), all of them to ``data_matrix.json`` and the table to
``data_matrix.md``, with the fastest decode at each core count beside the one ``data.decode=auto`` takes
(:func:`fastest_decodes`).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import Pool
from pathlib import Path

import numpy as np

from dres.data.decode import gpu_decoder_installed
from dres.data.factory import GPU_DECODE_WORKERS

# (preset, task, model sets): the trainers measured from files; batch and steps set per run
TRAINERS = {
    "mae_vit_b16_baseline": ("mae_vit_b16_in1k", "mae", ["model.variant=baseline"]),
    "mae_vit_b16_official": ("mae_vit_b16_in1k", "mae", ["model.variant=official"]),
    "resnet50d_224": ("classify_resnet50d_cifar10_timm224", "classify", ["model.num_classes=100"]),
}


# matrix's rows from files a trainer takes (data.* settings), beside its synthetic row: the CPU decode, the GPU
# decode, the GPU decode's streams at the default priority, nvImageCodec (left out where not installed)
MATRIX_VARIANTS = ("decode=cpu", "decode=gpu", "decode=gpu,finish_high_priority=false",
                   "decode=gpu,gpu_decoder=nvimgcodec")
# seconds a matrix run is planned at: start, a cold compile (about a minute) and 300 steps; the plan's estimate only
RUN_PLAN_S = 100


def encode(pixels: np.ndarray, kind: str) -> bytes:
    """(H, W, 3) uint8 pixels as a file of one of ImageNet's kinds: ``jpeg``, ``progressive``, ``grey`` and
    ``cmyk`` JPEGs (quality 90), or ``png``."""
    from PIL import Image

    im = Image.fromarray(pixels)
    buf = io.BytesIO()
    if kind == "png":
        im.save(buf, "PNG")
    else:
        im = im.convert({"grey": "L", "cmyk": "CMYK"}.get(kind, "RGB"))
        im.save(buf, "JPEG", quality=90, progressive=kind == "progressive")
    return buf.getvalue()


def _image(args):
    """One ImageNet-like file: smooth colour fields with texture, JPEG q90 (or the listed odd kinds)."""
    path, seed, kind = args
    from PIL import Image

    rng = np.random.default_rng(seed)
    w, h = [(500, 375), (500, 333), (375, 500), (333, 500)][rng.integers(4)] if rng.random() < 0.9 else \
        tuple(int(v) for v in rng.integers(150, 800, 2))
    low = rng.uniform(0, 255, (max(h // 24, 2), max(w // 24, 2), 3)).astype(np.uint8)
    base = np.asarray(Image.fromarray(low).resize((w, h), Image.BICUBIC), dtype=np.float32)
    pixels = np.clip(base + rng.normal(0, 22, (h, w, 3)), 0, 255).astype(np.uint8)
    data = encode(pixels, kind)
    Path(path).write_bytes(data)
    return len(data)


def make_folder(root: str, images: int, classes: int, procs: int | None = None) -> dict:
    """An ImageNet-layout folder ``root/<class>/<name>.JPEG`` of ``images`` files (module doc); returns its stats."""
    rng = np.random.default_rng(0)
    kinds = rng.choice(["jpeg", "grey", "cmyk", "png", "progressive"], images, p=[0.967, 0.01, 0.002, 0.001, 0.02])
    jobs = []
    for i in range(images):
        folder = Path(root) / f"n{i % classes:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        jobs.append((str(folder / f"img_{i:07d}.JPEG"), i, str(kinds[i])))
    with Pool(procs or os.cpu_count()) as pool:
        sizes = pool.map(_image, jobs, chunksize=64)
    return {"images": images, "classes": classes, "mean_kib": float(np.mean(sizes)) / 1024,
            "kinds": {str(k): int((kinds == k).sum()) for k in np.unique(kinds)}}


def _data_config(root: str, decode: str, workers: int, size: int = 224, sets=()):
    """The folder ``root``, or shards where ``root`` holds a ``manifest.json`` (``dres-prep``'s output); ``sets``:
    more data settings, ``KEY=VALUE``."""
    from dres.train.config import DataConfig, parse_override, set_key

    shards = (Path(root) / "manifest.json").is_file()
    cfg = DataConfig(name="wds" if shards else "imagefolder", path=root, img_size=size, num_classes=1000,
                     gpu_resident=False, decode=decode, num_workers=workers, crop_min=0.2, cpu_decode_share=0.0)
    for kv in sets:
        set_key(cfg, *parse_override(kv), prefix="data.")
    return cfg


def loader_rate(root: str, decode: str, workers: int, batch: int = 256, warmup: int = 10, batches: int = 40,
                sets=()) -> dict:
    """Images/s of the file loader alone (batches made on the GPU and waited for), after ``warmup`` batches and at
    least the loader's ``batches_ahead``; over ``batches`` batches and at least four a worker. The workers start
    together and hand over their first batches at once: a window that began among them would read high."""
    import torch

    from dres.data import build_loader, decode_backend

    cfg = _data_config(root, decode, workers, sets=sets)
    loader = build_loader(cfg, "train", batch, device="cuda", seed=0)
    warmup, batches = max(warmup, loader.batches_ahead), max(batches, 4 * loader.num_workers)
    for _ in range(warmup):
        loader.next()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n = 0
    for _ in range(batches):
        n += len(loader.next()["label"])
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return {"kind": "loader", "source": cfg.name, "decode": decode, "backend": decode_backend(cfg, "cuda"),
            "workers": cfg.num_workers, "batch": batch, "warmup": warmup, "batches": batches,
            "images_per_s": n / seconds,
            "decoded": loader.decoded, "variant": list(sets)}


# The runtime and driver calls that hold the host until the GPU catches up: the explicit waits, and the frees,
# which wait for the whole device (a library freeing its buffers every call waits for the running step)
HOST_WAITS = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cuEventSynchronize",
              "cuStreamSynchronize", "cuCtxSynchronize", "cudaFree", "cudaFreeHost", "cuMemFree_v2", "cuMemFreeHost")


def host_waits(fn) -> dict:
    """What one call of ``fn`` made the host wait for the GPU: the runtime's synchronising calls counted, whoever
    made them (PyTorch, a decoder library, the caching allocator), and the synchronising PyTorch operations among
    them by the Python line that ran each (torch.cuda's sync debug mode; a library's own waits have no line)."""
    import warnings

    import torch
    from torch.profiler import ProfilerActivity, profile

    def runtime_waits(call) -> Counter:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            call()
        return Counter({e.key: e.count for e in prof.key_averages() if e.key in HOST_WAITS})

    counts = dict(runtime_waits(fn) - runtime_waits(lambda: None))  # less the profiler's own
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return {"runtime_calls": counts, "torch_lines": sync_sites(caught)}


def finishing_times(data_lines: list) -> str:
    """The last epoch line's time to finish a batch, its GPU decode call's share and the finishing thread's CPU
    time, as a table cell's clause ('' where no epoch ended with the GPU decoding)."""
    found = [m for m in (re.search(r"a batch finished in ([\d.]+) ms, ([\d.]+) of them in the GPU decode call, "
                                   r"([\d.]+) on the finishing thread's CPU", line) for line in data_lines) if m]
    return (f"; a batch finished in {found[-1][1]} ms, {found[-1][2]} of them in the decode call, {found[-1][3]} on "
            "the thread's CPU" if found else "")


def sync_sites(caught: list) -> dict:
    """The five lines that warned most often of a synchronising operation, with their counts, among the
    warnings sync debug mode raised; the mode's own "prototype feature" notice, warned where the mode is set,
    is no synchronisation."""
    sites = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught
                    if "synchroniz" in str(w.message) and "prototype" not in str(w.message))
    return dict(sites.most_common(5))


# the finisher the trainers from files build (ImageNet's mean and std, 224 px)
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def prepared_batches(root: str, batch: int, count: int, pin: bool = False) -> list[dict]:
    """The folder's first ``count`` batches of ``batch`` files (as many whole ones as it holds, at least one) as the
    GPU-decode workers hand them to the training process (JPEG bytes with their crop boxes; what the GPU cannot
    decode as pixels), read once; in pinned memory with ``pin``, as the trainers' DataLoader gives them."""
    from dres.data.decode import SamplePrep, collate_prepared, prepare
    from dres.data.sources import list_image_folder

    paths, labels, _ = list_image_folder(root)
    count = max(1, min(count, len(paths) // batch))
    prep = SamplePrep(224, 3, "rrc_flip", 0.2, gpu=True)
    batches = [collate_prepared([prepare(prep, Path(p).read_bytes(), i, y, p)
                                 for i, (p, y) in enumerate(zip(paths[k * batch:(k + 1) * batch],
                                                                labels[k * batch:(k + 1) * batch]))])
               for k in range(count)]
    if pin:
        batches = [{k: v.pin_memory() if hasattr(v, "pin_memory") else v for k, v in b.items()} for b in batches]
    return batches


def decoder_rate(root: str, backend: str, batch: int = 256, batches: int = 20, hw_load: float = 0.65) -> dict:
    """Images/s of the training process's half alone (GPU decode, crop-resize kernel, order) on batches of
    the folder read and prepared once: the GPU decoder's own limit, with no worker in the way."""
    import torch

    from dres.data.decode import BatchFinisher

    prepared = prepared_batches(root, batch, 4)
    finisher = BatchFinisher("cuda", 224, 3, IMAGENET_MEAN, IMAGENET_STD, backend, hw_load)
    for b in prepared:
        finisher(b, [])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n = 0
    for k in range(batches):
        n += len(finisher(prepared[k % len(prepared)], [])["label"])
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    # the decode call alone, the rest of the GPU half (crop kernel, order) being the difference
    encoded = [prepared[0]["jpeg_bytes"][s:s + n] for s, n in zip(
        np.cumsum([0] + prepared[0]["jpeg_lengths"].tolist()[:-1]).tolist(), prepared[0]["jpeg_lengths"].tolist())]
    finisher._decode(encoded)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    for _ in range(batches):
        finisher._decode(encoded)
    torch.cuda.synchronize()
    decode_only = batches * len(encoded) / (time.perf_counter() - t1)
    return {"kind": "decoder", "backend": backend, "hw_load": hw_load if backend == "nvimgcodec" else None,
            "batch": batch, "images_per_s": n / seconds, "decode_call_images_per_s": decode_only,
            "host_waits_a_batch": host_waits(lambda: finisher(prepared[0], []))}


def core_range(first_core: int, cores: int) -> str:
    """``taskset -c``'s list of ``cores`` cores from ``first_core`` on."""
    return f"{first_core}-{first_core + cores - 1}"


def trainer_command(name: str, data: list[str], cores: int, first_core: int, gpus: int, steps: int, batch: int,
                    out: str, overrides: list[str], cpus: str | None = None) -> list[str]:
    """The trainer run of :data:`TRAINERS` ``name`` on ``gpus`` GPUs (one process, or DDP through
    ``dres.train.launch``), ``batch`` images a GPU, held to ``cores`` cores a GPU from ``first_core`` on (or to
    ``cpus``, a ``taskset -c`` list); ``overrides`` come last and so win."""
    from benchmarks.trainer_runs import TRAINER_EVAL_OFF

    preset, task, model_sets = TRAINERS[name]
    launcher = ["-m", "dres.train.launch", "--standalone", "--nproc_per_node", str(gpus)] if gpus > 1 else []
    cmd = ["taskset", "-c", cpus or core_range(first_core, cores * gpus), sys.executable, *launcher, "-m",
           f"dres.train.{task}", "--preset", preset, "--out", out]
    for kv in [*model_sets, *data, f"dist={'ddp' if gpus > 1 else 'none'}", f"batch_size={batch * gpus}",
               f"steps={steps}", "log.every=10", "log.progress=false", "log.tensorboard=false", "ckpt.every=0",
               *TRAINER_EVAL_OFF, *overrides]:
        cmd += ["--set", kv]
    return cmd


def trainer_rate(name: str, data: list[str], cores: int, first_core: int, gpus: int, steps: int, batch: int,
                 overrides: list[str], timeout_s: float = 300, cpus: str | None = None,
                 devices: str | None = None) -> dict:
    """Steady-state images/s of a trainer run (:func:`trainer_command`), timed after the warm-up and after the
    batches its loader made ahead meanwhile (:func:`batches_made_ahead`); ``batch`` is a GPU's; ``devices``: its
    ``CUDA_VISIBLE_DEVICES``. The row keeps the run's ``[dres] data:`` lines and, from its metrics, the host's
    wait for batches a step and the captured step's GPU time (``steady_state_waits``): a decode too slow for the
    step shows in the first, one that slows the step's kernels in the second."""
    from benchmarks.train_distributed import NCCL_ENV
    from benchmarks.trainer_runs import steady_state_rate, steady_state_waits

    row = {"kind": "trainer", "name": name, "data": data, "cores": cores, "gpus": gpus, "overrides": overrides}
    env = dict(os.environ, **NCCL_ENV, **({"CUDA_VISIBLE_DEVICES": devices} if devices is not None else {}))
    with tempfile.TemporaryDirectory(prefix="dres-data-") as out:
        cmd = trainer_command(name, data, cores, first_core, gpus, steps, batch, out, overrides, cpus)
        t0 = time.time()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            # SIGTERM, which torchrun passes on to the ranks and waits for: a SIGKILL would leave them on the GPUs
            proc.terminate()
            try:
                proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
            return {**row, "error": f"over {timeout_s} s"}
        if proc.returncode != 0:
            return {**row, "error": stderr[-2000:]}
        with open(Path(out) / "metrics.jsonl") as f:
            metrics = [json.loads(line) for line in f if line.strip()]
    data_lines = [line for line in stdout.splitlines() if line.startswith("[dres] data:")]
    ahead = batches_made_ahead(data_lines)
    try:
        ips, timed = steady_state_rate(metrics, batch * gpus, buffered=ahead)
    except ValueError as e:  # too few steps to time past the loader's buffer: a row that says so
        return {**row, "error": str(e)}
    return {**row, "batch": batch, "images_per_s": ips, "steps_timed": timed, "batches_ahead": ahead,
            **steady_state_waits(metrics, buffered=ahead), "wall_s": time.time() - t0, "data_lines": data_lines}


def batches_made_ahead(data_lines: list[str]) -> int:
    """The most batches the run's loader made ahead of the step, as its data line says (0 where none does: the
    data in memory); they fill while the step compiles, and the timed window starts after the step has taken
    them (``steady_state_rate``'s ``buffered``)."""
    found = [int(m[1]) for m in (re.search(r"up to (\d+) batches made ahead of the step", line)
                                 for line in data_lines) if m]
    return max(found, default=0)


def run_all(args) -> list[dict]:
    from dres.data.decode import GPU_DECODERS, gpu_decode_backend

    rows = []
    backends = [b for b in GPU_DECODERS if gpu_decode_backend("cuda", b) == b] if args.decoders else []
    for backend in backends:
        for hw_load in (args.hw_loads if backend == "nvimgcodec" else [0.0]):
            rows.append(decoder_rate(args.root, backend, hw_load=hw_load))
            print(json.dumps(rows[-1]), flush=True)
    if args.loaders:
        _loader_rows(args, rows)
    _trainer_rows(args, rows)
    print("gpu decoder:", gpu_decode_backend("cuda"))
    return rows


def _loader_rows(args, rows):
    for root, variant, cores in ((r, v, c) for r in args.sources for v in args.variants for c in args.cores):
        for decode in args.loader_decodes:
            workers = min(cores, args.gpu_workers) if decode == "gpu" else cores
            rows.append({**_in_subprocess_loader(root, decode, workers, cores, args.first_core,
                                                 [*args.data_sets, *variant]),
                         "cores": cores})
            print(json.dumps(rows[-1]), flush=True)


def _trainer_rows(args, rows):
    sources = [[f"data.path={root}", f"data.name={'wds' if root != args.root else 'imagefolder'}",
                "data.num_classes=100", "data.gpu_resident=false", *[f"data.{kv}" for kv in args.data_sets]]
               for root in args.sources]
    run = dict(first_core=args.first_core, gpus=args.gpus, steps=args.steps, batch=256, overrides=args.trainer_sets,
               timeout_s=args.trainer_timeout)
    for name in args.trainers:
        rows.append(trainer_rate(name, ["data.name=synthetic", "data.num_classes=100"], max(args.cores), **run))
        print(json.dumps(rows[-1]), flush=True)
        for files, variant, cores, decode in ((f, v, c, d) for f in sources for v in args.variants
                                              for c in args.cores for d in args.trainer_decodes):
            # the workers the product gives a decode (dres.data.factory.loader_workers: per rank, by the cores it
            # has), but the GPU decode's --gpu-workers that only read bytes where the variant asks for no CPU share;
            # auto: the trainer's own choice of decode, share and workers
            reads_bytes = decode == "gpu" and not any(kv.startswith("cpu_decode_share=") for kv in variant)
            bytes_only = ["data.cpu_decode_share=0", f"data.num_workers={min(cores, args.gpu_workers)}"]
            data = files + [f"data.decode={decode}", *(bytes_only if reads_bytes else []),
                            *[f"data.{kv}" for kv in variant]]
            rows.append({**trainer_rate(name, data, cores, **run), "variant": variant})
            print(json.dumps(rows[-1]), flush=True)


def matrix_jobs(args) -> list[dict]:
    """matrix's runs (module doc), each ``{"name", "data", "cores", "gpus", "variant"}``: the DDP runs first (they
    need two GPUs free at once), then the trainers' runs in turn, each trainer's synthetic run first and its runs
    from the folder by falling cores (a trainer's first runs compile it cold: with the most cores)."""
    from itertools import chain, zip_longest

    files = [f"data.path={args.root}", "data.name=imagefolder", "data.num_classes=100", "data.gpu_resident=false"]
    jobs = [{"name": name, "data": [*files, "data.decode=auto"], "cores": cores, "gpus": 2, "variant": [],
             "against_one_gpu": True} for name, cores in args.ddp]
    each = []
    for name in args.trainers:
        variants = args.variants if name in args.all_variants_for else args.variants[:2]
        each.append([{"name": name, "data": ["data.name=synthetic", "data.num_classes=100"],
                      "cores": max(args.cores), "gpus": 1, "variant": []}] +
                    [{"name": name, "data": [*files, *[f"data.{kv}" for kv in variant]], "cores": cores, "gpus": 1,
                      "variant": variant} for cores in sorted(args.cores, reverse=True) for variant in variants])
    return jobs + [job for job in chain.from_iterable(zip_longest(*each)) if job is not None]


def matrix_plan_s(jobs: list[dict], gpus: int) -> float:
    """The seconds the matrix is planned to take: every run's :data:`RUN_PLAN_S` on each of its GPUs, spread over
    ``gpus``."""
    return sum(RUN_PLAN_S * job["gpus"] for job in jobs) / gpus


class _Devices:
    """The GPUs of a matrix, handed to its runs: a run waits until as many as it needs are free and takes the lowest,
    each with its block of cores."""

    def __init__(self, devices: list[int], first_core: int, block: int):
        self.free, self.first_core, self.block = list(range(len(devices))), first_core, block
        self.devices = devices
        self.ready = threading.Condition()

    def take(self, n: int) -> list[int]:
        with self.ready:
            self.ready.wait_for(lambda: len(self.free) >= n)
            taken, self.free = self.free[:n], self.free[n:]
            return taken

    def give_back(self, slots: list[int]):
        with self.ready:
            self.free = sorted(self.free + slots)
            self.ready.notify_all()

    def cpus(self, slots: list[int], cores: int) -> str:
        """The ``taskset -c`` list of ``cores`` cores of each slot's block."""
        return ",".join(core_range(self.first_core + k * self.block, cores) for k in slots)


def run_matrix(args, jobs: list[dict], on_row) -> list[dict]:
    """The matrix's runs, as many at once as GPUs are free, in ``jobs``' order; ``on_row(row)`` as each ends."""
    pool = _Devices(args.devices, args.first_core, args.block)
    start = time.time()

    def run(job):
        slots = pool.take(job["gpus"])
        elapsed = time.time() - start
        row = {"kind": "trainer", "name": job["name"], "data": job["data"], "cores": job["cores"], "gpus": job["gpus"],
               "overrides": args.trainer_sets, "variant": job["variant"],
               "against_one_gpu": job.get("against_one_gpu", False)}
        try:
            if elapsed + RUN_PLAN_S > args.budget_s:
                row["error"] = f"not started: past --budget-s {args.budget_s:g} at {elapsed:.0f} s"
            else:
                row.update(trainer_rate(job["name"], job["data"], job["cores"], 0, job["gpus"], args.steps, 256,
                                        args.trainer_sets, min(args.trainer_timeout, args.budget_s - elapsed),
                                        cpus=pool.cpus(slots, job["cores"]),
                                        devices=",".join(args.devices[k] for k in slots)))
        except Exception as e:  # a run that left no rate (no metrics, too few steps) is a row that says why
            row["error"] = f"{type(e).__name__}: {e}"
        finally:
            pool.give_back(slots)
        on_row(row)
        return row

    with ThreadPoolExecutor(len(args.devices)) as runs:
        return list(runs.map(run, jobs))


def _slug(row: dict) -> str:
    """A row's file name: trainer, GPUs, cores and what it read."""
    data = dict(kv.split("=", 1) for kv in row["data"])
    what = [data.get("data.name", "")] + [kv.replace("=", "-") for kv in row.get("variant", [])]
    return re.sub(r"[^\w.-]+", "_", "-".join([row["name"], f"{row['gpus']}gpu", f"{row['cores']}cores", *what]))


def loader_command(root: str, decode: str, workers: int, cores: int, first_core: int, sets=()) -> list[str]:
    """:func:`loader_rate` in a fresh process held to ``cores`` cores from ``first_core`` on."""
    return ["taskset", "-c", core_range(first_core, cores), sys.executable, "-m", "benchmarks.bench_data", "loader",
            "--root", root, "--decode", decode, "--workers", str(workers), *[a for kv in sets for a in ("--set", kv)]]


def _in_subprocess_loader(root, decode, workers, cores, first_core, sets=()) -> dict:
    proc = subprocess.run(loader_command(root, decode, workers, cores, first_core, sets), capture_output=True,
                          text=True)
    if proc.returncode != 0:
        return {"kind": "loader", "source": _data_config(root, decode, workers).name, "decode": decode,
                "workers": workers, "variant": list(sets), "error": proc.stderr[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _trainer_key(row: dict) -> tuple:
    """What a trainer row from files shares with its synthetic row: trainer, GPUs and overrides."""
    return row["name"], row.get("gpus", 1), tuple(row.get("overrides", []))


def error_line(error: str) -> str:
    """The line of a failed run's stderr that says what failed: the last exception with a message, else the last
    line (torchrun's report of a failed rank ends in rules and fields below the rank's own exception)."""
    lines = [line.strip() for line in error.splitlines() if line.strip()] or ["no message"]
    return next((line for line in reversed(lines) if re.search(r"\w(Error|Exception): \S", line)), lines[-1])


def markdown(rows: list[dict], card: str) -> str:
    """The loaders' and trainers' table: each trainer row over the same trainer on synthetic data with the same
    GPUs and overrides; a failed row shows what failed."""
    synthetic = {_trainer_key(r): r["images_per_s"] for r in rows
                 if r["kind"] == "trainer" and "data.name=synthetic" in r["data"] and "images_per_s" in r}
    lines = [f"Card: {card}", "", "| what | decode | gpus | cores a GPU | workers a GPU | img/s | vs synthetic |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] == "decoder":
            hw = f", hardware share {r['hw_load']}" if r.get("hw_load") is not None else ""
            waits = r.get("host_waits_a_batch", {}).get("runtime_calls", {})
            waited = "".join(f"; {n} {call} a batch" for call, n in sorted(waits.items()))
            lines.append(f"| GPU half alone ({r['backend']}{hw}; the decode call alone "
                         f"{r['decode_call_images_per_s']:,.0f}{waited}) | gpu | 1 | | | {r['images_per_s']:,.0f} | |")
            continue
        if r["kind"] == "prep":
            lines.append(f"| dres-prep, shorter side {r['short_side']} ({r['mean_kib']:.1f} KiB an image, "
                         f"{r['seconds']:.0f} s) | | | all | | {r['images'] / r['seconds']:,.0f} | |")
            continue
        variant = "".join(f"; {kv}" for kv in r.get("variant", []))
        if r["kind"] == "loader":
            backend = f" ({r['backend'] or 'cpu'}{variant})" if "backend" in r else f" ({variant[2:]})" if variant else ""
            cells = [f"loader {r.get('source', 'imagefolder')}{backend}", r["decode"], 1, r["cores"], r["workers"]]
        else:
            data = dict(kv.split("=", 1) for kv in r["data"])
            sets = "".join(f"; {kv}" for kv in r.get("overrides", [])) + variant
            waits = "".join(f"; {what} {r[key]:.1f} ms a step" for key, what in
                            (("data_ms", "waits for data"), ("gpu_ms_per_step", "step's GPU time")) if key in r)
            waits += finishing_times(r.get("data_lines", []))
            waits += f"; timed after its {r['batches_ahead']} batches made ahead" if r.get("batches_ahead") else ""
            cells = [f"trainer {r['name']} ({data.get('data.name')}{sets}{waits})", data.get("data.decode", ""),
                     r.get("gpus", 1), r["cores"] or "all", data.get("data.num_workers", "by the decode")]
        if "error" in r:
            cells += ["failed: " + error_line(r["error"]).replace("|", "\\|"), ""]
        elif r.get("against_one_gpu"):  # over the GPUs' count times the same trainer's rate on one GPU
            one = synthetic.get((r["name"], 1, tuple(r.get("overrides", []))))
            cells += [f"{r['images_per_s']:,.0f}",
                      f"{r['images_per_s'] / (one * r['gpus']):.2f}x of {r['gpus']} x one GPU's" if one else ""]
        else:
            baseline = synthetic.get(_trainer_key(r)) if r["kind"] == "trainer" else None
            cells += [f"{r['images_per_s']:,.0f}", f"{r['images_per_s'] / baseline:.2f}x" if baseline else ""]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def fastest_decodes(rows: list[dict]) -> str:
    """The matrix's second table: for each trainer and core count on one GPU, the fastest of its runs from files
    (its variant) beside the decode ``data.decode=auto`` takes there with the workers by the decode
    (``dres.data.factory.CPU_DECODE_MIN_CORES``, and a GPU decode's CPU share, ``auto_cpu_decode_share``): where they
    differ, the constant is the one to change."""
    from dres.data.factory import CPU_DECODE_MIN_CORES, auto_cpu_decode_share

    def auto(cores: int) -> str:
        if cores >= CPU_DECODE_MIN_CORES:
            return "decode=cpu"
        share = auto_cpu_decode_share(cores)
        return f"decode=gpu; cpu_decode_share={share:g}" if share else "decode=gpu"

    best = {}
    for r in rows:
        if (r["kind"] != "trainer" or r.get("gpus", 1) != 1 or "images_per_s" not in r
                or "data.name=synthetic" in r["data"]):
            continue
        key = (r["name"], r["cores"])
        if key not in best or r["images_per_s"] > best[key][1]:
            best[key] = ("; ".join(r.get("variant", [])), r["images_per_s"])
    lines = ["| trainer | cores a GPU | fastest from files | img/s | auto takes |", "|---|---|---|---|---|"]
    lines += [f"| {name} | {cores} | {what} | {ips:,.0f} | {auto(cores)} |"
              for (name, cores), (what, ips) in sorted(best.items())]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("make", "loader", "all", "matrix"))
    ap.add_argument("--root", required=True)
    ap.add_argument("--images", type=int, default=20000)
    ap.add_argument("--classes", type=int, default=100)
    ap.add_argument("--decode", choices=("cpu", "gpu"), default="gpu")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--cores", help="comma-separated core counts a GPU (taskset); default: every core from "
                    "--first-core on shared by the GPUs, and 4")
    ap.add_argument("--first-core", type=int, default=0, help="the first core of every taskset range")
    ap.add_argument("--gpus", type=int, default=1, help="GPUs a trainer runs on (DDP where more than one)")
    ap.add_argument("--trainers", help="comma-separated (default: all: mae_vit_b16_baseline,mae_vit_b16_official,"
                    "resnet50d_224; matrix: mae_vit_b16_baseline,resnet50d_224)")
    ap.add_argument("--trainer-decodes", default="gpu,cpu",
                    help="decodes of the trainer rows from files: cpu, gpu, auto (the trainer's own choice)")
    ap.add_argument("--loader-decodes", default="gpu,cpu", help="the decodes of the loader-alone rows")
    ap.add_argument("--gpu-workers", type=int, default=GPU_DECODE_WORKERS,
                    help="DataLoader workers of the GPU-decode rows, which then read bytes only (no CPU share; at "
                         "most the cores; the loader rows' CPU decode: every core; the trainer rows' CPU decode, "
                         "and their GPU decode with a variant's cpu_decode_share: the trainer's own count)")
    ap.add_argument("--steps", type=int, default=300,
                    help="a trainer run's steps: 10 of warm-up, as many as its loader makes ahead (up to 63 at 16 "
                         "cores), then the timed ones")
    ap.add_argument("--devices", help="matrix: the GPUs its runs share, one run a GPU at a time, as "
                    "CUDA_VISIBLE_DEVICES names them (default: every GPU this process sees)")
    ap.add_argument("--all-variants-for", default="mae_vit_b16_baseline",
                    help="matrix: the trainers run with every --variant (the others: the first two)")
    ap.add_argument("--ddp", default="mae_vit_b16_baseline:8",
                    help="matrix: TRAINER:CORES,... runs on two GPUs with CORES cores each ('' for none)")
    ap.add_argument("--budget-s", type=float, default=450,
                    help="matrix: seconds after which no run starts, and by which every run is cut")
    ap.add_argument("--trainer-timeout", type=float, default=300, help="seconds a trainer run may take")
    ap.add_argument("--trainer-set", dest="trainer_sets", action="append", default=[],
                    help="KEY=VALUE for every trainer run, after the benchmark's own (e.g. compile_scope=model)")
    ap.add_argument("--hw-loads", default="0,0.65,1", help="nvImageCodec hardware shares the GPU half is timed at")
    ap.add_argument("--no-loaders", dest="loaders", action="store_false", help="skip the loader-alone rows")
    ap.add_argument("--no-decoders", dest="decoders", action="store_false", help="skip the GPU-half-alone rows")
    ap.add_argument("--shards", action="store_true",
                    help="also the folder as dres-prep shards (ROOT-shards, made once, timed): loaders and trainers")
    ap.add_argument("--set", dest="data_sets", action="append", default=[],
                    help="KEY=VALUE of data.* for the trainers from files (e.g. hw_decode_load=0.8)")
    ap.add_argument("--variant", dest="variants", action="append", default=None,
                    help="data.* settings, KEY=VALUE comma-separated, of another set of rows from files (the loaders "
                         "and the trainers); repeatable, beside the rows without them")
    ap.add_argument("--out", default=os.environ.get("OUT", "./device_out"))
    args = ap.parse_args(argv)
    if args.what == "make":
        t0 = time.time()
        stats = make_folder(args.root, args.images, args.classes)
        print(json.dumps({**stats, "seconds": time.time() - t0}), flush=True)
        return 0
    if args.what == "loader":
        print(json.dumps(loader_rate(args.root, args.decode, args.workers, sets=args.data_sets)), flush=True)
        return 0
    if args.what == "matrix":
        return matrix_main(ap, args)
    if args.gpus < 1:
        ap.error(f"--gpus {args.gpus}: at least 1")
    if args.gpu_workers < 1:
        ap.error(f"--gpu-workers {args.gpu_workers}: at least 1")
    every_core = (os.cpu_count() - args.first_core) // args.gpus
    args.cores = [int(c) for c in args.cores.split(",") if c] if args.cores else \
        [every_core, 4] if every_core > 4 else [every_core]
    if args.first_core < 0 or min(args.cores) < 1 or args.first_core + max(args.cores) * args.gpus > os.cpu_count():
        ap.error(f"--first-core {args.first_core}, --cores {max(args.cores)} a GPU x --gpus {args.gpus}: not within "
                 f"this machine's cores 0-{os.cpu_count() - 1}")
    args.trainers = _names(ap, "--trainers", args.trainers or "mae_vit_b16_baseline,mae_vit_b16_official,resnet50d_224")
    args.trainer_decodes = [d for d in args.trainer_decodes.split(",") if d]
    if set(args.trainer_decodes) - {"cpu", "gpu", "auto"}:
        ap.error(f"--trainer-decodes {','.join(args.trainer_decodes)}: each of cpu, gpu, auto")
    args.loader_decodes = [d for d in args.loader_decodes.split(",") if d]
    args.hw_loads = [float(v) for v in args.hw_loads.split(",") if v]
    args.variants = [[]] + [[kv for kv in v.split(",") if kv] for v in args.variants or []]
    from benchmarks import measure

    args.sources = [args.root]
    rows = []
    if args.shards:
        from dres.data.prep import prepare_shards

        shards = args.root.rstrip("/") + "-shards"
        t0 = time.time()
        manifest = prepare_shards(args.root, shards, log=lambda m: None)
        rows.append({"kind": "prep", "images": sum(e["samples"] for e in manifest["shards"].values()),
                     "short_side": manifest["short_side"], "seconds": time.time() - t0,
                     "mean_kib": sum(os.path.getsize(Path(shards) / n) for n in manifest["shards"]) / 1024
                     / max(sum(e["samples"] for e in manifest["shards"].values()), 1)})
        print(json.dumps(rows[-1]), flush=True)
        args.sources.append(shards)
    rows += run_all(args)
    card = measure.card_name()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    measure.write_json_atomic(out / "data.json", {"card": card, "date": measure.today(), **measure.versions(),
                                                  "rows": rows})
    table = markdown(rows, card)
    (out / "data.md").write_text(table)
    print(table)
    return 0


def _names(ap, flag: str, value: str) -> list[str]:
    """Comma-separated trainer names, each of :data:`TRAINERS` (else an argument error)."""
    names = [t for t in value.split(",") if t]
    unknown = [t for t in names if t not in TRAINERS]
    if unknown:
        ap.error(f"{flag} {value}: {', '.join(unknown)} not among {', '.join(TRAINERS)}")
    return names


def _visible_gpus() -> str:
    """The GPUs this process sees, as its children's ``CUDA_VISIBLE_DEVICES`` names them."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        return os.environ["CUDA_VISIBLE_DEVICES"]
    import torch

    return ",".join(str(i) for i in range(torch.cuda.device_count()))


def _ints(ap, flag: str, value: str) -> list[int]:
    """Comma-separated integers (else an argument error)."""
    try:
        return [int(v) for v in value.split(",") if v]
    except ValueError:
        ap.error(f"{flag} {value}: comma-separated integers")


def matrix_main(ap, args) -> int:
    """``matrix`` (module doc): its arguments checked, its plan printed, its runs, then its files."""
    from benchmarks import measure

    args.devices = [d for d in (args.devices or _visible_gpus()).split(",") if d]
    args.cores = _ints(ap, "--cores", args.cores or "4,8,16")
    ddp = [kv.partition(":") for kv in args.ddp.split(",") if kv]
    if not all(cores.isdigit() for _, _, cores in ddp):
        ap.error(f"--ddp {args.ddp}: TRAINER:CORES, comma-separated")
    args.ddp = [(name, int(cores)) for name, _, cores in ddp]
    args.trainers = _names(ap, "--trainers", args.trainers or "mae_vit_b16_baseline,resnet50d_224")
    args.all_variants_for = _names(ap, "--all-variants-for", args.all_variants_for)
    _names(ap, "--ddp", ",".join(name for name, _ in args.ddp))
    if not args.devices or len(set(args.devices)) < len(args.devices):
        ap.error(f"--devices {','.join(args.devices)}: distinct GPUs, at least one")
    if args.ddp and len(args.devices) < 2:
        ap.error(f"--ddp needs two of --devices {','.join(args.devices)}")
    args.block = (os.cpu_count() - args.first_core) // len(args.devices)
    most = max([*args.cores, *(cores for _, cores in args.ddp)])
    if args.first_core < 0 or min(args.cores) < 1 or most > args.block:
        ap.error(f"--cores {most} a GPU: more than the {args.block} cores of each of {len(args.devices)} GPUs' blocks "
                 f"from --first-core {args.first_core} on this machine's {os.cpu_count()}")
    variants = [[kv for kv in v.split(",") if kv] for v in (args.variants or MATRIX_VARIANTS)]
    args.variants = [v for v in variants if "gpu_decoder=nvimgcodec" not in v or gpu_decoder_installed("nvimgcodec")]
    jobs = matrix_jobs(args)
    print(f"matrix: {len(jobs)} trainer runs on GPUs {','.join(args.devices)}, {args.block} cores a GPU, "
          f"about {matrix_plan_s(jobs, len(args.devices)) / 60:.1f} min ({RUN_PLAN_S} s a run; none starts past "
          f"{args.budget_s:g} s)" + ("" if len(args.variants) == len(variants) else "; nvImageCodec not installed:"
                                    " its rows left out"), flush=True)
    out = Path(args.out)
    (out / "data_matrix").mkdir(parents=True, exist_ok=True)

    def on_row(row):
        measure.write_json_atomic(out / "data_matrix" / f"{_slug(row)}.json", row)
        print(json.dumps(row), flush=True)

    rows = run_matrix(args, jobs, on_row)
    card = measure.card_name()
    measure.write_json_atomic(out / "data_matrix.json", {"card": card, "date": measure.today(), **measure.versions(),
                                                         "rows": rows})
    table = markdown(rows, card) + "\n" + fastest_decodes(rows)
    (out / "data_matrix.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
