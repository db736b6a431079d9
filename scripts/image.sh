#!/usr/bin/env bash
# `make image`: builds the Docker image from the Dockerfile, then tests it
# (tests/test_image.py: `pipe-horovod check` and the digits job in one
# container; two containers as two nodes over ssh). What a machine lacks, it
# provides where it may (root): a Docker daemon from Debian's docker.io, and,
# when the default base cannot be pulled (no registry), that base made with
# debootstrap. Builds on the host network (a daemon started here has no bridge). One progress line per stage; the full log in $LOG_DIR.
#
# Knobs (environment):
#   IMAGE          the tag to build (default pipe-horovod:latest)
#   BASE_IMAGE     the base (default: the Dockerfile's, debian:bookworm-slim)
#   CUDA_CC_LIST   GPU architectures for Horovod's kernels (default: the Dockerfile's)
#   BUILD_ARGS     more `docker build` arguments, e.g. "--build-arg USER_NAME=trainer"
#   BUILD_CA       a CA bundle for a TLS proxy, passed as a build secret
#                  (default: PIP_CERT or pip's own `cert` setting, when there is one)
#   IMAGE_TEST=0   build only
# Exit status: 0 built (and tested), 1 a failure, 3 this machine cannot build
# it (no Docker daemon it may start, or too little disk), said in one line.
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE=${IMAGE:-pipe-horovod:latest}
LOG_DIR=${LOG_DIR:-build/image}
DEBIAN_SUITE=bookworm
DEFAULT_BASE=debian:bookworm-slim
LOCAL_BASE=pipe-horovod-base:$DEBIAN_SUITE
mkdir -p "$LOG_DIR"
start=$SECONDS
die() { echo "make image: $*" >&2; exit 1; }
stage() { printf '[%4ds] %s\n' $(( SECONDS - start )) "$*"; }

source scripts/cuda_archs.sh
problem=$(cuda_cc_problem CUDA_CC_LIST "${CUDA_CC_LIST:-}")
[ -z "$problem" ] || die "$problem"

# ---- a Docker daemon, and room for the image ----
bash scripts/docker_daemon.sh "$LOG_DIR/dockerd.log" || exit 3
# The image (11.5 GB) and its build cache (pip's wheels, the build stage) take
# about 25 GB the first time; a full disk would fail the build far in.
NEED_GB=${NEED_GB:-25}
if ! docker image inspect "$IMAGE" >/dev/null 2>&1; then
  root=$(docker info --format '{{.DockerRootDir}}' 2>/dev/null || echo /var/lib/docker)
  free_gb=$(( $(df -Pk "$root" 2>/dev/null | awk 'NR == 2 {print $4}' || echo 0) / 1048576 ))
  if [ "$free_gb" -lt "$NEED_GB" ]; then
    echo "make image: building $IMAGE needs about $NEED_GB GB free under $root; $free_gb GB are" >&2
    exit 3
  fi
fi

# BuildKit (secret and cache mounts): a client with buildx, or a pre-23 client
# (Debian's docker.io is 20.10) that has it built in under DOCKER_BUILDKIT=1.
build=()
for client in docker /usr/bin/docker; do
  command -v "$client" >/dev/null || continue
  if "$client" buildx version >/dev/null 2>&1; then build=("$client" buildx build --load); break; fi
  major=$("$client" version --format '{{.Client.Version}}' 2>/dev/null | cut -d. -f1)
  if [[ $major =~ ^[0-9]+$ ]] && [ "$major" -lt 23 ]; then build=(env DOCKER_BUILDKIT=1 "$client" build); break; fi
done
[ ${#build[@]} -gt 0 ] || die "docker build needs BuildKit: install the buildx plugin (Debian: docker-buildx)"

# ---- the base ----
base=${BASE_IMAGE:-}
if [ -z "$base" ]; then
  if docker image inspect "$DEFAULT_BASE" >/dev/null 2>&1 \
     || timeout 60 docker pull -q "$DEFAULT_BASE" >"$LOG_DIR/pull.log" 2>&1; then
    base=$DEFAULT_BASE
  elif docker image inspect "$LOCAL_BASE" >/dev/null 2>&1; then
    base=$LOCAL_BASE
    stage "base: $DEFAULT_BASE cannot be pulled; using $LOCAL_BASE made earlier with debootstrap"
  else
    stage "base: $DEFAULT_BASE cannot be pulled ($(tail -n 1 "$LOG_DIR/pull.log")); making $LOCAL_BASE with debootstrap"
    bash scripts/debian_base.sh "$DEBIAN_SUITE" "$LOCAL_BASE" "$LOG_DIR/debootstrap.log"
    base=$LOCAL_BASE
  fi
fi

# ---- build ----
args=(--progress=plain --network host -t "$IMAGE" --build-arg "BASE_IMAGE=$base")
[ -z "${CUDA_CC_LIST:-}" ] || args+=(--build-arg "CUDA_CC_LIST=$CUDA_CC_LIST")
ca=${BUILD_CA:-${PIP_CERT:-$(pip config list 2>/dev/null | sed -n "s/^[^ ]*\.cert='\(.*\)'$/\1/p" | head -n 1)}}
if [ -n "$ca" ]; then
  [ -s "$ca" ] || die "BUILD_CA=$ca: no such file (the CA bundle of this network's TLS proxy)"
  args+=(--secret "id=ca,src=$ca")
fi
# shellcheck disable=SC2206 # BUILD_ARGS is a list of words by design
args+=(${BUILD_ARGS:-})
log="$LOG_DIR/build.log"
stage "build: $IMAGE from $base${CUDA_CC_LIST:+, CUDA_CC_LIST=$CUDA_CC_LIST} (log: $log)"
"${build[@]}" "${args[@]}" . >"$log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
# One line per Dockerfile step as BuildKit starts it ("#12 [build 5/7] RUN ...").
seen=""
while kill -0 "$pid" 2>/dev/null; do
  while IFS= read -r line; do
    id=${line%% *}
    case " $seen " in *" $id "*) continue ;; esac
    seen="$seen $id"
    step=${line#* }
    stage "  ${step:0:110}"
  done < <(grep -E '^#[0-9]+ \[[a-z-]+ +[0-9]+/[0-9]+\]' "$log" | grep -v ' CACHED$' || true)
  sleep 3
done
status=0
wait "$pid" || status=$?
trap - EXIT
if [ "$status" -ne 0 ]; then
  # The failed step's own last lines ("#8 12.3 <output>"), not BuildKit's summary of it.
  failed=$(grep -m 1 -oE '^#[0-9]+ ERROR' "$log" | cut -d' ' -f1 || true)
  echo "make image: the build failed${failed:+ at step $failed}; its last lines (full log: $log):" >&2
  if [ -n "$failed" ]; then grep -E "^$failed [0-9.]+ " "$log" | cut -d' ' -f3-; else cat "$log"; fi \
    | tail -n 15 | sed 's/^/    /' >&2
  exit 1
fi
size=$(docker image inspect --format '{{.Size}}' "$IMAGE")
stage "built $IMAGE: $(( size / 1000000 )) MB, in $(( SECONDS - start )) s"

# ---- test ----
if [ "${IMAGE_TEST:-1}" = 1 ]; then
  stage "test: tests/test_image.py on $IMAGE"
  PIPE_HOROVOD_IMAGE=$IMAGE "${PYTHON:-.venv/bin/python}" -m pytest -q tests/test_image.py
  stage "done in $(( SECONDS - start )) s"
fi
