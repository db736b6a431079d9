"""The two-stage quantized allreduce on the engine's own alltoall and allgather.

The math is compression/two_stage.py's (pure functions, also the tests'
oracle); this chains it on the running engine, in chunks (`two_stage.chunks`:
one per CHUNK_NUMEL elements, at most MAX_CHUNKS; a small tensor is one), each
an independent two-stage reduction: stage 1 of chunk i on the caller's thread,
whose alltoall starts before chunk i+1 is quantized; stage 2 and the allgather
on one of the engine's pool of two-stage threads (Engine.two_stage_async: why a
pool thread, and why it cannot deadlock), reducing chunk i while chunk i+1 is
on the wire; the decode of each chunk on that thread once its allgather
landed, or on `wait`. So the CPU's stages overlap the transfers, and the result
is the same bits as in one chunk. One handle, the engine's: poll, wait, names,
the timeline and shutdown's completion apply as to its own collectives. The
optimizer's buckets use it for a codec with a wire format and no `collective=`
(pipeline/step_machine.py).
"""
import functools

from .. import engine as _engine
from ..compression import accumulator
from ..compression.two_stage import (chunks, decode_chunk, first_stage_chunk, own_shard,
                                     reduce_shard)
from ..engine.argument_checks import check_op, check_scale, check_tensor
from ..engine.base import Average, Done, EngineError, Sum


def _check_counts(counts, nbytes, name, fmt):
    if any(c != nbytes for c in counts):
        raise EngineError(f"quantized reduction {name!r} ({fmt.describe()}): expected "
                          f"{nbytes} byte(s) from every rank, received {counts}; the tensor's "
                          "size or the codec differs across ranks")


def _second_stage(received, counts, *, name, size, numel, fmt, acc, average, prescale,
                  postscale, residual):
    _check_counts(counts, fmt.shard_bytes(numel), name, fmt)
    return reduce_shard(received, size, numel, fmt, acc, average, prescale, postscale,
                        residual)


def allreduce_async(tensor, name=None, op=None, *, fmt, residuals=None, process_set=None,
                    prescale_factor=1.0, postscale_factor=1.0):
    """Start the two-stage quantized reduction of `tensor` in place (Average or Sum);
    `engine.wait(handle)` returns the tensor. `fmt`: a compression.two_stage.WireFormat;
    `residuals`: None or (first, second), error feedback's carries in the accumulator's
    type on the tensor's device: `first` of the tensor's size, `second` of this rank's
    shard (`own_shard`). With one rank nothing is sent or quantized."""
    op = Average if op is None else op
    check_tensor(tensor, "quantized allreduce")
    check_op(op, (Average, Sum), "quantized allreduce")
    check_scale(prescale_factor, "prescale_factor")
    check_scale(postscale_factor, "postscale_factor")
    if not tensor.is_floating_point():
        raise ValueError(f"a quantized allreduce reduces floating-point tensors, got "
                         f"{tensor.dtype}")
    acc = accumulator(tensor.dtype)
    eng = _engine.current()
    ps = eng.resolve_process_set(process_set)
    size, me = len(ps.ranks), ps.ranks.index(eng.rank())
    if residuals is not None:
        for residual, numel, what in zip(residuals, (tensor.numel(), own_shard(
                tensor.numel(), size, me)[1]), ("the tensor's", "this rank's shard's")):
            if (residual.dtype != acc or residual.numel() != numel
                    or residual.device != tensor.device or not residual.is_contiguous()):
                raise ValueError(f"residuals must be contiguous {acc} tensors on "
                                 f"{tensor.device} of {what} size ({numel}), got "
                                 f"{residual!r:.80}")
    flat = tensor.view(-1)
    if size == 1:                       # nothing sent, nothing quantized
        factor = prescale_factor * postscale_factor
        if factor != 1:
            flat.copy_(flat.to(acc) * factor)
        return eng.adopt_async("allreduce", tensor, name, op, lambda _: Done(tensor),
                               process_set=process_set)
    first, second = (None, None) if residuals is None else residuals
    own_start = own_shard(flat.numel(), size, me)[0]
    average = op is Average
    parts = chunks(flat.numel(), size, fmt)
    sent = []

    def joined():
        # A rank has joined (uneven data): the engine's allreduce, where it adds zeros,
        # carries what this rank's first stage sent (its dequantized values: the first
        # residual already holds what they lost); nothing is quantized a second time.
        for ranges, send in zip(parts, sent):
            decode_chunk(send, ranges, fmt, flat)
        return flat, prescale_factor, postscale_factor, lambda reduced: (
            None if reduced is flat else flat.copy_(reduced.view(-1)))

    def chunk(ranges):
        start, numel = ranges[me]             # this rank's part: a range of its shard
        reduce = functools.partial(
            _second_stage, name=name, size=size, numel=numel, fmt=fmt, acc=acc,
            average=average, prescale=prescale_factor, postscale=postscale_factor,
            residual=None if second is None else second[start - own_start:
                                                        start - own_start + numel])

        def first_stage():
            send, splits = first_stage_chunk(flat, ranges, fmt, first)
            sent.append(send)
            return (send, splits, [fmt.shard_bytes(numel)] * size, reduce,   # all send me that
                    lambda gathered: decode_chunk(gathered, ranges, fmt, flat))
        return first_stage

    return eng.two_stage_async("allreduce", tensor, name, op, [chunk(ranges) for ranges in parts],
                               lambda: tensor, process_set=process_set, joined=joined)


def allreduce(tensor, name=None, op=None, **options):
    return _engine.wait(allreduce_async(tensor, name, op, **options))


__all__ = ["allreduce", "allreduce_async"]
