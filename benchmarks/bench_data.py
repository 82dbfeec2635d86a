"""Real images at the GPU's rate: an ImageNet-like JPEG folder made on the machine, then the loaders alone and
the trainers from it against the same trainers on synthetic data, each with every core and with the process
held to fewer cores (``taskset``, which its DataLoader workers inherit).

    python -m benchmarks.bench_data make --root DIR [--images 20000 --classes 100]
    python -m benchmarks.bench_data loader --root DIR --decode gpu --workers 4 [--cores 4]
    python -m benchmarks.bench_data all --root DIR [--cores 16,4] [--shards] [--out OUT]

The folder is like ImageNet's train split: landscape and portrait photos of 500 x 375 / 333 mostly, some of
other sizes, JPEG quality 90 at about ImageNet's mean file size, 1% greyscale, 0.2% CMYK and 0.1% PNGs named
.JPEG (as ImageNet has), 2% progressive. ``all`` writes ``data.json`` and ``data.md`` under OUT: the GPU
decoder's own rate (the training process's half alone, on batches read once), each loader's images/s, and each
trainer's steady-state images/s from files over its rate on synthetic data.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from multiprocessing import Pool
from pathlib import Path

import numpy as np

# (preset, task, overrides): the trainers measured from files; batch and steps set per run
TRAINERS = {
    "mae_vit_b16_baseline": ("mae_vit_b16_in1k", "mae", ["model.variant=baseline"]),
    "mae_vit_b16_official": ("mae_vit_b16_in1k", "mae", ["model.variant=official"]),
    "resnet50d_224": ("classify_resnet50d_cifar10_timm224", "classify", ["model.num_classes=100"]),
}


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


def _data_config(root: str, decode: str, workers: int, size: int = 224):
    """The folder ``root``, or shards where ``root`` holds a ``manifest.json`` (``dres-prep``'s output)."""
    from dres.train.config import DataConfig

    shards = (Path(root) / "manifest.json").is_file()
    return DataConfig(name="wds" if shards else "imagefolder", path=root, img_size=size, num_classes=1000,
                      gpu_resident=False, decode=decode, num_workers=workers, crop_min=0.2)


def loader_rate(root: str, decode: str, workers: int, batch: int = 256, warmup: int = 10, batches: int = 40) -> dict:
    """Images/s of the file loader alone (batches made on the GPU and waited for), after ``warmup`` batches."""
    import torch

    from dres.data import build_loader, decode_backend

    cfg = _data_config(root, decode, workers)
    loader = build_loader(cfg, "train", batch, device="cuda", seed=0)
    for _ in range(warmup):
        loader.next()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n = 0
    for _ in range(batches):
        n += len(loader.next()["label"])
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return {"kind": "loader", "source": cfg.name, "decode": decode, "backend": decode_backend(cfg, "cuda"), "workers": workers,
            "batch": batch, "images_per_s": n / seconds, "gpu_fallbacks": loader.finisher.gpu_fallbacks}


def decoder_rate(root: str, backend: str, batch: int = 256, batches: int = 20, hw_load: float = 0.65) -> dict:
    """Images/s of the training process's half alone (GPU decode, crop-resize kernel, order) on batches of
    the folder read and prepared once: the GPU decoder's own limit, with no worker in the way."""
    import torch

    from dres.data.decode import BatchFinisher, SamplePrep, collate_prepared, prepare
    from dres.data.sources import list_image_folder

    paths, labels, _ = list_image_folder(root)
    prep = SamplePrep(224, 3, "rrc_flip", 0.2, gpu=True)
    prepared = [collate_prepared([prepare(prep, Path(p).read_bytes(), i, y, p)
                                  for i, (p, y) in enumerate(zip(paths[k * batch:(k + 1) * batch],
                                                                 labels[k * batch:(k + 1) * batch]))])
                for k in range(4)]
    finisher = BatchFinisher("cuda", 224, 3, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225], backend, hw_load)
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
            "batch": batch, "images_per_s": n / seconds, "decode_call_images_per_s": decode_only}


def trainer_rate(name: str, data: list[str], cores: int | None, steps: int, batch: int, timeout_s: float = 300) -> dict:
    """Steady-state images/s of a trainer run (``dres.train.TASK``), under ``taskset`` to ``cores`` cores."""
    from benchmarks.trainer_runs import TRAINER_EVAL_OFF, steady_state_rate

    preset, task, overrides = TRAINERS[name]
    with tempfile.TemporaryDirectory(prefix="dres-data-") as out:
        cmd = [sys.executable, "-m", f"dres.train.{task}", "--preset", preset, "--out", out]
        for kv in [*overrides, *data, "dist=none", f"batch_size={batch}", f"steps={steps}", "log.every=10",
                   "log.progress=false", "log.tensorboard=false", "ckpt.every=0", *TRAINER_EVAL_OFF]:
            cmd += ["--set", kv]
        if cores:
            cmd = ["taskset", "-c", f"0-{cores - 1}", *cmd]
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"kind": "trainer", "name": name, "data": data, "cores": cores, "error": f"over {timeout_s} s"}
        if proc.returncode != 0:
            return {"kind": "trainer", "name": name, "data": data, "cores": cores, "error": proc.stderr[-2000:]}
        with open(Path(out) / "metrics.jsonl") as f:
            metrics = [json.loads(line) for line in f if line.strip()]
        ips, timed = steady_state_rate(metrics, batch)
    return {"kind": "trainer", "name": name, "data": data, "cores": cores, "batch": batch, "images_per_s": ips,
            "steps_timed": timed, "wall_s": time.time() - t0}


def run_all(args) -> list[dict]:
    from dres.data.decode import gpu_decode_backend

    rows = []
    backends = [b for b in ("nvimgcodec", "torchvision") if _importable(b)]
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
    for root in args.sources:
        for cores in args.cores:
            for decode, workers in (("gpu", min(cores, 4)), ("cpu", cores)):
                rows.append({**_in_subprocess_loader(root, decode, workers, cores), "cores": cores})
                print(json.dumps(rows[-1]), flush=True)


def _trainer_rows(args, rows):
    sources = [[f"data.path={root}", f"data.name={'wds' if root != args.root else 'imagefolder'}",
                "data.num_classes=100", "data.gpu_resident=false", *[f"data.{kv}" for kv in args.data_sets]]
               for root in args.sources]
    for name in args.trainers:
        batch = 256
        rows.append(trainer_rate(name, ["data.name=synthetic", "data.num_classes=100"], None, args.steps, batch,
                                 args.trainer_timeout))
        print(json.dumps(rows[-1]), flush=True)
        for files, cores, decode in ((f, c, d) for f in sources for c in args.cores for d in args.trainer_decodes):
            workers = min(cores, 4) if decode == "gpu" else max(cores - 1, 1)
            data = files + [f"data.decode={decode}", f"data.num_workers={workers}"]
            rows.append(trainer_rate(name, data, cores, args.steps, batch, args.trainer_timeout))
            print(json.dumps(rows[-1]), flush=True)


def _importable(backend: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("nvidia.nvimgcodec" if backend == "nvimgcodec" else "torchvision.io") is not None
    except ModuleNotFoundError:  # no nvidia package at all
        return False


def _in_subprocess_loader(root, decode, workers, cores) -> dict:
    """:func:`loader_rate` in a fresh process held to ``cores`` cores."""
    cmd = ["taskset", "-c", f"0-{cores - 1}", sys.executable, "-m", "benchmarks.bench_data", "loader", "--root", root,
           "--decode", decode, "--workers", str(workers)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"kind": "loader", "decode": decode, "workers": workers, "error": proc.stderr[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def markdown(rows: list[dict], card: str) -> str:
    """The loaders' and trainers' table: each trainer row over the same trainer on synthetic data."""
    synthetic = {r["name"]: r["images_per_s"] for r in rows
                 if r["kind"] == "trainer" and "data.name=synthetic" in r["data"] and "images_per_s" in r}
    lines = [f"Card: {card}", "", "| what | decode | cores | workers | img/s | vs synthetic |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['kind']} {r.get('name', '')} | {r.get('decode', '')} | {r.get('cores', '')} | | failed | |")
            continue
        if r["kind"] == "decoder":
            hw = f", hardware share {r['hw_load']}" if r.get("hw_load") is not None else ""
            lines.append(f"| GPU half alone ({r['backend']}{hw}; the decode call alone "
                         f"{r['decode_call_images_per_s']:,.0f}) | gpu | | | {r['images_per_s']:,.0f} | |")
        elif r["kind"] == "prep":
            lines.append(f"| dres-prep, shorter side {r['short_side']} ({r['mean_kib']:.1f} KiB an image, "
                         f"{r['seconds']:.0f} s) | | all | | {r['images'] / r['seconds']:,.0f} | |")
        elif r["kind"] == "loader":
            lines.append(f"| loader {r.get('source', 'imagefolder')} ({r.get('backend') or 'cpu'}) | {r['decode']} | "
                         f"{r['cores']} | {r['workers']} | {r['images_per_s']:,.0f} | |")
        else:
            data = dict(kv.split("=", 1) for kv in r["data"])
            ratio = r["images_per_s"] / synthetic[r["name"]] if r["name"] in synthetic else float("nan")
            lines.append(f"| trainer {r['name']} ({data.get('data.name')}) | {data.get('data.decode', '')} | "
                         f"{r['cores'] or 'all'} | {data.get('data.num_workers', '')} | {r['images_per_s']:,.0f} | "
                         f"{ratio:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("make", "loader", "all"))
    ap.add_argument("--root", required=True)
    ap.add_argument("--images", type=int, default=20000)
    ap.add_argument("--classes", type=int, default=100)
    ap.add_argument("--decode", choices=("cpu", "gpu"), default="gpu")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--cores", default=f"{os.cpu_count()},4", help="comma-separated core counts (taskset)")
    ap.add_argument("--trainers", default="mae_vit_b16_baseline,mae_vit_b16_official,resnet50d_224")
    ap.add_argument("--trainer-decodes", default="gpu,cpu")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--trainer-timeout", type=float, default=300, help="seconds a trainer run may take")
    ap.add_argument("--hw-loads", default="0,0.65,1", help="nvImageCodec hardware shares the GPU half is timed at")
    ap.add_argument("--no-loaders", dest="loaders", action="store_false", help="skip the loader-alone rows")
    ap.add_argument("--shards", action="store_true",
                    help="also the folder as dres-prep shards (ROOT-shards, made once, timed): loaders and trainers")
    ap.add_argument("--set", dest="data_sets", action="append", default=[],
                    help="KEY=VALUE of data.* for the trainers from files (e.g. hw_decode_load=0.8)")
    ap.add_argument("--out", default=os.environ.get("OUT", "./device_out"))
    args = ap.parse_args(argv)
    if args.what == "make":
        t0 = time.time()
        stats = make_folder(args.root, args.images, args.classes)
        print(json.dumps({**stats, "seconds": time.time() - t0}), flush=True)
        return 0
    if args.what == "loader":
        print(json.dumps(loader_rate(args.root, args.decode, args.workers)), flush=True)
        return 0
    args.cores = [int(c) for c in args.cores.split(",") if c]
    args.trainers = [t for t in args.trainers.split(",") if t]
    args.trainer_decodes = [d for d in args.trainer_decodes.split(",") if d]
    args.hw_loads = [float(v) for v in args.hw_loads.split(",") if v]
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


if __name__ == "__main__":
    sys.exit(main())
