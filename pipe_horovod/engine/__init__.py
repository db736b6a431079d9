"""One interface over the communication libraries, chosen from the launcher.

`horovodrun` sets HOROVOD_RANK, `torchrun` sets RANK/WORLD_SIZE/MASTER_ADDR,
and plain `python` sets neither: the same script picks the matching engine
with no flag. `init(engine=...)` or PIPE_HOROVOD_ENGINE overrides the guess.
"""
import atexit
import importlib
import os

from .base import Average, Engine, EngineError, Handle, ReduceOp, Sum

ENGINES = {
    # name -> (module, class, package it needs, how to get that package)
    "horovod": ("horovod", "HorovodEngine", "horovod.torch",
                "run `make install` (builds Horovod 0.28.1 with PyTorch ops) or see README.md"),
    "torch": ("torch_dist", "TorchDistEngine", "torch.distributed",
              "pip install torch==2.13.0"),
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


def create(name):
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(sorted(ENGINES))}")
    problem = missing_package(name)
    if problem:
        raise EngineError(problem)
    module, cls, _, _ = ENGINES[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)()


def init(engine=None):
    """Start the engine (once per process) and return it."""
    global _current
    name = engine if engine is not None else detect()
    if _current is not None:
        if engine is not None and _current.name != engine:
            raise EngineError(f"engine {_current.name!r} is already initialized; "
                              f"call shutdown() before switching to {engine!r}")
        return _current
    _current = create(name)
    # Registered after the library's own start-up (and so its own atexit
    # shutdown), so at exit ours runs first and completes what is in flight.
    atexit.register(shutdown)
    return _current


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


def size():
    return current().size()


def local_rank():
    return current().local_rank()


def local_size():
    return current().local_size()


def allreduce_async(tensor, name, op=Average):
    return current().allreduce_async(tensor, name, op)


def poll(handle):
    return current().poll(handle)


def wait(handle):
    return current().wait(handle)


def broadcast(tensor, root):
    return current().broadcast(tensor, root)


def broadcast_object(obj, root):
    return current().broadcast_object(obj, root)


def allgather_object(obj):
    return current().allgather_object(obj)


def barrier():
    current().barrier()


__all__ = [
    "Average", "Sum", "ReduceOp", "Engine", "EngineError", "Handle", "ENGINES", "detect", "create",
    "init", "current", "is_initialized", "shutdown", "rank", "size", "local_rank", "local_size",
    "allreduce_async", "poll", "wait", "broadcast", "broadcast_object", "allgather_object", "barrier",
]
