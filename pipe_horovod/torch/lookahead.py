"""The lookahead prediction in one pass, from the optimizer's own state.

"lookahead" (pipeline/staleness.py) moves the parameters to where the
wrapped optimizer's next update would take them if this rank's own
gradient of the step in flight were the average. The update rules of the
built-in optimizers are known, so for them the prediction is a small pure
function of the current state and that gradient, written here with the
same operations, in the same order, as torch.optim's own step: the same
numbers, bit for bit, without stepping (or copying) the optimizer's state.

Each rule gets, per parameter, `p` (holding the real weights w), `g` (this
rank's local gradient, unscaled: scratch, the rule may overwrite it) and
`real` (a buffer that must hold w afterwards). It leaves the prediction in
`p`, using `p` and `g` as its only full-size temporaries, so the prediction
costs no memory beyond `real`. Like torch.optim's own kernels:

* SGD (momentum, dampening, nesterov, weight_decay, maximize);
* Adam and AdamW (amsgrad, weight_decay, maximize), once every parameter
  has state (the first prediction, before any update, steps instead).

Everything else (other optimizers, subclasses, fused/capturable/
differentiable groups, tensor hyperparameters, sparse or complex
gradients, several steps in flight at pipeline_depth >= 3) falls back to
`stepped`: the optimizer's own step on the parameters, its state saved in
temporaries beforehand and put back afterwards. Exact as well, but the
temporaries hold a copy of the state while the step runs.
"""
import torch

# Elements per piece where a rule needs a third temporary (AdamW's decayed weights):
# small enough to be negligible beside the parameters, large enough to amortize a call.
_PIECE = 1 << 20


def _plain(group, flags):
    """True when the group's hyperparameters are Python numbers and none of `flags` is set
    (those select kernels with another operation order: fused, capturable, ...)."""
    if any(group.get(flag) for flag in flags):
        return False
    return all(not torch.is_tensor(v) for k, v in group.items() if k != "params"
               ) and all(not torch.is_tensor(b) for b in group.get("betas", ()))


def _sgd_ready(group, states):
    return _plain(group, ("fused", "differentiable"))


def _adam_ready(group, states):
    return _plain(group, ("fused", "capturable", "differentiable")) and all(
        "step" in st and "exp_avg" in st for st in states)


def _sgd(group, items):
    """torch.optim.SGD's _single_tensor_sgd / _multi_tensor_sgd, predicted."""
    lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
    dampening, nesterov = group["dampening"], group["nesterov"]
    for p, g, real, st in items:
        real.copy_(p)
        if group["maximize"]:
            g.neg_()
        if wd != 0:
            g.add_(real, alpha=wd)                       # grad.add(param, alpha=wd)
        direction = g
        if mu != 0:
            buf = st.get("momentum_buffer")
            if buf is None:                              # buf = grad.clone()
                if nesterov:
                    g.add_(g, alpha=mu)
            else:
                torch.mul(buf, mu, out=p)                # buf.mul_(mu).add_(grad, 1 - d)
                p.add_(g, alpha=1 - dampening)
                if nesterov:
                    g.add_(p, alpha=mu)                  # grad.add(buf, alpha=mu)
                else:
                    direction = p
        torch.add(real, direction, alpha=-lr, out=p)     # param.add_(grad, alpha=-lr)


def _adam(group, items):
    """torch.optim.Adam's (and AdamW's) _single_tensor_adam / _multi_tensor_adam, predicted."""
    beta1, beta2 = group["betas"]
    lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
    decoupled = group.get("decoupled_weight_decay", False)
    for p, g, real, st in items:
        real.copy_(p)
        if group["maximize"]:
            g.neg_()
        step = float(st["step"]) + 1
        step_size = lr / (1 - beta1 ** step)
        bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
        if wd != 0 and not decoupled:
            g.add_(real, alpha=wd)
        # The second moment, then the denominator, in p.
        torch.mul(st["exp_avg_sq"], beta2, out=p)
        p.addcmul_(g, g, value=1 - beta2)
        if group["amsgrad"]:
            torch.maximum(st["max_exp_avg_sq"], p, out=p)
        p.sqrt_().div_(bias_correction2_sqrt).add_(eps)
        torch.lerp(st["exp_avg"], g, 1 - beta1, out=g)   # the first moment, in g
        if wd != 0 and decoupled:                        # param.mul_(1 - lr * wd), then ...
            _decayed_addcdiv(real, 1 - lr * wd, g, p, -step_size)
        else:
            torch.addcdiv(real, g, p, value=-step_size, out=p)


def _decayed_addcdiv(real, decay, numer, denom, value):
    """denom <- (real * decay) + value * numer / denom, the decayed weights made piece by
    piece (elementwise, so each element is computed exactly as in one call)."""
    if not (real.is_contiguous() and numer.is_contiguous() and denom.is_contiguous()):
        torch.addcdiv(real * decay, numer, denom, value=value, out=denom)
        return
    flat_real, flat_numer, flat_denom = real.view(-1), numer.view(-1), denom.view(-1)
    piece = torch.empty(min(_PIECE, flat_real.numel()), dtype=real.dtype, device=real.device)
    for start in range(0, flat_real.numel(), _PIECE):
        end = min(start + _PIECE, flat_real.numel())
        decayed = torch.mul(flat_real[start:end], decay, out=piece[:end - start])
        torch.addcdiv(decayed, flat_numer[start:end], flat_denom[start:end], value=value,
                      out=flat_denom[start:end])


# class -> (ready(group, states), rule(group, items)). Exact classes only: a subclass may
# change the step, and then only its own step can say what it does.
RULES = {torch.optim.SGD: (_sgd_ready, _sgd), torch.optim.Adam: (_adam_ready, _adam),
         torch.optim.AdamW: (_adam_ready, _adam)}


def has_rule(optimizer_class, groups):
    """Whether `optimizer_class` with these param groups is predicted in one pass."""
    rule = RULES.get(optimizer_class)
    return rule is not None and all(rule[0](group, ()) for group in groups)


def predict(optimizer_class, groups, state, locals_, reals):
    """Predict in one pass, if the rule applies to every group now: the parameters get the
    prediction, `reals` the real weights. `locals_` {param: dense local gradient, owned}.
    Returns False (nothing touched) where the rule does not apply."""
    rule = RULES.get(optimizer_class)
    if rule is None:
        return False
    ready, step = rule
    work = []
    for group in groups:
        params = [p for p in group["params"] if p in locals_]
        states = [state.get(p, {}) for p in params]
        if not ready(group, states) or any(
                locals_[p].is_sparse or locals_[p].is_complex() or p.is_complex()
                for p in params):
            return False
        work.append((group, [(p, locals_[p], reals[p], st) for p, st in zip(params, states)]))
    with torch.no_grad():
        for group, items in work:
            step(group, items)
    return True


def stepped(optimizer, steps, run_step):
    """The prediction by the optimizer's own step: for each `steps` entry ({param: local
    gradient}), set `.grad` and call `run_step()`; the state is saved in temporaries and put
    back afterwards (entries the steps created removed). The parameters keep the result.

    A wrapped optimizer whose state lives outside `optimizer.state` (the Keras adapter's
    stand-in: Keras variables) does this itself, in a context manager method
    `_pipe_horovod_state_restored()`."""
    own = getattr(optimizer, "_pipe_horovod_state_restored", None)
    if own is not None:
        with own():
            _run(optimizer, steps, run_step)
        return
    saved = {p: {k: (v, v.clone()) if torch.is_tensor(v) else (v, v) for k, v in st.items()}
             for p, st in optimizer.state.items()}
    try:
        _run(optimizer, steps, run_step)
    finally:
        for p in list(optimizer.state):
            if p not in saved:
                del optimizer.state[p]           # state the steps created
        for p, st in saved.items():
            optimizer.state[p] = {k: (v.copy_(copy) if torch.is_tensor(v) else v)
                                  for k, (v, copy) in st.items()}
        del saved


def _run(optimizer, steps, run_step):
    params = [p for group in optimizer.param_groups for p in group["params"]]
    applied = {p: p.grad for p in params}
    try:
        for grads in steps:
            for p in params:
                p.grad = grads.get(p)
            run_step()
    finally:
        for p in params:
            p.grad = applied[p]                  # zero_grad(set_to_none=False) zeroes these
