#!/usr/bin/env bash
# A background queue of experiment arms on a GPU host, with jobs beside it, that outlives the shell that started
# it. Everything runs from a private copy of the tree under $QUEUE_DIR, made and installed by the first start or
# job, with the run folders and records there too; the processes run under setsid and nohup, so the starting
# shell can end, and the checkout it came from can change or go, while they run. In the repository root:
#   bash experiments/queue.sh start WORDS [GPUS] [COMMIT]   start the queue: python -m experiments.repro --run WORDS
#                                                           on GPUS GPUs (default every GPU) for commit COMMIT;
#                                                           GPUS a count (the first N GPUs) or a list of GPU
#                                                           indices, 2,3 (then CUDA_VISIBLE_DEVICES=2,3)
#   bash experiments/queue.sh job NAME COMMAND              start COMMAND (bash) beside it, in the copy, with
#                                                           OUT=$QUEUE_DIR/jobs/NAME
#   bash experiments/queue.sh wait SECONDS                  wait until the queue and the jobs end (at most SECONDS),
#                                                           then pack what they made into $OUT; exit 3 (and say
#                                                           which arms and jobs) when some still run: the pack
#                                                           is partial, wait again before the host goes
# CUDA_VISIBLE_DEVICES given to start or job keeps the queue and a job on their own GPUs; DEADLINE_MIN=N starts no
# arm after N minutes of the queue; FORCE=1 trains again the arms that already have a record; JOBS=N runs N arms
# at a time on each GPU; MPS=1 (with start) first starts NVIDIA's MPS daemon, through which every CUDA process on
# the host then runs, so that arms sharing a GPU run their kernels side by side instead of taking turns (a small
# graphed model leaves most of an H200's multiprocessors idle), and refuses to start the queue when no CUDA
# context opens through it. COMMIT is recorded in every record (the copy may hold no git history). DRY_RUN=1 (with
# start) prints what the queue would run, each arm's command, minutes and the devices, from this tree, and starts
# nothing.
# Limits: one queue a host (a second start is refused; a job name once); the copy is taken once, so later changes
# of the checkout do not reach a running queue; run folders and their checkpoints live on this host only, and an arm
# cut short resumes from its last checkpoint when a queue naming it starts again on the same host. What `wait`
# packs stays within eight files of at most 16 MiB: records.tgz (the records with their kept features, about 1.5 MB
# an arm), runs.tgz (the queue's log and every run folder without
# its checkpoints) and jobs.tgz (each job's OUT, log and exit status).
set -uo pipefail
QUEUE_DIR=${QUEUE_DIR:-/tmp/dres-queue}
OUT=${OUT:-./queue_out}
usage() {
  echo "usage: bash experiments/queue.sh start WORDS [GPUS] [COMMIT] | job NAME COMMAND | wait SECONDS" >&2
  exit 2
}

# the queue's copy of the tree, made and installed once
queue_tree() {
  [ -d "$QUEUE_DIR/tree" ] && return 0
  mkdir -p "$QUEUE_DIR/records" "$QUEUE_DIR/jobs" && cp -r . "$QUEUE_DIR/tree" || return 1
  (cd "$QUEUE_DIR/tree" && python3 -m pip install -q --no-deps --no-build-isolation -e .) >"$QUEUE_DIR/install.log" 2>&1 \
    || { echo "install failed"; tail -n 20 "$QUEUE_DIR/install.log"; return 1; }
}

# NVIDIA's MPS daemon, started once a host and checked by opening a CUDA context through it
start_mps() {
  local pipe=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}
  [ -S "$pipe/control" ] || [ -p "$pipe/control" ] && return 0
  command -v nvidia-cuda-mps-control >/dev/null || { echo "queue.sh: MPS=1: nvidia-cuda-mps-control is not on PATH" >&2; return 1; }
  nvidia-cuda-mps-control -d || { echo "queue.sh: MPS=1: nvidia-cuda-mps-control -d failed" >&2; return 1; }
  python3 -c "import torch; torch.ones(1, device='cuda').sum().item()" >"$QUEUE_DIR/mps_check.log" 2>&1 && return 0
  echo quit | nvidia-cuda-mps-control
  echo "queue.sh: MPS=1: no CUDA context opened through the MPS daemon (stopped again): $(tail -n 1 "$QUEUE_DIR/mps_check.log")" >&2
  return 1
}

running() {
  local pid_file
  [ -f "$QUEUE_DIR/repro.pid" ] && kill -0 "$(cat "$QUEUE_DIR/repro.pid")" 2>/dev/null && return 0
  for pid_file in "$QUEUE_DIR"/jobs/*.pid; do
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
  if [[ "$gpus" =~ ^[0-9]+(,[0-9]+)+$ ]]; then  # GPU indices: the runner's slots map through CUDA_VISIBLE_DEVICES
    [ -z "${CUDA_VISIBLE_DEVICES:-}" ] \
      || { echo "queue.sh: GPUS $gpus and CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES: give the GPUs one way" >&2; exit 2; }
    export CUDA_VISIBLE_DEVICES=$gpus
    gpus=$(tr ',' '\n' <<<"$gpus" | wc -l)
  fi
  [[ "$gpus" =~ ^[0-9]+$ ]] || { echo "queue.sh: GPUS must be a number or a list of GPU indices, got '$gpus'" >&2; exit 2; }
  [[ "${JOBS:-1}" =~ ^[1-9][0-9]*$ ]] || { echo "queue.sh: JOBS must be a positive number, got '$JOBS'" >&2; exit 2; }
  if [ -n "${DRY_RUN:-}" ]; then
    exec python3 -m experiments.repro --run "$words" --gpus "$gpus" --jobs "${JOBS:-1}" --root "$QUEUE_DIR/runs" \
      --records "$QUEUE_DIR/records" --dry-run ${FORCE:+--force}
  fi
  [ -f "$QUEUE_DIR/repro.pid" ] && { echo "queue.sh: a queue was already started on this host ($QUEUE_DIR)" >&2; exit 2; }
  queue_tree || exit 1
  if [ -n "${MPS:-}" ]; then start_mps || exit 1; fi
  cd "$QUEUE_DIR/tree" || exit 1
  setsid nohup python3 -m experiments.repro --run "$words" --gpus "$gpus" --jobs "${JOBS:-1}" --root "$QUEUE_DIR/runs" \
    --records "$QUEUE_DIR/records" --commit "$commit" ${DEADLINE_MIN:+--deadline-min "$DEADLINE_MIN"} \
    ${FORCE:+--force} >"$QUEUE_DIR/repro.log" 2>&1 </dev/null &
  echo $! >"$QUEUE_DIR/repro.pid"
  sleep 20
  tail -n 5 "$QUEUE_DIR/repro.log"
  ;;
job)
  [ $# -eq 3 ] && [[ "$2" =~ ^[A-Za-z0-9_.-]+$ ]] && [ -n "$3" ] || usage
  [ -e "$QUEUE_DIR/jobs/$2.pid" ] && { echo "queue.sh: job $2 was already started on this host" >&2; exit 2; }
  queue_tree || exit 1
  mkdir -p "$QUEUE_DIR/jobs/$2"
  # the job's shell writes its own pid (what started it may fork away) and, at the end, NAME.rc
  cd "$QUEUE_DIR/tree" || exit 1
  OUT="$QUEUE_DIR/jobs/$2" setsid nohup bash -c 'echo $$ >"$3"; bash -c "$1"; echo $? >"$2"' job "$3" \
    "$QUEUE_DIR/jobs/$2.rc" "$QUEUE_DIR/jobs/$2.pid" >"$QUEUE_DIR/jobs/$2.log" 2>&1 </dev/null &
  for _ in 1 2 3 4 5 6 7 8 9 10; do [ -s "$QUEUE_DIR/jobs/$2.pid" ] && break; sleep 0.2; done
  echo "job $2 started: $3"
  ;;
wait)
  [[ "${2:-}" =~ ^[0-9]+$ ]] || usage
  [ -f "$QUEUE_DIR/repro.pid" ] || compgen -G "$QUEUE_DIR/jobs/*.pid" >/dev/null \
    || { echo "queue.sh: no queue or job was started on this host ($QUEUE_DIR)" >&2; exit 2; }
  end=$((SECONDS + $2))
  while [ $SECONDS -lt $end ] && running; do sleep 10; done
  date -u
  nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader 2>/dev/null
  mkdir -p "$OUT"
  if [ -f "$QUEUE_DIR/repro.pid" ]; then
    grep -E "^\[repro\] (start|resume|done|FAILED|skip)" "$QUEUE_DIR/repro.log" | tail -n 30
    tar czf "$OUT/records.tgz" -C "$QUEUE_DIR" records
    # the run folders without their checkpoints: logs, metrics and curves of finished and unfinished arms
    tar czf "$OUT/runs.tgz" --exclude=checkpoints --exclude=features.pt -C "$QUEUE_DIR" repro.log runs 2>/dev/null
  fi
  for pid_file in "$QUEUE_DIR"/jobs/*.pid; do
    [ -f "$pid_file" ] || continue
    name=$(basename "$pid_file" .pid)
    state="running"; [ -f "$QUEUE_DIR/jobs/$name.rc" ] && state="exit $(cat "$QUEUE_DIR/jobs/$name.rc")"
    echo "job $name: $state; last lines:"; tail -n 4 "$QUEUE_DIR/jobs/$name.log"
  done
  [ -d "$QUEUE_DIR/jobs" ] && tar czf "$OUT/jobs.tgz" -C "$QUEUE_DIR" jobs
  ls -la "$OUT"
  if running; then
    # the arms started and not ended, by the runner's log; the packed run folders hold them part-way
    unfinished=$(awk '/^\[repro\] (start|resume) /{sub(":", "", $3); open[$3]=1}
                      /^\[repro\] (done|FAILED) /{sub(":", "", $3); delete open[$3]}
                      END {for (a in open) printf "%s ", a}' "$QUEUE_DIR/repro.log" 2>/dev/null)
    echo "queue.sh: still running after $2 s (arms ${unfinished:-none}; jobs without an exit status count too):" \
      "what is packed is partial, wait again before the host goes" >&2
    exit 3
  fi
  ;;
*)
  usage
  ;;
esac
