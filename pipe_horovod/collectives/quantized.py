"""The two-stage quantized allreduce, on the engine's collectives or point to point.

The math is compression/two_stage.py's (pure functions, also the tests'
oracle), in chunks (`two_stage.chunks`: one per CHUNK_NUMEL elements, at most
MAX_CHUNKS; a small tensor is one), each an independent two-stage reduction,
so the CPU's stages overlap the transfers. Either transport gives the same
bits; they differ in how the bytes move:

- "engine": the engine's own alltoall and allgather (Engine.two_stage_async):
  stage 1 of chunk i on the caller's thread, whose alltoall starts before
  chunk i+1 is quantized; stage 2 and the allgather on one of the engine's
  pool of two-stage threads. Collectives matched by name, so ranks may start
  reductions in any order (Horovod's rule); NCCL for CUDA tensors.
- "p2p": point-to-point messages on the collectives' gloo group, run by the
  communicator's thread (collectives/communicator.py): every rank sends each
  peer its quantized part of a chunk as soon as it is encoded, reduces its own
  part once every peer's landed and sends the result to every peer, so chunk
  i's second stage runs while chunk i+1's first is on the wire. Horovod's gloo
  alltoall and allgather move about half the link rate on CPU tensors (the
  negotiation of every collective, then a blocking exchange); these messages
  keep the link busy as the per-hop ring does. Ranks must start reductions in
  the same order (the optimizer's buckets do), and a joined rank answers no
  message: Engine.gated_async first asks whether every rank is present.

The optimizer's buckets take "p2p" on the CPU and "engine" on a GPU
(`bucket_transport`), for a codec with a wire format and no `collective=`
(pipeline/step_machine.py); `hvd.allreduce(compression=int8)` keeps Horovod's
any-order rule on the engine.
"""
import functools
import itertools
import os

from .. import engine as _engine
from ..compression import accumulator
from ..compression.two_stage import (chunks, decode_chunk, first_stage_chunk, own_shard,
                                     reduce_shard)
from ..engine.argument_checks import check_op, check_scale, check_tensor
from ..engine.base import Average, Done, EngineError, Sum
from .buffers import Buffers
from .communicator import Job, communicator, opened


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


TRANSPORTS = ("engine", "p2p")
TRANSPORT_VARIABLE = "PIPE_HOROVOD_TWO_STAGE_TRANSPORT"


def check_transport(transport, tensor, what="transport"):
    """`transport` if it can carry `tensor` (p2p: CPU tensors only; it stages nothing
    through host buffers), else a ValueError naming `what` asked for it."""
    if transport not in TRANSPORTS or (transport == "p2p" and tensor.device.type != "cpu"):
        raise ValueError(f"{what}={transport!r}: choose one of {', '.join(TRANSPORTS)} (p2p "
                         f"for CPU tensors only; this tensor is on {tensor.device})")
    return transport


def bucket_transport(tensor):
    """The optimizer's buckets: "p2p" for CPU tensors, "engine" for others (NCCL keeps a
    GPU's bytes on the device); PIPE_HOROVOD_TWO_STAGE_TRANSPORT=engine|p2p decides for
    every device."""
    chosen = os.environ.get(TRANSPORT_VARIABLE)
    if chosen is None:
        return "p2p" if tensor.device.type == "cpu" else "engine"
    return check_transport(chosen, tensor, TRANSPORT_VARIABLE)


def allreduce_async(tensor, name=None, op=None, *, fmt, residuals=None, process_set=None,
                    prescale_factor=1.0, postscale_factor=1.0, transport="engine",
                    keep_buffers=True):
    """Start the two-stage quantized reduction of `tensor` in place (Average or Sum);
    `engine.wait(handle)` returns the tensor. `fmt`: a compression.two_stage.WireFormat;
    `residuals`: None or (first, second), error feedback's carries in the accumulator's
    type on the tensor's device: `first` of the tensor's size, `second` of this rank's
    shard (`own_shard`). `transport`: "engine" or "p2p" (CPU tensors; every rank starts
    its reductions in the same order), see the module's docstring. `keep_buffers`: the
    point-to-point path keeps its wire buffers for the next call of this size
    (buffers.py); False frees them when the call ends (the lookahead's exchange, so the
    memory between steps stays the default's). With one rank nothing is sent or
    quantized."""
    op = Average if op is None else op
    check_tensor(tensor, "quantized allreduce")
    check_op(op, (Average, Sum), "quantized allreduce")
    check_scale(prescale_factor, "prescale_factor")
    check_scale(postscale_factor, "postscale_factor")
    if not tensor.is_floating_point():
        raise ValueError(f"a quantized allreduce reduces floating-point tensors, got "
                         f"{tensor.dtype}")
    check_transport(transport, tensor)
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
    sent = []                           # the engine path's first stages, by chunk

    def joined():
        # A rank has joined (uneven data): the engine's allreduce, where it adds zeros,
        # carries what this rank's first stage sent (its dequantized values: the first
        # residual already holds what they lost); nothing is quantized a second time.
        for index, ranges in enumerate(parts):
            send = (sent[index] if index < len(sent)
                    else first_stage_chunk(flat, ranges, fmt, first)[0])
            decode_chunk(send, ranges, fmt, flat)
        return flat, prescale_factor, postscale_factor, lambda reduced: (
            None if reduced is flat else flat.copy_(reduced.view(-1)))

    def second_residual(ranges):
        start, numel = ranges[me]             # this rank's part: a range of its shard
        return None if second is None else second[start - own_start:start - own_start + numel]

    if transport == "p2p":
        def start(ps, gate):
            comm = opened(eng)
            if comm is None:
                # Opening the group is collective: only once every rank is here (else a
                # joined rank would never open it), the first time on this thread.
                if not gate():
                    return Done(tensor)
                comm, gate = communicator(eng), lambda: True
            return comm.start(_PointToPoint(
                tensor, op, fmt, parts, first, [second_residual(r) for r in parts], gate,
                ranks=list(ps.ranks), me=me, set_id=ps.process_set_id,
                prescale=prescale_factor, postscale=postscale_factor, keep=keep_buffers))

        return eng.gated_async("allreduce", tensor, name, op, start, joined,
                               process_set=process_set)

    def chunk(ranges):
        numel = ranges[me][1]
        reduce = functools.partial(
            _second_stage, name=name, size=size, numel=numel, fmt=fmt, acc=acc,
            average=average, prescale=prescale_factor, postscale=postscale_factor,
            residual=second_residual(ranges))

        def first_stage():
            send, splits = first_stage_chunk(flat, ranges, fmt, first)
            sent.append(send)
            return (send, splits, [fmt.shard_bytes(numel)] * size, reduce,   # all send me that
                    lambda gathered: decode_chunk(gathered, ranges, fmt, flat))
        return first_stage

    return eng.two_stage_async("allreduce", tensor, name, op, [chunk(ranges) for ranges in parts],
                               lambda: tensor, process_set=process_set, joined=joined)


def _laid_out(sizes):
    """Where each of `sizes` starts laid end to end, then where the last ends."""
    return list(itertools.accumulate(sizes, initial=0))


class _TwoStage:
    """The point-to-point path as the communicator's agreement check names it."""

    @staticmethod
    def describe():
        return "two-stage"


class _PointToPoint(Job):
    """One two-stage reduction on the communicator's thread. Message 2c carries
    chunk c's first-stage part to the rank that reduces it, 2c + 1 its reduced part
    to every rank; both sides compute every size from the agreed numel, format and
    ranks (the agreement check compares them), so no size travels."""

    __slots__ = ("fmt", "parts", "first", "seconds", "gate", "keep")

    def __init__(self, tensor, op, fmt, parts, first, seconds, gate, keep=True, **job):
        super().__init__("allreduce", tensor, _TwoStage, fmt, op, **job)
        self.fmt, self.parts, self.first, self.seconds, self.gate = fmt, parts, first, seconds, gate
        self.keep = keep

    def instead(self):
        return None if self.gate() else self.tensor

    def run(self, channel, pool):
        import torch

        flat, fmt, p, me = self.tensor.view(-1), self.fmt, self.p, self.me
        peers = [(me + k) % p for k in range(1, p)]     # a different first peer per rank
        # Persistent buffers (buffers.py: fresh ones page-fault on every call): the
        # copies of this rank's parts, every rank's reduced part, this rank's first stage.
        sizes = [[fmt.shard_bytes(n) for _, n in ranges] for ranges in self.parts]
        boxes_at = _laid_out([p * part[me] for part in sizes])
        chunks_at = _laid_out([sum(part) for part in sizes])
        boxes, outs, sent = (pool.get if self.keep else Buffers)(
            0, self.acc_dtype, max(chunks_at[-1], boxes_at[-1]), torch.uint8, False, False).wires
        received, gathered, at = [], [], []
        for c, part in enumerate(sizes):
            mine = part[me]
            box = boxes[boxes_at[c]:boxes_at[c + 1]]
            offsets = _laid_out(part)
            out = outs[chunks_at[c]:chunks_at[c + 1]]
            received.append((box, [channel.recv(box[r * mine:(r + 1) * mine], r, 2 * c)
                                   for r in peers if mine]))
            gathered.append((out, [channel.recv(out[offsets[r]:offsets[r + 1]], r, 2 * c + 1)
                                   for r in peers if part[r]]))
            at.append(offsets)
        sends, decoded = [], 0

        def reduce(c):
            box, works = received[c]
            for work in works:
                work.wait()
            numel = self.parts[c][me][1]
            wire = reduce_shard(box, p, numel, fmt, self.acc_dtype, self.op is Average,
                                self.prescale, self.postscale, self.seconds[c])
            out = gathered[c][0]
            out[at[c][me]:at[c][me] + wire.numel()] = wire
            sends.extend(channel.send(wire, r, 2 * c + 1) for r in peers if wire.numel())

        def decode(c, block):
            out, works = gathered[c]
            if not block and not all(work.is_completed() for work in works):
                return False
            for work in works:
                work.wait()
            decode_chunk(out, self.parts[c], fmt, flat)
            return True

        for c, ranges in enumerate(self.parts):
            send, splits = first_stage_chunk(flat, ranges, fmt, self.first,
                                             sent[chunks_at[c]:chunks_at[c + 1]])
            offsets = at[c]
            sends.extend(channel.send(send[offsets[r]:offsets[r + 1]], r, 2 * c)
                         for r in peers if splits[r])
            mine = splits[me]
            received[c][0][me * mine:(me + 1) * mine] = send[offsets[me]:offsets[me + 1]]
            if c:
                reduce(c - 1)
            while decoded < c - 1 and decode(decoded, block=False):    # landed meanwhile
                decoded += 1
        reduce(len(self.parts) - 1)
        for c in range(decoded, len(self.parts)):
            decode(c, block=True)
        for work in sends:
            work.wait()
        return self.tensor


def allreduce(tensor, name=None, op=None, **options):
    return _engine.wait(allreduce_async(tensor, name, op, **options))


__all__ = ["allreduce", "allreduce_async"]
