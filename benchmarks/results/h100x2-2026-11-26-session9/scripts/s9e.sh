#!/usr/bin/env bash
# session 9, call 5 (2 x H100): where the graphed DDP step's remaining time goes, at .snap (bucket views): the trainer's
# step profiled on one GPU (GPU 0) and under DDP on both; beside the 1-GPU profile (GPU 1), FSDP2 on a one-GPU mesh vs
# unwrapped, eager dres_official at 256 and 512 images (is FSDP2's host cost hidden once the step is GPU-bound?)
set -u
R=$(pwd); export OMP_NUM_THREADS=8 TORCHINDUCTOR_COMPILE_THREADS=8 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
START=$(date +%s); left() { echo $(( START + 330 - $(date +%s) )); }
mkdir -p $OUT/e; echo "new $(cat .snap/COMMIT)"
cd .snap && python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1 || echo "install failed"
P="python3 -m benchmarks.profile_train --trainer mae_vit_b16_in1k --batch 256 --set data.name=synthetic --set data.synthetic_size=2048 --trace"
( CUDA_VISIBLE_DEVICES=0 timeout 110 $P --out $OUT/e/prof1 > $OUT/e/prof1.log 2>&1; grep -A18 "^== " $OUT/e/prof1.log ) > $OUT/e/gpu0.log 2>&1 &
( export CUDA_VISIBLE_DEVICES=1
  for b in 256 512; do timeout 55 python3 -m benchmarks.bench_train --only mae --models dres_official --modes eager --scaling 1 --dist none,fsdp \
    --batch $b --steps 15 --warmup 4 --no-flops --out $OUT/e/fsdp_b$b > $OUT/e/fsdp_b$b.log 2>&1; grep -E "img/s" $OUT/e/fsdp_b$b.log | tail -3; done ) > $OUT/e/gpu1.log 2>&1 &
wait; cat $OUT/e/gpu0.log $OUT/e/gpu1.log; echo "+$(( $(date +%s) - START ))s"
t=$(left); [ $t -gt 120 ] && t=120; [ $t -gt 60 ] && timeout --signal=INT --kill-after=20 $t python3 -m torch.distributed.run --standalone --nproc_per_node=2 \
  -m benchmarks.profile_train --trainer mae_vit_b16_in1k --batch 256 --set dist=ddp --set data.name=synthetic --set data.synthetic_size=2048 \
  --trace --out $OUT/e/prof2 > $OUT/e/prof2.log 2>&1; grep -A18 "^== " $OUT/e/prof2.log; echo "+$(( $(date +%s) - START ))s"
cd $OUT && tar czf e.tgz e && rm -rf e
