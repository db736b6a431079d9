"""Staleness compensation: make a gradient K-1 steps old act like a fresh one.

With pipeline_depth K >= 2 the update of step t applies g computed at
w_{t-K+1}. At the learning rate synchronous SGD was tuned for, that delay
can make training oscillate early on (docs/convergence.md measures it). Each option below changes either where the gradient is
computed or what is applied, and is a no-op for K=1 and during warm-up:

* ``"lookahead"`` (ours; the best in docs/convergence.md): every rank computes its
  gradient at the weights the updates still in flight will produce,
  estimated by the wrapped optimizer's rule applied, from its current
  state, to this rank's own gradients of those steps, which it already
  has (PyTorch: in closed form for SGD/Adam/AdamW, torch/lookahead.py;
  otherwise its own step on a temporary copy of the state). With
  one rank this is exactly synchronous SGD; with several, the point
  differs from it only by the learning rate times the gap between one
  rank's gradient and the average. Weight prediction as in PipeMare
  (Yang et al. 2021) and SpecTrain (Chen et al. 2018), but along the
  optimizer's own next update rather than a smoothed velocity.
* ``"predict"``: the same, extrapolating linearly along the last update:
  w + s * (w - w_prev) for s steps in flight (PipeMare's and SAPipe's
  weight prediction).
* ``"dc"``: delay compensation (Zheng et al. 2017, DC-ASGD-a):
  g + lambda_t * g * g * (w_now - w_then), with the adaptive
  lambda_t = DC_LAMBDA / sqrt(mean square of g + eps).
* ``"momentum"``: a delay of tau steps acts like momentum tau/(tau+1)
  (Mitliagkas et al. 2016, "Asynchrony begets momentum"), so the wrapped
  optimizer's momentum is reduced by that much (never below 0) while the
  pipeline is full.

The math is written with operators NumPy arrays and torch tensors share,
so adapters of any framework use these functions unchanged.
"""

OPTIONS = ("lookahead", "predict", "dc", "momentum")
# What "lookahead" may predict from instead of this rank's own gradient: the ranks' average
# of the step in flight, exchanged quantized in this wire format as backward produces it
# and waited for at step() (the step machine's `exchange`). Every rank then predicts the
# same point, centred on sync's next weights; the own gradient's spread about the average
# is what costs the default its lag on some models (docs/convergence.md).
EXCHANGES = ("int4", "int8")
AUTO_EXCHANGE = "auto"
# What a user gets without choosing: the only option that kept up with synchronous
# training on all three tasks of docs/convergence.md (plain K=2 lost 1.5-8 points).
DEFAULT = "lookahead"
DC_LAMBDA = 2.0          # lambda_0 of DC-ASGD-a, as in its paper's experiments
DC_DECAY = 0.95          # decay of the mean square of the gradient (DC-ASGD-a's m)
DC_EPS = 1e-7


def check_staleness(option):
    """None or one of OPTIONS; anything else is named in the error."""
    if option is None or option in OPTIONS:
        return option
    if not isinstance(option, str):
        raise TypeError(f"staleness_compensation must be None or a string, got "
                        f"{type(option).__name__}")
    raise ValueError(f"staleness_compensation must be None or one of {', '.join(OPTIONS)}; "
                     f"got {option!r}")


def check_prediction_exchange(exchange, compensation):
    """None or one of EXCHANGES, where `compensation` is "lookahead" (what it feeds).

    "auto" (the Keras adapter's default): "int4" where the compensation is
    "lookahead", else None. On Keras models the own gradient's spread cost the
    default up to 0.06 val loss against sync where the int4 exchange kept every
    cell of the sweep of Keras settings within 0.02, for 1/8 of the gradient's bytes a step.
    """
    if exchange == AUTO_EXCHANGE:
        return EXCHANGES[0] if compensation == "lookahead" else None
    if exchange is None:
        return None
    if not isinstance(exchange, str):
        raise TypeError(f"prediction_exchange must be None or a string, got "
                        f"{type(exchange).__name__}")
    if exchange not in EXCHANGES:
        raise ValueError(f"prediction_exchange must be None, {AUTO_EXCHANGE!r} or one of "
                         f"{', '.join(EXCHANGES)}; got {exchange!r}")
    if compensation != "lookahead":
        raise ValueError(f"prediction_exchange={exchange!r} feeds the lookahead prediction: it "
                         f"needs staleness_compensation='lookahead', got {compensation!r}")
    return exchange


def implicit_momentum(delay):
    """The momentum a fixed delay of `delay` steps behaves like (Mitliagkas et al.)."""
    return delay / (delay + 1)


def reduced_momentum(momentum, delay):
    """The explicit momentum that, with the delay's implicit one, adds up to `momentum`."""
    return max(0.0, momentum - implicit_momentum(delay))


def dc_mean_square(mean_square, grad):
    """DC-ASGD-a's running mean of g*g (None: the first gradient starts it)."""
    if mean_square is None:
        return grad * grad
    return DC_DECAY * mean_square + (1 - DC_DECAY) * (grad * grad)


def delay_compensated(grad, mean_square, weights_now, weights_then):
    """g + lambda_t * g * g * (w_now - w_then): the first-order Taylor correction of
    DC-ASGD, with g*g standing in for the Hessian's diagonal."""
    lam = DC_LAMBDA / ((mean_square ** 0.5) + DC_EPS)
    return grad + lam * grad * grad * (weights_now - weights_then)


def extrapolated(weights, previous, steps):
    """w + steps * (w - w_prev): linear weight prediction `steps` updates ahead."""
    return weights + steps * (weights - previous)
