"""The pipelined DistributedOptimizer for PyTorch.

Like Horovod's, `DistributedOptimizer(opt, ...)` returns an instance of a
subclass of the user's own optimizer class, so `step`, `zero_grad`,
`param_groups` and LR schedulers behave as before. What changes is which
averaged gradient `step` applies and when (DESIGN.md, "Semantics"):

* every parameter's gradient is copied into a bucket by a
  post-accumulate-grad hook, and a full bucket's allreduce starts during
  backward, so the rest of backward hides it;
* `step()` sends what backward has not, pushes this step's reduction into
  the FIFO, and applies what the FIFO pops: g_t for `pipeline_depth=1`,
  g_{t-K+1} for K >= 2, whose reduction ran during the last K-1 steps.

Reductions land in buffers the optimizer owns, so `zero_grad()` and the
next backward never touch a tensor that is still on the wire. `.grad` is
then pointed at the landed result (a view, as DDP's gradient_as_bucket_view
does), not copied into: a full-model copy per step is what made the wrapper
cost 15% in one process. With one rank and no compression there is nothing
to send, so a step's gradient is the `.grad` tensors themselves, kept by
reference: the one-process wrapper copies nothing at all.
"""
import collections
import contextlib
import functools
import itertools
import os
import time
import warnings
import weakref
from typing import Any, Iterable, Optional, Tuple, Union

import torch

from .. import engine
from ..engine.process_sets import ProcessSet, global_process_set
from ..collectives import check_collective
from ..collectives.communicator import communicator
from ..compression import Compression
from ..compression import describe as describe_compression
from ..pipeline import auto
from ..pipeline.buckets import BucketCapBytes, bucket_cap_bytes, resolve_bucket_cap_mb
from ..pipeline.option_checks import refuse_double_wrapping
from ..pipeline import (StepGradient, StepMachine, announce_depth, check_options,
                        check_prediction_exchange, check_reduction, check_staleness,
                        compare_across_ranks,
                        opens_group, report_unapplied, resolve_depth, staleness)
from . import edits, lookahead
from .checkpoint import _PipelineCheckpoint
from .compensation import _Compensation, _momentum_key, _values
from .parameters import _ParameterOwnership, _describe, _group_names, _named
from .sparse import _SparseGradients

_instances = itertools.count()
_live = weakref.WeakSet()          # wrapped optimizers, for the exit report
_announced = set()                 # depth settings rank 0 has explained already


class _PipelinedOptimizer(_PipelineCheckpoint, _SparseGradients, _ParameterOwnership,
                          _Compensation):
    """Mixin placed before the user's optimizer class in the MRO: the step flow.

    Its parts, each a mixin in a module of its own: checkpoint state
    (torch/checkpoint.py), the sparse-gradient path (torch/sparse.py),
    parameter names, hooks and ownership (torch/parameters.py) and staleness
    compensation (torch/compensation.py).
    """

    def _setup_pipeline(self, name_of, compression, backward_passes_per_step, op,
                        pipeline_depth, warmup_steps, bucket_cap_mb, grad_scaler,
                        predivide, groups, sparse_as_dense, process_set, compensation,
                        collective=None, exchange=None, tuner=None):
        self._number = next(_instances)          # creation order: the same on every rank
        self._machine = StepMachine(f"pipe{self._number}", pipeline_depth, warmup_steps,
                                    compression=compression, op=op, predivide=predivide,
                                    process_set=process_set,
                                    cap_bytes=bucket_cap_bytes(bucket_cap_mb),
                                    groups=groups, collective=collective, exchange=exchange,
                                    tune=tuner)
        # tune="auto": the compensation asked for, set up once auto chose K >= 2; the
        # machine calls _tuned at that step boundary (and on resume, and to go back).
        self._tuned_compensation = compensation
        self._machine.tell_when_tuned(self._tuned)
        self._process_set = process_set          # None: every rank
        self._passes_per_step = backward_passes_per_step
        self._op = op
        self._setup_sparse(sparse_as_dense)
        self._grad_scaler = grad_scaler
        self._passes = {}                        # parameter -> backward passes this step
        self._grad_watch = edits.GradientWatch()
        self._told_passes = False                # warned: fewer backward passes than declared
        self._join_ranks = None                  # called before the first reduction (Keras)
        self._setup_parameters(name_of)          # names, hooks; older wrappers retire
        self._observed = {}                      # ready order seen in this process's first step
        self._order_agreed = False
        self._plan([self._name_of[p] for p in reversed(self._params)])
        self._pending_apply = None               # the gradient synchronize() put into .grad
        self._synchronized = False
        self._should_synchronize = True
        # "pending" while the synchronize() that ended a backward awaits its step();
        # "discarded" once zero_grad() dropped it (torch/edits.py).
        self._auto_synced = None
        self.timings = self._machine.timings     # steps, waits and the measured run
        self.timings["compensation_s"] = 0.0
        self._pipeline_depth = pipeline_depth
        self._setup_compensation(compensation, pipeline_depth, _user_class(type(self)))
        _live.add(self)
        self._attach_engine()

    def _tuned(self, decision):
        """tune="auto" decided (or a resume restored its decision, or an elastic reset
        went back to measuring): this optimizer's depth and compensation follow it."""
        machine = self._machine
        self._pipeline_depth = decision.pipeline_depth
        self._setup_compensation(self._tuned_compensation, decision.pipeline_depth,
                                 _user_class(type(self)))
        alone = self._compensation == "lookahead" and machine.solo
        machine.fifo.pipeline_depth = 1 if alone else decision.pipeline_depth

    # Read by tests and by join: the machine's FIFO and bucket plan.
    _fifo = property(lambda self: self._machine.fifo)
    _buckets = property(lambda self: self._machine.buckets)

    def _attach_engine(self):
        """Use the engine running now (a new one after an elastic reset)."""
        self._machine.attach()
        # Alone, a rank's lookahead prediction is exactly its next update (the same
        # numbers as K=1): apply it at once, with no copy and no extra optimizer step.
        alone = self._compensation == "lookahead" and self._machine.solo
        self._machine.fifo.pipeline_depth = 1 if alone else self._pipeline_depth
        self._engine = self._machine.engine
        self._engine.before_shutdown(__name__, _report_unapplied)
        self._engine.around_join(__name__, _flush_before_join, _align_after_join)

    # --- buckets ----------------------------------------------------------
    def _plan(self, order):
        self._order = list(order)
        members = [(name, self._param_of[name].numel(), self._param_of[name].element_size(),
                    (self._param_of[name].dtype, self._param_of[name].device)) for name in order
                   if self._in_buckets(name)]
        self._machine.plan(members)
        self._reset_step()

    def _reset_step(self):
        self._step_local = {}                    # "lookahead": copies of gradients in buckets
        self._machine.begin_step()
        self._hooks_fired = False
        self._end_queued = False                 # the end-of-backward callback is queued
        self._backwards = 0                      # backward passes ended this step
        self._sync_at_end = self._watching = False
        self._most_passes = 0                    # backward passes seen by any parameter
        self._grad_watch.clear()
        for p in self._params:
            self._passes[p] = 0

    def _on_grad_ready(self, param):
        if self._auto_synced == "pending":
            raise edits.backward_after_average(self._name_of[param])
        if self._passes[param] >= self._passes_per_step:
            raise RuntimeError(
                f"the gradient of {self._name_of[param]!r} was computed more than "
                f"backward_passes_per_step={self._passes_per_step} times before step(); "
                "call step() after each backward, or raise backward_passes_per_step to "
                "accumulate locally")
        if self._join_ranks is not None:        # the first gradient: every rank is here
            join, self._join_ranks = self._join_ranks, None
            join()
        if not self._hooks_fired:                # this step's first gradient
            self._first_gradient()
        self._hooks_fired = True
        if self._sync_at_end and not self._end_queued and _in_backward():
            self._end_queued = True
            _queue_after_backward(_weak_end(self))
        self._passes[param] += 1
        if not self._order_agreed:
            self._observed.setdefault(param)
        if self._passes[param] > self._most_passes:
            self._most_passes = self._passes[param]
        if self._passes[param] == self._passes_per_step:
            if self._watching:
                self._grad_watch.record(param)
            elif self._sync_at_end and not self._machine.solo:
                self._grad_as_bucket_view(param)
            self._machine.ready(self._name_of[param], self._fill_bucket)

    def _first_gradient(self):
        """At this step's first gradient: decide how edits of `.grad` are treated (torch/
        edits.py) and settle a prediction still waiting for a forward pass."""
        fifo = self._machine.fifo
        self._sync_at_end = fifo.threshold(fifo.steps) == 1
        self._watching = not (self._sync_at_end or self._machine.solo)
        self._prediction_missed()

    def _end_of_backward(self):
        """Autograd's callback after a backward pass that reached this optimizer's
        parameters, where this step's gradient is applied by this step: once the last of
        backward_passes_per_step passes ends, wait for the average and leave it in `.grad`
        (as DDP does), so edits before step() apply to it."""
        self._end_queued = False
        if not self._hooks_fired:
            return
        self._backwards += 1
        if self._backwards >= self._passes_per_step:
            self.synchronize()
            self._auto_synced = "pending"

    def _grad_as_bucket_view(self, param):
        """At a synchronous step, move backward's gradient into its bucket as soon as it
        is final and leave `.grad` a view of it (DDP's gradient_as_bucket_view), so the
        step never holds a gradient and its flat copy at once: the peak is one copy lower.
        Only where this step's reduction lands before step() (K=1, warm-up): a `.grad`
        that views a bucket still on the wire would show a reduction half done. Backward's
        own tensor goes once nothing refers to it; a `.grad` already in its place (zeroed
        with set_to_none=False), sparse, of another layout or type is left to
        _fill_bucket."""
        grad, part = param.grad, self._machine.part(self._name_of[param])
        if (part is None or grad is None or grad.is_sparse or not param.is_contiguous()
                or not grad.is_contiguous() or grad.dtype != part.dtype
                or grad.device != part.device or grad.data_ptr() == part.data_ptr()):
            return
        part.copy_(grad.view(-1))
        param.grad = part.view_as(param)

    def _fill_bucket(self, bucket, flat):
        """Copy the bucket's `.grad`s into its flat buffer, unless backward accumulated there."""
        for name, start, numel in bucket.offsets():
            grad = self._param_of[name].grad
            part = flat[start:start + numel]
            if grad is None:                     # unused on this rank: contributes zero
                part.zero_()
            elif grad.dtype != part.dtype or grad.device != part.device:
                raise _changed_after_wrapping(name, grad, part)
            elif grad.is_sparse:
                self._bucket_sparse(name, grad, part)
            elif grad.data_ptr() != part.data_ptr() or not grad.is_contiguous():
                part.copy_(grad.reshape(-1))     # else: backward accumulated in place already
            if self._compensation == "lookahead" and not self._sync_at_end and \
                    grad is not None and not grad.is_sparse and grad.data_ptr() == part.data_ptr():
                # Backward wrote this rank's own gradient into the bucket: the reduction
                # will overwrite it, so the prediction gets a copy (else: `.grad` itself).
                self._step_local[name] = self._kept_copy("local", name, part)

    # --- the step ---------------------------------------------------------
    def synchronize(self):
        """Finish this step's communication and put the gradient to apply into `.grad`.

        For pipeline_depth K >= 2 that gradient is the average from K-1 steps
        ago; while the pipeline fills it is zero and `step()` applies nothing.
        Call it before clipping or `GradScaler.unscale_`, then `step()` inside
        `skip_synchronize()`, exactly as with Horovod.
        """
        self._refuse_if_replaced()
        if self._auto_synced == "pending" and not self._hooks_fired:
            # backward() synchronized already (K=1): from here on as if this call had.
            self._auto_synced = None
            return
        if self._synchronized and not self._hooks_fired:
            warnings.warn("synchronize() called twice without step() in between: the second "
                          "call does nothing (.grad holds the gradient step() will apply)",
                          stacklevel=2)
            return
        if not self._hooks_fired:
            raise RuntimeError("step() or synchronize() called without a backward pass since the "
                               "last step(); compute gradients before every step")
        if self._most_passes < self._passes_per_step and not self._told_passes:
            self._told_passes = True
            warnings.warn(
                f"step() after {self._most_passes} backward pass(es) with "
                f"backward_passes_per_step={self._passes_per_step}: the gradient is reduced as "
                "it is (their sum), but only at step(), without overlap; pass "
                f"backward_passes_per_step={self._most_passes} if every step has "
                f"{self._most_passes}", stacklevel=2)
        self._drop_unstepped()
        self._restore_real()                     # backward is done: update the real weights
        scale = self._grad_scaler.get_scale() if self._grad_scaler is not None else None
        machine = self._machine
        if machine.solo:
            kept = self._keep()
            agreed = self._agree()
            # Nothing to send: the `.grad` tensors themselves, by reference.
            entry = StepGradient(loaded={name: p.grad for name, p in self._param_of.items()
                                         if p.grad is not None}, scale=scale, kept=kept)
        else:
            machine.launch_rest(self._fill_bucket)
            edited = self._grad_watch.edited() if self._watching else None
            if edited is not None:
                # Posted for the other ranks, whose next wait raises it too (engine/stall.py).
                raise machine.engine.refuse(
                    edits.edited_after_backward(self._name_of[edited], self._pipeline_depth))
            kept = self._keep()
            self._take_exchanged(kept)
            agreed = self._agree()
            entry = StepGradient(machine.launched + self._launch_sparse(), scale=scale,
                                 kept=kept)
        ready = machine.finish_step(entry)
        if agreed is not None:
            self._plan(agreed)
        self._reset_step()
        self.timings["steps"] += 1
        # Several only when a resume lands in warm-up, or tune="auto" undid a K=2 trial.
        for entry in ready[:-1]:
            self._apply(entry)
        self._pending_apply = ready[-1] if ready else None
        self._fill_grads(self._pending_apply)
        self._synchronized = True

    def _agree(self):
        """After the first backward: rank 0's gradient-ready order, every rank's sparse gradients.

        Returns the order to plan buckets by after this step, or None once agreed.
        """
        if self._order_agreed:
            return None
        seen = [self._name_of[p] for p in self._observed]
        rest = [self._name_of[p] for p in reversed(self._params) if p not in self._observed]
        order, everyone = self._machine.agree(seen, rest, (self._sparse_seen_here(),
                                                           _describe_optimizer(self)))
        self._adopt_sparse([sparse for sparse, _ in everyone])
        _compare_rules([rule for _, rule in everyone])
        self._order_agreed = True
        self._observed = {}
        return order

    def _fill_grads(self, entry):
        start = time.perf_counter()
        grads = entry.gradients() if entry is not None else {}
        self.timings["wait_s"] += time.perf_counter() - start
        factor = 1.0
        if entry is not None and entry.scale is not None:
            # A GradScaler may have changed its scale since this gradient was computed.
            factor = self._grad_scaler.get_scale() / entry.scale
        for name, p in self._param_of.items():
            grad = grads.get(name)
            # Never write into the old `.grad`: it may view a buffer on the wire.
            if grad is None:
                p.grad = torch.zeros_like(p)
                continue
            if grad.is_sparse:
                p.grad = grad
            elif name in self._sparse:           # sparse_as_dense: sparse again
                p.grad = self._sparse_again(name, grad, p)
            elif p.is_contiguous():
                p.grad = grad.view_as(p)         # the landed result itself: no copy
            else:
                p.grad = torch.empty_like(p).copy_(grad.view_as(p))
            if factor != 1.0:
                p.grad.mul_(factor)
        if entry is not None and "weights" in entry.kept:
            self._compensate_delay(entry.kept["weights"])

    def _apply(self, entry):
        """Apply a gradient taken from the FIFO outside the user's step() (drain)."""
        self._fill_grads(entry)                  # at the scaler's current scale
        if entry.scale is not None:
            scale = self._grad_scaler.get_scale()
            for p in self._params:
                p.grad.div_(scale)
            if not all(torch.isfinite(_values(p.grad)).all() for p in self._params):
                return                           # as GradScaler would: skip the overflowed step
        self._inner_step(hooks=True)             # flush() is no step(): its hooks run here
        self.timings["applied"] += 1

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._refuse_if_replaced()
        if self._should_synchronize:
            if self._synchronized and not self._hooks_fired and self._auto_synced is None:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(); the gradient was not "
                              "reduced twice, but wrap step() in optimizer.skip_synchronize() "
                              "when you call synchronize() yourself", stacklevel=2)
            elif not self._synchronized or self._hooks_fired:
                self.synchronize()
        elif not self._synchronized or self._hooks_fired:
            raise RuntimeError("step() inside skip_synchronize() needs a synchronize() first")
        self._synchronized = False
        self._auto_synced = None
        original = self._counted_by() if getattr(self, "_counted_by", None) else None
        if original is not None:                 # as the scheduler's own wrapper would
            original._opt_called = True
        entry, self._pending_apply = self._pending_apply, None
        if self._compensation == "predict":
            with self._charged():
                self._copy_params(self._previous)
        if entry is not None:
            self._inner_step()
            self.timings["applied"] += 1
        self._predict_at_forward()
        return loss

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Let step() apply what synchronize() already prepared (for clipping, AMP)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def flush(self):
        """Apply every gradient still in flight, oldest first (one wrapped step each).

        Call at the end of training and before evaluation or a checkpoint
        that must hold weights with every computed gradient applied.
        """
        if self._between_backward_and_step():
            raise RuntimeError("flush() called between backward and step(); call step() first")
        self._drop_unstepped()
        self._restore_real()
        for entry in self._machine.drain():
            self._apply(entry)

    def _drop_unstepped(self):
        """Forget a gradient synchronize() prepared that no step() applied.

        GradScaler.step does not call step() when that gradient overflowed:
        it counts as skipped, as it would without the pipeline, and the next
        synchronize() or flush() goes on from there.
        """
        if not self._synchronized:
            return
        self._synchronized = False
        discarded, self._auto_synced = self._auto_synced == "discarded", None
        skipped, self._pending_apply = self._pending_apply, None
        if skipped is not None and self._grad_scaler is None and not discarded:
            warnings.warn("synchronize() was not followed by step(): that gradient was not "
                          "applied, as after a GradScaler overflow (pass grad_scaler= to the "
                          "DistributedOptimizer when using one)", stacklevel=3)

    def _inner_step(self, hooks=False):
        """The wrapped optimizer's step, once.

        torch wraps every optimizer class's step() to run the hooks of
        register_step_pre_hook/post_hook, ours as well as the user's class:
        inside our step() they ran already, so here they run only if asked.
        """
        saved = self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks
        if not hooks:
            self._optimizer_step_pre_hooks = collections.OrderedDict()
            self._optimizer_step_post_hooks = collections.OrderedDict()
        try:
            with self._compensated_momentum():
                super().step()
        finally:
            self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = saved

    def zero_grad(self, set_to_none=True):
        if self._hooks_fired:
            raise RuntimeError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(): this step's gradients are "
                "already being reduced; call step() first")
        if self._auto_synced == "pending":       # the average backward left: dropped, as DDP
            self._auto_synced = "discarded"
        return super().zero_grad(set_to_none=set_to_none)

    def _between_backward_and_step(self):
        """A backward pass has run, or ended with its average in `.grad`, and no step()
        (one GradScaler may skip: dropped at the next synchronize() or flush())."""
        return self._hooks_fired or (self._auto_synced == "pending"
                                     and self._grad_scaler is None)

    # --- for the Keras torch backend (pipe_horovod/keras/torch_path.py) -------
    # It drives this optimizer from Keras's train step rather than from a user's
    # torch loop; these are the few things it needs beyond step() and flush().
    def collect_gradients(self):
        """Hand this step's `.grad` tensors to the pipeline if no hook has yet.

        Why: each parameter's post-accumulate-grad hook hands its gradient over
        during backward. An optimizer built after this step's backward (Keras
        builds it in its first apply(), after the first backward) had no hooks
        then, so its first step() would find no gradient. Call it right before
        step(); it does nothing once a hook has fired (or backward left its
        average in `.grad`), so calling it every step is safe.
        """
        if self._between_backward_and_step():
            return
        for p in reversed(self._params):         # the order backward produces them in
            if p.grad is not None:
                self._on_grad_ready(p)

    def restore_real_weights(self):
        """Put the real weights back in the parameters where they hold a prediction.

        Why: with staleness_compensation="lookahead" or "predict" the parameters
        hold predicted weights from step() to the next backward. A caller that
        reads or saves the weights outside that cycle (Keras's evaluate, predict
        and save) calls this first, so it sees the weights training updates. The
        prediction still due is dropped; the next step() makes a new one.
        """
        self._restore_real()

    def gradients_in_flight(self):
        """Returns: the number of averaged gradients computed and not applied yet
        (at most pipeline_depth - 1; flush() applies them)."""
        return len(self._machine.fifo)

    def write_run_summary(self, path):
        """Write what this run measured (per step compute, per bucket bytes, launch,
        landing and exposed wait; the configuration) to `path` as JSON, on rank 0, for
        `pipe-horovod plan --from-run path`. Returns `path` on rank 0, None elsewhere.
        Nothing is exchanged: call it on rank 0 alone if you like. (Or set
        PIPE_HOROVOD_RUN_SUMMARY=path to have it written at exit.)"""
        return self._machine.write_run_summary(path)

    # --- for elastic training (pipe_horovod.torch.elastic) ----------------------
    # Elastic's state handlers call these on a pipelined optimizer around a failure
    # and an engine reset (is_distributed() tells which optimizers are).
    def drop_in_flight(self):
        """Forget, without waiting, every gradient in flight and this step's progress.

        For an elastic restore after a failed collective: those reductions will
        never complete here (elastic's reset settles them in the engine). The
        committed state_dict is loaded next. `.grad` is cleared as well, since a
        failed backward may have left part of a gradient in it.
        """
        self._machine.forget()
        self._forget_prediction()                # the committed state brings its own weights
        self._reset_step()
        self._synchronized, self._pending_apply, self._auto_synced = False, None, None
        self._observed = {}
        self._forget_seen_sparse()
        for p in self._params:
            p.grad = None

    def release_engine(self):
        """Forget the engine before elastic resets it.

        Why: the engine's shutdown reports gradients in flight as never applied;
        the committed ones will be applied after the reset, so this optimizer must
        not be counted there. rebind_engine() attaches it to the next engine.
        """
        self._engine = None

    def rebind_engine(self):
        """Attach to the engine running now: after an elastic reset (shutdown and
        init in this process) it is a new engine, and rank and size may differ.

        Raises:
            RuntimeError: the optimizer reduces over a process set, which does not
                survive the reset.
        """
        if self._process_set is not None:
            raise RuntimeError("a DistributedOptimizer over a process set cannot follow an "
                               "elastic reset: process sets do not survive it")
        self._attach_engine()
        self._resolve_bucket_cap_again()

    def _resolve_bucket_cap_again(self):
        """An automatic cap (bucket_cap_mb=None) depends on the world size: choose it again
        for the engine running now, and plan the buckets again if it changed (the next
        sync's load_state_dict plans with it too). An explicit cap stays as set."""
        if not isinstance(self._machine.cap_bytes, BucketCapBytes):   # an automatic cap's type
            return
        old, cap = self._machine.cap_bytes, bucket_cap_bytes(resolve_bucket_cap_mb(None))
        if int(cap) == int(old) and (getattr(cap, "split_model", False)
                                     == getattr(old, "split_model", False)):
            return
        self._machine.cap_bytes = cap
        self._plan(self._order)


def _weak_end(opt):
    """The end-of-backward callback, not keeping `opt` alive."""
    ref = weakref.ref(opt)

    def end():
        owner = ref()
        if owner is not None:
            owner._end_of_backward()
    return end


# torch (2.13 here) has no public API to ask whether autograd is running a backward
# pass, nor to queue a callback at its end: torch's own FSDP makes the same two private
# calls. Both live in these two functions, the only private torch API used here.
def _in_backward():
    """True inside a backward pass run by autograd's engine (a hook called from it),
    False when this process calls a hook's work itself (the Keras torch backend)."""
    return torch._C._current_graph_task_id() != -1


def _queue_after_backward(callback):
    """Run `callback` once the running backward pass ends (only inside one)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def _wrapped_here():
    """This engine's live wrapped optimizers, in creation order."""
    return sorted((opt for opt in list(_live) if opt._engine is engine.current()),
                  key=lambda opt: opt._number)


def _flush_before_join():
    """A rank that joins computes no more gradients: apply what it has in flight.

    Horovod's join also refuses to start while this rank's own reductions
    are pending under its response cache ("Trying to overwrite cached
    response").
    """
    for opt in _wrapped_here():
        if opt._between_backward_and_step():
            raise RuntimeError("join() called between backward and step(); call step() first")
        opt.flush()


def _align_after_join(last):
    """Ranks that ran different numbers of steps continue from the last joiner's count,
    so per-slot tensor names and warm-up agree again."""
    opts = _wrapped_here()
    steps = engine.broadcast_object([opt._fifo.steps for opt in opts], last)
    for opt, count in zip(opts, steps):
        opt._fifo.steps = count


def _report_unapplied():
    """At shutdown: say (rank 0, once) how many computed gradients were never applied."""
    report_unapplied(sum(len(opt._fifo) for opt in _wrapped_here()))


def _say_how_lookahead_predicts(optimizer):
    """Warn (once, at wrap time) where the lookahead prediction is not one pass."""
    what = lookahead.fallback(type(optimizer), optimizer.param_groups)
    if what is None or hasattr(optimizer, "pipe_horovod_state_restored"):
        return                                           # (the Keras stand-in: Keras's own)
    warnings.warn(
        f"staleness_compensation='lookahead' has no one-pass prediction for {what} "
        "(pipe_horovod/torch/lookahead.py knows SGD, Adam and AdamW, plain, foreach, fused or "
        "capturable, with number hyperparameters and not differentiable): each step() falls "
        "back to running its step once more on a temporary copy of its state (exact, but one "
        "more step and transient memory the size of that state); "
        "staleness_compensation=None turns the prediction off", stacklevel=4)


def _changed_after_wrapping(name, grad, bucket):
    return RuntimeError(
        f"parameter {name!r} is {grad.dtype} on {grad.device} now but was {bucket.dtype} on "
        f"{bucket.device} when the DistributedOptimizer was wrapped (model.half(), "
        "model.to(...) or .data replaced after wrapping?): the reduction buffers have the old "
        "type; convert the model first, then create its optimizer and DistributedOptimizer")


def _describe_optimizer(optimizer):
    """The user's optimizer class and its hyper-parameters, as the ranks compare them."""
    cls = _user_class(type(optimizer))
    groups = [{key: repr(value) for key, value in sorted(group.items()) if key != "params"}
              for group in optimizer.param_groups]
    return f"{cls.__module__}.{cls.__qualname__}", groups


def _compare_rules(everyone):
    """At the first step (every rank's optimizer as it is then, after the start-up
    broadcasts): the class must be the same on every rank, as each rank applies the same
    averaged gradient with it; hyper-parameters that differ are what Horovod's scripts
    fix with broadcast_optimizer_state, which may come after a first step, as in
    Horovod's own tests: a warning on every rank, not an error."""
    (cls, groups), rest = everyone[0], everyone[1:]
    for rank, (theirs, their_groups) in enumerate(rest, start=1):
        if theirs != cls:
            raise ValueError(f"the optimizer differs between ranks: it is {theirs} on rank "
                             f"{rank} but {cls} on rank 0; every rank must wrap the same "
                             "optimizer class")
    for rank, (_, their_groups) in enumerate(rest, start=1):
        if their_groups != groups:
            diff = _first_difference(groups, their_groups)
            warnings.warn(f"the optimizer's hyper-parameters differ between ranks at its "
                          f"first step: {diff} on rank {rank}; each rank applies the "
                          "averaged gradient with its own: call "
                          "hvd.broadcast_optimizer_state(optimizer, root_rank=0) after "
                          "wrapping (Horovod's way), or build it alike on every rank",
                          stacklevel=5)
            return


def _first_difference(groups, theirs):
    """The first hyper-parameter whose value differs, in words."""
    if len(theirs) != len(groups):
        return f"{len(theirs)} parameter group(s) against rank 0's {len(groups)}"
    for i, (mine, other) in enumerate(zip(groups, theirs)):
        for key in sorted(set(mine) | set(other)):
            if mine.get(key) != other.get(key):
                return (f"param_groups[{i}]['{key}'] is {other.get(key, '<missing>')} "
                        f"against rank 0's {mine.get(key, '<missing>')}")
    return "they differ"


def _user_class(cls):
    """The user's optimizer class in a pipelined class's MRO."""
    return next(c for c in cls.__mro__ if issubclass(c, torch.optim.Optimizer)
                and not issubclass(c, _PipelinedOptimizer))




def DistributedOptimizer(
        optimizer: torch.optim.Optimizer,
        named_parameters: Optional[Iterable[Tuple[str, torch.nn.Parameter]]] = None,
        compression: Any = Compression.none, backward_passes_per_step: int = 1,
        op: engine.ReduceOp = engine.Average, gradient_predivide_factor: float = 1.0,
        num_groups: int = 0, groups: Union[int, list, None] = None,
        sparse_as_dense: bool = False, process_set: Optional[ProcessSet] = None, *,
        pipeline_depth: Optional[int] = None, warmup_steps: int = 0,
        bucket_cap_mb: Optional[float] = None, grad_scaler: Any = None,
        collective: Any = None,
        staleness_compensation: Optional[str] = staleness.DEFAULT,
        prediction_exchange: Optional[str] = None,
        tune: Optional[str] = None) -> torch.optim.Optimizer:
    """Wrap `optimizer` so its gradients are averaged across ranks, pipelined.

    Why pipelined: the reduction of step t's gradient runs while step t+1
    computes, so communication hides behind compute instead of adding to
    it (DESIGN.md, "Semantics", states the math). A Horovod script switches by
    changing its import: the arguments up to `process_set` are Horovod's, in
    Horovod's order and with its meaning.

    Args:
        optimizer: the torch optimizer to wrap; its own rule (SGD, Adam, ...)
            makes every update.
        named_parameters: model.named_parameters(), so errors and checkpoints name
            tensors by the model's names; None: param.0, param.1, ... in
            param_groups order.
        compression: a Compression codec for what travels (Compression.fp16,
            bf16, int8, int8_ef, ...).
        backward_passes_per_step: backward passes accumulated locally per step().
        op: Average (default), Sum or Adasum, as in Horovod.
        gradient_predivide_factor: divide before the sum and the rest after, to
            keep fp16 sums in range (Average only), as in Horovod.
        num_groups, groups: which gradients share a bucket (a count, or lists of
            parameters), in place of `bucket_cap_mb`; num_groups is deprecated,
            as in Horovod.
        sparse_as_dense: reduce sparse gradients densely, as in Horovod.
        process_set: the ranks that train together; None: all.
        pipeline_depth: 1 applies g_t at step t (synchronous, like Horovod); K >= 2
            applies g_{t-K+1} and overlaps the reduction with K-1 steps. Default:
            $PIPE_HOROVOD_PIPELINE_DEPTH if set; else tune="auto" chooses 1 or 2 (see
            `tune`), and 2 where tuning is off.
        warmup_steps: synchronous steps before the pipeline starts, for the first
            steps' large gradients.
        bucket_cap_mb: MiB per bucket; None (default): chosen from the number of
            ranks and the link ($PIPE_HOROVOD_LINK_GBPS,
            $PIPE_HOROVOD_LINK_LATENCY_US; pipe_horovod/pipeline/buckets.py,
            docs/planner.md), 32 to 128 MiB.
        grad_scaler: the torch.amp.GradScaler in use, if any; a delayed gradient is
            rescaled when the scaler's scale changed since it was computed.
        collective: None (the engine's own allreduce), "lp", "ring", "mst", "be" or a
            pipe_horovod.collectives.Collective: reduce the buckets with
            pipe_horovod's own algorithm, which runs the codec at every hop.
        staleness_compensation: "lookahead" (default), "predict", "dc", "momentum"
            or None (plain Pipe-SGD): how a gradient K-1 steps old is made to act
            like a fresh one (pipe_horovod/pipeline/staleness.py;
            docs/convergence.md measures them). No effect at K=1.
        prediction_exchange: None (default) or "int4" / "int8": the lookahead
            predicts from the ranks' average of the step in flight, exchanged in
            that format as backward produces it (1/8 or 1/4 of the gradient's
            bytes), instead of this rank's own gradient; step() waits for it, and
            the step's full reductions start after it. For models whose default
            lags synchronous training (docs/convergence.md).
        tune: "auto" (the default unless a pipeline depth is given) or "off" (the
            configuration as given: K=2 with the lookahead where no depth is given).
            "auto": the run tunes
            itself (docs/auto.md): its first $PIPE_HOROVOD_TUNE_STEPS steps (20) train
            synchronously while it measures compute, exposed wait and the link; then
            every rank applies the depth (1 or 2), codec and bucket cap predicted
            fastest among those the convergence rule allows, and rank 0 logs one line
            saying why. An explicit pipeline_depth, compression or bucket_cap_mb pins
            that choice. None (default): $PIPE_HOROVOD_TUNE ("auto" or "off") if set,
            else "auto" where neither the pipeline_depth argument nor
            $PIPE_HOROVOD_PIPELINE_DEPTH is given, else "off".

    Returns:
        The optimizer to use in place of `optimizer`: an instance of a pipelined
        subclass of its class that adopts its parameters, hyper-parameters, state
        and hooks. step(), zero_grad(), state_dict() and load_state_dict() keep
        their meaning; flush() applies every gradient still in flight.

    Raises:
        TypeError: `optimizer` is not a torch optimizer, or an option has the
            wrong type.
        ValueError: a bad option value, an optimizer wrapped twice, or a model
            that differs between ranks (raised on every rank, here, rather than
            as a hang inside the first reduction).
    """
    return _wrap(optimizer, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, num_groups, groups, sparse_as_dense, process_set,
                 pipeline_depth=pipeline_depth, warmup_steps=warmup_steps,
                 bucket_cap_mb=bucket_cap_mb, grad_scaler=grad_scaler, collective=collective,
                 staleness_compensation=staleness_compensation,
                 prediction_exchange=prediction_exchange, tune=tune)


def wrap_for_adapter(optimizer, named_parameters, *, join_ranks, **options):
    """DistributedOptimizer for another pipe_horovod adapter that drives it (Keras on torch).

    Why not DistributedOptimizer itself: the Keras wrapper has checked the
    options, told the user the depth, and may build this optimizer on one rank
    alone (inside load_model), where the cross-rank comparison that
    DistributedOptimizer makes at wrap time would wait forever. Here the
    depth is not announced again and that comparison (and the communicator's
    setup) is left to `join_ranks`.

    Args:
        optimizer, named_parameters, **options: as for DistributedOptimizer
            (pipeline_depth and warmup_steps given explicitly).
        join_ranks: called once, at the first gradient of the first step (every
            rank is there then), before anything is reduced.

    Returns:
        The wrapped optimizer, as DistributedOptimizer returns it.
    """
    # Announced by the caller: recorded as if DistributedOptimizer had (rank 0 logs once).
    _announced.add((options["pipeline_depth"], options["warmup_steps"],
                    "pipeline_depth argument"))
    return _wrap(optimizer, named_parameters, join_ranks=join_ranks, **options)


def is_distributed(optimizer):
    """True if `optimizer` is one DistributedOptimizer returned (pipelined).

    Why: elastic's state handlers take any torch optimizer and treat a
    pipelined one specially (gradients in flight, the engine it is bound to).
    """
    return isinstance(optimizer, _PipelinedOptimizer)


def _wrap(optimizer, named_parameters=None, compression=Compression.none,
          backward_passes_per_step=1, op=engine.Average, gradient_predivide_factor=1.0,
          num_groups=0, groups=None, sparse_as_dense=False, process_set=None, *,
          pipeline_depth=None, warmup_steps=0, bucket_cap_mb=None, grad_scaler=None,
          collective=None, staleness_compensation=staleness.DEFAULT, prediction_exchange=None,
          tune=None, join_ranks=None):
    """DistributedOptimizer's work; `join_ranks`: see wrap_for_adapter. Warnings
    given here name the caller of DistributedOptimizer or wrap_for_adapter (one frame
    above this one: stacklevel counts it)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if isinstance(optimizer, _PipelinedOptimizer) or type(optimizer).__module__.startswith(
            "horovod.torch"):                    # Horovod's wrapper: a class of its module
        refuse_double_wrapping(
            getattr(optimizer, "_pipe_wrapper", "pipe_horovod.torch.DistributedOptimizer")
            if isinstance(optimizer, _PipelinedOptimizer)
            else "horovod.torch.DistributedOptimizer",
            "pipe_horovod.torch.DistributedOptimizer", "torch.optim optimizer")
    pinned_cap = bucket_cap_mb
    pipeline_depth, depth_source = resolve_depth(pipeline_depth)
    bucket_cap_mb = resolve_bucket_cap_mb(bucket_cap_mb, process_set)   # None: auto
    check_options(pipeline_depth, warmup_steps, backward_passes_per_step, bucket_cap_mb)
    collective = check_collective(collective, compression)
    check_reduction(op, gradient_predivide_factor)
    compensation = check_staleness(staleness_compensation)
    exchange = check_prediction_exchange(prediction_exchange, compensation)
    # What ranks compare: the options as given (auto's own depth and warm-up follow from
    # tune, compared itself), so ranks whose tune differs are told that.
    given_depth, given_warmup = pipeline_depth, warmup_steps
    # (an adapter that drives this one passes its own choice, "auto" or "off", so
    # PIPE_HOROVOD_TUNE does not reach inside it twice; warnings name the caller of
    # DistributedOptimizer or wrap_for_adapter)
    tuned = auto.tuning(tune, depth_source != "default", functools.partial(
        auto.pins_from_options, pipeline_depth if depth_source != "default" else None,
        compression, pinned_cap, warmup_steps, collective, op, exchange), stacklevel=3)
    tuner = None
    if tuned is not None:                # its measured steps: K=1, the pinned codec or none
        tuner = auto.Tuner(*tuned)
        pipeline_depth, warmup_steps = 1, auto.warmup_steps(tuner.steps, warmup_steps)
    if isinstance(optimizer, torch.optim.LBFGS):
        raise TypeError(
            "LBFGS evaluates its closure (forward and backward) several times inside one "
            "step(), and a DistributedOptimizer reduces one gradient per step() (as Horovod's "
            "does), so LBFGS cannot be wrapped at any pipeline_depth; train with a first-order "
            "optimizer (SGD, Adam, ...)")
    if compensation == "momentum":
        for i, group in enumerate(optimizer.param_groups):
            if _momentum_key(group) is None:
                raise ValueError(
                    f"staleness_compensation='momentum' reduces the wrapped optimizer's momentum, "
                    f"but {type(optimizer).__name__} has none in param_groups[{i}] (no nonzero "
                    "'momentum' or 'betas'); use 'lookahead' instead")
    if grad_scaler is not None and not hasattr(grad_scaler, "get_scale"):
        raise TypeError(f"grad_scaler must be a torch.amp.GradScaler, got {grad_scaler!r}")
    eng = engine.current()
    name_of, named = _named(optimizer, named_parameters)
    meta = [name for name, p in named if p.is_meta]
    if meta:
        raise ValueError(
            f"parameter {meta[0]!r}{f' (and {len(meta) - 1} more)' if len(meta) > 1 else ''} "
            "is on the meta device: it has a shape but no values (a model built under "
            "torch.device('meta')); materialize it before wrapping its optimizer "
            "(model.to_empty(device=...) and initialize it, or "
            "model.load_state_dict(state, assign=True)), then create the optimizer")
    bucket_groups = _group_names(groups, num_groups, name_of)
    options = {"pipeline_depth": given_depth, "warmup_steps": given_warmup,
               "backward_passes_per_step": backward_passes_per_step,
               "compression": describe_compression(compression),
               "op": op.value, "bucket_cap_mb": bucket_cap_mb,
               "gradient_predivide_factor": float(gradient_predivide_factor),
               "groups": bucket_groups, "staleness_compensation": compensation,
               "prediction_exchange": exchange,
               "collective": None if collective is None else collective.describe(),
               "tune": None if tuner is None else f"auto ({tuner.steps} steps)"}
    if process_set is not None and not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a pipe_horovod ProcessSet, got {process_set!r}")
    if process_set is global_process_set:
        process_set = None
    if process_set is not None and process_set.process_set_id is None:
        raise ValueError(f"{process_set} is not registered: pass it to init(process_sets=[...]) "
                         "or add_process_set() first")
    # join_ranks: the Keras adapter's, which may build this on one rank alone (inside
    # load_model): it compares its own model and opens the group, called before the
    # first gradient is reduced, when every rank is there.
    if join_ranks is None and os.environ.get("HOROVOD_ELASTIC") != "1" and (
            process_set is None or process_set.included()):
        # Not under horovodrun's elastic mode: there a worker that joins wraps its
        # optimizer while the others synchronize state, so a collective here would
        # deadlock; elastic's sync gives it rank 0's state instead.
        compare_across_ranks(functools.partial(eng.allgather_object, process_set=process_set),
                             _describe(named, [n for n, _ in named], options))
    if tuner is None:
        announce_depth(pipeline_depth, warmup_steps, depth_source, process_set, _announced)
    else:
        auto.announce(tuner, process_set, _announced)

    if compensation == "lookahead" and pipeline_depth > 1:
        _say_how_lookahead_predicts(optimizer)
    cls = type(type(optimizer).__name__, (_PipelinedOptimizer, type(optimizer)), {})
    wrapped = cls.__new__(cls)
    # Adopt the user's optimizer as unpickling would: hyperparameters, state and
    # hooks carry over, whatever its constructor's signature. Not a `step` set on the
    # instance: an LR scheduler built before wrapping puts its step-counting wrapper there,
    # bound to the original optimizer, which would then step in place of this one.
    state = dict(optimizer.__dict__)
    counted = state.pop("step", None)
    torch.optim.Optimizer.__setstate__(wrapped, state)
    wrapped._counted_by = None
    if getattr(counted, "_wrapped_by_lr_sched", False):
        wrapped._counted_by = weakref.ref(optimizer)    # its scheduler reads _opt_called
    wrapped._setup_pipeline(name_of, compression, backward_passes_per_step, op, pipeline_depth,
                            warmup_steps, bucket_cap_mb, grad_scaler,
                            float(gradient_predivide_factor), bucket_groups,
                            bool(sparse_as_dense), process_set, compensation, collective,
                            exchange, tuner)
    if join_ranks is not None:
        wrapped._join_ranks = join_ranks
    elif opens_group(collective, compression, exchange):
        communicator(eng)            # collective: every rank is here, after the comparison
    return wrapped


__all__ = ["DistributedOptimizer"]
