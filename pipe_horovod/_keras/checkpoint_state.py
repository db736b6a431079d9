"""What a pipelined Keras optimizer holds in flight, as a tf.train.Checkpoint dependency.

A tf.train.Checkpoint of the optimizer (TensorFlow backend: pipe_horovod.keras's, and
pipe_horovod.tensorflow.DistributedOptimizer in a custom loop) saved its variables and
not the averaged gradients still in flight, which live outside any variable; a resume
was one update short while assert_consumed() passed. This child of the optimizer saves
what model.save saves of it (the optimizer's _save_in_flight: the gradients in flight,
the staleness compensation's state, the real weights while the model holds predicted
ones, error-feedback residuals), so save -> restore -> continue matches the run that
never stopped, as the tape's GradientsInFlight does for DistributedGradientTape.

With staleness_compensation="lookahead" the model holds this rank's predicted weights
between steps, so a tf.train.Checkpoint of the model written then held the prediction as
its weights, and one restored for inference (or without the optimizer) got weights no run
computed, with nothing said. Every tf.train.Checkpoint is therefore written inside each
live optimizer's real_weights(), as fit's saves are: the file holds the real weights, and
the optimizer's own state carries the prediction back for a resume, once the read is
done (TensorFlow may restore the model's variables after the optimizer's state).
"""
import contextlib
import functools
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
            # The model's variables may be read after this (they then hold the real weights
            # the file has): the prediction goes back once the whole read is done.
            optimizer._load_in_flight(store, after_read=True)


_live = []          # () -> the pipelined optimizers alive now, once the writes are wrapped


def write_real_weights(live):
    """Wrap tf.train.Checkpoint's write and save (each writes on its own: save does not
    call write) so that every checkpoint is written inside real_weights() of each optimizer
    `live()` returns, and its read (restore reads through it) so that a prediction read
    back is held once the model's variables are read too. TensorFlow offers no hook around
    a checkpoint write or read; the wrap is process-wide, installed once, and changes
    nothing where no model holds a prediction. A write inside a tf.function is left as it
    is (the weights cannot be swapped there)."""
    if _live:
        return
    _live.append(live)
    for name in ("write", "save"):
        original = getattr(tf.train.Checkpoint, name)

        @functools.wraps(original)
        def wrapped(self, *args, _original=original, **kwargs):
            if not tf.executing_eagerly():
                return _original(self, *args, **kwargs)
            with contextlib.ExitStack() as stack:
                for optimizer in live():
                    stack.enter_context(optimizer.real_weights())
                return _original(self, *args, **kwargs)
        setattr(tf.train.Checkpoint, name, wrapped)
    read = tf.train.Checkpoint.read

    @functools.wraps(read)
    def read_then_predict(self, *args, **kwargs):
        status = read(self, *args, **kwargs)
        for optimizer in live():
            optimizer._hold_read_prediction()
        return status
    tf.train.Checkpoint.read = read_then_predict
