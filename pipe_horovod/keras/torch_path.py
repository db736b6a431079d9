"""Keras 3 on torch: the PyTorch adapter itself does the work.

Keras's torch train step calls `loss.backward()` and then `apply`, and
every Keras variable's `.value` is a leaf torch Parameter. So the PyTorch
DistributedOptimizer, wrapped around a stand-in torch optimizer whose
`step()` is the Keras update, gives per-bucket overlap during backward,
the pipeline, flush and the checkpoint state with no second copy of any of it.
"""
import numpy as np
import torch

from ..torch import optimizer as torch_optimizer
from .paths import variable_names


class _KerasUpdate(torch.optim.Optimizer):
    """A torch optimizer whose step() is the Keras optimizer's own update of `.grad`."""

    def __init__(self, params, update):
        super().__init__(params, {})
        self._update = update

    def step(self, closure=None):
        self._update()


class TorchPath:
    def __init__(self, optimizer, variables, options):
        self.optimizer = optimizer
        self.variables = variables
        self.names = variable_names(variables)
        params = [v.value for v in variables]

        def update():
            with torch.no_grad():
                optimizer._base_apply([p.grad for p in params], variables)

        self.params = params
        # The Keras wrapper has told the user the depth already.
        torch_optimizer._announced.add((options["pipeline_depth"], options["warmup_steps"],
                                        "pipeline_depth argument"))
        self.torch_optimizer = torch_optimizer.DistributedOptimizer(
            _KerasUpdate(params, update), named_parameters=list(zip(self.names, params)),
            compression=options["compression"], op=options["op"],
            gradient_predivide_factor=options["gradient_predivide_factor"],
            process_set=options["process_set"], pipeline_depth=options["pipeline_depth"],
            warmup_steps=options["warmup_steps"], bucket_cap_mb=options["bucket_cap_mb"],
            groups=options["groups"],
            staleness_compensation=options.get("staleness_compensation"))

    def apply(self, grads, variables):
        opt = self.torch_optimizer
        if not opt._hooks_fired:
            # Built after this backward (no hooks then): hand the gradients over now.
            for p in reversed(self.params):
                if p.grad is not None:
                    opt._on_grad_ready(p)
        opt.step()

    @property
    def timings(self):
        return self.torch_optimizer.timings

    def flush(self):
        self.torch_optimizer.flush()

    def in_flight(self):
        return len(self.torch_optimizer._fifo)

    def state(self):
        pipe = self.torch_optimizer.state_dict()["pipe_horovod"]
        return {"steps": pipe["steps"], "in_flight": pipe["in_flight"],
                "order": pipe["bucket_order"], "order_agreed": pipe["order_agreed"]}

    def restore(self, in_flight, state):
        opt = self.torch_optimizer
        torch_state = opt.state_dict()
        torch_state["pipe_horovod"].update(
            steps=state["steps"], in_flight=[{n: torch.from_numpy(np.array(g, copy=True))
                                              .reshape(-1) for n, g in grads.items()}
                                             for grads in in_flight],
            scales=[None] * len(in_flight), bucket_order=state.get("order", []),
            order_agreed=state.get("order_agreed", False))
        opt.load_state_dict(torch_state)
