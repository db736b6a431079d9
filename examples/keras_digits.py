"""Train a small Keras 3 CNN on scikit-learn's digits with the pipelined DistributedOptimizer.

The Keras twin of examples/pytorch_digits.py. The same script runs in one
process or many, on the TensorFlow or the torch backend of Keras 3:

    python examples/keras_digits.py --epochs 1
    horovodrun -np 2 -H localhost:2 --gloo python examples/keras_digits.py
    KERAS_BACKEND=torch python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        examples/keras_digits.py

Data: as in pytorch_digits.py, `sklearn.datasets.load_digits` (1,797 8x8
images, 10 classes, nothing downloaded), split 80/20 stratified with a
fixed seed, so every run and every rank sees the same held-out test set,
standardized by the training set's statistics. Every rank takes its own
shard of the training set (rank::size of a permutation drawn from
--seed, the same on every rank), and `model.fit` shuffles it each epoch.
`--batch-size` is per rank; the gradient averaged across ranks is that of
a global batch of batch-size * size images, so the learning rate is
scaled by size (Horovod's rule): SGD(lr * size, momentum).

Learning rate: LearningRateWarmupCallback ramps it from lr to lr * size
over --lr-warmup-epochs (Goyal et al.; flat in one process), then a cosine
decays it to 0 at the last step. PipelineFlushCallback applies the
gradients still in flight (pipeline_depth >= 2) before each validation, so
the held-out accuracy printed is that of weights with every computed
gradient applied.

Output (rank 0 only): Keras's progress bar when stdout is a terminal;
otherwise (logs, pipes, horovodrun) one parseable line per epoch,
`epoch   3/20  train loss 0.1234  test loss 0.0567  held-out accuracy 98.33%`,
which examples/compare_digits.py turns into one clean progress display.
"""
import argparse
import json
import math
import os
import sys
import time

# Before TensorFlow, torch or Keras are imported: one thread per worker (the
# examples share small machines), and no TensorFlow start-up chatter.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

SPLIT_SEED = 0      # the train/test split never depends on --seed: one test set for all runs
TEST_FRACTION = 0.2
BACKENDS = ("tensorflow", "torch")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--backend", choices=BACKENDS,
                   default=os.environ.get("KERAS_BACKEND") or "tensorflow",
                   help="Keras backend; sets KERAS_BACKEND, whose value is the default "
                        "(tensorflow when unset)")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32, help="images per rank per step")
    p.add_argument("--lr", type=float, default=0.05,
                   help="learning rate per worker; SGD gets lr * size, after the warm-up "
                        "ramp, then cosine decay to 0")
    p.add_argument("--lr-warmup-epochs", type=int, default=1,
                   help="LearningRateWarmupCallback's ramp (0: none)")
    p.add_argument("--momentum", type=float, default=0.5,
                   help="SGD momentum; a delayed gradient tolerates less of it than a fresh one")
    p.add_argument("--pipeline-depth", type=int,
                   help="1: synchronous (Horovod's math); K>=2: apply the gradient of K-1 steps "
                        "ago; omitted: the default (tune='auto' chooses 1 or 2)")
    p.add_argument("--warmup-steps", type=int, default=0, help="synchronous steps before pipelining")
    p.add_argument("--compression", choices=["none", "fp16", "bf16"], default="none")
    p.add_argument("--tune", choices=["auto", "off"],
                   help="auto: the run chooses depth, codec and buckets from its first steps; "
                        "off: the configuration as given (K=2 where no depth is given); "
                        "omitted: the default (auto unless --pipeline-depth is given)")
    p.add_argument("--seed", type=int, default=42, help="model init, data shards and order")
    p.add_argument("--json", metavar="PATH", help="rank 0 writes the results here, and the "
                   "run summary beside it (PATH.run_summary)")
    p.add_argument("--no-progress", action="store_true",
                   help="no Keras progress bar, even on rank 0 at a terminal")
    return p.parse_args(argv)


def load_data():
    """(x_train, y_train, x_test, y_test) as NumPy arrays (N x 8 x 8 x 1, channels last),
    standardized by the training set's stats: the split and scaling of pytorch_digits.py."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = digits.images.astype(np.float32)[:, :, :, None]      # N x 8 x 8 x 1, values 0..16
    y = digits.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=TEST_FRACTION,
                                              random_state=SPLIT_SEED, stratify=y)
    mean, std = x_tr.mean(), x_tr.std()
    return (x_tr - mean) / std, y_tr, (x_te - mean) / std, y_te


def build_model(keras):
    """Two 3x3 convolutions, one 2x2 max-pool, two dense layers: ~40k parameters,
    the network of pytorch_digits.py."""
    layers = keras.layers
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        layers.Conv2D(16, 3, padding="same", activation="relu"),
        layers.Conv2D(32, 3, padding="same", activation="relu"),
        layers.MaxPooling2D(2),
        layers.Flatten(),
        layers.Dense(64, activation="relu"),
        layers.Dense(10),
    ], name="digits_cnn")


def set_threads(backend):
    if backend == "tensorflow":
        import tensorflow as tf
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(2)
    else:
        import torch
        torch.set_num_threads(1)


def main(argv=None):
    args = parse_args(argv)
    os.environ["KERAS_BACKEND"] = args.backend
    import keras

    if keras.backend.backend() != args.backend:
        sys.exit(f"keras was imported with the {keras.backend.backend()} backend before "
                 f"--backend {args.backend} could take effect")
    import pipe_horovod.keras as hvd
    from pipe_horovod import engine as phvd_engine

    set_threads(args.backend)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    engine = phvd_engine.current().name

    x_train, y_train, x_test, y_test = load_data()
    per_rank = len(x_train) // size          # equal shards: every rank takes the same steps
    shard = np.random.default_rng(args.seed).permutation(len(x_train))[rank::size][:per_rank]
    x_shard, y_shard = x_train[shard], y_train[shard]
    steps_per_epoch = -(-per_rank // args.batch_size)
    total_steps = steps_per_epoch * args.epochs

    keras.utils.set_random_seed(args.seed)   # the same initial weights everywhere (and broadcast)
    model = build_model(keras)
    peak_lr = args.lr * size
    optimizer = hvd.DistributedOptimizer(
        keras.optimizers.SGD(peak_lr, momentum=args.momentum),
        pipeline_depth=args.pipeline_depth, warmup_steps=args.warmup_steps,
        compression=hvd.Compression.by_name(args.compression), tune=args.tune)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

    warmup_epochs = min(args.lr_warmup_epochs, max(0, args.epochs - 1))
    decay_start = warmup_epochs * steps_per_epoch

    class CosineDecay(keras.callbacks.Callback):
        """After the warm-up epochs: peak_lr * (1 + cos(pi * progress)) / 2, batch by batch."""

        def __init__(self):
            super().__init__()
            self.epoch = 0

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):
            step = self.epoch * steps_per_epoch + batch
            if step >= decay_start:
                progress = (step - decay_start) / max(1, total_steps - decay_start)
                self.model.optimizer.learning_rate = peak_lr * 0.5 * (1 + math.cos(
                    math.pi * progress))

    history = []
    start = time.perf_counter()

    class EpochSummary(keras.callbacks.Callback):
        """One parseable line per epoch on rank 0, after the metrics are averaged."""

        def on_epoch_end(self, epoch, logs=None):
            logs = logs or {}
            row = {"epoch": epoch + 1, "train_loss": float(logs.get("loss", float("nan"))),
                   "test_loss": float(logs.get("val_loss", float("nan"))),
                   "accuracy": float(logs.get("val_accuracy", float("nan"))),
                   "train_accuracy": float(logs.get("accuracy", float("nan"))),
                   "elapsed_s": time.perf_counter() - start}
            history.append(row)
            if rank == 0 and not show_bar:     # Keras's bar ends with the same figures
                print(f"epoch {row['epoch']:3d}/{args.epochs}  train loss {row['train_loss']:.4f}"
                      f"  test loss {row['test_loss']:.4f}  held-out accuracy "
                      f"{100 * row['accuracy']:.2f}%", flush=True)

    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                 hvd.callbacks.MetricAverageCallback()]
    if warmup_epochs > 0:
        callbacks.append(hvd.callbacks.LearningRateWarmupCallback(
            initial_learning_rate=peak_lr, warmup_epochs=warmup_epochs,
            steps_per_epoch=steps_per_epoch))
    callbacks += [CosineDecay(), hvd.callbacks.PipelineFlushCallback(), EpochSummary()]

    show_bar = rank == 0 and not args.no_progress and sys.stdout.isatty()
    if rank == 0:
        print(f"digits: {len(x_train)} train / {len(x_test)} test images; keras "
              f"{keras.__version__} backend={args.backend} engine={engine} size={size} "
              f"pipeline_depth={args.pipeline_depth} tune={args.tune} "
              f"warmup_steps={args.warmup_steps} "
              f"compression={args.compression} batch={args.batch_size}/rank lr={args.lr}*{size} "
              f"momentum={args.momentum} seed={args.seed}; {steps_per_epoch} steps/epoch",
              flush=True)

    model.fit(x_shard, y_shard, batch_size=args.batch_size, epochs=args.epochs, shuffle=True,
              validation_data=(x_test, y_test), callbacks=callbacks,
              verbose=1 if show_bar else 0)
    train_time = time.perf_counter() - start

    # PipelineFlushCallback flushed at the end of fit: these are the final weights. Batched as
    # fit's validation is, so the same kernels give the last epoch's val_accuracy bit for bit.
    _, final, *_ = model.evaluate(x_test, y_test, batch_size=args.batch_size, verbose=0,
                                  return_dict=False)
    final = float(final)
    # Every rank must hold the same weights; a mismatch means the ranks diverged.
    checksum = float(sum(np.asarray(keras.ops.convert_to_numpy(v), np.float64).sum()
                         for v in model.trainable_variables))
    checksums = hvd.allgather_object(checksum)
    ranks_agree = all(c == checksums[0] for c in checksums)
    if args.json:               # the measured run and what auto chose (plan --from-run reads it)
        optimizer.write_run_summary(args.json + ".run_summary")
    if rank == 0:
        print(f"final held-out accuracy {100 * final:.2f}% after {args.epochs} epochs "
              f"in {train_time:.1f}s (ranks agree on the weights: {ranks_agree})", flush=True)
        if args.json:
            result = {
                "pipeline_depth": args.pipeline_depth,
                "tune": args.tune, "accuracy": final, "epochs": args.epochs,
                "warmup_steps": args.warmup_steps, "compression": args.compression,
                "batch_size": args.batch_size, "lr": args.lr, "momentum": args.momentum,
                "lr_warmup_epochs": warmup_epochs,
                "seed": args.seed, "size": size, "engine": engine,
                "steps_per_epoch": steps_per_epoch, "n_train": len(x_train),
                "n_test": len(x_test), "train_time_s": train_time, "ranks_agree": ranks_agree,
                "history": history,
                "timings": {**optimizer.timings, "in_flight": optimizer.in_flight,
                            "iterations": int(keras.ops.convert_to_numpy(optimizer.iterations))},
                "framework": "keras", "backend": args.backend, "keras_version": keras.__version__,
                "peak_lr": peak_lr,
            }
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    hvd.shutdown()
    return 0 if ranks_agree else 1


if __name__ == "__main__":
    sys.exit(main())
