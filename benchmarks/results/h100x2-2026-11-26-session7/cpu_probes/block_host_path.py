# Host-side cost of a dres TransformerStack against timm Blocks, fwd+bwd, on the CPU with every Triton launch
# stubbed out (TRITON_INTERPRET=1 so the ops take the Triton path; tiny width so compute is negligible):
# what is left is Python, autograd and allocation. Run: TRITON_INTERPRET=1 python block_host_path.py
import time, sys
import torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[4]))
from dres.kernels import utils as KU
import dres.kernels.residual_norm as KR, dres.kernels.bias_gelu as KB
KU.CachedLaunch.__call__ = lambda self, grid, args, num_warps, num_stages=None: None
KR.sum_partials = KB.sum_partials = lambda partials, outs: None
torch.set_num_threads(1)
from dres.nn import TransformerStack
import timm.models.vision_transformer as V
D, B, N = 64, 2, 4
def timeit(fn, n=300):
    for _ in range(20): fn()
    t0 = time.perf_counter()
    for _ in range(n): fn()
    return (time.perf_counter() - t0) / n * 1e6
for depth in (1, 4):
    dres_stack = TransformerStack(D, depth, 4, 4.0, qkv_bias=True, final_norm=True, backend="triton")
    timm_blocks = torch.nn.Sequential(*[V.Block(D, 4, qkv_bias=True) for _ in range(depth)], torch.nn.LayerNorm(D))
    x = torch.randn(B, N, D, requires_grad=True)
    def run_dres():
        y, _ = dres_stack(x)
        y.float().sum().backward()
    def run_timm():
        timm_blocks(x).float().sum().backward()
    print(f"depth {depth}: dres stack {timeit(run_dres):8.1f} us   timm blocks {timeit(run_timm):8.1f} us  (fwd+bwd, fp32, kernels stubbed, CPU)")
import cProfile, pstats
pr = cProfile.Profile(); pr.enable()
