"""The host's cost of the fused ops' eager calls: what an eager step pays in Python and in the dispatcher before any
kernel runs, each op against the PyTorch ops it replaces.

    python -m benchmarks.bench_host_cost                      # CPU, 10 x 24 rows, five rounds
    python -m benchmarks.bench_host_cost --calls 5000 --out DIR

Runs on the CPU with every Triton launch stubbed after its launch-cache key (``CachedLaunch.key``, the last Python
a launch runs before the compiled kernel's C launcher), so a call costs its checks, its allocations, its autograd
Function and its launch bookkeeping and nothing of the GPU: a host-bound eager step (a 384-wide ViT at batch 128)
runs at this cost (under ``TRITON_INTERPRET=1`` the kernels carry no launch metadata and the key is left out). The
PyTorch ops run for real on tiny tensors (24 wide), where their CPU kernels take a few
microseconds. Each row's implementations are timed in interleaved rounds (the minimum over ``--rounds`` of
``--calls`` calls back to back). Writes ``host_cost.json`` and ``host_cost.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import measure

DIM, ROWS = 24, 10


@contextlib.contextmanager
def launches_stubbed():
    """Every dres launch computes its launch-cache key and returns; ``backend=None`` takes the Triton kernels on
    CPU tensors, as it does on CUDA ones."""
    from dres.kernels.utils import CachedLaunch
    from dres.ops import checks

    def key_only(launch, grid, args, num_warps, num_stages=None):
        if launch.constexpr is not None:  # Triton's CPU interpreter (TRITON_INTERPRET=1) keeps no kernel metadata
            launch.key(args, 0, (num_warps, num_stages))

    call, default = CachedLaunch.__call__, checks._default_backend
    CachedLaunch.__call__ = key_only
    checks._default_backend = lambda x: "torch" if x.dtype == torch.float64 else "triton"
    try:
        yield
    finally:
        CachedLaunch.__call__, checks._default_backend = call, default


def cases() -> dict[tuple[str, str], dict]:
    """Per row, keyed by (the dres op, the PyTorch ops it replaces): both as callables of one eager call
    (``forward``) or of one call and its backward (``forward + backward``)."""
    import dres.ops as ops

    g = torch.Generator().manual_seed(0)
    leaf = lambda *shape: torch.randn(*shape, generator=g).requires_grad_()  # noqa: E731
    x, h = leaf(2, ROWS // 2, DIM), leaf(2, ROWS // 2, DIM)
    w, b = leaf(DIM), leaf(DIM)
    w1, b1, w2, b2 = leaf(4 * DIM, DIM), leaf(4 * DIM), leaf(DIM, 4 * DIM), leaf(DIM)
    g1, g2 = torch.randn(x.shape, generator=g), torch.randn(x.shape, generator=g)

    def add_norm_dres():
        return ops.residual_layer_norm(x, h, w, b, 1.0)

    def add_norm_torch():
        out = x + h
        return out, F.layer_norm(out, (DIM,), w, b, 1e-6)

    def mlp_dres():
        return (ops.fused_mlp(x, w1, b1, w2, b2),)

    def mlp_torch():
        return (F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2),)

    def norm_dres():
        return (ops.layer_norm(x, w, b),)

    def norm_torch():
        return (F.layer_norm(x, (DIM,), w, b, 1e-6),)

    def with_backward(forward):
        def call():
            outs = forward()
            torch.autograd.backward(outs, (g1, g2)[:len(outs)])
        return call

    rows = {("residual_layer_norm", "x + h, F.layer_norm"): (add_norm_dres, add_norm_torch),
            ("fused_mlp", "F.linear, F.gelu, F.linear"): (mlp_dres, mlp_torch),
            ("layer_norm", "F.layer_norm"): (norm_dres, norm_torch)}
    return {row: {"forward": (dres, torch_ops), "forward + backward": (with_backward(dres), with_backward(torch_ops))}
            for row, (dres, torch_ops) in rows.items()}


def us_per_call(fns: tuple, calls: int, rounds: int) -> list[float]:
    """Microseconds a call of each of ``fns``, timed in interleaved rounds: the minimum over the rounds."""
    best = [float("inf")] * len(fns)
    for fn in fns:  # warm: caches, the autograd graph's first build
        for _ in range(20):
            fn()
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best[i] = min(best[i], (time.perf_counter() - start) / calls * 1e6)
    return best


def measure_all(calls: int, rounds: int) -> list[dict]:
    results = []
    with launches_stubbed():
        for (op, replaced), kinds in cases().items():
            for kind, fns in kinds.items():
                dres_us, torch_us = us_per_call(fns, calls, rounds)
                results.append({"op": op, "replaces": replaced, "what": kind, "dres_us": dres_us, "torch_us": torch_us})
    return results


def markdown(results: list[dict], env: dict) -> str:
    lines = [f"Host cost of an eager call, launches stubbed after their key (torch {env['torch']}, triton "
             f"{env['triton']}, {ROWS} x {DIM}; microseconds a call, the minimum of the interleaved rounds)", "",
             "| dres op | replaces | call | dres | PyTorch | dres / PyTorch |", "|---|---|---|---|---|---|"]
    lines += [f"| `{r['op']}` | {r['replaces']} | {r['what']} | {r['dres_us']:.1f} | {r['torch_us']:.1f} | "
              f"{r['dres_us'] / r['torch_us']:.2f}x |" for r in results]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000, help="calls back to back in a round")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds; each implementation's minimum is kept")
    ap.add_argument("--out", default=None, help="folder for host_cost.json and host_cost.md (default: a record folder)")
    args = ap.parse_args(argv)
    if args.calls < 1 or args.rounds < 1:
        ap.error("--calls and --rounds must be at least 1")
    env = measure.versions()
    results = measure_all(args.calls, args.rounds)
    table = markdown(results, env)
    print(table, end="")
    out = Path(args.out or measure.default_out("ops-host-cost"))
    out.mkdir(parents=True, exist_ok=True)
    measure.write_json_atomic(out / "host_cost.json", {"env": env, "rows": ROWS, "dim": DIM, "calls": args.calls,
                                                       "rounds": args.rounds, "results": results})
    (out / "host_cost.md").write_text(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
