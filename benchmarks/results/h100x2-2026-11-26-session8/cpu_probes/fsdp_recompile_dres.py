import os, torch, torch.distributed as dist
os.environ.setdefault("MASTER_ADDR","127.0.0.1"); os.environ.setdefault("MASTER_PORT","29534")
dist.init_process_group("gloo", rank=0, world_size=1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
from torch._dynamo.utils import counters
from dres.nn import TransformerStack
mesh = init_device_mesh("cpu", (1,))
D=32
stack = TransformerStack(D, 4, 4, 4.0, qkv_bias=True, final_norm=True, backend="torch")
blocks = list(stack.parallel_units())
for b in blocks: b.compile()
mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
fully_shard(blocks[:2], mesh=mesh, mp_policy=mp, reshard_after_forward=False)
fully_shard(blocks[2:], mesh=mesh, mp_policy=mp, reshard_after_forward=False)
fully_shard(stack, mesh=mesh, mp_policy=mp)
opt = torch.optim.AdamW(stack.parameters(), lr=1e-3)
x = torch.randn(2, 8, D)
for step in range(5):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, _ = stack(x)
    y.float().sum().backward(); opt.step(); opt.zero_grad()
    print(step, dict(counters["stats"]), flush=True)
dist.destroy_process_group()
