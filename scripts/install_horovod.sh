#!/usr/bin/env bash
# Installs Horovod 0.28.1 (Gloo controller, PyTorch ops) into the active
# Python. PyPI ships only its source, which takes minutes to build on two
# cores, so the built wheel is cached per Horovod/torch/Python version and
# every later install takes seconds.
set -euo pipefail
PY=${PYTHON:-python}
HOROVOD_VERSION=${HOROVOD_VERSION:-0.28.1}
here=$(cd "$(dirname "$0")" && pwd)

torch_version=$("$PY" -c 'import torch; print(torch.__version__)')
py_tag=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
cache_root=${PIPE_HOROVOD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pipe_horovod}
key="horovod-${HOROVOD_VERSION}_torch-${torch_version//+/_}_${py_tag}"
wheel_dir="$cache_root/wheels/$key"

if "$PY" -c "import horovod, horovod.torch, sys; sys.exit(horovod.__version__ != '$HOROVOD_VERSION')" 2>/dev/null; then
  echo "horovod $HOROVOD_VERSION already installed"
  exit 0
fi

if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
  echo "Building horovod $HOROVOD_VERSION against torch $torch_version (several minutes on 2 cores; cached in $wheel_dir afterwards)"
  mkdir -p "$wheel_dir"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  # -v: the build prints its CMake/compiler progress instead of minutes of silence.
  CXX="$here/cxx17" HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 \
  HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
  MAKEFLAGS="-j$(nproc)" HOROVOD_BUILD_ARCH_FLAGS="" \
    "$PY" -m pip wheel -v --no-deps --no-build-isolation -w "$tmp" "horovod==$HOROVOD_VERSION" 2>&1 \
    | grep --line-buffered -E '^\s*\[ *[0-9]+%\]|Building|Linking|error|Error|Successfully' || true
  ls "$tmp"/horovod-*.whl >/dev/null 2>&1 || { echo "horovod build failed" >&2; exit 1; }
  mv "$tmp"/horovod-*.whl "$wheel_dir/"
fi
# With its runtime dependencies (cloudpickle, psutil, pyyaml, cffi, ...): horovodrun needs them.
"$PY" -m pip install "$wheel_dir"/horovod-*.whl
"$PY" -c "import horovod.torch as hvd; print('horovod', __import__('horovod').__version__, 'gloo built:', hvd.gloo_built())"
