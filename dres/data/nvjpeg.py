"""nvJPEG's batched decode called directly (ctypes), for the GPU decode of :class:`dres.data.decode.BatchFinisher`
(``data.gpu_decoder=nvjpeg``).

torchvision's and torchcodec's GPU decoders create nvJPEG with its default allocators and no memory pools;
:class:`NvjpegBatchDecoder` creates it with ``NVJPEG_FLAGS_ENABLE_MEMORY_POOLS`` (buffers kept and reused), decodes on
the caller's stream, waits for that stream only, and writes every image of a batch into one buffer from PyTorch's
caching allocator. A batch's JPEGs are split as DALI's ``hw_decoder_load`` splits them: a share to the hardware
decoders in one batched call (``nvjpegDecodeBatched``, hardware backend), the rest at the same time to one batched
call on the CUDA cores (GPU_HYBRID backend), what either refused one at a time (``nvjpegDecode``).
The library is ``libnvjpeg.so.13`` (or ``.12``) from the ``nvidia-nvjpeg`` wheel, torchvision's bundled copy or the
system's; :func:`load_nvjpeg` says in one line where it looked when none is found.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import os
import site
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

NVJPEG_MAX_COMPONENT = 4
BACKEND_DEFAULT, BACKEND_GPU_HYBRID, BACKEND_HARDWARE = 0, 2, 3  # nvjpegBackend_t
FLAGS_ENABLE_MEMORY_POOLS = 1 << 1
OUTPUT_RGB = 3  # nvjpegOutputFormat_t: planar R, G, B
STATUS_ARCH_MISMATCH = 7  # no hardware decoder on this GPU
STATUS_NAMES = {1: "NOT_INITIALIZED", 2: "INVALID_PARAMETER", 3: "BAD_JPEG", 4: "JPEG_NOT_SUPPORTED",
                5: "ALLOCATOR_FAILURE", 6: "EXECUTION_FAILED", 7: "ARCH_MISMATCH", 8: "INTERNAL_ERROR",
                9: "IMPLEMENTATION_NOT_SUPPORTED", 10: "INCOMPLETE_BITSTREAM"}
LIBRARY_NAMES = ("libnvjpeg.so.13", "libnvjpeg.so.12")


class NvjpegImage(ctypes.Structure):
    """``nvjpegImage_t``: a device pointer and a pitch for each of up to four planes."""
    _fields_ = [("channel", ctypes.c_void_p * NVJPEG_MAX_COMPONENT), ("pitch", ctypes.c_size_t * NVJPEG_MAX_COMPONENT)]


class NvjpegError(RuntimeError):
    """A call of nvJPEG that did not return NVJPEG_STATUS_SUCCESS."""


def library_candidates() -> list[str]:
    """Where :func:`load_nvjpeg` looks, in order: the nvidia-nvjpeg wheel (cu13, then cu12 layouts), torchvision's
    bundled copy, then the names the dynamic loader resolves."""
    roots = [*site.getsitepackages(), site.getusersitepackages(), *sys.path]
    patterns = ("nvidia/cu13/lib/libnvjpeg.so.1*", "nvidia/nvjpeg/lib/libnvjpeg.so.1*",
                "torchvision.libs/libnvjpeg*.so*")
    found = [path for root in dict.fromkeys(r for r in roots if r and os.path.isdir(r))
             for pattern in patterns for path in sorted(glob.glob(os.path.join(root, pattern)))]
    system = ctypes.util.find_library("nvjpeg")
    return list(dict.fromkeys(found + list(LIBRARY_NAMES) + ([system] if system else [])))


@functools.cache
def load_nvjpeg() -> ctypes.CDLL:
    """libnvjpeg, loaded once; an OSError naming where it looked when no candidate loads."""
    tried = library_candidates()
    for path in tried:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        _declare(lib)
        return lib
    raise OSError(f"data.gpu_decoder=nvjpeg needs libnvjpeg (pip install nvidia-nvjpeg); tried {', '.join(tried)}")


def _declare(lib: ctypes.CDLL) -> None:
    """The argument types of the calls used (every one returns an nvjpegStatus_t, an int)."""
    p, size, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    pi = ctypes.POINTER(ctypes.c_int)
    signatures = {
        "nvjpegCreateEx": (i, p, p, ctypes.c_uint, ctypes.POINTER(p)),
        "nvjpegJpegStateCreate": (p, ctypes.POINTER(p)),
        "nvjpegJpegStreamCreate": (p, ctypes.POINTER(p)),
        "nvjpegGetImageInfo": (p, p, size, pi, pi, pi, pi),
        "nvjpegJpegStreamParseHeader": (p, p, size, p),
        "nvjpegDecodeBatchedSupported": (p, p, pi),
        "nvjpegDecodeBatchedInitialize": (p, p, i, i, i),
        "nvjpegDecodeBatched": (p, p, ctypes.POINTER(p), ctypes.POINTER(size), ctypes.POINTER(NvjpegImage), p),
        "nvjpegDecode": (p, p, p, size, i, ctypes.POINTER(NvjpegImage), p),
    }
    for name, args in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int


def check(status: int, call: str) -> None:
    if status != 0:
        raise NvjpegError(f"{call} failed: NVJPEG_STATUS_{STATUS_NAMES.get(status, status)}")


class NvjpegBatchDecoder:
    """nvJPEG's handles (with memory pools) and their states, for the thread that owns them on ``device``:
    :meth:`decode` turns a batch of JPEG bytes into RGB images on the device. ``hw_load`` (``data.hw_decode_load``) is
    the share of each batch's JPEGs that the hardware decoders take (where the GPU has them; 0 leaves them unused) in
    one batched call; the rest go at the same time, from a thread beside, to one batched call of nvJPEG on the CUDA
    cores (its GPU-assisted Huffman decode), and what a batched call refused, one at a time."""

    def __init__(self, device: torch.device, hw_load: float):
        self.lib, self.device, self.hw_load = load_nvjpeg(), torch.device(device), hw_load
        with torch.cuda.device(self.device):
            # a handle a backend: the hardware backend's takes batched calls alone, GPU_HYBRID's batched calls decode
            # on the GPU, and the one-at-a-time calls go to the default backend's
            self.single_handle = self._handle(BACKEND_DEFAULT)
            self.cuda_handle = self._handle(BACKEND_GPU_HYBRID)
            self.hardware_handle = self._handle(BACKEND_HARDWARE) if hw_load > 0 else None
            self.single_state = self._create("nvjpegJpegStateCreate", self.single_handle)
            self.cuda_state = self._create("nvjpegJpegStateCreate", self.cuda_handle)
            self.hardware_state = self.parsed = None
            if self.hardware_handle is not None:
                self.hardware_state = self._create("nvjpegJpegStateCreate", self.hardware_handle)
                self.parsed = self._create("nvjpegJpegStreamCreate", self.hardware_handle)
        self.beside = ThreadPoolExecutor(1, thread_name_prefix="dres-nvjpeg-cuda")

    def _handle(self, backend: int) -> ctypes.c_void_p | None:
        """A library handle with memory pools on ``backend``; None where the GPU has no hardware decoder."""
        handle = ctypes.c_void_p()
        status = self.lib.nvjpegCreateEx(backend, None, None, FLAGS_ENABLE_MEMORY_POOLS, ctypes.byref(handle))
        if backend == BACKEND_HARDWARE and status == STATUS_ARCH_MISMATCH:
            return None
        check(status, "nvjpegCreateEx")
        return handle

    def _create(self, call: str, handle: ctypes.c_void_p) -> ctypes.c_void_p:
        out = ctypes.c_void_p()
        check(getattr(self.lib, call)(handle, ctypes.byref(out)), call)
        return out

    def _shape(self, data: torch.Tensor) -> tuple[int, int] | None:
        """(height, width) from the JPEG's header, None where nvJPEG cannot read it."""
        comps, subsampling = ctypes.c_int(), ctypes.c_int()
        widths, heights = (ctypes.c_int * NVJPEG_MAX_COMPONENT)(), (ctypes.c_int * NVJPEG_MAX_COMPONENT)()
        status = self.lib.nvjpegGetImageInfo(self.single_handle, data.data_ptr(), data.numel(), ctypes.byref(comps),
                                             ctypes.byref(subsampling), widths, heights)
        return (heights[0], widths[0]) if status == 0 and heights[0] > 0 and widths[0] > 0 else None

    def _hardware_takes(self, data: torch.Tensor) -> bool:
        """Whether the hardware decoders take this JPEG (baseline, a layout they support)."""
        if self.hardware_handle is None or self.lib.nvjpegJpegStreamParseHeader(
                self.hardware_handle, data.data_ptr(), data.numel(), self.parsed) != 0:
            return False
        unsupported = ctypes.c_int(1)
        status = self.lib.nvjpegDecodeBatchedSupported(self.hardware_handle, self.parsed, ctypes.byref(unsupported))
        return status == 0 and unsupported.value == 0

    def decode(self, encoded: list[torch.Tensor]) -> tuple[list, list]:
        """``encoded``: 1-D uint8 host tensors (contiguous; pinned for speed). Returns each image as a (3, H, W) uint8
        view into one device buffer, or None where nvJPEG refused it, and the path that decoded it ("hardware",
        "cuda" or "cuda_one", as :data:`dres.data.decode.DECODE_PATHS` words them; None where refused). The work
        runs on the current stream of ``device``, which it waits for: before (the hardware decoders do not wait for
        work queued on it) and after, so the images are ready. A batched call that fails (one bad file fails it) is
        done again one image at a time."""
        with torch.cuda.device(self.device):
            shapes = [self._shape(t) for t in encoded]
            sizes = [0 if s is None else 3 * s[0] * s[1] for s in shapes]
            buffer = torch.empty(max(sum(sizes), 1), dtype=torch.uint8, device=self.device)
            images, outputs, offset = [None] * len(encoded), [None] * len(encoded), 0
            for k, shape in enumerate(shapes):
                if shape is not None:
                    h, w = shape
                    images[k] = buffer[offset:offset + sizes[k]].view(3, h, w)
                    offset += sizes[k]
                    outputs[k] = NvjpegImage()
                    for c in range(3):
                        outputs[k].channel[c], outputs[k].pitch[c] = images[k].data_ptr() + c * h * w, w
            decodable = [k for k, shape in enumerate(shapes) if shape is not None]
            to_hardware, to_cuda = hardware_share([k for k in decodable if self._hardware_takes(encoded[k])],
                                                  decodable, self.hw_load)
            stream = torch.cuda.current_stream(self.device)
            stream.synchronize()
            paths = [None] * len(encoded)
            beside = (self.beside.submit(self._batched, self.cuda_handle, self.cuda_state, encoded, to_cuda, outputs,
                                         stream) if to_cuda else None)
            try:
                hardware_status = self._batched(self.hardware_handle, self.hardware_state, encoded, to_hardware,
                                                outputs, stream)
            finally:  # the thread beside writes into the buffer: never leave before it is done
                cuda_status = beside.result() if beside is not None else 0
            for rows, status, path in ((to_hardware, hardware_status, "hardware"), (to_cuda, cuda_status, "cuda")):
                for k in rows if status == 0 else ():
                    paths[k] = path
            for k in (k for k in decodable if paths[k] is None):
                status = self.lib.nvjpegDecode(self.single_handle, self.single_state, encoded[k].data_ptr(),
                                               encoded[k].numel(), OUTPUT_RGB, ctypes.byref(outputs[k]),
                                               stream.cuda_stream)
                paths[k] = "cuda_one" if status == 0 else None
            stream.synchronize()
        return [im if path else None for im, path in zip(images, paths)], paths

    def _batched(self, handle, state, encoded: list, rows: list[int], outputs: list, stream) -> int:
        """One batched call of ``handle``'s backend for the images ``rows`` on ``stream``; nvJPEG's status (0 for
        no rows)."""
        n = len(rows)
        if not n:
            return 0
        with torch.cuda.device(self.device):
            check(self.lib.nvjpegDecodeBatchedInitialize(handle, state, n, 1, OUTPUT_RGB),
                  "nvjpegDecodeBatchedInitialize")
            data = (ctypes.c_void_p * n)(*(encoded[k].data_ptr() for k in rows))
            lengths = (ctypes.c_size_t * n)(*(encoded[k].numel() for k in rows))
            destinations = (NvjpegImage * n)(*(outputs[k] for k in rows))
            return self.lib.nvjpegDecodeBatched(handle, state, data, lengths, destinations, stream.cuda_stream)


def hardware_share(hardware_takes: list[int], decodable: list[int], hw_load: float) -> tuple[list[int], list[int]]:
    """The images of a batch for the hardware decoders (the first ``hw_load`` of those they take, by position) and
    for the batched call on the CUDA cores (every other decodable one), in batch order."""
    to_hardware = hardware_takes[:round(hw_load * len(hardware_takes))]
    taken = set(to_hardware)
    return to_hardware, [k for k in decodable if k not in taken]
