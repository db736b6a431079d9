"""pipe_horovod.tensorflow.elastic in one process (local engine): what a commit, a restore
and a sync hold, with a DistributedGradientTape's gradient in flight, against a run that
never failed (bit for bit), and bad input. The horovodrun launch with a rank failing is
test_keras_elastic.py's TensorFlow launch (its tf-loop case, keras_elastic_worker.py).
"""
import os

import numpy as np
import pytest

pytest.importorskip("tensorflow")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
keras = pytest.importorskip("keras")
import tensorflow as tf  # noqa: E402

from pipe_horovod import engine  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def hvd():
    if keras.backend.backend() != "tensorflow":
        pytest.skip("pipe_horovod.tensorflow runs on Keras's TensorFlow backend")
    import pipe_horovod.tensorflow as hvd
    hvd.init("local")
    yield hvd
    hvd.shutdown()


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"),
                             keras.layers.Dense(2)])


def _batch(i):
    rng = np.random.default_rng(i)
    return (rng.standard_normal((4, 3)).astype("float32"),
            rng.standard_normal((4, 2)).astype("float32"))


def _loop(hvd, model, opt):
    """A custom loop's step: tf.function, DistributedGradientTape at the default depth
    (2), predivide 2 so the local engine reduces (one rank sends as on several)."""
    variables = model.trainable_variables

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        tape = hvd.DistributedGradientTape(tape, gradient_predivide_factor=2.0)
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))

    def finish():
        for grads in hvd.flush(variables):
            opt.apply_gradients(zip(grads, variables))

    return step, finish


def _values(variables):
    return [np.array(tf.convert_to_tensor(v), copy=True) for v in variables]


def _assert_equal(a, b, what):
    assert len(a) == len(b), what
    for i, (x, y) in enumerate(zip(a, b)):
        assert np.array_equal(x, y), f"{what} {i} differs"


@pytest.mark.parametrize("kind", ["TensorFlowState", "TensorFlowKerasState"])
def test_restore_after_a_failure_goes_on_bit_for_bit(hvd, kind):
    """Commit after step 3 (a gradient in flight), two steps that a failure undoes, the
    restore, the rest: the weights and optimizer state of the run that never failed."""
    want_model, want_opt = _model(), keras.optimizers.Adam(0.05)
    step, finish = _loop(hvd, want_model, want_opt)
    for i in range(6):
        step(*_batch(i))
    finish()

    model, opt = _model(), keras.optimizers.Adam(0.05)
    opt.build(model.trainable_variables)
    state = (hvd.elastic.TensorFlowState(model.variables + opt.variables, batch=0)
             if kind == "TensorFlowState"
             else hvd.elastic.TensorFlowKerasState(model, optimizer=opt, batch=0))
    step, finish = _loop(hvd, model, opt)
    for i in range(3):
        step(*_batch(i))
    state.batch = 3
    state.commit()
    for i in (10, 11):                         # trained on, then lost to the failure
        step(*_batch(i))
    state.batch = 5
    state.restore()
    engine.current().settle_in_flight()           # what elastic's reset does next
    assert state.batch == 3
    for i in range(state.batch, 6):
        step(*_batch(i))
    finish()
    _assert_equal(_values(model.variables), _values(want_model.variables), "weight")
    _assert_equal(_values(opt.variables), _values(want_opt.variables), "optimizer variable")


def test_a_restore_before_the_first_commit_empties_a_pipeline_built_since(hvd):
    model, opt = _model(), keras.optimizers.SGD(0.1)
    state = hvd.elastic.TensorFlowState(model.trainable_variables)
    weights = _values(model.trainable_variables)
    step, finish = _loop(hvd, model, opt)
    for i in range(3):
        step(*_batch(i))
    state.restore()
    engine.current().settle_in_flight()
    _assert_equal(_values(model.trainable_variables), weights, "weight")
    assert hvd.flush(model.trainable_variables) == [], "a gradient in flight survived"


def test_sync_gives_a_rank_rank0s_gradients_in_flight(hvd, monkeypatch):
    """A worker whose pipeline is not built yet gets rank 0's in-flight gradient at its
    first gradient(); one whose pipeline differs takes rank 0's; both then train as
    rank 0 does."""
    from pipe_horovod.tensorflow import elastic

    root, root_opt = _model(), keras.optimizers.SGD(0.1)
    step, finish = _loop(hvd, root, root_opt)
    for i in range(3):
        step(*_batch(i))
    rank0 = elastic._TapesInFlight(root.trainable_variables).snapshot()
    assert [len(s["in_flight"]) for s in rank0.values()] == [1]
    weights = _values(root.trainable_variables)
    synced = []
    for built in (False, True):
        model, opt = _model(), keras.optimizers.SGD(0.1)
        step_here, finish_here = _loop(hvd, model, opt)
        if built:
            step_here(*_batch(7))            # its own gradient in flight, to be replaced
        for v, w in zip(model.trainable_variables, weights):
            v.assign(w)                      # (what broadcast_variables does)
        state = hvd.elastic.TensorFlowState(model.trainable_variables)
        monkeypatch.setattr(elastic, "broadcast_object", lambda obj, root_rank: rank0)
        monkeypatch.setattr(elastic, "rank", lambda: 1)
        monkeypatch.setattr(elastic, "broadcast_variables", lambda variables, root_rank: None)
        state.sync()
        monkeypatch.undo()
        step_here(*_batch(3))
        finish_here()
        synced.append(_values(model.trainable_variables))
    step(*_batch(3))                         # rank 0 carries on alike
    finish()
    for built, values in zip((False, True), synced):
        _assert_equal(values, _values(root.trainable_variables),
                      f"weight after the sync (pipeline built before it: {built})")


def test_sync_keeps_each_ranks_own_residuals_and_local_gradients():
    """Rank 0's gradients in flight replace a rank's, but never its error-feedback
    residuals (each rank's codec memory) nor, at the same steps, its gradients of local
    sources; a pipeline built only after the sync starts with no residuals."""
    from pipe_horovod.tensorflow import elastic

    def state(steps, fill, residual):
        return {"steps": steps, "in_flight": [{"a": np.full(2, fill), "b": np.full(2, fill)}],
                "error_feedback": {0: {"a": np.full(2, residual)}, -1: {"b": np.ones(1)}}}
    own, rank0 = state(3, 1.0, 5.0), state(3, 2.0, 9.0)
    for local, steps, expected_b in ((set(), 3, 2.0), ({"b"}, 3, 1.0), ({"b"}, 4, 2.0)):
        got = elastic._keeping_local(own, {**rank0, "steps": steps}, local)
        assert got["error_feedback"] is own["error_feedback"], (local, steps)
        assert got["steps"] == steps and np.array_equal(got["in_flight"][0]["a"], [2.0, 2.0])
        assert np.array_equal(got["in_flight"][0]["b"], [expected_b] * 2), (local, steps)


def test_bad_input_is_named(hvd):
    v = tf.Variable([1.0])
    with pytest.raises(ValueError, match="TensorFlow 1's"):
        hvd.elastic.TensorFlowState([v], session=object())
    with pytest.raises(TypeError, match=r"variables\[1\] is a ndarray"):
        hvd.elastic.TensorFlowState([v, np.zeros(2)])
    model = keras.Sequential([keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="must be built first"):
        hvd.elastic.TensorFlowKerasState(model)
