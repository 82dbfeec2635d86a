#!/usr/bin/env bash
# session 7 call B (same H100, warm): the GPU suite at the snapshot, alone on the GPU
set -u
R=$(pwd); export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8 TORCHINDUCTOR_COMPILE_THREADS=8
cd $R/.snap && python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1 || echo install failed
echo "commit $(cat COMMIT)"; nvidia-smi --query-gpu=name --format=csv,noheader
timeout ${SUITE_S:-560} python3 -m pytest -v -p no:cacheprovider -p no:logging -m gpu tests --timeout 200 -o addopts="" -rfE \
  --tb=short --junitxml=$OUT/junit.xml > $OUT/gpu_tests.log 2>&1; echo "pytest exit $?"
grep -E "PASSED|FAILED|ERROR|SKIPPED" $OUT/gpu_tests.log | awk '{print $NF}' | sort | uniq -c
tail -n 30 $OUT/gpu_tests.log
gzip -k $OUT/gpu_tests.log
