#!/usr/bin/env bash
# Installs Slurm (Debian's slurm-wlm: slurmctld, slurmd, the client commands,
# the PMIx plugin), munge and runc, which tests/test_slurm.py runs as a two-node
# cluster on this machine (tests/slurm_cluster.py: its own key, config and
# daemons; the packages' system services are not used). Optional: where
# this machine does not allow it (not root, no apt-get) it says so and exits
# 0, and the Slurm tests skip, naming the reason.
set -euo pipefail
# runc: the OCI runtime Slurm's --container calls (oci.conf), to run our image in its jobs.
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
   && command -v runc >/dev/null; then
  echo "Slurm: $(slurmctld -V 2>/dev/null), munge and runc already installed"
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "Slurm not installed (needs root and apt-get; or install slurm-wlm and munge yourself):" \
       "tests/test_slurm.py will skip"
  exit 0
fi
echo "Installing Slurm, munge and runc (slurm-wlm munge runc) with apt-get"
apt-get update -q
DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm munge runc
slurmctld -V
