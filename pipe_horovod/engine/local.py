"""One process, no communication: `python train.py` just works.

Average and Sum over one rank are the identity, so a reduction is complete
the moment it starts.
"""
from .base import Engine, check_root


class LocalEngine(Engine):
    name = "local"

    def rank(self):
        return 0

    def size(self):
        return 1

    def local_rank(self):
        return 0

    def local_size(self):
        return 1

    def _start_allreduce(self, tensor, name, op):
        return None

    def _poll(self, handle):
        return True

    def _wait(self, handle):
        return handle.tensor

    def broadcast(self, tensor, root):
        check_root(root, 1)
        return tensor

    def broadcast_object(self, obj, root):
        check_root(root, 1)
        return obj

    def allgather_object(self, obj):
        return [obj]

    def barrier(self):
        pass

