#!/usr/bin/env bash
# Installs SimGrid's Python module for `pipe-horovod simulate` (pipe_horovod/tools/simulate):
# Debian's python3-simgrid, and a link to its one extension module in the venv given as $1
# (the venv's Python cannot see /usr/lib/python3/dist-packages, and a .pth file pointing
# there would bring every Debian Python package in with it). Optional: where this machine
# does not allow it (not root, no apt-get, no such package) it says so and exits 0, and
# only `pipe-horovod simulate` (and its tests, which skip) is missing.
set -euo pipefail
VENV=${1:?usage: install_simgrid.sh VENV}
PY="$VENV/bin/python"
if "$PY" -c "import simgrid" >/dev/null 2>&1; then
  VERSION=$("$PY" -c 'import simgrid; print(simgrid.simgrid_version)' 2>/dev/null | tail -1)
  echo "SimGrid $VERSION already importable"
  exit 0
fi
# Where Debian puts it (a variable so a test can point elsewhere).
DIST=${SIMGRID_DIST:-/usr/lib/python3/dist-packages}
module() { ls "$DIST"/simgrid.cpython-*.so 2>/dev/null | head -1; }
if [ -z "$(module)" ]; then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "SimGrid not installed (needs root and apt-get for Debian's python3-simgrid; or" \
         "pip install simgrid into $VENV): pipe-horovod simulate will say how"
    exit 0
  fi
  echo "Installing SimGrid (python3-simgrid) with apt-get"
  apt-get update -q
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends python3-simgrid; then
    echo "SimGrid not installed (apt-get has no python3-simgrid here; pip install simgrid" \
         "into $VENV builds it): pipe-horovod simulate will say how"
    exit 0
  fi
fi
SO=$(module)
SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['platlib'])")
# The module is built for the system Python's ABI tag (cpython-311): it loads in any 3.11.
if [ "$(basename "$SO" | cut -d. -f2)" != "$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("SOABI"))')" ]; then
  echo "SimGrid not linked into $VENV: $SO is for another Python than $PY;" \
       "pip install simgrid into $VENV builds one"
  exit 0
fi
ln -sf "$SO" "$SITE/"
"$PY" -c "import simgrid; print('SimGrid', simgrid.simgrid_version, 'importable from', simgrid.__file__)"
