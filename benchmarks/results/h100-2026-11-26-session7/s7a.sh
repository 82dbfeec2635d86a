#!/usr/bin/env bash
# session 7 call A (one H100): trainer step profile (graphed and eager) and trainer rates for issue 14
set -u
R=$(pwd); export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8 TORCHINDUCTOR_COMPILE_THREADS=8
START=$(date +%s); END=$((START + ${WORK_S:-560}))
left() { echo $(( END - $(date +%s) - ${1:-10} )); }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } > $OUT/env.txt
cd $R/.snap && python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1 || echo install failed
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUT/env.txt; echo "commit $(cat COMMIT)" >> $OUT/env.txt
cat $OUT/env.txt
mkdir -p $OUT/prof $OUT/bench
cd $R/.snap
timeout 150 python3 -m benchmarks.profile_train --trainer mae_cifar10 --batch 1024 --steps 5 --trace --out $OUT/prof > $OUT/prof/graphed.log 2>&1; echo "prof graphed $?"
timeout 120 python3 -m benchmarks.profile_train --trainer mae_cifar10 --batch 1024 --steps 5 --set cuda_graphs=false --out $OUT/prof > $OUT/prof/eager.log 2>&1; echo "prof eager $?"
grep -A40 "^==" $OUT/prof/graphed.log | head -40; grep -A20 "^==" $OUT/prof/eager.log | head -20
t=$(left 200); [ $t -gt 60 ] && timeout $t python3 -m benchmarks.bench_train --trainer mae_cifar10 --batch 1024 --modes compile --dist none \
  --trainer-steps 400 --trainer-log-every 40 --out $OUT/bench > $OUT/bench/trainer_mae.log 2>&1
grep "^trainer" $OUT/bench/trainer_mae.log
t=$(left 120); [ $t -gt 60 ] && timeout $t python3 -m benchmarks.bench_train --trainer mae_vit_b16_in1k --batch 256 --modes compile \
  --dist none --set data.name=synthetic --trainer-steps 60 --trainer-log-every 10 --out $OUT/bench > $OUT/bench/vitb.log 2>&1
grep "^trainer" $OUT/bench/vitb.log
t=$(left 5); [ $t -gt 60 ] && timeout $t python3 -m benchmarks.bench_train --only mae --models timm,dres_official --modes compile \
  --batch 256 --steps 20 --no-flops --out $OUT/bench >> $OUT/bench/vitb.log 2>&1
tail -n 12 $OUT/bench/vitb.log
cd $OUT && tar czf prof.tgz prof && tar czf bench.tgz bench && rm -rf prof bench
