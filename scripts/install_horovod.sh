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
#   HOROVOD_GPU_OPERATIONS  NCCL for GPU clusters (the Docker image); unset: CPU ops. NCCL
#                           needs a CUDA build of torch and nothing else: nvcc comes from
#                           PyPI (nvidia-cuda-nvcc pinned to torch's CUDA), NCCL from torch's
#                           nvidia-nccl wheel; no GPU needed to build
#   HOROVOD_BUILD_CUDA_CC_LIST  GPU compute capabilities (default 75,80,86,89,90,100,120;
#                           fewer build faster; CUDA 13 starts at 75)
#   HOROVOD_CUDA_HOME, HOROVOD_NCCL_HOME  an installed CUDA toolkit / NCCL instead of PyPI's
#   PIPE_HOROVOD_CUDA_VERSION  e.g. 13.0: fail unless torch is built for this CUDA
#   PIPE_HOROVOD_MPI        1: require MPI (fail without mpicc), 0: build without it,
#                           unset: MPI exactly when mpicc is found
#   PIPE_HOROVOD_CACHE      the cache root (default ~/.cache/pipe_horovod)
#   PIPE_HOROVOD_WHEEL_ONLY 1: build (or find in the cache) the wheel and print its path as
#                           the last line, installing nothing: the GPU kit carries it to a
#                           machine that cannot build (scripts/gpu_kit/build.sh)
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
die() { echo "$*" >&2; exit 1; }
cc_list=${HOROVOD_BUILD_CUDA_CC_LIST:-75,80,86,89,90,100,120}
source "$here/cuda_archs.sh"
problem=$(cuda_cc_problem HOROVOD_BUILD_CUDA_CC_LIST "$cc_list")
[ -z "$problem" ] || die "$problem"

torch_version=$("$PY" -c 'import torch; print(torch.__version__)')
py_tag=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
cache_root=${PIPE_HOROVOD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pipe_horovod}

# NCCL ops: nvcc from PyPI, pinned to the CUDA version torch was built for (or
# the toolkit HOROVOD_CUDA_HOME names), and NCCL from torch's own nvidia-nccl
# wheel (or HOROVOD_NCCL_HOME), so no system CUDA and no GPU are needed.
# A CUDA build of torch needs the toolkit even for CPU ops: Horovod's torch extension
# then compiles with CUDA (horovod/torch/CMakeLists.txt: add_cuda() for a CUDA torch),
# which lets it copy CUDA tensors through the host for its CPU ops, safely.
cuda_tag=""
torch_cuda=$("$PY" -c 'import torch; print(torch.version.cuda or "")')
if [ "$GPU_OPS" = NCCL ]; then
  [ -n "$torch_cuda" ] || die "HOROVOD_GPU_OPERATIONS=NCCL needs a CUDA build of torch, but $PY has torch $torch_version (a CPU build): install torch from PyPI's default index"
fi
if [ -n "$torch_cuda" ]; then
  want_cuda=${PIPE_HOROVOD_CUDA_VERSION:-$torch_cuda}
  [ "$want_cuda" = "$torch_cuda" ] || die "torch $torch_version is built for CUDA $torch_cuda, not the CUDA $want_cuda asked for (PIPE_HOROVOD_CUDA_VERSION, the image's CUDA_VERSION): pick a torch built for CUDA $want_cuda, or ask for $torch_cuda"
  cuda_tag="-cu${torch_cuda//./}-cc${cc_list//,/.}"
fi
key="horovod-${HOROVOD_VERSION}_torch-${torch_version//+/_}_${py_tag}_${controllers}${GPU_OPS:+_gpu-${GPU_OPS,,}}${cuda_tag}"
wheel_dir="$cache_root/wheels/$key"

# What the installed Horovod was built with, as "VERSION MPI=1 Gloo=1 NCCL=0".
built() {
  "$PY" -c "import horovod, horovod.torch as h; print(horovod.__version__, f'MPI={int(h.mpi_built())} Gloo={int(h.gloo_built())} NCCL={int(h.nccl_built() > 0)}')" 2>/dev/null || true
}
want="$HOROVOD_VERSION MPI=$with_mpi Gloo=1 NCCL=$([ "$GPU_OPS" = NCCL ] && echo 1 || echo 0)"
wheel_only=${PIPE_HOROVOD_WHEEL_ONLY:-0}
if [ "$wheel_only" != 1 ] && [ "$(built)" = "$want" ]; then
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

# Sets cuda_env to the variables Horovod's CMake needs for a CUDA torch: a CUDA
# home whose nvcc compiles C++17 (CUDA 13's headers need it; Horovod asks for
# C++11), and for NCCL ops an NCCL home with the unversioned library name CMake
# looks for. Without NCCL ops and without a toolkit this script can assemble (CUDA
# < 13 and no HOROVOD_CUDA_HOME), it leaves CMake to find the system's.
cuda_build_env() {
  local major=${torch_cuda%%.*} toolkit home nccl got
  if [ -n "${HOROVOD_CUDA_HOME:-}" ]; then
    toolkit=$HOROVOD_CUDA_HOME
  else
    if [ "$major" -lt 13 ] && [ "$GPU_OPS" != NCCL ]; then return; fi
    [ "$major" -ge 13 ] || die "torch is built for CUDA $torch_cuda: PyPI's CUDA $major toolkit is split over several packages this script does not assemble; set HOROVOD_CUDA_HOME to an installed CUDA $torch_cuda toolkit"
    toolkit="$cache_root/cuda-$torch_cuda"
    if [ ! -x "$toolkit/nvidia/cu$major/bin/nvcc" ]; then
      echo "Fetching the CUDA $torch_cuda compiler from PyPI into $toolkit"
      # nvvm and crt pinned too: pip would otherwise take newer ones whose PTX this ptxas rejects.
      "$PY" -m pip install -q --target "$toolkit" "nvidia-cuda-nvcc==$torch_cuda.*" \
          "nvidia-nvvm==$torch_cuda.*" "nvidia-cuda-crt==$torch_cuda.*" \
          "nvidia-cuda-cccl==$torch_cuda.*" "nvidia-cuda-runtime==$torch_cuda.*" \
        || die "could not install the CUDA $torch_cuda compiler from PyPI (nvidia-cuda-nvcc==$torch_cuda.*); behind a TLS proxy, give pip its CA (PIP_CERT)"
    fi
    toolkit="$toolkit/nvidia/cu$major"
    ln -sfn lib "$toolkit/lib64"                         # nvcc looks for lib64/
    ln -sfn libcudart.so.$major "$toolkit/lib/libcudart.so"
  fi
  [ -x "$toolkit/bin/nvcc" ] || die "no nvcc in $toolkit/bin (HOROVOD_CUDA_HOME)"
  got=$("$toolkit/bin/nvcc" --version | grep -oE 'release [0-9]+\.[0-9]+' | cut -d' ' -f2)
  [ "${got%%.*}" = "$major" ] || die "torch is built for CUDA $torch_cuda but $toolkit/bin/nvcc is CUDA $got: use a CUDA $major toolkit"
  home="$tmp/cuda"
  mkdir -p "$home/bin"
  for d in include lib lib64 nvvm; do [ -e "$toolkit/$d" ] && ln -s "$toolkit/$d" "$home/$d"; done
  printf '#!/bin/sh\nexec %s --compiler=%s "$@"\n' "$here/cxx17" "$toolkit/bin/nvcc" >"$home/bin/nvcc"
  chmod +x "$home/bin/nvcc"
  cuda_env=("HOROVOD_CUDA_HOME=$home" "CUDA_HOME=$home" "HOROVOD_BUILD_CUDA_CC_LIST=$cc_list")
  if [ "$GPU_OPS" != NCCL ]; then
    echo "  CUDA $got from $toolkit (torch's CUDA: Horovod's extension compiles with it), compute capabilities $cc_list"
    return
  fi
  if [ -n "${HOROVOD_NCCL_HOME:-}" ]; then
    nccl=$HOROVOD_NCCL_HOME
  else
    nccl=$("$PY" -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null) \
      || die "no NCCL: torch's nvidia-nccl wheel is not installed in $PY; set HOROVOD_NCCL_HOME"
    mkdir -p "$tmp/nccl/lib"
    ln -s "$nccl/include" "$tmp/nccl/include"
    ln -s "$nccl/lib/libnccl.so.2" "$tmp/nccl/lib/libnccl.so"
    nccl="$tmp/nccl"
  fi
  [ -f "$nccl/include/nccl.h" ] || die "no nccl.h in $nccl/include (HOROVOD_NCCL_HOME)"
  echo "  CUDA $got from $toolkit, NCCL $(grep -oE 'NCCL_(MAJOR|MINOR|PATCH) +[0-9]+' "$nccl/include/nccl.h" | grep -oE '[0-9]+$' | paste -sd.) from $nccl, compute capabilities $cc_list"
  cuda_env+=("HOROVOD_NCCL_HOME=$nccl" HOROVOD_NCCL_LINK=SHARED)
}

if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
  log="$cache_root/logs/$key.log"
  mkdir -p "$wheel_dir" "$(dirname "$log")"
  echo "Building horovod $HOROVOD_VERSION against torch $torch_version, controllers $controllers${GPU_OPS:+, GPU ops $GPU_OPS} (several minutes on 2 cores; cached in $wheel_dir afterwards)"
  echo "  compiler output: $log"
  tmp=$(mktemp -d)
  build_pid=""
  trap 'rm -rf "$tmp"; if [ -n "$build_pid" ]; then kill "$build_pid" 2>/dev/null || true; fi' EXIT
  cuda_env=()
  if [ -n "$torch_cuda" ]; then cuda_build_env; fi
  if [ "$with_mpi" = 1 ]; then mpi_flag=HOROVOD_WITH_MPI=1; else mpi_flag=HOROVOD_WITHOUT_MPI=1; fi
  # cxx17: Horovod's CMake asks for C++14, torch's headers need C++17.
  build_env=("CXX=$here/cxx17" HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 "$mpi_flag"
             HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITHOUT_TENSORFLOW=1
             ${GPU_OPS:+"HOROVOD_GPU_OPERATIONS=$GPU_OPS"} ${cuda_env[@]+"${cuda_env[@]}"} "MAKEFLAGS=-j$(nproc)"
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
if [ "$wheel_only" = 1 ]; then
  ls "$wheel_dir"/horovod-*.whl
  exit 0
fi
# Forced: the same version may be installed with other controllers. Then its
# runtime dependencies (cloudpickle, psutil, pyyaml, cffi, ...): horovodrun needs them.
"$PY" -m pip install -q --force-reinstall --no-deps "$wheel_dir"/horovod-*.whl
"$PY" -m pip install -q "$wheel_dir"/horovod-*.whl
got=$(built)
echo "horovod installed: $got"
[ "$got" = "$want" ] || { echo "installed horovod is '$got', wanted '$want'" >&2; exit 1; }
