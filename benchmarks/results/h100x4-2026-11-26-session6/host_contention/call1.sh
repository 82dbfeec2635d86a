#!/usr/bin/env bash
# x4: GPU0 the GPU suite then issue-14 trainer benchmarks; GPUs 1-3 the repro queues
set -u
R=$(pwd); export PYTHONUNBUFFERED=1
START=$(date +%s); END=$((START + ${WORK_S:-560}))
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nvidia-smi topo -m; } > $OUT/env.txt
cd $R/.snap && python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1 || echo install failed
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUT/env.txt; echo "commit $(cat COMMIT)" >> $OUT/env.txt
mkdir -p /tmp/dres-records $OUT/bench
bash $R/.dev/q.sh 1 $END C-resnet50d-none-s0:100 C-vit-none-s0:50 B-uvit-a1.0-s0:10 &
bash $R/.dev/q.sh 2 $END C-resnet50d-drop_path-s0:100 C-vit-drop_path-s0:50 B-uvit-a0.7-s0:10 &
( bash $R/.dev/q.sh 3 $END C-resnet50d-residual_droppath-s0:100 C-vit-residual_droppath-s0:50
  export CUDA_VISIBLE_DEVICES=3; left=$(( END - $(date +%s) - 100 ))
  [ $left -gt 60 ] && timeout $left python3 -m benchmarks.bench_train --trainer mae_vit_b16_in1k --batch 256 --modes compile \
    --dist none --set data.name=synthetic --trainer-steps 60 --trainer-log-every 10 --out $OUT/bench3 > $OUT/bench3.log 2>&1
  left=$(( END - $(date +%s) - 10 ))
  [ $left -gt 60 ] && timeout $left python3 -m benchmarks.bench_train --only mae --models timm,dres_official --modes compile \
    --batch 256 --steps 20 --no-flops --out $OUT/bench3 >> $OUT/bench3.log 2>&1 ) &
export CUDA_VISIBLE_DEVICES=0
timeout 290 python3 -m pytest -q -p no:cacheprovider -p no:logging -m gpu tests --timeout 150 -o addopts="" -rfE \
  --tb=short --junitxml=$OUT/junit.xml > $OUT/gpu_tests.log 2>&1
tail -n 25 $OUT/gpu_tests.log
left=$(( END - $(date +%s) - 150 ))
[ $left -gt 60 ] && timeout $left python3 -m benchmarks.bench_train --trainer mae_cifar10 --batch 1024 --modes compile --dist none \
  --trainer-steps 400 --trainer-log-every 40 --out $OUT/bench > $OUT/bench/trainer_mae.log 2>&1
tail -n 3 $OUT/bench/trainer_mae.log
left=$(( END - $(date +%s) - 10 ))
[ $left -gt 60 ] && timeout $left python3 -m benchmarks.bench_train --trainer mae_cifar10 --batch 256 --modes compile --dist none \
  --trainer-steps 400 --trainer-log-every 40 --out $OUT/bench > $OUT/bench/trainer_mae256.log 2>&1
wait
cd /tmp/dres-repro && tar czf $OUT/runs.tgz --exclude='checkpoints' --exclude='tb' --exclude='*.pt' . 2>/dev/null
cd /tmp/dres-records && tar czf $OUT/records.tgz .
cd $OUT && tar czf logs.tgz q*.log bench* && rm -rf q*.log bench*
ls /tmp/dres-records
