"""Per-hop codecs: what one hop of a point-to-point collective carries.

Horovod's codecs compress once before a library allreduce, so the sum runs
in the narrow type: fine for 16 bits, impossible for 8-bit integers, whose
sum overflows after two ranks. Pipe-SGD instead compresses inside the
allreduce (pipe_horovod/collectives/): every hop sends narrow bytes, the
receiver decodes them, adds in the accumulator's type (float32, or float64
for float64 gradients) and encodes again for the next hop. A codec here
therefore maps an accumulator range to wire bytes and back, nothing more.

Every method writes into buffers the caller owns (the collective's
persistent wire and scratch buffers): fresh large tensors page-fault, which
cost 6-19 ms per step where it was measured.
"""
import torch

SCALE_BYTES = 4        # int8: one float32 scale in front of each block


class CastHop:
    """Truncation to a narrower float type (or no change): elementwise, so any
    range of a message decodes on its own and bytes can be forwarded in any grouping."""

    elementwise = True

    def __init__(self, wire_dtype):
        self.wire_dtype = wire_dtype

    def __repr__(self):
        return f"CastHop({self.wire_dtype})"

    def lossless(self, acc_dtype):
        return self.wire_dtype == acc_dtype

    @staticmethod
    def wire_numel(numel):
        return numel

    def encode(self, src, wire, scratch, residual=None):
        """wire <- src in the wire type; residual (if given) <- what the cast lost."""
        wire.copy_(src)
        if residual is not None:
            torch.sub(src, wire, out=residual)

    @staticmethod
    def decode_add(wire, dst):
        dst.add_(wire)

    @staticmethod
    def decode_into(wire, dst):
        dst.copy_(wire)


class Int8Hop:
    """Scalar quantization: int8 values and one float32 scale per block.

    The scale is max|x| / 127 of the block, so a block's error is at most
    half a step, max|x| / 254, and a partial sum never overflows (the next
    hop rescales). Blocks are the collective's chunks: the scale travels
    with the chunk, so a chunk decodes on arrival and can be forwarded as is.
    The wire of a block is [scale (4 bytes)][n int8, padded to 4 bytes].
    """

    elementwise = False
    wire_dtype = torch.uint8

    def __repr__(self):
        return "Int8Hop()"

    @staticmethod
    def lossless(acc_dtype):
        return False

    @staticmethod
    def wire_numel(numel):
        return SCALE_BYTES + -(-numel // 4) * 4

    @staticmethod
    def encode(src, wire, scratch, residual=None):
        low, high = torch.aminmax(src)
        scale = max(-float(low), float(high)) / 127.0
        wire[:SCALE_BYTES].view(torch.float32).fill_(scale)
        values = wire[SCALE_BYTES:SCALE_BYTES + src.numel()].view(torch.int8)
        if scale == 0.0:
            values.zero_()
            if residual is not None:
                residual.copy_(src)
            return
        torch.div(src, scale, out=scratch).round_().clamp_(-127, 127)
        values.copy_(scratch)
        if residual is not None:
            torch.sub(src, scratch.mul_(scale), out=residual)

    @staticmethod
    def _parts(wire, numel):
        scale = float(wire[:SCALE_BYTES].view(torch.float32))
        return scale, wire[SCALE_BYTES:SCALE_BYTES + numel].view(torch.int8)

    @classmethod
    def decode_add(cls, wire, dst):
        scale, values = cls._parts(wire, dst.numel())
        dst.add_(values, alpha=scale)

    @classmethod
    def decode_into(cls, wire, dst):
        scale, values = cls._parts(wire, dst.numel())
        dst.copy_(values).mul_(scale)


# Per-hop codecs as the benchmark and the planner name them: (the Compression a user
# trains with, wire bytes per float32 byte before the int8 scales).
PER_HOP = {"bf16hop": ("bf16", 0.5), "int8": ("int8_ef", 0.25)}


def wire_ratio(name):
    """Bytes on the wire per float32 gradient byte of a per-hop codec run by ring, which
    cuts messages into blocks of at most PIECE_BYTES: int8 adds one scale per block."""
    from ..collectives.layout import PIECE_BYTES

    codec, ratio = PER_HOP[name]
    return ratio + (SCALE_BYTES / PIECE_BYTES if codec.startswith("int8") else 0.0)


def measure_costs(hop, numel=1 << 18, seconds=0.02, span_bytes=32 << 20):
    """(encode, decode-add, decode) seconds per accumulator (float32) byte of `hop` on this
    machine, for blocks of `numel` elements: the collectives' codec works block by block
    (collectives/layout.py: LP's chunks, ring's pieces, BE's halves), and a block's cost
    is not proportional to its size (a fixed per-call overhead of ~10 torch calls below
    64 KB; caches: 1 MB blocks stay in L2, 16 MB ones go to memory at 2-4x the cost per
    byte). Each step runs back to back for at least `seconds`, the mean taken, on blocks
    walking through `span_bytes` of memory, so they come cold from memory as in a
    collective (a hot, repeated block measured 3-7x below the codec time inside a
    4-worker collective). Run by every worker at once (the benchmark does), it includes
    their contention for the cores. pipe_horovod.tools.planner.hop_codec_time's calibration."""
    import time

    count = max(1, span_bytes // (numel * 4))
    src = torch.randn(count * numel, generator=torch.Generator().manual_seed(0))
    dst, scratch = torch.zeros(count * numel), torch.empty(numel)
    wire_numel = hop.wire_numel(numel)
    wire = torch.empty(count * wire_numel, dtype=hop.wire_dtype)

    def block(i):
        j = i % count
        return (src[j * numel:(j + 1) * numel], dst[j * numel:(j + 1) * numel],
                wire[j * wire_numel:(j + 1) * wire_numel])

    steps = (lambda s, d, w: hop.encode(s, w, scratch), lambda s, d, w: hop.decode_add(w, d),
             lambda s, d, w: hop.decode_into(w, d))
    for i in range(count):                        # every block encoded once, pages touched
        steps[0](*block(i))
    costs = []
    for step in steps:
        calls, t0 = 0, time.perf_counter()
        while calls < 3 or time.perf_counter() - t0 < seconds:
            step(*block(calls))
            calls += 1
        costs.append((time.perf_counter() - t0) / calls / (numel * src.element_size()))
    return tuple(costs)
