"""An ImageFolder tree to WebDataset shards of pre-resized JPEGs, once, for the streaming loader.

    dres-prep /data/imagenet/train /data/imagenet-shards/train [--short-side 320] [--workers 16]
    dres-train mae --preset mae_vit_b16_in1k --set data.name=wds --set data.path=/data/imagenet-shards/train

Each image's shorter side is resized to ``--short-side`` (smaller images are kept as they are) and written as an
RGB JPEG (greyscale, CMYK and PNG files become RGB JPEGs, which the GPU decoders all take), its label as the
index of its class folder in sorted order. The files are shuffled once (``--seed``) before they are cut into
shards of ``--shard-size``, so a shard mixes classes and the loader's shuffle buffer starts from mixed samples.

Shards are written in parallel, each through a temporary name renamed when complete; ``manifest.json`` lists
every shard's sample count and sha256 (the loader checks them and takes its epoch length from them), the classes
and the images that could not be read. Run it again after an interruption and it keeps the shards already
written. It refuses an output folder that holds anything else.
"""

from __future__ import annotations

import argparse
import io
import os
import random
import sys
import tarfile
import time
from multiprocessing import Pool
from pathlib import Path

from dres.data.decode import is_decode_error, read_file
from dres.data.sources import DataError, file_sha256, list_image_folder
from dres.records import write_json_atomic

SHARD = "{name}-{index:06d}.tar"


def resized_jpeg(data: bytes, short_side: int, quality: int) -> bytes:
    """The image with its shorter side at most ``short_side``, as an RGB JPEG; an RGB JPEG already small enough
    keeps its bytes (no second compression)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        if im.format == "JPEG" and im.mode == "RGB" and min(im.size) <= short_side:
            return data
        scale = short_side / min(im.size)
        if scale < 1:
            size = (max(1, round(im.size[0] * scale)), max(1, round(im.size[1] * scale)))
            im.draft("RGB", size)  # JPEG: decode at a reduced size where the DCT allows it
            im = im.convert("RGB").resize(size, Image.BICUBIC, reducing_gap=3.0)
        else:
            im = im.convert("RGB")
        buf = io.BytesIO()
        im.save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def _write_shard(job) -> dict:
    """One shard: its samples resized and written to a temporary file, renamed when complete."""
    path, items, short_side, quality = job
    tmp = path + ".tmp"
    lost, samples = [], 0
    with tarfile.open(tmp, "w") as tar:
        for key, src, label in items:
            try:
                jpeg = resized_jpeg(read_file(src), short_side, quality)
            except Exception as e:
                if not is_decode_error(e):
                    raise
                lost.append(f"{src}: {type(e).__name__}")
                continue
            for ext, payload in (("jpg", jpeg), ("cls", str(label).encode())):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size, info.mtime = len(payload), 0
                tar.addfile(info, io.BytesIO(payload))
            samples += 1
    os.replace(tmp, path)
    return {"shard": os.path.basename(path), "samples": samples, "sha256": file_sha256(path), "lost": lost}


def _existing_shard(path: str) -> dict:
    """A shard written by an earlier run: its count (of ``.cls`` members) and sha256."""
    with tarfile.open(path) as tar:
        samples = sum(m.name.endswith(".cls") for m in tar)
    return {"shard": os.path.basename(path), "samples": samples, "sha256": file_sha256(path), "lost": []}


def prepare_shards(src: str, out: str, *, short_side: int = 320, shard_size: int = 1000, quality: int = 90,
                   workers: int | None = None, seed: int = 0, name: str = "shard", log=print) -> dict:
    """Write ``src``'s images as shards in ``out`` (module doc); returns the manifest."""
    paths, labels, classes = list_image_folder(src)
    out_dir = Path(out)
    ours = {SHARD.format(name=name, index=i) for i in range((len(paths) + shard_size - 1) // shard_size)}
    if out_dir.exists():
        foreign = [p.name for p in out_dir.iterdir()
                   if p.name not in ours and p.name != "manifest.json" and not p.name.endswith(".tar.tmp")]
        if foreign:
            raise DataError(f"{out} holds files that are not this command's shards ({foreign[0]}, ...): choose an "
                            "empty or new folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    order = list(range(len(paths)))
    random.Random(seed).shuffle(order)
    jobs, done = [], []
    for i in range(0, len(order), shard_size):
        path = str(out_dir / SHARD.format(name=name, index=i // shard_size))
        if os.path.exists(path):
            done.append(path)
            continue
        items = [(f"{j:08d}", paths[j], labels[j]) for j in order[i:i + shard_size]]
        jobs.append((path, items, short_side, quality))
    log(f"[dres] prep: {len(paths)} images of {len(classes)} classes -> {len(jobs) + len(done)} shards in {out} "
        f"({len(done)} already written), shorter side {short_side}")
    t0 = time.time()
    results = [_existing_shard(p) for p in done]
    with Pool(workers or os.cpu_count()) as pool:
        for k, r in enumerate(pool.imap_unordered(_write_shard, jobs), 1):
            results.append(r)
            rate = sum(x["samples"] for x in results[len(done):]) / max(time.time() - t0, 1e-9)
            log(f"[dres] prep: shard {k}/{len(jobs)} written ({rate:,.0f} images/s)")
    results.sort(key=lambda r: r["shard"])
    manifest = {"shards": {r["shard"]: {"samples": r["samples"], "sha256": r["sha256"]} for r in results},
                "classes": classes, "short_side": short_side, "source": os.path.abspath(src),
                "lost": [x for r in results for x in r["lost"]]}
    write_json_atomic(out_dir / "manifest.json", manifest)
    lost = len(manifest["lost"])
    log(f"[dres] prep: done, {sum(r['samples'] for r in results)} images in {len(results)} shards"
        f"{f', {lost} unreadable (manifest.json, lost)' if lost else ''}; train with --set data.name=wds "
        f"--set data.path={out} --set data.num_classes={len(classes)}")
    return manifest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dres-prep", description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="ImageFolder root: SRC/<class>/<image>")
    ap.add_argument("out", help="the shards' folder (new or empty; or one this command wrote, to continue)")
    ap.add_argument("--short-side", type=int, default=320, help="the shorter side images are resized to (pixels)")
    ap.add_argument("--shard-size", type=int, default=1000, help="images a shard")
    ap.add_argument("--quality", type=int, default=90, help="JPEG quality of re-encoded images")
    ap.add_argument("--workers", type=int, default=None, help="processes (default: every core)")
    ap.add_argument("--seed", type=int, default=0, help="the shuffle of the files across shards")
    ap.add_argument("--name", default="shard", help="shard file names: NAME-000000.tar, ...")
    args = ap.parse_args(argv)
    for flag, value, low in (("--short-side", args.short_side, 16), ("--shard-size", args.shard_size, 1),
                             ("--quality", args.quality, 1)):
        if value < low or (flag == "--quality" and value > 100):
            ap.error(f"{flag} must be {'in [1, 100]' if flag == '--quality' else f'at least {low}'}, got {value}")
    try:
        prepare_shards(args.src, args.out, short_side=args.short_side, shard_size=args.shard_size,
                       quality=args.quality, workers=args.workers, seed=args.seed, name=args.name)
    except DataError as e:
        print(f"dres-prep: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
