# pipe_horovod for GPU clusters: CUDA + NCCL + Open MPI + PyTorch + TensorFlow/Keras
# + Horovod (NCCL ops, MPI and Gloo controllers) + this package, with sshd for
# `horovodrun -H` / `mpirun` across nodes and Kubeflow's MPIJob.
#
#   docker build -t pipe-horovod .
#   docker run --rm --gpus all pipe-horovod                  # runs `pipe-horovod check`
#   docker run --rm --gpus all pipe-horovod \
#       horovodrun -np 2 -H localhost:2 python examples/pytorch_digits.py
#
# Two nodes, the way Horovod's own image is used: README.md ("Clusters") and
# docs/getting-started.md#docker-not-run-here.
# Not built on the project's own machines (no Docker engine there); what can be
# checked without one (stages, arguments, the scripts it runs) is checked by
# tests/test_deploy.py.
#
# The CUDA major version of the base image must match the torch wheel's:
# torch==2.13.0 from PyPI is built for CUDA 13.0 (it depends on
# cuda-toolkit==13.0.*, nvidia-nccl-cu13, nvidia-cudnn-cu13), so Horovod's
# CUDA parts are compiled with a 13.0 toolkit too. A build step below stops
# with a clear message if the two disagree. The torch wheel brings its own
# cuDNN, so the plain `devel` image is enough (no `cudnn-devel` needed).
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-devel-ubuntu22.04
FROM ${CUDA_IMAGE} AS pipe-horovod

# GPU architectures Horovod's few CUDA kernels are compiled for
# (80 A100, 86/89 Ampere/Ada workstation cards, 90 H100/H200, 100 B200,
# 120 RTX Blackwell). CUDA 13 supports 75 and newer. Fewer = faster build.
ARG CUDA_CC_LIST=80,86,89,90,100,120
ARG PYTHON_VERSION=3.11
ARG TORCH_VERSION=2.13.0
ARG TENSORFLOW_VERSION=2.21.0
ARG KERAS_VERSION=3.15.1
ARG HOROVOD_VERSION=0.28.1
# CMake 4 rejects the old cmake_minimum_required of Horovod's third-party code;
# Ubuntu 22.04's 3.22 is older than CUDA 13 supports.
ARG CMAKE_VERSION=3.31.6
ARG SCIKIT_LEARN_VERSION=1.9.1
# USER_NAME=root (default) or a user created with USER_UID; sshd then listens
# on SSH_PORT as that user, so pick a port above 1023 (e.g. 2222).
ARG USER_NAME=root
ARG USER_UID=1000
ARG SSH_PORT=22

# Open MPI refuses root unless told; in containers its shared-memory transport
# cannot use cross-memory attach (no ptrace capability), so it copies instead.
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    OMPI_ALLOW_RUN_AS_ROOT=1 \
    OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    OMPI_MCA_btl_vader_single_copy_mechanism=none

SHELL ["/bin/bash", "-euo", "pipefail", "-c"]

# System packages: Python (+ -dev for Horovod's build, + -venv) from Ubuntu's
# archive; OpenSSH: horovodrun/mpirun start workers on other hosts over ssh,
# and Kubeflow's MPIJob runs sshd in the worker pods; g++ and make for the build.
RUN apt-get update && apt-get install -y --no-install-recommends \
        build-essential ca-certificates \
        python${PYTHON_VERSION} python${PYTHON_VERSION}-dev python${PYTHON_VERSION}-venv \
        openssh-client openssh-server \
    && rm -rf /var/lib/apt/lists/*

# Open MPI (mpirun, mpicxx) with the script `make` uses.
COPY scripts/install_openmpi.sh /opt/pipe_horovod/scripts/install_openmpi.sh
RUN bash /opt/pipe_horovod/scripts/install_openmpi.sh && rm -rf /var/lib/apt/lists/*

# NCCL: the CUDA devel images ship libnccl2 + libnccl-dev (apt-held at the
# version matching their CUDA). Install them only if a base image lacks them.
# Horovod links NCCL statically by default (HOROVOD_NCCL_LINK=STATIC), so its
# copy does not clash with the NCCL that the torch wheel loads.
RUN if [ ! -f /usr/include/nccl.h ]; then \
        apt-get update && apt-get install -y --no-install-recommends libnccl2 libnccl-dev \
        && rm -rf /var/lib/apt/lists/*; \
    fi; \
    grep -E '^#define NCCL_(MAJOR|MINOR|PATCH)' /usr/include/nccl.h

# ssh between the containers of a job without a prompt (as Horovod's image
# does); UserKnownHostsFile and StrictModes: the MPI Operator mounts the keys
# read-only from a Secret.
RUN mkdir -p /var/run/sshd \
    && sed -i '/StrictHostKeyChecking/d; /UserKnownHostsFile/d' /etc/ssh/ssh_config \
    && printf '    StrictHostKeyChecking no\n    UserKnownHostsFile /dev/null\n    Port %s\n' \
        "${SSH_PORT}" >> /etc/ssh/ssh_config \
    && sed -i 's/^#\?StrictModes .*/StrictModes no/; s/^#\?Port .*/Port '"${SSH_PORT}"'/' \
        /etc/ssh/sshd_config

# Everything Python lives in one virtual environment, first on PATH.
RUN python${PYTHON_VERSION} -m venv /opt/venv
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

# TensorFlow with its own CUDA libraries from PyPI ([and-cuda]), for the Keras adapter
# (which talks to the torch-based engines, so Horovod's TensorFlow ops are not built).
RUN pip install --no-cache-dir "tensorflow[and-cuda]==${TENSORFLOW_VERSION}" "keras==${KERAS_VERSION}"

# Horovod from source with the script `make` uses: PIPE_HOROVOD_MPI=1 fails
# the build rather than silently leaving MPI out. The CUDA driver
# (libcuda.so.1) only exists at run time, mounted by the NVIDIA container
# toolkit: link and check against the toolkit's stubs, then drop them from the
# loader cache again (as Horovod's own image does).
COPY scripts/install_horovod.sh scripts/cxx17 /opt/pipe_horovod/scripts/
RUN pip install --no-cache-dir "cmake==${CMAKE_VERSION}" packaging psutil cloudpickle pyyaml \
    && ldconfig /usr/local/cuda/targets/x86_64-linux/lib/stubs \
    && PYTHON=python HOROVOD_VERSION="${HOROVOD_VERSION}" PIPE_HOROVOD_MPI=1 \
       HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_CUDA_HOME=/usr/local/cuda \
       HOROVOD_BUILD_CUDA_CC_LIST="${CUDA_CC_LIST}" PIPE_HOROVOD_CACHE=/tmp/horovod-cache \
       bash /opt/pipe_horovod/scripts/install_horovod.sh \
    && rm -rf /tmp/horovod-cache \
    && horovodrun --check-build \
    && ldconfig

# This repository, installed. scikit-learn is for examples/*_digits.py (its data set ships with it).
WORKDIR /opt/pipe_horovod
COPY . /opt/pipe_horovod
RUN pip install --no-cache-dir . "scikit-learn==${SCIKIT_LEARN_VERSION}" \
    && ldconfig /usr/local/cuda/targets/x86_64-linux/lib/stubs \
    && pipe-horovod check --engine horovod --controller mpi --ops nccl --framework keras \
    && ldconfig

# The non-root option: its own sshd configuration (host key and pid file in
# its home), the layout the MPI Operator's non-root images use.
RUN if [ "${USER_NAME}" != root ]; then \
        useradd --create-home --uid "${USER_UID}" --shell /bin/bash "${USER_NAME}" \
        && home=$(getent passwd "${USER_NAME}" | cut -d: -f6) \
        && printf 'Port %s\nPidFile %s/sshd.pid\nHostKey %s/.ssh/id_rsa\nStrictModes no\n' \
            "${SSH_PORT}" "$home" "$home" > "$home/.sshd_config" \
        && chown -R "${USER_NAME}" "$home" /opt/pipe_horovod; \
    fi
USER ${USER_NAME}

CMD ["pipe-horovod", "check"]
