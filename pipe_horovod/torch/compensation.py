"""Staleness compensation for the PyTorch adapter: the per-step side of
pipe_horovod/pipeline/staleness.py (what the options keep, predict, correct).

A mixin of _PipelinedOptimizer. Its state: `_compensation` (the kind, None at
K=1), `_rule_class` (the user's optimizer class, passed to
`_setup_compensation`), `_real`, `_predicted`, `_swapped`, `_previous`,
`_mean_square`, `_kept_buffers`, and the module's `_due` set. It reads from
the optimizer `_machine` (fifo, solo, slot), `_param_of`, `_step_local`,
`_sparse`, `_pipeline_depth`, `timings`, `_number`, `param_groups` and
`state`, and calls `_inner_step` for the optimizer steps a prediction runs
where it cannot be computed in one pass. The rest calls on it:
`_keep`, `_predict_at_forward`, `_prediction_missed`, `_restore_real`,
`_compensate_delay`, `_compensated_momentum`; `_compensation_state()` and
`_restore_compensation(state)` for the checkpoint (torch/checkpoint.py), and
`_forget_prediction()` for elastic's drop_in_flight. Nothing else sets its
fields.

"lookahead" keeps only the real weights while the parameters hold the
prediction, and by swapping storage rather than copying: the parameter
takes the prediction's storage (`p.data = prediction`), the real weights
stay in theirs, and step() swaps them back. This rank's own gradient of the step in flight is the `.grad`
autograd made for it (the bucket got a copy), taken by reference when the
step is pushed and used as scratch by the prediction right after the real
update (torch/lookahead.py); so at pipeline_depth=2 nothing but the real
weights outlives step(). Where backward accumulated straight into the
bucket (zero_grad(set_to_none=False)) the reduction overwrites it, so a
copy is kept; at depth K >= 3 the K-2 older steps' gradients are kept too.

The prediction is made at the first nn.Module forward pass with gradients
enabled after step() (a global forward pre-hook, registered only while a
prediction is due), not in step() itself: until then the parameters hold
the real weights, the same on every rank, so what users do between steps
(a WGAN clamp of `p.data`, `model.state_dict()`, `torch.save(model)`,
evaluation under `torch.no_grad()`) sees and edits the real weights, and
the prediction starts from the edited ones.
"""
import contextlib
import time
import warnings
import weakref

import torch

from ..pipeline import staleness
from . import lookahead


class _Compensation:
    def _setup_compensation(self, compensation, pipeline_depth, rule_class):
        """`compensation` and `pipeline_depth` as the user passed them; `rule_class`: the
        user's optimizer class, whose update rule torch/lookahead.py may know."""
        # Nothing to compensate at K=1.
        self._compensation = compensation if pipeline_depth > 1 else None
        self._kept_buffers = {}                  # (slot, kind, name) -> tensor kept with a step
        self._real = {}                          # name -> real weights while params are predicted
        self._predicted = False
        self._swapped = False                    # the parameters hold the prediction's storage
        self._previous = {}                      # "predict": the weights before this step's update
        self._mean_square = {}                   # "dc": running mean of g*g per parameter
        self._rule_class = rule_class            # "lookahead": the user's optimizer class

    def _keep(self):
        """What this step must keep for its compensation until it is applied."""
        kind = self._compensation
        if kind == "lookahead" and not self._machine.solo:   # solo: the entry is local already
            # Autograd's `.grad` by reference (step() points `.grad` elsewhere before the
            # next backward), or the copy taken where backward wrote into the bucket.
            return {"local": {name: self._step_local.get(name, p.grad)
                              for name, p in self._param_of.items()}}
        if kind == "dc":
            return {"weights": {name: self._kept_copy("weights", name, p.detach())
                                for name, p in self._param_of.items()}}
        return {}

    def _take_exchanged(self, kept):
        """prediction_exchange: the ranks' exchanged average in place of this rank's own
        gradient in what the step keeps (its tensors are the prediction's scratch, and a
        checkpoint then carries what the prediction reads). Its wait is not the
        compensation's (the step machine times it: the timing model's W, not P)."""
        local = kept.get("local")
        if local is None:
            return
        for name, average in self._machine.estimates().items():
            own = local.get(name)
            if own is None or own.is_sparse:         # unused here: the others' still counts
                local[name] = average.view_as(self._param_of[name]).clone()
            else:
                own.copy_(average.view(own.shape))

    def _kept_copy(self, kind, name, tensor):
        """A copy in a persistent per-slot buffer (fresh large tensors page-fault)."""
        p = self._param_of[name]
        if tensor is None:                       # unused on this rank
            return torch.zeros_like(p)
        if tensor.is_sparse:
            return tensor.detach().clone()
        # A local gradient at depth 2 is used up within its step: one buffer, not one a slot.
        slot = 0 if kind == "local" and self._pipeline_depth == 2 else self._machine.slot
        return _copy_into(self._kept_buffers, (slot, kind, name), tensor)

    def _copy_params(self, into):
        with torch.no_grad():
            for name, p in self._param_of.items():
                buf = into.get(name)
                if buf is None or buf.shape != p.shape:
                    into[name] = p.detach().clone()
                else:
                    buf.copy_(p)

    def _restore_real(self):
        """Put the real weights back where the prediction was (one still due is dropped)."""
        _due.discard(self)
        if not self._predicted:
            return
        with self._charged(), torch.no_grad():
            if self._swapped:                    # the prediction's storage is dropped
                for name, real in self._real.items():
                    self._param_of[name].data = real
                self._real = {}
            else:
                for name, p in self._param_of.items():
                    p.copy_(self._real[name])
        self._predicted = self._swapped = False

    def _forget_prediction(self):
        """Forget the prediction, made or due, without restoring the real weights: for
        elastic's drop_in_flight, whose committed state brings its own weights."""
        self._predicted = False
        _due.discard(self)

    def _compensation_state(self):
        """Compensation's part of a checkpoint's "pipe_horovod" entry: the prediction's
        real weights (the parameters hold the predicted ones), whether a prediction is
        due, "predict"'s previous weights and "dc"'s running mean square, so a resume
        continues each exactly. The tensors are copies."""
        due = self in _due
        return {
            "real_weights": ({n: t.detach().clone() for n, t in self._real.items()}
                             if self._predicted else None),
            "prediction_due": due,
            # "predict" extrapolates from the weights before the last update.
            "previous_weights": ({n: t.detach().clone() for n, t in self._previous.items()}
                                 if due and self._compensation == "predict" else None),
            "mean_square": {n: t.detach().clone() for n, t in self._mean_square.items()},
        }

    def _restore_compensation(self, state):
        """Compensation's state from a checkpoint's "pipe_horovod" entry (the keys
        _compensation_state() writes; absent ones are empty), its tensors moved to their
        parameters' devices. The parameters already hold what was saved."""
        def here(tensors):
            return {n: t.to(self._param_of[n].device) for n, t in tensors.items()}
        real = state.get("real_weights")
        self._real = here(real) if real else {}
        self._predicted, self._swapped = bool(real), False
        _due.discard(self)
        if state.get("previous_weights"):
            self._previous = here(state["previous_weights"])
        if state.get("prediction_due"):
            self._predict_at_forward()
        self._mean_square = here(state.get("mean_square", {}))

    def _predict_at_forward(self):
        """Predict at the next forward pass with gradients (module docstring)."""
        if self._compensation in ("predict", "lookahead") and len(self._machine.fifo):
            _await_forward(self)

    def _prediction_missed(self):
        """A gradient arrived while the prediction was still due: no nn.Module forward ran
        with gradients since step(), so this gradient is at the real weights."""
        if self not in _due:
            return
        _due.discard(self)
        if not _warned:
            _warned.append(True)
            warnings.warn(
                f"staleness_compensation={self._compensation!r} predicts the weights at the "
                "first nn.Module forward pass with gradients enabled after step(); this "
                "backward followed no such forward (a model written without nn.Module?), so "
                "its gradient was computed at the real weights, as with "
                "staleness_compensation=None", stacklevel=4)

    def _predict(self):
        """Move the parameters to where the updates in flight will take them, for the next
        forward and backward ("predict", "lookahead"); the real weights are kept aside."""
        ahead = list(self._machine.fifo)
        if self._compensation not in ("predict", "lookahead") or not ahead:
            return
        with self._charged():
            self._predicted = self._predict_ahead(ahead)

    def _predict_ahead(self, ahead):
        if self._compensation == "predict":
            self._copy_params(self._real)
            with torch.no_grad():
                for name, p in self._param_of.items():
                    p.copy_(staleness.extrapolated(self._real[name], self._previous[name],
                                                   len(ahead)))
            return True
        return self._look_ahead(ahead)

    def _look_ahead(self, ahead):
        """This rank's own gradients of the steps in flight (oldest first), applied by the
        wrapped optimizer's rule from its current state: in one pass where
        torch/lookahead.py knows the rule, else by its own step on saved state. A step
        whose gradient overflowed (GradScaler) predicts nothing. Returns whether the
        parameters hold a prediction."""
        steps = []
        for entry in ahead:
            kept = entry.kept.get("local")
            grads = kept if kept is not None else entry.gradients()
            if entry.scale is not None and not all(
                    torch.isfinite(_values(g)).all() for g in grads.values() if g is not None):
                continue
            steps.append((grads, entry.scale))
        # The oldest entry pops at the next step: its gradient predicts nothing more.
        fifo = self._machine.fifo
        last = len(fifo) + 1 >= fifo.threshold(fifo.steps)
        if last:
            next(iter(fifo)).kept.pop("local", None)
        if not steps:
            return False
        # One pass uses the gradient as scratch: only where nothing needs it afterwards
        # (solo: the FIFO's own gradients; depth >= 3: later predictions).
        if len(ahead) == 1 and len(steps) == 1 and last and not self._machine.solo:
            (grads, scale), = steps
            owned = {p: self._owned(name, p, grads.get(name), scale)
                     for name, p in self._param_of.items()}
            # (`is None`: `None in` compares each tensor with None, ~15 us per large one)
            predicted = None if any(g is None for g in owned.values()) else lookahead.predict(
                self._rule_class, self.param_groups, self.state, owned)
            if predicted is not None:
                self._swap_in(predicted)
                return True
            steps = [({n: owned[p] for n, p in self._param_of.items()}, None)]
        per_param = [{p: self._stepped_grad(name, p, grads.get(name), scale)
                      for name, p in self._param_of.items()} for grads, scale in steps]
        # The steps run on a copy the parameters take as their storage; the real weights
        # stay in theirs (so nothing holds a copy of them between steps).
        self._swap_in({p: p.detach().clone() for p in self._param_of.values()})
        lookahead.stepped(self, per_param, self._inner_step)
        return True

    def _swap_in(self, predicted):
        """The parameters take the predictions' storage; the real weights stay in theirs,
        kept in self._real (no copy either way; _restore_real swaps back)."""
        kept = {t.data_ptr(): key for key, t in self._kept_buffers.items() if key[1] == "local"}
        for name, p in self._param_of.items():
            prediction = predicted.get(p)
            if prediction is None:               # (not in a param group: not predicted)
                continue
            if not _own_storage_like(prediction, p):
                prediction = torch.empty_like(p).copy_(prediction)   # (not seen in practice)
            # A kept copy of the local gradient becomes the parameter's storage: the next
            # step keeps its copy in a new buffer.
            self._kept_buffers.pop(kept.get(prediction.data_ptr()), None)
            self._real[name] = p.data
            p.data = prediction
        self._swapped = True

    def _owned(self, name, p, grad, scale):
        """The local gradient as a tensor the prediction may overwrite, unscaled (None:
        a sparse parameter this rank did not use)."""
        if grad is None:
            return None if name in self._sparse else torch.zeros_like(p)
        grad = grad.view_as(p) if not grad.is_sparse else grad
        if scale is not None:
            grad.mul_(1.0 / scale)
        return grad

    def _stepped_grad(self, name, p, grad, scale):
        """The local gradient as `.grad` for a step of the wrapped optimizer (not modified)."""
        if grad is None:                         # unused on this rank: a zero gradient
            return None if name in self._sparse else torch.zeros_like(p)
        grad = grad.view_as(p) if not grad.is_sparse else grad
        return grad * (1.0 / scale) if scale is not None else grad

    def _compensate_delay(self, then):
        """DC-ASGD's g + lambda_t g*g (w_now - w_then), with w_then kept at compute time."""
        with self._charged():
            self._delay_compensated(then)

    def _delay_compensated(self, then):
        for name, p in self._param_of.items():
            grad = p.grad
            if grad is None or grad.is_sparse:
                continue
            mean_square = staleness.dc_mean_square(self._mean_square.get(name), grad)
            self._mean_square[name] = mean_square
            p.grad = staleness.delay_compensated(grad, mean_square, p.detach(),
                                                 then[name].view_as(p))

    @contextlib.contextmanager
    def _charged(self):
        """Adds the block's seconds to timings["compensation_s"]: what compensation costs
        the compute path, which the timing model charges to the pipelined step (its P)."""
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.timings["compensation_s"] += time.perf_counter() - start
            # The calling thread's CPU seconds (with one intra-op thread, all of it): what
            # a shared machine's other jobs do not inflate, for the memory bench.
            self.timings["compensation_cpu_s"] = (self.timings.get("compensation_cpu_s", 0.0)
                                                  + time.thread_time() - cpu)

    @contextlib.contextmanager
    def _compensated_momentum(self):
        """While the pipeline is full, the momentum the delay adds is taken off the optimizer's."""
        fifo = self._machine.fifo
        if self._compensation != "momentum" or fifo.steps <= fifo.warmup_steps:
            yield
            return
        delay = fifo.pipeline_depth - 1
        saved = []
        for group in self.param_groups:
            key = _momentum_key(group)
            saved.append((group, key, group[key]))
            if key == "betas":
                group[key] = (staleness.reduced_momentum(group[key][0], delay), *group[key][1:])
            else:
                group[key] = staleness.reduced_momentum(group[key], delay)
        try:
            yield
        finally:
            for group, key, value in saved:
                group[key] = value


_due = weakref.WeakSet()     # wrapped optimizers whose prediction waits for a forward pass
_forward_hook = []           # the global forward pre-hook's handle while any is due
_warned = []


def _await_forward(optimizer):
    _due.add(optimizer)
    if not _forward_hook:
        _forward_hook.append(
            torch.nn.modules.module.register_module_forward_pre_hook(_before_forward))


def _before_forward(module, args):
    """Every due prediction, at the first forward pass that records gradients; then the
    hook removes itself, so later modules' calls take torch's fast path again."""
    if not torch.is_grad_enabled():
        return
    for optimizer in sorted(_due, key=lambda opt: opt._number):
        _due.discard(optimizer)
        optimizer._predict()
    if not _due and _forward_hook:
        _forward_hook.pop().remove()


def _copy_into(copies, key, tensor):
    """`tensor` copied into copies[key], a buffer made once (fresh tensors page-fault)."""
    buf = copies.get(key)
    if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype \
            or buf.device != tensor.device:
        buf = copies[key] = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return buf.copy_(tensor)


def _momentum_key(group):
    """The param_group entry holding the optimizer's momentum, or None."""
    if group.get("momentum"):
        return "momentum"
    betas = group.get("betas")
    if isinstance(betas, (tuple, list)) and betas and betas[0]:
        return "betas"
    return None


def _own_storage_like(tensor, param):
    """Whether `tensor` can be `param`'s storage: same dtype, device, shape and strides, and
    nothing else in its storage."""
    return (tensor.dtype == param.dtype and tensor.device == param.device
            and tensor.shape == param.shape and tensor.stride() == param.stride()
            and tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes()
            == tensor.numel() * tensor.element_size())


def _values(grad):
    return grad.coalesce().values() if grad.is_sparse else grad
