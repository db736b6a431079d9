"""DistributedGradientTape: Horovod's TF2 tape, its gradients averaged across ranks, pipelined.

    with tf.GradientTape() as tape:
        loss = ...
    tape = hvd.DistributedGradientTape(tape)              # Horovod's keyword arguments
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))

A script builds a new tape every step, so the pipeline cannot live in the
tape: it lives in a `_Pipeline` per list of sources (the variables, by
identity), made at the first `gradient()` for them (at trace time inside a
tf.function) and found again by every later tape, retrace or not. Its step
is pipe_horovod.pipeline.StepMachine, the one the other adapters use.

What `tape.gradient` returns (DESIGN.md's semantics, pipeline_depth=K):
- K=1: this step's gradients, averaged over the ranks (Horovod's math).
- K>=2: the averaged gradients of the step K-1 steps earlier; while the
  pipeline fills (the first K-1 steps after warm-up, none before) it
  returns zeros. An optimizer step on zeros leaves plain SGD's weights
  where they are, but moves momentum, Adam's moments, weight decay and the
  iteration counter: for those, wrap the optimizer instead
  (hvd.DistributedOptimizer, which applies nothing while the pipeline
  fills, and compensates the staleness), or use pipeline_depth=1. The tape
  never sees the optimizer, so it applies no staleness compensation.
- `tape.flush()` (or `hvd.flush(sources)`) hands back the averaged
  gradients still in flight, oldest first: apply each at the end of
  training so no gradient is lost.
- A gradient that is None on this rank is sent as zeros (ranks must send
  the same buckets) and returned as None, as Horovod returns it.
  tf.IndexedSlices gradients are reduced dense (sparse_as_dense=True).
- A local source (`register_local_source`, or PartialDistributedGradientTape's
  `local_layers`) is not reduced: its gradient is this rank's own, divided by
  the ranks' number with scale_local_gradients (Horovod's rule), and travels
  with its step, so it is returned with the same delay as the averaged ones.

Overlap: TensorFlow's tape.gradient hands back every gradient at once, so a
step's reduction starts after its backward pass and overlaps the next K-1
steps' compute (at K=1 it overlaps nothing). `GradientsInFlight(sources)`
puts what is in flight into a tf.train.Checkpoint, so save -> restore ->
continue is exact. The ranks agree on the step and the gradients in flight when a
pipeline is built (a resume where rank 0 alone restored takes rank 0's), and
`hvd.join()` lets what is in flight land and lines the steps up again after
uneven data, as the PyTorch optimizer's join does.
"""
import functools
import io
import itertools
import json
import warnings
import weakref

import numpy as np
import tensorflow as tf
import torch

from .. import engine
from ..compression import Compression
from ..pipeline import (StepGradient, StepMachine, announce_depth, auto, check_options,
                        check_reduction, compare_across_ranks, report_unapplied, resolve_depth)
from ..pipeline.buckets import bucket_cap_bytes, resolve_bucket_cap_mb
from ..pipeline.local_scale import LocalScale
from ..pipeline.identity import describe_variables
from ..pipeline.resume_agreement import agree_on_the_state
from . import bridge

# (source ids, process set) -> _Pipeline. The pipeline holds its sources by weak reference
# and leaves this when one of them goes: a k-fold or tuner loop's throwaway models take
# their buffers (and their unapplied gradients) with them.
_pipelines = {}
_pending = {}                      # source ids -> (weak sources, a checkpoint's state)
_prefixes = itertools.count()      # built in the same order on every rank: names agree
_announced = set()
_built = weakref.WeakSet()


def _ref(source):
    """A hashable stand-in for a source, that does not keep it alive: its identity (TF's
    own `ref()` would hold the variable). Valid while the source lives: a pipeline goes
    with its sources (_Pipeline's weak references)."""
    return id(source)


def _weak(source, callback=None):
    """A weak reference to `source`, or (what cannot be weakly referenced) a strong one."""
    try:
        return weakref.ref(source, callback)
    except TypeError:
        return lambda: source


def _path(source):
    """What names a source across ranks: a Keras 3 variable's path, else its name."""
    return getattr(source, "path", None) or getattr(source, "name", None) or "tensor"


def _key(sources):
    return tuple(_ref(s) for s in sources)


def _torch_dtype(dtype):
    return getattr(torch, tf.as_dtype(dtype).name)


class _Pipeline:
    """The pipelined reduction of one list of sources' gradients, across tapes and steps."""

    def __init__(self, sources, options):
        sources = list(sources)
        key = (_key(sources), options["process_set"])
        # Weak: the pipeline leaves _pipelines when a source goes (_forget)
        self._sources = [_weak(s, lambda _, key=key: _forget(key)) for s in sources]
        self.options = options
        self.names = [f"{i}.{getattr(s, 'name', 'tensor')}" for i, s in enumerate(sources)]
        self.local = {n for n, s in zip(self.names, sources)
                      if _ref(s) in options["local_sources"]}
        self.devices = {n: bridge.torch_device(s) for n, s in zip(self.names, sources)}
        self.shapes = [tuple(s.shape) for s in sources]
        self.dtypes = [tf.as_dtype(s.dtype) for s in sources]
        for shape, source in zip(self.shapes, sources):
            if any(d is None for d in shape):
                raise ValueError(f"DistributedGradientTape needs sources of a known shape; "
                                 f"{getattr(source, 'name', source)} has shape {shape}")
        ps = options["process_set"]
        groups = options["groups"]
        if isinstance(groups, list):                 # Horovod's lists of variables -> names
            position = {_ref(s): n for s, n in zip(sources, self.names)}
            groups = [[position[ref] for ref in group] for group in groups]
        self.number = next(_prefixes)
        depth, warmup, tuner = options["pipeline_depth"], options["warmup_steps"], None
        if options["tune"] is not None:          # tune="auto": its measured steps at K=1
            steps, pins = options["tune"]
            tuner = auto.Tuner(steps, pins, may_try=False)
            depth, warmup = 1, auto.warmup_steps(steps, warmup)
        self.machine = StepMachine(
            f"tf_tape{self.number}", depth, warmup,
            compression=options["compression"], op=options["op"],
            predivide=options["gradient_predivide_factor"], process_set=ps,
            cap_bytes=bucket_cap_bytes(options["bucket_cap_mb"]), groups=groups, tune=tuner)
        # Ready order: backward produces the last layer's gradients first.
        self.machine.plan([(name, int(np.prod(shape, dtype=np.int64)), dtype.size,
                            (_torch_dtype(dtype), self.devices[name]))
                           for name, shape, dtype in reversed(list(zip(
                               self.names, self.shapes, self.dtypes))) if name not in self.local])
        # A local source is this rank's own (never sent): its shape may differ between
        # ranks, as a model-parallel layer's does (Horovod's test_model_parallel_model).
        # By position, path, shape and dtype (pipeline/identity.py: why not the bare name).
        description = describe_variables(
            ((_path(source), None, None, "local") if n in self.local else
             (_path(source), s, d.name, "")
             for n, source, s, d in zip(self.names, sources, self.shapes, self.dtypes)),
            what="source")
        description.update({f"option {k}": repr(v) for k, v in options.items()
                            if k not in ("process_set", "groups", "local_sources")})
        tune = options["tune"]                   # ranks measuring other numbers of steps
        description["option tune"] = repr(tune and f"auto ({tune[0]} steps)")
        if ps is None or ps.included():
            compare_across_ranks(lambda obj: engine.current().allgather_object(
                obj, process_set=ps), description, what="list of variables to differentiate")
        self._arrays = {}
        self.timings = {"steps": 0, "applied": 0}
        machine = self.machine                   # (not self: no cycle keeps the pipeline)
        self.scale_local = LocalScale(options["scale_local_gradients"], lambda: machine.size)
        pending = _pending_for(sources)
        if pending is not None:
            self.restore(pending)
        if not machine.solo:
            self._agree_on_the_state()
        _built.add(self)

    @property
    def sources(self):
        """The sources, while they live (None in place of one that went)."""
        return [ref() for ref in self._sources]

    @property
    def local_scale(self):
        """What a local source's gradient is multiplied by: 1/size with
        scale_local_gradients, of the engine running now (elastic resets change it)."""
        return self.scale_local.value

    # --- a step (Python side: eagerly, or a py_function inside a tf.function) -------
    def step(self, *grads):
        machine = self.machine
        self._arrays = {n: bridge.to_torch(g) for n, g in zip(self.names, grads)}
        # Copies: TensorFlow reuses the buffers once the hand-off returns.
        own = {n: self._arrays.pop(n).reshape(-1) * self.local_scale for n in self.local}
        if machine.solo:                         # nothing to send: the gradient is the average
            entry = StepGradient(loaded={**{n: a.reshape(-1).clone()
                                            for n, a in self._arrays.items()}, **own})
        else:
            for name in reversed(self.names):
                if name not in self.local:
                    machine.ready(name, self._fill)
            machine.launch_rest(self._fill)
            entry = StepGradient(machine.launched, loaded=own or None)
        self._arrays = {}
        ready = machine.finish_step(entry)
        self.timings["steps"] += 1
        if not ready:
            return [tf.zeros(s, d) for s, d in zip(self.shapes, self.dtypes)] + [False]
        (oldest,) = ready                        # restore() refuses what would pop several
        self.timings["applied"] += 1
        return self._handed_out(oldest) + [True]

    def _fill(self, bucket, flat):
        for name, start, numel in bucket.offsets():
            flat[start:start + numel].copy_(self._arrays[name].reshape(-1))

    def _handed_out(self, entry):
        """`entry`'s gradients as TensorFlow tensors the user keeps: they view the slot
        buffers the reductions landed in, so those slots are let go (the next step that
        fills one allocates it again) and what the user holds keeps its value, as
        Keras's data path does. A copy of every gradient measured no faster, and held
        more memory at the peak."""
        grads = entry.gradients()
        out = [bridge.to_tf(grads[n].reshape(s), d)
               for n, s, d in zip(self.names, self.shapes, self.dtypes)]
        self.machine.release(entry)
        return out

    def flush(self):
        out = [self._handed_out(entry) for entry in self.machine.drain()]
        self.timings["applied"] += len(out)
        return out

    # --- checkpoints ------------------------------------------------------------------
    def state(self):
        state = self.machine.state()
        fifo = self.machine.fifo
        tuned = {} if self.machine.tuner is None else {"tune": state["tune"]}
        # The depth and warm-up saved with it: a resume under others names them (restore).
        # tune="auto": the depth in force (its decision's), and the decision itself.
        return {"steps": state["steps"], **tuned,
                "pipeline_depth": fifo.pipeline_depth if tuned else self.options["pipeline_depth"],
                "warmup_steps": fifo.warmup_steps if tuned else self.options["warmup_steps"],
                "in_flight": [{n: g.cpu().numpy() for n, g in e.items()}
                              for e in state["in_flight"]],
                "error_feedback": {slot: {n: r.cpu().numpy() for n, r in residuals.items()}
                                   for slot, residuals in
                                   (state["error_feedback"] or {}).items()}}

    def restore(self, state):
        fifo = self.machine.fifo
        # tune="auto": the decision first (its depth is the one the gradients in flight
        # were saved at); none saved, or for another number of ranks: measure again
        self.machine.restore_tuning(state.get("tune"), state["steps"])
        in_flight = state["in_flight"]
        if in_flight and len(in_flight) >= fifo.threshold(state["steps"]):
            raise ValueError(_cannot_resume(state, fifo))
        for entry in in_flight:
            if sorted(entry) != sorted(self.names):
                raise ValueError("the checkpoint's gradients in flight are for other variables "
                                 f"({sorted(entry)[:3]}...) than these ({self.names[:3]}...)")
        self.machine.settle()

        def here(arrays):
            return {n: torch.from_numpy(np.array(a, copy=True)).reshape(-1).to(self.devices[n])
                    for n, a in arrays.items()}
        self.machine.restore([here(entry) for entry in in_flight], [None] * len(in_flight),
                             state["steps"], error_feedback={
                                 slot: here(residuals) for slot, residuals in
                                 state.get("error_feedback", {}).items()} or None)

    def _agree_on_the_state(self):
        """Every rank starts from the same step and gradients in flight (rank 0 alone may
        have restored a checkpoint): pipeline/resume_agreement.py."""
        agree_on_the_state(self.machine, self.options["process_set"], self.state,
                           self.restore, "DistributedGradientTape")

    # --- elastic (pipe_horovod.tensorflow.elastic) ----------------------------------
    def drop_in_flight(self):
        """Forget, without waiting, the gradients in flight and this step's progress: after
        a failed collective they never land. A committed state is restored next."""
        self.machine.forget()
        self._arrays = {}

    def release_engine(self):
        """Leave the engine before elastic resets it: its shutdown would report the
        gradients in flight as never applied, and the committed ones will be, after it."""
        _built.discard(self)

    def rebind_engine(self):
        """Use the engine running now (a new one after an elastic reset: rank and size may
        differ). The buckets stay as planned: a traced step holds this pipeline."""
        self.machine.attach()
        _built.add(self)
        _register_with(engine.current())


def reduces_any(variables):
    """Whether a DistributedGradientTape reduces the gradient of any of `variables`: what a
    pipelined DistributedOptimizer refuses to reduce a second time."""
    refs = {_ref(v) for v in variables}
    return any(ref in refs for key, _ in _pipelines for ref in key)


def _cannot_resume(state, fifo):
    """Why a checkpoint's gradients in flight do not fit this pipeline: more than it holds
    at that step. A depth that differs from the saved one says so; else the warm-up."""
    held = (f"a checkpoint with {len(state['in_flight'])} gradient(s) in flight at step "
            f"{state['steps']}")
    saved = state.get("pipeline_depth")             # None: written before it was saved
    if saved is not None and saved != fifo.pipeline_depth:
        return (f"{held} was saved at pipeline_depth={saved} and cannot resume at "
                f"pipeline_depth={fifo.pipeline_depth}: resume with pipeline_depth={saved}, or "
                "apply the gradients in flight (tape.flush()) before saving")
    return (f"{held} cannot resume inside warm-up (warmup_steps={fifo.warmup_steps}): resume "
            "with the warm-up it was saved with"
            + ("" if state.get("warmup_steps") is None else
               f" (warmup_steps={state['warmup_steps']})"))


def pipelines_over(variables):
    """The tape pipelines whose sources are all among `variables`, by their sources'
    positions there: {(i, j, ...): pipeline}. What an elastic state carries with them.

    Raises:
        RuntimeError: such a pipeline reduces over a process set, which does not survive
            an elastic reset.
    """
    position = {_ref(v): i for i, v in enumerate(variables)}
    found = {}
    for (key, process_set), pipe in _pipelines.items():
        if not all(ref in position for ref in key):
            continue
        if process_set is not None:
            raise RuntimeError("a DistributedGradientTape over a process set cannot be part of "
                               "an elastic state: process sets do not survive a reset")
        found[tuple(position[ref] for ref in key)] = pipe
    return found


def restore_when_built(sources, state):
    """Have the pipeline of `sources` start from `state` (a pipeline's state()) when the
    first gradient() for them builds it: a worker that joined an elastic job receives
    rank 0's gradients in flight before its step is traced."""
    _set_pending(sources, state)


def _set_pending(sources, state):
    _pending[_key(sources)] = ([_weak(s) for s in sources], state)


def _pending_for(sources, pop=True):
    """The state waiting for the pipeline of `sources` (restore_when_built, a checkpoint
    restored first), or None: one left by other objects since gone (the ids in its key
    may now be others') is dropped."""
    key = _key(sources)
    waiting = _pending.get(key)
    if waiting is None:
        return None
    refs, state = waiting
    if not all(ref() is source for ref, source in zip(refs, sources)):
        del _pending[key]
        return None
    if pop:
        del _pending[key]
    return state


def _forget(key):
    """One of a pipeline's sources went: so does the pipeline, with its buffers and its
    gradients in flight (no one can apply them to variables that are gone). Its
    reductions still on the wire are waited for first: every rank launched them in its
    step (nothing new is sent), and the engine holds their tensors and names until then."""
    pipe = _pipelines.pop(key, None)
    if pipe is None:
        return
    _built.discard(pipe)
    if not engine.is_initialized() or pipe.machine.engine is not engine.current():
        return                            # that engine is gone, and what it held with it
    try:
        pipe.machine.settle()
    except Exception as exc:              # noqa: BLE001 -- inside a weakref callback
        warnings.warn(f"pipe_horovod: the gradients in flight of a DistributedGradientTape "
                      f"whose variables are gone did not land ({exc})", stacklevel=2)
    pipe.machine.forget()


def _pipeline_for(sources, options):
    key = (_key(sources), options["process_set"])
    pipe = _pipelines.get(key)
    if pipe is None:
        pipe = _pipelines[key] = _Pipeline(sources, options)
        _register_with(engine.current())
    elif pipe.options != options:
        changed = sorted(k for k in options if options[k] != pipe.options[k])
        said = [f"{len(pipe.local)} local source(s) registered" if k == "local_sources"
                else f"{k}={pipe.options[k]!r}" for k in changed]
        raise ValueError(f"these variables' gradients are pipelined with other options already "
                         f"({', '.join(said)}); a later DistributedGradientTape for them must "
                         "pass the same ones")
    return pipe


def _register_with(eng):
    """What the engine calls on the tape pipelines: at shutdown, the report of gradients
    never applied; around hvd.join(), the settle and the realignment."""
    eng.before_shutdown(__name__, _report_unapplied)
    eng.around_join(__name__, _settle_before_join, _align_after_join)


def _here():
    """The tape pipelines on the engine running now, in the order every rank built them."""
    eng = engine.current()
    return sorted((p for p in list(_pipelines.values()) if p.machine.engine is eng),
                  key=lambda p: p.number)


def _settle_before_join():
    """A rank that joins launches no more reductions: the ones it has in flight land first
    (the others started them too), so nothing of this rank's is on the wire while the
    others go on. The gradients stay in the pipeline: the tape never applies, so the next
    tape.gradient or flush() hands them back as it would have."""
    for pipe in _here():
        if not pipe.machine.solo:
            pipe.machine.settle()


def _align_after_join(last):
    """Ranks that ran different numbers of steps (uneven data) go on from the last
    joiner's count, so the slot names of their next reductions agree again (as the
    PyTorch optimizer's join does)."""
    pipes = _here()
    # By number, not position: a pipeline whose model went may linger on one rank until
    # its garbage is collected.
    steps = engine.current().broadcast_object({p.number: p.machine.fifo.steps for p in pipes},
                                              last)
    for pipe in pipes:
        machine, count = pipe.machine, steps.get(pipe.number)
        if count is None or count == machine.fifo.steps:
            continue
        # What is in flight stays, as copies: its slot buffers are the ones the next
        # steps fill once the count moved.
        state = machine.state()
        machine.restore(state["in_flight"], state["scales"], count, state["kept"],
                        state["error_feedback"])


def _report_unapplied():
    report_unapplied(sum(len(p.machine.fifo) for p in list(_built)),
                     "call tape.flush() (or hvd.flush(variables)) after the last step and "
                     "apply the gradients it returns")


class _DistributedGradientTape:
    """Methods placed before the user's tape class (see DistributedGradientTape)."""

    @tf.autograph.experimental.do_not_convert      # Python at trace time (see mpi_ops)
    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        # The tape's own computation first: TensorFlow's errors (a non-persistent tape used
        # twice, ...) are raised on this rank before anything is sent.
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        flat_sources, flat_grads = tf.nest.flatten(sources), tf.nest.flatten(grads)
        bridge.refuse_xla("DistributedGradientTape.gradient")
        pipe = _pipeline_for(flat_sources, dict(self._tape_options, local_sources=frozenset(
            self._local_sources)))
        self._tape_pipeline = pipe
        dense = [tf.zeros(shape, dtype) if g is None else tf.convert_to_tensor(g, dtype)
                 for g, shape, dtype in zip(flat_grads, pipe.shapes, pipe.dtypes)]
        out = bridge.run(pipe.step, dense, pipe.dtypes + [tf.bool], "pipe_horovod_tape_step")
        averaged = [tf.ensure_shape(g, shape) if not tf.executing_eagerly() else g
                    for g, shape in zip(out[:-1], pipe.shapes)]
        averaged = [None if g is None else a for g, a in zip(flat_grads, averaged)]
        return tf.nest.pack_sequence_as(grads, averaged)

    def register_local_source(self, source):
        """Keep `source`'s gradient on this rank: not reduced, only scaled by 1/size()
        with scale_local_gradients (Horovod's method). Before the first gradient() of
        these sources: every later tape for them must register the same ones."""
        self._local_sources.add(_ref(source))

    def get_local_and_global_gradients(self, target, sources, output_gradients=None):
        """gradient()'s result split as Horovod's: ([(local source, gradient)],
        [(reduced source, gradient)]), each in the sources' order."""
        pairs = list(zip(sources, self.gradient(target, sources, output_gradients)))
        local = [(s, g) for s, g in pairs if _ref(s) in self._local_sources]
        return local, [(s, g) for s, g in pairs if _ref(s) not in self._local_sources]

    def flush(self):
        """The averaged gradients still in flight for this tape's sources, oldest first.

        Returns:
            A list with one gradient list (in the sources' order) per step in flight:
            apply each, in order, at the end of training.

        Raises:
            ValueError: called before gradient() (use hvd.flush(sources)), or inside a
                tf.function.
        """
        if getattr(self, "_tape_pipeline", None) is None:
            raise ValueError("this tape has computed no gradient yet: call "
                             "hvd.flush(model.trainable_variables) instead")
        return flush(self._tape_pipeline.sources, self._tape_options["process_set"])

    def write_run_summary(self, path):
        """This tape's sources' measured run, for `pipe-horovod plan --from-run path`
        (write_run_summary(sources, path) below, which a loop's eager code can reach)."""
        if getattr(self, "_tape_pipeline", None) is None:
            raise ValueError("this tape has computed no gradient yet: nothing was measured")
        return write_run_summary(self._tape_pipeline.sources, path,
                                 self._tape_options["process_set"])


def write_run_summary(sources, path, process_set=None):
    """Write what the pipeline of `sources` measured (per step compute, per bucket bytes,
    launch, landing and exposed wait; the configuration) to `path` as JSON on rank 0, for
    `pipe-horovod plan --from-run path`, as the PyTorch DistributedOptimizer's
    write_run_summary: returns `path` on rank 0, None elsewhere; nothing is exchanged.
    (Or set PIPE_HOROVOD_RUN_SUMMARY=path to have it written at exit.)

    Raises:
        ValueError: no DistributedGradientTape has computed gradients for `sources`.
    """
    pipe = _existing(sources, process_set)
    if pipe is None:
        raise ValueError("no DistributedGradientTape has computed gradients for these "
                         "variables (with this process_set): nothing was measured")
    return pipe.machine.write_run_summary(path)


def flush(sources, process_set=None):
    """The averaged gradients still in flight for `sources`, oldest first (eager only).

    Args:
        sources: the variables the tapes differentiated (the same list, in the same order).
        process_set: the tapes' process_set, where they had one.

    Returns:
        A list of gradient lists, one per step in flight (empty when nothing is).
    """
    if not tf.executing_eagerly():
        raise ValueError("flush() runs eagerly, after the last step: call it outside any "
                         "tf.function")
    pipe = _existing(sources, process_set)
    return [] if pipe is None else pipe.flush()


def _existing(sources, process_set):
    """The pipeline of `sources` over `process_set`, None before their first gradient()."""
    if process_set is engine.global_process_set:
        process_set = None
    return _pipelines.get((_key(tf.nest.flatten(sources)), process_set))


class GradientsInFlight(tf.train.experimental.PythonState):
    """The gradients in flight for `sources`, as a tf.train.Checkpoint dependency.

        ckpt = tf.train.Checkpoint(model=model, optimizer=opt,
                                   pipeline=hvd.GradientsInFlight(model.trainable_variables))

    Saved: the pipeline's step count and every averaged gradient in flight (each
    rank holds the same ones), and with an error-feedback codec (int8_ef, ...) this
    rank's residuals, which differ between ranks: each rank saves and restores its own
    checkpoint to resume exactly (rank 0's alone gives every rank rank 0's residuals).
    Restored before the first step of the resumed run, they are what the next steps'
    tape.gradient returns, so the run continues as if it had never stopped.
    """

    def __init__(self, sources, process_set=None):
        self._sources = tf.nest.flatten(sources)
        self._process_set = None if process_set is engine.global_process_set else process_set

    def _pipeline(self):
        return _pipelines.get((_key(self._sources), self._process_set))

    def serialize(self):
        pipe = self._pipeline()
        waiting = None if pipe is not None else _pending_for(self._sources, pop=False)
        state = pipe.state() if pipe is not None else waiting or {"steps": 0, "in_flight": []}
        arrays = {f"{k}/{n}": a for k, entry in enumerate(state["in_flight"])
                  for n, a in entry.items()}
        arrays.update({f"ef{slot}/{n}": r for slot, residuals in
                       state.get("error_feedback", {}).items() for n, r in residuals.items()})
        buffer = io.BytesIO()
        settings = {key: np.int64(state[key]) for key in ("pipeline_depth", "warmup_steps")
                    if state.get(key) is not None}
        if "tune" in state:                        # tune="auto": its decision, as JSON
            settings["tune"] = np.frombuffer(json.dumps(state["tune"]).encode(), np.uint8)
        np.savez(buffer, steps=np.int64(state["steps"]),
                 entries=np.int64(len(state["in_flight"])), **settings, **arrays)
        return buffer.getvalue()

    def deserialize(self, string_value):
        with np.load(io.BytesIO(string_value)) as data:
            entries = [{} for _ in range(int(data["entries"]))]
            residuals = {}
            for key in data.files:
                if "/" in key:
                    k, name = key.split("/", 1)
                    if k.startswith("ef"):
                        residuals.setdefault(int(k[2:]), {})[name] = data[key]
                    else:
                        entries[int(k)][name] = data[key]
            state = {"steps": int(data["steps"]), "in_flight": entries,
                     "error_feedback": residuals,
                     **{key: int(data[key]) for key in ("pipeline_depth", "warmup_steps")
                        if key in data.files}}
            if "tune" in data.files:
                state["tune"] = json.loads(bytes(data["tune"]).decode())
        pipe = self._pipeline()
        if pipe is None:
            _set_pending(self._sources, state)
        else:
            pipe.restore(state)


def DistributedGradientTape(gradtape, device_dense="", device_sparse="",
                            compression=Compression.none, sparse_as_dense=False,
                            op=engine.Average, gradient_predivide_factor=1.0, num_groups=0,
                            groups=None, process_set=engine.global_process_set,
                            scale_local_gradients=True, *, pipeline_depth=None,
                            warmup_steps=0, bucket_cap_mb=None, tune=None):
    """Wrap `gradtape` so its gradient() averages the gradients across ranks, pipelined.

    The arguments up to `scale_local_gradients` are horovod.tensorflow's, in its
    order. device_dense and device_sparse are accepted and unused (the engine
    places reductions); sparse gradients are always reduced dense, so
    sparse_as_dense changes nothing; num_groups/groups fuse the gradients into that
    many buckets (groups may also be Horovod's lists of variables);
    scale_local_gradients divides the gradients of local sources
    (register_local_source) by the number of ranks.

    pipeline_depth: 1 returns this step's average (Horovod's behaviour); K >= 2 the
    average of K-1 steps earlier, zeros while the pipeline fills (module docstring).
    Default: $PIPE_HOROVOD_PIPELINE_DEPTH, else 2. warmup_steps: steps at depth 1
    before the pipeline starts. bucket_cap_mb: MiB per fused reduction (None: chosen
    from the ranks and the link, as in the other adapters).
    tune: None (default): $PIPE_HOROVOD_TUNE if set, else the configuration as given
    ("off": the same, whatever the environment; unlike the optimizers, the tape is not
    tuned by default: it hands the gradient to its user, so it cannot try K=2 and go
    back, and auto would decide on the prediction alone). "auto": the run tunes itself
    (docs/auto.md): its first $PIPE_HOROVOD_TUNE_STEPS steps (20) return this step's
    average (K=1) while it measures compute, exposed wait and the link; then every
    rank applies the depth (1 or 2), codec and bucket cap predicted fastest among those
    the convergence rule allows, and rank 0 logs one line saying why. An explicit
    pipeline_depth, compression or bucket_cap_mb pins that choice; one auto cannot
    honour is a ValueError naming both. GradientsInFlight carries the decision, so a
    resume keeps it.

    Returns:
        `gradtape` itself, its class now a subclass of its own with gradient() and
        flush() (Horovod returns a wrapper of the same class).

    Raises:
        TypeError, ValueError: a bad argument (not a tape, an op the pipeline cannot
            reduce, a depth out of range), before init() too. Sources that differ
            between ranks (number, shapes, dtypes, names) raise ValueError on every
            rank at the first gradient().
    """
    if not isinstance(gradtape, tf.GradientTape):
        raise TypeError(f"DistributedGradientTape wraps a tf.GradientTape, got "
                        f"{type(gradtape).__name__}")
    if isinstance(gradtape, _DistributedGradientTape):
        raise ValueError("this tape is a DistributedGradientTape already; wrap it once")
    if not isinstance(scale_local_gradients, bool):
        raise TypeError(f"scale_local_gradients must be a bool, got {scale_local_gradients!r}")
    if num_groups:
        groups = num_groups if groups is None else groups
    if isinstance(groups, (list, tuple)):         # compared by reference, as TF wants
        groups = [[_ref(v) for v in group] for group in groups]
    elif groups is not None and (isinstance(groups, bool) or not isinstance(groups, int)
                                 or groups < 0):
        raise ValueError(f"groups must be a bucket count (an int >= 0) or lists of variables, "
                         f"got {groups!r}")
    if process_set is engine.global_process_set:
        process_set = None
    if process_set is not None and not isinstance(process_set, engine.ProcessSet):
        raise TypeError(f"process_set must be a pipe_horovod ProcessSet, got {process_set!r}")
    pipeline_depth, source = resolve_depth(pipeline_depth)
    check_options(pipeline_depth, warmup_steps, 1, 25 if bucket_cap_mb is None else bucket_cap_mb)
    check_reduction(op, gradient_predivide_factor)
    # (No compensation: the tape sends no prediction exchange.)
    # Not tuned unless asked: the tape hands its user the gradient, so it cannot try K=2
    # and go back (auto would decide on the prediction alone).
    tuned = auto.tuning(tune, source != "default", functools.partial(
        auto.pins_from_options, pipeline_depth if source != "default" else None, compression,
        bucket_cap_mb, warmup_steps, op=op), default=None)
    engine.current()                             # a clear error before init()
    bucket_cap_mb = resolve_bucket_cap_mb(bucket_cap_mb, process_set)
    if tuned is None:
        announce_depth(pipeline_depth, warmup_steps, source, process_set, _announced)
    else:
        auto.announce(auto.Tuner(*tuned), process_set, _announced)
    cls = type(gradtape)
    gradtape.__class__ = type(cls.__name__, (_DistributedGradientTape, cls),
                              {"__module__": __name__})
    gradtape._tape_options = {
        "pipeline_depth": pipeline_depth, "warmup_steps": warmup_steps,
        "compression": compression, "op": op,
        "gradient_predivide_factor": float(gradient_predivide_factor),
        "bucket_cap_mb": bucket_cap_mb, "groups": groups or None, "process_set": process_set,
        "scale_local_gradients": scale_local_gradients, "tune": tuned}
    gradtape._tape_pipeline = None
    gradtape._local_sources = set()
    return gradtape


def PartialDistributedGradientTape(gradtape, device_dense="", device_sparse="",
                                   compression=Compression.none, sparse_as_dense=False,
                                   op=engine.Average, gradient_predivide_factor=1.0,
                                   num_groups=0, groups=None,
                                   process_set=engine.global_process_set, local_layers=None,
                                   scale_local_gradients=True, **pipelining):
    """DistributedGradientTape whose `local_layers` (a Keras layer or a list of them)
    keep their gradients on this rank (register_local_source for each of their
    trainable weights). `pipelining`: DistributedGradientTape's pipeline_depth,
    warmup_steps, bucket_cap_mb."""
    import keras

    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    elif not all(isinstance(layer, keras.layers.Layer) for layer in local_layers):
        raise ValueError("All local layers must be of tf.keras.layers.Layer type.")
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                   groups, process_set, scale_local_gradients, **pipelining)
    for layer in local_layers:
        for variable in layer.trainable_weights:
            tape.register_local_source(variable)
    return tape
