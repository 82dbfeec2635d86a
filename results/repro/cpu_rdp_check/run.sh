#!/usr/bin/env bash
# CPU check of ResidualDroppath vs none with AdamW and SGD (results/repro/notes.md, C): ViT dim 96, depth 6,
# CIFAR-10, 400 steps, batch 128. Usage: run.sh none|residual_droppath adamw|sgd; run folders in /tmp/rdp.
M=$1; O=$2; shift 2
COMMON="--set device=cpu --set compile=false --set steps=400 --set batch_size=128 --set model.embed_dim=96 --set model.depth=6 --set model.num_heads=3 --set optim.warmup_steps=40 --set log.every=50 --set log.progress=false --set log.tensorboard=false --set ckpt.every=0 --set data.gpu_resident=false"
if [ $O = sgd ]; then OPT="--set optim.name=sgd --set optim.lr=0.05 --set optim.momentum=0.9 --set optim.weight_decay=5e-4"; else OPT=""; fi
mkdir -p /tmp/rdp && cd "$(dirname "$0")/../../.." && python -m dres.train.cli classify --preset classify_cifar10 $COMMON $OPT --set model.droppath_mode=$M "$@" --out /tmp/rdp/${M}_$O > /tmp/rdp/${M}_$O.log 2>&1
grep -E "top1|done" /tmp/rdp/${M}_$O.log
