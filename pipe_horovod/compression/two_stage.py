"""Quantized allreduce in two stages, on the engine's own alltoall and allgather.

An 8-bit sum overflows, and a ring that reduces in the wire's type rounds
at every hop, so the error grows with the ranks. Two stages quantize once
each instead (the reduce-scatter of ZeRO++'s qgZ, then an allgather):

1. Split the flat tensor into `size` contiguous shards, larger ones first
   (`shard_sizes`: Horovod's reducescatter rule, the same on every rank).
   Add error feedback's first residual, quantize every shard, and alltoall
   them: rank r receives every rank's shard r.
2. Dequantize the `size` copies of the own shard, each times prescale, and
   sum them in rank order in float32 (float64 for float64 tensors); divide
   by `size` for Average, times postscale; add the second residual,
   quantize again and allgather; every rank dequantizes every shard into
   the caller's tensor.

Wire formats (`WireFormat`): "int8" (per block of `block_size` elements
one float32 scale max|x| / 127, values rounded half to even and clamped
to +-127), "float8_e4m3fn" / "float8_e5m2" (the same blocks, scale
max|x| / the format's largest finite value, values cast to the 8-bit
float type), "float16" / "bfloat16" (a cast, no scale). Blocks start at
each shard's first element; a shard's wire is its scales (float32 bytes)
then its values, padded to a multiple of 4 bytes, so every part is an
aligned view of one uint8 buffer. Each rank sends and receives about
2(p-1)/p of the tensor's wire bytes, as a ring allreduce of them would.

Error feedback (`residuals=(first, second)`, tensors of the accumulator's
type on the tensor's device): `first` (the tensor's size) receives what
this rank's first quantization lost, `second` (the size of this rank's
shard, `own_shard`) what the second lost; each is added before the same
quantization of the next reduction that uses them (compression/feedback.py
decides which).

With one rank nothing is sent and nothing is quantized: the result is
postscale * prescale * tensor, and the residuals are left alone.

Every step runs on the tensor's own device. The functions here are pure
(no communication, no engine) so that a single process can run the same
math as an oracle; pipe_horovod/collectives/quantized.py chains them on the
engine (Engine.two_stage_async).
"""
import torch

from . import DEFAULT_BLOCK_SIZE, SCALE_BYTES, accumulator

MIN_BLOCK_SIZE = 16           # below, the scales cost a quarter of the bytes or more
MAX_BLOCK_SIZE = 2 ** 20

_SCALED = {"int8": 127.0}     # + the float8 formats, largest finite value from finfo
_UNSCALED = ("float16", "bfloat16")
FLOAT8 = ("float8_e4m3fn", "float8_e5m2")
FORMATS = ("int8",) + FLOAT8 + _UNSCALED


def check_block_size(block_size):
    """Refuse a block size that is not a sensible int (TypeError / ValueError)."""
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size must be an int (elements per float32 scale), got "
                        f"{block_size!r}")
    if not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be between {MIN_BLOCK_SIZE} and {MAX_BLOCK_SIZE} "
                         f"elements per scale (default {DEFAULT_BLOCK_SIZE}), got {block_size}: "
                         "smaller blocks spend a quarter of the bytes or more on scales, larger "
                         "ones let one large gradient flatten a whole block to zero")
    return block_size


def check_format(kind):
    """Refuse a wire format this torch cannot carry (ValueError)."""
    if kind not in FORMATS:
        raise ValueError(f"unknown quantized wire format {kind!r}; choose one of "
                         f"{', '.join(FORMATS)}")
    if not hasattr(torch, kind):
        raise ValueError(f"wire format {kind!r} needs torch.{kind}, which torch "
                         f"{torch.__version__} does not have (fp8 dtypes came in torch 2.1); "
                         "use int8, fp16 or bf16")
    return kind


class WireFormat:
    """How one shard travels: the element type, and for scaled types the block size."""

    def __init__(self, kind, block_size=DEFAULT_BLOCK_SIZE):
        self.kind = check_format(kind)
        self.dtype = getattr(torch, kind)
        self.scaled = kind not in _UNSCALED
        self.block_size = check_block_size(block_size) if self.scaled else None
        self.qmax = (_SCALED[kind] if kind in _SCALED
                     else float(torch.finfo(self.dtype).max) if self.scaled else None)
        self.itemsize = torch.empty((), dtype=self.dtype).element_size()

    def __repr__(self):
        return f"WireFormat({self.describe()})"

    def describe(self):
        return self.kind if not self.scaled else f"{self.kind}/{self.block_size}"

    def blocks(self, numel):
        return -(-numel // self.block_size) if self.scaled else 0

    def shard_bytes(self, numel):
        """Wire bytes of a shard of `numel` elements: scales, values, padding to 4."""
        return SCALE_BYTES * self.blocks(numel) + -(-numel * self.itemsize // 4) * 4


def shard_sizes(numel, size):
    """`size` near-equal contiguous shards, larger ones first (Horovod's split)."""
    base, extra = divmod(numel, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def own_shard(numel, size, index):
    """(start, numel) of the shard that the set's `index`-th rank reduces."""
    sizes = shard_sizes(numel, size)
    return sum(sizes[:index]), sizes[index]


def quantize(x, fmt, wire=None):
    """Quantize `x` (1-D, the accumulator's type) into `wire` (uint8, fmt.shard_bytes
    of it; allocated when None). Returns (wire, dequantized x in x's type): the
    value every receiver will decode, bit for bit."""
    n = x.numel()
    if wire is None:
        wire = torch.empty(fmt.shard_bytes(n), dtype=torch.uint8, device=x.device)
    if n == 0:
        return wire, x.clone()
    if not fmt.scaled:
        q = x.to(fmt.dtype)
        wire[:n * fmt.itemsize].view(fmt.dtype).copy_(q)
        wire[n * fmt.itemsize:].zero_()
        return wire, q.to(x.dtype)
    size, nb = fmt.block_size, fmt.blocks(n)
    # Few passes, no avoidable temporaries: this runs on the whole bucket before it can be
    # sent (9 ns a byte on CPU with one temporary per operation, 2026-11-25).
    blocks = (x.view(nb, size) if nb * size == n
              else torch.nn.functional.pad(x, (0, nb * size - n)).view(nb, size))
    amax = torch.linalg.vector_norm(blocks, float("inf"), dim=1)      # max |x|, exactly
    scale = amax.div_(fmt.qmax).to(torch.float32)
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale)).to(x.dtype)
    q = torch.div(blocks, divisor[:, None]).clamp_(-fmt.qmax, fmt.qmax)
    head = SCALE_BYTES * nb
    wire[:head].view(torch.float32).copy_(scale)
    values = wire[head:head + n].view(fmt.dtype)
    if fmt.kind == "int8":
        q.round_()                    # integers within +-127: the wire's value, exactly
        values.copy_(q.view(-1)[:n])
    else:
        q8 = q.to(fmt.dtype)
        values.copy_(q8.view(-1)[:n])
        q.copy_(q8)                   # what the receivers decode
    wire[head + n:].zero_()
    return wire, q.mul_(scale.to(x.dtype)[:, None]).view(-1)[:n]


def dequantize(wire, numel, fmt, acc):
    """The values of one shard's wire (`numel` elements), in type `acc`."""
    if numel == 0:
        return torch.zeros(0, dtype=acc, device=wire.device)
    if not fmt.scaled:
        return wire[:numel * fmt.itemsize].view(fmt.dtype).to(acc)
    size, nb = fmt.block_size, fmt.blocks(numel)
    head = SCALE_BYTES * nb
    scale = wire[:head].view(torch.float32).to(acc)
    values = wire[head:head + numel].view(fmt.dtype).to(acc)
    if nb * size != numel:
        values = torch.nn.functional.pad(values, (0, nb * size - numel))
    return values.view(nb, size).mul_(scale[:, None]).view(-1)[:numel]


def encode(x, sizes, fmt):
    """Stage 1 on one rank: every shard of `x` quantized into one send buffer.
    Returns (send bytes, bytes per destination, dequantized x)."""
    splits = [fmt.shard_bytes(s) for s in sizes]
    send = torch.empty(sum(splits), dtype=torch.uint8, device=x.device)
    decoded = torch.empty_like(x)
    at = pos = 0
    for numel, nbytes in zip(sizes, splits):
        _, back = quantize(x[pos:pos + numel], fmt, send[at:at + nbytes])
        decoded[pos:pos + numel] = back
        at, pos = at + nbytes, pos + numel
    return send, splits, decoded


def reduce_shard(received, size, numel, fmt, acc, average, prescale=1.0, postscale=1.0,
                 residual=None):
    """Stage 2 on one rank: the `size` copies of its shard (`numel` elements each,
    concatenated in rank order) summed and requantized. `residual` (this shard's
    range of the second residual, or None) is added before the quantization and
    then holds what it lost. Returns the wire to allgather."""
    nbytes = fmt.shard_bytes(numel)
    total = None
    for r in range(size):             # rank order: the same result on every rank, every run
        value = dequantize(received[r * nbytes:(r + 1) * nbytes], numel, fmt, acc)
        if prescale != 1:
            value = value * prescale
        total = value if total is None else total.add_(value)    # value: a new tensor
    if average:
        total.div_(size)
    if postscale != 1:
        total.mul_(postscale)
    if residual is not None:
        total.add_(residual)
    wire, back = quantize(total, fmt)
    if residual is not None:
        torch.sub(total, back, out=residual)
    return wire


def decode(gathered, sizes, fmt, out):
    """Every rank's reduced shard (concatenated in rank order) into `out` (1-D)."""
    acc = accumulator(out.dtype)
    at = pos = 0
    for numel in sizes:
        nbytes = fmt.shard_bytes(numel)
        out[pos:pos + numel] = dequantize(gathered[at:at + nbytes], numel, fmt, acc)
        at, pos = at + nbytes, pos + numel
    return out


def first_stage(flat, sizes, fmt, residual=None):
    """`flat` in the accumulator's type plus `residual`, encoded (see `encode`); the
    residual then holds what the quantization lost."""
    x = flat.to(accumulator(flat.dtype), copy=True)
    if residual is None:
        send, splits, _ = encode(x, sizes, fmt)
        return send, splits
    x.add_(residual)
    splits = [fmt.shard_bytes(s) for s in sizes]
    send = torch.empty(sum(splits), dtype=torch.uint8, device=x.device)
    at = pos = 0
    for numel, nbytes in zip(sizes, splits):    # encode's loop, the loss written directly
        shard = x[pos:pos + numel]
        _, back = quantize(shard, fmt, send[at:at + nbytes])
        torch.sub(shard, back, out=residual[pos:pos + numel])
        at, pos = at + nbytes, pos + numel
    return send, splits


def wire_ratio(fmt, dtype=torch.float32, numel=2 ** 20):
    """Bytes on the wire per byte of `dtype` (for reports)."""
    return fmt.shard_bytes(numel) / (numel * torch.empty((), dtype=dtype).element_size())


__all__ = ["DEFAULT_BLOCK_SIZE", "FORMATS", "WireFormat", "check_block_size", "check_format", "decode", "dequantize", "encode", "first_stage",
           "own_shard", "quantize", "reduce_shard", "shard_sizes"]
