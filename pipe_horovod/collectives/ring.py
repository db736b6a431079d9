"""Ring: reduce-scatter then allgather, each segment cut into pieces.

Bandwidth-optimal (each rank sends 2(p-1)/p of the message) with 2(p-1)
latency terms. Pieces pipeline the ring: piece j of a segment moves on as
soon as it is added, while later pieces are still arriving, so decoding
and adding overlap the transfer. Segment s is owned (complete) by rank
s-1 after the reduce-scatter. Message ids: reduce-scatter step s piece j is
s*m + j; allgather step s piece j is (p-1)*m + s*m + j; gather/scatter
to/from a root use 2(p-1)*m + segment.
"""
from . import layout as _layout
from .exchange import wait


def blocks(kind, numel, p, nbytes, spec):
    per_segment = spec.chunks or _layout.pieces(nbytes / max(p, 1))
    per_segment = max(1, min(per_segment, _layout.MAX_BLOCKS // (2 * p)))
    return _layout.segmented(numel, p, per_segment)


class _Ring:
    def __init__(self, x, me, p):
        self.x, self.me, self.p = x, me, p
        self.m = len(x.layout) // p
        self.left, self.right = (me - 1) % p, (me + 1) % p
        self.gathered = (p - 1) * self.m          # first allgather message id

    def piece(self, segment, j):
        b = (segment % self.p) * self.m + j
        return b, b + 1

    def segment(self, segment):
        b = (segment % self.p) * self.m
        return b, b + self.m

    def reduce_scatter(self, owned):
        """After it, this rank's segment me+1 holds the full sum; `owned(b0, b1)`
        runs on each of its pieces as it completes."""
        x, me, p, m = self.x, self.me, self.p, self.m
        recvs = {(s, j): x.recv(x.recv_wire, *self.piece(me - s - 1, j), self.left, s * m + j)
                 for s in range(p - 1) for j in range(m)}
        for j in range(m):
            x.send_partial(*self.piece(me, j), self.right, j)
        for s in range(p - 1):
            for j in range(m):
                wait(recvs[(s, j)])
                b0, b1 = self.piece(me - s - 1, j)
                x.add(x.recv_wire, b0, b1)
                if s < p - 2:
                    x.send_partial(b0, b1, self.right, (s + 1) * m + j)
                else:
                    owned(b0, b1)

    def post_allgather(self):
        x, me, p, m = self.x, self.me, self.p, self.m
        return {(s, j): x.recv(x.final_wire, *self.piece(me - s, j), self.left,
                               self.gathered + s * m + j)
                for s in range(p - 1) for j in range(m)}

    def send_owned(self, b0, b1):
        """Allgather step 0: this rank's own segment, piece by piece."""
        j = b0 - self.segment(self.me + 1)[0]
        self.x.send(self.x.final_wire, b0, b1, self.right, self.gathered + j)

    def allgather(self, recvs):
        """Forward each final piece as it arrives (the last step's need not go on)."""
        x, me, p, m = self.x, self.me, self.p, self.m
        for s in range(p - 1):
            for j in range(m):
                wait(recvs[(s, j)])
                if s < p - 2:
                    x.send(x.final_wire, *self.piece(me - s, j), self.right,
                           self.gathered + (s + 1) * m + j)

    def owner(self, segment):
        return (segment - 1) % self.p


def allreduce(x, me, p):
    ring = _Ring(x, me, p)
    recvs = ring.post_allgather()

    def owned(b0, b1):
        x.finalize(b0, b1)
        ring.send_owned(b0, b1)

    ring.reduce_scatter(owned)
    ring.allgather(recvs)
    x.take(x.final_wire, 0, len(x.layout))


def reduce(x, me, p, root):
    ring = _Ring(x, me, p)
    ring.reduce_scatter(lambda b0, b1: None)
    first = 2 * (p - 1) * ring.m
    mine = ring.segment(me + 1)
    if me != root:
        x.send_partial(*mine, root, first + (me + 1) % p)
        return
    recvs = {s: x.recv(x.recv_wire, *ring.segment(s), ring.owner(s), first + s)
             for s in range(p) if ring.owner(s) != root}
    for s, received in recvs.items():
        wait(received)
        x.take(x.recv_wire, *ring.segment(s))
    x.scale(0, len(x.layout))


def broadcast(x, me, p, root):
    """Root scatters segment s to its owner, then the ring allgathers."""
    ring = _Ring(x, me, p)
    first = 2 * (p - 1) * ring.m
    recvs = ring.post_allgather()
    mine = ring.segment(me + 1)
    if me == root:
        x.encode(x.final_wire, 0, len(x.layout), feedback=False)
        for s in range(p):
            if ring.owner(s) != root:
                x.send(x.final_wire, *ring.segment(s), ring.owner(s), first + s)
    else:
        wait(x.recv(x.final_wire, *mine, root, first + (me + 1) % p))
    for j in range(ring.m):
        ring.send_owned(*ring.piece(me + 1, j))
    ring.allgather(recvs)
    x.take(x.final_wire, 0, len(x.layout))
