"""A run that tunes itself: the default of the PyTorch and Keras optimizers (`tune="auto"`,
or PIPE_HOROVOD_TUNE=auto, in any adapter).

Why: what pays on one cluster loses on another. Where backward already hides the
allreduce, a pipeline (K=2) and a codec only cost; where the network is the bound, K=2
with a codec is several times faster. The run measures which it is from its own first
steps and decides, so a user who never reads the docs is never slower than synchronous
training and, where the network shows, much faster.

How: the first N steps (TUNE_STEPS, default 20; PIPE_HOROVOD_TUNE_STEPS) train
synchronously, at K=1 without codec (exact: what warm-up does), while the step
machine's run record measures compute, exposed wait and each bucket's launch and
landing. At the boundary after step N-1 the first rank of the set takes the record's
summary and predicts every candidate with the one timing model
(pipeline/measured_run.py: K in 1 and 2, each codec the convergence rule allows,
pipeline/convergence_rule.py; the run's buckets and each bucket cap), and picks the
fastest that meets the rule, or stays at K=1, no codec, its own buckets where nothing is
predicted faster than the measured step by MARGIN (5%). Its decision is broadcast
through the machine's object collective, so every rank applies the same one at the same
step. That rank logs one line (`describe`). A run of the chosen configuration with
warmup_steps=N computes the same weights, bit for bit: the FIFO's warm-up already ends
at step N, and the decision only raises its depth there.

K=2 is not taken on the prediction: it is tried for trial_steps(N) steps (K=2 alone
predicted TRIAL_MARGIN faster suffices; K=2 with a codec is tried without it first), then
kept where those steps measured KEEP_MARGIN faster than as many K=1 steps just before
(`confirm`, decided and broadcast the same way); else undone: back to K=1, the gradient
in flight applied in that same step, nothing lost. With a codec to follow, K=2 alone
that measured faster or within TRIAL_TOLERANCE of its prediction is followed by the
codec's own trial, as long: the codec is kept where its steps measured KEEP_MARGIN
faster than both K=2 alone and K=1, else the faster of those two stays, and the codec's
error-feedback residuals are added to the next reductions (the step machine folds them),
so nothing it held back is lost. The model prices the link the K=1 steps saw, not what
K=2 adds itself (the lookahead's second update and exchange, a link that is the same
cores as compute, as on loopback) nor what a codec's collectives cost on the path its
tensors take. A kept trial of K=2 alone is the chosen configuration from step N on, so
the oracle above holds; an undone one equals a K=2 run to the trial's end, flushed, then
K=1. Which codec, a codec at K=1 and a pinned one are chosen on the prediction alone,
and so is everything where the adapter cannot apply two gradients in one step (the tape
hands its user one: `Tuner(may_try=False)`).

The API an adapter wires (the PyTorch optimizer does; Keras and the tape take the same):

- `resolve_tune(tune, depth_given, default)` -> "auto" or None: the argument, else
  $PIPE_HOROVOD_TUNE, else the adapter's default where no depth was given; ValueError
  on anything else. `tune_steps()` -> N from $PIPE_HOROVOD_TUNE_STEPS.
- `check_pins(...)` -> Pins at wrap time: the explicit pipeline_depth, compression and
  bucket_cap_mb pin their dimension; a pin auto cannot honour (a depth other than 1 or
  2, a codec the convergence rule or the model refuses, warmup_steps shorter than N) is
  a ValueError naming both. `warmup_steps(N, W)` -> the FIFO's warm-up to build with.
- `Tuner(steps, pins, cap_bytes, may_try)`: give it to StepMachine(tune=...). The
  machine decides in finish_step (`Tuner.due`; again at a trial's end, and where a trial
  is undone returns what K=1 no longer holds in flight with the step's own, oldest
  first: the adapter applies each), applies the decision at that step boundary (depth,
  codec, wire format and error feedback, bucket cap: re-planned from its buckets'
  members; the gloo group a two-stage codec needs, opened there by every rank) and
  calls each method given to `StepMachine.tell_when_tuned` (held weakly) with the
  Decision, so the adapter updates what it keeps itself (its own depth, staleness
  compensation: K=2 uses the adapter's default, as the convergence rule measured it).
  Build the machine at K=1 with the pinned codec or none (`Tuner.measuring()`),
  warm-up `warmup_steps(N, W)`.
  `StepMachine.state()` carries the decision ("tune") and
  `StepMachine.restore_tuning(saved, steps)` applies it again on resume without
  measuring (call it before restoring the gradients in flight); a
  decision taken for another number of ranks is dropped and measured again, and
  `attach()` after an elastic reset that changed the size goes back to K=1 and decides
  again. `run_config()` records it in the run summary ("auto").
- `decide(summary, pins)` -> Decision: the pure decision (unit-testable with a summary
  built by hand); `Decision.as_dict()` / `Decision.from_dict()` for the wire and
  checkpoints; `describe(decision)` the line; `Tuner.too_short()` the words said once
  when a run ends (flush, or state taken) before it decided.
"""
import logging
import math
import numbers
import os
import warnings
from dataclasses import asdict, dataclass, replace

from .convergence_rule import CAPS_MB, CONVERGENCE, DEPTHS, convergence_failure, depth_failure
from .measured_run import candidates, measure, recommend, wire_ratio

TUNE_VARIABLE = "PIPE_HOROVOD_TUNE"
STEPS_VARIABLE = "PIPE_HOROVOD_TUNE_STEPS"
TUNE_STEPS = 20
MARGIN = 0.05              # a candidate must be predicted this much faster than K=1 as run
# A candidate without codec predicted TRIAL_MARGIN faster is tried instead (on adapters
# that can go back), and kept only where its trial measured KEEP_MARGIN faster than K=1.
TRIAL_MARGIN = 0.02
KEEP_MARGIN = 0.02
MIN_TRIAL_STEPS = 5        # measure() leaves out a trial's first two (the pipeline filling)
# K=2 tried before its codec is kept where it measured within this of its prediction.
TRIAL_TOLERANCE = 0.25
MIN_STEPS = 3              # measure() needs two recorded steps (the first has no start)
VALUES = ("auto",)
OFF_WORDS = ("off", "0", "none", "false")   # $PIPE_HOROVOD_TUNE: the configuration as given
_log = logging.getLogger("pipe_horovod")


def resolve_tune(tune, depth_given, default="auto", environ=None):
    """The tuning in force, "auto" or None (the configuration as given): `tune` when
    given ("auto", or "off"), else $PIPE_HOROVOD_TUNE, else the adapter's `default` -
    unless the user gave a pipeline depth (`depth_given`: the argument or
    $PIPE_HOROVOD_PIPELINE_DEPTH), which then means that configuration as given.

    Why the depth decides: a user who names K chose it, and tuning would first train
    N steps at K=1 (a script whose oracle or schedule counts on K from step 0 would
    silently change); a user who names nothing gets the run that is never slower than
    synchronous training. Raises ValueError naming the bad value."""
    if tune is None:
        environ = os.environ if environ is None else environ
        text = (environ.get(TUNE_VARIABLE) or "").strip().lower()
        if not text:
            return None if depth_given else default
        if text in OFF_WORDS:
            return None
        if text not in VALUES:
            raise ValueError(f"{TUNE_VARIABLE} must be 'auto' or 'off' (or unset), got "
                             f"{environ.get(TUNE_VARIABLE)!r}")
        return "auto"
    if tune not in VALUES + ("off",):
        raise ValueError(f"tune must be 'auto', 'off' or None (the default), got {tune!r}")
    return None if tune == "off" else tune


def tune_steps(environ=None):
    """N, the synchronous steps measured before deciding: $PIPE_HOROVOD_TUNE_STEPS or 20."""
    environ = os.environ if environ is None else environ
    text = (environ.get(STEPS_VARIABLE) or "").strip()
    if not text:
        return TUNE_STEPS
    try:
        steps = int(text)
    except ValueError:
        steps = -1
    if steps < MIN_STEPS:
        raise ValueError(f"{STEPS_VARIABLE} must be an integer >= {MIN_STEPS} (steps measured "
                         f"before tune='auto' decides), got {text!r}")
    return steps


@dataclass(frozen=True)
class Pins:
    """What the user fixed beside tune="auto": None where auto chooses."""

    pipeline_depth: int = None
    compression: str = None        # a config name ("int8_ef", "int4_ef:32", "none")
    bucket_cap_mb: float = None
    codecs_allowed: bool = True    # False where the path cannot take a two-stage codec
    # The prediction exchange a K=2 step adds ("int4", "int8"; the Keras default's
    # lookahead sends one): K=2 candidates are priced with its wire bytes. Not a pin.
    exchange: str = None


def check_pins(steps, pipeline_depth=None, compression=None, bucket_cap_mb=None,
               warmup_steps=0, collective=None, op_allows_codecs=True, exchange=None):
    """Pins for tune="auto" from the options the user gave explicitly (None: not given;
    `compression` a config name, given only where it is not the default "none").

    Raises ValueError naming the option and auto where auto cannot honour it: a depth
    whose convergence the rule does not know (auto chooses K in DEPTHS), a codec the rule
    refuses or the model does not price, warmup_steps shorter than the N steps auto
    measures synchronously. `exchange`: the prediction exchange the adapter's staleness
    compensation sends at K=2 (staleness.check_prediction_exchange's), priced with K=2."""
    if pipeline_depth is not None and depth_failure(pipeline_depth) is not None:
        raise ValueError(f"pipeline_depth={pipeline_depth} with tune='auto': auto chooses K "
                         f"in {DEPTHS} under the convergence rule "
                         f"({depth_failure(pipeline_depth)}); pass pipeline_depth="
                         f"{' or '.join(map(str, DEPTHS))}, or pass tune='off'")
    if compression is not None and compression != "none":
        if collective is not None:
            raise ValueError(f"compression={compression!r} with collective={collective!r} and "
                             f"tune='auto': auto prices codecs on the engine's path only; "
                             f"drop the collective or pass tune='off'")
        failure = convergence_failure(compression)
        try:
            wire_ratio(compression)
        except ValueError:
            failure = failure or "the timing model does not price it"
        if failure is not None:
            raise ValueError(f"compression={compression!r} with tune='auto': auto chooses only "
                             f"codecs that meet the convergence rule ({failure}); pass one of "
                             f"{', '.join(c for c in CONVERGENCE if not CONVERGENCE[c])}, or "
                             f"pass tune='off'")
    if warmup_steps and warmup_steps < steps:
        raise ValueError(f"warmup_steps={warmup_steps} with tune='auto': auto trains the first "
                         f"{steps} steps synchronously to measure them ({STEPS_VARIABLE}); pass "
                         f"warmup_steps >= {steps}, or none")
    return Pins(pipeline_depth, compression, bucket_cap_mb,
                codecs_allowed=collective is None and op_allows_codecs, exchange=exchange)


def pins_from_options(pinned_depth, compression, pinned_cap, warmup_steps, collective=None,
                      op=None, exchange=None):
    """(the steps auto measures, Pins) from an adapter's options as the user passed them:
    `compression` a Compression (none is not a pin), `collective` a Collective or None,
    `op` the reduction (None: Average), `exchange` the lookahead's prediction exchange
    priced with K=2 (None where none is sent). The one rule every adapter wraps with;
    a conflict is check_pins's ValueError naming both."""
    from .. import engine
    from ..compression import Compression, config_name

    steps = tune_steps()
    codec = None
    if compression is not Compression.none:
        try:
            codec = config_name(compression)
        except (AttributeError, ValueError):
            codec = getattr(compression, "name", type(compression).__name__)
    pins = check_pins(steps, pinned_depth, codec, pinned_cap, warmup_steps,
                      None if collective is None else collective.describe(),
                      op in (None, engine.Average, engine.Sum), exchange)
    return steps, pins


def tuning(tune, depth_given, pins, *, default="auto", stacklevel=2):
    """(steps, Pins) where the run tunes itself, else None: the one rule every adapter
    wraps with. `tune`, `depth_given`, `default`: resolve_tune's; `pins()` computes
    pins_from_options from the adapter's options.

    Where auto was asked for (the argument or $PIPE_HOROVOD_TUNE), an option it cannot
    honour is pins()'s ValueError naming both. Where auto is only the default, such an
    option (a codec the convergence rule refuses, a warm-up shorter than the measured
    steps) says what the user wants instead: the configuration as given applies, and a
    UserWarning naming the caller's line says why, so nothing changes silently."""
    asked = tune is not None or bool((os.environ.get(TUNE_VARIABLE) or "").strip())
    if resolve_tune(tune, depth_given, default) is None:
        return None
    try:
        return pins()
    except ValueError as refused:
        if asked:
            raise
        warnings.warn(f"pipe_horovod: tune='auto' (the default) does not apply: {refused}. "
                      f"The configuration as given applies (tune='off' says so and silences "
                      f"this)", UserWarning, stacklevel=stacklevel + 1)
        return None


def trial_steps(steps):
    """How long a trial runs after `steps` measured ones: half as long, MIN_TRIAL_STEPS at
    least (its first two are left out of its median)."""
    return max(MIN_TRIAL_STEPS, -(-steps // 2))


def settle_steps(steps=None):
    """The steps a tuned run may take before it runs what it chose for good: the measured
    ones (`steps`, else tune_steps()) and two trials' (K=2 alone, then its codec). For
    benchmarks timing what it chose."""
    steps = tune_steps() if steps is None else steps
    return steps + 2 * trial_steps(steps)


def warmup_steps(steps, given):
    """The FIFO's warm-up for a tuned run: its first `steps` are synchronous (the
    measured ones), or more where the user asked for more."""
    return max(steps, given or 0)


@dataclass(frozen=True)
class Decision:
    """What auto chose and why, as every rank applies it and a checkpoint keeps it."""

    pipeline_depth: int
    compression: str                  # config name
    bucket_cap_mb: float = None       # None: the buckets as run
    workers: int = 1
    compute_s: float = math.nan       # measured, per step (medians)
    wait_s: float = math.nan
    link_gbps: float = math.nan       # the link that reproduces the measured step
    predicted_s: float = math.nan     # the chosen candidate's step
    gain: float = 1.0                 # measured K=1 step / predicted_s
    steps: int = 0                    # how many steps the medians are of
    reason: str = ""                  # why K=1 as run, where it is that
    # A trial: applied for the Tuner's trial steps, then kept or undone by what they
    # measured (`confirm`). measured_s: the K=1 step the trial must beat; tried_s: the
    # trial's own step, once measured.
    trying: bool = False
    measured_s: float = math.nan
    tried_s: float = math.nan
    # K=2 with a codec chosen: the trial runs K=2 without it (what the model predicted
    # for that, trial_predicted_s), and a kept trial then takes then_compression.
    then_compression: str = None
    trial_predicted_s: float = math.nan
    # The codec's own trial, which follows a kept trial of K=2 alone: what K=2 alone
    # measured there (NaN otherwise). The codec is kept only where its steps beat both.
    alone_s: float = math.nan

    def as_dict(self):
        return {k: (None if isinstance(v, float) and math.isnan(v) else v)
                for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data):
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**{k: (math.nan if v is None and k in _TIMES else v)
                      for k, v in known.items()})


_TIMES = ("compute_s", "wait_s", "link_gbps", "predicted_s", "measured_s", "tried_s",
          "trial_predicted_s", "alone_s")


def unchanged(workers, reason, pins=Pins(), measured=None, link_gbps=math.nan):
    """K=1 (or the pinned depth), no codec (or the pinned one), the buckets as run."""
    figures = {} if measured is None else {
        "compute_s": measured.compute_s, "wait_s": measured.wait_s, "link_gbps": link_gbps,
        "predicted_s": measured.step_s, "steps": measured.steps}
    return Decision(pins.pipeline_depth or 1, pins.compression or "none", pins.bucket_cap_mb,
                    workers, reason=reason, **figures)


def decide(summary, pins=Pins(), margin=MARGIN, latency_s=0.0, may_try=False):
    """The decision from a run summary (RunRecord.summary()) of synchronous steps at K=1.

    Candidates are predicted by measured_run.candidates (one model with `plan
    --from-run`), narrowed to the pins; the fastest that meets the convergence rule wins
    where it is predicted faster than the measured step by `margin`, else the run stays
    as it is (K=1 or the pinned depth, no codec or the pinned one, its buckets).

    `may_try` (an adapter that can go back to K=1 with a gradient in flight): a K=2
    winner is a trial (`trying`), which `confirm` keeps or undoes from what its own steps
    measured; without codec, a prediction TRIAL_MARGIN faster suffices; with a codec
    (`margin` faster), the trial runs K=2 without it, then the codec in a trial of its
    own. Why: the model prices the link the measured steps saw, not what K=2 itself adds
    (the lookahead's second update, its exchange, a link that is the same cores as
    compute), nor what the codec's collectives cost on the tensors' path; trying K=2
    alone first tells which of the two a slow trial is. Which codec, and a pinned one,
    stay the prediction's."""
    config = summary["config"]
    workers = config["workers"]
    if workers < 2:
        return unchanged(workers, "one rank: nothing to reduce", pins)
    if len(summary.get("steps") or ()) < 2 or not summary.get("reductions"):
        return unchanged(workers, "too few steps measured", pins)
    measured = measure(summary)
    if not measured.step_s > 0:
        return unchanged(workers, "no step time measured", pins, measured)
    depths = (pins.pipeline_depth,) if pins.pipeline_depth else DEPTHS
    if pins.compression is not None:
        codecs = (pins.compression,)
    else:
        codecs = tuple(c for c in CONVERGENCE if convergence_failure(c) is None)
        codecs = codecs if pins.codecs_allowed else ("none",)
    caps = () if pins.bucket_cap_mb is not None else CAPS_MB
    network, every = candidates(summary, measured, latency_s, depths=depths, codecs=codecs,
                                caps_mb=caps, exchange=pins.exchange)
    link = 8 / network.beta / 1e9 if network.beta > 0 else math.inf
    best, _ = recommend(every)
    # The baseline: what the run does without auto (the pins honoured, as run).
    base = [c for c in every if c.depth == depths[0] and c.codec == codecs[0]
            and c.cap == "as run"]
    base_s = base[0].step_s if base and pins.pipeline_depth else measured.step_s
    trying = (may_try and best.depth == 2 and not pins.pipeline_depth
              and (best.codec == "none" or pins.compression is None))
    bar = TRIAL_MARGIN if trying and best.codec == "none" else margin
    if not best.step_s * (1 + bar) < base_s:
        gained = base_s / best.step_s if best.step_s > 0 else 1.0
        return unchanged(workers, f"nothing predicted {bar:.0%} faster (best: K="
                         f"{best.depth} + {best.codec}, {gained:.2f}x)", pins, measured, link)
    cap = best.cap_mb if pins.bucket_cap_mb is None else pins.bucket_cap_mb
    chosen = Decision(best.depth, best.codec, cap, workers, measured.compute_s,
                      measured.wait_s, link, best.step_s, measured.step_s / best.step_s,
                      measured.steps, measured_s=measured.step_s)
    if not trying:
        return chosen
    if best.codec == "none":
        return replace(chosen, trying=True)
    # K=2 with a codec: K=2 is tried without it (a codec's residuals could not be left
    # behind), and the codec follows where K=2 itself ran as predicted.
    alone = [c for c in every if c.depth == 2 and c.codec == "none" and c.cap == best.cap]
    return replace(chosen, compression="none", trying=True, then_compression=best.codec,
                   trial_predicted_s=alone[0].step_s if alone else math.nan)


def confirm(summary, trial, tried_from, pins=Pins()):
    """A trial's outcome: `trial` (a Decision trying) kept where its steps from
    `tried_from` on measured KEEP_MARGIN faster than as many K=1 steps right before it
    (the same medians, measure(): the last measured steps, past the run's own warm-up,
    at the machine's load of the moment), else the run as it was (the pins honoured),
    saying what each measured. Without those K=1 steps (a trial resumed from a
    checkpoint) it compares with the measured step the trial was decided from."""
    tried_steps = [s for s in summary["steps"] if s["step"] >= tried_from]
    tried = measure({**summary, "steps": tried_steps}).step_s if tried_steps else math.nan
    if not math.isnan(trial.alone_s):
        return _confirm_codec(trial, tried, pins)
    before = [s for s in summary["steps"]
              if tried_from - len(tried_steps) <= s["step"] < tried_from]
    base = (measure({**summary, "steps": before}).step_s if len(before) == len(tried_steps)
            else trial.measured_s)
    # K=2 before its codec: the codec is tried next where K=2 ran as the model predicted
    # it (the codec may then gain what was predicted), even where K=2 alone gains little
    # on a saturated link
    if trial.then_compression is not None and (
            tried * (1 + KEEP_MARGIN) < base
            or tried <= trial.trial_predicted_s * (1 + TRIAL_TOLERANCE)):
        return replace(trial, compression=trial.then_compression, then_compression=None,
                       measured_s=base, alone_s=tried)
    if tried * (1 + KEEP_MARGIN) < base:
        return replace(trial, trying=False, measured_s=base, tried_s=tried)
    expected = ("" if trial.then_compression is None else
                f", {trial.trial_predicted_s * 1e3:.1f} ms predicted before + "
                f"{trial.then_compression}")
    words = (f"tried K={trial.pipeline_depth}, no codec (predicted {trial.gain:.2f}x): "
             f"{tried * 1e3:.1f} ms a step against {base * 1e3:.1f} ms at K=1{expected}")
    return replace(unchanged(trial.workers, words, pins), compute_s=trial.compute_s,
                   wait_s=trial.wait_s, link_gbps=trial.link_gbps, steps=trial.steps,
                   predicted_s=trial.measured_s, measured_s=base, tried_s=tried)


def _confirm_codec(trial, coded, pins):
    """The codec's trial (K=2 with it, after K=2 alone was kept): kept where its steps
    measured KEEP_MARGIN faster than both K=2 alone and K=1 (`trial.alone_s`,
    `trial.measured_s`); else the faster of those two, measured, stays. Why: the model
    prices the wire bytes a codec saves, not what its collectives cost on this path (on
    a GPU whose tensors Horovod stages through the host, int4_ef:32 in two stages ran
    1.3x slower than K=1, predicted 6.8x faster). Going back from the codec loses
    nothing: the step machine adds its error feedback's residuals to the next reductions."""
    base, alone = trial.measured_s, trial.alone_s
    if coded * (1 + KEEP_MARGIN) < min(base, alone):
        return replace(trial, trying=False, tried_s=coded)
    words = (f"tried K=2 + {trial.compression}: {coded * 1e3:.1f} ms a step against "
             f"{alone * 1e3:.1f} ms without it and {base * 1e3:.1f} ms at K=1")
    if alone * (1 + KEEP_MARGIN) < base:
        return replace(trial, trying=False, compression="none", tried_s=alone,
                       reason=words + "; K=2 without it kept")
    return replace(unchanged(trial.workers, words, pins), compute_s=trial.compute_s,
                   wait_s=trial.wait_s, link_gbps=trial.link_gbps, steps=trial.steps,
                   predicted_s=trial.measured_s, measured_s=base, tried_s=coded,
                   alone_s=alone)


def describe(decision, trial_steps=None):
    """The line rank 0 logs: the inputs and the predicted gain (a trial: for how many
    steps, `trial_steps`; its outcome: what it measured)."""
    d = decision
    if math.isnan(d.compute_s):
        return f"pipe_horovod auto: K={d.pipeline_depth}, compression {d.compression} ({d.reason})"
    link = "unbounded" if math.isinf(d.link_gbps) else f"{d.link_gbps:.3g} Gbit/s"
    head = (f"pipe_horovod auto: compute {d.compute_s * 1e3:.0f} ms, exposed wait "
            f"{d.wait_s * 1e3:.0f} ms, link {link} (median of {d.steps} steps)")
    codec = ", no codec" if d.compression == "none" else (
        f" + {d.compression} (two-stage)" if wire_ratio(d.compression) < 0.5
        else f" + {d.compression}")
    buckets = "as run" if d.bucket_cap_mb is None else f"{d.bucket_cap_mb:g} MiB"
    if d.reason:
        return f"{head} -> K={d.pipeline_depth}{codec}, buckets {buckets}: {d.reason}"
    then = "" if d.then_compression is None else f", then + {d.then_compression}"
    line = (f"{head} -> {'trying ' if d.trying else ''}K={d.pipeline_depth}{codec}, buckets "
            f"{buckets}{f' for {trial_steps} steps{then}' if d.trying else ''}: predicted "
            f"{d.gain:.2f}x over K=1")
    if d.trying and not math.isnan(d.alone_s):
        line += (f"; K=2 without it measured {d.measured_s / d.alone_s:.2f}x ("
                 f"{d.alone_s * 1e3:.1f} ms a step against {d.measured_s * 1e3:.1f} ms)")
    if not math.isnan(d.tried_s):
        line += (f", kept: its trial measured {d.measured_s / d.tried_s:.2f}x ("
                 f"{d.tried_s * 1e3:.1f} ms a step against {d.measured_s * 1e3:.1f} ms)")
    return line


class Tuner:
    """A step machine's tuning state (StepMachine(tune=Tuner(...)))."""

    def __init__(self, steps, pins=Pins(), cap_bytes=None, may_try=True):
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or \
                steps < MIN_STEPS:
            raise ValueError(f"tune steps must be an integer >= {MIN_STEPS}, got {steps!r}")
        self.steps = int(steps)
        self.pins = pins
        self.initial_cap_bytes = cap_bytes   # the cap the measured steps ran with
        self.decision = None
        self.measure_from = 0                # the step count measuring began at
        # Whether the adapter can go back to K=1 with a gradient in flight (it applies
        # two in one step): where it cannot (the tape hands its user one), no trials.
        self.may_try = may_try
        self.trial_steps = trial_steps(self.steps)
        self.tried_from = 0                  # the step count a trial began at
        self._told_short = False

    def due(self, steps_pushed):
        """Whether to decide now: the measured steps are done, or a trial's."""
        if self.decision is None:
            return steps_pushed - self.measure_from >= self.steps
        return self.decision.trying and steps_pushed - self.tried_from >= self.trial_steps

    def measuring(self):
        """The configuration the measured steps run in: K=1, no codec (or the pinned
        one), the buckets the machine was built with."""
        return Decision(1, self.pins.compression or "none", None, reason="measuring")

    def restart(self, steps_pushed):
        """Measure again from here (an elastic reset changed the ranks)."""
        self.decision = None
        self.measure_from = steps_pushed
        self._told_short = False

    def too_short(self, steps_pushed):
        """The words said once where the run flushes, saves or ends before it decided
        (a run shorter than the measured steps trains at K=1 throughout), else None."""
        if self.decision is not None or self._told_short:
            return None
        self._told_short = True
        done = steps_pushed - self.measure_from
        return (f"pipe_horovod auto: {done} step(s) measured of the {self.steps} auto needs "
                f"({STEPS_VARIABLE}) before it decides: the run trains at K=1"
                f"{'' if not self.pins.compression else ' with ' + self.pins.compression}"
                f"{' without codec' if not self.pins.compression else ''} until then (a run "
                f"that ends sooner, throughout)")


def announce(tuner, process_set, announced):
    """Rank 0 of the set says, once per setting, that the run tunes itself and when."""
    from .. import engine

    first = 0 if process_set is None else process_set.ranks[0]
    key = ("auto", tuner.steps, tuner.pins)
    if engine.rank() != first or key in announced:
        return
    announced.add(key)
    pins = ", ".join(f"{name}={value!r}" for name, value in (
        ("pipeline_depth", tuner.pins.pipeline_depth), ("compression", tuner.pins.compression),
        ("bucket_cap_mb", tuner.pins.bucket_cap_mb)) if value is not None)
    log(f"pipe_horovod: tune='auto': the first {tuner.steps} steps train synchronously "
        f"(K=1) while they are measured, then the depth, codec and bucket size predicted "
        f"fastest under the convergence rule apply on every rank"
        + (f" (pinned: {pins})" if pins else ""))


def log(line):
    _log.warning("%s", line)
