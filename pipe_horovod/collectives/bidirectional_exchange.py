"""Bidirectional exchange: recursive halving, then recursive doubling.

Rabenseifner's allreduce: ring's bandwidth with 2 log p latency terms. For
p not a power of two, q = 2**floor(log2 p) ranks run the exchange: of the
first 2(p-q) ranks each even one hands its vector to the odd one above it
first and gets the result back last (Thakur, Rabenseifner & Gropp 2005):
two whole-message transfers on that pair's link, 3n at 3 ranks against
ring's 4n/3 (pipe_horovod.pipeline.timing_model.be_allreduce). Sending the fold and the hand-back in
pieces that overlap the exchange was tried and measured the same (1.71 s
for 64 MB at 3 workers): the partner's link is ingress-bound until the
fold is in, and egress-bound once results exist.
The message is cut into q blocks; after halving, exchange position v holds
block v complete. Message ids: 0 the hand-over, 1.. the rounds, then
gather/scatter to or from a root, the hand-back last.
"""
from . import layout as _layout
from .exchange import wait

_HAND_OVER, _ROUNDS = 0, 1


def blocks(kind, numel, p, nbytes, spec):
    return _layout.split(numel, _exchanging(p))


def _exchanging(p):
    return 1 << (p.bit_length() - 1)


class _Exchange:
    """Who takes part in the exchange, and at which position."""

    def __init__(self, me, p):
        self.p, self.q = p, _exchanging(p)
        self.extra = p - self.q
        self.rounds = self.q.bit_length() - 1
        self.after = _ROUNDS + 2 * self.rounds            # gather/scatter ids
        self.hand_back = self.after + self.q
        if me < 2 * self.extra:
            self.position = me // 2 if me % 2 else None   # even ones sit out
        else:
            self.position = me - self.extra

    def rank(self, v):
        return 2 * v + 1 if v < self.extra else v + self.extra


def _hand_over(x, me, ex):
    everything = (0, len(x.layout))
    if me < 2 * ex.extra:
        if me % 2 == 0:
            x.send_partial(*everything, me + 1, _HAND_OVER)
        else:
            wait(x.recv(x.recv_wire, *everything, me - 1, _HAND_OVER))
            x.add(x.recv_wire, *everything)


def _halve(x, ex):
    """Recursive halving: after it, this position's block holds the full sum."""
    v, (lo, hi) = ex.position, (0, ex.q)
    d, step = ex.q // 2, 0
    while d:
        mid = (lo + hi) // 2
        keep, give = ((mid, hi), (lo, mid)) if v & d else ((lo, mid), (mid, hi))
        partner = ex.rank(v ^ d)
        received = x.recv(x.recv_wire, *keep, partner, _ROUNDS + step)
        x.send_partial(*give, partner, _ROUNDS + step)
        wait(received)
        x.add(x.recv_wire, *keep)
        lo, hi = keep
        d, step = d // 2, step + 1


def _double(x, ex):
    """Recursive doubling of the final wire: each round swaps everything held so far."""
    v, d, step = ex.position, 1, 0
    while d < ex.q:
        mine, theirs = (v // d) * d, ((v ^ d) // d) * d
        partner = ex.rank(v ^ d)
        received = x.recv(x.final_wire, theirs, theirs + d, partner,
                          _ROUNDS + ex.rounds + step)
        x.send(x.final_wire, mine, mine + d, partner, _ROUNDS + ex.rounds + step)
        wait(received)
        d, step = d * 2, step + 1


def _hand_back(x, me, ex, root=None):
    everything = (0, len(x.layout))
    if me >= 2 * ex.extra or me - (me % 2) == root:
        return
    if me % 2:
        x.send(x.final_wire, *everything, me - 1, ex.hand_back)
    else:
        wait(x.recv(x.final_wire, *everything, me + 1, ex.hand_back))


def allreduce(x, me, p):
    ex = _Exchange(me, p)
    _hand_over(x, me, ex)
    if ex.position is not None:
        _halve(x, ex)
        x.finalize(ex.position, ex.position + 1)
        _double(x, ex)
    _hand_back(x, me, ex)
    x.take(x.final_wire, 0, len(x.layout))


def reduce(x, me, p, root):
    """Halving, then every block's position sends it to the root."""
    ex = _Exchange(me, p)
    _hand_over(x, me, ex)
    if ex.position is not None:
        _halve(x, ex)
        if me != root:
            x.send_partial(ex.position, ex.position + 1, root, ex.after + ex.position)
    if me != root:
        return
    for v in range(ex.q):
        if ex.rank(v) != root:
            wait(x.recv(x.recv_wire, v, v + 1, ex.rank(v), ex.after + v))
            x.take(x.recv_wire, v, v + 1)
    x.scale(0, len(x.layout))


def broadcast(x, me, p, root):
    """The root scatters block v to position v, then doubling and the hand-back."""
    ex = _Exchange(me, p)
    if me == root:
        x.encode(x.final_wire, 0, len(x.layout), feedback=False)
        for v in range(ex.q):
            if ex.rank(v) != root:
                x.send(x.final_wire, v, v + 1, ex.rank(v), ex.after + v)
    elif ex.position is not None:
        wait(x.recv(x.final_wire, ex.position, ex.position + 1, root, ex.after + ex.position))
    if ex.position is not None:
        _double(x, ex)
    _hand_back(x, me, ex, root)
    x.take(x.final_wire, 0, len(x.layout))
