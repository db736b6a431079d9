"""Single-process NumPy reference of the pipelined math for Keras 3 optimizers.

The oracle for the Keras adapter (DESIGN.md, "Semantics"). It shares no code
with the package, nor with Keras: the two optimizer rules are written out
here in float32 NumPy, in the operation order of Keras 3.15's
keras/src/optimizers/sgd.py and adam.py, with what BaseOptimizer.apply does
around them (clipnorm / global_clipnorm, decoupled weight decay as AdamW's,
a learning-rate schedule read at the optimizer's iteration count) and three
of Keras's built-in schedules; the pipeline is a plain FIFO.

    each step t: push g_t = (sum over ranks of the rank gradients) / size
                 pop and apply, oldest first, while the FIFO holds >= need
                 entries, need = 1 during warm-up (t < W), else K
    flush:       pop and apply the rest

One pop is one optimizer update, and only an update advances the optimizer's
iteration counter (Adam's bias correction counts updates, not steps).

Gradients come either as a fixed sequence, gradients[step][rank] -> list of
arrays (one per variable), or as a function grad_fn(step, rank, weights) ->
list of arrays, evaluated at the weights the model holds when step `step`
computes its gradient (w_t), which is what `model.fit` does.

compensation="lookahead" (staleness compensation, written out from its
definition): rank r computes the gradient of step t not at w_t but at its
own prediction of where the steps still in flight will take w_t: a copy of
the optimizer (its slots and iteration count) updating a copy of w_t with
rank r's own gradients of those steps, oldest first. Nothing in flight (K=1,
warm-up): the prediction is w_t itself. The real updates are unchanged.
The other options, each from its formula (none has any effect at K=1):
  "predict"   every rank computes at w_t + s * (w_t - w_prev), s the steps in
              flight, w_prev the weights before step t-1's updates;
  "dc"        an applied gradient g of step u becomes
              g + 2 / (sqrt(ms) + 1e-7) * g * g * (w_now - w_u), with ms a running
              mean of g * g (0.95 * ms + 0.05 * g * g; the first g * g starts it);
  "momentum"  once more steps were pushed than warm-up ones, every update runs
              with the optimizer's momentum (SGD's momentum, Adam's beta_1) less
              tau / (tau + 1), tau = K - 1, never below 0.
"""
import copy

import numpy as np

F32 = np.float32


class Optimizer:
    """What Keras 3's BaseOptimizer.apply does around each rule's update_step, in its order:

        clip the gradients      clipnorm: g * c / max(|g|, c) per tensor;
                                global_clipnorm: g * (c * min(1 / |all|, 1 / c))
        lr = learning_rate      a number, or a schedule: a function of `iterations`
                                (the updates so far), returning float32
        weight decay            w = w - w * wd * lr (decoupled: AdamW, or any optimizer
                                given weight_decay)
        the rule's update       with the same lr
        iterations += 1

    Norms are float32 sums of squares, per tensor, then over tensors, as Keras's are.
    """

    def __init__(self, learning_rate, weight_decay=None, clipnorm=None, global_clipnorm=None):
        if clipnorm is not None and global_clipnorm is not None:
            raise ValueError("one of clipnorm and global_clipnorm")
        self.learning_rate = learning_rate
        self.weight_decay, self.clipnorm, self.global_clipnorm = (
            weight_decay, clipnorm, global_clipnorm)
        self.iterations = 0

    def lr(self):
        rate = self.learning_rate
        return F32(rate(self.iterations)) if callable(rate) else F32(rate)

    def clip(self, grads):
        if self.clipnorm:
            c = F32(self.clipnorm)
            return [g * c / np.maximum(np.sqrt(np.sum(np.square(g), dtype=F32)), c)
                    for g in grads]
        if self.global_clipnorm:
            c = F32(self.global_clipnorm)
            norm = np.sqrt(np.sum(np.array([np.sum(np.square(g), dtype=F32) for g in grads],
                                           dtype=F32), dtype=F32))
            scale = c * np.minimum(F32(1) / norm, F32(1) / c)
            return [g * scale for g in grads]
        return grads

    def update(self, weights, grads):
        grads = self.clip([np.asarray(g).astype(F32) for g in grads])
        lr = self.lr()
        if self.weight_decay:
            wd = F32(self.weight_decay)
            for i, w in enumerate(weights):
                weights[i] = w - w * wd * lr
        self.rule(weights, grads, lr)
        self.iterations += 1


class SGD(Optimizer):
    """keras.optimizers.SGD(learning_rate, momentum, nesterov=False)."""

    def __init__(self, learning_rate=0.01, momentum=0.0, **options):
        super().__init__(learning_rate, **options)
        self.momentum = momentum
        self.momentums = None

    def build(self, weights):
        if self.momentum != 0:
            self.momentums = [np.zeros_like(w) for w in weights]

    def rule(self, weights, grads, lr):
        for i, (w, g) in enumerate(zip(weights, grads)):
            if self.momentums is not None and self.momentum != 0:
                # m = m * momentum - g * lr;  w = w + m
                m = self.momentums[i] * F32(self.momentum) - g * lr
                self.momentums[i] = m
                weights[i] = w + m
            else:
                weights[i] = w - g * lr

    def slots(self):
        return {"momentum": self.momentums} if self.momentums is not None else {}


class Adam(Optimizer):
    """keras.optimizers.Adam(learning_rate, beta_1, beta_2, epsilon), amsgrad=False; with
    weight_decay, keras.optimizers.AdamW.

    Keras's form: the bias corrections go into the step size, and epsilon is
    added to sqrt(v) uncorrected ("epsilon hat" of Kingma & Ba, sec. 2):
        t     = iterations + 1
        alpha = lr * sqrt(1 - beta_2**t) / (1 - beta_1**t)
        m    += (g - m) * (1 - beta_1)
        v    += (g*g - v) * (1 - beta_2)
        w    -= m * alpha / (sqrt(v) + epsilon)
    """

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7, **options):
        super().__init__(learning_rate, **options)
        self.beta_1, self.beta_2, self.epsilon = beta_1, beta_2, epsilon
        self.m = self.v = None

    def build(self, weights):
        self.m = [np.zeros_like(w) for w in weights]
        self.v = [np.zeros_like(w) for w in weights]

    def rule(self, weights, grads, lr):
        t = F32(self.iterations + 1)
        b1_power = np.power(F32(self.beta_1), t)
        b2_power = np.power(F32(self.beta_2), t)
        alpha = lr * np.sqrt(F32(1) - b2_power) / (F32(1) - b1_power)
        # Python floats meet float32 tensors in Keras: 1 - beta is computed
        # in double, then rounded to float32.
        one_minus_b1, one_minus_b2 = F32(1 - self.beta_1), F32(1 - self.beta_2)
        for i, (w, g) in enumerate(zip(weights, grads)):
            self.m[i] = self.m[i] + (g - self.m[i]) * one_minus_b1
            self.v[i] = self.v[i] + (np.square(g) - self.v[i]) * one_minus_b2
            weights[i] = w - (self.m[i] * alpha) / (np.sqrt(self.v[i]) + F32(self.epsilon))

    def slots(self):
        return {"momentum": self.m, "velocity": self.v}


# Keras's built-in LearningRateSchedules, each as a function of the step written out in
# float32 from keras/src/optimizers/schedules/learning_rate_schedule.py.

def cosine_decay(initial_learning_rate, decay_steps, alpha=0.0, warmup_target=None,
                 warmup_steps=0):
    """keras.optimizers.schedules.CosineDecay (with warm-up when warmup_target is given)."""
    initial, steps = F32(initial_learning_rate), F32(decay_steps)

    def decayed(step, peak):
        cosine = F32(0.5) * (F32(1) + np.cos(F32(np.pi) * (step / steps)))
        return peak * (F32(1 - alpha) * cosine + F32(alpha))

    def schedule(step):
        step = F32(step)
        if warmup_target is None:
            return decayed(min(step, steps), initial)
        target, warm = F32(warmup_target), F32(warmup_steps)
        step = min(step, steps + warm)
        if step < warm:
            return (target - initial) * (step / warm) + initial
        return decayed(step - warm, target)
    return schedule


def exponential_decay(initial_learning_rate, decay_steps, decay_rate):
    """keras.optimizers.schedules.ExponentialDecay, staircase=False."""
    def schedule(step):
        return F32(initial_learning_rate) * np.power(F32(decay_rate),
                                                     F32(step) / F32(decay_steps))
    return schedule


def piecewise_constant_decay(boundaries, values):
    """keras.optimizers.schedules.PiecewiseConstantDecay: values[i] up to and including
    boundaries[i], the last value after the last boundary."""
    def schedule(step):
        for boundary, value in zip(boundaries, values):
            if step <= boundary:
                return F32(value)
        return F32(values[-1])
    return schedule


class Result:
    """weights (rank 0's; rank_weights[r] every rank's, which differ only in local
    variables), optimizer (rank 0's: its iterations and slots), the FIFO left in flight
    (steps and rank 0's averaged gradients, oldest first), which step's gradient each
    update applied, in order, and points[rank]: the weights each rank would compute its
    next gradient at (the predicted ones under "lookahead")."""

    def __init__(self, rank_weights, optimizer, fifo, applied, points):
        self.rank_weights = rank_weights
        self.weights, self.optimizer, self.fifo, self.applied = (rank_weights[0], optimizer,
                                                                 fifo, applied)
        self.points = points

    @property
    def iterations(self):
        return self.optimizer.iterations


def rank_data(rank, step, batch, n_in, n_out):
    """The batch (x, y) rank `rank` trains on at `step`: the workers' and this
    reference's inputs, the same on every engine and backend."""
    rng = np.random.default_rng(1000 * rank + step)
    return (rng.standard_normal((batch, n_in)).astype("float32"),
            rng.standard_normal((batch, n_out)).astype("float32"))


def average(per_rank):
    """The mean over ranks of one step's gradients: float32 sum in rank order, / size."""
    size = len(per_rank)
    out = []
    for grads in zip(*per_rank):
        total = np.zeros_like(np.asarray(grads[0], dtype=F32))
        for g in grads:
            total = total + np.asarray(g, dtype=F32)
        out.append(total / F32(size))
    return out


def reference(initial_weights, gradients, optimizer, pipeline_depth=1, warmup_steps=0,
              steps=None, size=None, flush=True, compensation=None, passes=1,
              average_passes=False, local=(), scale_local=True, predict_from=None):
    """Run `steps` pipelined steps from `initial_weights` and return a Result.

    gradients: gradients[step][rank] -> list of arrays, or a callable
    grad_fn(step, rank, weights) -> list of arrays (then `steps` and `size`
    are required). optimizer: an SGD or Adam above (fresh; built here).
    flush: apply what is still in flight at the end.
    compensation: None, "lookahead", "predict", "dc" or "momentum" (the module's
    docstring).
    passes (backward_passes_per_step): `steps` counts backward passes then; each
    rank sums its gradients over `passes` passes (float32, in order; divided by
    `passes` with average_passes) and every passes-th pass pushes that sum as one
    pipeline step (warm-up counts those steps); each pass between counts an
    iteration of the optimizer and applies nothing (Horovod's rule), and computes
    at the point the last step left (a prediction is made once per step). A cycle
    not finished at the end stays unapplied, as in the package.
    local: indices of variables whose gradient is not averaged: each rank applies
    its own, divided by size when scale_local (Horovod's register_local_var), so
    ranks differ in those variables, and every rank is simulated with its own
    weights and optimizer. A "lookahead" prediction runs the whole update and puts the
    local variables back: it moves the others only.
    predict_from(step, per_rank): what each rank's "lookahead" predicts from in place of
    its own gradients of pipeline step `step` (a list per rank; prediction_exchange's
    exchanged average).
    """
    if pipeline_depth < 1 or warmup_steps < 0 or passes < 1:
        raise ValueError("pipeline_depth >= 1, warmup_steps >= 0 and passes >= 1")
    if compensation not in (None, "lookahead", "predict", "dc", "momentum"):
        raise ValueError(f"no reference for compensation={compensation!r}")
    if pipeline_depth == 1:
        compensation = None
    if callable(gradients):
        if steps is None or size is None:
            raise ValueError("a gradient function needs steps= and size=")
        grad_fn = gradients
    else:
        steps = len(gradients) if steps is None else steps
        grad_fn = lambda t, r, w: gradients[t][r]  # noqa: E731
        size = len(gradients[0]) if size is None else size
    weights = [[np.array(w, dtype=F32, copy=True) for w in initial_weights]
               for _ in range(size)]
    optimizer.build(weights[0])
    optimizers = [optimizer] + [copy.deepcopy(optimizer) for _ in range(size - 1)]
    local = set(local)
    fifo, applied = [], []         # fifo: (step, each rank's gradient to apply, each rank's own)
    previous = None                # "predict": each rank's weights before the last step's updates
    computed_at = {}               # "dc": step -> each rank's weights its gradients were computed at
    mean_square = [[None] * len(initial_weights) for _ in range(size)]
    momentum = "momentum" if isinstance(optimizer, SGD) else "beta_1"
    sums = None                    # passes > 1: each rank's sum of this cycle's gradients

    def apply(step, grads, _, pushed):
        for r in range(size):
            opt, ws, g_r = optimizers[r], weights[r], list(grads[r])
            if compensation == "dc":
                for i, (g, w, w_then) in enumerate(zip(g_r, ws, computed_at[step][r])):
                    ms = g * g if mean_square[r][i] is None else F32(0.95) * mean_square[r][i] + \
                        F32(0.05) * (g * g)
                    mean_square[r][i] = ms
                    g_r[i] = g + F32(2.0) / (np.sqrt(ms) + F32(1e-7)) * g * g * (w - w_then)
            value = getattr(opt, momentum)
            if compensation == "momentum" and pushed > warmup_steps:
                tau = pipeline_depth - 1
                setattr(opt, momentum, max(0.0, value - tau / (tau + 1)))
            opt.update(ws, g_r)
            setattr(opt, momentum, value)
        computed_at.pop(step, None)
        applied.append(step)

    def point(rank):
        """Where rank `rank` computes its next gradient."""
        ahead = [w.copy() for w in weights[rank]]
        if compensation == "lookahead" and fifo:
            simulated = copy.deepcopy(optimizers[rank])
            for _, _, per_rank in fifo:
                simulated.update(ahead, per_rank[rank])
                for i in local:                  # not predicted
                    ahead[i] = weights[rank][i].copy()
        if compensation == "predict" and fifo:
            ahead = [w + len(fifo) * (w - w_prev)
                     for w, w_prev in zip(weights[rank], previous[rank])]
        return ahead

    pushed = 0
    points = [point(r) for r in range(size)]     # made once per step: passes between reuse it
    for t in range(steps):
        per_rank = [[np.asarray(g, dtype=F32) for g in grad_fn(t, r, points[r])]
                    for r in range(size)]
        if passes > 1:
            sums = per_rank if sums is None else [[s + g for s, g in zip(ss, gs)]
                                                  for ss, gs in zip(sums, per_rank)]
            if (t + 1) % passes:
                for opt in optimizers:
                    opt.iterations += 1
                continue
            per_rank, sums = sums, None
            if average_passes:
                per_rank = [[g / F32(passes) for g in gs] for gs in per_rank]
        step = pushed
        computed_at[step] = [[w.copy() for w in ws] for ws in weights]
        mean = average(per_rank)
        to_apply = [[(g * F32(1.0 / size) if scale_local else g) if i in local else mean[i]
                     for i, g in enumerate(per_rank[r])] for r in range(size)]
        fifo.append((step, to_apply, per_rank if predict_from is None
                     else predict_from(step, per_rank)))
        previous = [[w.copy() for w in ws] for ws in weights]
        need = 1 if step < warmup_steps else pipeline_depth
        pushed += 1
        while len(fifo) >= need:
            apply(*fifo.pop(0), pushed)
        points = [point(r) for r in range(size)]
    if flush:
        while fifo:
            apply(*fifo.pop(0), pushed)
    return Result(weights, optimizer, [(t, grads[0]) for t, grads, _ in fifo], applied, points)
