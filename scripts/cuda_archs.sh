# Sourced by scripts/image.sh and scripts/install_horovod.sh: the one rule for the
# GPU architectures Horovod's kernels may be built for. CUDA 13 (the image's, and
# torch's CUDA builds') dropped everything below compute capability 7.5 (Turing).
CUDA_MIN_CC=75

# cuda_cc_problem NAME LIST: prints why LIST (comma-separated compute capabilities,
# as in "75,80,90", from the variable NAME) cannot be built, or nothing when every
# entry can; a caller dies with that line.
cuda_cc_problem() {
  local name=$1 list=$2 cc
  for cc in ${list//,/ }; do
    if ! [[ $cc =~ ^[0-9]+$ ]] || [ "$cc" -lt "$CUDA_MIN_CC" ]; then
      echo "$name=$list: CUDA 13 compiles for compute capability $CUDA_MIN_CC (Turing) and newer, not '$cc'"
      return
    fi
  done
}
