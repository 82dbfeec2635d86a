"""How every dres:: custom op is defined (:func:`define_op`): its body, fake kernel, autograd (the
op's ``torch.autograd.Function``, :func:`register_function_autograd`), the rule that traces it
through under torch.compile, and Inductor fallback lowerings for it (imports no Triton).

On CUDA tensors of static shape torch.compile sees through the ops: AOTAutograd replaces an op by
its body, whose Triton launches are recorded into the graph (``torch.library.wrap_triton``, as
``torch.library.triton_op`` does), so Inductor launches the kernels from its own generated code with
no Python dispatch per call. Elsewhere an op stays opaque and Inductor calls it as a fallback: on
Triton's CPU interpreter (which cannot be traced), under ``torch.export``, and with symbolic sizes
(a dynamic-shape compile, e.g. after encoder and decoder blocks of other widths share a forward:
Inductor of torch 2.11 fails to lower user kernels of symbolic size in the backward).

Inductor lowers an op it has no lowering for as an "implicit fallback" (a call to the op's kernel),
but before torch 2.12 it first formats, eagerly, a log message holding the IR of every input; the IR
prints as a tree, so a deep graph feeding the op takes minutes to print (the ViT-B/16 ``official`` MAE
compiled in over 500 s: commit a949434). Registering the same fallback, with the layout constraint
Inductor would choose, skips that message. The fake kernels run during tracing, before any
lowering: a real-Python moment to do it.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

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


def _export_keeps_ops_opaque() -> bool:
    try:
        from torch.export._trace import custom_triton_ops_decomposition_disabled
    except ImportError:
        return False
    return custom_triton_ops_decomposition_disabled()


def _static_shape(t: torch.Tensor) -> bool:
    return not any(isinstance(n, torch.SymInt) for n in (*t.shape, *t.stride()))


def _inline_on_cuda(body: Callable) -> Callable:
    """The op's FunctionalTensorMode rule: trace ``body`` into the graph when its tensors are CUDA
    tensors of static shape and plain tracing types (no other subclass), else keep the op opaque."""

    def functional_rule(mode, op, types, args, kwargs):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        plain = all(t is torch.Tensor or issubclass(t, (FakeTensor, FunctionalTensor)) for t in types)
        inline = (plain and bool(tensors) and tensors[0].device.type == "cuda" and all(map(_static_shape, tensors))
                  and not _export_keeps_ops_opaque())
        if not inline:
            return mode.__torch_dispatch__(op, types, args, kwargs)
        with mode:
            return body(*args, **kwargs)

    return functional_rule


def register_function_autograd(qualname: str, function: type[torch.autograd.Function]) -> None:
    """``function``'s formulas as the autograd of the custom op ``qualname`` (a ``dres::`` op; the csrc
    ops carry the same formulas in C++). Every op's Function takes the op's inputs
    and then ``backend``, and has ``save(ctx, backend, inputs, output)``, its setup, with ``output``
    what the op returns; here ``backend`` is the op's namespace, so the formulas' backward calls that
    namespace's backward op. The backward drops the Function's last gradient (for ``backend``)."""
    namespace = qualname.split("::")[0]
    torch.library.register_autograd(
        qualname, lambda ctx, *grads: function.backward(ctx, *grads)[:-1],
        setup_context=lambda ctx, inputs, output: function.save(ctx, namespace, inputs, output))


def define_op(qualname: str, body: Callable, fake: Callable, module_qualnames: Iterable[str],
              schema: Optional[str] = None, inline: bool = True,
              autograd: Optional[type[torch.autograd.Function]] = None) -> torch.library.CustomOpDef:
    """The custom op ``qualname`` running ``body`` (the Triton launches), with ``fake`` as its fake
    kernel (registering the fallbacks of ``module_qualnames``, the ops of one module, first), the
    formulas of ``autograd`` (the op's Function, :func:`register_function_autograd`; None for a
    backward op), traced through on CUDA by torch.compile (:func:`_inline_on_cuda`) unless
    ``inline`` is False."""
    op = torch.library.custom_op(qualname, body, mutates_args=(), schema=schema)
    op.register_fake(with_inductor_fallbacks(module_qualnames, fake))
    if inline:
        op.register_torch_dispatch(FunctionalTensorMode, _inline_on_cuda(body))
    if autograd is not None:
        register_function_autograd(qualname, autograd)
    return op
