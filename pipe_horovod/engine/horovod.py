"""Horovod's torch ops: Gloo or MPI controller on CPU, NCCL on GPU.

Horovod negotiates each reduction by tensor name, so ranks may start them
in different orders; it allows one operation per name in flight, which the
base class enforces with a readable error before the C++ core sees it.
Horovod 0.28.1's torch ops reject bfloat16, so bfloat16 tensors travel as a
float32 copy (exact: every bfloat16 is a float32) and are rounded back on
`wait`.
"""
from .base import Average, Engine, check_root


def _torch():
    import torch

    return torch


class HorovodEngine(Engine):
    name = "horovod"

    def __init__(self):
        super().__init__()
        import horovod.torch as hvd

        self.hvd = hvd
        self._object_calls = 0
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
        hvd_op = self.hvd.Average if op is Average else self.hvd.Sum
        staged = tensor.float() if tensor.dtype == _torch().bfloat16 else None
        wire = tensor if staged is None else staged
        return self.hvd.allreduce_async_(wire, name=name, op=hvd_op), staged

    def _poll(self, handle):
        return self.hvd.poll(handle.backend[0])

    def _wait(self, handle):
        hvd_handle, staged = handle.backend
        result = self.hvd.synchronize(hvd_handle)
        if staged is None:
            return result
        return handle.tensor.copy_(staged)

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

    def shutdown(self):
        super().shutdown()
        self.hvd.shutdown()

    def controllers(self):
        hvd = self.hvd
        return {"gloo": hvd.gloo_enabled(), "mpi": hvd.mpi_enabled(), "nccl": hvd.nccl_built()}
