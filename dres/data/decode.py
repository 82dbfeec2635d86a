"""How encoded image bytes become the pixels of a batch: on the CPU in the loader's workers, or on the GPU.

A file-reading loader works in two halves:

* **In a worker** (:class:`SamplePrep`): the image's header is read (size, format, colour mode), its
  crop box and flip (and, with ``jitter``, its colour jitter's factors and order) are drawn from the
  sample's own seed (torchvision's RandomResizedCrop, so a sample's crop depends on ``(seed, epoch,
  index)`` alone and a resumed run sees the same batches),
  then either the encoded bytes are kept for the GPU (``decode=gpu``: a baseline RGB or greyscale JPEG)
  or the image is decoded on the CPU (libjpeg-turbo through ``torchvision.io``, PIL for other formats and
  CMYK), cropped and resized once to ``size`` x ``size`` uint8. Progressive JPEGs are decoded here too:
  neither the hardware decoders nor nvJPEG's batched GPU path take them, and nvJPEG's fallback decodes
  their Huffman stage on the CPU of the calling thread, the training process's. :func:`collate_prepared`
  packs a batch into a few tensors: one buffer of all encoded bytes, one stack of pixels.
* **In the training process** (:class:`BatchFinisher`): the packed bytes are decoded on the GPU in one
  batched call (torchvision's nvJPEG, else nvImageCodec, which reaches the hardware JPEG decoders, or nvJPEG
  called directly with its memory pools, :mod:`dres.data.nvjpeg`), the
  crop, resize, flip and normalisation of the whole batch is one kernel
  (:func:`dres.kernels.crop_resize.crop_resize_forward`, ``torchvision.ops.roi_align``'s arithmetic), the
  CPU-made pixels are normalised on the GPU, and the rows are put back in the batch's order; a batch
  drawn with colour jitter is jittered there, on pixels in [0, 1], before its normalisation. An image
  the GPU cannot decode is decoded on the CPU there; one nobody can decode is a lost sample. The finisher's
  streams run at the GPU's highest priority (:func:`stream_priority`), so its kernels and copies go before
  the running step's, and it counts the path each image took (:data:`DECODE_PATHS`).

Workers ignore SIGTERM and SIGINT (:func:`worker_init`): a signal to the whole process group (what
Slurm, Kubernetes and ``timeout`` send) is the training process's to act on, which finishes its step,
saves and exits; its workers end with it.
"""

from __future__ import annotations

import importlib
import io
import math
import os
import random
import signal
import stat
import statistics
import struct
import time
import warnings
import zlib
from collections import Counter
from contextlib import contextmanager, suppress
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from dres.data.augment import color_jitter, jitter_params, to_device


def decode_errors() -> tuple:
    """The exceptions a damaged or unsupported image raises while it is read or decoded."""
    from PIL import Image

    return (OSError, ValueError, SyntaxError, EOFError, struct.error, zlib.error, Image.DecompressionBombError)


def is_decode_error(e: BaseException) -> bool:
    # torchvision's decoders raise a plain RuntimeError; subclasses of it (a stop request) are not damage
    return isinstance(e, decode_errors()) or type(e) is RuntimeError


def read_file(path: str) -> bytes:
    """The bytes of a regular file; anything else (a FIFO, a device, a socket named ``*.jpg``) is a
    ``ValueError`` at once, since opening it non-blocking never waits for a writer."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


@contextmanager
def _quiet_torchvision():
    """torchvision 0.29 warns on every decode that its image decoders are deprecated (for torchcodec's)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities of TorchVision",
                                category=DeprecationWarning)
        yield


def worker_init(_worker_id: int) -> None:
    """DataLoader workers leave SIGTERM and SIGINT to the training process (see the module doc)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def crop_box(width: int, height: int, rng: random.Random, aug: str, scale=(0.2, 1.0), ratio=(3 / 4, 4 / 3),
             crop_pct: float = 1.0):
    """``(left, top, w, h), flip`` of one image: ``aug="rrc_flip"`` torchvision's RandomResizedCrop draw
    (area uniform in ``scale``, log aspect uniform in ``log(ratio)``, 10 tries, rounded to pixels) and a
    flip with probability 1/2; ``"flip"`` the centred square and the flip; ``"none"`` the centred square.
    Where no try fits, the centred square. The centred square's side is ``crop_pct`` of the shorter side
    (timm's evaluation crop: resize to ``size / crop_pct``, then the centre ``size``)."""
    if aug == "rrc_flip":
        for _ in range(10):
            area = width * height * rng.uniform(*scale)
            r = math.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1])))
            w, h = int(round(math.sqrt(area * r))), int(round(math.sqrt(area / r)))
            if 0 < w <= width and 0 < h <= height:
                top, left = rng.randint(0, height - h), rng.randint(0, width - w)
                return (left, top, w, h), rng.random() < 0.5
    side = max(1, round(min(width, height) * crop_pct))
    box = ((width - side) // 2, (height - side) // 2, side, side)
    return box, aug != "none" and rng.random() < 0.5


def import_cpu_decoder() -> None:
    """Import the CPU decoder (``torchvision.io``) here: DataLoader workers forked from this process then have it,
    instead of each importing it (seconds) as it starts, at every epoch of streamed shards."""
    with suppress(ImportError):
        importlib.import_module("torchvision.io")


def _decode_cpu(data: bytes, mode: str, jpeg: bool, in_chans: int) -> torch.Tensor:
    """uint8 (C, H, W) with the memory of (H, W, C), so that a crop's resize takes torch's channels-last
    uint8 path: libjpeg-turbo (``torchvision.io``) for RGB and greyscale JPEGs, PIL otherwise."""
    if jpeg and mode in ("RGB", "L"):
        try:
            from torchvision.io import ImageReadMode, decode_jpeg
        except ImportError:
            pass
        else:
            read_mode = ImageReadMode.GRAY if in_chans == 1 else ImageReadMode.RGB
            with _quiet_torchvision():
                return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=read_mode)
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        a = np.array(im.convert("L" if in_chans == 1 else "RGB"), dtype=np.uint8)
    return torch.from_numpy(a.reshape(a.shape[0], a.shape[1], -1)).permute(2, 0, 1)


def crop_resize_cpu(image: torch.Tensor, box, flip: bool, size: int) -> torch.Tensor:
    """uint8 (C, H, W) -> the crop ``box`` resized to uint8 (C, size, size) (bilinear, antialiased), flipped."""
    left, top, w, h = box
    crop = image[None, :, top:top + h, left:left + w]
    out = F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False)[0]
    return out.flip(-1) if flip else out


@dataclass(frozen=True)
class SamplePrep:
    """What a worker makes of one sample's bytes (module doc): ``gpu`` keeps the JPEGs the GPU decoders take
    encoded, but for ``cpu_share`` of them (drawn from each sample's seed, after its crop), which it decodes."""

    size: int
    in_chans: int = 3
    aug: str = "rrc_flip"
    crop_min: float = 0.2
    gpu: bool = False
    jitter: float = 0.0  # timm's --color-jitter strength (brightness, contrast, saturation); 0: none
    crop_pct: float = 1.0  # the centred crop's share of the shorter side where aug does not crop at random
    cpu_share: float = 0.0

    def __call__(self, data: bytes, seed: int):
        """``("jpeg", bytes, box, flip, jitter)`` for the GPU, or ``("pixels", uint8 (C, size, size), box, flip,
        jitter)``; ``jitter`` is None, or the 3 factors and the order of :func:`~dres.data.augment.jitter_params`."""
        from PIL import Image

        with Image.open(io.BytesIO(data)) as im:
            (width, height), fmt, mode = im.size, im.format, im.mode
            progressive = bool(im.info.get("progressive") or im.info.get("progression"))
        rng = random.Random(seed)
        box, flip = crop_box(width, height, rng, self.aug, (self.crop_min, 1.0), crop_pct=self.crop_pct)
        jitter = self._jitter(seed) if self.jitter else None
        jpeg = fmt in ("JPEG", "MPO")
        gpu_takes = self.gpu and jpeg and not progressive and mode in ("RGB", "L") and self.in_chans == 3
        if gpu_takes and rng.random() >= self.cpu_share:
            return "jpeg", data, box, flip, jitter
        pixels = crop_resize_cpu(_decode_cpu(data, mode, jpeg, self.in_chans), box, flip, self.size)
        return "pixels", pixels, box, flip, jitter

    def _jitter(self, seed: int) -> tuple:
        """The in-memory loader's ColorJitter draw (:func:`~dres.data.augment.jitter_params`) for this one image,
        from its seed: its 3 factors, then the order it applies them in."""
        factors, order = jitter_params(1, np.random.default_rng(seed), self.jitter)
        return (*factors[0].tolist(), *order[0].tolist())


def prepare(prep: SamplePrep, data: bytes, seed: int, label: int, name: str):
    """One prepared sample for :func:`collate_prepared`: ``(kind, payload, box, flip, jitter, label, lost)``;
    an image that cannot be read is ``lost`` (``"<name>: <error type>"``), never an exception."""
    try:
        return (*prep(data, seed), label, "")
    except Exception as e:
        if not is_decode_error(e):
            raise
        return lost_sample(label, name, e)


def lost_sample(label: int, name: str, error: BaseException):
    """The prepared form of a sample that could not be read or decoded (:func:`prepare`)."""
    return None, None, None, False, None, label, f"{name}: {type(error).__name__}"


def collate_prepared(samples: list) -> dict:
    """Prepared samples -> one batch of a few tensors: the JPEGs' bytes in one buffer (``jpeg_bytes``,
    ``jpeg_lengths``), their boxes and flips, the CPU-made pixels stacked, each with its row in the
    batch (``jpeg_rows``, ``pixel_rows``), the labels of the samples kept, their colour jitter (``jitter``:
    (kept, 6) factors then order, or None) and the lost samples' names."""
    kept = [s for s in samples if s[0] is not None]
    jpegs = [(row, s) for row, s in enumerate(kept) if s[0] == "jpeg"]
    pixels = [(row, s) for row, s in enumerate(kept) if s[0] == "pixels"]
    payload = b"".join(s[1] for _, s in jpegs)
    return {
        "labels": torch.tensor([s[5] for s in kept], dtype=torch.int64),
        "jitter": (torch.tensor([s[4] for s in kept], dtype=torch.float32)
                   if kept and kept[0][4] is not None else None),
        "jpeg_rows": torch.tensor([row for row, _ in jpegs], dtype=torch.int64),
        "jpeg_bytes": torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8),
        "jpeg_lengths": torch.tensor([len(s[1]) for _, s in jpegs], dtype=torch.int64),
        "jpeg_boxes": torch.tensor([s[2] for _, s in jpegs], dtype=torch.float32).reshape(-1, 4),
        "jpeg_flips": torch.tensor([s[3] for _, s in jpegs], dtype=torch.int64),
        "pixel_rows": torch.tensor([row for row, _ in pixels], dtype=torch.int64),
        "pixels": torch.stack([s[1] for _, s in pixels]) if pixels else None,
        "lost": [s[6] for s in samples if s[0] is None],
    }


def cgroup_cpu_limit() -> float | None:
    """The CPUs a period the process's cgroup may use (a container's CPU limit), None where there is no limit."""
    for quota_file, period_file in (("/sys/fs/cgroup/cpu.max", None),  # cgroup v2: "QUOTA PERIOD" or "max PERIOD"
                                    ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us")):
        try:
            fields = open(quota_file).read().split()
            quota, period = fields[0], fields[1] if period_file is None else open(period_file).read().strip()
            return None if quota == "max" or int(quota) <= 0 else int(quota) / int(period)
        except (OSError, ValueError, IndexError):
            continue
    return None


def cores_per_process() -> int:
    """The CPU cores this process may use (its affinity, within its cgroup's CPU limit), shared by the processes
    of its node (torchrun's ``LOCAL_WORLD_SIZE``). A rank pinned to cores of its own is undercounted."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    if limit is not None:
        cores = min(cores, max(int(limit), 1))
    return max(cores // max(int(os.environ.get("LOCAL_WORLD_SIZE") or 1), 1), 1)


GPU_DECODERS = ("torchvision", "nvimgcodec", "nvjpeg")  # in the order auto tries them


def gpu_decoder_installed(backend: str) -> bool:
    """Whether the library of GPU decoder ``backend`` (one of :data:`GPU_DECODERS`) imports, or, for nvjpeg, loads."""
    try:
        if backend == "nvjpeg":
            from dres.data.nvjpeg import load_nvjpeg

            load_nvjpeg()
        else:
            importlib.import_module({"torchvision": "torchvision.io", "nvimgcodec": "nvidia.nvimgcodec"}[backend])
    except (ImportError, OSError):
        return False
    return True


def gpu_decode_backend(device, choose: str = "auto") -> str | None:
    """The GPU decoder for ``device``: ``"torchvision"`` (its batched nvJPEG, which takes the GPU's hardware JPEG
    decoders for baseline JPEGs where it has them), ``"nvimgcodec"``
    (the hardware JPEG decoders where the GPU has them, and nvJPEG), ``"nvjpeg"`` (libnvjpeg called directly:
    :mod:`dres.data.nvjpeg`), the first of them installed with ``choose="auto"`` (torchvision's fed the ViT-B/16
    trainer faster: BENCHMARKS.md), or None (no CUDA device, or the decoder chosen is not installed)."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return None
    return next((b for b in GPU_DECODERS if choose in ("auto", b) and gpu_decoder_installed(b)), None)


def nvimgcodec_decoders(device_index: int, hw_load: float):
    """Two nvImageCodec decoders, ``(hardware, cuda)``: the GPU's hardware JPEG decoders alone (None with
    ``hw_load`` 0), and nvJPEG on the CUDA cores, then its CPU-assisted path (progressive files). Two rather than
    one of both backends, so that the path each image took is known (:data:`DECODE_PATHS`)."""
    from nvidia import nvimgcodec

    kind = nvimgcodec.BackendKind
    hardware = (nvimgcodec.Decoder(device_id=device_index, backends=[nvimgcodec.Backend(kind.HW_GPU_ONLY)])
                if hw_load > 0 else None)
    cuda = nvimgcodec.Decoder(device_id=device_index, backends=[nvimgcodec.Backend(kind.GPU_ONLY),
                                                                nvimgcodec.Backend(kind.HYBRID_CPU_GPU)])
    return hardware, cuda


def stream_priority(high: bool) -> int:
    """The priority of the streams that finish batches on the current CUDA device: its highest with ``high`` (the
    lowest number of ``torch.cuda.Stream.priority_range()``), so their kernels and copies are scheduled before the
    running step's; else the default, 0."""
    return min(torch.cuda.Stream.priority_range()) if high else 0


# where an image of a batch was decoded, as the finisher counts it (``paths``) and the loaders' epoch line words it
DECODE_PATHS = {
    "hardware": "by the GPU's hardware JPEG decoders",
    "cuda": "by nvJPEG on the CUDA cores",
    "cuda_one": "one at a time by nvJPEG on the CUDA cores (refused by a batched call)",
    "nvjpeg": "by torchvision's batched nvJPEG (the hardware decoders for baseline JPEGs where the GPU has them)",
    "cpu_fallback": "on the CPU of the training process (refused by the GPU decoder)",
    "workers": "on the CPU by the workers",
}


def decode_paths_line(epoch: int, counts: dict, finishing: list | None = None) -> str:
    """The run log's line of where an epoch's images were decoded (``counts``: :data:`DECODE_PATHS` keys) and,
    where the GPU decoded some (``finishing``: a dict a batch of the epoch, its ``finish_s``, ``decode_s`` and
    ``finish_cpu_s``, see :class:`BatchFinisher`), how long the training process took to finish a batch, its decode
    call to decode it and the finishing thread's CPU to do its part (the rest of the batch's time it waited: for
    the GPU, or for the interpreter's lock while the step's thread held it). Medians over the epoch's batches: the
    first ones, finished ahead while the step compiles, take longer than the run's steady ones."""
    parts = [f"{counts[k]:,} {words}" for k, words in DECODE_PATHS.items() if counts.get(k)]
    line = f"[dres] data: epoch {epoch}, {sum(counts.values()):,} images decoded: " + "; ".join(parts)
    if finishing and any(batch.get("decode_s") for batch in finishing):
        ms = {k: 1e3 * statistics.median(batch.get(k, 0.0) for batch in finishing)
              for k in ("finish_s", "decode_s", "finish_cpu_s")}
        line += (f"; a batch finished in {ms['finish_s']:.1f} ms, {ms['decode_s']:.1f} of them in the GPU decode call, "
                 f"{ms['finish_cpu_s']:.1f} on the finishing thread's CPU (median of {len(finishing):,} batches)")
    return line


# Each decoder's share of a batch for the hardware JPEG decoders where data.hw_decode_load is -1: the one that fed the
# ViT-B/16 MAE trainer faster with 8 cores (BENCHMARKS.md, "Real images")
HW_DECODE_LOAD = {"nvimgcodec": 0.65, "nvjpeg": 1.0}


class BatchFinisher:
    """The training process's half (module doc): a collated batch -> ``{"image": float (B, C, size, size)
    normalised on the device, "label": (B,)}``. ``backend`` is the GPU decoder (:func:`gpu_decode_backend`)
    for batches holding JPEG bytes, None when every sample comes as pixels. GPU work runs on a stream of
    its own, at the GPU's highest priority with ``high_priority`` (:attr:`priority`, which the thread finishing
    batches ahead takes for its stream too); the tensors returned are ready on the caller's current stream.
    ``hw_load``: the hardware JPEG decoders' share of each batch (``data.hw_decode_load``; negative: the decoder's
    own, :data:`HW_DECODE_LOAD`)."""

    def __init__(self, device, size: int, channels: int, mean=None, std=None, backend: str | None = None,
                 hw_load: float = -1.0, high_priority: bool = True):
        self.device, self.size, self.channels, self.backend = torch.device(device), size, channels, backend
        self.high_priority, self.priority = high_priority, 0
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            with torch.cuda.device(self.device):
                self.priority = stream_priority(high_priority)
        self.hw_load = HW_DECODE_LOAD.get(backend, 0.0) if hw_load < 0 else hw_load
        mean = torch.tensor((mean or [0.0] * channels)[:channels], dtype=torch.float32)
        std = torch.tensor((std or [1.0] * channels)[:channels], dtype=torch.float32)
        # (v / 255 - mean) / std = v * scale + shift; a jittered batch is made in [0, 1] first (v / 255)
        self.scale = (1.0 / (255.0 * std)).to(self.device)
        self.shift = (-mean / std).to(self.device)
        self.unit_scale = torch.full((channels,), 1.0 / 255.0, device=self.device)
        self.no_shift = torch.zeros(channels, device=self.device)
        self.mean, self.std = mean.to(self.device), std.to(self.device)
        self.stream = torch.cuda.Stream(self.device, priority=self.priority) if backend else None
        # made at first use: nvImageCodec's (nvimgcodec_decoders) and the thread running the CUDA one beside, or
        # the nvJPEG decoder (dres.data.nvjpeg) of this finisher's thread
        self._decoders = None
        self.decode_s = 0.0  # the host's time in the GPU decoder's calls, waits included, over the finisher's life

    def replica(self) -> "BatchFinisher":
        """A finisher like this one with a stream and decoders of its own, for another thread finishing batches at
        the same time."""
        return BatchFinisher(self.device, self.size, self.channels, self.mean.tolist(), self.std.tolist(), self.backend,
                             self.hw_load, self.high_priority)

    def __call__(self, batch: dict, lost: list, paths: Counter | None = None) -> dict | None:
        """``lost`` gets the names of images nobody could decode, ``paths`` (where given) the count of images
        each path decoded (:data:`DECODE_PATHS`); None when the whole batch is lost."""
        paths = Counter() if paths is None else paths
        jitter = batch.get("jitter")
        scale, shift = (self.unit_scale, self.no_shift) if jitter is not None else (self.scale, self.shift)
        rows = [batch["pixel_rows"]]
        parts = []
        if batch["pixels"] is not None:
            parts.append(self._normalised(batch["pixels"], scale, shift))
            paths["workers"] += len(batch["pixels"])
        if len(batch["jpeg_rows"]):
            decoded_rows, decoded, cpu_rows, cpu_pixels = self._decode_jpegs(batch, lost, scale, shift, paths)
            rows += [decoded_rows, cpu_rows]
            parts += [decoded, cpu_pixels]
        order = torch.cat(rows)
        if not len(order):
            return None
        images = torch.cat([p for p in parts if p is not None])
        keep = torch.argsort(order)  # rows of the samples kept, in the batch's order
        images = images[to_device(keep, self.device)]
        if jitter is not None:
            j = to_device(jitter[order[keep]], self.device)
            images = color_jitter(images, j[:, :3], j[:, 3:].long())
            images = (images - self.mean.view(1, -1, 1, 1)) / self.std.view(1, -1, 1, 1)
        return {"image": images, "label": to_device(batch["labels"][order[keep]], self.device)}

    def _decode_jpegs(self, batch, lost, scale, shift, paths):
        data, lengths = batch["jpeg_bytes"], batch["jpeg_lengths"].tolist()
        starts = np.cumsum([0] + lengths[:-1]).tolist()
        encoded = [data[s:s + n] for s, n in zip(starts, lengths)]
        caller = torch.cuda.current_stream(self.device)
        # the inputs are host tensors: the decode waits for nothing queued on the caller's stream (the running step)
        with torch.cuda.stream(self.stream):
            start = time.perf_counter()
            images, taken = self._decode(encoded)
            self.decode_s += time.perf_counter() - start
            paths.update(path for path in taken if path is not None)
            ok = [i for i, im in enumerate(images) if im is not None]
            decoded = None
            if ok:
                decoded = self._crop_resize([images[i] for i in ok], batch["jpeg_boxes"][ok], batch["jpeg_flips"][ok],
                                            scale, shift)
        caller.wait_stream(self.stream)
        if decoded is not None:
            decoded.record_stream(caller)
        jpeg_rows = batch["jpeg_rows"]
        refused = [i for i, im in enumerate(images) if im is None]
        cpu_rows, cpu_pixels = [], []
        for i in refused:  # rare: a JPEG the GPU decoder cannot do, decoded here
            box = tuple(int(v) for v in batch["jpeg_boxes"][i].tolist())
            try:
                pixels = crop_resize_cpu(_decode_cpu(bytes(encoded[i].numpy()), "", False, self.channels), box,
                                         bool(batch["jpeg_flips"][i]), self.size)
            except Exception as e:
                if not is_decode_error(e):
                    raise
                lost.append(f"a JPEG of the batch: {type(e).__name__}")
                continue
            paths["cpu_fallback"] += 1
            cpu_rows.append(int(jpeg_rows[i]))
            cpu_pixels.append(pixels)
        fallback = self._normalised(torch.stack(cpu_pixels), scale, shift) if cpu_pixels else None
        return (jpeg_rows[ok] if ok else jpeg_rows[:0], decoded, torch.tensor(cpu_rows, dtype=torch.int64), fallback)

    def _normalised(self, pixels: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        """Host uint8 (B, C, size, size) -> float on the device, ``v * scale + shift``."""
        return to_device(pixels, self.device).float() * scale.view(1, -1, 1, 1) + shift.view(1, -1, 1, 1)

    def _crop_resize(self, images: list, boxes: torch.Tensor, flips: torch.Tensor, scale: torch.Tensor,
                     shift: torch.Tensor) -> torch.Tensor:
        """Decoded (C, H, W) images of any sizes -> one buffer in each image's own memory order (HWC or
        CHW), then the batch's crop, resize, flip and normalisation in one kernel."""
        from dres.kernels.crop_resize import crop_resize_forward

        meta, dense, offset = [], [], 0
        for im, flip in zip(images, flips.tolist()):
            c, h, w = im.shape
            if im.stride(0) == 1 and c > 1:  # HWC memory (nvImageCodec's images)
                d, strides = im.permute(1, 2, 0).contiguous(), (w * c, c, 1)
            else:
                d, strides = im.contiguous(), (w, 1, h * w)
            meta.append((offset, h, w, *strides, flip))
            dense.append(d)
            offset += d.numel()
        src = torch.cat([d.reshape(-1) for d in dense])
        return crop_resize_forward(src, to_device(torch.tensor(meta, dtype=torch.int64), self.device),
                                   to_device(boxes, self.device), scale, shift, self.size, self.channels)

    def _decode(self, encoded: list) -> tuple[list, list]:
        """Each JPEG as a uint8 CUDA tensor (C, H, W) (any strides), None where the decoder refused it, and the
        path that decoded it (:data:`DECODE_PATHS`; None where refused)."""
        if self.backend == "nvimgcodec":
            return self._decode_nvimgcodec(encoded)
        if self.backend == "nvjpeg":
            if self._decoders is None:
                from dres.data.nvjpeg import NvjpegBatchDecoder

                self._decoders = NvjpegBatchDecoder(self.device, self.hw_load)
            return self._decoders.decode(encoded)
        from torchvision.io import ImageReadMode, decode_jpeg

        with _quiet_torchvision():
            try:
                out = decode_jpeg(encoded, device=self.device, mode=ImageReadMode.RGB)
            except RuntimeError:  # one bad image fails the batch: find it
                out = []
                for t in encoded:
                    try:
                        out.append(decode_jpeg(t, device=self.device, mode=ImageReadMode.RGB))
                    except RuntimeError:
                        out.append(None)
        return out, [None if im is None else "nvjpeg" for im in out]

    def _decode_nvimgcodec(self, encoded: list) -> tuple[list, list]:
        """The first ``hw_load`` of the batch by the hardware decoders while, in a thread beside, the rest goes to
        nvJPEG on the CUDA cores (DALI's ``hw_decoder_load``); what the hardware refused then goes there too."""
        from concurrent.futures import ThreadPoolExecutor

        from nvidia import nvimgcodec

        if self._decoders is None:
            self._decoders = (*nvimgcodec_decoders(self.device.index, self.hw_load),
                              ThreadPoolExecutor(1, thread_name_prefix="dres-nvjpeg-cuda"))
        hardware, cuda, beside = self._decoders
        streams = [nvimgcodec.CodeStream(t.numpy()) for t in encoded]
        n_hw = round(self.hw_load * len(streams)) if hardware is not None else 0
        out, taken = [None] * len(streams), [None] * len(streams)

        def decode(decoder, rows):
            return rows, (decoder.decode([streams[i] for i in rows], cuda_stream=self.stream.cuda_stream)
                          if rows else [])

        def keep(decoded, path):  # in this thread, whose current stream (this one) the tensors are handed to
            for i, im in zip(*decoded):
                if im is not None:
                    out[i], taken[i] = torch.from_dlpack(im).permute(2, 0, 1), path

        rest = beside.submit(decode, cuda, list(range(n_hw, len(streams))))
        if n_hw:
            keep(decode(hardware, list(range(n_hw))), "hardware")
        keep(rest.result(), "cuda")
        refused = [i for i in range(n_hw) if out[i] is None]
        if refused:
            keep(decode(cuda, refused), "cuda")
        return out, taken
