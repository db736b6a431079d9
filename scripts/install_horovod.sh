#!/usr/bin/env bash
# Installs Horovod 0.28.1 (PyTorch ops) into $PYTHON: with the MPI and Gloo
# controllers when an MPI compiler wrapper (mpicc) is on PATH, Gloo only
# otherwise. `make` and the Dockerfile both install through this script, so
# the image's Horovod is built the way the tests' is.
#
# PyPI ships only Horovod's source, which takes minutes to build on two cores,
# so the built wheel is cached under a key naming everything that changes the
# binary (Horovod, torch, Python, controllers, GPU ops); later installs take
# seconds. The compiler's output goes to a log under the cache
# (<cache>/logs/<key>.log); the terminal shows one progress line and, when the
# build fails, the log's last lines and what the build needs.
#
# Knobs (environment):
#   PYTHON                  the interpreter to install into (default: python)
#   HOROVOD_VERSION         default 0.28.1
#   HOROVOD_GPU_OPERATIONS  e.g. NCCL on a CUDA machine (the Docker image); unset: CPU ops
#   PIPE_HOROVOD_MPI        1: require MPI (fail without mpicc), 0: build without it,
#                           unset: MPI exactly when mpicc is found
#   PIPE_HOROVOD_CACHE      the cache root (default ~/.cache/pipe_horovod)
set -euo pipefail
PY=${PYTHON:-python}
HOROVOD_VERSION=${HOROVOD_VERSION:-0.28.1}
GPU_OPS=${HOROVOD_GPU_OPERATIONS:-}
here=$(cd "$(dirname "$0")" && pwd)

case "${PIPE_HOROVOD_MPI:-auto}" in
  auto) if command -v mpicc >/dev/null; then with_mpi=1; else with_mpi=0; fi ;;
  1) command -v mpicc >/dev/null || { echo "PIPE_HOROVOD_MPI=1 but no mpicc on PATH (install Open MPI: scripts/install_openmpi.sh)" >&2; exit 1; }
     with_mpi=1 ;;
  0) with_mpi=0 ;;
  *) echo "PIPE_HOROVOD_MPI must be 1, 0 or unset, not '$PIPE_HOROVOD_MPI'" >&2; exit 1 ;;
esac
case "$GPU_OPS" in
  ""|NCCL|MPI|GLOO) ;;
  *) echo "HOROVOD_GPU_OPERATIONS must be NCCL, MPI or GLOO (or unset for CPU ops), not '$GPU_OPS'" >&2; exit 1 ;;
esac
if [ "$with_mpi" = 1 ]; then controllers=mpi-gloo; else controllers=gloo; fi

torch_version=$("$PY" -c 'import torch; print(torch.__version__)')
py_tag=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
cache_root=${PIPE_HOROVOD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pipe_horovod}
key="horovod-${HOROVOD_VERSION}_torch-${torch_version//+/_}_${py_tag}_${controllers}${GPU_OPS:+_gpu-${GPU_OPS,,}}"
wheel_dir="$cache_root/wheels/$key"

# What the installed Horovod was built with, as "VERSION MPI=1 Gloo=1 NCCL=0".
built() {
  "$PY" -c "import horovod, horovod.torch as h; print(horovod.__version__, f'MPI={int(h.mpi_built())} Gloo={int(h.gloo_built())} NCCL={int(h.nccl_built() > 0)}')" 2>/dev/null || true
}
want="$HOROVOD_VERSION MPI=$with_mpi Gloo=1 NCCL=$([ "$GPU_OPS" = NCCL ] && echo 1 || echo 0)"
if [ "$(built)" = "$want" ]; then
  echo "horovod $HOROVOD_VERSION ($controllers${GPU_OPS:+, GPU ops $GPU_OPS}) already installed"
  exit 0
fi

fmt_elapsed() { printf '%dm%02ds' $(( $1 / 60 )) $(( $1 % 60 )); }

# Prints the build's progress while process $1 runs: the last "[ 42%]" that CMake's
# make wrote to log $2, rewritten in place on a terminal, one line per 10% elsewhere.
show_progress() {
  local pid=$1 log=$2 start=$SECONDS pct last=-10 stage line
  while kill -0 "$pid" 2>/dev/null; do
    pct=$(tail -c 65536 "$log" 2>/dev/null | grep -oE '^\s*\[ *[0-9]+%\]' | tail -n 1 | tr -dc '0-9' || true)
    case "$pct" in
      "") stage="configuring" ;;
      100) stage="[100%] linking, packing the wheel" ;;
      *) stage="[${pct}%] compiling" ;;
    esac
    line="  horovod $HOROVOD_VERSION: $stage, $(fmt_elapsed $(( SECONDS - start )))"
    if [ -t 1 ]; then
      printf '\r%s ' "$line"
    elif [ -n "$pct" ] && [ "$pct" -ge $(( last + 10 )) ]; then
      echo "$line"
      last=$pct
    fi
    sleep 2
  done
  if [ -t 1 ]; then printf '\r  horovod %s: finished after %s      \n' "$HOROVOD_VERSION" \
      "$(fmt_elapsed $(( SECONDS - start )))"; fi
}

# After a failed build: the log's last lines, then what a build needs.
explain_failure() {
  local log=$1 pyver first total
  pyver=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  # The cause is often far above pip's traceback at the end: show the first error too.
  first=$(grep -n -m 1 -E 'CMake Error|: (fatal )?error:|\*\*\* \[' "$log" | cut -d: -f1 || true)
  total=$(wc -l <"$log")
  if [ -n "$first" ] && [ "$first" -lt $(( total - 30 )) ]; then
    echo "horovod build failed; the first error, line $first of $log:" >&2
    sed -n "${first},$(( first + 9 ))p" "$log" | sed 's/^/    /' >&2
  fi
  echo "horovod build failed; the last 30 lines of $log:" >&2
  tail -n 30 "$log" | sed 's/^/    /' >&2
  cat >&2 <<MSG
Building Horovod $HOROVOD_VERSION needs:
  - a C++17 compiler: g++ (apt-get install g++), or another one named by PIPE_HOROVOD_REAL_CXX
    (scripts/cxx17 wraps it to turn Horovod's -std=c++14 into -std=c++17)
  - CMake >= 3.13 and < 4 on PATH (apt-get install cmake, or pip install 'cmake<4')
  - Python $pyver's headers (apt-get install python$pyver-dev, or python3-dev)
  - torch installed in $PY, built against here; for the MPI controller Open MPI's mpicc
    (scripts/install_openmpi.sh), or PIPE_HOROVOD_MPI=0 for Gloo only
It ran: ${build_env[*]} $PY -m pip wheel -v --no-deps --no-build-isolation --no-cache-dir --no-binary horovod horovod==$HOROVOD_VERSION
MSG
}

if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
  log="$cache_root/logs/$key.log"
  mkdir -p "$wheel_dir" "$(dirname "$log")"
  echo "Building horovod $HOROVOD_VERSION against torch $torch_version, controllers $controllers${GPU_OPS:+, GPU ops $GPU_OPS} (several minutes on 2 cores; cached in $wheel_dir afterwards)"
  echo "  compiler output: $log"
  tmp=$(mktemp -d)
  build_pid=""
  trap 'rm -rf "$tmp"; if [ -n "$build_pid" ]; then kill "$build_pid" 2>/dev/null || true; fi' EXIT
  if [ "$with_mpi" = 1 ]; then mpi_flag=HOROVOD_WITH_MPI=1; else mpi_flag=HOROVOD_WITHOUT_MPI=1; fi
  # cxx17: Horovod's CMake asks for C++14, torch's headers need C++17.
  build_env=("CXX=$here/cxx17" HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 "$mpi_flag"
             HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITHOUT_TENSORFLOW=1
             ${GPU_OPS:+"HOROVOD_GPU_OPERATIONS=$GPU_OPS"} "MAKEFLAGS=-j$(nproc)"
             HOROVOD_BUILD_ARCH_FLAGS=)
  # --no-cache-dir: pip would otherwise reuse its own cached build made with other controllers.
  # -v: CMake's and the compiler's output, for the log and the progress line.
  env "${build_env[@]}" "$PY" -m pip wheel -v --no-deps --no-build-isolation --no-cache-dir \
      --no-binary horovod -w "$tmp" "horovod==$HOROVOD_VERSION" >"$log" 2>&1 &
  build_pid=$!
  show_progress "$build_pid" "$log"
  status=0
  wait "$build_pid" || status=$?
  build_pid=""
  if [ "$status" -ne 0 ] || ! ls "$tmp"/horovod-*.whl >/dev/null 2>&1; then
    explain_failure "$log"
    exit 1
  fi
  mv "$tmp"/horovod-*.whl "$wheel_dir/"
fi
# Forced: the same version may be installed with other controllers. Then its
# runtime dependencies (cloudpickle, psutil, pyyaml, cffi, ...): horovodrun needs them.
"$PY" -m pip install -q --force-reinstall --no-deps "$wheel_dir"/horovod-*.whl
"$PY" -m pip install -q "$wheel_dir"/horovod-*.whl
got=$(built)
echo "horovod installed: $got"
[ "$got" = "$want" ] || { echo "installed horovod is '$got', wanted '$want'" >&2; exit 1; }
