#!/usr/bin/env bash
# `make test`: the whole suite, with its full output kept for when it fails.
#
# A failure seen once in three runs cannot be studied without its output, so
# every run writes pytest's complete log and a JUnit XML (with each test's
# captured output) under $PIPE_HOROVOD_TEST_LOGS (default .ci/artifacts),
# prints where they are, and on failure prints each failed test's full
# output again from the XML. The exit status is pytest's own: 5 ("no tests
# collected") fails as well. Arguments after the interpreter go to pytest.
#
# The suite runs on $PIPE_HOROVOD_TEST_WORKERS pytest-xdist workers (default 2; 0 runs it
# in this process): tests/conftest.py keeps each file, and the files sharing a launch,
# on one worker.
set -uo pipefail
PY=${1:?usage: run_tests.sh PYTHON [pytest arguments]}
shift
LOGS=${PIPE_HOROVOD_TEST_LOGS:-.ci/artifacts}
mkdir -p "$LOGS"
log="$LOGS/pytest.log"
xml="$LOGS/junit.xml"
echo "pytest: full log in $log, JUnit XML in $xml"
workers=${PIPE_HOROVOD_TEST_WORKERS:-2}
"$PY" -m pytest -n "$workers" --junitxml="$xml" -o junit_logging=all "$@" \
    2>&1 | tee "$log"
status=${PIPESTATUS[0]}
if [ "$status" -ne 0 ] && [ -s "$xml" ]; then
    "$PY" - "$xml" <<'PYEOF'
import sys
import xml.etree.ElementTree as ET

for case in ET.parse(sys.argv[1]).iter("testcase"):
    bad = [child for child in case if child.tag in ("failure", "error")]
    if not bad:
        continue
    print(f"\n===== {case.get('classname')}::{case.get('name')} ({case.get('time')} s) =====")
    for child in bad:
        print(f"--- {child.tag}: {child.get('message', '')[:500]}\n{child.text or ''}")
    for part in ("system-out", "system-err"):
        text = case.findtext(part)
        if text:
            print(f"--- {part}\n{text}")
PYEOF
fi
echo "pytest exited $status; full log: $log; JUnit XML: $xml"
exit "$status"
