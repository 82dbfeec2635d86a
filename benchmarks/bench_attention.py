"""SDPA's backends at the attention shapes of the presets: forward+backward of
``F.scaled_dot_product_attention(q, k, v)`` with each backend forced (``sdpa_kernel``), bf16; and
``dres``: :func:`dres.ops.short_attention` (sequences of <= 256 tokens), timed from the qkv Linear's
output to the projection's input as the model calls it (the SDPA rows start from contiguous (B, H, N, d)
tensors and leave out the layout copies a model pays around them).

    python -m benchmarks.bench_attention --out $OUT
    python -m benchmarks.bench_attention --dry-run        # the plan, no GPU needed

At CIFAR scale the sequences are short (17 visible tokens in the MAE encoder, 65 in its decoder);
this says which backend wins at each shape against torch's own choice (cuDNN first on Hopper, what
the trainer runs). Each backend's output and gradients are checked against the math backend in
float32 first (a backend that cannot run a shape is recorded as unsupported). Each is timed as the median
replay of its forward+backward captured in a CUDA graph (``measure.graph_median_us``: the GPU time alone, as
the trainers replay their step). Results merge into ``<out>/<card>-attention.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from benchmarks import measure

BACKENDS = ("cudnn", "flash", "efficient", "math", "dres")
# (where, batch, heads, tokens, head dim)
SHAPES = (
    ("mae_cifar10 encoder (ViT-S/4, 25% of 64 patches + cls)", 1024, 6, 17, 64),
    ("mae_cifar10 decoder", 1024, 8, 65, 32),
    ("classify_cifar10 (ViT-Ti/4)", 256, 3, 65, 64),
    ("uvit_cifar10 (U-ViT-S/2: 256 patches + time token)", 128, 8, 257, 64),
    ("mae_vit_b16_in1k encoder", 256, 12, 50, 64),
    ("mae_vit_b16_in1k decoder", 256, 16, 197, 32),
)
RECORD_KEY = ("card", "where", "backend")


def sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend

    return {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]


def fwd_bwd(backend: str, q, k, v, grad):
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(sdpa_backend(backend)):
        out = F.scaled_dot_product_attention(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), grad))


def packed(q, k, v) -> torch.Tensor:
    """(B, H, N, d) q, k, v as the qkv Linear's output (B, N, 3 * H * d), a leaf."""
    B, H, N, d = q.shape
    return torch.stack((q, k, v), dim=2).permute(0, 3, 2, 1, 4).reshape(B, N, 3 * H * d).detach().requires_grad_(True)


def dres_fwd_bwd(qkv, num_heads: int, grad_bnc):
    """:func:`dres.ops.short_attention` forward+backward; out and the q, k, v gradients as (B, H, N, d)."""
    from dres.ops import short_attention

    B, N, three_c = qkv.shape
    out = short_attention(qkv, num_heads)
    (dqkv,) = torch.autograd.grad(out, (qkv,), grad_bnc)
    d = three_c // (3 * num_heads)
    heads = lambda t, parts: t.reshape(B, N, parts, num_heads, d).permute(2, 0, 3, 1, 4)  # noqa: E731
    return (heads(out, 1)[0], *heads(dqkv, 3).unbind(0))


def run_shape(where: str, shape: tuple, backends: list[str], card: str, env: dict) -> list[dict]:
    B, H, N, d = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, grad = (torch.randn(B, H, N, d, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    want = fwd_bwd("math", *(t.detach().float().requires_grad_(True) for t in (q, k, v)), grad.float())
    records = []
    qkv, grad_bnc = packed(q, k, v), grad.transpose(1, 2).reshape(B, N, H * d)
    for name in backends:
        rec = {"where": where, "batch": B, "heads": H, "tokens": N, "head_dim": d, "backend": name, "card": card,
               "date": measure.today(), **env}
        run = (lambda: dres_fwd_bwd(qkv, H, grad_bnc)) if name == "dres" else (lambda: fwd_bwd(name, q, k, v, grad))
        try:
            got = run()
        except (RuntimeError, ValueError) as e:  # "No available kernel"; dres: more tokens than it takes
            rec.update(supported=False, why=str(e).strip().splitlines()[0][:160])
            records.append(rec)
            print(f"{where:55s} {name:9s} unsupported", flush=True)
            continue
        err = max(((g.float() - w).abs().max() / w.abs().max().clamp_min(1e-6)).item() for g, w in zip(got, want))
        try:
            us = measure.graph_median_us(run)
        except RuntimeError as e:  # a backend whose kernels cannot be captured in a CUDA graph
            rec.update(supported=False, why=f"graph capture: {str(e).strip().splitlines()[0][:140]}")
            records.append(rec)
            print(f"{where:55s} {name:9s} not capturable", flush=True)
            continue
        rec.update(supported=True, max_rel_err_vs_math_fp32=err, fwd_bwd_us=us)
        records.append(rec)
        print(f"{where:55s} {name:9s} {us:9.1f} us  (max rel err {err:.1e})", flush=True)
    return records


def markdown(records: list[dict]) -> str:
    lines = ["| shape (B, H, N, d) | where | " + " | ".join(BACKENDS) + " | fastest |", "|---|---|" + "---|" * (len(BACKENDS) + 1)]
    by_where: dict[str, dict] = {}
    for r in records:
        by_where.setdefault(r["where"], {})[r["backend"]] = r
    for where, recs in by_where.items():
        r0 = next(iter(recs.values()))
        times = {b: r["fwd_bwd_us"] for b, r in recs.items() if r.get("supported")}
        cells = [f"{times[b]:.0f}" if b in times else ("–" if b not in recs else "n/a") for b in BACKENDS]
        best = min(times, key=times.get) if times else "–"
        lines.append(f"| {r0['batch']}, {r0['heads']}, {r0['tokens']}, {r0['head_dim']} | {where} | "
                     + " | ".join(cells) + f" | {best} |")
    return "Forward+backward, microseconds (bf16; n/a: the backend cannot run the shape)\n\n" + "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default=",".join(BACKENDS), help=f"comma list of {', '.join(BACKENDS)}")
    p.add_argument("--out", default=measure.default_out("attention"),
                   help="record folder (default: records/benchmarks/<machine>-<today>-attention)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU needed)")
    args = p.parse_args(argv)
    backends = [b for b in args.backends.split(",") if b]
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown:
        p.error(f"--backends: unknown {', '.join(unknown)}; known: {', '.join(BACKENDS)}")
    if args.dry_run:
        for where, *shape in SHAPES:
            print(f"{where}: {tuple(shape)} x {', '.join(backends)}")
        return 0
    if not torch.cuda.is_available():
        print("bench_attention needs a CUDA GPU", file=sys.stderr)
        return 2
    card, env = measure.card_name(), measure.versions()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{card}-attention.json"
    for where, *shape in SHAPES:
        records = measure.merge_records(measure.load_records(path), run_shape(where, tuple(shape), backends, card, env),
                                       RECORD_KEY)
        measure.write_json_atomic(path, records)  # after each shape: a run cut short keeps what it measured
        (out / f"{card}-attention.md").write_text(markdown(records))
    print(markdown(measure.load_records(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
