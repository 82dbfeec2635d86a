"""A small forward + backward through every kernel shape of the CUDA backend, for
compute-sanitizer (memcheck by default; racecheck and initcheck work too):

    compute-sanitizer --tool memcheck --error-exitcode 1 python csrc/sanitize_check.py

Shapes cover the 16-byte-vector and the scalar paths, warp-per-row (D <= 1024) and
block-per-row, row counts that leave partial blocks, row_scale/grad_scale, a tensor alpha with
its gradient, strided gradients, and the residual_add and layer_norm ops. Sizes stay small:
under the sanitizer every access is checked.
"""

import sys

import torch

import dres.ops as ops
from dres.ops import csrc_backend


def main() -> int:
    if not torch.cuda.is_available() or not csrc_backend.available():
        print("sanitize_check: needs a GPU and the built extension (DRES_BUILD_CUDA=1 pip install -e .)")
        return 2
    torch.manual_seed(0)
    dev = "cuda"
    cases = [(35, 48), (9, 100), (17, 768), (5, 1030), (3, 4104), (2, 16384)]
    for rows, dim in cases:
        for x_dtype, h_dtype in ((torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)):
            B = rows if rows % 5 else 5
            x = torch.randn(rows, dim, device=dev, dtype=x_dtype, requires_grad=True)
            h = torch.randn(rows, dim, device=dev, dtype=h_dtype, requires_grad=True)
            w = torch.randn(dim, device=dev, requires_grad=True)
            b = torch.randn(dim, device=dev, requires_grad=True)
            alpha = torch.tensor(0.8, device=dev, requires_grad=True)
            m = (torch.rand(B, device=dev) > 0.3).float()
            out, y = ops.residual_layer_norm(x, h, w, b, alpha, row_scale=m, grad_scale=1 - m, backend="cuda")
            g_y = torch.randn(rows, dim + 3, device=dev)[:, :dim].to(y.dtype)  # odd row stride
            torch.autograd.backward((out, y), (torch.randn_like(out), g_y))
            z = ops.residual_add(x.detach().requires_grad_(True), h, 0.5, backend="cuda")
            z.backward(torch.randn(dim, device=dev, dtype=z.dtype).expand_as(z))  # row stride 0
            yn = ops.layer_norm(x.detach().requires_grad_(True), w, None, backend="cuda")
            yn.backward(torch.randn_like(yn))
    torch.cuda.synchronize()
    print(f"sanitize_check: {len(cases) * 2} shape/dtype cases ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
