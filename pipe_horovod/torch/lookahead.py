"""The lookahead prediction in one pass, from the optimizer's own state.

"lookahead" (pipeline/staleness.py) moves the parameters to where the
wrapped optimizer's next update would take them if this rank's own
gradient of the step in flight were the average. The update rules of the
built-in optimizers are known, so for them the prediction is a small pure
function of the current state and that gradient, written here with the
same operations, in the same order, as torch.optim's own step: the same
numbers, bit for bit, without stepping (or copying) the optimizer's state.

Each rule gets, per parameter, `p` (holding the real weights w, only read)
and `g` (this rank's local gradient, unscaled: scratch), and leaves the
prediction in `g`'s storage, or returns a fresh tensor holding it. The
caller then swaps storages (torch/compensation.py): the parameter takes the
prediction's, the real weights stay where they were, so neither is copied;
putting the real weights back is a swap too. So the prediction costs about
one step of the optimizer (the same operations on the same tensors) and no
memory beyond the real weights the parameters are not holding. Temporaries
are pieces of at most `_PIECE` elements (per-tensor rules, elementwise, so
each element is computed as in one call) or, where the group uses torch's
multi-tensor kernels (`foreach`), full-size for a batch of at most `_BATCH`
elements, as the optimizer's own multi-tensor step allocates them. Rules:

* SGD (momentum, dampening, nesterov, weight_decay, maximize);
* Adam and AdamW (amsgrad, weight_decay, maximize), once every parameter
  has state (the first prediction, before any update, steps instead);

each as torch.optim's _single_tensor_* or, for a foreach group, its
_multi_tensor_* step: bit for bit. A capturable group (Adam/AdamW) keeps
`step` as a tensor, on the device: its rules follow torch's capturable
branch, the bias corrections computed as 0-dim tensors and folded into the
denominator, never read back to the host (a read would wait for the
device): bit for bit as well. A fused group is predicted by the
multi-tensor form (the device rules for Adam/AdamW, their step a device
tensor too): torch's fused kernel evaluates the same formula per element in
one kernel but in its own order (vectorized, its own grouping of the bias
corrections), so the prediction is within the rounding of two evaluations
of the rule (2 gamma_n of its dozen operations per element), not bit for
bit; on CPU fused SGD came out bit-exact on some sizes, an ulp apart on
others (a vector loop's tail), fused Adam an ulp or so apart.

Everything else (other optimizers, subclasses, differentiable groups,
tensor hyperparameters, sparse or complex gradients, several steps in
flight at pipeline_depth >= 3) falls back to `stepped`: the optimizer's own
step on the parameters, its state saved in temporaries beforehand and put
back afterwards. Exact as well, but the temporaries hold a copy of the
state while the step runs; the wrap warns once, naming the groups
(`fallback`), where that is every prediction.
"""
import torch

# Elements per piece of a per-tensor rule's temporaries: small enough to be negligible
# beside the parameters (2 MiB of float32; never more than the largest parameter), large
# enough that each call runs at the speed of a whole-tensor one (smaller pieces measured
# slower on CPU: the per-call cost outweighs what a piece resident in cache saves).
_PIECE = 1 << 19
# Elements per batch of a multi-tensor rule (whose temporaries are full-size for the batch).
_BATCH = 1 << 22


def _plain(group, flags):
    """True when the group's hyperparameters are Python numbers and none of `flags` is set
    (those select kernels with another operation order: fused, capturable, ...)."""
    if any(group.get(flag) for flag in flags):
        return False
    return all(not torch.is_tensor(v) for k, v in group.items() if k != "params"
               ) and all(not torch.is_tensor(b) for b in group.get("betas", ()))


def _sgd_ready(group, states):
    return _plain(group, ("differentiable",))


def _adam_ready(group, states):
    return _plain(group, ("differentiable",)) and all(
        "step" in st and "exp_avg" in st for st in states)


def _on_device(group):
    """Whether the group keeps Adam's `step` as a tensor its kernels read on the device
    (capturable, fused): the bias corrections are then computed as tensors, never read
    back to the host (which would wait for the device)."""
    return bool(group.get("capturable") or group.get("fused"))


def _foreach(group, params):
    """Whether torch.optim steps this group with its multi-tensor kernels (foreach=None:
    torch's own default, which picks them where every parameter is on CUDA)."""
    foreach = group.get("foreach")
    if foreach is None and params:
        try:
            from torch.optim.optimizer import _default_to_fused_or_foreach
            foreach = _default_to_fused_or_foreach(params, False, use_fused=False)[1]
        except (ImportError, TypeError):
            foreach = False
    return bool(foreach)


def _pieces(*tensors):
    """Aligned flat pieces of at most _PIECE elements of same-shaped contiguous tensors."""
    flat = [t.view(-1) for t in tensors]
    n = flat[0].numel()
    for start in range(0, n, _PIECE):
        end = min(start + _PIECE, n)
        yield [f[start:end] for f in flat]


def _scratch_size(items):
    """Elements of a piece's temporary: _PIECE, or the largest parameter if smaller."""
    return min(_PIECE, max(p.numel() for p, _, _ in items))


def _contiguous(*tensors):
    return all(t.is_contiguous() for t in tensors)


def _sgd(group, items):
    """torch.optim.SGD's _single_tensor_sgd, predicted into g."""
    lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
    dampening, nesterov = group["dampening"], group["nesterov"]
    scratch = None
    for p, g, st in items:
        if group["maximize"]:
            g.neg_()
        if wd != 0:
            g.add_(p, alpha=wd)                          # grad.add(param, alpha=wd)
        buf = st.get("momentum_buffer") if mu != 0 else None
        if buf is None:
            if mu != 0 and nesterov:                     # buf = grad.clone()
                g.add_(g, alpha=mu)                      # grad.add(buf, alpha=mu)
            torch.add(p, g, alpha=-lr, out=g)            # param.add_(grad, alpha=-lr)
            continue
        if not _contiguous(p, g, buf):
            new_buf = buf.mul(mu).add_(g, alpha=1 - dampening)
            if nesterov:
                torch.add(p, g.add_(new_buf, alpha=mu), alpha=-lr, out=g)
            else:
                torch.add(p, new_buf, alpha=-lr, out=g)
            continue
        if scratch is None:
            scratch = torch.empty(_scratch_size(items), dtype=g.dtype, device=g.device)
        for pp, gp, bp in _pieces(p, g, buf):
            new_buf = torch.mul(bp, mu, out=_cut(scratch, gp))   # buf.mul_(mu) ...
            if nesterov:
                new_buf.add_(gp, alpha=1 - dampening)            #   .add_(grad, 1 - d)
                torch.add(pp, gp.add_(new_buf, alpha=mu), alpha=-lr, out=gp)
            else:
                # The same kernel as new_buf.add_(gp, alpha=1 - d), written over the
                # gradient (no longer needed): in place, so the last operation reads it
                # hot and writes where it read.
                torch.add(new_buf, gp, alpha=1 - dampening, out=gp)
                torch.add(pp, gp, alpha=-lr, out=gp)


def _sgd_foreach(group, items):
    """torch.optim.SGD's _multi_tensor_sgd, predicted: returns the predictions."""
    lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
    dampening, nesterov = group["dampening"], group["nesterov"]
    ps, gs, states = (list(x) for x in zip(*items))
    if group["maximize"]:
        torch._foreach_neg_(gs)
    if wd != 0:
        torch._foreach_add_(gs, ps, alpha=wd)
    direction = gs
    if mu != 0:
        bufs = [st.get("momentum_buffer") for st in states]
        if all(b is not None for b in bufs):
            new_bufs = torch._foreach_mul(bufs, mu)
            torch._foreach_add_(new_bufs, gs, alpha=1 - dampening)
        elif not any(b is not None for b in bufs):
            new_bufs = gs                                # buf = grad.clone() for each
        else:
            new_bufs = [g if b is None else b.mul(mu).add_(g, alpha=1 - dampening)
                        for b, g in zip(bufs, gs)]
        if nesterov:
            torch._foreach_add_(gs, list(new_bufs), alpha=mu)
        else:
            direction = new_bufs
    return torch._foreach_add(ps, direction, alpha=-lr)


def _adam_scalars(group, st):
    beta1, beta2 = group["betas"]
    step = float(st["step"]) + 1
    return _step_size(group["lr"], beta1, step), (1 - beta2 ** step) ** 0.5


def _step_size(lr, beta1, step):
    """Adam's step size lr / (1 - beta1^step)."""
    return lr / (1 - beta1 ** step)


def _adam(group, items, capturable=False):
    """torch.optim.Adam's (and AdamW's) _single_tensor_adam, predicted into g.

    capturable: its capturable=True form, in torch's operation order there: the bias
    corrections as 0-dim tensors from the tensor `step` (on the device, no host sync),
    folded into the denominator."""
    beta1, beta2 = group["betas"]
    lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
    decoupled = group.get("decoupled_weight_decay", False)
    amsgrad = group["amsgrad"]
    scratch = None
    for p, g, st in items:
        if group["maximize"]:
            g.neg_()
        if capturable:
            step = st["step"] + 1                        # step_t += 1, not in place
            step_size_neg = (lr / (1 - beta1 ** step)).neg()
            # sqrt / (bc2_sqrt * -ss) + eps / -ss, then the update's value 1
            divisor, shift, value = (1 - beta2 ** step).sqrt() * step_size_neg, \
                eps / step_size_neg, 1
        else:
            step_size, divisor = _adam_scalars(group, st)
            shift, value = eps, -step_size
        if wd != 0 and not decoupled:
            g.add_(p, alpha=wd)
        decay = 1 - lr * wd if wd != 0 and decoupled else None
        exp_avg, exp_avg_sq = st["exp_avg"], st["exp_avg_sq"]
        max_sq = st["max_exp_avg_sq"] if amsgrad else exp_avg_sq
        if not _contiguous(p, g, exp_avg, exp_avg_sq, max_sq):
            pieces = [(p, g, exp_avg, exp_avg_sq, max_sq, None, None)]
        else:
            if scratch is None:
                scratch = torch.empty(2, _scratch_size(items), dtype=g.dtype, device=g.device)
            pieces = [(*pc, _cut(scratch[0], pc[1]), _cut(scratch[1], pc[1]))
                      for pc in _pieces(p, g, exp_avg, exp_avg_sq, max_sq)]
        for pp, gp, ea, sq, msq, denom_out, decayed_out in pieces:
            # The second moment, then the denominator.
            denom = torch.mul(sq, beta2, out=denom_out)  # exp_avg_sq.mul_(beta2)
            denom.addcmul_(gp, gp, value=1 - beta2)      #   .addcmul_(grad, grad, 1 - beta2)
            if amsgrad:
                torch.maximum(msq, denom, out=denom)
            denom.sqrt_().div_(divisor).add_(shift)
            torch.lerp(ea, gp, 1 - beta1, out=gp)        # the first moment, in g
            base = pp if decay is None else torch.mul(pp, decay, out=decayed_out)
            torch.addcdiv(base, gp, denom, value=value, out=gp)


def _adam_foreach_inputs(group, items):
    """(params, gradients as a multi-tensor Adam step sees them, states): the gradients
    negated where the group maximizes, plus weight_decay * param for Adam's L2 decay (not
    AdamW's decoupled one)."""
    ps, gs, states = (list(x) for x in zip(*items))
    if group["maximize"]:
        torch._foreach_neg_(gs)
    if group["weight_decay"] != 0 and not group.get("decoupled_weight_decay", False):
        torch._foreach_add_(gs, ps, alpha=group["weight_decay"])
    return ps, gs, states


def _adam_foreach_root(group, gs, states):
    """The square root of each second moment after this step's gradient (its running
    maximum with amsgrad), new tensors: the optimizer's own are read, never written."""
    beta2 = group["betas"][1]
    denom = torch._foreach_mul([st["exp_avg_sq"] for st in states], beta2)
    torch._foreach_addcmul_(denom, gs, gs, value=1 - beta2)
    if group["amsgrad"]:
        torch._foreach_maximum_(denom, [st["max_exp_avg_sq"] for st in states])
    torch._foreach_sqrt_(denom)
    return denom


def _adam_foreach_update(group, ps, first, denom, *step_sizes):
    """The predicted parameters: ps + step_sizes * first / denom (step_sizes folded into
    denom where none are given), after AdamW's decoupled decay where it applies."""
    lr, wd = group["lr"], group["weight_decay"]
    if wd != 0 and group.get("decoupled_weight_decay", False):
        out = torch._foreach_mul(ps, 1 - lr * wd)
        torch._foreach_addcdiv_(out, first, denom, *step_sizes)
        return out
    return torch._foreach_addcdiv(ps, first, denom, *step_sizes)


def _adam_foreach(group, items):
    """torch.optim.Adam's (and AdamW's) _multi_tensor_adam, predicted: returns them."""
    beta1 = group["betas"][0]
    ps, gs, states = _adam_foreach_inputs(group, items)
    scalars = [_adam_scalars(group, st) for st in states]
    denom = _adam_foreach_root(group, gs, states)
    torch._foreach_div_(denom, [bc2 for _, bc2 in scalars])
    torch._foreach_add_(denom, group["eps"])
    first = torch._foreach_lerp([st["exp_avg"] for st in states], gs, 1 - beta1)
    step_sizes = [(_step_size(group["lr"], beta1, float(st["step"]) + 1)) * -1
                  for st in states]
    return _adam_foreach_update(group, ps, first, denom, step_sizes)


def _adam_capturable(group, items):
    """_adam's capturable=True form (a rule takes the group and items only)."""
    _adam(group, items, capturable=True)


def _adam_capturable_foreach(group, items):
    """torch.optim.Adam's (and AdamW's) _multi_tensor_adam with capturable=True, predicted:
    returns them. Also the rule for fused groups (torch's fused kernel computes the same
    formula per element in one kernel, in its own order): multi-tensor kernels, the step
    and bias corrections as device tensors, no host sync."""
    beta1, beta2 = group["betas"]
    ps, gs, states = _adam_foreach_inputs(group, items)
    steps = torch._foreach_add([st["step"] for st in states], 1)
    step_size = torch._foreach_pow(beta1, steps)     # becomes -(1 - beta1^t) / lr
    bc2_sqrt = torch._foreach_pow(beta2, steps)      # becomes sqrt(1 - beta2^t)
    del steps
    torch._foreach_sub_(step_size, 1)
    torch._foreach_sub_(bc2_sqrt, 1)
    torch._foreach_neg_(bc2_sqrt)
    torch._foreach_div_(step_size, group["lr"])
    torch._foreach_reciprocal_(step_size)
    torch._foreach_sqrt_(bc2_sqrt)
    denom = _adam_foreach_root(group, gs, states)
    torch._foreach_div_(denom, bc2_sqrt)
    torch._foreach_add_(denom, group["eps"])
    torch._foreach_div_(denom, step_size)
    first = torch._foreach_lerp([st["exp_avg"] for st in states], gs, 1 - beta1)
    return _adam_foreach_update(group, ps, first, denom)


def _cut(scratch, like):
    """The first `like.numel()` elements of a flat scratch buffer."""
    return scratch[:like.numel()]


# class -> (ready(group, states), rules, device rules). Exact classes only: a subclass may
# change the step, and then only its own step can say what it does. Each rules entry is
# (per-tensor, multi-tensor); the device rules serve capturable and fused groups (None:
# the same rules, the optimizer has no device-side step).
RULES = {torch.optim.SGD: (_sgd_ready, (_sgd, _sgd_foreach), None),
         torch.optim.Adam: (_adam_ready, (_adam, _adam_foreach),
                            (_adam_capturable, _adam_capturable_foreach)),
         torch.optim.AdamW: (_adam_ready, (_adam, _adam_foreach),
                             (_adam_capturable, _adam_capturable_foreach))}


def _rule(rules, device_rules, group, params):
    """The rule for a group: capturable and fused ones by the device rules (their step a
    tensor), foreach or not as the group steps; a fused group on CUDA by the multi-tensor
    form (batched kernels: one launch per op for many tensors, as its own fused kernel
    makes one pass), on CPU by the per-tensor one (no launches to save there, and its
    pieces reuse one scratch where the multi-tensor form allocates full-size results:
    measured 5-7x the fused step on CPU, against about 1x per tensor)."""
    if _on_device(group) and device_rules is not None:
        rules = device_rules
    fused_on_cuda = group.get("fused") and params[0].is_cuda
    return rules[1] if fused_on_cuda or _foreach(group, params) else rules[0]


def fallback(optimizer_class, groups):
    """Why the prediction for these param groups cannot be one pass, naming the groups
    ("param group 1 (differentiable)"), or None where it is (or where only the first
    prediction, before Adam has state, steps: that is exact and once)."""
    if optimizer_class not in RULES:
        return f"{optimizer_class.__name__} has no one-pass rule"
    ready = RULES[optimizer_class][0]
    named = []
    for i, group in enumerate(groups):
        if ready(group, ()):
            continue
        why = [flag for flag in ("differentiable",) if group.get(flag)] + [
            f"tensor {k}" for k, v in group.items()
            if k != "params" and (torch.is_tensor(v) or (
                k == "betas" and any(torch.is_tensor(b) for b in v)))]
        named.append(f"param group {i}" + (f" ({', '.join(why)})" if why else ""))
    return f"{optimizer_class.__name__} {', '.join(named)}" if named else None


_MULTI = (_sgd_foreach, _adam_foreach, _adam_capturable_foreach)


def predict(optimizer_class, groups, state, locals_):
    """Predict in one pass, if the rule applies to every group now. `locals_` {param: dense
    local gradient, owned: the rule writes into it}. Returns {param: its prediction} (the
    local gradient itself, or a fresh tensor) for the caller to swap in, or None (nothing
    touched) where the rule does not apply."""
    rule = RULES.get(optimizer_class)
    if rule is None:
        return None
    ready, rules, device_rules = rule
    work = []
    for group in groups:
        params = [p for p in group["params"] if p in locals_]
        states = [state.get(p, {}) for p in params]
        if not ready(group, states) or any(
                locals_[p].is_sparse or locals_[p].is_complex() or p.is_complex()
                or locals_[p].shape != p.shape for p in params):
            return None
        if not params:
            continue
        work.append((group, [(p, locals_[p], st) for p, st in zip(params, states)],
                     _rule(rules, device_rules, group, params)))
    predicted = {}
    with torch.no_grad():
        for group, items, rule in work:
            if rule not in _MULTI:
                rule(group, items)
                predicted.update((p, g) for p, g, _ in items)
                continue
            for batch in _batches(items):
                predicted.update(zip((p for p, _, _ in batch), rule(group, batch)))
    return predicted


def _batches(items):
    """Consecutive runs of items of the same device and dtype, of at most _BATCH elements
    (or one larger parameter), for the multi-tensor kernels."""
    batch, size = [], 0
    for item in items:
        p = item[0]
        if batch and (size + p.numel() > _BATCH or p.device != batch[0][0].device
                      or p.dtype != batch[0][0].dtype):
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += p.numel()
    if batch:
        yield batch


def stepped(optimizer, steps, run_step):
    """The prediction by the optimizer's own step: for each `steps` entry ({param: local
    gradient}), set `.grad` and call `run_step()`; the state is saved in temporaries and put
    back afterwards (entries the steps created removed). The parameters keep the result.

    A wrapped optimizer whose state lives outside `optimizer.state` (the Keras adapter's
    stand-in: Keras variables) does this itself, in a context manager method
    `pipe_horovod_state_restored()`: the one method pipe_horovod looks for on a torch
    optimizer, named so it cannot clash with torch's or a user's own."""
    own = getattr(optimizer, "pipe_horovod_state_restored", None)
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
