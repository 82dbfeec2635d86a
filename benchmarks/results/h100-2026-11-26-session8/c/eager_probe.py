# why the fp32/bf16 eager loop is slower than bf16/bf16: profile both (CPU ops, CUDA kernels, per-call time)
import torch, sys
from benchmarks.bench_kernels import Case
from benchmarks.bench_eager_launch import step_for
from torch.profiler import profile, ProfilerActivity
dev = torch.device("cuda")
for xd in ("bf16", "fp32"):
    case = Case("residual_layer_norm", 12800, 768, xd, "bf16", "plain")
    step = step_for("dres_triton", case, dev)
    for _ in range(20): step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(20): step()
        torch.cuda.synchronize()
    print(f"===== {xd}/bf16 plain")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=10, max_name_column_width=60))
