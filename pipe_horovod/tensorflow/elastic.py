"""Elastic training for TensorFlow 2 custom loops with Horovod's names: `TensorFlowState`,
`TensorFlowKerasState`, `run`.

    import pipe_horovod.tensorflow as hvd
    hvd.init()
    state = hvd.elastic.TensorFlowKerasState(model, optimizer=opt, batch=0, epoch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch in range(state.batch, batches):
                step(*data(state.epoch, state.batch))        # a DistributedGradientTape inside
                if state.batch % 10 == 0:
                    state.commit()
            state.batch = 0
        for grads in hvd.flush(model.trainable_variables):
            opt.apply_gradients(zip(grads, model.trainable_variables))

    train(state)

The mechanism is every adapter's (pipe_horovod.common.elastic; DESIGN.md and
docs/faults.md): the same `run` loop (Horovod's own under horovodrun's elastic
mode), commits kept in memory, a restore after a failure, a reset of the engine
in the process, a sync from rank 0, and an end when the same failure repeats.
What a custom loop adds:

* A DistributedGradientTape at pipeline_depth >= 2 holds averaged gradients in
  flight between steps, in a pipeline per list of variables that outlives the
  tapes. They belong to the state of the variables they are for: a commit waits
  for them and keeps them, a restore drops what was on the wire and puts the
  committed ones back, a sync gives every rank rank 0's (a worker that joined
  gets them when its first step builds its pipeline). So a restored run goes on
  bit for bit as if the steps since the commit never ran. A pipeline is in the
  state when every variable it differentiates is among the state's.
* TensorFlowKerasState is the model's and the optimizer's variables (a pipelined
  hvd.DistributedOptimizer's gradients in flight and lookahead's real weights:
  pipe_horovod.common.model_state) plus the tapes' gradients over the model's
  variables. pipe_horovod.keras.elastic.KerasState builds on it, as Horovod's does.
* A failed collective inside a tf.function surfaces as TensorFlow's UnknownError;
  `run` raises the HorovodInternalError behind it (Horovod's `run` recognises its
  ops' names in the message; this knows the failure itself).
* TensorFlow 2, eagerly: no TF1 sessions (`session=` must be None; `backend=`,
  TF1's Keras session holder, is accepted and unused, as Horovod ignores it when
  eager).
"""
import keras
import numpy as np
import tensorflow as tf

from ..common import elastic as _common
from ..common.basics import rank
from ..common.elastic import ObjectState
from ..common.model_state import ModelState
from .bridge import failure_behind
from .functions import broadcast_object, broadcast_variables
from .gradient_tape import pipelines_over, restore_when_built


def run(func):
    """Decorator: run `func(state, ...)` until it returns, surviving resets (Horovod's
    `horovod.tensorflow.elastic.run`: pipe_horovod.common.elastic.run, raising the engine
    failure behind a TensorFlow error raised inside a tf.function).

    Args:
        func: the training function, called with the state first; it must not start with
            a collective (a joining worker runs it while the others sync).

    Returns:
        A function of the same arguments that returns what `func` returns.
    """
    return _common.run(func, failure_behind=failure_behind)


_NOTHING_IN_FLIGHT = {"steps": 0, "in_flight": []}


class _TapesInFlight:
    """The gradients DistributedGradientTapes hold in flight for some of `variables`,
    committed, restored and synchronised with them (each tape pipeline named by its
    sources' positions among the variables, the same on every rank)."""

    def __init__(self, variables):
        self.variables = variables
        self.saved = {}

    def snapshot(self):
        """Every pipeline's state (waits for the reductions in flight to land)."""
        return {where: pipe.state() for where, pipe in pipelines_over(self.variables).items()}

    def restore(self):
        """Back to the commit: a pipeline built since starts empty, as it was then."""
        for where, pipe in pipelines_over(self.variables).items():
            pipe.drop_in_flight()
            pipe.restore(self.saved.get(where, _NOTHING_IN_FLIGHT))

    def sync(self):
        """Rank 0's gradients in flight on every rank, where they differ (a worker that
        joined, or one astray). A rank keeps its own gradients of local sources
        (register_local_source) and error-feedback residuals: they are never averaged,
        so ranks differ there."""
        pipes = pipelines_over(self.variables)
        mine = {where: pipe.state() for where, pipe in pipes.items()}
        theirs = broadcast_object(mine if rank() == 0 else None, root_rank=0)
        for where in set(mine) | set(theirs):
            pipe, state = pipes.get(where), theirs.get(where, _NOTHING_IN_FLIGHT)
            if pipe is None:               # not built here yet: at its first gradient(),
                # with no residuals of its own yet (rank 0's are rank 0's)
                restore_when_built([self.variables[i] for i in where],
                                   {**state, "error_feedback": {}})
                continue
            own = mine[where]
            state = _keeping_local(own, state, pipe.local)
            if not _same_state(own, state):
                pipe.restore(state)

    def release(self):
        for pipe in pipelines_over(self.variables).values():
            pipe.release_engine()

    def rebind(self):
        for pipe in pipelines_over(self.variables).values():
            pipe.rebind_engine()


def _keeping_local(own, theirs, local):
    """`theirs` with what is this rank's own: its error-feedback residuals (each rank's
    codec memory, never averaged), and its gradients of local sources where both hold the
    same steps (otherwise this rank's are not the ones that go with rank 0's)."""
    mine = {"error_feedback": own.get("error_feedback") or {}}
    if not local or own["steps"] != theirs["steps"] \
            or len(own["in_flight"]) != len(theirs["in_flight"]):
        return {**theirs, **mine}
    return {"steps": theirs["steps"], **mine,
            "in_flight": [{n: kept[n] if n in local else g for n, g in entry.items()}
                          for kept, entry in zip(own["in_flight"], theirs["in_flight"])]}


def _same_state(a, b):
    return (a["steps"] == b["steps"] and len(a["in_flight"]) == len(b["in_flight"])
            and all(x.keys() == y.keys() and all(np.array_equal(x[n], y[n]) for n in x)
                    for x, y in zip(a["in_flight"], b["in_flight"])))


def _no_session(session):
    if session is not None:
        raise ValueError("TensorFlowState(session=...) is TensorFlow 1's; "
                         "pipe_horovod.tensorflow runs TensorFlow 2 eagerly: pass no session")
    if not tf.executing_eagerly():
        raise ValueError("pipe_horovod.tensorflow's elastic states run eagerly (TensorFlow 2): "
                         "create the state outside any tf.function")


class TensorFlowState(ObjectState):
    """Horovod's `TensorFlowState`: a list of TensorFlow variables and plain values.

    Args:
        variables: the tf.Variables (or Keras variables) to commit, restore and
            broadcast. Horovod's default, `tf.compat.v1.global_variables()`, is empty
            in TensorFlow 2: pass them.
        session: TensorFlow 1's; must be None.
        kwargs: more state (`epoch=0`, `batch=0`, ...), exposed as attributes and
            broadcast from rank 0 as one object.

    The gradients DistributedGradientTapes have in flight for these variables are
    part of the state (module docstring).

    Raises:
        ValueError: a session, or not executing eagerly.
        TypeError: an entry of `variables` is not a variable.
    """

    def __init__(self, variables=None, session=None, **kwargs):
        _no_session(session)
        self.variables = list(variables if variables is not None
                              else tf.compat.v1.global_variables())
        self.session = None
        for i, variable in enumerate(self.variables):
            if not hasattr(variable, "assign"):
                raise TypeError(f"TensorFlowState: variables[{i}] is a "
                                f"{type(variable).__name__}, not a tf.Variable or Keras "
                                "variable")
        self._tapes = _TapesInFlight(self.variables)
        self._saved_values = self._snapshot_variables()
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)

    def _snapshot_variables(self):
        return [np.array(tf.convert_to_tensor(v), copy=True) for v in self.variables]

    def save(self):
        # Every snapshot before any is kept: a commit whose wait for a gradient in flight
        # fails (a peer died) leaves the previous commit whole.
        tapes = self._tapes.snapshot()
        values = self._snapshot_variables()
        super().save()
        self._tapes.saved, self._saved_values = tapes, values

    def restore(self):
        self._tapes.restore()
        for variable, value in zip(self.variables, self._saved_values):
            variable.assign(value)
        super().restore()

    def sync(self):
        broadcast_variables(self.variables, root_rank=0)
        self._tapes.sync()
        self._tapes.saved, self._saved_values = self._tapes.snapshot(), self._snapshot_variables()
        super().sync()

    def reset(self):
        self._tapes.rebind()

    def _before_engine_reset(self):
        self._tapes.release()


class TensorFlowKerasState(ModelState):
    """Horovod's `TensorFlowKerasState`: a built Keras model, its optimizer and plain values.

    Args:
        model: a built Keras model.
        optimizer: the optimizer, when not the one the model was compiled with (a custom
            loop's: a plain Keras optimizer fed by a DistributedGradientTape, or
            hvd.DistributedOptimizer).
        backend: TensorFlow 1's Keras session holder; accepted and unused (TensorFlow 2
            runs eagerly, where Horovod ignores it too).
        kwargs: more state, exposed as attributes and broadcast from rank 0.

    What is in flight is part of the state: a pipelined DistributedOptimizer's
    (pipe_horovod.common.model_state) and the DistributedGradientTapes' for the model's
    variables.

    Raises:
        ValueError: the model is not built, there is no optimizer, or not eager.
    """

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        _no_session(None)
        self.backend = backend
        self._tapes = _TapesInFlight(list(model.variables))
        super().__init__(model, optimizer, **kwargs)

    def _numpy(self, variable):
        return np.array(keras.ops.convert_to_numpy(variable.value), copy=True)

    def save(self):
        tapes = self._tapes.snapshot()        # first: it may fail, then nothing is kept
        super().save()
        self._tapes.saved = tapes

    def restore(self):
        self._tapes.restore()
        super().restore()

    def sync(self):
        super().sync()
        self._tapes.sync()
        self._tapes.saved = self._tapes.snapshot()

    def reset(self):
        super().reset()
        self._tapes.rebind()

    def _before_engine_reset(self):
        super()._before_engine_reset()
        self._tapes.release()


__all__ = ["TensorFlowKerasState", "TensorFlowState", "run"]
