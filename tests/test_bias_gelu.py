"""The fused bias + GELU op (exact erf GELU, its tanh approximation and QuickGELU) and the memory-saving MLP
against float64 PyTorch.

Forward and backward of ``fused_bias_gelu`` (act, dpre, dbias) and of ``fused_mlp`` (out, dx, dW1,
db1, dW2, db2) on fresh random inputs, with tests/test_ops.py's per-dtype relative-L2 tolerances;
odd sizes, strided gradients, poisoned outputs, deterministic dbias, opcheck, torch.compile,
autocast, the saved-tensor memory the op exists for, and bad input. On CPU the Triton kernels run
under TRITON_INTERPRET=1 (tests/conftest.py); ``gpu``-marked tests add ViT-B shapes, Inductor and
CUDA graphs.
"""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import dres.ops as ops
from dres.ops import bias_gelu as bg
from dres.ops import csrc_backend, reference
from helpers import (BF16, F16, F32, TOLERANCE, as_f64, assert_close, assert_graph_runs, capture_graph, grads, leaves,
                     recording_backend, rel_err)

MLP_GRAD_NAMES = ("dx", "dW1", "db1", "dW2", "db2")


NEEDS_CSRC = [pytest.mark.gpu, pytest.mark.skipif(not (torch.cuda.is_available() and csrc_backend.available()),
                                                  reason="needs a CUDA GPU and the csrc extension (DRES_BUILD_CUDA=1)")]


@pytest.fixture(params=["triton", pytest.param("cuda", marks=NEEDS_CSRC)])
def mlp_backend(request, triton_device):
    """(backend, device) of an eager fused_mlp: the Triton kernels (the GPU, or the CPU's interpreter), or
    the csrc extension's MLP (its kernels and C++ autograd) on the GPU."""
    return request.param, triton_device


def make_pre(rows, hidden, dtype, device, bias_dtype=F32):
    # Scale 2: most of the values fall in GELU's curved region (|v| < 3), some in both tails.
    pre = (2.0 * torch.randn(rows, hidden, device=device)).to(dtype)
    bias = (0.5 * torch.randn(hidden, device=device)).to(bias_dtype)
    return pre, bias


def make_mlp(shape, hidden, out_features, dtype, device, param_dtype=None):
    """x and nn.Linear-like parameters (fc1: (hidden, D), fc2: (out, hidden)), xavier-scaled."""
    dim = shape[-1]
    param_dtype = param_dtype or dtype
    x = torch.randn(shape, device=device).to(dtype)
    w1 = (torch.randn(hidden, dim, device=device) / dim**0.5).to(param_dtype)
    b1 = (0.5 * torch.randn(hidden, device=device)).to(param_dtype)
    w2 = (torch.randn(out_features, hidden, device=device) / hidden**0.5).to(param_dtype)
    b2 = (0.1 * torch.randn(out_features, device=device)).to(param_dtype)
    return x, w1, b1, w2, b2


def bias_gelu_against_float64(pre, bias, g=None, backend="triton", approximate="none"):
    """((act, dpre, dbias) of the op, the same of the float64 reference) for cotangent g."""
    pl, bl = leaves(pre, bias)
    act = ops.fused_bias_gelu(pl, bl, backend=backend, approximate=approximate)
    g = torch.randn_like(act) if g is None else g
    got = grads(act, g, (pl, bl))
    p6, b6 = as_f64(pre, bias)
    act6 = reference.bias_gelu(p6, b6, approximate=approximate)
    want = grads(act6, g.double(), (p6, b6))
    return (act, *got), (act6, *want)


def mlp_against_float64(x, w1, b1, w2, b2, g=None, backend="triton", approximate="none"):
    """((out, dx, dW1, db1, dW2, db2) of fused_mlp, the same of the float64 MLP) for cotangent g."""
    inputs = leaves(x, w1, b1, w2, b2)
    out = ops.fused_mlp(*inputs, backend=backend, approximate=approximate)
    g = torch.randn_like(out) if g is None else g
    got = grads(out, g, inputs)
    inputs6 = as_f64(x, w1, b1, w2, b2)
    out6 = reference.mlp(*inputs6, approximate=approximate)
    want = grads(out6, g.double(), inputs6)
    return (out, *got), (out6, *want)


# ---------------------------------------------------------------------------------------------
# fused_bias_gelu


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("rows,hidden", [(1, 37), (3, 100), (129, 37), (129, 300)])
def test_bias_gelu_matches_float64(triton_device, dtype, rows, hidden):
    torch.manual_seed(rows * 1000 + hidden)
    pre, bias = make_pre(rows, hidden, dtype, triton_device)
    (act, dpre, dbias), (act6, dpre6, dbias6) = bias_gelu_against_float64(pre, bias)
    assert act.dtype == dtype and dpre.dtype == dtype and dbias.dtype == F32
    assert_close("act", act, act6, dtype)
    assert_close("dpre", dpre, dpre6, dtype)
    # dbias sums the fp32 products g * gelu'(v) of the (exactly representable) inputs, not the
    # rounded stored dpre, so it is fp32-accurate whatever the storage dtype.
    assert_close("dbias", dbias, dbias6, F32)


def test_bias_gelu_without_bias_and_with_out_dtype(triton_device):
    torch.manual_seed(1)
    pre, _ = make_pre(5, 3 * 37, BF16, triton_device)
    pre = pre.view(5, 3, 37)  # any leading shape
    act = ops.fused_bias_gelu(pre, None, out_dtype=F32, backend="triton")
    assert act.dtype == F32 and act.shape == pre.shape
    assert_close("act", act, F.gelu(pre.double()), F32)  # computed in fp32 from the bf16 input
    # The exact-erf GELU of nn.GELU's default, not the tanh approximation.
    assert rel_err(act, F.gelu(pre.double(), approximate="tanh")) > 10 * TOLERANCE[F32]


@pytest.mark.parametrize("approximate", ["tanh", "quick"])
@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_approximate_bias_gelu_matches_float64(triton_device, dtype, approximate):
    """approximate="tanh" against F.gelu(approximate="tanh") and "quick" against QuickGELU's v * sigmoid(1.702 v),
    in float64: odd sizes (masked rows and columns, several row strips), and for fp32 a non-contiguous cotangent."""
    torch.manual_seed(13)
    pre, bias = make_pre(129, 37, dtype, triton_device)
    g = torch.randn(37, 129, device=triton_device).to(dtype).t() if dtype == F32 else None  # stride(-1) != 1
    (act, dpre, dbias), (act6, dpre6, dbias6) = bias_gelu_against_float64(pre, bias, g, approximate=approximate)
    assert act.dtype == dtype and dpre.dtype == dtype and dbias.dtype == F32
    assert_close("act", act, act6, dtype)
    assert_close("dpre", dpre, dpre6, dtype)
    assert_close("dbias", dbias, dbias6, F32)
    if dtype == F32:  # this formula ran, not the erf one: their difference is far above fp32 rounding
        assert rel_err(act, reference.bias_gelu(*as_f64(pre, bias))) > 10 * TOLERANCE[F32]


# The interpreter computes with numpy, which warns where fp32 overflows to inf as the kernel means it to.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:divide by zero:RuntimeWarning")
@pytest.mark.parametrize("approximate", ["none", "tanh", "quick"])
def test_bias_gelu_gradient_has_no_nan_at_extremes(triton_device, approximate):
    """Past |v| = 1.8e19 (v * v overflows fp32, and torch's own fp32 tanh-GELU gradient is NaN), and where the
    exponentials overflow or underflow, the kernel's gradient is the float64 one: 0 below, 1 above."""
    pre = torch.tensor([[-1e20, -100.0, -30.0, -9.0, -4.0, 4.0, 9.0, 30.0, 100.0, 1e20]], device=triton_device)
    (act, dpre, _), (act6, dpre6, _) = bias_gelu_against_float64(pre, None, torch.ones_like(pre),
                                                                 approximate=approximate)
    torch.testing.assert_close(act.double(), act6, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dpre.double(), dpre6, rtol=1e-6, atol=1e-6)


def test_erf_gelu_keeps_its_digits_in_the_negative_tail(triton_device):
    """For v < 0 the kernel's Phi is erfc(|v| / sqrt(2)) / 2 itself, not 1 + erf(v / sqrt(2)), which cancels: down to
    v = -12 (gelu 2e-32) each fp32 activation and gradient is within 2e-5 of the float64 value relative to itself
    (float64's erfc), where F.gelu's fp32 form is off by up to 100% past v = -5."""
    pre = torch.linspace(-12.0, -1.0, 2201, device=triton_device).view(1, -1).requires_grad_()
    act = ops.fused_bias_gelu(pre, None, backend="triton")
    (dpre,) = torch.autograd.grad(act, pre, torch.ones_like(act))
    v = pre.detach().double()
    phi = torch.special.erfc(-v / math.sqrt(2)) / 2
    act6, dpre6 = v * phi, phi + v * torch.exp(-0.5 * v * v) / math.sqrt(2 * math.pi)
    assert act6.abs().min() > 1e-32
    assert ((act.double() - act6).abs() / act6.abs()).max() < 2e-5
    assert ((dpre.double() - dpre6).abs() / dpre6.abs()).max() < 2e-5
    fp32_erf_form = F.gelu(pre.detach())
    assert ((fp32_erf_form.double() - act6).abs() / act6.abs()).max() > 0.5  # the cancellation this test is about


def test_bias_gelu_empty_rows(triton_device):
    pre, bias = make_pre(0, 37, F32, triton_device)
    (act, dpre, dbias), _ = bias_gelu_against_float64(pre, bias)
    assert act.shape == (0, 37) and dpre.shape == (0, 37)
    assert torch.equal(dbias, torch.zeros_like(bias))


def test_bias_gelu_gradients_with_any_strides(triton_device):
    torch.manual_seed(3)
    rows, hidden = 40, 100
    pre, bias = make_pre(rows, hidden, F32, triton_device)
    cotangents = {
        "slice": torch.randn(rows, 2 * hidden, device=triton_device)[:, hidden:],          # row stride 2N
        "expanded": torch.randn(1, hidden, device=triton_device).expand(rows, hidden),     # row stride 0
        "transposed": torch.randn(hidden, rows, device=triton_device).t(),                 # stride(-1) != 1
    }
    for name, g in cotangents.items():
        got, want = bias_gelu_against_float64(pre, bias, g)
        for what, a, r in zip(("act", "dpre", "dbias"), got, want):
            assert_close(f"{name} {what}", a, r, F32)


def test_backward_op_recomputes_the_forward_activation(triton_device):
    """bias_gelu_backward's act (what fc2's weight gradient uses) is the forward's act, bit for bit."""
    torch.manual_seed(4)
    pre, bias = make_pre(70, 300, BF16, triton_device)
    for approximate in ("none", "tanh", "quick"):
        act = bg.bias_gelu_triton(pre, bias, None, approximate)
        dpre, act_again, dbias = bg.bias_gelu_backward_triton(torch.randn_like(pre), pre, bias, BF16, True, approximate)
        assert torch.equal(act_again, act), approximate
    assert dbias.shape == (300,) and dpre.shape == pre.shape
    dpre, no_act, no_dbias = bg.bias_gelu_backward_triton(torch.randn_like(pre), pre, bias, None, False, "none")
    assert no_act.numel() == 0 and no_dbias.numel() == 0


def test_launch_config_hooks_of_the_tuning_sweep(triton_device):
    """The launchers read ``forward_config`` and ``backward_config`` at every launch: benchmarks.tune_bias_gelu's
    ``configs_replaced`` runs them with other tiles, programs per SM and warps, the results unchanged."""
    from benchmarks.tune_bias_gelu import configs_replaced
    from dres.kernels import bias_gelu as kernels

    torch.manual_seed(12)
    pre, bias = make_pre(70, 300, BF16, triton_device)
    g = torch.randn_like(pre)

    def outputs():
        act = bg.bias_gelu_triton(pre, bias, None, "none")
        return (act, *bg.bias_gelu_backward_triton(g, pre, bias, BF16, True, "none"))

    default = outputs()
    assert kernels.forward_config(300) != (8, 64, 4) and kernels.backward_config(300) != (32, 64, 4, 2)
    with configs_replaced((8, 64, 4), (32, 64, 4, 2)), mock.patch.object(kernels, "cdiv", wraps=kernels.cdiv) as cdiv:
        tuned = outputs()
    assert cdiv.call_args_list[0].args == (70, 8)  # the forward: 70 rows in tiles of 8
    assert (300, 64) in [c.args for c in cdiv.call_args_list]  # the backward: column blocks of 64
    for got, want in zip(tuned[:3], default[:3]):  # act, dpre, act again: elementwise, the same bits
        assert torch.equal(got, want)
    torch.testing.assert_close(tuned[3], default[3])  # dbias: its partial sums in other strips


def test_every_output_element_is_written(triton_device, poisoned_allocations):
    """Outputs and the dbias partials start as NaN: an element a kernel skips stays NaN. The shapes
    give several row strips and column blocks, so the partials' reduction runs too."""
    from dres.kernels.bias_gelu import backward_config

    assert backward_config(300)[1] < 300  # more than one column block
    torch.manual_seed(5)
    for rows, hidden in ((129, 37), (129, 300)):
        pre, bias = make_pre(rows, hidden, BF16, triton_device)
        (act, dpre, dbias), _ = bias_gelu_against_float64(pre, bias)
        _, act_again, _ = bg.bias_gelu_backward_triton(torch.randn_like(pre), pre, bias, F32, False, "none")
        out, *mlp_grads = mlp_against_float64(*make_mlp((rows, 24), hidden, 20, F32, triton_device))[0]
        for name, t in dict(act=act, dpre=dpre, dbias=dbias, act_again=act_again, out=out,
                            **dict(zip(MLP_GRAD_NAMES, mlp_grads))).items():
            assert not torch.isnan(t).any(), f"{name} ({rows}x{hidden}) has unwritten (NaN) elements"


def test_dbias_is_not_overwritten_by_later_calls(triton_device):
    """dbias is an output of its own, never a view of the partial-sum scratch that the next backward
    reuses: with one row strip (the partials are dbias) and with several (summed from scratch)."""
    torch.manual_seed(11)
    for rows in (3, 257):
        pre, bias = make_pre(rows, 96, BF16, triton_device)
        dbias = bg.bias_gelu_backward_triton(torch.randn_like(pre), pre, bias, None, True, "none")[2]
        kept = dbias.clone()
        bg.bias_gelu_backward_triton(torch.randn_like(pre), pre, bias, None, True, "none")
        assert torch.equal(dbias, kept), f"{rows} rows: dbias changed under a later call"


def test_dbias_is_deterministic(triton_device):
    torch.manual_seed(6)
    pre, bias = make_pre(257, 300, F16, triton_device)
    g = torch.randn(257, 300, device=triton_device).to(F16)
    first, second = (bias_gelu_against_float64(pre, bias, g)[0] for _ in range(2))
    for name, a, c in zip(("act", "dpre", "dbias"), first, second):
        assert torch.equal(a, c), f"{name} differs between two identical runs"


# ---------------------------------------------------------------------------------------------
# fused_mlp


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("shape,hidden", [((129, 24), 100), ((2, 3, 16), 37), ((1, 8), 64)])
def test_fused_mlp_matches_float64(mlp_backend, dtype, shape, hidden):
    backend, device = mlp_backend
    torch.manual_seed(len(shape) * 100 + hidden)
    out_features = shape[-1]
    (out, *got), (out6, *want) = mlp_against_float64(*make_mlp(shape, hidden, out_features, dtype, device),
                                                     backend=backend)
    assert out.dtype == dtype and out.shape == shape
    assert_close("out", out, out6, dtype)
    for name, a, r in zip(MLP_GRAD_NAMES, got, want):
        assert a.dtype == dtype, name
        assert_close(name, a, r, dtype)


@pytest.mark.parametrize("approximate", ["tanh", "quick"])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_approximate_fused_mlp_matches_float64(mlp_backend, dtype, approximate):
    backend, device = mlp_backend
    torch.manual_seed(14)
    (out, *got), (out6, *want) = mlp_against_float64(*make_mlp((2, 3, 16), 37, 16, dtype, device),
                                                     backend=backend, approximate=approximate)
    assert_close("out", out, out6, dtype)
    for name, a, r in zip(MLP_GRAD_NAMES, got, want):
        assert_close(name, a, r, dtype)


def test_fused_mlp_optional_biases_and_partial_gradients(mlp_backend):
    backend, device = mlp_backend
    torch.manual_seed(7)
    x, w1, _, w2, _ = make_mlp((9, 16), 40, 12, F32, device)
    (out, dx, dw1, db1, dw2, db2), (out6, dx6, dw16, _, dw26, _) = mlp_against_float64(x, w1, None, w2, None,
                                                                                       backend=backend)
    assert db1 is None and db2 is None
    for name, a, r in (("out", out, out6), ("dx", dx, dx6), ("dW1", dw1, dw16), ("dW2", dw2, dw26)):
        assert_close(name, a, r, F32)
    # Only fc2's weight trained (fc1 frozen, x a constant): the backward still recomputes the activation.
    w2l = w2.clone().requires_grad_(True)
    out = ops.fused_mlp(x, w1, None, w2l, None, backend=backend)
    g = torch.randn_like(out)
    (dw2,) = grads(out, g, (w2l,))
    assert_close("dW2 alone", dw2, g.double().t() @ F.gelu(x.double() @ w1.double().t()), F32)


def test_fused_mlp_strided_gradient_and_empty_batch(mlp_backend):
    backend, device = mlp_backend
    torch.manual_seed(8)
    params = make_mlp((4, 5, 16), 37, 16, F32, device)
    g = torch.randn(1, 1, 16, device=device).expand(4, 5, 16)  # a broadcast loss gradient
    got, want = mlp_against_float64(*params, g=g, backend=backend)
    for name, a, r in zip(("out",) + MLP_GRAD_NAMES, got, want):
        assert_close(f"expanded g: {name}", a, r, F32)
    x0 = params[0][:0]
    (out, dx, dw1, db1, dw2, db2), _ = mlp_against_float64(x0, *params[1:], backend=backend)
    assert out.shape == (0, 5, 16) and dx.shape == x0.shape
    for name, t in dict(dW1=dw1, db1=db1, dW2=dw2, db2=db2).items():
        assert torch.count_nonzero(t) == 0, name


def test_fused_mlp_autocast_bf16(mlp_backend):
    """fp32 x and parameters under bf16 autocast: matmuls in bf16 (bf16 result), x's gradient in
    fp32 and the parameters' gradients in fp32, all within bf16 accuracy of the float64 MLP."""
    backend, device = mlp_backend
    torch.manual_seed(9)
    params = make_mlp((3, 11, 24), 100, 24, F32, device)
    inputs = leaves(*params)
    with torch.autocast(device.type, dtype=BF16):
        out = ops.fused_mlp(*inputs, backend=backend)
    assert out.dtype == BF16
    g = torch.randn_like(out)
    got = grads(out, g, inputs)
    inputs6 = as_f64(*params)
    out6 = reference.mlp(*inputs6)
    want = grads(out6, g.double(), inputs6)
    assert_close("out", out, out6, BF16)
    for name, a, r, p in zip(MLP_GRAD_NAMES, got, want, params):
        assert a.dtype == p.dtype == F32, name
        assert_close(name, a, r, BF16)
    # The reference backend follows the same dtype rules.
    with torch.autocast(device.type, dtype=BF16):
        assert ops.fused_mlp(*params, backend="torch").dtype == BF16


def _saved_activation_bytes(fn, params):
    """Bytes of the tensors autograd saves while ``fn`` runs, leaving out the parameters themselves
    (those stay alive anyway; casts of them under autocast count)."""
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    saved = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in param_storages:
            saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(saved)


@pytest.mark.parametrize("autocast", [False, True])
def test_fused_mlp_saves_one_hidden_activation_less(mlp_backend, autocast):
    """The point of the op: plain autograd keeps fc1's output (for GELU's backward) and GELU's
    output (for fc2's); fused_mlp keeps only fc1's and recomputes GELU. Exactly one (tokens x hidden)
    tensor of the compute dtype less."""
    backend, device = mlp_backend
    torch.manual_seed(10)
    tokens, dim, hidden = 33, 24, 100
    x, w1, b1, w2, b2 = make_mlp((tokens, dim), hidden, dim, F32, device)
    params = [p.requires_grad_(True) for p in (w1, b1, w2, b2)]
    x.requires_grad_(True)
    with torch.autocast(device.type, dtype=BF16, enabled=autocast):
        fused = _saved_activation_bytes(lambda: ops.fused_mlp(x, *params, backend=backend), params)
        plain = _saved_activation_bytes(lambda: F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2), params)
    hidden_bytes = tokens * hidden * (2 if autocast else 4)
    assert fused < plain
    assert plain - fused == hidden_bytes, (plain, fused, hidden_bytes)


def test_default_backend_is_reference_on_cpu():
    x, w1, b1, w2, b2 = as_f64(*make_mlp((5, 8), 16, 8, F32, "cpu"))
    out = ops.fused_mlp(x, w1, b1, w2, b2)
    assert out.dtype == torch.float64  # float64 runs only through the reference
    want = F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ops.fused_bias_gelu(x, b1[:8]), F.gelu(x + b1[:8]), rtol=1e-12, atol=1e-12)
    tanh = dict(approximate="tanh")
    torch.testing.assert_close(ops.fused_bias_gelu(x, b1[:8], **tanh), F.gelu(x + b1[:8], **tanh), rtol=0, atol=0)
    torch.testing.assert_close(ops.fused_mlp(x, w1, b1, w2, b2, **tanh),
                               F.linear(F.gelu(F.linear(x, w1, b1), **tanh), w2, b2), rtol=1e-12, atol=1e-12)
    v = x + b1[:8]  # QuickGELU as timm and HF write it
    torch.testing.assert_close(ops.fused_bias_gelu(x, b1[:8], approximate="quick"), v * torch.sigmoid(1.702 * v),
                               rtol=0, atol=0)


@pytest.mark.parametrize("approximate", ["none", "tanh", "quick"])
@pytest.mark.parametrize("autocast", [False, True])
def test_plain_mlp_is_the_mlp_of_a_plain_model(approximate, autocast):
    """plain_mlp computes what nn.Linear -> GELU (timm's and HF's QuickGELU for "quick") -> nn.Linear computes,
    outputs and gradients bit for bit, in fp32 and under bf16 autocast (the rule's launch-bound path)."""
    torch.manual_seed(3)
    fc1, fc2 = torch.nn.Linear(24, 96), torch.nn.Linear(96, 24)
    act = (lambda v: v * torch.sigmoid(1.702 * v)) if approximate == "quick" else torch.nn.GELU(approximate)
    x = torch.randn(5, 7, 24)
    results = []
    for fn in (lambda x: fc2(act(fc1(x))),
               lambda x: bg.plain_mlp(x, fc1.weight, fc1.bias, fc2.weight, fc2.bias, approximate)):
        xl = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=BF16, enabled=autocast):
            out = fn(xl)
        results.append((out, *torch.autograd.grad(out.float().square().sum(), [xl, *fc1.parameters(),
                                                                              *fc2.parameters()])))
    assert results[1][0].dtype == (BF16 if autocast else F32)
    for want, got in zip(*results):
        assert torch.equal(got, want)


@pytest.mark.parametrize("csrc_built", [False, True])
def test_a_launch_bound_eager_mlp_runs_as_the_plain_models(monkeypatch, csrc_built):
    """backend=None in eager mode without the csrc extension: a launch-bound fused_mlp (the residual norms' rule,
    dres.ops.checks.takes_pytorch_formula) runs plain_mlp, which keeps no float32 (tokens x hidden) tensor;
    inside replayed_launches(), with the extension or for a larger x, the fused path (fake CUDA tensors)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dres.ops.checks import replayed_launches

    ran = []
    monkeypatch.setattr(csrc_backend, "available", lambda: csrc_built)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(bg, "plain_mlp", lambda x, *args: ran.append("plain") or x)
    monkeypatch.setattr(bg.FusedMlpFn, "apply", lambda x, *args: ran.append("fused") or x)
    monkeypatch.setattr(torch.ops.dres_cuda, "fused_mlp", mock.Mock(default=lambda x, *a: ran.append("fused") or x),
                        raising=False)
    with FakeTensorMode():
        def mlp(tokens, dim):
            x, w1, b1, w2, b2 = make_mlp((128, tokens, dim), 4 * dim, dim, BF16, "cuda")
            return ops.fused_mlp(x, w1, b1, w2, b2)

        mlp(257, 384)  # DINOv2 ViT-S/14 at batch 128: 4.9e9
        with replayed_launches():
            mlp(257, 384)
        mlp(197, 768)  # ViT-B/16: 1.5e10
    assert ran == ["fused" if csrc_built else "plain", "fused", "fused"]


def test_cuda_backend_runs_the_triton_kernel_for_every_gelu(triton_device, monkeypatch):
    """fused_bias_gelu has no csrc path of its own (the csrc bias + GELU serves fused_mlp): backend="cuda"
    (and the auto choice where the residual ops take csrc) dispatches every GELU to the Triton kernel."""
    from dres.ops import checks

    pre, bias = leaves(*make_pre(6, 37, F32, triton_device))
    monkeypatch.setattr(checks, "resolve_backend", lambda backend, x, name="x": "cuda")  # as on a csrc build
    for approximate in ("none", "tanh", "quick"):
        act = ops.fused_bias_gelu(pre, bias, backend="cuda", approximate=approximate)
        assert type(act.grad_fn).__name__ == "BiasGeluFnBackward"
        assert torch.equal(act, bg.bias_gelu_triton(pre.detach(), bias.detach(), None, approximate)), approximate


# ---------------------------------------------------------------------------------------------
# Registration: opcheck, eager fast path, torch.compile


def test_opcheck(triton_device):
    torch.manual_seed(11)
    pre, bias = make_pre(6, 37, BF16, triton_device)
    g = torch.randn(6, 37, device=triton_device)
    req = lambda *ts: [t.clone().requires_grad_(True) for t in ts]  # noqa: E731
    pr, br = req(pre, bias)
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    for args in ((pr, br, None, "none"), (pr, None, F32, "tanh"), (pr, br, None, "quick"), (pre, bias, None, "none")):
        torch.library.opcheck(bg.bias_gelu_op, args, test_utils=checks)
    # The backward op has no autograd of its own (no double backward): plain inputs.
    for args in ((g, pre, bias, BF16, True, "tanh"), (g, pre, bias, BF16, True, "quick"),
                 (g.t().contiguous().t(), pre, None, None, False, "none"),
                 (g, pre, bias, None, True, "none")):
        torch.library.opcheck(bg.bias_gelu_backward_op, args, test_utils=checks)


def test_eager_calls_bypass_the_custom_ops(triton_device):
    """Outside torch.compile the ops run as plain autograd.Functions (no dispatcher cost)."""
    pre, bias = leaves(*make_pre(4, 37, F32, triton_device))
    assert type(ops.fused_bias_gelu(pre, bias, backend="triton").grad_fn).__name__ == "BiasGeluFnBackward"
    x, w1, b1, w2, b2 = leaves(*make_mlp((4, 8), 16, 8, F32, triton_device))
    assert type(ops.fused_mlp(x, w1, b1, w2, b2, backend="triton").grad_fn).__name__ == "FusedMlpFnBackward"


@pytest.mark.parametrize("autocast", [False, True])
def test_compile_fullgraph_matches_eager(triton_device, autocast):
    """Dynamo + AOTAutograd trace fused_mlp's Function into the custom ops, forward and backward,
    with no graph break, and compute exactly what eager does (Inductor itself runs on the GPU);
    the ops after the first take the tanh GELU and QuickGELU through their ``approximate`` argument."""
    torch.manual_seed(12)
    params = make_mlp((2, 7, 16), 37, 16, F32, triton_device)

    def block(x, w1, b1, w2, b2):
        h = ops.fused_mlp(x, w1, b1, w2, b2, backend="triton")
        h = ops.fused_bias_gelu(h, b2, backend="triton", approximate="tanh")
        return ops.fused_mlp(h, w1, b1, w2, b2, backend="triton", approximate="quick")

    forward_targets, backward_targets = set(), set()
    torch._dynamo.reset()  # compile afresh, so that the recording backend sees the graphs
    compiled = torch.compile(block, fullgraph=True, backend=recording_backend(forward_targets, backward_targets))
    eager_inputs, compiled_inputs = leaves(*params), leaves(*params)
    with torch.autocast(triton_device.type, dtype=BF16, enabled=autocast):
        eager = block(*eager_inputs)
        comp = compiled(*compiled_inputs)
    assert torch.equal(comp, eager)
    g = torch.randn_like(eager)
    for name, a, c in zip(MLP_GRAD_NAMES, grads(eager, g, eager_inputs), grads(comp, g, compiled_inputs)):
        assert torch.equal(c, a), name
    assert_graph_runs(forward_targets, ["bias_gelu"], triton_device)
    assert_graph_runs(backward_targets, ["bias_gelu_backward"], triton_device)


# ---------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_bad_input_errors_name_the_argument(triton_device, backend):
    x, w1, b1, w2, b2 = make_mlp((4, 3, 16), 32, 8, F32, triton_device)
    mlp = lambda **kw: ops.fused_mlp(**{**dict(x=x, fc1_weight=w1, fc1_bias=b1, fc2_weight=w2, fc2_bias=b2,  # noqa: E731
                                              backend=backend), **kw})
    with pytest.raises(ValueError, match=r"fc1_weight has shape \(32, 15\); expected \(hidden, 16\)"):
        mlp(fc1_weight=w1[:, :15])
    with pytest.raises(ValueError, match=r"fc2_weight has shape \(8, 31\); expected \(out, 32\)"):
        mlp(fc2_weight=w2[:, :31])
    with pytest.raises(ValueError, match=r"fc1_bias has shape \(31,\); expected \(32,\)"):
        mlp(fc1_bias=b1[:31])
    with pytest.raises(ValueError, match=r"fc2_bias has shape \(4, 2\); expected \(8,\)"):
        mlp(fc2_bias=b2.view(4, 2))
    with pytest.raises(ValueError, match="fc2_weight must be a 2-D"):
        mlp(fc2_weight=w2.flatten())
    with pytest.raises(ValueError, match="x must have shape"):
        mlp(x=x[0, 0])
    with pytest.raises(TypeError, match="x has dtype torch.int64"):
        mlp(x=torch.ones(4, 16, dtype=torch.long, device=triton_device))
    with pytest.raises(TypeError, match="fc1_weight must be a torch.Tensor"):
        mlp(fc1_weight=w1.tolist())
    with pytest.raises(ValueError, match=r"bias has shape \(36,\); expected \(37,\)"):
        ops.fused_bias_gelu(torch.randn(2, 37, device=triton_device), torch.randn(36, device=triton_device), backend=backend)
    with pytest.raises(TypeError, match="pre has dtype torch.int32"):
        ops.fused_bias_gelu(torch.ones(2, 8, dtype=torch.int32, device=triton_device), backend=backend)
    with pytest.raises(TypeError, match="out_dtype must be None or one of"):
        ops.fused_bias_gelu(torch.randn(2, 8, device=triton_device), out_dtype=torch.int8, backend=backend)
    with pytest.raises(ValueError, match="backend must be one of"):
        ops.fused_mlp(x, w1, b1, w2, b2, backend="cutlass")
    with pytest.raises(ValueError, match="approximate must be 'none' .* or 'tanh'.*; got 'erf'"):
        ops.fused_bias_gelu(x, approximate="erf", backend=backend)
    with pytest.raises(ValueError, match="approximate must be .*; got True"):
        mlp(approximate=True)


def test_kernels_reject_float64(triton_device):
    x, w1, b1, w2, b2 = make_mlp((4, 16), 32, 8, F32, triton_device)
    with pytest.raises(TypeError, match="fc1_weight has dtype torch.float64"):
        ops.fused_mlp(x, w1.double(), b1, w2, b2, backend="triton")
    with pytest.raises(TypeError, match="pre has dtype torch.float64"):
        ops.fused_bias_gelu(x.double(), backend="triton")


@pytest.mark.gpu
def test_tensors_on_different_devices():
    x, w1, b1, w2, b2 = make_mlp((4, 16), 32, 8, F32, "cuda")
    with pytest.raises(ValueError, match="fc1_weight is on cpu but x is on cuda"):
        ops.fused_mlp(x, w1.cpu(), b1, w2, b2)
    with pytest.raises(ValueError, match="fc2_bias is on cpu but x is on cuda"):
        ops.fused_mlp(x, w1, b1, w2, b2.cpu())
    with pytest.raises(ValueError, match="bias is on cpu but x is on cuda"):
        ops.fused_bias_gelu(x, torch.zeros(16))


# ---------------------------------------------------------------------------------------------
# GPU: ViT-B shapes, autocast against the plain chain, Inductor, CUDA graphs


@pytest.mark.gpu
@pytest.mark.parametrize("approximate", ["none", "tanh", "quick"])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_gpu_vit_b_bias_gelu(dtype, approximate):
    """MAE ViT-B/16 at batch 256: 12800 visible tokens x 3072 hidden features."""
    torch.manual_seed(0)
    pre, bias = make_pre(12800, 3072, dtype, "cuda")
    g = torch.randn(12800, 3072, device="cuda").to(dtype)
    (act, dpre, dbias), (act6, dpre6, dbias6) = bias_gelu_against_float64(pre, bias, g, None, approximate)
    assert_close("act", act, act6, dtype)
    assert_close("dpre", dpre, dpre6, dtype)
    assert_close("dbias", dbias, dbias6, F32)
    again = bias_gelu_against_float64(pre, bias, g, None, approximate)[0]
    for name, a, c in zip(("act", "dpre", "dbias"), (act, dpre, dbias), again):
        assert torch.equal(a, c), f"{name} differs between two identical runs"
    _, act_again, _ = bg.bias_gelu_backward_triton(g, pre, bias, dtype, False, approximate)
    assert torch.equal(act_again, act)


def _plain_mlp(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


@pytest.mark.gpu
def test_gpu_fused_mlp_autocast_against_plain_chain():
    """ViT-B MLP (768 -> 3072 -> 768) on 256 x 50 tokens, fp32 parameters, bf16 autocast: the fused
    MLP is as accurate as the plain chain against float64, keeps one bf16 (tokens x 3072) tensor
    fewer alive between forward and backward, peaks no higher than the plain chain during the
    backward, and its gradients have the parameters' dtypes."""
    torch.manual_seed(1)
    params = make_mlp((256, 50, 768), 3072, 768, F32, "cuda")
    g = torch.randn(256, 50, 768, device="cuda", dtype=BF16)
    results, retained, peak = {}, {}, {}
    for fn in (ops.fused_mlp, _plain_mlp):  # first calls allocate cuBLAS workspaces: not activations
        inputs = leaves(*params)
        with torch.autocast("cuda", dtype=BF16):
            out = fn(*inputs)
        grads(out, g, inputs)
    del out, inputs
    for name, fn in (("fused", ops.fused_mlp), ("plain", _plain_mlp)):
        inputs = leaves(*params)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=BF16):
            out = fn(*inputs)
        retained[name] = torch.cuda.memory_allocated() - before
        results[name] = (out, *grads(out, g, inputs))
        torch.cuda.synchronize()
        peak[name] = torch.cuda.max_memory_allocated() - before
        del out
    inputs6 = as_f64(*params)
    out6 = _plain_mlp(*inputs6)
    want = (out6, *grads(out6, g.double(), inputs6))
    for name, fused, plain, ref in zip(("out",) + MLP_GRAD_NAMES, results["fused"], results["plain"], want):
        assert fused.dtype == plain.dtype, name
        err_fused, err_plain = rel_err(fused, ref), rel_err(plain, ref)
        assert err_fused <= max(1.5 * err_plain, TOLERANCE[F32]), f"{name}: fused {err_fused:.2e}, plain {err_plain:.2e}"
        assert err_fused <= TOLERANCE[BF16], name
    hidden_bytes = 256 * 50 * 3072 * 2
    assert retained["plain"] - retained["fused"] >= 0.95 * hidden_bytes, retained
    assert peak["fused"] <= peak["plain"], peak


@pytest.mark.gpu
@pytest.mark.parametrize("approximate", ["none", "tanh", "quick"])
def test_gpu_compile_inductor_fused_mlp(approximate):
    """Inductor launches the traced kernels (the ``GELU`` constexpr among their arguments)."""
    torch.manual_seed(2)
    params = make_mlp((8, 64, 256), 1024, 256, F32, "cuda")
    compiled = torch.compile(lambda *a: ops.fused_mlp(*a, approximate=approximate) * 2.0, fullgraph=True)
    eager_inputs, compiled_inputs = leaves(*params), leaves(*params)
    with torch.autocast("cuda", dtype=BF16):
        eager = ops.fused_mlp(*eager_inputs, approximate=approximate) * 2.0
        comp = compiled(*compiled_inputs)
    assert rel_err(comp, eager) < 1e-2
    g = torch.randn_like(eager)
    for name, a, c in zip(MLP_GRAD_NAMES, grads(eager, g, eager_inputs), grads(comp, g, compiled_inputs)):
        assert c.dtype == a.dtype == F32, name
        assert rel_err(c, a) < 1e-2, name


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", pytest.param("cuda", marks=NEEDS_CSRC)])
def test_gpu_cuda_graph_capture_and_replay(backend):
    """The replay gives what the same backend gives in eager, bit for bit (backend=None may take
    another backend in eager than under capture: checks.choose_default_backend)."""
    torch.manual_seed(3)
    x, w1, b1, w2, b2 = leaves(*make_mlp((64, 50, 768), 3072, 768, BF16, "cuda"))
    g = torch.randn(64, 50, 768, device="cuda", dtype=BF16)

    def step():
        out = ops.fused_mlp(x, w1, b1, w2, b2, backend=backend)
        return (out, *torch.autograd.grad(out, (x, w1, b1, w2, b2), g))

    graph, static = capture_graph(step)  # warmed up on a side stream first, as PyTorch's docs prescribe
    for _ in range(2):
        with torch.no_grad():
            x.copy_(torch.randn_like(x))
            b1.copy_(torch.randn_like(b1))
        graph.replay()
        eager = step()
        for name, a, c in zip(("out",) + MLP_GRAD_NAMES, static, eager):
            assert torch.equal(a, c), name
