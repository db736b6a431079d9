"""What happens to the user's edits of `.grad` between backward() and step().

DDP ends backward() with the averaged gradient in `.grad`, so a clip,
scaling or mask written between backward() and step() applies to the
average, identically on every rank; it is the most common habit of a PyTorch
training loop. The DistributedOptimizer keeps it where it can and refuses it
where it cannot (one rule, here):

* when this step's gradient is applied by this step (pipeline_depth=1, or a
  warm-up step) backward() ends by waiting for the average and leaving it in
  `.grad` (the optimizer's end-of-backward callback), as DDP does: the edit
  applies to the averaged gradient;
* at pipeline_depth K >= 2 the gradient went on the wire during backward()
  and is applied K-1 steps later: an edit of it would be silently lost, so
  step() refuses it, naming Horovod's pattern (synchronize(), edit the
  gradient step() applies, step() inside skip_synchronize()).

Detection reads each gradient's version counter (in-place operations bump
it) and identity, recorded when backward finished it: no pass over the
gradients' values. Not watched: gradients backward accumulated into the
previous step's averaged `.grad` (zero_grad(set_to_none=False), which views a
bucket whose gradients share one version counter) and sparse gradients.
"""


class GradientWatch:
    """The `.grad` tensors backward() finished this step, and their versions then."""

    __slots__ = ("_seen",)

    def __init__(self):
        self._seen = {}

    def record(self, param):
        grad = param.grad
        # Sparse gradients are read at step() itself. A view (the previous step's averaged
        # gradient, accumulated into where zero_grad(set_to_none=False) kept it) shares its
        # version counter with every gradient of its bucket: not watched.
        if grad is not None and not grad.is_sparse and grad._base is None:
            self._seen[param] = (grad, grad._version)

    def clear(self):
        self._seen.clear()

    def edited(self):
        """The first parameter whose `.grad` was changed or replaced since, or None."""
        for param, (grad, version) in self._seen.items():
            if param.grad is not grad or grad._version != version:
                return param
        return None


def edited_after_backward(name, depth):
    return RuntimeError(
        f"the gradient of {name!r} was changed between backward() and step() (a clip, a "
        f"scaling, a mask or GradScaler.unscale_ of .grad), but at pipeline_depth={depth} "
        "backward() sent it already, so the change would be lost. Change the gradient that "
        "step() applies instead, as with Horovod: optimizer.synchronize(), then clip or "
        "unscale .grad (it holds the averaged gradient being applied), then "
        "`with optimizer.skip_synchronize(): optimizer.step()`; or use pipeline_depth=1, "
        "where backward() leaves the averaged gradient in .grad as DDP does")


def backward_after_average(name):
    return RuntimeError(
        f"the gradient of {name!r} was computed again after backward() had averaged this "
        "step's gradient (a step applied at once, pipeline_depth=1 or a warm-up step, ends "
        "backward() with the average in .grad, as DDP does): call step() after each "
        "backward(), optimizer.zero_grad() to discard the average, or pass "
        "backward_passes_per_step=N to accumulate N backward passes before they are averaged")
