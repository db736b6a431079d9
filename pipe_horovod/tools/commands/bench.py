"""`pipe-horovod bench`: measure pipelined vs sync vs Horovod vs DDP, then report.

Launches `pipe_horovod.tools.bench.worker` on every worker, the way users launch
training: `horovodrun -np N -H localhost:N --gloo` (engine horovod),
`python -m torch.distributed.run --standalone` (engine torch), plain python
(engine local, one process: the wrapper-overhead measurement), or, with
`--emulate RATE`, inside `pipe_horovod.tools.emulate.EmulatedCluster` (one network
namespace per worker, links capped at RATE; needs root). Under --engine
horovod a `ddp` configuration runs in the same worker processes, over a
torch.distributed gloo group the launcher gives a rendezvous
(PIPE_HOROVOD_BENCH_DDP_ADDR / _PORT: 127.0.0.1 and a free port locally, rank
0's namespace address and a port free there under --emulate), so Horovod and
DDP are compared in one run. A progress bar follows the rank-0 worker's
progress file; afterwards the report
(`pipe_horovod.tools.bench.report`) is printed and saved under --out as
<name>.md, <name>.json and <name>.png, next to the raw <name>-raw.json.
"""
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

from pipe_horovod.pipeline import auto
from pipe_horovod.tools.bench import keras_launch, models
from pipe_horovod.tools.bench import worker as bench_worker
from pipe_horovod.tools.emulate import read_progress, tail_file
from pipe_horovod.tools.launch import UsageError, check, horovodrun, worker_env
from pipe_horovod.tools.validators import (bucket_cap_flag, link_rate, names, positive_int,
                                           seconds)

ENGINES = ("horovod", "torch", "local")
_POLL = 0.5


_workers = positive_int("workers")
_timeout = seconds("timeout")


def add_arguments(parser):
    # "-1" and "-10gbit" reach the converters (which say "must be >= 1" / "must not be
    # negative") instead of argparse's "expected one argument".
    parser._negative_number_matcher = re.compile(r"^-\.?\d")
    parser.add_argument("--emulate", metavar="RATE", type=link_rate,
                        help="run the workers in an emulated cluster whose links are capped at "
                             "RATE (e.g. 1gbit, 4gbit); needs root")
    parser.add_argument("--workers", type=_workers, default=2, help="worker processes (default 2)")
    parser.add_argument("--framework", choices=("torch", "keras", "tf-loop"), default="torch",
                        help="torch: PyTorch, ours vs Horovod vs DDP; keras: Keras 3, ours vs "
                             "tf-keras + MultiWorkerMirroredStrategy; tf-loop: TensorFlow "
                             "custom loops, DistributedGradientTape vs the strategy's loop "
                             "(both pipe_horovod.tools.bench.keras_launch) (default torch)")
    parser.add_argument("--engine", choices=ENGINES, default="horovod",
                        help="communication engine and launcher: horovod (horovodrun / Horovod "
                             "env), torch (torch.distributed.run), local (one plain process) "
                             "(default horovod)")
    bench_worker.add_model_arguments(parser)
    keras_launch.add_arguments(parser)
    add_output_arguments(parser, "bench")
    from pipe_horovod.tools.bench import regimes

    parser.add_argument("--regimes", nargs="?", const=list(regimes.REGIMES), default=None,
                        type=names(tuple(regimes.REGIMES), "regime"), metavar="NAMES",
                        help="run the regimes side by side instead of one bench: "
                             f"{', '.join(regimes.REGIMES)} (default: all three), each on "
                             "the emulated cluster (needs root) under every --regime-engines, "
                             "replayed compute sized so the regime's comm / compute holds; "
                             "rows: the sync baseline, each fixed candidate, ours-auto and, "
                             "network-bound, Horovod fp16, DDP PowerSGD and DDP bf16. Prints "
                             "one table per regime and which targets hold, and writes "
                             "<out>/<name>.md/.json/.png (name default regimes) beside each "
                             "run's own report. Uses --workers, --steps, --rounds, --warmup "
                             f"(at least {regimes.REGIME_WARMUP}), --auto-warmup, --timeout; "
                             "the model is the regimes' own")
    parser.add_argument("--regime-engines", type=names(regimes.ENGINES, "engine"),
                        default=list(regimes.ENGINES), metavar="NAMES",
                        help="--regimes: the engines each regime runs under (default "
                             f"{','.join(regimes.ENGINES)})")


def add_output_arguments(parser, name):
    """--out, --name (default `name`), --timeout, --report-only, --no-progress."""
    parser.add_argument("--out", default="bench-out", help="output directory (default bench-out)")
    parser.add_argument("--name", default=name,
                        help=f"file name stem of the outputs (default {name})")
    parser.add_argument("--timeout", type=_timeout, default=3600.0,
                        help="give up (and kill the workers) after this many seconds "
                             "(default 3600)")
    parser.add_argument("--report-only", action="store_true",
                        help="do not run: rebuild the report from <out>/<name>-raw.json")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _error(message):
    print(f"pipe-horovod bench: error: {message}", file=sys.stderr)
    return 2


def command_line(args):
    """The canonical command that reproduces this run (recorded in the report)."""
    parts = ["pipe-horovod", "bench"]
    if args.emulate:
        parts += ["--emulate", args.emulate]
    parts += ["--workers", str(args.workers), "--engine", args.engine]
    if args.compute == "replay":
        parts += ["--compute", "replay"]
        parts += (["--device-tflops", f"{args.device_tflops:g}"] if args.profile is None
                  else ["--profile", args.profile])
    parts += ["--model", args.model]
    if args.device != "cpu":
        parts += ["--device", args.device]
    if args.model in ("mlp", "cnn"):
        parts += ["--model-mb", f"{args.model_mb:g}"]
    if args.model == "bert-base" and args.seq_len != 128:
        parts += ["--seq-len", str(args.seq_len)]
    parts += ["--batch-size", str(args.batch_size)]
    if args.model == "mlp" and args.layers != 5:
        parts += ["--layers", str(args.layers)]
    parts += ["--steps", str(args.steps), "--warmup", str(args.warmup),
              "--rounds", str(args.rounds), "--configs", *args.configs]
    if "ours-auto" in args.configs and args.auto_warmup != auto.settle_steps():
        parts += ["--auto-warmup", str(args.auto_warmup)]
    if args.bucket_cap_mb != 25.0:
        parts += ["--bucket-cap-mb", bucket_cap_flag(args.bucket_cap_mb)]
    if args.fit:
        parts += ["--fit"] + (["--fit-max-mb", f"{args.fit_max_mb:g}"]
                              if args.fit_max_mb != 64.0 else [])
    if args.threads != 1:
        parts += ["--threads", str(args.threads)]
    if args.one_model:
        parts += ["--one-model"]
    if args.horovod_fusion_mb is not None:
        parts += ["--horovod-fusion-mb", f"{args.horovod_fusion_mb:g}"]
    if args.horovod_cycle_ms is not None:
        parts += ["--horovod-cycle-ms", f"{args.horovod_cycle_ms:g}"]
    parts += ["--out", args.out]
    if args.name != "bench":
        parts += ["--name", args.name]
    return shlex.join(parts)


def _worker_argv(args, raw, progress):
    argv = ["--model", args.model, "--model-mb", repr(args.model_mb), "--layers",
            str(args.layers), "--batch-size", str(args.batch_size), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--rounds", str(args.rounds),
            "--configs", ",".join(args.configs), "--bucket-cap-mb", bucket_cap_flag(args.bucket_cap_mb),
            "--threads", str(args.threads), "--seed", str(args.seed),
            "--idle-probe-s", repr(args.idle_probe_s), "--compute", args.compute,
            "--seq-len", str(args.seq_len), "--device", args.device,
            "--auto-warmup", str(args.auto_warmup), "--out", raw, "--progress", progress]
    for flag, value in (("--device-tflops", args.device_tflops),
                        ("--horovod-fusion-mb", args.horovod_fusion_mb),
                        ("--horovod-cycle-ms", args.horovod_cycle_ms)):
        if value is not None:
            argv += [flag, repr(value)]
    if args.profile is not None:
        argv += ["--profile", os.path.abspath(args.profile)]
    if args.fit:
        argv += ["--fit", "--fit-max-mb", repr(args.fit_max_mb)]
    if args.one_model:
        argv += ["--one-model"]
    return argv


def _needs_ddp_group(args):
    """Horovod workers run ddp over a torch.distributed group of their own."""
    return args.engine == "horovod" and any(map(bench_worker.is_ddp,
                                                getattr(args, "configs", ())))


def _ddp_env(addr, port):
    return {bench_worker.DDP_ADDR_ENV: str(addr), bench_worker.DDP_PORT_ENV: str(port)}


WORKER = "pipe_horovod.tools.bench.worker"


def _local_command(args, worker, module=WORKER):
    py = sys.executable
    module = ["-m", module, *worker]
    if args.engine == "horovod":
        n = args.workers
        return [horovodrun(), "-np", str(n), "-H", f"localhost:{n}", "--gloo", py, *module]
    if args.engine == "torch":
        return [py, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node", str(args.workers), *module]
    return [py, *module]


class _Bar:
    """tqdm over the rank-0 progress file; silent when disabled."""

    def __init__(self, path, enabled, desc):
        self.path = path
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=1, desc=desc, unit="block", dynamic_ncols=True,
                            file=sys.stderr)

    def poll(self):
        if self.bar is None:
            return
        state = read_progress(self.path)
        if state is None:
            return
        if self.bar.total != state["total"]:
            self.bar.total = state["total"]
        self.bar.n = min(state["done"], state["total"])
        self.bar.set_postfix_str(state.get("current", ""), refresh=False)
        self.bar.refresh()

    def close(self):
        if self.bar is not None:
            self.poll()
            self.bar.close()


def wait_group(proc, bar, deadline):
    """Poll `bar` until `proc` (started in a session of its own) exits or `deadline`
    passes; on time-out or interruption the whole process group goes, SIGTERM first."""
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            bar.poll()
            time.sleep(_POLL)
    finally:
        if proc.poll() is None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=5)
                    break
                except subprocess.TimeoutExpired:
                    continue


def run_local(args, worker, log_path, bar, module=WORKER):
    """Runs `module` with argv `worker` on args.workers local workers; raises RuntimeError."""
    cmd = _local_command(args, worker, module)
    env = worker_env(args.threads, args.engine)
    if _needs_ddp_group(args):          # horovodrun on this host: every worker reaches loopback
        env.update(_ddp_env("127.0.0.1", bench_worker.free_port("127.0.0.1")))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + args.timeout
    wait_group(proc, bar, deadline)
    if proc.returncode is None or proc.returncode < 0 and time.monotonic() >= deadline:
        raise RuntimeError(f"timed out after {args.timeout:.0f} s: {shlex.join(cmd)}\n"
                           f"{tail_file(log_path, 40)}")
    if proc.returncode != 0:
        raise RuntimeError(f"workers failed (exit {proc.returncode}): {shlex.join(cmd)}\n"
                           f"{tail_file(log_path, 40)}")
    return {"launcher": shlex.join(cmd), "log": log_path}


def run_emulated(args, worker, log_dir, bar, module=WORKER):
    """Runs `module` with argv `worker` in an EmulatedCluster capped at args.emulate."""
    from pipe_horovod.tools import emulate

    argv = [sys.executable, "-m", module, *worker]
    env = {k: v for k, v in worker_env(args.threads, args.engine).items()
           if k in ("PYTHONPATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    # bench-collectives' --topology; `pipe-horovod bench` always runs on the star
    topology = getattr(args, "topology", "star")
    with emulate.EmulatedCluster(workers=args.workers, rate=args.emulate, log_dir=log_dir,
                                 topology=topology) as cluster:
        if _needs_ddp_group(args):
            # Rank 0's namespace address, a port free inside that namespace; each worker's
            # gloo binds its own namespace NIC (GLOO_SOCKET_IFNAME from worker_env).
            env.update(_ddp_env(cluster.addresses[0], cluster.free_port(0)))
        job = cluster.launch(argv, engine=args.engine, env=env, timeout=args.timeout)
        emulate.wait_polling(cluster, job, bar.poll, _POLL)
        cpu = [emulate.cpu_times(p) for p in job.procs]
        links = [cluster.link_stats(r) for r in range(args.workers)]
        return {"launcher": f"EmulatedCluster(workers={args.workers}, rate={args.emulate!r}, "
                            f"topology={topology!r}).launch({shlex.join(argv)}, "
                            f"engine={args.engine!r})",
                "topology": topology,
                "log": log_dir, "cpu_s": [c.total for c in cpu],
                "cpu_user_s": [c.user for c in cpu], "cpu_system_s": [c.system for c in cpu],
                "link_stats": links}


def run_workers(args, out, worker_argv, command, module=WORKER, prog="bench"):
    """Runs `module` on the workers (--emulate or local) with a progress bar on
    <out>/<name>-progress.json (argv: `worker_argv(progress path)`), then records the
    launch and `command` in the raw JSON the workers wrote, <out>/<name>-raw.json.
    Returns 0, or 1 after saying why."""
    raw = os.path.join(out, f"{args.name}-raw.json")
    os.makedirs(out, exist_ok=True)
    progress = os.path.join(out, f"{args.name}-progress.json")
    for stale in (raw, progress):
        if os.path.exists(stale):
            os.remove(stale)
    worker = worker_argv(progress)
    where = f"emulated {args.emulate}" if args.emulate else "local"
    bar = _Bar(progress, not args.no_progress,
               f"{prog} {args.engine} x{args.workers} ({where})")
    started = time.time()
    try:
        if args.emulate:
            launch = run_emulated(args, worker, os.path.join(out, f"{args.name}-logs"), bar,
                                  module)
        else:
            launch = run_local(args, worker, os.path.join(out, f"{args.name}.log"), bar, module)
    except RuntimeError as exc:
        print(f"pipe-horovod {prog}: the benchmark failed:\n{exc}", file=sys.stderr)
        return 1
    finally:
        bar.close()
    if not os.path.exists(raw):
        print(f"pipe-horovod {prog}: the workers exited without writing {raw}", file=sys.stderr)
        return 1
    with open(raw) as f:
        data = json.load(f)
    data["launch"] = dict(launch, command=command, emulate=args.emulate,
                          wall_s=time.time() - started)
    with open(raw, "w") as f:
        json.dump(data, f)
    if os.path.exists(progress):
        os.remove(progress)
    return 0


def run(args):
    from pipe_horovod.tools.bench import report

    if args.regimes:
        return run_regimes(args)
    if args.framework in ("keras", "tf-loop"):
        if args.device != "cpu":
            return _error("--device cuda is the PyTorch benchmark's (--framework torch); the "
                          "Keras one runs on CPU")
        if args.compute != "cpu":
            return _error("--compute replay is not in the Keras benchmark yet; use "
                          "--framework torch")
        return keras_launch.run(args)
    args.configs = bench_worker.flatten_configs(args.configs)
    if args.configs == bench_worker.DEFAULT_CONFIGS and args.engine == "local":
        args.configs = ["compute", "ours-k1", "ours-k2"]
    out = os.path.abspath(args.out)
    raw = os.path.join(out, f"{args.name}-raw.json")
    if args.report_only:
        if not os.path.exists(raw):
            return _error(f"--report-only: {raw} does not exist; run the benchmark first")
        text, paths = report.write_report([raw], out, args.name)
        print(text)
        print("wrote " + ", ".join(paths.values()))
        return 0
    try:
        check(args, models.check_compute)
    except UsageError as exc:
        return _error(str(exc))
    failed = run_workers(args, out, lambda progress: _worker_argv(args, raw, progress),
                         command_line(args))
    if failed:
        return failed
    text, paths = report.write_report([raw], out, args.name)
    print(text)
    print("wrote " + ", ".join([raw, *paths.values()]))
    return 0


# The regimes' model: an MLP whose 8 MB of gradients take ~70 ms at 1 Gbit between 2
# workers, long enough for the link to dominate its messages' overheads, short enough
# that every row of three regimes under two engines runs in minutes on 2 cores.
REGIME_MODEL = {"model": "mlp", "model_mb": 8.0, "layers": 5, "batch_size": 32}


def regime_args(args, regime, engine, sizes):
    """The one-bench arguments of `regime` under `engine` (sizes: regimes.sizing's)."""
    import argparse

    from pipe_horovod.tools.bench import regimes

    sub = argparse.Namespace(**vars(args))
    sub.__dict__.update(REGIME_MODEL)
    sub.engine, sub.emulate = engine, regimes.REGIMES[regime].rate
    sub.compute, sub.device, sub.profile = "replay", "cpu", None
    sub.device_tflops = sizes[regime]["device_tflops"]
    sub.bucket_cap_mb = None               # ours at its default sizing, DDP at its 25 MB
    sub.configs = regimes.configs_for(regime, engine)
    sub.warmup = max(args.warmup, regimes.REGIME_WARMUP)
    sub.fit, sub.one_model = False, False
    sub.name = f"{args.name}-{regime}-{engine}"
    return sub


def _commit():
    """HEAD of the checkout these tools run from, and whether the package differs from it
    (a figure measured on uncommitted code must say so), or None outside git."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=here, timeout=10).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--", "../.."],
                                 capture_output=True, text=True, cwd=here,
                                 timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    if not head:
        return None
    return f"{head} + uncommitted changes in pipe_horovod/" if changed else head


def run_regimes(args):
    """`pipe-horovod bench --regimes`: every regime under every engine, one launch each,
    then one table per regime (pipe_horovod.tools.bench.regimes) and its targets."""
    from pipe_horovod.tools.bench import regimes, report
    from pipe_horovod.tools.emulate.network import rate_bytes

    if args.framework != "torch":
        return _error("--regimes runs the PyTorch benchmark (--framework torch)")
    if args.name == "bench":
        args.name = "regimes"
    args.regimes = [r for r in regimes.REGIMES if r in args.regimes]     # the table's order
    out = os.path.abspath(args.out)
    flops, numel = regimes.forward_flops(REGIME_MODEL["model"], REGIME_MODEL["batch_size"],
                                         REGIME_MODEL["model_mb"], REGIME_MODEL["layers"])
    sizes = {r: regimes.sizing(regimes.REGIMES[r], flops, numel * 4, args.workers,
                               rate_bytes("1gbit")) for r in args.regimes}
    launches = [(r, e) for r in args.regimes for e in args.regime_engines]
    if not args.report_only:
        for regime, engine in launches:
            try:
                check(regime_args(args, regime, engine, sizes), models.check_compute)
            except UsageError as exc:
                return _error(f"--regimes ({regime}, engine {engine}): {exc}")
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=len(launches), desc="regimes", unit="run", file=sys.stderr,
                   dynamic_ncols=True)
    results = {r: {} for r in args.regimes}
    for regime, engine in launches:
        sub = regime_args(args, regime, engine, sizes)
        raw = os.path.join(out, f"{sub.name}-raw.json")
        if bar is not None:
            bar.set_postfix_str(f"{regime}, {engine} engine")
        failed = 0
        if not args.report_only:
            commit = _commit()       # per launch: each one imports the package afresh
            failed = run_workers(sub, out, lambda progress: _worker_argv(sub, raw, progress),
                                 command_line(sub))
            if not failed:                   # which code measured it, for the docs
                with open(raw) as f:
                    data = json.load(f)
                data["launch"]["commit"] = commit
                with open(raw, "w") as f:
                    json.dump(data, f)
        if failed or not os.path.exists(raw):
            why = (f"the workers failed (see {os.path.join(out, sub.name + '-logs')})"
                   if failed else f"no result {raw}")
            results[regime][engine] = {"error": why, "steps": {}, "skipped": {}}
        else:
            with open(raw) as f:
                results[regime][engine] = regimes.run_result(json.load(f))
            try:                                            # each run's own full report
                report.write_report([raw], out, sub.name)
            except Exception as exc:  # noqa: BLE001 - the regimes' table does not need it
                print(f"pipe-horovod bench: {sub.name}'s own report failed ({exc!r}); the "
                      f"regime table reads {raw}", file=sys.stderr)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    text = regimes.heading(results, args.workers, REGIME_MODEL) + "\n\n" + regimes.markdown(
        results, sizes)
    paths = report.save_outputs(out, args.name, text, {
        **regimes.summary(results, sizes), "workers": args.workers, "model": REGIME_MODEL})
    regimes.plot(results, paths["png"])
    print(text)
    print("wrote " + ", ".join(paths.values()))
    return 0
