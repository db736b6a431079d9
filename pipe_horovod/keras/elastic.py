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

The mechanism is the PyTorch adapter's (pipe_horovod.torch.elastic, which
DESIGN.md and docs/faults.md describe): the same `run` loop (Horovod's own
under horovodrun's elastic mode), the same ObjectState for plain values,
commits kept in memory, a restore after a failure, a reset of the engine in
the process, and a sync from rank 0. What a Keras model adds:

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
import copy
import functools

import keras
import numpy as np

from .. import engine
from ..pipeline.own_state import OWN, identical
from ..torch import elastic as torch_elastic
from .callbacks import broadcast_variables


def run(func):
    """Decorator: run `func(state, ...)` until it returns, surviving resets (Horovod's
    `horovod.tensorflow.keras.elastic.run`; pipe_horovod.torch.elastic.run's loop).

    Args:
        func: the training function, called with the KerasState first; it must not
            start with a collective (a joining worker runs it while the others sync).

    Returns:
        A function of the same arguments that returns what `func` returns.
    """
    @functools.wraps(func)
    def raising_engine_failures(state, *args, **kwargs):
        try:
            return func(state, *args, **kwargs)
        except Exception as error:
            failure = _failure_behind(error)
            if failure is None:
                raise
            raise failure from error

    return torch_elastic.run(raising_engine_failures)


def _failure_behind(error):
    if keras.backend.backend() != "tensorflow":
        return None                     # on torch the engine's exception leaves fit itself
    from .tensorflow_path import failure_behind
    return failure_behind(error)


class KerasState(torch_elastic.ObjectState):
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
        if not model.built:
            raise ValueError("KerasState: the model must be built first; run "
                             "`model.build(input_shape)` or give it a keras.Input")
        optimizer = optimizer or getattr(model, "optimizer", None)
        if optimizer is None:
            raise ValueError("KerasState: no optimizer; compile the model with one or pass "
                             "optimizer=")
        if not optimizer.built:          # so its variables exist to commit and broadcast
            optimizer.build(model.trainable_variables)
        self.model, self.optimizer = model, optimizer
        self._saved_model = self._snapshot_model()
        super().__init__(**kwargs)

    def _snapshot_model(self):
        """Copies of the model's variables and of what the optimizer saves (its variables
        and, for a pipelined one, the gradients in flight)."""
        weights = [np.array(keras.ops.convert_to_numpy(v.value), copy=True)
                   for v in self.model.variables]
        store = {}
        self.optimizer.save_own_variables(store)
        return weights, {key: np.array(value, copy=True) for key, value in store.items()}

    def save(self):
        # Both snapshots before either is kept: a commit whose wait for a gradient in
        # flight fails leaves the previous commit whole.
        snapshot = self._snapshot_model()
        super().save()
        self._saved_model = snapshot

    def restore(self):
        drop = getattr(self.optimizer, "drop_in_flight", None)
        if drop is not None:            # what was on the wire will never land
            drop()
        weights, store = self._saved_model
        for variable, value in zip(self.model.variables, weights):
            variable.assign(value)
        self.optimizer.load_own_variables(copy.deepcopy(store))
        super().restore()

    def sync(self):
        join = getattr(self.optimizer, "_join", None)
        if join is not None:            # every rank compares its model here, together
            join()
        mine = self._committable()
        theirs = engine.broadcast_object(mine if engine.rank() == 0 else None, 0)
        if not identical(_shared(mine), _shared(theirs)):   # a worker that joined, or astray
            (weights, real), store = theirs
            for variable, value in zip(self.model.variables, weights):
                if value is not None:           # (trainable ones: the real weights below)
                    variable.assign(value)
            for variable, value in zip(self.model.trainable_variables, real):
                variable.assign(value)
            self.optimizer.load_own_variables(store)
        self._saved_model = self._snapshot_model()
        super().sync()

    def _committable(self):
        """What every rank must hold alike: the model's variables (the trainable ones as
        the real weights, where lookahead has this rank's prediction in the model) and the
        optimizer's saved state.

        A rank whose state is rank 0's (_shared: but for what each rank keeps of its own)
        keeps its own prediction and its own gradients: training without the reset would
        have used them, so a restored run goes on bit for bit. Another takes rank 0's
        state with the real weights in the model (its first gradient is then computed
        there, as after fit ends)."""
        weights, store = self._snapshot_model()
        trainable = {id(v) for v in self.model.trainable_variables}
        real = [store.get(f"pipe_horovod.real.{i}")
                for i in range(len(self.model.trainable_variables))]
        if any(r is None for r in real):             # no prediction: the model holds them
            real = [w for w, v in zip(weights, self.model.variables) if id(v) in trainable]
        others = [None if id(v) in trainable else w
                  for w, v in zip(weights, self.model.variables)]
        return (others, real), store

    def reset(self):
        rebind = getattr(self.optimizer, "rebind_engine", None)
        if rebind is not None:
            rebind()

    def _before_engine_reset(self):
        release = getattr(self.optimizer, "release_engine", None)
        if release is not None:
            release()


# The saved variables of what a pipelined optimizer holds of this rank's own (own_state.OWN).
_OWN = tuple(f"pipe_horovod.{name}." for name in OWN)


def _shared(committable):
    weights, store = committable
    return weights, {k: v for k, v in store.items() if not k.startswith(_OWN)}


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
