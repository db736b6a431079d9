"""Telling the other ranks what went wrong here, and naming the cause of a failure.

A rank that raises where the others wait for it would leave them blocked until
the timeout, blaming uneven data; so its error is posted to the status board
(stall.py), the others' waits raise it naming this rank (causes.py), and a rank
that ends lingers until they read it. A failed collective is diagnosed as the
rank that ended (and why) or was lost, when that can be known.
"""
import os
import time
import traceback
import uuid

from . import causes
from .faults import (RankLostError, WaitTimeoutError, describe_lost, lost_ranks, runs_here,
                     whoami)
from .mismatch import MismatchError, from_library
from .process_sets import global_process_set
from .stall import STATUS_AFTER_S, Stall, StepMismatchError, describe, read_pause


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


class FailureReports:
    """Engine's error posting and diagnosis (mixed into Engine)."""

    def learn_peers(self, peers=True):
        """Gather every rank's host and process id (engine.init calls it, once the library
        is up), so that a failed collective can name the rank that died (unless `peers` is
        false: elastic mode, whose reset handles a lost rank); and rank 0's name for this
        engine's session, under which every rank posts on the status board (an elastic
        reset starts a new engine on the same store: without it, the last one's posts)."""
        if self.size() > 1:
            session = uuid.uuid4().hex[:12] if self.rank() == 0 else None
            gathered = self.allgather_object((*whoami(), session), name="pipe_horovod.peers")
            if peers:
                self._peers = [(host, pid) for host, pid, _ in gathered]
            if self._board is not None:
                self._board.session = f".{gathered[0][2]}"

    def _diagnose(self, exc, call):
        """The error to raise for `exc`, a failure of the library while running `call`
        (a stall.Call)."""
        refused = from_library(exc, call.what)
        if refused is not None:          # ranks disagreed (Horovod's check): nobody is lost
            return refused
        self._failed = True
        # A rank that ends posts so before it lets go of the library, so its post is on the
        # board by the time its sockets close, whether or not its process is gone yet (on a
        # loaded machine it may take longer than the search for lost ranks below).
        stopped = None if isinstance(exc, WaitTimeoutError) else self._who_ended(call)
        if stopped is not None:
            return stopped
        if self._peers is None:
            return exc
        gone = lost_ranks(self._peers, self.rank())
        if isinstance(exc, WaitTimeoutError):
            return WaitTimeoutError(f"{exc}; {describe_lost(self._peers, self.rank(), gone)}")
        if not gone:
            return exc
        self._lost = describe_lost(self._peers, self.rank(), gone)
        return RankLostError(f"{call.what} failed on rank {self.rank()}: {self._lost} "
                             f"({type(exc).__name__}: {str(exc).strip()})")

    def refuse(self, exc):
        """`exc`, an error this rank raises at a step the others will not know of (they
        would wait for this rank's next collective), posted to the status board: every
        other rank's next stalled wait raises it too, naming this rank (causes.py). Returns
        `exc`, so callers write `raise engine.refuse(...)`."""
        self._tell_raised(exc, final=True)
        return exc

    def _tell_raised(self, exc, kind=None, name=None, process_set=None, final=False,
                     where=None, wires=None):
        """Post `exc`, raised on this rank in the collective `kind` `name` (None: outside
        one; an automatic name is the one the call would have taken), for the others.
        `final`: this rank will not start what the others wait for (refuse(), or the error
        ends its script); `wires`: the names of the collectives the ranks it concerns wait
        in (a cause read off the board, which they raise too)."""
        if self._board is None or self._closed:
            return
        calls = self._object_calls()
        if calls:                        # inside an object collective: that is the call
            kind, name, _ = calls[0]
        elif kind is not None and name is None:
            try:
                ps = self.resolve_process_set(process_set)
            except Exception:
                ps = global_process_set
            name = self._unnamed_name(kind, ps)
        self._raises += 1
        if final:
            self._final = self._raises
        error = f"{type(exc).__name__}: {exc}".strip()
        # Raised alike on another rank: the same error at the same step, the same cause, or
        # in the same call.
        key = ("final", self.step, error) if final else ("cause", error) if wires else \
            ("name", name)
        self._raised.add(key)
        # A cause this rank read off the board, or every rank's MismatchError: the others
        # raise the same words, not "rank r raised" them (causes.py).
        shared = isinstance(exc, (StepMismatchError, RankLostError, MismatchError))
        self._posted.append(dict(
            seq=self._raises, error=error,
            call=None if kind is None else describe(kind, name), name=name, where=where,
            step=self.step, final=final, shared=shared, wires=wires, key=list(key),
            at=time.time()))
        self._board.tell_raised(self.rank(), self._posted)

    def raised_alike(self, post):
        """Whether this rank raised where another rank's posted error was raised (each
        rank has its own error then: the other's is no news)."""
        return tuple(post.get("key") or ()) in self._raised

    def tell_uncaught(self, exc, tb):
        """engine.init's excepthook: `exc` ends this rank's script; the others' waits name
        it (with where it was raised) instead of blaming uneven data."""
        self._failed = True              # leave without waiting for the others' teardown
        self._uncaught = True
        frames = traceback.extract_tb(tb) if tb is not None else []
        # The script's own line: the innermost frame outside pipe_horovod and installed
        # packages (where a collective of ours or a library call raised, the caller's).
        ours = [f for f in frames if not f.filename.startswith(_PACKAGE)
                and "-packages" + os.sep not in f.filename]
        where = None
        if ours or frames:
            last = (ours or frames)[-1]
            where = f"{os.path.basename(last.filename)}:{last.lineno} in {last.name}"
        self._tell_raised(exc, final=True, where=where)

    def _linger_for_readers(self, me, size, bound_s=2 * STATUS_AFTER_S + 1.0):
        """A rank that posted an error that stops it (refuse(), or one that ends its script)
        leaves once every other rank has raised it (read it off the board), raised alike,
        or ended, or after `bound_s`: its launcher would stop the others before they could
        say why."""
        if self._final is None or self._board is None:
            return
        others = [r for r in range(size) if r != me]
        deadline = time.monotonic() + bound_s
        while others and time.monotonic() < deadline:
            acks = self._board.read(others, f"told.{me}")
            raised = self._board.raised(others)
            statuses = self._board.read(others)
            others = [r for r in others if not (
                (acks[r] and acks[r].get("seq", 0) >= self._final)
                or any(self.raised_alike(post) for post in raised[r])
                or (statuses[r] and statuses[r]["state"] == "ended"))]
            if others:
                time.sleep(read_pause(len(others)))

    def _leave_after_raisers(self, bound_s=2 * STATUS_AFTER_S + 1.0):
        """A rank whose script ends with another rank's error (read off the board) leaves
        after that rank's process did, or after `bound_s`: launchers stop every rank once the
        first one exits with an error and name that one as the cause, which must be the rank
        that raised it. Ranks on other hosts cannot be watched: their posted end counts;
        without the peers' processes (elastic mode does not gather them) nothing is."""
        if not (self._uncaught and self._raisers) or self._board is None or self._peers is None:
            return
        deadline = time.monotonic() + bound_s
        ranks = sorted(self._raisers)
        while ranks and time.monotonic() < deadline:
            running = {r: runs_here(self._peers[r]) for r in ranks}
            elsewhere = self._board.read([r for r in ranks if running[r] is None])
            ranks = [r for r in ranks if running[r] or (
                running[r] is None and (elsewhere[r] or {}).get("state") != "ended")]
            if ranks:
                time.sleep(0.02)

    def _who_ended(self, call):
        """A failure because another rank ended (Horovod's "has been shut down", or a
        peer that exited) as the error naming that rank and why, read from the status
        board (causes.py); None when no rank says it ended (it was lost)."""
        if self._board is None:
            return None
        stall = Stall(self, call, time.monotonic(), post=False)
        others = self._board.read([r for r in range(self.size()) if r != self.rank()])
        return causes.raised(stall, others) or causes.ended(stall, others, time.monotonic())
