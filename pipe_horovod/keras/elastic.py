"""Elastic training for Keras with Horovod's names: `KerasState`, `run` and the callbacks.

    import pipe_horovod.keras as hvd
    hvd.init()
    model.compile(optimizer=hvd.DistributedOptimizer(opt), loss=...)   # a built model
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    callbacks = [hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=10)]

    @hvd.elastic.run
    def train(state):
        model.fit(data_from(state.epoch, state.batch), epochs=epochs - state.epoch,
                  callbacks=callbacks)

    train(state)

The mechanism is every adapter's (pipe_horovod.common.elastic, which DESIGN.md
and docs/faults.md describe): the same `run` loop (Horovod's own under
horovodrun's elastic mode), the same ObjectState for plain values, commits
kept in memory, a restore after a failure, a reset of the engine in the
process, a sync from rank 0, and an end when the same failure repeats. As in
Horovod, the layers stack: on the TensorFlow backend KerasState is
pipe_horovod.tensorflow.elastic.TensorFlowKerasState and `run` is that
adapter's; on the torch backend (no TensorFlow needed) KerasState is the
common layer's model state (pipe_horovod.common.model_state) and `run` the
common loop. What a Keras model adds:

* The state is every variable of the model and of its optimizer, and for a
  pipelined DistributedOptimizer what its checkpoints carry (the gradients
  in flight, the real weights while the model holds lookahead's prediction):
  a restore returns to the commit bit for bit, so training that failed goes
  on as if the steps since the commit never ran.
* On TensorFlow a failed collective surfaces inside the train step's graph,
  which reports it as its own error; `run` raises the HorovodInternalError
  (or HostsUpdatedInterrupt) behind it, as Horovod's TensorFlow `run` does.
* Keras 3's fit runs an epoch's steps as its data gives them and does not
  read `params["steps"]` back, so UpdateBatchStateCallback cannot shorten the
  epoch a reset interrupted, as Horovod's tries to: give fit the rest of that
  epoch's data. `state.batch` says how many of its batches are done (Horovod
  keeps the index of the last one, so its resumed epoch repeats it).
"""
import keras
import numpy as np

from .._keras.callbacks import join, pipelined_optimizer
from ..common import elastic as _common
from ..common.model_state import ModelState


def _on_tensorflow():
    return keras.backend.backend() == "tensorflow"


if _on_tensorflow():
    from ..tensorflow import elastic as _backend_elastic
    _StateBase = _backend_elastic.TensorFlowKerasState
else:
    _backend_elastic = None
    _StateBase = ModelState


def run(func):
    """Decorator: run `func(state, ...)` until it returns, surviving resets (Horovod's
    `horovod.tensorflow.keras.elastic.run`: on the TensorFlow backend
    pipe_horovod.tensorflow.elastic.run, which raises the engine failure behind a
    TensorFlow error; on the torch backend the engine's exception leaves fit itself,
    and this is pipe_horovod.common.elastic.run).

    Args:
        func: the training function, called with the KerasState first; it must not
            start with a collective (a joining worker runs it while the others sync).

    Returns:
        A function of the same arguments that returns what `func` returns.
    """
    if _backend_elastic is not None:
        return _backend_elastic.run(func)
    return _common.run(func)


class KerasState(_StateBase):
    """Horovod's `KerasState`: a Keras model, its optimizer and plain values.

    Args:
        model: a built Keras model (Horovod's rule: build it first, e.g. with
            `model.build(input_shape)` or a `keras.Input`).
        optimizer: the optimizer, when not the one the model was compiled with.
        kwargs: more state (`epoch=0`, `batch=0`, ...), exposed as attributes and
            broadcast from rank 0 as one object.

    Raises:
        ValueError: the model is not built, or there is no optimizer.
    """

    def __init__(self, model, optimizer=None, **kwargs):
        super().__init__(model, optimizer, **kwargs)

    def _numpy(self, variable):
        return np.array(keras.ops.convert_to_numpy(variable.value), copy=True)

    def _agree_on_model(self):
        optimizer = pipelined_optimizer(self.optimizer)
        if optimizer is not None:       # every rank compares its model here, together
            join(optimizer)


class CommitStateCallback(keras.callbacks.Callback):
    """Commit `state` every `batches_per_commit` batches and at each epoch's end.

    Args:
        state: the KerasState (or any elastic State) to commit.
        batches_per_commit: batches between commits (default 1). A commit copies the
            model and waits for the gradients in flight: every few batches is cheaper.
    """

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        if isinstance(batches_per_commit, bool) or not isinstance(batches_per_commit, int) \
                or batches_per_commit < 1:
            raise ValueError(f"batches_per_commit must be an integer >= 1, got "
                             f"{batches_per_commit!r}")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs=None):
        self.batches_remaining = self.batches_per_commit      # alike on every rank

    def on_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep in `state.batch` how many batches of the current epoch are done (0 at each
    epoch's end), counting on from its value when fit resumed an interrupted epoch.
    The module's docstring says how this differs from Horovod's."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self._done_before = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._done_before = self.state.batch

    def on_batch_end(self, batch, logs=None):
        self.state.batch = self._done_before + batch + 1

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keep in `state.epoch` the number of epochs done, across resets: fit counts its
    epochs from 0 (or `initial_epoch`) on each call, the state from where it left off."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self._start = None

    def on_train_begin(self, logs=None):
        self._start = None

    def on_epoch_begin(self, epoch, logs=None):
        if self._start is None:         # (the state's epoch, fit's) when this fit began
            self._start = (self.state.epoch, epoch)

    def on_epoch_end(self, epoch, logs=None):
        state_epoch, fit_epoch = self._start
        self.state.epoch = state_epoch + epoch - fit_epoch + 1


__all__ = ["KerasState", "CommitStateCallback", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "run"]
