import os, torch, torch.distributed as dist
os.environ.setdefault("MASTER_ADDR","127.0.0.1"); os.environ.setdefault("MASTER_PORT","29533")
dist.init_process_group("gloo", rank=0, world_size=1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
import timm.models.vision_transformer as V
from torch._dynamo.utils import counters
mesh = init_device_mesh("cpu", (1,))
D=64
blocks = torch.nn.Sequential(*[V.Block(D, 4, qkv_bias=True) for _ in range(4)])
for b in blocks: b.compile()
mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for i in range(0,4,2):
    fully_shard([blocks[i], blocks[i+1]], mesh=mesh, mp_policy=mp, reshard_after_forward=False)
fully_shard(blocks, mesh=mesh, mp_policy=mp)
opt = torch.optim.AdamW(blocks.parameters(), lr=1e-3)
x = torch.randn(2, 8, D)
for step in range(6):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = blocks(x)
    y.float().sum().backward(); opt.step(); opt.zero_grad()
    print(step, dict(counters["stats"]), flush=True)
dist.destroy_process_group()
