"""The synchronous baseline TensorFlow users have today: legacy tf-keras 2 with
`tf.distribute.MultiWorkerMirroredStrategy`, on the Keras benchmark's model and data.

Neither Horovod nor MultiWorkerMirroredStrategy runs Keras 3, so this is
what a TensorFlow user falls back to. Run with TF_USE_LEGACY_KERAS=1 (so
`tf.keras` is tf-keras) in processes of its own; the launcher gives each
worker its index in $RANK and every worker's host:port in
$PIPE_HOROVOD_BENCH_TF_WORKERS, and this builds TF_CONFIG from them (on the
emulated cluster: the namespaces' addresses, so gRPC and the ring
all-reduce cross the capped links).

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
NAME = "tf-keras-mwms"


def run(args):
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    hosts = os.environ[WORKERS_ENV].split(",")
    rank = int(os.environ["RANK"])
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": hosts},
                                          "task": {"type": "worker", "index": rank}})
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    keras = tf.keras
    if not keras.__name__.startswith("tf_keras"):
        raise RuntimeError(f"tf.keras is {keras.__name__}, not tf-keras: install tf-keras "
                           "and set TF_USE_LEGACY_KERAS=1")
    size = strategy.num_replicas_in_sync
    progress = torch_worker.Progress(args.progress, args.rounds + 1, rank == 0)
    with strategy.scope():
        model = common.build_mlp(keras, args.model_mb, args.layers, args.seed)
        model.compile(optimizer=keras.optimizers.SGD(common.LR), loss=common.loss(keras))
    x, y = common.batch(rank, args.batch_size, args.seed)
    data = common.repeated_dataset(x, y, args.batch_size * size, shard_off=True)
    timer = common.timer_callback(keras)
    progress(f"built {NAME}")
    rounds, background = [], []
    for i in range(args.rounds):
        rnd = args.round_offset + i
        t0 = torch_worker._machine_ticks()
        time.sleep(args.idle_probe_s)
        background.append(common.busy_cores(t0, torch_worker._machine_ticks()))
        timer.reset()
        ticks0, cpu0, wall0 = (torch_worker._machine_ticks(), torch_worker._cpu_s(),
                               time.perf_counter())
        model.fit(data, steps_per_epoch=args.warmup + args.steps, epochs=1, verbose=0,
                  callbacks=[timer])
        wall, cpu = time.perf_counter() - wall0, torch_worker._cpu_s() - cpu0
        busy = common.busy_cores(ticks0, torch_worker._machine_ticks())
        recs = timer.steps(args.warmup)
        # Per-rank CPU: each worker writes its own figures; the launcher merges them.
        rounds.append(common.record_block(recs, rnd, wall, cpu, busy,
                                          [{"cpu_s": cpu, "wall_s": wall,
                                            "threads": torch_worker._threads()}]))
        progress(f"round {rnd + 1} {NAME}")
    raw = {"format": "pipe_horovod.bench/1",
           "meta": {"framework": "tf-keras", "workers": size, "rank": rank,
                    "versions": {"tensorflow": tf.__version__, "tf_keras": _version("tf_keras")},
                    "strategy": "MultiWorkerMirroredStrategy (default communication)",
                    "background_busy_cores": [b for b in background if b is not None]},
           "configs": {NAME: {"kind": "train", "compression": "none", "pipeline_depth": None,
                              "rounds": rounds}},
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
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
