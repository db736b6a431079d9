"""How a message is cut into blocks, and where each block sits on the wire.

A block is the unit a codec encodes on its own (int8: one scale per block)
and the unit an algorithm sends: LP's chunks, ring's pieces of a segment,
BE's halves and quarters are all runs of consecutive blocks. Knowing only
(numel, codec, algorithm, p, chunks), every rank computes the same layout,
so no sizes travel with the data.
"""
import math

from . import cost_model
from ..engine.base import shard_sizes

# Most messages one collective sends to one peer: tags reserve 17 bits for them.
MAX_BLOCKS = 4096
# Ring pieces and MST/BE int8 blocks: small enough that a piece's decode
# overlaps the next piece's transfer, large enough that per-message overhead stays small.
PIECE_BYTES = 1 << 20
# Where no network was measured: 100 us per message (gloo + Python per send), 1 Gbit/s.
DEFAULT_NETWORK = cost_model.Network(alpha=100e-6, beta=8e-9)


class Layout:
    """Blocks of `sizes` elements laid end to end, in the accumulator and on the wire."""

    def __init__(self, sizes, codec):
        self.sizes = list(sizes)
        self.starts = [0]
        self.wire_starts = [0]
        for size in self.sizes:
            self.starts.append(self.starts[-1] + size)
            self.wire_starts.append(self.wire_starts[-1] + codec.wire_numel(size))

    def __len__(self):
        return len(self.sizes)

    @property
    def numel(self):
        return self.starts[-1]

    @property
    def wire_numel(self):
        return self.wire_starts[-1]

    def span(self, b0, b1):
        return self.starts[b0], self.starts[b1]

    def wire_span(self, b0, b1):
        return self.wire_starts[b0], self.wire_starts[b1]


def lp_chunks(p, nbytes, network=None, hops=None):
    """Chunks for LP, the cost model's optimum: the allreduce's
    (cost_model.lp_allreduce_chunks: reduce and broadcast overlapped, each worker
    on one link), or with `hops` a one-way chain of that many ranks (a plain
    broadcast or reduce: p)."""
    if p <= 1:
        return 1
    net = network or DEFAULT_NETWORK
    k = (cost_model.lp_allreduce_chunks(net, p, nbytes) if hops is None
         else cost_model.optimal_chunks(net, hops, nbytes))
    return min(MAX_BLOCKS, k)


def pieces(nbytes):
    """Blocks per message so no block exceeds PIECE_BYTES."""
    return max(1, min(MAX_BLOCKS, math.ceil(nbytes / PIECE_BYTES)))


def split(numel, count):
    """`count` near-equal blocks (some empty when numel < count)."""
    return shard_sizes(numel, count)


def segmented(numel, segments, per_segment):
    """`segments` near-equal segments, each cut into `per_segment` blocks (ring's pieces)."""
    return [size for segment in shard_sizes(numel, segments)
            for size in shard_sizes(segment, per_segment)]
