#!/usr/bin/env bash
# q.sh GPU END "ARM:EPOCHS" ...: repro arms one after another on one GPU until epoch-second END
set -u
G=$1; END=$2; shift 2
cd /work/snap 2>/dev/null || cd "$(dirname "$0")/../.snap"
for spec in "$@"; do
  arm=${spec%%:*}; ep=${spec##*:}
  if [[ $arm == B-* ]]; then  # B reads C-vit-none-s0's run dir: wait for its record
    while [ ! -f /tmp/dres-records/C-vit-none-s0.json ] && [ $(date +%s) -lt $END ]; do sleep 5; done
  fi
  left=$(( END - $(date +%s) )); [ $left -lt 30 ] && break
  CUDA_VISIBLE_DEVICES=$G timeout --signal=INT --kill-after=10 $left python3 -m benchmarks.repro --run $arm --epochs $ep --gpus 1 \
    --root /tmp/dres-repro --records /tmp/dres-records --commit $(cat COMMIT) >> $OUT/q$G.log 2>&1
done
