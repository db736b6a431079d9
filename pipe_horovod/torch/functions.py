"""Synchronous collectives with Horovod's names, for code around the training step.

Metric averaging, parameter and optimizer-state broadcast at start-up: the
calls a Horovod script makes besides the optimizer, so it runs unchanged.
"""
import itertools

import torch

from .. import engine

_auto_names = itertools.count()


def _name(name, kind):
    return name if name is not None else f"{kind}.auto.{next(_auto_names)}"


def broadcast_parameters(params, root_rank):
    """Copy root's parameters (a state_dict or named_parameters) to every rank, in place."""
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"broadcast_parameters: {name!r} is a {type(tensor).__name__}, "
                            "not a tensor")
        with torch.no_grad():
            if tensor.is_contiguous():
                engine.broadcast(tensor, root_rank)
            else:
                tensor.copy_(engine.broadcast(tensor.contiguous(), root_rank))


def broadcast_optimizer_state(optimizer, root_rank, model=None):
    """Give every rank root's optimizer state: momentum, Adam moments, LR, step counts,
    and for a DistributedOptimizer the pipeline's own (gradients in flight, step,
    bucket order).

    Horovod's resume pattern loads a checkpoint on rank 0 only and then calls
    this: the pipeline state must travel too, or rank 0 would wait for
    reductions its peers never start. The whole state_dict is sent as one
    object, so optimizers Horovod cannot broadcast (LBFGS) work as well, and
    no zero-gradient step is needed to create missing state. `model` is
    accepted for Horovod's signature (it finds sparse parameters there for
    that step) and not needed here.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"broadcast_optimizer_state needs a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    root = engine.rank() == root_rank
    state = engine.broadcast_object(optimizer.state_dict() if root else None, root_rank)
    if not root:
        optimizer.load_state_dict(state)
