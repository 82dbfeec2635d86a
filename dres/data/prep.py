"""An ImageFolder tree to WebDataset shards of pre-resized JPEGs, once, for the streaming loader.

    dres-prep /data/imagenet/train /data/imagenet-shards/train [--short-side 320] [--workers 16]
    dres-train mae --preset mae_vit_b16_in1k --set data.name=wds --set data.path=/data/imagenet-shards/train

Each image's shorter side is resized to ``--short-side`` (smaller images are kept as they are) and written as an
RGB JPEG (greyscale, CMYK and PNG files become RGB JPEGs, which the GPU decoders all take), its label as the
index of its class folder in sorted order. The files are shuffled once (``--seed``) before they are cut into
shards of ``--shard-size``, so a shard mixes classes and the loader's shuffle buffer starts from mixed samples.

Every image is decoded in full before it is written: one that cannot be (truncated, not an image) is left out and
listed with its reason in the manifest's ``lost``. Shards are written in parallel, each through a temporary name
renamed when complete; ``manifest.json`` lists every shard's sample count and sha256 (the loader checks them and
takes its epoch length from them), the classes and the images left out; ``sources.json`` names each sample's source
file (the loader names a lost sample by it); ``prep.json``, written first, the source and settings.

Run it again after an interruption (SIGTERM or SIGINT stops it in one line, exit 75) and it keeps the shards
already written. It refuses an output folder that holds anything else, shards of another source or settings
(``--replace`` removes those and writes new ones), or one inside the source.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import random
import re
import signal
import sys
import tarfile
import time
from multiprocessing import Pool
from pathlib import Path

from dres.data.decode import is_decode_error, read_file
from dres.data.sources import SOURCES, DataError, file_sha256, list_image_folder
from dres.records import replace_atomic, write_json_atomic

EXIT_STOPPED = 75  # stopped on a signal; run again to continue (the trainers' status for the same)

SHARD = "{name}-{index:06d}.tar"


def resized_jpeg(data: bytes, short_side: int, quality: int) -> bytes:
    """The image, decoded in full, with its shorter side at most ``short_side``, as an RGB JPEG; an RGB JPEG already
    small enough keeps its bytes (no second compression). A truncated or damaged image raises."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        scale = short_side / min(im.size)
        size = (max(1, round(im.size[0] * scale)), max(1, round(im.size[1] * scale)))
        if scale < 1:
            im.draft("RGB", size)  # JPEG: decode at a reduced size where the DCT allows it
        im.load()  # every byte of the image decoded: a truncated file fails here, not in training
        if im.format == "JPEG" and im.mode == "RGB" and scale >= 1:
            return data
        if scale < 1:
            im = im.convert("RGB").resize(size, Image.BICUBIC, reducing_gap=3.0)
        else:
            im = im.convert("RGB")
        buf = io.BytesIO()
        im.save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def _sample(src: str, short_side: int, quality: int) -> tuple[bytes | None, str]:
    """``(jpeg, '')``, or ``(None, reason)`` for a file that cannot be read or decoded."""
    try:
        return resized_jpeg(read_file(src), short_side, quality), ""
    except Exception as e:
        if not is_decode_error(e):
            raise
        said = re.sub(r" ?<[^<>]* at 0x[0-9a-f]+>", "", " ".join(str(e).split()))  # no object's address: reruns agree
        return None, f"{type(e).__name__}: {said}".rstrip(": ")


def _write_shard(job) -> dict:
    """One shard: its samples resized and written to a temporary file, renamed when complete."""
    path, items, short_side, quality = job
    lost, keys = [], []

    def write(tmp):
        with tarfile.open(tmp, "w") as tar:
            for key, src, label in items:
                jpeg, why = _sample(src, short_side, quality)
                if jpeg is None:
                    lost.append(f"{src}: {why}")
                    continue
                for ext, payload in (("jpg", jpeg), ("cls", str(label).encode())):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size, info.mtime = len(payload), 0
                    tar.addfile(info, io.BytesIO(payload))
                keys.append(key)

    replace_atomic(path, write, path + ".tmp")
    return {"shard": os.path.basename(path), "keys": keys, "sha256": file_sha256(path), "lost": lost}


def _existing_shard(job) -> dict | None:
    """A shard written by an earlier run: its keys and sha256, and the images it left out with their reasons
    (read again: the earlier run's list may not have reached its manifest); None where it cannot be read."""
    path, items, short_side, quality = job
    try:
        with tarfile.open(path) as tar:
            present = {m.name[:-len(".cls")] for m in tar if m.name.endswith(".cls")}
    except (tarfile.TarError, OSError, EOFError):
        return None
    lost = [f"{src}: {_sample(src, short_side, quality)[1] or 'left out by an earlier run'}"
            for key, src, _ in items if key not in present]
    return {"shard": os.path.basename(path), "keys": [key for key, _, _ in items if key in present],
            "sha256": file_sha256(path), "lost": lost}


def _own_process_group() -> None:
    """Pool workers: in a process group of their own, so that a signal to the command's group (Ctrl-C, Slurm,
    ``timeout``) reaches the parent alone, which ends them; without the parent's handlers, which fork copied."""
    os.setpgid(0, 0)
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, signal.SIG_DFL)


PREP_FILES = ("manifest.json", SOURCES, "prep.json")


def _settings(src: str, paths, labels, **settings) -> dict:
    """What decides the shards' contents: the source, its files and labels, the options."""
    listing = hashlib.sha256("\n".join(f"{os.path.relpath(p, src)}\t{y}" for p, y in zip(paths, labels)).encode())
    return {"source": os.path.abspath(src), "images": len(paths), "files_sha256": listing.hexdigest(), **settings}


def _is_prep_file(name: str, shard_name: str) -> bool:
    """A file dres-prep writes into its output (a shard of the name ``shard_name``, a temporary of one)."""
    return (name in PREP_FILES or re.fullmatch(rf"{re.escape(shard_name)}-\d{{6}}\.tar(\.tmp)?", name) is not None
            or any(name.startswith(f) and name.endswith(".tmp") for f in PREP_FILES))


def _check_output(src: str, out: Path, settings: dict, replace: bool, log) -> None:
    """Refuse an output that is a file, lies inside the source, or holds anything but this command's shards;
    ``replace`` removes the shards of other settings."""
    if out.exists() and not out.is_dir():
        raise DataError(f"output {out} is a file: the shards need a folder (a new or empty one)")
    real_src, real_out = os.path.realpath(src), os.path.realpath(out)
    if os.path.commonpath([real_src, real_out]) == real_src:
        raise DataError(f"output {out} is inside the source {src}: its shards would become a class of the source; "
                        "choose a folder outside it")
    if not out.exists():
        return
    record = out / "prep.json"
    try:
        before = json.loads(record.read_text()) if record.exists() else None
    except (OSError, ValueError):
        before = {}
    if before is not None and not isinstance(before, dict):  # not a record of dres-prep's: differs from any settings
        before = {}
    shard_name = (before or {}).get("name", settings["name"])
    names = sorted(p.name for p in out.iterdir())
    foreign = [n for n in names if not _is_prep_file(n, shard_name)]
    if foreign:
        raise DataError(f"{out} holds files that are not this command's shards ({foreign[0]}, ...): choose an "
                        "empty or new folder")
    for n in names:  # the temporaries of an interrupted run: incomplete
        if n.endswith(".tmp"):
            (out / n).unlink()
    names = [n for n in names if not n.endswith(".tmp")]
    if before == settings or not names:
        return
    if before is None:
        differ = "no prep.json records what made them"
    else:
        differ = ", ".join("the source's files differ" if k == "files_sha256" else f"{k} {before.get(k)!r} there, {v!r} now"
                           for k, v in settings.items() if before.get(k) != v)
    if not replace:
        raise DataError(f"{out} holds shards of another source or settings ({differ}): pass --replace to remove them "
                        "and write new ones, or choose another folder")
    log(f"[dres] prep: removing the {len(names)} files of the earlier shards in {out} ({differ})")
    for n in names:
        (out / n).unlink()


def _readable_like_shards(path: Path) -> None:
    """A JSON file written through a private temporary gets the mode the shards get (0666 less the umask)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _write_json(path: Path, obj) -> None:
    write_json_atomic(path, obj)
    _readable_like_shards(path)


def prepare_shards(src: str, out: str, *, short_side: int = 320, shard_size: int = 1000, quality: int = 90,
                   workers: int | None = None, seed: int = 0, name: str = "shard", replace: bool = False,
                   log=print) -> dict:
    """Write ``src``'s images as shards in ``out`` (module doc); returns the manifest. An exception (a stop on a
    signal) ends the workers and removes the shards they were writing."""
    paths, labels, classes = list_image_folder(src)
    out_dir = Path(out)
    settings = _settings(src, paths, labels, short_side=short_side, shard_size=shard_size, quality=quality,
                         seed=seed, name=name)
    _check_output(src, out_dir, settings, replace, log)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / "prep.json", settings)
    order = list(range(len(paths)))
    random.Random(seed).shuffle(order)
    jobs, done = [], []
    for i in range(0, len(order), shard_size):
        path = str(out_dir / SHARD.format(name=name, index=i // shard_size))
        items = [(f"{j:08d}", paths[j], labels[j]) for j in order[i:i + shard_size]]
        (done if os.path.exists(path) else jobs).append((path, items, short_side, quality))
    results = []
    for job in done:
        kept = _existing_shard(job)
        if kept is None:  # damaged since: written again
            jobs.append(job)
        else:
            results.append(kept)
    log(f"[dres] prep: {len(paths)} images of {len(classes)} classes -> {len(jobs) + len(results)} shards in {out} "
        f"({len(results)} already written), shorter side {short_side}")
    t0, total = time.time(), len(jobs)
    try:
        with Pool(workers or os.cpu_count(), initializer=_own_process_group) as pool:
            for k, r in enumerate(pool.imap_unordered(_write_shard, jobs), 1):
                results.append(r)
                rate = sum(len(x["keys"]) for x in results[-k:]) / max(time.time() - t0, 1e-9)
                log(f"[dres] prep: shard {k}/{total} written ({rate:,.0f} images/s)")
    except BaseException:
        for path, *_ in jobs:  # the pool is ended: what its workers were writing is incomplete
            with contextlib.suppress(FileNotFoundError):
                os.remove(path + ".tmp")
        raise
    results.sort(key=lambda r: r["shard"])
    by_key = {f"{j:08d}": os.path.relpath(paths[j], src) for j in order}
    manifest = {"shards": {r["shard"]: {"samples": len(r["keys"]), "sha256": r["sha256"]} for r in results},
                "classes": classes, "short_side": short_side, "source": os.path.abspath(src),
                "lost": [x for r in results for x in r["lost"]]}
    _write_json(out_dir / SOURCES, {"source": os.path.abspath(src),
                                    "shards": {r["shard"]: {k: by_key[k] for k in r["keys"]} for r in results}})
    _write_json(out_dir / "manifest.json", manifest)
    lost = len(manifest["lost"])
    log(f"[dres] prep: done, {sum(e['samples'] for e in manifest['shards'].values())} images in {len(results)} shards"
        f"{f', {lost} left out (manifest.json, lost)' if lost else ''}; train with --set data.name=wds "
        f"--set data.path={out} --set data.num_classes={len(classes)}")
    return manifest


class Stopped(Exception):
    """A stop request (SIGTERM, SIGINT) to dres-prep."""


def _stop(signum, _frame):
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, signal.SIG_DFL)  # a second signal stops at once
    raise Stopped(signal.Signals(signum).name)


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
    ap.add_argument("--replace", action="store_true",
                    help="remove shards of another source or settings from OUT and write new ones")
    args = ap.parse_args(argv)
    for flag, value, low in (("--short-side", args.short_side, 16), ("--shard-size", args.shard_size, 1),
                             ("--quality", args.quality, 1)):
        if value < low or (flag == "--quality" and value > 100):
            ap.error(f"{flag} must be {'in [1, 100]' if flag == '--quality' else f'at least {low}'}, got {value}")
    if not re.fullmatch(r"[\w.-]+", args.name):
        ap.error(f"--name must be letters, digits, '.', '_' or '-', got {args.name!r}")
    previous = {s: signal.signal(s, _stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        prepare_shards(args.src, args.out, short_side=args.short_side, shard_size=args.shard_size,
                       quality=args.quality, workers=args.workers, seed=args.seed, name=args.name,
                       replace=args.replace)
    except DataError as e:
        print(f"dres-prep: error: {e}", file=sys.stderr)
        return 2
    except Stopped as e:
        print(f"dres-prep: stopped by {e}: the shards written are kept; run the same command again to continue",
              file=sys.stderr)
        return EXIT_STOPPED
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 0


if __name__ == "__main__":
    sys.exit(main())
