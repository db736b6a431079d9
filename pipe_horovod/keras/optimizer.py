"""pipe_horovod.keras.DistributedOptimizer: the pipelined Keras optimizer
(pipe_horovod/_keras/optimizer.py, which pipe_horovod.tensorflow's DistributedOptimizer
wraps too) with this adapter's data paths: on the torch backend the PyTorch adapter's
hooks (torch_path.py), on TensorFlow pipe_horovod.tensorflow's, loaded only there, so
Keras on the torch backend never needs TensorFlow.
"""
from .._keras.optimizer import (DistributedOptimizer, PartialDistributedOptimizer,
                                told_saving, use_data_path)

_told_saving = told_saving       # the saving warning's once-per-process flag (tests reset it)


def _torch_path():
    from .torch_path import TorchPath
    return TorchPath


def _tensorflow_path():
    from ..tensorflow.keras_path import TensorFlowPath
    return TensorFlowPath


use_data_path("torch", _torch_path)
use_data_path("tensorflow", _tensorflow_path)

__all__ = ["DistributedOptimizer", "PartialDistributedOptimizer"]
