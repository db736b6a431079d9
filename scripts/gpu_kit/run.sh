#!/usr/bin/env bash
# The GPU check, in one call on a lent GPU machine (docs/gpu.md):
#
#   bash build/gpu-kit/run.sh [--no-gpu] [--budget SECONDS] [--steps a,b] [REPORT_DIR]
#
# Installs what `make gpu-kit` built (no network: Horovod, Keras and the rest from the
# kit's wheels into a scratch directory, nothing into the machine's Python), then runs
# the checks of tests/gpu_kit/checks.py, each with its own time limit, and writes
# report.md and report.json into REPORT_DIR (default: $OUT, where the device tool
# collects files). A failing step is marked in the report and the next one runs; the
# exit status is 0 when every step passed, 1 when one failed, 2 when nothing could run.
#
# --steps: only these steps (a rerun of the ones that failed; names in the report).
# --no-gpu: the rehearsal on a machine without a GPU (tests/test_gpu_kit.py, in CI):
# every step that needs no GPU runs, on CPU tensors where the step has a CPU form.
# Without it, a machine where torch sees no GPU is refused in one line (exit 2).
# PYTHON: the interpreter (default python3, the GPU machine's one with torch).
set -uo pipefail
kit=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$kit/../.." && pwd)
PY=${PYTHON:-python3}
no_gpu=0
budget=420
steps=""
out=${OUT:-}
while [ $# -gt 0 ]; do
  case "$1" in
    --no-gpu) no_gpu=1 ;;
    --budget) budget=${2:?--budget needs seconds}; shift ;;
    --steps) steps=${2:?--steps needs step names}; shift ;;
    -h|--help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "run.sh: unknown option $1 (--no-gpu, --budget SECONDS, --steps a,b, REPORT_DIR)" >&2
        exit 2 ;;
    *) out=$1 ;;
  esac
  shift
done
[ -n "$out" ] || { echo "run.sh: name the report's directory (an argument, or \$OUT)" >&2; exit 2; }
started=$SECONDS

if [ "$no_gpu" = 0 ]; then
  why=$("$PY" -c 'import torch
print("" if torch.cuda.is_available() else f"torch {torch.__version__} sees no GPU")' 2>&1 | tail -n 1)
  if [ -n "$why" ]; then
    echo "run.sh: no GPU on this machine ($why); the rehearsal without one: run.sh --no-gpu" >&2
    exit 2
  fi
fi
"$PY" "$repo/scripts/gpu_kit/manifest.py" check "$kit" || exit 2

# The kit's wheels into a scratch directory: the common ones, and each Horovod build in
# a directory of its own (a step puts one of them first on PYTHONPATH and PATH).
site=$(mktemp -d "${TMPDIR:-/tmp}/pipe-horovod-gpu-kit.XXXXXX")
trap 'rm -rf "$site"' EXIT
for part in common horovod-nccl horovod-cpu; do
  if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
        --target "$site/$part" "$kit"/wheels/"$part"/*.whl >"$site/pip-$part.log" 2>&1; then
    echo "run.sh: installing the kit's $part wheels failed:" >&2
    tail -n 20 "$site/pip-$part.log" >&2
    exit 2
  fi
done
echo "[gpu-kit] installed from the kit in $(( SECONDS - started )) s"

args=(--out "$out" --kit "$kit" --site "$site" --budget "$(( budget - (SECONDS - started) ))")
[ "$no_gpu" = 1 ] && args+=(--no-gpu)
[ -n "$steps" ] && args+=(--steps "$steps")
PYTHONPATH="$repo:$site/common${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 \
  "$PY" "$repo/tests/gpu_kit/checks.py" "${args[@]}"
