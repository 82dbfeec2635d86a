"""Benchmark of the convolutional residual op ``dres.ops.residual_act`` and of a ResNet50d training
step with and without it.

    python -m benchmarks.bench_residual_act --out $OUT              # kernels + training steps
    python -m benchmarks.bench_residual_act --dry-run               # the plan, no GPU needed

Kernels: ``relu(alpha*x + s[b]*h)`` forward + backward (``torch.autograd.grad`` into x and h) at the
ResNet50 stage outputs of batch 256, 224 px (256x56x56 .. 2048x7x7) and 32 px through timm's
ImageNet stem (256x8x8 .. 2048x1x1), bf16 and fp32, NCHW and channels_last. Implementations: the op
(``dres``), eager PyTorch of the same expression with autograd (``eager``) and torch.compile of that
(``compile``). Each is checked against eager first; timed by ``triton.testing.do_bench`` (median).
Bytes moved: x, h read and out written forward; g and out read, dx and dh written backward (the
ReLU backward reads out), so ``us_at_ceiling`` is that traffic at the copy bandwidth measured in
the same run.

Training step (``--train``): timm resnet50d, batch 256, bf16 autocast, channels_last, AdamW,
forward + backward + step; unconverted (``timm``) against converted (``dres``, alpha_min 1, no drop
path: the same function), eager and whole-model torch.compile, 224 px and 32 px; median over steps.

Results merge into ``<out>/<card>-residual_act.json`` and a Markdown table ``.md`` beside it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks import measure

IMPLS = ("dres", "eager", "compile")
LAYOUTS = ("nchw", "channels_last")
MODES = ("plain", "scaled")  # alpha only; alpha and a per-sample scale s (drop path / ResidualDroppath)
# ResNet50 stage outputs (C, H, W) at 224 px, and at 32 px through timm's stride-4 stem
STAGES = {224: ((256, 56, 56), (512, 28, 28), (1024, 14, 14), (2048, 7, 7)),
          32: ((256, 8, 8), (512, 4, 4), (1024, 2, 2), (2048, 1, 1))}
KEY = ("card", "kind", "shape", "dtype", "layout", "mode", "impl")


def parse_shapes(text: str, batch: int) -> list[tuple[int, ...]]:
    """'224,32' -> the stages of those image sizes; 'BxCxHxW,...' -> those shapes."""
    shapes = []
    for item in text.split(","):
        if item.isdigit() and int(item) in STAGES:
            shapes += [(batch,) + s for s in STAGES[int(item)]]
        elif all(p.isdigit() for p in item.split("x")) and len(item.split("x")) == 4:
            shapes.append(tuple(int(p) for p in item.split("x")))
        else:
            raise SystemExit(f"--shapes: {item!r} is neither an image size of {sorted(STAGES)} nor BxCxHxW")
    return shapes


def residual_bytes(shape, dtype: torch.dtype, mode: str) -> int:
    """Bytes the fused forward + backward moves: 7 tensors of the shape, plus the scales."""
    n = 1
    for s in shape:
        n *= s
    scales = 2 * shape[0] * 4 if mode == "scaled" else 0
    return 7 * n * torch.tensor([], dtype=dtype).element_size() + scales


def eager_residual(x, h, alpha, s):
    return torch.relu(alpha * x + (h if s is None else s[:, None, None, None] * h))


def build(impl: str):
    from dres.ops import residual_act

    if impl == "dres":
        return lambda x, h, alpha, s: residual_act(x, h, alpha, s, backend="triton")
    if impl == "eager":
        return eager_residual
    return torch.compile(eager_residual, dynamic=False)


def kernel_cases(shapes, dtypes, layouts, modes, impls):
    return [(shape, dt, layout, mode, impl) for shape in shapes for dt in dtypes for layout in layouts
            for mode in modes for impl in impls]


def measure_kernel(shape, dtype, layout, mode, impl, device, timer) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    make = lambda: torch.randn(shape, device=device, generator=gen).to(dtype)  # noqa: E731
    x, h, g = make(), make(), make()
    if layout == "channels_last":
        x, h, g = (t.to(memory_format=torch.channels_last) for t in (x, h, g))
    x.requires_grad_(True), h.requires_grad_(True)
    s = (torch.rand(shape[0], device=device, generator=gen) > 0.1).float() / 0.9 if mode == "scaled" else None
    alpha = torch.tensor(0.9, device=device)
    fn = build(impl)

    def step():
        out = fn(x, h, alpha, s)
        return (out,) + torch.autograd.grad(out, (x, h), g)

    # checked against the eager expression in fp32 on the same inputs; in bf16/fp16 a ReLU whose
    # rounded input changes sign flips a gradient element, hence the loose bound there
    x32, h32 = x.detach().float().requires_grad_(True), h.detach().float().requires_grad_(True)
    ref = eager_residual(x32, h32, alpha, s)
    want = [ref] + list(torch.autograd.grad(ref, (x32, h32), g.float()))
    got = step()
    err = max(((a.float() - b).norm() / b.norm().clamp_min(1e-30)).item() for a, b in zip(got, want))
    del got, want, ref, x32, h32
    us = timer(step)
    return dict(kind="kernel", shape="x".join(map(str, shape)), dtype=measure.dtype_name(dtype), layout=layout,
                mode=mode, impl=impl, us=us, bytes=residual_bytes(shape, dtype, mode),
                check_rel_err=err, check_ok=err < (1e-5 if dtype == torch.float32 else 1e-1))


def train_cases(img_sizes, models, modes):
    return [(img, model, mode) for img in img_sizes for model in models for mode in modes]


def measure_train(img: int, model_name: str, mode: str, batch: int, steps: int, arch: str, device) -> dict:
    import timm

    import dres

    torch.manual_seed(0)
    model = timm.create_model(arch, pretrained=False, num_classes=1000 if img == 224 else 10)
    if model_name == "dres":
        dres.convert_timm_resnet(model)
    model = model.to(device).to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if device.type == "cuda" else {}))
    forward = torch.compile(model) if mode == "compile" else model
    x = torch.randn(batch, 3, img, img, device=device).to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch,), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step():
        with autocast:
            loss = torch.nn.functional.cross_entropy(forward(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):  # compile and allocator warm-up
        step()
    sync()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    ms = statistics.median(times) * 1e3
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    return dict(kind="train", shape=f"{arch} {batch}x3x{img}x{img}", dtype="bf16" if device.type == "cuda" else "fp32",
                layout="channels_last", mode=mode, impl=model_name, ms_per_step=ms, images_per_s=batch / ms * 1e3,
                peak_mem_gib=peak)


def markdown(records: list[dict]) -> str:
    lines = []
    kernels = [r for r in records if r["kind"] == "kernel"]
    if kernels:
        lines += ["| shape | dtype | layout | mode | impl | us | at ceiling us | % ceiling | vs compile | check |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        compile_us = {(r["shape"], r["dtype"], r["layout"], r["mode"]): r["us"] for r in kernels if r["impl"] == "compile"}
        for r in sorted(kernels, key=lambda r: (r["shape"], r["dtype"], r["layout"], r["mode"], IMPLS.index(r["impl"]))):
            base = compile_us.get((r["shape"], r["dtype"], r["layout"], r["mode"]))
            vs_compile = f"{base / r['us']:.2f}x" if base else "-"
            lines.append(f"| {r['shape']} | {r['dtype']} | {r['layout']} | {r['mode']} | {r['impl']} | {r['us']:.1f} | "
                         f"{r['us_at_ceiling']:.1f} | {100 * r['us_at_ceiling'] / r['us']:.0f}% | {vs_compile} | "
                         f"{'ok' if r['check_ok'] else 'MISMATCH'} |")
    trains = [r for r in records if r["kind"] == "train"]
    if trains:
        lines += ["", "| model | impl | mode | ms/step | img/s | peak GiB |", "|---|---|---|---|---|---|"]
        for r in sorted(trains, key=lambda r: (r["shape"], r["mode"], r["impl"])):
            lines.append(f"| {r['shape']} | {r['impl']} | {r['mode']} | {r['ms_per_step']:.1f} | "
                         f"{r['images_per_s']:.0f} | {r['peak_mem_gib']:.1f} |")
    return "\n".join(lines) + "\n" if lines else "No measurements.\n"


def split(text: str, valid, flag: str) -> list[str]:
    items = [t for t in text.split(",") if t]
    bad = [t for t in items if t not in valid]
    if bad:
        raise SystemExit(f"{flag}: unknown {bad}; choose from {', '.join(valid)}")
    return items


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="224,32", help="image sizes (224, 32) or BxCxHxW shapes, comma-separated")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--modes", default="scaled")
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--no-kernels", action="store_true", help="only the training steps")
    p.add_argument("--train", default="224,32", help="training-step image sizes ('' for none)")
    p.add_argument("--train-arch", default="resnet50d")
    p.add_argument("--train-modes", default="eager,compile")
    p.add_argument("--train-steps", type=int, default=20)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=measure.default_out("residual-act"),
                   help="record folder (default: records/benchmarks/<machine>-<today>-residual-act)")
    p.add_argument("--dry-run", action="store_true")
    a = p.parse_args(argv)
    shapes = parse_shapes(a.shapes, a.batch)
    dtypes = [measure.DTYPES[d] for d in split(a.dtypes, ("bf16", "fp32", "fp16"), "--dtypes")]
    layouts, modes = split(a.layouts, LAYOUTS, "--layouts"), split(a.modes, MODES, "--modes")
    impls = split(a.impls, IMPLS, "--impls")
    train_sizes = [int(s) for s in split(a.train, ("224", "32"), "--train")]
    train_modes = split(a.train_modes, ("eager", "compile"), "--train-modes")
    kcases = [] if a.no_kernels else kernel_cases(shapes, dtypes, layouts, modes, impls)
    tcases = train_cases(train_sizes, ("timm", "dres"), train_modes)
    if a.dry_run:
        for shape, dt, layout, mode, impl in kcases:
            print(f"kernel {'x'.join(map(str, shape))} {measure.dtype_name(dt)} {layout} {mode} {impl} "
                  f"bytes={residual_bytes(shape, dt, mode)}")
        for img, model, mode in tcases:
            print(f"train {a.train_arch} {a.batch}x3x{img}x{img} {model} {mode}")
        return 0
    device = torch.device(a.device)
    on_gpu = device.type == "cuda"
    if on_gpu:
        measure.configure_caches()
        measure.configure_dynamo_for_many_shapes()
    card = measure.card_name() if on_gpu else "cpu"
    ceiling = measure.copy_ceiling_gbps() if on_gpu else measure.cpu_copy_gbps()
    timer = measure.do_bench_median_us if on_gpu else measure.cpu_median_us
    stamp = dict(card=card, ceiling_gbps=ceiling, date=measure.today(), **measure.versions())
    records = []
    for case in kcases:
        rec = dict(measure_kernel(*case, device, timer), **stamp)
        rec["us_at_ceiling"] = measure.us_at_ceiling(rec["bytes"], ceiling)
        print(f"{rec['shape']} {rec['dtype']} {rec['layout']} {rec['mode']} {rec['impl']}: {rec['us']:.1f} us "
              f"({100 * rec['us_at_ceiling'] / rec['us']:.0f}% of copy){'' if rec['check_ok'] else ' MISMATCH'}",
              flush=True)
        records.append(rec)
        if on_gpu:
            torch.cuda.empty_cache()
    for img, model, mode in tcases:
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        rec = dict(measure_train(img, model, mode, a.batch, a.train_steps, a.train_arch, device), **stamp)
        print(f"{rec['shape']} {model} {mode}: {rec['ms_per_step']:.1f} ms/step, {rec['images_per_s']:.0f} img/s",
              flush=True)
        records.append(rec)
        if on_gpu:
            torch.cuda.empty_cache()
    out = Path(a.out)
    path = out / f"{card}-residual_act.json"
    merged = measure.merge_records(measure.load_records(path), records, KEY)
    measure.write_json_atomic(path, merged)
    (out / f"{card}-residual_act.md").write_text(markdown(merged))
    print(f"wrote {path} and {path.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
