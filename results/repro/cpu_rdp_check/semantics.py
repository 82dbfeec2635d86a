"""Which reading of ResidualDroppath's odd iterations? A CPU toy check (results/repro/notes.md, C).

The paper trains "the dropped parts while freezing the undropped parts" in odd iterations. DESIGN.md
(and dres) writes that as ``X + f(X).detach() m + f(X) (1 - m)``: a kept branch passes no gradient at
all, neither to its weights nor back to its input. Freezing can also mean that a kept branch's weights
get no gradient while gradients still flow through it to earlier layers. This script trains the same
toy ViT on CIFAR-10 in plain PyTorch (not dres' fused ops) under both readings, against no drop path
and timm's drop path, with the same initial weights, data order, augmentation and masks in every arm:

    none          X + f(X)
    drop_path     X + f(X) m / keep                                  (timm)
    rdp_detach    even: X + f(X) m;  odd: X + f(X).detach() m + f(X) (1 - m)
    rdp_freeze    even: X + f(X) m;  odd: X + f_w(X) m + f(X) (1 - m),  f_w = f with detached weights

Masks per (block, sample slot), drop rate linear in depth from 0 to 0.1, drawn in even iterations
and reused by the following odd one. AdamW (lr 1e-3, wd 0.05), batch 128, 400 steps, 40 warm-up
then cosine; top-1 on the 10k test images. Usage (repository root; about 4 minutes an arm on 2 cores):

    python results/repro/cpu_rdp_check/semantics.py MODE [--seed S] [--steps N]

writes ``results/repro/cpu_rdp_check/semantics_<MODE>_s<S>.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from dres.data import device_augment, normalize, read_shards  # noqa: E402

MODES = ("none", "drop_path", "rdp_detach", "rdp_freeze")
MEAN, STD = [0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616]


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm, self.heads = nn.LayerNorm(dim), heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d))


class Mlp(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(self.norm(x))))


class ToyViT(nn.Module):
    def __init__(self, dim=96, depth=6, heads=3, patch=4, img=32, classes=10):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, (img // patch) ** 2 + 1, dim) * 0.02)
        self.branches = nn.ModuleList(m for _ in range(depth) for m in (Attention(dim, heads), Mlp(dim)))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)
        self.drop = [0.1 * (i // 2) / max(1, depth - 1) for i in range(2 * depth)]  # per branch, linear in depth

    def forward(self, x, mode="none", masks=None, odd=False):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
        for i, f in enumerate(self.branches):
            if mode == "none" or masks is None or self.drop[i] == 0:
                x = x + f(x)
                continue
            m = masks[i].view(-1, 1, 1)
            h = f(x)
            if mode == "drop_path":
                x = x + h * m / (1 - self.drop[i])
            elif not odd:
                x = x + h * m
            elif mode == "rdp_detach":
                x = x + h.detach() * m + h * (1 - m)
            else:  # rdp_freeze: the kept samples' branch with its weights detached, its input not
                frozen = {n: p.detach() for n, p in f.named_parameters()}
                x = x + functional_call(f, frozen, (x,)) * m + h * (1 - m)
        return self.head(self.norm(x[:, 0]))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=MODES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=400)
    a = p.parse_args()
    torch.set_num_threads(2)
    data = ROOT / "shared" / "data" / "cifar10"
    if not data.exists():
        data = ROOT.parent / "shared" / "data" / "cifar10"
    xtr, ytr, _ = read_shards(str(data / "cifar10-train-*.tar.gz"))
    xte, yte, _ = read_shards(str(data / "cifar10-test-*.tar.gz"))
    torch.manual_seed(a.seed)
    model = ToyViT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    warm, batch = 40, 128
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (a.steps - warm))))
    order = torch.from_numpy(np.random.default_rng(a.seed).permutation(len(xtr)))
    mask_rng = torch.Generator().manual_seed(a.seed + 1)
    masks, t0, losses = None, time.time(), []
    for step in range(a.steps):
        idx = order[(step * batch + torch.arange(batch)) % len(order)]  # whole batches across the epoch's end
        x = device_augment(xtr[idx], 32, np.random.default_rng([a.seed, step]),
                           scale=(0.35, 1.0), mean=MEAN, std=STD)
        odd = step % 2 == 1
        if not odd or a.mode == "drop_path":  # rdp: odd iterations reuse the even one's masks
            masks = [(torch.rand(batch, generator=mask_rng) >= d).float() for d in model.drop]
        loss = F.cross_entropy(model(x, a.mode, masks, odd), ytr[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        if (step + 1) % 50 == 0:
            print(f"[{a.mode} s{a.seed}] step {step + 1} loss {np.mean(losses[-50:]):.4f} ({time.time() - t0:.0f}s)",
                  flush=True)
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(xte), 500):
            x = normalize(xte[i:i + 500], 32, MEAN, STD)
            correct += (model(x).argmax(1) == yte[i:i + 500]).sum().item()
    rec = {"mode": a.mode, "seed": a.seed, "steps": a.steps, "top1": correct / len(xte),
           "train_loss_last50": float(np.mean(losses[-50:])), "wall_s": time.time() - t0,
           "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
    out = Path(__file__).parent / f"semantics_{a.mode}_s{a.seed}.json"
    out.write_text(json.dumps(rec, indent=1) + "\n")
    print(json.dumps(rec))


if __name__ == "__main__":
    main()
