# Host side of one residual_layer_norm forward+backward (32 x 64, bf16) with every Triton launch stubbed
# (TRITON_INTERPRET=1 so the ops take the Triton path): dres vs the unfused PyTorch reference, best of 7 loops.
# Run: TRITON_INTERPRET=1 python rln_host_path.py
import time, sys
import torch
from dres.kernels import utils as KU
import dres.kernels.residual_norm as KR
KU.CachedLaunch.__call__ = lambda self, grid, args, num_warps, num_stages=None: None
KR.sum_partials = lambda partials, outs: None
torch.set_num_threads(1)
from dres.ops import residual_layer_norm, reference
D, M = 64, 32
def timeit(fn, n=1000):
    best = 1e9
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(n): fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best
x = torch.randn(4, 8, D, dtype=torch.bfloat16, requires_grad=True)
h = torch.randn(4, 8, D, dtype=torch.bfloat16, requires_grad=True)
w = torch.ones(D, requires_grad=True); b = torch.zeros(D, requires_grad=True)
go = torch.randn(4, 8, D, dtype=torch.bfloat16); gy = torch.randn(4, 8, D, dtype=torch.bfloat16)
rs = torch.rand(4)
for mode in ("plain", "rdp"):
    kw = dict(row_scale=rs) if mode == "rdp" else {}
    def dres_step():
        out, y = residual_layer_norm(x, h, w, b, 1.0, 1e-6, backend="triton", **kw)
        return torch.autograd.grad((out, y), (x, h, w, b), (go, gy))
    def ref_step():
        out, y = reference.residual_layer_norm(x, h, w, b, 1.0, 1e-6, **kw)
        return torch.autograd.grad((out, y), (x, h, w, b), (go, gy))
    def fwd():
        with torch.no_grad():
            return residual_layer_norm(x, h, w, b, 1.0, 1e-6, backend="triton", **kw)
    print(mode, f"dres {timeit(dres_step):.1f} us  unfused {timeit(ref_step):.1f} us  dres fwd no_grad {timeit(fwd):.1f}")
