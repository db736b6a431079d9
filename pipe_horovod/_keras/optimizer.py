"""The pipelined DistributedOptimizer for Keras 3, shared by pipe_horovod.keras and
pipe_horovod.tensorflow (as horovod/_keras is by horovod.keras and
horovod.tensorflow.keras).

Keras 3 sends every backend's update through `Optimizer.apply(grads,
variables)`, so that is the one method wrapped. As for PyTorch, the result
is an instance of a subclass of the user's own optimizer class; what
changes is which averaged gradient `apply` hands to the real update, and
when (DESIGN.md, "Semantics"): g_t for pipeline_depth=1, g_{t-K+1} for
K >= 2, nothing (and no iteration counted) while the pipeline fills.

The data path depends on the backend, and each lives with the adapter it runs on,
which hands it down here (use_data_path) so this package imports neither:
- TensorFlow: a graph op cannot outlive its step, so each bucket's
  gradients leave the graph through a stateful numpy_function that hands
  them to the pipeline core (pipe_horovod/tensorflow/keras_path.py);
- torch: Keras's train step runs `loss.backward()`, so the PyTorch
  adapter's hooks do it (pipe_horovod/keras/torch_path.py), unchanged.
Both paths share pipeline.StepMachine with the PyTorch adapter.
"""
import contextlib
import copy
import functools
import json
import sys
import warnings
import weakref

import numpy as np

from .. import engine
from ..collectives import Collective, check_collective
from ..collectives.communicator import communicator
from ..compression import Compression, config_name
from ..pipeline import auto
from ..pipeline.buckets import AutoBucketCap, resolve_bucket_cap_mb
from ..pipeline.identity import describe_variables
from ..pipeline.option_checks import refuse_double_wrapping
from ..pipeline.resume_agreement import agree_on_the_state
from ..pipeline import (announce_depth, check_options, check_prediction_exchange,
                        check_reduction, check_staleness, compare_across_ranks, opens_group,
                        report_unapplied, resolve_depth, staleness)
from .keras2_gradients import _Keras2Gradients
from .naming import momentum_attribute, next_prefix
from .variables import backend as _backend, dense as _dense, same_variable as _same_variable

SUPPORTED_BACKENDS = ("tensorflow", "torch")
WRAPPER = "pipe_horovod.keras.DistributedOptimizer"
# staleness_compensation options per backend (None works everywhere): on torch the
# PyTorch adapter runs them all; the TensorFlow path implements lookahead itself.
COMPENSATION = {"torch": staleness.OPTIONS, "tensorflow": ("lookahead",)}
_announced = set()                 # depth settings rank 0 has explained already
_built = weakref.WeakSet()         # wrapped optimizers with a data path, for the exit report
# Saved models name this module for every wrapped class: where it lived before the Keras
# optimizer was shared with pipe_horovod.tensorflow (a string Keras writes, not imports).
SAVED_MODULE = "pipe_horovod.keras.optimizer"
# {Keras backend: a function returning its data path class}, handed down by the adapter
# that holds it (use_data_path): pipe_horovod.keras both, pipe_horovod.tensorflow its own.
_data_paths = {}


def use_data_path(backend, load):
    """Make `load()` (the data path class, loaded when first needed: a Keras optimizer on
    the torch backend never loads TensorFlow) the data path of the Keras `backend`.

    The class is made as `path(optimizer, variables, options, local, base_apply=...)`,
    with `join=...` too on the torch backend; on TensorFlow it also has
    `outside_the_trace()`, where the optimizer builds its variables."""
    _data_paths[backend] = load


def _data_path(backend):
    load = _data_paths.get(backend)
    if load is None:
        raise RuntimeError(f"the pipelined Keras optimizer's data path on the {backend} "
                           "backend is pipe_horovod.keras's: import pipe_horovod.keras")
    return load()


class PipelinedKeras(_Keras2Gradients):
    """Mixin placed before the user's optimizer class in the MRO."""

    _local_vars = ()     # register_local_var's: a list per instance (_setup_pipeline)

    def _setup_pipeline(self, options, tune=None):
        self._pipe_options = options
        # tune="auto": (the steps it measures, its auto.Pins), checked at wrap time; each
        # build gives its data path a Tuner of them (_path_options). Past Keras's tracking.
        object.__setattr__(self, "_tuning", tune)
        self._path = None                        # the backend's data path, made by build()
        self._joined = False
        # register_local_var's, until build(): set past Keras's attribute tracking, which
        # would make model variables in a list here variables of the optimizer (saved,
        # broadcast and put back after each lookahead prediction with its state).
        object.__setattr__(self, "_local_vars", [])
        self._local = []                         # per built variable: its gradient stays local
        self._agg_helper = None                  # aggregation.py, Horovod's attribute name
        self._reduced = False                    # _compute_gradients reduced what apply gets
        self._tape_checked = False               # _refuse_tape_gradients ran
        object.__setattr__(self, "_retraced", False)   # fit_retraces(): inside a fit

    def register_local_var(self, var):
        """Keep `var`'s gradient local: never reduced, divided by size() when
        scale_local_gradients=True (Horovod's rule), and applied with its step's averaged
        gradients. Call before the first step (Horovod's PartialDistributedOptimizer calls
        it for every trainable variable of its `local_layers`).

        Raises:
            ValueError: the optimizer is built already (its reductions are planned).
        """
        if self.built:
            raise ValueError(f"register_local_var({_variable_name(var)}): the optimizer is "
                             "built already; register local variables before the first step")
        self._local_vars.append(var)

    # --- building ----------------------------------------------------------
    # Keras builds an optimizer wherever it first needs its variables: before the first
    # step (on torch, before the first backward, whose hooks the data path needs), but
    # also inside load_model, which Horovod's resume pattern runs on rank 0 alone. So
    # build() makes the data path locally, and what every rank must do together (compare
    # the models, open the collectives' group) waits for _join(): at on_train_begin in
    # BroadcastGlobalVariablesCallback, else at the first apply() or flush().
    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        variables, options = list(variables), self._path_options()
        self._local = [any(_same_variable(v, local) for local in self._local_vars)
                       for v in variables]
        self._prefix = next_prefix()             # names of what it reduces outside the path
        if options["backward_passes_per_step"] > 1:
            from .aggregation import Aggregation
            self._agg_helper = Aggregation(self, variables, options["backward_passes_per_step"],
                                           options["average_aggregated_gradients"])
        path = _data_path(_backend())
        if _backend() == "torch":
            self._path = path(self, variables, options, self._local,
                              base_apply=self._base_apply, join=self._join)
        else:
            self._path = path(self, variables, options, self._local,
                              base_apply=self._base_apply)
            _built.add(self)
            engine.current().before_shutdown(__name__, _report_unapplied)
        self.fit_retraces(self._retraced)
        pending = self.__dict__.pop("_pending_in_flight", None)
        if pending is not None:
            self._load_in_flight(pending)

    def _join(self):
        """The collective half of building; every rank calls it at the same point."""
        if self._joined:
            return
        self._joined = True
        options = self._pipe_options
        # By position, path, shape and dtype (pipeline/identity.py: why not the bare name)
        description = describe_variables(
            (_variable_name(v), v.shape, _dtype(v), "local" if local else "")
            for v, local in zip(self._path.variables, self._local))
        description.update({f"option {k}": repr(v) for k, v in options.items()
                            if k != "process_set"})
        if self._tuning is not None:         # ranks measuring a different number of steps
            description["option tune"] = repr(f"auto ({self._tuning[0]} steps)")
        ps = options["process_set"]
        if ps is None or ps.included():
            compare_across_ranks(lambda obj: engine.current().allgather_object(
                obj, process_set=ps), description)
            machine = getattr(self._path, "machine", None)   # the torch path's: its optimizer's
            if machine is not None and not machine.solo:
                with _outside_the_trace():       # reads and assigns variables eagerly
                    agree_on_the_state(
                        machine, ps, self._path.state,
                        lambda state: self._path.restore(state.pop("in_flight"), state),
                        self._pipe_wrapper)
        # (tune="auto": the exchange's group is the step machine's to open, where every
        # rank applies a decision that sends one; at K=1 it is never needed)
        if opens_group(options["collective"], options["compression"],
                       None if self._tuning is not None
                       else self._path_options()["prediction_exchange"]):
            communicator(engine.current())

    def _path_options(self):
        """The options as the data paths take them: prediction_exchange resolved ("auto":
        staleness.check_prediction_exchange). The options keep what the user asked for,
        which the ranks compare and a saved model keeps."""
        options = self._pipe_options
        resolved = {**options, "prediction_exchange": check_prediction_exchange(
            options["prediction_exchange"], options["staleness_compensation"])}
        if self._tuning is not None:
            # tune="auto": the TensorFlow path builds its machine with this Tuner (the
            # measured steps at K=1, its graph ready for the deepest K auto may choose);
            # the torch path hands tune to the PyTorch adapter, which checks the same pins.
            steps, pins = self._tuning
            resolved.update(tuner=auto.Tuner(steps, pins), pinned_depth=pins.pipeline_depth)
        return resolved

    def _base_apply(self, grads, variables):
        """The user's optimizer's own update (one iteration)."""
        return super().apply(grads, variables)

    # --- the step ----------------------------------------------------------
    def apply(self, grads, trainable_variables=None):
        variables = (list(trainable_variables) if trainable_variables is not None
                     else list(self._trainable_variables))
        self._build_for(variables)
        self._join()
        if not self._tape_checked:
            self._tape_checked = True
            self._refuse_tape_gradients(variables)
        grads = [_dense(g) for g in grads]
        if self._reduced:                        # _compute_gradients reduced them already
            self._reduced = False
            return self._apply_reduced(grads, variables)
        if self._agg_helper is None:
            return self._path.apply(grads, variables)
        return self._agg_helper.apply(grads, lambda total: self._path.apply(total, variables),
                                      getattr(self._path, "count_pass", None))

    def _refuse_tape_gradients(self, variables):
        """Refuse gradients a pipe_horovod DistributedGradientTape reduced already: reduced
        again here they would be averaged twice and, pipelined, delayed twice (at K=2 each
        an effective depth of 3, and a zero update counted while the tape fills)."""
        # No tape can exist where its module was never imported (nor on the torch backend).
        tape = sys.modules.get("pipe_horovod.tensorflow.gradient_tape")
        if tape is not None and tape.reduces_any(variables):
            raise ValueError(
                "these gradients are reduced twice: pipe_horovod.tensorflow."
                f"DistributedGradientTape reduces them, and {self._pipe_wrapper} (which applies "
                "them) would reduce them again; use one of the two: a plain tf.GradientTape with "
                "this DistributedOptimizer (it applies nothing while its pipeline fills and "
                "compensates the staleness), or the DistributedGradientTape with the unwrapped "
                "Keras optimizer")

    def _build_for(self, variables):
        if not self.built:
            from keras.src import backend as keras_backend
            with _outside_the_trace(), keras_backend.name_scope(self.name, caller=self):
                self.build(variables)
            self.built = True

    def scale_loss(self, loss):
        """Keras's loss scaling; on the torch backend with backward_passes_per_step > 1 it
        also prepares this pass's backward (aggregation.py: Keras's train step calls this
        after Model.zero_grad() and before backward, the one place to put the running sum
        back into `.grad`)."""
        loss = super().scale_loss(loss)
        if self._agg_helper is not None and _backend() == "torch":
            self._agg_helper.prepare_backward()
            scale = self._agg_helper.loss_scale()
            if scale != 1.0:
                loss = loss * scale
        return loss

    def finalize_variable_values(self, var_list):
        """Keras calls this at the end of fit, on every rank: with flush_in_fit (the
        default) every gradient in flight is applied (flush()); with flush_in_fit=False
        they stay in flight and the model only gets its real weights back where the
        staleness compensation left this rank's predicted ones. Either way what is read
        after fit is the same on every rank."""
        if self._path is not None:
            if self._pipe_options["flush_in_fit"]:
                self.flush()
            else:
                self._path.put_real_back()
        super().finalize_variable_values(var_list)

    def restore_real_weights(self):
        """Put the real weights back in the model where it holds this rank's prediction.

        Why: with staleness_compensation="lookahead" the TensorFlow backend leaves the
        model at this rank's predicted weights between steps. Whatever reads the model
        outside a train step (evaluate, predict, a checkpoint; callbacks.
        PipelineFlushCallback does it at the start of each) calls this first, so it
        sees the weights training updates, the same on every rank. No collective: one
        rank may call it alone. The next step computes at the real weights.
        """
        if self._path is not None:
            self._path.put_real_back()

    @contextlib.contextmanager
    def real_weights(self):
        """A block in which the model holds the real weights; this rank's prediction comes
        back, bit for bit, when it ends.

        Why: with staleness_compensation="lookahead" the TensorFlow backend leaves the
        model at this rank's predicted weights between steps, so a file written then
        (model.save, save_weights, export) held the prediction as the model's weights.
        Written in this block it holds the real ones, and the optimizer's own saved
        variables carry the prediction: keras.models.load_model(path, compile=False) and
        load_weights get the real weights, and a resume with the optimizer puts the
        prediction back and continues exactly. fit (flush_in_fit=True) runs every
        model.save, save_weights and export of its model in this block. No collective:
        one rank may enter it alone. Where the model holds no prediction (the torch
        backend predicts at the next forward pass) it does nothing.
        """
        path = self._path
        prediction = getattr(path, "prediction", lambda: None)()
        if prediction is None:
            yield
            return
        steps, in_flight = path.timings["steps"], path.in_flight()
        path.put_real_back()
        object.__setattr__(self, "_held_prediction", prediction)   # _save_in_flight's
        try:
            yield
        finally:
            object.__setattr__(self, "_held_prediction", None)
            # Unless the block trained, flushed or loaded (then the prediction is stale).
            if (self._path is path and path.timings["steps"] == steps
                    and path.in_flight() == in_flight and path.prediction() is None):
                path.hold_prediction(prediction)

    def flush(self):
        """Apply every gradient still in flight, oldest first (one update each).

        Call it (or use callbacks.PipelineFlushCallback) at the end of
        training, and before evaluating or saving weights that must hold
        every computed gradient.
        """
        if self._path is None:
            return                               # not built: nothing computed or loaded
        self._join()
        self._path.flush()

    @property
    def timings(self):
        """Steps taken, updates applied, and seconds spent waiting for reductions."""
        if self._path is None:
            return {"steps": 0, "wait_s": 0.0, "applied": 0}
        return self._path.timings

    def write_run_summary(self, path):
        """Write what this run measured to `path` as JSON on rank 0 (see the PyTorch
        DistributedOptimizer's write_run_summary); None before the first step."""
        return None if self._path is None else self._path.write_run_summary(path)

    @property
    def in_flight(self):
        """How many computed gradients are not applied yet."""
        return 0 if self._path is None else self._path.in_flight()

    # --- elastic training (pipe_horovod.keras.elastic) ----------------------------
    # KerasState calls these around a failure and an engine reset, as the PyTorch
    # adapter's elastic state calls the torch optimizer's methods of the same names.
    def drop_in_flight(self):
        """Forget, without waiting, every gradient in flight and this step's progress:
        after a failed collective they never land here. The committed state is loaded
        next (load_own_variables)."""
        if self._path is not None:
            self._path.drop_in_flight()

    def release_engine(self):
        """Leave the engine before elastic resets it: its shutdown reports gradients in
        flight as never applied, and the committed ones will be, after the reset."""
        _built.discard(self)
        if self._path is not None and _backend() == "torch":
            self._path.torch_optimizer.release_engine()

    def rebind_engine(self):
        """Attach to the engine running now: after an elastic reset it is a new one, and
        rank and size may differ. Every rank compares its model again at the next
        collective point (elastic's sync).

        Raises:
            RuntimeError: the optimizer reduces over a process set, which does not
                survive the reset.
        """
        if self._pipe_options["process_set"] is not None:
            raise RuntimeError("a DistributedOptimizer over a process set cannot follow an "
                               "elastic reset: process sets do not survive it")
        self._joined = False
        if self._path is None:
            return
        self._path.rebind_engine()
        if _backend() == "tensorflow":
            _built.add(self)
            engine.current().before_shutdown(__name__, _report_unapplied)

    def prediction_scope(self):
        """The context the "lookahead" prediction runs this optimizer's updates in.

        The prediction is this optimizer's own update run on this rank's local
        gradients; entering a different context here changes what it sees without
        touching the real update (the convergence bench lifts `global_clipnorm` so as
        to measure what clipping the local gradient does to the prediction). On
        TensorFlow it is entered while the prediction is traced; on torch around each
        prediction.

        Returns:
            A context manager; this one does nothing. Override the method, or assign
            a function returning a context manager to it on the instance.
        """
        return contextlib.nullcontext()

    # --- the traced train step (TensorFlow) -----------------------------------------
    def fit_retraces(self, on):
        """Say whether a fit that traces its train step again when step_holds() differ is now
        running (PipelineFlushCallback, from on_train_begin to on_train_end). Why: a step
        traced once must hold everything tune="auto" may come to need (the lookahead, a
        second gradient where a trial is undone), which costs a K=1 step about a ms;
        retraced, it holds only what the pipeline's state needs now."""
        object.__setattr__(self, "_retraced", bool(on))
        if self._path is not None and hasattr(self._path, "retraced"):
            self._path.retraced = bool(on)

    def step_holds(self):
        """(what the train step that ran last was traced to hold, what the next one needs):
        where they differ, the model's train function must be made again, or one traced
        for the second taken back, before the next step. (None, None) where nothing is
        traced (the torch backend) or no step ran yet."""
        if self._path is None or not hasattr(self._path, "holds") or self._path.ran is None:
            return None, None
        return self._path.ran, self._path.holds()

    def time_handoffs(self, timed):
        """Let a benchmark time the TensorFlow path's Python work of each step.

        Args:
            timed: called as `timed(key, fn)` for each function the graph calls back
                into Python, with key "fill_s" (copying a bucket's gradients into its
                buffer), "handoff_s" (one bucket's hand-off, fill and launch included)
                or "finish_s" (the step's last hand-off: launch what is left, wait,
                hand the averaged gradient back); it returns the function to run in
                fn's place (fn inside a timer, say).

        Returns:
            True when there was a TensorFlow path to time; False on the torch backend,
            whose work runs in the PyTorch adapter's hooks.

        Raises:
            ValueError: the optimizer is not built yet; build it (`opt.build(variables)`)
                before the first trace, since the graph keeps the functions it traced.
        """
        if self._path is None:
            raise ValueError("build the optimizer (opt.build(model.trainable_variables)) "
                             "before time_handoffs")
        if _backend() != "tensorflow":
            return False
        self._path.time_handoffs(timed)
        return True

    # --- serialization -----------------------------------------------------
    def get_config(self):
        if not told_saving:                      # model.save: once per process
            told_saving.append(True)
            warnings.warn(
                "a model saved with a pipe_horovod DistributedOptimizer loads where "
                "pipe_horovod.keras is imported and initialized (keras.models.load_model or "
                "hvd.load_model); elsewhere load the weights alone with "
                "keras.models.load_model(path, compile=False)", stacklevel=2)
        inner = _user_class(type(self))
        builtin = inner.__module__.startswith("keras.")
        return {"optimizer": {"module": "keras.optimizers" if builtin else inner.__module__,
                              "class_name": inner.__name__,
                              "config": inner.get_config(self),
                              "registered_name": None if builtin else _registered_name(inner)},
                **{k: _config_value(k, v) for k, v in self._pipe_options.items()
                   if k != "process_set"},
                # tune="auto" chooses the depth: saved unpinned, a reload chooses again
                **({"pipeline_depth": self._tuning[1].pipeline_depth}
                   if self._tuning is not None else {})}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        import keras

        config = copy.deepcopy(config)           # deserialize edits what it is given
        inner = keras.optimizers.deserialize(config.pop("optimizer"),
                                             custom_objects=custom_objects)
        config["compression"] = Compression.by_name(config["compression"])
        config["op"] = engine.ReduceOp(config["op"])
        if config.get("collective") is not None:
            config["collective"] = Collective.from_config(config["collective"])
        return DistributedOptimizer(inner, **config)

    # --- checkpoints: the gradients in flight travel with the optimizer's variables,
    # and so does what the staleness compensation keeps (per in-flight step: this
    # rank's own gradients or the weights then; the real weights while the model holds
    # predicted ones; dc's running mean square), each {name: tensor} stored per variable.
    def save_own_variables(self, store):
        super().save_own_variables(store)
        # Keras writes the model's layers before its optimizer (saving_lib._save_state),
        # so where this finds the prediction in the model, the file holds it already.
        # (Keras's file stores are not dicts; pipe_horovod's in-memory copies, broadcast
        # and elastic, are, and there the prediction is what must travel.)
        if self._save_in_flight(store) and not isinstance(store, dict):
            warnings.warn(
                "this file holds this rank's lookahead prediction as the model's weights, "
                "not the real ones: on TensorFlow the model holds the prediction between "
                "train steps, and this save ran outside fit's (or in a fit with "
                "flush_in_fit=False). Resuming with this optimizer is exact (it saved the "
                "real weights), but keras.models.load_model(path, compile=False) and "
                "load_weights get the prediction. Save inside `with "
                "model.optimizer.real_weights():` (fit with flush_in_fit=True does that for "
                "model.save, save_weights and export), or after flush()", stacklevel=2)

    def _save_in_flight(self, store):
        """What is in flight, into `store` ({key: array}): model.save's and (checkpoint_state.
        InFlight) tf.train.Checkpoint's. Inside real_weights() the model holds the real
        weights and the prediction is stored here ("prediction"), for a resume to put back.

        Returns:
            True where the model's variables hold this rank's prediction now (so what is
            saved beside them holds it as the model's weights).
        """
        if self._path is None:
            return False
        state = self._path.state()
        in_flight, kept = state.pop("in_flight"), state.pop("kept", [])
        real, mean_square = state.pop("real", None), state.pop("mean_square", {})
        residuals = state.pop("error_feedback", None) or {}
        prediction = self.__dict__.get("_held_prediction")
        if prediction is not None:               # real_weights(): the model holds them
            real = {n: np.array(v.numpy(), copy=True)
                    for n, v in zip(self._path.names, self._path.variables)}
        store["pipe_horovod"] = np.frombuffer(json.dumps(
            {**state, "entries": len(in_flight), "kept": [sorted(k) for k in kept],
             "real": real is not None, "prediction": prediction is not None,
             "mean_square": sorted(mean_square),
             "error_feedback": {str(slot): sorted(r) for slot, r in residuals.items()}}
        ).encode(), dtype=np.uint8)
        for k, grads in enumerate(in_flight):
            self._store(store, f"pipe_horovod.{k}", grads)
        for k, kinds in enumerate(kept):
            for kind, tensors in kinds.items():
                self._store(store, f"pipe_horovod.kept.{k}.{kind}", tensors)
        self._store(store, "pipe_horovod.real", real or {})
        self._store(store, "pipe_horovod.prediction", prediction or {})
        self._store(store, "pipe_horovod.mean_square", mean_square)
        for slot, tensors in residuals.items():
            self._store(store, f"pipe_horovod.error_feedback.{slot}", tensors)
        return real is not None and prediction is None

    def _store(self, store, prefix, tensors):
        for i, (name, v) in enumerate(zip(self._path.names, self._path.variables)):
            if name in tensors:
                t = tensors[name]
                store[f"{prefix}.{i}"] = np.asarray(t.cpu() if hasattr(t, "cpu") else t
                                                    ).reshape(v.shape)

    def load_own_variables(self, store):
        keys = list(store.keys())
        own = {key: store[key] for key in keys if not key.startswith("pipe_horovod")}
        super().load_own_variables(own)
        self._load_in_flight(store)

    def _load_in_flight(self, store, after_read=False):
        """Restore what _save_in_flight stored: now, or where the optimizer is not built yet
        (a tf.train.Checkpoint read before the first step), when build() makes its path.
        after_read: a prediction saved with it waits for _hold_read_prediction."""
        if "pipe_horovod" not in list(store.keys()):
            return
        if self._path is None:
            object.__setattr__(self, "_pending_in_flight", dict(store))
            return
        state = json.loads(bytes(np.asarray(store["pipe_horovod"])).decode())
        names = self._path.names

        def load(prefix, only=None):
            return {name: np.asarray(store[f"{prefix}.{i}"]) for i, name in enumerate(names)
                    if only is None or name in only}
        in_flight = [load(f"pipe_horovod.{k}") for k in range(state.pop("entries"))]
        state["kept"] = [{kind: load(f"pipe_horovod.kept.{k}.{kind}") for kind in kinds}
                         for k, kinds in enumerate(state.get("kept", []))]
        state["real"] = load("pipe_horovod.real") if state.get("real") else None
        state["mean_square"] = load("pipe_horovod.mean_square", state.get("mean_square", []))
        state["error_feedback"] = {
            int(slot): {n: a.reshape(-1) for n, a in
                        load(f"pipe_horovod.error_feedback.{slot}", only).items()}
            for slot, only in (state.get("error_feedback") or {}).items()}   # older: null
        # Saved inside real_weights(): the model was written (and has loaded, layers
        # first) the real weights; it predicted when saved, so it predicts again.
        prediction = load("pipe_horovod.prediction") if state.pop("prediction", False) else None
        self._path.restore(in_flight, state)
        if prediction is not None and hasattr(self._path, "hold_prediction"):
            if after_read:
                object.__setattr__(self, "_read_prediction", prediction)
            else:
                self._path.hold_prediction(prediction)

    def _hold_read_prediction(self):
        """Hold the prediction a tf.train.Checkpoint read brought (checkpoint_state.py), now
        that the model's variables hold the real weights it read."""
        prediction = self.__dict__.pop("_read_prediction", None)
        if prediction is not None:
            self._path.hold_prediction(prediction)


told_saving = []        # the warning of get_config, once per process


def _config_value(key, value):
    """An option as get_config keeps it (plain values, for the saved model's JSON)."""
    if key == "compression":
        return config_name(value)
    if key == "op":
        return value.value
    if key == "collective":
        return None if value is None else value.config()
    if key == "bucket_cap_mb" and isinstance(value, AutoBucketCap):
        return None      # automatic: a reload resolves it again, for its own world size
    return value


def _report_unapplied():
    # (On the torch backend the PyTorch adapter reports its own.)
    report_unapplied(sum(opt.in_flight for opt in list(_built)),
                     "add callbacks.PipelineFlushCallback() to fit, or call "
                     "model.optimizer.flush(), to apply them")


def _register(cls):
    """Saved models name every wrapped optimizer "pipe_horovod>DistributedOptimizer";
    loading resolves that name to whichever class holds it, all alike."""
    import keras
    return keras.saving.register_keras_serializable("pipe_horovod", "DistributedOptimizer")(cls)


def _user_class(cls):
    """The user's optimizer class behind a wrapped class (past our mixins)."""
    return next(c for c in cls.__mro__[1:] if c not in PipelinedKeras.__mro__
                and not issubclass(c, PipelinedKeras))


def _registered_name(cls):
    import keras
    return keras.saving.get_registered_name(cls)


def _outside_the_trace():
    """Where build() creates the optimizer's variables (its slots, the lookahead's real
    weights) when Keras first builds it inside the traced train step, as fit does without
    a distribution strategy: on TensorFlow, eagerly and unseen by the tf.function being
    traced (the TensorFlow data path's outside_the_trace: the bridge's eager_variables), so
    that it is traced once, not twice (a tf.function that created variables on its first
    trace traces again: half of a fit's tracing)."""
    if _backend() != "tensorflow":
        return contextlib.nullcontext()
    return _data_path("tensorflow").outside_the_trace()


def _check_optimizer(optimizer):
    if isinstance(optimizer, PipelinedKeras):
        refuse_double_wrapping(getattr(optimizer, "_pipe_wrapper", WRAPPER), WRAPPER,
                               "Keras optimizer")
    module = type(optimizer).__module__
    if module.startswith(("tf_keras", "tensorflow.python.keras", "keras.src.optimizers.legacy",
                          "keras.optimizers.legacy")):
        raise TypeError(f"{type(optimizer).__name__} is a Keras 2 (tf.keras / tf-keras) "
                        "optimizer; pipe_horovod.keras wraps Keras 3 optimizers "
                        "(keras.optimizers.SGD, Adam, ...)")
    import keras
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a keras.optimizers.Optimizer, got "
                        f"{type(optimizer).__name__}")
    backend = _backend()
    if backend not in SUPPORTED_BACKENDS:
        raise ValueError(f"the Keras backend is {backend!r}; pipe_horovod.keras supports "
                         f"{' and '.join(SUPPORTED_BACKENDS)} (set KERAS_BACKEND)")
    if backend == "tensorflow":
        import tensorflow as tf
        if tf.distribute.has_strategy():
            raise ValueError("a tf.distribute strategy is active: it would average the "
                             "gradients a second time; use pipe_horovod alone (no strategy "
                             "scope) for data parallelism")
    if getattr(optimizer, "gradient_accumulation_steps", None):
        raise ValueError(f"the optimizer accumulates gradients itself "
                         f"(gradient_accumulation_steps={optimizer.gradient_accumulation_steps}), "
                         "after the reduction; wrap it without that and pass "
                         "DistributedOptimizer(..., backward_passes_per_step=N, "
                         "average_aggregated_gradients=True), which sums before reducing")


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                         compression=Compression.none, sparse_as_dense=False,
                         gradient_predivide_factor=1.0, op=engine.Average,
                         backward_passes_per_step=1, average_aggregated_gradients=False,
                         num_groups=0, groups=None, process_set=None,
                         scale_local_gradients=True, *, pipeline_depth=None, warmup_steps=0,
                         bucket_cap_mb=None, staleness_compensation=staleness.DEFAULT,
                         collective=None, flush_in_fit=True, prediction_exchange="auto",
                         tune=None):
    """Wrap a Keras 3 optimizer so its gradients are averaged across ranks, pipelined.

    The arguments up to `scale_local_gradients` are horovod.tensorflow.keras's,
    in its order, so a Horovod script's call works unchanged. device_dense
    and device_sparse are accepted and unused (the engine places
    reductions); gradients reach the engine dense (a sparse one, such as an
    Embedding's, is made dense), so sparse_as_dense changes nothing; groups
    is a bucket count, like num_groups.

    backward_passes_per_step=N > 1 sums each variable's gradient locally over
    N passes and reduces the sum once (divided by N with
    average_aggregated_gradients), as Horovod does; the N-1 passes between
    count an iteration each and apply nothing, so `iterations` counts passes.
    The N-th pass's sum is one pipeline step (aggregation.py).
    Local variables (register_local_var, PartialDistributedOptimizer) are
    not reduced: their gradient is this rank's, divided by size() when
    scale_local_gradients is True, and travels with its step.

    `compression`, `gradient_predivide_factor`, `op` and `process_set` mean
    what they mean to Horovod. pipeline_depth: 1 applies g_t at step t
    (synchronous); K >= 2 applies g_{t-K+1}, the reduction overlapping
    K-1 steps. Default: $PIPE_HOROVOD_PIPELINE_DEPTH if set; else tune="auto"
    chooses 1 or 2 (see `tune`), and 2 where tuning is off.
    warmup_steps: synchronous steps before the pipeline starts.
    staleness_compensation: how a gradient K-1 steps old is made to act like
    a fresh one (pipe_horovod/pipeline/staleness.py; docs/convergence.md);
    no effect at K=1 or during warm-up. "lookahead" (the default, as in the
    PyTorch adapter): each rank computes its gradient at the weights the
    updates in flight will produce, found by running this optimizer, from a
    copy of its variables, on this rank's own gradients of those steps. So
    during fit the model holds this rank's predicted weights; the next
    update, flush() and the end of fit put the real ones back, and
    checkpoints carry them. Alone (one process, nothing to send) that
    prediction is the next update itself, so the pipeline runs at depth 1.
    None: plain Pipe-SGD. On the torch backend also "predict", "dc" and
    "momentum" (the latter reduces the optimizer's `momentum` or `beta_1`);
    on TensorFlow only None and "lookahead".
    prediction_exchange: "auto" (default), None, "int4" or "int8": "lookahead"
    predicts from the ranks' average of the step in flight, exchanged in that
    format as backward produces it (1/8 or 1/4 of the gradient's bytes), in
    place of this rank's own gradients: every rank then predicts the same
    weights. The step waits for that exchange, and its full reductions start
    after it. "auto": "int4" with "lookahead", else None. On Keras models the
    own gradient (None, the PyTorch adapter's default) lagged sync by up to
    0.06 val loss; int4 kept every cell of the sweep within 0.02, at about
    +12% a step where the link is the bottleneck (docs/convergence.md).
    collective: None (the engine's own allreduce) or "lp", "ring", "mst", "be"
    (a pipe_horovod.collectives.Collective): reduce the buckets with
    pipe_horovod's collectives, where `compression` works at every hop, so
    Compression.int8 and int8_ef (error feedback, whose residuals checkpoints
    carry, per rank) become possible; as in the PyTorch adapter.
    bucket_cap_mb: MiB per bucket; None (default): chosen from the number of
    ranks and the link, as in the PyTorch adapter (docs/planner.md). A saved
    model keeps None, so loading it chooses again for the ranks it runs on.
    flush_in_fit (default True): `fit` applies every gradient in flight after
    each epoch's last batch and when it ends, and puts the real weights back
    before each evaluate() and predict() (callbacks.PipelineFlushCallback,
    which fit then gets first among its callbacks), so validation,
    checkpoints, EarlyStopping and what fit leaves behind all see the real
    weights, the same on every rank, with every computed gradient applied.
    False keeps the gradients in flight across epochs and fits (flush() is
    then the caller's, as before).
    tune: "auto" (the default unless a pipeline depth is given) or "off" (the
    configuration as given: K=2 with the lookahead and its int4 exchange where no
    depth is given). "auto": the run tunes
    itself (docs/auto.md): its first $PIPE_HOROVOD_TUNE_STEPS steps (20) train
    synchronously while it measures compute, exposed wait and the link; then
    every rank applies the depth (1 or 2), codec and bucket cap predicted fastest
    among those the convergence rule allows (K=2 priced with the prediction
    exchange it sends), and rank 0 logs one line saying why. An explicit
    pipeline_depth, compression or bucket_cap_mb pins that choice; one auto cannot
    honour is a ValueError naming both. None (default): $PIPE_HOROVOD_TUNE
    ("auto" or "off") if set, else "auto" where neither the pipeline_depth argument
    nor $PIPE_HOROVOD_PIPELINE_DEPTH is given, else "off".
    Every rank must build the same model: differences are raised as
    ValueError on every rank at the first step (or at
    BroadcastGlobalVariablesCallback's on_train_begin), not when the
    optimizer is built, which Horovod's resume does on rank 0 alone.
    """
    _check_optimizer(optimizer)
    for flag, value in (("average_aggregated_gradients", average_aggregated_gradients),
                        ("sparse_as_dense", sparse_as_dense),
                        ("scale_local_gradients", scale_local_gradients),
                        ("flush_in_fit", flush_in_fit)):
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{flag} must be True or False, got {value!r}")
    if num_groups:
        groups = num_groups if groups is None else groups
    if groups is not None and (isinstance(groups, bool) or not isinstance(groups, int)
                               or groups < 0):
        raise ValueError(f"groups must be a bucket count (an int >= 0) in the Keras adapter, "
                         f"got {groups!r}")
    pinned_cap = bucket_cap_mb
    pipeline_depth, depth_source = resolve_depth(pipeline_depth)
    bucket_cap_mb = resolve_bucket_cap_mb(bucket_cap_mb, process_set)   # None: auto
    check_options(pipeline_depth, warmup_steps, backward_passes_per_step, bucket_cap_mb)
    collective = check_collective(collective, compression)
    check_reduction(op, gradient_predivide_factor)
    compensation = check_staleness(staleness_compensation)
    exchange = check_prediction_exchange(prediction_exchange, compensation)
    pinned_depth = pipeline_depth if depth_source != "default" else None
    # K=2 is priced with the prediction exchange the lookahead sends (resolved above).
    tuned = auto.tuning(tune, pinned_depth is not None, functools.partial(
        auto.pins_from_options, pinned_depth, compression, pinned_cap, warmup_steps,
        collective, op, exchange if pinned_depth != 1 else None))
    supported = COMPENSATION[_backend()]
    if compensation is not None and compensation not in supported:
        raise ValueError(f"staleness_compensation={compensation!r} is not available on the "
                         f"Keras {_backend()} backend; there: None or "
                         f"{', '.join(map(repr, supported))}")
    if compensation == "momentum" and momentum_attribute(optimizer) is None:
        raise ValueError(f"staleness_compensation='momentum' reduces the optimizer's momentum, "
                         f"but this {type(optimizer).__name__} has none (no nonzero `momentum` or "
                         "`beta_1`); use 'lookahead' instead")
    if process_set is engine.global_process_set:
        process_set = None
    if process_set is not None and not isinstance(process_set, engine.ProcessSet):
        raise TypeError(f"process_set must be a pipe_horovod ProcessSet, got {process_set!r}")
    engine.current()                             # a clear error before init()
    if tuned is None:
        announce_depth(pipeline_depth, warmup_steps, depth_source, process_set, _announced)
    elif _backend() == "tensorflow":             # (on torch the PyTorch adapter says it)
        auto.announce(auto.Tuner(*tuned), process_set, _announced)
    if optimizer.built:
        raise ValueError("wrap the optimizer before it is built (before compile/fit), so "
                         "every rank builds the pipeline with it")
    cls = type(optimizer)
    # Saved under SAVED_MODULE: Keras looks up classes of keras modules by name, so the
    # user's module (keras.src.optimizers.sgd) would load as a plain SGD given our config
    # ("Argument(s) not recognized"); here the error says what is missing.
    wrapped_cls = type(cls.__name__, (PipelinedKeras, cls), {"__module__": SAVED_MODULE})
    _register(wrapped_cls)
    optimizer.__class__ = wrapped_cls
    optimizer._pipe_wrapper = WRAPPER            # what a second wrapper's refusal names
    if name is not None:
        optimizer.name = name
    optimizer._setup_pipeline({
        "pipeline_depth": pipeline_depth, "warmup_steps": warmup_steps,
        "compression": compression, "op": op,
        "gradient_predivide_factor": float(gradient_predivide_factor),
        "bucket_cap_mb": bucket_cap_mb, "groups": groups or None, "process_set": process_set,
        "staleness_compensation": compensation, "prediction_exchange": prediction_exchange,
        "collective": collective,
        "backward_passes_per_step": backward_passes_per_step,
        "average_aggregated_gradients": bool(average_aggregated_gradients),
        "sparse_as_dense": bool(sparse_as_dense),
        "scale_local_gradients": bool(scale_local_gradients), "flush_in_fit": bool(flush_in_fit),
        "tune": tune}, tuned)
    if _backend() == "tensorflow":              # tf.train.Checkpoint carries what is in flight
        from .checkpoint_state import InFlight, write_real_weights
        optimizer.pipe_horovod_in_flight = InFlight(optimizer)
        write_real_weights(lambda: list(_built))
    if flush_in_fit:
        from .callbacks import flush_in_every_fit
        flush_in_every_fit()
    return optimizer


def PartialDistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                                compression=Compression.none, sparse_as_dense=False,
                                gradient_predivide_factor=1.0, op=engine.Average, groups=None,
                                process_set=None, local_layers=None, scale_local_gradients=True,
                                **options):
    """A DistributedOptimizer whose `local_layers`' trainable variables are local
    (register_local_var): their gradients are not reduced. Horovod's
    (horovod.keras.PartialDistributedOptimizer), with the same arguments; the keyword
    options after them are DistributedOptimizer's.

    Raises:
        TypeError: `local_layers` holds something that is not a Keras layer.
    """
    import keras

    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    bad = [layer for layer in local_layers if not isinstance(layer, keras.layers.Layer)]
    if bad:
        raise TypeError(f"PartialDistributedOptimizer: local_layers must be Keras layers, got "
                        f"{type(bad[0]).__name__}")
    wrapped = DistributedOptimizer(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
        compression=compression, sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=op, groups=groups,
        process_set=process_set, scale_local_gradients=scale_local_gradients, **options)
    for layer in local_layers:
        for variable in layer.trainable_weights:
            wrapped.register_local_var(variable)
    return wrapped


def _variable_name(variable):
    return getattr(variable, "path", None) or variable.name


def _dtype(variable):
    import keras
    return keras.backend.standardize_dtype(variable.dtype)


def pipe_options(optimizer):
    """The pipeline options of `optimizer` (a pipelined one) as the user gave them."""
    return optimizer._pipe_options


_register(PipelinedKeras)    # so load_model in a fresh process finds from_config

__all__ = ["DistributedOptimizer", "PartialDistributedOptimizer"]
