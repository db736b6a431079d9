"""Launched on N ranks: Keras 3 `model.fit` with the pipelined optimizer, against the
NumPy reference (tests/keras_reference.py). KERAS_BACKEND picks the backend.

`python keras_worker.py MODE[,MODE...] [ARGS]`:
  memory                 test_memory's: keras_memory_worker with keras_launches.MEMORY_ARGS
                         (one process on TensorFlow, TF_CPU_ALLOCATOR_USE_BFC=true); first
  oracle                 SGD+momentum and Adam, K = 1, 2, 3, warm-up 0 and 2 (plain Pipe-SGD);
                         on several ranks also reduced by collective="ring"
  staleness              the same with staleness_compensation="lookahead", K = 2, 3 (with one
                         rank equal to K=1 bit for bit); on several ranks also "settings";
                         on TensorFlow one run_eagerly case too; on torch one case of each
                         other option
  settings               AdamW with CosineDecay's warm-up and global_clipnorm, SGD with
                         ExponentialDecay, clipnorm and weight decay, under lookahead
  full K OUT             all STEPS steps, then flush; weights to OUT (.npz)
  save K CKPT            SAVE_AT steps, then save the model (gradients in flight)
  full,save K OUT CKPT   both, in one launch, other optimizers; also among other modes
                         (`oracle,full,save,api K OUT CKPT`), so that a checkpoint test's
                         first launch is a fit test's (TensorFlow starts slowly). Before
                         overlap: its slowed reductions stay slow
  resume K CKPT OUT      new processes: load CKPT, fit the rest, flush (each of these three
                         runs plain Pipe-SGD in Horovod's pattern: rank 0 saves, rank 0 alone
                         loads and BroadcastGlobalVariablesCallback gives the others its
                         state; and "lookahead", int8 with error feedback per ring hop and
                         int8 with error feedback in two stages on the engine's collectives,
                         each rank saving and loading its own: the files are named after the
                         case, and the rank)
  callbacks              Horovod's callbacks together, different initial weights per rank;
                         its warm-up and schedule rates and momentum correction
  aggregation            backward_passes_per_step and local variables against the reference
                         at K=1 and K=2; Horovod's _compute_gradients path; from_config
  metrics                flush_in_fit (the default): validation, evaluate and the built-in
                         checkpoint callbacks see the real weights, the same on every rank, on
                         a model built by its first batch (broadcast after it)
  errors                 bad input: a clear error on every rank, and no hang after it
  auto                   tune="auto" in fit (keras_auto.py): K=1 and K=2 outcomes (and a
                         trial undone) bit for bit against the chosen configuration with
                         warmup_steps=N, its decision everywhere, in the summary and state;
                         on TensorFlow the step traced again only when what it holds changes
  overlap                with reductions slowed by a fixed delay, K=2 steps beat K=1's
  tf.CASE                on TensorFlow: tensorflow_worker.py's custom-loop CASE (api, tape,
                         optimizer, checkpoint, errors) with pipe_horovod.tensorflow
  midsave                on TensorFlow, K=2 lookahead: files written mid-epoch in fit
                         (ModelCheckpoint with save_freq, both formats; a callback's
                         save_weights) hold the real weights; load_model of one resumes
                         bit-identically; outside fit's writers, a warning or real_weights().
                         Files in $PIPE_HOROVOD_TEST_DIR
  api                    horovod.tensorflow.keras's allreduce, allgather, broadcast,
                         reducescatter, and load_model (on rank 0 alone) of a plain and a
                         pipelined checkpoint; files in $PIPE_HOROVOD_TEST_DIR. Last in a
                         launch (rank 0 alone builds optimizers)
"""
import contextlib
import copy
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import numpy as np  # noqa: E402
import keras  # noqa: E402

import keras_reference as ref  # noqa: E402
import launcher  # noqa: E402
import pipe_horovod.keras as phvd  # noqa: E402
from pipe_horovod.pipeline.staleness import check_prediction_exchange  # noqa: E402
from tolerance import gamma, relative_error, training_rtol  # noqa: E402

STEPS, SAVE_AT, BATCH, IN, HIDDEN, OUT = 12, 5, 8, 4, 5, 3


def rank_data(rank, step):
    return ref.rank_data(rank, step, BATCH, IN, OUT)


def fit_data(rank, start, stop):
    xs, ys = zip(*[rank_data(rank, t) for t in range(start, stop)])
    return np.concatenate(xs), np.concatenate(ys)


def build(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((IN,)), keras.layers.Dense(HIDDEN, name="hidden"),
                             keras.layers.Dense(OUT, name="out")])


def gradients(step, rank, weights):
    """d/dw of Keras's mean squared error for the two linear layers, by hand."""
    w1, b1, w2, b2 = weights
    x, y = rank_data(rank, step)
    h = x @ w1 + b1
    d_out = 2 * (h @ w2 + b2 - y) / np.float32(y.size)
    d_h = d_out @ w2.T
    return [x.T @ d_h, d_h.sum(0), h.T @ d_out, d_out.sum(0)]


def make(kind):
    if kind == "sgd":
        return keras.optimizers.SGD(0.05, momentum=0.9), ref.SGD(0.05, momentum=0.9)
    if kind == "adam":
        return keras.optimizers.Adam(0.01), ref.Adam(0.01)
    # What Keras's apply does around the rule: a schedule read at the iteration
    # count, clipping of the gradient it is given, decoupled weight decay.
    schedules = keras.optimizers.schedules
    if kind == "adamw-cosine-global":
        return (keras.optimizers.AdamW(schedules.CosineDecay(
                    0.0, STEPS - 4, alpha=0.1, warmup_target=0.03, warmup_steps=4),
                    weight_decay=0.2, beta_2=0.95, global_clipnorm=0.5),
                ref.Adam(ref.cosine_decay(0.0, STEPS - 4, alpha=0.1, warmup_target=0.03,
                                          warmup_steps=4),
                         weight_decay=0.2, beta_2=0.95, global_clipnorm=0.5))
    assert kind == "sgd-exponential-clipnorm", kind
    return (keras.optimizers.SGD(schedules.ExponentialDecay(0.05, 4, 0.5), momentum=0.9,
                                 weight_decay=0.1, clipnorm=0.3),
            ref.SGD(ref.exponential_decay(0.05, 4, 0.5), momentum=0.9, weight_decay=0.1,
                    clipnorm=0.3))


def fit(model, start, stop, callbacks=()):
    x, y = fit_data(phvd.rank(), start, stop)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=list(callbacks))


def weights_of(model):
    return [np.asarray(keras.ops.convert_to_numpy(v)) for v in model.trainable_variables]


def fit_rtol(kind, depth=1, compensation=None):
    """How far STEPS steps of this model may stray from the float32 NumPy reference by
    rounding alone (tests/tolerance.py), with `kind`'s rule run once per update and, under
    "lookahead", K - 1 more times per step for the prediction."""
    predicted = depth - 1 if compensation == "lookahead" else 0
    clipped = (IN * HIDDEN + HIDDEN + HIDDEN * OUT + OUT if "global" in kind
               else IN * HIDDEN if "clipnorm" in kind else 0)
    settings = kind not in ("sgd", "adam")       # make()'s: each decays and is scheduled
    return training_rtol(steps=STEPS, fan_ins=(IN, HIDDEN, OUT), batch=BATCH,
                         ranks=phvd.size(), optimizer="adam" if kind.startswith("adam")
                         else "momentum", predicted=predicted, clipped=clipped,
                         decayed=settings, scheduled=settings)


def assert_close(got, want, what, rtol):
    for i, (a, b) in enumerate(zip(got, want)):
        err = relative_error(a, b)
        assert err <= rtol, (f"{what}: variable {i} differs from the reference by {err:.3g} "
                             f"(rounding allows {rtol:.3g})")


def compiled(optimizer, model=None):
    model = model or build()
    model.compile(optimizer=optimizer, loss="mse")
    return model


class AtLastBatch(keras.callbacks.Callback):
    """Calls `call` after fit's last training batch (before fit ends); keeps its result."""

    def __init__(self, call):
        super().__init__()
        self.call, self.result = call, None

    def on_train_batch_end(self, batch, logs=None):
        if batch + 1 == self.params["steps"]:
            self.result = self.call()


TRACES = {}                # TensorFlow: the data path -> times its apply() was traced


def count_traces():
    """Count, per optimizer, the traces of the train step's apply on TensorFlow: a fit
    traces its train step once (the optimizer's variables are made outside the trace;
    made inside it, TensorFlow traced the whole step twice)."""
    from pipe_horovod.tensorflow.keras_path import TensorFlowPath

    traced = TensorFlowPath.apply

    def apply(self, *args):
        TRACES[self] = TRACES.get(self, 0) + 1
        return traced(self, *args)
    TensorFlowPath.apply = apply


def check_case(kind, depth, warmup, compensation=None, eagerly=False, predivide=1.0,
               collective=None, passes=1, average=False, local=(), exchange=None):
    """fit STEPS steps against the reference, then flush against it again (flush_in_fit off:
    the pipeline's state after fit is what is checked).

    One process with nothing to send runs lookahead at depth 1 (its prediction is the
    next update); a predivide factor of 2 (exact) sends its gradients through the engine.
    passes: backward_passes_per_step (average: average_aggregated_gradients); local: the
    indices of variables registered local. exchange: prediction_exchange ("default": not
    passed, the Keras default, int4 with lookahead). With an
    exchange, each exchange is checked exactly against the
    two-stage reference of what every rank sent, and the reference predicts from the
    averages the run exchanged: an int4 code a rounding away from its boundary flips with
    the gradient's last bits, which the backends and NumPy round differently, and the
    prediction then moves by a grid step, beyond any rounding bound."""
    what = (f"{keras.backend.backend()} {kind} K={depth} W={warmup} {compensation}"
            f"{' eagerly' if eagerly else ''} predivide {predivide} collective {collective} "
            f"passes {passes}{' averaged' if average else ''} local {list(local)}"
            f"{f' exchange {exchange}' if exchange else ''}")
    keras_opt, ref_opt = make(kind)
    opt = phvd.DistributedOptimizer(keras_opt, pipeline_depth=depth, warmup_steps=warmup,
                                    bucket_cap_mb=1e-5, staleness_compensation=compensation,
                                    gradient_predivide_factor=predivide, collective=collective,
                                    backward_passes_per_step=passes,
                                    average_aggregated_gradients=average, flush_in_fit=False,
                                    **({} if exchange == "default"
                                       else {"prediction_exchange": exchange}))
    exchange = check_prediction_exchange("auto" if exchange == "default" else exchange,
                                         compensation)
    if phvd.size() == 1 and compensation == "lookahead" and predivide == 1.0:
        depth, exchange = 1, None            # alone: no prediction, nothing exchanged
    model = build()
    for i in local:
        opt.register_local_var(model.trainable_variables[i])
    model.compile(optimizer=opt, loss="mse", run_eagerly=eagerly)
    start = weights_of(model)
    last = AtLastBatch(lambda: weights_of(model))
    exchanges = ExchangeLog()
    with exchanges if exchange else contextlib.nullcontext():
        fit(model, 0, STEPS, [last])
    if keras.backend.backend() == "tensorflow" and not eagerly:
        assert TRACES.get(opt._path) == 1, f"{what}: traced {TRACES.get(opt._path)} times"
    options = {"steps": STEPS, "size": phvd.size(), "compensation": compensation,
               "passes": passes, "average_passes": average, "local": local,
               "predict_from": exchanges.check(exchange, opt._path.names, model, what)
               if exchange else None}
    expected = ref.reference(start, gradients, ref_opt, depth, warmup, flush=False, **options)
    assert int(opt.iterations.numpy()) == expected.iterations, what
    assert opt.in_flight == len(expected.fifo), what
    # During fit on TensorFlow the model holds the weights this rank computes its next
    # gradient at (its own prediction); on torch the prediction is made at the next
    # forward pass (torch/compensation.py), so a batch's end sees the real weights. fit
    # ends with the real ones.
    rtol = fit_rtol(kind, depth, compensation)
    mine = expected.rank_weights[phvd.rank()]
    at_last = mine if keras.backend.backend() == "torch" else expected.points[phvd.rank()]
    assert_close(last.result, at_last, what + " (last batch)", rtol)
    if exchange and keras.backend.backend() == "tensorflow":
        # Every rank predicts from the same exchanged average: the same point, bit for bit
        # (a local variable is not predicted: each rank's own real one).
        everyone = phvd.allgather_object(last.result)
        assert all(np.array_equal(theirs[i], last.result[i]) for theirs in everyone
                   for i in range(len(last.result)) if i not in local), \
            f"{what}: the ranks predicted different points"
    assert_close(weights_of(model), mine, what, rtol)
    opt.flush()
    expected = ref.reference(start, gradients, make(kind)[1], depth, warmup, **options)
    assert int(opt.iterations.numpy()) == STEPS, what
    assert opt.timings["applied"] == STEPS // passes, what
    assert opt.timings["steps"] == STEPS // passes, what
    _check_run_record(opt, STEPS // passes, what, reduced=phvd.size() > 1 and not local)
    assert_close(weights_of(model), expected.rank_weights[phvd.rank()], what + " after flush",
                 rtol)
    # The bound still tells the pipelines apart: one step more or less of delay moves the
    # weights beyond it (so a wrong order or a dropped gradient cannot pass).
    if depth > 1 and warmup < STEPS and compensation is None:
        other = ref.reference(start, gradients, make(kind)[1], depth - 1, warmup,
                              **{**options, "compensation": None})
        assert relative_error(other.weights[0], expected.weights[0]) > rtol, what
    return weights_of(model)


SYNC = {}                  # kind -> weights after fit and flush at K=1 (check_oracle's)


def check_memory():
    """The Keras adapter's live memory, as `pipe-horovod memory --framework keras` measures
    it: MEMORY lines for test_memory.py, which asserts them."""
    from keras_launches import MEMORY_ARGS
    from pipe_horovod.tools.bench import keras_memory_worker

    keras_memory_worker.run(keras_memory_worker.parse_args(MEMORY_ARGS))


def check_oracle():
    for kind in ("sgd", "adam"):
        for depth in (1, 2, 3):
            for warmup in (0, 2):
                weights = check_case(kind, depth, warmup)
                if depth == 1:
                    SYNC[kind] = weights
    if phvd.size() > 1:
        # Two ranks' float32 average is the same sum in either order: ring matches exactly.
        check_case("adam", 2, 1, collective="ring")
        check_case("sgd", 3, 0, collective="ring")


def check_staleness():
    alone = phvd.size() == 1
    for kind in ("sgd", "adam"):
        sync = SYNC.get(kind) or check_case(kind, 1, 0)
        for depth in (2, 3):
            for warmup in (0, 2):
                got = check_case(kind, depth, warmup, "lookahead", predivide=2.0 if alone else 1)
                if alone:
                    # One rank's own gradient is the average: the prediction is exact.
                    for i, (a, b) in enumerate(zip(got, sync)):
                        assert np.array_equal(a, b), f"{kind} K={depth} W={warmup}: variable " \
                                                     f"{i} differs from K=1"
    if alone:
        check_case("sgd", 3, 0, "lookahead")     # depth 1: nothing to send
    else:
        check_settings()
    if keras.backend.backend() == "tensorflow":
        if alone:
            check_case("adam", 3, 2, "lookahead", eagerly=True, predivide=2.0)
        return
    # The PyTorch adapter runs the other options (its stand-in optimizer's step is Keras's).
    for kind, depth, warmup, option in (("sgd", 3, 2, "predict"), ("adam", 2, 0, "dc"),
                                        ("sgd", 2, 1, "momentum"), ("adam", 3, 0, "momentum")):
        check_case(kind, depth, warmup, option)


class ExchangeLog:
    """This rank's prediction exchanges during a fit, by pipeline step: what each bucket
    sent and the average that came back ({step: {name: flat tensor}}), logged around
    pipe_horovod's own quantized allreduce and StepMachine.estimates."""

    def __enter__(self):
        from pipe_horovod.collectives import quantized
        from pipe_horovod.pipeline.step_machine import StepMachine

        self.sent, self.got, pending = {}, {}, {}
        send, estimates = quantized.allreduce_async, StepMachine.estimates
        self._undo = [(quantized, "allreduce_async", send), (StepMachine, "estimates", estimates)]

        def logged_send(tensor, name=None, *args, **kwargs):
            if name is not None and name.endswith(".x"):       # the step machine's exchange
                pending[name] = tensor.detach().clone()
            return send(tensor, name, *args, **kwargs)

        def logged_estimates(machine):
            out, step = estimates(machine), machine.fifo.steps
            for bucket in machine.buckets:
                flat = pending.pop(f"{machine.prefix}.{bucket.index}.{bucket.numel}.x", None)
                if flat is not None:
                    self.sent.setdefault(step, {}).update(
                        (name, flat[at:at + numel]) for name, at, numel in bucket.offsets())
            if out:
                self.got[step] = {n: v.clone() for n, v in out.items()}
            return out
        quantized.allreduce_async, StepMachine.estimates = logged_send, logged_estimates
        return self

    def __exit__(self, *exc):
        for owner, attribute, original in self._undo:
            setattr(owner, attribute, original)

    def check(self, exchange, names, model, what):
        """Assert every exchange exact against the two-stage reference of what every rank
        sent; return keras_reference's predict_from: the averages exchanged, by step (the
        own gradient for a variable not exchanged)."""
        import torch
        from quantized_worker import reference_two_stage
        from pipe_horovod.compression.two_stage import WireFormat

        everyone = phvd.allgather_object(self.sent)
        assert self.got and set(self.got) == set(self.sent), f"{what}: exchanges {self.got}"
        for step, averages in self.got.items():
            for name, got in averages.items():
                want = reference_two_stage([theirs[step][name] for theirs in everyone],
                                           WireFormat(exchange))
                assert torch.equal(got, want), f"{what}: step {step}'s exchange of {name} is " \
                                               f"{(got - want).abs().max():.3g} off"
        shapes = [tuple(v.shape) for v in model.trainable_variables]

        def predict_from(step, per_rank):
            averages = self.got.get(step, {})
            return [[averages[n].numpy().reshape(shapes[i]) if n in averages else g
                     for i, (n, g) in enumerate(zip(names, own))] for own in per_rank]
        return predict_from


def check_settings():
    """A schedule, clipping and weight decay in the real update and in the prediction:
    lookahead runs the whole of Keras's apply on this rank's own gradient, at the
    iteration count the update it predicts will have."""
    check_case("adamw-cosine-global", 2, 0, "lookahead")
    check_case("sgd-exponential-clipnorm", 3, 1, "lookahead")
    # prediction_exchange: the prediction from the ranks' exchanged average.
    check_case("adamw-cosine-global", 2, 0, "lookahead", exchange="default")   # int4
    check_case("sgd-exponential-clipnorm", 3, 1, "lookahead", exchange="int8")


def check_aggregation():
    """backward_passes_per_step (summed, and averaged), local variables, and both together,
    at K=1 and K=2, against the reference; then Horovod's Keras 2 entry points
    (_compute_gradients + apply_gradients) with both, and from_config leaving its input
    alone."""
    # Each case traces a new train step (seconds on TensorFlow): the features combined.
    for kind, depth, passes, average, local in (("sgd", 1, 2, True, (1, 2)),
                                                ("adam", 2, 3, False, (0,))):
        check_case(kind, depth, 0, passes=passes, average=average, local=local)
    check_case("adam", 2, 0, "lookahead", passes=2, average=True, local=(1,))
    if keras.backend.backend() == "tensorflow":
        check_compute_gradients()
    opt = phvd.DistributedOptimizer(keras.optimizers.Adam(0.01), backward_passes_per_step=2)
    config = opt.get_config()
    kept = copy.deepcopy(config)
    assert opt.from_config(config).get_config() == kept and config == kept, "from_config"


def check_compute_gradients():
    """_compute_gradients reduces now: x's gradient is averaged over ranks, the local y's is
    this rank's / size; with backward_passes_per_step=2 summed over 2 passes and applied on
    the second, every pass an iteration (Horovod's rule, as its
    test_gradient_aggregation_with_local_vars has it); with 1, every pass reduced and
    applied (its test_partial_distributed_optimizer)."""
    import tensorflow as tf

    r, n = phvd.rank(), phvd.size()
    mean = sum(k + 1 for k in range(n)) / n
    for passes in (1, 2):
        opt = phvd.DistributedOptimizer(keras.optimizers.SGD(1.0),
                                        backward_passes_per_step=passes)
        x, y = tf.Variable([0.0, 0.0]), tf.Variable([0.0])
        opt.register_local_var(y)

        @tf.function
        def step():
            grads_and_vars = opt._compute_gradients(
                lambda: tf.reduce_sum(x * float(r + 1)) + tf.reduce_sum(y * float(r + 1)),
                [x, y])
            opt.apply_gradients(grads_and_vars, experimental_aggregate_gradients=False)
            return [g for g, _ in grads_and_vars]
        for i in range(4):
            gx, gy = step()
            cycles = (i + 1) // passes
            reduced = (i + 1) % passes == 0
            assert int(opt.iterations.numpy()) == i + 1
            if passes > 1:
                assert int(opt._agg_helper.counter.numpy()) == (i + 1) % passes
            # the reduced sum, or this rank's so far
            want_x = passes * mean if reduced else r + 1.0
            want_y = passes * (r + 1) / n if reduced else r + 1.0
            assert gx.numpy().tolist() == [want_x] * 2 and gy.numpy().tolist() == [want_y], \
                (passes, i, gx, gy)
            assert x.numpy().tolist() == [-passes * mean * cycles] * 2, (passes, i, x)
            assert y.numpy().tolist() == [-passes * (r + 1) / n * cycles], (passes, i, y)


def case_file(path, compensation, rank=None):
    path = Path(path)
    return path.with_name(f"{compensation}{'' if rank is None else f'-rank{rank}'}-{path.name}")


# label -> the optimizer's options. Plain: Horovod's pattern (rank 0 saves, rank 0 alone loads
# it, the broadcast callback gives the others its state). Lookahead and int8 with error
# feedback: each rank saves and loads its own (its prediction used its own gradients; its
# residuals are what its own encodes lost).
CHECKPOINT_CASES = {
    "None": {"staleness_compensation": None},
    "lookahead": {"staleness_compensation": "lookahead"},
    "int8": {"staleness_compensation": None, "compression": phvd.Compression.int8_ef,
             "collective": "ring"},
    # int8 in two stages on the engine's own alltoall + allgather: both residuals saved.
    "int8-engine": {"staleness_compensation": None, "compression": phvd.Compression.int8_ef},
}


def check_checkpoint(mode, depth, path, out=None):
    for label in CHECKPOINT_CASES:
        own = label != "None" and mode != "full"
        checkpoint_case(mode, int(depth), label,
                        case_file(path, label, phvd.rank() if own else None),
                        out and case_file(out, label))
    if mode in ("save", "resume"):
        auto_cap_case(mode, case_file(path, "auto-cap", phvd.rank()))


def auto_cap_case(mode, path):
    """bucket_cap_mb=None (automatic) is saved as None, not as the number it resolved to, so a
    reload (maybe on another world size) chooses again; an explicit cap is kept (1e-5 above)."""
    from pipe_horovod.pipeline.buckets import AutoBucketCap, resolve_bucket_cap_mb

    if mode == "save":
        opt = phvd.DistributedOptimizer(keras.optimizers.Adam(0.01), pipeline_depth=2)
        assert isinstance(opt._pipe_options["bucket_cap_mb"], AutoBucketCap)
        compiled(opt).save(path)
        return
    model = keras.models.load_model(path)
    assert model.optimizer.get_config()["bucket_cap_mb"] is None
    cap = model.optimizer._pipe_options["bucket_cap_mb"]
    assert isinstance(cap, AutoBucketCap) and cap == resolve_bucket_cap_mb(None), cap


def checkpoint_case(mode, depth, label, path, out):
    options = CHECKPOINT_CASES[label]
    if mode == "resume" and label == "None" and phvd.rank() != 0:
        # Rank 0 alone loads: its load_model must not wait for the others (it builds the
        # optimizer), and the callback must bring them everything it loaded.
        opt = checkpointed_optimizer(depth, options)
        model = compiled(opt, build(seed=1))     # other weights: the broadcast must fix them
        fit(model, SAVE_AT, STEPS, [phvd.callbacks.BroadcastGlobalVariablesCallback(0)])
        assert opt.in_flight == depth - 1
    elif mode == "resume":
        model = keras.models.load_model(path)
        assert isinstance(model.optimizer, keras.optimizers.Adam)
        config = model.optimizer.get_config()
        assert config["staleness_compensation"] == options["staleness_compensation"]
        assert config["compression"] == options.get("compression", phvd.Compression.none).name
        assert (config["collective"] or {}).get("algorithm") == options.get("collective")
        assert config["bucket_cap_mb"] == 1e-5, "an explicit cap is kept as it was"
        assert model.optimizer.in_flight == depth - 1, "the gradients in flight must be restored"
        fit(model, SAVE_AT, STEPS, [phvd.callbacks.BroadcastGlobalVariablesCallback(0)]
            if label == "None" else [])
    else:
        opt = checkpointed_optimizer(depth, options)
        model = compiled(opt)
        if mode == "save":
            # Saved during fit, as ModelCheckpoint does: the model holds predicted weights.
            saving = phvd.rank() == 0 or label != "None"
            fit(model, 0, SAVE_AT, [AtLastBatch(lambda: saving and model.save(path))])
            assert opt.in_flight == depth - 1
            phvd.allreduce(0, f"saved.{label}")   # a barrier: the files exist for all
            return
        fit(model, 0, STEPS)
        out = path
    model.optimizer.flush()
    everyone = phvd.allgather_object(weights_of(model))
    assert all(np.array_equal(a, b) for theirs in everyone for a, b in zip(theirs, everyone[0]))
    if phvd.rank() == 0:
        np.savez(out, *weights_of(model), iterations=int(model.optimizer.iterations.numpy()))


def checkpointed_optimizer(depth, options):
    """flush_in_fit=False: the checkpoints are saved, and loaded, with gradients in flight."""
    return phvd.DistributedOptimizer(keras.optimizers.Adam(0.01), pipeline_depth=depth,
                                     bucket_cap_mb=1e-5, flush_in_fit=False, **options)


def check_callbacks():
    """Every rank starts from other weights; the callbacks make them one run. Horovod's
    warm-up and schedule rates, batch by batch, and its momentum correction."""
    lr = 0.05 * phvd.size()
    opt = phvd.DistributedOptimizer(keras.optimizers.SGD(lr, momentum=0.9), pipeline_depth=2,
                                    bucket_cap_mb=1e-5)
    model = compiled(opt, build(seed=phvd.rank()))
    x, y = fit_data(phvd.rank(), 0, STEPS)
    rates = RateProbe()
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                        validation_data=(x, y), callbacks=[
                            phvd.callbacks.BroadcastGlobalVariablesCallback(0),
                            phvd.callbacks.MetricAverageCallback(),
                            phvd.callbacks.LearningRateWarmupCallback(lr, warmup_epochs=1),
                            rates, phvd.callbacks.PipelineFlushCallback()])
    assert opt.in_flight == 0, "PipelineFlushCallback must leave nothing in flight"
    assert int(opt.iterations.numpy()) == 2 * STEPS
    # Horovod's warm-up: lr / size * (e * (size - 1) / warmup + 1), e = (batch + 1) / steps,
    # then left alone; each change scales the momentum buffers by new / old rate.
    n = phvd.size()
    want = [np.float32(lr / n * ((b + 1) / STEPS * (n - 1) + 1)) for b in range(STEPS)]
    assert rates.rates[:STEPS] == want, (rates.rates, want)
    assert rates.rates[STEPS:] == [want[-1]] * STEPS and history.history["lr"][-1] == want[-1]
    if n > 1:
        assert rates.corrected and all(abs(got - r) <= 4 * gamma(2, "float32") * abs(r)
                                       for got, r in rates.corrected), rates.corrected
    # The same weights everywhere, and the averaged metrics agree across ranks.
    mine = np.concatenate([w.ravel() for w in weights_of(model)])
    total = phvd.allreduce(mine, "weights", op=phvd.Sum)
    assert np.array_equal(total, mine * phvd.size()), "ranks ended with different weights"
    for key in ("loss", "val_loss"):
        values = np.array(history.history[key])
        assert np.array_equal(phvd.allreduce(values, key, op=phvd.Sum), values * phvd.size()), key
    # Validation ran on flushed weights: evaluating now gives the last val_loss (same data).
    loss = phvd.allreduce(model.evaluate(x, y, batch_size=BATCH, verbose=0), "eval")
    # Both are the mean over STEPS batches of each batch's mean squared error after a forward
    # pass, averaged over ranks: two such sums differ by rounding alone.
    ops = IN + HIDDEN + BATCH * OUT + STEPS + phvd.size()
    assert abs(loss - history.history["val_loss"][-1]) <= 2 * gamma(ops, "float32") * abs(loss), (
        loss, history.history["val_loss"])
    # Horovod's staircase schedules: untouched before start_epoch, then lr * 0.5**epoch from a
    # function; a number m means m ** (epoch - start_epoch).
    for multiplier, factors in ((lambda epoch: 0.5 ** epoch, (1, 0.5, 0.25)), (0.5, (1, 1, 0.5))):
        opt.learning_rate = lr
        schedule = phvd.callbacks.LearningRateScheduleCallback(initial_lr=lr, start_epoch=1,
                                                              multiplier=multiplier)
        history = model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0,
                            callbacks=[schedule])
        assert history.history["lr"] == [np.float32(lr * m) for m in factors], history.history
    expect_error(ValueError, "BestModelCheckpoint needs its filepath", lambda: model.fit(
        x, y, batch_size=BATCH, epochs=1, verbose=0,
        callbacks=[phvd.callbacks.BestModelCheckpoint(monitor="loss")]))
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    scheduled = compiled(phvd.DistributedOptimizer(keras.optimizers.SGD(schedule)))
    expect_error(ValueError, "LearningRateWarmupCallback sets the optimizer's learning rate",
                 lambda: scheduled.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[
                     phvd.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=1)]))


class RateProbe(keras.callbacks.Callback):
    """Each batch's learning rate, and (rate ratio, momentum buffer ratio) where the rate
    changed (the callbacks before it in the list ran already)."""

    def __init__(self):
        super().__init__()
        self.rates, self.corrected, self._last = [], [], None

    def _state(self):
        opt = self.model.optimizer
        buffers = [np.array(keras.ops.convert_to_numpy(b)) for b in opt.momentums]
        return float(keras.ops.convert_to_numpy(opt.learning_rate)), buffers

    def on_train_batch_begin(self, batch, logs=None):
        rate, buffers = self._state()
        self.rates.append(np.float32(rate))
        if self._last is not None and rate != self._last[0] and self.model.optimizer.built:
            before = self._last[1][0].ravel()
            if np.abs(before).max() > 0:
                i = int(np.abs(before).argmax())
                self.corrected.append((float(buffers[0].ravel()[i] / before[i]),
                                       rate / self._last[0]))

    def on_train_batch_end(self, batch, logs=None):
        self._last = self._state()


def check_metrics(tmp):
    """flush_in_fit (the default) on a model built by its first batch, each rank from its own
    start: after the first batch the broadcast makes them one run; every epoch, validation,
    evaluate(), the checkpoint that epoch saved and EarlyStopping / ReduceLROnPlateau /
    BackupAndRestore see the real weights with every gradient applied, the same on every
    rank; fit ends with nothing in flight. The hidden layer's bias is local to each rank
    (local_variables=): never broadcast, never averaged."""
    r = phvd.rank()
    keras.utils.set_random_seed(r)
    model = keras.Sequential([keras.layers.Dense(HIDDEN, name="hidden"),
                              keras.layers.Dense(OUT, name="out")])   # built by its first batch
    opt = phvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), pipeline_depth=2,
                                    bucket_cap_mb=1e-5)
    model.compile(optimizer=opt, loss="mse")
    x, y = fit_data(r, 0, STEPS)
    vx, vy = fit_data(1000, 0, 3)                # the same validation data on every rank
    probe = EpochProbe(vx, vy)
    path = tmp / f"epoch-{r}.weights.h5"
    fit_callbacks = [phvd.callbacks.BroadcastGlobalVariablesCallback(0), probe,
                     keras.callbacks.ModelCheckpoint(str(path), save_weights_only=True),
                     keras.callbacks.EarlyStopping(patience=10),
                     keras.callbacks.ReduceLROnPlateau(patience=10)]

    class LocalBias(keras.callbacks.Callback):
        """The bias exists from the first batch on: registered before the broadcast."""

        def on_train_batch_end(self, batch, logs=None):
            if not fit_callbacks[0].broadcast_done:
                fit_callbacks[0].register_local_var(model.get_layer("hidden").bias)

    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                        validation_data=(vx, vy), callbacks=[LocalBias(), *fit_callbacks])
    # BackupAndRestore needs a built model: a third epoch, now that it is.
    history.history["val_loss"] += model.fit(
        x, y, batch_size=BATCH, initial_epoch=2, epochs=3, shuffle=False, verbose=0,
        validation_data=(vx, vy), callbacks=[
            probe, keras.callbacks.BackupAndRestore(str(tmp / f"backup-{r}"))]
    ).history["val_loss"]
    assert opt.in_flight == 0 and opt.timings["applied"] == 3 * STEPS, opt.timings
    assert [v for v, _, _ in probe.epochs] == history.history["val_loss"]
    for val_loss, evaluated, digest in probe.epochs:
        assert val_loss == evaluated, (val_loss, evaluated)     # same weights, same kernels
        assert len(set(phvd.allgather_object(digest))) == 1, "ranks differ at an epoch's end"
    saved = keras.models.clone_model(model)
    saved.load_weights(path)                     # the second epoch's, what the model held then
    assert all(np.array_equal(a, b) for a, b in zip(weights_of(saved), probe.weights[1]))


class EpochProbe(keras.callbacks.Callback):
    """Per epoch: fit's val_loss, evaluate() on the same data now, and a digest of the
    shared weights (all but the local hidden bias)."""

    def __init__(self, vx, vy):
        super().__init__()
        self.vx, self.vy, self.epochs, self.weights = vx, vy, [], []

    def on_epoch_end(self, epoch, logs=None):
        evaluated = self.model.evaluate(self.vx, self.vy, batch_size=BATCH, verbose=0)
        shared = [w for v, w in zip(self.model.weights, self.model.get_weights())
                  if v.path != self.model.get_layer("hidden").bias.path]
        digest = hashlib.sha256(b"".join(np.ascontiguousarray(w).tobytes() for w in shared))
        self.epochs.append((logs["val_loss"], evaluated, digest.hexdigest()))
        self.weights.append(weights_of(self.model))


def check_mid_epoch_saves(tmp):
    """On TensorFlow, lookahead (K=2, several ranks) leaves this rank's prediction in the
    model between train steps. What fit writes mid-epoch (ModelCheckpoint with save_freq, as
    a model and as weights; a callback's own model.save_weights) holds the real weights as
    the model's: loaded without the optimizer, the optimizer's real weights at that batch, bit
    for bit. load_model of such a file (with its optimizer) goes on bit-identically with the
    run that never saved, and saving did not change the run that saved. Outside fit's
    writers (flush_in_fit=False) the file holds the prediction and the save warns; inside
    opt.real_weights() it holds the real weights."""
    if keras.backend.backend() != "tensorflow" or phvd.size() == 1:
        return          # torch predicts at the next forward pass; alone nothing is predicted
    import warnings

    r = phvd.rank()

    def optimizer(**options):
        return phvd.DistributedOptimizer(keras.optimizers.Adam(0.01), pipeline_depth=2,
                                         bucket_cap_mb=1e-5, staleness_compensation="lookahead",
                                         **options)

    def same(a, b):
        return all(np.array_equal(x, y) for x, y in zip(a, b))
    plain = compiled(optimizer())
    fit(plain, 0, STEPS)                          # the run that never saves
    want = weights_of(plain)

    model = compiled(optimizer())
    probe = RealWeightsProbe()
    as_model, as_weights = tmp / f"mid-{r}-{{batch}}.keras", tmp / f"mid-{r}-{{batch}}.weights.h5"
    own = tmp / f"own-{r}.weights.h5"
    fit(model, 0, STEPS, [
        keras.callbacks.ModelCheckpoint(str(as_model), save_freq=SAVE_AT),
        keras.callbacks.ModelCheckpoint(str(as_weights), save_weights_only=True,
                                        save_freq=SAVE_AT),
        AtBatch(SAVE_AT + 1, lambda: model.save_weights(own)), probe])
    assert same(weights_of(model), want), "saving mid-epoch changed the run"
    saved = {SAVE_AT: str(as_model).format(batch=SAVE_AT),
             2 * SAVE_AT: str(as_model).format(batch=2 * SAVE_AT)}
    for batch, path in saved.items():
        real, predicted = probe.at[batch - 1]
        assert not same(real, predicted), "the model held no prediction: nothing tested"
        loaded = keras.models.load_model(path, compile=False)
        assert same(weights_of(loaded), real), f"{path} holds other weights than the real ones"
        weights = build(seed=1)                  # no optimizer: the weights alone
        weights.load_weights(str(as_weights).format(batch=batch))
        assert same(weights_of(weights), real), f"the .weights.h5 of batch {batch}"
    weights.load_weights(own)
    assert same(weights_of(weights), probe.at[SAVE_AT][0]), "a callback's save_weights"
    resumed = keras.models.load_model(saved[SAVE_AT])  # with its optimizer (own file per rank)
    assert resumed.optimizer.in_flight == 1
    assert same(weights_of(resumed), probe.at[SAVE_AT - 1][1]), "the prediction is put back"
    fit(resumed, SAVE_AT, STEPS)
    assert same(weights_of(resumed), want), "a resume from a mid-epoch file differs"

    # No fit writer (flush_in_fit=False): warned; inside real_weights(): the real weights.
    opt = optimizer(flush_in_fit=False)
    model = compiled(opt)
    warned, real = tmp / f"warned-{r}.weights.h5", tmp / f"real-{r}.weights.h5"
    caught = []

    def save_both():
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            model.save_weights(warned)
        caught.extend(str(w.message) for w in record)
        with opt.real_weights():
            model.save_weights(real)
    probe = RealWeightsProbe()
    fit(model, 0, STEPS, [AtBatch(SAVE_AT, save_both), probe])
    opt.flush()
    assert same(weights_of(model), want), "real_weights() changed the run"
    assert any("lookahead prediction" in m and "real_weights()" in m for m in caught), caught
    weights.load_weights(warned)
    assert same(weights_of(weights), probe.at[SAVE_AT - 1][1]), "the warned file's weights"
    weights.load_weights(real)
    assert same(weights_of(weights), probe.at[SAVE_AT - 1][0]), "real_weights()'s file"


class AtBatch(keras.callbacks.Callback):
    """Calls `call` after batch `batch` (counted from 1) of each epoch."""

    def __init__(self, batch, call):
        super().__init__()
        self.batch, self.call = batch, call

    def on_train_batch_end(self, batch, logs=None):
        if batch + 1 == self.batch:
            self.call()


class RealWeightsProbe(keras.callbacks.Callback):
    """After each batch (and the callbacks before it): the optimizer's real weights, and the
    model's, which hold this rank's prediction (both read from the TensorFlow path itself)."""

    def __init__(self):
        super().__init__()
        self.at = {}

    def on_train_batch_end(self, batch, logs=None):
        path = self.model.optimizer._path
        real = ([np.array(v.numpy()) for v in path.real] if bool(path.predicted.numpy())
                else weights_of(self.model))
        self.at[batch] = (real, weights_of(self.model))


def expect_error(error, text, call):
    try:
        call()
    except error as e:
        assert text in str(e), f"{error.__name__} without {text!r}: {e}"
    else:
        raise AssertionError(f"no {error.__name__} ({text})")


def check_errors():
    import torch

    backend = keras.backend.backend()
    # Under TensorFlow a stand-in: a torch optimizer imports triton (CUDA torch wheels), which
    # segfaults once TensorFlow >= 2.20 has loaded its LLVM globally (tensorflow#124205).
    torch_sgd = (torch.optim.SGD([torch.zeros(1)], lr=0.1) if backend == "torch"
                 else type("SGD", (), {"__module__": "torch.optim.sgd"})())
    expect_error(TypeError, "wraps a keras.optimizers.Optimizer",
                 lambda: phvd.DistributedOptimizer(torch_sgd))
    legacy = type("SGD", (), {"__module__": "tf_keras.src.optimizers.sgd"})
    expect_error(TypeError, "Keras 2", lambda: phvd.DistributedOptimizer(legacy()))
    once = phvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    expect_error(ValueError, "DistributedOptimizer already",
                 lambda: phvd.DistributedOptimizer(once))
    expect_error(ValueError, "pipeline_depth must be >= 1",
                 lambda: phvd.DistributedOptimizer(keras.optimizers.SGD(0.1), pipeline_depth=0))
    expect_error(ValueError, "one of lookahead, predict, dc, momentum",
                 lambda: phvd.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                   staleness_compensation="lookahed"))
    expect_error(ValueError, "prediction_exchange='int4' feeds the lookahead prediction: it "
                 "needs staleness_compensation='lookahead', got None",
                 lambda: phvd.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                   staleness_compensation=None,
                                                   prediction_exchange="int4"))
    expect_error(ValueError, "prediction_exchange must be None, 'auto' or one of int4, int8",
                 lambda: phvd.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                   prediction_exchange="fp16"))
    if backend == "torch":
        expect_error(ValueError, "has none (no nonzero `momentum` or `beta_1`)",
                     lambda: phvd.DistributedOptimizer(keras.optimizers.Adagrad(0.1),
                                                       staleness_compensation="momentum"))
    else:
        expect_error(ValueError, "not available on the Keras tensorflow backend; there: None "
                     "or 'lookahead'", lambda: phvd.DistributedOptimizer(
                         keras.optimizers.SGD(0.1), staleness_compensation="dc"))
    # A model that differs between ranks: every rank raises when fit builds the optimizer.
    model = keras.Sequential([keras.Input((IN,)), keras.layers.Dense(HIDDEN + phvd.rank()),
                              keras.layers.Dense(OUT)])
    model.compile(optimizer=phvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    if phvd.size() > 1:
        expect_error(ValueError, "differs between ranks", lambda: fit(model, 0, 2))
        # Pipeline options that differ between ranks: every rank raises, naming the option.
        other = phvd.rank() == 1
        for option, value in [("pipeline_depth", 3 if other else 2),
                              ("compression", phvd.Compression.fp16 if other
                               else phvd.Compression.none),
                              ("bucket_cap_mb", 1 if other else 25),
                              ("staleness_compensation", None if other else "lookahead"),
                              ("prediction_exchange", "int8" if other else "int4"),
                              ("collective", "ring" if other else None)]:
            model = compiled(phvd.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                       **{option: value}))
            expect_error(ValueError, f"option {option} is", lambda: fit(model, 0, 2))
    if backend == "tensorflow":
        import tensorflow as tf
        with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
            expect_error(ValueError, "tf.distribute strategy",
                         lambda: phvd.DistributedOptimizer(keras.optimizers.SGD(0.1)))
        model = build()
        model.compile(optimizer=phvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                      loss="mse", jit_compile=True)
        expect_error(ValueError, "jit_compile=False", lambda: fit(model, 0, 2))
    expect_error(ValueError, "runs only in the two-stage reduction",
                 lambda: phvd.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                   compression=phvd.Compression.fp8_e4m3,
                                                   collective="ring"))
    expect_error(ValueError, "unknown collective 'rign'",
                 lambda: phvd.DistributedOptimizer(keras.optimizers.SGD(0.1), collective="rign"))
    # Horovod's aggregation, local variables and callbacks: at the call, on every rank.
    expect_error(ValueError, "backward_passes_per_step must be >= 1", lambda: phvd.
                 DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=0))
    expect_error(TypeError, "average_aggregated_gradients must be True or False", lambda: phvd.
                 DistributedOptimizer(keras.optimizers.SGD(0.1), average_aggregated_gradients=1))
    expect_error(TypeError, "local_layers must be Keras layers", lambda: phvd.
                 PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=["dense"]))
    expect_error(TypeError, "BroadcastGlobalVariablesCallback: local_variables must be variables",
                 lambda: phvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[1]))
    model = compiled(phvd.DistributedOptimizer(keras.optimizers.SGD(0.1)))
    expect_error(ValueError, f"root_rank={phvd.size()} is not a rank", lambda: fit(
        model, 0, 2, [phvd.callbacks.BroadcastGlobalVariablesCallback(phvd.size())]))
    model = compiled(phvd.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                               backward_passes_per_step=2))
    expect_error(ValueError, "backward_passes_per_step=2 does not divide the 3 steps", lambda:
                 fit(model, 0, 3))
    if backend == "torch":
        expect_error(RuntimeError, "Keras 2's TensorFlow API", lambda: model.optimizer.
                     _compute_gradients(lambda: 0.0, model.trainable_variables))
    if phvd.size() > 1:
        # A variable local on one rank only, and aggregation set differently: named, on every
        # rank, at the first step.
        opt = phvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
        model = compiled(opt)
        if phvd.rank() == 1:
            opt.register_local_var(model.trainable_variables[1])
        expect_error(ValueError, "differs between ranks", lambda: fit(model, 0, 2))
        model = compiled(phvd.DistributedOptimizer(
            keras.optimizers.SGD(0.1), backward_passes_per_step=2 if phvd.rank() else 1))
        expect_error(ValueError, "option backward_passes_per_step is", lambda: fit(model, 0, 2))
    # After all of that the ranks still agree: a normal run works.
    model = compiled(phvd.DistributedOptimizer(keras.optimizers.SGD(0.1)))
    fit(model, 0, 4)
    expect_error(ValueError, "register local variables before the first step",
                 lambda: model.optimizer.register_local_var(model.trainable_variables[0]))


class Sleep(keras.layers.Layer):
    """Stands for accelerator compute: it takes time but no CPU."""

    def call(self, x):
        if keras.backend.backend() == "tensorflow":
            import tensorflow as tf
            return tf.ensure_shape(tf.numpy_function(lambda a: (time.sleep(DELAY), a)[1], [x],
                                                     x.dtype, stateful=True), x.shape)
        time.sleep(DELAY)
        return x

    def compute_output_spec(self, x):
        return keras.KerasTensor(x.shape, x.dtype)


DELAY = 0.1                # per step, of the Sleep layer and of each reduction


def delay_reductions(eng, delay):
    """Make every reduction of the real engine land `delay` seconds after it starts,
    as over a slow network (the reduction itself still runs on the engine)."""
    started = {}
    launch, wait = eng.allreduce_async, eng.wait

    def allreduce_async(*args, **kwargs):
        handle = launch(*args, **kwargs)
        started[handle.id] = time.perf_counter()
        return handle

    def delayed_wait(handle):
        begun = started.pop(handle.id, None)
        if begun is not None:
            time.sleep(max(0.0, begun + delay - time.perf_counter()))
        return wait(handle)

    eng.allreduce_async, eng.wait = allreduce_async, delayed_wait


class StepClock(keras.callbacks.Callback):
    """Each step's duration. A step, not an epoch, is the sample: under load one gloo
    allreduce of a 2-rank run now and then lands ~1 s late on one rank (traced per
    rank: launch and wait times otherwise as designed), which spoiled whole epochs."""

    def __init__(self):
        super().__init__()
        self.durations = []

    def on_train_batch_begin(self, batch, logs=None):
        self._begin = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.durations.append(time.perf_counter() - self._begin)


def check_overlap():
    from pipe_horovod import engine
    delay_reductions(engine.current(), DELAY)
    seconds = {}
    for depth in (1, 2):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((IN,)), keras.layers.Dense(HIDDEN), Sleep(),
                                  keras.layers.Dense(OUT)])
        # One process reduces nothing unless a codec makes it (fp16 here).
        codec = phvd.Compression.fp16 if phvd.size() == 1 else phvd.Compression.none
        model.compile(optimizer=phvd.DistributedOptimizer(   # one pipeline over the fits
            keras.optimizers.SGD(0.01), pipeline_depth=depth, bucket_cap_mb=1e-5,
            compression=codec, flush_in_fit=False), loss="mse")
        fit(model, 0, 3)                         # traced, built, pipeline started
        clock = StepClock()
        for _ in range(3):
            fit(model, 0, STEPS, callbacks=[clock])
        seconds[depth] = float(np.median(clock.durations))
    ratio = seconds[2] / seconds[1]
    print(f"step seconds (median) K=1 {seconds[1]:.3f} K=2 {seconds[2]:.3f} ratio {ratio:.2f}",
          flush=True)
    assert ratio <= 0.8, f"K=2 did not hide the reduction delay: {seconds}"


class MySGD(keras.optimizers.SGD):
    """A user's own optimizer class, unregistered: load_model finds it by custom_optimizers."""


def check_api(tmp):
    """horovod.tensorflow.keras's value collectives and load_model (run it last in a launch:
    rank 0 alone builds optimizers here, which numbers the later ones differently)."""
    r, n = phvd.rank(), phvd.size()
    assert phvd.allreduce(r + 1.0, "api.sum", op=phvd.Sum) == n * (n + 1) / 2
    assert phvd.allreduce(np.full(3, r, "float32"), "api.avg").tolist() == [(n - 1) / 2] * 3
    assert phvd.allreduce(keras.ops.ones((2,)), "api.tensor").tolist() == [1.0, 1.0]
    assert phvd.allreduce(2.0, "api.scaled", op=phvd.Sum, prescale_factor=2.0,
                          postscale_factor=3.0) == 12.0 * n
    expect_error(TypeError, "op=", lambda: phvd.allreduce(1.0, "api.bad", phvd.Sum))
    gathered = phvd.allgather(np.full((r + 1, 2), r, "int64"), "api.gather")
    assert gathered.tolist() == [[k, k] for k in range(n) for _ in range(k + 1)], gathered
    # Horovod's Keras ImageNet example: every rank resumes from rank 0's epoch.
    assert int(phvd.broadcast(5 if r == 0 else 0, 0, name="resume_from_epoch")) == 5
    rows = np.arange(2 * n, dtype="float32").reshape(n, 2) + r
    assert phvd.reducescatter(rows, "api.scatter").tolist() == [[2 * r + (n - 1) / 2,
                                                                 2 * r + 1 + (n - 1) / 2]]
    assert 0 <= phvd.cross_rank() < phvd.cross_size()
    from pipe_horovod.torch import mpi_ops   # one implementation, tested in test_horovod_api
    for name in ("gloo_built", "mpi_enabled", "nccl_built", "is_homogeneous", "start_timeline",
                 "ProcessSet", "add_process_set", "Adasum"):
        assert getattr(phvd, name) is getattr(mpi_ops, name), name
    expect_error(RuntimeError, "BroadcastGlobalVariablesCallback",
                 lambda: phvd.broadcast_global_variables(0))
    expect_error(ValueError, "Keras 3 does not have",
                 lambda: phvd.load_model(tmp / "none.keras", legacy_opts=True))
    if r == 0:                               # alone, as in Horovod's resume pattern
        check_load_model(tmp)
    phvd.barrier()


def check_load_model(tmp):
    # A plain optimizer (a checkpoint from before pipe_horovod): wrapped, its state kept.
    model = build()
    model.compile(optimizer=MySGD(0.05, momentum=0.9), loss="mse", metrics=["mae"])
    x, y = fit_data(0, 0, 3)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    model.save(tmp / "plain.keras")
    expect_error(TypeError, "MySGD", lambda: phvd.load_model(tmp / "plain.keras"))
    plain = keras.models.load_model(tmp / "plain.keras", custom_objects={"MySGD": MySGD})
    loaded = phvd.load_model(tmp / "plain.keras", custom_optimizers=[MySGD])
    opt = loaded.optimizer
    assert isinstance(opt, MySGD) and hasattr(opt, "flush"), type(opt).__mro__
    assert opt.get_config()["optimizer"]["config"] == plain.optimizer.get_config()
    assert len(opt.variables) == len(plain.optimizer.variables)
    for a, b in zip(opt.variables, plain.optimizer.variables):
        assert np.array_equal(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b)), a.name
    assert loaded.evaluate(x, y, verbose=0) == plain.evaluate(x, y, verbose=0), "loss, metrics"
    # A pipe_horovod checkpoint comes back as saved; another codec would change it.
    loaded.save(tmp / "pipelined.keras")
    again = phvd.load_model(tmp / "pipelined.keras", custom_optimizers=[MySGD])
    assert again.optimizer.get_config() == opt.get_config()
    if phvd.size() == 1:                     # training on: the same steps
        later = fit_data(0, 3, 6)
        for m in (plain, loaded):
            m.fit(*later, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        loaded.optimizer.flush()
        assert all(np.array_equal(a, b) for a, b in zip(weights_of(loaded), weights_of(plain)))
    expect_error(ValueError, "saved with compression none", lambda: phvd.load_model(
        tmp / "pipelined.keras", custom_optimizers=[MySGD], compression=phvd.Compression.fp16))


def _check_run_record(opt, steps, what, reduced):
    """The measured run (pipeline/run_record.py) as the PyTorch adapter keeps it: every
    step after the first timed, every step's buckets recorded and landed, and the summary
    written by rank 0 alone."""
    timings = opt.timings
    assert [s["step"] for s in timings["recent_steps"]] == list(range(1, steps)), what
    assert timings["compute_s"] > 0, what
    if reduced:
        assert {r["step"] for r in timings["reductions"]} == set(range(steps)), what
        assert all(r["landed_s"] >= r["launched_s"] for r in timings["reductions"]), what
    # The GPU kit's keras step runs the oracle cases with no test directory: a scratch one.
    folder = os.environ.get("PIPE_HOROVOD_TEST_DIR") or tempfile.mkdtemp()
    path = str(Path(folder) / f"run-summary-{phvd.rank()}.json")
    assert opt.write_run_summary(path) == (path if phvd.rank() == 0 else None), what
    assert os.path.exists(path) == (phvd.rank() == 0), what


def main():
    phvd.init()
    if keras.backend.backend() == "tensorflow":
        count_traces()
    # Where Keras keeps the variables (the GPU kit checks that they are on the GPU).
    print(f"KERAS_DEVICE {keras.backend.backend()} {keras.Variable(0.0).value.device}",
          flush=True)
    modes, args = sys.argv[1], sys.argv[2:]
    if modes == "resume":
        check_checkpoint("resume", *args)
    else:
        # K, then one file for each of full and save that the launch runs, in that order.
        files = dict(zip([m for m in modes.split(",") if m in ("full", "save")], args[1:]))
        checks = {"memory": check_memory, "oracle": check_oracle, "staleness": check_staleness,
                  "settings": check_settings, "callbacks": check_callbacks,
                  "errors": check_errors, "overlap": check_overlap,
                  "aggregation": check_aggregation,
                  "midsave": lambda: check_mid_epoch_saves(
                      Path(os.environ["PIPE_HOROVOD_TEST_DIR"])),
                  "metrics": lambda: check_metrics(Path(os.environ["PIPE_HOROVOD_TEST_DIR"])),
                  "auto": lambda: __import__("keras_auto").check_auto(
                      Path(os.environ["PIPE_HOROVOD_TEST_DIR"])),
                  "api": lambda: check_api(Path(os.environ["PIPE_HOROVOD_TEST_DIR"])),
                  "full": lambda: check_checkpoint("full", args[0], files["full"]),
                  "save": lambda: check_checkpoint("save", args[0], files["save"])}
        if any(m.startswith("tf.") for m in modes.split(",")):
            import tensorflow_worker     # Horovod's TF2 custom-loop API (test_tensorflow)
            test_dir = Path(os.environ["PIPE_HOROVOD_TEST_DIR"]) / "tensorflow"
            checks.update({f"tf.{name}": check for name, check in
                           tensorflow_worker.checks(test_dir).items()})
        # Several in one launch (TF starts slowly); the checkpoint test reads its own
        # modes' CASE_OK lines: a later mode's failure is not its.
        launcher.worker_cases(checks, modes, phvd.rank)
    print(f"WORKER_OK rank={phvd.rank()}", flush=True)
    phvd.shutdown()


if __name__ == "__main__":
    main()
