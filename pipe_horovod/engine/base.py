"""The contract every communication engine honours.

Adapters and the pipeline core see only this interface, so a script runs
unchanged under horovodrun, torchrun or plain python. The checks that
protect users from silent corruption (a name reused while in flight, a
non-contiguous tensor that the C++ side would reduce in a copy) live here
once, instead of in each engine.
"""
import enum
import itertools


class ReduceOp(enum.Enum):
    AVERAGE = "average"
    SUM = "sum"


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM


class EngineError(RuntimeError):
    """A communication engine cannot be used as asked."""


class Handle:
    """One reduction in flight: what `allreduce_async` returns.

    The engine keeps the backend's own handle; users only pass this back to
    `poll` and `wait`.
    """

    __slots__ = ("id", "name", "tensor", "op", "backend")

    def __init__(self, id_, name, tensor, op, backend):
        self.id = id_
        self.name = name
        self.tensor = tensor
        self.op = op
        self.backend = backend

    def __repr__(self):
        return f"Handle(id={self.id}, name={self.name!r})"


def _check_tensor(tensor):
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"allreduce_async expects a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError(
            "allreduce_async needs a contiguous tensor (the result is written in place); "
            "call .contiguous() and reduce that")


def _check_op(op):
    if not isinstance(op, ReduceOp):
        raise ValueError(f"unknown reduce op {op!r}: use pipe_horovod.Average or pipe_horovod.Sum")


def check_root(root, size):
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < size:
        raise ValueError(f"root rank {root!r} is out of range for {size} rank(s)")


class Engine:
    """Base class: bookkeeping of handles; subclasses talk to a library."""

    name = "base"

    def __init__(self):
        self._in_flight = {}      # handle id -> Handle
        self._names = {}          # tensor name -> handle id
        self._ids = itertools.count()
        self._before_shutdown = {}
        self._closed = False

    # --- identity -------------------------------------------------------
    def rank(self):
        raise NotImplementedError

    def size(self):
        raise NotImplementedError

    def local_rank(self):
        raise NotImplementedError

    def local_size(self):
        raise NotImplementedError

    # --- reductions -----------------------------------------------------
    def allreduce_async(self, tensor, name, op=Average):
        """Start an in-place reduction of `tensor` across ranks."""
        _check_tensor(tensor)
        _check_op(op)
        if not isinstance(name, str) or not name:
            raise ValueError(f"allreduce_async needs a non-empty string name, got {name!r}")
        if name in self._names:
            raise ValueError(
                f"tensor name {name!r} is already in flight; wait for it first or use a "
                "distinct name per in-flight reduction")
        backend = self._start_allreduce(tensor, name, op)
        handle = Handle(next(self._ids), name, tensor, op, backend)
        self._in_flight[handle.id] = handle
        self._names[name] = handle.id
        return handle

    def _known(self, handle):
        if not isinstance(handle, Handle) or self._in_flight.get(handle.id) is not handle:
            raise ValueError(
                f"unknown handle {handle!r}: not returned by this engine's allreduce_async, "
                "or already waited for")
        return handle

    def poll(self, handle):
        """True when `wait(handle)` would return without blocking."""
        return self._poll(self._known(handle))

    def wait(self, handle):
        """Block until the reduction lands; return the reduced tensor."""
        handle = self._known(handle)
        result = self._wait(handle)
        del self._in_flight[handle.id]
        del self._names[handle.name]
        return result

    def in_flight(self):
        return len(self._in_flight)

    # --- other collectives ----------------------------------------------
    def broadcast(self, tensor, root):
        """Overwrite `tensor` in place with root's value; return it."""
        raise NotImplementedError

    def broadcast_object(self, obj, root):
        raise NotImplementedError

    def allgather_object(self, obj):
        """Every rank's `obj`, in rank order (for cross-rank consistency checks)."""
        raise NotImplementedError

    def barrier(self):
        raise NotImplementedError

    def before_shutdown(self, key, callback):
        """Have shutdown() call `callback()` first, once per `key`.

        Adapters use it to report what they still hold (gradients never
        applied) while the engine can still talk to the other ranks.
        """
        self._before_shutdown[key] = callback

    def shutdown(self):
        """Complete every reduction still in flight, then let go of the library.

        Scripts exit without draining the pipeline. A rank that shut the
        library down with reductions in flight would fail the ranks that have
        not started them yet (Horovod: "Horovod has been shut down"), so
        each is waited for here: it completes as soon as every rank started
        it, which every rank does before it exits. Called at interpreter
        exit too (engine.init registers it); a second call does nothing.
        """
        if self._closed:
            return
        self._closed = True
        try:
            for callback in list(self._before_shutdown.values()):
                callback()
            for handle in list(self._in_flight.values()):
                self.wait(handle)
        finally:
            self._in_flight.clear()
            self._names.clear()
            self._close()

    def _close(self):
        """Subclass hook: release the library (after in-flight work completed)."""

    # --- subclass hooks -------------------------------------------------
    def _start_allreduce(self, tensor, name, op):
        raise NotImplementedError

    def _poll(self, handle):
        raise NotImplementedError

    def _wait(self, handle):
        raise NotImplementedError
