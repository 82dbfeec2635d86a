"""Sweep the backward kernel's launch config (BLOCK_M, warps, programs per SM) and profile one eager step: how kernels/residual_norm.py backward_config was chosen. Run on a GPU: python3 benchmarks/tune_backward.py"""
import torch, triton
import dres.ops as ops
from dres.kernels import residual_norm_forward, residual_norm_backward

def bench(fn, **kw):
    return triton.testing.do_bench(fn, return_mode="median", **kw) * 1000

a = torch.empty(2**28, dtype=torch.float32, device="cuda"); b = torch.empty_like(a)
ceil = 2 * a.numel() * 4 / bench(lambda: b.copy_(a)) / 1e3
del a, b
for rows, dim, xd in [(12800, 768, torch.bfloat16), (262144, 768, torch.bfloat16), (262144, 768, torch.float32), (65536, 384, torch.float32), (65536, 1024, torch.bfloat16)]:
    x = torch.randn(rows, dim, device="cuda", dtype=xd); h = torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(dim, device="cuda"); bb = torch.zeros(dim, device="cuda")
    go = torch.randn_like(x); gy = torch.randn_like(h)
    es = x.element_size()
    bc = rows * dim * (es + 2 + es + es + 2) / ceil / 1e3
    out = torch.empty_like(x); y = torch.empty_like(h)
    mean = torch.empty(rows, device="cuda"); rstd = torch.empty(rows, device="cuda")
    residual_norm_forward(x, h, w, bb, 0.9, 1e-6, None, 1, out, y, mean, rstd)
    dx = torch.empty_like(x); dh = torch.empty_like(h)
    res = []
    bd = triton.next_power_of_2(dim)
    for bm in [1, 2, 4, 8, 16]:
        for nw in [2, 4, 8]:
            if bm * bd / (nw * 32) > 64 or bm * bd / (nw * 32) < 2:
                continue
            for pps in [2, 4, 8, 16]:
                try:
                    t = bench(lambda: residual_norm_backward(go, gy, out, None, w, mean, rstd, 0.9, None, 1, dx, dh, True, True, False, config=(bm, nw, pps)), warmup=5, rep=20)
                except Exception as e:
                    continue
                res.append((t, bm, nw, pps))
    res.sort()
    print(f"{rows}x{dim} x={str(xd)[6:]} bwd at ceiling {bc:.0f}us; best: " + "; ".join(f"{t:.0f}us bm{bm} w{nw} p{pps} ({100*bc/t:.0f}%)" for t, bm, nw, pps in res[:4]))

# Where the op's time goes at the small size
rows, dim = 12800, 768
x = torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
h = torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = torch.ones(dim, device="cuda", requires_grad=True); bb = torch.zeros(dim, device="cuda", requires_grad=True)
go = torch.randn_like(x); gy = torch.randn_like(h)
def step():
    o, yy = ops.residual_layer_norm(x, h, w, bb, 0.9)
    torch.autograd.backward((o, yy), (go, gy))
for _ in range(5): step()
torch.cuda.synchronize()
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(10):
        step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
import time
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(50): step()
torch.cuda.synchronize(); print("wall per step us", (time.perf_counter() - t) / 50 * 1e6)
