"""Runs the collectives of one engine on a thread of their own.

An algorithm is a sequence of dependent sends and receives (receive a
chunk, add, send it on), so it cannot be one library call that completes
by itself. A single background thread per engine runs them one after the
other, in the order they were started: the gradients of step t keep moving
while step t+1 computes, and since every rank starts collectives in the
same order (the optimizer's buckets do), the ranks' threads meet. The
caller holds an engine handle (poll: finished; wait: the result), so many
collectives can be in flight and waited in any order.
"""
import collections
import concurrent.futures
import queue
import threading
import time
import weakref

from ..compression import accumulator
from ..engine.base import Average, Done, Work
from ..engine.faults import WaitError, WaitTimeoutError
from .agreement import Agreement, signature
from .buffers import Pool
from .channel import Channel, tag_base
from .exchange import Exchange
from .group import gloo_timeout, open_group
from .layout import Layout

_communicators = weakref.WeakKeyDictionary()     # engine -> Communicator
CLOSE_TIMEOUT_S = 600


def communicator(eng):
    """The engine's communicator, created on first use (collectively: every rank
    must get here at the same point, as the optimizer's wrap and first launch do)."""
    found = _communicators.get(eng)
    if found is None:
        found = _communicators[eng] = Communicator(eng)
    return found


def opened(eng):
    """The engine's communicator if one was created, else None (creates nothing)."""
    return _communicators.get(eng)


def abandon(eng):
    """After a failure that an elastic reset recovers from: fail what `eng`'s
    communicator still runs or queues, without waiting for it (see Communicator.abandon)."""
    found = _communicators.get(eng)
    if found is not None:
        found.abandon()


class _Thread:
    """One daemon thread running the calls submitted to it, in order.

    Why not a ThreadPoolExecutor: after a peer failed, a call may wait for a
    message that will never come. `abandon` fails every call not finished at
    once, whatever gloo does with the one running (its group is aborted too:
    Communicator.abandon), and a daemon never holds up the process's exit.
    """

    def __init__(self, name):
        self._calls = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._unfinished = set()
        self._abandoned = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, *args):
        future = concurrent.futures.Future()
        with self._lock:
            if self._abandoned:
                raise RuntimeError("pipe_horovod.collectives: the communicator was abandoned")
            self._unfinished.add(future)
        self._calls.put((future, fn, args))
        return future

    def _loop(self):
        while (call := self._calls.get()) is not None:
            self._run(*call)
            del call             # nor the last call's tensors alive while the thread waits

    def _run(self, future, fn, args):
        with self._lock:
            if self._abandoned:
                return                        # its future failed in abandon()
            future.set_running_or_notify_cancel()
        try:
            outcome = (fn(*args), None)
        except BaseException as exc:          # handed to the waiter, as an executor does
            outcome = (None, exc)
        with self._lock:
            if future not in self._unfinished:
                return                        # abandoned while it ran: dropped
            self._unfinished.discard(future)
            if outcome[1] is None:
                future.set_result(outcome[0])
            else:
                future.set_exception(outcome[1])

    def stop(self):
        """After the last call: the thread ends once it has run every call before."""
        self._calls.put(None)
        self._thread.join()

    def abandon(self, exc):
        with self._lock:
            self._abandoned = True
            unfinished, self._unfinished = self._unfinished, set()
            for future in unfinished:
                future.set_exception(exc)
        self._calls.put(None)


class _Running(Work):
    def __init__(self, future):
        self.future = future

    def poll(self):
        return self.future.done()

    def wait(self):
        return self.future.result()


class Job:
    """One collective, as the thread runs it."""

    __slots__ = ("kind", "tensor", "spec", "codec", "op", "root", "ranks", "me", "set_id",
                 "prescale", "postscale", "residual")

    def __init__(self, kind, tensor, spec, codec, op, *, ranks, me, set_id, root=None,
                 prescale=1.0, postscale=1.0, residual=None):
        self.kind, self.tensor, self.spec, self.codec, self.op = kind, tensor, spec, codec, op
        self.ranks, self.me, self.set_id, self.root = ranks, me, set_id, root
        self.prescale, self.postscale, self.residual = prescale, postscale, residual

    @property
    def p(self):
        return len(self.ranks)

    @property
    def acc_dtype(self):
        return accumulator(self.tensor.dtype)

    @property
    def factor(self):
        """Sum -> result, where the result is complete."""
        return self.postscale / self.p if self.op is Average else self.postscale

    @property
    def in_place(self):
        """Accumulate in the caller's tensor: it has the accumulator's type and lives on the
        CPU, and (reduce) its partial sums may show. Else a persistent buffer, copied back."""
        tensor = self.tensor
        return (tensor.dtype == self.acc_dtype and tensor.device.type == "cpu"
                and self.kind != "reduce")

    def instead(self):
        """None: run here. A job that another way completed returns its result."""
        return None

    def run(self, channel, pool):
        """The algorithm, on the communicator's thread, over `channel`; the result."""
        import torch

        tensor, codec = self.tensor, self.codec
        flat = tensor.view(-1)
        algorithm = self.spec.module
        nbytes = flat.numel() * torch.empty(0, dtype=codec.wire_dtype).element_size()
        layout = Layout(algorithm.blocks(self.kind, flat.numel(), self.p, nbytes, self.spec),
                        codec)
        buffers = pool.get(flat.numel(), self.acc_dtype, layout.wire_numel, codec.wire_dtype,
                           not codec.elementwise, not self.in_place)
        work = flat if self.in_place else buffers.work.copy_(flat)
        if self.prescale != 1.0:
            work.mul_(self.prescale)
        if self.residual is not None:
            work.add_(self.residual)
            self.residual.zero_()
        x = Exchange(channel, codec, layout, work, buffers, self.residual, self.factor)
        if self.kind == "allreduce":
            algorithm.allreduce(x, self.me, self.p)
        else:
            getattr(algorithm, self.kind)(x, self.me, self.p, self.root)
        x.finish()
        if not self.in_place and (self.kind != "reduce" or self.me == self.root):
            flat.copy_(work)
        return tensor


class Communicator:
    def __init__(self, eng):
        self.engine = eng
        self.group, self.owned = open_group(eng) if eng.size() > 1 else (None, False)
        # How long gloo lets a point-to-point wait block (the group's timeout, fixed when
        # the group opened): a wait that failed after that long timed out.
        self.timeout_s = gloo_timeout(eng).total_seconds()
        self._thread = _Thread("pipe_horovod-collectives")
        self._sequence = collections.Counter()    # per process set: launches so far
        self.pool = Pool()
        self.agreement = Agreement()
        self.closed = False
        eng.before_shutdown(__name__, self.close)

    def start(self, job):
        """Run `job` (nothing to send: at once) and return its engine Work."""
        if job.p == 1:
            return Done(self._alone(job))
        if self.closed:
            raise RuntimeError("pipe_horovod.collectives: the engine is shutting down")
        return _Running(self._thread.submit(self._run, job))

    @staticmethod
    def _alone(job):
        """One rank: the sum is this rank's tensor (nothing is encoded, so nothing is
        lost); a broadcast changes nothing."""
        if job.residual is not None:
            job.tensor.view(-1).add_(job.residual.to(job.tensor.dtype))
            job.residual.zero_()
        if job.kind != "broadcast":
            factor = job.prescale * job.factor
            if factor != 1.0:
                job.tensor.mul_(factor)
        return job.tensor

    def _run(self, job):
        """On the thread, in start order. The call number counts only the jobs that
        communicate here (`job.instead()` None): every rank that runs a job runs the same
        ones before it, so the numbers, and the tags made from them, agree."""
        import torch

        done = job.instead()
        if done is not None:
            return done
        sequence = self._sequence[job.set_id]
        self._sequence[job.set_id] += 1
        try:
            checking = _Watched(Channel(torch.distributed, self.group, job.ranks,
                                        tag_base(sequence, job.set_id)))
            verified = self.agreement.check(job, checking, sequence)
            channel = _Watched(Channel(torch.distributed, self.group, job.ranks,
                                       tag_base(sequence, job.set_id, verified)))
            return job.run(channel, self.pool)
        except PeerWaitFailed as failed:
            where = (f"rank {job.ranks[job.me]}: collectives.{job.kind} (call #{sequence}, "
                     f"{dict(signature(job))})")
            raise self.peer_failure(failed, where) from failed.cause

    def peer_failure(self, failed, where):
        """The error a failed point-to-point operation of a collective is raised as, told
        by what happened, not by gloo's words: a wait that blocked for the group's whole
        timeout is WaitTimeoutError (a peer stopped or hangs; or the ranks run calls
        verified before with other arguments, whose messages never meet), one that
        failed sooner is WaitError (a peer failed, reset or exited: its connection
        closed). Both are HorovodInternalError, so elastic training resets on them. A
        true argument mismatch never gets here: the agreement check compares the
        arguments and raises ValueError naming each rank's (agreement.py)."""
        if failed.waited_s >= _TIMED_OUT * self.timeout_s:
            return WaitTimeoutError(
                f"{where} waited {failed.waited_s:.0f} s (the point-to-point timeout, "
                f"PIPE_HOROVOD_TIMEOUT) for a peer's message that never came: a peer "
                f"stopped or hangs, or the ranks called it with different arguments (each "
                f"a call verified before): {failed.cause}")
        return WaitError(f"{where} failed: a peer closed the connection (it failed, "
                         f"reset or exited): {failed.cause}")

    def close(self):
        """Before the engine stops: let every started collective finish (the other
        ranks started them too), then take down the group if it was ours."""
        if self.closed:
            return
        self.closed = True
        self._thread.submit(lambda: None).result(timeout=CLOSE_TIMEOUT_S)
        self._thread.stop()
        self.pool.clear()
        if self.owned:
            import torch.distributed as dist

            from ..engine.torch_dist import tear_down

            if dist.is_initialized():
                tear_down(dist)
        _communicators.pop(self.engine, None)

    def abandon(self):
        """Fail every collective not finished, at once, and let the group go unused.

        Why: an elastic reset after a failure (a peer died, or failed and reset)
        restores a commit, so nothing waits for what is in flight here, and some
        of it waits for messages the peers will never send. The group is aborted,
        so what waits on it fails, here and at the peers (whose own reset then
        finds nothing to wait for); the ranks' message numbers no longer agree, so
        the engine's next communicator (after the reset) opens a new group.
        """
        if self.closed:
            return
        self.closed = True
        self._thread.abandon(WaitError(
            "pipe_horovod.collectives: abandoned at an elastic reset after a failure"))
        if self.group is not None:
            _abort(self.group, self.engine.rank())
        if self.owned:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        _communicators.pop(self.engine, None)


# A tag no collective's message takes (channel.py: message ids are small).
_ABORT_TAG = (1 << 31) - 1
# The share of the group's timeout a failed wait must have blocked to count as timed out
# (gloo counts its timeout from the wait's start; a closed connection fails at once).
_TIMED_OUT = 0.9


class PeerWaitFailed(RuntimeError):
    """A point-to-point operation of a collective failed in gloo: what failed (a post or a
    wait on a peer) and how long it had waited, which is how its failure is told apart
    (Communicator.peer_failure). gloo raises a plain RuntimeError either way."""

    def __init__(self, cause, waited_s):
        super().__init__(str(cause))
        self.cause, self.waited_s = cause, waited_s


class _Watched:
    """A Channel whose sends and receives, and the waits on them, raise PeerWaitFailed."""

    def __init__(self, channel):
        self._channel = channel

    def __getattr__(self, name):
        return getattr(self._channel, name)

    def send(self, tensor, peer, message):
        return _post(self._channel.send, tensor, peer, message)

    def recv(self, tensor, peer, message):
        return _post(self._channel.recv, tensor, peer, message)


def _post(post, *args):
    try:
        return _WatchedWork(post(*args))
    except RuntimeError as exc:
        raise PeerWaitFailed(exc, 0.0) from exc


class _WatchedWork:
    """A point-to-point work whose failed wait says how long it blocked."""

    def __init__(self, work):
        self._work = work

    def __getattr__(self, name):
        return getattr(self._work, name)

    def wait(self, *args):
        start = time.monotonic()
        try:
            return self._work.wait(*args)
        except PeerWaitFailed:
            raise
        except RuntimeError as exc:
            raise PeerWaitFailed(exc, time.monotonic() - start) from exc


def _abort(group, me):
    """Close every connection of a gloo group, failing what waits on it here and at the
    peers. Why this way: gloo has no abort (ProcessGroupGloo.abort frees no wait), but a
    wait that passes its own timeout closes every pair of its context, and each peer's
    waits on those pairs then fail too ("Connection closed by peer")."""
    import datetime

    import torch
    import torch.distributed as dist

    try:
        dist.irecv(torch.empty(1), src=1 if me == 0 else 0, group=group,
                   tag=_ABORT_TAG).wait(datetime.timedelta(milliseconds=1))
    except RuntimeError:
        pass                  # the expected timeout, or the pairs had closed already
