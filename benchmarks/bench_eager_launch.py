"""Eager launch cost of the fused ops: forward + backward of ``residual_layer_norm`` called back to
back from Python, against unfused eager PyTorch and against the CUDA-graph replay of the same
fused step (the GPU-bound floor).

    python -m benchmarks.bench_eager_launch                       # 12800x768 bf16/bf16, plain + rdp_odd
    python -m benchmarks.bench_eager_launch --rows 12800 --dim 768 --dtypes bf16/bf16,fp32/bf16 --json out.json

Steady state: each implementation is warmed up (Triton compiles, csrc loads, caches fill) before
it is timed by ``measure.loop_median_us`` (calls issued back to back, median of 5 loops), which is
what a training loop sees; ``do_bench`` flushes L2 between calls and hides launch cost. The
implementations of a case are timed in interleaved rounds (median of ``--rounds``). Prints a
table and writes JSON (``--json``, default ``$OUT/eager_launch.json`` or ./eager_launch.json).

impls: ``dres_triton`` and ``dres_cuda`` (when the csrc extension is built) through the eager
autograd Functions; ``unfused`` = the PyTorch reference (``dres.ops.reference``: the add with its
per-sample scales, then F.layer_norm, through ordinary autograd); ``dres_triton_graph`` = the
Triton step captured once as a CUDA graph and replayed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

from benchmarks import measure
from benchmarks.bench_kernels import Case, build_fn, make_callable, make_inputs, make_mode_args

IMPLS = ("dres_triton", "dres_cuda", "unfused", "dres_triton_graph")
MODES = ("plain", "drop_path", "rdp_even", "rdp_odd")


def available_impls(device: torch.device) -> list[str]:
    from dres.ops import csrc_backend

    impls = ["dres_triton", "unfused"]
    if device.type == "cuda":
        if csrc_backend.available():
            impls.insert(1, "dres_cuda")
        impls.append("dres_triton_graph")
    return impls


def step_for(impl: str, case: Case, device: torch.device):
    """The fwd+bwd callable of ``impl`` on one input set (the graph: its replay)."""
    inputs = [make_inputs(case, device, requires_grad=True, seed=0)]
    mode_args = make_mode_args(case, device)
    if impl == "dres_triton_graph":
        step = make_callable(build_fn("dres_triton", case), case, inputs, mode_args, "fwd_bwd")
        graph, outs = measure.capture_graph(step)
        return lambda: (graph.replay(), outs)  # keeps the captured outputs alive with the graph
    fn = build_fn({"dres_triton": "dres_triton", "dres_cuda": "dres_cuda", "unfused": "eager"}[impl], case)
    return make_callable(fn, case, inputs, mode_args, "fwd_bwd")


def measure_case(case: Case, impls: list[str], device: torch.device, warmup: int, rounds: int) -> list[dict]:
    """Each implementation timed in ``rounds`` interleaved rounds (A B C A B C ...), median per
    implementation: a host-bound loop's time drifts within a process, and interleaving spreads the
    drift over every implementation alike instead of charging it to whichever ran last."""
    timer = measure.loop_median_us if device.type == "cuda" else measure.cpu_median_us
    steps = {impl: step_for(impl, case, device) for impl in impls}
    for step in steps.values():
        for _ in range(warmup):
            step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    times = {impl: [] for impl in impls}
    for _ in range(rounds):
        for impl, step in steps.items():
            times[impl].append(timer(step))
    records = [{"op": case.op, "rows": case.rows, "dim": case.dim, "x_dtype": case.x_dtype, "h_dtype": case.h_dtype,
                "mode": case.mode, "pass": "fwd_bwd", "impl": impl, "us_loop": round(statistics.median(t), 1),
                "us_rounds": [round(v, 1) for v in t]} for impl, t in times.items()]
    unfused = next(r["us_loop"] for r in records if r["impl"] == "unfused")
    for r in records:
        r["vs_unfused"] = round(unfused / r["us_loop"], 3)
    return records


def table(records: list[dict]) -> str:
    impls = [i for i in IMPLS if any(r["impl"] == i for r in records)]
    lines = ["| case | " + " | ".join(f"{i} (us)" for i in impls) + " |", "|---" * (len(impls) + 1) + "|"]
    cases = sorted({(r["rows"], r["dim"], r["x_dtype"], r["h_dtype"], r["mode"]) for r in records})
    for rows, dim, xd, hd, mode in cases:
        cells = []
        for impl in impls:
            r = next((r for r in records if (r["rows"], r["dim"], r["x_dtype"], r["h_dtype"], r["mode"], r["impl"])
                      == (rows, dim, xd, hd, mode, impl)), None)
            cells.append("" if r is None else f"{r['us_loop']} ({r['vs_unfused']}x)")
        lines.append(f"| {rows}x{dim} {xd}/{hd} {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=12800)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--dtypes", default="bf16/bf16", help="x/h dtype pairs, comma-separated (bf16, fp16, fp32)")
    p.add_argument("--modes", default="plain,rdp_odd", help="plain, drop_path, rdp_even, rdp_odd (comma-separated)")
    p.add_argument("--impls", default=None, help=f"comma-separated subset of {', '.join(IMPLS)} (default: all available)")
    p.add_argument("--warmup", type=int, default=20, help="untimed calls per implementation before timing")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds per implementation (median)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    if args.rounds < 1:
        print(f"bench_eager_launch: --rounds must be at least 1, got {args.rounds}", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    impls = available_impls(device)
    if args.impls:
        wanted = [i.strip() for i in args.impls.split(",") if i.strip()]
        unknown = [i for i in wanted if i not in IMPLS]
        if unknown:
            print(f"bench_eager_launch: unknown impl {unknown[0]!r}; choose from {', '.join(IMPLS)}", file=sys.stderr)
            return 2
        impls = [i for i in impls if i in wanted or i == "unfused"]  # unfused: the baseline of every ratio
    records = []
    for pair in args.dtypes.split(","):
        x_dtype, _, h_dtype = pair.partition("/")
        if x_dtype not in measure.DTYPES or h_dtype not in measure.DTYPES:
            print(f"bench_eager_launch: bad dtype pair {pair!r} (e.g. bf16/bf16)", file=sys.stderr)
            return 2
        for mode in (m.strip() for m in args.modes.split(",")):
            if mode not in MODES:
                print(f"bench_eager_launch: unknown mode {mode!r}; choose from {', '.join(MODES)}", file=sys.stderr)
                return 2
            case = Case("residual_layer_norm", args.rows, args.dim, x_dtype, h_dtype, mode)
            records.extend(measure_case(case, impls, device, args.warmup, args.rounds))
    print(table(records))
    out = args.json or Path(os.environ.get("OUT", ".")) / "eager_launch.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    measure.write_json_atomic(out, {"card": measure.card_name() if device.type == "cuda" else "cpu",
                                   "versions": measure.versions(), "date": measure.today(), "records": records})
    print(f"wrote {out}")
    print(json.dumps(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
