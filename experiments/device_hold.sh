#!/usr/bin/env bash
# A queue of arms that outlives the device calls of one machine hold. The GPU machines copy the working
# tree afresh at every call (a carried folder is deleted and copied again, an ignored one not carried is
# removed), which kills whatever runs from it; so the queue runs from a copy under $HOLD, in the background.
# In the repository root on the GPU machine:
#   bash experiments/device_hold.sh start WORDS [GPUS] [COMMIT]   copy the tree, install it, start the queue
#   bash experiments/device_hold.sh wait SECONDS                   wait (until the queue ends, at most SECONDS),
#                                                                  then pack records and logs into $OUT
# WORDS as for `python -m experiments.repro --run`; GPUS defaults to every GPU; COMMIT is the commit the tree
# was copied from (`git rev-parse HEAD` here). DEADLINE_MIN=N starts no arm after N minutes of the queue.
# Every call of a hold after the first is `wait`, issued as soon as the previous call returns.
set -uo pipefail
HOLD=${HOLD:-/tmp/dres-hold}
OUT=${OUT:-./device_out}
usage() { echo "usage: bash experiments/device_hold.sh start WORDS [GPUS] [COMMIT] | wait SECONDS" >&2; exit 2; }

case "${1:-}" in
start)
  [ $# -ge 2 ] && [ -n "$2" ] || usage
  words=$2
  gpus=${3:-$(nvidia-smi -L 2>/dev/null | wc -l)}
  commit=${4:-unknown}
  [[ "$gpus" =~ ^[0-9]+$ ]] || { echo "device_hold.sh: GPUS must be a number, got '$gpus'" >&2; exit 2; }
  rm -rf "$HOLD/tree" && mkdir -p "$HOLD/records" && cp -r . "$HOLD/tree" || exit 1
  cd "$HOLD/tree" || exit 1
  python3 -m pip install -q --no-deps --no-build-isolation -e . >"$HOLD/install.log" 2>&1 \
    || { echo "install failed"; tail -n 20 "$HOLD/install.log"; exit 1; }
  setsid nohup python3 -m experiments.repro --run "$words" --gpus "$gpus" --root "$HOLD/runs" \
    --records "$HOLD/records" --commit "$commit" ${DEADLINE_MIN:+--deadline-min "$DEADLINE_MIN"} \
    >"$HOLD/repro.log" 2>&1 </dev/null &
  echo $! >"$HOLD/repro.pid"
  sleep 20
  tail -n 5 "$HOLD/repro.log"
  ;;
wait)
  [[ "${2:-}" =~ ^[0-9]+$ ]] || usage
  [ -f "$HOLD/repro.pid" ] || { echo "device_hold.sh: no queue was started on this machine ($HOLD)" >&2; exit 2; }
  end=$((SECONDS + $2))
  while [ $SECONDS -lt $end ] && kill -0 "$(cat "$HOLD/repro.pid")" 2>/dev/null; do sleep 10; done
  date -u
  nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader 2>/dev/null
  grep -E "^\[repro\] (start|resume|done|FAILED|skip)" "$HOLD/repro.log" | tail -n 30
  mkdir -p "$OUT"
  tar czf "$OUT/records.tgz" -C "$HOLD" records
  # the run folders without their checkpoints: logs, metrics and curves of finished and unfinished arms
  tar czf "$OUT/runs.tgz" --exclude=checkpoints -C "$HOLD" repro.log runs 2>/dev/null
  ls -la "$OUT"
  ;;
*)
  usage
  ;;
esac
