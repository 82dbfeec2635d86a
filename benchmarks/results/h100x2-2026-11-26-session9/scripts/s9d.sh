#!/usr/bin/env bash
# session 9, call 4 (2 x H100): NCCL's Simple protocol against its default choice (RING_LL in call 2's trace) for the
# graphed DDP step's all-reduces, ViT-B/16 trainer on 2 GPUs at .snap; the 1-GPU trainer for the scaling
set -u
R=$(pwd); export OMP_NUM_THREADS=8 TORCHINDUCTOR_COMPILE_THREADS=8 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
START=$(date +%s)
mkdir -p $OUT/d; echo "new $(cat .snap/COMMIT)"
cd .snap && python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1 || echo "install failed"
TR="python3 -m benchmarks.bench_train --trainer mae_vit_b16_in1k --modes compile --batch 256 --trainer-steps 100 --trainer-log-every 10 --set data.name=synthetic --set data.synthetic_size=2048"
timeout 120 $TR --scaling 2 --dist ddp --out $OUT/d/t2 > $OUT/d/t2.log 2>&1; echo "== default"; grep "^trainer" $OUT/d/t2.log; echo "+$(( $(date +%s) - START ))s"
NCCL_PROTO=Simple timeout 120 $TR --scaling 2 --dist ddp --out $OUT/d/t2_simple > $OUT/d/t2_simple.log 2>&1; echo "== NCCL_PROTO=Simple"; grep "^trainer" $OUT/d/t2_simple.log; echo "+$(( $(date +%s) - START ))s"
timeout 120 $TR --scaling 1 --dist ddp --out $OUT/d/t1 > $OUT/d/t1.log 2>&1; grep "^trainer" $OUT/d/t1.log; echo "+$(( $(date +%s) - START ))s"
cd $OUT && tar czf d.tgz d && rm -rf d
