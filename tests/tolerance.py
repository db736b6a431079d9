"""Numerical tolerances derived from the computation, never from what one CPU printed.

Two runs of the same floating-point math differ only in rounding: another CPU's
kernels (AVX-512 against AVX2 blocking, oneDNN against Eigen, one thread or several)
sum the same products in another order, and so do an allreduce and a NumPy oracle.
A result that depends on a chain of n rounded operations is within Higham's

    gamma_n = n * u / (1 - n * u),        u = eps(dtype) / 2 (the unit roundoff)

of the exact value, relative to the magnitudes involved (Higham, "Accuracy and
Stability of Numerical Algorithms", 2nd ed., sec. 3.1 and 3.4: a dot product of
length n, a sum of n terms). Two such runs are within 2 * gamma_n of each other.
That worst case lets errors add up linearly; short chains (an average over ranks, a
batch norm's statistics) use it as it is. Over a training run's chain of hundreds or
thousands of operations the errors mostly cancel, and the worst case grows so loose
that it no longer tells a one-step delay with Adam from the right pipeline (1.1e-4
apart in test_keras_reference.py). There Higham and Mary's probabilistic bound
(SIAM J. Sci. Comput. 41(5), 2019, thm. 2.4) applies: with rounding errors
independent and of mean zero, a chain of n operations is within

    gamma~_n(lam) = exp(lam * sqrt(n) * u + n * u**2 / (1 - u)) - 1

of the exact value with probability at least 1 - 2 * exp(-lam**2 * (1 - u)**2 / 2);
lam = 6 makes that 1 - 3e-8 for each compared value.

A weight after T training steps depends on the T updates before it, and each update
on its gradient: the forward pass (a dot product of each layer's fan-in), the
backward pass (about as many), the sum over the batch of a weight's gradient, the sum
over ranks of the average, and the optimizer's rule. `training_rtol` counts that chain
and assumes the trajectory does not amplify a perturbation (its condition is about 1:
short runs at small learning rates, as in these tests).
"""
import os

import numpy as np

# Threads per worker process: 1 in the suite (the ranks share 2 cores), 2 or more where
# docs/ci.md's tolerance runs check that another summation order still passes.
THREADS = int(os.environ.get("PIPE_HOROVOD_TEST_THREADS", "1"))

# Rounded operations per element in one update of each rule (their formulas, counted
# as written in torch.optim and keras.optimizers), so a bound counts the rule it runs.
OPTIMIZER_OPS = {
    "sgd": 2,            # w - lr * g
    "momentum": 4,       # b = mu * b + g; w - lr * b
    "adam": 12,          # two moments, two bias corrections, sqrt, + eps, divide, update
    "adamw": 14,         # adam and the decoupled decay
}

# What Keras's apply adds to a rule, per update: clipping sums the squares of the
# elements it takes the norm of (a tensor's for clipnorm, every gradient's for
# global_clipnorm), then takes the root and scales (CLIP_OPS); decoupled weight decay
# (w - w * wd * lr: DECAY_OPS, what "adamw" adds to "adam"); a learning-rate schedule
# computes the rate in a few roundings (SCHEDULE_OPS: CosineDecay's division, cosine,
# two products and two sums; ExponentialDecay's division and power).
CLIP_OPS = 4
DECAY_OPS = 2
SCHEDULE_OPS = 6

# The loss and the nonlinearities: a softmax and its log over a handful of classes,
# tanh/relu, the mean's division: a few roundings each pass.
LOSS_OPS = 8


def unit_roundoff(dtype) -> float:
    """u = eps / 2 for a NumPy or torch floating dtype (or its name)."""
    name = str(dtype).replace("torch.", "")
    if name == "bfloat16":                      # NumPy has no bfloat16
        return 2.0 ** -8
    return float(np.finfo(np.dtype(name)).eps) / 2


def gamma(n: int, dtype) -> float:
    """Higham's gamma_n: the relative error bound of n rounded operations in `dtype`."""
    nu = n * unit_roundoff(dtype)
    if nu >= 1:
        raise ValueError(f"{n} operations in {dtype}: gamma_n is unbounded (n * u >= 1)")
    return nu / (1 - nu)


LAMBDA = 6.0


def probable_gamma(n: int, dtype, lam: float = LAMBDA) -> float:
    """Higham and Mary's gamma~_n(lam): n rounded operations in `dtype` stay within it with
    probability at least 1 - 2 exp(-lam^2 (1 - u)^2 / 2)."""
    u = unit_roundoff(dtype)
    return float(np.expm1(lam * np.sqrt(n) * u + n * u * u / (1 - u)))


def fan_ins(model) -> list:
    """Each layer's dot-product length in a torch model (Linear: in_features; Conv: the
    kernel's size times its input channels per group; Embedding: a lookup, 1), and the
    classes the loss sums over (the last layer's outputs)."""
    sizes, outputs = [], 1
    for m in model.modules():
        if hasattr(m, "in_features"):
            sizes.append(m.in_features)
            outputs = m.out_features
        elif hasattr(m, "kernel_size") and hasattr(m, "in_channels"):
            sizes.append(m.in_channels // m.groups * int(np.prod(m.kernel_size)))
            outputs = m.out_channels
        elif hasattr(m, "embedding_dim"):
            sizes.append(1)
            outputs = m.embedding_dim
    return sizes + [outputs]


def training_ops(*, steps: int, fan_ins, batch: int, ranks: int, optimizer: str,
                 predicted: int = 0, clipped: int = 0, decayed: bool = False,
                 scheduled: bool = False) -> int:
    """The rounded operations on the longest chain a weight depends on after `steps` updates:
    each step a forward and a backward pass (2 * the layers' fan-ins), the loss, the batch
    sum of the weight's gradient, the sum over ranks, and the optimizer's rule, run once for
    the update and `predicted` more times where a gradient is computed at predicted weights
    (staleness_compensation="lookahead" at depth K predicts K - 1 updates ahead). What
    Keras's apply adds to the rule: `clipped`, the elements a clipping norm sums (0: no
    clipping); `decayed`, weight decay; `scheduled`, a learning-rate schedule."""
    rule = (OPTIMIZER_OPS[optimizer] + (clipped + CLIP_OPS if clipped else 0)
            + DECAY_OPS * decayed + SCHEDULE_OPS * scheduled) * (1 + predicted)
    return steps * (2 * sum(fan_ins) + LOSS_OPS + batch + ranks + rule)


def training_rtol(dtype="float32", *, steps: int, fan_ins, batch: int, ranks: int,
                  optimizer: str, predicted: int = 0, clipped: int = 0,
                  decayed: bool = False, scheduled: bool = False) -> float:
    """How far two float runs of the same training may differ, relative to the largest
    weight: 2 * gamma~_n of the chain `training_ops` counts."""
    n = training_ops(steps=steps, fan_ins=fan_ins, batch=batch, ranks=ranks,
                     optimizer=optimizer, predicted=predicted, clipped=clipped,
                     decayed=decayed, scheduled=scheduled)
    return 2 * probable_gamma(n, dtype)


def relative_error(got, want) -> float:
    """max |got - want| / max |want| (an all-zero `want` compares absolutely); NumPy arrays
    or torch tensors."""
    got, want = (np.asarray(x.detach().double().cpu() if hasattr(x, "detach") else x,
                            dtype=np.float64) for x in (got, want))
    scale = np.abs(want).max() if want.size else 0.0
    diff = np.abs(got - want).max() if want.size else 0.0
    return float(diff / scale) if scale > 0 else float(diff)

