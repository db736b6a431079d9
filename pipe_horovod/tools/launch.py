"""What the launching commands (pipe_horovod.tools.commands) and the launchers in
pipe_horovod.tools.bench (keras_launch, convergence_lm) share: the workers'
environment, horovodrun, the prerequisite checks and the per-launch file names.
Both sides import it; it imports neither.
"""
import os
import re
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Variables that would make a worker join some other job (as in pipe_horovod.tools.emulate),
# the bench's DDP rendezvous and a pipeline depth the configurations set themselves.
SCRUB = re.compile(r"^(HOROVOD_|OMPI_|PMI_|PMIX_|TORCHELASTIC_)"
                   r"|^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK|"
                   r"GROUP_WORLD_SIZE|ROLE_RANK|ROLE_NAME|ROLE_WORLD_SIZE|MASTER_ADDR|"
                   r"MASTER_PORT|PIPE_HOROVOD_ENGINE|PIPE_HOROVOD_PIPELINE_DEPTH|"
                   r"PIPE_HOROVOD_BENCH_DDP_ADDR|PIPE_HOROVOD_BENCH_DDP_PORT)$")


class UsageError(Exception):
    """Arguments that parse but cannot run together, or a missing prerequisite (exit 2)."""


def worker_env(threads=1, engine=None):
    """This process's environment for launched workers: no other job's variables, the
    repository on PYTHONPATH, `threads` OpenMP/MKL threads, unbuffered output, and
    PIPE_HOROVOD_ENGINE=local for engine 'local'."""
    env = {k: v for k, v in os.environ.items() if not SCRUB.search(k)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    if engine == "local":
        env["PIPE_HOROVOD_ENGINE"] = "local"
    return env


def horovodrun():
    """horovodrun next to this Python, else on PATH, else None."""
    local = Path(sys.executable).parent / "horovodrun"
    return str(local) if local.exists() else shutil.which("horovodrun")


def check(args, compute_check=None):
    """Raises UsageError for combinations argparse cannot express, and missing prerequisites
    (args: workers, engine, emulate). compute_check(args), run when args has --compute,
    returns the reason the compute options cannot run, or None."""
    if args.engine == "local" and args.workers != 1:
        raise UsageError(f"--engine local runs one process; use --workers 1 (got {args.workers}) "
                         "or --engine horovod / torch")
    if args.emulate:
        if args.engine == "local":
            raise UsageError("--emulate needs a distributed engine: --engine horovod or torch")
        if os.geteuid() != 0:
            raise UsageError("--emulate needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN for "
                             "'ip netns' and 'tc'); run as root, or drop --emulate to launch "
                             "the workers locally over loopback")
        from pipe_horovod.tools import emulate

        reason = emulate.unavailable_reason()
        if reason:
            raise UsageError(f"--emulate is not possible here: {reason}")
    problem = compute_check(args) if compute_check is not None and "compute" in args else None
    if problem:
        raise UsageError(problem)
    from pipe_horovod.engine import missing_package

    problem = missing_package(args.engine)
    if problem:
        raise UsageError(problem + ("; or use --engine torch" if args.engine == "horovod" else ""))
    if args.engine == "horovod" and not args.emulate and horovodrun() is None:
        raise UsageError("horovodrun was not found next to this Python or on PATH")


def run_files(out, stem):
    """A launch's raw result, progress and log paths under `out`; a previous launch's result
    and progress are removed, so a launch that writes none cannot pass for one that did."""
    raw_path = os.path.join(out, f"{stem}-raw.json")
    progress_path = os.path.join(out, f"{stem}-progress.json")
    for stale in (raw_path, progress_path):
        if os.path.exists(stale):
            os.remove(stale)
    return raw_path, progress_path, os.path.join(out, f"{stem}.log")
