"""torch.distributed: gloo on CPU, nccl on GPU, with Horovod's name matching.

torch.distributed matches collectives by call order; Horovod by name, after
comparing every rank's shape, dtype, op and root. So every async collective
here goes through a negotiation thread (negotiation.py): it starts once
every rank of the set has started that name, in an order all ranks agree
on, and a disagreement is Horovod's error on every rank (mismatch.py)
instead of a gloo abort or a half-written broadcast. Average is a Sum
divided on `wait` (gloo's AVG refuses integer tensors). Horovod's other
collectives map onto torch's:

- allgather with first dimensions that differ across ranks (gloo's
  all_gather wants equal sizes): every rank's row count is in the
  negotiated records, so one all_gather padded to the longest;
- alltoall: a small all_gather of every rank's splits, then
  all_to_all_single with uneven splits;
- reducescatter: an allreduce of a copy, of which each rank keeps its rows
  (Horovod's uneven split; twice the bytes of a true reduce-scatter, but
  every backend and row count works);
- Adasum: an all_gather and the combination rule of engine/adasum.py;
- process sets: torch.distributed.new_group (two per set: one for the
  blocking calls of the caller's thread, one for the negotiation thread);
- join: Horovod's: a joined rank stands in with zeros for the others'
  allreduces until every rank joined, and returns the rank that joined last.

Barrier is a negotiated name like any other (every rank has announced it:
it is done); object collectives are built on broadcast and allgather
(objects.py), so they are matched and compared too.

Launched by Open MPI's `mpirun` instead of torchrun (PIPE_HOROVOD_ENGINE=torch),
the ranks come from mpirun's OMPI_COMM_WORLD_* variables and the rendezvous
from MASTER_ADDR/MASTER_PORT (`mpirun -x MASTER_ADDR=host -x MASTER_PORT=port`).
"""
import atexit
import datetime
import math
import os
import time

from . import rendezvous
from .adasum import combine as adasum_combine
from .base import DEFAULT_TIMEOUT_S, Adasum, Average, Done, Engine, \
    EngineError, Max, Min, Product, Sum, Then, Work, WorkList, scale_, \
    shard_sizes
from .stall import label_or_name, torch_board
from .mismatch import DTYPES, encode
from .negotiation import INLINE_BYTES, SLICE_S, Negotiator, Request, key_of

# How Horovod's ops map onto torch.distributed's (Average: SUM, divided on wait).
_OPS = {Average: "SUM", Sum: "SUM", Min: "MIN", Max: "MAX", Product: "PRODUCT"}
_OP_NAMES = {"Average": "SUM", "Sum": "SUM", "Min": "MIN", "Max": "MAX", "Product": "PRODUCT"}
# The same ops on two ranks' values, for small collectives settled from the cycle's bytes.
_COMBINE = {Average: lambda a, b: a.add_(b), Sum: lambda a, b: a.add_(b),
            Min: lambda a, b: a.copy_(a.minimum(b)), Max: lambda a, b: a.copy_(a.maximum(b)),
            Product: lambda a, b: a.mul_(b)}


def _finish_allreduce(tensor, op, size, postscale_factor):
    """A reduced sum becomes the op's result: Average divides, then the postscale."""
    if op is Average and not tensor.is_floating_point():
        return scale_(tensor, postscale_factor / size)    # one truncation, as Horovod
    if op is Average and size > 1:
        tensor.div_(size)
    return scale_(tensor, postscale_factor)


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


NAP_S = 0.05        # a wait for the negotiation thread looks at its deadline this often


class _Negotiated(Work):
    """A collective waiting for every rank to start it, then running (negotiation.py)."""

    def __init__(self, request):
        self.request = request

    def poll(self):
        request = self.request
        return request.error is not None or (request.work is not None and request.work.poll())

    def nap(self, seconds):
        """Pause a wait: until the negotiation thread has run or refused it (a small
        collective then is complete already), at most NAP_S; polling in short sleeps
        would take the GIL the thread needs to finish its cycle."""
        if self.request.done():
            time.sleep(seconds)
        else:
            self.request.wait_done(NAP_S)

    def wait(self):
        request = self.request
        if request.error is not None:
            raise request.error
        return request.work.wait()


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


_FAILED_KEY = "pipe_horovod.failed"     # ranks whose collectives failed: they skip teardown


def _wait_for_everyone(store, key, size, timeout_s=60.0):
    """Count this rank on `store` and wait, bounded, until `size` ranks have.
    False when a rank failed (it will never count itself)."""
    store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    try:
        while store.add(key, 0) < size and time.monotonic() < deadline:
            if store.add(_FAILED_KEY, 0):
                return False
            time.sleep(0.01)
    except RuntimeError:
        pass        # the store's host (rank 0 under plain env://) has left: everyone is done
    return True


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
            # The group's timeout bounds torch's own waits (its rendezvous, a collective
            # that failed) as our own deadline bounds every wait (faults.py).
            bound = {} if math.isinf(timeout_s) else {
                "timeout": datetime.timedelta(seconds=timeout_s)}
            self._rendezvous(lambda: dist.init_process_group(backend=backend, **bound),
                             timeout_s)
            # Scripts rarely call shutdown(); exiting with the group alive lets gloo
            # abort the process ("terminate called without an active exception").
            atexit.register(self.shutdown)
        self._local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self._local_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        if comm not in (None, []) and list(comm) != list(range(self.size())):
            raise ValueError(f"the torch engine spans every rank torchrun started; comm={comm!r} "
                             "(a sub-communicator) is not supported: use process_sets")
        self._set_ids = 0
        self._negotiators = {}          # process_set_id -> Negotiator (sets this rank is in)
        self._join_device = "cpu"
        self._negotiate_on(0, list(range(self.size())))
        if self.size() > 1:
            self._board = torch_board(dist.distributed_c10d._get_default_store(), self.size())
        self._register_process_sets(process_sets)

    @staticmethod
    def _rendezvous(init, timeout_s):
        """`init()` (torch's env:// rendezvous), its failures naming MASTER_ADDR:MASTER_PORT
        and what answers there; ranks but 0 first check that rank 0's store does, where
        torch would wait forever on another program (rendezvous.py)."""
        env = os.environ
        if rendezvous.served_by_launcher(env) or "MASTER_PORT" not in env:
            init()
            return
        addr, port, rank = env.get("MASTER_ADDR", "127.0.0.1"), int(env["MASTER_PORT"]), \
            int(env.get("RANK", 0))
        if rank != 0:
            rendezvous.check(addr, port, rank, timeout_s if math.isfinite(timeout_s)
                             else DEFAULT_TIMEOUT_S)
        try:
            init()
        except RuntimeError as exc:         # torch's DistNetworkError, DistStoreError
            raise rendezvous.explain(exc, addr, port, rank) from exc

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

    # --- negotiation -------------------------------------------------------
    def _negotiate_on(self, set_id, ranks):
        """Make set `set_id`'s negotiation group (collective: every rank calls it)."""
        group = self.dist.new_group(ranks)
        if self.rank() in ranks:
            self._negotiators[set_id] = Negotiator(self.torch, self.dist, group, ranks,
                                                   self.rank(), self._stand_in)

    def _negotiate(self, kind, name, tensor, process_set, run, op=None, root=-1,
                   prescale_factor=1.0, postscale_factor=1.0, settle=None):
        """Start `run(records)` once every rank of the set started `name` alike; or, for a
        small CPU tensor, `settle(records)` from every rank's bytes sent in the cycle."""
        row = encode(key_of(name), kind, tensor, op, root, prescale_factor, postscale_factor,
                     name)
        inline = None
        if settle is not None and tensor.device.type == "cpu" and \
                tensor.numel() * tensor.element_size() <= INLINE_BYTES:
            inline = tensor
        negotiator = self._negotiators[process_set.process_set_id]
        return _Negotiated(negotiator.submit(Request(name, row, run, inline,
                                                     settle if inline is not None else None)))

    def _group(self, process_set):
        return self._negotiators[process_set.process_set_id].group

    def _stand_in(self, record):
        """A joined rank's part in an allreduce it never started: zeros (Horovod's join)."""
        torch = self.torch
        dtype = getattr(torch, DTYPES[record.dtype])
        zeros = torch.zeros(record.shape, dtype=dtype, device=self._join_device)
        group = self._negotiators[0].group
        if record.op == "Adasum":
            parts = [torch.empty_like(zeros) for _ in range(self.size())]
            work = self.dist.all_gather(parts, zeros, group=group, async_op=True)
        else:
            work = self.dist.all_reduce(zeros, op=getattr(self.dist.ReduceOp,
                                                          _OP_NAMES[record.op]),
                                        group=group, async_op=True)
        return _Pending([work], lambda: zeros)

    # --- reductions -----------------------------------------------------
    def _start_allreduce(self, tensor, name, op, process_set, prescale_factor, postscale_factor):
        def settle(records):
            """Every rank's bytes, combined in rank order: the same result on every rank."""
            total = None
            for record in records:
                part = scale_(record.data.view(tensor.dtype).view(tensor.shape),
                              prescale_factor)
                total = part if total is None else _COMBINE[op](total, part)
            tensor.copy_(total)
            return Done(_finish_allreduce(tensor, op, len(records), postscale_factor))

        return self._negotiate("allreduce", name, tensor, process_set,
                               lambda records: self._run_allreduce(
                                   tensor, op, process_set, prescale_factor, postscale_factor),
                               op, -1, prescale_factor, postscale_factor,
                               None if op is Adasum else settle)

    def _run_allreduce(self, tensor, op, process_set, prescale_factor, postscale_factor):
        group, size = self._group(process_set), len(process_set.ranks)
        scale_(tensor, prescale_factor)
        if op is Adasum:
            parts = [self.torch.empty_like(tensor) for _ in range(size)]
            work = self.dist.all_gather(parts, tensor, group=group, async_op=True)
            return _Pending([work], lambda: scale_(tensor.copy_(adasum_combine(parts)),
                                                   postscale_factor))
        work = self.dist.all_reduce(tensor, op=getattr(self.dist.ReduceOp, _OPS[op]),
                                    group=group, async_op=True)
        return _Pending([work], lambda: _finish_allreduce(tensor, op, size, postscale_factor))

    def _start_reducescatter(self, tensor, name, op, process_set, prescale_factor,
                             postscale_factor):
        rows = shard_sizes(tensor.shape[0], len(process_set.ranks))
        me = process_set.ranks.index(self.rank())
        first = sum(rows[:me])

        def run(records):
            full = self._run_allreduce(tensor.clone(), op, process_set, prescale_factor,
                                       postscale_factor)
            return Then(full, lambda out: out.narrow(0, first, rows[me]).clone())

        return self._negotiate("reducescatter", name, tensor, process_set, run, op, -1,
                               prescale_factor, postscale_factor)

    # --- data movement --------------------------------------------------
    def _start_allgather(self, tensor, name, process_set):
        trailing = tensor.shape[1:]

        def settle(records):
            return Done(self.torch.cat([r.data.view(tensor.dtype).view(-1, *trailing)
                                        for r in records]))

        return self._negotiate("allgather", name, tensor, process_set,
                               lambda records: self._run_allgather(tensor, records, process_set),
                               settle=settle if trailing.numel() else None)

    def _run_allgather(self, tensor, records, process_set):
        torch = self.torch
        rows = [record.shape[0] for record in records]
        longest = max(rows)
        if longest == 0:
            return Done(tensor.new_empty((0, *tensor.shape[1:])))
        send = tensor
        if tensor.shape[0] != longest:           # gloo's all_gather wants equal sizes
            send = tensor.new_zeros((longest, *tensor.shape[1:]))
            send[:tensor.shape[0]] = tensor
        parts = [torch.empty_like(send) for _ in rows]
        work = self.dist.all_gather(parts, send, group=self._group(process_set), async_op=True)
        return _Pending([work], lambda: torch.cat([p[:n] for p, n in zip(parts, rows)]))

    def _start_broadcast(self, tensor, root, name, process_set):
        def run(records):
            work = self.dist.broadcast(tensor, src=root, group=self._group(process_set),
                                       async_op=True)
            return _Pending([work], lambda: tensor)

        def settle(records):
            if self.rank() != root:
                data = records[process_set.ranks.index(root)].data
                tensor.copy_(data.view(tensor.dtype).view(tensor.shape))
            return Done(tensor)

        return self._negotiate("broadcast", name, tensor, process_set, run, root=root,
                               settle=settle)

    def _start_alltoall(self, tensor, splits, name, process_set):
        return self._negotiate("alltoall", name, tensor, process_set,
                               lambda records: self._run_alltoall(tensor, splits, process_set))

    def _start_alltoall_known(self, tensor, splits, received, name, process_set):
        """No exchange of splits (a blocking all_gather on the negotiation thread, which
        would hold every collective behind it until the gloo queue drains: the two-stage
        chunks' alltoalls ran at about 60% of the link with it); the negotiated records
        show every rank's rows, which must be the same."""
        def run(records):
            rows = [record.shape[0] if record.shape else 0 for record in records]
            if any(n != tensor.shape[0] for n in rows):
                raise EngineError(f"alltoall {name!r}: every rank must send the same rows "
                                  f"here, the ranks sent {rows}; the tensor's size or the "
                                  "codec differs across ranks")
            if sum(received) == 0 and not any(splits):
                return Done((tensor.new_empty((0, *tensor.shape[1:])),
                             self.torch.tensor(received, dtype=self.torch.int32)))
            out = tensor.new_empty((sum(received), *tensor.shape[1:]))
            work = self.dist.all_to_all_single(out, tensor, output_split_sizes=list(received),
                                               input_split_sizes=list(splits),
                                               group=self._group(process_set), async_op=True)
            return _Pending([work], lambda: (out, self.torch.tensor(received,
                                                                   dtype=self.torch.int32)))

        return self._negotiate("alltoall", name, tensor, process_set, run)

    def _run_alltoall(self, tensor, splits, process_set):
        """On the negotiation thread, where every rank runs the same calls in the same order,
        so the blocking exchange of splits cannot interleave with anything else."""
        torch = self.torch
        group = self._group(process_set)
        mine = torch.tensor(splits, dtype=torch.int64, device=tensor.device)
        table = [torch.empty_like(mine) for _ in process_set.ranks]
        self._negotiators[process_set.process_set_id].await_work(
            self.dist.all_gather(table, mine, group=group, async_op=True))
        me = process_set.ranks.index(self.rank())
        received = [int(row[me]) for row in table]
        out = tensor.new_empty((sum(received), *tensor.shape[1:]))
        counts = torch.tensor(received, dtype=torch.int32)
        if all(int(row.sum()) == 0 for row in table):
            return Done((out, counts))
        work = self.dist.all_to_all_single(out, tensor, output_split_sizes=received,
                                           input_split_sizes=splits, group=group,
                                           async_op=True)
        return _Pending([work], lambda: (out, counts))

    # --- barrier and join -------------------------------------------------
    def _start_barrier(self, name, process_set):
        """Done once every rank has announced it: the negotiation is the barrier."""
        return self._negotiate("barrier", name, None, process_set,
                               lambda records: Done(None))

    def _join(self, device):
        self._join_device = "cpu" if device < 0 else f"cuda:{device}"   # Horovod's meaning
        negotiator = self._negotiators[0]
        done = negotiator.start_join()
        self._wait_for_join(done.is_set, done.wait)
        return negotiator.joined_last()

    # --- stalls (stall.py) ------------------------------------------------
    def _matched(self, handle):
        """Has every rank started `handle`'s collective (it runs: slow, not stalled)?"""
        def started(work):
            if isinstance(work, _Negotiated):
                return work.request.work is not None or work.request.error is not None
            if isinstance(work, WorkList):
                return all(started(w) for w in work.works)
            if isinstance(work, Then):
                return started(work.work)
            return True
        return started(handle.backend)

    def _missing(self, call):
        missing = {}
        wire = call.wire or ""
        for negotiator in self._negotiators.values():
            for name, ranks in negotiator.waiting_on().items():
                if name != wire and not name.startswith(wire + "."):   # (grouped: its members)
                    continue
                for rank in ranks:
                    missing.setdefault(rank, []).append(name)
        if not missing:
            return ""
        return "; missing ranks: " + ", ".join(
            f"{rank}: [{', '.join(map(label_or_name, names))}]"
            for rank, names in sorted(missing.items()))

    # --- process sets ---------------------------------------------------
    def _add_library_set(self, process_set):
        self._set_ids += 1          # the same on every rank: sets are added collectively
        library_set = self.dist.new_group(process_set.ranks)
        self._negotiate_on(self._set_ids, process_set.ranks)
        return self._set_ids, library_set

    def _remove_library_set(self, process_set, library_set):
        negotiator = self._negotiators.pop(process_set.process_set_id, None)
        if negotiator is not None:
            negotiator.stop()
            self.dist.destroy_process_group(negotiator.group)
        if self.rank() in process_set.ranks:
            self.dist.destroy_process_group(library_set)

    def _close(self):
        for negotiator in self._negotiators.values():   # no thread of ours left in torch
            negotiator.stop(join_s=2 * SLICE_S + 1.0)
        # After a failed collective, a teardown's barrier would wait on the lost rank;
        # the ranks still in theirs stop waiting for this one.
        if self._owns_group and self.dist.is_initialized():
            if self._failed:
                try:
                    self.dist.distributed_c10d._get_default_store().add(_FAILED_KEY, 1)
                except RuntimeError:
                    pass
            else:
                tear_down(self.dist, self.timeout_s)


def tear_down(dist, timeout_s=60.0):
    """Destroy the default process group without aborting a peer.

    Gloo aborts a process ("terminate called without an active exception",
    about 1 run in 8 with 3 ranks here) when a peer closes its connections
    while this process is still inside its own teardown. So: every rank
    counted on the rendezvous store, which does not go through gloo (no
    collective is left running; a rank whose collectives failed, e.g. one
    that found this rank had ended early, says so there instead and this
    one leaves without teardown), the teardown, then no rank leaves before
    every rank has finished its teardown.
    """
    store = dist.distributed_c10d._get_default_store()
    size = dist.get_world_size()
    if not _wait_for_everyone(store, "pipe_horovod.ending", size, timeout_s):
        return
    dist.destroy_process_group()
    _wait_for_everyone(store, "pipe_horovod.torn_down", size)
