"""The optional CUDA C++ backend (``csrc/``), when the extension was built.

``available()`` says whether ``dres._C`` imported; without it ``backend="cuda"`` fails with a
message saying how to build it, and everything else works unchanged.
"""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def available() -> bool:
    try:
        import dres._C  # noqa: F401
    except ImportError:
        return False
    return True
