"""TensorFlow 2 custom loops, named like `horovod.tensorflow` so a script switches by one import.

    import pipe_horovod.tensorflow as hvd
    hvd.init()
    ...
    tape = hvd.DistributedGradientTape(tape)          # pipelined: pipeline_depth, default 2
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    if first_batch:
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables, root_rank=0)
    ...
    for grads in tape.flush():                         # the gradients still in flight
        opt.apply_gradients(zip(grads, model.trainable_variables))

Horovod 0.28.1's TensorFlow ops do not build against TensorFlow >= 2.16; this
runs on today's TensorFlow through the same engines as the other adapters
(horovodrun with Gloo or MPI, torchrun, one plain process). Identity, build
queries and process sets are pipe_horovod.common's (one implementation);
gradient_tape.py says what tape.gradient returns while the pipeline fills.
Elastic training: `hvd.elastic` (TensorFlowState, TensorFlowKerasState, run),
whose commits carry the tapes' gradients in flight. Not here: TF1 sessions and
hooks (BroadcastGlobalVariablesHook).
"""
from ..compression import Compression
from ..common import (Adasum, Average, Max, Min, Product, ProcessSet, Sum, add_process_set,
                      barrier, ccl_built, cross_rank, cross_size, cuda_built, ddl_built,
                      global_process_set, gloo_built, gloo_enabled, init, is_homogeneous,
                      is_initialized, local_rank, local_size, mpi_built, mpi_enabled,
                      mpi_threads_supported, nccl_built, rank, remove_process_set, rocm_built,
                      shutdown, size, start_timeline, stop_timeline)
from . import elastic
from .functions import (allgather_object, broadcast_global_variables, broadcast_object,
                        broadcast_object_fn, broadcast_variables)
from .gradient_tape import (DistributedGradientTape, GradientsInFlight,
                            PartialDistributedGradientTape, flush,
                            write_run_summary)
from .identity_ops import (local_rank_op, local_size_op, process_set_included_op, rank_op,
                           size_op)
from .mpi_ops import (allgather, allreduce, alltoall, broadcast, broadcast_, grouped_allgather,
                      grouped_allreduce, grouped_reducescatter, join, reducescatter)
from .optimizer import DistributedOptimizer
from .sync_batch_norm import SyncBatchNormalization
from .util import _executing_eagerly

__all__ = [
    "Adasum", "Average", "Compression", "DistributedGradientTape", "DistributedOptimizer",
    "GradientsInFlight", "Max", "Min", "PartialDistributedGradientTape", "ProcessSet",
    "Product", "Sum", "SyncBatchNormalization", "add_process_set", "allgather",
    "allgather_object", "allreduce", "alltoall", "barrier", "broadcast", "broadcast_",
    "broadcast_object", "broadcast_object_fn", "broadcast_variables", "ccl_built",
    "cross_rank", "cross_size", "cuda_built", "ddl_built", "elastic", "flush",
    "global_process_set", "gloo_built", "gloo_enabled", "grouped_allgather", "grouped_allreduce",
    "grouped_reducescatter", "init", "is_homogeneous", "is_initialized", "join", "local_rank",
    "local_rank_op", "local_size", "local_size_op", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "process_set_included_op", "rank", "rank_op",
    "reducescatter", "remove_process_set", "rocm_built", "shutdown", "size", "size_op",
    "start_timeline", "stop_timeline", "write_run_summary"]
