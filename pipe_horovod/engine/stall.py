"""Stalled waits: what each rank posts, and Horovod's stall inspector.

A rank can stop taking part in the collectives the others wait for in
many ways: it raised (an error at a call, or one that ended its script),
it finished with fewer steps (uneven data), it calls other collectives
(a different order, a call made on some ranks only, a barrier against an
allreduce), it calls the same one differently (a count or root the library
does not compare), or it died. The library alone says none of this:
Horovod warns after HOROVOD_STALL_CHECK_TIME_SECONDS that some ranks have
not submitted some tensors and, when a rank ends, fails the others with
"Horovod has been shut down"; torch.distributed blocks.

So every rank posts what it does to a status board every rank can read
(torch's rendezvous store; horovodrun's key-value server; under MPI a
store rank 0 hosts):

- a wait that has lasted STATUS_AFTER_S: the call it waits in (kind, name,
  root, tensor count, shapes and dtypes: `Call`), the names it has in
  flight, its step and since when; "running" again once the wait is over;
- an error it raised at a collective (a bad argument on this rank alone),
  one it declared the others will stall on (`Engine.refuse`), or one that
  ends its script (the excepthook engine.init installs), kept apart from
  the status, with the call it was raised in and where;
- "ended" at shutdown, with the cause when a rank was lost.

Each wait that has lasted STATUS_AFTER_S looks at the others' posts every
STATUS_AFTER_S (itself up to summary.DIRECT_UP_TO ranks; above, through one
summary key a leading rank publishes, summary.py) and raises the cause, in
words, as soon as the posts tell it (causes.py); otherwise, at HOROVOD_STALL_CHECK_TIME_SECONDS, a warning in
Horovod's words, then one per period, and StepMismatchError past
HOROVOD_STALL_SHUTDOWN_TIME_SECONDS (default 0: never).
HOROVOD_STALL_CHECK_DISABLE=1 turns the warnings and the stall-time check
off, as in Horovod; the causes and the timeout stay. A healthy wait shorter
than STATUS_AFTER_S costs nothing beyond its polls, and an error costs one
post.
"""
import concurrent.futures
import http.client
import itertools
import json
import os
import time
import warnings

from . import causes, summary
from .stall_words import (CHECK_VARIABLE, StepMismatchError, _label, describe,  # noqa: F401
                          label_or_name, labelled)

SHUTDOWN_VARIABLE = "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"
DISABLE_VARIABLE = "HOROVOD_STALL_CHECK_DISABLE"
DEFAULT_CHECK_S = 60.0
STATUS_AFTER_S = 1.0    # a wait this long posts its status and reads the others', each period
POSTED_NAMES = 256      # names in flight a waiting rank posts (more: the list says partial)
POSTED_SHAPES = 16      # tensors of a grouped call whose shapes and dtypes are posted
POSTED_RAISES = 8       # a rank's last errors kept on the board
PARALLEL_READS = 3      # reads in flight at once when one rank reads many posts (below the
#                         listen queue of horovodrun's server, 5, which drops connections past it)
_WAITS = itertools.count(1)     # this process's stalled waits, numbered: a post's wait


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


class Call:
    """A collective as the ranks post and compare it: what the user called (kind, name,
    root, tensor count, shapes and dtypes), and `wire`, the name this rank's engine waits
    on (the same as `name` except inside an object collective)."""

    __slots__ = ("kind", "name", "wire", "root", "count", "shapes", "dtypes")

    def __init__(self, kind, name, wire=None, root=None, tensors=None):
        self.kind, self.name, self.root = kind, name, root
        self.wire = name if wire is None else wire
        if tensors is None:
            tensors = []
        elif not isinstance(tensors, (list, tuple)):
            tensors = [tensors]
        self.count = len(tensors) if kind.startswith("grouped_") else None
        self.shapes = [list(t.shape) for t in tensors[:POSTED_SHAPES]]
        self.dtypes = [str(t.dtype).replace("torch.", "") for t in tensors[:POSTED_SHAPES]]

    @property
    def what(self):
        return describe(self.kind, self.name)

    def posted(self):
        label = _label(self.name) or _label(self.wire)
        return {"kind": self.kind, "name": self.name, "wire": self.wire, "root": self.root,
                "count": self.count, "shapes": self.shapes, "dtypes": self.dtypes,
                "hint": None if label is None else label[1]}


class Board:
    """Each rank's posts (small JSON dicts) on a store every rank reaches."""

    def __init__(self, put, get, size):
        self._put, self._get, self.size = put, get, size
        self.last = None            # this rank's last status post (tell_raised posts it again)
        self.raises = 0             # the number of its last error posted (in every status)
        self.failed = False         # its last status says a wait failed (see Stall.end)
        self._pool = None           # threads for reading many posts (a leader's sweep)
        self.serves_per_s = None    # requests a second the store serves, if few (summary.py)
        # The engine's session (Engine.learn_peers): the launcher's store outlives an engine,
        # and a script that shuts down and starts again in one job must not read the last
        # engine's posts ("rank 0 ended") as news.
        self.session = ""

    def _key(self, kind, rank):
        return f"pipe_horovod{self.session}.{kind}.{rank}"

    def read(self, ranks, kind="status"):
        """{rank: post or None} (a rank that posted only its count of errors: None, it
        posted no status). Many ranks: PARALLEL_READS at a time, so that a leader's sweep
        (summary.py) over a thousand ranks takes a fraction of a period."""
        def one(rank):
            try:
                raw = self._get(self._key(kind, rank))
                post = None if raw is None else json.loads(raw)
            except Exception:
                return None
            return None if post is not None and post.get("state") == "unposted" else post
        ranks = list(ranks)
        if len(ranks) <= 2 * PARALLEL_READS:
            return {rank: one(rank) for rank in ranks}
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(PARALLEL_READS,
                                                               "pipe_horovod-board")
        return dict(zip(ranks, self._pool.map(one, ranks)))

    def put_raw(self, kind, data):
        """One key of `kind` for the whole board (summary.py's summary)."""
        try:
            self._put(self._key(kind, "all"), data)
        except Exception:
            pass

    def get_raw(self, kind):
        try:
            return self._get(self._key(kind, "all"))
        except Exception:
            return None

    def tell_raised(self, rank, raised):
        """Rank `rank`'s last errors (each: seq, error, call, name, where, step, final,
        shared, wires, key, at), oldest first: kept apart from its status, which later waits
        overwrite, and several, as a rank may raise again before the others look. Its
        status is posted again with the number of the last (`raises`): a rank that looks
        reads the raised key of a rank only when that number moved (summary.py)."""
        for _ in range(3):          # the cause of the others' errors: not lost to one timeout
            if self.post(rank, kind="raised", raised=list(raised)):
                break
        self.raises = max([post["seq"] for post in raised] + [self.raises])
        last = self.last or {"state": "unposted"}
        self.post(rank, **{k: v for k, v in last.items() if k != "raises"})
        if self.size > summary.DIRECT_UP_TO:
            self.tell_news(rank)

    def tell_news(self, rank):
        """`rank`'s posts changed (a wait stalled or ended, an error, its end): the leader
        of the looks reads them again at its next (summary.py)."""
        self.put_raw("news", f"{rank}.{os.urandom(6).hex()}")

    def raised(self, ranks):
        """{rank: [its last errors, oldest first]}."""
        return {rank: (post or {}).get("raised", []) for rank, post in
                self.read(ranks, "raised").items()}

    def acknowledge(self, rank, raiser, seq):
        """`rank` has raised `raiser`'s error number `seq` (the raiser may leave now)."""
        self.post(rank, kind=f"told.{raiser}", seq=seq)

    def wait_for_ends(self, ranks, bound_s=2 * STATUS_AFTER_S + 1.0):
        """Until every rank of `ranks` posted that it ended, or `bound_s` passed (a rank
        that was killed never does)."""
        deadline = time.monotonic() + bound_s
        while ranks and time.monotonic() < deadline:
            ranks = [r for r, s in self.read(ranks).items() if not s or s["state"] != "ended"]
            if ranks:
                time.sleep(read_pause(len(ranks)))

    def post(self, rank, kind="status", **status):
        """True once the store took it."""
        news = False
        if kind == "status":        # a new state or wait, not a renewal: news (summary.py)
            last = self.last or {}
            news = (last.get("state"), last.get("wait")) != (status.get("state"),
                                                             status.get("wait"))
            self.last, self.failed = status, status.get("state") == "failed"
            status = dict(status, raises=self.raises)
        try:
            self._put(self._key(kind, rank), json.dumps(status))
        except Exception:           # the store is gone (its host ended), or did not answer
            return False
        if news and self.size > summary.DIRECT_UP_TO:
            self.tell_news(rank)
        return True


def read_pause(posts):
    """Between two reads of `posts` posts each by one rank that waits for them to change
    (a rank leaving after its error, the board's host at its end): 50 ms up to 32 posts,
    longer above, so that such a rank reads at most about 640 posts a second."""
    return max(0.05, posts / 640)


def torch_board(store, size):
    """On torch.distributed's rendezvous store (torchrun's agent, or rank 0)."""
    return Board(*torch_store(store), size)


def torch_store(store):
    """(put, get) of a Board on torch's store (get: None for a key not set)."""
    def get(key):
        return store.get(key) if store.check([key]) else None
    return store.set, get


HTTP_SERVES_PER_S = 1000    # horovodrun's server: Python, a thread per request, one core


def http_board(addr, port, size):
    """On horovodrun's rendezvous key-value server (HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT)."""
    board = Board(*http_store(addr, port), size)
    board.serves_per_s = HTTP_SERVES_PER_S
    return board


def http_store(addr, port):
    """(put, get) of a Board on horovodrun's server: one connection per request, as the
    server closes each (HTTP/1.0), made by http.client itself (urllib's opener costs the
    rank several times the CPU of the request)."""
    def request(method, key, data=None):
        connection = http.client.HTTPConnection(addr, int(port), timeout=2)
        try:
            connection.request(method, f"/pipe_horovod/{key}", body=data)
            reply = connection.getresponse()
            body = reply.read()
        finally:
            connection.close()
        if method == "GET" and reply.status == 404:
            return None
        if reply.status != 200:
            raise OSError(f"{method} {key}: HTTP {reply.status}")
        return body

    def put(key, value):
        request("PUT", key, value.encode() if isinstance(value, str) else value)

    def get(key):
        return request("GET", key)
    return put, get


class Stall:
    """One wait that has lasted STATUS_AFTER_S: posts, reads, warns, or raises its cause."""

    def __init__(self, engine, call, start, post=True):
        self.causes = causes
        self.engine, self.call, self.start = engine, call, start
        self.what = call.what
        self.board = engine._board
        self.check_s, self.shutdown_s = settings()
        self.warned_at = 0.0
        self.wait = next(_WAITS)    # this wait, told apart from the rank's others
        self.me = engine.rank()
        self.seen_deadlock = None   # a deadlock seen at the last tick, confirmed at the next
        self.seen_beats = {}        # the others' beats at that sighting
        self.beat = 0               # this wait's posts so far (see renew)
        self.tick_beats = {}        # the others' beats at the last tick (see tick's stuck)
        self.renewing = True        # post again each half period (the look says: summary.py)
        self.raised_view = None     # the others' raised errors, as the last look read them
        if engine._closed:          # shutting down: the board keeps saying "ended"
            self.board = None
        self.posting = self.board is not None and post
        if self.posting:
            summary.look(self.board, self).start()
        self.renew(first=True)

    def renew(self, first=False):
        """Post (again) that this rank waits in this call, with the next `beat`.

        Why again and again: a post is one PUT that may be lost (the store's server
        slow past the client's timeout on a loaded machine), so the "running" that ended
        an earlier wait may never land, and that rank's stale "waiting" would read as a
        wait it is no longer in. A rank that still waits renews its post; one whose beat
        has not moved may have gone on (causes.deadlock). Called when the wait starts and
        every half period after (Engine._wait_for) while `renewing`: above
        summary.DIRECT_UP_TO ranks, only while the summary asks for it (every rank
        waits, so a deadlock or the stall time may have to be confirmed)."""
        if not self.posting or not (first or self.renewing):
            return
        self.board.post(self.me, **self.posted_status())
        self.beat += 1

    def posted_status(self):
        """This rank's post while it waits here: the call, its step, which wait, the
        seconds it has waited (its own monotonic clock: no clock is compared across
        hosts), the beat, the names in flight."""
        names = self.engine.names_in_flight()
        return dict(state="waiting", what=self.what, call=self.call.posted(),
                    step=self.engine.step, stepping=self.engine.stepping, wait=self.wait,
                    waited=round(time.monotonic() - self.start, 1), beat=self.beat,
                    names=names[:POSTED_NAMES], partial=len(names) > POSTED_NAMES)

    def gave_up(self, status):
        """A rank whose wait failed and that has not completed a wait since (Engine._wait_for
        posts "running" at its next): it will not start this rank's collective for that
        wait."""
        return status is not None and status["state"] == "failed"

    def mine(self):
        """This rank's post, as the others read it."""
        return {"state": "waiting", "what": self.what, "call": self.call.posted(),
                "step": self.engine.step, "stepping": self.engine.stepping,
                "waited": time.monotonic() - self.start}

    def tick(self, matched):
        """Called every STATUS_AFTER_S while the wait goes on; `matched()` tells whether
        every rank has started the collective (then it is slow, not stalled)."""
        if self.board is None:
            return
        now = time.monotonic()
        elapsed = now - self.start
        others = summary.look(self.board, self)(self)
        if not matched():
            cause = self.causes.find(self, others, now)
            if cause is not None:
                raise self._shared(cause)
        beats, self.tick_beats = self.tick_beats, {
            r: status.get("beat") for r, status in others.items() if status is not None}
        if self.check_s is None or elapsed < self.check_s:
            return

        def stuck(rank, status):    # waiting long enough that it is not just slow, or gave up;
            # waiting still: its post renewed since the last tick (a lost "running" post
            # leaves a rank that went on "waiting", with a beat that no longer moves)
            return self.gave_up(status) or (status is not None and status["state"] == "waiting"
                                            and causes.waited(status, now) >= self.check_s / 2
                                            and rank in beats
                                            and status.get("beat") != beats[rank])

        if others and all(stuck(r, status) for r, status in others.items()) and not matched():
            raise self._shared(self.causes.deadlock(self, others, now, confirmed=True))
        if self.shutdown_s is not None and elapsed >= self.shutdown_s:
            raise self.causes.report(self, others, now, f"rank {self.me} stalled for "
                                     f"{elapsed:.0f} s, past {SHUTDOWN_VARIABLE}="
                                     f"{self.shutdown_s:g}, in {self.what}")
        if elapsed - self.warned_at >= self.check_s:
            self.warned_at = elapsed
            warnings.warn(self._report(others, now, elapsed), StallWarning, stacklevel=4)

    def _shared(self, cause):
        """`cause`, posted for the ranks it names (`cause.wires`: the collectives they wait
        in), which raise the same words at their next look instead of concluding again
        from posts this rank's end changes."""
        wires = getattr(cause, "wires", None)
        if wires:
            self.engine._tell_raised(cause, wires=wires)
            self.causes.concluded(self, wires)
        return cause

    def end(self, failed):
        """The wait is over: this rank runs again, or gave up (the others stop waiting
        for it at their next look)."""
        if self.board is None:
            return
        if failed:
            self.board.post(self.me, state="failed", what=self.what, call=self.call.posted(),
                            step=self.engine.step, wait=self.wait)
        else:
            self.board.post(self.me, state="running", step=self.engine.step)

    def _report(self, others, now, elapsed):
        return (f"One or more tensors were submitted to be reduced, gathered or broadcasted by "
                f"subset of ranks and are waiting for remainder of ranks for more than "
                f"{elapsed:.0f} seconds. This may indicate that different ranks are trying to "
                f"submit different tensors or that only subset of ranks is submitting tensors, "
                f"which will cause deadlock. {self.causes.everyone(self, others, now)}"
                f"{self.engine._missing(self.call)}")
