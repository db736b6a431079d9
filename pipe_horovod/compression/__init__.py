"""Lightweight gradient compression applied to a bucket before it goes on the wire.

Same shape as Horovod's `Compression`: `compress(tensor) -> (wire, ctx)`,
`decompress(wire, ctx) -> tensor`. Truncation to 16 bits halves the bytes
on the wire; the reduction itself then runs in 16 bits, as in Horovod
(except bf16 on the horovod engine, which sums in float32: see BF16Compressor).

Each codec also names its per-hop form (`hop(dtype)`, compression/hops.py),
which pipe_horovod.collectives applies at every hop of its own allreduce.
int8 exists only in that form: an 8-bit sum overflows, so no library
allreduce can carry it.
"""


class Compressor:
    name = "none"
    error_feedback = False
    needs_collective = False     # True: only a per-hop collective can carry it

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
        import torch

        wire_dtype = getattr(torch, cls.dtype_name)
        if not tensor.is_floating_point() or tensor.dtype == wire_dtype:
            return tensor, None
        return tensor.to(wire_dtype), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)

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


class INT8Compressor(Compressor):
    """Pipe-SGD's scalar quantization to 8 bits, one float32 scale per chunk.

    A quarter of float32's bytes, but only inside a per-hop collective
    (`collective="ring"` or `"lp"`), which adds in float32 at every hop.
    """

    name = "int8"
    needs_collective = True

    @classmethod
    def compress(cls, tensor):
        raise ValueError(_NEEDS_COLLECTIVE.format(name=cls.name))

    @staticmethod
    def hop(dtype):
        from .hops import Int8Hop

        return Int8Hop()


class INT8FeedbackCompressor(INT8Compressor):
    """int8 with error feedback: what quantization took from a bucket at one
    step is added to that bucket's gradient at a later step, so the applied
    updates sum to the uncompressed ones up to the last step's error."""

    name = "int8_ef"
    error_feedback = True


_NEEDS_COLLECTIVE = (
    "compression {name!r} needs a collective that adds at every hop: an 8-bit sum in the "
    "engine's own allreduce would overflow. Pass collective=\"ring\" or collective=\"lp\" "
    "(pipe_horovod.collectives), or use fp16/bf16")


class Compression:
    none = Compressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
    int8 = INT8Compressor
    int8_ef = INT8FeedbackCompressor

    @classmethod
    def by_name(cls, name):
        known = (cls.none, cls.fp16, cls.bf16, cls.int8, cls.int8_ef)
        try:
            return {c.name: c for c in known}[name]
        except KeyError:
            raise ValueError(f"unknown compression {name!r}; choose one of "
                             f"{', '.join(c.name for c in known)}") from None


def check_compression(compression, collective=None):
    """Refuse a codec that is not one, or int8 where no collective adds per hop."""
    if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
        raise TypeError(f"compression must provide compress() and decompress() like "
                        f"pipe_horovod.Compression.fp16, got {compression!r}")
    if collective is None and getattr(compression, "needs_collective", False):
        raise ValueError(_NEEDS_COLLECTIVE.format(name=compression.name))
