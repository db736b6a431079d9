"""Single-process reference of the pipelined math (DESIGN.md, "Semantics").

It shares no code with the package on purpose: it simulates every rank's
gradient, averages them, and applies them through a FIFO written out here
in the plainest form, so a bug in the product cannot hide in the oracle.
"""
import torch


def rank_gradients(model, loss_fn, batches):
    """One gradient per parameter for one rank: the sum over its micro-batches.

    A parameter the rank never touched (unused branch) contributes zero.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    for x, y in batches:
        loss_fn(model(x), y).backward()
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]


def average(grads, size):
    """The mean over ranks; sparse if any rank's gradient is (its rows: those not all zero)."""
    sparse = [g for g in grads if g.is_sparse]
    mean = sum(g.to_dense() for g in grads) / size
    return mean.to_sparse(sparse[0].sparse_dim()) if sparse else mean


def reference(model, optimizer, loss_fn, data, size, steps, pipeline_depth, warmup_steps,
              scheduler=None, skip=()):
    """Train `model` in place as the pipelined optimizer should, then flush.

    data(rank, step) -> list of (x, y) micro-batches. Gradients whose step is
    in `skip` are dropped at application, as GradScaler skips an overflow.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    fifo = []

    def apply(step, grads):
        if step in skip:
            return
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optimizer.step()

    for t in range(steps):
        per_rank = [rank_gradients(model, loss_fn, data(r, t)) for r in range(size)]
        fifo.append((t, [average(gs, size) for gs in zip(*per_rank)]))
        need = 1 if t < warmup_steps else pipeline_depth
        while len(fifo) >= need:
            apply(*fifo.pop(0))
        if scheduler is not None:
            scheduler.step()
    while fifo:
        apply(*fifo.pop(0))
    return model
