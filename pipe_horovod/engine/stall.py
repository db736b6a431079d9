"""Stalled waits: Horovod's stall inspector, and naming the rank that stopped.

Ranks that run different numbers of steps (uneven data without `join`, a
batch skipped on one rank) leave the others waiting for a collective that
will never start. Horovod warns after HOROVOD_STALL_CHECK_TIME_SECONDS
(default 60 s) and says which ranks have not submitted which tensors; when
the rank that stopped shuts down, it fails the others with "Horovod has
been shut down", which names neither the rank nor the cause. Here every
wait that has lasted STATUS_AFTER_S posts what this rank is doing to a
status board every rank can read (the rendezvous store), and then:

- a rank that ended (shut down) while this one waits for a collective it
  never started: StepMismatchError at once (within STATUS_AFTER_S), naming
  the rank, the step it stopped after and what every rank is doing;
- every other rank waiting too, for HOROVOD_STALL_CHECK_TIME_SECONDS:
  nobody can progress (each waits for a collective another never starts),
  so StepMismatchError on every rank, with each rank's wait and step;
- a rank that refused a step (an error raised on that rank alone, e.g. an edit
  of `.grad` at pipeline_depth >= 2, torch/edits.py) posted the error with
  `Engine.refuse`: the same error, naming that rank, at once (within
  STATUS_AFTER_S), so every rank stops with the reason, not a timeout;
- otherwise, at HOROVOD_STALL_CHECK_TIME_SECONDS, a warning naming the
  missing ranks and tensors (Horovod's words), then one per period; past
  HOROVOD_STALL_SHUTDOWN_TIME_SECONDS (default 0: never), StepMismatchError.

HOROVOD_STALL_CHECK_DISABLE=1 turns the warnings and the all-waiting check
off, as in Horovod; the ended-rank check and the timeout stay. A healthy
wait shorter than STATUS_AFTER_S costs nothing beyond its polls.
"""
import json
import os
import time
import urllib.request
import warnings

from .faults import RankLostError, WaitError

CHECK_VARIABLE = "HOROVOD_STALL_CHECK_TIME_SECONDS"
SHUTDOWN_VARIABLE = "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"
DISABLE_VARIABLE = "HOROVOD_STALL_CHECK_DISABLE"
DEFAULT_CHECK_S = 60.0
STATUS_AFTER_S = 1.0    # a wait this long posts its status and reads the others', each period
JOIN_HINT = ("The ranks ran different numbers of steps (uneven data, or a batch skipped on "
             "some rank): give every rank the same number of batches, or call hvd.join() on "
             "each rank when its data runs out (Horovod's way for uneven data)")


class StepMismatchError(WaitError):
    """Ranks wait for collectives that other ranks will never start."""


class StallWarning(UserWarning):
    """Horovod's stall inspector: some ranks have not started a collective others wait on."""


def _seconds(variable, default):
    value = os.environ.get(variable, "").strip()
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{variable} must be a number of seconds, got {value!r}") from None
    if seconds < 0:
        raise ValueError(f"{variable} must be a number of seconds >= 0, got {value!r}")
    return seconds


def settings():
    """(check_s or None when disabled, shutdown_s or None), from Horovod's variables."""
    disabled = os.environ.get(DISABLE_VARIABLE, "").strip().lower() in ("1", "true", "yes")
    check = None if disabled else _seconds(CHECK_VARIABLE, DEFAULT_CHECK_S) or None
    return check, _seconds(SHUTDOWN_VARIABLE, 0.0) or None


class Board:
    """Each rank's status (a small JSON dict) on a store every rank reaches."""

    def __init__(self, put, get, size):
        self._put, self._get, self.size = put, get, size

    def read(self, ranks, kind="status"):
        """{rank: status dict or None}."""
        out = {}
        for rank in ranks:
            try:
                raw = self._get(f"pipe_horovod.{kind}.{rank}")
                out[rank] = None if raw is None else json.loads(raw)
            except Exception:
                out[rank] = None
        return out

    def refuse(self, rank, step, error):
        """Rank `rank` raised `error` (text) at a step the others cannot know of: kept apart
        from its status, which later waits overwrite."""
        self.post(rank, kind="refused", step=step, error=error)

    def acknowledge(self, rank, refuser):
        """`rank` has raised `refuser`'s refusal (the refuser may leave now)."""
        self.post(rank, kind=f"told.{refuser}", seen=True)

    def wait_for_ends(self, ranks, bound_s=2 * STATUS_AFTER_S + 1.0):
        """Until every rank of `ranks` posted that it ended, or `bound_s` passed (a rank
        that was killed never does)."""
        deadline = time.monotonic() + bound_s
        while ranks and time.monotonic() < deadline:
            ranks = [r for r, s in self.read(ranks).items() if not s or s["state"] != "ended"]
            if ranks:
                time.sleep(0.05)

    def post(self, rank, kind="status", **status):
        try:
            self._put(f"pipe_horovod.{kind}.{rank}", json.dumps(status))
        except Exception:           # the store is gone (its host ended): nothing to tell
            pass


def torch_board(store, size):
    """On torch.distributed's rendezvous store (torchrun's agent, or rank 0)."""
    def get(key):
        return store.get(key) if store.check([key]) else None
    return Board(store.set, get, size)


def http_board(addr, port, size):
    """On horovodrun's rendezvous key-value server (HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT)."""
    base = f"http://{addr}:{port}/pipe_horovod"

    def put(key, value):
        request = urllib.request.Request(f"{base}/{key}", data=value.encode(), method="PUT")
        urllib.request.urlopen(request, timeout=2).close()

    def get(key):
        try:
            with urllib.request.urlopen(f"{base}/{key}", timeout=2) as reply:
                return reply.read()
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise
    return Board(put, get, size)


def _doing(rank, status, now):
    """One rank's line in a report: what it does, at which step, for how long."""
    if status is None:
        return f"rank {rank} is not waiting in any collective (computing, or stopped outside pipe_horovod)"
    step = "" if status.get("step") is None else f" after {status['step']} step(s)"
    if status["state"] == "ended":
        steps = "" if status.get("step") is None else f" after {status['step']} step(s)"
        cause = f", as {status['lost']}" if status.get("lost") else ""
        return f"rank {rank} ended (shut down{steps}{cause})"
    if status["state"] in ("waiting", "failed"):
        return (f"rank {rank} waits in {status['what']}{step} (for "
                f"{max(0.0, now - status['since']):.0f} s)")
    return f"rank {rank} runs{step}"


class Stall:
    """One wait that has lasted STATUS_AFTER_S: posts, reads, warns, or raises."""

    def __init__(self, engine, what, start):
        self.engine, self.what, self.start = engine, what, start
        self.board = engine._board
        self.check_s, self.shutdown_s = settings()
        self.warned_at = 0.0
        self.since = time.time() - (time.monotonic() - start)
        self.me = engine.rank()
        if engine._closed:          # shutting down: the board keeps saying "ended"
            self.board = None
        if self.board is not None:
            self.board.post(self.me, state="waiting", what=what, step=engine.step,
                            since=self.since)

    def tick(self, matched):
        """Called every STATUS_AFTER_S while the wait goes on; `matched()` tells whether
        every rank has started the collective (then it is slow, not stalled)."""
        if self.board is None:
            return
        elapsed = time.monotonic() - self.start
        now = time.time()
        others = self.board.read([r for r in range(self.engine.size()) if r != self.me])
        if not matched():
            refused = self.engine._refused_elsewhere(self.what)
            if refused is not None:
                raise refused
        ended = [r for r, s in others.items() if s and s["state"] == "ended"]
        if ended and not matched():
            raise self._error(others, now, ended)
        def gave_up(status):        # during this wait: a rank that raised and went on before
            # it started says nothing about it (its status stays until its next long wait)
            return (status is not None and status["state"] == "failed"
                    and status.get("at", 0.0) >= self.since)

        if (self.check_s is None or elapsed < self.check_s) and \
                not any(gave_up(status) for status in others.values()):
            return

        def stuck(status):          # waiting long enough that it is not just slow
            return gave_up(status) or (status is not None and status["state"] == "waiting"
                                       and self.check_s is not None
                                       and now - status["since"] >= self.check_s / 2)

        if all(stuck(status) for status in others.values()) and not matched():
            raise self._error(others, now, [])
        if self.check_s is None:
            return
        if self.shutdown_s is not None and elapsed >= self.shutdown_s:
            raise self._error(others, now, [], f"stalled for {elapsed:.0f} s, past "
                                                f"{SHUTDOWN_VARIABLE}={self.shutdown_s:g}")
        if elapsed - self.warned_at >= self.check_s:
            self.warned_at = elapsed
            warnings.warn(self._report(others, now, elapsed), StallWarning, stacklevel=4)

    def end(self, failed):
        """The wait is over: this rank runs again, or gave up (the others stop waiting
        for it at their next look)."""
        if self.board is None:
            return
        if failed:
            self.board.post(self.me, state="failed", what=self.what, step=self.engine.step,
                            since=self.since, at=time.time())
        else:
            self.board.post(self.me, state="running", step=self.engine.step)

    def _everyone(self, others, now):
        mine = {"state": "waiting", "what": self.what, "step": self.engine.step,
                "since": self.since}
        return "; ".join(_doing(r, mine if r == self.me else others.get(r), now)
                         for r in range(self.engine.size()))

    def _error(self, others, now, ended, why=None):
        lost = [(r, others[r]["lost"]) for r in ended if others[r].get("lost")]
        if lost:                    # it stopped because a rank died: name that one, not steps
            rank, cause = lost[0]
            self.engine._lost = cause   # and this rank's own end passes the cause on
            return RankLostError(f"rank {rank} stopped while rank {self.me} waits in "
                                 f"{self.what}: {cause}; {self._everyone(others, now)}")
        if ended:
            lead = (f"{', '.join(f'rank {r}' for r in ended)} ended while rank {self.me} "
                    f"waits in {self.what}, which {'it' if len(ended) == 1 else 'they'} "
                    f"never started")
        elif why:
            lead = f"rank {self.me} {why} in {self.what}"
        else:
            lead = (f"every rank waits for a collective that another rank never starts "
                    f"(for more than {self.check_s:g} s, {CHECK_VARIABLE})")
        missing = self.engine._missing(self.what)
        return StepMismatchError(f"{lead}: {self._everyone(others, now)}{missing}. {JOIN_HINT}")

    def _report(self, others, now, elapsed):
        return (f"One or more tensors were submitted to be reduced, gathered or broadcasted by "
                f"subset of ranks and are waiting for remainder of ranks for more than "
                f"{elapsed:.0f} seconds. This may indicate that different ranks are trying to "
                f"submit different tensors or that only subset of ranks is submitting tensors, "
                f"which will cause deadlock. {self._everyone(others, now)}"
                f"{self.engine._missing(self.what)}")
