#!/usr/bin/env bash
# Installs Open MPI (Debian's openmpi-bin and libopenmpi-dev) so that
# scripts/install_horovod.sh builds Horovod's MPI controller beside Gloo.
# Optional: where this machine does not allow it (not root, no apt-get) it
# says so and exits 0, and Horovod is built with Gloo only.
set -euo pipefail
if command -v mpicc >/dev/null && command -v mpirun >/dev/null; then
  echo "Open MPI: $(mpirun --version 2>/dev/null | head -1) already installed"
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "Open MPI not installed (needs root and apt-get; or install openmpi-bin and libopenmpi-dev yourself):" \
       "Horovod will be built with the Gloo controller only"
  exit 0
fi
echo "Installing Open MPI (openmpi-bin libopenmpi-dev) with apt-get"
apt-get update -q
DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends openmpi-bin libopenmpi-dev
mpirun --version | head -1
