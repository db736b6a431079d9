"""One convergence worker: every configuration x seed of one task, interleaved.

Run on every worker by `pipe-horovod convergence` (torch.distributed.run or
horovodrun on loopback). For seed 1 it trains `sync`, `k2`, `k2-momentum`,
... one after the other, then seed 2, and so on, in these same processes,
so a run pays no start-up and a slow minute of the shared machine hits
every configuration alike. Each run is the training loop of
`examples/pytorch_digits.py`: the same permutation of the training set on
every rank each epoch (a generator seeded with the seed), this rank's shard
of it (rank::size), `zero_grad / loss / backward / step`, and at the end of
each epoch `opt.flush()` then the held-out accuracy. Runs are deterministic
given the seed (torch.manual_seed before the model is built, one thread,
torch.use_deterministic_algorithms), so the `sync` run of the digits-cnn
task equals the example run with `--pipeline-depth 1 --seed S`.

Rank 0 writes the raw result to `--out` after every run (so a stopped
benchmark keeps what it finished) and its progress to `--progress` (the
launcher draws the bar).

Configurations: `sync` (pipeline_depth=1), `kK` (pipeline_depth=K, no
staleness compensation), `kK-OPTION` (pipeline_depth=K,
staleness_compensation=OPTION).
"""
import argparse
import re
import sys
import time

DEFAULT_CONFIGS = ("sync", "k2", "k2-momentum", "k2-dc", "k2-predict", "k2-lookahead")
STALENESS_OPTIONS = ("momentum", "dc", "predict", "lookahead")
# A codec suffix (-int8_ef, -int4_ef) reduces with that codec on the engine's own
# collectives (the two-stage quantized allreduce, no collective=): sync-int8_ef,
# k2-lookahead-int4_ef; ":N" after the codec sets its block size (k2-lookahead-int4_ef:64).
# Each maps to the bench configuration that times it (at the bench's block size).
CODECS = {"int8_ef": "-int8eng", "int4_ef": "-int4eng"}
_CONFIG = re.compile(r"^(?:sync|k([2-9])(?:-(" + "|".join(STALENESS_OPTIONS) + r"))?)"
                     r"(?:-((?:" + "|".join(CODECS) + r")(?::[0-9]+)?))?$")
FORMAT = "pipe_horovod.convergence/1"


# --------------------------------------------------------------------- configs

def parse_configs(text):
    """'sync,k2 k2-dc' -> validated names in the given order, duplicates dropped."""
    names = []
    for name in re.split(r"[,\s]+", str(text).strip()):
        if not name:
            continue
        if not _CONFIG.match(name):
            raise ValueError(
                f"unknown configuration {name!r}; choose from {', '.join(DEFAULT_CONFIGS)} "
                f"(or kK, kK-OPTION for pipeline depth K = 2..9, OPTION one of "
                f"{', '.join(STALENESS_OPTIONS)}; any of them -CODEC, CODEC one of "
                f"{', '.join(CODECS)})")
        if name not in names:
            names.append(name)
    if not names:
        raise ValueError("no configuration given")
    return names


def config_settings(name):
    """(pipeline_depth, staleness_compensation) of a configuration name."""
    m = _CONFIG.match(name)
    if not m:
        raise ValueError(f"unknown configuration {name!r}")
    if m.group(1) is None:                  # sync[-CODEC]
        return 1, None
    return int(m.group(1)), m.group(2)


def config_compression(name):
    """The codec name of a configuration ('none' without a -CODEC suffix)."""
    m = _CONFIG.match(name)
    if not m:
        raise ValueError(f"unknown configuration {name!r}")
    return m.group(3) or "none"


def bench_config(name):
    """The `pipe-horovod bench` configuration that times this one's step."""
    depth, option = config_settings(name)
    codec = CODECS.get(config_compression(name).split(":")[0], "")
    if depth == 1:
        return f"ours-k1{codec}"
    return f"ours-k{depth}{codec}-{option or 'none'}"


def staleness_supported():
    """Whether this pipe_horovod's DistributedOptimizer takes staleness_compensation."""
    import inspect

    import pipe_horovod.torch as phvd

    return "staleness_compensation" in inspect.signature(phvd.DistributedOptimizer).parameters


def unsupported(configs):
    """Configurations this installation cannot run (they need staleness_compensation)."""
    if staleness_supported():
        return []
    return [c for c in configs if config_settings(c)[1] is not None]


# ---------------------------------------------------------------------- train

def train_one(task, config, seed, data, eng_info, epochs, on_epoch):
    """One run; returns its record (every rank), per-epoch figures included."""
    import torch

    import pipe_horovod.torch as phvd
    from pipe_horovod.tools.bench import convergence_tasks as tasks

    rank, size = eng_info
    x_train, y_train, x_test, y_test = data
    depth, option = config_settings(config)
    loss_fn = tasks.loss_fn(task)
    per_rank = len(x_train) // size          # equal shards: every rank takes the same steps
    steps_per_epoch = tasks.steps_per_epoch(task, len(x_train), size)
    batch = task.batch_size

    torch.manual_seed(seed)
    model = tasks.build_model(task.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=task.base_lr(size),
                                momentum=task.momentum)
    kwargs = {}
    if staleness_supported():
        kwargs["staleness_compensation"] = option       # None explicitly: whatever the default
    elif option is not None:
        raise RuntimeError(f"{config} needs DistributedOptimizer(staleness_compensation=...), "
                           "which this pipe_horovod does not have")
    optimizer = phvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), pipeline_depth=depth,
        warmup_steps=0, compression=phvd.Compression.by_name(config_compression(config)),
        **kwargs)
    phvd.broadcast_parameters(model.state_dict(), root_rank=0)
    phvd.broadcast_optimizer_state(optimizer, root_rank=0)

    history = {"accuracy": [], "test_loss": [], "train_loss": [], "elapsed_s": []}
    total_steps = steps_per_epoch * epochs
    global_step = 0
    order = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    for epoch in range(1, epochs + 1):
        perm = torch.randperm(len(x_train), generator=order)   # the same on every rank
        shard = perm[rank::size][:per_rank]
        running = 0.0
        for step in range(steps_per_epoch):
            idx = shard[step * batch:(step + 1) * batch]
            for group in optimizer.param_groups:
                group["lr"] = task.lr_at(global_step, total_steps, steps_per_epoch, size)
            global_step += 1
            optimizer.zero_grad()
            loss = loss_fn(model(x_train[idx]), y_train[idx])
            loss.backward()
            optimizer.step()
            running += loss.item()
        optimizer.flush()                     # every computed gradient applied before evaluating
        accuracy, test_loss = tasks.evaluate(model, x_test, y_test)
        history["accuracy"].append(accuracy)
        history["test_loss"].append(test_loss)
        history["train_loss"].append(running / steps_per_epoch)
        history["elapsed_s"].append(time.perf_counter() - start)
        on_epoch(epoch, accuracy)
    train_time = time.perf_counter() - start
    with torch.no_grad():
        checksum = float(sum(p.double().sum().item() for p in model.parameters()))
    checksums = phvd.allgather_object(checksum)
    return {"config": config, "seed": seed, "pipeline_depth": depth,
            "staleness_compensation": option, "train_time_s": train_time,
            "ranks_agree": all(c == checksums[0] for c in checksums),
            "timings": {k: v for k, v in dict(optimizer.timings).items()
                        if isinstance(v, (int, float))},
            **history}


def run(args):
    import torch

    import pipe_horovod.torch as phvd
    from pipe_horovod import engine as phvd_engine
    from pipe_horovod.tools.bench import convergence_tasks as tasks
    from pipe_horovod.tools.bench.worker import Progress, write_json

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    phvd.init()
    rank, size = phvd.rank(), phvd.size()
    task = tasks.get_task(args.task)
    epochs = args.epochs or task.epochs
    configs = parse_configs(args.configs)
    missing = unsupported(configs)
    if missing:
        raise SystemExit(f"this pipe_horovod's DistributedOptimizer has no "
                         f"staleness_compensation argument: cannot run {', '.join(missing)}")
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    data = tasks.load_data(task.data)
    log = (lambda *a: print("[convergence]", *a, flush=True)) if rank == 0 else (lambda *a: None)
    progress = Progress(args.progress, len(seeds) * len(configs) * epochs, rank == 0)
    raw = {"format": FORMAT, "task": task.describe(size), "engine": phvd_engine.current().name,
           "workers": size, "epochs": epochs, "seeds": seeds, "configs": configs,
           "n_train": len(data[0]), "n_test": len(data[2]),
           "steps_per_epoch": tasks.steps_per_epoch(task, len(data[0]), size),
           "staleness_compensation_supported": staleness_supported(),
           "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "runs": []}
    log(f"{task.name}: {raw['n_train']} train / {raw['n_test']} test images, {size} workers, "
        f"engine {raw['engine']}, {raw['steps_per_epoch']} steps/epoch, {epochs} epochs, "
        f"configs {','.join(configs)}, seeds {seeds[0]}..{seeds[-1]}")
    for seed in seeds:
        for config in configs:
            def on_epoch(epoch, accuracy, config=config, seed=seed):
                progress.done += 1
                progress.write(f"seed {seed} {config} epoch {epoch}/{epochs} "
                               f"acc {100 * accuracy:.1f}%")

            record = train_one(task, config, seed, data, (rank, size), epochs, on_epoch)
            raw["runs"].append(record)
            accs = " ".join(f"{100 * a:.1f}" for a in record["accuracy"])
            log(f"seed {seed} {config:>13}: final {100 * record['accuracy'][-1]:.2f}% in "
                f"{record['train_time_s']:.1f} s (ranks agree: {record['ranks_agree']}); "
                f"per epoch: {accs}")
            if rank == 0 and args.out:
                write_json(args.out, raw)
    progress.write("done")
    phvd.shutdown()
    return 0 if all(r["ranks_agree"] for r in raw["runs"]) else 1


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", required=True)
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS))
    p.add_argument("--seeds", type=int, default=5, help="how many seeds")
    p.add_argument("--first-seed", type=int, default=1)
    p.add_argument("--epochs", type=int, default=None, help="default: the task's")
    p.add_argument("--out", help="raw JSON written by rank 0")
    p.add_argument("--progress", help="progress file rank 0 keeps up to date")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
