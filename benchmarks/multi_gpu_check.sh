#!/usr/bin/env bash
# One command on a machine of several GPUs: install, then in priority order
#   candidates  bench_train --scaling, eager, official MAE ViT-B/16 and the timm-style baseline on 1, 2, 4
#               GPUs: each candidate wrapping (CANDIDATES) against DDP; plain "fsdp" is the trainer's
#               default (reshard auto, 4 blocks a unit), fsdp:auto:1 its former one (a unit per block)
#   profile     one GPU, eager: no FSDP2, FSDP2 with a unit per block and the trainer's default (top CPU
#               ops, top kernels, GPU idle, Chrome traces)
#   ddp_profile DDP and DDP with gradients as bucket views on the most GPUs, under torchrun (traces)
#   ddp_graph_test  the two-GPU test of the captured DDP step against eager DDP (tests/test_step.py)
#   trainer     torchrun -m dres.train.mae --preset mae_vit_b16_in1k, synthetic data, eager, 256 images/GPU,
#               dist none|ddp, DDP eager (ddp:eager) and with the whole step captured (ddp, the default) and fsdp on
#               TRAINER_SCALING GPUs, steady-state img/s
#   trainer_profile  the trainer's own step as the preset runs it (compile=true, the graphed step), on one GPU
#               and under DDP on the most GPUs (profile_train --trainer, Chrome traces)
#   compile     bench_train --scaling, blocks compiled one by one (on 1 and the most GPUs unless
#               COMPILE_SCALING says), DDP and the trainer's FSDP2
#   memory      (only when named in STAGES) the largest batch per GPU that trains on the most GPUs: the eager
#               trainer of each MEMORY_PRESETS (default MAE ViT-L/16 and ViT-H/14), synthetic data, under DDP,
#               and FSDP2 at MEMORY_BATCHES (default 128,256,512,768), DDP with activation checkpointing
#               (act_ckpt=full) at MEMORY_CKPT_BATCHES (default 1024,2048,3072), ascending until one fails
# Each stage gets at most its own cap and what is left of BUDGET_S (default 530 s), and is skipped when
# too little is left; the tools write after every measurement, so a stage cut short keeps what it
# measured (SIGINT: torchrun stops its workers). Under $OUT (at
# most 8 files come back): summary.md (every table), log.txt, train.json, profile.json,
# traces.tar.gz, env.txt. Usage (repository root):
#   bash benchmarks/multi_gpu_check.sh                      # all stages
#   STAGES="trainer compile" bash benchmarks/multi_gpu_check.sh   # a second call on a warm machine
# DRY_RUN=1 prints the commands without running them (no GPU needed).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./device_out}
STAGES=${STAGES:-candidates profile ddp_profile ddp_graph_test trainer trainer_profile compile}
BUDGET_S=${BUDGET_S:-530}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
START=$(date +%s)
# seconds since START; a dry run's clock stands still (it runs nothing), so its plan does not depend on timing
elapsed() { [ -n "${DRY_RUN:-}" ] && echo 0 || echo $(( $(date +%s) - START )); }
if [ -n "${DRY_RUN:-}" ]; then
  NGPU=${NGPU:-4} STAGE_DIR='$STAGE_DIR' LOG=/dev/null
else
  NGPU=${NGPU:-$(nvidia-smi -L 2>/dev/null | wc -l)}
  STAGE_DIR=$(mktemp -d /tmp/dres-multi-gpu.XXXXXX)  # everything the tools write; packed into $OUT at the end
  mkdir -p "$OUT"
  LOG="$OUT/log.txt"
  : >"$LOG"
fi
WORLDS=$(for w in 1 2 4 8; do [ "$w" -le "$NGPU" ] && echo -n "$w,"; done)
WORLDS=${WORLDS%,}
MAXW=${WORLDS##*,}
COMPILE_SCALING=${COMPILE_SCALING:-$( [ "$MAXW" = 1 ] && echo 1 || echo "1,$MAXW" )}
TRAINER_SCALING=${TRAINER_SCALING:-$( [ "$MAXW" = 1 ] && echo 1 || echo "1,$MAXW" )}
MODELS=${MODELS:-dres_official,timm}
PROFILE_MODELS=${PROFILE_MODELS:-dres_official}
CANDIDATES=${CANDIDATES:-ddp,fsdp,fsdp:auto:1,fsdp:never:4,fsdp:auto:8}

want() { [[ " $STAGES " == *" $1 "* ]]; }
say() { echo "[multi_gpu_check +$(elapsed)s] $*" | tee -a "$LOG"; }
# stage NAME MIN_S MAX_S CMD...: run CMD for at most MAX_S seconds and what is left of the budget (less
# the grace for torchrun to stop its workers), if at least MIN_S are left
GRACE_S=40
status=0
stage() {
  local name=$1 min=$2 max=$3
  shift 3
  want "$name" || return 0
  local left=$(( BUDGET_S - GRACE_S - $(elapsed) ))
  [ "$left" -gt "$max" ] && left=$max
  if [ "$left" -lt "$min" ]; then
    say "SKIPPED $name: ${left}s left, needs ${min}s (run it again with STAGES=$name)"
    return 0
  fi
  say "stage $name (up to ${left}s): $*"
  [ -n "${DRY_RUN:-}" ] && return 0
  timeout --signal=INT --kill-after=$GRACE_S "$left" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { say "stage $name ended with status $rc"; status=1; }
}

if [ -z "${DRY_RUN:-}" ]; then
  {
    date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    nvidia-smi topo -m
    python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda)'
  } >"$OUT/env.txt" 2>&1
  cat "$OUT/env.txt" | tee -a "$LOG"
  python3 -m pip install -q --no-deps --no-build-isolation -e . >>"$LOG" 2>&1 || { say "install failed"; exit 1; }
fi
say "GPUs: $NGPU; worlds $WORLDS; compile on $COMPILE_SCALING; stages: $STAGES"

stage candidates 90 230 python3 -m benchmarks.bench_train --only mae --models "$MODELS" --modes eager \
  --scaling "$WORLDS" --dist "$CANDIDATES" --steps 20 --warmup 3 --out "$STAGE_DIR"
stage profile 45 80 python3 -m benchmarks.profile_train --bench mae --models "$PROFILE_MODELS" --mode eager \
  --dist none,fsdp:auto:1,fsdp --steps 3 --warmup 4 --trace --out "$STAGE_DIR"
[ "$MAXW" -gt 1 ] && stage ddp_profile 45 60 python3 -m torch.distributed.run --standalone --nproc_per_node="$MAXW" \
  -m benchmarks.profile_train --bench mae --models "$PROFILE_MODELS" --mode eager --dist ddp,ddp:bucket_view \
  --steps 3 --warmup 4 --trace --out "$STAGE_DIR"
[ "$MAXW" -gt 1 ] && stage ddp_graph_test 30 120 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu \
  tests/test_step.py -k ddp -rfE
stage trainer 90 180 python3 -m benchmarks.bench_train --trainer mae_vit_b16_in1k --scaling "$TRAINER_SCALING" \
  --dist ddp:eager,ddp,fsdp --modes eager --batch 256 --trainer-steps 60 --trainer-log-every 10 \
  --set data.name=synthetic --set data.synthetic_size=2048 --out "$STAGE_DIR"
stage trainer_profile 90 150 python3 -m benchmarks.profile_train --trainer mae_vit_b16_in1k --batch 256 --set data.name=synthetic \
  --set data.synthetic_size=2048 --trace --out "$STAGE_DIR"
[ "$MAXW" -gt 1 ] && stage trainer_profile 90 150 python3 -m torch.distributed.run --standalone --nproc_per_node="$MAXW" \
  -m benchmarks.profile_train --trainer mae_vit_b16_in1k --batch 256 --set dist=ddp --set data.name=synthetic \
  --set data.synthetic_size=2048 --trace --out "$STAGE_DIR"
stage compile 90 600 python3 -m benchmarks.bench_train --only mae --models "$MODELS" --modes compile \
  --scaling "$COMPILE_SCALING" --dist ddp,fsdp --steps 10 --warmup 4 --out "$STAGE_DIR"
# memory_stage PRESET MAX_S BATCHES WRAPPING...: BATCHES ascending; the synthetic set holds one global batch of the
# largest (it lives on the GPU)
memory_stage() {
  local preset=$1 max=$2 batches=$3
  shift 3
  stage memory 60 "$max" python3 -m benchmarks.bench_train --trainer "$preset" --scaling "$MAXW" "$@" --modes eager \
    --trainer-batches "$batches" --trainer-steps 24 --trainer-log-every 4 --set data.name=synthetic \
    --set data.synthetic_size=$(( ${batches##*,} * MAXW )) --out "$STAGE_DIR"
}
for preset in ${MEMORY_PRESETS:-mae_vit_l16_in1k mae_vit_h14_in1k}; do
  memory_stage "$preset" 360 "${MEMORY_BATCHES:-128,256,512,768}" --dist ddp,fsdp
  memory_stage "$preset" 240 "${MEMORY_CKPT_BATCHES:-1024,2048,3072}" --dist ddp --set act_ckpt=full
done

[ -n "${DRY_RUN:-}" ] && exit 0
# pack: at most 8 files come back from $OUT
{
  echo "# multi_gpu_check $(date -u +%Y-%m-%d) on $NGPU x $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
  echo
  for f in "$STAGE_DIR"/*-train.md "$STAGE_DIR"/*-profile.md; do [ -f "$f" ] && { cat "$f"; echo; }; done
} >"$OUT/summary.md"
for f in "$STAGE_DIR"/*-train.json; do [ -f "$f" ] && cp "$f" "$OUT/train.json"; done
for f in "$STAGE_DIR"/*-profile.json; do [ -f "$f" ] && cp "$f" "$OUT/profile.json"; done
ls "$STAGE_DIR"/trace-*.json.gz >/dev/null 2>&1 && tar -C "$STAGE_DIR" -cf "$OUT/traces.tar.gz" $(cd "$STAGE_DIR" && ls trace-*.json.gz)
say "done (status $status); files: $(ls "$OUT" | tr '\n' ' ')"
cat "$OUT/summary.md"
exit $status
