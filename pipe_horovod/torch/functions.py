"""Start-up broadcasts with Horovod's names: parameters and optimizer state.

A Horovod script calls these after building its model and optimizer (and
after rank 0 alone restored a checkpoint), so every rank starts alike.
"""
import torch

from .. import engine


def broadcast_parameters(params, root_rank):
    """Copy root's parameters to every rank, in place.

    `params`: a state_dict, model.named_parameters(), or a list of tensors,
    as Horovod accepts.
    """
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    for item in items:
        name, tensor = item if isinstance(item, tuple) else (None, item)
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
    no zero-gradient step is needed to create missing state. As Horovod
    does, a fresh optimizer's trainable parameters are left with a zero
    `.grad` (sparse for SparseAdam and for sparse embeddings of `model`).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"broadcast_optimizer_state needs a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if not optimizer.state:
        _zero_gradients(optimizer, model)
    root = engine.rank() == root_rank
    state = engine.broadcast_object(optimizer.state_dict() if root else None, root_rank)
    if not root:
        optimizer.load_state_dict(state)


def _zero_gradients(optimizer, model):
    sparse = {id(p) for m in (model.modules() if model is not None else ())
              if isinstance(m, torch.nn.Embedding) and m.sparse for p in m.parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
                if isinstance(optimizer, torch.optim.SparseAdam) or id(p) in sparse:
                    p.grad = p.grad.to_sparse()
