"""pipe_horovod.tensorflow (Horovod's TF2 API) in custom loops, on N ranks: the cases that
keras_worker.py runs as its modes tf.CASE in the Keras fit launches on the TensorFlow
backend (tests/keras_launches.py; one TensorFlow start-up per engine):
  api         the collectives on tf.Tensor / tf.Variable / IndexedSlices, eagerly and inside
              tf.function, against values every rank computes for every rank; the object
              collectives, broadcast_variables, barrier
  tape        DistributedGradientTape in a tf.function with Keras SGD, K = 1, 2, 3 and a
              warm-up, against tests/keras_reference.py's pipelined FIFO fed with the same
              TensorFlow gradients: bit for bit (the float32 average of 1 or 2 ranks is
              exact); zeros while the pipeline fills; flush() hands back the rest; the
              run summary (write_run_summary) as the optimizers write theirs
  optimizer   hvd.DistributedOptimizer(Adam) with a plain tape at K=2 (plain Pipe-SGD)
              against the reference's Adam, within tests/tolerance.py's bound
  checkpoint  tf.train.Checkpoint with GradientsInFlight saved mid-run at K=2, without
              compression and with int8_ef (this rank's residuals); a fresh model
              restored from it continues to the uninterrupted run's weights exactly;
              the same for hvd.DistributedOptimizer's tf.train.Checkpoint
  align       rank 0 alone restores a tape checkpoint, then broadcasts (both parities of
              the saved step): the uninterrupted run exactly; ranks that stepped unevenly
              before hvd.join() pair their steps again after it (Horovod's engine)
  errors      bad input: a clear error on every rank, and a collective still works after;
              variables in another order on one rank; two wrappers in a row; a tape
              checkpoint resumed at another depth
  partial     PartialDistributedGradientTape at K=2 in a tf.function: the last layer local
              (this rank's own gradient / size), the others averaged, both one step late,
              zeros first; get_local_and_global_gradients; the *_op identity ops; a local
              source shaped differently on each rank
  auto        tune="auto" for the tape and hvd.DistributedOptimizer (tensorflow_auto.py):
              K=1 and K=2 outcomes bit for bit against the chosen configuration with
              warmup_steps=N, the same decision everywhere, in the run summary and
              kept by a checkpoint's resume; wrap-time conflicts; ranks that differ told
  autodiff    gradients through allreduce, grouped_allreduce, allgather and broadcast
              (Horovod's rules, exact values), eagerly and in a tf.function;
              SyncBatchNormalization against Keras's BatchNormalization on every rank's
              batch at once: outputs, input gradients, moving statistics
"""
import functools
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import numpy as np  # noqa: E402
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_reference as ref  # noqa: E402
from tensorflow_auto import check_auto  # noqa: E402
import pipe_horovod.tensorflow as hvd  # noqa: E402
from tolerance import gamma, relative_error, training_rtol  # noqa: E402

STEPS, SAVE_AT, BATCH, IN, HIDDEN, OUT = 8, 3, 8, 4, 5, 3


def rank_data(rank, step):
    return ref.rank_data(rank, step, BATCH, IN, OUT)


def build(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((IN,)), keras.layers.Dense(HIDDEN, activation="tanh"),
                             keras.layers.Dense(OUT)])


def loss_of(model, x, y):
    return tf.reduce_mean(tf.square(model(x) - y))


def weights_of(model):
    return [np.asarray(v.numpy()) for v in model.trainable_variables]


_probe = {}


def local_gradients(step, rank, weights, eagerly=False):
    """Rank `rank`'s gradient at `weights`, by the same TensorFlow computation as the run's:
    traced, or eager for an eager run (graph and eager gradients may differ in the last bit:
    on an AVX-512 CPU they do)."""
    if eagerly not in _probe:
        model = build()

        def grads(x, y):
            with tf.GradientTape() as tape:
                loss = loss_of(model, x, y)
            return tape.gradient(loss, model.trainable_variables)
        _probe[eagerly] = model, (grads if eagerly else tf.function(grads))
    model, grads = _probe[eagerly]
    for v, w in zip(model.trainable_variables, weights):
        v.assign(w)
    return [g.numpy() for g in grads(*rank_data(rank, step))]


def equal(got, want, what):
    for i, (a, b) in enumerate(zip(got, want)):
        assert np.array_equal(a, b), (f"{what}: variable {i} differs from the reference by "
                                      f"{relative_error(a, b):.3g}")


# --- api ---------------------------------------------------------------------------------
def check_api():
    r, n = hvd.rank(), hvd.size()
    assert hvd.local_rank() == r and hvd.local_size() == n and hvd.cross_size() == 1
    assert hvd.is_initialized() and isinstance(hvd.gloo_built(), bool)
    value = lambda k: tf.constant(np.arange(6, dtype=np.float32).reshape(2, 3) + k)  # noqa
    total = sum(value(k).numpy() for k in range(n))

    @tf.function
    def in_graph(t):
        return (hvd.allreduce(t, op=hvd.Sum), hvd.allgather(t), hvd.broadcast(t, n - 1),
                hvd.grouped_allreduce([t, 2 * t]))
    for mode, run in (("eager", lambda t: (hvd.allreduce(t, op=hvd.Sum), hvd.allgather(t),
                                           hvd.broadcast(t, n - 1),
                                           hvd.grouped_allreduce([t, 2 * t]))),
                      ("tf.function", in_graph)):
        summed, gathered, sent, grouped = run(value(r))
        assert np.array_equal(summed.numpy(), total), mode
        assert np.array_equal(gathered.numpy(), np.concatenate([value(k) for k in range(n)]))
        assert np.array_equal(sent.numpy(), value(n - 1).numpy()), mode
        assert np.allclose(grouped[0].numpy(), total / n) and np.allclose(
            grouped[1].numpy(), 2 * total / n), mode
    variable = tf.Variable(value(r))
    assert np.array_equal(hvd.allreduce(variable, op=hvd.Max).numpy(), value(n - 1).numpy())
    # Ranks gather different first dimensions; alltoall with splits; reducescatter.
    gathered = hvd.allgather(tf.fill([r + 1, 2], float(r)))
    assert gathered.shape == (n * (n + 1) // 2, 2)
    rows = tf.reshape(tf.range(2 * n, dtype=tf.float32) + 10 * r, (2 * n, 1))
    out, received = hvd.alltoall(rows, splits=[2] * n)
    assert received.numpy().tolist() == [2] * n
    assert out.numpy().ravel().tolist() == [10 * k + 2 * r + j for k in range(n) for j in (0, 1)]
    scattered = hvd.reducescatter(tf.ones((2 * n, 3)) * (r + 1), op=hvd.Sum)
    assert np.array_equal(scattered.numpy(), np.full((2, 3), n * (n + 1) / 2, np.float32))
    # IndexedSlices: values and indices gathered, values averaged (Horovod's reduction).
    slices = tf.IndexedSlices(tf.fill([1, 3], float(r + 1)), tf.constant([r]),
                              tf.constant([n, 3]))
    reduced = hvd.allreduce(slices)
    assert isinstance(reduced, tf.IndexedSlices)
    assert np.array_equal(tf.convert_to_tensor(reduced).numpy(),
                          np.array([[(k + 1) / n] * 3 for k in range(n)], np.float32))
    # broadcast_variables: every rank ends with rank 0's weights.
    for mode in ("eager", "tf.function"):
        model = build(seed=r)
        if mode == "eager":
            hvd.broadcast_variables(model.variables, root_rank=0)
        else:
            tf.function(lambda: hvd.broadcast_variables(model.variables, root_rank=0))()
        mine = weights_of(model)
        for theirs in hvd.allgather_object(mine):
            equal(theirs, mine, f"broadcast_variables {mode}")
    assert hvd.broadcast_object({"epoch": 3} if r == 0 else None, 0) == {"epoch": 3}
    hvd.barrier()
    compressed = hvd.allreduce(tf.constant([1.0, 2.0]), compression=hvd.Compression.fp16)
    assert compressed.dtype == tf.float32 and np.array_equal(compressed.numpy(), [1.0, 2.0])
    # Horovod's TF Compression on tf tensors: floats to float16 and back, the rest as is.
    for dtype, wire in ((tf.float64, tf.float16), (tf.int32, tf.int32)):
        wired, ctx = hvd.Compression.fp16.compress(tf.ones(3, dtype))
        assert wired.dtype == wire and hvd.Compression.fp16.decompress(wired, ctx).dtype == dtype
    check_horovod_dtypes(r, n)
    assert hvd._executing_eagerly() and not tf.function(hvd.util._executing_eagerly)()


def check_horovod_dtypes(r, n):
    """What Horovod's TensorFlow ops take beyond its torch ops (the engines here): 8- and
    16-bit integer reductions, in int32, cast back (a Sum that overflows wraps as
    Horovod's); unsigned 16-bit tensors moved bit for bit; alltoall in equal parts,
    empty ones included. Eagerly and in a tf.function."""
    for mode, run in (("eager", lambda f: f()), ("tf.function", lambda f: tf.function(f)())):
        summed = run(lambda: hvd.allreduce(tf.constant([200, 3 + r], tf.uint8), op=hvd.Sum))
        assert summed.dtype == tf.uint8 and summed.numpy().tolist() == [
            (200 * n) % 256, sum(3 + k for k in range(n)) % 256], (mode, summed)
        low = run(lambda: hvd.allreduce(tf.constant([-r, r], tf.int8), op=hvd.Min))
        assert low.dtype == tf.int8 and low.numpy().tolist() == [-(n - 1), 0], mode
        top = tf.constant([65535 - r, r], tf.uint16)
        assert run(lambda: hvd.allgather(top)).numpy().tolist() == [
            v for k in range(n) for v in (65535 - k, k)], mode
        assert run(lambda: hvd.broadcast(top, 0)).numpy().tolist() == [65535, 0], mode
        parts = run(lambda: hvd.alltoall(tf.repeat(tf.cast(tf.range(n) + 10 * r, tf.int16), 2)))
        assert parts.numpy().tolist() == [10 * k + r for k in range(n) for _ in (0, 1)], mode
        empty = run(lambda: hvd.alltoall(tf.zeros([n, 0], tf.float32)))
        assert empty.shape == (n, 0), (mode, empty.shape)   # a row of nothing from each


# --- the tape against the pipelined reference ----------------------------------------------
def tape_run(depth, warmup, steps=STEPS, model=None, start=0, eagerly=False, state=None,
             compression=hvd.Compression.none, held=None):
    """Train `steps` steps with DistributedGradientTape and Keras SGD; return the model,
    the optimizer and what tape.gradient returned at each step (and, into `held`, the
    returned tensors themselves, kept across the later steps)."""
    model = model or build()
    opt = keras.optimizers.SGD(0.1) if state is None else state
    returned = []

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_of(model, x, y)
        tape = hvd.DistributedGradientTape(tape, pipeline_depth=depth, warmup_steps=warmup,
                                           bucket_cap_mb=1e-5, compression=compression)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return grads
    run = step if eagerly else tf.function(step)
    for t in range(start, start + steps):
        grads = run(*rank_data(hvd.rank(), t))
        returned.append([g.numpy() for g in grads])
        if held is not None:
            held.append(grads)
    return model, opt, returned


def check_tape():
    for depth, warmup, eagerly in ((1, 0, False), (2, 0, False), (3, 2, False), (2, 1, True)):
        what = f"tape K={depth} W={warmup}{' eagerly' if eagerly else ''}"
        held = []
        model, opt, returned = tape_run(depth, warmup, eagerly=eagerly, held=held)
        # What tape.gradient returned keeps its value while later steps refill the slots
        for t, (grads, values) in enumerate(zip(held, returned)):
            assert all(np.array_equal(g.numpy(), v) for g, v in zip(grads, values)), \
                f"{what}: the gradient returned at step {t} changed later"
        start = weights_of(build())
        gradients = functools.partial(local_gradients, eagerly=eagerly)
        expected = ref.reference(start, gradients, ref.SGD(0.1), depth, warmup,
                                 steps=STEPS, size=hvd.size(), flush=False)
        equal(weights_of(model), expected.weights, what)
        filling = [t for t in range(STEPS) if t >= warmup][:depth - 1]
        for t in filling:
            assert all(not g.any() for g in returned[t]), f"{what}: step {t} is not zeros"
        left = hvd.flush(model.trainable_variables)
        assert len(left) == len(expected.fifo), what
        for grads, (_, averaged) in zip(left, expected.fifo):
            equal([g.numpy() for g in grads], averaged, what + " flush")
            opt.apply_gradients(zip(grads, model.trainable_variables))
        done = ref.reference(start, gradients, ref.SGD(0.1), depth, warmup, steps=STEPS,
                             size=hvd.size())
        equal(weights_of(model), done.weights, what + " after flush")
        assert hvd.flush(model.trainable_variables) == []
        if (depth, eagerly) == (2, False):
            check_run_summary(model, what)
        if depth > 1:      # one step more or less of delay is told apart
            other = ref.reference(start, gradients, ref.SGD(0.1), depth - 1, warmup,
                                  steps=STEPS, size=hvd.size())
            assert not np.array_equal(other.weights[0], done.weights[0]), what


def check_run_summary(model, what):
    """The tape's measured run (pipeline/run_record.py), as the optimizers write theirs:
    rank 0 alone writes it, every step after the first timed with its compute, every
    step's buckets landed; a source list with no pipeline, or a tape before its first
    gradient(), is a clear error."""
    folder = Path(os.environ.get("PIPE_HOROVOD_TEST_DIR") or tempfile.mkdtemp())
    path = str(folder / f"tape-run-summary-{hvd.rank()}.json")
    assert hvd.write_run_summary(model.trainable_variables, path) == (
        path if hvd.rank() == 0 else None), what
    assert os.path.exists(path) == (hvd.rank() == 0), what
    if hvd.rank() == 0:
        with open(path) as f:
            summary = json.load(f)
        assert summary["config"]["pipeline_depth"] == 2, (what, summary["config"])
        assert [s["step"] for s in summary["steps"]] == list(range(1, STEPS)), what
        assert all(s["compute_s"] > 0 for s in summary["steps"]), what
        if hvd.size() > 1:
            reduced = summary["reductions"]
            assert {r["step"] for r in reduced} == set(range(STEPS)), what
            assert all(r["landed_s"] >= r["launched_s"] for r in reduced), what
    expect_error(ValueError, "no DistributedGradientTape has computed gradients",
                 lambda: hvd.write_run_summary(build().trainable_variables, path))
    expect_error(ValueError, "this tape has computed no gradient yet",
                 lambda: hvd.DistributedGradientTape(tf.GradientTape()).write_run_summary(path))


def check_optimizer():
    model = build()
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01), pipeline_depth=2,
                                   staleness_compensation=None)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_of(model, x, y)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    for t in range(STEPS):
        step(*rank_data(hvd.rank(), t))
    opt.flush()
    expected = ref.reference(weights_of(build()), local_gradients, ref.Adam(0.01), 2, 0,
                             steps=STEPS, size=hvd.size())
    rtol = training_rtol(steps=STEPS, fan_ins=(IN, HIDDEN, OUT), batch=BATCH, ranks=hvd.size(),
                         optimizer="adam")
    assert int(opt.iterations.numpy()) == STEPS
    for i, (a, b) in enumerate(zip(weights_of(model), expected.weights)):
        err = relative_error(a, b)
        assert err <= rtol, f"DistributedOptimizer: variable {i} off by {err:.3g} > {rtol:.3g}"


def check_checkpoint(directory):
    """Saved mid-run at K=2 and restored into a fresh model: the uninterrupted run's weights
    exactly; with int8_ef too, whose error-feedback residuals (this rank's own) the
    checkpoint must carry, or the resumed run's quantization differs."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    for compression in (hvd.Compression.none, hvd.Compression.int8_ef):
        what = f"restored from tf.train.Checkpoint ({compression.name})"
        path = Path(directory) / f"tape_{compression.name}_rank{hvd.rank()}"
        model, opt, _ = tape_run(2, 0, steps=SAVE_AT, compression=compression)
        ckpt = tf.train.Checkpoint(model=model, optimizer=opt,
                                   pipeline=hvd.GradientsInFlight(model.trainable_variables))
        saved = ckpt.write(str(path))
        tape_run(2, 0, steps=STEPS - SAVE_AT, model=model, start=SAVE_AT, state=opt,
                 compression=compression)
        for grads in hvd.flush(model.trainable_variables):
            opt.apply_gradients(zip(grads, model.trainable_variables))
        uninterrupted = weights_of(model)
        # A fresh model, optimizer and pipeline, as a restarted job has them.
        fresh, fresh_opt = build(seed=7), keras.optimizers.SGD(0.1)
        fresh_opt.build(fresh.trainable_variables)
        tf.train.Checkpoint(model=fresh, optimizer=fresh_opt,
                            pipeline=hvd.GradientsInFlight(fresh.trainable_variables)).read(
            saved).assert_consumed()
        tape_run(2, 0, steps=STEPS - SAVE_AT, model=fresh, start=SAVE_AT, state=fresh_opt,
                 compression=compression)
        for grads in hvd.flush(fresh.trainable_variables):
            fresh_opt.apply_gradients(zip(grads, fresh.trainable_variables))
        equal(weights_of(fresh), uninterrupted, what)
    # Rank 0 alone restores: the others take its step and gradients in flight, except an
    # error-feedback codec's residuals, which are each rank's own: refused on every rank.
    fresh = build(seed=7)
    if hvd.rank() == 0:
        tf.train.Checkpoint(pipeline=hvd.GradientsInFlight(fresh.trainable_variables)).read(
            saved).expect_partial()
    if hvd.size() == 2:                      # (one process has no one to agree with)
        expect_error(ValueError, f"the ranks' DistributedGradientTape pipelines differ at their "
                     f"first step (rank 0 at step {SAVE_AT} with 1 in flight, rank 1 at step "
                     f"0 with 0 in flight): with an error-feedback codec (int8_ef)",
                     lambda: tape_run(2, 0, steps=1, model=fresh, start=SAVE_AT,
                                      compression=hvd.Compression.int8_ef))
    check_optimizer_checkpoint(directory)


def check_align(directory):
    """Rank 0 alone restores a K=2 tape checkpoint (Horovod's resume: rank 0 loads, then
    broadcasts the variables), saved after an odd and after an even number of steps: every
    rank ends at the uninterrupted run's weights exactly (the other ranks' pipelines take
    rank 0's step and gradients in flight at their first step). Under Horovod, ranks that
    ran different numbers of steps before hvd.join() go on stepping together after it."""
    from pipe_horovod import engine

    Path(directory).mkdir(parents=True, exist_ok=True)
    for save_at in (3, 4):
        what = f"rank 0 alone restored a tape checkpoint saved at step {save_at}"
        path = Path(directory) / f"align_{save_at}_rank{hvd.rank()}"
        model, opt, _ = tape_run(2, 0, steps=save_at)
        saved = tf.train.Checkpoint(model=model, optimizer=opt, pipeline=hvd.GradientsInFlight(
            model.trainable_variables)).write(str(path))
        tape_run(2, 0, steps=STEPS - save_at, model=model, start=save_at, state=opt)
        for grads in hvd.flush(model.trainable_variables):
            opt.apply_gradients(zip(grads, model.trainable_variables))
        uninterrupted = weights_of(model)
        fresh, fresh_opt = build(seed=7), keras.optimizers.SGD(0.1)
        fresh_opt.build(fresh.trainable_variables)
        if hvd.rank() == 0:
            tf.train.Checkpoint(model=fresh, optimizer=fresh_opt, pipeline=hvd.GradientsInFlight(
                fresh.trainable_variables)).read(saved).assert_consumed()
        hvd.broadcast_variables(fresh.variables + fresh_opt.variables, root_rank=0)
        tape_run(2, 0, steps=STEPS - save_at, model=fresh, start=save_at, state=fresh_opt)
        for grads in hvd.flush(fresh.trainable_variables):
            fresh_opt.apply_gradients(zip(grads, fresh.trainable_variables))
        equal(weights_of(fresh), uninterrupted, what)
    if engine.current().name != "horovod":      # the torch engine's join is a plain barrier
        return
    model = build()
    _, opt, before = tape_run(2, 0, steps=STEPS - hvd.rank(), model=model)
    hvd.join()
    _, _, returned = tape_run(2, 0, steps=2, model=model, start=STEPS, state=opt)
    gathered = hvd.allgather_object([g.tobytes() for g in returned[-1]])
    assert all(g == gathered[0] for g in gathered), \
        "after hvd.join(), the ranks' averaged gradients of the same step differ"
    # Rank 1 stopped a step early: what it held in flight (step STEPS - 2's average, which
    # rank 0 got at its last step before the join) comes back intact after the join.
    kept = hvd.broadcast_object([g.tobytes() for g in before[STEPS - 1]]
                                if hvd.rank() == 0 else None, root_rank=0)
    if hvd.rank() == 1:
        assert [g.tobytes() for g in returned[0]] == kept, \
            "the gradient in flight across hvd.join() changed"
    hvd.flush(model.trainable_variables)


def optimizer_run(model, opt, start, steps):
    """`steps` steps of hvd.DistributedOptimizer with a plain tape, in a tf.function."""
    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_of(model, x, y)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
    for t in range(start, start + steps):
        step(*rank_data(hvd.rank(), t))


def check_optimizer_checkpoint(directory):
    """tf.train.Checkpoint of hvd.DistributedOptimizer saved mid-run at K=2: it dropped the
    gradient in flight (a resume was one update short) while assert_consumed() passed. A
    fresh model and optimizer restored from it continue to the uninterrupted run's weights
    exactly, with the default lookahead (the model holds predicted weights when saved) and
    with plain Pipe-SGD."""
    for compensation in ("lookahead", None):
        def wrapped():
            return hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
                                            pipeline_depth=2,
                                            staleness_compensation=compensation)
        model, opt = build(), wrapped()
        optimizer_run(model, opt, 0, SAVE_AT)
        if hvd.size() > 1:                       # (one process may apply at once)
            assert opt.in_flight == 1, opt.in_flight
        with opt.real_weights():                 # (lookahead: the model holds a prediction)
            real = weights_of(model)
        saved = tf.train.Checkpoint(model=model, optimizer=opt).write(
            str(Path(directory) / f"optimizer_{compensation}_rank{hvd.rank()}"))
        optimizer_run(model, opt, SAVE_AT, STEPS - SAVE_AT)
        opt.flush()
        uninterrupted = weights_of(model)
        # The model read alone (for inference) holds the real weights, not the prediction.
        inference = build(seed=11)
        tf.train.Checkpoint(model=inference).read(saved).expect_partial()
        equal(weights_of(inference), real, f"the model's weights in the checkpoint ({compensation})")
        fresh, fresh_opt = build(seed=7), wrapped()
        fresh_opt.build(fresh.trainable_variables)
        tf.train.Checkpoint(model=fresh, optimizer=fresh_opt).read(saved).assert_consumed()
        optimizer_run(fresh, fresh_opt, SAVE_AT, STEPS - SAVE_AT)
        fresh_opt.flush()
        equal(weights_of(fresh), uninterrupted,
              f"DistributedOptimizer restored from tf.train.Checkpoint ({compensation})")
        # Horovod's resume: rank 0 alone reads, then broadcasts the variables. The other
        # ranks' pipelines take rank 0's step and gradients in flight at the first step.
        fresh, fresh_opt = build(seed=7 + hvd.rank()), wrapped()
        fresh_opt.build(fresh.trainable_variables)
        if hvd.rank() == 0:
            tf.train.Checkpoint(model=fresh, optimizer=fresh_opt).read(saved).assert_consumed()
        hvd.broadcast_variables(fresh.variables + fresh_opt.variables, root_rank=0)
        optimizer_run(fresh, fresh_opt, SAVE_AT, STEPS - SAVE_AT)
        fresh_opt.flush()
        equal(weights_of(fresh), uninterrupted,
              f"DistributedOptimizer restored by rank 0, then broadcast ({compensation})")


def check_partial():
    r, n = hvd.rank(), hvd.size()
    model = build()
    weights = weights_of(model)           # no update is applied: every step at these weights
    variables = model.trainable_variables
    local = [id(v) in {id(w) for w in model.layers[-1].trainable_weights} for v in variables]

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_of(model, x, y)
        tape = hvd.PartialDistributedGradientTape(tape, local_layers=model.layers[-1],
                                                  pipeline_depth=2)
        mine, reduced = tape.get_local_and_global_gradients(loss, variables)
        return ([g for _, g in mine], [g for _, g in reduced], hvd.rank_op(), hvd.size_op(),
                hvd.local_rank_op(), hvd.local_size_op(), hvd.process_set_included_op(),
                hvd.process_set_included_op(99))
    for t in range(3):
        mine, reduced, *identity = step(*rank_data(r, t))
        assert [int(i) for i in identity] == [r, n, r, n, 1, -3], identity
        assert len(mine) == sum(local) and len(reduced) == len(variables) - sum(local)
        mine, reduced = iter(mine), iter(reduced)
        got = [next(mine if own else reduced).numpy() for own in local]
        if t == 0:                        # the pipeline fills: zeros
            assert all(not g.any() for g in got), "partial: step 0 is not zeros"
            continue
        own = local_gradients(t - 1, r, weights)
        averaged = ref.average([local_gradients(t - 1, k, weights) for k in range(n)])
        for i, is_local in enumerate(local):
            want = own[i] / np.float32(n) if is_local else averaged[i]
            assert np.array_equal(got[i], want), f"partial: step {t}, variable {i}"
    assert len(hvd.flush(variables)) == 1
    # A local source may have another shape on each rank (a model-parallel layer, as in
    # Horovod's test_model_parallel_model): only the shared sources are compared.
    own, shared = tf.Variable(tf.ones([r + 1])), tf.Variable(tf.ones([2]))
    with tf.GradientTape() as tape:
        loss = (tf.reduce_sum(own) + tf.reduce_sum(shared)) * (r + 1)
    tape = hvd.DistributedGradientTape(tape, pipeline_depth=1)
    tape.register_local_source(own)
    mine, averaged = tape.gradient(loss, [own, shared])
    assert mine.numpy().tolist() == [(r + 1) / n] * (r + 1), mine
    assert averaged.numpy().tolist() == [(n + 1) / 2] * 2, averaged


def check_autodiff():
    r, n = hvd.rank(), hvd.size()
    x = tf.Variable([1.0, 2.0, 3.0])
    c = tf.constant([1.0, 2.0, 3.0])
    cases = {   # loss -> this rank's gradient by Horovod's rules
        "allreduce Sum": (lambda: tf.reduce_sum(hvd.allreduce(x * (r + 1), op=hvd.Sum) * c),
                          n * (r + 1) * c),
        "allreduce Average": (lambda: tf.reduce_sum(hvd.allreduce(x * (r + 1)) * c),
                              (r + 1) * c),
        "grouped_allreduce": (lambda: tf.reduce_sum(hvd.grouped_allreduce([x, 2 * x])[1]),
                              tf.fill([3], 2.0)),
        "allgather": (lambda: tf.reduce_sum(hvd.allgather(tf.reshape(x, (3, 1))[:r + 1]) ** 2),
                      tf.concat([2 * x[:r + 1], tf.zeros(2 - r)], 0)),
        "broadcast": (lambda: tf.reduce_sum(hvd.broadcast(x * (r + 1), 0) * c),
                      c if r == 0 else tf.zeros(3)),
    }
    z = tf.Variable(tf.ones(2 * n))
    w = tf.range(2 * n, dtype=tf.float32)
    cases.update({    # z's gradient: Horovod's reducescatter (Sum: times the set's size) and
                      # alltoall (back along the received splits) rules
        "reducescatter Sum": (lambda: tf.reduce_sum(hvd.reducescatter(z * (r + 1), op=hvd.Sum)),
                              tf.fill([2 * n], float(n * (r + 1)))),
        "reducescatter Average": (lambda: tf.reduce_sum(hvd.reducescatter(z * (r + 1))),
                                  tf.fill([2 * n], float(r + 1))),
        "alltoall": (lambda: tf.reduce_sum(hvd.alltoall(z * (r + 1)) * w),
                     (r + 1) * tf.tile(w[2 * r:2 * r + 2], [n])),
    })
    for what, (loss, want) in cases.items():
        def grad(loss=loss, what=what):
            with tf.GradientTape() as tape:
                value = loss()
            return tape.gradient(value, z if what.startswith(("reducescatter", "alltoall")) else x)
        for mode, got in (("eager", grad()), ("tf.function", tf.function(grad)())):
            assert np.array_equal(got.numpy(), want.numpy()), (what, mode, got, want)
    # SyncBatchNormalization: this rank's rows of Keras's BatchNormalization of every rank's.
    inputs = [rank_data(k, 0)[0] for k in range(n)]
    weights = [rank_data(k, 1)[0] for k in range(n)]
    layer = hvd.SyncBatchNormalization(momentum=0.5)
    mine = tf.constant(inputs[r])
    with tf.GradientTape() as tape:
        tape.watch(mine)
        out = layer(mine, training=True)
        loss = tf.reduce_sum(out * weights[r])
    got = [out.numpy(), tape.gradient(loss, mine).numpy(), layer.moving_mean.numpy(),
           layer.moving_variance.numpy()]
    oracle = keras.layers.BatchNormalization(momentum=0.5)
    everyone = tf.constant(np.concatenate(inputs))
    with tf.GradientTape() as tape:
        tape.watch(everyone)
        out = oracle(everyone, training=True)
        loss = tf.reduce_sum(out * np.concatenate(weights))
    rows = slice(r * BATCH, (r + 1) * BATCH)
    want = [out.numpy()[rows], tape.gradient(loss, everyone).numpy()[rows],
            oracle.moving_mean.numpy(), oracle.moving_variance.numpy()]
    data = np.concatenate(inputs)   # E[x^2] - E[x]^2 amplifies rounding by E[x^2] / Var[x]
    condition = float(np.max(np.mean(data ** 2, 0) / np.var(data, 0)))
    rtol = gamma(8 * n * BATCH, "float32") * condition
    for name, a, b in zip(("output", "input gradient", "moving mean", "moving variance"),
                          got, want):
        assert relative_error(a, b) <= rtol, (name, relative_error(a, b), rtol)
    if n > 1:                       # this rank's batch alone normalises differently
        alone = keras.layers.BatchNormalization()(mine, training=True).numpy()
        assert relative_error(alone, want[0]) > 100 * rtol


# --- bad input ---------------------------------------------------------------------------
def expect_error(kind, words, fn):
    try:
        fn()
    except kind as exc:
        assert words in str(exc), f"{kind.__name__} without {words!r}: {exc}"
        return
    raise AssertionError(f"no {kind.__name__} ({words!r})")


def check_reordered_variables(r):
    """The same variables listed in another order on rank 1, every shape and bare name
    ("kernel") alike: compared by name, the ranks averaged each layer's gradient into
    the other layer, silently. Refused on every rank, naming the first position that
    differs with its path on each rank, through the tape and through the optimizer."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, use_bias=False),
                              keras.layers.Dense(4, use_bias=False)])
    variables = model.trainable_variables[::-1] if r == 1 else model.trainable_variables
    x = tf.ones((1, 4))

    def through_the_tape():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x))
        hvd.DistributedGradientTape(tape).gradient(loss, variables)
    # Paths as compared: layer/weight, each counter renumbered within the list
    # (pipeline/identity.py), whatever models this process built before.
    expect_error(ValueError, "the list of variables to differentiate differs between ranks: "
                 "source 0 is dense_1/kernel, shape (4, 4) float32 on rank 1 but "
                 "dense/kernel, shape (4, 4) float32 on rank 0", through_the_tape)

    def through_the_optimizer():
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
        opt.apply_gradients(zip([tf.ones_like(v) for v in variables], variables))
    expect_error(ValueError, "the model differs between ranks: variable 0 is "
                 "dense_1/kernel, shape (4, 4) float32 on rank 1 but "
                 "dense/kernel, shape (4, 4) float32 on rank 0",
                 through_the_optimizer)

    # broadcast_variables: an optimizer's slots in another order on rank 1 (same shape);
    # the slots' paths embed the model's auto-numbered name, so kinds are compared.
    adam = keras.optimizers.Adam()
    adam.build(model.trainable_variables)
    slots = list(adam.variables)
    if r == 1:
        slots[2], slots[3] = slots[3], slots[2]
    expect_error(ValueError, "the list of variables to broadcast differs between ranks: "
                 "variable 2 is velocity, shape (4, 4) float32 on rank 1 but momentum, "
                 "shape (4, 4) float32 on rank 0",
                 lambda: hvd.broadcast_variables(slots, root_rank=0))


def check_double_wrapping(r):
    """Two of our wrappers in a row reduce every gradient twice (at K=2 each: an effective
    depth of 3, a zero update counted while the tape fills), which ran silently: an optimizer
    wrapped twice is refused when wrapped, a tape's gradients applied through a wrapped
    optimizer at the first apply; each refusal names both wrappers."""
    import pipe_horovod.keras as khvd

    for first, second in ((hvd, hvd), (khvd, hvd), (hvd, khvd)):
        once = first.DistributedOptimizer(keras.optimizers.SGD(0.1))
        expect_error(ValueError, f"wrap the original Keras optimizer once: {first.__name__}."
                     f"DistributedOptimizer wraps it, and {second.__name__}.DistributedOptimizer "
                     "would reduce every gradient a second time",
                     lambda: second.DistributedOptimizer(once))
    model, opt = build(), hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    with tf.GradientTape() as tape:
        loss = loss_of(model, *rank_data(r, 0))
    grads = hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
    expect_error(ValueError, "these gradients are reduced twice: pipe_horovod.tensorflow."
                 "DistributedGradientTape reduces them, and pipe_horovod.tensorflow."
                 "DistributedOptimizer (which applies them) would reduce them again",
                 lambda: opt.apply_gradients(zip(grads, model.trainable_variables)))
    hvd.flush(model.trainable_variables)


def check_resume_at_another_depth():
    """A tape checkpoint saved at K=2 (one gradient in flight) resumed at K=1: the refusal
    named the warm-up, which the script never set; it names both depths."""
    model, _, _ = tape_run(2, 0, steps=SAVE_AT, eagerly=True)
    with tempfile.TemporaryDirectory() as directory:
        saved = tf.train.Checkpoint(pipeline=hvd.GradientsInFlight(
            model.trainable_variables)).write(str(Path(directory) / f"k2_rank{hvd.rank()}"))
        hvd.flush(model.trainable_variables)
        fresh = build(seed=7)
        tf.train.Checkpoint(pipeline=hvd.GradientsInFlight(fresh.trainable_variables)).read(
            saved)
    expect_error(ValueError, f"a checkpoint with 1 gradient(s) in flight at step {SAVE_AT} was "
                 "saved at pipeline_depth=2 and cannot resume at pipeline_depth=1: resume with "
                 "pipeline_depth=2", lambda: tape_run(1, 0, steps=1, model=fresh, eagerly=True))


def check_errors():
    r = hvd.rank()
    model = build()
    x, y = rank_data(r, 0)

    def twice():
        with tf.GradientTape() as tape:
            loss = loss_of(model, x, y)
        tape = hvd.DistributedGradientTape(tape, pipeline_depth=1)
        tape.gradient(loss, model.trainable_variables)
        tape.gradient(loss, model.trainable_variables)
    expect_error(RuntimeError, "only be used to compute one set of gradients", twice)
    hvd.flush(model.trainable_variables)

    def differing():               # rank 1 differentiates a differently shaped model
        other = keras.Sequential([keras.Input((IN,)), keras.layers.Dense(HIDDEN + r)])
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(other(x))
        hvd.DistributedGradientTape(tape).gradient(loss, other.trainable_variables)
    if hvd.size() > 1:
        expect_error(ValueError, "differs between ranks", differing)
        check_reordered_variables(r)
    check_double_wrapping(r)
    check_resume_at_another_depth()

    @tf.function(jit_compile=True)
    def compiled(t):
        return hvd.allreduce(t)
    expect_error(ValueError, "jit_compile=True", lambda: compiled(tf.ones(2)))
    expect_error(ValueError, "op must be", lambda: hvd.DistributedGradientTape(
        tf.GradientTape(), op=hvd.Adasum))
    for kind in (ValueError, NotImplementedError):     # ours, and Horovod's TF error
        expect_error(kind, "IndexedSlices", lambda: hvd.allreduce(
            tf.IndexedSlices(tf.ones((1, 2)), tf.constant([0])), op=hvd.Max))
    # Eagerly, the engine's errors are also the TensorFlow errors Horovod's ops raise.
    if hvd.size() > 1:
        for kind in (ValueError, tf.errors.InvalidArgumentError):
            expect_error(kind, "equally", lambda: hvd.alltoall(tf.ones([hvd.size() + 1])))
        for kind in (ValueError, tf.errors.FailedPreconditionError):
            expect_error(kind, "Mismatched", lambda: hvd.allreduce(tf.ones([2 + r])))
    expect_error(RuntimeError, "broadcast_variables", lambda: hvd.broadcast_global_variables(0))
    expect_error(ValueError, "pipeline_depth", lambda: hvd.DistributedGradientTape(
        tf.GradientTape(), pipeline_depth=0))
    expect_error(TypeError, "tf.GradientTape", lambda: hvd.DistributedGradientTape(model))
    expect_error(ValueError, "local layers must be", lambda: hvd.PartialDistributedGradientTape(
        tf.GradientTape(), local_layers=[model.layers[0], "dense"]))
    expect_error(ValueError, "fused=True", lambda: hvd.SyncBatchNormalization(fused=True))
    expect_error(TypeError, "scale_local_gradients must be a bool",
                 lambda: hvd.DistributedGradientTape(tf.GradientTape(), scale_local_gradients=1))
    expect_error(ValueError, "no gradient yet",
                 hvd.DistributedGradientTape(tf.GradientTape(), pipeline_depth=1).flush)
    expect_error(TypeError, "TensorFlow 1", lambda: hvd.DistributedOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.1)))
    # Nothing hangs after the errors: a collective still agrees.
    assert hvd.allreduce(tf.constant(1.0), op=hvd.Sum).numpy() == hvd.size()


def checks(directory):
    """The cases by name; keras_worker.py runs them as its modes tf.CASE."""
    return {"api": check_api, "tape": check_tape, "optimizer": check_optimizer,
            "checkpoint": lambda: check_checkpoint(directory), "errors": check_errors,
            "align": lambda: check_align(directory),
            "partial": check_partial, "autodiff": check_autodiff,
            "auto": lambda: check_auto(directory)}
