"""tune="auto" on TensorFlow: the tape and the Keras DistributedOptimizer in custom loops
(tensorflow_worker.py's case `auto`, run in the Keras fit launches on the TensorFlow
backend: one TensorFlow start-up per engine).

Timings are injected as tests/workers/auto_worker.py does for PyTorch: every step sleeps
COMPUTE_S outside the traced step (compute, as the run record counts it; BOUND_S where
compute alone is the bound), and the network-bound runs have a slow link (slow_link.py:
a reduction lands WAIT_S after its launch). Compute alone: auto stays at K=1. With the
link: K=2, no codec (at max(compute, link) every codec ties with none; the tie goes to
none): the tape chooses it on the prediction; the Keras optimizer tries it and keeps it.

For each of the tape and the optimizer:
- K=1 and K=2 outcomes: the decision is the same on every rank, in the run summary
  (written, read back) and in force; the weights equal, bit for bit, a run of the chosen
  configuration fixed with warmup_steps=N (the Keras oracle: its default lookahead and
  int4 prediction exchange at K=2); the optimizer's step is traced once.
- resume: a K=2 decision saved in a tf.train.Checkpoint mid-run (GradientsInFlight for the
  tape, the optimizer's own state for Keras); a fresh model restored from it with
  tune="auto" applies it at once and continues to the uninterrupted run's weights.
- undone (the Keras optimizer): compute grows during the trial, which measures slower than
  K=1 and is undone, the gradient in flight applied in the same step (the graph's second
  update); the weights equal, bit for bit, a fixed K=2 run to the trial's end, flushed,
  its checkpoint read by a K=1 optimizer that trains on.
- adopt (the Keras optimizer): a fixed K=2 run's checkpoint (a gradient in flight, no
  decision) read with tune="auto": the gradient in flight is applied at the first step,
  bit for bit as the fixed run one step further, flushed, then K=1.
On one rank auto has nothing to reduce: K=1, said why, and the K=1 oracle holds.
Wrap-time conflicts and ranks whose tune differs are told, naming both.
"""
import json
import math
import os
import time
from pathlib import Path

import keras
import tensorflow as tf

import pipe_horovod.engine as engine_module
import pipe_horovod.tensorflow as hvd
from pipe_horovod.compression import Compression
from pipe_horovod.pipeline import auto
from pipe_horovod.tensorflow import gradient_tape
from slow_link import SlowLink
from tuning_default import the_default

N = 8                             # PIPE_HOROVOD_TUNE_STEPS for these runs
TRIAL = 5                         # its trial's steps (auto.Tuner(N).trial_steps)
AFTER = TRIAL + 2                 # steps trained after the decision
COMPUTE_S = 0.08
BOUND_S = 0.25                    # compute alone: the real waits well under 2% of a step
SLOWER_S = 0.2                    # "undone": compute from the trial on
WAIT_S = 0.04
_folder = []                      # where this launch's files go (check_auto's directory)


class _TuneSteps:
    def __enter__(self):
        self.before = os.environ.get("PIPE_HOROVOD_TUNE_STEPS")
        os.environ["PIPE_HOROVOD_TUNE_STEPS"] = str(N)

    def __exit__(self, *exc):
        if self.before is None:
            os.environ.pop("PIPE_HOROVOD_TUNE_STEPS")
        else:
            os.environ["PIPE_HOROVOD_TUNE_STEPS"] = self.before


def _loop(step, start, steps, compute_s):
    """`compute_s`: seconds each step sleeps, or a function of the step."""
    from tensorflow_worker import rank_data
    for t in range(start, start + steps):
        step(*rank_data(hvd.rank(), t))
        seconds = compute_s(t) if callable(compute_s) else compute_s
        if seconds and hvd.size() > 1:           # (alone auto decides K=1 whatever it takes)
            time.sleep(seconds)


def _in(slow, run):
    if slow:
        with SlowLink(WAIT_S):
            return run()
    return run()


def _same_everywhere(decision, what):
    everyone = hvd.allgather_object(decision.as_dict())
    assert all(d == everyone[0] for d in everyone), (what, everyone)


def _summary_holds(write, decision, what):
    """The run summary rank 0 writes records the decision."""
    path = str(_folder[0] / f"{what.replace(' ', '_')}-{hvd.rank()}.json")
    assert write(path) == (path if hvd.rank() == 0 else None), what
    if hvd.rank() == 0:
        with open(path) as f:
            config = json.load(f)["config"]
        assert config["auto"] == json.loads(json.dumps(decision.as_dict())), (what, config)
        assert config["pipeline_depth"] == decision.pipeline_depth, (what, config)


def _fixed(decision):
    """The chosen configuration as explicit options, with warmup_steps=N: the oracle."""
    return {"pipeline_depth": decision.pipeline_depth, "warmup_steps": N,
            "compression": Compression.by_name(decision.compression),
            "bucket_cap_mb": decision.bucket_cap_mb}


def _expected(slow):
    """The decision auto must take here: (K, codec, cap); None: whichever it takes (the
    oracle still holds for it). Under Horovod's engine a reduction is answered by its
    background cycle, so a K=1 step there waits for real (about 10 ms against the 250 ms
    injected), and K=2 may rightly be tried: the K=1 outcome is checked under torchrun
    and in one process."""
    if not slow and hvd.size() > 1 and engine_module.current().name == "horovod":
        return None
    return (2 if slow and hvd.size() > 1 else 1), "none", None


def _check_decision(decision, slow, what):
    assert decision is not None, f"{what}: auto did not decide"
    expected = _expected(slow)
    if expected is not None:
        assert (decision.pipeline_depth, decision.compression, decision.bucket_cap_mb) == \
            expected, (what, decision)


# --- the tape -----------------------------------------------------------------------------
def _tape_run(options, steps, model=None, opt=None, start=0, compute_s=0.0):
    from tensorflow_worker import build, loss_of
    model = model or build()
    opt = opt or keras.optimizers.SGD(0.1)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_of(model, x, y)
        tape = hvd.DistributedGradientTape(tape, **options)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    _loop(step, start, steps, compute_s)
    return model, opt


def _flush_tape(model, opt):
    for grads in hvd.flush(model.trainable_variables):
        opt.apply_gradients(zip(grads, model.trainable_variables))


def _tape_machine(model):
    return gradient_tape._pipelines[(gradient_tape._key(model.trainable_variables),
                                     None)].machine


def _tape_outcome(slow):
    from tensorflow_worker import equal, weights_of
    what = f"tape auto ({'network' if slow else 'compute'}-bound)"
    model, opt = _in(slow, lambda: _tape_run({"tune": "auto"}, N + AFTER,
                                             compute_s=COMPUTE_S if slow else BOUND_S))
    machine = _tape_machine(model)
    decision = machine.tuner.decision
    _check_decision(decision, slow, what)
    assert machine.fifo.pipeline_depth == decision.pipeline_depth, what
    if hvd.size() == 1:
        assert decision.reason == "one rank: nothing to reduce", decision
    _same_everywhere(decision, what)
    _summary_holds(lambda path: hvd.write_run_summary(model.trainable_variables, path),
                   decision, what)
    _flush_tape(model, opt)
    oracle, oracle_opt = _tape_run(_fixed(decision), N + AFTER)
    _flush_tape(oracle, oracle_opt)
    equal(weights_of(model), weights_of(oracle), f"{what} against its oracle")


def _tape_resume(directory):
    from tensorflow_worker import build, equal, weights_of
    what = "tape auto resumed from GradientsInFlight"
    total, save_at = N + AFTER + 1, N + 2
    straight, straight_opt = _in(True, lambda: _tape_run({"tune": "auto"}, total,
                                                         compute_s=COMPUTE_S))
    _flush_tape(straight, straight_opt)
    model, opt = _in(True, lambda: _tape_run({"tune": "auto"}, save_at, compute_s=COMPUTE_S))
    saved_decision = _tape_machine(model).tuner.decision
    assert saved_decision.pipeline_depth == 2, saved_decision
    saved = tf.train.Checkpoint(
        model=model, optimizer=opt,
        pipeline=hvd.GradientsInFlight(model.trainable_variables)).write(
        str(directory / f"tape_auto_rank{hvd.rank()}"))
    _flush_tape(model, opt)                  # (nothing left in flight for the exit report)
    fresh, fresh_opt = build(seed=7), keras.optimizers.SGD(0.1)
    fresh_opt.build(fresh.trainable_variables)
    tf.train.Checkpoint(model=fresh, optimizer=fresh_opt,
                        pipeline=hvd.GradientsInFlight(fresh.trainable_variables)).read(
        saved).assert_consumed()
    _tape_run({"tune": "auto"}, 1, model=fresh, opt=fresh_opt, start=save_at)
    machine = _tape_machine(fresh)
    assert machine.tuner.decision == saved_decision, (what, machine.tuner.decision)
    assert machine.fifo.pipeline_depth == 2 and not machine.tuner.due(machine.fifo.steps), what
    _tape_run({"tune": "auto"}, total - save_at - 1, model=fresh, opt=fresh_opt,
              start=save_at + 1)
    _flush_tape(fresh, fresh_opt)
    equal(weights_of(fresh), weights_of(straight), what)


# --- the Keras optimizer --------------------------------------------------------------------
def _optimizer(**options):
    return hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), **options)


def _optimizer_run(opt, steps, model=None, start=0, compute_s=0.0, traces=None):
    from tensorflow_worker import build, loss_of
    model = model or build()

    @tf.function
    def step(x, y):
        if traces is not None:
            traces.append(1)
        with tf.GradientTape() as tape:
            loss = loss_of(model, x, y)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
    _loop(step, start, steps, compute_s)
    return model


def _optimizer_outcome(slow):
    from tensorflow_worker import equal, weights_of
    what = f"Keras optimizer auto ({'network' if slow else 'compute'}-bound)"
    traces = []
    with the_default():                  # what a user gets: tune="auto", nothing passed
        opt = _optimizer()
    model = _in(slow, lambda: _optimizer_run(opt, N + AFTER,
                                             compute_s=COMPUTE_S if slow else BOUND_S,
                                             traces=traces))
    assert len(traces) == 1, f"{what}: the step was traced {len(traces)} times"
    machine = opt._path.machine
    decision = machine.tuner.decision
    _check_decision(decision, slow, what)
    if hvd.size() > 1:
        # K=2 was priced with the lookahead's int4 exchange (the Keras default)
        assert machine.tuner.pins.exchange == "int4", machine.tuner.pins
        assert opt._path.lookahead and opt._path.exchanging, what
    assert opt._path.depth == decision.pipeline_depth, what
    _same_everywhere(decision, what)
    _summary_holds(opt.write_run_summary, decision, what)
    undone = decision.pipeline_depth == 1 and not math.isnan(decision.tried_s)
    if decision.pipeline_depth == 1:
        # Nothing in flight after a step (after a trial undone, nothing since)
        assert opt._path.prediction() is None and opt.in_flight == 0, what
    if decision.pipeline_depth == 1 and not undone:
        # The lookahead's branch never ran
        assert machine.timings.get("exchange_wait_s") is None, machine.timings
    opt.flush()
    if undone:
        oracle = _k2_then_k1(N + TRIAL, N + AFTER, warmup_steps=N)
    else:
        fixed = _optimizer(**_fixed(decision))
        oracle = _optimizer_run(fixed, N + AFTER)
        fixed.flush()
    equal(weights_of(model), weights_of(oracle), f"{what} against its oracle")


def _k2_then_k1(switch_at, total, **options):
    """The oracle of a run that leaves K=2 at step `switch_at`: a fixed K=2 run (with
    `options`) of that many steps, flushed, its checkpoint read by a K=1 optimizer that
    trains on to `total` steps (the lookahead's own variables are not read)."""
    fixed = _optimizer(pipeline_depth=2, **options)
    model = _optimizer_run(fixed, switch_at)
    fixed.flush()
    saved = tf.train.Checkpoint(optimizer=fixed).write(
        str(_folder[0] / f"k2_then_k1_at{switch_at}_rank{hvd.rank()}"))
    after = _optimizer(pipeline_depth=1)
    after.build(model.trainable_variables)
    tf.train.Checkpoint(optimizer=after).read(saved).expect_partial()
    _optimizer_run(after, total - switch_at, model=model, start=switch_at)
    after.flush()
    return model


def _read_fresh(model, opt, name):
    """`model` and `opt` written to a checkpoint (then `opt` flushed), read by a fresh
    model (another seed) and a tune="auto" optimizer: (the fresh pair, the read status)."""
    saved = tf.train.Checkpoint(model=model, optimizer=opt).write(
        str(_folder[0] / f"{name}_rank{hvd.rank()}"))
    opt.flush()
    from tensorflow_worker import build
    fresh, fresh_opt = build(seed=7), _optimizer(tune="auto")
    fresh_opt.build(fresh.trainable_variables)
    return fresh, fresh_opt, tf.train.Checkpoint(model=fresh, optimizer=fresh_opt).read(saved)


def _optimizer_adopt():
    """A fixed K=2 optimizer's checkpoint (a gradient in flight, no decision) read by one
    with tune="auto", which measures at K=1: the gradient in flight is applied at the first
    step with that step's own (the graph's second update); the weights equal the fixed run
    one step further, flushed, then K=1 from its checkpoint. Without staleness
    compensation: at K=1 auto makes no prediction, where the fixed run would."""
    from tensorflow_worker import equal, weights_of
    what = "Keras optimizer auto reading a fixed K=2 checkpoint"
    saved_at, more = 3, 4                    # fewer than N after it: auto stays measuring
    fixed = _optimizer(pipeline_depth=2, staleness_compensation=None)
    model = _optimizer_run(fixed, saved_at)
    assert fixed.in_flight == 1, what
    fresh, tuned, status = _read_fresh(model, fixed, "adopt")
    status.expect_partial()                  # (no lookahead variables in a fixed K=2 one)
    assert tuned.in_flight == 1, what
    _optimizer_run(tuned, more, model=fresh, start=saved_at)
    assert tuned.in_flight == 0 and tuned._path.machine.tuner.decision is None, what
    tuned.flush()
    oracle = _k2_then_k1(saved_at + 1, saved_at + more, staleness_compensation=None)
    equal(weights_of(fresh), weights_of(oracle), what)


def _optimizer_undone():
    from tensorflow_worker import equal, weights_of
    what = "Keras optimizer auto, its trial undone"
    opt = _optimizer(tune="auto")
    model = _in(True, lambda: _optimizer_run(
        opt, N + AFTER, compute_s=lambda t: COMPUTE_S if t < N else SLOWER_S))
    decision = opt._path.machine.tuner.decision
    assert (decision.pipeline_depth, decision.trying) == (1, False), (what, decision)
    assert decision.tried_s > decision.measured_s, (what, decision)
    assert opt._path.depth == 1 and opt.in_flight == 0, what
    assert opt._path.timings["applied"] == N + AFTER, (what, opt._path.timings["applied"])
    _same_everywhere(decision, what)
    opt.flush()
    equal(weights_of(model), weights_of(_k2_then_k1(N + TRIAL, N + AFTER, warmup_steps=N)),
          what)


def _optimizer_resume():
    from tensorflow_worker import equal, weights_of
    what = "Keras optimizer auto resumed from tf.train.Checkpoint"
    total, save_at = N + AFTER + 1, N + 2
    straight_opt = _optimizer(tune="auto")
    straight = _in(True, lambda: _optimizer_run(straight_opt, total, compute_s=COMPUTE_S))
    straight_opt.flush()
    opt = _optimizer(tune="auto")
    model = _in(True, lambda: _optimizer_run(opt, save_at, compute_s=COMPUTE_S))
    saved_decision = opt._path.machine.tuner.decision
    assert saved_decision.pipeline_depth == 2 and opt.in_flight == 1, saved_decision
    fresh, fresh_opt, status = _read_fresh(model, opt, "optimizer_auto")
    status.assert_consumed()
    machine = fresh_opt._path.machine
    assert machine.tuner.decision == saved_decision, (what, machine.tuner.decision)
    assert machine.fifo.pipeline_depth == 2 and fresh_opt.in_flight == 1, what
    _optimizer_run(fresh_opt, total - save_at, model=fresh, start=save_at)
    fresh_opt.flush()
    equal(weights_of(fresh), weights_of(straight), what)


# --- wrap time ------------------------------------------------------------------------------
def _conflicts():
    from tensorflow_worker import build, expect_error, loss_of, rank_data
    for wrap in (lambda **o: _optimizer(**o),
                 lambda **o: hvd.DistributedGradientTape(tf.GradientTape(), **o)):
        expect_error(ValueError, "pipeline_depth=3 with tune='auto': auto chooses K in (1, 2)",
                     lambda: wrap(tune="auto", pipeline_depth=3))
        expect_error(ValueError, "compression='fp16' with tune='auto'",
                     lambda: wrap(tune="auto", compression=hvd.Compression.fp16))
        expect_error(ValueError, f"warmup_steps=4 with tune='auto': auto trains the first {N} "
                     "steps synchronously", lambda: wrap(tune="auto", warmup_steps=4))
        expect_error(ValueError, "tune must be 'auto', 'off' or None (the default), got 'fast'",
                     lambda: wrap(tune="fast"))
    expect_error(ValueError, "compression='int8_ef' with collective='ring",
                 lambda: _optimizer(tune="auto", collective="ring",
                                    compression=hvd.Compression.int8_ef))
    # A saved model keeps tune and an unpinned depth (a reload chooses again), or the pin
    config = _optimizer(tune="auto").get_config()
    assert config["tune"] == "auto" and config["pipeline_depth"] is None, config
    again = _optimizer(tune="auto").from_config(config)
    assert again._tuning == (N, auto.Pins(exchange="int4")), again._tuning
    config = _optimizer(tune="auto", pipeline_depth=2).get_config()
    assert config["pipeline_depth"] == 2, config
    assert _optimizer().get_config()["tune"] is None
    if hvd.size() == 1:
        return
    mine = "auto" if hvd.rank() == 0 else None
    told = f"option tune is None on rank 1 but 'auto ({N} steps)' on rank 0"
    # The Keras optimizer compares at its first step, the tape at its first gradient
    opt = _optimizer(tune=mine)
    expect_error(ValueError, told, lambda: _optimizer_run(opt, 1))
    model = build()
    x, y = rank_data(hvd.rank(), 0)

    def tape_step():
        with tf.GradientTape() as tape:
            loss = loss_of(model, x, y)
        hvd.DistributedGradientTape(tape, tune=mine).gradient(loss, model.trainable_variables)
    expect_error(ValueError, told, tape_step)


def check_auto(directory):
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _folder[:] = [directory]
    with _TuneSteps():
        _conflicts()
        _tape_outcome(slow=False)
        _optimizer_outcome(slow=False)
        if hvd.size() > 1:
            _tape_outcome(slow=True)
            _optimizer_outcome(slow=True)
            _optimizer_undone()
            _optimizer_adopt()
            _tape_resume(directory)
            _optimizer_resume()
