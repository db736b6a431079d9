"""Lightweight gradient compression applied to a bucket before it goes on the wire.

Same shape as Horovod's `Compression`: `compress(tensor) -> (wire, ctx)`,
`decompress(wire, ctx) -> tensor`. Truncation to 16 bits halves the bytes
on the wire; the reduction itself then runs in 16 bits, as in Horovod
(except bf16 on the horovod engine, which sums in float32: see BF16Compressor).

Each codec also names its per-hop form (`hop(dtype)`, compression/hops.py),
which pipe_horovod.collectives applies at every hop of its own allreduce.
int8, int4 and fp8 have no compress() of a whole tensor: a narrow sum overflows,
so they run inside the reduction, in two stages on the engine's own
alltoall and allgather (compression/two_stage.py) or per hop.
"""


from .arithmetic import DEFAULT_BLOCK_SIZE, SCALE_BYTES, accumulator, divide_  # noqa: F401


class Compressor:
    name = "none"
    error_feedback = False
    wire = None                  # a two-stage wire format: the codec runs inside the reduction

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor

    @staticmethod
    def hop(dtype):
        """The per-hop codec for gradients of `dtype`: the dtype itself on the wire."""
        from .hops import CastHop

        return CastHop(dtype)


class _Truncate(Compressor):
    """Cast floating tensors to a 16-bit type for the wire; back on arrival."""

    dtype_name = None

    @classmethod
    def compress(cls, tensor):
        if not hasattr(tensor, "is_floating_point"):   # a tf.Tensor (pipe_horovod.tensorflow)
            import tensorflow as tf

            wire_dtype, floating = getattr(tf, cls.dtype_name), tensor.dtype.is_floating
            cast = tf.cast
        else:
            import torch

            wire_dtype, floating = getattr(torch, cls.dtype_name), tensor.is_floating_point()
            cast = torch.Tensor.to
        if not floating or tensor.dtype == wire_dtype:
            return tensor, None
        return cast(tensor, wire_dtype), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        if ctx is None:
            return tensor
        if not hasattr(tensor, "is_floating_point"):
            import tensorflow as tf

            return tf.cast(tensor, ctx)
        return tensor.to(ctx)

    @classmethod
    def hop(cls, dtype):
        import torch

        from .hops import CastHop

        return CastHop(getattr(torch, cls.dtype_name))


class FP16Compressor(_Truncate):
    name = "fp16"
    dtype_name = "float16"


class BF16Compressor(_Truncate):
    """bfloat16 keeps float32's exponent range, so large gradients do not overflow.

    Horovod 0.28.1 cannot reduce bfloat16; the horovod engine still sends
    16 bits, by alltoall + allgather, and sums in float32 (see
    pipe_horovod/engine/horovod.py).
    """

    name = "bf16"
    dtype_name = "bfloat16"


class _Quantized(Compressor):
    """A codec whose reduction must sum in float32: it runs inside the reduction.

    With no `collective=`, the optimizer reduces it in two stages on the engine's
    own alltoall and allgather (compression/two_stage.py: quantize, exchange,
    sum in float32, quantize again, gather; NCCL on GPUs); with
    `collective="ring"|"lp"|...` per hop in pipe_horovod.collectives (CPU).
    `wire` names the two-stage wire format, `block_size` the elements per scale.
    """

    wire = None
    block_size = DEFAULT_BLOCK_SIZE
    per_hop = True                # False: only the two-stage path carries it
    hop_class = None              # its per-hop codec in compression/hops.py

    @classmethod
    def compress(cls, tensor):
        raise ValueError(_INSIDE_THE_REDUCTION.format(name=cls.name))

    @classmethod
    def hop(cls, dtype):
        from . import hops

        return getattr(hops, cls.hop_class)()

    @classmethod
    def with_block_size(cls, block_size):
        """This codec with `block_size` elements per float32 scale (checked here)."""
        from .two_stage import check_block_size

        check_block_size(block_size, cls.wire)
        return type(cls.__name__, (cls,), {"block_size": block_size})

    @classmethod
    def describe(cls):
        return f"{cls.name}(block_size={cls.block_size})"


class INT8Compressor(_Quantized):
    """Pipe-SGD's scalar quantization to 8 bits, one float32 scale per block.

    A quarter of float32's bytes (plus 4 bytes per block of 256 values). Per
    hop, the blocks are the collective's chunks instead.
    """

    name = "int8"
    wire = "int8"
    hop_class = "Int8Hop"


class INT8FeedbackCompressor(INT8Compressor):
    """int8 with error feedback: what quantization took from a bucket at one
    step is added to that bucket's gradient at a later step, so the applied
    updates sum to the uncompressed ones up to the last step's error."""

    name = "int8_ef"
    error_feedback = True


class INT4Compressor(_Quantized):
    """4-bit integers, one float32 scale per block (max|x| maps to 7), two values a
    byte: an eighth of float32's bytes, as ZeRO++'s qgZ averages gradients. Its
    error is nine times int8's, so it is meant with error feedback (`int4_ef`).
    Blocks hold an even number of values (a block starts on a byte)."""

    name = "int4"
    wire = "int4"
    hop_class = "Int4Hop"


class INT4FeedbackCompressor(INT4Compressor):
    name = "int4_ef"
    error_feedback = True


class _FP8(_Quantized):
    """8-bit floats with one float32 scale per block (max|x| maps to the format's
    largest value): e4m3 keeps more mantissa, e5m2 more range. Two-stage only."""

    per_hop = False

    @classmethod
    def hop(cls, dtype):
        raise ValueError(_NOT_PER_HOP.format(name=cls.name))


class FP8E4M3Compressor(_FP8):
    name = "fp8_e4m3"
    wire = "float8_e4m3fn"


class FP8E4M3FeedbackCompressor(FP8E4M3Compressor):
    name = "fp8_e4m3_ef"
    error_feedback = True


class FP8E5M2Compressor(_FP8):
    name = "fp8_e5m2"
    wire = "float8_e5m2"


class FP8E5M2FeedbackCompressor(FP8E5M2Compressor):
    name = "fp8_e5m2_ef"
    error_feedback = True


_INSIDE_THE_REDUCTION = (
    "compression {name!r} quantizes inside the reduction (an 8- or 4-bit sum would overflow), so "
    "it has no compress() of a whole tensor: use it through DistributedOptimizer (the "
    "engine's own alltoall + allgather, or collective=\"ring\"/\"lp\"), allreduce(), "
    "pipe_horovod.collectives.quantized.allreduce_async, or use fp16/bf16")
_NOT_PER_HOP = (
    "compression {name!r} runs only in the two-stage reduction on the engine's own "
    "collectives: leave collective=None, or use int8/int8_ef or int4/int4_ef per hop")


class Compression:
    none = Compressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
    int8 = INT8Compressor
    int8_ef = INT8FeedbackCompressor
    int4 = INT4Compressor
    int4_ef = INT4FeedbackCompressor
    fp8_e4m3 = FP8E4M3Compressor
    fp8_e4m3_ef = FP8E4M3FeedbackCompressor
    fp8_e5m2 = FP8E5M2Compressor
    fp8_e5m2_ef = FP8E5M2FeedbackCompressor

    @classmethod
    def by_name(cls, name):
        """The codec called `name`; "int8_ef:1024" is int8_ef with 1024 values per scale
        (what `config_name` writes for a block size other than the default)."""
        known = (cls.none, cls.fp16, cls.bf16, cls.int8, cls.int8_ef, cls.int4, cls.int4_ef,
                 cls.fp8_e4m3, cls.fp8_e4m3_ef, cls.fp8_e5m2, cls.fp8_e5m2_ef)
        base, _, block = name.partition(":")
        try:
            codec = {c.name: c for c in known}[base]
        except KeyError:
            raise ValueError(f"unknown compression {name!r}; choose one of "
                             f"{', '.join(c.name for c in known)}") from None
        if not block:
            return codec
        if not hasattr(codec, "with_block_size") or not block.isdigit():
            raise ValueError(f"compression {name!r}: only int8, int4 and fp8 codecs take a "
                             f"block size, as an int after ':' (e.g. 'int8_ef:1024')")
        return codec.with_block_size(int(block))


def wire_format(compression):
    """The two-stage WireFormat of a codec that quantizes inside the reduction, else None."""
    kind = getattr(compression, "wire", None)
    if kind is None:
        return None
    from .two_stage import WireFormat

    block_size = getattr(compression, "block_size", None)
    return WireFormat(kind, DEFAULT_BLOCK_SIZE if block_size is None else block_size)


def config_name(compression):
    """The name `Compression.by_name` turns back into `compression` (saved configs)."""
    name = compression.name
    block = getattr(compression, "block_size", None)
    default = getattr(Compression.by_name(name), "block_size", None)
    return name if block == default else f"{name}:{block}"


def describe(compression):
    """What ranks must agree on about a codec (compared at wrap time)."""
    describe_ = getattr(compression, "describe", None)
    return describe_() if callable(describe_) else getattr(compression, "name",
                                                            repr(compression))


def check_compression(compression, collective=None):
    """Refuse a codec that is not one, one this torch cannot carry (fp8 without fp8
    dtypes), a bad block size, or a two-stage-only codec given a per-hop collective."""
    if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
        raise TypeError(f"compression must provide compress() and decompress() like "
                        f"pipe_horovod.Compression.fp16, got {compression!r}")
    if getattr(compression, "wire", None) is not None:
        try:
            wire_format(compression)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"compression {getattr(compression, 'name', compression)!r}: "
                            f"{exc}") from None
        if collective is not None and not getattr(compression, "per_hop", True):
            raise ValueError(_NOT_PER_HOP.format(name=compression.name))
