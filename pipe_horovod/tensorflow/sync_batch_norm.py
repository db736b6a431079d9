"""SyncBatchNormalization: Keras's BatchNormalization with every rank's batch statistics.

Small per-rank batches (detection, segmentation) make batch statistics noisy;
Horovod's layer averages them over the ranks, and so does this one, in
Horovod's way: each rank's mean and mean of squares, summed across the ranks
and divided by their number, so the variance is E[x^2] - E[x]^2 of the
union of equal-sized batches. The allreduce carries its gradient (mpi_ops),
so backward is that of normalising the whole global batch. Keras 3 on the
TensorFlow backend only (the statistics are tf ops); Keras's own
`synchronized=True` is tf.distribute's and is refused here.
"""
import keras
import tensorflow as tf

from ..common import size
from .mpi_ops import Sum, allreduce


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Batch normalization whose training statistics are synchronized across all ranks."""

    def __init__(self, fused=False, **kwargs):
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True.")
        if kwargs.get("synchronized"):
            raise ValueError("synchronized=True is tf.distribute's synchronization; "
                             "SyncBatchNormalization synchronizes across pipe_horovod's ranks "
                             "already: leave it False")
        if keras.backend.backend() != "tensorflow":
            raise ValueError(f"SyncBatchNormalization needs Keras's TensorFlow backend "
                             f"(KERAS_BACKEND=tensorflow), not {keras.backend.backend()!r}")
        super().__init__(**kwargs)

    def _moments(self, inputs, mask):
        mean, variance = super()._moments(inputs, mask)
        ranks = size()
        if ranks == 1:
            return mean, variance
        stack = tf.stack([mean, variance + tf.square(mean)])
        group_mean, group_mean_of_square = tf.unstack(allreduce(stack, op=Sum) / ranks)
        return group_mean, group_mean_of_square - tf.square(group_mean)
