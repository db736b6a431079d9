"""Lightweight gradient compression applied to a bucket before it goes on the wire.

Same shape as Horovod's `Compression`: `compress(tensor) -> (wire, ctx)`,
`decompress(wire, ctx) -> tensor`. Truncation to 16 bits halves the bytes
on the wire; the reduction itself then runs in 16 bits, as in Horovod
(except bf16 on the horovod engine, which sums in float32: see BF16Compressor).
"""


class Compressor:
    name = "none"

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


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


class Compression:
    none = Compressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor

    @classmethod
    def by_name(cls, name):
        try:
            return {c.name: c for c in (cls.none, cls.fp16, cls.bf16)}[name]
        except KeyError:
            raise ValueError(f"unknown compression {name!r}; choose none, fp16 or bf16") from None


def check_compression(compression):
    if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
        raise TypeError(f"compression must provide compress() and decompress() like "
                        f"pipe_horovod.Compression.fp16, got {compression!r}")
