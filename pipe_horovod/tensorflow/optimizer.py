"""horovod.tensorflow.DistributedOptimizer for TF2 custom loops: the shared Keras one.

Horovod's TensorFlow DistributedOptimizer hands a Keras optimizer to its Keras
implementation (horovod/_keras); here too: the result is the pipelined Keras
optimizer of pipe_horovod/_keras (pipe_horovod.keras's too), on this package's data
path (keras_path.py), whose `apply_gradients` (eagerly or inside a tf.function) averages
the local gradients across ranks, applies nothing while the pipeline fills,
compensates the staleness ("lookahead" by default) and carries what is in flight
as a checkpoint dependency of its own (the gradients live outside its variables),
so a tf.train.Checkpoint of it resumes exactly. Use it with a
plain tf.GradientTape (a DistributedGradientTape's gradients would be averaged twice:
refused at the first apply), and call
`optimizer.flush()` after the last step.
"""
from .._keras import optimizer as keras_optimizer
from ..compression import Compression
from ..engine import Average, global_process_set
from ..pipeline.option_checks import refuse_double_wrapping

WRAPPER = "pipe_horovod.tensorflow.DistributedOptimizer"


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="",
                         device_sparse="", compression=Compression.none, sparse_as_dense=False,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True,
                         **pipelined):
    """Wrap a Keras 3 optimizer (keras.optimizers.SGD, Adam, ...) for a custom loop.

    The arguments are horovod.tensorflow's, in its order; `use_locking` (TF1's) is
    accepted and unused. Keyword-only: pipe_horovod.keras.DistributedOptimizer's
    pipeline_depth, warmup_steps, bucket_cap_mb, staleness_compensation, collective,
    tune ("auto": the run chooses depth, codec and buckets from its first steps).

    Raises:
        TypeError: a TensorFlow 1 optimizer (tf.compat.v1.train.Optimizer), which needs
            sessions, or anything not a Keras 3 optimizer.
    """
    import tensorflow as tf

    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        raise TypeError(f"{type(optimizer).__name__} is a TensorFlow 1 optimizer "
                        "(tf.compat.v1.train); pipe_horovod.tensorflow wraps Keras 3 optimizers "
                        "(keras.optimizers.SGD, Adam, ...) or reduces with "
                        "DistributedGradientTape")
    if hasattr(optimizer, "_pipe_wrapper"):     # one of ours: named by the one who wrapped it
        refuse_double_wrapping(optimizer._pipe_wrapper, WRAPPER, "Keras optimizer")
    wrapped = keras_optimizer.DistributedOptimizer(
        optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
        gradient_predivide_factor, op, backward_passes_per_step, average_aggregated_gradients,
        num_groups, groups, process_set, scale_local_gradients, **pipelined)
    wrapped._pipe_wrapper = WRAPPER
    return wrapped


def _keras_path():
    from .keras_path import TensorFlowPath
    return TensorFlowPath


keras_optimizer.use_data_path("tensorflow", _keras_path)
