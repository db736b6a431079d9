"""The pipelined optimizer's checkpoint: the wrapped optimizer's state plus the pipeline's.

`state_dict()` adds a "pipe_horovod" entry: the step machine's state (the
averaged gradients in flight, their GradScaler scales, the step count,
what compensation keeps with each step, error-feedback residuals, what tune="auto"
decided), the
bucket order and whether the ranks agreed on it, the sparse gradients'
names, and compensation's own state (the real weights while the parameters
hold a prediction, "predict"'s previous weights, "dc"'s running mean
square). So save -> load -> continue is bit-exact with a run that never
stopped (DESIGN.md, "Semantics").

A mixin of _PipelinedOptimizer (torch/optimizer.py). It calls on the
optimizer `_between_backward_and_step()` and `_plan(order)`, and reads
`_machine` (state, settle, restore, fifo), `_fifo`, `_order`,
`_order_agreed`, `_sparse`, `_param_of` and `_pipeline_depth`.
Compensation's part is the _Compensation mixin's (torch/compensation.py):
`_compensation_state()` gives it, `_restore_compensation(pipe)` takes it
back; this module touches none of compensation's fields.
"""
import torch

IN_FLIGHT = "pipe_horovod_in_flight"   # marks the param group a plain optimizer cannot load


class _PipelineCheckpoint:
    """state_dict and load_state_dict of _PipelinedOptimizer (module docstring)."""

    def state_dict(self):
        """The wrapped optimizer's state plus the gradients still in flight.

        Waiting for in-flight reductions is local (every rank started them),
        so rank 0 alone may call this, as users write it.
        """
        if self._between_backward_and_step():
            raise RuntimeError("state_dict() called between backward and step(): this step's "
                               "gradient is not in the checkpoint yet; call step() first")
        state = super().state_dict()
        state["pipe_horovod"] = {
            **self._machine.state(),
            "bucket_order": self._order,
            "order_agreed": self._order_agreed,
            "sparse": dict(self._sparse),
            **self._compensation_state(),
        }
        if len(self._fifo):
            # A plain torch optimizer ignores unknown keys: loaded there, the gradients in
            # flight would vanish without a word. This extra group makes its
            # load_state_dict() fail instead ("different number of parameter groups").
            state["param_groups"] = [*state["param_groups"], {"params": [], IN_FLIGHT: (
                f"{len(self._fifo)} averaged gradient(s) in flight: load this state_dict into "
                "pipe_horovod's DistributedOptimizer, or into a plain torch optimizer with "
                "pipe_horovod.torch.flush_into(optimizer, state_dict, named_parameters), "
                "which applies them as flush() would; or call flush() before state_dict() "
                "for a checkpoint any torch optimizer loads")}]
        return state

    def load_state_dict(self, state_dict):
        """Restore the wrapped optimizer and, if present, the pipeline's state.

        Reductions this process still has on the wire are completed first
        (the other ranks started them too) and then replaced by the
        checkpoint's, so loading on some ranks only, as Horovod's resume
        pattern does before broadcast_optimizer_state, never strands one.
        """
        if self._between_backward_and_step():
            raise RuntimeError("load_state_dict() called between backward and step(); "
                               "call step() first")
        state_dict = dict(state_dict)
        state_dict["param_groups"] = [group for group in state_dict.get("param_groups", ())
                                      if IN_FLIGHT not in group]
        pipe = state_dict.pop("pipe_horovod", None)
        super().load_state_dict(state_dict)
        if pipe is None:
            return
        self._machine.settle()
        unknown = set(pipe["bucket_order"]) ^ set(self._param_of)
        if unknown:
            raise ValueError(f"checkpoint parameters do not match this model: {sorted(unknown)}")
        device_of = {name: p.device for name, p in self._param_of.items()}

        def here(tensors):
            return {n: t.to(device_of[n]) for n, t in tensors.items()}
        # tune="auto": the decision first (its depth is the one the gradients in flight
        # were saved at); none saved, or for another number of ranks: measure again.
        self._machine.restore_tuning(pipe.get("tune"), pipe["steps"])
        fifo = self._machine.fifo
        alone, fifo.pipeline_depth = fifo.pipeline_depth, self._pipeline_depth
        try:        # (alone, a checkpoint's K-1 gradients in flight all pop at the next step)
            self._machine.restore(
                [here(grads) for grads in pipe["in_flight"]], pipe["scales"], pipe["steps"],
                [{kind: here(tensors) for kind, tensors in k.items()}
                 for k in pipe.get("kept", [])] or None, pipe.get("error_feedback"))
        except ValueError as exc:   # a depth that cannot hold them: the others, which may
            # not load anything (rank 0 alone resumes), are told at their next wait
            raise self._machine.engine.refuse(exc) from None
        finally:
            fifo.pipeline_depth = alone
        self._restore_compensation(pipe)
        self._order_agreed = pipe["order_agreed"]
        self._sparse = dict(pipe.get("sparse", {}))
        self._plan(pipe["bucket_order"])



def flush_into(optimizer: torch.optim.Optimizer, state_dict: dict,
               named_parameters=None) -> int:
    """Load a DistributedOptimizer's `state_dict()` into a plain torch optimizer, then apply
    the averaged gradients it had in flight, oldest first, one `optimizer.step()` each: what
    `flush()` would have done before saving.

    Why: at pipeline_depth K >= 2 a checkpoint holds up to K-1 averaged gradients not yet
    applied. A plain optimizer's own load_state_dict refuses such a checkpoint (torch's
    "different number of parameter groups": an extra group marks them), since loading it
    there would drop them without a word. Load the model's weights first (a model's
    state_dict() between steps holds the weights training updates, lookahead included).

    Args:
        optimizer: the plain torch optimizer, over the same parameters in the same order as
            the wrapped one.
        state_dict: what the DistributedOptimizer's state_dict() returned.
        named_parameters: the names given to the DistributedOptimizer
            (model.named_parameters()); None if it was given none.

    Returns:
        The number of gradients applied.

    Raises:
        ValueError: the checkpoint names parameters this optimizer does not have.
    """
    from .parameters import _named

    state = dict(state_dict)
    pipe = state.pop("pipe_horovod", None)
    state["param_groups"] = [g for g in state["param_groups"] if IN_FLIGHT not in g]
    optimizer.load_state_dict(state)
    if not pipe or not pipe.get("in_flight"):
        return 0
    name_of, _ = _named(optimizer, named_parameters)
    param_of = {name: p for p, name in name_of.items()}
    unknown = sorted({name for grads in pipe["in_flight"] for name in grads} - set(param_of))
    if unknown:
        raise ValueError(f"the checkpoint's gradients in flight name parameters this optimizer "
                         f"does not have: {unknown[:5]}; pass the named_parameters the "
                         "DistributedOptimizer was given")
    saved = {p: p.grad for p in param_of.values()}
    applied = 0
    try:
        for grads, scale in zip(pipe["in_flight"], pipe["scales"]):
            for name, p in param_of.items():
                grad = grads.get(name)
                if grad is None:
                    p.grad = torch.zeros_like(p)
                else:
                    grad = grad.to(p.device)
                    p.grad = grad if grad.is_sparse else grad.view_as(p).clone()
                if scale is not None:           # a GradScaler's scale, as flush() unscales
                    p.grad.div_(scale)
            if scale is not None and not all(torch.isfinite(
                    p.grad.coalesce().values() if p.grad.is_sparse else p.grad).all()
                    for p in param_of.values()):
                continue                        # skipped, as GradScaler skips an overflow
            optimizer.step()
            applied += 1
    finally:
        for p, grad in saved.items():
            p.grad = grad
    return applied
