#!/usr/bin/env bash
# On a GPU host, in one command: install, run the GPU test suite, run the benchmarks; everything
# lands under $OUT (default ./device_out). Usage:
#   bash benchmarks/device_check.sh [tests|data|kernels|probe|attention|compiled|train|trainers|own_models|csrc_tests|all]   (default: all)
# data: an ImageNet-like JPEG folder, then the ViT-B/16 MAE and ResNet50d trainers from it at 4, 8 and 16 cores a
# GPU, several at once (a GPU and its own cores each), against the same trainers on synthetic data, with the decode
# variants, and DDP on 2 GPUs with 8 cores each (benchmarks.bench_data matrix: data_matrix.md, data_matrix.json,
# data_matrix/*.json; DATA_ARGS narrows it; DATA_MODE=all runs the older sweep with the loaders alone instead).
# Stages can be limited with STAGES="tests kernels" and pytest selection with TESTS="tests/test_ops.py".
# TEST_PROCS=N (without TESTS) runs the suite as N pytest processes at once, the test files (a heavy file by its
# test functions, a heavy function by its cases) split into groups of about equal time by the last suites' reports (tests/split_tests.py): one
# GPU's suite in about a third of the time with 3 (each process its own junit-K.xml and tests-K.log). The logs name each test as it ends (-v), so a
# process stopped before its report still says which tests failed.
# probe: the U-ViT probe grid's 13 linear probes of one noise level, one at a time against together
# (benchmarks.bench_probe; PROBE_ARGS narrows it).
# attention: SDPA's backends and dres.ops.short_attention at the presets' attention shapes (bench_attention),
# then short_attention's launch configs at those shapes (tune_attention).
# compiled: the compiled bare MAE ViT-B/16 step of dres against torch.compile of the plain model, each
# in SPREAD_PROCESSES (default 3) fresh processes: median and spread (a slow or noisy path shows here), and
# the same of the step's CUDA-graph replay with each process's step / replay (a slow process slow in its
# replay too is slow on the GPU side; one slow only in its step, on the host side).
# csrc_tests: the whole suite again, CPU and GPU tests, with the optional CUDA C++ extension built (sm_90 only; the
# default backend then takes its kernels for eager calls) into a temporary folder removed afterwards: in one
# process, or with TEST_PROCS=N in N processes split by the extension's own earlier reports
# (junit_csrc-K.xml, tests_csrc-K.log); CSRC_TESTS="tests/test_csrc.py ..." narrows it to one process (TESTS and MARK are the tests
# stage's alone). CSRC_SITE=DIR tests the extension already built into DIR (`DRES_BUILD_CUDA=1 DRES_CUDA_ARCHS=90
# python3 -m pip install --no-deps --no-build-isolation --target DIR .`, e.g. on spare cores while a GPU measures)
# instead of building it, and leaves DIR in place.
# own_models: timm and Hugging Face models converted in one line against their plain originals, eager, compiled and
# through dres.compile_step (benchmarks.bench_own_model, one arm per GPU at a time over every GPU, OWN_MINUTES
# (default 8) before it starts no more arms; OWN_ARGS narrows it), then where the ViT-B/16 MAE's lead over the compiled
# timm-style MAE comes from: its bare compiled step with the pieces of that lead off in turn (all dres kernels, the
# short-sequence attention, the fused MLP and loss), one process each.
# trainers: each preset's trainer (one GPU, steady-state img/s and trainer / replay), each run cut at
# TRAINER_TIMEOUT_S (default 300: a fresh machine compiles cold); model.backend=torch runs leave the norms to Inductor's own fused code, the fused_mlp
# rows take the MLP path the preset does not (auto: dres's fused MLP in captured steps; mae_cifar10 sets false);
# TRAINER_ROWS=REGEX runs only the rows (of both lists below) that match it; the --fp8 rows need torchao
# (carried as a wheel). BASELINE=TGZ (a `git archive --format=tar.gz` of the commit to compare with) runs every
# row from that tree too, just before this tree's, into $OUT/baseline: the two side by side in one call.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./device_out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # absolute: the baseline's rows run from another folder
STAGES=${STAGES:-${1:-all}}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
want() { [[ " $STAGES " == *" all "* || " $STAGES " == *" $1 "* ]]; }
status=0

{
  date -u +%Y-%m-%dT%H:%M:%SZ
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda)'
} 2>&1 | tee "$OUT/env.txt"

# installed once: an editable install of this very tree is kept (reinstalling it would pull dres from under the
# other jobs of the host that import it meanwhile)
tree=$(pwd -P)
if ! (cd / && python3 -c 'import sys, pathlib, dres.train as t; sys.exit(pathlib.Path(t.__file__).resolve().parents[1] != pathlib.Path(sys.argv[1]))' "$tree") 2>/dev/null; then
  python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { echo "install failed"; cat "$OUT/install.log"; exit 1; }
fi

# optional wheels carried in .whl/ (nvImageCodec and nvJPEG for the GPU decode: benchmarks/README.md): installed
# apart, their `nvidia` folder made a namespace that also reaches the image's own nvidia packages; installed once
# a host (the namespace file is written last) and used by every later run there, a copy of the tree without
# .whl/ included (a queue's, taken when another call carried other files)
wheels=/tmp/dres-wheels
if compgen -G ".whl/*.whl" >/dev/null && [ ! -f $wheels/nvidia/__init__.py ]; then
  { python3 -m pip install -q --no-index --no-deps --no-compile --target $wheels .whl/*.whl >>"$OUT/install.log" 2>&1 &&
    echo "__path__ = __import__('pkgutil').extend_path(__path__, __name__)" >$wheels/nvidia/__init__.py; } ||
    echo "the wheels in .whl/ did not install (see install.log)"
fi
if [ -f $wheels/nvidia/__init__.py ]; then
  export PYTHONPATH=$wheels${PYTHONPATH:+:$PYTHONPATH} LD_LIBRARY_PATH=$wheels/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi

# SITE: dres installed apart there looks for the CIFAR-10 shards beside or inside its own folder: point it at the
# shared/ this tree's dres finds
link_shared() {
  ln -sfn "$(python3 -c 'from dres.data.sources import default_cifar10_dir as d; print(d().parents[1])')" "$1/shared"
}

# NAME SPLIT_ARGS ARGS...: the suite as TEST_PROCS pytest processes at once, one per group of test files of about
# equal time by the last suites' reports (tests/split_tests.py SPLIT_ARGS: "" or --extension), each with its
# $OUT/junitNAME-K.xml, testsNAME-K.log and timesNAME-K.jsonl (-v: a process stopped early still names its failed
# tests, and its times log its finished tests' times and the test it was in; a test running
# past 5 minutes dumps its stack there); ARGS go to every process; TEST_GPUS="2,3" gives process K the K-th of those
# GPUs in turn (default: every process sees the GPUs the caller sees); SUITE_S=N interrupts each process after N
# seconds as Ctrl-C does, so that it still writes its report and summary (the tests it finished, with their times,
# which the next split weighs) rather than being killed by the caller's own limit; fails when any process failed
split_suite() {
  local name=$1 split_args=$2 k pids=() groups gpus=() failed=0
  shift 2
  mapfile -t groups < <(python3 tests/split_tests.py --procs "$TEST_PROCS" $split_args)
  [ -n "${TEST_GPUS:-}" ] && IFS=, read -ra gpus <<<"$TEST_GPUS"
  for k in "${!groups[@]}"; do
    (
      [ ${#gpus[@]} -gt 0 ] && export CUDA_VISIBLE_DEVICES=${gpus[$((k % ${#gpus[@]}))]}
      export DRES_TEST_TIMES="$OUT/times$name-$k.jsonl"  # each test's time as it ends (tests/conftest.py)
      exec timeout -s INT -k 30 "${SUITE_S:-0}" python3 -m pytest -v -p no:cacheprovider -o faulthandler_timeout=300 \
        ${groups[$k]} "$@" \
        --junitxml="$OUT/junit$name-$k.xml"
    ) >"$OUT/tests$name-$k.log" 2>&1 &
    pids+=($!)
  done
  for k in "${!pids[@]}"; do
    wait "${pids[$k]}" || failed=1
    echo "tests$name, process $k (${groups[$k]}):"; tail -n 3 "$OUT/tests$name-$k.log"
  done
  return $failed
}

if want tests && [ "${TEST_PROCS:-1}" -gt 1 ] && [ -z "${TESTS:-}" ]; then
  split_suite "" "" -m "${MARK:-gpu or not gpu}" || status=1
elif want tests; then
  python3 -m pytest -v -p no:cacheprovider ${TESTS:-tests} -m "${MARK:-gpu or not gpu}" --junitxml="$OUT/junit.xml" 2>&1 | tee "$OUT/tests.log" | tail -n 40
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if want data; then
  # real images: an ImageNet-like JPEG folder made here (DATA_ROOT, DATA_IMAGES), the loaders and trainers from it
  root=${DATA_ROOT:-/tmp/dres-imagenet-like}
  [ -d "$root" ] || python3 -m benchmarks.bench_data make --root "$root" --images "${DATA_IMAGES:-20000}" 2>&1 | tail -n 2
  python3 -m benchmarks.bench_data "${DATA_MODE:-matrix}" --root "$root" --out "$OUT" ${DATA_ARGS:-} 2>&1 |
    tee "$OUT/data.log" | tail -n 40
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if want kernels && [ -f benchmarks/bench_kernels.py ]; then
  python3 -m benchmarks.bench_kernels ${KERNEL_ARGS:---quick} --out "$OUT" 2>&1 | tee "$OUT/kernels.log" | tail -n 60
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if want probe; then
  python3 -m benchmarks.bench_probe --json "$OUT/probe.json" ${PROBE_ARGS:-} 2>&1 | tee "$OUT/probe.log" | tail -n 3
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if want attention; then
  python3 -m benchmarks.bench_attention --out "$OUT" 2>&1 | tee "$OUT/attention.log" | tail -n 12
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  python3 -m benchmarks.tune_attention 2>&1 | tee "$OUT/tune_attention.log" | grep -v "^ "
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if want compiled; then
  python3 -m benchmarks.bench_spread --models timm,dres_baseline,dres_official --processes "${SPREAD_PROCESSES:-3}" \
    --out "$OUT" 2>&1 | tee "$OUT/compiled.log" | tail -n 8
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if want trainers; then
  T=${TRAINER_TIMEOUT_S:-300}
  base_tree=""
  if [ -n "${BASELINE:-}" ]; then
    # the tree to compare with (`git archive --format=tar.gz -o base.tgz COMMIT`, carried), installed into a
    # folder of its own and run from its copy without dres/, so each row runs from both trees, baseline first
    base_tree=$(mktemp -d) base_site=$(mktemp -d)
    if tar xzf "$BASELINE" -C "$base_tree" && python3 -m pip install -q --no-deps --no-build-isolation \
        --target "$base_site" "$base_tree" >"$OUT/install_baseline.log" 2>&1; then
      rm -rf "$base_tree/dres"
      link_shared "$base_site"
    else
      echo "baseline $BASELINE: install failed"; tail -n 5 "$OUT/install_baseline.log"; status=1; base_tree=""
    fi
  fi
  bench_row() {  # TIMEOUT ARGS...: one row from the baseline (if any), then from this tree
    if [ -n "$base_tree" ]; then
      (cd "$base_tree" && PYTHONPATH="$base_site" timeout "$1" python3 -m benchmarks.bench_train "${@:2}" \
        --out "$OUT/baseline") >>"$OUT/trainers-baseline.log" 2>&1 || status=1
    fi
    timeout "$1" python3 -m benchmarks.bench_train "${@:2}" --out "$OUT" >>"$OUT/trainers.log" 2>&1 || status=1
  }
  while read -r preset batch steps every extra; do
    bench_row "$T" --trainer "$preset" --batch "$batch" --modes compile --dist none \
      --trainer-steps "$steps" --trainer-log-every "$every" $extra
  done < <(grep -E -- "${TRAINER_ROWS:-.}" <<'RUNS'
mae_cifar10 1024 400 40
mae_cifar10 1024 400 40 --set fused_mlp=true
mae_cifar10 1024 400 40 --set model.backend=torch
mae_cifar10 256 600 60
classify_cifar10 256 600 60
uvit_cifar10 128 600 60 --set eval.n_samples=8
uvit_cifar10 128 600 60 --set eval.n_samples=8 --set fused_mlp=false
uvit_cifar10 128 600 60 --set eval.n_samples=8 --set model.backend=torch
mae_vit_b16_in1k 256 60 10 --set data.name=synthetic
mae_vit_b16_in1k 256 60 10 --set data.name=synthetic --set compile_scope=model
mae_vit_b16_in1k 256 60 10 --set data.name=synthetic --set compile_scope=model --set fused_mlp=false
mae_vit_b16_in1k 256 60 10 --set data.name=synthetic --set compile_scope=model --set model.backend=torch
mae_vit_b16_in1k 256 60 10 --set data.name=synthetic --set compile_scope=model --set model.variant=baseline --set model.alpha_min=1.0
mae_vit_b16_in1k 256 60 10 --set data.name=synthetic --set compile_scope=model --set model.variant=baseline --set model.alpha_min=1.0 --set fused_mlp=false
mae_vit_b16_in1k 256 60 10 --set data.name=synthetic --set compile_scope=model --set model.variant=baseline --set model.alpha_min=1.0 --set model.backend=torch
mae_vit_b16_in1k 256 60 10 --set data.name=synthetic --set compile_scope=model --set model.variant=baseline --set model.alpha_min=1.0 --set data.side_stream=true
mae_cifar10 1024 400 40 --set data.side_stream=true
RUNS
)
  # the compiled plain models the trainers are compared with, the dres models with Inductor's own norm code,
  # and both with float8 block matmuls (torchao Float8Linear: slower than bf16 so far, BENCHMARKS.md)
  while read -r bench batch models extra; do
    bench_row "$((2 * T))" --only "$bench" --batch "$batch" --models "$models" --modes compile --no-flops $extra
  done < <(grep -E -- "${TRAINER_ROWS:-.}" <<'BARE'
mae 256 timm,dres_baseline
mae 256 dres_baseline --ops-backend torch
uvit 128 plain,dres
uvit 128 dres --ops-backend torch
mae 256 timm,dres_baseline --fp8
uvit 128 plain,dres --fp8
BARE
)
  [ -n "$base_tree" ] && { echo "baseline ($BASELINE):"; grep -E "^trainer|img/s, step" "$OUT/trainers-baseline.log"; }
  grep -E "^trainer|img/s, step" "$OUT/trainers.log"
  [ -n "$base_tree" ] && rm -rf "$base_tree" "$base_site"
fi

if want own_models; then
  gpus=$(python3 -c 'import torch; print(",".join(map(str, range(torch.cuda.device_count()))))')
  python3 -m benchmarks.bench_own_model --gpus "$gpus" --max-minutes "${OWN_MINUTES:-8}" ${OWN_ARGS:-} \
    --out "$OUT/own-models" 2>&1 | tee "$OUT/own_models.log" | grep -v "^\[own-models\]"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  while read -r models extra; do
    timeout 600 python3 -m benchmarks.bench_train --only mae --batch 256 --modes compile --no-flops --models "$models" \
      $extra --out "$OUT/ablation" >>"$OUT/ablation.log" 2>&1 || status=1
  done <<'ABLATION'
timm
dres_baseline --ops-backend torch --fused-branches off
dres_baseline --attention sdpa --fused-branches off
dres_baseline --fused-branches off
dres_baseline --fused-branches on
ABLATION
  grep -E "img/s, step" "$OUT/ablation.log"
fi

if want train && [ -f benchmarks/bench_train.py ]; then
  python3 -m benchmarks.bench_train ${TRAIN_ARGS:-} --out "$OUT" 2>&1 | tee "$OUT/train.log" | tail -n 40
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if want csrc_tests; then
  # built into its own folder and tested from a copy of the tree without dres/, so the editable install
  # (and anything running from this tree meanwhile) keeps the pure-Python library
  csite=${CSRC_SITE:-$(mktemp -d)} csrun=$(mktemp -d)
  if { [ -n "${CSRC_SITE:-}" ] && echo "the extension built into $csite beforehand" >"$OUT/install_csrc.log" ||
       DRES_BUILD_CUDA=1 DRES_CUDA_ARCHS=90 python3 -m pip install -q --no-deps --no-build-isolation --target "$csite" . \
       >"$OUT/install_csrc.log" 2>&1; } \
      && (cd / && PYTHONPATH="$csite" python3 -c 'from dres.ops import csrc_backend as c; assert c.available(), c.LOAD_ERROR') \
      >>"$OUT/install_csrc.log" 2>&1; then
    cp -r . "$csrun/tree" && rm -rf "$csrun/tree/dres"
    link_shared "$csite"
    if [ "${TEST_PROCS:-1}" -gt 1 ] && [ -z "${CSRC_TESTS:-}" ]; then
      # test_csrc.py once, in the groups; its forced CUDA dispatch key, which once leaked into every later test of
      # its process, has a test of its own (test_forced_cuda_dispatch_leaves_the_thread_as_it_found_it)
      (cd "$csrun/tree" && export PYTHONPATH="$csite${PYTHONPATH:+:$PYTHONPATH}" &&
        split_suite _csrc --extension) || status=1
    else
      (cd "$csrun/tree" && PYTHONPATH="$csite${PYTHONPATH:+:$PYTHONPATH}" python3 -m pytest -v -p no:cacheprovider \
        ${CSRC_TESTS:-tests} --junitxml="$OUT/junit_csrc.xml" 2>&1) | tee "$OUT/tests_csrc.log" | tail -n 20
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    fi
  else
    echo "csrc build failed"; tail -n 20 "$OUT/install_csrc.log"; status=1
  fi
  [ -n "${CSRC_SITE:-}" ] || rm -rf "$csite"
  rm -rf "$csrun"
fi
exit $status
