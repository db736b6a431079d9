"""What every framework adapter shares, as Horovod's horovod/common: start and identity,
process sets, collectives on objects, the failure types and the elastic core.

It stands on the engine (and the collectives and pipeline beneath the adapters) and
imports no adapter: pipe_horovod.torch, pipe_horovod.tensorflow and pipe_horovod.keras
re-export these very names, so `hvd.rank()` is one function whichever one a script
imports. Each module is named for what it holds:

    basics.py        init, shutdown, rank/size and the build and capability queries
    process_sets.py  ProcessSet, add_process_set, remove_process_set
    objects.py       barrier, join, broadcast_object, allgather_object
    exceptions.py    HorovodInternalError, HostsUpdatedInterrupt, RepeatedFailureError
    elastic.py       State, ObjectState and the `run` loop the adapters' `run` call
    model_state.py   a model's and its optimizer's variables as elastic state (Keras)
    tensor_ops.py    the engine's collectives on its tensors, without autograd
"""
from ..engine import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from .basics import (ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built,
                     gloo_enabled, init, is_homogeneous, is_initialized, local_rank, local_size,
                     mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank, rocm_built,
                     shutdown, size, start_timeline, stop_timeline)
from .exceptions import (HorovodInternalError, HostsUpdatedInterrupt, RankLostError,
                         RepeatedFailureError, WaitError, WaitTimeoutError)
from .objects import allgather_object, barrier, broadcast_object, join
from .process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set

__all__ = [
    "Adasum", "Average", "HorovodInternalError", "HostsUpdatedInterrupt", "Max", "Min",
    "Product", "ProcessSet", "RankLostError", "ReduceOp", "RepeatedFailureError", "Sum",
    "WaitError", "WaitTimeoutError", "add_process_set", "allgather_object", "barrier",
    "broadcast_object", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built",
    "global_process_set", "gloo_built", "gloo_enabled", "init", "is_homogeneous",
    "is_initialized", "join", "local_rank", "local_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "rank", "remove_process_set", "rocm_built",
    "shutdown", "size", "start_timeline", "stop_timeline"]
