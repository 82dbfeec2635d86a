"""pytest-benchmark view of the kernel benchmarks (GPU only; skipped without CUDA):

    pytest benchmarks --benchmark-only                       # all cases below
    pytest benchmarks --benchmark-only -k "12800 and triton" # a subset
    pytest benchmarks --benchmark-only --benchmark-json=$OUT/bench.json

``pyproject.toml`` sets ``testpaths = ["tests"]``, so a plain ``pytest`` (CI, CPU) never collects
this file; it runs only when the path is given. pytest-benchmark times wall clock, so each timed
call ends with ``torch.cuda.synchronize()``; the do_bench median (the CLI's number), GB/s and the
percent of the copy ceiling go to ``extra_info`` of every benchmark, so the JSON carries both.
The full sweep with peers and the Markdown/plot is ``python -m benchmarks.bench_kernels``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="kernel benchmarks need a CUDA GPU"),
]

pytest.importorskip("pytest_benchmark")

from benchmarks import bench_kernels as bk  # noqa: E402
from benchmarks import measure  # noqa: E402
from benchmarks.measure import DTYPES  # noqa: E402

# The headline shapes (D = 768); other D values are the CLI's job. About 6 minutes on an H100.
SHAPES = [(12800, 768), (65536, 768), (262144, 768)]
DTYPE_PAIRS = ["bf16/bf16", "fp32/bf16"]
CASES = [("residual_layer_norm", "plain"), ("residual_layer_norm", "drop_path"), ("residual_layer_norm", "rdp_odd"),
         ("residual_add", "plain"), ("layer_norm", "plain")]
IMPLS = ["dres_triton", "eager", "compile"]


@pytest.fixture(scope="session")
def ceiling_gbps():
    measure.configure_dynamo_for_many_shapes()
    return measure.copy_ceiling_gbps()


@pytest.mark.parametrize("pass_", ["fwd", "fwd_bwd"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op,mode", CASES, ids=[f"{o}-{m}" for o, m in CASES])
@pytest.mark.parametrize("dtypes", DTYPE_PAIRS, ids=[d.replace("/", "_") for d in DTYPE_PAIRS])
@pytest.mark.parametrize("rows,dim", SHAPES, ids=[f"{r}x{d}" for r, d in SHAPES])
def test_kernel(benchmark, ceiling_gbps, rows, dim, dtypes, op, mode, impl, pass_):
    xd, hd = dtypes.split("/")
    case = bk.Case(op, rows, dim, xd, hd, mode)
    torch._dynamo.reset()
    fn = bk.build_fn(impl, case)
    device = torch.device("cuda")
    inputs = [bk.make_inputs(case, device, pass_ == "fwd_bwd", seed=10)]
    alpha, rs, gs = bk.make_mode_args(case, device)
    if pass_ == "fwd" and isinstance(alpha, torch.Tensor):
        alpha = alpha.detach()
    call = bk.make_callable(fn, case, inputs, (alpha, rs, gs), pass_)

    def timed():
        call()
        torch.cuda.synchronize()

    call()  # compile / autotune outside the timed rounds
    us = measure.do_bench_median_us(call)
    nbytes = measure.kernel_bytes(op, pass_, rows, dim, DTYPES[xd], DTYPES[hd], mode, case.batch_tokens[0])
    benchmark.extra_info.update(
        do_bench_median_us=us, bytes=nbytes, gbps=measure.gbps(nbytes, us), ceiling_gbps=ceiling_gbps,
        pct_ceiling=100 * measure.gbps(nbytes, us) / ceiling_gbps, card=measure.card_name(), **measure.versions())
    benchmark.pedantic(timed, rounds=30, iterations=1, warmup_rounds=3)
