#!/usr/bin/env python
"""Horovod drop-in compatibility harness (issue 8).

Runs Horovod's own `test/parallel/test_torch.py`, one test per
`horovodrun -np 2 -H localhost:2 --gloo python -m pytest ...`, under up to
three configurations:

  horovod   the file as it is, against Horovod itself;
  ours-k2   a copy whose only change is `import horovod.torch as hvd` ->
            `import pipe_horovod.torch as hvd`, with PIPE_HOROVOD_PIPELINE_DEPTH=2
            (K=2 from the first step: the default, tune="auto", would train
            Horovod's tests, all shorter than its 20 measured steps, at K=1);
  ours-k1   the same copy with PIPE_HOROVOD_PIPELINE_DEPTH=1.

Horovod's test code is never part of this repository: pass its path with
--tests, in Horovod's own layout (`../utils/common.py` beside it), e.g. from a
git clone of horovod/horovod:

    mkdir -p /tmp/horovod_tests
    git -C HOROVOD_GIT archive v0.28.1 test/parallel test/utils | tar -x -C /tmp/horovod_tests
    python scripts/horovod_compat.py --tests /tmp/horovod_tests/test/parallel/test_torch.py \
        --out docs/horovod_compatibility.json --markdown docs/horovod_compatibility.md

What those files import beyond pipe_horovod (mock, cloudpickle, ...) is the
`horovod-tests` extra, which `make install` installs; the run stops first,
naming the command, where one is missing (check_imports). Results go to a JSON
file that makes runs resumable (a test/configuration already there is not run
again unless --rerun), and --markdown renders the table with a summary.
"""
import argparse
import ast
import datetime
import difflib
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIGS = ("horovod", "ours-k2", "ours-k1")
CONFIG_TITLES = {"horovod": "Horovod", "ours-k2": "ours K=2", "ours-k1": "ours K=1"}
DEPTH_ENV = "PIPE_HOROVOD_PIPELINE_DEPTH"
STATUSES = ("PASS", "FAIL", "SKIP", "TIMEOUT")
NOTES_BEGIN, NOTES_END = "<!-- notes -->", "<!-- /notes -->"
# The Keras and TensorFlow suites' sections (scripts/horovod_compat_keras.py and
# scripts/horovod_compat_tensorflow.py write them; a render here keeps them).
KERAS_BEGIN, KERAS_END = "<!-- keras -->", "<!-- /keras -->"
TENSORFLOW_BEGIN, TENSORFLOW_END = "<!-- tensorflow -->", "<!-- /tensorflow -->"
SECTIONS = ((KERAS_BEGIN, KERAS_END), (TENSORFLOW_BEGIN, TENSORFLOW_END))

# Tests whose result differs by the design of pipelining at K=2 (they must
# pass with PIPE_HOROVOD_PIPELINE_DEPTH=1): test id -> why.
BY_DESIGN_K2 = {
    "TorchTests::test_gradient_clipping":
        "the test takes a single step and clips `.grad` after `synchronize()`; at K=2 the first step "
        "applies no gradient (w_{t+1} = w_t - lr*g_{t-1}), so `.grad` holds zeros and clipping cannot "
        "shrink it (`assert 0.0 > 0.0`). Passes at K=1.",
}


# --------------------------------------------------------------------------
# The one change made to Horovod's file

TORCH_MODULES = {"horovod.torch": "pipe_horovod.torch"}


def _import_patterns(module):
    m = re.escape(module)
    return (re.compile(rf"^(?P<indent>\s*)import\s+{m}(?P<sub>(?:\.\w+)*)\s+as\s+(?P<alias>\w+)\s*(?P<comment>#.*)?$"),
            re.compile(rf"^(?P<indent>\s*)from\s+{m}(?P<sub>(?:\.\w+)*)\s+import\s+(?P<names>.+)$"),
            re.compile(rf"^\s*import\s+{m}(?:\.\w+)*\s*(?:#.*)?$"))


def rewrite_imports(source, modules=TORCH_MODULES):
    """Point every import of each Horovod module in `modules` (and its submodules) at
    ours (`modules`: {horovod module: pipe_horovod module}, default `horovod.torch` ->
    `pipe_horovod.torch`); nothing else changes.

    Returns (new_source, changes) where changes is a list of
    (line_number, old_line, new_line). Raises ValueError for a bare
    `import horovod.torch` (its uses would need rewriting too, which is
    more than an import change), or when there is nothing to rewrite.
    """
    lines = source.splitlines(keepends=True)
    changes = []
    # Longest first: `horovod.tensorflow.keras` before a `horovod.tensorflow` in the map.
    patterns = [(module, ours, *_import_patterns(module))
                for module, ours in sorted(modules.items(), key=lambda kv: -len(kv[0]))]
    for i, line in enumerate(lines):
        body = line.rstrip("\r\n")
        ending = line[len(body):]
        new = None
        for module, ours, import_as, from_import, bare in patterns:
            if import_as.match(body) or from_import.match(body):
                new = re.sub(rf"\b{re.escape(module)}\b", ours, body, count=1)
                break
            if bare.match(body):
                raise ValueError(f"line {i + 1}: bare {body.strip()!r}: its uses would need rewriting too")
        if new is not None and new != body:
            changes.append((i + 1, body, new))
            lines[i] = new + ending
    if not changes:
        raise ValueError(f"no {' or '.join(f'`{m}`' for m in modules)} import to rewrite")
    return "".join(lines), changes


def import_diff(source, new_source, name="test_torch.py"):
    return "".join(difflib.unified_diff(source.splitlines(keepends=True),
                                        new_source.splitlines(keepends=True),
                                        f"a/{name}", f"b/{name}", n=0))


# --------------------------------------------------------------------------
# Reading horovodrun + pytest output

_RANK_LINE = re.compile(r"^\[(?P<rank>\d+)\]<(?:stdout|stderr)>:(?P<text>.*)$")
# pytest-subtests adds "N subtests passed" (TensorFlow's graph/eager halves): a failed
# subtest fails the test.
_SUMMARY = re.compile(r"^=*\s*(?P<body>(?:\d+ (?:subtests )?[a-z]+(?:, )?)+) in [\d.]+s"
                      r"(?: \([\d:]+\))?\s*=*\s*$")
_NO_TESTS = re.compile(r"^=*\s*no tests ran in [\d.]+s")
_COUNT = re.compile(r"(\d+) (?:subtests )?(passed|failed|skipped|errors?|xfailed|xpassed|"
                    r"deselected)")
_SHORT = re.compile(r"^(?:FAILED|ERROR) \S+(?: - (?P<msg>.*))?$")
_EXC_LINE = re.compile(r"\b(?:[A-Z]\w*(?:Error|Exception|Exit)|FatalError)\b(?::|$)")


def split_ranks(output):
    """Per-rank text (from horovodrun's `[N]<stdout>:` prefixes) and the
    launcher's own lines (key None)."""
    per = {}
    for line in output.splitlines():
        m = _RANK_LINE.match(line)
        key, text = (int(m.group("rank")), m.group("text")) if m else (None, line)
        per.setdefault(key, []).append(text)
    return per


def rank_outcome(lines):
    """'passed' / 'failed' / 'skipped' / 'error' from one rank's pytest
    summary line, or None when pytest never printed one (crash, kill)."""
    for text in reversed(lines):
        text = text.strip()
        if _NO_TESTS.match(text):
            return "error"
        m = _SUMMARY.match(text)
        if m:
            counts = Counter()
            for n, what in _COUNT.findall(m.group("body")):
                counts[what.rstrip("s") if what.startswith("error") else what] += int(n)
            if counts["failed"] or counts["error"]:
                return "failed"
            if counts["passed"] or counts["xfailed"] or counts["xpassed"]:
                return "passed"
            if counts["skipped"]:
                return "skipped"
            return "error"
    return None


def first_error(per_rank):
    """The first line that says what went wrong: pytest's short summary
    message, else the first `E   ` line, else an exception line, else the
    launcher's last words."""
    ranks = sorted(k for k in per_rank if k is not None)
    for rank in ranks:
        for text in per_rank[rank]:
            m = _SHORT.match(text.strip())
            if m and m.group("msg"):
                return m.group("msg").strip()
    for rank in ranks:
        for text in per_rank[rank]:
            if text.startswith("E   ") and text[4:].strip():
                return text[4:].strip()
    for key in ranks + [None]:
        for text in per_rank.get(key, []):
            if _EXC_LINE.search(text) and not text.lstrip().startswith(("File ", "raise ", "#")):
                return text.strip()
    launcher = [t.strip() for t in per_rank.get(None, []) if t.strip()]
    return launcher[-1] if launcher else None


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
_THREAD = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):")


def hang_location(per_rank):
    """From pytest's faulthandler dump (faulthandler_timeout): for the first
    rank that dumped, the innermost frame of the thread running the test,
    and the test line it was called from."""
    for rank in sorted(k for k in per_rank if k is not None):
        lines = per_rank[rank]
        if not any(t.startswith("Timeout (") for t in lines):
            continue
        blocks, current = [], None
        for text in lines:
            if _THREAD.match(text.strip()):
                current = []
                blocks.append(current)
            elif current is not None:
                m = _FRAME.match(text)
                if m:
                    current.append(m)
                elif text.strip():
                    current = None
        for frames in blocks:
            tests = [f for f in frames if os.path.basename(f["file"]).startswith("test_")]
            if frames and tests:
                inner, caller = frames[0], tests[0]
                where = f"{inner['func']} ({os.path.basename(inner['file'])}:{inner['line']})"
                return (f"rank {rank} hung in {where}, called from "
                        f"{os.path.basename(caller['file'])}:{caller['line']} {caller['func']}")
    return None


def parse_run(output, returncode, np=2, timed_out=False, timeout=None):
    """Classify one horovodrun run: (status, error line or None)."""
    per_rank = split_ranks(output)
    if timed_out:
        where = hang_location(per_rank)
        return "TIMEOUT", f"no result after {timeout:g} s" + (f"; {where}" if where else "; workers printed nothing")
    outcomes = [rank_outcome(per_rank.get(r, [])) for r in range(np)]
    if any(o in ("failed", "error") for o in outcomes):
        return "FAIL", first_error(per_rank)
    if all(o == "skipped" for o in outcomes):
        return "SKIP", None
    if all(o in ("passed", "skipped") for o in outcomes):
        if returncode == 0:
            return "PASS", None
        return "FAIL", f"tests passed but horovodrun exited with {returncode}" + (
            f": {first_error(per_rank)}" if first_error(per_rank) else "")
    missing = [r for r, o in zip(range(np), outcomes) if o is None]
    err = first_error(per_rank)
    return "FAIL", f"rank(s) {missing} printed no pytest result (exit {returncode})" + (f": {err}" if err else "")


# --------------------------------------------------------------------------
# Running

def horovodrun_command(horovodrun, python, test_id, np=2):
    """One test (`test_id`: a string), stopping at its failure; or a batch (a list of test
    ids), every test run and each one's outcome printed as it ends (`-v -s`: pytest's
    live lines, subtests' included, not swallowed by output capture) for parse_batch."""
    run = (["-x", "-q", "-rfEs", "-p", "no:cacheprovider", "-c", "pytest.ini", test_id]
           if isinstance(test_id, str) else
           ["-v", "-s", "-rfE", "-p", "no:cacheprovider", "-c", "pytest.ini", *test_id])
    return [horovodrun, "-np", str(np), "-H", f"localhost:{np}", "--gloo",
            python, "-m", "pytest", *run]


def config_env(config, base=None):
    env = dict(os.environ if base is None else base)
    env.pop(DEPTH_ENV, None)
    env.pop("PIPE_HOROVOD_ENGINE", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    env["COLUMNS"] = "400"  # pytest's short summary is cut at the terminal width
    if config.startswith("ours-k"):
        env[DEPTH_ENV] = config[len("ours-k"):]
    return env


def _kill_tree(proc):
    """SIGTERM then SIGKILL the process group we started and every
    descendant (Horovod's launcher puts workers in groups of their own)."""
    try:
        import psutil
        children = psutil.Process(proc.pid).children(recursive=True)
    except Exception:
        children = []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        for child in children:
            try:
                child.send_signal(sig)
            except Exception:
                pass
        try:
            proc.wait(timeout=10)
            if sig == signal.SIGTERM and not any(_alive(c) for c in children):
                return
        except subprocess.TimeoutExpired:
            pass


def _alive(p):
    try:
        return p.is_running() and p.status() != "zombie"
    except Exception:
        return False


def launch(cmd, workdir, env, timeout):
    """Run a launcher's command line in a session of its own, the whole tree killed at
    `timeout`: (output, exit code, timed out, seconds)."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace",
                            start_new_session=True)
    timed_out = False
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_tree(proc)
        output, _ = proc.communicate()
    return output, proc.returncode, timed_out, round(time.monotonic() - start, 1)


def write_log(log_dir, config, name, cmd, workdir, rc, output):
    if log_dir:
        log = Path(log_dir) / config / (name + ".log")
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(f"$ {shlex.join(cmd)}\n# cwd={workdir} config={config} rc={rc}\n{output}")


def run_one(workdir, test_id, config, horovodrun, python, timeout, np=2, log_dir=None):
    cmd = horovodrun_command(horovodrun, python, test_id, np)
    output, rc, timed_out, seconds = launch(cmd, workdir, config_env(config), timeout)
    status, error = parse_run(output, rc, np=np, timed_out=timed_out, timeout=timeout)
    write_log(log_dir, config, test_id.split("::")[-1], cmd, workdir, rc, output)
    return {"status": status, "error": error, "rc": rc, "seconds": seconds}


# --------------------------------------------------------------------------
# Several tests in one launch (--batch): TensorFlow's start-up is most of a run

_LIVE_OUTCOME = (r"(?P<sub>SUB)?(?P<outcome>PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)"
                 r"(?:\[(?P<mode>[^\]]+)\])?")
_LIVE = re.compile(r"^(?P<id>\S+\.py::\S+) " + _LIVE_OUTCOME)
# A test that prints (pytest -s) puts its output between its id (and the space after it)
# and its outcome, which then starts a line of its own.
_LIVE_START = re.compile(r"^(?P<id>\S+\.py::\S+) ")
_LIVE_LATE = re.compile(r"^" + _LIVE_OUTCOME + r"(?: \(.*\))?(?:\s+\[\s*\d+%\])?$")
_FAILURE_HEADER = re.compile(r"^_{3,} (?:ERROR at \w+ of )?(?P<name>[\w.]+)(?: \[(?P<mode>[^\]]+)\])? _{3,}$")
_OUTCOME = {"PASSED": "PASS", "XFAIL": "PASS", "XPASS": "PASS", "SKIPPED": "SKIP",
            "FAILED": "FAIL", "ERROR": "FAIL"}


def _combine(statuses):
    """Several ranks' (or modes') statuses as one: any failure fails; all skipped skips."""
    statuses = list(statuses)
    if any(s == "FAIL" for s in statuses):
        return "FAIL"
    return "SKIP" if statuses and all(s == "SKIP" for s in statuses) else "PASS"


def parse_batch(output, test_ids, np=2, timed_out=False, timeout=None):
    """Per-test results of one launch of several tests (horovodrun_command with a list):
    {test key: {"status", "error", "modes"}}, from each rank's live `-v` lines. `modes`
    holds the subtests' outcomes ({"graph_mode": {...}, "eager_mode": {...}} for a
    TensorFlow test under `run_all_in_graph_and_eager_modes`), each with its first `E`
    line from the failures section. A test some rank never finished is left out (a later
    run does it), except the one that was running at a timeout: TIMEOUT, with where it hung."""
    per_rank = split_ranks(output)
    seen = {}          # key -> {rank: {"outcome": status, "modes": {mode: status}}}
    errors = {}        # (Class.test, mode or None) -> first E line
    for rank in range(np):
        failure = running = None     # running: the test whose output is being printed
        for text in per_rank.get(rank, []):
            m = _LIVE.match(text.strip())
            test = m and m["id"]
            if not m and running:
                m, test = _LIVE_LATE.match(text.strip()), running
            if m:
                running = None
                entry = seen.setdefault(test_key(test), {}).setdefault(rank, {"modes": {}})
                status = _OUTCOME[m["outcome"]]
                if m["sub"]:
                    entry["modes"][m["mode"]] = _combine([entry["modes"].get(m["mode"], status), status])
                else:
                    entry["outcome"] = status
                continue
            m = _LIVE_START.match(text)
            if m:
                running = m["id"]
                continue
            if text.startswith("="):       # a section of pytest's summary: no test runs
                running = None
            m = _FAILURE_HEADER.match(text.strip())
            if m:
                failure = (m["name"].replace(".", "::"), m["mode"])
            elif failure and text.startswith("E   ") and text[4:].strip() and failure not in errors:
                errors[failure] = text[4:].strip()
    results = {}
    for tid in test_ids:
        key = test_key(tid)
        ranks = seen.get(key, {})
        if len(ranks) < np or any("outcome" not in r for r in ranks.values()):
            continue
        modes = {}
        for mode in sorted({m for r in ranks.values() for m in r["modes"]}):
            status = _combine(r["modes"].get(mode, "SKIP") for r in ranks.values())
            modes[mode] = {"status": status, "error": errors.get((key, mode)) if status == "FAIL" else None}
        outcome = _combine(r["outcome"] for r in ranks.values())
        if modes:   # the test's own outcome only says it ran; its subtests say how
            outcome = _combine([m["status"] for m in modes.values()] + ([outcome] if outcome == "FAIL" else []))
        error = None
        if outcome == "FAIL":
            error = errors.get((key, None)) or next((m["error"] for m in modes.values() if m["error"]), None)
        results[key] = {"status": outcome, "error": error, **({"modes": modes} if modes else {})}
    if timed_out:
        running = next((test_key(t) for t in test_ids if test_key(t) not in results), None)
        if running:
            where = hang_location(per_rank)
            results[running] = {"status": "TIMEOUT", "error": f"no result after {timeout:g} s"
                                + (f"; {where}" if where else "")}
    return results


def run_batch(workdir, test_ids, config, horovodrun, python, timeout, np=2, log_dir=None):
    """Several tests in one launch: {test key: result}, as run_one's per test, plus the
    batch's size; parse_batch says what a crash or a timeout leaves out."""
    cmd = horovodrun_command(horovodrun, python, list(test_ids), np)
    output, rc, timed_out, seconds = launch(cmd, workdir, config_env(config), timeout)
    write_log(log_dir, config, f"batch_{test_key(test_ids[0]).split('::')[-1]}_{len(test_ids)}",
              cmd, workdir, rc, output)
    results = parse_batch(output, test_ids, np=np, timed_out=timed_out, timeout=timeout)
    return {key: {**res, "rc": rc, "seconds": seconds, "batch": len(test_ids)}
            for key, res in results.items()}


def common_helpers(common_source, test_source):
    """Horovod's `test/utils/common.py` cut to the functions the test file imports
    (`from common import a, b`) and the standard-library imports: the whole module
    imports `mock`, `cloudpickle` and Horovod's runner, which a test of ours needs not."""
    wanted = set()
    for node in ast.walk(ast.parse(test_source)):
        if isinstance(node, ast.ImportFrom) and node.module == "common":
            wanted |= {a.name for a in node.names}
    keep = []
    for node in ast.parse(common_source).body:
        if isinstance(node, ast.Import) and all(a.name.split(".")[0] in sys.stdlib_module_names
                                                for a in node.names):
            keep.append(ast.get_source_segment(common_source, node))
        elif isinstance(node, ast.FunctionDef) and node.name in wanted:
            keep.append(ast.get_source_segment(common_source, node))
            wanted.discard(node.name)
    if wanted:
        raise ValueError(f"common.py has no {sorted(wanted)}")
    return "\n\n".join(keep) + "\n"


# What Horovod's test files import that pipe_horovod does not need (mock, cloudpickle,
# parameterized, packaging): pyproject.toml's `horovod-tests` extra, which `make install`
# installs; horovod itself comes from scripts/install_horovod.sh.
INSTALL = "pip install -c constraints.txt -e '.[horovod-tests]'"


def module_imports(test_file):
    """{top-level module: file importing it} for what collecting `test_file` imports: its
    module-level imports, and those of the files beside it that it imports (`common` in
    ../utils, `base_test_tensorflow`), the standard library left out. Imports inside
    functions or `try` blocks are the tests' own business, not collection's."""
    folders = (test_file.parent, test_file.parent.parent / "utils")
    needed, seen, todo = {}, set(), [test_file]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            else:
                continue
            for top in (name.split(".")[0] for name in names):
                local = [f / f"{top}.py" for f in folders if (f / f"{top}.py").is_file()]
                if local:
                    todo += local
                elif top not in sys.stdlib_module_names:
                    needed.setdefault(top, path.name)
    return needed


def check_imports(test_files, python, env):
    """Stop before collection when `python` (with `env`) cannot find a module the test
    files import, naming each and the command that installs them: pytest would only say
    `ModuleNotFoundError` at collection, in a file that is not ours."""
    needed = {}
    for test_file in test_files:
        needed.update(module_imports(Path(test_file)))
    probe = ("import importlib.util, sys; "
             "print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))")
    proc = subprocess.run([python, "-c", probe, *sorted(needed)], env=env, capture_output=True,
                          text=True, timeout=300, check=True)
    missing = proc.stdout.split()
    if missing:
        raise SystemExit(
            "Horovod's tests import modules that " + python + " cannot find: "
            + ", ".join(f"{m} (imported by {needed[m]})" for m in missing)
            + ".\nInstall them from the root of this repository with\n    " + python
            + " -m " + INSTALL + "\n(`make install` does; horovod itself comes from "
            "scripts/install_horovod.sh).")


def pytest_ini(timeout):
    """Config for the copies: a hung test dumps every thread's stack shortly
    before the harness kills it, so a TIMEOUT says where it hung."""
    return f"[pytest]\nfaulthandler_timeout = {max(5, int(timeout) - 20)}\n"


def prepare_copies(tests_path, configs, root, timeout=120, convert=rewrite_imports):
    """A copy of the test file's folder (and its sibling `utils`, which the
    file puts on sys.path) per configuration; for ours, converted by
    `convert(source) -> (new source, changes)` (the imports rewritten).
    Returns ({config: test file path}, diff text)."""
    tests_path = Path(tests_path).resolve()
    source = tests_path.read_text()
    copies, diff = {}, ""
    for kind in sorted({"horovod" if c == "horovod" else "ours" for c in configs} | {"horovod"}):
        base = Path(root) / kind / tests_path.parent.parent.name
        shutil.copytree(tests_path.parent, base / tests_path.parent.name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        utils = tests_path.parent.parent / "utils"
        if utils.is_dir():
            shutil.copytree(utils, base / "utils", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        target = base / tests_path.parent.name / tests_path.name
        (target.parent / "pytest.ini").write_text(pytest_ini(timeout))
        if kind == "ours":
            new_source, _ = convert(source)
            diff = import_diff(source, new_source, tests_path.name)
            target.write_text(new_source)
        copies[kind] = target
    return {c: copies["horovod" if c == "horovod" else "ours"] for c in configs} | {"_collect": copies["horovod"]}, diff


def collect(test_file, python, keyword=None):
    cmd = [python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-c", "pytest.ini",
           test_file.name]
    if keyword:
        cmd += ["-k", keyword]
    env = config_env("horovod")
    proc = subprocess.run(cmd, cwd=test_file.parent, env=env, capture_output=True, text=True, timeout=300)
    ids = [line.strip() for line in proc.stdout.splitlines() if line.startswith(f"{test_file.name}::")]
    if not ids and proc.returncode not in (0, 5):
        raise SystemExit(f"collection failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return ids


def test_key(test_id):
    """'test_torch.py::TorchTests::test_x' -> 'TorchTests::test_x'."""
    return test_id.split("::", 1)[1] if "::" in test_id else test_id


# --------------------------------------------------------------------------
# Results file

def load_results(path):
    if path and Path(path).exists():
        return json.loads(Path(path).read_text())
    return {"meta": {}, "results": {}}


def save_results(data, path):
    if not path:
        return
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


# --------------------------------------------------------------------------
# Markdown

def classify(test, results):
    """Cause of a failure under ours, for grouping."""
    ours = results.get("ours-k2") or results.get("ours-k1") or {}
    k1, k2 = results.get("ours-k1", {}), results.get("ours-k2", {})
    if k2.get("status") not in (None, "PASS", "SKIP") and k1.get("status") == "PASS":
        return "passes at K=1, fails at K=2 (pipelining semantics)"
    if k2.get("status") in (None, "PASS", "SKIP") and k1.get("status") not in (None, "PASS", "SKIP"):
        ours = k1
    error = ours.get("error") or ""
    if ours.get("status") == "TIMEOUT":
        return "hang (timeout)"
    if re.search(r"has no attribute|cannot import name|No module named", error):
        return "missing name"
    if re.search(r"unexpected keyword argument|positional argument|required (?:keyword-only |positional )?argument|takes \d+|got multiple values", error):
        return "different signature"
    if re.search(r"not (?:been )?initiali[sz]ed", error):
        return "needs init() where Horovod does not"
    if re.search(r"did not throw error|DID NOT RAISE", error):
        return "no error raised where Horovod raises"
    if re.search(r"^(?:AssertionError|assert )|produces incorrect|differs from expected", error):
        return "different result"
    if re.search(r"horovodrun exited", error):
        return "crash at exit"
    return "other error"


def missing_name(error):
    m = re.search(r"has no attribute '(\w+)'", error or "")
    return m.group(1) if m else None


def render_markdown(data, command, notes=None):
    results = data.get("results", {})
    meta = data.get("meta", {})
    tests = sorted(results)
    ran = [c for c in CONFIGS if any(c in results[t] for t in tests)]
    out = ["# Horovod compatibility: Horovod's own `test_torch.py` against `pipe_horovod.torch`", ""]
    out += ["Generated by `scripts/horovod_compat.py` (issue 8). Each test runs alone in",
            "`horovodrun -np 2 -H localhost:2 --gloo python -m pytest -x -q FILE::Class::test`,",
            "with a timeout, under: **Horovod** (the file as it is), **ours K=2** (the only change:",
            "`import horovod.torch as hvd` -> `import pipe_horovod.torch as hvd`; default depth),",
            "**ours K=1** (same, `PIPE_HOROVOD_PIPELINE_DEPTH=1`). SKIP = skipped on every rank;",
            "`—` = not run yet.", ""]
    out += ["Command:", "", "```", command, "```", ""]
    if meta:
        out += ["| | |", "|---|---|"]
        for key in ("tests_source", "tests_sha256", "tests_collected", "horovod", "pipe_horovod", "torch", "python",
                    "updated", "timeout_s", "import_diff"):
            if key in meta:
                value = meta[key]
                if key == "import_diff":
                    value = "<br>".join(f"`{l}`" for l in value.splitlines() if l.startswith(("-", "+"))
                                        and not l.startswith(("---", "+++")))
                out.append(f"| {key} | {value} |")
        out.append("")
    if notes:
        out += [NOTES_BEGIN, notes.strip("\n"), NOTES_END, ""]
    else:
        out += [NOTES_BEGIN, NOTES_END, ""]

    # Summary
    out += ["## Summary", "", "| config | " + " | ".join(STATUSES) + " | not run |",
            "|---|" + "---|" * (len(STATUSES) + 1)]
    for c in CONFIGS:
        counts = Counter(results[t].get(c, {}).get("status", "—") for t in tests)
        out.append(f"| {CONFIG_TITLES[c]} | " + " | ".join(str(counts.get(s, 0)) for s in STATUSES)
                   + f" | {counts.get('—', 0)} |")
    out.append("")
    hv_pass = [t for t in tests if results[t].get("horovod", {}).get("status") == "PASS"]
    if "ours-k2" in ran or "ours-k1" in ran:
        ok_k2 = [t for t in hv_pass if results[t].get("ours-k2", {}).get("status") == "PASS"]
        ok_k1 = [t for t in hv_pass if results[t].get("ours-k1", {}).get("status") == "PASS"]
        out.append(f"Of the {len(hv_pass)} tests that pass on Horovod: {len(ok_k2)} pass on ours at K=2"
                   + (f", {len(ok_k1)} at K=1" if "ours-k1" in ran else "") + ".")
        accepted = [t for t in hv_pass if results[t].get("ours-k2", {}).get("status") == "PASS"
                    or (t in BY_DESIGN_K2 and results[t].get("ours-k1", {}).get("status") == "PASS")]
        out.append(f"Acceptance (pass at K=2, or listed as by design at K=2 and pass at K=1): "
                   f"{len(accepted)}/{len(hv_pass)}" + (" — met." if len(accepted) == len(hv_pass) else " — not met yet."))
        out.append("")

        failing = [t for t in hv_pass
                   if any(results[t].get(c, {}).get("status") not in (None, "PASS") for c in ("ours-k2", "ours-k1"))]
        if failing:
            out += ["## Passing on Horovod, failing on ours, by cause", ""]
            groups = {}
            for t in failing:
                groups.setdefault(classify(t, results[t]), []).append(t)
            for cause in sorted(groups, key=lambda g: (-len(groups[g]), g)):
                members = groups[cause]
                out.append(f"### {cause} ({len(members)})")
                out.append("")
                if cause == "missing name":
                    names = Counter(missing_name((results[t].get("ours-k2") or results[t].get("ours-k1") or {}).get("error"))
                                    for t in members)
                    out.append("Names: " + ", ".join(f"`{n}` ({k})" for n, k in sorted(names.items(), key=lambda x: (-x[1], str(x[0]))) if n) + ".")
                    out.append("")
                for t in members:
                    r = results[t]
                    parts = []
                    for c in ("ours-k2", "ours-k1"):
                        if c in r and r[c]["status"] != "PASS":
                            parts.append(f"{CONFIG_TITLES[c]}: {r[c]['status']}")
                    err = (r.get("ours-k2", {}).get("error") if r.get("ours-k2", {}).get("status") != "PASS"
                           else r.get("ours-k1", {}).get("error"))
                    out.append(f"- `{t}` ({', '.join(parts)}): {_md_code(err)}")
                out.append("")
        if BY_DESIGN_K2:
            out += ["## Different by design at K=2", ""]
            out += [f"- `{t}`: {why}" for t, why in sorted(BY_DESIGN_K2.items())]
            out.append("")

    out += ["## Table", "", "| test | " + " | ".join(CONFIG_TITLES[c] for c in CONFIGS) + " |",
            "|---|" + "---|" * len(CONFIGS)]
    for t in tests:
        cells = []
        for c in CONFIGS:
            r = results[t].get(c)
            cells.append(r["status"] if r else "—")
        out.append(f"| `{t.split('::')[-1]}` | " + " | ".join(cells) + " |")
    out.append("")
    hv_fail = [t for t in tests if results[t].get("horovod", {}).get("status") in ("FAIL", "TIMEOUT")]
    if hv_fail:
        out += ["## Failing on Horovod 0.28.1 itself (not counted)", ""]
        out += [f"- `{t}`: {results[t]['horovod']['status']}: {_md_code(results[t]['horovod'].get('error'))}"
                for t in hv_fail]
        out.append("")
    return "\n".join(out)


def _md_code(text):
    if not text:
        return "(no error line)"
    text = text.replace("`", "'")
    if len(text) > 300:
        text = text[:297] + "..."
    return f"`{text}`"


def read_section(markdown_path, begin, end):
    """The text between the markers `begin` and `end` in the file, or None."""
    if not markdown_path or not Path(markdown_path).exists():
        return None
    text = Path(markdown_path).read_text()
    if begin in text and end in text:
        return text.split(begin, 1)[1].split(end, 1)[0].strip("\n") or None
    return None


def read_notes(markdown_path):
    return read_section(markdown_path, NOTES_BEGIN, NOTES_END)


# --------------------------------------------------------------------------

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tests", help="path to Horovod's test/parallel/test_torch.py (kept outside this repo)")
    p.add_argument("-k", dest="keyword", help="pytest -k expression selecting tests")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated subset of {','.join(CONFIGS)} (default: all)")
    p.add_argument("--jobs", type=int, default=1, help="runs at once (default 1)")
    p.add_argument("--timeout", type=float, default=120, help="seconds per run (default 120)")
    p.add_argument("--np", type=int, default=2, help="workers per run (default 2)")
    p.add_argument("--out", help="results JSON (read first: runs already there are skipped)")
    p.add_argument("--rerun", action="store_true", help="run selected tests/configs even if in --out")
    p.add_argument("--markdown", help="write the table here (keeps its <!-- notes --> block)")
    p.add_argument("--logs", help="folder for each run's full output")
    p.add_argument("--horovodrun", default=str(Path(sys.executable).parent / "horovodrun"))
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--render-only", action="store_true", help="only render --out to --markdown")
    args = p.parse_args(argv)

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        p.error(f"unknown config(s) {bad}; choose from {CONFIGS}")
    data = load_results(args.out)
    command = "python scripts/horovod_compat.py " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    data["meta"].setdefault("commands", [])
    if not args.render_only:
        if not args.tests:
            p.error("--tests is required unless --render-only")
        data["meta"]["commands"] = (data["meta"]["commands"] + [command])[-10:]
        run_all(args, configs, data)
    if args.markdown:
        cmds = data["meta"].get("commands") or [command]
        text = render_markdown(data, "\n".join(cmds), notes=read_notes(args.markdown))
        for begin, end in SECTIONS:
            section = read_section(args.markdown, begin, end)
            if section is not None:
                text = text.rstrip("\n") + f"\n\n{begin}\n{section}\n{end}\n"
        Path(args.markdown).write_text(text)
        print(f"wrote {args.markdown}")
    summary = Counter()
    for t, r in data["results"].items():
        for c in configs:
            if c in r:
                summary[(c, r[c]["status"])] += 1
    for c in configs:
        print(f"{c}: " + ", ".join(f"{s} {summary[(c, s)]}" for s in STATUSES))
    return 0


def repo_state():
    """The commit ours was run at, and whether pipe_horovod/ had local changes."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "pipe_horovod"], cwd=REPO,
                               capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head} (pipe_horovod/ with uncommitted changes)" if dirty else head


def run_all(args, configs, data):
    from tqdm import tqdm
    import torch

    tests_path = Path(args.tests).resolve()
    source = tests_path.read_text()
    meta = data["meta"]
    try:
        import horovod
        meta["horovod"] = horovod.__version__
    except ImportError:
        meta["horovod"] = "not installed"
    meta["pipe_horovod"] = repo_state()
    meta.update(tests_source=str(tests_path), tests_sha256=hashlib.sha256(source.encode()).hexdigest(),
                torch=torch.__version__, python=sys.version.split()[0], timeout_s=args.timeout,
                updated=datetime.datetime.now().isoformat(timespec="seconds"))
    with tempfile.TemporaryDirectory(prefix="horovod_compat_") as root:
        copies, diff = prepare_copies(tests_path, configs, root, timeout=args.timeout)
        if diff:
            print("Import change for ours:\n" + diff)
            meta["import_diff"] = diff
        check_imports({copies[c] for c in configs}, args.python, config_env("horovod"))
        ids = collect(copies["_collect"], args.python, args.keyword)
        if not args.keyword:
            meta["tests_collected"] = len(ids)
        print(f"{len(ids)} tests collected from {tests_path}")
        todo = [(tid, c) for tid in ids for c in configs
                if args.rerun or c not in data["results"].get(test_key(tid), {})]
        print(f"{len(todo)} runs to do ({len(ids) * len(configs) - len(todo)} already in {args.out})")

        def work(item):
            tid, c = item
            test_file = copies[c]
            return item, run_one(test_file.parent, f"{test_file.name}::{test_key(tid)}", c,
                                 args.horovodrun, args.python, args.timeout, np=args.np, log_dir=args.logs)

        with tqdm(total=len(todo), unit="run", dynamic_ncols=True) as bar, \
                ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            for (tid, c), res in pool.map(work, todo):
                if c != "horovod":
                    res["pipe_horovod"] = meta["pipe_horovod"]
                data["results"].setdefault(test_key(tid), {})[c] = res
                save_results(data, args.out)
                bar.update(1)
                line = f"{res['status']:7} {c:8} {test_key(tid)} ({res['seconds']} s)"
                if res["status"] not in ("PASS", "SKIP") and res["error"]:
                    line += f": {res['error'][:160]}"
                tqdm.write(line)
    meta["updated"] = datetime.datetime.now().isoformat(timespec="seconds")
    save_results(data, args.out)


if __name__ == "__main__":
    sys.exit(main())
