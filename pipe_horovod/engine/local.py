"""One process, no communication: `python train.py` just works.

Every collective over one rank is the identity (up to Horovod's scaling),
so each operation is complete the moment it starts.
"""
from .base import DEFAULT_TIMEOUT_S, Done, Engine, scale_


class LocalEngine(Engine):
    name = "local"

    def __init__(self, comm=None, process_sets=None, timeout_s=DEFAULT_TIMEOUT_S):
        super().__init__(timeout_s)
        if comm not in (None, [], [0]):
            raise ValueError(f"the local engine runs one rank; comm={comm!r} names others")
        self._register_process_sets(process_sets)

    def rank(self):
        return 0

    def size(self):
        return 1

    def local_rank(self):
        return 0

    def local_size(self):
        return 1

    def cross_rank(self):
        return 0

    def cross_size(self):
        return 1

    def is_homogeneous(self):
        return True

    @classmethod
    def build_info(cls):
        return {"mpi_built": False, "gloo_built": False, "nccl_built": 0, "ddl_built": False,
                "ccl_built": False, "cuda_built": False, "rocm_built": False}

    def capabilities(self):
        return {**self.build_info(), "mpi_enabled": False, "mpi_threads_supported": None,
                "gloo_enabled": False}

    def _start_allreduce(self, tensor, name, op, process_set, prescale_factor, postscale_factor):
        # Sum, Average, Min, Max, Product and Adasum of one value: that value.
        scale_(tensor, prescale_factor)
        return Done(scale_(tensor, postscale_factor))

    def _start_reducescatter(self, tensor, name, op, process_set, prescale_factor,
                             postscale_factor):
        out = tensor.clone()
        scale_(out, prescale_factor)
        return Done(scale_(out, postscale_factor))

    def _start_allgather(self, tensor, name, process_set):
        return Done(tensor.clone())

    def _start_broadcast(self, tensor, root, name, process_set):
        return Done(tensor)

    def _start_alltoall(self, tensor, splits, name, process_set):
        import torch

        return Done((tensor.clone(), torch.tensor(splits, dtype=torch.int32)))

    def _start_barrier(self, name, process_set):
        return Done(None)

    def _join(self, device):
        return 0

    def _add_library_set(self, process_set):
        raise AssertionError("unreachable: one rank has no set besides the global one")

    def _remove_library_set(self, process_set, library_set):
        pass
