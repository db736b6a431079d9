#!/usr/bin/env bash
# The ends of the ranges pyproject.toml declares, tested: one virtual
# environment per combination below, each with a fast subset of the suite.
# The full suite runs on the versions constraints.txt pins (`make test`);
# this checks that the oldest and newest versions we claim still work.
#
#   scripts/compat.sh              every combination
#   scripts/compat.sh oldest       the named ones
#   scripts/compat.sh --install-only oldest
#
# The subset: the one-process oracle at K=1, 2, 3 (tests/test_optimizer.py,
# tests/test_staleness.py), a 2-rank torchrun launch against the oracle, the
# digits example under python and torchrun, the package without Horovod
# (Horovod is never installed here), and the Keras oracle on both backends
# where TensorFlow installs. Each environment is kept under $COMPAT_DIR
# (default ~/.cache/pipe_horovod/compat) and reused; delete it to start over.
# Results: one line per combination at the end, pytest's log and JUnit XML
# beside each environment. docs/compatibility.md records the last run.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
root=${COMPAT_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pipe_horovod/compat}

# name | Python | what pip installs beside `-e .[test,keras]`
COMBOS=(
  # Oldest: torch 2.1 (register_post_accumulate_grad_hook), built against NumPy 1;
  # TensorFlow 2.16, the first to take Keras 3, with the first Keras 3.
  "oldest|3.10|torch==2.1.0 numpy<2 tensorflow-cpu==2.16.2 keras==3.0.5"
  # Newest: the newest torch pip installs here, the full tensorflow package
  # (not the CPU flavour), the newest Keras.
  "newest|3.13|torch==2.14.1 tensorflow==2.21.0 keras==3.15.1"
)

# Two pytest runs, so a crash in one costs the other nothing: collecting
# tests/test_keras.py imports TensorFlow, and a triton imported after
# TensorFlow >= 2.20 segfaults (tensorflow#124205; tests/conftest.py imports
# triton first, and the torch tests run apart from TensorFlow anyway).
TORCH_TESTS=(
  "tests/test_optimizer.py::test_single_process_matches_oracle"
  "tests/test_optimizer.py::test_matches_single_process_oracle[torch-2-features]"
  "tests/test_optimizer.py::test_digits_example_runs_under_each_launcher"
  "tests/test_staleness.py::test_every_option_matches_its_oracle_and_resumes_exactly[local-1]"
  "tests/test_staleness.py::test_lookahead_on_one_rank_is_synchronous_sgd"
  "tests/test_without_horovod.py"
)
KERAS_TESTS=(
  "tests/test_keras.py::test_fit_matches_the_reference[local-1-tensorflow]"
  "tests/test_keras.py::test_fit_matches_the_reference[local-1-torch]"
  "tests/test_keras.py::test_fit_matches_the_reference[torch-2-tensorflow]"
)

install_only=0
names=()
for arg in "$@"; do
  case "$arg" in
    --install-only) install_only=1 ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) names+=("$arg") ;;
  esac
done

# The interpreter for "3.10": pyenv's newest 3.10.x when pyenv is here, else python3.10 on PATH.
find_python() {
  local want=$1 version
  if command -v pyenv >/dev/null; then
    version=$(pyenv versions --bare | grep -E "^${want//./\\.}\.[0-9]+$" | sort -V | tail -1)
    if [ -n "$version" ]; then echo "$(pyenv root)/versions/$version/bin/python$want"; return; fi
  fi
  command -v "python$want" || true
}

# Installs combination $1 into $root/$1; prints nothing on success but pip's errors.
install() {
  local name=$1 want=$2 reqs=$3 venv="$root/$1" py
  py=$(find_python "$want")
  [ -n "$py" ] || { echo "$name: no Python $want (pyenv install $want, or put python$want on PATH)" >&2; return 1; }
  if [ ! -x "$venv/bin/python" ]; then
    "$py" -m venv "$venv" || return 1
    "$venv/bin/python" -m pip install -q --upgrade pip || return 1
  fi
  echo "$name: installing into $venv: $reqs (log: $venv/install.log)"
  # shellcheck disable=SC2086  # $reqs is a list of requirements
  "$venv/bin/python" -m pip install --upgrade-strategy only-if-needed \
      -e "$repo[test,keras]" $reqs >"$venv/install.log" 2>&1 \
    || { tail -30 "$venv/install.log" >&2; echo "$name: pip install failed" >&2; return 1; }
}

# Runs the subset in combination $1; prints its one-line result.
run_tests() {
  local name=$1 venv="$root/$1" start status=0 part selection
  start=$(date +%s)
  : >"$venv/pytest.log"
  for part in torch keras; do
    if [ "$part" = torch ]; then selection=("${TORCH_TESTS[@]}"); else selection=("${KERAS_TESTS[@]}"); fi
    rm -f "$venv/junit-$part.xml"
    (cd "$repo" && "$venv/bin/python" -m pytest -p no:cacheprovider -q -o addopts="" \
        --junitxml="$venv/junit-$part.xml" "${selection[@]}") >>"$venv/pytest.log" 2>&1 \
      || status=$?
  done
  "$venv/bin/python" - "$name" "$(( $(date +%s) - start ))" "$status" \
      "$venv/junit-torch.xml" "$venv/junit-keras.xml" <<'PYEOF'
import importlib.metadata as md
import os
import platform
import sys
import xml.etree.ElementTree as ET

name, seconds, status, *paths = sys.argv[1:]
n = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
for path in paths:
    if not os.path.exists(path):        # pytest died (a crash): count the run as one error
        n["tests"] += 1
        n["errors"] += 1
        continue
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    for k in n:
        n[k] += int(suite.get(k, 0))
passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]


def version(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "-"


tf = next((f"{d} {version(d)}" for d in ("tensorflow", "tensorflow-cpu") if version(d) != "-"),
          "no TensorFlow")
print(f"| {name} | {platform.python_version()} | {version('torch')} | {version('numpy')} | "
      f"{tf} | {version('keras')} | {passed} passed, {n['failures'] + n['errors']} failed, "
      f"{n['skipped']} skipped | {int(seconds) // 60} min {int(seconds) % 60} s | "
      f"pytest exit {status} |")
PYEOF
}

mkdir -p "$root"
results=()
overall=0
for combo in "${COMBOS[@]}"; do
  IFS='|' read -r name want reqs <<<"$combo"
  if [ ${#names[@]} -gt 0 ] && [[ ! " ${names[*]} " == *" $name "* ]]; then continue; fi
  if ! install "$name" "$want" "$reqs"; then overall=1; continue; fi
  [ "$install_only" = 1 ] && continue
  echo "$name: running $(( ${#TORCH_TESTS[@]} + ${#KERAS_TESTS[@]} )) test selections (log: $root/$name/pytest.log)"
  line=$(run_tests "$name") || overall=1
  grep -q "pytest exit 0 |" <<<"$line" || { overall=1; tail -40 "$root/$name/pytest.log"; }
  results+=("$line")
done
if [ ${#results[@]} -gt 0 ]; then
  echo
  echo "| combination | Python | torch | NumPy | TensorFlow | Keras | tests | time | |"
  echo "|---|---|---|---|---|---|---|---|---|"
  printf '%s\n' "${results[@]}"
fi
exit "$overall"
