#!/usr/bin/env bash
# Makes sure a Docker daemon answers: the one already running, or one started
# here from Debian's docker.io (installed with apt-get when missing) where the
# machine allows it (root). Started with neither iptables nor a bridge, so it
# works inside a sandbox; containers then use `--network host`.
# Usage: docker_daemon.sh [LOG]. Exit 0 when a daemon answers, else 1 with one line why.
set -euo pipefail
log=${1:-/tmp/pipe-horovod-dockerd.log}
answers() { timeout 20 docker info >/dev/null 2>&1; }
if command -v docker >/dev/null && answers; then exit 0; fi
[ "$(id -u)" = 0 ] || { echo "no Docker daemon answers, and starting one needs root (or start Docker yourself)" >&2; exit 1; }
if ! command -v dockerd >/dev/null; then
  command -v apt-get >/dev/null || { echo "no Docker daemon answers and no dockerd to start (install Docker; apt-get is not here)" >&2; exit 1; }
  echo "installing Debian's docker.io with apt-get"
  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends docker.io; } \
    >"$log.apt" 2>&1 || { echo "apt-get install docker.io failed (log: $log.apt)" >&2; exit 1; }
fi
echo "starting dockerd (log: $log)"
nohup dockerd --iptables=false --ip6tables=false --bridge=none --storage-driver=overlay2 >"$log" 2>&1 &
for _ in $(seq 60); do
  if answers; then exit 0; fi
  kill -0 $! 2>/dev/null || break
  sleep 1
done
echo "dockerd did not start; its last lines ($log):" >&2
tail -n 5 "$log" | sed 's/^/    /' >&2
exit 1
