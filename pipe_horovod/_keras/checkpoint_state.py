"""What a pipelined Keras optimizer holds in flight, as a tf.train.Checkpoint dependency.

A tf.train.Checkpoint of the optimizer (TensorFlow backend: pipe_horovod.keras's, and
pipe_horovod.tensorflow.DistributedOptimizer in a custom loop) saved its variables and
not the averaged gradients still in flight, which live outside any variable; a resume
was one update short while assert_consumed() passed. This child of the optimizer saves
what model.save saves of it (the optimizer's _save_in_flight: the gradients in flight,
the staleness compensation's state, the real weights while the model holds predicted
ones, error-feedback residuals), so save -> restore -> continue matches the run that
never stopped, as the tape's GradientsInFlight does for DistributedGradientTape.
"""
import io
import weakref

import numpy as np
import tensorflow as tf


class InFlight(tf.train.experimental.PythonState):
    """The optimizer's in-flight state, serialized with NumPy (per rank: error-feedback
    residuals differ between ranks, so each rank restores its own file to resume exactly)."""

    def __init__(self, optimizer):
        self._optimizer = weakref.ref(optimizer)    # the optimizer holds this: no cycle

    def serialize(self):
        store = {}
        optimizer = self._optimizer()
        if optimizer is not None:
            optimizer._save_in_flight(store)
        buffer = io.BytesIO()
        np.savez(buffer, **store)
        return buffer.getvalue()

    def deserialize(self, string_value):
        with np.load(io.BytesIO(string_value)) as data:
            store = {key: data[key] for key in data.files}
        optimizer = self._optimizer()
        if optimizer is not None:
            optimizer._load_in_flight(store)
