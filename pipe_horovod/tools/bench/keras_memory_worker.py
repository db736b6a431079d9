"""One rank of `pipe-horovod memory --framework keras`: live memory of the Keras adapter.

The Keras counterpart of memory_worker: each configuration trains the same
small MLP (two width x width Dense layers) for a few `train_on_batch` steps on
this rank's own synthetic batch, then counts what is alive, in units of the
parameters' bytes:

* the bytes TensorFlow's CPU allocator holds (`tf.config.experimental.
  get_memory_info("CPU:0")`, which counts only under its BFC allocator:
  $TF_CPU_ALLOCATOR_USE_BFC=true, set by the command): the Keras variables,
  the optimizer's slots, the lookahead's shadow copy of the real weights, and
  anything a graph step left behind; and its peak over the steps (what the
  step's temporaries add, like torch.cuda.max_memory_allocated);
* the distinct CPU torch tensor storages reachable from Python (memory_worker.
  live_bytes): on the TensorFlow backend the pipeline core's flat buffers and
  whatever it keeps; on the torch backend everything (Keras variables are
  torch tensors there).

Configurations: keras (the user's Keras optimizer unwrapped: the memory
Horovod's Keras DistributedOptimizer would hold visibly, as its fusion buffer
lives in C++; Horovod's own Keras layer cannot run here, see DESIGN.md),
ours-k1, ours-k2 (plain Pipe-SGD) and ours-k2-default (K=2 with the default
lookahead). The backend is $KERAS_BACKEND. Rank 0 prints one JSON line per
(width, optimizer, configuration).
"""
import argparse
import gc
import json
import os

import numpy as np

CONFIGS = ("keras", "ours-k1", "ours-k2", "ours-k2-default")
OPTIMIZERS = {
    "sgd": lambda k: k.optimizers.SGD(0.01),
    "sgd-momentum": lambda k: k.optimizers.SGD(0.01, momentum=0.9),
    "adam": lambda k: k.optimizers.Adam(1e-3),
    "adamw": lambda k: k.optimizers.AdamW(1e-3, weight_decay=0.1),
}


def tf_bytes(backend):
    """(current, peak) bytes of TensorFlow's CPU allocator; zeros on the torch backend."""
    if backend != "tensorflow":
        return 0, 0
    import tensorflow as tf
    info = tf.config.experimental.get_memory_info("CPU:0")
    return info["current"], info["peak"]


def reset_tf_peak(backend):
    if backend == "tensorflow":
        import tensorflow as tf
        tf.config.experimental.reset_memory_stats("CPU:0")


def measure(config, kind, width, steps, rank, backend, predivide=1.0):
    import keras
    import torch

    import pipe_horovod.keras as hvd
    from .memory_worker import live_bytes

    cpu = torch.device("cpu")
    keras.backend.clear_session()
    x = np.random.default_rng(rank).standard_normal((8, width)).astype("float32")
    y = np.zeros((8, width), "float32")
    gc.collect()
    reset_tf_peak(backend)
    torch_base = live_bytes(cpu)
    tf_base, _ = tf_bytes(backend)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((width,)), keras.layers.Dense(width, "tanh"),
                              keras.layers.Dense(width)])
    opt = OPTIMIZERS[kind](keras)
    if config != "keras":
        opt = hvd.DistributedOptimizer(
            opt, pipeline_depth=1 if config == "ours-k1" else 2,
            gradient_predivide_factor=predivide,
            staleness_compensation="lookahead" if config == "ours-k2-default" else None)
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    for _ in range(steps):
        model.train_on_batch(x, y)
    gc.collect()
    tf_now, tf_peak = tf_bytes(backend)
    torch_live = live_bytes(cpu) - torch_base     # before a flush: the pipeline is full
    size = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
               for v in model.trainable_variables)
    row = {"framework": "keras", "backend": backend, "optimizer": kind, "config": config,
           "width": width, "params": size // 4, "param_mb": size / 2**20,
           "tf": (tf_now - tf_base) / size, "torch": torch_live / size}
    row["live"] = row["tf"] + row["torch"]
    if backend == "tensorflow":
        row["tf_peak"] = (tf_peak - tf_base) / size
    if config != "keras":
        opt.flush()
    del model, opt
    keras.backend.clear_session()
    gc.collect()
    return row


def parse_args(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--widths", default="1024", help="comma-separated MLP widths")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--optimizers", default="sgd-momentum,adam")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--predivide", type=float, default=1.0,
                        help="gradient_predivide_factor: 2 sends one process's gradients "
                             "through the pipeline as on many ranks (exact in floating point)")
    return parser.parse_args(argv)


def run(args):
    """Every (width, optimizer, configuration) on the engine initialised already; rank 0
    prints one MEMORY line each. (The test suite runs it inside another launch of one
    TensorFlow process, tests/workers/keras_worker.py, to spare a TensorFlow start-up.)"""
    import keras

    import pipe_horovod.keras as hvd
    from pipe_horovod import engine
    backend = keras.backend.backend()
    if backend == "tensorflow" and os.environ.get("TF_CPU_ALLOCATOR_USE_BFC") != "true":
        raise SystemExit("set TF_CPU_ALLOCATOR_USE_BFC=true before TensorFlow starts: "
                         "without it the CPU allocator counts nothing")
    for width in [int(w) for w in args.widths.split(",")]:
        for kind in args.optimizers.split(","):
            for config in args.configs.split(","):
                row = measure(config, kind, width, args.steps, hvd.rank(), backend,
                              args.predivide)
                row["engine"] = engine.current().name
                row["workers"] = hvd.size()
                if hvd.rank() == 0:
                    print("MEMORY " + json.dumps(row), flush=True)


def main(argv=None):
    args = parse_args(argv)
    import pipe_horovod.keras as hvd
    hvd.init()
    run(args)
    hvd.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    main()
