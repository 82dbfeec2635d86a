"""Argument checks shared by every backend: bad input fails here with a message that names the
argument, never as a Triton compiler trace or silent garbage."""

from __future__ import annotations

import contextlib
import math
import numbers
import os
from typing import Optional

import torch

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
REFERENCE_DTYPES = KERNEL_DTYPES + (torch.float64,)
BACKENDS = ("triton", "torch", "cuda")


# backend=None on CUDA tensors takes whichever implementation measured faster (csrc/README.md,
# "Default backend"): csrc in eager mode up to this size, where launch cost dominates; Triton for
# larger tensors and under torch.compile or CUDA-graph capture, where its kernels are faster.
CSRC_EAGER_MAX_ELEMENTS = 1 << 24  # MAE ViT-B/16 encoder residuals at batch 256 (9.8M) stay below


def choose_default_backend(is_cuda: bool, numel: int, compiling: bool, capturing: bool, csrc_built: bool) -> str:
    """The backend ``backend=None`` means for a tensor with these properties."""
    if not is_cuda:
        return "torch"
    if csrc_built and not compiling and not capturing and numel <= CSRC_EAGER_MAX_ELEMENTS:
        return "cuda"
    return "triton"


def _default_backend(x: torch.Tensor) -> str:
    if not x.is_cuda or x.dtype == torch.float64:  # only the references compute in float64
        return "torch"
    if torch.compiler.is_compiling():  # first, so that tracing never looks at sizes or the stream
        return "triton"
    from dres.ops import csrc_backend

    return choose_default_backend(True, x.numel(), False, torch.cuda.is_current_stream_capturing(),
                                  csrc_backend.available())


def resolve_backend(backend: str | None, x: torch.Tensor, name: str = "x") -> str:
    """None -> the measured-faster kernels on CUDA tensors (:func:`choose_default_backend`), the
    PyTorch reference elsewhere and in float64. ``name``: what the caller calls ``x``, for the messages."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if backend is None:
        return _default_backend(x)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "triton" and not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"backend='triton' needs CUDA tensors ({name} is on {x.device}); set TRITON_INTERPRET=1 to run "
            "the kernels on the CPU through Triton's interpreter, or use backend='torch'"
        )
    if backend == "cuda":
        from dres.ops import csrc_backend

        if not csrc_backend.available():
            raise ValueError(
                "backend='cuda' needs the csrc extension, which is not built in this install "
                "(rebuild with DRES_BUILD_CUDA=1 pip install -e .)"
            )
        if not x.is_cuda:
            raise ValueError(f"backend='cuda' needs CUDA tensors, x is on {x.device}")
    return backend


# Outside a step replayed from a CUDA graph the host launches every kernel of every step. Under torch.compile a
# dres kernel launched from Inductor's code costs 17-50 us of host time against Inductor's own 7-15 (BENCHMARKS.md,
# "dres kernels launched by Inductor"); in eager mode an op's Triton call costs its Python (bench_host_cost: a
# residual_layer_norm's forward and backward 2.6x the host time of PyTorch's add and layer_norm), where the csrc
# extension's ops run no Python past their checks. Below this rows x D^2 (a block's matmul work, a twelfth of
# its multiply-adds) the block's matmuls take less GPU time than the host takes to launch its kernels: backend=None
# then gives the residual norms and the MLP their PyTorch formulas (which Inductor fuses into kernels of its own) and
# the models' attention modules SDPA rather than short_attention (dres.nn.transformer.takes_short_attention), under
# torch.compile and in eager mode without the csrc extension. Between the models measured both ways, compiled: timm
# DINOv2 ViT-S/14 at batch 128 (4.9e9; Inductor's code 1.24-1.29x the dres kernels in three rounds, 0.97x in a
# fourth), HF CLIP ViT-B/32 at batch 128 (3.8e9; the norms and MLP on Inductor's code 1.10-1.36x the kernels, its
# attention in SDPA too 1.01-1.45x that) and timm ViT-B/16 at batch 128 (1.5e10; the dres kernels 1.05x against
# 1.00x, 1.4 GiB smaller); eager: the DINOv2 on the formulas 1.24x the kernels (0.85x and 0.69x the plain model),
# timm ViT-B/16 1.25x the plain model on the kernels.
LAUNCH_BOUND_WORK = 6e9
_replayed = False  # inside replayed_launches()


@contextlib.contextmanager
def replayed_launches():
    """Run (and so trace, under torch.compile) a step that is then captured in a CUDA graph and replayed: its
    launches cost the host nothing at a replay, so :func:`takes_pytorch_formula` keeps the dres kernels."""
    global _replayed
    outer, _replayed = _replayed, True
    try:
        yield
    finally:
        _replayed = outer


def launch_bound(x: torch.Tensor, parts: int = 1) -> bool:
    """Whether the residual stream of ``x`` (rows x D, static sizes; with ``parts``, rows x parts * D, as qkv holds
    q, k and v side by side) has rows x D^2 below :data:`LAUNCH_BOUND_WORK`; symbolic sizes (a dynamic-shape
    compile) never are."""
    dim, numel = x.shape[-1], x.numel()
    return type(dim) is int and type(numel) is int and numel * dim // parts ** 2 < LAUNCH_BOUND_WORK


def takes_pytorch_formula(backend: str | None, x, parts: int = 1) -> bool:
    """Whether ``backend=None`` gives a launch-bound CUDA ``x`` (:func:`launch_bound`) its op's PyTorch formula:
    where each dres kernel would be launched from Python at every step, that is under torch.compile and in eager
    mode without the csrc extension, and neither inside :func:`replayed_launches` nor during a CUDA-graph capture."""
    if (backend is not None or _replayed or not isinstance(x, torch.Tensor) or not x.is_cuda
            or not launch_bound(x, parts)):
        return False
    if torch.compiler.is_compiling():
        return True
    from dres.ops import csrc_backend

    return not csrc_backend.available() and not torch.cuda.is_current_stream_capturing()


def resolve_backend_by_work(backend: str | None, x: torch.Tensor, name: str = "x") -> str:
    """:func:`resolve_backend`, except that ``backend=None`` gives a launch-bound CUDA ``x`` its PyTorch formula
    where :func:`takes_pytorch_formula` says so."""
    return "torch" if takes_pytorch_formula(backend, x) else resolve_backend(backend, x, name)


def resolve_backend_without_csrc(backend: str | None, x: torch.Tensor, name: str = "x") -> str:
    """:func:`resolve_backend` for an op the csrc extension does not implement: where the residual
    ops would take ``"cuda"`` (asked for, or chosen by ``backend=None``) it takes Triton."""
    resolved = resolve_backend("triton" if backend == "cuda" else backend, x, name)
    return "triton" if resolved == "cuda" else resolved


def supported_dtypes(backend: str) -> tuple[torch.dtype, ...]:
    """The dtypes a backend takes: the kernels' three, and float64 too for the reference."""
    return REFERENCE_DTYPES if backend == "torch" else KERNEL_DTYPES


def check_vector(name: str, t: Optional[torch.Tensor], length: int, ref: torch.Tensor, dtypes, what: str) -> None:
    """An optional (length,) parameter on ``ref``'s device; ``what`` names the size it must match."""
    if t is None:
        return
    check_tensor(name, t, dtypes)
    if t.shape != (length,):
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected ({length},) to match {what}")
    check_same_device(name, t, ref)


def check_tensor(name: str, t, dtypes) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} has dtype {t.dtype}; supported: {names}")


def check_same_device(name: str, t: torch.Tensor, x: torch.Tensor) -> None:
    if t.device != x.device:
        raise ValueError(f"{name} is on {t.device} but x is on {x.device}; all tensors must share one device")


def check_eps(eps, name: str = "eps") -> None:
    """A positive, finite Python number (a string or a tensor is refused on every backend alike)."""
    if not isinstance(eps, numbers.Real) or isinstance(eps, bool):
        raise TypeError(f"{name} must be a positive float, got {type(eps).__name__}")
    if not 0 < eps < math.inf:  # not math.isfinite: a SymFloat eps (dynamic=True) has no such op
        raise ValueError(f"{name} must be a positive finite float, got {eps!r}")


def check_dropout_p(dropout_p) -> None:
    """A Python number in [0, 1): the probability of dropping an element."""
    if not isinstance(dropout_p, numbers.Real) or isinstance(dropout_p, bool):
        raise TypeError(f"dropout_p must be a float in [0, 1), got {type(dropout_p).__name__}")
    if not 0 <= dropout_p < 1:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")


def check_factors_are_data(**factors: Optional[torch.Tensor]) -> None:
    """Per-sample factors (row_scale, grad_scale: drop-path masks) get no gradient on any backend, so
    one that requires grad is refused rather than silently left without."""
    for name, t in factors.items():
        if t is not None and t.requires_grad:
            raise ValueError(f"{name} requires grad, but per-sample factors are data and get no gradient; "
                             f"pass {name}.detach()")


def check_dtype_arg(name: str, dtype, dtypes) -> None:
    if dtype is not None and dtype not in dtypes:
        raise TypeError(f"{name} must be None or one of {[str(d) for d in dtypes]}, got {dtype!r}")


def check_alpha(alpha, x: torch.Tensor, dtypes) -> None:
    """alpha: a Python number or a one-element tensor on x's device."""
    if isinstance(alpha, torch.Tensor):
        check_tensor("alpha", alpha, dtypes)
        if alpha.numel() != 1:
            raise ValueError(f"alpha must be a float or a 0-dim tensor, got shape {tuple(alpha.shape)}")
        check_same_device("alpha", alpha, x)
    elif not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise TypeError(f"alpha must be a float or a 0-dim tensor, got {type(alpha).__name__}")
