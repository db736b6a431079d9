# pipe_horovod for GPU clusters: PyTorch (CUDA), TensorFlow + Keras 3, Horovod
# (NCCL ops, MPI and Gloo controllers), Open MPI, sshd, and this package.
#
#   make image                      # builds and tests it (scripts/image.sh)
#   docker build -t pipe-horovod .  # by hand; behind a TLS proxy add
#                                   #   --secret id=ca,src=/path/to/ca-bundle.crt
#   docker run --rm --gpus all pipe-horovod                  # runs `pipe-horovod check`
#   docker run --rm --gpus all pipe-horovod \
#       horovodrun -np 2 -H localhost:2 python examples/pytorch_digits.py
#
# No CUDA base image: the CUDA runtime, cuDNN and NCCL come with torch's
# wheels from PyPI, and the compiler Horovod's NCCL ops need (nvcc) from
# PyPI's CUDA toolkit wheels, pinned to torch's CUDA version, in a build stage
# that the runtime image leaves behind; so is the C compiler, which builds the
# int8/fp8 codec's kernels there for the image (PIPE_HOROVOD_NATIVE_LIBRARY). Any Debian or Ubuntu base with
# Python >= 3.10 works; no GPU is needed to build. Two nodes, Kubernetes:
# docs/getting-started.md#docker.
#
# Needs BuildKit (secret and cache mounts): Docker >= 23, or DOCKER_BUILDKIT=1.

# Debian 12: Python 3.11. ubuntu:22.04 (3.10) and ubuntu:24.04 (3.12) work too.
ARG BASE_IMAGE=debian:bookworm-slim
# Both stages install it: Horovod is compiled against the torch it runs with.
ARG TORCH_VERSION=2.13.0

# ---- system: what both stages need ----
FROM ${BASE_IMAGE} AS system
# Open MPI refuses root unless told; in containers its shared-memory transport
# cannot use cross-memory attach (no ptrace capability), so it copies instead.
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    OMPI_ALLOW_RUN_AS_ROOT=1 \
    OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    OMPI_MCA_btl_vader_single_copy_mechanism=none
SHELL ["/bin/bash", "-euo", "pipefail", "-c"]
# Python from the base's own archive; OpenSSH: horovodrun/mpirun start the
# workers of other nodes over ssh, and Kubeflow's MPIJob runs sshd in them.
RUN command -v apt-get >/dev/null \
        || { echo "BASE_IMAGE must be Debian or Ubuntu (apt-get); this one has no apt-get" >&2; exit 1; } \
    && apt-get update -q \
    && apt-get install -y -q --no-install-recommends ca-certificates python3 python3-venv \
        openssh-client openssh-server openmpi-bin \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -c "import sys; v = sys.version_info; sys.exit(0 if v >= (3, 10) else \
f'BASE_IMAGE has Python {v[0]}.{v[1]}; pipe_horovod needs 3.10 or newer: use e.g. debian:bookworm-slim, ubuntu:22.04 or ubuntu:24.04')" \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:${PATH}
COPY scripts/with_build_ca.sh /opt/pipe_horovod/scripts/with_build_ca.sh

# ---- build: Horovod's wheel, compiled with NCCL ops ----
FROM system AS build
ARG TORCH_VERSION
ARG HOROVOD_VERSION=0.28.1
# The CUDA version torch's wheel is built for; the build stops if they differ.
ARG CUDA_VERSION=13.0
# GPU architectures Horovod's few CUDA kernels are compiled for (75 Turing,
# 80 A100, 86/89 Ampere/Ada cards, 90 H100/H200, 100 B200, 120 RTX
# Blackwell); CUDA 13 starts at 75. Fewer build faster.
ARG CUDA_CC_LIST=75,80,86,89,90,100,120
# CMake 4 rejects the old cmake_minimum_required of Horovod's third-party code.
ARG CMAKE_VERSION=3.31.6
RUN apt-get update -q \
    && apt-get install -y -q --no-install-recommends g++ make python3-dev libopenmpi-dev \
    && rm -rf /var/lib/apt/lists/*
RUN --mount=type=secret,id=ca --mount=type=cache,target=/root/.cache/pip \
    bash /opt/pipe_horovod/scripts/with_build_ca.sh \
        pip install -q "torch==${TORCH_VERSION}" numpy "cmake==${CMAKE_VERSION}" packaging psutil cloudpickle pyyaml wheel setuptools
COPY scripts/install_horovod.sh scripts/cuda_archs.sh scripts/cxx17 /opt/pipe_horovod/scripts/
# PIPE_HOROVOD_MPI=1 fails the build rather than silently leaving MPI out.
RUN --mount=type=secret,id=ca --mount=type=cache,target=/root/.cache/pip \
    PYTHON=python HOROVOD_VERSION="${HOROVOD_VERSION}" PIPE_HOROVOD_MPI=1 HOROVOD_GPU_OPERATIONS=NCCL \
    PIPE_HOROVOD_CUDA_VERSION="${CUDA_VERSION}" HOROVOD_BUILD_CUDA_CC_LIST="${CUDA_CC_LIST}" \
    PIPE_HOROVOD_CACHE=/tmp/horovod-cache \
        bash /opt/pipe_horovod/scripts/with_build_ca.sh bash /opt/pipe_horovod/scripts/install_horovod.sh \
    && horovodrun --check-build \
    && mkdir /wheels && mv /tmp/horovod-cache/wheels/*/horovod-*.whl /wheels/ \
    && rm -rf /tmp/horovod-cache
# The int8/fp8 codec's C kernels (pipe_horovod/compression/native.py), compiled
# here, where the compiler is, by native.py's own CLI and flags (native.py needs
# only the standard library, so it runs without the package). Only these two
# files are copied: a change elsewhere in the package leaves this cached, and a
# change to them rebuilds it in seconds, after Horovod's layers. Not in /wheels:
# the image's Horovod install mounts that, and would be rebuilt too.
COPY pipe_horovod/compression/native.py pipe_horovod/compression/cpu_kernels.c \
     /opt/pipe_horovod/pipe_horovod/compression/
RUN python /opt/pipe_horovod/pipe_horovod/compression/native.py /native/cpu_kernels.so

# ---- the image ----
FROM system AS pipe-horovod
ARG TORCH_VERSION
ARG TENSORFLOW_VERSION=2.21.0
ARG KERAS_VERSION=3.15.1
ARG SCIKIT_LEARN_VERSION=1.9.1
# The frameworks, and what the package and its examples need (pyproject.toml's
# dependencies; `pip check` below fails if one is missing). TensorFlow with its
# own CUDA libraries ([and-cuda]) for Keras's TensorFlow backend on GPUs.
# scikit-learn is for examples/*_digits.py (its data set ships with it).
RUN --mount=type=secret,id=ca --mount=type=cache,target=/root/.cache/pip \
    bash /opt/pipe_horovod/scripts/with_build_ca.sh \
        pip install -q "torch==${TORCH_VERSION}" "tensorflow[and-cuda]==${TENSORFLOW_VERSION}" \
        "keras==${KERAS_VERSION}" "scikit-learn==${SCIKIT_LEARN_VERSION}" numpy tqdm matplotlib \
        setuptools wheel
RUN --mount=type=secret,id=ca --mount=type=cache,target=/root/.cache/pip \
    --mount=type=bind,from=build,source=/wheels,target=/wheels \
    bash /opt/pipe_horovod/scripts/with_build_ca.sh pip install -q /wheels/horovod-*.whl

# The prebuilt kernels, loaded instead of compiling on first use (this stage has no
# compiler; without them the codec would run its slower torch form on CPU tensors).
COPY --from=build /native/cpu_kernels.so /opt/pipe_horovod/lib/cpu_kernels.so
ENV PIPE_HOROVOD_NATIVE_LIBRARY=/opt/pipe_horovod/lib/cpu_kernels.so

# The package, installed and checked before the user options and the rest of the
# repository, so that neither another USER_NAME nor a change outside the package
# (tests, docs, examples) runs this again. The build fails if the kernels above do not
# load (e.g. an ABI other than native.py's).
WORKDIR /opt/pipe_horovod
COPY pyproject.toml setup.py README.md /opt/pipe_horovod/
COPY pipe_horovod /opt/pipe_horovod/pipe_horovod
RUN pip install -q --no-deps --no-build-isolation . && pip check \
    && pipe-horovod check --engine horovod --controller mpi --ops nccl --framework keras \
    && python -c "import sys; from pipe_horovod.compression import native; \
sys.exit(native.library() is None and native.status())"

# Declared here, not above: a RUN after an ARG is rebuilt when the ARG changes.
# USER_NAME=root (default) or a user created with USER_UID; sshd then listens
# on SSH_PORT as that user, so pick a port above 1023 (e.g. 2222).
ARG USER_NAME=root
ARG USER_UID=1000
ARG SSH_PORT=22
# ssh between the containers of a job without a prompt (as Horovod's image
# does); UserKnownHostsFile and StrictModes: the MPI Operator mounts the keys
# read-only from a Secret.
RUN mkdir -p /var/run/sshd \
    && sed -i '/StrictHostKeyChecking/d; /UserKnownHostsFile/d' /etc/ssh/ssh_config \
    && printf '    StrictHostKeyChecking no\n    UserKnownHostsFile /dev/null\n    Port %s\n' \
        "${SSH_PORT}" >> /etc/ssh/ssh_config \
    && sed -i 's/^#\?StrictModes .*/StrictModes no/; s/^#\?Port .*/Port '"${SSH_PORT}"'/' \
        /etc/ssh/sshd_config
# The non-root option: its own sshd configuration (host key and pid file in
# its home), the layout the MPI Operator's non-root images use.
RUN if [ "${USER_NAME}" != root ]; then \
        useradd --create-home --uid "${USER_UID}" --shell /bin/bash "${USER_NAME}" \
        && home=$(getent passwd "${USER_NAME}" | cut -d: -f6) \
        && printf 'Port %s\nPidFile %s/sshd.pid\nHostKey %s/.ssh/id_rsa\nStrictModes no\n' \
            "${SSH_PORT}" "$home" "$home" > "$home/.sshd_config" \
        && chown -R "${USER_NAME}" "$home" /opt/pipe_horovod; \
    fi

# This repository last, so that a change to it rebuilds only this layer, which runs
# nothing.
COPY --chown=${USER_NAME} . /opt/pipe_horovod
USER ${USER_NAME}

CMD ["pipe-horovod", "check"]
