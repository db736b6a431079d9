"""Elastic Keras training under horovodrun's elastic mode, with a failure mid-epoch.

`python keras_elastic_worker.py MODE[,MODE]` (KERAS_BACKEND picks the backend), launched
by horovodrun's elastic mode on two "hosts" (localhost:1, 127.0.0.1:1):

* fail-one: train twice under hvd.elastic.run with the default pipelined optimizer
  (K=2, lookahead), model.fit one epoch at a time with Horovod's three elastic callbacks
  (commit every COMMIT batches). The first run is clean: the oracle. In the second, rank 1
  raises HorovodInternalError after batch FAIL_BATCH of epoch FAIL_EPOCH (after a commit,
  with a gradient in flight and the model holding lookahead's prediction). Its engine
  resets, which fails rank 0's collectives inside its TensorFlow train step; every rank
  restores the commit, Horovod re-forms the job in the same processes, the state is
  synchronized from rank 0 and fit resumes at the committed batch. Every rank checks
  that both runs end with the same weights and optimizer state, bit for bit.
* tf-loop (TensorFlow backend): the same twice with a TensorFlow custom loop instead of
  fit: pipe_horovod.tensorflow's DistributedGradientTape at its default depth (K=2) in a
  tf.function step feeding a plain Keras Adam, under hvd.elastic.run with a
  TensorFlowKerasState committed every COMMIT steps. Rank 1 fails after step FAIL_BATCH
  of FAIL_EPOCH (a gradient in flight in the tape's pipeline since the commit); rank 0's
  collective fails inside its tf.function step (TensorFlow's UnknownError, the engine
  failure behind it); both restore, and both runs end alike, bit for bit.
* crash (last in a launch): rank 1's process dies (os._exit) at that point; Horovod
  blacklists its host, rank 0's collectives fail, it restores the commit and finishes
  alone.

Every rank checks that each epoch trained on each of its batches exactly once (counted
from the committed state, so batches undone by a restore count once).
"""
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import keras  # noqa: E402
import numpy as np  # noqa: E402

import launcher  # noqa: E402
import pipe_horovod.keras as hvd  # noqa: E402
from pipe_horovod.engine import HorovodInternalError  # noqa: E402

EPOCHS, BATCHES, BATCH, IN, OUT = 3, 8, 4, 6, 3
COMMIT, FAIL_EPOCH, FAIL_BATCH = 3, 1, 5
_resets = []


def epoch_data(rank, epoch, start):
    """This rank's batches `start`.. of `epoch` (the same whatever happened before)."""
    rng = np.random.default_rng([rank, epoch])
    x = rng.standard_normal((BATCHES * BATCH, IN)).astype("float32")
    y = rng.standard_normal((BATCHES * BATCH, OUT)).astype("float32")
    return x[start * BATCH:], y[start * BATCH:]


class Inject(keras.callbacks.Callback):
    """After the step that completes batch FAIL_BATCH of FAIL_EPOCH, once: fail (rank 1)."""

    def __init__(self, state, mode):
        super().__init__()
        self.state, self.mode, self.fired = state, mode, False

    def on_train_batch_end(self, batch, logs=None):
        if self.fired or hvd.rank() != 1 or self.mode == "clean" or \
                (self.state.epoch, self.state.batch) != (FAIL_EPOCH, FAIL_BATCH):
            return
        self.fired = True
        if self.mode == "crash":
            print(f"INJECTED_CRASH rank={hvd.rank()}", flush=True)
            os._exit(1)
        print(f"INJECTED_FAILURE rank={hvd.rank()}", flush=True)
        raise HorovodInternalError("injected failure after a step, before the commit")


class Count(keras.callbacks.Callback):
    """Counts, in the state, the batches each epoch trained on (so a restore undoes the
    ones after the commit)."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_train_batch_end(self, batch, logs=None):
        self.state.trained = self.state.trained + [(self.state.epoch, self.state.batch)]


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((IN,)), keras.layers.Dense(16, activation="tanh"),
                             keras.layers.Dense(OUT)])


def _record_resets(state):
    state.register_reset_callbacks([lambda: _resets.append(hvd.size()) or print(
        f"ELASTIC_RESET rank={hvd.rank()} size={hvd.size()}", flush=True)])


def _trained(state, model, opt):
    """After a run: every batch of every epoch trained exactly once (the restore undid
    the ones after the commit); the weights and the optimizer's variables."""
    for epoch in range(EPOCHS):
        done = sorted(b for e, b in state.trained if e == epoch)
        assert done == list(range(1, BATCHES + 1)), f"epoch {epoch} trained batches {done}"
    return ([np.asarray(keras.ops.convert_to_numpy(v)) for v in model.variables],
            [np.asarray(keras.ops.convert_to_numpy(v)) for v in opt.variables])


def _restores_bit_exactly(train, what=""):
    """`train("fail-one")` (one reset to two ranks) ends with `train("clean")`'s weights
    and optimizer variables, bit for bit."""
    want = train("clean")
    assert not _resets, _resets
    got = train("fail-one")
    assert _resets == [2], f"expected one reset to two ranks, saw sizes {_resets}"
    for kind, a, b in (("weight", want[0], got[0]), ("optimizer variable", want[1], got[1])):
        assert len(a) == len(b)
        for i, (x, y) in enumerate(zip(a, b)):
            assert np.array_equal(x, y), f"{what}{kind} {i} differs after the restore"
    _resets.clear()


def train_once(mode):
    model = _model()
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01))   # the default: K=2, lookahead
    model.compile(optimizer=opt, loss="mse")
    state = hvd.elastic.KerasState(model, epoch=0, batch=0, trained=[])
    _record_resets(state)
    # Order matters as in Horovod: the state is updated before it is committed.
    callbacks = [hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.UpdateBatchStateCallback(state), Count(state),
                 Inject(state, mode), hvd.elastic.CommitStateCallback(state, COMMIT)]

    @hvd.elastic.run
    def train(state):
        while state.epoch < EPOCHS:
            x, y = epoch_data(hvd.rank(), state.epoch, state.batch)
            model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                      callbacks=callbacks)
        opt.flush()

    train(state)
    return _trained(state, model, opt)


def check_fail_one():
    _restores_bit_exactly(train_once)


def train_loop_once(mode):
    """The tf-loop case's training (module docstring); returns weights and Adam's state."""
    import tensorflow as tf

    import pipe_horovod.tensorflow as tf_hvd

    model = _model()
    opt = keras.optimizers.Adam(0.01)
    opt.build(model.trainable_variables)
    variables = model.trainable_variables
    state = tf_hvd.elastic.TensorFlowKerasState(model, optimizer=opt, epoch=0, batch=0,
                                                trained=[])
    _record_resets(state)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        tape = tf_hvd.DistributedGradientTape(tape)           # the default: K=2
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))

    fired = []

    @tf_hvd.elastic.run
    def train(state):
        while state.epoch < EPOCHS:
            x, y = epoch_data(hvd.rank(), state.epoch, 0)
            while state.batch < BATCHES:
                b = state.batch
                step(x[b * BATCH:(b + 1) * BATCH], y[b * BATCH:(b + 1) * BATCH])
                state.batch += 1
                state.trained = state.trained + [(state.epoch, state.batch)]
                if (mode == "fail-one" and not fired and hvd.rank() == 1
                        and (state.epoch, state.batch) == (FAIL_EPOCH, FAIL_BATCH)):
                    fired.append(1)
                    print(f"INJECTED_FAILURE rank={hvd.rank()}", flush=True)
                    raise HorovodInternalError("injected failure after a step, before the "
                                               "commit")
                if state.batch % COMMIT == 0:
                    state.commit()
            state.epoch, state.batch = state.epoch + 1, 0
            state.commit()
        for grads in tf_hvd.flush(variables):
            opt.apply_gradients(zip(grads, variables))

    train(state)
    return _trained(state, model, opt)


def check_tf_loop():
    _restores_bit_exactly(train_loop_once, "tf-loop: ")


def check_crash():
    train_once("crash")
    assert _resets == [1], f"expected one reset to one rank, saw sizes {_resets}"


def main():
    hvd.init()
    launcher.worker_cases({"fail-one": check_fail_one, "tf-loop": check_tf_loop,
                           "crash": check_crash}, sys.argv[1], hvd.rank)
    print(f"WORKER_OK rank={hvd.rank()} size={hvd.size()}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
