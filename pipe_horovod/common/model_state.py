"""A model's and its optimizer's variables as elastic state: the core of the Keras
states on both of Keras 3's backends.

TensorFlowKerasState (pipe_horovod.tensorflow.elastic) and KerasState
(pipe_horovod.keras.elastic, which builds on TensorFlowKerasState on the
TensorFlow backend, as Horovod's does) hold a built model and its optimizer.
On Keras' torch backend KerasState must not need TensorFlow, so the part both
share lives here, written against what every Keras 3 model and optimizer has
(`variables`, `trainable_variables`, `assign`, `save_own_variables`,
`load_own_variables`) and against the elastic methods pipe_horovod's
pipelined optimizers define (`drop_in_flight`, `release_engine`,
`rebind_engine`). It imports no framework: subclasses say how a variable
becomes NumPy (`_numpy`).

The state is every variable of the model and of its optimizer and, for a
pipelined optimizer, what its saved variables carry (the gradients in
flight, the real weights while the model holds lookahead's prediction): a
restore returns to the commit bit for bit, so training that failed goes on
as if the steps since the commit never ran.
"""
import copy

import numpy as np

from .. import engine
from ..pipeline.own_state import OWN, identical
from .elastic import ObjectState

# The saved variables of what a pipelined optimizer holds of this rank's own (own_state.OWN).
_OWN = tuple(f"pipe_horovod.{name}." for name in OWN)


class ModelState(ObjectState):
    """A built model, its optimizer and plain values (keyword arguments).

    Args:
        model: a built model (Horovod's rule: build it first).
        optimizer: the optimizer, when not the one the model was compiled with.
        kwargs: more state (`epoch=0`, `batch=0`, ...), exposed as attributes and
            broadcast from rank 0 as one object.

    Raises:
        ValueError: the model is not built, or there is no optimizer.
    """

    def __init__(self, model, optimizer=None, **kwargs):
        if not model.built:
            raise ValueError(f"{type(self).__name__}: the model must be built first; run "
                             "`model.build(input_shape)` or give it a keras.Input")
        optimizer = optimizer or getattr(model, "optimizer", None)
        if optimizer is None:
            raise ValueError(f"{type(self).__name__}: no optimizer; compile the model with one or "
                             "pass optimizer=")
        if not optimizer.built:          # so its variables exist to commit and broadcast
            optimizer.build(model.trainable_variables)
        self.model, self.optimizer = model, optimizer
        self._saved_model = self._snapshot_model()
        super().__init__(**kwargs)

    def _numpy(self, variable):
        """A NumPy copy of `variable`'s value (a subclass knows its framework's way)."""
        return np.array(variable, copy=True)

    def _snapshot_model(self):
        """Copies of the model's variables and of what the optimizer saves (its variables
        and, for a pipelined one, the gradients in flight)."""
        weights = [self._numpy(v) for v in self.model.variables]
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

    def _agree_on_model(self):
        """Before the sync, every rank at the same point: a subclass whose optimizer
        compares the ranks' models collectively does it here."""

    def sync(self):
        self._agree_on_model()
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


def _shared(committable):
    weights, store = committable
    return weights, {k: v for k, v in store.items() if not k.startswith(_OWN)}


__all__ = ["ModelState"]
