"""Runs the collectives of one engine on a thread of their own.

An algorithm is a sequence of dependent sends and receives (receive a
chunk, add, send it on), so it cannot be one library call that completes
by itself. A single background thread per engine runs them one after the
other, in the order they were started: the gradients of step t keep moving
while step t+1 computes, and since every rank starts collectives in the
same order (the optimizer's buckets do), the ranks' threads meet. The
caller holds an engine handle (poll: finished; wait: the result), so many
collectives can be in flight and waited in any order.
"""
import collections
import concurrent.futures
import weakref

from ..compression import accumulator
from ..engine.base import Average, Done, Work
from .agreement import Agreement, signature
from .buffers import Pool
from .channel import Channel, tag_base
from .exchange import Exchange
from .group import open_group
from .layout import Layout

_communicators = weakref.WeakKeyDictionary()     # engine -> Communicator
CLOSE_TIMEOUT_S = 600


def communicator(eng):
    """The engine's communicator, created on first use (collectively: every rank
    must get here at the same point, as the optimizer's wrap and first launch do)."""
    found = _communicators.get(eng)
    if found is None:
        found = _communicators[eng] = Communicator(eng)
    return found


class _Running(Work):
    def __init__(self, future):
        self.future = future

    def poll(self):
        return self.future.done()

    def wait(self):
        return self.future.result()


class Job:
    """One collective, as the thread runs it."""

    __slots__ = ("kind", "tensor", "spec", "codec", "op", "root", "ranks", "me", "set_id",
                 "prescale", "postscale", "residual")

    def __init__(self, kind, tensor, spec, codec, op, *, ranks, me, set_id, root=None,
                 prescale=1.0, postscale=1.0, residual=None):
        self.kind, self.tensor, self.spec, self.codec, self.op = kind, tensor, spec, codec, op
        self.ranks, self.me, self.set_id, self.root = ranks, me, set_id, root
        self.prescale, self.postscale, self.residual = prescale, postscale, residual

    @property
    def p(self):
        return len(self.ranks)

    @property
    def acc_dtype(self):
        return accumulator(self.tensor.dtype)

    @property
    def factor(self):
        """Sum -> result, where the result is complete."""
        return self.postscale / self.p if self.op is Average else self.postscale

    @property
    def in_place(self):
        """Accumulate in the caller's tensor: it has the accumulator's type and lives on the
        CPU, and (reduce) its partial sums may show. Else a persistent buffer, copied back."""
        tensor = self.tensor
        return (tensor.dtype == self.acc_dtype and tensor.device.type == "cpu"
                and self.kind != "reduce")


class Communicator:
    def __init__(self, eng):
        self.engine = eng
        self.group, self.owned = open_group(eng) if eng.size() > 1 else (None, False)
        self._thread = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="pipe_horovod-collectives")
        self._sequence = collections.Counter()    # per process set: launches so far
        self.pool = Pool()
        self.agreement = Agreement()
        self.closed = False
        eng.before_shutdown(__name__, self.close)

    def start(self, job):
        """Run `job` (nothing to send: at once) and return its engine Work."""
        if job.p == 1:
            return Done(self._alone(job))
        sequence = self._sequence[job.set_id]
        self._sequence[job.set_id] += 1
        if self.closed:
            raise RuntimeError("pipe_horovod.collectives: the engine is shutting down")
        return _Running(self._thread.submit(self._run, job, sequence))

    @staticmethod
    def _alone(job):
        """One rank: the sum is this rank's tensor (nothing is encoded, so nothing is
        lost); a broadcast changes nothing."""
        if job.residual is not None:
            job.tensor.view(-1).add_(job.residual.to(job.tensor.dtype))
            job.residual.zero_()
        if job.kind != "broadcast":
            factor = job.prescale * job.factor
            if factor != 1.0:
                job.tensor.mul_(factor)
        return job.tensor

    def _run(self, job, sequence):
        import torch

        checking = Channel(torch.distributed, self.group, job.ranks,
                           tag_base(sequence, job.set_id))
        verified = self.agreement.check(job, checking, sequence)
        channel = Channel(torch.distributed, self.group, job.ranks,
                          tag_base(sequence, job.set_id, verified))
        tensor, codec = job.tensor, job.codec
        flat = tensor.view(-1)
        algorithm = job.spec.module
        nbytes = flat.numel() * torch.empty(0, dtype=codec.wire_dtype).element_size()
        layout = Layout(algorithm.blocks(job.kind, flat.numel(), job.p, nbytes, job.spec), codec)
        buffers = self.pool.get(flat.numel(), job.acc_dtype, layout.wire_numel, codec.wire_dtype,
                                not codec.elementwise, not job.in_place)
        work = flat if job.in_place else buffers.work.copy_(flat)
        if job.prescale != 1.0:
            work.mul_(job.prescale)
        if job.residual is not None:
            work.add_(job.residual)
            job.residual.zero_()
        x = Exchange(channel, codec, layout, work, buffers, job.residual, job.factor)
        try:
            if job.kind == "allreduce":
                algorithm.allreduce(x, job.me, job.p)
            else:
                getattr(algorithm, job.kind)(x, job.me, job.p, job.root)
            x.finish()
        except RuntimeError as exc:
            if "timed out" not in str(exc).lower():
                raise
            raise ValueError(
                f"rank {job.ranks[job.me]}: collectives.{job.kind} (call #{sequence}, "
                f"{dict(signature(job))}) got no message from a peer within the timeout: "
                f"the ranks may have called it with different arguments (each a call "
                f"verified before), or a peer stopped") from exc
        if not job.in_place and (job.kind != "reduce" or job.me == job.root):
            flat.copy_(work)
        return tensor

    def close(self):
        """Before the engine stops: let every started collective finish (the other
        ranks started them too), then take down the group if it was ours."""
        if self.closed:
            return
        self.closed = True
        try:
            self._thread.submit(lambda: None).result(timeout=CLOSE_TIMEOUT_S)
        except RuntimeError:
            pass        # at interpreter exit Python joined the thread already, its queue done
        self._thread.shutdown(wait=True)
        self.pool.clear()
        if self.owned:
            import torch.distributed as dist

            from ..engine.torch_dist import tear_down

            if dist.is_initialized():
                tear_down(dist)
        _communicators.pop(self.engine, None)
