"""Keras 3 on TensorFlow: gradients leave the graph through numpy_function hand-offs.

The data path of the pipelined Keras optimizer (pipe_horovod/_keras/optimizer.py) on
the TensorFlow backend, whichever wrapper made it (pipe_horovod.keras's or this
package's DistributedOptimizer): it lives here, beside the TF<->torch bridge it runs on,
so that Keras on the torch backend never needs TensorFlow.

A reduction must outlive the graph step that starts it (step t's runs
while step t+1 computes), so it cannot be a graph op. Each bucket gets one
stateful `tf.numpy_function` that copies the bucket's gradients (numpy
views of TensorFlow's buffers: no copy on the way in) into the step
machine's flat buffer and starts its allreduce without waiting. TF's
executor runs it as soon as that bucket's gradients exist, so the rest of
backward hides the send. A last op pushes the step into the FIFO and
returns what pops; the user's own update runs under `tf.cond` only when
something popped, so its iteration counter counts updates, not steps.

The hand-offs are chained by a token: the engine matches collectives by
name (Horovod) or by issue order (torch.distributed), and TF would
otherwise start them in whatever order their inputs become ready, which
differs between ranks.

Gradients on a GPU cross by DLPack instead (`tf.py_function` and
pipe_horovod.tensorflow.bridge, which says what crossing needs): they stay
on the GPU that holds them, where NCCL reduces them.
PIPE_HOROVOD_KERAS_TRANSFER=numpy|dlpack overrides the choice, so the
DLPack path is tested on CPU too.

staleness_compensation="lookahead" (pipeline/staleness.py): after the
update, the real weights go into shadow variables and the model's variables
move to where the updates in flight will take them, by the user's optimizer
run on this rank's own gradients of those steps, from a snapshot of its
variables (iterations included) put back afterwards. The next apply() puts
the real weights back before the real update. This step's own gradients are
still in the graph; older ones (K >= 3) come back from the Python side,
which keeps them with their step. Local variables (register_local_var) are
not reduced and not predicted: their gradient travels with its step.
With prediction_exchange the prediction takes the ranks' exchanged average
(StepMachine.estimates) in place of this rank's own gradients: the last
hand-off returns it beside the average that pops.

tune="auto" (pipeline/auto.py): the path is built for the deepest K auto may choose (the
lookahead's shadow weights) while the step machine runs the measured steps at K=1. In
fit the step is traced for what the pipeline needs now (holds(): no lookahead, exchange
or second update while measured at K=1, since each costs the step's hand-off an output
per variable and a branch), and PipelineFlushCallback makes the train function again
after a batch that changed it (a trial begins or ends). A step traced once (a custom
loop, train_on_batch) holds everything: at K=1 the lookahead's branch then never runs
(the hand-off reports none ahead), no exchange is sent (the machine sends one only for a
step that stays in flight) and the exchange's outputs are empty.
"""
import functools
import os
import time

import numpy as np
import tensorflow as tf
import torch

from ..pipeline import StepGradient, StepMachine, auto
from ..pipeline.buckets import bucket_cap_bytes
from ..pipeline.convergence_rule import DEPTHS
from ..pipeline.local_scale import LocalScale
from .._keras.naming import next_prefix, variable_names
from .bridge import (DLPack, NumPy, eager_variables, keeping_failures, refuse_xla,
                     torch_device)


class TensorFlowPath:
    """`base_apply(grads, variables)` is the user's optimizer's own update (one
    iteration), which the path runs when a gradient is due."""

    # Where the optimizer builds its variables when Keras first builds it inside the
    # traced train step (the optimizer's build): eagerly, unseen by the trace.
    outside_the_trace = staticmethod(eager_variables)

    def __init__(self, optimizer, variables, options, local=(), *, base_apply):
        self.optimizer = optimizer
        self._base_apply = base_apply
        self.variables = variables
        self.names = variable_names(variables)
        self.shapes = dict(zip(self.names, (tuple(v.shape) for v in variables)))
        devices = [torch_device(v) for v in variables]
        # Local variables (register_local_var): not reduced; this rank's gradient, divided
        # by size() with scale_local_gradients, travels with its step (_keep_unreduced).
        self.local = [n for n, own in zip(self.names, local) if own]
        self._unreduced = {}
        choice = os.environ.get("PIPE_HOROVOD_KERAS_TRANSFER")
        if choice not in (None, "numpy", "dlpack"):
            raise ValueError(f"PIPE_HOROVOD_KERAS_TRANSFER must be numpy or dlpack, got {choice!r}")
        dlpack = choice == "dlpack" or (choice is None and any(d.type != "cpu" for d in devices))
        self.transfer = DLPack() if dlpack else NumPy()
        tuner = options.get("tuner")             # tune="auto": a pipeline/auto.py Tuner
        depth, warmup = options["pipeline_depth"], options["warmup_steps"]
        if tuner is not None:                    # measured at K=1; built for auto's deepest
            depth = options["pinned_depth"] or max(DEPTHS)
            warmup = auto.warmup_steps(tuner.steps, warmup)
        self.machine = StepMachine(
            next_prefix(), 1 if tuner is not None else depth, warmup,
            compression=options["compression"], op=options["op"],
            predivide=options["gradient_predivide_factor"], process_set=options["process_set"],
            cap_bytes=bucket_cap_bytes(options["bucket_cap_mb"]), groups=options["groups"],
            collective=options["collective"], exchange=options["prediction_exchange"],
            tune=tuner)
        if tuner is not None:
            self.machine.tell_when_tuned(self._tuned)
        # tune="auto" may undo a K=2 trial: that step applies the gradient in flight too
        self.may_undo = tuner is not None and tuner.may_try
        # Where the train step is traced again when what it must hold changes (fit, with
        # PipelineFlushCallback: `retraced`), it holds only that (`holds`): measured at
        # K=1, tune="auto" then costs what K=1 costs. A custom loop's step, traced once,
        # holds everything auto may come to need.
        self.retraced = False
        self.ran = None                          # what the last step's graph held
        # 1/size with scale_local_gradients, of the engine running now (rebind_engine)
        self.scale_local = LocalScale(options["scale_local_gradients"],
                                      lambda: self.machine.size)
        self.kinds = {name: (getattr(torch, _dtype(v).name), device)
                      for name, v, device in zip(self.names, variables, devices)}
        # Ready order: backward produces the last layer's gradients first.
        self.machine.plan([(name, int(np.prod(v.shape)), _dtype(v).itemsize, self.kinds[name])
                           for name, v in reversed(list(zip(self.names, variables)))
                           if name not in self.local])
        self._arrays = {}                        # this step's gradients (torch views), by name
        self.timings = self.machine.timings      # steps, waits and the measured run
        self.lookahead = options["staleness_compensation"] == "lookahead" and depth > 1
        # "lookahead": how many in-flight steps older than this one a prediction may use,
        # and (when there are some and ranks differ) this step's own gradients, kept.
        self.older = depth - 2 if self.lookahead else 0
        self.exchanging = self.lookahead and self.machine.exchange is not None
        self._local = {}
        # Alone, the prediction is exactly the next update (K=1's numbers, as the PyTorch
        # adapter does): the FIFO runs at depth 1, with no copy and no extra update,
        # except while gradients a checkpoint brought are in flight (until a flush).
        self.depth = self.machine.fifo.pipeline_depth
        self.alone = self.lookahead and self.machine.solo
        self._set_depth()
        if self.lookahead:
            with tf.init_scope():
                self.real = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False,
                                         name=f"pipe_horovod_real_{i}")
                             for i, v in enumerate(variables)]
                self.predicted = tf.Variable(False, trainable=False,
                                             name="pipe_horovod_predicted")

    # --- graph side (runs once per trace) -------------------------------------
    def apply(self, grads, variables):
        refuse_xla("the pipelined DistributedOptimizer (its reductions outlive the step)",
                   "compile the model with model.compile(..., jit_compile=False)")
        if [id(v) for v in variables] != [id(v) for v in self.variables]:
            raise ValueError("apply() got other variables than the optimizer was built with")
        index = {name: i for i, name in enumerate(self.names)}
        grads = [tf.zeros(v.shape, v.dtype) if g is None else tf.convert_to_tensor(g, v.dtype)
                 for g, v in zip(grads, variables)]
        token = tf.constant(0, tf.int64)
        for bucket in self.machine.buckets:
            members = [grads[index[name]] for name in bucket.names]
            token = self.transfer.op(keeping_failures(self._handoff_for(bucket)),
                                     [token, *members], tf.int64,
                                     f"pipe_horovod_bucket_{bucket.index}")
        if self.local:
            # (keeping_failures: also settles torch's reads before TF reuses the buffers)
            token = self.transfer.op(keeping_failures(self._keep_unreduced),
                                     [token, *(grads[index[name]] for name in self.local)],
                                     tf.int64, "pipe_horovod_local")
        types = [tf.as_dtype(v.dtype) for v in variables]
        holds = self.holds()
        lookahead, undo = holds
        older_n = self.older * lookahead
        exchanging = self.exchanging and lookahead
        out = self.transfer.op(keeping_failures(functools.partial(self._finish, holds)),
                               [token],
                               types + [tf.bool] + types * older_n
                               + (types + [tf.bool]) * exchanging
                               + [tf.int64] * lookahead
                               + (types + [tf.bool]) * undo,
                               "pipe_horovod_finish")
        n = len(variables)

        def shaped(tensors):
            return [tf.ensure_shape(g, v.shape) for g, v in zip(tensors, variables)]
        averaged, popped = shaped(out[:n]), tf.ensure_shape(out[n], ())
        if undo:                                 # tune="auto" undid a trial: two this step
            out, earlier = out[:-n - 1], out[-n - 1:]
        older = [shaped(out[n + 1 + j * n:n + 1 + (j + 1) * n]) for j in range(older_n)]
        current = grads
        if exchanging:                           # the ranks' average where one was exchanged
            at = n + 1 + older_n * n
            # (shaped inside the branch: a step that exchanged nothing hands back empty
            # tensors, not a model's worth of zeros: K=1 under tune="auto", warm-up)
            current = tf.cond(tf.ensure_shape(out[at + n], ()),
                              lambda: [g if name in self.local else e for g, e, name in
                                       zip(grads, shaped(out[at:at + n]), self.names)],
                              lambda: grads)
        self.put_real_back()                     # after backward, before the real update
        if undo:                                 # (shaped in the branch: empty when unused)
            tf.cond(tf.ensure_shape(earlier[n], ()), lambda: self._step(shaped(earlier[:n])),
                    lambda: tf.constant(False))
        applied = tf.cond(popped, lambda: self._step(averaged), lambda: tf.constant(False))
        if lookahead:
            ahead = tf.ensure_shape(out[-1], ())
            tf.cond(ahead > 0, lambda: self._look_ahead(older, current, ahead),
                    lambda: tf.constant(False))
        return applied

    def holds(self):
        """What the next step's graph must hold: (the lookahead's outputs and prediction,
        the outputs of a second gradient applied in the same step). Traced once (not
        `retraced`): whatever the depth may become. Else what the machine's state needs
        now: the lookahead where the pipeline runs deeper than K=1; the second gradient
        while a trial may be undone or a checkpoint's gradient waits to be adopted."""
        if not self.retraced or self.machine.tuner is None:
            return self.lookahead, self.may_undo
        fifo, decision = self.machine.fifo, self.machine.tuner.decision
        trying = decision is not None and decision.trying
        return (self.lookahead and fifo.pipeline_depth > 1,
                self.may_undo and (trying or len(fifo) >= fifo.pipeline_depth))

    def _step(self, grads):
        """One update of the user's optimizer (a tf.cond branch: returns a tensor)."""
        self._base_apply(grads, self.variables)
        return tf.constant(True)

    def put_real_back(self):
        """The real weights where the prediction was (in the graph, or now)."""
        if not self.lookahead:
            return

        def put_back():
            for v, real in zip(self.variables, self.real):
                v.assign(real)
            self.predicted.assign(False)
            return tf.constant(True)
        tf.cond(self.predicted, put_back, lambda: tf.constant(False))

    def prediction(self):
        """Copies of this rank's predicted weights, {name: array}, while the model holds
        them (between train steps, eagerly); else None. With put_real_back() and
        hold_prediction() a save can write the real weights as the model's and give the
        model its prediction back bit for bit (DistributedOptimizer.real_weights)."""
        if not (self.lookahead and bool(self.predicted.numpy())):
            return None
        return {n: np.array(v.numpy(), copy=True) for n, v in zip(self.names, self.variables)}

    def hold_prediction(self, prediction):
        """Put `prediction` (prediction()'s) in the model over the real weights, which
        self.real keeps already (put_real_back() leaves them there; restore() loads them)."""
        if not self.lookahead:
            return
        for v, n in zip(self.variables, self.names):
            v.assign(prediction[n])
        self.predicted.assign(True)

    def _look_ahead(self, older, current, ahead):
        """Keep the real weights, then run the user's optimizer on this rank's own
        gradients of the `ahead` steps in flight (`older` ones first, this step's
        `current` last) and undo what that did to the optimizer's variables."""
        for real, v in zip(self.real, self.variables):
            real.assign(v)
        state = self.optimizer.variables
        saved = [tf.identity(v.value) for v in state]   # reads: later updates do not change them
        with self.optimizer.prediction_scope():        # entered while tracing the prediction
            for j, grads in enumerate(older):
                tf.cond(j + 1 < ahead, lambda g=grads: self._step(g), lambda: tf.constant(False))
            self._step(current)
        for v, value in zip(state, saved):
            v.assign(value)
        for v, real, name in zip(self.variables, self.real, self.names):
            if name in self.local:                     # not predicted: back to the real one
                v.assign(real)
        self.predicted.assign(True)
        return tf.constant(True)

    @property
    def local_scale(self):
        """What a local variable's gradient is multiplied by now (LocalScale)."""
        return self.scale_local.value

    def time_handoffs(self, timed):
        """Let a benchmark time the Python side of each step (see
        DistributedOptimizer.time_handoffs, which calls this)."""
        self._fill = timed("fill_s", self._fill)
        handoff_for = self._handoff_for
        self._handoff_for = lambda bucket: timed("handoff_s", handoff_for(bucket))
        self._finish = timed("finish_s", self._finish)

    # --- Python side (runs every step) -------------------------------------------
    def _handoff_for(self, bucket):
        def handoff(token, *arrays):
            self._arrays.update(zip(bucket.names, map(self.transfer.to_torch, arrays)))
            for name in bucket.names:
                self.machine.ready(name, self._fill)
            return token
        return handoff

    def _keep_unreduced(self, token, *arrays):
        for name, array in zip(self.local, map(self.transfer.to_torch, arrays)):
            own = array.clone()                  # TF reuses the buffer after the hand-off
            self._unreduced[name] = self.scale_local.apply(own)
            if self.older:
                self._local[name] = own
        return token

    def _fill(self, bucket, flat):
        for name, start, numel in bucket.offsets():
            array = self._arrays.pop(name)
            flat[start:start + numel].copy_(array.reshape(-1))
            if self.older:                       # TF reuses the buffer after the hand-off
                self._local[name] = array.clone()

    def _finish(self, holds, token):
        lookahead, undo = self.ran = holds       # what this step's graph was traced with
        machine = self.machine
        estimates = {}
        if machine.solo:                         # TF reuses its buffers after the hand-off
            entry = StepGradient(loaded={**{n: a.clone() for n, a in self._arrays.items()},
                                         **self._unreduced})
        else:
            machine.launch_rest(self._fill)
            estimates = machine.estimates()
            for name, average in estimates.items():     # older steps predict from it too
                if name in self._local:
                    self._local[name].copy_(average.view(self._local[name].shape))
            entry = StepGradient(machine.launched, loaded=self._unreduced or None,
                                 kept={"local": self._local} if self.older else None)
        self._arrays, self._local, self._unreduced = {}, {}, {}
        ready = machine.finish_step(entry)
        self.timings["steps"] += 1
        # Two only where tune="auto" undid a trial (restore() refuses what would pop
        # several): the earlier one is applied first, from the outputs may_undo adds.
        earlier = ready[:-1]
        if (earlier and not undo) or (not lookahead and self.lookahead
                                      and machine.fifo.pipeline_depth > 1 and machine.fifo):
            raise RuntimeError(
                "pipe_horovod: this train step was traced for what tune='auto' needed before "
                f"(K=1), and the pipeline now runs at K={machine.fifo.pipeline_depth} with "
                f"{len(machine.fifo)} gradient(s) in flight: fit traces the step again after "
                "the batch that changes it; call the train step again only after that")
        if ready:
            oldest = ready[-1]
            start = time.perf_counter()
            out = self._to_tf(oldest.gradients())
            self.timings["wait_s"] += time.perf_counter() - start
            # TensorFlow holds what it applies now; the slot allocates again when next
            # filled, so between steps only the gradients in flight hold a buffer.
            machine.release(oldest)
            self.timings["applied"] += 1
        else:
            out = self._zeros_tf()
        out.append(self.transfer.flag(bool(ready)))
        if lookahead:
            # This step is the newest in flight; the graph has its gradients already.
            ahead = list(machine.fifo)
            older = [e.kept.get("local") or e.gradients() for e in ahead[:-1]]
            for j in range(self.older):
                out += self._to_tf(older[j]) if j < len(older) else self._zeros_tf()
            if self.exchanging:
                # (local variables are not exchanged: the graph keeps their own gradient)
                out += [self.transfer.to_tf(estimates[n].reshape(self.shapes[n]))
                        if n in estimates else self._empty(n) for n in self.names]
                out.append(self.transfer.flag(bool(estimates)))
            out.append(self.transfer.count(len(ahead)))
        if undo:
            out += (self._to_tf(earlier[0].gradients()) if earlier
                    else [self._empty(n) for n in self.names])
            out.append(self.transfer.flag(bool(earlier)))
            for entry in earlier:
                machine.release(entry)
                self.timings["applied"] += 1
        return tuple(out)

    def _to_tf(self, grads):
        return [self.transfer.to_tf(grads[n].reshape(self.shapes[n])) for n in self.names]

    def _zeros_tf(self):
        # Made per call, not kept: only the steps that fill the pipeline (and, at depth
        # K >= 3, its older slots until it is full) need them, and kept they were a
        # copy of the model alive for the whole run.
        return [self._zero(n) for n in self.names]

    def _zero(self, name):
        return self.transfer.to_tf(torch.zeros(self.shapes[name], dtype=self.kinds[name][0],
                                               device=self.kinds[name][1]))

    def _empty(self, name):
        """An output the graph does not read (its branch is not taken): no elements."""
        return self.transfer.to_tf(torch.zeros(0, dtype=self.kinds[name][0],
                                               device=self.kinds[name][1]))

    # --- tune="auto" ----------------------------------------------------------------
    def _tuned(self, decision):
        """The machine applied `decision` (or a resume restored it, or an elastic reset
        went back to measuring): this path's depth follows it. The graph holds the
        lookahead for K=2 already; at K=1 it finds nothing ahead and does not run."""
        self.depth = decision.pipeline_depth
        self._set_depth(len(self.machine.fifo))

    # --- outside the step ---------------------------------------------------------
    def flush(self):
        self.put_real_back()
        for entry in self.machine.drain():
            grads = entry.gradients()
            self._base_apply(
                [tf.convert_to_tensor(self.transfer.to_tf(grads[n].reshape(self.shapes[n])))
                 for n in self.names], self.variables)
            self.machine.release(entry)
            self.timings["applied"] += 1
        self._set_depth()

    def write_run_summary(self, path):
        return self.machine.write_run_summary(path)

    # --- elastic training (pipe_horovod.keras.elastic) ----------------------------
    def drop_in_flight(self):
        """Forget, without waiting, the gradients in flight and this step's hand-offs
        (after a failed collective they never land); a committed state is loaded next."""
        self.machine.forget()
        self._arrays, self._local = {}, {}

    def rebind_engine(self):
        """Use the engine running now (rank and size may differ). The buckets stay as
        planned: the traced train step holds one hand-off per bucket."""
        self.machine.attach()
        self.alone = self.lookahead and self.machine.solo
        self._set_depth(len(self.machine.fifo))

    def _set_depth(self, in_flight=0):
        self.machine.fifo.pipeline_depth = 1 if self.alone and not in_flight else self.depth

    def in_flight(self):
        return len(self.machine.fifo)

    def state(self):
        state = self.machine.state()
        state.pop("scales")
        predicted = self.lookahead and bool(self.predicted.numpy())
        state["real"] = ({n: r.numpy() for n, r in zip(self.names, self.real)} if predicted
                         else None)
        return state

    def restore(self, in_flight, state):
        steps = state["steps"]
        fifo = self.machine.fifo
        # tune="auto": the decision first (its depth is the one the gradients in flight
        # were saved at); none saved, or for another number of ranks: measure again
        self.machine.restore_tuning(state.get("tune"), steps)
        self._set_depth(len(in_flight))
        # (StepMachine.adopts: the graph's second update takes one gradient in flight)
        adopting = self.machine.adopts() and len(in_flight) == 1
        if in_flight and len(in_flight) >= fifo.threshold(steps) and not adopting:
            raise ValueError(f"a checkpoint with {len(in_flight)} gradients in flight at step "
                             f"{steps} cannot resume inside warm-up (warmup_steps="
                             f"{fifo.warmup_steps}): resume with the warm-up it was saved with")
        self.machine.settle()

        def here(arrays):
            return {n: torch.from_numpy(np.array(a, copy=True)).reshape(-1).to(
                self.kinds[n][1]) for n, a in arrays.items()}
        self.machine.restore([here(grads) for grads in in_flight], [None] * len(in_flight), steps,
                             [{kind: here(t) for kind, t in k.items()}
                              for k in state.get("kept", [])] or None,
                             {slot: {n: torch.from_numpy(np.array(a, copy=True))
                                     for n, a in residuals.items()}
                              for slot, residuals in (state.get("error_feedback") or {}).items()}
                             or None)
        real = state.get("real")
        if real and self.lookahead:
            for r, n in zip(self.real, self.names):
                r.assign(real[n])
        elif real:                               # saved predicted: the real weights are these
            for v, n in zip(self.variables, self.names):
                v.assign(real[n])
        if self.lookahead:
            self.predicted.assign(bool(real))


def _dtype(variable):
    """A Keras or tf.Variable's NumPy dtype."""
    return np.dtype(tf.as_dtype(variable.dtype).as_numpy_dtype)
