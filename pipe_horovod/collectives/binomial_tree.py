"""Binomial tree (minimal spanning tree): log p rounds, each moving the whole message.

Wins on latency for small messages; for large ones every round pays the
full bandwidth term, which is what LP and ring avoid. Positions are taken
relative to the root (position 0). Messages: 0 up the tree, 1 down it.
"""
from . import layout as _layout
from .exchange import wait


def blocks(kind, numel, p, nbytes, spec):
    # One message per hop; blocks only set int8's scale granularity.
    count = spec.chunks or _layout.pieces(nbytes)
    return _layout.split(numel, max(1, min(count, numel)))


def _lowbit(v):
    return v & -v


def _up(x, v, p, at):
    """Binomial reduce to position 0: add each child's partial, then send to the parent."""
    everything = (0, len(x.layout))
    mask = 1
    while mask < p:
        if v & mask:
            x.send_partial(*everything, at(v - mask), 0)
            return
        if v + mask < p:
            wait(x.recv(x.recv_wire, *everything, at(v + mask), 0))
            x.add(x.recv_wire, *everything)
        mask <<= 1


def _down(x, v, p, at):
    """Binomial broadcast of the final wire from position 0."""
    everything = (0, len(x.layout))
    if v:
        wait(x.recv(x.final_wire, *everything, at(v - _lowbit(v)), 1))
        mask = _lowbit(v) >> 1
    else:
        mask = 1 << max(0, (p - 1).bit_length() - 1)
    while mask:
        if v + mask < p:
            x.send(x.final_wire, *everything, at(v + mask), 1)
        mask >>= 1


def _positions(me, p, root):
    return (me - root) % p, (lambda v: (v + root) % p)


def allreduce(x, me, p):
    _up(x, me, p, lambda v: v)
    if me == 0:
        x.finalize(0, len(x.layout))
    _down(x, me, p, lambda v: v)
    x.take(x.final_wire, 0, len(x.layout))


def reduce(x, me, p, root):
    v, at = _positions(me, p, root)
    _up(x, v, p, at)
    if v == 0:
        x.scale(0, len(x.layout))


def broadcast(x, me, p, root):
    v, at = _positions(me, p, root)
    if v == 0:
        x.encode(x.final_wire, 0, len(x.layout), feedback=False)
    _down(x, v, p, at)
    x.take(x.final_wire, 0, len(x.layout))
