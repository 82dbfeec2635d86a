#!/usr/bin/env bash
# session 9, call 1 (2 x H100): the loader fix (.snap: a rank augments its share only) against .base on the ViT-B/16
# trainer (compile=true, graphed DDP, 2 GPUs); 1-GPU trainer beside residual_act's GPU tests; the graphed DDP step's
# profile (rank 0 trace); FSDP2 trainer on 2 GPUs if time is left
set -u
R=$(pwd); export OMP_NUM_THREADS=8 TORCHINDUCTOR_COMPILE_THREADS=8 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
START=$(date +%s); left() { echo $(( START + 565 - $(date +%s) )); }
inst() { (cd $R/$1 && python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1) || echo "install $1 failed"; }
mkdir -p $OUT/a; echo "base $(cat .base/COMMIT) new $(cat .snap/COMMIT)"; nvidia-smi --query-gpu=name --format=csv,noheader
TR="python3 -m benchmarks.bench_train --trainer mae_vit_b16_in1k --modes compile --batch 256 --trainer-steps 100 --trainer-log-every 10 --set data.name=synthetic --set data.synthetic_size=2048"
inst .snap; cd $R/.snap
( export CUDA_VISIBLE_DEVICES=0
  timeout 150 $TR --scaling 1 --dist ddp --out $OUT/a/t1_snap > $OUT/a/t1_snap.log 2>&1; grep "^trainer" $OUT/a/t1_snap.log ) > $OUT/a/gpu0.log 2>&1 &
( export CUDA_VISIBLE_DEVICES=1
  timeout 150 python3 -m pytest -v -p no:cacheprovider -p no:logging -m gpu tests/test_residual_act.py tests/test_ops.py -k "cached_launch or residual_act" \
    --timeout 120 -o addopts="" -rfE --tb=short > $OUT/a/gpu_tests.log 2>&1; echo "pytest exit $?"; grep -cE "PASSED" $OUT/a/gpu_tests.log; tail -n 3 $OUT/a/gpu_tests.log ) > $OUT/a/gpu1.log 2>&1 &
wait; cat $OUT/a/gpu0.log $OUT/a/gpu1.log; echo "+$(( $(date +%s) - START ))s"
timeout 150 $TR --scaling 2 --dist ddp --out $OUT/a/t2_snap > $OUT/a/t2_snap.log 2>&1; grep "^trainer" $OUT/a/t2_snap.log; echo "+$(( $(date +%s) - START ))s"
t=$(left); [ $t -gt 150 ] && t=150; [ $t -gt 80 ] && timeout --signal=INT --kill-after=30 $t python3 -m torch.distributed.run --standalone --nproc_per_node=2 \
  -m benchmarks.profile_train --trainer mae_vit_b16_in1k --set dist=ddp --set data.name=synthetic --set data.synthetic_size=2048 \
  --trace --out $OUT/a/prof2 > $OUT/a/prof2.log 2>&1; grep -A30 "^== " $OUT/a/prof2.log | head -40; echo "+$(( $(date +%s) - START ))s"
inst .base; cd $R/.base
t=$(left); [ $t -gt 150 ] && t=150; [ $t -gt 70 ] && timeout $t $TR --scaling 2 --dist ddp --out $OUT/a/t2_base > $OUT/a/t2_base.log 2>&1; grep "^trainer" $OUT/a/t2_base.log; echo "+$(( $(date +%s) - START ))s"
inst .snap; cd $R/.snap
t=$(left); [ $t -gt 80 ] && timeout $t $TR --scaling 2 --dist fsdp --out $OUT/a/t2_fsdp > $OUT/a/t2_fsdp.log 2>&1; grep "^trainer" $OUT/a/t2_fsdp.log
cd $OUT && tar czf a.tgz a && rm -rf a
