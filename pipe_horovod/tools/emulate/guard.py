"""Tears an emulated cluster down when the process that built it is SIGKILLed.

No signal handler or atexit hook runs on SIGKILL, so namespaces, veths and
the workers inside them would outlive the run. The owner therefore starts
this guard in a session of its own with a pipe as its stdin and keeps the
only write end (pipes are close-on-exec, so no worker inherits it): the
guard's read returns end-of-file exactly when the owner is gone. A clean
`close()` writes ``closed`` first and the guard exits without touching
anything. Stdlib only, like `pipe_horovod.tools.emulate`.
"""

import subprocess
import sys

CLOSED = b"closed\n"


def start(prefix):
    """The guard process for `prefix`; write CLOSED to its stdin on a clean teardown."""
    # -c, not -m: `python -m` on a module its package already imports warns (runpy's
    # RuntimeWarning, printed by every emulated run, `make run` included)
    return subprocess.Popen([sys.executable, "-c", f"import sys; from {__name__} import main; "
                             "main(sys.argv[1])", prefix], stdin=subprocess.PIPE,
                            start_new_session=True)


def stop(guard):
    """Tells the guard the owner tore down itself, and reaps it."""
    try:
        guard.stdin.write(CLOSED)
        guard.stdin.close()
    except (BrokenPipeError, ValueError):
        pass   # the guard is gone already
    try:
        guard.wait(timeout=10)
    except subprocess.TimeoutExpired:
        guard.kill()
        guard.wait()


def main(prefix):
    if sys.stdin.buffer.readline() == CLOSED:
        return
    from pipe_horovod.tools.emulate.network import cleanup, leftovers
    cleanup(prefix)
    left = leftovers(prefix)
    print(f"pipe_horovod: the owner of emulated cluster {prefix} died without tearing it "
          f"down; removed its namespaces{'; still left: ' + ', '.join(left) if left else ''}",
          file=sys.stderr, flush=True)
