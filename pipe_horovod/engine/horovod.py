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

Step 1 is queued on the caller's thread and steps 2-3 run on the engine's
pool of two-stage threads (`Engine._start_two_stage`, shared with
`Engine.two_stage_async`, whose docstring gives the reason and why it
cannot deadlock); `wait` finishes the allgather. The names `<name>.a2a` and
`<name>.ag` must not be in flight as other tensors' names. A tensor whose
size differs across ranks is reported (EngineError on `wait`) by the ranks
whose shard sizes then disagree.
Other dtypes use `allreduce_async_` directly. Min, Max and Product of
bfloat16 take the same path, combining the shards in float32; so do
process sets and Horovod's prescale/postscale factors.

Collectives that only move bits (allgather, broadcast, alltoall) send
bfloat16 as int16 and bool as uint8, which Horovod moves untouched.
Everything else delegates to `horovod.torch`, except Adasum without MPI
(Horovod runs Adasum only through MPI): that gathers every rank's tensor
and combines them with engine/adasum.py.
"""
import os

from .adasum import combine as adasum_combine
from .base import (DEFAULT_TIMEOUT_S, Adasum, Average, Call, Done, Engine, EngineError, Max,
                   Min, Product, Sum, WaitError, Work, scale_, shard_sizes)
from .process_sets import check_new_sets
from .stall import http_board, torch_board

_HOROVOD_OPS = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max",
                Product: "Product"}


def _torch():
    import torch

    return torch


def _wire(tensor):
    """`tensor`'s bits as a dtype Horovod 0.28.1 moves (it refuses bfloat16 and bool)."""
    torch = _torch()
    wire_dtype = {torch.bfloat16: torch.int16, torch.bool: torch.uint8}.get(tensor.dtype)
    return tensor if wire_dtype is None else tensor.view(wire_dtype)


class _HorovodWork(Work):
    """A Horovod handle, and what to make of its output once it lands."""

    def __init__(self, hvd, handle, finish=None):
        self.hvd = hvd
        self.handle = handle
        self.finish = finish

    def poll(self):
        return self.hvd.poll(self.handle)

    def wait(self):
        out = self.hvd.synchronize(self.handle)
        return out if self.finish is None else self.finish(out)


class HorovodEngine(Engine):
    name = "horovod"

    def __init__(self, comm=None, process_sets=None, timeout_s=DEFAULT_TIMEOUT_S):
        super().__init__(timeout_s)
        import horovod.torch as hvd

        self.hvd = hvd
        self._hosts_board = False      # rank 0 under MPI: the board is its TCPStore
        # Checked before hvd.init, which answers a bad set with "initialization failed".
        size = int(os.environ["HOROVOD_SIZE"]) if "HOROVOD_SIZE" in os.environ else None
        sets = check_new_sets(process_sets, size, [list(range(size))] if size else [])
        self._made_by_init = {tuple(ps.ranks): hvd.ProcessSet(ps.ranks) for ps in sets}
        # Horovod's response cache hands its background thread the cached tensors that are
        # ready in cache order, not in the order they were enqueued. With two steps in
        # flight (K >= 2) a later step's large bucket then goes ahead of the earlier step's
        # last buckets, and the step waiting on those waits for both: VGG-16 replayed at
        # K=2 took alternately 3.5 s and 7 s a step, 8% over the link's bound; with the
        # cache off, steady steps (docs/bench/log.md, "Replay compute"). Off unless the
        # user set a capacity; it only saves negotiation, which is small beside a bucket.
        os.environ.setdefault("HOROVOD_CACHE_CAPACITY", "0")
        addr = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")
        if (addr and size and size > 1 and "HOROVOD_RANK" in os.environ
                and os.environ.get("HOROVOD_ELASTIC") != "1"):    # elastic: ranks change
            # Before hvd.init, whose rendezvous every rank passes only after all did this:
            # no wait of another rank reads what an engine before this one posted.
            http_board(addr, os.environ["HOROVOD_GLOO_RENDEZVOUS_PORT"], size).start(
                int(os.environ["HOROVOD_RANK"]))
        hvd.init(comm, process_sets=list(self._made_by_init.values()))
        self._register_process_sets(sets, hvd.global_process_set)
        if addr and self.size() > 1:            # horovodrun's key-value server (stall.py)
            self._board = http_board(addr, os.environ["HOROVOD_GLOO_RENDEZVOUS_PORT"],
                                     self.size())
        elif self.size() > 1:                   # MPI (mpirun, horovodrun --mpi): no server
            self._board = self._store_board()

    def _store_board(self):
        """A status board on a TCPStore that rank 0 hosts (its address in one broadcast at
        init), for MPI launches, which have no key-value server. It lives as long as rank 0,
        which on leaving stays until the others have read its end (_close)."""
        import datetime
        import socket

        import torch.distributed as dist

        store, where = None, None
        if self.rank() == 0:
            try:
                store = dist.TCPStore("0.0.0.0", 0, None, True,
                                      timeout=datetime.timedelta(seconds=10),
                                      wait_for_workers=False)
                where = (socket.gethostname(), store.port)
            except Exception:                   # no board: Horovod's own messages
                store = None
        where = self.hvd.broadcast_object(where, root_rank=0, name="pipe_horovod.board")
        if where is None:
            return None
        self._hosts_board = store is not None
        if store is None:
            host = "127.0.0.1" if where[0] == socket.gethostname() else where[0]
            try:
                store = dist.TCPStore(host, where[1], None, False,
                                      timeout=datetime.timedelta(seconds=10))
            except Exception:
                return None
        return torch_board(store, self.size())

    def rank(self):
        return self.hvd.rank()

    def size(self):
        return self.hvd.size()

    def local_rank(self):
        return self.hvd.local_rank()

    def local_size(self):
        return self.hvd.local_size()

    def cross_rank(self):
        return self.hvd.cross_rank()

    def cross_size(self):
        return self.hvd.cross_size()

    def is_homogeneous(self):
        return self.hvd.mpi_ops.is_homogeneous()

    @classmethod
    def build_info(cls):
        import horovod.torch as hvd         # its *_built queries need no hvd.init()

        return {name: getattr(hvd, name)() for name in (
            "mpi_built", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built",
            "rocm_built")}

    def capabilities(self):
        hvd = self.hvd
        info = {**self.build_info(), "mpi_enabled": hvd.mpi_enabled(),
                "gloo_enabled": hvd.gloo_enabled()}
        info["mpi_threads_supported"] = hvd.mpi_threads_supported() if info["mpi_enabled"] else None
        return info

    def start_timeline(self, file_path, mark_cycles=False):
        self.hvd.start_timeline(file_path, mark_cycles)

    def stop_timeline(self):
        self.hvd.stop_timeline()

    # --- reductions -----------------------------------------------------
    def _start_allreduce(self, tensor, name, op, process_set, prescale_factor, postscale_factor):
        torch = _torch()
        if op is Adasum and (tensor.dtype == torch.bfloat16 or not self.hvd.mpi_enabled()):
            return self._start_gathered_adasum(tensor, name, prescale_factor, postscale_factor)
        if tensor.dtype == torch.bfloat16:
            return self._start_split16(tensor, name, op, process_set, prescale_factor,
                                       postscale_factor)
        return self.hvd.allreduce_async_(
            tensor, name=name, op=getattr(self.hvd, _HOROVOD_OPS[op]),
            prescale_factor=prescale_factor, postscale_factor=postscale_factor,
            process_set=self._library_set(process_set))

    def _start_gathered_adasum(self, tensor, name, prescale_factor, postscale_factor):
        """Adasum without MPI: allgather every rank's tensor, combine them here."""
        scale_(tensor, prescale_factor)
        gathered = self.hvd.allgather_async(_wire(tensor).reshape(1, -1), name=name)

        def finish(rows):
            parts = list(rows.view(tensor.dtype).view(self.size(), *tensor.shape))
            return scale_(tensor.copy_(adasum_combine(parts)), postscale_factor)

        return _HorovodWork(self.hvd, gathered, finish)

    def _start_grouped_allreduce(self, tensors, name, op, process_set, prescale_factor,
                                 postscale_factor):
        if op is Adasum and not self.hvd.mpi_enabled():
            return super()._start_grouped_allreduce(tensors, name, op, process_set,
                                                    prescale_factor, postscale_factor)
        handle = self.hvd.grouped_allreduce_async_(
            tensors, name=name, op=getattr(self.hvd, _HOROVOD_OPS[op]),
            prescale_factor=prescale_factor, postscale_factor=postscale_factor,
            process_set=self._library_set(process_set))
        return _HorovodWork(self.hvd, handle, list)

    def _start_reducescatter(self, tensor, name, op, process_set, prescale_factor,
                             postscale_factor):
        handle = self.hvd.reducescatter_async(
            tensor, name=name, op=getattr(self.hvd, _HOROVOD_OPS[op]),
            process_set=self._library_set(process_set), prescale_factor=prescale_factor,
            postscale_factor=postscale_factor)
        return _HorovodWork(self.hvd, handle)

    def _start_grouped_reducescatter(self, tensors, name, op, process_set, prescale_factor,
                                     postscale_factor):
        handle = self.hvd.grouped_reducescatter_async(
            tensors, name=name, op=getattr(self.hvd, _HOROVOD_OPS[op]),
            process_set=self._library_set(process_set), prescale_factor=prescale_factor,
            postscale_factor=postscale_factor)
        return _HorovodWork(self.hvd, handle, list)

    def _start_split16(self, tensor, name, op, process_set, prescale_factor, postscale_factor):
        """Start the alltoall of a 16-bit float tensor; a pool thread does the rest
        (Engine._start_two_stage)."""
        torch = _torch()
        wire = tensor.view(-1).view(torch.int16)
        size = len(process_set.ranks)
        if size == 1:                  # one value: the input, bit for bit unless scaled
            if prescale_factor != 1 or postscale_factor != 1:
                tensor.copy_(tensor.float().mul_(prescale_factor).mul_(postscale_factor))
            return Done(tensor)
        splits = shard_sizes(wire.numel(), size)
        shard = splits[process_set.ranks.index(self.rank())]

        def reduce(received, counts):
            return self._reduce_shard(received, counts, shard, size, tensor.dtype, op, name,
                                      prescale_factor, postscale_factor)

        def finish(gathered):
            wire.copy_(gathered)

        def joined():                  # a rank joined: Horovod's float32 allreduce, zeros added
            return tensor.view(-1).float(), prescale_factor, postscale_factor, \
                lambda reduced: tensor.view(-1).copy_(reduced)

        return self._start_two_stage([lambda: (wire, splits, None, reduce, finish)], name,
                                     process_set, lambda: tensor, op, joined)    # one chunk

    def _reduce_shard(self, received, counts, shard, size, dtype, op, name, prescale_factor,
                      postscale_factor):
        """Pool thread: this rank's shard of every rank, reduced in float32 (int16 bits)."""
        torch = _torch()
        if counts != [shard] * size:
            raise EngineError(
                f"{dtype} reduction {name!r}: rank {self.rank()} expected {shard} element(s) "
                f"from every rank, received {counts}; the tensor's size differs across ranks")
        values = received.view(dtype).view(size, shard).float()
        if prescale_factor != 1:
            values.mul_(prescale_factor)
        if op is Min:
            total = values.amin(0)
        elif op is Max:
            total = values.amax(0)
        else:                          # rank order: the same result on every rank, every run
            total = values[0].clone()
            for value in values[1:]:
                if op is Product:
                    total.mul_(value)
                else:
                    total.add_(value)
        if op is Average:
            total.div_(size)
        if postscale_factor != 1:
            total.mul_(postscale_factor)
        return total.to(dtype).view(torch.int16)

    def _poll(self, handle):
        return self.hvd.poll(handle.backend)

    def _wait(self, handle):
        return self.hvd.synchronize(handle.backend)

    # --- data movement --------------------------------------------------
    def _start_allgather(self, tensor, name, process_set):
        handle = self.hvd.allgather_async(_wire(tensor), name=name,
                                          process_set=self._library_set(process_set))
        return _HorovodWork(self.hvd, handle, lambda out: out.view(tensor.dtype))

    def _start_grouped_allgather(self, tensors, name, process_set):
        handle = self.hvd.grouped_allgather_async([_wire(t) for t in tensors], name=name,
                                                  process_set=self._library_set(process_set))
        return _HorovodWork(self.hvd, handle,
                            lambda outs: [o.view(t.dtype) for o, t in zip(outs, tensors)])

    def _start_broadcast(self, tensor, root, name, process_set):
        handle = self.hvd.broadcast_async_(_wire(tensor), root_rank=root, name=name,
                                           process_set=self._library_set(process_set))
        return _HorovodWork(self.hvd, handle, lambda out: tensor)

    def _start_alltoall(self, tensor, splits, name, process_set):
        torch = _torch()
        handle = self.hvd.alltoall_async(_wire(tensor), torch.tensor(splits, dtype=torch.int32),
                                         name=name, process_set=self._library_set(process_set))
        return _HorovodWork(self.hvd, handle,
                            lambda out: (out[0].view(tensor.dtype), out[1]))

    # --- barrier and join -------------------------------------------------
    # Horovod's own barrier and join block in C++ until they complete; their handles
    # (what hvd.barrier and hvd.join wait on) are waited for here instead, bounded and
    # inspected as any wait (stall.py).
    def _start_barrier(self, name, process_set):
        mpi_ops = self.hvd.mpi_ops
        handle = mpi_ops.mpi_lib.horovod_torch_barrier(
            self._library_set(process_set).process_set_id)
        mpi_ops._handle_map[handle] = (None, None)
        return _HorovodWork(self.hvd, handle)

    def _join(self, device):
        torch = _torch()
        mpi_ops = self.hvd.mpi_ops
        output = torch.tensor(-1, dtype=torch.int)
        handle = mpi_ops.mpi_lib.horovod_torch_join(output, device)
        mpi_ops._handle_map[handle] = (None, output)
        try:
            self._wait_for_join(lambda: self.hvd.poll(handle))
            return self.hvd.synchronize(handle).item()
        except RuntimeError as exc:
            if isinstance(exc, WaitError):
                raise
            raise self._diagnose(exc, Call("join", None)) from exc

    # --- process sets ---------------------------------------------------
    def _add_library_set(self, process_set):
        library_set = self._made_by_init.pop(tuple(process_set.ranks), None)
        if library_set is None:        # needs HOROVOD_DYNAMIC_PROCESS_SETS=1 (Horovod says so)
            library_set = self.hvd.add_process_set(process_set.ranks)
        return library_set.process_set_id, library_set

    def _remove_library_set(self, process_set, library_set):
        self.hvd.remove_process_set(library_set)

    def _close(self):
        others = [r for r in range(self.size()) if r != self.rank()]
        self.hvd.shutdown()            # two-stage pool threads already see _releasing (base)
        if self._hosts_board:      # the board dies with this process: stay until the others
            # posted their own end, so a rank waiting for this one reads that it ended and
            # names it, instead of Horovod's "has been shut down"
            self._board.wait_for_ends(others)
