"""What fit needs of a pipelined Keras optimizer, whichever wrapper made it
(pipe_horovod.keras's or pipe_horovod.tensorflow's DistributedOptimizer): the
PipelineFlushCallback every fit gets (flush_in_every_fit), and what pipe_horovod.keras's
callbacks ask of the optimizer (pipelined_optimizer, join, running_sums) without reading
its private state themselves.
"""
import contextlib
import functools

import keras
import numpy as np


def pipelined_optimizer(optimizer):
    """The pipe_horovod DistributedOptimizer `optimizer` is or wraps (a Keras
    LossScaleOptimizer's inner one), else None.

    Known by its pipeline options (what optimizer.py's wrapper sets up, and what these
    callbacks read), not by its class: optimizer.py imports this module
    (flush_in_every_fit), so this one does not import it."""
    for candidate in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if getattr(candidate, "_pipe_options", None) is not None:
            return candidate
    return None


def join(optimizer):
    """The collective half of building `optimizer` (a pipelined one): every rank calls it
    at the same point (BroadcastGlobalVariablesCallback's broadcast, else the first
    apply() or flush())."""
    optimizer._join()


def running_sums(optimizer):
    """A backward_passes_per_step cycle's sums so far, this rank's own: (variable, value)."""
    aggregation = getattr(optimizer, "_agg_helper", None)
    return [] if aggregation is None else [
        (s, np.array(keras.ops.convert_to_numpy(s.value))) for s in aggregation.sums]


class PipelineFlushCallback(keras.callbacks.Callback):
    """Apply every gradient in flight after each epoch's last batch and at the end of fit,
    and put the real weights back before evaluate() and predict().

    The flush comes after the last training batch, before fit() validates,
    so validation, ModelCheckpoint, EarlyStopping and ReduceLROnPlateau see
    weights with every computed gradient applied, the same on every rank; the
    pipeline restarts with the next epoch. When fit cannot tell an epoch's
    last batch (a dataset of unknown length), validation still sees the real
    weights (on_test_begin) and the flush comes at the epoch's end. evaluate()
    and predict() on their own take the real weights with no collective, so a
    rank may call them alone. During fit the model's save, save_weights and export
    write the real weights as the model's, also mid-epoch (ModelCheckpoint with
    save_freq=N, a user's callback), and the prediction comes back after
    (DistributedOptimizer.real_weights). A DistributedOptimizer with
    flush_in_fit=True (the default) gets one of these first in every fit, evaluate
    and predict.
    """

    def _optimizer(self):
        return pipelined_optimizer(getattr(self.model, "optimizer", None))

    def _flush(self):
        optimizer = self._optimizer()
        if optimizer is not None:
            optimizer.flush()

    def _real_weights(self, logs=None):
        optimizer = self._optimizer()
        if optimizer is not None:
            optimizer.restore_real_weights()

    def on_train_begin(self, logs=None):
        optimizer, steps = self._optimizer(), self.params.get("steps")
        passes = optimizer._pipe_options["backward_passes_per_step"] if optimizer else 1
        if steps and steps % passes:
            raise ValueError(
                f"backward_passes_per_step={passes} does not divide the {steps} steps of an "
                f"epoch: the flush after each epoch's last batch would leave its last "
                f"{steps % passes} pass(es) summed but not applied. Make steps_per_epoch a "
                f"multiple of {passes}, or pass DistributedOptimizer(..., flush_in_fit=False) "
                "to carry them into the next epoch, as Horovod does")
        _write_real_weights(self.model)
        if optimizer is not None:    # (several steps per call: the step is checked too late)
            optimizer.fit_retraces(getattr(self.model, "steps_per_execution", 1) == 1)

    def on_train_batch_end(self, batch, logs=None):
        if batch + 1 == self.params.get("steps"):
            self._flush()
        self._retrace()

    def on_epoch_end(self, epoch, logs=None):
        self._flush()

    def on_train_end(self, logs=None):
        self._flush()
        _stop_writing_real_weights(self.model)
        optimizer = self._optimizer()
        if optimizer is not None:    # outside fit (train_on_batch, the next fit's first step)
            optimizer.fit_retraces(False)
            self._retrace()

    def _retrace(self):
        """The model's train function made again where the step traced last does not hold
        what the next needs (tune="auto" changed the pipeline's depth, on TensorFlow), or
        the one this fit traced for that taken back (a trial undone goes back to K=1's)."""
        optimizer = self._optimizer()
        ran, needed = (None, None) if optimizer is None else optimizer.step_holds()
        if ran == needed:
            return
        traced = self.__dict__.setdefault("_traced", {})
        traced[ran] = self.model.train_function
        if needed in traced:
            self.model.train_function = traced[needed]
        else:
            self.model.make_train_function(force=True)

    on_test_begin = on_predict_begin = _real_weights


# What writes a model's weights to a file: Keras's ModelCheckpoint and BackupAndRestore
# call the first two, a user's callback any of them.
_WRITERS = ("save", "save_weights", "export")


def _write_real_weights(model):
    """Make the model's save, save_weights and export write the real weights, in
    fit: each runs inside its pipelined optimizer's real_weights().

    Why: on TensorFlow, lookahead leaves this rank's prediction in the model between
    train steps, where a ModelCheckpoint(save_freq=N), a BackupAndRestore or a user's
    callback saves mid-epoch; Keras writes the layers before the optimizer, and calls
    nothing of ours before them, so the model's own methods are the place. They are
    wrapped on the instance (PipelineFlushCallback: from on_train_begin to
    on_train_end), never on a class; elsewhere the optimizer warns at write time."""
    for name in _WRITERS:
        write = getattr(model, name, None)
        if write is None or getattr(write, "_pipe_horovod_writes_real", False):
            continue
        # Set past Keras's (and TensorFlow's) attribute tracking, as a plain attribute.
        object.__setattr__(model, name, _writer(model, write, model.__dict__.get(name)))


def _writer(model, write, before):
    @functools.wraps(write)
    def writer(*args, **kwargs):
        optimizer = pipelined_optimizer(getattr(model, "optimizer", None))
        with optimizer.real_weights() if optimizer is not None else contextlib.nullcontext():
            return write(*args, **kwargs)
    writer._pipe_horovod_writes_real = True
    writer._pipe_horovod_before = before         # the instance's own attribute, if any
    return writer


def _stop_writing_real_weights(model):
    for name in _WRITERS:
        writer = model.__dict__.get(name)
        if getattr(writer, "_pipe_horovod_writes_real", False):
            if writer._pipe_horovod_before is None:
                del model.__dict__[name]
            else:
                object.__setattr__(model, name, writer._pipe_horovod_before)


def flush_in_every_fit():
    """Give every fit, evaluate and predict of a model whose optimizer is a
    DistributedOptimizer with flush_in_fit=True a PipelineFlushCallback, first among
    its callbacks (unless it has one), so an unmodified Horovod script validates,
    checkpoints and ends at the real weights with every gradient applied.

    Keras builds the callbacks of those three calls in keras.callbacks.CallbackList;
    this wraps its constructor (once per process) to add ours to the list it is
    given: Keras then treats it as one of the user's (it sets its model and
    parameters, and runs batch-end callbacks in order, not in the background).
    It is the only hook: Keras 3.15's trainers build that list themselves and offer no
    documented way to add a callback to every fit.
    """
    if _wrapped_list:
        return
    original = keras.callbacks.CallbackList.__init__

    def __init__(self, callbacks=None, add_history=False, add_progbar=False, model=None,
                 **params):
        original(self, _with_flush(callbacks, model), add_history, add_progbar, model, **params)
    __init__.__doc__ = original.__doc__
    keras.callbacks.CallbackList.__init__ = __init__
    _wrapped_list.append(original)


_wrapped_list = []


def _with_flush(callbacks, model):
    optimizer = pipelined_optimizer(getattr(model, "optimizer", None))
    if optimizer is None or not optimizer._pipe_options["flush_in_fit"]:
        return callbacks
    listed = list(keras.tree.flatten(callbacks)) if callbacks else []
    if any(isinstance(c, PipelineFlushCallback) for c in listed):
        return callbacks
    return [PipelineFlushCallback(), *listed]
