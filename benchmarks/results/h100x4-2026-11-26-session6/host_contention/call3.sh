#!/usr/bin/env bash
# x4: repro queues on all GPUs with per-process CPU threads capped; top snapshots to see host contention
set -u
R=$(pwd); export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP:-8} TORCHINDUCTOR_COMPILE_THREADS=${CT:-8}
START=$(date +%s); END=$((START + ${WORK_S:-540}))
cd $R/.snap && python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1 || echo install failed
mkdir -p /tmp/dres-records $OUT/diag
nproc > $OUT/diag/nproc.txt; cat /sys/fs/cgroup/cpu.max >> $OUT/diag/nproc.txt 2>/dev/null
( for t in 45 120 240 400; do sleep $((t - ($(date +%s) - START))); top -b -n1 -w 200 | head -40 > $OUT/diag/top_$t.txt; ps -eo pid,nlwp,pcpu,etime,args --sort=-pcpu | head -30 | cut -c1-220 > $OUT/diag/ps_$t.txt; done ) &
bash $R/.dev/q.sh 0 $END C-vit-none-s0:50 C-vit-drop_path-s0:50 &
bash $R/.dev/q.sh 1 $END C-resnet50d-none-s0:100 B-uvit-a1.0-s0:10 &
bash $R/.dev/q.sh 2 $END C-resnet50d-drop_path-s0:100 B-uvit-a0.7-s0:10 &
bash $R/.dev/q.sh 3 $END C-resnet50d-residual_droppath-s0:100 C-vit-residual_droppath-s0:50 &
wait
cd /tmp/dres-repro && tar czf $OUT/runs.tgz --exclude='checkpoints' --exclude='tb' --exclude='*.pt' . 2>/dev/null
cd /tmp/dres-records && tar czf $OUT/records.tgz .
cd $OUT && tar czf logs.tgz q*.log diag && rm -rf q*.log diag
ls /tmp/dres-records
for f in /tmp/dres-repro/*/metrics.jsonl; do echo $f $(tail -1 $f | cut -c1-160); done
