"""The optional CUDA C++ backend (``csrc/``), when the extension was built.

``available()`` says whether ``dres._C`` imported; without it ``backend="cuda"`` fails with a
message saying how to build it, and everything else works unchanged.

Importing ``dres._C`` defines ``torch.ops.dres_cuda.{residual_layer_norm, residual_add, layer_norm,
residual_norm_backward, bias_gelu, bias_gelu_backward}`` (CUDA kernels, same schemas as the ``dres::``
Triton ops) and ``fused_mlp``, the forward ops with their autograd in C++. This module owns what the
backend adds in Python: :func:`register_fakes`, which registers the fake (meta) kernels the op modules
hand it, so the ops trace under ``torch.compile``. torch requires those fakes to be registered from the
module the C++ library names (``set_python_module``), this one; importing it imports ``dres.ops``
first, whose ``residual_norm`` and ``bias_gelu`` register them. It imports nothing of ``dres.ops``: the
op modules import it.
"""

from __future__ import annotations

import os
import warnings
from typing import Callable

import torch


def _load() -> str | None:
    """Import the extension; None on success, else why it is unavailable."""
    try:
        import dres._C  # noqa: F401
    except ImportError as e:
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        built = any(n.startswith("_C.") and n.endswith((".so", ".pyd")) for n in os.listdir(here))
        if built:  # a library that is there but does not load (torch ABI mismatch, ...) deserves a word
            warnings.warn(f"dres._C is present but failed to load ({e}); backend='cuda' is unavailable. "
                          "Rebuild it against this torch: DRES_BUILD_CUDA=1 pip install -e .", stacklevel=3)
        return str(e)
    return None


LOAD_ERROR = _load()


def available() -> bool:
    # a plain function of a module constant (no lru_cache): torch.compile traces it without warnings
    return LOAD_ERROR is None


def register_fakes(fakes: dict[str, Callable]) -> None:
    """Register ``fakes`` (op name -> fake kernel) for ``torch.ops.dres_cuda``; torch checks that the
    calling module is the one the C++ library names, which the default stack level finds here."""
    for name, fake in fakes.items():
        torch.library.register_fake(f"dres_cuda::{name}", fake)
