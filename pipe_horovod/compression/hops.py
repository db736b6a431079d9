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

from .arithmetic import SCALE_BYTES, divide_


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
        divide_(src, scale, out=scratch).round_().clamp_(-127, 127)
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


class Int4Hop(Int8Hop):
    """Int8Hop's scheme with 4-bit values (max|x| / 7 per block), two a byte as the
    two-stage int4 format packs them (element 2k in the low nibble of byte k). The
    wire of a block is [scale (4 bytes)][ceil(n / 2) bytes, padded to 4]; packing
    runs in the caller's float scratch, so a hop allocates only its decoded nibbles."""

    QMAX = 7.0

    def __repr__(self):
        return "Int4Hop()"

    @staticmethod
    def wire_numel(numel):
        return SCALE_BYTES + -(-numel // 8) * 4

    @classmethod
    def encode(cls, src, wire, scratch, residual=None):
        low, high = torch.aminmax(src)
        scale = max(-float(low), float(high)) / cls.QMAX
        wire[:SCALE_BYTES].view(torch.float32).fill_(scale)
        packed = wire[SCALE_BYTES:SCALE_BYTES + -(-src.numel() // 2)]
        if scale == 0.0:
            packed.zero_()
            if residual is not None:
                residual.copy_(src)
            return
        divide_(src, scale, out=scratch).round_().clamp_(-cls.QMAX, cls.QMAX)
        if residual is not None:
            torch.sub(src, torch.mul(scratch, scale, out=residual), out=residual)
        # Two's complement nibbles as floats (remainder by 16 maps -7..-1 to 9..15),
        # then low + 16 * high per pair: exact in float32, written to the bytes.
        scratch.remainder_(16)
        even, odd = scratch[0::2], scratch[1::2]
        even[:odd.numel()].add_(odd, alpha=16)
        packed.copy_(even)

    @staticmethod
    def _nibbles(wire, numel):
        scale = float(wire[:SCALE_BYTES].view(torch.float32))
        data = wire[SCALE_BYTES:SCALE_BYTES + -(-numel // 2)].view(torch.int8)
        return scale, (data << 4) >> 4, (data >> 4)[:numel // 2]

    @classmethod
    def decode_add(cls, wire, dst):
        scale, low, high = cls._nibbles(wire, dst.numel())
        dst[0::2].add_(low, alpha=scale)
        dst[1::2].add_(high, alpha=scale)

    @classmethod
    def decode_into(cls, wire, dst):
        scale, low, high = cls._nibbles(wire, dst.numel())
        dst[0::2].copy_(low).mul_(scale)
        dst[1::2].copy_(high).mul_(scale)
