"""Staleness compensation for the PyTorch adapter: the per-step side of
pipe_horovod/pipeline/staleness.py (what the options keep, predict, correct).

A mixin of _PipelinedOptimizer: it reads the optimizer's parameters, its
state and the step machine's FIFO, and calls `_inner_step` for the
optimizer steps a prediction runs.
"""
import contextlib
import time

import torch

from ..pipeline import staleness


class _Compensation:
    def _setup_compensation(self, compensation, pipeline_depth):
        # Nothing to compensate at K=1.
        self._compensation = compensation if pipeline_depth > 1 else None
        self._kept_buffers = {}                  # (slot, kind, name) -> tensor kept with a step
        self._real = {}                          # name -> real weights while params are predicted
        self._predicted = False
        self._previous = {}                      # "predict": the weights before this step's update
        self._mean_square = {}                   # "dc": running mean of g*g per parameter
        self._state_copies = {}                  # "lookahead": the optimizer state, saved

    def _keep(self):
        """What this step must keep for its compensation until it is applied."""
        kind = self._compensation
        if kind == "lookahead" and not self._machine.solo:   # solo: the entry is local already
            # Bucketed gradients were kept as their buckets launched; sparse ones here.
            return {"local": {name: self._step_local[name] if name in self._step_local
                              else self._kept_copy("local", name, p.grad)
                              for name, p in self._param_of.items()}}
        if kind == "dc":
            return {"weights": {name: self._kept_copy("weights", name, p.detach())
                                for name, p in self._param_of.items()}}
        return {}

    def _kept_copy(self, kind, name, tensor):
        """A copy in a persistent per-slot buffer (fresh large tensors page-fault)."""
        p = self._param_of[name]
        if tensor is None:                       # unused on this rank
            return torch.zeros_like(p)
        if tensor.is_sparse:
            return tensor.detach().clone()
        return _copy_into(self._kept_buffers, (self._machine.slot, kind, name), tensor)

    def _copy_params(self, into):
        with torch.no_grad():
            for name, p in self._param_of.items():
                buf = into.get(name)
                if buf is None or buf.shape != p.shape:
                    into[name] = p.detach().clone()
                else:
                    buf.copy_(p)

    def _restore_real(self):
        """Put the real weights back where the prediction was."""
        if not self._predicted:
            return
        with self._charged(), torch.no_grad():
            for name, p in self._param_of.items():
                p.copy_(self._real[name])
        self._predicted = False

    def _predict(self):
        """Move the parameters to where the updates in flight will take them, for the next
        forward and backward ("predict", "lookahead"); the real weights are kept aside."""
        ahead = list(self._machine.fifo)
        if self._compensation not in ("predict", "lookahead") or not ahead:
            return
        with self._charged():
            self._predict_ahead(ahead)
        self._predicted = True

    def _predict_ahead(self, ahead):
        self._copy_params(self._real)
        if self._compensation == "predict":
            with torch.no_grad():
                for name, p in self._param_of.items():
                    p.copy_(staleness.extrapolated(self._real[name], self._previous[name],
                                                   len(ahead)))
        else:
            applied = {name: p.grad for name, p in self._param_of.items()}
            with _state_restored(self, self._state_copies):
                for entry in ahead:
                    self._bare_step(entry.kept.get("local") or entry.gradients(), entry.scale)
            for name, p in self._param_of.items():
                p.grad = applied[name]           # zero_grad(set_to_none=False) zeroes these

    def _bare_step(self, grads, scale):
        """One step of the wrapped optimizer with `grads`, without the user's step hooks."""
        unscale = 1.0 / scale if scale is not None else 1.0
        for name, p in self._param_of.items():
            grad = grads.get(name)
            p.grad = None if grad is None else (grad.view_as(p) if not grad.is_sparse else grad)
            if p.grad is not None and unscale != 1.0:
                p.grad = p.grad * unscale
        if scale is not None and not all(torch.isfinite(_values(p.grad)).all()
                                         for p in self._params if p.grad is not None):
            return      # an overflow GradScaler will skip predicts nothing (no scaler: no check)
        self._inner_step()

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
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings["compensation_s"] += time.perf_counter() - start

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


@contextlib.contextmanager
def _state_restored(opt, copies):
    """Run steps of `opt` whose effect on its state (momentum, Adam's moments and step
    count) is undone afterwards; the parameters keep theirs. The state is saved in
    `copies`, persistent buffers reused every step (fresh large tensors page-fault).

    A wrapped optimizer whose state lives outside `opt.state` (the Keras adapter's
    stand-in: Keras variables) does this itself, in a context manager method
    `_pipe_horovod_state_restored(copies)`."""
    own = getattr(opt, "_pipe_horovod_state_restored", None)
    if own is not None:
        with own(copies):
            yield
        return
    saved = {p: {k: (v, _copy_into(copies, (p, k), v) if torch.is_tensor(v) else v)
                 for k, v in state.items()}
             for p, state in opt.state.items()}
    try:
        yield
    finally:
        for p in list(opt.state):
            if p not in saved:
                del opt.state[p]                 # state the simulated steps created
        for p, state in saved.items():
            opt.state[p] = {k: (v.copy_(copy) if torch.is_tensor(v) else v)
                            for k, (v, copy) in state.items()}


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


def _values(grad):
    return grad.coalesce().values() if grad.is_sparse else grad
