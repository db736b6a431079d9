#!/usr/bin/env bash
# A Debian base image without a registry: debootstrap (minbase) from the
# Debian mirror apt already uses, imported into Docker. For machines that
# reach a package mirror but no image registry.
# Usage: debian_base.sh SUITE TAG LOG
set -euo pipefail
suite=$1 tag=$2 log=$3
[ "$(id -u)" = 0 ] || { echo "making a base with debootstrap needs root; or pass BASE_IMAGE=<a Debian/Ubuntu image you have>" >&2; exit 1; }
if ! command -v debootstrap >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends debootstrap >"$log" 2>&1 \
    || { echo "apt-get install debootstrap failed (log: $log)" >&2; exit 1; }
fi
# The first Debian mirror of apt's own sources (deb822 or one-line format).
mirror=$(grep -hE '^(URIs:|deb )' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null \
         | grep -oE 'https?://[^ ]+/debian/?' | head -n 1 || true)
mirror=${mirror:-http://deb.debian.org/debian}
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase "$suite" "$root" "$mirror" >>"$log" 2>&1 \
  || { echo "debootstrap $suite from $mirror failed; its last lines ($log):" >&2; tail -n 5 "$log" >&2; exit 1; }
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | docker import - "$tag" >/dev/null
echo "made $tag ($suite from $mirror)"
