"""Horovod's torch ops: Gloo or MPI controller on CPU, NCCL on GPU.

Horovod negotiates each reduction by tensor name, so ranks may start them
in different orders; it allows one operation per name in flight, which the
base class enforces with a readable error before the C++ core sees it.

bfloat16. Horovod 0.28.1's torch ops reject bfloat16 (allreduce, allgather
and alltoall alike: "Tensor type torch.BFloat16Tensor is not supported"),
and staging through float32 would double the bytes on the wire. So a
bfloat16 reduction runs as a reduce-scatter plus an allgather, both on the
same bits reinterpreted as int16, which Horovod moves untouched. (Measured
on the emulated 1gbit cluster by examples/horovod_collectives_probe.py,
Horovod's gloo alltoall and allgather each move data at about half the
link rate, so this path saves little time
there over float32, and float16 keeps Horovod's native allreduce, which
does run at the link rate.)

1. `<name>.a2a`: `hvd.alltoall` of the flat tensor, split into `size`
   near-equal contiguous shards; rank r receives every rank's shard r
   (the reduce-scatter's communication).
2. Rank r sums the `size` copies of its shard in float32, in rank order,
   divides by `size` for Average, and rounds to bfloat16 once.
3. `<name>.ag`: `hvd.allgather` of the reduced shards (shards may differ by
   one element, or be empty when numel < size; allgather concatenates along
   dim 0 and allows that) rebuilds the full result, copied back into the
   caller's tensor on `wait`.

Each rank sends and receives 2(p-1)/p * n elements of 2 bytes, the same
bytes as a ring allreduce in 16 bits. The sum is done once in float32 and
rounded once, so it is at least as accurate as a ring accumulating in
bfloat16 (which rounds after every hop). With one rank nothing is sent.

Step 2 needs step 1's result, and the optimizer starts reductions during
backward and waits for them later, so step 1 is queued on the caller's
thread and steps 2-3 run on a pool thread owned by the engine; `wait`
finishes the allgather. A pool thread blocks only on an alltoall, which
completes once every rank has *started* that reduction, never on another
rank's pool, so as long as fewer than `_BF16_THREADS` bfloat16 reductions
wait at once for other ranks to start them, any start order that works
with Horovod's own allreduce also works here (a single worker thread
would not: it would hold one reduction's allgather behind another's
alltoall, which can wait on a rank that is itself waiting for that
allgather). The names `<name>.a2a` and `<name>.ag` must not be in flight as
other tensors' names. A tensor whose size differs across ranks is reported
(EngineError on `wait`) by the ranks whose shard sizes then disagree.
Other dtypes use `allreduce_async_` directly.
"""
import concurrent.futures

from .base import Average, Engine, EngineError, check_root

# Pool threads are created only while that many bfloat16 reductions are
# blocked at once in their alltoall; see the module docstring.
_BF16_THREADS = 64


def _torch():
    import torch

    return torch


def shard_sizes(numel, size):
    """`size` near-equal contiguous shards of `numel` elements, larger ones first."""
    base, extra = divmod(numel, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


class _Split16Reduction:
    """Backend state of one alltoall + allgather reduction (see the module docstring)."""

    __slots__ = ("wire", "future")

    def __init__(self, wire, future):
        self.wire = wire            # the caller's tensor, flat, as int16
        self.future = future        # -> allgather handle, or None with one rank


class HorovodEngine(Engine):
    name = "horovod"

    def __init__(self):
        super().__init__()
        import horovod.torch as hvd

        self.hvd = hvd
        self._object_calls = 0
        self._pool = None
        hvd.init()

    def rank(self):
        return self.hvd.rank()

    def size(self):
        return self.hvd.size()

    def local_rank(self):
        return self.hvd.local_rank()

    def local_size(self):
        return self.hvd.local_size()

    def _start_allreduce(self, tensor, name, op):
        torch = _torch()
        if tensor.dtype == torch.bfloat16:
            return self._start_split16(tensor, name, op)
        hvd_op = self.hvd.Average if op is Average else self.hvd.Sum
        return self.hvd.allreduce_async_(tensor, name=name, op=hvd_op)

    def _start_split16(self, tensor, name, op):
        """Start the alltoall of a 16-bit float tensor; a pool thread does the rest."""
        torch = _torch()
        wire = tensor.view(-1).view(torch.int16)
        size = self.size()
        if size == 1:                  # sum of one value, /1: the input, bit for bit
            done = concurrent.futures.Future()
            done.set_result(None)
            return _Split16Reduction(wire, done)
        splits = shard_sizes(wire.numel(), size)
        a2a = self.hvd.alltoall_async(wire, splits=splits, name=f"{name}.a2a")
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=_BF16_THREADS, thread_name_prefix="pipe_horovod-bf16")
        future = self._pool.submit(self._reduce_shard, a2a, splits[self.rank()], size,
                                   tensor.dtype, op, name)
        return _Split16Reduction(wire, future)

    def _reduce_shard(self, a2a, shard, size, dtype, op, name):
        """Pool thread: finish the alltoall, reduce this rank's shard, start the allgather."""
        torch = _torch()
        received, received_splits = self.hvd.synchronize(a2a)
        got = received_splits.tolist()
        if got != [shard] * size:
            raise EngineError(
                f"{dtype} reduction {name!r}: rank {self.rank()} expected {shard} element(s) "
                f"from every rank, received {got}; the tensor's size differs across ranks")
        parts = received.view(dtype).view(size, shard)
        total = parts[0].float()
        for part in parts[1:]:         # rank order: the same sum on every rank, every run
            total.add_(part)
        if op is Average:
            total.div_(size)
        reduced = total.to(dtype).view(torch.int16)
        return self.hvd.allgather_async(reduced, name=f"{name}.ag")

    def _poll(self, handle):
        backend = handle.backend
        if not isinstance(backend, _Split16Reduction):
            return self.hvd.poll(backend)
        future = backend.future
        if not future.done():
            return False
        if future.exception() is not None:
            return True                # wait raises at once
        ag = future.result()
        return ag is None or self.hvd.poll(ag)

    def _wait(self, handle):
        backend = handle.backend
        if not isinstance(backend, _Split16Reduction):
            return self.hvd.synchronize(backend)
        ag = backend.future.result()   # re-raises the pool thread's error
        if ag is not None:
            backend.wire.copy_(self.hvd.synchronize(ag))
        return handle.tensor

    def broadcast(self, tensor, root):
        check_root(root, self.size())
        return self.hvd.broadcast_(tensor, root_rank=root)

    # Horovod names object collectives after type(obj) by default, which
    # deadlocks when the root sends a dict and the others pass None: name
    # them by call count instead, identical on every rank.
    def broadcast_object(self, obj, root):
        check_root(root, self.size())
        return self.hvd.broadcast_object(obj, root_rank=root, name=self._object_name("bcast"))

    def allgather_object(self, obj):
        return self.hvd.allgather_object(obj, name=self._object_name("gather"))

    def _object_name(self, kind):
        self._object_calls += 1
        return f"pipe_horovod.{kind}_object.{self._object_calls}"

    def barrier(self):
        self.hvd.barrier()

    def _close(self):
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        self.hvd.shutdown()            # fails the alltoalls a pool thread may still block on
        if pool is not None:
            pool.shutdown(wait=True)

    def controllers(self):
        hvd = self.hvd
        return {"gloo": hvd.gloo_enabled(), "mpi": hvd.mpi_enabled(), "nccl": hvd.nccl_built()}
