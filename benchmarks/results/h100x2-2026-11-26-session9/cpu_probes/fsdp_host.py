"""CPU probe: FSDP2's host time per step on one rank (gloo), ViT-B/16 MAE structure (12 + 8 blocks, 280 parameters)
at width 32, one thread, bf16 autocast; median ms of 12 steps after 4 (fwd+bwd, then the foreach AdamW step)."""
import os, sys, time, statistics, warnings, torch, torch.distributed as dist
warnings.filterwarnings("ignore")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29611")
dist.init_process_group("gloo", rank=0, world_size=1)
from dres.models.mae import create_mae
from dres.train import distributed as D
torch.set_num_threads(1)

def build():
    torch.manual_seed(0)
    return create_mae("mae_vit_base_patch16", variant="official", alpha_min=0.6, img_size=32, embed_dim=32,
                      num_heads=2, decoder_embed_dim=32, decoder_num_heads=2)

def timeit(model, opt, steps=12, warm=4, what="step"):
    x = torch.randn(2, 3, 32, 32)
    ts = {"fwdbwd": [], "opt": []}
    for i in range(warm + steps):
        t0 = time.perf_counter()
        with torch.autocast("cpu", torch.bfloat16):
            loss = model(x)[0]
        loss.backward()
        t1 = time.perf_counter()
        opt.step(); opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        if i >= warm:
            ts["fwdbwd"].append((t1 - t0) * 1e3); ts["opt"].append((t2 - t1) * 1e3)
    return {k: round(statistics.median(v), 2) for k, v in ts.items()}

from dres.train.distributed import DistInfo
info = DistInfo(0, 1, 0, torch.device("cpu"))
for name, kw in [("none", None), ("fsdp bf16 1/unit", dict(param_dtype="bf16", blocks_per_unit=1)),
                 ("fsdp bf16 4/unit", dict(param_dtype="bf16", blocks_per_unit=4)),
                 ("fsdp fp32 4/unit", dict(param_dtype="fp32", blocks_per_unit=4)),
                 ("fsdp bf16 20/unit", dict(param_dtype="bf16", blocks_per_unit=20))]:
    for fused in (False,):
        m = build()
        n = sum(1 for _ in m.parameters())
        if kw is not None:
            m = D.apply_fsdp(m, info, **kw)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=True)
        print(name, "params", n, timeit(m, opt), flush=True)
dist.destroy_process_group()
