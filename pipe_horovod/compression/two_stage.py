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
to +-127), "int4" (the same with max|x| / 7 and +-7, two values a byte: the
even element in the low four bits, the odd one in the high four, two's
complement; blocks of an even size, so a block starts on a byte),
"float8_e4m3fn" / "float8_e5m2" (the same blocks, scale
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

On CPU, int8 and float8 with float32/float64 accumulators run in C kernels
(compression/native.py, cpu_kernels.c): one pass per stage instead of one per
torch operation, 10-20x less CPU (docs/compression.md), the same bits (tests/test_native_codec.py
compares them with the torch operations kept here as `_quantize_torch`,
`_dequantize_torch`, `_reduce_torch`, which also serve CUDA tensors, the other
formats, and any machine without a C compiler).
"""
import logging

import torch

from . import native
from .arithmetic import DEFAULT_BLOCK_SIZE, SCALE_BYTES, accumulator, divide_

MIN_BLOCK_SIZE = 16           # below, the scales cost a quarter of the bytes or more
MAX_BLOCK_SIZE = 2 ** 20

_SCALED = {"int8": 127.0, "int4": 7.0}   # + float8's: largest finite value from finfo
_PACKED = ("int4",)           # two values a byte
_UNSCALED = ("float16", "bfloat16")
FLOAT8 = ("float8_e4m3fn", "float8_e5m2")
FORMATS = ("int8", "int4") + FLOAT8 + _UNSCALED


def check_block_size(block_size, kind=None):
    """Refuse a block size that is not a sensible int (TypeError / ValueError), or, for
    a packed format (`kind` "int4"), an odd one."""
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size must be an int (elements per float32 scale), got "
                        f"{block_size!r}")
    if not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be between {MIN_BLOCK_SIZE} and {MAX_BLOCK_SIZE} "
                         f"elements per scale (default {DEFAULT_BLOCK_SIZE}), got {block_size}: "
                         "smaller blocks spend a quarter of the bytes or more on scales, larger "
                         "ones let one large gradient flatten a whole block to zero")
    if kind in _PACKED and block_size % 2:
        raise ValueError(f"{kind} packs two values a byte, so a block (which starts on a "
                         f"byte) holds an even number of them: block_size must be even, got "
                         f"{block_size}")
    return block_size


def check_format(kind):
    """Refuse a wire format this torch cannot carry (ValueError)."""
    if kind not in FORMATS:
        raise ValueError(f"unknown quantized wire format {kind!r}; choose one of "
                         f"{', '.join(FORMATS)}")
    if kind not in _PACKED and not hasattr(torch, kind):
        raise ValueError(f"wire format {kind!r} needs torch.{kind}, which torch "
                         f"{torch.__version__} does not have (fp8 dtypes came in torch 2.1); "
                         "use int8, fp16 or bf16")
    return kind


class WireFormat:
    """How one shard travels: the element type, and for scaled types the block size."""

    def __init__(self, kind, block_size=DEFAULT_BLOCK_SIZE):
        self.kind = check_format(kind)
        self.packed = kind in _PACKED
        # the values' element type (int4: the int8 each value is computed in)
        self.dtype = torch.int8 if self.packed else getattr(torch, kind)
        self.scaled = kind not in _UNSCALED
        self.block_size = check_block_size(block_size, kind) if self.scaled else None
        self.qmax = (_SCALED[kind] if kind in _SCALED
                     else float(torch.finfo(self.dtype).max) if self.scaled else None)
        self.itemsize = torch.empty((), dtype=self.dtype).element_size()

    def __repr__(self):
        return f"WireFormat({self.describe()})"

    def describe(self):
        return self.kind if not self.scaled else f"{self.kind}/{self.block_size}"

    def blocks(self, numel):
        return -(-numel // self.block_size) if self.scaled else 0

    def value_bytes(self, numel):
        """Bytes of `numel` values, unpadded (int4: two a byte, the last half-filled)."""
        return -(-numel // 2) if self.packed else numel * self.itemsize

    def shard_bytes(self, numel):
        """Wire bytes of a shard of `numel` elements: scales, values, padding to 4."""
        return SCALE_BYTES * self.blocks(numel) + -(-self.value_bytes(numel) // 4) * 4


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
    kernels = _kernels(fmt, x, wire)
    if kernels and n:
        back = torch.empty_like(x)
        head = SCALE_BYTES * fmt.blocks(n)
        if kernels.encode(x.data_ptr(), None, back.data_ptr(), n, fmt.block_size,
                          wire.data_ptr(), wire.data_ptr() + head) == fmt.blocks(n):
            wire[head + fmt.value_bytes(n):].zero_()
            return wire, back
    return _quantize_torch(x, fmt, wire)       # also for a block that is not finite


def _quantize_torch(x, fmt, wire=None):
    """`quantize` in torch operations: the reference, and the path for CUDA tensors
    and every format and type the C kernels do not cover."""
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
    scale = divide_(amax, fmt.qmax).to(torch.float32)
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale)).to(x.dtype)
    q = torch.div(blocks, divisor[:, None]).clamp_(-fmt.qmax, fmt.qmax)
    head = SCALE_BYTES * nb
    wire[:head].view(torch.float32).copy_(scale)
    values = wire[head:head + fmt.value_bytes(n)]
    if fmt.packed:
        q.round_()                    # integers within +-7
        values.copy_(pack_int4(q.view(-1)[:n]))
    elif fmt.kind == "int8":
        q.round_()                    # integers within +-127: the wire's value, exactly
        values.view(fmt.dtype).copy_(q.view(-1)[:n])
    else:
        q8 = q.to(fmt.dtype)
        values.view(fmt.dtype).copy_(q8.view(-1)[:n])
        q.copy_(q8)                   # what the receivers decode
    wire[head + fmt.value_bytes(n):].zero_()
    return wire, q.mul_(scale.to(x.dtype)[:, None]).view(-1)[:n]


def pack_int4(q):
    """Integers in [-7, 7] (any float or int type), two a byte: element 2k in the low
    four bits of byte k, 2k+1 in the high four, two's complement; an odd count's last
    byte has zero high bits."""
    q = q.to(torch.int8)
    if q.numel() % 2:
        q = torch.nn.functional.pad(q, (0, 1))
    pairs = q.view(-1, 2)
    return ((pairs[:, 0] & 0x0F) | (pairs[:, 1] << 4)).view(torch.uint8)


def unpack_int4(data, numel):
    """The `numel` int8 values `pack_int4` wrote into the uint8 `data`."""
    b = data.view(torch.int8)
    low = ((b << 4) >> 4)             # arithmetic shifts: the sign comes back
    high = b >> 4
    return torch.stack((low, high), dim=1).view(-1)[:numel]


def dequantize(wire, numel, fmt, acc):
    """The values of one shard's wire (`numel` elements), in type `acc`."""
    kernels = _kernels(fmt, wire, dtype=acc)
    if kernels and numel:
        out = torch.empty(numel, dtype=acc)
        if kernels.decode(wire.data_ptr(), wire.data_ptr() + SCALE_BYTES * fmt.blocks(numel),
                          numel, fmt.block_size, out.data_ptr()) == fmt.blocks(numel):
            return out
    return _dequantize_torch(wire, numel, fmt, acc)


def _dequantize_torch(wire, numel, fmt, acc):
    """`dequantize` in torch operations (see `_quantize_torch`)."""
    if numel == 0:
        return torch.zeros(0, dtype=acc, device=wire.device)
    if not fmt.scaled:
        return wire[:numel * fmt.itemsize].view(fmt.dtype).to(acc)
    size, nb = fmt.block_size, fmt.blocks(numel)
    head = SCALE_BYTES * nb
    scale = wire[:head].view(torch.float32).to(acc)
    raw = wire[head:head + fmt.value_bytes(numel)]
    values = (unpack_int4(raw, numel) if fmt.packed else raw.view(fmt.dtype)).to(acc)
    if nb * size != numel:
        values = torch.nn.functional.pad(values, (0, nb * size - numel))
    return values.view(nb, size).mul_(scale[:, None]).view(-1)[:numel]


def reduce_shard(received, size, numel, fmt, acc, average, prescale=1.0, postscale=1.0,
                 residual=None):
    """Stage 2 on one rank: the `size` copies of its shard (`numel` elements each,
    concatenated in rank order) summed and requantized. `residual` (this shard's
    range of the second residual, or None) is added before the quantization and
    then holds what it lost. Returns the wire to allgather."""
    kernels = _kernels(fmt, received, residual, dtype=acc)
    if (kernels and numel and isinstance(prescale, (int, float))
            and isinstance(postscale, (int, float))):
        wire = torch.empty(fmt.shard_bytes(numel), dtype=torch.uint8)
        head, nb = SCALE_BYTES * fmt.blocks(numel), fmt.blocks(numel)
        done = kernels.reduce(received.data_ptr(), fmt.shard_bytes(numel), size, numel,
                              fmt.block_size, float(prescale), prescale != 1, bool(average),
                              float(postscale), postscale != 1,
                              None if residual is None else residual.data_ptr(),
                              wire.data_ptr(), wire.data_ptr() + head)
        if done == nb:
            wire[head + fmt.value_bytes(numel):].zero_()
            return wire
        if done >= 0:                 # blocks from `done` on are not finite: torch's way
            rest = _reduce_torch(received, size, numel, fmt, acc, average, prescale,
                                 postscale, residual, done * fmt.block_size)
            return _splice(wire, rest, fmt, numel, done)
    return _reduce_torch(received, size, numel, fmt, acc, average, prescale, postscale,
                         residual)


def _reduce_torch(received, size, numel, fmt, acc, average, prescale=1.0, postscale=1.0,
                  residual=None, start=0):
    """`reduce_shard` in torch operations, of the elements from `start` on (a block
    boundary): the wire of those blocks alone."""
    nbytes = fmt.shard_bytes(numel)
    total = None
    for r in range(size):             # rank order: the same result on every rank, every run
        value = _dequantize_torch(received[r * nbytes:(r + 1) * nbytes], numel, fmt,
                                  acc)[start:]
        if prescale != 1:
            value = value * prescale
        total = value if total is None else total.add_(value)    # value: a new tensor
    if average:
        divide_(total, size)
    if postscale != 1:
        total.mul_(postscale)
    if residual is not None:
        total.add_(residual[start:])
    wire, back = _quantize_torch(total, fmt)
    if residual is not None:
        torch.sub(total, back, out=residual[start:])
    return wire


def _splice(wire, part, fmt, numel, first):
    """`part`, the wire of a shard's blocks from `first` on, into the shard's `wire`."""
    nb, start = fmt.blocks(numel), first * fmt.block_size
    head, part_head = SCALE_BYTES * nb, SCALE_BYTES * (nb - first)
    wire[SCALE_BYTES * first:head] = part[:part_head]
    at, end = fmt.value_bytes(start), fmt.value_bytes(numel)     # start: on a byte
    wire[head + at:head + end] = part[part_head:part_head + end - at]
    wire[head + end:].zero_()
    return wire


def decode(gathered, sizes, fmt, out):
    """Every rank's reduced shard (concatenated in rank order) into `out` (1-D)."""
    acc = accumulator(out.dtype)
    kernels = _kernels(fmt, gathered, out, dtype=acc) if out.dtype == acc else None
    at = pos = 0
    for numel in sizes:
        nbytes = fmt.shard_bytes(numel)
        if not (kernels and numel and kernels.decode(
                gathered.data_ptr() + at, gathered.data_ptr() + at + SCALE_BYTES *
                fmt.blocks(numel), numel, fmt.block_size,
                out.data_ptr() + pos * out.element_size()) == fmt.blocks(numel)):
            out[pos:pos + numel] = dequantize(gathered[at:at + nbytes], numel, fmt, acc)
        at, pos = at + nbytes, pos + numel
    return out


def first_stage(flat, sizes, fmt, residual=None, out=None):
    """Stage 1 on one rank: `flat` in the accumulator's type plus `residual`, every shard
    (`sizes`) quantized into `out` (uint8, the wire's bytes; allocated when None); the
    residual then holds what the quantization lost. Returns (send bytes, bytes per
    destination)."""
    acc = accumulator(flat.dtype)
    kernels = _kernels(fmt, residual, dtype=acc) if flat.device.type == "cpu" else None
    if kernels:
        return _first_stage_native(kernels, flat.to(acc).contiguous(), sizes, fmt, residual,
                                   out)
    x = flat.to(acc, copy=True)
    if residual is not None:
        x.add_(residual)
    splits = [fmt.shard_bytes(s) for s in sizes]
    send = (torch.empty(sum(splits), dtype=torch.uint8, device=x.device) if out is None
            else out)
    at = pos = 0
    for numel, nbytes in zip(sizes, splits):    # encode's loop, the loss written directly
        shard = x[pos:pos + numel]
        _, back = quantize(shard, fmt, send[at:at + nbytes])
        if residual is not None:
            torch.sub(shard, back, out=residual[pos:pos + numel])
        at, pos = at + nbytes, pos + numel
    return send, splits


def _first_stage_native(kernels, x, sizes, fmt, residual, out=None):
    """`first_stage` in one pass per shard (x: flat in the accumulator's type, not
    changed); a shard's blocks from the first that is not finite on in torch."""
    splits = [fmt.shard_bytes(s) for s in sizes]
    send = torch.empty(sum(splits), dtype=torch.uint8) if out is None else out
    size, item = fmt.block_size, x.element_size()
    at = pos = 0
    for numel, nbytes in zip(sizes, splits):
        nb, wire = fmt.blocks(numel), send[at:at + nbytes]
        head = SCALE_BYTES * nb
        done = kernels.encode(x.data_ptr() + pos * item,
                              None if residual is None else residual.data_ptr() + pos * item,
                              None, numel, size, wire.data_ptr(), wire.data_ptr() + head)
        if done == nb:
            wire[head + fmt.value_bytes(numel):].zero_()
        else:
            rest = x[pos + done * size:pos + numel]
            if residual is not None:
                rest = rest + residual[pos + done * size:pos + numel]
            part, back = _quantize_torch(rest, fmt)
            _splice(wire, part, fmt, numel, done)
            if residual is not None:
                torch.sub(rest, back, out=residual[pos + done * size:pos + numel])
        at, pos = at + nbytes, pos + numel
    return send, splits


_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
_BITS = {torch.float32: torch.int32, torch.float64: torch.int64}
_log = logging.getLogger(__name__)
_checked = {}


class _Kernels:
    """The C functions for one accumulator type and one wire format, the format's
    arguments (kind, qmax, the float8 table) bound."""

    KINDS = {"int8": 0, "float8_e4m3fn": 1, "float8_e5m2": 2, "int4": 3}

    def __init__(self, lib, suffix, fmt):
        kind = self.KINDS[fmt.kind]
        # float8: torch's own decoding of the 256 bytes, so the C side needs no copy of it
        self.table = (None if kind in (0, 3) else
                      torch.arange(256, dtype=torch.uint8).view(fmt.dtype).to(torch.float32))
        table = None if self.table is None else self.table.data_ptr()
        encode = getattr(lib, f"phv_encode_{suffix}")
        decode = getattr(lib, f"phv_decode_{suffix}")
        reduce = getattr(lib, f"phv_reduce_{suffix}")
        self.encode = lambda *a: encode(*a, kind, fmt.qmax, table)
        self.decode = lambda *a: decode(*a, kind, table)
        self.reduce = lambda *a: reduce(*a, kind, fmt.qmax, table)


def _kernels(fmt, *tensors, dtype=None):
    """The native kernels (compression/native.py) when they cover this call: int8 or
    float8, float32 or float64 (`dtype`, else the first tensor's), every tensor given a
    contiguous CPU one; else None and the torch operations run."""
    dtype = dtype or tensors[0].dtype
    if fmt.kind not in _Kernels.KINDS or dtype not in _SUFFIX:
        return None
    for t in tensors:
        if t is not None and (t.device.type != "cpu" or not t.is_contiguous()
                              or (t.dtype != torch.uint8 and t.dtype != dtype)):
            return None
    lib = native.library()
    if lib is None:
        return None
    key = (id(lib), fmt.kind, dtype)
    if key not in _checked:
        _checked[key] = _self_check(lib, fmt.kind, dtype)
    return _checked[key]


def _self_check(lib, kind, dtype):
    """The kernels for `kind` and `dtype` if they give torch's bits on a small sample
    (ties, zeros, -0, a partial block), else None: a safeguard against a compiler that
    does not keep IEEE semantics. A mismatch is logged and the torch form runs."""
    fmt = WireFormat(kind, 32)
    kernels = _Kernels(lib, _SUFFIX[dtype], fmt)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0), dtype=dtype)
    x[:32] = torch.arange(-16, 16, dtype=dtype) / 2 * fmt.qmax / 8    # ties of .5 for int8
    x[32:64], x[64], x[65] = 0.0, -0.0, -1e-30
    x[100:132] *= torch.exp2(torch.arange(-16, 16, dtype=dtype))
    wire = torch.empty(fmt.shard_bytes(1000), dtype=torch.uint8)
    back = torch.empty_like(x)
    head = SCALE_BYTES * fmt.blocks(1000)
    kernels.encode(x.data_ptr(), None, back.data_ptr(), 1000, 32, wire.data_ptr(),
                   wire.data_ptr() + head)
    wire[head + fmt.value_bytes(1000):].zero_()
    ref_wire, ref_back = _quantize_torch(x, fmt)
    if torch.equal(wire, ref_wire) and same_bits(back, ref_back.contiguous()):
        return kernels
    _log.warning("pipe_horovod: the native %s codec's %s results differ from torch's on "
                 "this machine; using the torch implementation", kind, dtype)
    return None


def same_bits(a, b):
    """Whether two float32/float64 tensors hold the same bits (NaN payloads and -0 too)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(_BITS[a.dtype]), b.contiguous().view(_BITS[b.dtype]))


def wire_ratio(fmt, dtype=torch.float32, numel=2 ** 20):
    """Bytes on the wire per byte of `dtype` (for reports)."""
    return fmt.shard_bytes(numel) / (numel * torch.empty((), dtype=dtype).element_size())


# --- chunks: the two stages pipelined ----------------------------------------------------
# A large reduction runs as `count` independent two-stage reductions, so that one chunk's
# alltoall or allgather (the wire) overlaps the next chunk's quantization and the previous
# one's reduction (the CPU). Chunk c holds the c-th part of every rank's shard (not a
# contiguous c-th of the tensor): each rank's own part over all chunks is still its whole
# shard (`own_shard`), so the second residual keeps its layout, and the parts split the
# shards at multiples of the block size, so every block, scale and rounding is the one the
# unchunked reduction has: the result is the same bits for any chunk count.

# Measured on the emulated 1 Gbit links (docs/compression.md, "Pipelined in chunks"): 16
# chunks beat 4 and 8 at 64 MB; 32 were no faster with 2 workers, slower with 4 on 2 cores
# and on Horovod; chunks of 512 Ki elements beat 1 Mi at 16 MB.
CHUNK_NUMEL = 2 ** 19    # elements per chunk at least (2 MiB of float32); read at each call
MAX_CHUNKS = 16          # every chunk costs two collectives more (their latency, negotiation)


def chunk_count(numel, size, fmt, min_numel=None):
    """How many chunks a reduction of `numel` elements on `size` ranks runs in: one
    per `min_numel` (default CHUNK_NUMEL) elements, at most MAX_CHUNKS and at most the
    smallest shard's blocks; 1 for one rank or a tensor below twice `min_numel`."""
    min_numel = CHUNK_NUMEL if min_numel is None else min_numel
    if size < 2 or numel < 2 * min_numel:
        return 1
    unit = fmt.block_size if fmt.scaled else DEFAULT_BLOCK_SIZE
    smallest = -(-shard_sizes(numel, size)[-1] // unit)
    return max(1, min(MAX_CHUNKS, numel // min_numel, smallest))


def chunks(numel, size, fmt, min_numel=None):
    """The one rule for the chunk boundaries (the engine path and the tests' reference):
    a list with one entry per chunk, each a list of `size` (start, numel) ranges of the
    flat tensor, range r being what the set's r-th rank reduces in that chunk. Shard r
    (`shard_sizes`) is split into `count` consecutive parts of whole blocks (of the
    format's block size; DEFAULT_BLOCK_SIZE elements for fp16/bf16), larger parts first,
    the shard's last, partial block in its last part."""
    count = chunk_count(numel, size, fmt, min_numel)
    unit = fmt.block_size if fmt.scaled else DEFAULT_BLOCK_SIZE
    out = [[] for _ in range(count)]
    start = 0
    for shard in shard_sizes(numel, size):
        at = 0
        for c, blocks in enumerate(shard_sizes(-(-shard // unit), count)):
            n = max(0, min(blocks * unit, shard - at))
            out[c].append((start + at, n))
            at += n
        start += shard
    return out


def first_stage_chunk(flat, ranges, fmt, residual=None, out=None):
    """Stage 1 of one chunk (`ranges`: one entry of `chunks`): `first_stage` of each range
    of `flat` (with the first residual's same range, which then holds what was lost),
    for its rank, in one send buffer (`out`, uint8 of the chunk's wire bytes, or a new
    one). Returns (send bytes, bytes per destination)."""
    if len(ranges) == 1 or all(a + n == b for (a, n), (b, _) in zip(ranges, ranges[1:])):
        start, end = ranges[0][0], ranges[-1][0] + ranges[-1][1]     # one chunk: the shards
        return first_stage(flat[start:end], [n for _, n in ranges], fmt,
                           None if residual is None else residual[start:end], out)
    splits = [fmt.shard_bytes(n) for _, n in ranges]
    send = torch.empty(sum(splits), dtype=torch.uint8, device=flat.device) if out is None else out
    at = 0
    for (a, n), nbytes in zip(ranges, splits):
        first_stage(flat[a:a + n], [n], fmt, None if residual is None else residual[a:a + n],
                    send[at:at + nbytes])
        at += nbytes
    return send, splits


def decode_chunk(gathered, ranges, fmt, out):
    """Every rank's reduced part of one chunk (concatenated in rank order) into its
    ranges of `out` (the flat tensor), by `decode`."""
    at = 0
    for start, n in ranges:
        nbytes = fmt.shard_bytes(n)
        decode(gathered[at:at + nbytes], [n], fmt, out[start:start + n])
        at += nbytes
    return out


__all__ = ["CHUNK_NUMEL", "DEFAULT_BLOCK_SIZE", "FORMATS", "MAX_CHUNKS", "WireFormat",
           "check_block_size", "check_format", "chunk_count", "chunks", "decode", "decode_chunk",
           "dequantize", "first_stage", "first_stage_chunk", "own_shard", "quantize",
           "reduce_shard", "shard_sizes"]
