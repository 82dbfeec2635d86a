"""Kernel microbenchmarks of the fused residual ops against eager PyTorch, torch.compile and the
peers that are installed (flash-attn's Triton layer_norm_fn, FusedLayerNorm of NVIDIA apex built from
source, Liger LayerNorm; the PyPI package named apex is an unrelated toolkit).

    python -m benchmarks.bench_kernels --quick                 # < 2 min on an H100, compile included
    python -m benchmarks.bench_kernels --ops residual_layer_norm --dims 768 --out $OUT
    python -m benchmarks.bench_kernels --dry-run               # the plan, no GPU needed

Each (op, rows, D, dtypes, mode) is a *case*; each case is timed forward (inference: inputs need no
grad) and forward+backward (``torch.autograd.grad`` with given output gradients; nothing is kept
between repetitions) for every implementation, by ``triton.testing.do_bench`` (median, L2 flushed
before each call). Bytes follow :func:`benchmarks.measure.kernel_bytes`; the ceiling is a 1 GiB
device copy measured at the start of the same run. Results merge into
``<out>/<card>-kernels.json`` after every case (a run stopped at its time limit keeps what it
measured), then the Markdown table and the PNG plot are rewritten from the whole file.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Optional

if __package__ in (None, ""):  # `python benchmarks/bench_kernels.py`: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks import measure
from benchmarks.measure import DROPOUT_P, DTYPES, MODES, OP_MODES, OPS, PASSES

ALL_IMPLS = ("dres_triton", "dres_cuda", "eager", "compile", "flash_attn", "apex", "liger")
IMPL_ALIASES = {"triton": "dres_triton", "cuda": "dres_cuda", "torch.compile": "compile",
                "torch_compile": "compile", "flash-attn": "flash_attn", "flash": "flash_attn"}
# Implementations that can also be timed as a captured CUDA graph (fwd or fwd+bwd replayed).
GRAPH_IMPLS = ("dres_triton", "dres_cuda", "eager", "compile")
DTYPE_COMBOS = ("bf16/bf16", "fp32/bf16", "fp32/fp32")

DEFAULTS = dict(rows=[12800, 65536, 262144], dims=[384, 512, 768, 1024], ops=list(OPS), modes=list(MODES),
                dtypes=list(DTYPE_COMBOS), passes=list(PASSES), graph_shapes=["12800x768"])
# The quick set: the two headline shapes (MAE ViT-B encoder at batch 256, and a >= 65536-row one),
# the common mixed-precision case and the detach mode; ~16 compiles, under 2 minutes on an H100.
QUICK = dict(rows=[12800, 65536], dims=[768], ops=["residual_layer_norm"], modes=["plain", "rdp_odd"],
             dtypes=["bf16/bf16", "fp32/bf16"], passes=list(PASSES), graph_shapes=["12800x768"])

KEEP = 0.9  # drop-path keep probability of the drop_path / rdp modes
ALPHA = 0.8
EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class Case:
    op: str
    rows: int
    dim: int
    x_dtype: str   # the residual stream (layer_norm: its input)
    h_dtype: str   # the branch (layer_norm: the output y)
    mode: str

    @property
    def batch_tokens(self) -> tuple[int, int]:
        return split_rows(self.rows)

    def label(self) -> str:
        return f"{self.op} {self.rows}x{self.dim} {self.x_dtype}/{self.h_dtype} {self.mode}"


def split_rows(rows: int) -> tuple[int, int]:
    """(B, T) with B * T = rows for the per-sample scales: T = 50 is an MAE ViT-B/16 encoder at mask
    ratio 0.75 (49 visible patches + cls; 12800 = 256 x 50), T = 256 a 16x16-token image."""
    for t in (50, 256, 197, 64, 16, 8, 4, 2, 1):
        if rows % t == 0:
            return rows // t, t
    return rows, 1


def parse_list(text: str, conv=str) -> list:
    return [conv(s) for s in text.split(",") if s.strip()]


def normalize_impls(names: list[str]) -> list[str]:
    out = []
    for n in names:
        n = IMPL_ALIASES.get(n, n)
        if n not in ALL_IMPLS:
            raise SystemExit(f"unknown impl {n!r}; choose from {', '.join(ALL_IMPLS)}")
        out.append(n)
    return out


def plan_cases(ops, rows, dims, dtypes, modes) -> list[Case]:
    cases = []
    for op in ops:
        for r, d, dt in itertools.product(rows, dims, dtypes):
            xd, hd = dt.split("/")
            for mode in modes:
                if mode in OP_MODES[op]:
                    cases.append(Case(op, r, d, xd, hd, mode))
    return cases


def parse_shapes(items: list[str]) -> set[tuple[int, int]]:
    shapes = set()
    for s in items:
        if s.lower() in ("", "none"):
            continue
        r, d = s.lower().split("x")
        shapes.add((int(r), int(d)))
    return shapes


# ---------------------------------------------------------------------------------------------
# Implementations. Each builder returns fn(x, h, w, b, alpha, row_scale, grad_scale) -> tuple of the
# op's outputs in contract order ((out, y), (out,) or (y,)) with the contract's dtypes, or raises
# Unsupported with the reason.


class Unsupported(Exception):
    pass


def available_impls(requested: list[str]) -> tuple[list[str], dict[str, str]]:
    """The requested implementations that can run here, and why the others cannot."""
    import importlib.util

    ok, why = [], {}
    for impl in requested:
        reason = None
        if impl == "dres_cuda":
            from dres.ops import csrc_backend

            if not csrc_backend.available():
                reason = "csrc extension not built (DRES_BUILD_CUDA=1 pip install -e .)"
        elif impl == "flash_attn":
            if importlib.util.find_spec("flash_attn") is None:
                reason = "flash-attn not installed"
        elif impl == "apex":
            if importlib.util.find_spec("apex") is None or importlib.util.find_spec("apex.normalization") is None:
                reason = "NVIDIA apex (built from source) not installed"
        elif impl == "liger":
            if importlib.util.find_spec("liger_kernel") is None:
                reason = "liger-kernel not installed"
        if reason:
            why[impl] = reason
        else:
            ok.append(impl)
    return ok, why


def dropout_p(case: Case) -> float:
    return DROPOUT_P if case.mode == "dropout" else 0.0


def _reference_fn(case: Case):
    """PyTorch's ops (F.dropout of h in the dropout mode): eager, and what torch.compile is given."""
    from dres.ops import reference

    ydt = DTYPES[case.h_dtype]
    p = dropout_p(case)
    if case.op == "residual_layer_norm":
        def fn(x, h, w, b, alpha, rs, gs):
            return reference.residual_layer_norm(x, reference.dropout(h, p), w, b, alpha, EPS, rs, gs)
    elif case.op == "residual_add":
        def fn(x, h, w, b, alpha, rs, gs):
            return (reference.residual_add(x, reference.dropout(h, p), alpha, rs, gs),)
    else:
        def fn(x, h, w, b, alpha, rs, gs):
            return (reference.layer_norm(x, w, b, EPS, ydt),)
    return fn


def _dres_fn(case: Case, backend: str):
    import dres.ops as ops

    ydt = DTYPES[case.h_dtype]
    p = dropout_p(case)
    if case.op == "residual_layer_norm":
        def fn(x, h, w, b, alpha, rs, gs):
            return ops.residual_layer_norm(x, h, w, b, alpha, EPS, rs, gs, dropout_p=p, backend=backend)
    elif case.op == "residual_add":
        def fn(x, h, w, b, alpha, rs, gs):
            return (ops.residual_add(x, h, alpha, rs, gs, dropout_p=p, backend=backend),)
    else:
        def fn(x, h, w, b, alpha, rs, gs):
            return (ops.layer_norm(x, w, b, EPS, ydt, backend=backend),)
    return fn


def _flash_attn_fn(case: Case):
    """flash-attn's Triton ``layer_norm_fn(h, w, b, residual=x, prenorm=True, rowscale=...)``: the add
    and the norm in one kernel. It has no alpha and no separate gradient scale, so it covers the
    plain, drop_path, rdp_even and dropout modes (rowscale scales both the value and the gradient of h;
    its dropout_p drops h, its mask saved for the backward)."""
    import inspect

    from flash_attn.ops.triton.layer_norm import layer_norm_fn

    params = inspect.signature(layer_norm_fn).parameters
    ydt = DTYPES[case.h_dtype]
    if case.op == "residual_add":
        raise Unsupported("flash-attn has no add-only op")
    if case.op == "layer_norm":
        if case.x_dtype != case.h_dtype and "out_dtype" not in params:
            raise Unsupported("this flash-attn has no out_dtype")
        kw = {"out_dtype": ydt} if "out_dtype" in params and case.x_dtype != case.h_dtype else {}

        def fn(x, h, w, b, alpha, rs, gs):
            return (layer_norm_fn(x, w, b, eps=EPS, **kw),)
        return fn
    if case.mode not in ("plain", "drop_path", "rdp_even", "dropout"):
        raise Unsupported(f"flash-attn has no {case.mode} (no alpha, no separate gradient scale)")
    _, tokens = case.batch_tokens
    p = dropout_p(case)

    def fn(x, h, w, b, alpha, rs, gs):
        # rowscale is per row; expanding the per-sample factor is part of what a user of flash-attn
        # pays, so it stays inside the timed function.
        rowscale = None if rs is None else rs.repeat_interleave(tokens, output_size=rs.shape[0] * tokens)
        y, res = layer_norm_fn(h, w, b, residual=x, eps=EPS, dropout_p=p, prenorm=True, rowscale=rowscale)
        return res, y
    return fn


def _unfused_peer_ln(case: Case, ln: Callable):
    """apex / Liger have LayerNorm only: for residual_layer_norm the add (and the dropout) runs in eager
    PyTorch (the reference), then their norm, then a cast when the contract's y dtype differs from the input's."""
    from dres.ops import reference

    ydt = DTYPES[case.h_dtype]
    if case.op == "residual_add":
        raise Unsupported("LayerNorm-only library")
    if case.op == "layer_norm":
        def fn(x, h, w, b, alpha, rs, gs):
            y = ln(x, w, b)
            return (y if y.dtype == ydt else y.to(ydt),)
        return fn

    p = dropout_p(case)

    def fn(x, h, w, b, alpha, rs, gs):
        out = reference.residual_add(x, reference.dropout(h, p), alpha, rs, gs)
        y = ln(out, w, b)
        return out, (y if y.dtype == ydt else y.to(ydt))
    return fn


def _apex_fn(case: Case):
    from apex.normalization.fused_layer_norm import fused_layer_norm_affine

    def ln(x, w, b):
        # apex's kernel wants weight and bias in the input's dtype (its mixed-dtype variant returns
        # fp32); the cast of D-sized parameters is negligible next to the rows.
        return fused_layer_norm_affine(x, w.to(x.dtype), b.to(x.dtype), (x.shape[-1],), EPS)
    return _unfused_peer_ln(case, ln)


def _liger_fn(case: Case):
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction

    def ln(x, w, b):
        return LigerLayerNormFunction.apply(x, w, b, EPS)
    return _unfused_peer_ln(case, ln)


def build_fn(impl: str, case: Case):
    if impl == "dres_triton":
        return _dres_fn(case, "triton")
    if impl == "dres_cuda":
        return _dres_fn(case, "cuda")
    if impl == "eager":
        return _reference_fn(case)
    if impl == "compile":
        # A fresh static-shape compile per case (see measure.configure_dynamo_for_many_shapes);
        # fullgraph so a graph break fails loudly instead of timing a half-eager function.
        return torch.compile(_reference_fn(case), dynamic=False, fullgraph=True)
    if impl == "flash_attn":
        return _flash_attn_fn(case)
    if impl == "apex":
        return _apex_fn(case)
    if impl == "liger":
        return _liger_fn(case)
    raise ValueError(impl)


# ---------------------------------------------------------------------------------------------
# Inputs


@dataclasses.dataclass
class Inputs:
    x: torch.Tensor
    h: torch.Tensor
    w: torch.Tensor
    b: torch.Tensor
    g_out: Optional[torch.Tensor]
    g_y: Optional[torch.Tensor]


def make_mode_args(case: Case, device) -> tuple:
    """(alpha, row_scale, grad_scale) of a mode (docs/ops.md's op table)."""
    batch, _ = case.batch_tokens
    gen = torch.Generator(device=device).manual_seed(1)
    m = (torch.rand(batch, device=device, generator=gen) < KEEP).float()
    mode = case.mode
    if mode in ("plain", "dropout"):
        return 1.0, None, None
    if mode == "alpha":
        return ALPHA, None, None
    if mode == "drop_path":
        return 1.0, m / KEEP, None
    if mode == "rdp_even":
        return 1.0, m, None
    if mode == "rdp_odd":
        return 1.0, None, 1.0 - m
    if mode == "alpha_tensor":
        return torch.tensor(ALPHA, device=device), None, None
    if mode == "alpha_grad":
        return torch.tensor(ALPHA, device=device, requires_grad=True), None, None
    raise ValueError(mode)


def make_inputs(case: Case, device, requires_grad: bool, seed: int) -> Inputs:
    batch, tokens = case.batch_tokens
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (batch, tokens, case.dim)
    xdt, hdt = DTYPES[case.x_dtype], DTYPES[case.h_dtype]

    def rnd(dt, scale=1.0):
        return (torch.randn(shape, device=device, generator=gen) * scale).to(dt)

    x = rnd(xdt)
    h = rnd(hdt, 0.5)
    w = (1 + 0.1 * torch.randn(case.dim, device=device, generator=gen))
    b = 0.1 * torch.randn(case.dim, device=device, generator=gen)
    g_out = g_y = None
    if requires_grad:
        for t in (x, h, w, b):
            t.requires_grad_(True)
        if case.op == "residual_layer_norm":
            g_out, g_y = rnd(xdt), rnd(hdt)
        elif case.op == "residual_add":
            g_out = rnd(xdt)
        else:
            g_y = rnd(hdt)
    return Inputs(x, h, w, b, g_out, g_y)


def diff_inputs(case: Case, inp: Inputs, alpha) -> tuple:
    if case.op == "residual_layer_norm":
        ts = [inp.x, inp.h, inp.w, inp.b]
    elif case.op == "residual_add":
        ts = [inp.x, inp.h]
    else:
        ts = [inp.x, inp.w, inp.b]
    if isinstance(alpha, torch.Tensor) and alpha.requires_grad:
        ts.append(alpha)
    return tuple(ts)


def grad_outputs(case: Case, inp: Inputs) -> tuple:
    if case.op == "residual_layer_norm":
        return inp.g_out, inp.g_y
    if case.op == "residual_add":
        return (inp.g_out,)
    return (inp.g_y,)


def rotation_count(case: Case, l2_bytes: int) -> int:
    """Input sets to cycle through so that one call's inputs are not still in L2 from the previous
    call: enough sets to cover 4x the L2. do_bench flushes L2 before each timed call anyway; this
    matters for the back-to-back loop timing."""
    ws = measure.kernel_bytes(case.op, "fwd_bwd", case.rows, case.dim, DTYPES[case.x_dtype],
                             DTYPES[case.h_dtype], case.mode, case.batch_tokens[0])
    return max(1, min(8, math.ceil(4 * l2_bytes / max(ws, 1))))


def make_callable(fn, case: Case, inputs: list[Inputs], mode_args, pass_: str):
    """The timed function: one forward (``fwd``) or forward + ``torch.autograd.grad`` (``fwd_bwd``)
    on the next input set. Returns the results (dropped by the timer) and keeps nothing."""
    alpha, rs, gs = mode_args
    sets = [(i.x, i.h, i.w, i.b) for i in inputs]
    if pass_ == "fwd":
        if len(sets) == 1:
            x, h, w, b = sets[0]
            return lambda: fn(x, h, w, b, alpha, rs, gs)
        it = itertools.cycle(sets)

        def run_fwd():
            x, h, w, b = next(it)
            return fn(x, h, w, b, alpha, rs, gs)
        return run_fwd
    packs = [((i.x, i.h, i.w, i.b), diff_inputs(case, i, alpha), grad_outputs(case, i)) for i in inputs]
    it = itertools.cycle(packs)

    def run_fwd_bwd():
        (x, h, w, b), wrt, gouts = next(it)
        outs = fn(x, h, w, b, alpha, rs, gs)
        return torch.autograd.grad(outs, wrt, gouts)
    return run_fwd_bwd


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.float(), ref.float()
    return float((a - ref).norm() / ref.norm().clamp_min(1e-12))


def check_against(results, reference_results, case: Case) -> tuple[float, bool]:
    """Largest relative (L2) error of any output or gradient against eager PyTorch. The tolerance
    only catches wrong semantics (a scale applied to the wrong term, a missing alpha), not rounding:
    1e-2 when any tensor is 16-bit, 1e-4 in fp32. With dropout the implementations draw other masks,
    so the norms of the row-shaped tensors are compared instead, to 5e-3 (a missing mask or 1 / (1 - p)
    moves them by >= 1%; the weight gradients, each a sum over rows, move with the masks themselves)."""
    err = 0.0
    for a, r in zip(results, reference_results):
        if a is None or r is None:
            continue
        if a.shape != r.shape or a.dtype != r.dtype:
            return float("inf"), False
        if case.mode == "dropout":
            if a.dim() > 1:
                err = max(err, abs(a.float().norm().item() / r.float().norm().clamp_min(1e-12).item() - 1))
        else:
            err = max(err, rel_err(a, r))
    tol = 5e-3 if case.mode == "dropout" else 1e-4 if case.x_dtype == case.h_dtype == "fp32" else 1e-2
    return err, err <= tol


# ---------------------------------------------------------------------------------------------
# The run


def run_case(case: Case, impls: list[str], passes: list[str], graph_shapes: set, ceiling: float,
             card: str, env: dict, args) -> list[dict]:
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    batch, tokens = case.batch_tokens
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20) if on_gpu else 0
    bench = measure.do_bench_median_us if on_gpu else measure.cpu_median_us
    n_sets = rotation_count(case, l2)
    mode_args = make_mode_args(case, device)
    small = (case.rows, case.dim) in graph_shapes and on_gpu
    records = []
    torch._dynamo.reset()  # drop the previous case's compiled graphs (memory, and a clean cache)
    for pass_ in passes:
        need_grad = pass_ == "fwd_bwd"
        alpha, rs, gs = mode_args
        if not need_grad and isinstance(alpha, torch.Tensor):
            alpha = alpha.detach()  # inference: nothing may record an autograd graph
        pass_args = (alpha, rs, gs)
        inputs = [make_inputs(case, device, need_grad, seed=10 + i) for i in range(n_sets)]
        nbytes = measure.kernel_bytes(case.op, pass_, case.rows, case.dim, DTYPES[case.x_dtype],
                                     DTYPES[case.h_dtype], case.mode, batch)
        ref_results = None
        if not args.no_check:
            ref_call = make_callable(_reference_fn(case), case, inputs[:1], pass_args, pass_)
            ref_results = [t.detach() if t is not None else None for t in ref_call()]
        for impl in impls:
            variants = [False] + ([True] if small and impl in GRAPH_IMPLS and not args.no_graph else [])
            for graph in variants:
                name = impl + ("_graph" if graph else "")
                t0 = time.time()
                try:
                    fn = build_fn(impl, case)
                    extra = {"batch": batch, "tokens": tokens,
                             "gpu": torch.cuda.get_device_name(device) if on_gpu else "cpu"}
                    if graph:
                        step = make_callable(fn, case, inputs[:1], pass_args, pass_)
                        g, keep = measure.capture_graph(step)
                        us = bench(g.replay, args.warmup, args.rep)
                        del g, keep
                    else:
                        call = make_callable(fn, case, inputs, pass_args, pass_)
                        if ref_results is not None:
                            first = make_callable(fn, case, inputs[:1], pass_args, pass_)()
                            err, ok = check_against([t.detach() if t is not None else None for t in first],
                                                    ref_results, case)
                            extra.update(check_rel_err=err, check_ok=ok)
                            del first
                            if not ok:
                                print(f"  WARNING {name} {pass_}: relative error {err:.3g} vs eager",
                                      flush=True)
                        us = bench(call, args.warmup, args.rep)
                        if small:
                            extra["us_loop"] = measure.loop_median_us(call)
                except Unsupported as e:
                    if args.verbose:
                        print(f"  skip {name} {pass_}: {e}", flush=True)
                    continue
                except Exception as e:  # one failing implementation must not end the sweep
                    print(f"  FAILED {name} {pass_} {case.label()}: {type(e).__name__}: {e}", flush=True)
                    if args.verbose:
                        traceback.print_exc()
                    if isinstance(e, torch.cuda.OutOfMemoryError):
                        torch.cuda.empty_cache()
                    continue
                rec = measure.make_kernel_record(
                    op=case.op, rows=case.rows, dim=case.dim, x_dtype=case.x_dtype, h_dtype=case.h_dtype,
                    mode=case.mode, pass_=pass_, impl=name, us=us, nbytes=nbytes, ceiling_gbps=ceiling,
                    card=card, env=env, **extra)
                records.append(rec)
                print(f"  {name:18s} {pass_:7s} {us:10.1f} us {rec['gbps']:7.0f} GB/s "
                      f"{rec['pct_ceiling']:5.1f}%" + (f"  loop {extra['us_loop']:.1f} us" if "us_loop" in extra
                                                       else "") + f"  [{time.time() - t0:.1f}s]", flush=True)
        del inputs, ref_results
    return records


def write_outputs(out_dir: Path, card: str, new_records: list[dict], plot: bool = True) -> Path:
    """Merge ``new_records`` into ``<card>-kernels.json`` and rewrite the Markdown table (and the plot)
    from the whole file."""
    path = out_dir / f"{card}-kernels.json"
    records = measure.merge_records(measure.load_records(path), new_records)
    measure.add_speedups(records)
    measure.write_json_atomic(path, records)
    (out_dir / f"{card}-kernels.md").write_text(f"# Kernel benchmarks: {card}\n\n" + measure.kernel_markdown(records))
    if not plot:
        return path
    try:
        measure.kernel_plot(records, out_dir / f"{card}-kernels.png")
    except Exception as e:  # a plotting problem must not lose the measurements (JSON is written)
        print(f"plot failed: {type(e).__name__}: {e}", flush=True)
    return path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", help="comma list (default 12800,65536,262144)")
    p.add_argument("--dims", help="comma list (default 384,512,768,1024)")
    p.add_argument("--ops", help=f"comma list of {','.join(OPS)}")
    p.add_argument("--modes", help=f"comma list of {','.join(MODES)} (layer_norm runs plain only)")
    p.add_argument("--dtypes", help=f"comma list of x/h dtype pairs (default {','.join(DTYPE_COMBOS)})")
    p.add_argument("--passes", help="comma list of fwd,fwd_bwd")
    p.add_argument("--impls", default=",".join(ALL_IMPLS),
                   help="comma list; missing optional peers are skipped with a note")
    p.add_argument("--graph-shapes", help="RxD list timed also as CUDA graphs and back-to-back loops "
                                          "(default 12800x768; 'none' to skip)")
    p.add_argument("--quick", action="store_true", help="small set, < 2 minutes on an H100")
    p.add_argument("--out", default=measure.default_out("kernels"),
                   help="record folder (default: records/benchmarks/<machine>-<today>-kernels)")
    p.add_argument("--warmup", type=float, default=25, help="do_bench warmup, ms")
    p.add_argument("--rep", type=float, default=100, help="do_bench repetition time, ms")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="start no new case after this many minutes (results so far are written)")
    p.add_argument("--skip-existing", action="store_true",
                   help="skip cases already in the card's JSON (resume a split sweep)")
    p.add_argument("--no-check", action="store_true", help="skip the check against eager PyTorch")
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph variants")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU needed)")
    p.add_argument("--report-only", action="store_true",
                   help="rewrite <card>-kernels.md/.png from the JSON files in --out (no GPU needed)")
    p.add_argument("-v", "--verbose", action="store_true")
    # The CPU path exists to test the harness end to end without a GPU (Triton under
    # TRITON_INTERPRET=1, wall-clock timing); its numbers mean nothing for performance.
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help=argparse.SUPPRESS)
    return p


def resolve_plan(args) -> dict:
    base = QUICK if args.quick else DEFAULTS
    plan = dict(base)
    if args.rows:
        plan["rows"] = parse_list(args.rows, int)
    if args.dims:
        plan["dims"] = parse_list(args.dims, int)
    if args.ops:
        plan["ops"] = parse_list(args.ops)
    if args.modes:
        plan["modes"] = parse_list(args.modes)
    if args.dtypes:
        plan["dtypes"] = parse_list(args.dtypes)
    if args.passes:
        plan["passes"] = parse_list(args.passes)
    if args.graph_shapes:
        plan["graph_shapes"] = parse_list(args.graph_shapes)
    for op in plan["ops"]:
        if op not in OPS:
            raise SystemExit(f"unknown op {op!r}; choose from {', '.join(OPS)}")
    for m in plan["modes"]:
        if m not in MODES:
            raise SystemExit(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    for dt in plan["dtypes"]:
        parts = dt.split("/")
        if len(parts) != 2 or any(p not in DTYPES for p in parts):
            raise SystemExit(f"bad dtype pair {dt!r}; write x/h with bf16, fp16, fp32 (e.g. fp32/bf16)")
    for ps in plan["passes"]:
        if ps not in PASSES:
            raise SystemExit(f"unknown pass {ps!r}; choose from {', '.join(PASSES)}")
    plan["impls"] = normalize_impls(parse_list(args.impls))
    plan["cases"] = plan_cases(plan["ops"], plan["rows"], plan["dims"], plan["dtypes"], plan["modes"])
    plan["graph_set"] = parse_shapes(plan["graph_shapes"])
    return plan


def print_plan(plan: dict) -> None:
    cases, impls, passes = plan["cases"], plan["impls"], plan["passes"]
    n_graph = 0
    print(f"# {len(cases)} cases x {len(passes)} passes; implementations requested: {', '.join(impls)}")
    for c in cases:
        batch, tokens = c.batch_tokens
        graph = (c.rows, c.dim) in plan["graph_set"]
        gi = [i + "_graph" for i in impls if i in GRAPH_IMPLS] if graph else []
        n_graph += len(gi) * len(passes)
        for ps in passes:
            nb = measure.kernel_bytes(c.op, ps, c.rows, c.dim, DTYPES[c.x_dtype], DTYPES[c.h_dtype], c.mode, batch)
            print(f"{c.op} rows={c.rows} dim={c.dim} (B={batch}, T={tokens}) x/h={c.x_dtype}/{c.h_dtype} "
                  f"mode={c.mode} pass={ps} bytes={nb} impls={','.join(impls + gi)}")
    n = len(cases) * len(passes) * len(impls) + n_graph
    n_compile = len(cases) * len(passes) if "compile" in impls else 0
    print(f"# at most {n} measurements, {n_compile} torch.compile compilations "
          f"(roughly 10 s per case with compile on an H100: plan about {len(cases) * 10 / 60:.0f} min)")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    plan = resolve_plan(args)
    if args.dry_run:
        print_plan(plan)
        return 0
    if args.report_only:
        paths = sorted(Path(args.out).glob("*-kernels.json"))
        for path in paths:
            write_outputs(path.parent, path.name[: -len("-kernels.json")], [])
            print(f"rewrote the table and plot of {path}")
        return 0 if paths else 1
    on_gpu = args.device == "cuda"
    if on_gpu and not torch.cuda.is_available():
        print("bench_kernels needs a CUDA GPU (use --dry-run to see the plan)", file=sys.stderr)
        return 2
    measure.configure_caches()
    measure.configure_dynamo_for_many_shapes()
    impls, why = available_impls(plan["impls"])
    for impl, reason in why.items():
        print(f"# {impl}: not measured ({reason})", flush=True)
    card = measure.card_name() if on_gpu else "cpu"
    env = measure.versions()
    out_dir = Path(args.out)
    json_path = out_dir / f"{card}-kernels.json"
    done = set()
    if args.skip_existing:
        done = {(r["op"], r["rows"], r["dim"], r["x_dtype"], r["h_dtype"], r["mode"])
                for r in measure.load_records(json_path) if r.get("card") == card}
    print(f"# card {card} ({torch.cuda.get_device_name() if on_gpu else 'cpu'}), torch {env['torch']}, "
          f"triton {env['triton']}", flush=True)
    ceiling = measure.copy_ceiling_gbps() if on_gpu else measure.cpu_copy_gbps()
    print(f"# copy ceiling (1 GiB copy_, read+write): {ceiling:.0f} GB/s", flush=True)
    t_start = time.time()
    all_new = []
    for i, case in enumerate(plan["cases"]):
        key = (case.op, case.rows, case.dim, case.x_dtype, case.h_dtype, case.mode)
        if key in done:
            continue
        if args.max_minutes is not None and (time.time() - t_start) / 60 > args.max_minutes:
            print(f"# --max-minutes reached; stopped before case {i + 1}/{len(plan['cases'])}", flush=True)
            break
        print(f"[{i + 1}/{len(plan['cases'])}] {case.label()}", flush=True)
        recs = run_case(case, impls, plan["passes"], plan["graph_set"], ceiling, card, env, args)
        all_new.extend(recs)
        # Files after every case so a run killed at its limit keeps its results; the plot at the end.
        write_outputs(out_dir, card, recs, plot=False)
    write_outputs(out_dir, card, [])
    print(f"# {len(all_new)} measurements in {(time.time() - t_start) / 60:.1f} min -> {json_path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
