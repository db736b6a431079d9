"""pipe_horovod: pipelined gradient communication (Pipe-SGD) for PyTorch and Keras.

The framework adapters live in `pipe_horovod.torch` and `pipe_horovod.keras`;
this top level holds only the engine functions, which need no framework.
"""
from .engine import (Average, Sum, allgather_object, allreduce_async, barrier, broadcast,
                     broadcast_object, init, is_initialized, local_rank, local_size, poll, rank,
                     shutdown, size, wait)
from .preemption import Preemption

__version__ = "0.1.0"
