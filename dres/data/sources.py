"""Readers for every supported data source, all producing uint8 ``(N, C, H, W)`` arrays or streams
of ``(uint8 CHW image, label)`` samples.

* WebDataset shards (``.tar``/``.tar.gz``, brace notation ``x-{000000..000009}.tar.gz``): members
  ``<key>.jpg|png|jpeg|webp`` + ``<key>.cls``. Read with :mod:`tarfile` directly so that a corrupt
  member or a truncated shard is skipped and *counted* instead of killing the run.
* ImageFolder trees (ImageNet layout: ``root/<class>/<image>``).
* CIFAR-10/100 in torchvision's pickled ``cifar-10-batches-py`` / ``cifar-100-python`` format.
* MNIST in torchvision's folder layout (``MNIST/raw/*-ubyte[.gz]``, the idx format; no pickle).
* scikit-learn's digits (8x8 greyscale, ships with scikit-learn: no download).
* synthetic random images for throughput runs.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import json
import os
import pickle
import re
import subprocess
import tarfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import torch

from dres.data.decode import is_decode_error, read_file

IMG_EXT = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".ppm")


class DataError(ValueError):
    """A one-line, user-facing data problem (missing/empty path, no samples)."""


class CorruptCounter:
    """Samples lost to unreadable data and the shards they came from, reported as they happen.

    ``log`` (when given) gets one line per loss, rate-limited: the first :attr:`LOG_FIRST`, then at
    most one line every :attr:`LOG_EVERY_S` seconds that also counts the losses in between. With
    ``collect=True`` each event is also kept in :attr:`pending` for a DataLoader worker to hand to
    the main process (:meth:`drain`, then :meth:`replay` there)."""

    LOG_FIRST = 10
    LOG_EVERY_S = 30.0

    def __init__(self, log=None, collect=False, unit="shard"):
        self.unit = unit         # what `shards_total` counts: "shard" (WebDataset) or "file" (a folder's images)
        self.lost_keys: set = set()  # samples already counted: a streamed data set meets them again every epoch
        self.count = 0           # samples lost (for a damaged shard: what its manifest count says was not read)
        self.damaged: list = []  # shards that could not be read to their end
        self.uncounted: list = []  # damaged shards without a manifest count: how many samples they lost is unknown
        self.examples: list = []
        self.files: list = []    # the source file of each lost sample where it is known (a folder's, or by sources.json)
        self.dropped_by_prep: list = []  # "<file>: <reason>" of the images dres-prep left out of the shards read
        self.shards_total = 0    # shards (or files) read, for the damaged fraction
        self.log, self.collect, self.pending = log, collect, []
        self._logged, self._quiet, self._last = 0, 0, 0.0

    def add(self, what: str, shard: str = "", damaged: bool = False, lost: int | None = 1, key: str | None = None,
            files=()):
        """One lost sample or, with ``damaged``, the unread rest of ``shard``: ``lost`` samples by its
        manifest, None when no manifest counts them; ``files``: the lost samples' source files, where known. A
        sample ``key`` met again is not counted again."""
        if key is not None:
            if key in self.lost_keys:
                return
            self.lost_keys.add(key)
        if damaged:
            if shard not in self.damaged:  # a streaming loader meets it again every epoch
                self.damaged.append(shard)
            if lost is None and shard not in self.uncounted:
                self.uncounted.append(shard)
        self.count += lost or 0
        self.files.extend(files)
        if len(self.examples) < 20:
            self.examples.append(what)
        if self.collect:
            self.pending.append((what, shard, damaged, lost, key, tuple(files)))
        self._report(what)

    def state_dict(self) -> dict:
        """What was counted, in plain lists and numbers (a checkpoint's), for a resumed run to count on from."""
        return {"count": self.count, "keys": sorted(self.lost_keys), "damaged": list(self.damaged),
                "uncounted": list(self.uncounted), "examples": list(self.examples), "files": list(self.files)}

    def load_state_dict(self, s: dict):
        self.count, self.lost_keys = int(s["count"]), set(s["keys"])
        self.damaged, self.uncounted = list(s["damaged"]), list(s["uncounted"])
        self.examples, self.files = list(s["examples"]), list(s["files"])

    @classmethod
    def of_ranks(cls, states: list, dropped_by_prep=()) -> "CorruptCounter":
        """One counter of what every rank counted (their :meth:`state_dict`): each rank reads samples of its own,
        so the counts add up; ``dropped_by_prep`` is the manifest's, the same on every rank."""
        merged = cls()
        for s in states:
            merged.count += int(s["count"])
            merged.lost_keys |= set(s["keys"])
            merged.damaged += [d for d in s["damaged"] if d not in merged.damaged]
            merged.uncounted += [u for u in s["uncounted"] if u not in merged.uncounted]
            merged.examples += s["examples"]
            merged.files += s["files"]
        merged.dropped_by_prep = list(dropped_by_prep)
        return merged

    def drain(self) -> list:
        out, self.pending = self.pending, []
        return out

    def replay(self, events):
        for what, shard, damaged, lost, key, files in events:
            self.add(what, shard, damaged, lost, key, files)

    def _report(self, what):
        if self.log is None:
            return
        now = time.monotonic()
        if self._logged < self.LOG_FIRST or now - self._last >= self.LOG_EVERY_S:
            more = f" (and {self._quiet} more since the last report)" if self._quiet else ""
            damaged = f" and {len(self.damaged)} damaged shard(s)" if self.unit == "shard" else ""
            self.log(f"[dres] lost data: {what}{more}; {self._samples_lost()} sample(s){damaged} lost so far")
            self._logged, self._last, self._quiet = self._logged + 1, now, 0
        else:
            self._quiet += 1

    def _samples_lost(self) -> str:
        return f"at least {self.count} (unknown how many more)" if self.uncounted else str(self.count)

    def summary(self) -> dict:
        """``corrupt_samples`` is None when a damaged shard's loss is unknown (no manifest count);
        ``corrupt_samples_at_least`` then says how many were counted. ``lost_files`` names the lost samples'
        source files where they are known, ``dropped_by_prep`` the images dres-prep could not put in the shards."""
        s = {"corrupt_samples": None if self.uncounted else self.count, "damaged_shards": list(self.damaged),
             "examples": self.examples[:10], "lost_files": list(self.files),
             "dropped_by_prep": list(self.dropped_by_prep)}
        if self.uncounted:
            s.update(corrupt_samples_at_least=self.count, uncounted_shards=list(self.uncounted))
        return s

    def check(self, samples_read: int, max_frac: float, where: str, expected: int = 0):
        """Raise :class:`DataError` when the lost fraction of samples (of ``max(read + lost,
        expected)``) or of shards exceeds ``max_frac``."""
        samples = max(samples_read + self.count, expected, 1)
        shard_frac = len(self.damaged) / self.shards_total if self.shards_total else 0.0
        if self.count / samples <= max_frac and shard_frac <= max_frac:
            return
        names = ", ".join(self.damaged[:3]) + (" ..." if len(self.damaged) > 3 else "")
        shards = (f" and {len(self.damaged)} of {self.shards_total} shards" if self.unit == "shard" else
                  f" (of {self.shards_total} files)")
        raise DataError(f"too much unreadable data in {where}: {self._samples_lost()} of {samples} samples{shards} "
                        f"lost{' (' + names + ')' if names else ''}, above data.max_corrupt_frac={max_frac} (repair the "
                        "data, or raise the limit)")


def lost_data_line(lost: dict) -> str:
    """One line about a :meth:`CorruptCounter.summary`'s losses ('' when nothing was lost)."""
    damaged = lost["damaged_shards"]
    if not (lost["corrupt_samples"] or damaged):
        return ""
    if lost["corrupt_samples"] is None:
        samples = (f"at least {lost['corrupt_samples_at_least']} samples (how many more is unknown: "
                   f"{len(lost['uncounted_shards'])} damaged shard(s) have no count in a manifest.json)")
    else:
        samples = f"{lost['corrupt_samples']} samples"
    return f"[dres] lost {samples} and {len(damaged)} damaged shards {damaged[:3]} (summary.json, lost_data)"


def check_labels(labels: torch.Tensor, num_classes: int, where: str):
    """Labels must lie in [0, num_classes) (a larger label fails deep inside the loss or the probe)."""
    if num_classes > 0 and len(labels) and (int(labels.max()) >= num_classes or int(labels.min()) < 0):
        raise DataError(f"labels in {where} range over [{int(labels.min())}, {int(labels.max())}] but "
                        f"data.num_classes={num_classes}; set data.num_classes to the data's class count")


_SHA_CACHE: dict = {}


def file_sha256(path: str) -> str:
    """A file's sha256, remembered by its real path, size and modification time."""
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    if key not in _SHA_CACHE:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        _SHA_CACHE[key] = h.hexdigest()
    return _SHA_CACHE[key]


def manifest_entries(shards: list[str]) -> list[dict]:
    """Each shard's entry in its folder's ``manifest.json`` (``{"shards": {name: {"sha256": ...,
    "samples": ...}}}``), ``{}`` for a shard the folder does not list or a folder without a manifest."""
    manifests, entries = {}, []
    for s in shards:
        if s.startswith("pipe:"):  # a command's output has no folder
            entries.append({})
            continue
        folder = s.rsplit("/", 1)[0] if is_remote(s) else os.path.dirname(os.path.abspath(s))
        if folder not in manifests:
            manifests[folder] = _read_manifest(folder)
        entries.append(manifests[folder].get(s.rsplit("/", 1)[-1]) or {})
    return entries


def _read_manifest(folder: str) -> dict:
    """The ``shards`` table of ``folder``'s manifest.json (a local folder or a URL), {} where it has none."""
    return read_manifest(folder).get("shards", {})


_MANIFESTS: dict = {}


def read_manifest(folder: str) -> dict:
    """``folder``'s manifest.json (a local folder, remembered by its size and modification time, or a URL), {}
    where it has none; a manifest that is no shard table, or names a shard outside its folder, is a
    :class:`DataError`."""
    where = f"{folder}/manifest.json"
    try:
        if is_remote(folder):
            try:
                with urllib.request.urlopen(where, timeout=60) as r:
                    text = r.read()
            except urllib.error.HTTPError as e:
                if e.code == 404:
                    return {}
                raise DataError(f"{where}: HTTP {e.code}") from e
            except OSError as e:
                raise DataError(f"{where} cannot be read ({type(e).__name__}: {e})") from e
        elif os.path.exists(where):
            st = os.stat(where)
            cached = _MANIFESTS.get(where)
            if cached is not None and cached[0] == (st.st_size, st.st_mtime_ns):
                return cached[1]
            with open(where) as f:
                text = f.read()
        else:
            return {}
        manifest = json.loads(text)
        shards = manifest["shards"]
        outside = [n for n in shards if not isinstance(n, str) or os.path.basename(n) != n or n in ("", ".", "..")]
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{where} is not a shard manifest ({type(e).__name__}: {e})") from e
    if outside:  # read as a path, such a name would leave the folder ("../x.tar", "/etc/x.tar")
        raise DataError(f"{where} names the shard {outside[0]!r}, which is not a file name in its folder")
    if not is_remote(folder):
        _MANIFESTS[where] = ((st.st_size, st.st_mtime_ns), manifest)
    return manifest


_SOURCES: dict = {}
SOURCES = "sources.json"  # beside dres-prep's manifest: each shard's samples' source files, by key, in shard order


def sample_sources(shard: str) -> dict:
    """``{key: source file}`` of a local shard's samples, in the shard's order, from the sources.json dres-prep
    wrote beside it; {} where there is none or it cannot be read (it only names losses)."""
    if is_remote(shard):
        return {}
    where = os.path.join(os.path.dirname(os.path.abspath(shard)), SOURCES)
    try:
        st = os.stat(where)
        stamp = (st.st_size, st.st_mtime_ns)
        if _SOURCES.get(where, (None,))[0] != stamp:
            with open(where) as f:
                table = json.load(f)
            root = table["source"]
            _SOURCES[where] = (stamp, {name: {k: os.path.join(root, p) for k, p in keys.items()}
                                       for name, keys in table["shards"].items()})
        return _SOURCES[where][1].get(os.path.basename(shard), {})
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def prep_dropped(shards: list[str]) -> list[str]:
    """The images dres-prep could not put into the folders of ``shards`` (``lost`` of each manifest.json)."""
    folders = dict.fromkeys(os.path.dirname(os.path.abspath(s)) for s in shards if not is_remote(s))
    dropped = []
    for folder in folders:
        try:
            lost = read_manifest(folder).get("lost", [])
        except DataError:
            continue
        dropped.extend(x for x in lost if isinstance(x, str))
    return dropped


def manifest_samples(shards: list[str]) -> int | None:
    """How many samples ``shards`` hold by their manifests (an empty shard's count, 0, is a count), or None
    unless every shard is listed with one (an unreadable manifest counts as none: only ``verify_manifest``
    stops a run over it)."""
    try:
        counts = [e.get("samples") for e in manifest_entries(shards)]
    except DataError:
        return None
    valid = all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts)
    return sum(counts) if counts and valid else None


def verify_manifest(shards: list[str]) -> int:
    """Check each shard listed in its folder's ``manifest.json`` against its sha256 before use; a
    mismatch is a :class:`DataError` naming the shard. Returns how many shards were checked (files
    without a manifest entry are not)."""
    checked = 0
    for s, entry in zip(shards, manifest_entries(shards)):
        folder = os.path.dirname(os.path.abspath(s))
        if "sha256" not in entry or is_remote(s):  # a streamed shard is checked as it is read (open_shard)
            continue
        got = file_sha256(s)
        if got != entry["sha256"]:
            raise DataError(f"shard {s} does not match {folder}/manifest.json (sha256 {got[:12]}..., expected "
                            f"{entry['sha256'][:12]}...): re-fetch it, or set data.verify_manifest=false to use it as is")
        checked += 1
    return checked


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def default_cifar10_dir() -> Path:
    """The shared CIFAR-10 shards: ``../shared/data/cifar10`` beside the checkout (CI, development),
    else ``shared/data/cifar10`` inside it (where the GPU machines place shared/)."""
    for base in (repo_root().parent, repo_root()):
        d = base / "shared" / "data" / "cifar10"
        if d.exists():
            return d
    return repo_root().parent / "shared" / "data" / "cifar10"


_BRACE = re.compile(r"\{([^{}]*)\}")


def braceexpand(pattern: str) -> list[str]:
    """WebDataset's brace notation: ``a-{000..009}.tar`` (zero-padded ranges) and ``{x,y}``.

    Written here rather than imported so that shard loading needs no package beyond torch (the GPU
    machines have no webdataset/braceexpand).
    """
    m = _BRACE.search(pattern)
    if m is None:
        return [pattern]
    body, head, tail = m.group(1), pattern[: m.start()], pattern[m.end():]
    rng = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if rng:
        lo, hi = rng.groups()
        width = len(lo) if lo.startswith("0") else 0
        items = [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    else:
        items = body.split(",")
    return [e for item in items for e in braceexpand(head + item + tail)]


def expand_shards(pattern: str) -> list[str]:
    """Brace notation, globs and folders with a ``manifest.json`` (its shards) -> shard paths; a missing local
    path is a one-line error; ``pipe:`` commands and URLs are taken as they are."""
    if not pattern:
        raise DataError("no data path given (set data.path=...)")
    out = []
    for p in pattern.split("::"):
        if is_remote(p):  # read when used; a missing one is a damaged shard then
            out.extend(braceexpand(p))
            continue
        for q in braceexpand(os.path.expanduser(p)):
            if os.path.isdir(q) and os.path.isfile(os.path.join(q, "manifest.json")):  # a folder of shards (dres-prep)
                out.extend(os.path.join(q, name) for name in sorted(_read_manifest(q)))
                continue
            out.extend(sorted(glob.glob(q)) if any(c in q for c in "*?[") else [q])
    local = [p for p in out if not is_remote(p)]
    missing = [p for p in local if not os.path.exists(p)]
    if missing:
        raise DataError(f"data path not found: {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    odd = [p for p in local if not os.path.isfile(p)]
    if odd:
        raise DataError(f"data path {odd[0]} is not a regular file (a shard is a .tar or .tar.gz file)")
    if not out:
        raise DataError(f"data path '{pattern}' matches no shard files")
    return out


def decode_image(data: bytes, in_chans: int = 3) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        im = im.convert("L" if in_chans == 1 else "RGB")
        a = np.asarray(im, dtype=np.uint8)
    return a[None] if a.ndim == 2 else a.transpose(2, 0, 1)


def is_remote(pattern: str) -> bool:
    """A shard read through a shell command (``pipe:CMD``, as webdataset writes it) or over HTTP(S)."""
    return pattern.startswith(("pipe:", "http://", "https://"))


class _HashingReader:
    """A binary stream that hashes what is read through it (a streamed shard checked against its manifest)."""

    def __init__(self, raw):
        self.raw, self.sha = raw, hashlib.sha256()

    def read(self, n=-1):
        data = self.raw.read(n)
        self.sha.update(data)
        return data


def open_shard(path: str):
    """``(tarfile, finish)``: a local shard (a regular file: anything else would block or is not a shard)
    read with seeks, a ``pipe:`` command's output or an HTTP(S) body read as a stream; ``finish()`` returns
    why the stream was bad after its end (the command's exit status, a sha256 that differs from the manifest's)
    or ''."""
    if not is_remote(path):
        if not os.path.isfile(path):
            raise OSError(f"{path} is not a regular file")
        return tarfile.open(path, "r:*"), lambda: ""
    if path.startswith("pipe:"):
        proc = subprocess.Popen(path[len("pipe:"):], shell=True, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)

        def finish():
            proc.stdout.close()
            code = proc.wait()
            return f"its command exited with status {code}" if code else ""
        return tarfile.open(fileobj=proc.stdout, mode="r|*"), finish
    body = _HashingReader(urllib.request.urlopen(path, timeout=60))
    expected = (manifest_entries([path]) or [{}])[0].get("sha256")

    def finish():
        body.raw.close()
        got = body.sha.hexdigest()
        return f"its sha256 {got[:12]}... is not its manifest's {expected[:12]}..." if expected and got != expected else ""
    return tarfile.open(fileobj=body, mode="r|*"), finish


def iter_shard(path: str, counter: CorruptCounter, slot: tuple[int, int] | None = None):
    """Yield ``(key, encoded image bytes, label)`` from one shard (local, ``pipe:`` or a URL); members that
    lack an image or a label and damaged shards are counted, a damaged shard's unread samples by its
    manifest count (unknown without one).

    With ``slot=(keep, n)`` only the samples whose index in the shard (over every sample read or lost) is
    ``keep`` mod ``n`` are yielded and counted when lost."""
    seen = 0  # samples of this shard met so far, readable or not
    name = os.path.basename(path)

    def mine(i):
        return slot is None or i % slot[1] == slot[0]

    def lose_rest(why, total=None):
        total = manifest_samples([path]) if total is None else total
        if total is None or total < seen:
            counter.add(f"{name}: {why}, the rest of it is lost", path, damaged=True, lost=None)
            return
        rest = [i for i in range(seen, total) if mine(i)]
        keys = list(sample_sources(path).values())
        files = [keys[i] for i in rest if i < len(keys)]
        counter.add(f"{name}: {why}, its last {total - seen} of {total} samples (manifest.json) are lost"
                    f"{f' ({files[0]}, ...)' if files else ''}", path, damaged=True, lost=len(rest), files=files,
                    key=f"{path}:{slot}: from {seen}")  # met again in every epoch: counted once

    try:
        tf, finish = open_shard(path)
    except (tarfile.TarError, OSError, EOFError) as e:
        return lose_rest(f"unreadable shard ({type(e).__name__})")
    cur_key, parts = None, {}

    def emit(key, parts):
        nonlocal seen
        seen += 1
        if not mine(seen - 1):
            return None
        img_bytes = next((v for k, v in parts.items() if k in IMG_EXT), None)
        try:
            if img_bytes is None or "cls" not in parts:
                raise ValueError("sample lacks an image or a .cls member")
            label = int(parts["cls"].decode().strip())
        except (ValueError, UnicodeDecodeError) as e:
            source = sample_sources(path).get(key)
            counter.add(f"{name}:{key}: {type(e).__name__}{f' ({source})' if source else ''}", path,
                        key=f"{path}:{key}", files=[source] if source else [])
            return None
        return key, img_bytes, label

    try:
        with tf:
            for m in tf:
                if not m.isfile():
                    continue
                base = os.path.basename(m.name)
                key, _, ext = base.partition(".")
                key = os.path.join(os.path.dirname(m.name), key)
                ext = "." + ext.lower() if ext.lower() != "cls" else "cls"
                if key != cur_key and cur_key is not None:
                    s = emit(cur_key, parts)
                    if s is not None:
                        yield s
                    parts = {}
                cur_key = key
                parts[ext] = tf.extractfile(m).read()
            if cur_key is not None:
                s = emit(cur_key, parts)
                if s is not None:
                    yield s
    except (tarfile.TarError, OSError, EOFError, zlib_error()) as e:
        # a truncated/corrupt shard: keep what was read; the sample being read when it broke is lost too
        finish()
        return lose_rest(f"truncated or corrupt shard ({type(e).__name__})")
    why = finish()
    if why:
        counter.add(f"{name}: {why}", path, damaged=True, lost=0)
    # a shard cut between two members ends as if complete: its manifest's count tells
    total = manifest_samples([path])
    if total is not None and total > seen:
        lose_rest(f"ends after {seen} samples", total)


def zlib_error():
    import zlib

    return zlib.error


def read_shards(pattern: str, in_chans=3, limit=0, counter: CorruptCounter | None = None):
    """Decode every sample of the shards into memory: ``(uint8 (N,C,H,W), int64 (N,), counter)``."""
    counter = counter or CorruptCounter()
    imgs, labels = [], []
    shards = expand_shards(pattern)
    counter.dropped_by_prep = prep_dropped(shards)
    for shard in shards:
        counter.shards_total += 1
        for key, data, label in iter_shard(shard, counter):
            try:
                imgs.append(decode_image(data, in_chans))
            except Exception as e:
                if not is_decode_error(e):
                    raise
                source = sample_sources(shard).get(key)
                counter.add(f"{os.path.basename(shard)}:{key}: {type(e).__name__}{f' ({source})' if source else ''}",
                            shard, files=[source] if source else [])
                continue
            labels.append(label)
            if limit and len(imgs) >= limit:
                break
        if limit and len(imgs) >= limit:
            break
    if not imgs:
        raise DataError(f"no readable samples in '{pattern}' ({counter.count} corrupt)")
    shapes = {i.shape for i in imgs}
    if len(shapes) > 1:
        raise DataError(f"images in '{pattern}' have different sizes {sorted(shapes)[:3]}; use a streaming loader")
    return torch.from_numpy(np.stack(imgs)), torch.tensor(labels, dtype=torch.int64), counter


def cifar10_pattern(root: str | os.PathLike, split: str) -> str:
    n = {"train": 9, "test": 1}[split]
    return str(Path(root) / f"cifar10-{split}-{{000000..{n:06d}}}.tar.gz")


def read_cifar_torchvision(root: str, train: bool):
    """torchvision's CIFAR-10/100 python format (``cifar-10-batches-py`` or ``cifar-100-python``).

    Trust boundary: that format is a Python pickle, and unpickling runs whatever code the file
    names, so ``root`` must hold the official files (or ones you made): never point ``data.path`` of
    ``data.name=cifar_tv`` at downloaded data you have not checked. The shard sources do not
    unpickle anything."""
    root = Path(root)
    for sub, files, key in (("cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)] if train else ["test_batch"], b"labels"),
                            ("cifar-100-python", ["train"] if train else ["test"], b"fine_labels")):
        d = root / sub if (root / sub).exists() else (root if (root / files[0]).exists() else None)
        if d is None:
            continue
        xs, ys = [], []
        for f in files:
            with open(d / f, "rb") as fh:
                entry = pickle.load(fh, encoding="bytes")
            xs.append(np.asarray(entry[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
            ys.extend(entry[key])
        return torch.from_numpy(np.concatenate(xs)), torch.tensor(ys, dtype=torch.int64)
    if not root.exists():
        raise DataError(f"data path not found: {root}")
    raise DataError(f"no CIFAR data in torchvision format under {root} (expected cifar-10-batches-py/ or cifar-100-python/)")


_MNIST_FILES = {True: ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
               False: ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
_MNIST_WHERE = ("data.name=mnist_tv needs data.path: the folder holding torchvision's MNIST/ folder (MNIST/raw/"
               "train-images-idx3-ubyte[.gz] and the other three idx files, as torchvision.datasets.MNIST(root, "
               "download=True) leaves them under root); dres does not download it")


def read_idx(path: Path, ndim: int) -> np.ndarray:
    """One uint8 idx file (plain or gzip) -> its ``ndim``-dimensional array: magic ``0x0000 08 ndim``
    (ubyte data), then ``ndim`` big-endian uint32 sizes, then exactly their product of bytes."""
    try:
        with (gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")) as f:
            data = f.read()
    except (EOFError, gzip.BadGzipFile, zlib_error()) as e:  # a truncated or corrupt gzip stream
        raise DataError(f"{path} is truncated or corrupt ({type(e).__name__}: {e})") from e
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DataError(f"{path} is truncated: {len(data)} bytes, shorter than its {header}-byte idx header")
    magic = int.from_bytes(data[:4], "big")
    if magic != 0x800 + ndim:
        raise DataError(f"{path} is not a uint8 idx file of {ndim} dimension(s): magic number {magic:#010x}, "
                        f"expected {0x800 + ndim:#010x}")
    dims = tuple(int(n) for n in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    expected = int(np.prod(dims, dtype=np.int64))
    if len(data) - header != expected:
        raise DataError(f"{path} holds {len(data) - header} data bytes but its header says {'x'.join(map(str, dims))}"
                        f" = {expected} ({'truncated' if len(data) - header < expected else 'trailing bytes'})")
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)


def read_mnist_torchvision(root: str, train: bool, in_chans: int = 1):
    """MNIST (or any data set in its idx format: Fashion-MNIST, KMNIST) in torchvision's layout:
    ``root/MNIST/raw/``, ``root/raw/`` or ``root`` holding ``{train,t10k}-{images-idx3,labels-idx1}-ubyte``,
    each plain or ``.gz`` -> ``(uint8 (N, in_chans, H, W), int64 (N,))``; the greyscale channel is
    replicated when ``in_chans`` is 3 (for 3-channel stems)."""
    if not root:
        raise DataError(_MNIST_WHERE)
    if in_chans not in (1, 3):
        raise DataError(f"data.in_chans must be 1 or 3 for data.name=mnist_tv (greyscale), got {in_chans}")
    base = Path(root).expanduser()
    if not base.exists():
        raise DataError(f"data path not found: {base}")
    names = _MNIST_FILES[train]
    for d in (base / "MNIST" / "raw", base / "raw", base):
        found = [next((d / (n + ext) for ext in ("", ".gz") if (d / (n + ext)).is_file()), None) for n in names]
        if all(found):
            break
    else:
        raise DataError(f"no MNIST idx files under {base} (expected MNIST/raw/{names[0]}[.gz] and {names[1]}[.gz], "
                        f"or them in raw/ or {base} itself)")
    images, labels = read_idx(found[0], 3), read_idx(found[1], 1)
    if len(images) != len(labels):
        raise DataError(f"{found[0]} holds {len(images)} images but {found[1]} {len(labels)} labels")
    x = np.repeat(images[:, None], in_chans, axis=1)  # also the writable copy torch needs (frombuffer's is read-only)
    return torch.from_numpy(x), torch.from_numpy(labels.astype(np.int64))


def read_digits(split: str, img_size: int = 16, seed: int = 0):
    """scikit-learn's 1,797 handwritten digits (8x8, values 0..16), upsampled bilinearly to
    ``img_size`` and split 80/20 (stratified, fixed seed) into train/test."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = torch.from_numpy(d.images.astype(np.float32) / 16.0)[:, None]
    if img_size != 8:
        x = torch.nn.functional.interpolate(x, size=(img_size, img_size), mode="bilinear", align_corners=False)
    x = (x.clamp(0, 1) * 255).round().to(torch.uint8)
    y = torch.from_numpy(d.target.astype(np.int64))
    idx_tr, idx_te = train_test_split(np.arange(len(y)), test_size=0.2, random_state=seed, stratify=d.target)
    idx = idx_tr if split == "train" else idx_te
    return x[idx], y[idx]


def list_image_folder(root: str):
    """``root/<class>/<file>`` -> (paths, labels, class names); sorted for determinism."""
    r = Path(root)
    if not r.exists():
        raise DataError(f"data path not found: {root}")
    if not r.is_dir():
        raise DataError(f"data path {root} is a file, not a folder (an image folder holds <class>/<image> files)")
    classes = sorted(p.name for p in r.iterdir() if p.is_dir())
    paths, labels = [], []
    for ci, c in enumerate(classes):
        for f in sorted((r / c).rglob("*")):
            if f.suffix.lower() in IMG_EXT and f.is_file():  # not a FIFO or a device that would block a read
                paths.append(str(f))
                labels.append(ci)
    if not paths:
        raise DataError(f"data path '{root}' is empty (no images in <class>/ sub-folders)")
    return paths, labels, classes


def read_image_folder(root: str, in_chans=3, img_size=None, limit=0, counter=None):
    """Decode a (small) ImageFolder tree into memory, resizing to ``img_size`` when given."""
    from PIL import Image

    counter = counter or CorruptCounter(unit="file")
    paths, labels, _ = list_image_folder(root)
    counter.shards_total = len(paths)
    xs, ys = [], []
    for p, y in zip(paths, labels):
        try:
            with Image.open(io.BytesIO(read_file(p))) as im:
                im = im.convert("L" if in_chans == 1 else "RGB")
                if img_size:
                    im = im.resize((img_size, img_size), Image.BICUBIC)
                a = np.asarray(im, dtype=np.uint8)
        except Exception as e:  # a stop request (a signal) is no damaged file: it passes
            if not is_decode_error(e):
                raise
            counter.add(f"{p}: {type(e).__name__}", p, key=p, files=[p])
            continue
        xs.append(a[None] if a.ndim == 2 else a.transpose(2, 0, 1))
        ys.append(y)
        if limit and len(xs) >= limit:
            break
    if not xs:
        raise DataError(f"no readable images under '{root}' ({counter.count} corrupt)")
    return torch.from_numpy(np.stack(xs)), torch.tensor(ys, dtype=torch.int64), counter
