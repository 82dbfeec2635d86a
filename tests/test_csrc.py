"""The CUDA C++ backend (csrc/, ``backend="cuda"``): against the float64 reference and against the
Triton backend, forward and backward, every mode of docs/ops.md's op table, mixed dtypes, odd sizes
(both the 16-byte-vector and the scalar paths, warp-per-row and block-per-row), strided gradients,
poisoned outputs, deterministic weight gradients, opcheck and torch.compile.

GPU tests are marked ``gpu`` and skipped as well when the extension is not built
(``DRES_BUILD_CUDA=1 pip install --no-deps --no-build-isolation -e .``). The CPU tests check what
holds without a GPU: the package imports, ``backend="cuda"`` fails clearly without the extension,
setup.py compiles nothing unless asked, and (when built) schemas and fake kernels.
"""

from __future__ import annotations

import os
import runpy
import sys

import pytest
import torch
import torch.nn.functional as F

import dres.ops as ops
from dres.ops import csrc_backend, reference
from helpers import (BF16, F16, F32, MODES, TOLERANCE, assert_close, capture_graph, cuda_dispatch_forced, f64, grads,
                     leaves, make_case, mode_scales, philox_kept)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPS = ("residual_layer_norm", "residual_add", "layer_norm", "residual_norm_backward", "bias_gelu", "bias_gelu_backward")

built = pytest.mark.skipif(not csrc_backend.available(), reason="dres._C (csrc) not built")


def gpu(test):
    """GPU test of the extension: marked gpu, and skipped too when dres._C is not built."""
    return pytest.mark.gpu(built(test))


def rln_run(backend, x, h, w, b, alpha, row_scale, grad_scale, g_out, g_y, stored_out=None):
    """(out, y, dx, dh, dw, db, dalpha) of residual_layer_norm on ``backend``.

    ``"reference"`` is the contract in float64: out exact; y the LayerNorm of ``stored_out`` (the
    value the kernel actually stored in out, rounded to out's dtype; docs/design.md: y
    normalises the stored, rounded out), with out's gradient passed through unchanged in float64.
    Normalising the unrounded out instead would put one bf16 rounding of out (relative 2**-9,
    entering LN_bwd through xhat and rstd) into every fp32 result downstream of it (y, g, dh,
    dweight, dbias, dalpha), which then could only be checked to bf16 accuracy.
    """
    if backend == "reference":
        xl, hl, wl, bl = (f64(t).requires_grad_(True) for t in (x, h, w, b))
        al = f64(alpha).requires_grad_(True) if isinstance(alpha, torch.Tensor) else alpha
        out = reference.residual_add(xl, hl, al, f64(row_scale), f64(grad_scale))
        normed = out + (stored_out.double() - out).detach()  # stored value, identity gradient
        y = reference.layer_norm(normed, wl, bl, 1e-6)
        inputs = (xl, hl, wl, bl, al if isinstance(al, torch.Tensor) else None)
        return (out, y, *grads((normed, y), (g_out.double(), g_y.double()), inputs))
    xl, hl, wl, bl = leaves(x, h, w, b)
    al = alpha.detach().clone().requires_grad_(True) if isinstance(alpha, torch.Tensor) else alpha
    out, y = ops.residual_layer_norm(xl, hl, wl, bl, al, row_scale=row_scale, grad_scale=grad_scale, backend=backend)
    inputs = (xl, hl, wl, bl, al if isinstance(al, torch.Tensor) else None)
    return (out, y, *grads((out, y), (g_out, g_y), inputs))


def assert_out_rounded(out, x, h, alpha, row_scale):
    """out within one unit of its dtype of the exact alpha*x + row_scale*h, elementwise: one
    rounding to out's dtype plus fp32 arithmetic, both bounded by eps * (|alpha*x| + |row_scale*h|)."""
    a = alpha.double().abs() if isinstance(alpha, torch.Tensor) else abs(alpha)
    exact = reference.residual_add(f64(x), f64(h), f64(alpha) if isinstance(alpha, torch.Tensor) else alpha, f64(row_scale))
    mag = reference.residual_add(f64(x).abs(), f64(h).abs(), a, None if row_scale is None else f64(row_scale).abs())
    bound = torch.finfo(out.dtype).eps * mag + torch.finfo(out.dtype).tiny
    excess = ((out.double() - exact).abs() - bound).max().item() if out.numel() else 0.0
    assert excess <= 0, f"out: an element is more than one {out.dtype} unit from the exact value (by {excess:.2e})"


def assert_close_sum(name, a, ref, terms, dtype):
    """A sum of many terms (dalpha = sum(g * x)) whose terms cancel: its error is bounded by the
    roundoff of the terms, relative to sum(|terms|), not to the (possibly far smaller) sum itself.
    ``dtype``: the dtype the result is stored in (its rounding is at most eps * |sum| <= eps * sum|terms|)."""
    scale = terms.abs().sum().item()
    err = abs(a.double().item() - ref.double().item()) / (scale if scale > 0 else 1.0)
    assert err <= TOLERANCE[dtype], f"{name}: error {err:.2e} of sum|g*x| above {TOLERANCE[dtype]:.0e} ({dtype})"


def compare_rln(x, h, w, b, alpha, row_scale, grad_scale, g_out=None, g_y=None):
    """The cuda backend against the float64 contract and against triton, every output and gradient."""
    x_dtype, h_dtype = x.dtype, h.dtype
    g_out = torch.randn(x.shape, device=x.device).to(x_dtype) if g_out is None else g_out
    g_y = torch.randn(x.shape, device=x.device).to(h_dtype) if g_y is None else g_y
    cuda = rln_run("cuda", x, h, w, b, alpha, row_scale, grad_scale, g_out, g_y)
    ref = rln_run("reference", x, h, w, b, alpha, row_scale, grad_scale, g_out, g_y, stored_out=cuda[0])
    tri = rln_run("triton", x, h, w, b, alpha, row_scale, grad_scale, g_out, g_y)
    assert cuda[0].dtype == x_dtype and cuda[1].dtype == h_dtype
    assert_out_rounded(cuda[0], x, h, alpha, row_scale)
    param_dtype = F32 if h_dtype == F32 else BF16
    alpha_dtype = alpha.dtype if isinstance(alpha, torch.Tensor) else F32
    # Against float64 (which normalises the same stored out): each result to its own dtype.
    names = ("out", "y", "dx", "dh", "dweight", "dbias")
    dtypes = (x_dtype, h_dtype, x_dtype, h_dtype, param_dtype, param_dtype)
    # Against triton: its out may round an fp32 value on the other side of a bf16/fp16 tie (FMA
    # vs separate ops; about 2**-16 of the elements), and everything downstream of out inherits
    # that one unit: with a low-precision out those results agree to out's precision.
    chain = x_dtype
    for name, c, r, t, dt in zip(names, cuda, ref, tri, dtypes):
        if c is None:
            continue
        assert_close(f"{name} vs float64", c, r, dt)
        downstream = name not in ("out", "dx")
        assert_close(f"{name} vs triton", c, t, chain if downstream and chain != F32 else dt)
    if cuda[6] is not None:  # dalpha = sum(g * x), g the gradient of out (float64 dx = alpha * g)
        terms = ref[2] / (f64(alpha) if isinstance(alpha, torch.Tensor) else alpha) * f64(x)
        assert_close_sum("dalpha vs float64", cuda[6], ref[6], terms, alpha_dtype)
        assert_close_sum("dalpha vs triton", cuda[6], tri[6], terms, alpha_dtype if chain == F32 else chain)
# ---------------------------------------------------------------------------------------------
# GPU: parity


@pytest.mark.parametrize("alpha_kind", ["float", "tensor"])
@pytest.mark.parametrize("dim", [48, 200, 1000, 4104])
@pytest.mark.parametrize("x_dtype,h_dtype", [(F32, BF16), (F32, F32), (BF16, BF16), (BF16, F32)])
@pytest.mark.parametrize("mode", MODES)
@gpu
def test_residual_layer_norm_parity(mode, x_dtype, h_dtype, dim, alpha_kind):
    torch.manual_seed(hash((mode, str(x_dtype), str(h_dtype), dim, alpha_kind)) % 2**31)
    shape = (5, 7, dim)  # 35 rows: not a multiple of the 8 rows of a warp-per-row block
    x, h, w, b = make_case(shape, x_dtype, h_dtype, "cuda")
    row_scale, grad_scale = mode_scales(mode, shape[0], "cuda")
    alpha = torch.tensor(0.7, device="cuda") if alpha_kind == "tensor" else 0.7
    compare_rln(x, h, w, b, alpha, row_scale, grad_scale)


@gpu
@pytest.mark.parametrize("dim", [100, 1030, 16384, 8200, 520, 8])  # scalar path (D % 8), wide and narrow rows
@pytest.mark.parametrize("rows", [1, 33, 130, 1031])
def test_odd_sizes(dim, rows):
    torch.manual_seed(dim * 7 + rows)
    if dim * rows > 4_000_000:
        rows = 130
    x, h, w, b = make_case((rows, dim), F32, BF16, "cuda")
    rs, gs = mode_scales("drop_path", rows, "cuda")
    compare_rln(x, h, w, b, torch.tensor(0.6, device="cuda"), rs, gs)


@gpu
def test_alpha_tensor_dtypes_and_gradient():
    torch.manual_seed(3)
    for adt in (F32, BF16, F16):
        x, h, w, b = make_case((4, 9, 64), F32, BF16, "cuda")
        compare_rln(x, h, w, b, torch.tensor(0.85, device="cuda", dtype=adt), None, None)


@gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("x_dtype,h_dtype", [(F32, BF16), (BF16, BF16), (F32, F32), (F16, F16)])
@pytest.mark.parametrize("alpha_kind", ["float", "tensor"])
def test_residual_add_parity(mode, x_dtype, h_dtype, alpha_kind):
    torch.manual_seed(hash((mode, str(x_dtype), alpha_kind)) % 2**31)
    shape = (6, 11, 200)
    x, h, _, _ = make_case(shape, x_dtype, h_dtype, "cuda")
    rs, gs = mode_scales(mode, shape[0], "cuda")
    alpha = torch.tensor(0.5, device="cuda") if alpha_kind == "tensor" else 0.5
    g = torch.randn(shape, device="cuda").to(x_dtype)
    results = {}
    for backend in ("cuda", "triton", "reference"):
        if backend == "reference":
            xl, hl = f64(x).requires_grad_(True), f64(h).requires_grad_(True)
            al = f64(alpha).requires_grad_(True) if alpha_kind == "tensor" else alpha
            out = reference.residual_add(xl, hl, al, f64(rs), f64(gs))
            gg = g.double()
        else:
            xl, hl = leaves(x, h)
            al = alpha.clone().requires_grad_(True) if alpha_kind == "tensor" else alpha
            out = ops.residual_add(xl, hl, al, rs, gs, backend=backend)
            gg = g
        results[backend] = (out, *grads(out, gg, (xl, hl, al if alpha_kind == "tensor" else None)))
    assert results["cuda"][0].dtype == x_dtype
    for name, i, dt in (("out", 0, x_dtype), ("dx", 1, x_dtype), ("dh", 2, h_dtype), ("dalpha", 3, BF16)):
        c = results["cuda"][i]
        if c is None:
            continue
        assert_close(f"{name} vs float64", c, results["reference"][i], dt)
        assert_close(f"{name} vs triton", c, results["triton"][i], dt)


@gpu
@pytest.mark.parametrize("x_dtype,out_dtype", [(F32, None), (BF16, None), (F32, BF16), (BF16, F32)])
@pytest.mark.parametrize("dim", [48, 100, 1000, 4104])
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_parity(x_dtype, out_dtype, dim, affine):
    torch.manual_seed(dim)
    x, _, w, b = make_case((3, 13, dim), x_dtype, x_dtype, "cuda")
    if not affine:
        w = b = None
    y_dtype = out_dtype or x_dtype
    g = torch.randn(x.shape, device="cuda").to(y_dtype)
    res = {}
    for backend in ("cuda", "triton", "reference"):
        if backend == "reference":
            xl, wl, bl = (None if t is None else f64(t).requires_grad_(True) for t in (x, w, b))
            y = reference.layer_norm(xl, wl, bl, 1e-6)
            res[backend] = (y, *grads(y, g.double(), (xl, wl, bl)))
        else:
            xl, wl, bl = leaves(x, w, b)
            y = ops.layer_norm(xl, wl, bl, out_dtype=out_dtype, backend=backend)
            res[backend] = (y, *grads(y, g, (xl, wl, bl)))
    assert res["cuda"][0].dtype == y_dtype
    param_dtype = F32 if y_dtype == F32 else BF16
    for name, i, dt in (("y", 0, y_dtype), ("dx", 1, x_dtype),
                        ("dweight", 2, param_dtype), ("dbias", 3, param_dtype)):
        c = res["cuda"][i]
        if c is None:
            continue
        assert_close(f"{name} vs float64", c, res["reference"][i], dt)
        assert_close(f"{name} vs triton", c, res["triton"][i], dt)



@gpu
def test_non_contiguous_gradients_and_inputs():
    """Gradients with any strides (stride-0 expand, slices with odd row strides, transposes) and
    inputs whose rows are not 16-byte aligned (forcing the scalar path)."""
    torch.manual_seed(11)
    B, T, D = 4, 6, 200
    x, h, w, b = make_case((B, T, D), F32, BF16, "cuda")
    rs, gs = mode_scales("rdp_odd", B, "cuda")
    alpha = torch.tensor(0.9, device="cuda")
    g_out = torch.randn(D, device="cuda").expand(B, T, D)  # row stride 0
    g_y = torch.randn(B, T, D + 3, device="cuda").to(BF16)[..., :D]  # row stride D + 3
    compare_rln(x, h, w, b, alpha, rs, gs, g_out=g_out, g_y=g_y)
    g_t = torch.randn(B, D, T, device="cuda").transpose(1, 2)  # last-dim stride != 1
    compare_rln(x, h, w, b, alpha, rs, gs, g_out=g_t, g_y=g_t.to(BF16))
    # Inputs sliced so rows start at odd offsets (misaligned for 16-byte vectors).
    big_x = torch.randn(B * T, D + 1, device="cuda")[:, 1:]
    big_h = torch.randn(B * T, D + 5, device="cuda").to(BF16)[:, 5:]
    compare_rln(big_x, big_h, w, b, 0.8, None, None)


@gpu
def test_every_output_element_is_written():
    """With deterministic algorithms on, torch fills every fresh allocation (also the C++
    at::empty of the op) with NaN: an element a kernel skips stays NaN."""
    torch.manual_seed(5)
    prev = (torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        assert torch.isnan(torch.empty(8, device="cuda")).all(), "allocations are not being poisoned"
        for dim in (72, 100, 4104, 1030):
            x, h, w, b = make_case((7, 9, dim), F32, BF16, "cuda")
            rs, gs = mode_scales("drop_path", 7, "cuda")
            xl, hl, wl, bl = leaves(x, h, w, b)
            al = torch.tensor(0.8, device="cuda", requires_grad=True)
            out, y = ops.residual_layer_norm(xl, hl, wl, bl, al, row_scale=rs, grad_scale=gs, backend="cuda")
            dx, dh, dw, db, da = grads((out, y), (torch.randn_like(out), torch.randn_like(y)), (xl, hl, wl, bl, al))
            z = ops.residual_add(x, h, 0.8, backend="cuda")
            yn = ops.layer_norm(x, w, b, backend="cuda")
            zl, hl2 = leaves(x, h)
            dz = grads(ops.residual_add(zl, hl2, 0.5, backend="cuda"), torch.randn_like(x), (zl, hl2))
            for name, t in dict(out=out, y=y, dx=dx, dh=dh, dw=dw, db=db, da=da, add=z, ln=yn,
                                add_dx=dz[0], add_dh=dz[1]).items():
                assert not torch.isnan(t).any(), f"{name} (D={dim}) has unwritten (NaN) elements"
    finally:
        torch.use_deterministic_algorithms(prev[0])
        torch.utils.deterministic.fill_uninitialized_memory = prev[1]


@gpu
@pytest.mark.parametrize("shape", [(4097, 768), (515, 4104), (333, 100)])
def test_weight_gradients_are_deterministic(shape):
    torch.manual_seed(13)
    x, h, w, b = make_case(shape, F32, BF16, "cuda")
    g_out, g_y = torch.randn(shape, device="cuda"), torch.randn(shape, device="cuda").to(BF16)
    runs = []
    for _ in range(3):
        xl, hl, wl, bl = leaves(x, h, w, b)
        al = torch.tensor(0.75, device="cuda", requires_grad=True)
        out, y = ops.residual_layer_norm(xl, hl, wl, bl, al, backend="cuda")
        runs.append(grads((out, y), (g_out, g_y), (xl, hl, wl, bl, al)))
    for first, again in zip(runs[0], runs[1]):
        assert torch.equal(first, again)
    for first, again in zip(runs[0], runs[2]):
        assert torch.equal(first, again)


@gpu
def test_empty_rows():
    x, h, w, b = make_case((0, 64), F32, BF16, "cuda")
    xl, hl, wl, bl = leaves(x, h, w, b)
    out, y = ops.residual_layer_norm(xl, hl, wl, bl, backend="cuda")
    assert out.shape == (0, 64) and y.shape == (0, 64)
    dx, dh, dw, db = grads((out, y), (torch.randn_like(out), torch.randn_like(y)), (xl, hl, wl, bl))
    assert dx.shape == (0, 64) and torch.equal(dw, torch.zeros_like(w)) and torch.equal(db, torch.zeros_like(b))


@gpu
def test_opcheck():
    torch.manual_seed(2)
    x, h, w, b = make_case((4, 3, 32), F32, BF16, "cuda")
    rs = torch.tensor([1.0, 0.0, 1.0, 1.0], device="cuda")
    alpha = torch.tensor(0.9, device="cuda")
    req = lambda *ts: [t.clone().requires_grad_(True) for t in ts]  # noqa: E731
    xr, hr, wr, br, ar = req(x, h, w, b, alpha)
    c = torch.ops.dres_cuda
    cases = [
        (c.residual_layer_norm.default, (xr, hr, wr, br, None, 0.7, 1e-6, rs, None, None, None, 0.0, None)),
        (c.residual_layer_norm.default, (xr, hr, wr, br, ar, 1.0, 1e-6, None, 1 - rs, F32, F32, 0.0, None)),
        (c.residual_add.default, (xr, hr, ar, 1.0, rs, None, None, 0.0, None)),
        (c.layer_norm.default, (xr, wr, br, 1e-6, BF16)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@gpu
def test_compile_fullgraph():
    torch.manual_seed(4)
    x, h, w, b = make_case((3, 5, 64), F32, BF16, "cuda")
    m = torch.tensor([1.0, 0.0, 1.0], device="cuda")

    def two_sublayers(x, h, w, b, alpha):
        out, y = ops.residual_layer_norm(x, h, w, b, alpha, grad_scale=1 - m, backend="cuda")
        out2, y2 = ops.residual_layer_norm(out, torch.tanh(y), w, b, alpha, backend="cuda")
        return ops.residual_add(out2, y2, alpha, backend="cuda")

    alpha = torch.tensor(0.8, device="cuda")
    for backend in ("aot_eager", "inductor"):
        compiled = torch.compile(two_sublayers, fullgraph=True, backend=backend)
        xa, ha, wa, ba = leaves(x, h, w, b)
        xb, hb, wb, bb = leaves(x, h, w, b)
        eager = two_sublayers(xa, ha, wa, ba, alpha)
        comp = compiled(xb, hb, wb, bb, alpha)
        torch.testing.assert_close(comp, eager, msg=lambda m: f"{backend} forward: {m}")
        g = torch.randn_like(eager)
        names = ("dx", "dh", "dweight", "dbias")
        for name, a, c in zip(names, grads(eager, g, (xa, ha, wa, ba)), grads(comp, g, (xb, hb, wb, bb))):
            if backend == "aot_eager":  # the same aten ops and kernels as eager
                torch.testing.assert_close(c, a, msg=lambda m: f"{backend} {name}: {m}")
            else:
                # Inductor generates its own code for the bf16 tanh between the sublayers: it
                # recomputes tanh(y) in fp32 in the backward instead of reading the bf16-rounded
                # value eager saved, and rounds the bf16 gradient g_y1 = dh2 * (1 - tanh^2) once
                # from fp32. g_y1 then differs from eager's by bf16 units in some elements, and
                # LN_bwd spreads that over every element of the row (dx, dh, dweight, dbias).
                # The custom ops are opaque to Inductor, so the kernels themselves are not at issue.
                assert_close(f"{backend} {name}", c, a, BF16)


@gpu
def test_cuda_graph_capture():
    torch.manual_seed(6)
    x, h, w, b = make_case((64, 768), F32, BF16, "cuda")
    graph, (out, y) = capture_graph(lambda: ops.residual_layer_norm(x, h, w, b, 0.9, backend="cuda"))
    x.copy_(torch.randn_like(x))
    graph.replay()
    want_out, want_y = ops.residual_layer_norm(x, h, w, b, 0.9, backend="cuda")
    assert torch.equal(out, want_out) and torch.equal(y, want_y)


@gpu
@pytest.mark.parametrize("dim", [48, 100, 1000, 4104])  # 16-byte vectors and scalars, warp and block per row
@pytest.mark.parametrize("x_dtype,h_dtype", [(F32, BF16), (BF16, BF16), (F32, F32)])
def test_dropout_draws_tritons_mask_and_matches_float64(dim, x_dtype, h_dtype):
    """The CUDA kernels draw the stream the Triton kernels draw (tests/helpers.py's ``philox_kept``, with
    a seed above 2**32): one mask for a seed whichever backend runs; forward and backward against the
    float64 reference fed h * mask / (1 - p), per-sample factors included."""
    from dres.ops.residual_norm import residual_add_op

    shape, p = (3, 37, dim), 0.3
    torch.manual_seed(dim)
    x, h, w, b = make_case(shape, x_dtype, h_dtype, "cuda")
    row_scale, grad_scale = mode_scales("rdp_odd", shape[0], "cuda")
    g_out, g_y = torch.randn(shape, device="cuda").to(x_dtype), torch.randn(shape, device="cuda").to(h_dtype)
    ones, seed = torch.ones(shape, device="cuda"), torch.tensor(2**40 + 5, device="cuda")
    for add in (torch.ops.dres_cuda.residual_add, residual_add_op):
        scaled = add(torch.zeros_like(ones), ones, None, 1.0, None, None, None, p, seed)
        assert torch.equal((scaled != 0).cpu(), philox_kept(shape, p, 2**40 + 5)), add
    torch.manual_seed(5)
    keep = ops.residual_add(torch.zeros_like(ones), ones, dropout_p=p, backend="cuda").double() * (1 - p)
    xl, hl, wl, bl = leaves(x, h, w, b)
    torch.manual_seed(5)
    out, y = ops.residual_layer_norm(xl, hl, wl, bl, 0.8, row_scale=row_scale, grad_scale=grad_scale, dropout_p=p,
                                     backend="cuda")
    got = grads((out, y), (g_out, g_y), (xl, hl, wl, bl))
    x6, h6, w6, b6 = (f64(t).requires_grad_(True) for t in (x, h, w, b))
    out6, y6 = reference.residual_layer_norm(x6, h6 * keep / (1 - p), w6, b6, 0.8, 1e-6, f64(row_scale),
                                             f64(grad_scale))
    want = grads((out6, y6), (g_out.double(), g_y.double()), (x6, h6, w6, b6))
    y_dtype = h_dtype if x_dtype == F32 else BF16
    for name, a, ref, dtype in zip(("out", "y", "dx", "dh", "dweight", "dbias"), (out, y, *got), (out6, y6, *want),
                                   (x_dtype, y_dtype, x_dtype, h_dtype, y_dtype, y_dtype)):
        assert_close(name, a, ref, dtype)


# ---------------------------------------------------------------------------------------------
# The MLP: dres_cuda::bias_gelu / bias_gelu_backward (its kernels) and fused_mlp (its C++ autograd);
# fused_mlp's float64 parity on this backend is tests/test_bias_gelu.py's (its mlp_backend "cuda")


def gelu_reference(pre, bias, g, approximate):
    """(act, dpre, dbias) of the float64 reference for cotangent g."""
    p6 = pre.double().requires_grad_(True)
    b6 = None if bias is None else bias.double().requires_grad_(True)
    act = reference.bias_gelu(p6, b6, approximate=approximate)
    got = torch.autograd.grad(act, [t for t in (p6, b6) if t is not None], g.double())
    return act.detach(), got[0], (got[1] if bias is not None else None)


@gpu
@pytest.mark.parametrize("approximate", ["none", "tanh", "quick"])
@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("rows,hidden", [(1, 8), (3, 37), (129, 100), (257, 1536), (1000, 3072), (33, 4104)])
def test_bias_gelu_kernels_match_float64(approximate, dtype, rows, hidden):
    """Both the 16-byte-vector path (hidden % 8 == 0) and the scalar one, one and several column blocks."""
    torch.manual_seed(rows + hidden)
    c = torch.ops.dres_cuda
    pre = (2.0 * torch.randn(rows, hidden, device="cuda")).to(dtype)
    bias = (0.5 * torch.randn(hidden, device="cuda")).to(F32)
    g = torch.randn(rows, hidden, device="cuda").to(dtype)
    act6, dpre6, dbias6 = gelu_reference(pre, bias, g, approximate)
    act = c.bias_gelu(pre, bias, None, approximate)
    dpre, act_again, dbias = c.bias_gelu_backward(g, pre, bias, dtype, True, approximate)
    assert act.dtype == dpre.dtype == act_again.dtype == dtype and dbias.dtype == F32
    assert_close("act", act, act6, dtype)
    assert torch.equal(act_again, act), "the backward's recomputed activation differs from the forward's"
    assert_close("dpre", dpre, dpre6, dtype)
    assert_close("dbias", dbias, dbias6, F32)  # fp32 sums of the fp32 products
    want = torch.ops.dres.bias_gelu(pre, bias, None, approximate)  # the Triton kernel
    assert_close("act against Triton", act, want.double(), dtype)


@gpu
def test_bias_gelu_kernels_options_strides_and_empty_rows():
    torch.manual_seed(3)
    c = torch.ops.dres_cuda
    pre = torch.randn(6, 5, 48, device="cuda").to(BF16)
    act = c.bias_gelu(pre, None, F32, "none")  # no bias, fp32 output, any leading shape
    assert act.dtype == F32 and act.shape == pre.shape
    assert_close("act", act, torch.nn.functional.gelu(pre.double()), F32)
    g = torch.randn(1, 48, device="cuda").to(BF16).expand(30, 48)  # stride-0 rows
    dpre, act_none, dbias = c.bias_gelu_backward(g, pre.view(30, 48), None, None, True, "tanh")
    assert act_none.numel() == 0 and dbias.numel() == 0  # not asked for / no bias
    _, want, _ = gelu_reference(pre.view(30, 48), None, g, "tanh")
    assert_close("dpre, expanded g", dpre, want, BF16)
    bias = torch.randn(48, device="cuda")
    empty = pre[:0].reshape(0, 48)
    dpre, _, dbias = c.bias_gelu_backward(empty, empty, bias, None, True, "none")
    assert dpre.shape == (0, 48) and torch.equal(dbias, torch.zeros(48, device="cuda"))
    with pytest.raises(RuntimeError, match="approximate must be 'none', 'tanh' or 'quick'"):
        c.bias_gelu(pre, None, None, "erf")


@gpu
def test_bias_gelu_kernels_write_every_element_and_dbias_is_deterministic(poisoned_allocations):
    torch.manual_seed(4)
    c = torch.ops.dres_cuda
    for rows, hidden in ((257, 300), (4099, 1536)):
        pre = torch.randn(rows, hidden, device="cuda").to(F16)
        bias = torch.randn(hidden, device="cuda").to(F16)
        g = torch.randn(rows, hidden, device="cuda").to(F16)
        act = c.bias_gelu(pre, bias, None, "quick")
        first = c.bias_gelu_backward(g, pre, bias, F16, True, "quick")
        for name, t in zip(("act", "dpre", "act again", "dbias"), (act, *first)):
            assert torch.isfinite(t).all(), f"{rows} x {hidden}: {name} has unwritten (NaN) elements"
        second = c.bias_gelu_backward(g, pre, bias, F16, True, "quick")
        for name, a, b in zip(("dpre", "act", "dbias"), first, second):
            assert torch.equal(a, b), f"{rows} x {hidden}: {name} differs between two identical runs"


@gpu
def test_mlp_opcheck_and_default_backend():
    torch.manual_seed(5)
    c = torch.ops.dres_cuda
    x = torch.randn(4, 7, 24, device="cuda", requires_grad=True)
    w1 = torch.randn(40, 24, device="cuda", requires_grad=True)
    b1 = torch.randn(40, device="cuda", requires_grad=True)
    w2 = torch.randn(24, 40, device="cuda", requires_grad=True)
    b2 = torch.randn(24, device="cuda", requires_grad=True)
    every = ("test_schema", "test_autograd_registration", "test_faketensor")
    for args in ((x, w1, b1, w2, b2, F32, "none"), (x, w1, None, w2, None, BF16, "quick")):
        torch.library.opcheck(c.fused_mlp.default, args, test_utils=every)
    pre, g = torch.randn(28, 40, device="cuda"), torch.randn(28, 40, device="cuda")
    kernels = ("test_schema", "test_faketensor")  # fused_mlp's autograd is theirs
    torch.library.opcheck(c.bias_gelu.default, (pre, b1.detach(), BF16, "tanh"), test_utils=kernels)
    torch.library.opcheck(c.bias_gelu_backward.default, (g, pre, b1.detach(), F32, True, "none"), test_utils=kernels)
    # backend=None on a csrc build: the csrc MLP in eager at these sizes, the Triton one when compiled
    assert "FusedMlpFunction" in ops.fused_mlp(x, w1, b1, w2, b2).grad_fn.name()
    assert type(ops.fused_mlp(x, w1, b1, w2, b2, backend="triton").grad_fn).__name__ == "FusedMlpFnBackward"
    compiled = torch.compile(lambda *a: ops.fused_mlp(*a), fullgraph=True)
    torch.testing.assert_close(compiled(x, w1, b1, w2, b2), ops.fused_mlp(x, w1, b1, w2, b2, backend="triton"))


@gpu
def test_default_backend_is_csrc_in_eager_at_small_sizes_and_triton_otherwise():
    """backend=None with the extension built: csrc for small eager calls, Triton for large tensors
    and under CUDA-graph capture (checks.choose_default_backend); both give the same values."""
    x, h, w, b = make_case((4, 50, 768), F32, BF16, "cuda")
    x.requires_grad_(True)
    out, y = ops.residual_layer_norm(x, h, w, b)
    assert "ResidualLayerNormFunction" in out.grad_fn.name()  # the csrc op's C++ autograd (csrc/ops.cpp)
    want_out, want_y = ops.residual_layer_norm(x, h, w, b, backend="triton")
    assert want_out.grad_fn.backend == "triton"
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(y, want_y, atol=2e-2, rtol=2e-2)  # bf16 y: one rounding apart at most
    big = torch.empty(ops.checks.CSRC_EAGER_MAX_ELEMENTS // 64 + 1, 64, device="cuda", requires_grad=True)
    assert ops.residual_add(big, big.detach()).grad_fn.backend == "triton"
    x2 = x.detach().clone()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        ops.residual_layer_norm(x2, h, w, b)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert ops.checks.resolve_backend(None, x2) == "triton"
        ops.residual_layer_norm(x2, h, w, b)


@gpu
def test_public_api_rejects_bad_input_before_the_extension():
    """dres.ops validates in Python before calling dres_cuda, so users get a ValueError/TypeError."""
    x, h, w, b = make_case((2, 3, 64), F32, BF16, "cuda")
    with pytest.raises(ValueError, match="weight has shape"):
        ops.residual_layer_norm(x, h, w[:10], b, backend="cuda")
    with pytest.raises(ValueError, match="h has shape"):
        ops.residual_layer_norm(x, h[:1], w, b, backend="cuda")
    with pytest.raises(ValueError, match="row_scale has length 4"):
        ops.residual_add(x, h, row_scale=torch.ones(4, device="cuda"), backend="cuda")
    with pytest.raises(TypeError, match="x has dtype torch.float64"):
        ops.layer_norm(x.double(), None, None, backend="cuda")
    with pytest.raises(ValueError, match="weight is on cpu"):
        ops.layer_norm(x, w.cpu(), None, backend="cuda")
    with pytest.raises(TypeError, match="eps must be a positive float"):
        ops.layer_norm(x, w, b, eps="1e-6", backend="cuda")
    with pytest.raises(ValueError, match="eps must be a positive finite float"):
        ops.residual_layer_norm(x, h, w, b, eps=0.0, backend="cuda")
    with pytest.raises(ValueError, match="row_scale requires grad"):
        ops.residual_add(x, h, row_scale=torch.ones(2, device="cuda", requires_grad=True), backend="cuda")


@gpu
def test_bad_input_names_the_argument():
    """Direct calls of the C++ ops raise RuntimeErrors naming the argument and its shape (they
    once segfaulted on the GPU image while the messages streamed integers; see csrc/ops.cpp num())."""
    x, h, w, b = make_case((2, 3, 64), F32, BF16, "cuda")
    c = torch.ops.dres_cuda
    with pytest.raises(RuntimeError, match=r"weight has shape \[10\]; expected \(64,\)"):
        c.residual_layer_norm(x, h, w[:10], b, None, 1.0, 1e-6, None, None, None, None, 0.0, None)
    with pytest.raises(RuntimeError, match=r"h has shape \[1, 3, 64\] but x has \[2, 3, 64\]"):
        c.residual_layer_norm(x, h[:1], w, b, None, 1.0, 1e-6, None, None, None, None, 0.0, None)
    with pytest.raises(RuntimeError, match=r"x has 6 rows, not divisible by len\(row_scale\) = 4"):
        c.residual_add(x, h, None, 1.0, torch.ones(4, device="cuda"), None, None, 0.0, None)
    with pytest.raises(RuntimeError, match="x has dtype"):
        c.layer_norm(x.double(), None, None, 1e-6, None)
    with pytest.raises(RuntimeError, match="CUDA tensor"):
        c.layer_norm(x, w.cpu(), None, 1e-6, None)
    for eps in (0.0, -1.0, float("nan")):
        with pytest.raises(RuntimeError, match="eps must be a positive finite float"):
            c.residual_layer_norm(x, h, w, b, None, 1.0, eps, None, None, None, None, 0.0, None)
        with pytest.raises(RuntimeError, match="eps must be a positive finite float"):
            c.layer_norm(x, w, b, eps, None)



# ---------------------------------------------------------------------------------------------
# CPU: what holds without a GPU


@built
def test_argument_checks_raise_through_the_cpp_autograd_without_gpu():
    """The C++ kernels run their argument checks before any device access. With the CUDA dispatch
    key forced on, CPU tensors reach them through the C++ autograd (as a GPU call does): the
    TORCH_CHECK must come back as a RuntimeError naming the argument, not a crash."""
    c = torch.ops.dres_cuda
    x = torch.randn(2, 3, 64, requires_grad=True)
    h = torch.randn(2, 3, 64).to(BF16)
    w, b = torch.randn(64), torch.randn(64)
    calls = [
        lambda: c.residual_layer_norm(x, h, w[:10], b, None, 1.0, 1e-6, None, None, None, None, 0.0, None),
        lambda: c.residual_add(x, h, None, 1.0, torch.ones(4), None, None, 0.0, None),
        lambda: c.layer_norm(x.double(), None, None, 1e-6, None),
        lambda: c.residual_norm_backward(None, None, None, None, None, None, None, None, 1.0, None, F32, None,
                                         False, False, False, 0.0, None),
    ]
    with cuda_dispatch_forced():
        for call in calls[:3]:
            with pytest.raises(RuntimeError, match="x must be a CUDA tensor"):
                call()
        with pytest.raises(RuntimeError, match="needs g_out or g_y"):
            calls[3]()
    assert torch.equal(torch.ones(2) + 1, torch.full((2,), 2.0))  # CPU tensors reach CPU kernels again


def test_forced_cuda_dispatch_leaves_the_thread_as_it_found_it():
    """What forcing the CUDA dispatch key in one test must not leak into the next: with the key left
    in the thread's included set (torch 2.11's guard alone), every later CPU op of the suite failed
    in CUDAGuardImpl (36 tests of test_ops.py after the argument-check test above, extension built)."""
    included = torch._C._dispatch_tls_local_include_set
    before = included().raw_repr()
    with cuda_dispatch_forced():
        assert included().has(torch._C.DispatchKey.CUDA)
    assert included().raw_repr() == before
    assert torch.equal(torch.ones(2) + 1, torch.full((2,), 2.0))



def test_package_imports_and_cuda_backend_without_extension_raises(monkeypatch):
    x = torch.randn(2, 3, 8)
    h = torch.randn(2, 3, 8)
    monkeypatch.setattr(csrc_backend, "available", lambda: False)
    for call in (lambda: ops.residual_layer_norm(x, h, None, None, backend="cuda"),
                 lambda: ops.residual_add(x, h, backend="cuda"),
                 lambda: ops.layer_norm(x, None, None, backend="cuda")):
        with pytest.raises(ValueError, match="DRES_BUILD_CUDA=1"):
            call()
    # The other backends are untouched.
    out, y = ops.residual_layer_norm(x, h, None, None, backend="torch")
    assert out.shape == x.shape


@built
def test_cuda_backend_with_cpu_tensors_raises():
    x = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match="CUDA tensors"):
        ops.residual_add(x, x, backend="cuda")


@built
def test_schemas_match_the_triton_ops():
    import dres.ops.bias_gelu  # noqa: F401  (registers dres::)
    import dres.ops.residual_norm  # noqa: F401  (and these)

    for name in OPS:
        ours = str(getattr(torch.ops.dres_cuda, name).default._schema).split("::", 1)[1]
        theirs = str(getattr(torch.ops.dres, name).default._schema).split("::", 1)[1]
        assert ours == theirs, f"{name}: {ours} != {theirs}"


@built
def test_fake_kernels_give_the_real_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(4, 8, 48, device="cuda")
        h = torch.empty(4, 8, 48, device="cuda", dtype=BF16)
        w = torch.empty(48, device="cuda")
        out, y, mean, rstd = torch.ops.dres_cuda.residual_layer_norm(x, h, w, w, None, 0.5, 1e-6, None, None, None,
                                                                     None, 0.0, None)
        assert (out.dtype, y.dtype, tuple(mean.shape), tuple(rstd.shape)) == (F32, BF16, (32,), (32,))
        dx, dh, dw, db, da = torch.ops.dres_cuda.residual_norm_backward(
            out, y, out, x, w, mean, rstd, None, 1.0, None, F32, BF16, True, True, True, 0.0, None)
        assert dx.shape == x.shape and dh.dtype == BF16 and dw.shape == (48,) and db.shape == (48,) and da.dim() == 0
        z = torch.ops.dres_cuda.residual_add(x, h, None, 1.0, None, None, BF16, 0.0, None)
        assert z.dtype == BF16


def _meta_leaves(shape, dtypes, needs):
    return [torch.empty(shape if i < 2 else shape[-1:], device="meta", dtype=d).requires_grad_(n)
            for i, (d, n) in enumerate(zip(dtypes, needs))]


def _grad_signature(outputs, inputs, grads):
    """Per input: None where it gets no gradient, else (shape, dtype)."""
    wanted = [t for t in inputs if t is not None and t.requires_grad]
    got = iter(torch.autograd.grad(outputs, wanted, grads, allow_unused=True) if wanted else ())
    return [None if t is None or not t.requires_grad else
            (lambda g: None if g is None else (tuple(g.shape), g.dtype))(next(got)) for t in inputs]


@built
@pytest.mark.parametrize("needs", [(True, True, True, True, True), (True, False, True, False, False),
                                   (False, True, False, True, True), (True, True, False, False, False)])
@pytest.mark.parametrize("scales", ["none", "row", "row_and_grad"])
def test_cpp_autograd_gives_the_gradients_the_reference_gives(needs, scales):
    """The C++ autograd of the csrc ops (csrc/ops.cpp), on meta tensors (their fake kernels): every
    input gets a gradient of the reference's shape and dtype exactly where the reference gives one."""
    c = torch.ops.dres_cuda
    need_x, need_h, need_w, need_b, need_alpha = needs
    x, h, w, b = _meta_leaves((4, 3, 48), (F32, BF16, BF16, F32), (need_x, need_h, need_w, need_b))
    alpha = torch.empty((), device="meta").requires_grad_(need_alpha)
    rs = None if scales == "none" else torch.empty(4, device="meta")
    gs = rs if scales == "row_and_grad" else None
    inputs = (x, h, w, b, alpha)
    out, y, mean, rstd = c.residual_layer_norm.default(x, h, w, b, alpha, 1.0, 1e-6, rs, gs, None, F32, 0.0, None)
    assert not mean.requires_grad and not rstd.requires_grad
    grads = (torch.ones_like(out), torch.ones_like(y))
    want = reference.residual_layer_norm(x, h, w, b, alpha, 1e-6, rs, gs, None, F32)
    assert _grad_signature((out, y), inputs, grads) == _grad_signature(want, inputs, grads)
    # out alone carries a gradient: the norm's parameters get zeros, as the Python Functions give
    out, _, _, _ = c.residual_layer_norm.default(x, h, w, b, alpha, 1.0, 1e-6, rs, gs, None, None, 0.0, None)
    dw_db = _grad_signature(out, inputs, torch.ones_like(out))[2:4]
    assert dw_db == [((48,), BF16) if need_w else None, ((48,), F32) if need_b else None]
    out = c.residual_add.default(x, h, alpha, 1.0, rs, gs, BF16, 0.0, None)
    want = reference.residual_add(x, h, alpha, rs, gs, BF16)
    assert out.dtype == BF16
    assert _grad_signature(out, inputs, torch.ones_like(out)) == _grad_signature(want, inputs, torch.ones_like(out))
    y, _, _ = c.layer_norm.default(x, w, b, 1e-6, BF16)
    want = reference.layer_norm(x, w, b, 1e-6, BF16)
    assert _grad_signature(y, (x, w, b), torch.ones_like(y)) == _grad_signature(want, (x, w, b), torch.ones_like(y))
    y, _, _ = c.layer_norm.default(x, None, None, 1e-6, None)
    assert _grad_signature(y, (x, None, None), torch.ones_like(y))[1:] == [None, None]


@built
@pytest.mark.parametrize("needs", [(True, True, True, True, True), (False, True, False, True, False),
                                   (True, False, False, False, False)])
@pytest.mark.parametrize("autocast", [False, True])
def test_cpp_autograd_of_the_mlp_gives_the_gradients_the_reference_gives(needs, autocast):
    """dres_cuda::fused_mlp's C++ autograd on meta tensors: each input gets a gradient of the reference
    MLP's shape and dtype exactly where the reference gives one, the output in the compute dtype."""
    shapes = ((4, 3, 24), (40, 24), (40,), (24, 40), (24,))
    x, w1, b1, w2, b2 = [torch.empty(shape, device="meta").requires_grad_(need)
                                  for shape, need in zip(shapes, needs)]
    compute = BF16 if autocast else F32
    for fc1_bias, fc2_bias in ((b1, b2), (None, None)):
        out = torch.ops.dres_cuda.fused_mlp.default(x, w1, fc1_bias, w2, fc2_bias, compute, "tanh")
        assert out.shape == (4, 3, 24) and out.dtype == compute and out.requires_grad == any(needs)
        args = (x, w1, fc1_bias, w2, fc2_bias)
        x_c, w1_c, b1_c, w2_c, b2_c = (None if t is None else t.to(compute) for t in args)
        want = F.linear(F.gelu(F.linear(x_c, w1_c, b1_c), approximate="tanh"), w2_c, b2_c)  # the MLP, as autocast runs it
        g = torch.ones_like(out)
        assert _grad_signature(out, args, g) == _grad_signature(want, args, g)
    # below autograd no op hands back its input (without autocast the casts to float32 are no-ops)
    torch.library.opcheck(torch.ops.dres_cuda.fused_mlp.default, (x, w1, b1, w2, b2, compute, "none"),
                          test_utils=("test_schema",))


def _run_setup(monkeypatch, env_value):
    """Run setup.py with setuptools.setup replaced by a recorder; returns setup()'s kwargs."""
    import setuptools

    seen = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: seen.update(kw))
    if env_value is None:
        monkeypatch.delenv("DRES_BUILD_CUDA", raising=False)
    else:
        monkeypatch.setenv("DRES_BUILD_CUDA", env_value)
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["setup.py", "--name"])
    runpy.run_path(os.path.join(ROOT, "setup.py"), run_name="__main__")
    return seen


@pytest.mark.parametrize("env_value", [None, "0", ""])
def test_setup_does_not_compile_unless_asked(monkeypatch, env_value):
    kw = _run_setup(monkeypatch, env_value)  # the name and metadata live in pyproject.toml
    assert kw["package_dir"]["dres.kernels"] == "kernels" and "dres.train" in kw["packages"]
    assert not kw.get("ext_modules") and "cmdclass" not in kw


def test_setup_rejects_unknown_build_mode(monkeypatch):
    with pytest.raises(SystemExit, match="DRES_BUILD_CUDA"):
        _run_setup(monkeypatch, "maybe")


def test_setup_describes_the_extension_when_asked(monkeypatch):
    """DRES_BUILD_CUDA=1 declares dres._C for sm_80 + sm_90 (declaring compiles nothing), or,
    where it cannot be built, exits saying why."""
    try:
        kw = _run_setup(monkeypatch, "1")
    except SystemExit as e:
        assert "cannot be built" in str(e)
        return
    (ext,) = kw["ext_modules"]
    assert ext.name == "dres._C"
    assert sorted(os.path.basename(s) for s in ext.sources) == ["bias_gelu.cu", "ops.cpp", "residual_norm.cu"]
    nvcc = ext.extra_compile_args["nvcc"]
    assert "-gencode=arch=compute_80,code=sm_80" in nvcc and "-gencode=arch=compute_90,code=sm_90" in nvcc
