"""The optional CUDA C++ backend (``csrc/``), when the extension was built.

``available()`` says whether ``dres._C`` imported; without it ``backend="cuda"`` fails with a
message saying how to build it, and everything else works unchanged.

Importing ``dres._C`` defines ``torch.ops.dres_cuda.{residual_layer_norm, residual_add,
layer_norm, residual_norm_backward}`` (CUDA kernels, same schemas as the ``dres::`` Triton ops).
This module adds what is written in Python for both backends alike, from
:mod:`dres.ops.residual_norm`: the fake (meta) kernels, so the ops trace under
``torch.compile``, and the autograd formulas (the autograd Functions' own), here calling the C++
backward op. The C++ library names this module (``set_python_module``), so torch imports it
whenever it needs the fakes. Eager calls reach the C++ kernels through the same Functions
(``ResidualLayerNormFn`` & co. with ``backend="cuda"``).
"""

from __future__ import annotations

import os
import warnings

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


def _register() -> None:
    from dres.ops import residual_norm as shared

    shared.register_fakes("dres_cuda")  # called from this module, the one the C++ library names
    shared.register_autograd("dres_cuda")


if LOAD_ERROR is None:
    _register()
