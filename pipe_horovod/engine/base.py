"""The contract every communication engine honours.

Adapters and the pipeline core see only this interface, so a script runs
unchanged under horovodrun, torchrun or plain python. The checks that
protect users from silent corruption (a name reused while in flight, a
non-contiguous tensor that the C++ side would reduce in a copy, a bad
argument the library would answer with an abort or a hang) run here once,
instead of in each engine. Engines implement the `_start_*` hooks; process
sets (process_set_registry.py), automatic names, the timeline and the handles in
flight are kept here; two-stage operations (two_stage.py) and the reports of what
failed (reporting.py) are mixed in from modules of their own.
"""
import collections
import contextlib
import functools
import inspect
import itertools
import math
import threading
import time

from .argument_checks import (check_name, check_op, check_reducible, check_root, check_rows,
                              check_scale, check_splits, check_tensor, check_tensors)
from .faults import (DEFAULT_TIMEOUT_S, TIMEOUT_VARIABLE, EngineError,  # noqa: F401
                     HorovodInternalError, HostsUpdatedInterrupt, RankLostError, WaitError,
                     WaitTimeoutError, wait_until)
from . import objects, summary
from .handles import Handle
from .mismatch import MismatchError
from .stall import POSTED_RAISES, STATUS_AFTER_S, Call, Stall, StepMismatchError, describe
from .ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum  # noqa: F401
from .process_set_registry import ProcessSetRegistry
from .process_sets import ProcessSet, global_process_set  # noqa: F401
from .reporting import FailureReports
from .timeline import Timeline
from .two_stage import TwoStageOperations
from .work import Done, Then, Work, WorkList  # noqa: F401 -- engines import them from here


def shard_sizes(numel, size):
    """`size` near-equal contiguous shards of `numel` elements, larger ones first
    (how Horovod's reducescatter splits rows)."""
    base, extra = divmod(numel, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def _tells_the_others(method):
    """Decorates the engine's collectives: an error `method` raises on this rank (a bad
    argument, here alone, while the others start the call) is posted to the status board
    with the call, so the others' waits for it name it (causes.py) instead of stalling.
    Errors every rank gets from the collective itself (MismatchError) or that name another
    rank's cause (WaitError) are not posted again."""
    signature = inspect.signature(method)
    kind = method.__name__.removesuffix("_async")

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except (MismatchError, WaitError):
            raise
        except Exception as exc:
            try:
                bound = signature.bind(self, *args, **kwargs).arguments
            except TypeError:
                bound = {}
            called = bound["kind"] if isinstance(bound.get("kind"), str) else kind
            if isinstance(exc, HorovodInternalError):   # the library refused to start it
                raise self._diagnose(exc, Call(called, bound.get("name"))) from exc
            self._tell_raised(exc, called, bound.get("name"), bound.get("process_set"))
            raise
    return call


def _member(name, i, tensors):
    """The name of a grouped operation's i-th tensor run on its own: with the count, as
    Horovod names them, so ranks that pass different counts match none (and the stall
    report compares the counts, causes.py) instead of completing some."""
    return f"{name}.{i + 1}of{len(tensors)}"


def scale_(tensor, factor):
    """Multiply in place by `factor`; integer tensors truncate, as Horovod's scaling does."""
    if factor == 1:
        return tensor
    if tensor.is_floating_point() or tensor.is_complex():
        return tensor.mul_(factor)
    return tensor.copy_((tensor.double() * factor).trunc())


class Engine(ProcessSetRegistry, TwoStageOperations, FailureReports):
    """Base class: bookkeeping of handles; subclasses talk to a library."""

    name = "base"

    def __init__(self, timeout_s=DEFAULT_TIMEOUT_S):
        self._in_flight = {}      # handle id -> Handle
        self._names = {}          # tensor name -> handle id
        self._ids = itertools.count()
        self._before_shutdown = {}
        self._around_join = {}    # key -> (before(), after(last_rank))
        self._closed = False
        self._process_sets = {}   # process_set_id -> (ProcessSet, the library's object)
        self._tag_slots = {}      # process_set_id -> its slot in message tags (the registry)
        self._unnamed = collections.Counter()   # kind -> operations started without a name
        self._timeline = None
        self.timeout_s = timeout_s  # how long a wait may block (faults.py)
        self._peers = None        # [(host, pid)] by rank: who to look for when a collective fails
        self._failed = False      # a collective failed: shutdown waits for nothing more
        self._lost = None         # why it failed, when a rank was lost: posted at shutdown
        self._board = None        # where ranks post what they do when a wait stalls (stall.py)
        self.step = None          # the step count of the pipeline (set by the step machine)
        self.stepping = False     # a pipeline launched the next step's collectives (ditto)
        self._raises = 0          # errors this rank posted (stall.py), numbered
        self._posted = collections.deque(maxlen=POSTED_RAISES)   # the last of them
        self._final = None        # the number of the last that stops it (refuse, uncaught)
        self._raised = set()      # what they were raised in: others raising alike are not news
        self._told = set()        # (rank, number) of others' posted errors raised here
        self._raisers = set()     # ranks whose error that stops them this rank raised
        self._uncaught = False    # an error ends this rank's script (tell_uncaught)
        self._thread = threading.local()    # .calls: the object collective a thread is in
        self._pool = None         # threads of two-stage reductions (two_stage_async)
        self._releasing = False   # shutdown lets go of the library: pool threads stop waiting

    # --- identity -------------------------------------------------------
    def rank(self):
        raise NotImplementedError

    def size(self):
        raise NotImplementedError

    def local_rank(self):
        raise NotImplementedError

    def local_size(self):
        raise NotImplementedError

    def cross_rank(self):
        """Index of this process's node (Horovod: rank among processes with its local rank)."""
        raise NotImplementedError

    def cross_size(self):
        raise NotImplementedError

    def is_homogeneous(self):
        """True when every node runs the same number of ranks."""
        raise NotImplementedError

    def capabilities(self):
        """What the library was built with and runs on, under Horovod's query names:
        mpi_built, mpi_enabled, mpi_threads_supported (None without MPI), gloo_built,
        gloo_enabled, nccl_built (NCCL's version code, 0 without), ddl_built, ccl_built,
        cuda_built, rocm_built."""
        raise NotImplementedError

    # --- bookkeeping of operations in flight ---------------------------
    def _claim(self, kind, name, ps=None):
        """The name an operation runs under: `name`, or an automatic one for None.

        Automatic names count per kind and process set, so they agree across
        the ranks of a set that start unnamed operations in the same order
        (Horovod's rule, kept when only some ranks use another set)."""
        check_name(name, kind)
        if name is None:
            name = self._unnamed_name(kind, ps, claim=True)
        if name in self._names:
            raise ValueError(
                f"tensor name {name!r} is already in flight; wait for it first or use a "
                "distinct name per in-flight operation")
        return name

    def _unnamed_name(self, kind, ps, claim=False):
        """The automatic name of the next `kind` started without one on `ps` (None: every
        rank), counted once `claim`ed."""
        set_id = 0 if ps is None else ps.process_set_id or 0
        count = self._unnamed[kind, set_id] + 1
        if claim:
            self._unnamed[kind, set_id] = count
        return f"{kind}.noname.{'' if not set_id else f'set{set_id}.'}{count}"

    def _track(self, kind, name, tensor, op, backend, started, root=None):
        handle = Handle(next(self._ids), name, tensor, op, backend, kind, started, root)
        self._in_flight[handle.id] = handle
        self._names[name] = handle.id
        return handle

    def _clock(self):
        return None if self._timeline is None else self._timeline.now()

    # --- reductions -----------------------------------------------------
    @_tells_the_others
    def allreduce_async(self, tensor, name, op=Average, *, process_set=None,
                        prescale_factor=1.0, postscale_factor=1.0):
        """Start an in-place reduction of `tensor` across the ranks of `process_set`.

        `name` None picks an automatic name. The result is
        postscale * op(prescale * tensor); Average divides the sum by the set's size.
        """
        check_tensor(tensor)
        check_reducible(tensor, "allreduce")
        check_op(op)
        check_scale(prescale_factor, "prescale_factor")
        check_scale(postscale_factor, "postscale_factor")
        started = self._clock()
        ps = self.resolve_process_set(process_set)
        name = self._claim("allreduce", name, ps)
        self._check_adasum(op, ps, [tensor])
        backend = self._start_allreduce(tensor, name, op, ps, prescale_factor, postscale_factor)
        return self._track("allreduce", name, tensor, op, backend, started)

    @_tells_the_others
    def grouped_allreduce_async(self, tensors, name, op=Average, *, process_set=None,
                                prescale_factor=1.0, postscale_factor=1.0):
        """Reduce a list of tensors in place as one operation; `wait` returns the list."""
        tensors = check_tensors(tensors, "grouped_allreduce")
        for tensor in tensors:
            check_reducible(tensor, "grouped_allreduce")
        check_op(op)
        check_scale(prescale_factor, "prescale_factor")
        check_scale(postscale_factor, "postscale_factor")
        started = self._clock()
        ps = self.resolve_process_set(process_set)
        name = self._claim("grouped_allreduce", name, ps)
        self._check_adasum(op, ps, tensors)
        backend = self._start_grouped_allreduce(tensors, name, op, ps, prescale_factor,
                                                postscale_factor)
        return self._track("grouped_allreduce", name, tensors, op, backend, started)

    def _check_adasum(self, op, ps, tensors):
        if op is not Adasum:
            return
        if ps is not global_process_set:
            raise NotImplementedError("Adasum does not support process sets other than the "
                                      "global one (as in Horovod)")
        size = len(ps.ranks)
        if size & (size - 1):
            raise NotImplementedError(f"Adasum needs a power-of-2 number of ranks (as in "
                                      f"Horovod), got {size}")
        if not all(t.is_floating_point() for t in tensors):
            raise ValueError("Adasum needs floating-point tensors")

    @_tells_the_others
    def reducescatter_async(self, tensor, name, op=Average, *, process_set=None,
                            prescale_factor=1.0, postscale_factor=1.0):
        """Reduce `tensor` and give rank i of the set the i-th block of rows.

        Rows split as evenly as possible, the first ranks taking one more
        (Horovod's split). `wait` returns this rank's block, a new tensor."""
        check_tensor(tensor, "reducescatter")
        check_reducible(tensor, "reducescatter")
        check_op(op, (Average, Sum), "reducescatter")
        check_rows(tensor, "reducescatter")
        check_scale(prescale_factor, "prescale_factor")
        check_scale(postscale_factor, "postscale_factor")
        started = self._clock()
        ps = self.resolve_process_set(process_set)
        name = self._claim("reducescatter", name, ps)
        backend = self._start_reducescatter(tensor, name, op, ps, prescale_factor,
                                            postscale_factor)
        return self._track("reducescatter", name, tensor, op, backend, started)

    @_tells_the_others
    def grouped_reducescatter_async(self, tensors, name, op=Average, *, process_set=None,
                                    prescale_factor=1.0, postscale_factor=1.0):
        tensors = check_tensors(tensors, "grouped_reducescatter")
        for tensor in tensors:
            check_reducible(tensor, "grouped_reducescatter")
        check_op(op, (Average, Sum), "grouped_reducescatter")
        for tensor in tensors:
            check_rows(tensor, "grouped_reducescatter")
        check_scale(prescale_factor, "prescale_factor")
        check_scale(postscale_factor, "postscale_factor")
        started = self._clock()
        ps = self.resolve_process_set(process_set)
        name = self._claim("grouped_reducescatter", name, ps)
        backend = self._start_grouped_reducescatter(tensors, name, op, ps, prescale_factor,
                                                    postscale_factor)
        return self._track("grouped_reducescatter", name, tensors, op, backend, started)

    # --- data movement --------------------------------------------------
    @_tells_the_others
    def allgather_async(self, tensor, name, *, process_set=None):
        """Concatenate every rank's `tensor` along dim 0 (first dims may differ)."""
        check_tensor(tensor, "allgather")
        check_rows(tensor, "allgather")
        started = self._clock()
        ps = self.resolve_process_set(process_set)
        name = self._claim("allgather", name, ps)
        return self._track("allgather", name, tensor, None,
                           self._start_allgather(tensor, name, ps), started)

    @_tells_the_others
    def grouped_allgather_async(self, tensors, name, *, process_set=None):
        tensors = check_tensors(tensors, "grouped_allgather")
        for tensor in tensors:
            check_rows(tensor, "grouped_allgather")
        started = self._clock()
        ps = self.resolve_process_set(process_set)
        name = self._claim("grouped_allgather", name, ps)
        return self._track("grouped_allgather", name, tensors, None,
                           self._start_grouped_allgather(tensors, name, ps), started)

    @_tells_the_others
    def broadcast_async(self, tensor, root, name, *, process_set=None):
        """Overwrite `tensor` in place with global rank `root`'s value."""
        check_tensor(tensor, "broadcast")
        started = self._clock()
        ps = self.resolve_process_set(process_set)
        name = self._claim("broadcast", name, ps)
        self._check_root_in(root, ps)
        return self._track("broadcast", name, tensor, None,
                           self._start_broadcast(tensor, root, name, ps), started, root)

    @_tells_the_others
    def alltoall_async(self, tensor, splits, name, *, process_set=None):
        """Send rows splits[i] to the set's i-th rank; `wait` returns
        (received rows concatenated in rank order, int32 tensor of rows received from each)."""
        check_tensor(tensor, "alltoall")
        check_rows(tensor, "alltoall")
        started = self._clock()
        ps = self.resolve_process_set(process_set)
        name = self._claim("alltoall", name, ps)
        splits = check_splits(splits, tensor.shape[0], len(ps.ranks))
        return self._track("alltoall", name, tensor, None,
                           self._start_alltoall(tensor, splits, name, ps), started)

    @_tells_the_others
    def adopt_async(self, kind, tensor, name, op, start, *, process_set=None):
        """Track an operation the library does not run (pipe_horovod.collectives):
        `start(process_set)` returns its Work; names, poll/wait, the timeline and
        shutdown's completion of what is in flight then apply as to the library's own."""
        started = self._clock()
        ps = self.resolve_process_set(process_set)
        name = self._claim(kind, name, ps)
        return self._track(kind, name, tensor, op, start(ps), started)

    def _known(self, handle):
        if not isinstance(handle, Handle) or self._in_flight.get(handle.id) is not handle:
            raise ValueError(
                f"unknown handle {handle!r}: not returned by this engine's *_async calls, "
                "or already waited for")
        return handle

    def poll(self, handle):
        """True when `wait(handle)` would return without blocking."""
        return self._poll_backend(self._known(handle))

    def _poll_backend(self, handle):
        if isinstance(handle.backend, Work):
            return handle.backend.poll()
        return self._poll(handle)

    def _wait_backend(self, handle):
        if isinstance(handle.backend, Work):
            return handle.backend.wait()
        return self._wait(handle)

    def wait(self, handle):
        """Block until the operation completes; return its result (for an
        allreduce, the reduced tensor). A failed operation is forgotten too.

        Raises WaitTimeoutError after `timeout_s` seconds, RankLostError when
        the operation failed because a rank died (faults.py).
        """
        handle = self._known(handle)
        try:
            if math.isfinite(self.timeout_s) and not self._wait_for(
                    lambda: self._poll_backend(handle), lambda: self._call_of(handle),
                    lambda: self._matched(handle), getattr(handle.backend, "nap", None)):
                raise WaitTimeoutError(
                    f"{describe(handle.kind, handle.name)} did not complete within "
                    f"{self.timeout_s:g} s ({TIMEOUT_VARIABLE}, or init(timeout=...)): a rank "
                    "has not started it")
            result = self._wait_backend(handle)
        except (EngineError, MismatchError):
            raise
        except (StepMismatchError, RankLostError):   # from the stall checks: diagnosed
            self._failed = True          # the others will not start what is in flight
            raise
        except RuntimeError as exc:
            raise self._diagnose(exc, self._call_of(handle)) from exc
        finally:
            del self._in_flight[handle.id]
            del self._names[handle.name]
        if self._timeline is not None and handle.started is not None:
            self._timeline.record(handle.kind, handle.name, handle.started, self._timeline.now())
        return result

    def in_flight(self):
        return len(self._in_flight)

    def settle_in_flight(self):
        """Wait for every operation still in flight, forgetting those that fail.

        Why: an elastic reset (pipe_horovod.torch.elastic) follows a failed
        collective. On the rank that failed, its peers are still running and
        complete these operations; on a rank whose peer reset, they fail at
        once. Either way none is left for a shutdown to wait for.
        """
        for handle in list(self._in_flight.values()):
            try:
                self.wait(handle)
            except Exception:        # a failed collective: nothing left to complete
                pass

    def _wait_for(self, poll, call, matched=lambda: False, nap=None):
        """True once `poll()` is, False past `timeout_s`; a wait that lasts STATUS_AFTER_S
        is inspected as a stall (stall.py), which may raise its cause (causes.py).

        `call()`: the stall.Call this rank waits in, asked only then; `nap(seconds)`:
        how to pause between polls, when the backend can wake the wait sooner."""
        start = time.monotonic()
        deadline = start + self.timeout_s
        first = STATUS_AFTER_S + summary.phase(self.rank(), self.size(), STATUS_AFTER_S)
        if wait_until(poll, min(deadline, start + first), nap):
            if getattr(self._board, "failed", False):   # it went on (Stall.gave_up)
                self._board.post(self.rank(), state="running", step=self.step)
            return True
        if self._board is None:
            return wait_until(poll, deadline, nap)
        stall = Stall(self, call(), start)
        done = False
        try:
            while time.monotonic() < deadline:
                stall.tick(matched)             # reads the others' posts
                for _ in range(2):              # renewed twice a period: another rank's next
                    if wait_until(poll, min(deadline, time.monotonic() + STATUS_AFTER_S / 2),
                                  nap):         # look finds it renewed (causes.deadlock)
                        done = True
                        return True
                    stall.renew()
            return False
        finally:
            stall.end(failed=not done)

    def _call_of(self, handle):
        """The stall.Call a wait on `handle` is in: the object collective around it, if any."""
        calls = self._object_calls()
        if calls:
            kind, name, root = calls[-1]
            return Call(kind, name, handle.name, root)
        return Call(handle.kind, handle.name, root=handle.root, tensors=handle.tensor)

    @contextlib.contextmanager
    def calling(self, kind, name, root=None):
        """Inside it, the engine's waits and errors are those of the call `kind` `name`
        (objects.py: an object collective is made of tensor collectives)."""
        calls = self._object_calls()
        calls.append((kind, name, root))
        try:
            yield
        finally:
            calls.pop()

    def _object_calls(self):
        """This thread's stack of calling() (a thread of its own in Keras's hand-offs)."""
        if not hasattr(self._thread, "calls"):
            self._thread.calls = []
        return self._thread.calls

    def names_in_flight(self):
        """The names of the collectives this rank has started and not waited for."""
        return list(self._names)

    def _matched(self, handle):
        """Whether every rank has started `handle` (engines that know say so)."""
        return False

    def _missing(self, call):
        """Which ranks have not started the collective this rank waits on (`call`, a
        stall.Call), as a clause for messages (engines that know say so)."""
        return ""

    # --- faults -----------------------------------------------------------
    # --- synchronous collectives ----------------------------------------
    def broadcast(self, tensor, root, *, process_set=None):
        """Overwrite `tensor` in place with root's value; return it."""
        return self.wait(self.broadcast_async(tensor, root, None, process_set=process_set))

    @_tells_the_others
    def broadcast_object(self, obj, root, *, name=None, process_set=None):
        """Root's picklable `obj`, on every rank of the set (objects.py)."""
        check_name(name, "broadcast_object")
        ps = self.resolve_process_set(process_set)
        self._check_root_in(root, ps)
        return objects.broadcast_object(self, obj, root, self._object_name(name, ps), ps)

    @_tells_the_others
    def allgather_object(self, obj, *, name=None, process_set=None):
        """Every rank's `obj`, in rank order (objects.py)."""
        check_name(name, "allgather_object")
        ps = self.resolve_process_set(process_set)
        return objects.allgather_object(self, obj, self._object_name(name, ps), ps)

    def _object_name(self, name, ps):
        """`name`, or the next automatic name of an object collective: one counter for both
        kinds (objects.py says why)."""
        return name if name is not None else self._unnamed_name("object", ps, claim=True)

    def gather_despite_join(self, obj, *, name, process_set=None):
        """Every rank's picklable `obj` in set order, None for a rank that has joined.

        Built on Sum allreduces, which a joined rank answers with zeros
        (Horovod's join, and the torch engine's), where an allgather fails
        ("Allgather is not supported with Join"): the pipeline agrees its
        bucket order this way at the first step, which a rank with an empty
        shard never takes."""
        import pickle

        import torch

        ps = self.resolve_process_set(process_set)
        me = ps.ranks.index(self.rank())
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = torch.zeros(len(ps.ranks), dtype=torch.int64)
        sizes[me] = data.numel() + 1                     # 0: a joined rank's zeros
        sizes = self.wait(self.allreduce_async(sizes, f"{name}.sizes", Sum, process_set=ps))
        table = torch.zeros(len(ps.ranks), int(sizes.max()), dtype=torch.int32)
        table[me, :data.numel()] = data                  # int32: Horovod sums no bytes
        table = self.wait(self.allreduce_async(table, f"{name}.data", Sum, process_set=ps))
        return [None if n == 0 else pickle.loads(table[r, :n - 1].to(torch.uint8).numpy()
                                                 .tobytes())
                for r, n in enumerate(sizes.tolist())]

    @_tells_the_others
    def barrier(self, *, process_set=None):
        """Return once every rank of the set has called barrier (matched by name, as the
        other collectives: an automatic one per call)."""
        started = self._clock()
        ps = self.resolve_process_set(process_set)
        name = self._claim("barrier", None, ps)
        self.wait(self._track("barrier", name, None, None, self._start_barrier(name, ps),
                              started))

    @_tells_the_others
    def join(self, device=-1):
        """Declare this rank done; return the rank that joined last.

        Callbacks registered with around_join run before (this rank) and
        after (every rank, once all joined), so adapters can drain state
        that is tied to a step count and line it up again across ranks.
        """
        if isinstance(device, bool) or not isinstance(device, int):
            raise TypeError(f"join's device must be an int (-1: CPU), got {device!r}")
        for before, _ in list(self._around_join.values()):
            before()
        last = self._join(device)
        for _, after in list(self._around_join.values()):
            after(last)
        return last

    def _wait_for_join(self, poll, nap=None):
        """Engines' _join: wait, bounded and inspected as any wait, until every rank joined."""
        if not self._wait_for(poll, lambda: Call("join", None), nap=nap):
            raise WaitTimeoutError(f"join did not complete within {self.timeout_s:g} s "
                                   f"({TIMEOUT_VARIABLE}, or init(timeout=...)): a rank has not "
                                   "joined")

    def around_join(self, key, before, after):
        """Have join() call `before()` first and `after(last_rank)` last, once per `key`."""
        self._around_join[key] = (before, after)

    def _check_root_in(self, root, ps):
        check_root(root, self.size())
        if root not in ps.ranks:
            raise ValueError(f"root rank {root} is not a member of {ps}")

    # --- timeline -------------------------------------------------------
    def start_timeline(self, file_path, mark_cycles=False):
        """Record operations to a Chrome-trace file (rank 0 writes it, as in Horovod)."""
        self.stop_timeline()
        if self.rank() == 0:
            self._timeline = Timeline(file_path, mark_cycles)

    def stop_timeline(self):
        timeline, self._timeline = self._timeline, None
        if timeline is not None:
            timeline.close()

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
        me, size = self.rank(), self.size()      # the library cannot say once released
        if self._board is not None:      # the others' waits can now say who stopped, when
            cause = {} if self._lost is None else {"lost": self._lost}
            self._board.post(self.rank(), state="ended", step=self.step,
                             stepping=self.stepping, **cause)
        try:
            if self._failed:             # the others cannot complete anything now
                return
            for callback in list(self._before_shutdown.values()):
                callback()
            for handle in list(self._in_flight.values()):
                self.wait(handle)
        finally:
            self._in_flight.clear()
            self._names.clear()
            self._releasing = True
            self._close()
            pool, self._pool = self._pool, None
            if pool is not None:     # its threads see _releasing and leave
                pool.shutdown(wait=True, cancel_futures=True)
            self._linger_for_readers(me, size)
            self._leave_after_raisers()

    def _close(self):
        """Subclass hook: release the library (after in-flight work completed)."""

    # --- subclass hooks -------------------------------------------------
    # Each gets validated arguments and a registered ProcessSet the caller is
    # in; each returns the backend state of the operation (a Work, or for
    # _start_allreduce anything the engine's _poll/_wait understand).
    def _start_allreduce(self, tensor, name, op, process_set, prescale_factor, postscale_factor):
        raise NotImplementedError

    def _start_grouped_allreduce(self, tensors, name, op, process_set, prescale_factor,
                                 postscale_factor):
        return WorkList([self._start_allreduce(t, _member(name, i, tensors), op, process_set,
                                               prescale_factor, postscale_factor)
                         for i, t in enumerate(tensors)])

    def _start_reducescatter(self, tensor, name, op, process_set, prescale_factor,
                             postscale_factor):
        raise NotImplementedError

    def _start_grouped_reducescatter(self, tensors, name, op, process_set, prescale_factor,
                                     postscale_factor):
        return WorkList([self._start_reducescatter(t, _member(name, i, tensors), op,
                                                   process_set, prescale_factor,
                                                   postscale_factor)
                         for i, t in enumerate(tensors)])

    def _start_allgather(self, tensor, name, process_set):
        raise NotImplementedError

    def _start_grouped_allgather(self, tensors, name, process_set):
        return WorkList([self._start_allgather(t, _member(name, i, tensors), process_set)
                         for i, t in enumerate(tensors)])

    def _start_broadcast(self, tensor, root, name, process_set):
        raise NotImplementedError

    def _start_alltoall(self, tensor, splits, name, process_set):
        raise NotImplementedError

    def _start_alltoall_known(self, tensor, splits, received, name, process_set):
        """An alltoall whose receiver already knows what each rank sends it (`received`,
        rows by rank), and every rank's tensor has the same rows (two_stage_async's
        chunks): engines that exchange the splits first may skip that (and must then
        refuse a tensor whose rows differ across ranks)."""
        return self._start_alltoall(tensor, splits, name, process_set)

    def _start_barrier(self, name, process_set):
        raise NotImplementedError

    def _join(self, device):
        raise NotImplementedError

    def _add_library_set(self, process_set):
        """Create the library's side of a new set; return (process_set_id, library object)."""
        raise NotImplementedError

    def _remove_library_set(self, process_set, library_set):
        raise NotImplementedError

    def _poll(self, handle):
        raise NotImplementedError

    def _wait(self, handle):
        raise NotImplementedError
