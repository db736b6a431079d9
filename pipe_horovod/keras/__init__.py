"""Keras 3 adapter, named like `horovod.keras` so a script switches by one import.

    import pipe_horovod.keras as hvd
    hvd.init()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
    model.compile(optimizer=opt, ...)
    model.fit(..., callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])

fit applies every gradient in flight after each epoch and when it ends
(DistributedOptimizer's flush_in_fit), so what it validates, saves and leaves
behind holds every computed gradient, the same on every rank.

Backends: TensorFlow (graph mode or eager; not XLA) and torch. The rest of
horovod.tensorflow.keras's names are here too (identity, build flags,
process sets, timeline, load_model, the value collectives, `elastic`), each
delegating to the one pipe_horovod implementation.
"""
from ..compression import Compression
from ..common import (Adasum, Average, ProcessSet, Sum, add_process_set, allgather_object,
                      barrier, broadcast_object, ccl_built, cross_rank, cross_size, cuda_built,
                      ddl_built, global_process_set, gloo_built, gloo_enabled, init,
                      is_homogeneous, is_initialized, local_rank, local_size, mpi_built,
                      mpi_enabled, mpi_threads_supported, nccl_built, rank, remove_process_set,
                      rocm_built, shutdown, size, start_timeline, stop_timeline)
from .optimizer import DistributedOptimizer, PartialDistributedOptimizer
from . import callbacks, elastic
from .callbacks import broadcast_variables
from .functions import allgather, allreduce, broadcast, broadcast_global_variables, reducescatter
from .saving import load_model

__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "PartialDistributedOptimizer",
    "ProcessSet", "Sum",
    "add_process_set", "allgather", "allgather_object", "allreduce", "barrier", "broadcast",
    "broadcast_global_variables", "broadcast_object", "broadcast_variables", "callbacks",
    "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "elastic",
    "global_process_set",
    "gloo_built", "gloo_enabled", "init", "is_homogeneous", "is_initialized", "load_model",
    "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported",
    "nccl_built", "rank", "reducescatter", "remove_process_set", "rocm_built", "shutdown",
    "size", "start_timeline", "stop_timeline"]
