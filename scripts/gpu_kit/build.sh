#!/usr/bin/env bash
# `make gpu-kit`: builds build/gpu-kit/, everything the lent GPU machine needs to run the
# GPU check (docs/gpu.md) and cannot fetch there: Horovod 0.28.1 built for that machine's
# Python and torch (NCCL ops for the one-rank checks; CPU ops for two ranks sharing its one
# GPU, which NCCL refuses), the wheels the checks import that its image lacks, the codec's
# C kernels prebuilt, run.sh and a manifest. Nothing needs a GPU here.
#
# The machine's versions are in scripts/gpu_kit/target.env. Horovod is built against a
# torch of exactly that version, in a virtual environment of that Python kept in the cache
# (PyPI's torch for it is a CUDA build: about 3.5 GB once), by scripts/install_horovod.sh,
# the project's one recipe, which caches each wheel. A kit whose inputs (these scripts, the
# recipe, the codec's sources, target.env, the pinned wheels) are unchanged since it was
# built, and whose files are whole, is kept: `make gpu-kit` then only rewrites its
# manifest (the commit, the repository's size), in a second or two.
#
# Knobs (environment): KIT_PYTHON_BIN, an interpreter of the target's Python version (else
# python3.X on PATH, else pyenv's); PIPE_HOROVOD_CACHE, the cache root; KIT_OUT, the kit's
# directory (default build/gpu-kit).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
source "$here/target.env"
out=${KIT_OUT:-$repo/build/gpu-kit}
cache_root=${PIPE_HOROVOD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pipe_horovod}
# The kit's environment is not the project's: CI's constraints pin another torch.
unset PIP_CONSTRAINT
die() { echo "make gpu-kit: $*" >&2; exit 1; }
step() { echo "[gpu-kit] $*"; }

# An interpreter of the target's Python version (its minor version fixes the wheels' ABI).
find_python() {
  local cand version
  for cand in "${KIT_PYTHON_BIN:-}" "python$KIT_PYTHON"; do
    [ -n "$cand" ] || continue
    if "$cand" -c 'pass' >/dev/null 2>&1; then echo "$cand"; return; fi
  done
  if command -v pyenv >/dev/null; then
    version=$(pyenv versions --bare 2>/dev/null | grep -E "^$KIT_PYTHON\.[0-9]+$" | sort -V | tail -n 1)
    if [ -n "$version" ]; then echo "$(pyenv root)/versions/$version/bin/python$KIT_PYTHON"; return; fi
  fi
  die "the GPU machine runs Python $KIT_PYTHON, and none is here to build its kit with: install one (pyenv install $KIT_PYTHON), or name it with KIT_PYTHON_BIN"
}

torch_release=${KIT_TORCH%%+*}
env_dir="$cache_root/gpu-kit/env-py$KIT_PYTHON-torch-$KIT_TORCH"
envpy="$env_dir/bin/python"

pins=()
for name in $KIT_WHEELS; do
  pin=$(grep -iE "^$name==" "$repo/constraints.txt" || true)
  [ -n "$pin" ] || die "constraints.txt pins no version of $name (scripts/gpu_kit/target.env KIT_WHEELS)"
  pins+=("$pin")
done
# What the kit's files are made of (the manifest is written anew every time): this script,
# run.sh, the target, the recipe, the codec's sources, the environment, the pins.
inputs=$(cd "$repo" && { cat scripts/gpu_kit/build.sh scripts/gpu_kit/run.sh \
           scripts/gpu_kit/target.env scripts/install_horovod.sh \
           scripts/cuda_archs.sh scripts/cxx17 pipe_horovod/compression/native.py \
           pipe_horovod/compression/cpu_kernels.c; printf '%s\n' "$envpy" "${pins[@]}"; } \
         | sha256sum | cut -d' ' -f1)
write_manifest() {
  "$envpy" "$here/manifest.py" write "$out" --python "$KIT_PYTHON" --torch "$KIT_TORCH" \
      --cc "$KIT_CUDA_CC_LIST" --repo "$repo" --max-mib "$KIT_MAX_MIB" --inputs "$inputs"
}
if [ -x "$envpy" ] && "$envpy" "$here/manifest.py" fresh "$out" --inputs "$inputs"; then
  write_manifest
  step "current: $out (its inputs unchanged since it was built; only the manifest rewritten)"
  exit 0
fi
# A copy of each of the last few kits built on this machine, by their inputs' hash: a new
# clone or worktree (CI's) finds its kit there instead of repacking Horovod's wheels and
# fetching the common ones again (about a minute on 2 cores).
kits="$cache_root/gpu-kit/kits"
if [ -x "$envpy" ] && "$envpy" "$here/manifest.py" fresh "$kits/$inputs" --inputs "$inputs"; then
  rm -rf "$out"
  mkdir -p "$(dirname "$out")"
  cp -r "$kits/$inputs" "$out"
  write_manifest
  step "current: $out (copied from $kits/$inputs, built from the same inputs; only the manifest rewritten)"
  exit 0
fi

got=$("$envpy" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)
if [ "$got" != "$KIT_TORCH" ]; then
  python=$(find_python)
  step "a Python $KIT_PYTHON environment with torch $KIT_TORCH in $env_dir (about 3.5 GB from PyPI, once)"
  rm -rf "$env_dir"
  "$python" -m venv "$env_dir"
  "$envpy" -m pip install -q --upgrade pip wheel
  "$envpy" -m pip install -q "torch==$torch_release" "setuptools<82" $KIT_IMAGE_HAS
  got=$("$envpy" -c 'import torch; print(torch.__version__)')
  [ "$got" = "$KIT_TORCH" ] || die "PyPI's torch==$torch_release here is $got, not the GPU machine's $KIT_TORCH: change scripts/gpu_kit/target.env or give the kit's environment that build"
fi

rm -rf "$out"
mkdir -p "$out/wheels/common" "$out/wheels/horovod-nccl" "$out/wheels/horovod-cpu" "$out/lib"

# Horovod: NCCL ops (one rank per GPU; the check's one-rank runs) and CPU ops (Horovod copies
# CUDA tensors through the host, so two ranks can share the machine's one GPU over gloo).
# No MPI: the image's mpi4py brings no MPI library a build here could link.
# The wheels carry the extension without its debug information (Horovod builds
# RelWithDebInfo: 66 MB of it, 2.4 MB without), repacked by `wheel`, which rewrites RECORD.
build_horovod() {   # $1: kit subdirectory, then environment assignments for the recipe
  local dest=$1 wheel tmp; shift
  wheel=$(env PYTHON="$envpy" PIPE_HOROVOD_MPI=0 PIPE_HOROVOD_WHEEL_ONLY=1 "$@" \
          bash "$repo/scripts/install_horovod.sh" | tail -n 1)
  [ -f "$wheel" ] || die "scripts/install_horovod.sh gave no wheel for $dest"
  tmp=$(mktemp -d)
  "$envpy" -m wheel unpack -d "$tmp" "$wheel" >/dev/null
  find "$tmp" -name '*.so' -exec strip --strip-debug {} +
  "$envpy" -m wheel pack -d "$out/wheels/$dest" "$tmp"/horovod-* >/dev/null
  rm -rf "$tmp"
}
step "Horovod with NCCL ops for compute capability $KIT_CUDA_CC_LIST"
build_horovod horovod-nccl HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_BUILD_CUDA_CC_LIST="$KIT_CUDA_CC_LIST"
step "Horovod with CPU ops"
build_horovod horovod-cpu HOROVOD_BUILD_CUDA_CC_LIST="$KIT_CUDA_CC_LIST"

step "wheels the image lacks: $KIT_WHEELS"
"$envpy" -m pip download -q --no-deps --only-binary=:all: -d "$out/wheels/common" "${pins[@]}"

step "the codec's C kernels"
PYTHONPATH="$repo" "$envpy" -m pipe_horovod.compression.native "$out/lib/pipe_horovod_kernels.so" >/dev/null

cp "$here/run.sh" "$out/run.sh"
chmod +x "$out/run.sh"
write_manifest
rm -rf "${kits:?}/$inputs"
mkdir -p "$kits"
cp -r "$out" "$kits/$inputs"
ls -1t "$kits" | tail -n +5 | while read -r old; do rm -rf "${kits:?}/$old"; done   # keep 4
step "done: $out ($(du -sh "$out" | cut -f1)); on the GPU machine: bash build/gpu-kit/run.sh (docs/gpu.md)"
