"""Inductor fallback lowerings for the dres custom ops (imports no Triton).

Inductor lowers an op it has no lowering for as an "implicit fallback" (a call to the op's kernel),
but before torch 2.12 it first formats, eagerly, a log message holding the IR of every input; the IR
prints as a tree, so a deep graph feeding the op takes minutes to print (BENCHMARKS.md: the compile
time of the ViT-B/16 ``official`` MAE). Registering the same fallback, with the layout constraint
Inductor would choose, skips that message. The fake kernels run during tracing, before any
lowering: a real-Python moment to do it.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable

import torch

# Qualified names ("namespace::name") whose fallbacks are registered (or found already lowered).
FALLBACKS_REGISTERED: set[str] = set()


def register_inductor_fallbacks(qualnames: Iterable[str]) -> None:
    """Give Inductor its fallback lowering for each op in ``qualnames`` unless it has one.

    Internal Inductor API: on a torch where it differs this does nothing and the implicit path is taken.
    """
    todo = [q for q in qualnames if q not in FALLBACKS_REGISTERED]
    if not todo:
        return
    FALLBACKS_REGISTERED.update(todo)
    try:
        from torch._inductor.lowering import lowerings, make_fallback, tag_to_layout_constraint
        from torch._library.utils import get_layout_constraint_tag
    except ImportError:
        return
    for qualname in todo:
        namespace, name = qualname.split("::")
        op = getattr(getattr(torch.ops, namespace), name).default
        if op not in lowerings:
            make_fallback(op, layout_constraint=tag_to_layout_constraint(get_layout_constraint_tag(op)), warn=False)


def with_inductor_fallbacks(qualnames: Iterable[str], fake: Callable) -> Callable:
    """``fake`` that first registers the fallbacks of ``qualnames`` (the ops of one module)."""
    qualnames = tuple(qualnames)

    @functools.wraps(fake)
    def fake_registering_fallbacks(*args, **kwargs):
        register_inductor_fallbacks(qualnames)
        return fake(*args, **kwargs)

    return fake_registering_fallbacks
