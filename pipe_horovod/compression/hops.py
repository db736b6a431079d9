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

The quantized codecs run in two forms with the same bits. On CPU (the reference)
the scale is read into a Python number, as the first form was written. On any other
device that read is a host sync, two per encode: the GPU kit measured the int8
encode of a 4 MiB chunk at 2.4-22 GB/s on an H100, against about 100 GB/s for the
two-stage formats' whole-tensor operations. There (the device form) the scale stays
a 0-dim tensor on the device and every step is one whole-tensor operation, in the
reference's order with the reference's roundings, so encode and decode_into never
wait for the GPU (decode_add reads its scale: Int8Hop.decode_add says why).
`DEVICE_FORM_ON_CPU` runs the device form on CPU tensors too: the tests hold its bits
to the reference's there, so CUDA's arithmetic is checked without a GPU.
"""
import math

import torch

from .arithmetic import SCALE_BYTES, divide_

DEVICE_FORM_ON_CPU = False    # tests: the device form's operations on CPU tensors


def device_form(tensor):
    """Whether the codecs take the sync-free device form for `tensor`."""
    return tensor.device.type != "cpu" or DEVICE_FORM_ON_CPU


_constants = {}


def _constant(value, like):
    """A cached tensor of `value` (a number: 0-dim; a tuple: 1-dim) in `like`'s dtype on
    its device: a Python number would be converted on every call (a fill kernel), and
    CUDA divides by a number as a product with its reciprocal (see divide_)."""
    key = (repr(value), like.dtype, like.device)      # repr: 0.0 and -0.0 are equal keys
    tensor = _constants.get(key)
    if tensor is None:
        tensor = _constants[key] = torch.tensor(value, dtype=like.dtype, device=like.device)
    return tensor


def _device_scale(src, qmax, wire):
    """The device form of the reference's scale arithmetic, without leaving the device:
    writes the wire's float32 scale and returns (divisor, multiplier), 0-dim tensors of
    src's dtype, for src / divisor and the residual's q * multiplier. Seven small
    kernels: on CUDA each costs a launch, so none is spent on what a view can do.

    The reference takes max(-low, high) in Python (-low on a tie, so -0.0 for a block of
    +0.0, and NaN when low is NaN), divides it by qmax in float64 and rounds that to the
    wire's float32 and to src's dtype. For float32 the float32 quotient is the same
    number (a float64 quotient of float32 operands rounds to float32 as the direct
    float32 quotient does: 53 >= 2 * 24 + 2 bits). Where the reference's float64 scale
    is 0 (float32: max|x| == 0) it writes zero values and residual = src: here the
    divisor is -inf, so q is -0.0 for +0.0 and +0.0 for -0.0, and the multiplier +0.0,
    so src - q * multiplier is src to the sign of its zeros; the values cast to 0."""
    low, high = torch.aminmax(src)
    neg = low.neg()
    amax = torch.where(high > neg, high, neg)
    wire_scale = wire[:SCALE_BYTES].view(torch.float32)[0]
    if src.dtype == torch.float32:        # the wire's scale is the divisor's
        scale = torch.div(amax, _constant(qmax, src), out=wire_scale)
        zero = amax == 0
    else:
        scale = torch.div(amax, _constant(qmax, src))
        wire_scale.copy_(scale)
        zero = scale == 0
    pair = torch.where(zero, _constant((-math.inf, 0.0), src), scale)
    return pair[0], pair[1]


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
        values = wire[SCALE_BYTES:SCALE_BYTES + src.numel()].view(torch.int8)
        if device_form(src):
            divisor, multiplier = _device_scale(src, 127.0, wire)
            torch.div(src, divisor, out=scratch).round_().clamp_(-127, 127)
            values.copy_(scratch)
            if residual is not None:
                torch.sub(src, scratch.mul_(multiplier), out=residual)
            return
        low, high = torch.aminmax(src)
        scale = max(-float(low), float(high)) / 127.0
        wire[:SCALE_BYTES].view(torch.float32).fill_(scale)
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
        # Both forms read the scale into a number: dst + values * scale is one fused
        # multiply-add on CUDA and in the CPU's vector loop (add with alpha), and no
        # torch operation fuses a product with a scale that stays on the device
        # (addcmul's CUDA kernel rounds the product first, its CPU loop fuses).
        scale, values = cls._parts(wire, dst.numel())
        dst.add_(values, alpha=scale)

    @classmethod
    def decode_into(cls, wire, dst):
        if device_form(dst):              # values * scale, rounded once, as the reference
            dst.copy_(wire[SCALE_BYTES:SCALE_BYTES + dst.numel()].view(torch.int8))
            dst.mul_(wire[:SCALE_BYTES].view(torch.float32))
            return
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
        packed = wire[SCALE_BYTES:SCALE_BYTES + -(-src.numel() // 2)]
        if device_form(src):
            divisor, multiplier = _device_scale(src, cls.QMAX, wire)
            torch.div(src, divisor, out=scratch).round_().clamp_(-cls.QMAX, cls.QMAX)
            if residual is not None:
                torch.sub(src, torch.mul(scratch, multiplier, out=residual), out=residual)
            cls._pack(scratch, packed)
            return
        low, high = torch.aminmax(src)
        scale = max(-float(low), float(high)) / cls.QMAX
        wire[:SCALE_BYTES].view(torch.float32).fill_(scale)
        if scale == 0.0:
            packed.zero_()
            if residual is not None:
                residual.copy_(src)
            return
        divide_(src, scale, out=scratch).round_().clamp_(-cls.QMAX, cls.QMAX)
        if residual is not None:
            torch.sub(src, torch.mul(scratch, scale, out=residual), out=residual)
        cls._pack(scratch, packed)

    @staticmethod
    def _pack(scratch, packed):
        """The integers in `scratch` (overwritten) two a byte into `packed`."""
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

    @staticmethod
    def _unpacked(wire, numel):
        """The device form's values, in element order: both nibbles of every byte in two
        kernels, [(b << 4) >> 4, (b << 0) >> 4], where the CPU form takes three and two
        strided passes over dst."""
        data = wire[SCALE_BYTES:SCALE_BYTES + -(-numel // 2)].view(torch.int8)
        return ((data[:, None] << _constant((4, 0), data)) >> 4).view(-1)[:numel]

    @classmethod
    def decode_add(cls, wire, dst):
        if device_form(dst):              # the scale read as Int8Hop.decode_add says
            scale = float(wire[:SCALE_BYTES].view(torch.float32))
            dst.add_(cls._unpacked(wire, dst.numel()), alpha=scale)
            return
        scale, low, high = cls._nibbles(wire, dst.numel())
        dst[0::2].add_(low, alpha=scale)
        dst[1::2].add_(high, alpha=scale)

    @classmethod
    def decode_into(cls, wire, dst):
        if device_form(dst):              # values * scale, rounded once, as the reference
            dst.copy_(cls._unpacked(wire, dst.numel()))
            dst.mul_(wire[:SCALE_BYTES].view(torch.float32))
            return
        scale, low, high = cls._nibbles(wire, dst.numel())
        dst[0::2].copy_(low).mul_(scale)
        dst[1::2].copy_(high).mul_(scale)
