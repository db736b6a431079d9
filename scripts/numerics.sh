#!/usr/bin/env bash
# The numerical tests under other summation orders: the check that their tolerances come
# from the computation (tests/tolerance.py) and not from this CPU. Each setting changes
# how the same float math is ordered: threads per process, oneDNN on or off in
# TensorFlow (on by default on x86-64), and the vector ISA that ATen, MKL and oneDNN may
# use (capped to AVX2 as on older x86-64 CPUs, or to no vectorization at all). docs/ci.md
# keeps the last table.
#
#   bash scripts/numerics.sh [PYTHON] [SETTING...]   (default .venv/bin/python, every setting)
set -uo pipefail
PY=${1:-.venv/bin/python}
shift || true
ONLY=" $* "
# Every Keras oracle (where the fitted bounds failed), the torch oracles in one process and
# on 2-3 ranks of the torch engine, and the collectives against float64 on 2 ranks: the
# multi-rank Horovod launches repeat the same math and are left to the suite.
TESTS=(tests/test_keras_reference.py tests/test_keras.py tests/test_optimizer.py
       tests/test_staleness.py tests/test_collectives.py)
SELECT="reference or (oracle and not horovod and not torch-4 and not torch-3-collectives)"
SETTINGS=(
  "threads-1 PIPE_HOROVOD_TEST_THREADS=1 OMP_NUM_THREADS=1 TF_NUM_INTRAOP_THREADS=1"
  "isa-avx2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2"
  "threads-2 PIPE_HOROVOD_TEST_THREADS=2 OMP_NUM_THREADS=2 TF_NUM_INTRAOP_THREADS=2"
  "onednn-off TF_ENABLE_ONEDNN_OPTS=0"
  "isa-none ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41"
)
printf '%-12s %-40s %s\n' setting result seconds
status=0
for setting in "${SETTINGS[@]}"; do
  read -r name vars <<<"$setting"
  [ "$ONLY" = "  " ] || [[ "$ONLY" == *" $name "* ]] || continue
  start=$SECONDS
  log=$(mktemp)
  # shellcheck disable=SC2086  # vars is a list of NAME=VALUE words
  env $vars "$PY" -m pytest -q -p no:cacheprovider -k "$SELECT" "${TESTS[@]}" >"$log" 2>&1
  rc=$?
  [ "$rc" = 0 ] || status=1
  printf '%-12s %-40s %s\n' "$name" "$(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed)' "$log" \
    | tail -1 | tr -d '=' | sed 's/ in .*//;s/^ *//')" "$((SECONDS - start))"
  [ "$rc" = 0 ] || { grep -E '^(FAILED|ERROR)' "$log"; echo "  full log: $log"; }
done
exit "$status"
