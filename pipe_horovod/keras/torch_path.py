"""Keras 3 on torch: the PyTorch adapter itself does the work.

Keras's torch train step calls `loss.backward()` and then `apply`, and
every Keras variable's `.value` is a leaf torch Parameter. So the PyTorch
DistributedOptimizer, wrapped around a stand-in torch optimizer whose
`step()` is the Keras update, gives per-bucket overlap during backward,
the pipeline, flush and the checkpoint state with no second copy of any of it.
"""
import contextlib

import numpy as np
import torch

from .. import engine
from ..pipeline.buckets import AutoBucketCap
from ..pipeline.local_scale import LocalScale
from ..torch import optimizer as torch_optimizer
from .._keras.naming import momentum_attribute, variable_names


class _KerasUpdate(torch.optim.Optimizer):
    """A torch optimizer whose step() is the Keras optimizer's own update of `.grad`.

    Its state is the Keras optimizer's variables (slots, `iterations`), so it saves
    and restores them itself around the steps "lookahead" simulates. For the
    "momentum" option its param group holds the Keras optimizer's momentum under
    torch's name ("momentum", or beta_1 as "betas"), where that option reduces it;
    step() hands the group's value to Keras.
    """

    def __init__(self, params, keras_optimizer, update, compensation):
        super().__init__(params, {})
        self._keras, self._update = keras_optimizer, update
        self.simulating = False                  # inside a prediction's steps
        self._attribute = momentum_attribute(keras_optimizer) if compensation == "momentum" \
            else None
        self.follow_keras()

    def follow_keras(self):
        """Copy the Keras optimizer's momentum into the param group (before each step)."""
        if self._attribute == "momentum":
            self.param_groups[0]["momentum"] = self._keras.momentum
        elif self._attribute == "beta_1":
            self.param_groups[0]["betas"] = (self._keras.beta_1, self._keras.beta_2)

    def step(self, closure=None):
        if self._attribute is None:
            self._update()
            return
        group = self.param_groups[0]
        value = group["momentum"] if self._attribute == "momentum" else group["betas"][0]
        saved = getattr(self._keras, self._attribute)
        setattr(self._keras, self._attribute, value)
        try:
            self._update()
        finally:
            setattr(self._keras, self._attribute, saved)

    @contextlib.contextmanager
    def pipe_horovod_state_restored(self):
        """A context manager: torch/lookahead.py's `stepped` calls it in place of saving
        `optimizer.state`, which is empty here (the state is in Keras variables).

        Returns:
            A context manager that saves the Keras optimizer's variables, runs the
            prediction's steps inside the Keras optimizer's `prediction_scope()`, and
            puts the variables back on exit.
        """
        variables = self._keras.variables
        saved = [v.value.clone() for v in variables]
        self.simulating = True
        try:
            with self._keras.prediction_scope():
                yield
        finally:
            self.simulating = False
            for v, value in zip(variables, saved):
                v.assign(value)


class TorchPath:
    """Local variables (register_local_var) stay outside the PyTorch adapter, which
    reduces every parameter it is given: their gradients, divided by size() with
    scale_local_gradients, wait in `local_in_flight` (one entry per step the adapter
    holds, oldest first) and go into the update that applies their step. A prediction
    ("lookahead", "predict") moves the reduced variables only. `base_apply(grads,
    variables)` is the user's optimizer's own update (one iteration); `join()` the
    optimizer's collective half of building, which the PyTorch adapter calls at the
    first gradient."""

    def __init__(self, optimizer, variables, options, local=(), *, base_apply, join):
        self.optimizer = optimizer
        self.variables = variables
        self.names = variable_names(variables)
        params = [v.value for v in variables]
        local = list(local) or [False] * len(variables)
        self.local = [n for n, own in zip(self.names, local) if own]
        self.local_in_flight = []
        self._local_params = {n: p for n, p, own in zip(self.names, params, local) if own}
        reduced = [(n, p, v) for n, p, v, own in zip(self.names, params, variables, local)
                   if not own]

        def update():
            with torch.no_grad():
                if not self.local:
                    base_apply([p.grad for p in params], variables)
                elif self.torch_optimizer.simulating:          # not predicted: put back
                    held = [(p, p.detach().clone()) for p in self._local_params.values()]
                    base_apply([p.grad for p in params], variables)
                    for p, value in held:
                        p.copy_(value)
                else:
                    grads = self.local_in_flight.pop(0)
                    base_apply([grads.get(n, p.grad)
                                for n, p in zip(self.names, params)], variables)

        self.params = params
        stand_in = _KerasUpdate([p for _, p, _ in reduced], optimizer, update,
                                options["staleness_compensation"])
        ps = options["process_set"]
        # 1/size with scale_local_gradients, of the engine running now (an elastic reset
        # changes it)
        self.scale_local = LocalScale(options["scale_local_gradients"],
                                      lambda: ps.size() if ps is not None else engine.size())
        # Not DistributedOptimizer: the Keras wrapper has told the user the depth already,
        # and its _join compares the ranks at the first gradient (this may be built on one
        # rank alone, inside load_model). tune="auto" is the PyTorch adapter's to run: the
        # depth goes down pinned or not (None: auto chooses), the cap automatic or not.
        tuner = options.get("tuner")
        depth, cap = options["pipeline_depth"], options["bucket_cap_mb"]
        if tuner is not None:
            depth = options["pinned_depth"]
            cap = None if isinstance(cap, AutoBucketCap) else cap
        self.torch_optimizer = torch_optimizer.wrap_for_adapter(
            stand_in, named_parameters=[(n, p) for n, p, _ in reduced],
            backward_passes_per_step=options["backward_passes_per_step"],
            compression=options["compression"], op=options["op"],
            gradient_predivide_factor=options["gradient_predivide_factor"],
            process_set=options["process_set"], pipeline_depth=depth,
            warmup_steps=options["warmup_steps"], bucket_cap_mb=cap,
            groups=options["groups"],
            staleness_compensation=options["staleness_compensation"],
            prediction_exchange=options["prediction_exchange"],
            collective=options["collective"], join_ranks=join,
            tune="off" if tuner is None else "auto")

    def apply(self, grads, variables):
        opt = self.torch_optimizer
        opt.follow_keras()
        opt.collect_gradients()      # built after this backward (no hooks then): hand them over
        if self.local:
            self.local_in_flight.append({n: p.grad.detach() * self.scale_local.value
                                         for n, p in self._local_params.items()})
        opt.step()

    def count_pass(self):
        """A pass of backward_passes_per_step that ends no step (aggregation.py): the
        adapter counts it (its hooks missed the first pass of an optimizer built after it)."""
        self.torch_optimizer.collect_gradients()

    @property
    def timings(self):
        return self.torch_optimizer.timings

    def put_real_back(self):
        self.torch_optimizer.restore_real_weights()

    def flush(self):
        self.torch_optimizer.follow_keras()
        self.torch_optimizer.flush()

    def write_run_summary(self, path):
        return self.torch_optimizer.write_run_summary(path)

    def drop_in_flight(self):
        self.torch_optimizer.drop_in_flight()

    def rebind_engine(self):
        self.torch_optimizer.rebind_engine()

    def in_flight(self):
        return self.torch_optimizer.gradients_in_flight()

    def state(self):
        pipe = self.torch_optimizer.state_dict()["pipe_horovod"]
        in_flight = [{**grads, **{n: g.reshape(-1) for n, g in local.items()}}
                     for grads, local in zip(pipe["in_flight"], self.local_in_flight)] \
            if self.local else pipe["in_flight"]
        return {"steps": pipe["steps"], "in_flight": in_flight, "kept": pipe["kept"],
                "real": pipe["real_weights"], "mean_square": pipe["mean_square"],
                "order": pipe["bucket_order"], "order_agreed": pipe["order_agreed"],
                "error_feedback": pipe["error_feedback"], "due": pipe["prediction_due"],
                "tune": pipe.get("tune")}

    def restore(self, in_flight, state):
        def tensors(arrays):
            return {n: torch.from_numpy(np.array(a, copy=True)) for n, a in arrays.items()}
        opt = self.torch_optimizer
        torch_state = opt.state_dict()
        real = state.get("real")
        self.local_in_flight = [{n: g.reshape(self._local_params[n].shape)
                                 for n, g in tensors(grads).items() if n in self.local}
                                for grads in in_flight]
        torch_state["pipe_horovod"].update(
            steps=state["steps"], in_flight=[{n: g.reshape(-1) for n, g in tensors(grads).items()
                                              if n not in self.local}
                                             for grads in in_flight],
            scales=[None] * len(in_flight), bucket_order=state.get("order", []),
            order_agreed=state.get("order_agreed", False),
            kept=[{kind: tensors(t) for kind, t in k.items()} for k in state.get("kept", [])],
            real_weights=tensors(real) if real else None,
            prediction_due=bool(state.get("due")), tune=state.get("tune"),
            mean_square=tensors(state.get("mean_square", {})),
            error_feedback={slot: tensors(r) for slot, r in
                            (state.get("error_feedback") or {}).items()} or None)
        opt.load_state_dict(torch_state)
