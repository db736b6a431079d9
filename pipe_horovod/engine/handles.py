"""What an operation in flight is, to the engine and to whoever started it.

A Handle is all a caller holds (it passes it back to poll and wait); Started
lets a library's own handle stand where the engine expects a Work, so the
engine's waits, stall checks and shutdown treat both alike.
"""
from .work import Work


class Started(Work):
    """A subclass hook's backend state (`_start_allreduce` may return the library's own
    handle) as a Work, read through the engine's `_poll`/`_wait`."""

    __slots__ = ("engine", "backend")

    def __init__(self, engine, backend):
        self.engine, self.backend = engine, backend

    def poll(self):
        return self.engine._poll_backend(self)

    def wait(self):
        return self.engine._wait_backend(self)


class Handle:
    """One operation in flight: what `allreduce_async` and the other `*_async` return.

    The engine keeps the backend's own handle; users only pass this back to
    `poll` and `wait`.
    """

    __slots__ = ("id", "name", "tensor", "op", "backend", "kind", "started", "root")

    def __init__(self, id_, name, tensor, op, backend, kind="allreduce", started=None,
                 root=None):
        self.id = id_
        self.name = name
        self.tensor = tensor
        self.op = op                # the ReduceOp of a reduction, else None
        self.backend = backend
        self.kind = kind            # "allreduce", "allgather", "broadcast", ...
        self.started = started      # timeline clock at start, when a timeline records
        self.root = root            # a broadcast's root

    def __repr__(self):
        return f"Handle(id={self.id}, name={self.name!r})"
