"""PyTorch adapter, named like `horovod.torch` so a script switches by one import.

    import pipe_horovod.torch as hvd
    hvd.init()
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
"""
from ..compression import Compression
from ..engine import (Average, Sum, allgather_object, barrier, broadcast_object, init,
                      is_initialized, local_rank, local_size, rank, shutdown, size)
from .functions import (allreduce, allreduce_, broadcast, broadcast_, broadcast_optimizer_state,
                        broadcast_parameters)
from .optimizer import DistributedOptimizer

__all__ = [
    "Average", "Sum", "Compression", "DistributedOptimizer", "allgather_object", "allreduce",
    "allreduce_", "barrier", "broadcast", "broadcast_",
    "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters", "init",
    "is_initialized", "local_rank", "local_size", "rank", "shutdown", "size",
]
