"""One interface over the communication libraries, chosen from the launcher.

`horovodrun` sets HOROVOD_RANK, `torchrun` sets RANK/WORLD_SIZE/MASTER_ADDR,
Open MPI's `mpirun` (also under `horovodrun --mpi`) sets OMPI_COMM_WORLD_RANK,
and plain `python` sets none: the same script picks the matching engine with
no flag. `init(engine=...)` or PIPE_HOROVOD_ENGINE overrides the guess.
"""
import atexit
import importlib
import os
import sys

from .base import (Adasum, Average, Engine, EngineError, Handle, HorovodInternalError,
                   HostsUpdatedInterrupt, Max, Min, Product, ReduceOp, Sum)
from .faults import RankLostError, WaitError, WaitTimeoutError, resolve_timeout
from .horovod_install import how_to_install, without_horovod
from .process_sets import ProcessSet, follow_rank, global_process_set

ENGINES = {
    # name -> (module, class, package it needs, how to get that package)
    "horovod": ("horovod", "HorovodEngine", "horovod.torch",
                f"{without_horovod()}; or {how_to_install()}"),
    "torch": ("torch_dist", "TorchDistEngine", "torch.distributed", "pip install 'torch>=2.1'"),
    "local": ("local", "LocalEngine", None, None),
}

_current = None


def detect(environ=None):
    """The engine name the launcher's environment implies."""
    env = os.environ if environ is None else environ
    forced = env.get("PIPE_HOROVOD_ENGINE")
    if forced:
        return forced
    if "HOROVOD_RANK" in env:
        return "horovod"
    if "RANK" in env and "WORLD_SIZE" in env and "MASTER_ADDR" in env:
        return "torch"
    if "OMPI_COMM_WORLD_RANK" in env:
        # As with Horovod: `mpirun python train.py` means Horovod's MPI controller.
        return "horovod"
    return "local"


def missing_package(name):
    """None when engine `name` can be used here, else the reason it cannot."""
    _, _, package, how = ENGINES[name]
    if package is None:
        return None
    try:
        importlib.import_module(package)
    except ImportError as exc:
        return f"engine {name!r} needs the package {package!r}, which cannot be imported ({exc}); {how}"
    return None


def engine_class(name):
    """The class of engine `name`, imported but not started."""
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(sorted(ENGINES))}")
    problem = missing_package(name)
    if problem:
        raise EngineError(problem)
    module, cls, _, _ = ENGINES[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def create(name, **options):
    """A new engine `name`; `options` (comm, process_sets) go to its constructor."""
    return engine_class(name)(**options)


def build_info(name=None):
    """What engine `name` (default: the launcher's) was built with, before init.

    Horovod answers its *_built queries before hvd.init(); scripts ask them
    first (e.g. to skip a test), so this needs no running engine.
    """
    if _current is not None and name in (None, _current.name):
        return _current.build_info()
    return engine_class(detect() if name is None else name).build_info()


def init(comm=None, process_sets=None, *, engine=None, timeout=None):
    """Start pipe_horovod (once per process): Horovod's `init(comm=None, process_sets=None)`.

    The one init behind `pipe_horovod.init`, `pipe_horovod.torch.init` and
    `pipe_horovod.keras.init`, so a Horovod script's call works unchanged and
    `init("local")` names an engine wherever it is called.

    Args:
        comm: what Horovod's comm means (a list of ranks or an MPI communicator),
            passed to Horovod; or a string, which Horovod's comm never is, naming the
            engine ("horovod", "torch" or "local") like `engine=`.
        process_sets: a list of ProcessSet (or of rank lists) to register, or
            "dynamic" to allow add_process_set later (the torch and local engines
            always allow it). Sets passed after the engine started are added.
        engine: the engine's name; default: the launcher's environment picks it
            (horovodrun: horovod, torchrun: torch, plain python: local;
            $PIPE_HOROVOD_ENGINE overrides).
        timeout: seconds any wait for a collective may block before it raises
            WaitTimeoutError (default: $PIPE_HOROVOD_TIMEOUT, else
            faults.DEFAULT_TIMEOUT_S; math.inf: never).

    Returns:
        The running engine (the one already running, if init was called before).

    Raises:
        ValueError: `engine=` and a string `comm` name two engines, or process_sets
            is a string other than "dynamic".
        EngineError: another engine is running already (call shutdown() first).
    """
    global _current
    if isinstance(comm, str):
        if engine is not None and engine != comm:
            raise ValueError(f"hvd.init was given two engines: comm={comm!r} and "
                             f"engine={engine!r}; name one")
        engine, comm = comm, None
    name = engine if engine is not None else detect()
    timeout_s = resolve_timeout(timeout) if timeout is not None or _current is None else None
    if isinstance(process_sets, str):
        if process_sets.lower() != "dynamic":
            raise ValueError(f"process_sets must be a list of ProcessSet or 'dynamic', "
                             f"got {process_sets!r}")
        os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"     # read by Horovod's init
        process_sets = None
    if _current is not None:
        if engine is not None and _current.name != engine:
            raise EngineError(f"engine {_current.name!r} is already initialized; "
                              f"call shutdown() before switching to {engine!r}")
        for ps in process_sets or ():
            if getattr(ps, "process_set_id", None) is None:
                _current.add_process_set(ps)
        if timeout_s is not None:
            _current.timeout_s = timeout_s
        return _current
    _current = create(name, comm=comm, process_sets=process_sets, timeout_s=timeout_s)
    # Elastic mode resets on a lost rank itself: it learns the board session, not the peers.
    _current.learn_peers(peers=os.environ.get("HOROVOD_ELASTIC") != "1")
    # Registered after the library's own start-up (and so its own atexit
    # shutdown), so at exit ours runs first and completes what is in flight.
    atexit.register(shutdown)
    if not getattr(sys.excepthook, "tells_the_others", False):
        sys.excepthook = _telling_the_others(sys.excepthook)
    return _current


def _telling_the_others(hook):
    """`hook` (sys.excepthook), after posting the error that ends this script for the
    other ranks, whose waits then name it (engine/causes.py) rather than a rank that
    ended. Python calls it before the exit handlers, so before shutdown posts the end."""
    def excepthook(kind, exc, tb):
        if _current is not None:
            try:
                _current.tell_uncaught(exc, tb)
            except Exception:       # never hide the error itself
                pass
        hook(kind, exc, tb)
    excepthook.tells_the_others = True
    return excepthook


def current():
    if _current is None:
        raise ValueError("pipe_horovod has not been initialized; call pipe_horovod.init() first")
    return _current


def is_initialized():
    return _current is not None


def shutdown():
    global _current
    if _current is not None:
        _current.shutdown()
        _current = None


def rank():
    return current().rank()


follow_rank(rank)        # ProcessSet.rank() and included() ask the engine running then


def size():
    return current().size()


def local_rank():
    return current().local_rank()


def local_size():
    return current().local_size()


def allreduce_async(tensor, name, op=Average, **options):
    """See Engine.allreduce_async (options: process_set, prescale_factor, postscale_factor)."""
    return current().allreduce_async(tensor, name, op, **options)


def poll(handle):
    return current().poll(handle)


def wait(handle):
    return current().wait(handle)


def broadcast(tensor, root, **options):
    return current().broadcast(tensor, root, **options)


def broadcast_object(obj, root, **options):
    return current().broadcast_object(obj, root, **options)


def allgather_object(obj, **options):
    return current().allgather_object(obj, **options)


def barrier(**options):
    current().barrier(**options)


__all__ = [
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "ReduceOp", "ProcessSet",
    "global_process_set", "HorovodInternalError", "HostsUpdatedInterrupt", "Engine", "EngineError", "Handle", "ENGINES", "detect", "create",
    "RankLostError", "WaitError", "WaitTimeoutError",
    "init", "current", "is_initialized", "shutdown", "rank", "size", "local_rank", "local_size",
    "allreduce_async", "poll", "wait", "broadcast", "broadcast_object", "allgather_object", "barrier",
]
