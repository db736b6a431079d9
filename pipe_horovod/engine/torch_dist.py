"""torch.distributed: gloo on CPU, nccl on GPU, with async work handles.

Unlike Horovod, torch.distributed matches collectives by call order, not by
name: callers (the pipeline core) must start operations in the same order
on every rank. Average is a Sum divided on `wait` (gloo's AVG refuses
integer tensors). Horovod's other collectives map onto torch's:

- allgather with first dimensions that differ across ranks (gloo's
  all_gather wants equal sizes): one small all_gather of every rank's shape,
  which also turns a dtype or trailing-shape mismatch into a ValueError on
  every rank instead of a hang, then an all_gather padded to the longest;
- alltoall: the same shape exchange carries every rank's splits, then
  all_to_all_single with uneven splits;
- reducescatter: an allreduce of a copy, of which each rank keeps its rows
  (Horovod's uneven split; twice the bytes of a true reduce-scatter, but
  every backend and row count works);
- Adasum: an all_gather and the combination rule of engine/adasum.py;
- process sets: torch.distributed.new_group;
- join: a collective every rank must reach after the same collectives; it
  returns the rank that arrived last (by wall clock). Unlike Horovod, a
  joined rank does not stand in for the others' later allreduces:
  torch.distributed has no names to answer them by.

Unlike Horovod, torch.distributed does not compare tensors across ranks:
an allreduce whose shape differs between ranks hangs under gloo, and a
broadcast of different sizes goes through wrong. TORCH_DISTRIBUTED_DEBUG=
DETAIL (set before the engine starts) makes torch check every collective
and raise a readable mismatch error, at some cost per call; allgather and
alltoall always check, as part of their shape exchange.

Launched by Open MPI's `mpirun` instead of torchrun (PIPE_HOROVOD_ENGINE=torch),
the ranks come from mpirun's OMPI_COMM_WORLD_* variables and the rendezvous
from MASTER_ADDR/MASTER_PORT (`mpirun -x MASTER_ADDR=host -x MASTER_PORT=port`).
"""
import atexit
import datetime
import math
import os
import time

from .adasum import combine as adasum_combine
from .base import DEFAULT_TIMEOUT_S, Adasum, Average, Done, Engine, EngineError, Max, Min, \
    Product, Sum, Then, Work, scale_, shard_sizes

# How Horovod's ops map onto torch.distributed's (Average: SUM, divided on wait).
_OPS = {Average: "SUM", Sum: "SUM", Min: "MIN", Max: "MAX", Product: "PRODUCT"}
# Small codes for dtypes in the shape exchange (any code works if it is the same everywhere).
_DTYPES = ("float32", "float64", "float16", "bfloat16", "uint8", "int8", "int16", "int32",
           "int64", "bool", "complex64", "complex128")
_TRAILING = 8   # trailing dimensions compared one by one; further ones by their product


class _Pending(Work):
    """torch.distributed work handles, and what to return once they complete."""

    def __init__(self, works, finish):
        self.works = works
        self.finish = finish

    def poll(self):
        return all(work.is_completed() for work in self.works)

    def wait(self):
        for work in self.works:
            work.wait()
        return self.finish()


def env_from_mpirun(environ):
    """torchrun's variables from Open MPI's, in `environ`, when mpirun started us.

    torch's env:// rendezvous reads RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT. mpirun gives the ranks; the address must come from the user
    unless every rank is on this node; the port defaults to torchrun's 29500.
    """
    if "RANK" in environ or "OMPI_COMM_WORLD_RANK" not in environ:
        return
    size = environ["OMPI_COMM_WORLD_SIZE"]
    local_size = environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", size)
    if "MASTER_ADDR" not in environ:
        if local_size != size:
            raise EngineError(
                f"the torch engine under mpirun across nodes ({size} ranks, {local_size} on this "
                "node) needs rank 0's address: mpirun -x MASTER_ADDR=<host of rank 0> "
                "-x MASTER_PORT=<free port> ...")
        environ["MASTER_ADDR"] = "127.0.0.1"
    environ.setdefault("MASTER_PORT", "29500")
    environ.update(RANK=environ["OMPI_COMM_WORLD_RANK"], WORLD_SIZE=size,
                   LOCAL_RANK=environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
                   LOCAL_WORLD_SIZE=local_size)


def _wait_for_everyone(store, key, size, timeout_s=60.0):
    """Count this rank on `store` and wait, bounded, until `size` ranks have."""
    store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    try:
        while store.add(key, 0) < size and time.monotonic() < deadline:
            time.sleep(0.01)
    except RuntimeError:
        pass        # the store's host (rank 0 under plain env://) has left: everyone is done


class TorchDistEngine(Engine):
    name = "torch"

    def __init__(self, backend=None, comm=None, process_sets=None, timeout_s=DEFAULT_TIMEOUT_S):
        super().__init__(timeout_s)
        import torch
        import torch.distributed as dist

        self.torch = torch
        self.dist = dist
        self._owns_group = not dist.is_initialized()
        if self._owns_group:
            if backend is None:
                backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
            env_from_mpirun(os.environ)
            # The group's timeout bounds torch's blocking collectives (barrier, object
            # collectives) as our own deadline bounds every wait (faults.py).
            bound = {} if math.isinf(timeout_s) else {
                "timeout": datetime.timedelta(seconds=timeout_s)}
            dist.init_process_group(backend=backend, **bound)
            # Scripts rarely call shutdown(); exiting with the group alive lets gloo
            # abort the process ("terminate called without an active exception").
            atexit.register(self.shutdown)
        self._local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self._local_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        if comm not in (None, []) and list(comm) != list(range(self.size())):
            raise ValueError(f"the torch engine spans every rank torchrun started; comm={comm!r} "
                             "(a sub-communicator) is not supported: use process_sets")
        self._set_ids = 0
        self._register_process_sets(process_sets)

    def rank(self):
        return self.dist.get_rank()

    def size(self):
        return self.dist.get_world_size()

    def local_rank(self):
        return self._local_rank

    def local_size(self):
        return self._local_size

    def cross_rank(self):
        return int(os.environ.get("GROUP_RANK", self.rank() // self._local_size))

    def cross_size(self):
        return int(os.environ.get("GROUP_WORLD_SIZE", max(1, self.size() // self._local_size)))

    def is_homogeneous(self):
        return self.size() == self._local_size * self.cross_size()

    @classmethod
    def build_info(cls):
        import torch
        import torch.distributed as dist

        nccl = 0
        if dist.is_nccl_available() and torch.cuda.is_available():
            major, minor, patch = torch.cuda.nccl.version()
            nccl = major * 10000 + minor * 100 + patch   # NCCL_VERSION_CODE
        return {"mpi_built": dist.is_mpi_available(), "gloo_built": dist.is_gloo_available(),
                "nccl_built": nccl, "ddl_built": False, "ccl_built": False,
                "cuda_built": torch.version.cuda is not None,
                "rocm_built": torch.version.hip is not None}

    def capabilities(self):
        backend = str(self.dist.get_backend())
        return {**self.build_info(), "mpi_enabled": "mpi" in backend,
                "mpi_threads_supported": False if "mpi" in backend else None,
                "gloo_enabled": "gloo" in backend}

    # --- reductions -----------------------------------------------------
    def _start_allreduce(self, tensor, name, op, process_set, prescale_factor, postscale_factor):
        group, size = self._library_set(process_set), len(process_set.ranks)
        scale_(tensor, prescale_factor)
        if op is Adasum:
            parts = [self.torch.empty_like(tensor) for _ in range(size)]
            work = self.dist.all_gather(parts, tensor, group=group, async_op=True)
            return _Pending([work], lambda: scale_(tensor.copy_(adasum_combine(parts)),
                                                   postscale_factor))
        work = self.dist.all_reduce(tensor, op=getattr(self.dist.ReduceOp, _OPS[op]),
                                    group=group, async_op=True)

        def finish():
            if op is Average and not tensor.is_floating_point():
                return scale_(tensor, postscale_factor / size)    # one truncation, as Horovod
            if op is Average and size > 1:
                tensor.div_(size)
            return scale_(tensor, postscale_factor)

        return _Pending([work], finish)

    def _start_reducescatter(self, tensor, name, op, process_set, prescale_factor,
                             postscale_factor):
        rows = shard_sizes(tensor.shape[0], len(process_set.ranks))
        me = process_set.ranks.index(self.rank())
        first = sum(rows[:me])
        full = self._start_allreduce(tensor.clone(), name, op, process_set, prescale_factor,
                                     postscale_factor)
        return Then(full, lambda out: out.narrow(0, first, rows[me]).clone())

    # --- data movement --------------------------------------------------
    def _shapes(self, tensor, process_set, what, extra=()):
        """Every rank's row count (and `extra` ints), after checking that all ranks
        agree on dtype and trailing shape. One small blocking all_gather."""
        torch = self.torch
        trailing = list(tensor.shape[1:])
        dtype = str(tensor.dtype).replace("torch.", "")
        code = _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)
        head = [tensor.dim(), code, math.prod(trailing)]
        # On the data's device: a group with only NCCL cannot move CPU tensors.
        mine = torch.tensor(head + (trailing + [-1] * _TRAILING)[:_TRAILING]
                            + [tensor.shape[0], *extra], dtype=torch.int64, device=tensor.device)
        everyone = [torch.empty_like(mine) for _ in process_set.ranks]
        self.dist.all_gather(everyone, mine, group=self._library_set(process_set))
        table = torch.stack(everyone)
        agree = len(head) + _TRAILING
        if not bool((table[:, :agree] == table[0, :agree]).all()):
            described = {r: f"{tuple(row[len(head):len(head) + row[0] - 1])} code {row[1]}"
                         for r, row in zip(process_set.ranks, table.tolist())}
            raise ValueError(f"{what}: ranks disagree on the tensor's dtype or its shape beyond "
                             f"dimension 0 (rank: trailing shape, dtype code): {described}")
        return table[:, agree:].tolist()

    def _start_allgather(self, tensor, name, process_set):
        torch = self.torch
        rows = [row[0] for row in self._shapes(tensor, process_set, "allgather")]
        longest = max(rows)
        if longest == 0:
            return Done(tensor.new_empty((0, *tensor.shape[1:])))
        send = tensor
        if tensor.shape[0] != longest:           # gloo's all_gather wants equal sizes
            send = tensor.new_zeros((longest, *tensor.shape[1:]))
            send[:tensor.shape[0]] = tensor
        parts = [torch.empty_like(send) for _ in rows]
        work = self.dist.all_gather(parts, send, group=self._library_set(process_set),
                                    async_op=True)
        return _Pending([work], lambda: torch.cat([p[:n] for p, n in zip(parts, rows)]))

    def _start_broadcast(self, tensor, root, name, process_set):
        work = self.dist.broadcast(tensor, src=root, group=self._library_set(process_set),
                                   async_op=True)
        return _Pending([work], lambda: tensor)

    def _start_alltoall(self, tensor, splits, name, process_set):
        torch = self.torch
        table = self._shapes(tensor, process_set, "alltoall", extra=splits)
        me = process_set.ranks.index(self.rank())
        received = [row[1 + me] for row in table]
        out = tensor.new_empty((sum(received), *tensor.shape[1:]))
        counts = torch.tensor(received, dtype=torch.int32)
        if all(row[0] == 0 for row in table):
            return Done((out, counts))
        work = self.dist.all_to_all_single(out, tensor, output_split_sizes=received,
                                           input_split_sizes=splits,
                                           group=self._library_set(process_set), async_op=True)
        return _Pending([work], lambda: (out, counts))

    # --- synchronous collectives ----------------------------------------
    def _broadcast_object(self, obj, root, name, process_set):
        box = [obj]
        self.dist.broadcast_object_list(box, src=root, group=self._library_set(process_set))
        return box[0]

    def _allgather_object(self, obj, name, process_set):
        out = [None] * len(process_set.ranks)
        self.dist.all_gather_object(out, obj, group=self._library_set(process_set))
        return out

    def _barrier(self, process_set):
        self.dist.barrier(group=self._library_set(process_set))

    def _join(self, device):
        where = "cpu" if device < 0 else f"cuda:{device}"     # Horovod's meaning of device
        stamp = self.torch.tensor([time.time()], dtype=self.torch.float64, device=where)
        everyone = [self.torch.empty_like(stamp) for _ in range(self.size())]
        self.dist.all_gather(everyone, stamp)
        return int(self.torch.cat(everyone).argmax())

    # --- process sets ---------------------------------------------------
    def _add_library_set(self, process_set):
        self._set_ids += 1          # the same on every rank: sets are added collectively
        return self._set_ids, self.dist.new_group(process_set.ranks)

    def _remove_library_set(self, process_set, library_set):
        if self.rank() in process_set.ranks:
            self.dist.destroy_process_group(library_set)

    def _close(self):
        # After a failed collective, a teardown's barrier would wait on the lost rank.
        if self._owns_group and self.dist.is_initialized() and not self._failed:
            tear_down(self.dist)


def tear_down(dist):
    """Destroy the default process group without aborting a peer.

    Gloo aborts a process ("terminate called without an active exception",
    about 1 run in 8 with 3 ranks here) when a peer closes its connections
    while this process is still inside its own teardown. So: a barrier (no
    collective is left running), the teardown, then no rank leaves before
    every rank has finished its teardown, counted on the rendezvous store,
    which does not go through gloo.
    """
    store = dist.distributed_c10d._get_default_store()
    size = dist.get_world_size()
    dist.barrier()
    dist.destroy_process_group()
    _wait_for_everyone(store, "pipe_horovod.torn_down", size)
