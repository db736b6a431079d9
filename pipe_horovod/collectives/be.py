"""Bidirectional exchange: recursive halving, then recursive doubling.

Rabenseifner's allreduce: ring's bandwidth with 2 log p latency terms. For
p not a power of two, q = 2**floor(log2 p) ranks run the exchange: of the
first 2(p-q) ranks each even one (an extra) folds its vector into the odd
one above it (its partner) and gets the result back (Thakur, Rabenseifner
& Gropp 2005). Done as three whole-vector phases that costs two extra
transfers (3n on 3 ranks against ring's 4n/3); here both are piece by
piece and overlap the exchange: the extra sends its pieces in the order
the partner's halving needs them (each round's outgoing half first), and
the partner hands each block back as soon as it holds it final, so the
partner's link carries one extra n each way and the cost is the
power-of-two cost plus one message time (timing.be_allreduce).

Each of the q segments (position v owns segment v after halving) is cut
into pieces, so a piece's decode and add overlap the next one's transfer
(as in ring). Message ids: phase * blocks + block, the phases being the
hand-over, the halving rounds, the doubling rounds, gather/scatter to or
from a root, the hand-back.
"""
from . import layout as _layout
from .channel import MESSAGE_BITS
from .exchange import wait


def _exchanging(p):
    return 1 << (p.bit_length() - 1)


def _phases(q):
    return 2 * (q.bit_length() - 1) + 3


def blocks(kind, numel, p, nbytes, spec):
    q = _exchanging(p)
    per_segment = spec.chunks or _layout.pieces(nbytes / q)
    most = min(_layout.MAX_BLOCKS, ((1 << MESSAGE_BITS) - 1) // _phases(q)) // q
    return _layout.segmented(numel, q, max(1, min(per_segment, most)))


class _Exchange:
    """Who takes part in the exchange, at which position, and the message ids."""

    def __init__(self, x, me, p):
        self.x, self.me, self.p = x, me, p
        self.q = _exchanging(p)
        self.extra = p - self.q
        self.rounds = self.q.bit_length() - 1
        self.blocks = len(x.layout)
        self.m = self.blocks // self.q              # pieces per segment
        if me < 2 * self.extra:
            self.position = me // 2 if me % 2 else None   # even ones sit out
        else:
            self.position = me - self.extra
        self.folding = None                          # the partner: the extra's pieces

    def rank(self, v):
        return 2 * v + 1 if v < self.extra else v + self.extra

    def has_extra(self):
        return self.me < 2 * self.extra and self.me % 2 == 1

    def id(self, phase, b):
        return phase * self.blocks + b

    @property
    def gather_phase(self):
        return 1 + 2 * self.rounds

    @property
    def back_phase(self):
        return 2 + 2 * self.rounds

    def span(self, lo, hi):
        """Blocks of segments lo..hi-1."""
        return range(lo * self.m, hi * self.m)

    def segment(self, v):
        """(first block, block past the last) of segment v."""
        return v * self.m, (v + 1) * self.m

    def need_order(self, v):
        """Segment ranges in the order position v's halving consumes them: each
        round's outgoing half, then its own segment."""
        order, (lo, hi), d = [], (0, self.q), self.q // 2
        while d:
            mid = (lo + hi) // 2
            keep, give = ((mid, hi), (lo, mid)) if v & d else ((lo, mid), (mid, hi))
            order.append(give)
            lo, hi = keep
            d //= 2
        return order + [(v, v + 1)]

    # --- the extra's vector, folded into its partner --------------------------
    def hand_over(self):
        """The extra sends its pieces in need order; the partner posts their receives
        (into the final wire, unused until its own doubling, by when all are added)."""
        x, me = self.x, self.me
        if self.me >= 2 * self.extra:
            return
        if me % 2 == 0:
            for lo, hi in self.need_order(me // 2):
                for b in self.span(lo, hi):
                    x.send_partial(b, b + 1, me + 1, self.id(0, b))
        else:
            self.folding = [x.recv(x.final_wire, b, b + 1, me - 1, self.id(0, b))
                            for b in range(self.blocks)]

    def fold(self, blocks):
        """Add the extra's pieces of `blocks` (the partner only; once each)."""
        if self.folding is None:
            return
        for b in blocks:
            received, self.folding[b] = self.folding[b], None
            if received is not None:
                wait(received)
                self.x.add(self.x.final_wire, b, b + 1)

    def hand_back(self, blocks, root=None):
        """The partner passes final blocks on to its extra (unless the extra is the root)."""
        if self.has_extra() and self.me - 1 != root:
            for b in blocks:
                self.x.send(self.x.final_wire, b, b + 1, self.me - 1, self.id(self.back_phase, b))

    def receive_back(self):
        """The extra's receives of its result, posted before anything else it does."""
        x = self.x
        return [x.recv(x.final_wire, b, b + 1, self.me + 1, self.id(self.back_phase, b))
                for b in range(self.blocks)]

    # --- the exchange among q positions ---------------------------------------
    def halve(self):
        """Recursive halving: after it, this position's segment holds the full sum."""
        x, v = self.x, self.position
        (lo, hi), d, step = (0, self.q), self.q // 2, 0
        while d:
            mid = (lo + hi) // 2
            keep, give = ((mid, hi), (lo, mid)) if v & d else ((lo, mid), (mid, hi))
            partner, phase = self.rank(v ^ d), 1 + step
            received = [(b, x.recv(x.recv_wire, b, b + 1, partner, self.id(phase, b)))
                        for b in self.span(*keep)]
            for b in self.span(*give):
                self.fold((b,))
                x.send_partial(b, b + 1, partner, self.id(phase, b))
            for b, work in received:
                wait(work)
                x.add(x.recv_wire, b, b + 1)
            lo, hi = keep
            d, step = d // 2, step + 1
        self.fold(self.span(v, v + 1))

    def double(self, root=None):
        """Recursive doubling of the final wire: each round swaps everything held so
        far; each block goes on to this position's extra as soon as it is here."""
        x, v, d, step = self.x, self.position, 1, 0
        self.hand_back(self.span(v, v + 1), root)
        while d < self.q:
            mine, theirs = (v // d) * d, ((v ^ d) // d) * d
            partner, phase = self.rank(v ^ d), 1 + self.rounds + step
            received = [(b, x.recv(x.final_wire, b, b + 1, partner, self.id(phase, b)))
                        for b in self.span(theirs, theirs + d)]
            for b in self.span(mine, mine + d):
                x.send(x.final_wire, b, b + 1, partner, self.id(phase, b))
            for b, work in received:
                wait(work)
                self.hand_back((b,), root)
            d, step = d * 2, step + 1


def allreduce(x, me, p):
    ex = _Exchange(x, me, p)
    back = ex.receive_back() if ex.position is None else ()
    ex.hand_over()
    if ex.position is not None:
        ex.halve()
        x.finalize(*ex.segment(ex.position))
        ex.double()
    for work in back:
        wait(work)
    x.take(x.final_wire, 0, len(x.layout))


def reduce(x, me, p, root):
    """Halving, then every position sends its segment to the root."""
    ex = _Exchange(x, me, p)
    ex.hand_over()
    if ex.position is not None:
        ex.halve()
        if me != root:
            for b in ex.span(ex.position, ex.position + 1):
                x.send_partial(b, b + 1, root, ex.id(ex.gather_phase, b))
    if me != root:
        return
    received = [(b, x.recv(x.recv_wire, b, b + 1, ex.rank(v), ex.id(ex.gather_phase, b)))
                for v in range(ex.q) if ex.rank(v) != root for b in ex.span(v, v + 1)]
    for b, work in received:
        wait(work)
        x.take(x.recv_wire, b, b + 1)
    x.scale(0, len(x.layout))


def broadcast(x, me, p, root):
    """The root scatters segment v to position v, then doubling and the hand-back."""
    ex = _Exchange(x, me, p)
    back = ex.receive_back() if ex.position is None and me != root else ()
    if me == root:
        x.encode(x.final_wire, 0, len(x.layout), feedback=False)
        for v in range(ex.q):
            if ex.rank(v) != root:
                for b in ex.span(v, v + 1):
                    x.send(x.final_wire, b, b + 1, ex.rank(v), ex.id(ex.gather_phase, b))
    elif ex.position is not None:
        for b in ex.span(ex.position, ex.position + 1):
            wait(x.recv(x.final_wire, b, b + 1, root, ex.id(ex.gather_phase, b)))
    if ex.position is not None:
        ex.double(root)
    for work in back:
        wait(work)
    x.take(x.final_wire, 0, len(x.layout))
