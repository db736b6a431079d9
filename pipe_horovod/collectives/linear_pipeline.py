"""Linear pipeline (Wang et al.): chunks flow along a chain, every link busy.

Once the chain fills, each link carries one chunk per step, so the cost is
about (p + k) chunk-times, nearly independent of p for large messages. The
allreduce reduces along the chain 0 -> p-1 and broadcasts back p-1 -> 0;
on full-duplex links the two directions overlap, chunk c coming back while
chunk c+1 still goes out. Messages: reduce chunk c is id c, broadcast chunk
c is id k + c.
"""
from . import layout as _layout
from .arrivals import InOrder
from .exchange import wait


def blocks(kind, numel, p, nbytes, spec):
    hops = None if kind == "allreduce" else p
    k = spec.chunks or _layout.lp_chunks(p, nbytes, spec.network, hops)
    return _layout.split(numel, max(1, min(k, numel, _layout.MAX_BLOCKS)))


class _Forwarder:
    """Final chunks travelling from chain position 0 to p-1: receive each from the
    previous position, pass it on as is. `at(v)` maps a position to a rank index.

    Every receive is posted here, up front, so the bytes land whatever this
    thread is doing; only the forwarding sends wait for it. With `watch`
    (a rank that forwards while it reduces), a helper thread tells which
    have arrived: gloo's receives cannot be polled (arrivals.py)."""

    def __init__(self, x, v, p, at, first, watch=False):
        self.x, self.first = x, first
        self.k = len(x.layout)
        self.next = at(v + 1) if v < p - 1 else None
        self.recvs = [None] * self.k if v == 0 else [
            x.recv(x.final_wire, c, c + 1, at(v - 1), first + c) for c in range(self.k)]
        watch = watch and v > 0 and self.next is not None
        self.arrivals = InOrder(self.recvs) if watch else None
        self.done = 0

    def pump(self, block):
        """Forward every chunk that has arrived (none if not watched); with
        `block`, all of them."""
        while self.done < self.k:
            if self.arrivals is None:
                if not block:
                    return
                wait(self.recvs[self.done])
            elif block:
                self.arrivals.wait(self.done)
            elif self.arrivals.count() <= self.done:
                return
            if self.next is not None:
                self.x.send(self.x.final_wire, self.done, self.done + 1, self.next,
                            self.first + self.done)
            self.done += 1


def _reduce_chain(x, v, p, at, complete, between=lambda: None):
    """Reduce chunk by chunk toward chain position p-1, where `complete(c)` runs
    as chunk c becomes the full sum; `between()` runs after each chunk."""
    k = len(x.layout)
    recvs = [] if v == 0 else [x.recv(x.recv_wire, c, c + 1, at(v - 1), c) for c in range(k)]
    for c in range(k):
        if v > 0:
            wait(recvs[c])
            x.add(x.recv_wire, c, c + 1)
        if v == p - 1:
            complete(c)
        else:
            x.send_partial(c, c + 1, at(v + 1), c)
        between()


def allreduce(x, me, p):
    k = len(x.layout)
    if me == p - 1:
        def complete(c):   # the tail: chunk c is the full sum; send it back at once
            x.finalize(c, c + 1)
            x.send(x.final_wire, c, c + 1, me - 1, k + c)

        _reduce_chain(x, me, p, lambda v: v, complete)
    else:
        # The broadcast runs backwards: position v of its chain is rank p-1-v.
        back = _Forwarder(x, p - 1 - me, p, lambda v: p - 1 - v, k, watch=True)
        _reduce_chain(x, me, p, lambda v: v, None, lambda: back.pump(block=False))
        back.pump(block=True)
    x.take(x.final_wire, 0, k)


def reduce(x, me, p, root):
    # The chain ends at the root: position v is rank (root + 1 + v) % p.
    _reduce_chain(x, (me - root - 1) % p, p, lambda v: (root + 1 + v) % p,
                  lambda c: x.scale(c, c + 1))


def broadcast(x, me, p, root):
    k = len(x.layout)
    if me == root:
        x.encode(x.final_wire, 0, k, feedback=False)
    _Forwarder(x, (me - root) % p, p, lambda v: (root + v) % p, 0).pump(block=True)
    x.take(x.final_wire, 0, k)
