"""Keras 3 adapter, named like `horovod.keras` so a script switches by one import.

    import pipe_horovod.keras as hvd
    hvd.init()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
    model.compile(optimizer=opt, ...)
    model.fit(..., callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                              hvd.callbacks.PipelineFlushCallback()])

Backends: TensorFlow (graph mode or eager; not XLA) and torch.
"""
import numpy as np

from ..compression import Compression
from ..engine import (Average, Sum, allgather_object, barrier, broadcast_object,
                      global_process_set, init, is_initialized, local_rank, local_size, rank,
                      shutdown, size)
from . import callbacks
from .callbacks import broadcast_variables
from .optimizer import DistributedOptimizer


def allreduce(value, name=None, op=Average):
    """The reduction of a number or NumPy array over every rank (for metrics, counts).

    Unnamed calls get names in call order, so every rank must make them in the same order."""
    import torch

    from .. import engine

    tensor = torch.from_numpy(np.array(value, copy=True))
    return engine.wait(engine.allreduce_async(tensor, name, op)).numpy()


__all__ = ["Average", "Sum", "Compression", "DistributedOptimizer", "allgather_object",
           "allreduce", "barrier", "broadcast_object",
           "broadcast_variables", "callbacks", "global_process_set", "init", "is_initialized",
           "local_rank", "local_size", "rank", "shutdown", "size"]
