#!/usr/bin/env bash
# A queue of arms, and side jobs, that outlive the device calls of one machine hold. The GPU machines copy
# the working tree afresh at every call (a carried folder is deleted and copied again, an ignored one not
# carried is removed), which kills whatever runs from it; so everything runs from one copy under $HOLD, in
# the background. In the repository root on the GPU machine:
#   bash experiments/device_hold.sh start WORDS [GPUS] [COMMIT]   start the queue of arms
#   bash experiments/device_hold.sh job NAME COMMAND               start COMMAND (bash) beside it, in the copy,
#                                                                  with OUT=$HOLD/jobs/NAME (packed as jobs.tgz)
#   bash experiments/device_hold.sh wait SECONDS                   wait (until the queue and the jobs end, at most
#                                                                  SECONDS), then pack records and logs into $OUT
# The first start or job of a hold copies the tree and installs it. WORDS as for `python -m experiments.repro
# --run`; GPUS defaults to every GPU; COMMIT is the commit the tree was copied from (`git rev-parse HEAD` here).
# DEADLINE_MIN=N starts no arm after N minutes of the queue. CUDA_VISIBLE_DEVICES given to start or job keeps
# the queue and a job on their own GPUs. Every call of a hold after the first is `wait`, issued as soon as the
# previous call returns.
set -uo pipefail
HOLD=${HOLD:-/tmp/dres-hold}
OUT=${OUT:-./device_out}
usage() {
  echo "usage: bash experiments/device_hold.sh start WORDS [GPUS] [COMMIT] | job NAME COMMAND | wait SECONDS" >&2
  exit 2
}

# the hold's copy of the tree, made and installed once
hold_tree() {
  [ -d "$HOLD/tree" ] && return 0
  mkdir -p "$HOLD/records" "$HOLD/jobs" && cp -r . "$HOLD/tree" || return 1
  (cd "$HOLD/tree" && python3 -m pip install -q --no-deps --no-build-isolation -e .) >"$HOLD/install.log" 2>&1 \
    || { echo "install failed"; tail -n 20 "$HOLD/install.log"; return 1; }
}

running() {
  local pid_file
  [ -f "$HOLD/repro.pid" ] && kill -0 "$(cat "$HOLD/repro.pid")" 2>/dev/null && return 0
  for pid_file in "$HOLD"/jobs/*.pid; do
    [ -f "$pid_file" ] && [ ! -f "${pid_file%.pid}.rc" ] && kill -0 "$(cat "$pid_file")" 2>/dev/null && return 0
  done
  return 1
}

case "${1:-}" in
start)
  [ $# -ge 2 ] && [ -n "$2" ] || usage
  words=$2
  gpus=${3:-$(nvidia-smi -L 2>/dev/null | wc -l)}
  commit=${4:-unknown}
  [[ "$gpus" =~ ^[0-9]+$ ]] || { echo "device_hold.sh: GPUS must be a number, got '$gpus'" >&2; exit 2; }
  [ -f "$HOLD/repro.pid" ] && { echo "device_hold.sh: a queue was already started on this machine ($HOLD)" >&2; exit 2; }
  hold_tree || exit 1
  cd "$HOLD/tree" || exit 1
  setsid nohup python3 -m experiments.repro --run "$words" --gpus "$gpus" --root "$HOLD/runs" \
    --records "$HOLD/records" --commit "$commit" ${DEADLINE_MIN:+--deadline-min "$DEADLINE_MIN"} \
    >"$HOLD/repro.log" 2>&1 </dev/null &
  echo $! >"$HOLD/repro.pid"
  sleep 20
  tail -n 5 "$HOLD/repro.log"
  ;;
job)
  [ $# -eq 3 ] && [[ "$2" =~ ^[A-Za-z0-9_.-]+$ ]] && [ -n "$3" ] || usage
  [ -e "$HOLD/jobs/$2.pid" ] && { echo "device_hold.sh: job $2 was already started on this machine" >&2; exit 2; }
  hold_tree || exit 1
  mkdir -p "$HOLD/jobs/$2"
  # the job's shell writes its own pid (what started it may fork away) and, at the end, NAME.rc
  cd "$HOLD/tree" || exit 1
  OUT="$HOLD/jobs/$2" setsid nohup bash -c 'echo $$ >"$3"; bash -c "$1"; echo $? >"$2"' job "$3" \
    "$HOLD/jobs/$2.rc" "$HOLD/jobs/$2.pid" >"$HOLD/jobs/$2.log" 2>&1 </dev/null &
  for _ in 1 2 3 4 5 6 7 8 9 10; do [ -s "$HOLD/jobs/$2.pid" ] && break; sleep 0.2; done
  echo "job $2 started: $3"
  ;;
wait)
  [[ "${2:-}" =~ ^[0-9]+$ ]] || usage
  [ -f "$HOLD/repro.pid" ] || compgen -G "$HOLD/jobs/*.pid" >/dev/null \
    || { echo "device_hold.sh: no queue or job was started on this machine ($HOLD)" >&2; exit 2; }
  end=$((SECONDS + $2))
  while [ $SECONDS -lt $end ] && running; do sleep 10; done
  date -u
  nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader 2>/dev/null
  mkdir -p "$OUT"
  if [ -f "$HOLD/repro.pid" ]; then
    grep -E "^\[repro\] (start|resume|done|FAILED|skip)" "$HOLD/repro.log" | tail -n 30
    tar czf "$OUT/records.tgz" --exclude=features -C "$HOLD" records
    # each arm's kept features (~15 MB) in a file of its own: one file brought back stays under 16 MiB
    for f in "$HOLD"/records/features/*.pt; do [ -f "$f" ] && cp "$f" "$OUT/features-$(basename "$f")"; done
    # the run folders without their checkpoints: logs, metrics and curves of finished and unfinished arms
    tar czf "$OUT/runs.tgz" --exclude=checkpoints -C "$HOLD" repro.log runs 2>/dev/null
  fi
  for pid_file in "$HOLD"/jobs/*.pid; do
    [ -f "$pid_file" ] || continue
    name=$(basename "$pid_file" .pid)
    state="running"; [ -f "$HOLD/jobs/$name.rc" ] && state="exit $(cat "$HOLD/jobs/$name.rc")"
    echo "job $name: $state; last lines:"; tail -n 4 "$HOLD/jobs/$name.log"
  done
  [ -d "$HOLD/jobs" ] && tar czf "$OUT/jobs.tgz" -C "$HOLD" jobs
  ls -la "$OUT"
  ;;
*)
  usage
  ;;
esac
