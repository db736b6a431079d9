"""What the two Keras benchmark workers share: model, data, block timing, the raw format.

`keras_worker` (Keras 3 with pipe_horovod) and `mwms_worker` (legacy
tf-keras with MultiWorkerMirroredStrategy) import different Keras
packages, so everything here takes the `keras` module (Keras 3's, or
tf-keras's) as an argument and imports no framework at module level.

Both train the same model on the same data with `model.fit`: the MLP of
`pipe-horovod bench --model mlp` (Dense layers, widths from
`worker.mlp_width`), SGD(0.01), sparse categorical cross-entropy from
logits, one synthetic batch per rank repeated. A block is one `fit` of
warm-up + timed steps; a step's time is the gap between consecutive
`on_train_batch_end` calls, so it covers the whole step (input, graph,
hand-offs) as a user's throughput sees it.
"""
import os
import time

from . import worker as torch_worker

MLP_IN, MLP_CLASSES = torch_worker.MLP_IN, torch_worker.MLP_CLASSES
LR = 0.01


def layer_widths(model_mb, layers):
    """Dense layer widths of the benchmark MLP (the PyTorch benchmark's, same parameters)."""
    width = torch_worker.mlp_width(model_mb * 1e6, layers)
    return [width] * (layers - 1) + [MLP_CLASSES]


def build_mlp(keras, model_mb, layers, seed):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((MLP_IN,))]
                             + [keras.layers.Dense(w, activation="relu" if i < layers - 1
                                                   else None)
                                for i, w in enumerate(layer_widths(model_mb, layers))])
    return model


def params_of(model_mb, layers):
    widths = [MLP_IN] + layer_widths(model_mb, layers)
    return sum(a * b + b for a, b in zip(widths, widths[1:]))


def batch(rank, batch_size, seed):
    import numpy as np

    rng = np.random.default_rng(seed + 1 + rank)
    x = rng.standard_normal((batch_size, MLP_IN), dtype=np.float32)
    y = rng.integers(0, MLP_CLASSES, (batch_size,)).astype(np.int64)
    return x, y


def repeated_dataset(x, y, global_batch, shard_off=False):
    """The same batch forever, as a tf.data pipeline (Keras 3 on TF and tf-keras both fit it)."""
    import numpy as np
    import tensorflow as tf

    reps = max(1, global_batch // len(x))
    xs, ys = np.concatenate([x] * reps), np.concatenate([y] * reps)
    ds = tf.data.Dataset.from_tensors((xs, ys)).repeat()
    if shard_off:            # every worker feeds its own data (no auto-sharding of one source)
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = \
            tf.data.experimental.AutoShardPolicy.OFF
        ds = ds.with_options(options)
    return ds.prefetch(2)


def loss(keras):
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def timer_callback(keras, on_step=None):
    """A Keras callback recording when each batch ends; `on_step()` returns extra per-step
    fields (the breakdown timers), read right after the step."""

    class StepTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.reset()

        def reset(self):
            self.begin, self.ends, self.extra = None, [], []

        def on_train_batch_begin(self, batch, logs=None):
            if self.begin is None:
                self.begin = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter())
            self.extra.append(on_step() if on_step else {})

        def steps(self, skip):
            """Per-step records of the steps after the first `skip`."""
            marks = [self.begin] + self.ends
            out = []
            for i in range(skip, len(self.ends)):
                rec = {"step_s": marks[i + 1] - marks[i]}
                rec.update(self.extra[i])
                out.append(rec)
            return out

    return StepTimer()


def record_block(recs, rnd, wall, cpu, machine_busy, per_rank):
    keys = []
    for rec in recs:
        keys += [k for k in rec if k not in keys]
    block = {k: [r.get(k) for r in recs] for k in keys}
    block.setdefault("fwdbwd_s", [None] * len(recs))
    block.setdefault("opt_s", [None] * len(recs))
    block.setdefault("exposed_s", [None] * len(recs))
    block.update(round=rnd, wall_s=wall, per_rank=per_rank, machine_busy_cores=machine_busy)
    return block


def busy_cores(t0, t1):
    if t0 and t1 and t1[1] > t0[1]:
        return (t1[0] - t0[0]) / (t1[1] - t0[1]) * (os.cpu_count() or 1)
    return None


write_json = torch_worker.write_json      # the Keras and MWMS workers' results


def add_arguments(parser):
    parser.add_argument("--model-mb", type=float, default=12.5)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=384)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--round-offset", type=int, default=0,
                        help="index of this launch's first round in the whole run")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--idle-probe-s", type=float, default=0.5)
    parser.add_argument("--auto-warmup", type=int, default=0,
                        help="untimed steps ours-auto trains before its first block, beyond "
                             "--warmup (the launcher passes the bench's)")
    parser.add_argument("--out", help="raw JSON written by rank 0")
    parser.add_argument("--progress", help="progress file rank 0 keeps up to date")
