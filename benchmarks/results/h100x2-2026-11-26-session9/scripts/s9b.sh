#!/usr/bin/env bash
# session 9, call 2 (2 x H100): the graphed DDP step's profile (rank 0 trace, 2 GPUs); the ViT-B/16 trainer (compile=true,
# graphed DDP) on 2 GPUs with NCCL's default channels, at most 8 and at most 4 (SMs NCCL takes from the overlapped
# backward); the 1-GPU trainer for the scaling, all in this call
set -u
R=$(pwd); export OMP_NUM_THREADS=8 TORCHINDUCTOR_COMPILE_THREADS=8 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
START=$(date +%s); left() { echo $(( START + 565 - $(date +%s) )); }
mkdir -p $OUT/b; echo "new $(cat .snap/COMMIT)"
cd .snap && python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1 || echo "install failed"
TR="python3 -m benchmarks.bench_train --trainer mae_vit_b16_in1k --modes compile --batch 256 --trainer-steps 100 --trainer-log-every 10 --set data.name=synthetic --set data.synthetic_size=2048"
timeout --signal=INT --kill-after=30 150 python3 -m torch.distributed.run --standalone --nproc_per_node=2 \
  -m benchmarks.profile_train --trainer mae_vit_b16_in1k --batch 256 --set dist=ddp --set data.name=synthetic --set data.synthetic_size=2048 \
  --trace --out $OUT/b/prof2 > $OUT/b/prof2.log 2>&1; grep -A40 "^== " $OUT/b/prof2.log | head -45; echo "+$(( $(date +%s) - START ))s"
timeout 120 $TR --scaling 2 --dist ddp --out $OUT/b/t2 > $OUT/b/t2.log 2>&1; grep "^trainer" $OUT/b/t2.log; echo "+$(( $(date +%s) - START ))s"
for c in 8 4; do
  t=$(left); [ $t -gt 120 ] && t=120; [ $t -gt 70 ] && NCCL_MAX_NCHANNELS=$c timeout $t $TR --scaling 2 --dist ddp --out $OUT/b/t2_ch$c > $OUT/b/t2_ch$c.log 2>&1
  echo "NCCL_MAX_NCHANNELS=$c"; grep "^trainer" $OUT/b/t2_ch$c.log; echo "+$(( $(date +%s) - START ))s"
done
t=$(left); [ $t -gt 120 ] && t=120; [ $t -gt 70 ] && timeout $t $TR --scaling 1 --dist ddp --out $OUT/b/t1 > $OUT/b/t1.log 2>&1; grep "^trainer" $OUT/b/t1.log
cd $OUT && tar czf b.tgz b && rm -rf b
