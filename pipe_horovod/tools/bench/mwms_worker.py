"""The synchronous baselines TensorFlow users have today, with
`tf.distribute.MultiWorkerMirroredStrategy`, on the Keras benchmark's model and data.

Horovod does not run Keras 3 and MultiWorkerMirroredStrategy fails in Keras 3's
`fit` (tests/test_keras_mwms.py), so a `fit` user falls back to legacy tf-keras 2:
NAME, run with TF_USE_LEGACY_KERAS=1 (so `tf.keras` is tf-keras), the Keras
benchmark's baseline. In a custom loop the strategy does run Keras 3: LOOP_NAME, the
TensorFlow custom loop's baseline (`pipe-horovod bench --framework tf-loop`; it needs
no tf-keras). In processes of their own: the launcher gives each worker its index in
$RANK and every worker's host:port in $PIPE_HOROVOD_BENCH_TF_WORKERS, and this builds
TF_CONFIG from them (on the emulated cluster: the namespaces' addresses, so gRPC and
the ring all-reduce cross the capped links).

Every worker feeds its own batch (auto-sharding off; global batch = batch
x workers, so each replica steps on --batch-size samples, like ours).
"""
import argparse
import json
import os
import sys
import time

from . import keras_common as common
from . import worker as torch_worker

WORKERS_ENV = "PIPE_HOROVOD_BENCH_TF_WORKERS"
NAME = "tf-keras-mwms"               # model.fit under the strategy
LOOP_NAME = "tf-mwms-loop"           # the strategy's custom loop (strategy.run + reduce)
NAMES = (NAME, LOOP_NAME)


def _fit_block(strategy, keras, args, rank, size):
    """NAME: model.fit under the strategy; a block's step times from the timer callback."""
    with strategy.scope():
        model = common.build_mlp(keras, args.model_mb, args.layers, args.seed)
        model.compile(optimizer=keras.optimizers.SGD(common.LR), loss=common.loss(keras))
    x, y = common.batch(rank, args.batch_size, args.seed)
    data = common.repeated_dataset(x, y, args.batch_size * size, shard_off=True)
    timer = common.timer_callback(keras)

    def block():
        timer.reset()
        model.fit(data, steps_per_epoch=args.warmup + args.steps, epochs=1, verbose=0,
                  callbacks=[timer])
        return timer.steps(args.warmup)

    return block


def _loop_block(strategy, legacy_keras, args, rank, size):
    """LOOP_NAME: the custom loop tf.distribute documents (strategy.run of a step whose
    loss is averaged over the global batch, strategy.reduce of the loss). On Keras 3,
    which runs under MultiWorkerMirroredStrategy in a custom loop (not in fit): the same
    Keras 3 model, batch and SGD as ours' loop-kK rows. A step's time ends when its
    reduced loss is read."""
    import keras
    import tensorflow as tf

    global_batch = args.batch_size * size
    with strategy.scope():
        model = common.build_mlp(keras, args.model_mb, args.layers, args.seed)
        opt = keras.optimizers.SGD(common.LR)
        per_example = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                 reduction=None)
    x, y = common.batch(rank, args.batch_size, args.seed)
    data = iter(strategy.experimental_distribute_dataset(
        common.repeated_dataset(x, y, global_batch, shard_off=True)))

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(per_example(y, model(x, training=True)),
                                              global_batch_size=global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def step(iterator):
        loss = strategy.run(replica_step, args=next(iterator))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, loss, axis=None)

    def block():
        marks = [time.perf_counter()]
        for _ in range(args.warmup + args.steps):
            float(step(data))
            marks.append(time.perf_counter())
        return [{"step_s": b - a} for a, b in zip(marks[args.warmup:], marks[args.warmup + 1:])]

    return block


BLOCKS = {NAME: _fit_block, LOOP_NAME: _loop_block}


def run(args):
    configs = [c for c in args.configs.split(",") if c]
    if NAME in configs:
        os.environ["TF_USE_LEGACY_KERAS"] = "1"
    hosts = os.environ[WORKERS_ENV].split(",")
    rank = int(os.environ["RANK"])
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": hosts},
                                          "task": {"type": "worker", "index": rank}})
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    keras = tf.keras if NAME in configs else None
    if keras is not None and not keras.__name__.startswith("tf_keras"):
        raise RuntimeError(f"tf.keras is {keras.__name__}, not tf-keras: install tf-keras "
                           "and set TF_USE_LEGACY_KERAS=1")
    size = strategy.num_replicas_in_sync
    progress = torch_worker.Progress(args.progress, (args.rounds + 1) * len(configs), rank == 0)
    blocks = {}
    for name in configs:                       # same order on every worker
        blocks[name] = BLOCKS[name](strategy, keras, args, rank, size)
        progress(f"built {name}")
    results = {n: {"kind": "train", "compression": "none", "pipeline_depth": None,
                   "rounds": []} for n in configs}
    background = []
    for i in range(args.rounds):
        rnd = args.round_offset + i
        t0 = torch_worker._machine_ticks()
        time.sleep(args.idle_probe_s)
        background.append(common.busy_cores(t0, torch_worker._machine_ticks()))
        for name in configs:
            ticks0, cpu0, wall0 = (torch_worker._machine_ticks(), torch_worker._cpu_s(),
                                   time.perf_counter())
            recs = blocks[name]()
            wall, cpu = time.perf_counter() - wall0, torch_worker._cpu_s() - cpu0
            busy = common.busy_cores(ticks0, torch_worker._machine_ticks())
            # Per-rank CPU: each worker writes its own figures; the launcher merges them.
            results[name]["rounds"].append(common.record_block(
                recs, rnd, wall, cpu, busy,
                [{"cpu_s": cpu, "wall_s": wall, "threads": torch_worker._threads()}]))
            progress(f"round {rnd + 1} {name}")
    raw = {"format": "pipe_horovod.bench/1",
           "meta": {"framework": "tf-keras", "workers": size, "rank": rank,
                    "versions": {"tensorflow": tf.__version__, "tf_keras": _version("tf_keras"),
                                 "keras": _version("keras")},
                    "strategy": "MultiWorkerMirroredStrategy (default communication)",
                    "background_busy_cores": [b for b in background if b is not None]},
           "configs": results,
           "process": [{"cpu_s": torch_worker._cpu_s(), "threads": torch_worker._threads()}]}
    if args.out:
        common.write_json(f"{args.out}.rank{rank}" if rank else args.out, raw)
    progress.write("done")


def _version(dist):
    from importlib import metadata
    try:
        return metadata.version(dist.replace("_", "-"))
    except metadata.PackageNotFoundError:
        return None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_arguments(parser)
    parser.add_argument("--configs", default=NAME, help="comma-separated: " + ", ".join(NAMES))
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
