"""The Keras oracle (tests/keras_reference.py) against the real Keras 3 optimizers.

The reference is what the Keras adapter's multi-process tests compare with,
so it must itself be right: here the real keras.optimizers.SGD / Adam
(TensorFlow backend, eager) are fed the averaged gradients on an independent
schedule (step t applies g_t during warm-up, then g_{t-K+1}; the end applies
the rest) and must land on the reference's weights and optimizer slots.
The gradients depend on the weights (a least-squares layer per rank), so a
delay changes the trajectory. For "lookahead" each rank's point is found by
a second real Keras optimizer given a copy of the first one's variables.
"""
import os

import numpy as np
import pytest

pytest.importorskip("tensorflow")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
keras = pytest.importorskip("keras")

import keras_reference as ref  # noqa: E402
from keras_reference import SGD, Adam, average, reference  # noqa: E402
from tolerance import OPTIMIZER_OPS, gamma, relative_error, training_rtol  # noqa: E402

pytestmark = pytest.mark.skipif(keras.backend.backend() != "tensorflow",
                                reason="checks Keras's TensorFlow backend")

SIZE, STEPS, N_IN, N_OUT, BATCH = 3, 9, 5, 3, 8


def problem(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((SIZE, STEPS, BATCH, N_IN)).astype(np.float32)
    y = rng.standard_normal((SIZE, STEPS, BATCH, N_OUT)).astype(np.float32)
    w0 = [(0.5 * rng.standard_normal((N_IN, N_OUT))).astype(np.float32),
          (0.1 * rng.standard_normal(N_OUT)).astype(np.float32)]

    def grad_fn(step, rank, weights):
        """d/dW, d/db of 0.5 * mean over the batch of |x W + b - y|^2 (rank's own data)."""
        w, b = weights
        xb, yb = x[rank, step], y[rank, step]
        err = (xb @ w + b - yb) / np.float32(BATCH)
        return [xb.T @ err, err.sum(axis=0)]

    return w0, grad_fn


def applied_at(step, depth, warmup):
    """Which step's gradient the pipeline applies at `step` (closed form, no FIFO)."""
    if step < warmup:
        return [step]
    src = step - depth + 1
    return [src] if src >= warmup else []


def keras_run(make_optimizer, w0, grad_fn, depth, warmup, flush, compensation=None):
    """The real Keras optimizer on the delayed averaged gradients."""
    variables = [keras.Variable(w, dtype="float32") for w in w0]
    opt = make_optimizer()
    opt.build(variables)
    computed, own, applied = {}, {}, []
    ahead = [keras.Variable(w, dtype="float32") for w in w0]
    simulated = make_optimizer()
    simulated.build(ahead)

    def lookahead(rank):
        """A second optimizer, given `opt`'s variables, steps a copy of the weights
        with this rank's gradients of the steps not applied yet."""
        for mine, theirs in zip(ahead + simulated.variables, variables + opt.variables):
            mine.assign(theirs)
        for src in sorted(computed):
            simulated.apply(own[src][rank], ahead)
        return [v.numpy() for v in ahead]

    for t in range(STEPS):
        current = [v.numpy() for v in variables]
        points = [lookahead(r) if compensation and computed else current for r in range(SIZE)]
        own[t] = [grad_fn(t, r, points[r]) for r in range(SIZE)]
        computed[t] = average(own[t])
        for src in applied_at(t, depth, warmup):
            opt.apply(computed.pop(src), variables)
            applied.append(src)
    if flush:
        for src in sorted(computed):
            opt.apply(computed.pop(src), variables)
            applied.append(src)
    return variables, opt, applied, sorted(computed)


def rtol_for(name, depth=1, compensation=None):
    """Rounding's bound for STEPS steps of `name` on this problem (tests/tolerance.py):
    the gradients are NumPy's on both sides, the rule is Keras's against the reference's,
    with what Keras's apply adds to it (SETTINGS' clipping, decay and schedule)."""
    settings = SETTINGS.get(name, {})
    clipped = (N_IN * N_OUT + N_OUT if "global_clipnorm" in settings
               else N_IN * N_OUT if "clipnorm" in settings else 0)
    return training_rtol(steps=STEPS, fan_ins=(N_IN, N_OUT), batch=BATCH, ranks=SIZE,
                         optimizer="momentum" if name.startswith("sgd") else "adam",
                         predicted=depth - 1 if compensation == "lookahead" else 0,
                         clipped=clipped, decayed="weight_decay" in settings,
                         scheduled="schedule" in settings)


def assert_close(actual, expected, what, rtol):
    err = relative_error(actual, expected)
    assert err <= rtol, f"{what}: max |diff| / max |expected| = {err:.3g} > {rtol:.3g}"


OPTIMIZERS = {
    "sgd-momentum": (lambda: keras.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                     lambda: SGD(learning_rate=0.1, momentum=0.9),
                     {"momentum": "momentum"}),
    "adam": (lambda: keras.optimizers.Adam(learning_rate=0.01, beta_1=0.9, beta_2=0.999, epsilon=1e-7),
             lambda: Adam(learning_rate=0.01, beta_1=0.9, beta_2=0.999, epsilon=1e-7),
             {"momentum": "momentum", "velocity": "velocity"}),
    # A large epsilon and short betas: where epsilon sits and how the bias
    # correction counts updates move the weights well beyond the tolerance.
    "adam-eps": (lambda: keras.optimizers.Adam(learning_rate=0.05, beta_1=0.8, beta_2=0.95, epsilon=0.05),
                 lambda: Adam(learning_rate=0.05, beta_1=0.8, beta_2=0.95, epsilon=0.05),
                 {"momentum": "momentum", "velocity": "velocity"}),
}


# What Keras's apply does around the rule: a schedule read at the iteration
# count, clipping, decoupled weight decay; each (keras, reference) pair of schedules and
# the optimizer's other keyword arguments. Every setting moves the weights beyond
# rounding's bound (checked below), so one applied at the wrong step or to the wrong
# gradient cannot pass.
SCHEDULES = {
    "cosine": (lambda: keras.optimizers.schedules.CosineDecay(
        0.0, STEPS - 3, alpha=0.1, warmup_target=0.05, warmup_steps=3),
        lambda: ref.cosine_decay(0.0, STEPS - 3, alpha=0.1, warmup_target=0.05,
                                 warmup_steps=3)),
    "exponential": (lambda: keras.optimizers.schedules.ExponentialDecay(0.1, 3, 0.5),
                    lambda: ref.exponential_decay(0.1, 3, 0.5)),
    "piecewise": (lambda: keras.optimizers.schedules.PiecewiseConstantDecay(
        [2, 5], [0.05, 0.02, 0.005]),
        lambda: ref.piecewise_constant_decay([2, 5], [0.05, 0.02, 0.005])),
}
SETTINGS = {
    "adamw-cosine-global": {"schedule": "cosine", "weight_decay": 0.2, "global_clipnorm": 0.5},
    "sgd-exponential-clipnorm": {"schedule": "exponential", "weight_decay": 0.1,
                                 "clipnorm": 0.3},
    "adam-piecewise-global": {"schedule": "piecewise", "global_clipnorm": 0.5},
}


def with_settings(name, side):
    """(keras or reference optimizer factory) for SETTINGS[name]; side 0: Keras, 1: ours."""
    settings = dict(SETTINGS[name])
    schedule = SCHEDULES[settings.pop("schedule")][side]
    if name.startswith("sgd"):
        cls = (keras.optimizers.SGD, SGD)[side]
        return lambda: cls(learning_rate=schedule(), momentum=0.9, **settings)
    if side == 0:
        cls = keras.optimizers.AdamW if "weight_decay" in settings else keras.optimizers.Adam
        return lambda: cls(learning_rate=schedule(), beta_1=0.9, beta_2=0.95, **settings)
    return lambda: Adam(learning_rate=schedule(), beta_1=0.9, beta_2=0.95, **settings)


for _name in SETTINGS:
    OPTIMIZERS[_name] = (with_settings(_name, 0), with_settings(_name, 1),
                         {"momentum": "momentum"} if _name.startswith("sgd")
                         else {"momentum": "momentum", "velocity": "velocity"})


@pytest.mark.parametrize("depth,warmup,compensation", [
    (1, 0, None), (2, 0, None), (2, 2, None), (3, 1, None),
    (2, 0, "lookahead"), (2, 2, "lookahead"), (3, 1, "lookahead")])
@pytest.mark.parametrize("flush", [True, False], ids=["flush", "noflush"])
@pytest.mark.parametrize("name", sorted(set(OPTIMIZERS) - set(SETTINGS)))
def test_reference_matches_keras(name, depth, warmup, flush, compensation):
    make_keras, make_ref, slot_names = OPTIMIZERS[name]
    w0, grad_fn = problem()
    variables, opt, applied, in_flight = keras_run(make_keras, w0, grad_fn, depth, warmup, flush,
                                                   compensation)
    ref = reference(w0, grad_fn, make_ref(), pipeline_depth=depth, warmup_steps=warmup,
                    steps=STEPS, size=SIZE, flush=flush, compensation=compensation)

    assert ref.applied == applied
    assert [s for s, _ in ref.fifo] == in_flight
    if flush:
        assert applied == list(range(STEPS))
    assert ref.iterations == int(opt.iterations.numpy()) == len(applied)
    rtol = rtol_for(name, depth, compensation)
    for i, (v, w) in enumerate(zip(variables, ref.weights)):
        assert w.dtype == np.float32
        assert_close(v.numpy(), w, f"{name} K={depth} W={warmup} weight {i}", rtol)
    for slot, keras_name in slot_names.items():
        keras_slots = [v for v in opt.variables if keras_name in v.path]
        assert len(keras_slots) == len(w0)
        for i, (kv, rv) in enumerate(zip(keras_slots, ref.optimizer.slots()[slot])):
            assert_close(kv.numpy(), rv, f"{name} K={depth} W={warmup} {slot} {i}", rtol)
    # The delay matters here, beyond rounding's bound: a pipelined trajectory is not the sync
    # one, and lookahead (with 3 ranks: each predicts with its own gradient) is neither. (The
    # closest pair, Adam's sync and lookahead runs at K=2 W=2, is 1.1e-4 apart: 6.7 bounds.)
    if depth > 1 and warmup < STEPS:
        for other in ({}, {"pipeline_depth": depth, "warmup_steps": warmup}):
            if compensation or not other:
                base = reference(w0, grad_fn, make_ref(), steps=STEPS, size=SIZE, flush=flush,
                                 **other)
                assert relative_error(base.weights[0], ref.weights[0]) > rtol


@pytest.mark.parametrize("depth,warmup,compensation", [
    (1, 0, None), (2, 0, None), (2, 0, "lookahead"), (3, 1, "lookahead")])
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_schedules_clipping_and_decay_match_keras(name, depth, warmup, compensation):
    """The reference's schedules, clipping and weight decay against Keras's own, pipelined
    and with lookahead (whose prediction runs the whole apply: this rank's gradient
    clipped alone, the rate of the update it predicts, the decay)."""
    test_reference_matches_keras(name, depth, warmup, True, compensation)
    w0, grad_fn = problem()
    want = reference(w0, grad_fn, OPTIMIZERS[name][1](), pipeline_depth=depth,
                     warmup_steps=warmup, steps=STEPS, size=SIZE, compensation=compensation)
    rtol = rtol_for(name, depth, compensation)
    for setting in SETTINGS[name]:
        opt = OPTIMIZERS[name][1]()
        if setting == "schedule":       # the rate it has half-way, throughout
            opt.learning_rate = opt.learning_rate(STEPS // 2)
        else:
            setattr(opt, setting, None)
        other = reference(w0, grad_fn, opt, pipeline_depth=depth, warmup_steps=warmup,
                          steps=STEPS, size=SIZE, compensation=compensation)
        assert relative_error(other.weights[0], want.weights[0]) > rtol, (
            f"{name}: without {setting} the weights stay within rounding's bound")


@pytest.mark.parametrize("depth,warmup", [(2, 0), (3, 2)])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_lookahead_on_one_rank_is_synchronous(name, depth, warmup):
    """One rank's own gradient is the average: its prediction is where the delayed
    updates do take the weights, so the lookahead run is the K=1 run, bit for bit."""
    w0, grad_fn = problem()
    make_ref = OPTIMIZERS[name][1]
    sync = reference(w0, grad_fn, make_ref(), steps=STEPS, size=1)
    ahead = reference(w0, grad_fn, make_ref(), pipeline_depth=depth, warmup_steps=warmup,
                      steps=STEPS, size=1, compensation="lookahead")
    for a, b in zip(sync.weights, ahead.weights):
        assert np.array_equal(a, b)


def test_fixed_gradient_sequences():
    """gradients[step][rank] as data: K=1 is the real optimizer on their averages;
    K=2 without flush leaves exactly the last step in flight."""
    rng = np.random.default_rng(1)
    shapes = [(4, 2), (2,)]
    grads = [[[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(2)]
             for _ in range(5)]
    w0 = [np.ones(s, np.float32) for s in shapes]
    variables = [keras.Variable(w, dtype="float32") for w in w0]
    opt = keras.optimizers.Adam(learning_rate=0.05)
    for step in grads:
        opt.apply([(a + b) / np.float32(2) for a, b in zip(*step)], variables)
    ref = reference(w0, grads, Adam(learning_rate=0.05), pipeline_depth=1)
    rtol = 2 * gamma(len(grads) * (OPTIMIZER_OPS["adam"] + 2), "float32")   # the rule, 2 ranks
    for v, w in zip(variables, ref.weights):
        assert_close(v.numpy(), w, "fixed sequence, Adam K=1", rtol)
    ref2 = reference(w0, grads, Adam(learning_rate=0.05), pipeline_depth=2, flush=False)
    assert ref2.applied == [0, 1, 2, 3] and [s for s, _ in ref2.fifo] == [4]
    assert ref2.iterations == 4


@pytest.mark.parametrize("average", [False, True])
def test_aggregation_and_local_variables(average):
    """backward_passes_per_step=3 and a local variable, written out: the real Keras Adam,
    per rank, given each 3 passes' sum (/ 3 averaged) every third pass, averaged over the
    2 ranks except the local bias (this rank's / 2); iterations count every pass."""
    rng = np.random.default_rng(2)
    shapes = [(4, 2), (2,)]
    passes, size = 3, 2
    grads = [[[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(size)]
             for _ in range(2 * passes)]
    w0 = [np.ones(s, np.float32) for s in shapes]
    ref = reference(w0, grads, Adam(learning_rate=0.05), pipeline_depth=1, passes=passes,
                    average_passes=average, local=(1,))
    rtol = 2 * gamma(len(grads) * (OPTIMIZER_OPS["adam"] + 4), "float32")
    for rank in range(size):
        variables = [keras.Variable(w, dtype="float32") for w in w0]
        opt = keras.optimizers.Adam(learning_rate=0.05)
        opt.build(variables)
        for cycle in range(2):
            sums = [[sum(grads[cycle * passes + p][r][i] for p in range(passes))
                     for i in range(len(shapes))] for r in range(size)]
            if average:
                sums = [[g / np.float32(passes) for g in gs] for gs in sums]
            opt.iterations.assign_add(passes - 1)          # the passes that apply nothing
            opt.apply([(sums[0][0] + sums[1][0]) / np.float32(2), sums[rank][1] / np.float32(2)],
                      variables)
        assert int(opt.iterations.numpy()) == ref.iterations == 2 * passes
        for v, w in zip(variables, ref.rank_weights[rank]):
            assert_close(v.numpy(), w, f"rank {rank}", rtol)
    assert not np.array_equal(ref.rank_weights[0][1], ref.rank_weights[1][1]), "local differs"
    assert np.array_equal(ref.rank_weights[0][0], ref.rank_weights[1][0]), "shared agrees"
