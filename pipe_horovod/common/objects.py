"""Collectives on Python objects and on the ranks themselves: barrier, join, and
broadcast/allgather of picklable objects.

They carry no framework's tensors, so every adapter re-exports these (a
TensorFlow script's `hvd.broadcast_object` is this one). The engine names
the object transfers itself: Horovod 0.28.1 named them after the object's
type, which deadlocks when root passes a dict and the others None.
"""
from typing import Any, List, Optional

from .. import engine as _engine
from ..engine import ProcessSet, global_process_set


def join(device: int = -1) -> int:
    """Declare this rank out of data, for epochs where ranks get uneven batches.

    Horovod (the horovod engine) lets joined ranks take part in the others'
    later allreduces with zeros; the torch engine's join is a plain collective
    that every rank must reach after the same collectives.

    Args:
        device: Horovod's device for the zeros (-1: the CPU); unused elsewhere.

    Returns:
        The rank that joined last.
    """
    return _engine.current().join(device)


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return once every rank of `process_set` has called barrier.

    Args:
        process_set: the ranks that wait for each other.

    Raises:
        HorovodInternalError: a rank died or the wait timed out.
    """
    _engine.current().barrier(process_set=process_set)


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Root's picklable `obj` on every rank: checkpoints' metadata, epoch counters.

    Args:
        obj: root's object; the others may pass anything (None, say).
        root_rank: the global rank whose object everyone receives.
        name: names the transfer; None: pipe_horovod names it (Horovod 0.28.1 named
            it after the object's type, which deadlocks when the types differ).
        process_set: the ranks that take part; every one of them must call it.

    Returns:
        A copy of root's object (root gets its own back).

    Raises:
        HorovodInternalError: a rank died or the wait timed out; pickling errors on root.
    """
    return _engine.current().broadcast_object(obj, root_rank, name=name,
                                              process_set=process_set)


def allgather_object(obj: Any, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> List[Any]:
    """Every rank's picklable `obj`, in rank order: to compare or merge per-rank results.

    Args:
        obj: this rank's object.
        name: as for broadcast_object.
        process_set: pipe_horovod's addition (Horovod 0.28.1's allgather_object has
            none): the ranks whose objects are gathered.

    Returns:
        A list with one object per rank of `process_set`.

    Raises:
        HorovodInternalError: a rank died or the wait timed out.
    """
    return _engine.current().allgather_object(obj, name=name, process_set=process_set)


__all__ = ["allgather_object", "barrier", "broadcast_object", "join"]
