"""The elastic core every adapter shares: State, ObjectState and the `run` loop.

As Horovod's horovod/common/elastic.py: the names, arguments and life cycle
are Horovod's, and the framework adapters build on them (TorchState in
pipe_horovod.torch.elastic, TensorFlowState and TensorFlowKerasState in
pipe_horovod.tensorflow.elastic, KerasState in pipe_horovod.keras.elastic).
What differs from Horovod, and why:

* Committed values are deep copies, and `restore()` hands out copies again:
  changing a list held in the state in place after a commit does not change
  what was committed (Horovod keeps a reference).
* `run` works on every engine. Under horovodrun's elastic mode it is
  Horovod's own loop (`horovod.common.elastic.run_fn`) with pipe_horovod's
  reset (engine/ restarted in the process); under torchrun and plain python
  the same loop without a notification service (`run_in_process`).
* A failure that repeats is not retried forever. A misuse that raises the same
  error at the same point after every restore (every rank passes another
  argument, say) would otherwise loop with nothing printed. When the same
  failure (same type, same message) ends MAX_SAME_FAILURES attempts in a row
  with no commit in between, `run` raises RepeatedFailureError naming it and
  the count. A failure after progress (a commit since the last one) starts
  the count again, so a job that loses a rank now and then is never stopped.
  $PIPE_HOROVOD_ELASTIC_MAX_SAME_FAILURES sets the bound (default 3).
"""
import copy
import functools
import os
import queue

from .. import engine
from ..collectives.communicator import abandon
from .basics import rank
from .exceptions import HorovodInternalError, HostsUpdatedInterrupt, RepeatedFailureError
from .objects import broadcast_object

_HOSTS_REMOVED = 1          # Horovod's HostUpdateResult.removed (a flag; added = 2)
MAX_SAME_FAILURES_VARIABLE = "PIPE_HOROVOD_ELASTIC_MAX_SAME_FAILURES"
DEFAULT_MAX_SAME_FAILURES = 3


def _bcast_from_rank0(obj):
    return broadcast_object(obj, root_rank=0)


class State:
    """Horovod's `State`: what a training function must be able to commit,
    restore and synchronize, plus the host-update notifications.

    `bcast_object(obj)` sends rank 0's object to all ranks; `get_rank()`
    returns this rank (both default to pipe_horovod's own).
    """

    def __init__(self, bcast_object=None, get_rank=None):
        self._bcast_object = bcast_object or _bcast_from_rank0
        self._rank = get_rank or rank
        self._host_messages = queue.Queue()
        self._last_updated_timestamp = 0
        self._reset_callbacks = []
        self._commits = 0

    def register_reset_callbacks(self, callbacks):
        """Call each of `callbacks` (no arguments) after every reset, before the sync:
        e.g. to scale the learning rate to the new number of ranks."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        self._host_messages = queue.Queue()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp, update_res):
        """Called by Horovod's worker notification service when hosts were added or removed."""
        self._host_messages.put((timestamp, update_res))

    def commit(self):
        """Keep the current state in memory as the one to return to after a failure,
        then check for host changes (which raises HostsUpdatedInterrupt on every rank).

        Commits copy the whole state and, with a pipelined optimizer, wait for its
        gradients in flight: commit every few batches rather than every batch.
        """
        self.save()
        self._commits += 1          # progress: `run` counts repeated failures anew
        self.check_host_updates()

    def check_host_updates(self):
        """Raise HostsUpdatedInterrupt, on every rank at once, if rank 0 heard of new
        or removed hosts since the last check. A collective: call it on every rank."""
        previous = latest = self._last_updated_timestamp
        update = 0
        while not self._host_messages.empty():
            timestamp, result = self._host_messages.get()
            if timestamp > latest:
                latest = timestamp
                update |= int(result)
        previous, self._last_updated_timestamp, update = self._bcast_object(
            (previous, latest, update))
        if self._last_updated_timestamp > previous:
            # Only removed hosts: the survivors hold the same state, no sync needed.
            raise HostsUpdatedInterrupt(update == _HOSTS_REMOVED)

    def save(self):
        """Copy the state to host memory (what commit keeps)."""
        raise NotImplementedError

    def restore(self):
        """Return to the last committed state, undoing every change since."""
        raise NotImplementedError

    def sync(self):
        """Give every rank rank 0's state."""
        raise NotImplementedError

    def reset(self):
        """Adjust to a reset (new ranks), after the engine restarted and before the sync."""

    def _before_engine_reset(self):
        """Called by elastic `run` just before the engine shuts down for a reset."""


class ObjectState(State):
    """Horovod's `ObjectState`: plain Python values given as keyword arguments and
    exposed as attributes (`state.epoch`), committed and broadcast as one object."""

    def __init__(self, bcast_object=None, get_rank=None, **kwargs):
        self._saved_state = copy.deepcopy(kwargs)
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self):
        self._saved_state = {attr: copy.deepcopy(getattr(self, attr))
                             for attr in self._saved_state}

    def restore(self):
        self._set_attrs()

    def sync(self):
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self):
        for attr, value in self._saved_state.items():
            setattr(self, attr, copy.deepcopy(value))


# --- the run loop -----------------------------------------------------------------
def max_same_failures(environ=None):
    """How many identical failures in a row end elastic `run`: the environment's
    PIPE_HOROVOD_ELASTIC_MAX_SAME_FAILURES, else DEFAULT_MAX_SAME_FAILURES.

    Raises:
        ValueError: the variable is not an integer >= 1.
    """
    value = (os.environ if environ is None else environ).get(MAX_SAME_FAILURES_VARIABLE, "")
    if value.strip() == "":
        return DEFAULT_MAX_SAME_FAILURES
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise ValueError(f"{MAX_SAME_FAILURES_VARIABLE} must be an integer >= 1 (how many "
                         f"identical failures in a row end elastic training), got {value!r}")
    return count


class _FailureStreak:
    """The failures that ended the attempts since the last commit, counted while they are
    the same (type and message): restoring the same commit over and over cures nothing."""

    def __init__(self, limit):
        self.limit = limit
        self.key, self.count, self.commits = None, 0, None

    def record(self, failure, state):
        """Count `failure`; raise RepeatedFailureError (from it) at the limit."""
        key = (type(failure), str(failure))
        commits = getattr(state, "_commits", 0)
        if key == self.key and commits == self.commits:
            self.count += 1
        else:
            self.key, self.count, self.commits = key, 1, commits
        if self.count >= self.limit:
            raise RepeatedFailureError(failure, self.count,
                                       MAX_SAME_FAILURES_VARIABLE) from failure


def run(func, failure_behind=None):
    """Decorator: run `func(state, ...)` until it returns, surviving resets.

    Why: a lost or added worker should cost the steps since the last commit,
    not the whole job. Before each attempt the state is synchronized from
    rank 0 (skipped after a HostsUpdatedInterrupt that only removed hosts).
    On HorovodInternalError the state is restored to its last commit; on
    HostsUpdatedInterrupt it is kept; either way the engine is reset, the
    state's reset callbacks run, and `func` is called again. The same failure
    ending several attempts in a row ends the run (module docstring).

    Args:
        func: the training function, called with the State first; it must not start
            with a collective (a joining worker runs it while the others sync).
        failure_behind: an adapter's hook: given an exception `func` raised, the
            HorovodInternalError or HostsUpdatedInterrupt behind it (a framework that
            wraps errors raised inside its graphs), or None to let it through as it is.

    Returns:
        A function of the same arguments that returns what `func` returns.

    Raises:
        RepeatedFailureError: the same failure ended MAX_SAME_FAILURES attempts in a row.
        ValueError: PIPE_HOROVOD_ELASTIC_MAX_SAME_FAILURES is not an integer >= 1.
    """
    def attempt(state, *args, **kwargs):
        try:
            return func(state, *args, **kwargs)
        except Exception as error:
            failure = None if failure_behind is None else failure_behind(error)
            if failure is None or failure is error:
                raise
            raise failure from error

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        streak = _FailureStreak(max_same_failures())
        current = engine.current()
        if current.name != "horovod":
            return run_in_process(attempt, functools.partial(_settle, current), state, args,
                                  kwargs, streak)
        from horovod.common.elastic import run_fn

        def attempt_under_horovod(state, *args, **kwargs):
            try:
                return attempt(state, *args, **kwargs)
            except HorovodInternalError as failure:
                # At the failure, before the restore and the reset wait for anything:
                # pipe_horovod's own point-to-point collectives are abandoned. The
                # restore drops what they carry, and some wait for a peer that will
                # never send (the one that failed, or whose collective failed, before
                # starting them); the reset's engine opens a new group when needed.
                abandon(engine.current())
                streak.record(failure, state)
                raise

        return run_fn(attempt_under_horovod, functools.partial(_restart, state))(
            state, *args, **kwargs)

    return wrapper


def run_in_process(func, reset, state, args, kwargs, streak=None):
    """The elastic loop without a notification service (torch and local engines):
    Horovod's run_fn, with `reset()` for its reset and repeated failures counted."""
    streak = streak or _FailureStreak(max_same_failures())
    skip_sync = False
    while True:
        try:
            if not skip_sync:
                state.sync()
            return func(state, *args, **kwargs)
        except HorovodInternalError as failure:
            streak.record(failure, state)
            state.restore()
            skip_sync = False
        except HostsUpdatedInterrupt as interrupt:
            skip_sync = interrupt.skip_sync
        reset()
        state.on_reset()


def _restart(state):
    """Under Horovod: settle what is in flight, restart the engine in this process."""
    current = engine.current()
    _settle(current)
    getattr(state, "_before_engine_reset", lambda: None)()
    engine.shutdown()
    engine.init(current.name)


def _settle(eng):
    """Wait for every operation `eng` still has in flight, forgetting failed ones.

    On the rank that failed, its peers are still running and start (so
    complete) these operations; on a rank whose peer reset, they fail at
    once. Either way none is left for the engine's shutdown to wait for.
    """
    eng.settle_in_flight()


__all__ = ["DEFAULT_MAX_SAME_FAILURES", "MAX_SAME_FAILURES_VARIABLE", "ObjectState", "State",
           "max_same_failures", "run", "run_in_process"]
