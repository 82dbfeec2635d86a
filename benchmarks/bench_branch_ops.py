"""Microbenchmarks of the fused ops inside the branches: the MLP with bias+GELU fused and GELU
recomputed in the backward (``dres.ops.fused_mlp``), and the MAE loss read straight from the image
(``dres.ops.mae_loss``), each against eager PyTorch and torch.compile of the same unfused code.

    python -m benchmarks.bench_branch_ops --out $OUT          # ViT-B/16 MAE shapes, batch 256
    python -m benchmarks.bench_branch_ops --dry-run           # the plan, no GPU needed

Timed forward+backward (``torch.autograd.grad``), by ``triton.testing.do_bench`` (median) and by
back-to-back loops (``loop``: what a training step sees, launch cost included). Besides time:

* fused_mlp: the activation memory the forward keeps for the backward (allocated after the forward
  minus before, less the output), the reason the op exists; matmuls dominate its time.
* mae_loss: bytes (pred, image and mask read once, the gradient of pred written once) and the
  percent of the copy ceiling measured in the same run.

Every implementation's loss/outputs and gradients are checked against eager PyTorch first.
Results merge into ``<out>/<card>-branch.json`` (one record per measurement) and ``.md``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from benchmarks import measure

IMPLS = ("dres", "dres_cuda", "eager", "compile")  # dres_cuda: the csrc extension's MLP, where it is built
# (tokens, dim, hidden): the MAE ViT-B/16 encoder MLP at batch 256 (256 x 50 tokens) and the
# decoder MLP (256 x 197 tokens, 512 wide); ViT-B/16 at batch 128 (197 tokens) and DINOv2 ViT-S/14
# at batch 128 (257 tokens), the own-model benchmark's.
MLP_SHAPES = ((12800, 768, 3072), (50432, 512, 2048), (25216, 768, 3072), (32896, 384, 1536))
# (batch, image size, patch size): MAE ViT-B/16 at 224 px, and CIFAR-10 with patch 4.
LOSS_SHAPES = ((256, 224, 16), (512, 32, 4))
BRANCH_KEY = ("card", "op", "shape", "dtype", "pass", "impl")
PROFILE_TOP = 12  # kernels kept of each profiled implementation


def plan(ops: list[str], mlp_shapes: tuple = MLP_SHAPES) -> list[tuple[str, tuple]]:
    cases = []
    if "fused_mlp" in ops:
        cases += [("fused_mlp", s) for s in mlp_shapes]
    if "mae_loss" in ops:
        cases += [("mae_loss", s) for s in LOSS_SHAPES]
    return cases


def impls_for(op: str, impls: list[str]) -> list[str]:
    """The implementations an op has: the csrc extension carries the MLP alone of these ops."""
    return [i for i in impls if i != "dres_cuda" or op == "fused_mlp"]


# ---------------------------------------------------------------------------------------------
# The unfused code each op replaces (what eager and torch.compile run)


def unfused_mlp(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


def unfused_mae_loss(pred, imgs, mask, patch_size):
    """dres.models.mae.MAE.forward_loss (norm-pix), written out."""
    p = patch_size
    B, C, H, W = imgs.shape
    target = imgs.reshape(B, C, H // p, p, W // p, p)
    target = torch.einsum("nchpwq->nhwpqc", target).reshape(B, (H // p) * (W // p), p * p * C).float()
    mean = target.mean(dim=-1, keepdim=True)
    var = target.var(dim=-1, keepdim=True)
    target = (target - mean) / (var + 1.0e-6) ** 0.5
    loss = ((pred.float() - target) ** 2).mean(dim=-1)
    return (loss * mask).sum() / mask.sum()


def build(op: str, impl: str):
    if op == "fused_mlp":
        from dres.ops import fused_mlp

        fns = {"dres": lambda *a: fused_mlp(*a, backend="triton"), "dres_cuda": lambda *a: fused_mlp(*a, backend="cuda"),
               "eager": unfused_mlp}
        base = unfused_mlp
    else:
        from dres.ops import mae_loss

        fns = {"dres": lambda pred, imgs, mask, p: mae_loss(pred, imgs, mask, p, backend="triton"),
               "eager": unfused_mae_loss}
        base = unfused_mae_loss
    if impl == "compile":
        return torch.compile(base, fullgraph=True)
    return fns[impl]


def make_case(op: str, shape: tuple, device):
    """(inputs, differentiable inputs, autocast dtype or None, bytes or None)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    rand = lambda *s: torch.randn(*s, generator=g).to(device)  # noqa: E731
    if op == "fused_mlp":
        tokens, dim, hidden = shape
        # The training case: fp32 parameters, bf16 activations under autocast.
        x = rand(tokens, dim).to(torch.bfloat16).requires_grad_(True)
        w1 = (rand(hidden, dim) * dim**-0.5).requires_grad_(True)
        b1 = (rand(hidden) * 0.1).requires_grad_(True)
        w2 = (rand(dim, hidden) * hidden**-0.5).requires_grad_(True)
        b2 = (rand(dim) * 0.1).requires_grad_(True)
        return (x, w1, b1, w2, b2), (x, w1, b1, w2, b2), torch.bfloat16, None
    batch, size, p = shape
    imgs = rand(batch, 3, size, size)
    n, cols = (size // p) ** 2, p * p * 3
    pred = rand(batch, n, cols).to(torch.bfloat16).requires_grad_(True)
    mask = (torch.rand(batch, n, generator=g) < 0.75).float().to(device)
    nbytes = pred.numel() * 2 + imgs.numel() * 4 + mask.numel() * 4 + pred.numel() * 2
    return (pred, imgs, mask, p), (pred,), None, nbytes


def fwd_bwd_callable(fn, inputs, wrt, autocast_dtype, device):
    def step():
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            out = fn(*inputs)
        return (out,) + torch.autograd.grad(out, wrt, torch.ones_like(out))
    return step


def held_by_forward_bytes(fn, inputs, autocast_dtype, device) -> int:
    """Memory the forward leaves allocated for the backward (its saved activations), output excluded."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        out = fn(*inputs)
    torch.cuda.synchronize(device)
    held = torch.cuda.memory_allocated(device) - before - out.numel() * out.element_size()
    del out
    return held


def max_rel_err(results, reference) -> float:
    err = 0.0
    for a, r in zip(results, reference):
        a, r = a.float(), r.float()
        err = max(err, float((a - r).norm() / r.norm().clamp_min(1e-12)))
    return err


def run(op: str, shape: tuple, impls: list[str], ceiling: float, card: str, env: dict, args) -> list[dict]:
    device = torch.device("cuda")
    inputs, wrt, ac_dtype, nbytes = make_case(op, shape, device)
    torch._dynamo.reset()
    reference = [t.detach() for t in fwd_bwd_callable(build(op, "eager"), inputs, wrt, ac_dtype, device)()]
    records = []
    for impl in impls_for(op, impls):
        t0 = time.time()
        try:
            fn = build(op, impl)
            step = fwd_bwd_callable(fn, inputs, wrt, ac_dtype, device)
            err = max_rel_err([t.detach() for t in step()], reference)
            us = measure.do_bench_median_us(step, args.warmup, args.rep)
            rec = {"card": card, "op": op, "shape": "x".join(map(str, shape)),
                   "dtype": "bf16", "pass": "fwd_bwd",  # both cases: bf16 pred / autocast
                   "impl": impl, "us": us, "us_loop": measure.loop_median_us(step), "check_rel_err": err,
                   "check_ok": err <= 2e-2, "torch": env["torch"], "triton": env["triton"],
                   "date": measure.today()}
            if nbytes is not None:
                rec.update(bytes=nbytes, gbps=measure.gbps(nbytes, us), ceiling_gbps=ceiling,
                           pct_ceiling=100 * measure.gbps(nbytes, us) / ceiling,
                           us_at_ceiling=measure.us_at_ceiling(nbytes, ceiling))
            if op == "fused_mlp":
                rec["saved_mib"] = held_by_forward_bytes(fn, inputs, ac_dtype, device) / 2**20
            if args.profile_steps:
                rec["kernels"] = kernel_times(step, args.profile_steps)
        except Exception as e:  # one failing implementation must not end the sweep
            print(f"  FAILED {impl}: {type(e).__name__}: {e}", flush=True)
            continue
        records.append(rec)
        extra = (f"{rec['pct_ceiling']:5.1f}% of copy" if "pct_ceiling" in rec else f"saved {rec['saved_mib']:7.1f} MiB")
        print(f"  {impl:8s} {us:9.1f} us  loop {rec['us_loop']:9.1f} us  {extra}  err {err:.1e}"
              f"{'' if rec['check_ok'] else '  MISMATCH'}  [{time.time() - t0:.1f}s]", flush=True)
    return records


def kernel_times(step, steps: int) -> list[dict]:
    """GPU time a call by kernel (``steps`` calls under torch.profiler, after the timing's warm-up): where an
    implementation's time goes, the kernels of the fused op beside the matmuls."""
    from benchmarks.profile_train import profile_steps

    return profile_steps(step, steps, None, top=PROFILE_TOP)["top_kernels"]


def kernel_markdown(records: list[dict]) -> list[str]:
    lines = []
    for r in records:
        if r.get("kernels"):
            lines += [f"### {r['op']} {r['shape']} {r['impl']}: GPU time a call by kernel", "",
                      "| us | calls | kernel |", "|---|---|---|"]
            lines += [f"| {k['us']:.1f} | {k['calls']:g} | `{k['name'][:90]}` |" for k in r["kernels"]]
            lines.append("")
    return lines


def markdown(records: list[dict]) -> str:
    lines = ["# Branch-op benchmarks", "",
             "Forward+backward, median microseconds (do_bench) and back-to-back loop; fused_mlp: activation "
             "memory kept by the forward; mae_loss: percent of the copy ceiling measured in the same run.", ""]
    for card in sorted({r["card"] for r in records}):
        recs = [r for r in records if r["card"] == card]
        r0 = recs[0]
        recs.sort(key=lambda r: (r["op"], r["shape"], IMPLS.index(r["impl"])))  # the table's and the kernels' order
        lines += [f"## {card}", "", f"torch {r0['torch']}, triton {r0['triton']}; dates "
                  f"{', '.join(sorted({r['date'] for r in recs}))}.", "",
                  "| op | shape | impl | us | loop us | saved MiB / % ceiling | rel. err vs eager |",
                  "|---|---|---|---|---|---|---|"]
        for r in recs:
            third = f"{r['saved_mib']:.0f} MiB" if "saved_mib" in r else f"{r.get('pct_ceiling', 0):.0f}%"
            lines.append(f"| {r['op']} | {r['shape']} | {r['impl']} | {r['us']:.1f} | {r['us_loop']:.1f} | "
                         f"{third} | {r['check_rel_err']:.1e}{'' if r['check_ok'] else ' MISMATCH'} |")
        lines.append("")
        lines += kernel_markdown(recs)
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default="fused_mlp,mae_loss", help="comma list of fused_mlp, mae_loss")
    p.add_argument("--impls", default=None,
                   help=f"comma list of {', '.join(IMPLS)} (default: each, dres_cuda where the extension is built)")
    p.add_argument("--out", default=measure.default_out("branch-ops"),
                   help="record folder (default: records/benchmarks/<machine>-<today>-branch-ops)")
    p.add_argument("--warmup", type=float, default=25, help="do_bench warmup, ms")
    p.add_argument("--rep", type=float, default=100, help="do_bench repetition time, ms")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="profile this many more calls of each implementation: GPU time by kernel in the record")
    p.add_argument("--shapes", default=None,
                   help="comma list of fused_mlp shapes TOKENSxDIMxHIDDEN (default: the four below)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU needed)")
    args = p.parse_args(argv)
    ops = [o for o in args.ops.split(",") if o]
    impls = [i for i in (args.impls or ",".join(IMPLS)).split(",") if i]
    for name, given, known in (("--ops", ops, ("fused_mlp", "mae_loss")), ("--impls", impls, IMPLS)):
        bad = [v for v in given if v not in known]
        if bad:
            raise SystemExit(f"{name}: unknown {bad}; choose from {', '.join(known)}")
    if args.profile_steps < 0:
        raise SystemExit(f"--profile-steps: {args.profile_steps} is negative")
    try:
        mlp_shapes = measure.parse_int_shapes(args.shapes, "TOKENSxDIMxHIDDEN", "25216x768x3072") if args.shapes \
            else MLP_SHAPES
    except ValueError as e:
        raise SystemExit(str(e)) from None
    cases = plan(ops, mlp_shapes)
    if args.dry_run:
        for op, shape in cases:
            print(f"{op} {'x'.join(map(str, shape))}: {', '.join(impls_for(op, impls))}")
        return 0
    if not torch.cuda.is_available():
        print("bench_branch_ops needs a CUDA GPU (use --dry-run to see the plan)", file=sys.stderr)
        return 2
    from dres.ops import csrc_backend

    if args.impls is None and not csrc_backend.available():
        impls.remove("dres_cuda")
    measure.configure_caches()
    card, env = measure.card_name(), measure.versions()
    ceiling = measure.copy_ceiling_gbps()
    print(f"# card {card}, torch {env['torch']}, triton {env['triton']}; copy ceiling {ceiling:.0f} GB/s", flush=True)
    path = Path(args.out) / f"{card}-branch.json"
    records = measure.load_records(path)
    for op, shape in cases:
        print(f"{op} {'x'.join(map(str, shape))}", flush=True)
        records = measure.merge_records(records, run(op, shape, impls, ceiling, card, env, args), BRANCH_KEY)
        measure.write_json_atomic(path, records)  # after every case: a run stopped early keeps its results
    path.with_suffix(".md").write_text(markdown(records))
    print(f"# -> {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
