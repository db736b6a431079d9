"""Horovod's name matching on torch.distributed: a negotiation thread per process set.

torch.distributed pairs collectives by call order: two metrics reduced in
a different order per rank are silently swapped, an allreduce whose shape
differs aborts a rank inside gloo, and a broadcast of a different size
half-overwrites the receiver. Horovod instead matches by name: a
background loop tells a coordinator which names each rank has started, and
a collective runs once every rank started it, after its shapes, dtypes,
ops and roots were compared. This module does the same for the torch
engine.

Each process set has a negotiation thread and a process group of its own.
A thread with requests not yet run takes part in a cycle: one all_gather
of fixed-size records (mismatch.encode: name key, kind, dtype, op, root,
shape, scale factors, device, the start of the name), the new requests of
every rank. Every rank applies the cycles in the same order to the same
table of who requested what, so every rank computes the same list of
names now requested by all, compares their records (mismatch.compare) and
runs them, in that order, on the set's group: the same collectives in the
same order on every rank, whatever order the callers started them in.

Cost: a collective waits for the next cycle (one small all_gather among
the set) before it runs; requests started while a cycle runs share the
next one. A small collective's data (up to INLINE_BYTES) rides in the cycle
itself: once every rank has announced it, each rank has every rank's data
and finishes it alone (a sum in rank order, the same on every rank), so a
lone small collective costs one all_gather, as plain torch.distributed's
call does. A cycle carries up to FIRST_PAYLOAD bytes of such data per rank,
or what the ranks' small requests of the previous cycle needed when that is
at most INLINE_BYTES (every rank reads the same records, so every rank sizes
the next cycle alike): a script's repeated small collective travels in the
cycle from its second call on, and a pipeline's buckets (or a burst of
collectives too large together) leave the cycles small. `pipe-horovod bench-collectives
--unmatched` measures it against plain torch.distributed (docs/faults.md).
A thread whose cycle made no progress (a name some rank has not started
yet) backs off to STALL_POLL_S between cycles, so ranks that wait on each
other do not spin a core.

The thread never blocks inside torch: a cycle's all_gather is waited for in
slices of SLICE_S, between which it looks at its stop flag, and the engine's
shutdown stops and joins it. A Python thread that returns from a blocking
torch call while the interpreter finalizes is ended by CPython with
pthread_exit, whose unwinding through torch's noexcept frames calls
std::terminate: the process then died by SIGABRT ("terminate called without
an active exception") after any failure that left a cycle on the wire.

Join (Horovod's semantics): a rank that called join() takes part in every
cycle until all ranks joined, and stands in for the others' allreduces
with zeros (Average still divides by the set's size, as in Horovod's
join); for any other collective it cannot stand in, and every rank gets
Horovod's "... is not supported with Join at this time".
"""
import collections
import datetime
import hashlib
import threading
import time

import numpy

from . import mismatch
from .faults import HorovodInternalError

PER_CYCLE = 16          # requests announced per cycle; more wait for the next
INLINE_BYTES = 64 << 10     # collectives this small may ride in the cycle
FIRST_PAYLOAD = 4 << 10     # bytes per rank a cycle carries when the last needed less
STALL_POLL_S = 0.005    # longest pause between two cycles that made no progress
SLICE_S = 0.05          # how often a thread waiting for a cycle looks at its stop flag
_HEAD = 3 + PER_CYCLE   # count, joining, small bytes wanted, each record's bytes (-1: none)
_PAYLOAD = _HEAD + PER_CYCLE * mismatch.WIDTH


def key_of(name):
    """The name's 64-bit key (the same on every rank)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little",
                          signed=True)


class _Stopped(Exception):
    """The engine shut down while the thread waited for a cycle."""


class Request:
    """One collective this rank started: announced, then run by the thread, or refused."""

    __slots__ = ("name", "key", "row", "run", "inline", "settle", "work", "error", "started",
                 "_pending")

    def __init__(self, name, row, run, inline=None, settle=None):
        self.name = name
        self.key = row[0]
        self.row = row
        self.run = run          # run(records by member) -> Work, on the negotiation thread
        # A small collective's CPU tensor, whose bytes the cycle may carry, and
        # settle(records by member) -> Work, which finishes it from every rank's bytes.
        self.inline = inline
        self.settle = settle
        self.work = None        # the running collective's Work, once every rank started it
        self.error = None       # a MismatchError (or the thread's failure) instead
        self.started = time.monotonic()
        self._pending = threading.Lock()    # held until work or error is set (a lighter
        self._pending.acquire()             # Event: one per collective)

    def finish(self, work=None, error=None):
        self.work, self.error = work, error
        self._pending.release()

    def done(self):
        return self.work is not None or self.error is not None

    def wait_done(self, seconds):
        """Until work or error is set, at most `seconds`."""
        if self._pending.acquire(timeout=seconds):
            self._pending.release()


class Negotiator:
    """The negotiation thread of one process set (see the module docstring)."""

    def __init__(self, torch, dist, group, ranks, me, stand_in):
        self.torch, self.dist, self.group = torch, dist, group
        self.ranks = list(ranks)        # global ranks of the set, in set order
        self.me = self.ranks.index(me)
        self.stand_in = stand_in        # stand_in(records) -> Work: a joined rank's zeros
        self._lock = threading.Condition()
        self._new = collections.deque()     # started, not yet announced
        self._mine = {}                     # key -> Request, announced and not run yet
        self._table = [dict() for _ in self.ranks]   # member -> {key: Record}, in order
        self._joined = [None] * len(self.ranks)      # member -> cycle it joined in
        self._join = None                   # this rank's join: [done event, last rank]
        self._standing_in = []              # joined rank's zero tensors still on the wire
        self._cycles = 0
        self._payload = FIRST_PAYLOAD       # this cycle's bytes of small collectives per rank
        self._everyone = []                 # the last cycle's all_gather output, reused
        self._stop = False
        self.failure = None                 # what ended the thread, if it failed
        self._thread = None

    # --- the caller's side ---------------------------------------------------
    def submit(self, request):
        with self._lock:
            if self.failure is not None:
                request.finish(error=self.failure)
                return request
            self._new.append(request)
            self._wake()
        return request

    def start_join(self):
        """Take part in cycles as a joined rank; returns the Event set once every rank
        joined (then `joined_last()`)."""
        done = threading.Event()
        with self._lock:
            self._join = [done, None]
            self._wake()
        return done

    def joined_last(self):
        """The global rank that joined last, once the join completed."""
        if self.failure is not None:
            raise self.failure
        return self._join_result

    def waiting_on(self):
        """{name: members that have not started it} for this rank's requests still
        waiting, as of the last cycle (for the stall report)."""
        with self._lock:
            requests = list(self._mine.values()) + list(self._new)
            return {r.name: [self.ranks[m] for m, table in enumerate(self._table)
                             if m != self.me and r.key not in table and self._joined[m] is None]
                    for r in requests}

    def stop(self, join_s=0.0):
        """Stop the thread; wait up to `join_s` for it to leave (it looks at the flag
        every SLICE_S while a cycle is on the wire)."""
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        thread = self._thread
        if join_s and thread is not None and thread is not threading.current_thread():
            thread.join(join_s)

    def _wake(self):
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, daemon=True,
                                            name=f"pipe_horovod-negotiation-{id(self):x}")
            self._thread.start()
        self._lock.notify_all()

    # --- the thread -------------------------------------------------------------
    def _busy(self):
        return bool(self._new or self._mine or self._join is not None)

    def _loop(self):
        pause = 0.0
        while True:
            with self._lock:
                while not (self._stop or self._busy()):
                    self._lock.wait()
                if self._stop:
                    return
            try:
                progressed = self._cycle()
            except _Stopped:
                return
            except Exception as exc:        # a rank is gone: fail everything waiting
                self._fail(exc)
                return
            self._standing_in = [w for w in self._standing_in if not w.poll()]
            if progressed:
                pause = 0.0
            else:
                pause = min(max(2 * pause, 50e-6), STALL_POLL_S)
                time.sleep(pause)

    def await_work(self, work):
        """On the thread: wait for a torch Work in slices, leaving at a stop; raises the
        Work's error."""
        slice_ = datetime.timedelta(seconds=SLICE_S)
        while not work.is_completed():
            if self._stop:
                raise _Stopped()
            try:
                work.wait(slice_)
            except RuntimeError:            # the slice passed, or it failed: looked at above
                pass
        work.wait()

    def _fail(self, exc):
        error = exc if isinstance(exc, HorovodInternalError) else HorovodInternalError(
            f"negotiation of collectives failed: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        with self._lock:
            self.failure = error
            for request in list(self._mine.values()) + list(self._new):
                request.finish(error=error)
            self._mine.clear()
            self._new.clear()
            if self._join is not None:
                self._join[0].set()

    def _message(self, batch, joining):
        """This rank's part of a cycle: its new records and the small ones' bytes (built
        in NumPy: a cycle is on every collective's path, and torch's per-op cost is
        several times NumPy's at this size)."""
        mine = numpy.zeros(_PAYLOAD + self._payload // 8, dtype=numpy.int64)
        mine[0], mine[1] = len(batch), int(joining)
        if batch:
            # Viewed here, not when started: a torch call lets this thread take the GIL
            # from a caller still starting a burst of collectives, splitting it in cycles.
            small = [(i, r.inline.reshape(-1).view(self.torch.uint8).numpy())
                     for i, r in enumerate(batch) if r.inline is not None]
            wanted = sum(-(-data.size // 8) * 8 for _, data in small)
            lengths, at = [-1] * len(batch), 0
            if wanted <= self._payload:     # all of them, or none: a burst of collectives
                payload = mine[_PAYLOAD:].view(numpy.uint8)     # too large for the cycle runs
                for i, data in small:                           # as a pipeline's buckets do
                    payload[at:at + data.size] = data
                    lengths[i], at = data.size, at + -(-data.size // 8) * 8
            mine[2] = wanted
            mine[3:3 + len(batch)] = lengths
            mine[_HEAD:_HEAD + len(batch) * mismatch.WIDTH] = [v for r in batch for v in r.row]
        return self.torch.from_numpy(mine)

    def _read(self, member, row):
        """Record member's new requests (and their bytes) from its part of a cycle; returns
        the bytes of small collectives it wanted to send."""
        row = row.numpy()
        count = int(row[0])
        if count:
            lengths = row[3:3 + count].tolist()
            values = row[_HEAD:_HEAD + count * mismatch.WIDTH].tolist()
            payload, at = row[_PAYLOAD:].view(numpy.uint8), 0
            for i in range(count):
                record = mismatch.Record(values[i * mismatch.WIDTH:(i + 1) * mismatch.WIDTH])
                if lengths[i] > 0:
                    record.data = self.torch.from_numpy(payload[at:at + lengths[i]].copy())
                    at += -(-lengths[i] // 8) * 8
                elif lengths[i] == 0:       # (NumPy's empty arrays have stride 0)
                    record.data = self.torch.empty(0, dtype=self.torch.uint8)
                self._table[member][record.key] = record
        if row[1] and self._joined[member] is None:
            self._joined[member] = self._cycles
        return int(row[2])

    def _cycle(self):
        """One all_gather of new requests, then run what every rank has requested."""
        with self._lock:
            batch = [self._new.popleft() for _ in range(min(PER_CYCLE, len(self._new)))]
            for request in batch:
                self._mine[request.key] = request
            joining = self._join is not None
        mine = self._message(batch, joining)
        everyone = self._everyone      # reused: one cycle at a time, read before the next
        if not everyone or everyone[0].numel() != mine.numel():
            everyone = self._everyone = [self.torch.empty_like(mine) for _ in self.ranks]
        # The group's own call: torch.distributed.all_gather's checks in Python cost as
        # much again as the small transfer itself.
        self.await_work(self.group.allgather([everyone], [mine]))
        self._cycles += 1
        with self._lock:
            wanted = max(self._read(member, row) for member, row in enumerate(everyone))
            # Room for the small collectives of this cycle, next time: when they fit in one
            # (a burst of larger ones, a pipeline's buckets, would only make cycles longer).
            self._payload = max(wanted, FIRST_PAYLOAD) if wanted <= INLINE_BYTES \
                else FIRST_PAYLOAD
            ready = self._ready()
        for key in ready:
            self._run(key)
        if all(cycle is not None for cycle in self._joined):
            self._finish_join()
            return True
        return bool(ready)

    def _ready(self):
        """Keys every member requested (or stands in for), in the lowest requester's order."""
        active = [m for m, cycle in enumerate(self._joined) if cycle is None]
        if not active:
            return []
        first = self._table[active[0]]
        return [key for key in first
                if all(key in self._table[m] for m in active)]

    def _run(self, key):
        records = [(self.ranks[m], self._table[m].get(key)) for m in range(len(self.ranks))]
        present = [(rank, rec) for rank, rec in records if rec is not None]
        error = mismatch.compare(present)
        kind = present[0][1].kind
        if error is None and len(present) < len(records) and kind not in ("ALLREDUCE",
                                                                            "BARRIER"):
            error = mismatch.unsupported_with_join(present[0][1])
        for table in self._table:
            table.pop(key, None)
        with self._lock:
            request = self._mine.pop(key, None)
        if request is None:                 # this rank joined: zeros in its place
            if error is None and kind == "ALLREDUCE":
                self._standing_in.append(self.stand_in(present[0][1]))
            return
        if error is not None:
            request.finish(error=error)
            return
        by_member = [rec for _, rec in records]
        try:
            if request.settle is not None and all(
                    rec is not None and rec.data is not None for rec in by_member):
                work = request.settle([rec.data for rec in by_member])
            else:
                work = request.run(by_member)
        except _Stopped:
            raise
        except Exception as exc:            # refused locally (e.g. a bad alltoall split)
            request.finish(error=exc)
            return
        request.finish(work=work)

    def _finish_join(self):
        last_cycle = max(self._joined)
        last = max(m for m, cycle in enumerate(self._joined) if cycle == last_cycle)
        self._joined = [None] * len(self.ranks)
        with self._lock:
            join, self._join = self._join, None
        self._join_result = self.ranks[last]
        if join is not None:
            join[0].set()
