"""What tune="auto" costs a Keras step on TensorFlow while it measures at K=1: the digits
CNN's shape in fit, 2 ranks, three fits of each kind interleaved, each kind's median step
(steps 20 to the end of one epoch, 200 steps): `pipeline_depth=1`; auto measuring
(PIPE_HOROVOD_TUNE_STEPS very large), the step traced for K=1 (what fit does); and auto
measuring with the step traced for everything auto may need (as a custom loop's).
With --traces, one auto fit that tries K=2 (after 20 measured steps) prints each batch's
milliseconds: the traces show as the slow batches.

    .venv/bin/torchrun --nproc-per-node 2 scripts/keras_auto_step_cost.py
    .venv/bin/horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python scripts/keras_auto_step_cost.py
"""
import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ["PIPE_HOROVOD_TUNE"] = ""

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import layers  # noqa: E402

import pipe_horovod.keras as hvd  # noqa: E402

STEPS, BATCH = 200, 32


def model():
    keras.utils.set_random_seed(1)
    return keras.Sequential([
        keras.Input((8, 8, 1)), layers.Conv2D(16, 3, padding="same", activation="relu"),
        layers.Conv2D(32, 3, padding="same", activation="relu"), layers.MaxPooling2D(2),
        layers.Flatten(), layers.Dense(64, activation="relu"), layers.Dense(10)])


class Clock(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.times = []

    def on_train_batch_begin(self, batch, logs=None):
        self.began = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self.began)


def fit(kind, steps):
    rng = np.random.default_rng(hvd.rank())
    x = rng.normal(size=(BATCH * steps, 8, 8, 1)).astype("float32")
    y = rng.integers(0, 10, size=(BATCH * steps,))
    m = model()
    options = {"pipeline_depth": 1, "tune": "off"} if kind == "sync" else {"tune": "auto"}
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.5), **options)
    if kind == "full":          # the step traced once, as in a custom loop
        opt.fit_retraces = lambda on: type(opt).fit_retraces(opt, False)
    m.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    clock = Clock()
    m.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[clock])
    return clock.times


def main():
    hvd.init()
    if "--traces" in sys.argv:
        os.environ["PIPE_HOROVOD_TUNE_STEPS"] = "20"
        times = fit("auto", 60)
        if hvd.rank() == 0:
            print("ms per batch:", " ".join(f"{t * 1e3:.0f}" for t in times), flush=True)
        return
    os.environ["PIPE_HOROVOD_TUNE_STEPS"] = "100000"
    medians = {"sync": [], "lean": [], "full": []}
    for _ in range(3):
        for kind, runs in medians.items():
            runs.append(statistics.median(fit(kind, STEPS)[20:]) * 1e3)
    if hvd.rank() == 0:
        for kind, runs in medians.items():
            print(f"{kind:5} {' '.join(f'{t:.2f}' for t in runs)}  median "
                  f"{statistics.median(runs):.2f} ms", flush=True)


if __name__ == "__main__":
    main()
