"""tune="auto" for the Keras DistributedOptimizer in model.fit (keras_worker.py's mode
`auto`, in the torchrun launch of each backend), priced with the Keras default's int4
prediction exchange: on torch the PyTorch adapter underneath runs it; on TensorFlow the
train step is traced for what the pipeline needs and traced again when that changes
(once measured at K=1; twice where a trial was undone, K=1's function coming back; three
times where K=2 was kept).

Timings are injected as tests/workers/auto_worker.py does: a callback sleeps COMPUTE_S
after every batch (compute, as the run record counts it; BOUND_S where compute alone is
the bound); the network-bound run also has a slow link (slow_link.py: a reduction lands
WAIT_S after its launch). Compute alone: K=1; with the link: K=2, no codec, tried and
kept. Each outcome: the same decision on every rank, in the
run summary, and fit's weights equal, bit for bit, a fit of the chosen configuration with
warmup_steps=N (the Keras default lookahead and exchange at K=2). The optimizer's state
(what model.save and broadcasts carry) holds the decision; a fresh optimizer loading it
applies it without measuring.
"""
import json
import math
import os
import time

import keras
import numpy as np

import pipe_horovod.keras as phvd
from pipe_horovod.compression import Compression
from slow_link import SlowLink
from tuning_default import the_default

N = 8
TRIAL = 5                         # a trial's steps (auto.Tuner(N).trial_steps)
BATCHES = N + TRIAL + 2           # measured, a trial, two more
COMPUTE_S = 0.08
BOUND_S = 0.25                    # compute alone: the real waits well under 2% of a step
WAIT_S = 0.04


class _Compute(keras.callbacks.Callback):
    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(self.seconds)


def _build():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, activation="tanh"),
                             keras.layers.Dense(3)])


def _data():
    rng = np.random.default_rng(phvd.rank())
    return (rng.normal(size=(8 * BATCHES, 4)).astype("float32"),
            rng.normal(size=(8 * BATCHES, 3)).astype("float32"))


def _optimizer(options):
    return phvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), **options)


def _machine(opt):
    path = opt._path
    return path.machine if keras.backend.backend() == "tensorflow" else \
        path.torch_optimizer._machine


def _fit(options, slow=False, timed=False, model=None, batches=slice(0, BATCHES), opt=None,
         traces=None):
    """`batches` of the data fitted (on `model`, else a fresh one) and flushed; `traces`
    (on TensorFlow) gets a 1 for each trace of the train step's update."""
    model = model or _build()
    opt = opt or _optimizer(options)
    model.compile(opt, "mse")
    if traces is not None and keras.backend.backend() == "tensorflow":
        opt.build(model.trainable_variables)
        apply = opt._path.apply
        opt._path.apply = lambda *args: (traces.append(1), apply(*args))[1]
    compute = [_Compute(COMPUTE_S if slow else BOUND_S)] if timed else []
    rows = slice(8 * batches.start, 8 * batches.stop)
    x, y = (part[rows] for part in _data())
    if slow:
        with SlowLink(WAIT_S):
            model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False,
                      callbacks=compute)
    else:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=compute)
    opt.flush()
    return model, opt


def _k2_then_k1(switch_at):
    """The oracle of a fit that leaves K=2 at batch `switch_at` (a trial undone): a fixed
    K=2 fit (warmup_steps=N) of that many batches, flushed, its optimizer's state (what
    model.save and the broadcasts carry) loaded by a K=1 optimizer that fits the rest."""
    model, fixed = _fit({"pipeline_depth": 2, "warmup_steps": N}, batches=slice(0, switch_at))
    store = {}
    fixed.save_own_variables(store)
    after = _optimizer({"pipeline_depth": 1})
    after.build(model.trainable_variables)
    after.load_own_variables(store)
    return _fit({}, model=model, opt=after, batches=slice(switch_at, BATCHES))[0]


def _outcome(slow, folder):
    what = f"Keras {keras.backend.backend()} auto ({'network' if slow else 'compute'}-bound)"
    traces = []
    with the_default():                  # what a user gets: tune="auto", nothing passed
        model, opt = _fit({}, slow=slow, timed=True, traces=traces)
    machine = _machine(opt)
    decision = machine.tuner.decision
    assert decision is not None, f"{what}: auto did not decide"
    assert (decision.pipeline_depth, decision.compression, decision.bucket_cap_mb,
            decision.trying) == (2 if slow else 1, "none", None, False), (what, decision)
    # Compute-bound, a busy machine's real waits can pass TRIAL_MARGIN of the step (6 ms
    # of 254 ms was seen): K=2 is then rightly tried, and undone.
    undone = decision.pipeline_depth == 1 and not math.isnan(decision.tried_s)
    if keras.backend.backend() == "tensorflow":
        # A trial: traced for it, then for K=2 kept; undone, K=1's first trace again.
        assert len(traces) == (3 if slow else 2 if undone else 1), (what, len(traces))
    assert machine.tuner.pins.exchange == "int4", machine.tuner.pins
    everyone = phvd.allgather_object(decision.as_dict())
    assert all(d == everyone[0] for d in everyone), (what, everyone)
    path = str(folder / f"keras-auto-{int(slow)}-{phvd.rank()}.json")
    assert opt.write_run_summary(path) == (path if phvd.rank() == 0 else None), what
    if phvd.rank() == 0:
        with open(path) as f:
            assert json.load(f)["config"]["auto"] == json.loads(
                json.dumps(decision.as_dict())), what
    if undone:
        oracle = _k2_then_k1(N + TRIAL)
    else:
        oracle, _ = _fit({"pipeline_depth": decision.pipeline_depth, "warmup_steps": N,
                          "compression": Compression.by_name(decision.compression),
                          "bucket_cap_mb": decision.bucket_cap_mb})
    for i, (a, b) in enumerate(zip(model.get_weights(), oracle.get_weights())):
        assert np.array_equal(a, b), f"{what}: weight {i} differs from its oracle"
    if keras.backend.backend() == "tensorflow":
        # Outside fit (train_on_batch here, its input traced once more) the step holds
        # everything auto may come to need.
        x, y = _data()
        model.train_on_batch(x[:8], y[:8])
        assert len(traces) == (4 if slow else 3 if undone else 2), (what, len(traces))
        ran, needed = opt.step_holds()
        assert ran == needed == (True, True), (what, ran, needed)
    return model, opt, decision


def check_auto(folder):
    before = os.environ.get("PIPE_HOROVOD_TUNE_STEPS")
    os.environ["PIPE_HOROVOD_TUNE_STEPS"] = str(N)
    try:
        _outcome(False, folder)
        model, opt, decision = _outcome(True, folder)
        store = {}
        opt.save_own_variables(store)         # what model.save and the broadcasts carry
        saved = json.loads(bytes(np.asarray(store["pipe_horovod"])).decode())
        assert saved["tune"] == json.loads(json.dumps(decision.as_dict())), saved["tune"]
        fresh = phvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
                                          tune="auto")
        fresh.build(model.trainable_variables)
        fresh.load_own_variables(store)
        machine = _machine(fresh)
        assert machine.tuner.decision == decision, machine.tuner.decision
        assert machine.fifo.pipeline_depth == 2 and not machine.tuner.due(machine.fifo.steps)
    finally:
        if before is None:
            os.environ.pop("PIPE_HOROVOD_TUNE_STEPS")
        else:
            os.environ["PIPE_HOROVOD_TUNE_STEPS"] = before
