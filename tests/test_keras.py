"""The Keras 3 adapter on real workers: `model.fit` against the NumPy reference
(tests/keras_reference.py), on the TensorFlow and torch backends, under plain
python, torchrun and horovodrun."""
import numpy as np
import pytest

import launcher
from keras_launches import CHECKPOINT_DEPTH, fit_launch

pytest.importorskip("tensorflow")
pytest.importorskip("keras")


@pytest.mark.parametrize("backend", ["tensorflow", "torch"])
@pytest.mark.parametrize("engine_name, np_", [("local", 1), ("torch", 2), ("horovod", 2)])
def test_fit_matches_the_reference(tmp_path_factory, backend, engine_name, np_):
    """Weights after fit and after flush, K = 1, 2, 3, warm-up 0 and 2, SGD and Adam, plain
    and with lookahead (on torch: the other staleness options too); the callbacks; bad input
    raising on every rank; K=2 hiding a slow reduction; Horovod's value collectives and
    load_model; on TensorFlow under horovodrun, through DLPack."""
    launcher.skip_without(engine_name)
    _, code, out = fit_launch(tmp_path_factory, engine_name, backend, np_)
    launcher.assert_finished(code, out, np_, f"keras_worker.py on {engine_name} {backend}")


@pytest.mark.parametrize("backend, engine_name", [("tensorflow", "torch"), ("torch", "horovod")])
def test_save_load_continue_is_bit_identical(tmp_path_factory, backend, engine_name):
    """model.save with gradients in flight (K=3: two), load_model in new processes, fit on;
    plain Pipe-SGD in Horovod's pattern (rank 0 alone loads; BroadcastGlobalVariablesCallback
    gives the others its weights, slots and gradients in flight), with lookahead (its real
    weights and kept gradients saved too), and int8 with error feedback per ring hop and in
    two stages on the engine's collectives (each rank's residuals saved too)."""
    launcher.skip_without(engine_name)
    tmp, code, out = fit_launch(tmp_path_factory, engine_name, backend, 2)
    for mode in ("full", "save"):    # the fit test answers for the launch's other modes
        launcher.assert_case(code, out, 2, mode, f"keras_worker.py on {engine_name} {backend}")
    launcher.run(engine_name, 2, "keras_worker.py", "resume", CHECKPOINT_DEPTH, tmp / "m.keras",
                 tmp / "resumed.npz", env={"KERAS_BACKEND": backend}, timeout=300)
    for case in ("None", "lookahead", "int8", "int8-engine"):
        want = np.load(tmp / f"{case}-full.npz")
        got = np.load(tmp / f"{case}-resumed.npz")
        assert want.files == got.files
        for key in want.files:
            assert np.array_equal(want[key], got[key]), (case, key)


def test_files_saved_mid_epoch_hold_the_real_weights(tmp_path_factory):
    """TensorFlow, lookahead at K=2 on 2 ranks (the model holds each rank's prediction
    between steps): ModelCheckpoint(save_freq=N) as a model and as weights, and a callback's
    own save_weights, mid-epoch, write the real weights as the model's (loaded without the
    optimizer: the optimizer's real weights at that batch, bit for bit); load_model of the
    file continues bit-identically with the run that never saved; outside fit's writers a
    save warns, and opt.real_weights() writes the real ones (keras_worker's midsave)."""
    launcher.skip_without("torch")
    _, code, out = fit_launch(tmp_path_factory, "torch", "tensorflow", 2)
    launcher.assert_case(code, out, 2, "midsave", "keras_worker.py on torch tensorflow")


def test_unsupported_backend_is_named(monkeypatch):
    import keras
    import pipe_horovod.keras as phvd
    from pipe_horovod._keras import optimizer

    monkeypatch.setattr(optimizer, "_backend", lambda: "jax")
    with pytest.raises(ValueError, match="'jax'.*supports tensorflow and torch"):
        phvd.DistributedOptimizer(keras.optimizers.SGD(0.1))


def test_wrapping_before_init_is_a_clear_error():
    import keras
    import pipe_horovod.keras as phvd

    assert not phvd.is_initialized()
    with pytest.raises(ValueError, match="call pipe_horovod.init"):
        phvd.DistributedOptimizer(keras.optimizers.SGD(0.1))


def test_horovod_keras_script_runs_with_only_its_import_changed(tmp_path):
    """Under horovodrun, Horovod's own Keras arguments and callbacks, a tf.data pipeline,
    rank-0 checkpoints and no flush(): it runs, every rank ends with the same weights, every
    computed gradient applied (fit flushes), and nothing is said about unapplied ones.
    Launched again for one more epoch, it resumes as Horovod's Keras ImageNet example
    does (hvd.broadcast of the epoch, hvd.load_model on rank 0 alone). (The torch engine
    runs the same TensorFlow path in test_fit_matches_the_reference.)"""
    launcher.skip_without("horovod")
    pytest.importorskip("sklearn")
    env = {"KERAS_BACKEND": "tensorflow"}
    _, out = launcher.run("horovod", 2, "horovod_keras_script.py", tmp_path, 2, timeout=300,
                          env=env)
    assert (tmp_path / "checkpoint-2.keras").exists() and (tmp_path / "weights-2.npy").exists()
    assert "resumed_from=0" in out
    assert "were not applied" not in out       # fit applied them
    _, out = launcher.run("horovod", 2, "horovod_keras_script.py", tmp_path, 3, timeout=300,
                          env=env)
    assert "resumed_from=2" in out and (tmp_path / "checkpoint-3.keras").exists()
    assert not np.array_equal(np.load(tmp_path / "weights-3.npy"),
                              np.load(tmp_path / "weights-2.npy")), "it trained on"
