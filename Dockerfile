# pipe_horovod for GPU clusters: CUDA + NCCL + Open MPI + PyTorch + Horovod.
#
#   docker build -t pipe-horovod .
#   docker run --rm --gpus all pipe-horovod                    # runs `pipe-horovod check`
#   docker run --rm --gpus all pipe-horovod \
#       horovodrun -np 2 -H localhost:2 python examples/pytorch_digits.py
#
# A skeleton: it has not been built on the project's own machines (no Docker
# engine there). integrations/README.md says how to launch it on Slurm and
# Kubernetes.
#
# The CUDA major version of the base image must match the torch wheel's:
# torch==2.13.0 from PyPI is built for CUDA 13.0 (it depends on
# cuda-toolkit==13.0.*, nvidia-nccl-cu13, nvidia-cudnn-cu13), so Horovod's
# CUDA parts are compiled with a 13.0 toolkit too. A build step below stops
# with a clear message if the two disagree. The torch wheel brings its own
# cuDNN, so the plain `devel` image is enough (no `cudnn-devel` needed).
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-devel-ubuntu22.04
FROM ${CUDA_IMAGE}

# GPU architectures Horovod's few CUDA kernels are compiled for
# (80 A100, 86/89 Ampere/Ada workstation cards, 90 H100/H200, 100 B200,
# 120 RTX Blackwell). CUDA 13 supports 75 and newer. Fewer = faster build.
ARG CUDA_CC_LIST=80,86,89,90,100,120
ARG TORCH_VERSION=2.13.0
ARG HOROVOD_VERSION=0.28.1

# Containers usually run as root; Open MPI refuses that unless told.
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    OMPI_ALLOW_RUN_AS_ROOT=1 \
    OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

SHELL ["/bin/bash", "-euo", "pipefail", "-c"]

# System packages:
# - python3.11 (+ -dev for Horovod's build, + -venv) from Ubuntu 22.04's own archive;
# - Open MPI (mpirun, mpicxx) for HOROVOD_WITH_MPI=1;
# - OpenSSH: horovodrun/mpirun start workers on other hosts over ssh, and
#   Kubeflow's MPIJob needs sshd in the worker pods;
# - g++ and make for the build (cmake comes from pip below: Ubuntu's 3.22 is
#   older than CUDA 13).
RUN apt-get update && apt-get install -y --no-install-recommends \
        build-essential ca-certificates \
        python3.11 python3.11-dev python3.11-venv \
        openmpi-bin libopenmpi-dev \
        openssh-client openssh-server \
    && rm -rf /var/lib/apt/lists/*

# NCCL: the CUDA devel images ship libnccl2 + libnccl-dev (apt-held at the
# version matching their CUDA). Install them only if a base image lacks them.
# Horovod links NCCL statically by default (HOROVOD_NCCL_LINK=STATIC), so its
# copy does not clash with the NCCL that the torch wheel loads.
RUN if [ ! -f /usr/include/nccl.h ]; then \
        apt-get update && apt-get install -y --no-install-recommends libnccl2 libnccl-dev \
        && rm -rf /var/lib/apt/lists/*; \
    fi; \
    grep -E '^#define NCCL_(MAJOR|MINOR|PATCH)' /usr/include/nccl.h

# Let ssh reach the other containers of a job without an interactive prompt.
RUN mkdir -p /var/run/sshd \
    && sed -i '/StrictHostKeyChecking/d' /etc/ssh/ssh_config \
    && echo "    StrictHostKeyChecking no" >> /etc/ssh/ssh_config

# Everything Python lives in one virtual environment, first on PATH.
RUN python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:${PATH}
RUN pip install --no-cache-dir --upgrade pip setuptools wheel

# PyTorch: the default wheel on PyPI is the CUDA build. Then check that its
# CUDA major version is the toolkit's (see the top of this file).
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" \
    && python -c "import re, subprocess, sys, torch; \
nvcc = subprocess.check_output(['/usr/local/cuda/bin/nvcc', '--version'], text=True); \
toolkit = re.search(r'release (\d+\.\d+)', nvcc).group(1); \
print('torch', torch.__version__, 'built for CUDA', torch.version.cuda, '- toolkit CUDA', toolkit); \
ok = torch.version.cuda is not None and torch.version.cuda.split('.')[0] == toolkit.split('.')[0]; \
sys.exit(0 if ok else f'torch is built for CUDA {torch.version.cuda} (None: a CPU build) but the image has CUDA {toolkit}: pick a CUDA_IMAGE of the same major version')"

# Horovod 0.28.1 from source (PyPI has nothing else), against the torch above:
# - CXX: its CMake asks for -std=c++14, which torch >= 2.1 headers reject;
#   scripts/cxx17 rewrites that to -std=c++17 and runs g++ (as in
#   scripts/install_horovod.sh). Its nvcc kernels need no such change.
# - --no-build-isolation so the build sees the installed torch; cmake < 4
#   because CMake 4 rejects the old cmake_minimum_required of Horovod's
#   third-party code.
# - The CUDA driver (libcuda.so.1) only exists at run time, mounted by the
#   NVIDIA container toolkit: link and check against the toolkit's stubs,
#   then drop them from the loader cache again (as Horovod's own images do).
COPY scripts/cxx17 /opt/pipe_horovod/scripts/cxx17
RUN pip install --no-cache-dir "cmake>=3.27,<4" packaging psutil cloudpickle pyyaml \
    && ldconfig /usr/local/cuda/targets/x86_64-linux/lib/stubs \
    && CXX=/opt/pipe_horovod/scripts/cxx17 \
       HOROVOD_GPU_OPERATIONS=NCCL \
       HOROVOD_WITH_PYTORCH=1 \
       HOROVOD_WITH_GLOO=1 \
       HOROVOD_WITH_MPI=1 \
       HOROVOD_WITHOUT_TENSORFLOW=1 \
       HOROVOD_WITHOUT_MXNET=1 \
       HOROVOD_CUDA_HOME=/usr/local/cuda \
       HOROVOD_BUILD_CUDA_CC_LIST="${CUDA_CC_LIST}" \
       MAKEFLAGS="-j$(nproc)" \
       pip install --no-cache-dir --no-build-isolation -v "horovod==${HOROVOD_VERSION}" \
    && horovodrun --check-build \
    && python -c "import horovod.torch as hvd; assert hvd.nccl_built() and hvd.mpi_built() and hvd.gloo_built(), 'horovod lacks NCCL, MPI or Gloo'" \
    && ldconfig

# This repository. scikit-learn is for examples/pytorch_digits.py (its data set ships with it).
WORKDIR /opt/pipe_horovod
COPY . /opt/pipe_horovod
RUN pip install --no-cache-dir . scikit-learn

CMD ["pipe-horovod", "check"]
