"""horovod.tensorflow.keras's value collectives: a tensor-like value in, NumPy out.

Horovod's Keras module reduces, gathers and broadcasts small values (a
metric, a count, the epoch to resume from) and hands back NumPy. These do
the same through pipe_horovod.torch's collectives, so they behave alike on
either Keras backend and under every engine, and check their arguments as
Horovod does. Unnamed calls get names in call order, so every rank must
make them in the same order (Horovod's rule).
"""
import keras
import numpy as np
import torch

from ..compression import Compression
from ..engine import Average, ReduceOp
from ..torch import mpi_ops


def _tensor(value):
    """A torch copy of a Python number, list, NumPy array or Keras/backend tensor."""
    return torch.from_numpy(np.array(keras.ops.convert_to_numpy(value), copy=True))


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0,
              op=None, compression=Compression.none):
    """The reduction of `value` over every rank (op defaults to Average)."""
    if isinstance(average, ReduceOp):
        raise TypeError(f"allreduce's third argument is Horovod's deprecated average= (a bool), "
                        f"got {average!r}: pass the reduction as op={average!r}")
    return mpi_ops.allreduce(_tensor(value), average, name, compression, op,
                             prescale_factor, postscale_factor).numpy()


def allgather(value, name=None):
    """Every rank's `value` concatenated along the first dimension, in rank order
    (the first dimension may differ between ranks)."""
    return mpi_ops.allgather(_tensor(value), name).numpy()


def broadcast(value, root_rank, name=None):
    """`root_rank`'s `value` (its shape must be the same on every rank)."""
    return mpi_ops.broadcast(_tensor(value), root_rank, name).numpy()


def reducescatter(value, name=None, op=Average):
    """The reduction of `value`, split along the first dimension: this rank's part."""
    return mpi_ops.reducescatter(_tensor(value), name, op=op).numpy()


def broadcast_global_variables(root_rank):
    """Horovod's TF1 graph call; Keras 3 has no global-variable collection to read."""
    raise RuntimeError(
        "broadcast_global_variables() reads TensorFlow 1's global-variable collection, which "
        "Keras 3 does not have (Horovod raises too, in eager mode): add "
        f"callbacks.BroadcastGlobalVariablesCallback({root_rank}) to fit, or call "
        f"broadcast_variables(model.variables, root_rank={root_rank}) once the model is built")
