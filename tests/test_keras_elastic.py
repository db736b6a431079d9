"""pipe_horovod.keras.elastic: Horovod's Keras elastic names over the PyTorch adapter's loop.

Under horovodrun's elastic mode a worker fails mid-epoch (with a gradient in flight and
the model holding lookahead's prediction) and the job must end with the weights and
optimizer state of a run without the failure, bit for bit (the failure-free run in the
same launch is the oracle), each batch trained on once; a worker whose process dies
leaves the other to finish alone. In one process: what a commit and a restore hold, the
callbacks' counting, how a failure inside TensorFlow's graph comes out, and bad input.
"""
import os

import numpy as np
import pytest

import launcher

pytest.importorskip("tensorflow")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
keras = pytest.importorskip("keras")

pytestmark = pytest.mark.timeout(600)
WORKER = launcher.WORKERS / "keras_elastic_worker.py"


def _horovodrun_elastic(tmp_path, cases, backend):
    """horovodrun's elastic mode on two "hosts" of this machine (127.0.0.1 is local to
    horovodrun: no ssh), listed by a discovery script."""
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("localhost:1\n127.0.0.1:1\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    cmd = [str(launcher.BIN / "horovodrun"), "-np", "2", "--min-np", "1", "--max-np", "2",
           "--host-discovery-script", str(script), "--network-interface", "lo", "--gloo",
           launcher.sys.executable, str(WORKER), cases]
    return launcher.run_command(cmd, 2, timeout=500, env={"KERAS_BACKEND": backend},
                                expect_ok=False)


# The TensorFlow launch also runs the TensorFlow custom loop's case (pipe_horovod.tensorflow
# .elastic with a DistributedGradientTape) and then kills a worker's process
# (each its own launch would cost ~30 s of start-up); the torch backend's failure surfaces
# outside any graph, so its launch checks the restore alone.
@pytest.mark.parametrize("backend,cases", [("tensorflow", "fail-one,tf-loop,crash"),
                                           ("torch", "fail-one")])
def test_horovodrun_elastic_failure_mid_epoch_restores_bit_exactly(tmp_path, backend, cases):
    if launcher.horovod_missing():
        pytest.skip(launcher.horovod_missing())
    code, out = _horovodrun_elastic(tmp_path, cases, backend)
    what = f"keras_elastic_worker.py {cases} on {backend}"
    assert "INJECTED_FAILURE rank=1" in out, out
    # Both ranks went through the reset (rank 0 by its failed collectives), and both
    # runs ended alike on both ranks.
    launcher.assert_case(code, out, 2, "fail-one", what)
    if "tf-loop" in cases:           # the custom loop restored bit for bit as well
        launcher.assert_case(code, out, 2, "tf-loop", what)
        assert out.count("INJECTED_FAILURE rank=1") == 2, out
    assert "ELASTIC_RESET rank=0 size=2" in out and "ELASTIC_RESET rank=1 size=2" in out, out
    if "crash" in cases:
        assert "INJECTED_CRASH rank=1" in out and "ELASTIC_RESET rank=0 size=1" in out, out
        launcher.assert_case(code, out, 1, "crash", what)
        assert code == 0 and "WORKER_OK rank=0 size=1" in out, out
    else:
        launcher.assert_finished(code, out, 2, what)


# --- in one process, local engine -----------------------------------------------
@pytest.fixture
def hvd():
    if keras.backend.backend() != "tensorflow":
        pytest.skip("in-process checks run on TensorFlow")
    import pipe_horovod.keras as hvd
    hvd.init("local")
    yield hvd
    hvd.shutdown()


def _model(hvd, **options):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"),
                              keras.layers.Dense(2)])
    # predivide 2 (exact): one process sends its gradients through the pipeline as on
    # several ranks, so gradients are in flight and the model holds a prediction.
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.05), gradient_predivide_factor=2.0,
                                   **options)
    model.compile(optimizer=opt, loss="mse")
    return model, opt


def _data(seed, batches=3):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((4 * batches, 3)).astype("float32"),
            rng.standard_normal((4 * batches, 2)).astype("float32"))


def _fit(model, seed, callbacks=()):
    x, y = _data(seed)
    model.fit(x, y, batch_size=4, shuffle=False, verbose=0, callbacks=list(callbacks))


def _steps(model, seed):
    """Three steps; unlike fit's end, train_on_batch leaves lookahead's prediction in the
    model (what a commit inside fit sees)."""
    x, y = _data(seed)
    for i in range(3):
        model.train_on_batch(x[4 * i:4 * i + 4], y[4 * i:4 * i + 4])


def _values(variables):
    return [np.array(keras.ops.convert_to_numpy(v), copy=True) for v in variables]


def _assert_equal(a, b, what):
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        assert np.array_equal(x, y), f"{what} {i} differs"


def test_restore_returns_to_the_commit_with_its_gradient_in_flight(hvd):
    from pipe_horovod import engine

    model, opt = _model(hvd)
    state = hvd.elastic.KerasState(model, epoch=0, log=[])
    _steps(model, 0)
    state.epoch, state.log = 1, ["a"]
    state.commit()
    assert opt.in_flight == 1
    weights, slots = _values(model.variables), _values(opt.variables)
    twin, twin_opt = _model(hvd)                 # carries on from the commit, undisturbed
    store = {}
    opt.save_own_variables(store)
    for v, w in zip(twin.variables, weights):
        v.assign(w)
    twin_opt.build(twin.trainable_variables)
    twin_opt.load_own_variables(store)
    _steps(model, 1)                               # changes everything, then "fails"
    state.epoch = 2
    state.log.append("changed in place")
    state.restore()
    engine.current().settle_in_flight()          # what elastic's reset does next
    assert state.epoch == 1 and state.log == ["a"]
    _assert_equal(_values(model.variables), weights, "weight")
    _assert_equal(_values(opt.variables), slots, "optimizer variable")
    assert opt.in_flight == 1
    for m in (model, twin):
        _steps(m, 2)
    opt.flush()
    twin_opt.flush()
    _assert_equal(_values(model.variables), _values(twin.variables), "weight after the restore")


def test_sync_keeps_a_rank_own_prediction_and_gives_others_the_real_weights(hvd,
                                                                           monkeypatch):
    from pipe_horovod import engine

    model, opt = _model(hvd)
    state = hvd.elastic.KerasState(model)
    _steps(model, 0)
    predicted = _values(model.trainable_variables)
    state.sync()                       # its state is rank 0's: it keeps its own prediction
    _assert_equal(_values(model.trainable_variables), predicted, "own prediction")
    # Rank 0 trained on other data: this rank takes its state, with the real weights in
    # the model (computed at them, its next gradient needs none of its own).
    root, root_opt = _model(hvd)
    _steps(root, 1)                      # a gradient in flight, and a prediction in the model
    assert root_opt.in_flight == 1
    rank0 = hvd.elastic.KerasState(root)._committable()
    (_, real), _ = rank0
    slots = _values(root_opt.variables)
    assert not any(np.array_equal(r, p) for r, p in zip(real, _values(root.trainable_variables)))
    monkeypatch.setattr(engine, "broadcast_object", lambda obj, root_rank: rank0)
    monkeypatch.setattr(engine, "rank", lambda: 1)
    state.sync()
    _assert_equal(_values(model.trainable_variables), real, "real weight of rank 0")
    _assert_equal(_values(opt.variables), slots, "optimizer variable of rank 0")
    assert opt.in_flight == 1
    monkeypatch.undo()
    for m, o in ((model, opt), (root, root_opt)):     # and both go on alike from the real
        o.finalize_variable_values(m.trainable_variables)   # weights (as after fit)
        _steps(m, 3)
        o.flush()
    _assert_equal(_values(model.variables), _values(root.variables), "weight after the sync")


def test_callbacks_count_epochs_and_batches_across_a_resumed_epoch(hvd):
    model, _ = _model(hvd)
    state = hvd.elastic.KerasState(model, epoch=0, batch=0)
    seen = []

    class Record(keras.callbacks.Callback):
        def on_batch_end(self, batch, logs=None):
            seen.append((state.epoch, state.batch))

    commits = []
    state.commit = lambda: commits.append((state.epoch, state.batch))
    callbacks = [hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.UpdateBatchStateCallback(state), Record(),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=2)]
    _fit(model, 0, callbacks)                    # epoch 0: three batches
    assert seen == [(0, 1), (0, 2), (0, 3)] and (state.epoch, state.batch) == (1, 0)
    assert commits == [(0, 2), (1, 0)]           # every 2 batches, and at the epoch's end
    state.batch = 1                              # as restored: epoch 1 had one batch done
    seen.clear()
    x, y = _data(1, batches=2)                   # the rest of epoch 1
    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    assert seen[:2] == [(1, 2), (1, 3)] and seen[2:] == [(2, 1), (2, 2)]
    assert (state.epoch, state.batch) == (3, 0)


def test_a_failure_inside_the_graph_comes_out_as_the_engine_raised_it(hvd):
    import tensorflow as tf

    from pipe_horovod.engine import HorovodInternalError
    from pipe_horovod.tensorflow import bridge

    def collective(x):
        raise HorovodInternalError("a peer left")

    step = tf.function(lambda x: tf.numpy_function(
        bridge.keeping_failures(collective), [x], tf.float32))
    calls = []

    @hvd.elastic.run
    def train(state):
        calls.append(1)
        if len(calls) == 1:
            step(tf.constant(1.0))               # TensorFlow's UnknownError, then restored
        return len(calls)

    model, _ = _model(hvd)
    assert train(hvd.elastic.KerasState(model)) == 2
    assert bridge.failure_behind(tf.errors.UnknownError(None, None, "x")) is None


def test_bad_input_is_named(hvd):
    model = keras.Sequential([keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="must be built first"):
        hvd.elastic.KerasState(model)
    model.build((None, 3))
    with pytest.raises(ValueError, match="no optimizer"):
        hvd.elastic.KerasState(model)
    with pytest.raises(ValueError, match="batches_per_commit must be an integer >= 1"):
        hvd.elastic.CommitStateCallback(hvd.elastic.KerasState(*_model(hvd)),
                                        batches_per_commit=0)
