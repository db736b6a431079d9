"""One Keras 3 benchmark worker: pipe_horovod's optimizer under `model.fit`, interleaved.

Configurations (each its own model and optimizer, same seed, same data):

  ours-kK      pipe_horovod.keras.DistributedOptimizer(SGD), pipeline_depth=K
  ours-auto    the same with tune="auto" and nothing else: its first block trains
               --auto-warmup more untimed steps (its measured steps and its trials'), so
               the timed steps run what it chose; each round's decision is recorded
  compute      the plain Keras SGD: forward, backward, update, no communication
  allreduce    one engine allreduce of a model-sized float32 buffer (comm alone)
  loop-kK      a TensorFlow custom loop (`--framework tf-loop`): a tf.function step
               whose pipe_horovod.tensorflow.DistributedGradientTape(pipeline_depth=K)
               averages the gradients for the plain Keras SGD (TensorFlow backend only)

The backend is $KERAS_BACKEND (tensorflow: the default `tf.function` graph,
jit_compile=False; or torch). Launched by `pipe-horovod bench --framework
keras` on every worker, like `pipe_horovod.tools.bench.worker`.

The time breakdown of the TensorFlow path is measured here, by wrapping
(bench-only, per instance) the engine's `allreduce_async` / `wait`, and the
TensorFlow path's hand-off functions through the optimizer's public
`time_handoffs` before the first trace: per step, the seconds spent copying
gradients into bucket buffers (`fill_s`), inside the per-bucket
numpy_function hand-offs (`handoff_s`, fill and launch included), inside the
final hand-off (`finish_s`: launching what backward left, waiting, handing
the averaged gradient back), launching reductions (`launch_s`), and blocked
waiting for them (`wait_s`, the exposed communication).
"""
import argparse
import logging
import os
import sys
import time

from . import keras_common as common
from . import worker as torch_worker
from pipe_horovod.tools.validators import bucket_cap

TIMERS = ("fill_s", "handoff_s", "finish_s", "launch_s", "wait_s")


class Timers:
    def __init__(self):
        self.total = dict.fromkeys(TIMERS, 0.0)
        self.total["handoffs"] = 0
        self.last = dict(self.total)

    def add(self, key, seconds):
        self.total[key] += seconds

    def timed(self, key, fn):
        def wrapper(*args, **kwargs):
            if key == "handoff_s":
                self.total["handoffs"] += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[key] += time.perf_counter() - t0
        return wrapper

    def step(self):
        """Per-step deltas since the last call."""
        out = {k: self.total[k] - self.last[k] for k in self.total}
        self.last = dict(self.total)
        return out


def instrument_engine(eng, timers):
    eng.allreduce_async = timers.timed("launch_s", eng.allreduce_async)
    eng.wait = timers.timed("wait_s", eng.wait)


class FitRunner:
    """One configuration's model; a block is one `model.fit` of warm-up + timed steps."""

    kind = "train"

    def __init__(self, name, args, rank, timers, opt=None):
        import keras

        self.name, self.args, self.timers = name, args, timers
        self.model = common.build_mlp(keras, args.model_mb, args.layers, args.seed)
        self.opt = opt or keras.optimizers.SGD(common.LR)
        self.model.compile(optimizer=self.opt, loss=common.loss(keras), jit_compile=False)
        x, y = common.batch(rank, args.batch_size, args.seed)
        if keras.backend.backend() == "tensorflow":
            self.data = common.repeated_dataset(x, y, args.batch_size)
        else:
            self.data = _repeat(x, y)
        self.timer = common.timer_callback(keras, timers.step)
        self.pipelined = hasattr(self.opt, "flush")
        if self.pipelined:
            # Build now (every rank, same order), so the path exists before the first trace.
            self.opt.build(self.model.trainable_variables)
            self.opt.time_handoffs(timers.timed)     # before the first trace

    def block(self, warmup, steps):
        self.timer.reset()
        self.model.fit(self.data, steps_per_epoch=warmup + steps, epochs=1, verbose=0,
                       callbacks=[self.timer])
        recs = self.timer.steps(warmup)
        for rec in recs:
            rec["exposed_s"] = rec["wait_s"] if self.pipelined else None
            if not self.pipelined:          # the plain step is all compute
                rec["fwdbwd_s"], rec["opt_s"] = rec["step_s"], 0.0
            if not self.pipelined:
                for key in TIMERS + ("handoffs",):
                    rec.pop(key, None)
        return recs

    def end_block(self):
        if self.pipelined:
            self.opt.flush()            # the block leaves nothing in flight


class LoopRunner:
    """A TensorFlow custom loop, as Horovod's TF2 examples write it: a tf.function step
    (jit_compile=False) with a DistributedGradientTape and the plain Keras SGD, on the fit
    rows' model and data. The tape has no optimizer to compensate staleness with
    (docs/tensorflow.md): at K >= 2 it hands SGD the average of K-1 steps earlier."""

    kind = "train"

    def __init__(self, name, args, rank, timers, depth):
        import keras
        import tensorflow as tf

        import pipe_horovod.tensorflow as hvd

        self.hvd = hvd
        self.model = common.build_mlp(keras, args.model_mb, args.layers, args.seed)
        self.opt = keras.optimizers.SGD(common.LR)
        loss = common.loss(keras)
        x, y = common.batch(rank, args.batch_size, args.seed)
        self.data = iter(common.repeated_dataset(x, y, args.batch_size))
        self.timers = timers
        model, opt = self.model, self.opt
        variables = model.trainable_variables
        options = {"pipeline_depth": depth, "bucket_cap_mb": args.bucket_cap_mb}

        @tf.function(jit_compile=False)
        def step(data):
            x, y = next(data)
            with tf.GradientTape() as tape:
                value = loss(y, model(x, training=True))
            tape = hvd.DistributedGradientTape(tape, **options)
            opt.apply_gradients(zip(tape.gradient(value, variables), variables))
            return value

        self.step = step
        opt.build(variables)

    def block(self, warmup, steps):
        self.timers.step()                       # drop what earlier blocks left
        marks = [time.perf_counter()]
        recs = []
        for i in range(warmup + steps):
            float(self.step(self.data))          # the step's result: its work is done
            marks.append(time.perf_counter())
            extra = self.timers.step()
            if i >= warmup:
                recs.append({"step_s": marks[-1] - marks[-2], "exposed_s": extra["wait_s"],
                             "launch_s": extra["launch_s"], "wait_s": extra["wait_s"]})
        return recs

    def end_block(self):
        variables = self.model.trainable_variables
        for grads in self.hvd.flush(variables):   # the block leaves nothing in flight
            self.opt.apply_gradients(zip(grads, variables))


def _repeat(x, y):
    def gen():
        while True:
            yield x, y
    return gen()


class AllreduceBlock:
    kind = "allreduce"

    def __init__(self, name, eng, numel):
        import torch
        self.inner = torch_worker.AllreduceRunner(name, eng, numel, torch.float32)

    def block(self, warmup, steps):
        for _ in range(warmup):
            self.inner.step()
        return [self.inner.step() for _ in range(steps)]

    def end_block(self):
        pass


def run(args):
    backend = os.environ.get("KERAS_BACKEND", "tensorflow")
    if backend == "tensorflow":
        import tensorflow as tf
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    import keras
    import torch

    import pipe_horovod.keras as phvd
    from pipe_horovod import engine

    torch.set_num_threads(args.threads)
    phvd.init()
    eng = engine.current()
    rank, size = eng.rank(), eng.size()
    timers = Timers()
    instrument_engine(eng, timers)
    configs = [c for c in args.configs.split(",") if c]
    auto_lines = torch_worker.AutoLines()
    if "ours-auto" in configs:
        logging.getLogger("pipe_horovod").addHandler(auto_lines)
    progress = torch_worker.Progress(args.progress, args.rounds * len(configs) + len(configs),
                                     rank == 0)
    log = (lambda *a: print("[bench keras]", *a, flush=True)) if rank == 0 else (lambda *a: None)
    numel = common.params_of(args.model_mb, args.layers)
    runners = {}
    for name in configs:                           # same order on every rank
        if name == "allreduce":
            runners[name] = AllreduceBlock(name, eng, numel)
        elif name == "compute":
            runners[name] = FitRunner(name, args, rank, timers)
        elif name.startswith("loop-k"):
            runners[name] = LoopRunner(name, args, rank, timers,
                                       torch_worker.pipeline_depth_of(name))
        else:
            # flush_in_fit=False: each block's fit would drain the pipeline inside its last
            # timed step; end_block flushes, outside the timing.
            options = ({"tune": "auto"} if name == "ours-auto" else
                       {"pipeline_depth": torch_worker.pipeline_depth_of(name),
                        "bucket_cap_mb": args.bucket_cap_mb})
            opt = phvd.DistributedOptimizer(keras.optimizers.SGD(common.LR),
                                            flush_in_fit=False, **options)
            runners[name] = FitRunner(name, args, rank, timers, opt)
        progress(f"built {name}")

    results = {n: {"kind": runners[n].kind, "compression": "none",
                   "pipeline_depth": torch_worker.pipeline_depth_of(n), "rounds": []}
               for n in configs}
    background = []
    for i in range(args.rounds):
        rnd = args.round_offset + i
        eng.barrier()
        t0 = torch_worker._machine_ticks()
        time.sleep(args.idle_probe_s)
        background.append(common.busy_cores(t0, torch_worker._machine_ticks()))
        for name in configs:
            runner = runners[name]
            eng.barrier()
            ticks0, cpu0, wall0 = (torch_worker._machine_ticks(), torch_worker._cpu_s(),
                                   time.perf_counter())
            # tune="auto" measures, decides and tries first: the timed steps run its choice
            settle = args.auto_warmup if name == "ours-auto" and i == 0 else 0
            recs = runner.block(args.warmup + settle, args.steps)
            wall, cpu = time.perf_counter() - wall0, torch_worker._cpu_s() - cpu0
            busy = common.busy_cores(ticks0, torch_worker._machine_ticks())
            runner.end_block()
            per_rank = eng.allgather_object({"cpu_s": cpu, "wall_s": wall,
                                             "threads": torch_worker._threads()})
            block = common.record_block(recs, rnd, wall, cpu, busy, per_rank)
            if name == "ours-auto":                # what this launch's run chose (rank 0's)
                block["auto_decision"] = auto_lines.lines[-1] if auto_lines.lines else None
            results[name]["rounds"].append(block)
            med = sorted(block["step_s"])[len(recs) // 2]
            log(f"round {rnd + 1} {name:>10}: median step {med * 1e3:8.1f} ms")
            progress(f"round {rnd + 1} {name}")

    versions = torch_worker._versions()
    versions.update(keras=keras.__version__)
    if backend == "tensorflow":
        versions["tensorflow"] = tf.__version__
    raw = {
        "format": "pipe_horovod.bench/1",
        "meta": {
            "framework": "keras", "keras_backend": backend, "engine": eng.name,
            "workers": size, "model": "mlp", "model_mb_requested": args.model_mb,
            "layers": args.layers, "params": numel, "model_bytes": numel * 4,
            "batch_size": args.batch_size, "steps": args.steps, "warmup": args.warmup,
            "rounds": args.rounds, "bucket_cap_mb": args.bucket_cap_mb,
            **torch_worker.auto_bucket_meta(args.bucket_cap_mb, size),
            "threads": args.threads, "configs": configs, "requested": configs, "skipped": {},
            "cpu_count": os.cpu_count(), "versions": versions,
            "config_backends": {n: (None if n == "compute" else
                                    f"pipe_horovod engine {eng.name}"
                                    + (" (DistributedGradientTape)" if n.startswith("loop-k")
                                       else "")) for n in configs},
            "background_busy_cores": [b for b in background if b is not None],
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
        "configs": results, "sweep": None, "codec_s": None,
        "process": eng.allgather_object({"cpu_s": torch_worker._cpu_s(),
                                         "threads": torch_worker._threads()}),
    }
    eng.barrier()
    if rank == 0 and args.out:
        common.write_json(args.out, raw)
    progress.write("done")
    phvd.shutdown()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_arguments(parser)
    parser.add_argument("--configs", default="ours-k1,ours-k2,compute,allreduce")
    parser.add_argument("--bucket-cap-mb", type=bucket_cap, default=25.0)
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
