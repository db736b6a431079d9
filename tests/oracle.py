"""Single-process reference of the pipelined math (DESIGN.md, "Semantics").

It shares no code with the package on purpose: it simulates every rank's
gradient, averages them, and applies them through a FIFO written out here
in the plainest form, so a bug in the product cannot hide in the oracle.
"""
import contextlib
import copy

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
              scheduler=None, skip=(), compensation=None, edit_grads=None, edit_weights=None,
              reduce=None, predict_from=None):
    """Train `model` in place as the pipelined optimizer should, then flush.

    data(rank, step) -> list of (x, y) micro-batches. Gradients whose step is
    in `skip` are dropped at application, as GradScaler skips an overflow.
    `compensation` is the staleness compensation, written out from its
    formula (docs/convergence.md), each rank computing at its own point.
    `edit_grads(params)` runs where the user's code between backward and step
    would see the averaged gradient about to be applied (pipeline_depth=1: a
    clip); `edit_weights(params)` after each step (a WGAN clamp), on the real
    weights, before any rank's next point is computed from them.
    `predict_from(t, per_rank)`: what each rank's lookahead predicts from in place of
    its own gradients of step t (a list per rank), as `reduce` stands for the average.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    fifo = []                      # (step, averaged gradient, per-rank gradients, weights then)
    mean_square = [None] * len(params)
    previous = None                # "predict": the weights before the last update
    if pipeline_depth == 1:
        compensation = None

    def apply(step, grads, pushed):
        if step in skip:
            return
        if compensation == "dc":
            then = fifo_weights[step]
            for i, (p, g) in enumerate(zip(params, grads)):
                ms = g * g if mean_square[i] is None else 0.95 * mean_square[i] + 0.05 * g * g
                mean_square[i] = ms
                p.grad = g + 2.0 / (ms.sqrt() + 1e-7) * g * g * (p.detach() - then[i])
        else:
            for p, g in zip(params, grads):
                p.grad = g.clone()
        if edit_grads is not None:
            edit_grads(params)
        with reduced_momentum(optimizer, compensation == "momentum" and pushed > warmup_steps,
                              pipeline_depth - 1):
            optimizer.step()

    def point(rank, in_flight):
        """The weights rank `rank` computes its gradient at."""
        real = [p.detach().clone() for p in params]
        if compensation == "predict" and previous is not None:
            n = len(in_flight)
            return [w + n * (w - w_prev) for w, w_prev in zip(real, previous)]
        if compensation == "lookahead" and in_flight:
            saved = copy.deepcopy(optimizer.state_dict())
            for _, _, per_rank in in_flight:
                if not all(torch.isfinite(g.coalesce().values() if g.is_sparse else g).all()
                           for g in per_rank[rank]):
                    continue               # an overflowed gradient predicts nothing
                for p, g in zip(params, per_rank[rank]):
                    p.grad = g.clone()
                optimizer.step()
            ahead = [p.detach().clone() for p in params]
            optimizer.load_state_dict(saved)
            with torch.no_grad():
                for p, w in zip(params, real):
                    p.copy_(w)
            return ahead
        return real

    fifo_weights = {}
    points = [point(r, fifo) for r in range(size)]
    for t in range(steps):
        real = [p.detach().clone() for p in params]
        per_rank = []
        for r in range(size):
            with torch.no_grad():
                for p, w in zip(params, points[r]):
                    p.copy_(w)
            per_rank.append(rank_gradients(model, loss_fn, data(r, t)))
        with torch.no_grad():
            for p, w in zip(params, real):
                p.copy_(w)
        fifo_weights[t] = real
        averaged = (reduce(t, per_rank) if reduce is not None
                    else [average(gs, size) for gs in zip(*per_rank)])
        fifo.append((t, averaged, per_rank if predict_from is None
                     else predict_from(t, per_rank)))
        need = 1 if t < warmup_steps else pipeline_depth
        before = real
        stepped = True
        while len(fifo) >= need:
            step, grads, _ = fifo.pop(0)
            apply(step, grads, t + 1)
            stepped = step not in skip
        previous = before
        if edit_weights is not None:
            with torch.no_grad():
                edit_weights(params)
        if scheduler is not None:
            scheduler.step()
        # Predicted at the next forward pass, so with the learning rate the scheduler set
        # for the step that applies it; a step GradScaler skips (no step() call) predicts
        # nothing.
        points = [point(r, fifo if stepped else []) for r in range(size)]
    while fifo:
        step, grads, _ = fifo.pop(0)
        apply(step, grads, steps)
    return model


@contextlib.contextmanager
def reduced_momentum(optimizer, reduce, delay):
    """Mitliagkas et al.: a delay of `delay` steps adds momentum delay/(delay+1)."""
    saved = [(g, dict(g)) for g in optimizer.param_groups] if reduce else []
    if reduce:
        implicit = delay / (delay + 1)
        for g in optimizer.param_groups:
            if g.get("momentum"):
                g["momentum"] = max(0.0, g["momentum"] - implicit)
            elif g.get("betas") and g["betas"][0]:
                g["betas"] = (max(0.0, g["betas"][0] - implicit), *g["betas"][1:])
    try:
        yield
    finally:
        for g, values in saved:
            g.update(values)
