"""dres.ops.residual_act: the fused convolutional residual ``act(alpha*x + row_scale[b]*h)``.

Every case compares the Triton kernels (CPU: TRITON_INTERPRET=1) with the float64 reference on fresh
random inputs, forward and backward, at per-dtype tolerances: the four drop-path uses of docs/ops.md's
table, ReLU and identity, NCHW and channels_last, odd sizes, strided gradients, poisoned outputs,
alpha as a tensor with a gradient, bad arguments and torch.compile (the op's formula). ``gpu``-marked tests add
ResNet-sized feature maps, more than 2**20 elements per sample, Inductor and CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch
from helpers import (BF16, F16, F32, MODES, assert_close, assert_direct_launch_equals_tritons_own, assert_sum_close,
                     capture_graph, grads, mode_scales, recording_backend)

import dres.ops as ops
from dres.ops import reference
from dres.ops.residual_act import sample_major_dense

DTYPE_PAIRS = [(F32, F32), (BF16, BF16), (F16, F16), (F32, BF16)]  # (x = shortcut, h = branch)
ACTS = ["relu", "identity"]
LAYOUTS = ["nchw", "channels_last"]


def make(shape, dtype, device, layout="nchw"):
    t = torch.randn(shape, device=device).to(dtype)
    return t.to(memory_format=torch.channels_last) if layout == "channels_last" else t


def away_from_the_kink(x, h, alpha, row_scale):
    """Move x, in place, where ``alpha*x + row_scale*h`` lies within fp32 rounding of 0: there relu has no one
    derivative (fp32 and float64 may round the pre-activation to opposite signs; about 3 draws in 1000 of the
    bf16 cases had one such element)."""
    scale = 1.0 if row_scale is None else row_scale.double().view(-1, *[1] * (x.dim() - 1))
    pre = alpha * x.double() + scale * h.double()
    x.add_((pre.abs() < 1e-4).to(x.dtype) * 0.0625)


def against_float64(x, h, alpha=0.8, row_scale=None, grad_scale=None, act="relu", g=None, backend="triton"):
    """((out, dx, dh, dalpha) of the op, the same of the float64 reference) for cotangent g.

    alpha: a float, or a tensor that then gets a gradient."""
    is_t = isinstance(alpha, torch.Tensor)
    xl, hl = x.detach().clone().requires_grad_(True), h.detach().clone().requires_grad_(True)
    al = alpha.detach().clone().requires_grad_(True) if is_t else alpha
    out = ops.residual_act(xl, hl, al, row_scale, grad_scale, act, backend=backend)
    g = torch.randn(out.shape, device=out.device).to(out.dtype) if g is None else g
    got = [out] + grads(out, g, [xl, hl, al if is_t else None])
    x6, h6 = x.detach().double().requires_grad_(True), h.detach().double().requires_grad_(True)
    a6 = alpha.detach().double().requires_grad_(True) if is_t else alpha
    f64 = lambda s: None if s is None else s.double()  # noqa: E731
    ref = reference.residual_act(x6, h6, a6, f64(row_scale), f64(grad_scale), act)
    want = [ref] + grads(ref, g.double(), [x6, h6, a6 if is_t else None])
    # dalpha = sum over elements of g * act' * x, and the reference's dx is alpha * g * act'
    want.append((want[1] / a6.detach() * x6.detach()).norm() if is_t else None)
    return got, want


def check_all(got, want, x_dtype, h_dtype):
    """want: the reference's (out, dx, dh, dalpha, root-sum-square of dalpha's terms)."""
    for name, a, r, dt in zip(("out", "dx", "dh"), got, want, (x_dtype, x_dtype, h_dtype)):
        assert_close(name, a, r, dt)
    if want[3] is not None:
        assert_sum_close("dalpha", got[3], want[3], want[4], F32)


# ---------------------------------------------------------------------------------------------
# The float64 reference: dtypes x drop-path uses x activations x layouts


@pytest.mark.parametrize("x_dtype,h_dtype", DTYPE_PAIRS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_float64(triton_device, x_dtype, h_dtype, mode, act, layout):
    torch.manual_seed(hash((str(x_dtype), mode, act, layout)) % 1000)
    shape = (3, 5, 7, 9)
    x, h = make(shape, x_dtype, triton_device, layout), make(shape, h_dtype, triton_device, layout)
    row_scale, grad_scale = mode_scales(mode, 3, triton_device)
    if act == "relu":
        away_from_the_kink(x, h, 0.85, row_scale)
    got, want = against_float64(x, h, 0.85, row_scale, grad_scale, act)
    check_all(got, want, x_dtype, h_dtype)
    memory_format = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    assert got[0].is_contiguous(memory_format=memory_format) and got[0].dtype == x_dtype


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 3, 37, 41), (3, 4096), (5, 1000), (5, 17), (4,),
                                   (2, 3, 4, 5, 3), (0, 3, 2, 2)])
def test_odd_sizes(triton_device, shape):
    """Samples longer than a program's 4096 elements (4551; exactly 4096) and shorter ones with a
    program boundary inside a sample (5 x 1000), one element per sample, 5-D, empty."""
    torch.manual_seed(sum(shape))
    x, h = make(shape, F32, triton_device), make(shape, BF16, triton_device)
    row_scale, grad_scale = mode_scales("rdp_even", shape[0], triton_device) if shape[0] > 1 else (None, None)
    got, want = against_float64(x, h, torch.tensor(0.7, device=triton_device), row_scale, grad_scale)
    if x.numel():
        check_all(got, want, F32, BF16)
    else:
        assert got[0].shape == shape and got[3].item() == 0.0


@pytest.mark.parametrize("mode", ["plain", "rdp_odd"])
def test_alpha_tensor_gets_gradient(triton_device, mode):
    torch.manual_seed(5)
    x, h = make((4, 6, 5, 5), F32, triton_device, "channels_last"), make((4, 6, 5, 5), F32, triton_device, "channels_last")
    row_scale, grad_scale = mode_scales(mode, 4, triton_device)
    got, want = against_float64(x, h, torch.tensor(0.6, device=triton_device), row_scale, grad_scale)
    check_all(got, want, F32, F32)
    assert got[3].shape == () and got[3].dtype == F32


def test_drop_path_uses_route_gradients(triton_device):
    """Even RDP iteration (m, m): dropped samples are the shortcut alone and their branch gets no
    gradient. Odd iteration (None, 1 - m): the value of the plain residual, gradient only into the
    branches that were dropped."""
    torch.manual_seed(6)
    x, h = make((6, 4, 5, 3), F32, triton_device), make((6, 4, 5, 3), F32, triton_device)
    m = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0], device=triton_device)
    hl = h.clone().requires_grad_(True)
    even = ops.residual_act(x, hl, 0.9, m, m, backend="triton")
    torch.testing.assert_close(even[m == 0], torch.relu(0.9 * x[m == 0]))
    even.sum().backward()
    assert torch.equal(hl.grad.flatten(1).abs().sum(1) == 0, m == 0)
    hl.grad = None
    odd = ops.residual_act(x, hl, 0.9, None, 1 - m, backend="triton")
    torch.testing.assert_close(odd, ops.residual_act(x, h, 0.9, backend="triton"))
    odd.sum().backward()
    assert torch.equal(hl.grad.flatten(1).abs().sum(1) == 0, m == 1)


# ---------------------------------------------------------------------------------------------
# Layouts and strides


def test_gradients_with_any_strides(triton_device):
    """Upstream gradients that are slices, expanded or in the other memory format are read correctly."""
    torch.manual_seed(7)
    shape = (3, 4, 6, 5)
    x, h = make(shape, F32, triton_device, "channels_last"), make(shape, BF16, triton_device, "channels_last")
    rs, gs = mode_scales("drop_path", 3, triton_device)
    big = torch.randn(3, 8, 6, 5, device=triton_device)
    for g in (big[:, ::2], torch.randn(1, 1, 1, 1, device=triton_device).expand(shape),
              torch.randn(shape, device=triton_device), torch.randn(5, 6, 4, 3, device=triton_device).permute(3, 2, 1, 0)):
        got, want = against_float64(x, h, torch.tensor(0.75, device=triton_device), rs, gs, g=g)
        check_all(got, want, F32, BF16)


def test_mixed_and_non_sample_major_layouts(triton_device):
    """h in another layout than x is read in x's layout; x whose batch is not outermost is copied."""
    torch.manual_seed(8)
    x = make((3, 5, 4, 6), F32, triton_device, "channels_last")
    h = make((3, 5, 4, 6), F32, triton_device)
    got, want = against_float64(x, h, 0.9, *mode_scales("rdp_even", 3, triton_device))
    check_all(got, want, F32, F32)
    assert got[0].is_contiguous(memory_format=torch.channels_last)
    xt = torch.randn(5, 3, 4, 6, device=triton_device).transpose(0, 1)  # batch not outermost
    assert not sample_major_dense(xt) and sample_major_dense(x) and sample_major_dense(h)
    got, want = against_float64(xt, h, 0.9, *mode_scales("rdp_odd", 3, triton_device))
    check_all(got, want, F32, F32)
    assert got[0].is_contiguous()


def test_every_output_element_is_written(triton_device, poisoned_allocations):
    """Outputs start as NaN: a skipped element shows (3 programs, the last one partial)."""
    torch.manual_seed(9)
    shape = (2, 3, 37, 41)
    for layout in LAYOUTS:
        x, h = make(shape, BF16, triton_device, layout), make(shape, BF16, triton_device, layout)
        got, want = against_float64(x, h, torch.tensor(0.5, device=triton_device),
                                    *mode_scales("drop_path", 2, triton_device), act="identity")
        check_all(got, want, BF16, BF16)


def test_reference_backend_runs_float64():
    x, h = torch.randn(2, 3, 4, 4, dtype=torch.float64), torch.randn(2, 3, 4, 4, dtype=torch.float64)
    out = ops.residual_act(x, h, 0.5, backend="torch")
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, torch.relu(0.5 * x + h))
    assert ops.residual_act(x, h).dtype == torch.float64  # CPU default: the reference


def test_the_formulas_relu_backward_reads_the_stored_out_as_the_kernels_does(triton_device):
    """Where alpha*x + h is positive in fp32 but rounds to 0 in the stored dtype, the kernel's ReLU backward (read
    from the stored out) passes no gradient; the formula (what torch.compile runs) must do the same."""
    x = torch.full((2, 1, 2, 2), 2.0 ** -24, dtype=F16, device=triton_device)  # fp16's smallest subnormal
    h = torch.zeros_like(x)
    got = []
    for backend in ("triton", "torch"):
        xl = x.clone().requires_grad_(True)
        out = ops.residual_act(xl, h, 0.25, backend=backend)  # 2**-26 in fp32, 0 in fp16
        out.backward(torch.ones_like(out))
        got.append((out, xl.grad))
    (out_kernel, dx_kernel), (out_formula, dx_formula) = got
    assert torch.equal(out_kernel, out_formula) and not out_kernel.any()
    assert torch.equal(dx_kernel, dx_formula) and not dx_kernel.any()


def test_a_plain_sum_is_what_the_default_leaves_to_pytorch():
    """backend=None leaves an eager call to PyTorch's add and ReLU when it has nothing to scale, in one
    dtype and layout; any factor, another dtype or layout, or an alpha tensor keeps the kernel."""
    from dres.ops.residual_act import is_plain_sum

    x = torch.randn(2, 3, 4, 4)
    cl, m = x.to(memory_format=torch.channels_last), torch.ones(2)
    assert is_plain_sum(x, x.clone(), 1.0, None, None) and is_plain_sum(cl, cl.clone(), 1, None, None)
    for h, alpha, row_scale, grad_scale in ((x, 0.9, None, None), (x, torch.tensor(1.0), None, None),
                                            (x, 1.0, m, None), (x, 1.0, None, m), (x.to(BF16), 1.0, None, None),
                                            (cl, 1.0, None, None)):
        assert not is_plain_sum(x, h, alpha, row_scale, grad_scale)
    # a 1 x 1 feature map (ResNet50d's last stage at 32 px) is NCHW and NHWC at once: strides of size-1 dims differ
    one = torch.randn(2, 8, 1, 1)
    nhwc = one.to(memory_format=torch.channels_last)
    assert one.stride() != nhwc.stride() and is_plain_sum(one, nhwc, 1.0, None, None)
    assert not is_plain_sum(x[:, :, :, :1].contiguous(), cl[:, :, :, :1], 1.0, None, None)  # 4 x 1: they differ


# ---------------------------------------------------------------------------------------------
# torch.compile: the op's formula, which Inductor fuses with its neighbours


def test_compile_traces_the_formula_with_no_dres_op_or_kernel(triton_device):
    """Under torch.compile the op is its PyTorch formula (no custom op, no Triton launch in the forward or
    backward graph, so Inductor can fuse it with the BatchNorm before it), with the drop-path uses' gradient
    routing intact, and no graph break."""
    from torch._higher_order_ops.triton_kernel_wrap import triton_kernel_wrapper_functional

    torch.manual_seed(11)
    shape = (3, 4, 5, 5)
    x, h = make(shape, F32, triton_device, "channels_last"), make(shape, F32, triton_device, "channels_last")
    m = torch.tensor([1.0, 0.0, 1.0], device=triton_device)

    def two_blocks(x, h, alpha):
        out = ops.residual_act(x, h, alpha, None, 1 - m, backend="triton")
        return ops.residual_act(out, torch.tanh(h), alpha, m, m, act="identity", backend="triton")

    forward_targets, backward_targets = set(), set()
    torch._dynamo.reset()  # compile afresh, so that the recording backend sees the graphs
    compiled = torch.compile(two_blocks, fullgraph=True, backend=recording_backend(forward_targets, backward_targets))
    alpha = torch.tensor(0.8, device=triton_device)
    xa, ha = x.clone().requires_grad_(True), h.clone().requires_grad_(True)
    xb, hb = x.clone().requires_grad_(True), h.clone().requires_grad_(True)
    eager, comp = two_blocks(xa, ha, alpha), compiled(xb, hb, alpha)
    torch.testing.assert_close(comp, eager)
    g = torch.randn_like(eager)
    for a, c in zip(grads(eager, g, (xa, ha)), grads(comp, g, (xb, hb))):
        torch.testing.assert_close(c, a)
    for targets in (forward_targets, backward_targets):
        assert targets and triton_kernel_wrapper_functional not in targets
        assert not [t for t in targets if "dres" in str(t)], targets
    assert torch.ops.aten.relu.default in forward_targets


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dynamic", [True, None])
def test_inductor_dynamic_shapes_match_eager(triton_device, layout, dynamic):
    """Inductor with symbolic sizes around the op and its backward: ``dynamic=True`` compiles once for
    every batch and feature-map size, the default at most once per shape; outputs and the gradients of
    x, h and alpha equal eager's, with per-sample scales."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from helpers import inductor_caches_off

    def block(x, h, alpha, m):
        out = ops.residual_act(x, 2 * h, alpha, m, 1 - m, backend="triton")
        return ops.residual_act(out, h, alpha, m, m, act="identity", backend="triton")

    torch.manual_seed(12)
    torch._dynamo.reset()  # block's code object keeps its compiles and automatic-dynamic sizes across parameters
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(block, backend=counter, dynamic=dynamic, fullgraph=True)
    with inductor_caches_off():
        for shape in [(2, 3, 5, 6), (3, 3, 7, 4), (5, 3, 5, 6)]:  # the 2nd changes every dim but C
            x, h = make(shape, F32, triton_device, layout), make(shape, F32, triton_device, layout)
            m, _ = mode_scales("rdp_even", shape[0], triton_device)
            alpha = torch.tensor(0.8, device=triton_device)
            inputs = [[t.clone().requires_grad_(True) for t in (x, h, alpha)] for _ in range(2)]
            eager, comp = block(*inputs[0], m), compiled(*inputs[1], m)
            assert comp.stride() == eager.stride()
            torch.testing.assert_close(comp, eager, rtol=1e-6, atol=1e-6)
            g = torch.randn(*shape[:-1], 2 * shape[-1], device=triton_device)[..., ::2]  # a strided gradient
            (*elementwise, d_alpha), (*elementwise_c, d_alpha_c) = grads(eager, g, inputs[0]), grads(comp, g, inputs[1])
            for a, c in zip(elementwise, elementwise_c):
                torch.testing.assert_close(c, a, rtol=1e-6, atol=1e-6)
            # alpha's gradient is a sum over every element: Inductor may add in another order (seen with
            # channels_last on an H200, 2e-6 relative), so fp32's default tolerance
            torch.testing.assert_close(d_alpha_c, d_alpha)
    if dynamic:  # one graph with symbolic sizes serves every shape
        assert counter.frame_count == 1
    else:  # when automatic dynamic turns sizes symbolic depends on what earlier compiles in the process left
        assert counter.frame_count <= 3


# ---------------------------------------------------------------------------------------------
# Bad arguments: one-line errors naming the argument


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_bad_arguments_name_the_argument(triton_device, backend):
    dev = triton_device
    x, h = torch.randn(2, 3, 4, 4, device=dev), torch.randn(2, 3, 4, 4, device=dev)
    bad = [
        (dict(x=x.numpy() if dev.type == "cpu" else x.cpu()), TypeError if dev.type == "cpu" else ValueError, "x"),
        (dict(x=x.long()), TypeError, "x has dtype"),
        (dict(h=h[:, :2]), ValueError, "h has shape"),
        (dict(h=h.int()), TypeError, "h has dtype"),
        (dict(alpha=torch.ones(2, device=dev)), ValueError, "alpha must be"),
        (dict(alpha="0.5"), TypeError, "alpha must be"),
        (dict(row_scale=torch.ones(3, device=dev)), ValueError, "row_scale has shape"),
        (dict(grad_scale=torch.ones(2, 1, device=dev)), ValueError, "grad_scale has shape"),
        (dict(act="gelu"), ValueError, "act must be"),
        (dict(x=torch.tensor(1.0, device=dev), h=torch.tensor(1.0, device=dev)), ValueError, "x must have a batch"),
    ]
    for kwargs, exc, match in bad:
        args = dict(x=x, h=h, alpha=0.9, row_scale=None, grad_scale=None, act="relu") | kwargs
        with pytest.raises(exc, match=match) as info:
            ops.residual_act(backend=backend, **args)
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="backend must be"):
        ops.residual_act(x, h, backend="cudnn")


# ---------------------------------------------------------------------------------------------
# GPU: ResNet feature maps, > 2**20 elements per sample, Inductor, CUDA graphs


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(256, 256, 56, 56), (256, 2048, 7, 7), (2, 64, 160, 160), (3, 5, 600, 700)])
@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_resnet_and_large_feature_maps(shape, dtype, layout):
    """ResNet50 stages at batch 256, and 1.6M / 2.1M elements per sample (above 2**20)."""
    torch.manual_seed(shape[1])
    x, h = make(shape, dtype, "cuda", layout), make(shape, dtype, "cuda", layout)
    for mode in ("plain", "rdp_odd"):
        got, want = against_float64(x, h, torch.tensor(0.9, device="cuda"), *mode_scales(mode, shape[0], "cuda"))
        check_all(got, want, dtype, dtype)
        del got, want


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F16, F32])
@pytest.mark.parametrize("act", ACTS)
def test_gpu_default_plain_sum_runs_pytorchs_ops_with_the_kernels_values(dtype, act):
    torch.manual_seed(7)
    x, h = make((8, 64, 7, 7), dtype, "cuda", "channels_last"), make((8, 64, 7, 7), dtype, "cuda", "channels_last")
    g = make((8, 64, 7, 7), dtype, "cuda", "channels_last")
    results = []
    for backend in (None, "triton"):
        xl, hl = x.clone().requires_grad_(True), h.clone().requires_grad_(True)
        out = ops.residual_act(xl, hl, 1.0, act=act, backend=backend)
        results.append((type(out.grad_fn).__name__, out, *grads(out, g, [xl, hl])))
    (fn, *got), (kernel_fn, *want) = results
    assert "ResidualActFn" not in fn and "ResidualActFn" in kernel_fn
    for name, a, r in zip(("out", "dx", "dh"), got, want):
        assert torch.equal(a, r), name
        assert a.stride() == r.stride(), name
    m = (torch.rand(8, device="cuda") > 0.3).float()
    assert "ResidualActFn" in type(ops.residual_act(x.requires_grad_(True), h, 1.0, m).grad_fn).__name__


@pytest.mark.gpu
def test_gpu_compile_inductor_resnet_block():
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(64, 64, 3, padding=1).cuda().to(memory_format=torch.channels_last)
    x = torch.randn(8, 64, 16, 16, device="cuda").to(memory_format=torch.channels_last)
    m = (torch.rand(8, device="cuda") > 0.3).float()

    def block(x, alpha):
        return ops.residual_act(x, conv(x), alpha, m, m)

    compiled = torch.compile(block, fullgraph=True)
    alpha = torch.tensor(0.9, device="cuda")
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    eager, comp = block(xa, alpha), compiled(xb, alpha)
    torch.testing.assert_close(comp, eager)
    g = torch.randn_like(eager)
    torch.testing.assert_close(grads(comp, g, [xb])[0], grads(eager, g, [xa])[0], rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_and_replay():
    torch.manual_seed(1)
    shape = (16, 32, 14, 14)
    x = make(shape, BF16, "cuda", "channels_last").requires_grad_(True)
    h = make(shape, BF16, "cuda", "channels_last").requires_grad_(True)
    alpha = torch.tensor(0.7, device="cuda")
    m = (torch.rand(16, device="cuda") > 0.3).float()
    g = torch.randn(shape, device="cuda").to(BF16)

    def step():
        out = ops.residual_act(x, h, alpha, None, 1 - m)
        return (out,) + tuple(torch.autograd.grad(out, (x, h), g))

    graph, outs = capture_graph(step)
    with torch.no_grad():
        x.copy_(torch.randn(shape, device="cuda"))
        alpha.fill_(0.4)
    graph.replay()
    torch.cuda.synchronize()
    for a, r in zip(outs, step()):
        torch.testing.assert_close(a, r)


@pytest.mark.gpu
def test_gpu_cached_launch_equals_tritons_own_launch():
    """residual_act's kernels run through dres.kernels.utils.CachedLaunch: after the first launch of a
    specialisation the compiled kernel is called directly, with results equal to Triton's own launch
    bit for bit when later calls change what Triton specialises on (dtype, alpha tensor, flags, size)."""
    from dres.kernels import residual_act as kernels

    cases = [  # (shape, dtype, alpha, act, row_scale), each differing from the one before
        ((8, 16, 7, 7), F32, 0.8, "relu", False),
        ((8, 16, 7, 7), BF16, 0.8, "relu", False),
        ((8, 16, 7, 7), BF16, torch.tensor(0.6, device="cuda"), "relu", True),
        ((5, 24, 9, 11), F32, 0.8, "identity", True),  # odd size: no 16-divisible element count
    ]

    def run(shape, dtype, alpha, act, with_scale):
        gen = torch.Generator("cuda").manual_seed(3)
        x, h = (torch.randn(shape, device="cuda", generator=gen).to(dtype).requires_grad_(True) for _ in range(2))
        m = (torch.arange(shape[0], device="cuda") % 3 > 0).float() if with_scale else None
        out = ops.residual_act(x, h, alpha, m, act=act, backend="triton")
        g = torch.linspace(-1, 1, out.numel(), device="cuda").view(shape).to(dtype)
        return (out, *torch.autograd.grad(out, (x, h), g))

    assert_direct_launch_equals_tritons_own(run, cases, [kernels._FORWARD, kernels._BACKWARD])


# ---------------------------------------------------------------------------------------------
# The benchmark's harness on the CPU (the GPU numbers come from the device)


def test_benchmark_plan_and_cpu_run(tmp_path, capsys):
    import json

    from benchmarks import bench_residual_act

    assert bench_residual_act.main(["--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # 8 ResNet50 stages x 2 dtypes x 2 layouts x 1 mode x 3 impls, then 2 sizes x 2 models x 2 modes
    assert len([ln for ln in lines if ln.startswith("kernel")]) == 8 * 2 * 2 * 3
    assert "kernel 256x256x56x56 bf16 channels_last scaled dres bytes=2877294592" in lines
    assert lines[-1] == "train resnet50d 256x3x32x32 dres compile" and len(lines) == 96 + 8
    with pytest.raises(SystemExit, match="--impls: unknown"):
        bench_residual_act.main(["--dry-run", "--impls", "cudnn"])
    with pytest.raises(SystemExit, match="--shapes"):
        bench_residual_act.main(["--dry-run", "--shapes", "64"])
    if torch.cuda.is_available():
        return
    assert bench_residual_act.main(["--device", "cpu", "--shapes", "3x4x33x40", "--impls", "dres,eager", "--dtypes", "bf16",
                     "--layouts", "channels_last", "--modes", "plain,scaled", "--train", "32", "--train-arch",
                     "resnet18", "--batch", "2", "--train-modes", "eager", "--train-steps", "1",
                     "--out", str(tmp_path)]) == 0
    records = json.loads((tmp_path / "cpu-residual_act.json").read_text())
    assert len(records) == 4 + 2
    assert all(r["check_ok"] for r in records if r["kind"] == "kernel")
    table = (tmp_path / "cpu-residual_act.md").read_text()
    assert "| 3x4x33x40 | bf16 | channels_last | scaled | dres |" in table and "| resnet18 2x3x32x32 | dres | eager |" in table
