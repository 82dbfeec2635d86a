#!/usr/bin/env bash
# session 9, call 3 (2 x H100): DDP with gradients as bucket views in the trainer (.snap) against .base (the copy back
# of every gradient after the backward, 0.86 ms/step in call 2's trace): ViT-B/16 trainer graphed DDP on 2 GPUs, both
# commits; 1-GPU trainer; the 2-GPU captured-DDP test (graphed vs eager DDP steps) at .snap
set -u
R=$(pwd); export OMP_NUM_THREADS=8 TORCHINDUCTOR_COMPILE_THREADS=8 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
START=$(date +%s); left() { echo $(( START + 565 - $(date +%s) )); }
inst() { (cd $R/$1 && python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1) || echo "install $1 failed"; }
mkdir -p $OUT/c; echo "base $(cat .base/COMMIT) new $(cat .snap/COMMIT)"
TR="python3 -m benchmarks.bench_train --trainer mae_vit_b16_in1k --modes compile --batch 256 --trainer-steps 100 --trainer-log-every 10 --set data.name=synthetic --set data.synthetic_size=2048"
for v in snap base snap; do
  inst .$v; cd $R/.$v
  timeout 120 $TR --scaling 2 --dist ddp --out $OUT/c/t2_$v > $OUT/c/t2_$v.log 2>&1; echo "== $v"; grep "^trainer" $OUT/c/t2_$v.log; echo "+$(( $(date +%s) - START ))s"
  [ $v = base ] && { t=$(left); [ $t -gt 120 ] && t=120; timeout $t $TR --scaling 1 --dist ddp --out $OUT/c/t1 > $OUT/c/t1.log 2>&1; grep "^trainer" $OUT/c/t1.log; }
done
t=$(left); [ $t -gt 150 ] && t=150; [ $t -gt 60 ] && timeout $t python3 -m pytest -v -p no:cacheprovider -p no:logging -m gpu tests/test_graph_step.py -k ddp \
  -o addopts="" -rfE --tb=short > $OUT/c/ddp_graph_test.log 2>&1; echo "pytest exit $?"; tail -n 4 $OUT/c/ddp_graph_test.log
cd $OUT && tar czf c.tgz c && rm -rf c
