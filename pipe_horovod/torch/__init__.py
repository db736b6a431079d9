"""PyTorch adapter, named like `horovod.torch` so a script switches by one import.

    import pipe_horovod.torch as hvd
    hvd.init()
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
"""
from ..compression import Compression
from .checkpoint import flush_into
from .functions import broadcast_optimizer_state, broadcast_parameters
from .mpi_ops import *  # noqa: F401,F403 -- Horovod's collective API, names as in horovod.torch
from .mpi_ops import __all__ as _mpi_ops_names
from .optimizer import DistributedOptimizer
from .sync_batch_norm import SyncBatchNorm
from . import elastic  # hvd.elastic: run, TorchState, ElasticSampler

__all__ = sorted(["Compression", "DistributedOptimizer", "SyncBatchNorm",
                  "broadcast_optimizer_state", "broadcast_parameters", "flush_into",
                  *_mpi_ops_names])
