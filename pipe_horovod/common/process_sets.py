"""Process sets: collectives over a subset of the ranks (Horovod's ProcessSet API).

The ProcessSet class and the global set are the engine's (every engine
registers sets itself); these are the collective calls a script makes to
register and unregister one, the same for every framework.
"""
from typing import Sequence, Union

from .. import engine as _engine
from ..engine import ProcessSet, global_process_set


def add_process_set(process_set: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Register a process set on every rank, so collectives can run on a subset of ranks.

    A collective: every rank calls it, with the same ranks. The horovod engine
    needs init(process_sets="dynamic") first, as Horovod does.

    Args:
        process_set: a ProcessSet or a list of global ranks.

    Returns:
        The registered ProcessSet.

    Raises:
        ValueError: no ranks, a rank out of range, or a set registered already (the
            global one included); on the horovod engine without
            init(process_sets="dynamic"), Horovod's own error.
    """
    return _engine.current().add_process_set(process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set (a collective: every rank calls it).

    Args:
        process_set: one add_process_set or init(process_sets=...) registered.

    Returns:
        True if it was registered, False if not.
    """
    return _engine.current().remove_process_set(process_set)


__all__ = ["ProcessSet", "add_process_set", "global_process_set", "remove_process_set"]
