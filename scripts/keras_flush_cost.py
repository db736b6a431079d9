#!/usr/bin/env python
"""What flush_in_fit costs per epoch (issue 36, item 4): fit's epochs timed with the
pipeline drained after each epoch's last batch (flush_in_fit=True, the default) and
without (False), the same model, data and steps, on every rank of a launch.

    horovodrun -np 2 -H localhost:2 --gloo python scripts/keras_flush_cost.py \\
        --epochs 12 --steps 50 --json /tmp/flush_cost.json

A drain applies the K-1 gradients in flight with their reductions waited for
at once, so its cost is about one exposed reduction per epoch (plus, on
TensorFlow, one update run eagerly); the script times whole epochs (wall time
from on_epoch_begin to on_epoch_end, validation excluded) and reports the
median of each setting and their difference, for every K and backend asked.
Settings alternate epoch blocks, so a machine's drift hits both alike. On a
loaded machine the epochs' spread hides the difference, so it also times the
drains themselves (the flush calls fit makes in an epoch): an upper bound on
the cost, since without the drain the next step would wait for part of it.
"""
import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=12, help="timed epochs per setting")
    p.add_argument("--steps", type=int, default=50, help="steps per epoch")
    p.add_argument("--width", type=int, default=1024, help="hidden width of the MLP")
    p.add_argument("--depths", default="2", help="pipeline depths, comma-separated")
    p.add_argument("--json", help="write the results here (rank 0)")
    args = p.parse_args(argv)

    import keras
    import numpy as np

    import pipe_horovod.keras as hvd

    hvd.init()
    rng = np.random.default_rng(hvd.rank())
    x = rng.standard_normal((args.steps * 32, 256)).astype("float32")
    y = rng.standard_normal((args.steps * 32, 10)).astype("float32")
    results = []
    for depth in [int(d) for d in args.depths.split(",")]:
        models = {}
        for flush in (False, True):
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((256,)),
                                      keras.layers.Dense(args.width, activation="relu"),
                                      keras.layers.Dense(args.width, activation="relu"),
                                      keras.layers.Dense(10)])
            model.compile(optimizer=hvd.DistributedOptimizer(
                keras.optimizers.SGD(0.01, momentum=0.9), pipeline_depth=depth,
                flush_in_fit=flush), loss="mse")
            model.fit(x, y, batch_size=32, epochs=1, verbose=0)      # traced, pipeline built
            models[flush] = model
        drains = timed_flush(models[True].optimizer)
        seconds = {False: [], True: []}
        drain_s = []
        for block in range(args.epochs):
            for flush in ((False, True) if block % 2 == 0 else (True, False)):
                clock = epoch_clock(keras)
                drains.clear()
                models[flush].fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False,
                                  callbacks=[clock])
                seconds[flush].append(clock.seconds)
                if flush:
                    drain_s.append(sum(drains))
        for model in models.values():
            model.optimizer.flush()
        row = {"backend": keras.backend.backend(), "size": hvd.size(), "pipeline_depth": depth,
               "steps_per_epoch": args.steps, "width": args.width,
               "epoch_s_no_flush": float(np.median(seconds[False])),
               "epoch_s_flush": float(np.median(seconds[True]))}
        row["cost_s"] = row["epoch_s_flush"] - row["epoch_s_no_flush"]
        row["drain_s"] = float(np.median(drain_s))
        row["epoch_s_spread"] = [float(np.percentile(seconds[f], 75) - np.percentile(
            seconds[f], 25)) for f in (False, True)]
        row["cost_steps"] = row["cost_s"] / (row["epoch_s_no_flush"] / args.steps)
        results.append(row)
        if hvd.rank() == 0:
            print("FLUSH_COST " + json.dumps(row), flush=True)
    if hvd.rank() == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def timed_flush(optimizer):
    """Time every flush() of `optimizer` (the drains fit makes): the list of seconds."""
    seconds, flush = [], optimizer.flush

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return flush(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)
    optimizer.flush = timed
    return seconds


def epoch_clock(keras):
    """A callback timing the epoch's training batches (flush included, validation not)."""
    class EpochClock(keras.callbacks.Callback):
        seconds = None

        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds = time.perf_counter() - self.start
    return EpochClock()


if __name__ == "__main__":
    sys.exit(main())
