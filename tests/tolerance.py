"""Numerical tolerances derived from the computation, never from what one CPU printed.

Two runs of the same floating-point math differ only in rounding: another CPU's
kernels (AVX-512 against AVX2 blocking, oneDNN against Eigen, one thread or several)
sum the same products in another order, and so do an allreduce and a NumPy oracle.
A result that depends on a chain of n rounded operations is within Higham's

    gamma_n = n * u / (1 - n * u),        u = eps(dtype) / 2 (the unit roundoff)

of the exact value, relative to the magnitudes involved (Higham, "Accuracy and
Stability of Numerical Algorithms", 2nd ed., sec. 3.1 and 3.4: a dot product of
length n, a sum of n terms). Two such runs are within 2 * gamma_n of each other.
That is a worst case: rounding errors add up linearly there, where in practice they
mostly cancel (about sqrt(n) * u), so a bound from it holds on any IEEE machine and
still sits orders of magnitude below what a wrong step, a dropped or repeated
gradient or a wrong average would move.

A weight after T training steps depends on the T updates before it, and each update
on its gradient: the forward pass (a dot product of each layer's fan-in), the
backward pass (about as many), the sum over the batch of a weight's gradient, the sum
over ranks of the average, and the optimizer's rule. `training_rtol` counts that chain
and assumes the trajectory does not amplify a perturbation (its condition is about 1:
short runs at small learning rates, as in these tests). A test whose trajectory does
amplify says so with `condition=`, and says why.
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
                 predicted: int = 0) -> int:
    """The rounded operations on the longest chain a weight depends on after `steps` updates:
    each step a forward and a backward pass (2 * the layers' fan-ins), the loss, the batch
    sum of the weight's gradient, the sum over ranks, and the optimizer's rule, run once for
    the update and `predicted` more times where a gradient is computed at predicted weights
    (staleness_compensation="lookahead" at depth K predicts K - 1 updates ahead)."""
    rule = OPTIMIZER_OPS[optimizer] * (1 + predicted)
    return steps * (2 * sum(fan_ins) + LOSS_OPS + batch + ranks + rule)


def training_rtol(dtype="float32", *, steps: int, fan_ins, batch: int, ranks: int,
                  optimizer: str, predicted: int = 0, condition: float = 1.0) -> float:
    """How far two float runs of the same training may differ, relative to the largest
    weight: 2 * gamma_n of the chain `training_ops` counts, times the trajectory's
    condition (1 unless a test argues otherwise)."""
    n = training_ops(steps=steps, fan_ins=fan_ins, batch=batch, ranks=ranks,
                     optimizer=optimizer, predicted=predicted)
    return 2 * condition * gamma(n, dtype)


def sum_rtol(terms: int, dtype="float32") -> float:
    """Two sums of the same `terms` numbers in different orders (an allreduce against a
    reference's loop), relative to the sum of their magnitudes."""
    return 2 * gamma(max(terms - 1, 1), dtype)


def relative_error(got, want) -> float:
    """max |got - want| / max |want| (an all-zero `want` compares absolutely); NumPy arrays
    or torch tensors."""
    got, want = (np.asarray(x.detach().double().cpu() if hasattr(x, "detach") else x,
                            dtype=np.float64) for x in (got, want))
    scale = np.abs(want).max() if want.size else 0.0
    diff = np.abs(got - want).max() if want.size else 0.0
    return float(diff / scale) if scale > 0 else float(diff)

