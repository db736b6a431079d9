"""Launch real workers the way users do (horovodrun, torchrun, mpirun, python).

Every launch has a timeout, kills the whole process group when it expires,
and fails with every worker's output, so a broken collective shows up as a
readable test failure instead of a hung suite.
"""
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"
OK = "WORKER_OK"
CASE_OK = "CASE_OK"


# Open MPI refuses root without --allow-run-as-root (CI runs as root); 2 cores
# give 2 slots, so 3 ranks need --oversubscribe; no binding: ranks share cores.
MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none"]


def command(launcher, np, argv):
    if launcher in ("horovod", "horovod-mpi"):
        controller = "--gloo" if launcher == "horovod" else "--mpi"
        return [str(BIN / "horovodrun"), "-np", str(np), "-H", f"localhost:{np}", controller,
                sys.executable, *argv]
    if launcher == "mpirun":
        return [*MPIRUN, "-np", str(np), sys.executable, *argv]
    if launcher == "torch":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node", str(np), *argv]
    if launcher == "local":
        assert np == 1, "plain python runs one process"
        return [sys.executable, *argv]
    raise ValueError(f"unknown launcher {launcher!r}")


def run(launcher, np, script, *args, timeout=120, env=None, expect_ok=True):
    """Run `script` (a path, or a name under tests/workers) on `np` workers.

    Returns the combined output. With expect_ok, asserts a zero exit and one
    OK line per worker (workers print "WORKER_OK rank=N" after their own assertions pass).
    """
    path = Path(script)
    if not path.is_absolute():
        path = WORKERS / script
    return run_command(command(launcher, np, [str(path), *map(str, args)]), np,
                       timeout=timeout, env=env, expect_ok=expect_ok)


_KEPT = {}


def run_once(launcher, np, script, *args, timeout=120, env=None):
    """`run`'s (exit code, output), without its assertions, of a launch kept for the
    session: several tests (one per case it runs) read the same launch. A timeout
    is kept as its output, with exit code None."""
    key = (launcher, np, str(script), tuple(map(str, args)), tuple(sorted((env or {}).items())))
    if key not in _KEPT:
        try:
            _KEPT[key] = run(launcher, np, script, *args, timeout=timeout, env=env,
                             expect_ok=False)
        except AssertionError as timed_out:
            _KEPT[key] = (None, str(timed_out))
    return _KEPT[key]


def ranks_saying(out, word, case=None):
    """The ranks that printed "WORD rank=N" (or "WORD CASE rank=N")."""
    what = word if case is None else f"{word} {re.escape(case)}"
    return {int(r) for r in re.findall(rf"{what} rank=(\d+)", out)}


def assert_finished(code, out, np, what):
    """A zero exit and WORKER_OK from ranks 0..np-1."""
    ranks = ranks_saying(out, OK)
    assert code == 0 and ranks == set(range(np)), (
        f"{what} exited {code}; {OK} from ranks {sorted(ranks)} of {np}; output:\n{out}")


def assert_case(code, out, np, case, what):
    """CASE_OK for `case` from ranks 0..np-1 (worker_cases prints it)."""
    ranks = ranks_saying(out, CASE_OK, case)
    assert ranks == set(range(np)), (
        f"case {case!r} of {what}: {CASE_OK} from ranks {sorted(ranks)} of {np} (exit {code}); "
        f"output:\n{out}")


def run_case(launcher, np, script, cases, case, *args, timeout=120, env=None):
    """Check `case`, one of `cases` that a single launch of `script` runs in turn.

    Start-up is most of a small launch's time, so several cases share one
    (run_once): the worker gets them comma-separated as its first argument
    (`worker_cases` runs them), and each case's test fails on its own, with
    every worker's output. The last case also asserts the launch's clean exit.
    """
    assert case in cases, f"{case!r} is not one of this launch's cases {cases}"
    code, out = run_once(launcher, np, script, ",".join(cases), *args, timeout=timeout, env=env)
    what = f"{script} {','.join(cases)}"
    assert_case(code, out, np, case, what)
    if case == cases[-1]:
        assert_finished(code, out, np, what)


def worker_cases(checks, cases, rank):
    """The worker's side of run_case: each named check in turn, CASE_OK after each.
    `rank` is called after a check, which may be what initialised the engine."""
    for case in cases.split(","):
        checks[case]()
        print(f"{CASE_OK} {case} rank={rank()}", flush=True)


def _descendants(pid):
    """Every process below `pid`, read from /proc before any is killed (a killed parent's
    children are re-parented, and a worker in its own session escapes killpg)."""
    children = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_command(cmd, np, timeout=120, env=None, expect_ok=True):
    """Run a launch command line in its own process group, killed on timeout.

    With expect_ok, asserts a zero exit and WORKER_OK from ranks 0..np-1
    (np: the number of ranks the job ends with). Returns (exit code, output).
    """
    cmd = [str(part) for part in cmd]
    full_env = dict(os.environ)
    full_env.pop("PIPE_HOROVOD_ENGINE", None)
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full_env.get("PYTHONPATH")]))
    full_env.setdefault("OMP_NUM_THREADS", "1")
    # Open MPI ranks busy-poll while they wait; on 2 shared cores they should yield.
    full_env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    full_env.update(env or {})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full_env, cwd=REPO, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in [proc.pid, *_descendants(proc.pid)]:   # torchrun's workers: own sessions
            _kill(pid)
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} timed out after {timeout}s; output:\n{out}")
    if expect_ok:
        assert_finished(proc.returncode, out, np, " ".join(cmd))
    return proc.returncode, out


@functools.cache
def horovod_missing():
    """None when horovod.torch imports here, else why not (checked in a subprocess,
    so a broken build cannot take the test process down; once per session, as
    the import costs more than a second). An import that does not finish is an
    error, not a reason to skip: on a loaded machine a short timeout here would
    skip every horovod-engine test of the run (the answer is cached), silently."""
    try:
        res = subprocess.run([sys.executable, "-c", "import horovod.torch"],
                             capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError("import horovod.torch did not finish within 600 s") from exc
    return None if res.returncode == 0 else "horovod.torch does not import: " + (
        res.stderr.strip().splitlines() or ["?"])[-1]


def skip_without(engine_name):
    """Skips the calling test where `engine_name` cannot run here (the horovod engine
    without a working horovod.torch). pytest is imported here, not at the top: workers
    import this module too."""
    if engine_name == "horovod" and horovod_missing():
        import pytest

        pytest.skip(horovod_missing())


def mpirun_missing():
    """None when Open MPI's mpirun is on PATH, else why not."""
    return None if shutil.which("mpirun") else (
        "mpirun is not on PATH: Open MPI is not installed (scripts/install_openmpi.sh)")


@functools.cache
def mpi_missing():
    """None when mpirun is on PATH and Horovod here has the MPI controller, else why not."""
    why = mpirun_missing() or horovod_missing()
    if why:
        return why
    res = subprocess.run([sys.executable, "-c", "import horovod.torch as h; print(h.mpi_built())"],
                         capture_output=True, text=True, timeout=60)
    return None if res.stdout.strip() == "True" else (
        "Horovod was built without the MPI controller (scripts/install_horovod.sh builds it "
        "when Open MPI is installed)")
