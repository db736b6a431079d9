"""How a stalled wait looks at the others' posts (stall.py) for a cost that does not grow
with the number of ranks.

Every rank whose wait lasts STATUS_AFTER_S looked every period at every other rank's posts:
on horovodrun each look is an HTTP GET to the one rendezvous server that elastic mode and
the rendezvous also need, so a straggler among 1024 ranks cost about a million requests a
second, and the server that was to say why the job stalled stopped answering. So above
DIRECT_UP_TO ranks one waiting rank, the leader, publishes one summary key each period
(every rank's post, the same posts grouped: ranks in one collective share one entry),
which the other waiting ranks read each period (on a store that serves few requests a
second, every `read_every` periods). It reads the posts again (a sweep, one
GET per rank) when they may have changed: a rank writes one `news` key (any new value: its
rank and a nonce) whenever its status changes (a wait stalls or ends, it raises, it ends),
and the leader reads that key each period; and every SWEEP_EVERY periods all the same (a
news write may be lost), and each period while it asks for renewals. A straggler's storm
costs one GET per rank per period and a sweep every SWEEP_EVERY: about 1.25 requests per
rank per second. Each rank names the
cause from the same posts as before (causes.py), so the words do not change; only where
it read them.

The leader is rank 0 while it waits. When it does not (it is the straggler, it raised, it
died, it ended), the summary stops advancing, and the lowest rank the last summary saw
waiting takes over after that many periods more (the next one after one more, ...), so one
rank, not all, starts reading; a rank that leads steps down when it sees a lower rank's
summary advance. With no summary at all, rank r takes over at its look r + 2.

A rank renews its post (a new beat) only while the summary asks for it: when every rank
waits or gave up, the only case in which causes.deadlock and the stall-time check need to
see posts renewed. A straggler's storm therefore costs no PUTs.

The ranks of one collective start waiting within milliseconds of each other, so their looks
would reach the store together each period: a thousand requests at once overflow the
listen queue of horovodrun's server (5 connections), and a refused connection is retried
a second later, by the ranks and by whatever else needs the server then. So above
DIRECT_UP_TO ranks each rank starts looking `phase` into the period, spread over it.

No clock is compared across hosts: a post carries the seconds its rank had waited (its own
monotonic clock); a reader adds how long ago it first saw that post (its own clock).
"""
import json
import math
import threading
import time
import zlib

DIRECT_UP_TO = 2        # up to this many ranks each rank reads the other's post itself
SUMMARY_RAISERS = 64    # ranks whose raised errors a summary carries (the lowest that raised)
VARYING = ("wait", "waited", "beat", "raises")   # per-rank fields, kept out of the grouping
SWEEP_EVERY = 4         # a leader with no news sweeps every this many periods all the same
STALE_TICKS = 2         # periods without a new summary that may just be the leader's phase
PER_RANK = 1.0 + 1.0 / SWEEP_EVERY  # requests per rank per period, reading every period


def read_every(size, serves_per_s):
    """Periods between two reads of the summary by a rank that does not lead: 1, unless
    the store serves too few requests a second for `size` ranks to read each period
    (`serves_per_s`, Board: horovodrun's Python server, about 1,000; torch's TCPStore
    does not count). A saturated store answers late or not at all (2 s timeouts), which
    names causes later than reading less often does."""
    if not serves_per_s:
        return 1
    return max(1, math.ceil(PER_RANK * size / (0.8 * serves_per_s)))


def phase(rank, size, period=1.0):
    """When in the period `rank` first looks (posts, then reads), spread evenly over the
    ranks (the golden ratio's multiples, whatever the size); 0 for the leader and up to
    DIRECT_UP_TO ranks."""
    if size <= DIRECT_UP_TO:
        return 0.0
    return (rank * 0.6180339887498949) % 1.0 * period


class Look:
    """One rank's view of the board across its stalled waits: what it read, when it first
    saw each post (its monotonic clock), which errors it read, whether it leads."""

    def __init__(self, board, me, size):
        self.board, self.me, self.size = board, me, size
        self.lock = threading.Lock()
        self.first_seen = {}        # (rank, state, wait, beat) -> monotonic time first read
        self.raises = {}            # rank -> the count of errors read from its raised key
        self.raised = {}            # rank -> its raised posts, as last read
        self.leading = False
        self.seq = 0                # summaries this rank published
        self.last = None            # (writer, seq) of the summary read at the last look
        self.stale = 0              # looks in a row that found no new summary
        self.waiting = []           # ranks the last summary read saw waiting
        self.summary_seen = 0.0     # when the summary read last was first seen here
        self.looks = 0              # looks since this rank began to lead
        self.view = {}              # the others' posts, as the leader's last sweep read them
        self.news = None            # the news key as the leader last read it
        self.follows = 0            # looks as a follower
        self.every = read_every(size, getattr(board, "serves_per_s", None))
        self.adopted = {r: None for r in range(size) if r != me}   # as the last summary said

    def start(self):
        """A new stalled wait: rank 0 leads; a rank that took over last time follows again
        until the summary goes stale."""
        self.leading = self.me == 0
        self.looks = 0

    def __call__(self, stall):
        """{rank: post or None} of every other rank, as this rank names causes from them;
        sets stall.raised_view (their raised errors) and stall.renewing."""
        with self.lock:
            now = time.monotonic()
            if self.size <= DIRECT_UP_TO:
                stall.renewing = True
                others = self._sweep(now)
            elif self.leading:
                others = self._lead(stall, now)
            else:
                others = self._follow(stall, now)
            stall.raised_view = {r: p for r, p in self.raised.items() if r != self.me}
            return others

    # --- reading the posts ---------------------------------------------------------
    def _sweep(self, now):
        ranks = [r for r in range(self.size) if r != self.me]
        others = self.board.read(ranks)
        behind = [r for r, s in others.items() if s and s.get("raises", 0) > self.raises.get(r, 0)]
        if behind:                  # only ranks whose count of errors moved: rare
            self.raised = dict(self.raised)     # (a follower's was a summary's, shared)
            for rank, posts in self.board.raised(behind).items():
                self.raised[rank] = posts
                self.raises[rank] = max([p.get("seq", 0) for p in posts] + [0])
        seen = {}                   # (only the posts read now: the dict stays N long)
        for rank, status in others.items():
            if status is not None and "waited" in status:
                key = (rank, status["state"], status.get("wait"), status.get("beat"))
                status["seen"] = seen[key] = self.first_seen.get(key, now)
        self.first_seen = seen
        return others

    def _lead(self, stall, now):
        self.looks += 1
        news, self.news = self.news, self.board.get_raw("news")
        if self.me != 0:            # a deputy: has a lower rank's summary moved on?
            summary = self._read_summary()
            if summary is not None and summary["by"] < self.me and \
                    (summary["by"], summary["n"]) != self.last:
                self.leading = False
                self.last, self.stale, self.summary_seen = (summary["by"], summary["n"]), 0, now
                return self._adopt(stall, summary, now)
        if news != self.news or stall.renewing or self.looks % SWEEP_EVERY == 1:
            others = self._sweep(now)
            self.waiting = sorted(r for r, s in others.items() if s and s["state"] == "waiting")
            stall.renewing = all(s is not None and s["state"] in ("waiting", "failed")
                                 for s in others.values())
            self.view = others
        else:                       # nothing new: the last sweep's posts, published again
            others = self.view
        posts = dict(others)
        posts[self.me] = dict(stall.posted_status(), seen=now)
        self.seq += 1
        self.last = (self.me, self.seq)
        self.board.put_raw("summary", encode(self.me, self.seq, stall.renewing, posts,
                                             self.raised, now))
        return dict(others)

    def _follow(self, stall, now):
        self.follows += 1
        if (self.follows - 1) % self.every:
            return dict(self.adopted)       # a look between two reads: the last one's
        summary = self._read_summary()
        key = None if summary is None else (summary["by"], summary["n"])
        if key == self.last:
            self.stale += 1
        else:
            self.stale = 0
            self.summary_seen = now
        self.last = key
        if self.stale > STALE_TICKS + self._place(summary):
            self.leading = True                 # the leader went on: this rank reads
            self.stale, self.looks = 0, 0
            return self._lead(stall, now)
        if summary is None:
            stall.renewing = False
            self.adopted = {r: None for r in range(self.size) if r != self.me}
            return dict(self.adopted)
        return self._adopt(stall, summary, now)

    def _place(self, summary):
        """How many periods after the first candidate this rank takes over: its place among
        the ranks the last summary saw waiting (its writer, gone on, not counted)."""
        if summary is None:
            return self.me - 1
        waiting = [r for r in self.waiting if r != summary["by"]]
        return waiting.index(self.me) if self.me in waiting else len(waiting) + self.me

    def _adopt(self, stall, summary, now):
        posts, self.waiting, self.raised = _decoded(summary, self.summary_seen)
        stall.renewing = summary.get("renew", False)
        others = dict(posts)
        others.pop(self.me, None)
        self.adopted = others
        return dict(others)

    def _read_summary(self):
        global _parsed
        raw = self.board.get_raw("summary")
        if raw is None:
            return None
        last = _parsed
        if last[0] == raw:          # read by another rank of this process (a simulation)
            return last[1]
        try:
            summary = json.loads(zlib.decompress(raw))
        except (ValueError, zlib.error):
            return None
        _parsed = (raw, summary)
        return summary


# The last summary parsed in this process, as (bytes, summary), and its decoding: read-only
# once made, so that where one process simulates many ranks (tools/stall_load.py) they
# parse and decode each summary once, as one rank does; `seen` is then when this process
# first read it.
_parsed = (None, None)
_decoding = (None, None)


def _decoded(summary, seen):
    """(posts, the ranks waiting, raised errors by rank) of `summary`, first read at
    `seen`: shared, not to be changed."""
    global _decoding
    last = _decoding
    if last[0] is summary:
        return last[1]
    posts = decode(summary, seen)
    made = (posts, sorted(r for r, s in posts.items() if s and s["state"] == "waiting"),
            {int(r): p for r, p in summary.get("raised", {}).items()})
    _decoding = (summary, made)
    return made


def look(board, stall):
    """`board`'s Look for `stall`'s rank (made at the first stalled wait)."""
    view = getattr(board, "_look", None)
    if view is None or view.me != stall.me:
        view = board._look = Look(board, stall.me, stall.engine.size())
    return view


# --- the summary's encoding ----------------------------------------------------------
def encode(writer, seq, renew, posts, raised, now):
    """Every rank's post in one compressed key: the posts grouped by what they say (the
    ranks waiting in one collective share an entry), the per-rank fields in lists, the
    seconds each waiting rank had waited as of `now` (this rank's clock), and the raised
    errors of the lowest SUMMARY_RAISERS ranks that raised."""
    size = max(posts) + 1 if posts else 0
    kinds, index, of = [], {}, []
    per = {field: [] for field in VARYING}
    for rank in range(size):
        status = posts.get(rank)
        if status is None:
            of.append(-1)
            for field in VARYING:
                per[field].append(None)
            continue
        status = dict(status)
        seen = status.pop("seen", None)
        values = {field: status.pop(field, None) for field in VARYING}
        if values["waited"] is not None and seen is not None:
            values["waited"] = round(values["waited"] + max(0.0, now - seen), 1)
        text = json.dumps(status, sort_keys=True)
        if text not in index:
            index[text] = len(kinds)
            kinds.append(status)
        of.append(index[text])
        for field in VARYING:
            per[field].append(values[field])
    raisers = sorted(r for r, p in raised.items() if p)[:SUMMARY_RAISERS]
    summary = {"by": writer, "n": seq, "renew": renew, "kinds": kinds, "of": of, "per": per,
               "raised": {str(r): raised[r] for r in raisers}}
    return zlib.compress(json.dumps(summary, separators=(",", ":")).encode(), 1)


def decode(summary, seen):
    """{rank: post or None} from a summary first read at `seen` (this rank's clock)."""
    posts = {}
    for rank, kind in enumerate(summary["of"]):
        if kind < 0:
            posts[rank] = None
            continue
        status = dict(summary["kinds"][kind])
        for field in VARYING:
            value = summary["per"][field][rank]
            if value is not None:
                status[field] = value
        if "waited" in status:
            status["seen"] = seen
        posts[rank] = status
    return posts
