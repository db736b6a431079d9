"""torch.distributed: gloo on CPU, nccl on GPU, with async work handles.

Unlike Horovod, torch.distributed matches collectives by call order, not by
name: callers (the pipeline core) must start reductions in the same order
on every rank. Gloo has no AVG op, so Average is a Sum divided on `wait`.
"""
import atexit
import os

from .base import Average, Engine, check_root


class TorchDistEngine(Engine):
    name = "torch"

    def __init__(self, backend=None):
        super().__init__()
        import torch
        import torch.distributed as dist

        self.torch = torch
        self.dist = dist
        self._owns_group = not dist.is_initialized()
        if self._owns_group:
            if backend is None:
                backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend=backend)
            # Scripts rarely call shutdown(); exiting with the group alive lets gloo
            # abort the process ("terminate called without an active exception").
            atexit.register(self.shutdown)
        self._local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self._local_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))

    def rank(self):
        return self.dist.get_rank()

    def size(self):
        return self.dist.get_world_size()

    def local_rank(self):
        return self._local_rank

    def local_size(self):
        return self._local_size

    def _start_allreduce(self, tensor, name, op):
        return self.dist.all_reduce(tensor, op=self.dist.ReduceOp.SUM, async_op=True)

    def _poll(self, handle):
        return handle.backend.is_completed()

    def _wait(self, handle):
        handle.backend.wait()
        if handle.op is Average and self.size() > 1:
            handle.tensor.div_(self.size())
        return handle.tensor

    def broadcast(self, tensor, root):
        check_root(root, self.size())
        self.dist.broadcast(tensor, src=root)
        return tensor

    def broadcast_object(self, obj, root):
        check_root(root, self.size())
        box = [obj]
        self.dist.broadcast_object_list(box, src=root)
        return box[0]

    def allgather_object(self, obj):
        out = [None] * self.size()
        self.dist.all_gather_object(out, obj)
        return out

    def barrier(self):
        self.dist.barrier()

    def _close(self):
        if self._owns_group and self.dist.is_initialized():
            # Without a barrier a fast rank tears down gloo's connections while a
            # slower one still uses them, and the slow one aborts (seen in CI).
            self.dist.barrier()
            self.dist.destroy_process_group()
