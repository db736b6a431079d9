"""Reductions in two stages (an alltoall, then an allgather) tracked as one operation.

They live in the engine, below the collectives, because the engine itself runs
on them (the horovod engine's bfloat16 path, which Horovod's torch ops refuse)
as well as pipe_horovod.collectives.quantized (the quantized allreduce and the
prediction's exchange). Engine mixes TwoStageOperations in; it uses the engine's
_start_* hooks, process sets and bookkeeping (adopt_async).
"""
import collections
import concurrent.futures
import queue
import time

from .faults import EngineError, WaitTimeoutError, wait_until
from .handles import Started
from .mismatch import join_refused
from .ops import Sum
from .work import Work


# Pool threads of two-stage reductions (alltoall, then allgather) are created only
# while that many are blocked at once in their alltoall; see Engine.two_stage_async.
TWO_STAGE_THREADS = 64

class TwoStage(Work):
    """A reduction in chunks of an alltoall, then an allgather (Engine.two_stage_async):
    the pool thread's future, and the allgathers it started that no chunk's `finish`
    has taken yet, in chunk order. Only the pool thread touches `pending` until its
    future is done (`poll` looks at it only then)."""

    def __init__(self, result):
        self.future = None          # set once the first chunk's alltoall started
        self.pending = collections.deque()    # (allgather's Work, finish) by chunk
        self.result = result        # result() -> the operation's result, once all finished

    def poll(self):
        future = self.future
        if not future.done():
            return False
        if future.exception() is not None:
            return True             # wait raises at once
        return all(work.poll() for work, _ in self.pending)

    def finish_ready(self):
        """Pool thread: hand the allgathers already complete to their `finish`, in order."""
        while self.pending and self.pending[0][0].poll():
            work, finish = self.pending.popleft()
            finish(work.wait())

    def wait(self):
        self.future.result()        # re-raises the pool thread's error
        while self.pending:
            work, finish = self.pending.popleft()
            finish(work.wait())
        return self.result()



class TwoStageOperations:
    """Engine's two-stage and gated operations (mixed into Engine)."""

    def two_stage_async(self, kind, tensor, name, op, chunks, result, *, process_set=None,
                        joined=None):
        """A reduction in chunks of two collectives each, tracked as one operation
        under `name`.

        `chunks`: a sequence of callables, called in order on the caller's thread (before
        this returns); chunk i's call returns (send, splits, received, reduce, finish), and
        its alltoall of `send` (splits[j] rows to the set's j-th rank) starts at once, before
        the next chunk's call, so that the next chunk's first stage overlaps this one's
        transfer. `received`: None, or the rows every rank sends this one when the caller
        knows them (`_start_alltoall_known`: then every rank's `send` must have the same
        rows). One pool thread per operation then, chunk by chunk, waits for the
        alltoall, calls `reduce(received, counts)` and starts the allgather of what it
        returns, handing allgathers already complete to `finish(gathered)`; `wait` hands
        it the rest, in chunk order, and returns `result()`. Names: `<name>.a2a` and
        `<name>.ag` for chunk 0, `<name>.a2a.<i>` and `<name>.ag.<i>` for chunk i > 0;
        none may be in flight as another tensor's name. Every rank must pass the same
        number of chunks. The quantized allreduce (collectives/quantized.py, in chunks:
        compression/two_stage.py's `chunks`) and Horovod's bfloat16 path (one chunk) run
        on it.

        `joined`: None, or the way on once a rank has joined (hvd.join: uneven data).
        A joined rank stands in with zeros for an allreduce, not for an alltoall
        (Horovod: "Alltoall is not supported with Join"), which every rank still
        training then gets for the whole operation. `joined()` returns (tensor,
        prescale, postscale, finish): the library's own allreduce of `tensor` (op `op`,
        named `<name>.join`) runs instead, and `finish` gets its result. Without it,
        the refusal is the operation's error.

        Why a pool thread: the second collective needs the first one's result, and
        the optimizer starts reductions during backward and waits for them later,
        so the alltoalls are started on the caller's thread and the rest runs on a
        pool thread. A pool thread blocks only on an alltoall, which completes once
        every rank has *started* that reduction, never on another rank's pool (nor on
        an allgather: those it only polls); so while fewer than TWO_STAGE_THREADS
        reductions wait at once for other ranks to start them, any start order that
        works with the library's own allreduce works here (a single worker thread would
        not: it would hold one reduction's allgather behind another's alltoall, which
        can wait on a rank that is itself waiting for that allgather). Collectives of
        one operation start from two threads in an order that may differ across ranks;
        both engines match them by name (Horovod's coordinator, the torch engine's
        negotiation), not by call order.
        """
        if name is None:             # the automatic name, which adopt_async then claims
            name = self._claim(kind, None, self.resolve_process_set(process_set))

        def start(ps):
            return self._start_two_stage(chunks, name, ps, result, op, joined)

        return self.adopt_async(kind, tensor, name, op, start, process_set=process_set)

    def gated_async(self, kind, tensor, name, op, start, joined, *, process_set=None):
        """An operation on a transport a joined rank does not answer (pipe_horovod's own
        point-to-point group: collectives/quantized.py), tracked as one under `name`.

        A joined rank (hvd.join: uneven data) runs none of our code, so a send to it
        would wait until the timeout. Every rank therefore first allreduces a one under
        `<name>.probe`, for which a joined rank stands in with zero: `start(ps, gate)`
        returns the operation's Work, whose thread calls `gate()` before it sends
        anything. `gate()` is True when every rank of the set is present; else it runs
        the way on after a join that two_stage_async's `joined` describes (the library's
        allreduce of what `joined()` gives, under `<name>.join`, its result to `finish`)
        and returns False once that completed, and the operation sends nothing. Every
        rank still training gets the same answer, so they all take the same way."""
        def begin(ps):
            one = tensor.new_ones(1).float()      # float32: any engine sums it plainly
            probe = Started(self, self._start_allreduce(one, f"{name}.probe", Sum, ps, 1.0,
                                                         1.0))

            def gate():
                present = self._settled(probe, f"allreduce {name + '.probe'!r}").wait()
                if int(present.item()) == len(ps.ranks):
                    return True
                tensor_, prescale, postscale, finish = joined()
                stand_in = self._join_allreduce(tensor_, name, op, ps, prescale, postscale)
                finish(self._settled(stand_in, f"allreduce {name + '.join'!r}").wait())
                return False
            return start(ps, gate)

        if name is None:
            name = self._claim(kind, None, self.resolve_process_set(process_set))
        return self.adopt_async(kind, tensor, name, op, begin, process_set=process_set)

    def _settled(self, work, what):
        """`work` (`what`: the collective, for messages) once complete, waited for off the
        caller's thread, with no stall report (the caller's own wait gives that): past the
        timeout, or at a shutdown that lets go of the library, it raises."""
        if not wait_until(lambda: self._releasing or work.poll(),
                          time.monotonic() + self.timeout_s):
            raise WaitTimeoutError(f"{what} did not complete within {self.timeout_s:g} s: "
                                   "a rank has not started it")
        if self._releasing and not work.poll():
            raise EngineError(f"the engine shut down while {what} was in flight")
        return work

    def _join_allreduce(self, tensor, name, op, ps, prescale, postscale):
        """The library's allreduce that stands in for `name` once a rank joined."""
        return Started(self, self._start_allreduce(tensor, f"{name}.join", op, ps, prescale,
                                                    postscale))

    @staticmethod
    def _chunk_name(name, what, index):
        return f"{name}.{what}" if index == 0 else f"{name}.{what}.{index}"

    def _start_two_stage(self, chunks, name, ps, result, op=None, joined=None):
        """two_stage_async's backend state (a TwoStage Work), for engines' own hooks."""
        work = TwoStage(result)
        started = queue.SimpleQueue()         # the caller's alltoalls, to the pool thread
        try:
            for index, first_stage in enumerate(chunks):
                send, splits, received, reduce, finish = first_stage()
                a2a_name = self._chunk_name(name, "a2a", index)
                a2a = (self._start_alltoall(send, splits, a2a_name, ps) if received is None
                       else self._start_alltoall_known(send, splits, received, a2a_name, ps))
                started.put((a2a, reduce, finish))
                if work.future is None:
                    work.future = self._submit(self._second_stage, started, len(chunks),
                                               name, ps, work, op, joined)
        finally:
            started.put(None)                 # after the last chunk: nothing more comes
        return work

    def _submit(self, fn, *args):
        """Run `fn(*args)` on the engine's pool of two-stage threads; its Future."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=TWO_STAGE_THREADS, thread_name_prefix="pipe_horovod-two-stage")
        return self._pool.submit(fn, *args)

    def _second_stage(self, started, count, name, ps, work, op, joined):
        """Pool thread: chunk by chunk, finish the alltoall, reduce, start the allgather."""
        for index in range(count):
            a2a, reduce, finish = self._next_chunk(started, index, count, name)
            try:
                received, counts = a2a.wait()
            except Exception as exc:
                if joined is None or index or not join_refused(exc):
                    raise
                self._reduce_after_join(started, count, name, ps, work, op, joined, exc)
                return
            gathered = self._start_allgather(reduce(received, counts.tolist()),
                                             self._chunk_name(name, "ag", index), ps)
            work.pending.append((gathered, finish))
            work.finish_ready()               # while the next chunk is on the wire

    def _reduce_after_join(self, started, count, name, ps, work, op, joined, refused):
        """Pool thread, chunk 0's alltoall `refused` for a joined rank: so are the
        others (every rank started them all before it could join); then the library's
        allreduce of what `joined()` gives (two_stage_async)."""
        for index in range(1, count):
            try:
                self._next_chunk(started, index, count, name)[0].wait()
            except Exception as exc:
                if not join_refused(exc):
                    raise
            else:
                raise EngineError(f"{name!r}: chunk 0's alltoall was refused for a joined "
                                  f"rank, chunk {index}'s was not") from refused
        tensor, prescale, postscale, finish = joined()
        work.pending.append((self._join_allreduce(tensor, name, op, ps, prescale, postscale),
                             finish))

    def _next_chunk(self, started, index, count, name):
        """Pool thread: chunk `index`'s (alltoall, reduce, finish), its alltoall complete."""
        item = started.get()                  # the caller is computing it: no remote wait
        if item is None:
            raise EngineError(f"{name!r}: the first stage of chunk {index} of {count} "
                              "failed on this rank (the caller got its error)")
        # Not `_closed`: shutdown first completes what is in flight, these included.
        self._settled(item[0], f"alltoall {self._chunk_name(name, 'a2a', index)!r}")
        return item
