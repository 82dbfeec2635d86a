#!/usr/bin/env bash
# session 9, call 6 (one H100): FSDP2 on a one-GPU mesh against the unwrapped model, dres_official and timm, eager, at
# 256 and 512 images (issue 15 target 1: FSDP2's host cost against a host-bound or a GPU-bound step), then compiled at 512
set -u
export OMP_NUM_THREADS=8 TORCHINDUCTOR_COMPILE_THREADS=8 PYTHONUNBUFFERED=1
START=$(date +%s); left() { echo $(( START + 380 - $(date +%s) )); }
mkdir -p $OUT/f; echo "new $(cat .snap/COMMIT)"
cd .snap && python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1 || echo "install failed"
for b in 512 256; do
  t=$(left); [ $t -gt 110 ] && t=110; [ $t -gt 40 ] && timeout $t python3 -m benchmarks.bench_train --only mae --models dres_official,timm --modes eager --scaling 1 --dist none,fsdp \
    --batch $b --steps 25 --warmup 5 --no-flops --out $OUT/f/eager_b$b > $OUT/f/eager_b$b.log 2>&1; grep -E "img/s" $OUT/f/eager_b$b.log | grep -v "^|"; echo "+$(( $(date +%s) - START ))s"
done
t=$(left); [ $t -gt 40 ] && timeout $t python3 -m benchmarks.bench_train --only mae --models dres_official --modes compile --scaling 1 --dist none,fsdp \
  --batch 512 --steps 20 --warmup 5 --no-flops --out $OUT/f/compile_b512 > $OUT/f/compile_b512.log 2>&1; grep -E "img/s" $OUT/f/compile_b512.log | grep -v "^|"; echo "+$(( $(date +%s) - START ))s"
cd $OUT && tar czf f.tgz f && rm -rf f
