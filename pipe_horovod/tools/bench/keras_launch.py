"""`pipe-horovod bench --framework keras` (and `tf-loop`): launch the workers, merge, report.

Each round launches, one after the other on the same workers (the same
emulated cluster under --emulate): our Keras 3 worker (`keras_worker`,
TensorFlow backend: ours-kK, compute, allreduce interleaved), the
tf-keras + MultiWorkerMirroredStrategy baseline (`mwms_worker`, its own
processes, TF_USE_LEGACY_KERAS=1), and with --keras-torch our worker again
on the Keras torch backend (rows torch-*). Rounds alternate the jobs
(A B C A B C ...), so a noisy minute hits every row alike, as in the
PyTorch benchmark; the raw results are merged into one raw JSON and
reported by `keras_report`.

`--framework tf-loop` is the same machinery on TensorFlow custom loops
(what Horovod's TensorFlow users write): our worker's loop-kK rows (a tf.function step with
pipe_horovod.tensorflow's DistributedGradientTape) against the MWMS
worker's custom loop (strategy.run + strategy.reduce), beside compute and
allreduce. Both sets of names may be mixed in one run.
"""
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time

from pipe_horovod.pipeline import auto
from . import keras_report, mwms_worker
from . import worker as bench_worker
from pipe_horovod.tools.emulate import read_progress, tail_file
from pipe_horovod.tools.launch import UsageError, horovodrun, worker_env
from pipe_horovod.tools.validators import bucket_cap_flag

DEFAULT_CONFIGS = ["ours-k1", "ours-k2", "compute", "allreduce", mwms_worker.NAME]
LOOP_CONFIGS = ["loop-k1", "loop-k2", "compute", "allreduce", mwms_worker.LOOP_NAME]
_OURS = ("compute", "allreduce")
_POLL = 0.5


def add_arguments(parser):
    parser.add_argument("--keras-torch", action="store_true",
                        help="--framework keras: also run ours on the Keras torch backend "
                             "(rows torch-ours-kK, torch-compute)")


def check(args, configs):
    """UsageError for what the Keras benchmark cannot run."""
    if args.model != "mlp":
        raise UsageError("--framework keras measures the MLP only (--model mlp)")
    if args.fit:
        raise UsageError("--fit is not supported with --framework keras")
    if args.engine == "local":
        raise UsageError("--framework keras compares multi-worker training: use --engine "
                         "torch or horovod and --workers >= 2")
    if args.workers < 2:
        raise UsageError("--framework keras needs --workers >= 2")
    for name in configs:
        if name in mwms_worker.NAMES or name in _OURS or name == "ours-auto":
            continue
        if (name.startswith(("ours-k", "loop-k")) and bench_worker.compression_of(name) == "none"
                and not bench_worker.staleness_of(name)[0] and not bench_worker.exchange_of(name)):
            continue
        raise UsageError(f"configuration {name!r} is not part of the Keras benchmark; choose "
                         f"from ours-kK, ours-auto, loop-kK, compute, allreduce, "
                         f"{', '.join(mwms_worker.NAMES)}")
    if importlib.util.find_spec("keras") is None:
        raise UsageError("--framework keras needs Keras 3: pip install 'pipe_horovod[keras]'")
    if importlib.util.find_spec("tensorflow") is None:
        raise UsageError("--framework keras runs Keras on TensorFlow, which is not installed: "
                         "pip install tensorflow (or tensorflow-cpu)")
    if mwms_worker.NAME in configs and importlib.util.find_spec("tf_keras") is None:
        raise UsageError("the tf-keras + MultiWorkerMirroredStrategy baseline needs tf-keras: "
                         "pip install --no-deps tf-keras==2.21.0 (without --no-deps its "
                         "'tensorflow' requirement installs TensorFlow over tensorflow-cpu), "
                         f"or leave {mwms_worker.NAME} out of --configs")


def command_line(args, configs):
    parts = ["pipe-horovod", "bench", "--framework", args.framework]
    if args.emulate:
        parts += ["--emulate", args.emulate]
    parts += ["--workers", str(args.workers), "--engine", args.engine,
              "--model-mb", f"{args.model_mb:g}", "--batch-size", str(args.batch_size)]
    if args.layers != 5:
        parts += ["--layers", str(args.layers)]
    parts += ["--steps", str(args.steps), "--warmup", str(args.warmup),
              "--rounds", str(args.rounds), "--configs", *configs]
    if "ours-auto" in configs and args.auto_warmup != auto.settle_steps():
        parts += ["--auto-warmup", str(args.auto_warmup)]
    if args.bucket_cap_mb != 25.0:
        parts += ["--bucket-cap-mb", bucket_cap_flag(args.bucket_cap_mb)]
    if args.threads != 1:
        parts += ["--threads", str(args.threads)]
    if args.keras_torch:
        parts.append("--keras-torch")
    parts += ["--out", args.out]
    if args.name != "bench":
        parts += ["--name", args.name]
    return shlex.join(parts)


# --------------------------------------------------------------------- jobs

class _Job:
    """One launch: which worker module, its configs, its environment, its raw output."""

    def __init__(self, key, module, configs, env, total):
        self.key, self.module, self.configs, self.env, self.total = key, module, configs, env, total


def _jobs(args, configs):
    ours = [c for c in configs if c not in mwms_worker.NAMES]
    baselines = [c for c in configs if c in mwms_worker.NAMES]
    quiet = {"TF_CPP_MIN_LOG_LEVEL": "2"}
    jobs = []
    if ours:
        jobs.append(_Job("tf", "pipe_horovod.tools.bench.keras_worker", ours,
                         {**quiet, "KERAS_BACKEND": "tensorflow"}, 2 * len(ours)))
    if baselines:
        legacy = {"TF_USE_LEGACY_KERAS": "1"} if mwms_worker.NAME in baselines else {}
        jobs.append(_Job("mwms", "pipe_horovod.tools.bench.mwms_worker", baselines,
                         {**quiet, **legacy}, 2 * len(baselines)))
    if args.keras_torch:
        # (loop-kK rows are TensorFlow custom loops: not on the Keras torch backend)
        torch_ours = [c for c in ours if c != "allreduce" and not c.startswith("loop-k")]
        if torch_ours:
            jobs.append(_Job("torch", "pipe_horovod.tools.bench.keras_worker", torch_ours,
                             {**quiet, "KERAS_BACKEND": "torch"}, 2 * len(torch_ours)))
    return jobs


def _argv(args, job, rnd, raw, progress):
    argv = [sys.executable, "-m", job.module, "--model-mb", repr(args.model_mb),
            "--layers", str(args.layers), "--batch-size", str(args.batch_size),
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--rounds", "1",
            "--round-offset", str(rnd), "--threads", str(args.threads), "--seed", str(args.seed),
            "--idle-probe-s", repr(args.idle_probe_s), "--out", raw, "--progress", progress]
    argv += ["--configs", ",".join(job.configs)]
    if "ours-auto" in job.configs:
        argv += ["--auto-warmup", str(args.auto_warmup)]
    if job.key != "mwms":
        argv += ["--bucket-cap-mb", bucket_cap_flag(args.bucket_cap_mb)]
    return argv


def _base_env(args):
    return worker_env(args.threads, args.engine)


class _Bar:
    """tqdm over the whole run: finished launches plus the running one's progress file."""

    def __init__(self, total, enabled, desc):
        self.offset, self.path, self.bar = 0, None, None
        if enabled:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=desc, unit="block", dynamic_ncols=True,
                            file=sys.stderr)

    def follow(self, path, label):
        self.path = path
        if self.bar is not None:
            self.bar.set_postfix_str(label)

    def poll(self):
        if self.bar is None or self.path is None:
            return
        state = read_progress(self.path)
        if state is None:
            return
        self.bar.n = min(self.offset + state["done"], self.bar.total)
        self.bar.refresh()

    def advance(self, n):
        self.offset += n
        if self.bar is not None:
            self.bar.n = min(self.offset, self.bar.total)
            self.bar.refresh()

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _tail(path, lines=40):
    return tail_file(path, lines)


def _free_port():
    return bench_worker.free_port("127.0.0.1")


def _run_local(args, job, argv, env, log_prefix, bar, deadline):
    """Local launch over loopback: one process per worker with the launcher's variables."""
    n = args.workers
    if job.key == "mwms":
        hosts = ",".join(f"127.0.0.1:{_free_port()}" for _ in range(n))
        envs = [{**env, "RANK": str(r), mwms_worker.WORKERS_ENV: hosts} for r in range(n)]
        cmds = [argv] * n
    elif args.engine == "torch":
        port = str(_free_port())
        envs = [{**env, "RANK": str(r), "WORLD_SIZE": str(n), "LOCAL_RANK": str(r),
                 "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                 "PIPE_HOROVOD_ENGINE": "torch"} for r in range(n)]
        cmds = [argv] * n
    else:
        envs = [env]
        cmds = [[horovodrun(), "-np", str(n), "-H", f"localhost:{n}", "--gloo",
                 *argv]]
    procs, logs = [], []
    for r, (cmd, e) in enumerate(zip(cmds, envs)):
        path = f"{log_prefix}-worker{r}.log"
        logs.append(path)
        with open(path, "wb") as log:
            procs.append(subprocess.Popen(cmd, env=e, stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
    try:
        while True:
            bar.poll()
            codes = [p.poll() for p in procs]
            if any(c not in (None, 0) for c in codes):
                raise RuntimeError(f"a {job.key} worker failed (exit codes {codes})\n"
                                   + "\n".join(f"--- {p} ---\n{_tail(p)}" for p in logs))
            if None not in codes:
                return {"launcher": shlex.join(cmds[0]), "log": logs}
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {args.timeout:.0f} s\n"
                                   + "\n".join(f"--- {p} ---\n{_tail(p)}" for p in logs))
            time.sleep(_POLL)
    finally:
        import signal
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()


def _run_emulated(args, cluster, job, argv, env, bar, deadline):
    env = dict(env)
    engine = args.engine
    if job.key == "mwms":
        engine = "torch"               # only for RANK; TF reads TF_CONFIG built from these:
        env[mwms_worker.WORKERS_ENV] = ",".join(
            f"{addr}:{cluster.free_port(r)}" for r, addr in enumerate(cluster.addresses))
    launched = cluster.launch(argv, engine=engine, env=env,
                              timeout=max(1.0, deadline - time.monotonic()))
    from pipe_horovod.tools import emulate
    emulate.wait_polling(cluster, launched, bar.poll, _POLL)
    return {"launcher": f"EmulatedCluster.launch({shlex.join(argv)}, engine={engine!r})",
            "log": launched.logs, "cpu_s": [emulate.cpu_times(p).total for p in launched.procs]}


# ------------------------------------------------------------------ merging

def _load(raw, workers, key):
    with open(raw) as f:
        data = json.load(f)
    if key == "mwms":                  # every rank wrote its own CPU figures: gather them
        ranks = [data]
        for r in range(1, workers):
            with open(f"{raw}.rank{r}") as f:
                ranks.append(json.load(f))
        for name, cfg in data["configs"].items():
            for i, block in enumerate(cfg["rounds"]):
                block["per_rank"] = [d["configs"][name]["rounds"][i]["per_rank"][0]
                                     for d in ranks]
        data["process"] = [d["process"][0] for d in ranks]
    return data


def merge(parts, rounds):
    """One raw result (pipe_horovod.bench/1) from the launches' raws, rows in job order."""
    base = next((d for key, d in parts if key == "tf"), None) or parts[0][1]
    meta = dict(base["meta"])
    configs, background, versions = {}, [], dict(meta.get("versions") or {})
    backends = dict(meta.get("config_backends") or {})
    for key, data in parts:
        versions.update(data["meta"].get("versions") or {})
        background += data["meta"].get("background_busy_cores") or []
        for name, cfg in data["configs"].items():
            label = f"torch-{name}" if key == "torch" else name
            if label not in configs:
                configs[label] = {k: v for k, v in cfg.items() if k != "rounds"}
                configs[label]["rounds"] = []
                if key == "mwms":
                    backends[label] = (
                        f"Keras {versions.get('keras', '')} MultiWorkerMirroredStrategy custom "
                        "loop (TF collective ring)" if name == mwms_worker.LOOP_NAME else
                        f"tf-keras {versions.get('tf_keras', '')} MultiWorkerMirroredStrategy "
                        "(TF collective ring)")
                elif key == "torch":
                    inner = data["meta"]["config_backends"][name]
                    backends[label] = None if inner is None else f"Keras torch backend, {inner}"
            configs[label]["rounds"] += cfg["rounds"]
    meta.update(configs=list(configs), requested=list(configs), rounds=rounds,
                versions=versions, config_backends=backends, background_busy_cores=background,
                launches_per_round=[key for key, _ in parts[:len({k for k, _ in parts})]])
    return {"format": "pipe_horovod.bench/1", "meta": meta, "configs": configs,
            "sweep": None, "codec_s": None,
            "process": next((d["process"] for k, d in parts if k == "tf"), parts[0][1]["process"])}


# ---------------------------------------------------------------------- run

def run(args):
    default = LOOP_CONFIGS if args.framework == "tf-loop" else DEFAULT_CONFIGS
    configs = (list(default) if args.configs is None
               else bench_worker.flatten_configs(args.configs))
    out = os.path.abspath(args.out)
    raw_path = os.path.join(out, f"{args.name}-raw.json")
    if args.report_only:
        if not os.path.exists(raw_path):
            return _error(f"--report-only: {raw_path} does not exist; run the benchmark first")
        return _report(raw_path, out, args.name)
    from pipe_horovod.tools import launch
    from pipe_horovod.tools.bench import models

    try:
        check(args, configs)
        launch.check(args, models.check_compute)   # --emulate, root, the engine's packages
    except UsageError as exc:
        return _error(str(exc))
    os.makedirs(out, exist_ok=True)
    logs = os.path.join(out, f"{args.name}-logs")
    os.makedirs(logs, exist_ok=True)
    jobs = _jobs(args, configs)
    where = f"emulated {args.emulate}" if args.emulate else "local"
    bar = _Bar(args.rounds * sum(j.total for j in jobs), not args.no_progress,
               f"bench {args.framework} {args.engine} x{args.workers} ({where})")
    started = time.time()
    deadline = time.monotonic() + args.timeout
    env = _base_env(args)
    parts, launches = [], []
    cluster = None
    try:
        if args.emulate:
            from pipe_horovod.tools import emulate
            cluster = emulate.EmulatedCluster(workers=args.workers, rate=args.emulate,
                                              log_dir=logs).start()
            env = {k: v for k, v in env.items()
                   if k in ("PYTHONPATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        for rnd in range(args.rounds):
            for job in jobs:
                raw = os.path.join(logs, f"r{rnd}-{job.key}.json")
                progress = os.path.join(logs, f"r{rnd}-{job.key}-progress.json")
                for stale in (raw, progress):
                    if os.path.exists(stale):
                        os.remove(stale)
                bar.follow(progress, f"round {rnd + 1}/{args.rounds} {job.key}")
                argv = _argv(args, job, rnd, raw, progress)
                jenv = {**env, **job.env}
                if cluster is not None:
                    launch = _run_emulated(args, cluster, job, argv, jenv, bar, deadline)
                else:
                    launch = _run_local(args, job, argv, jenv,
                                        os.path.join(logs, f"r{rnd}-{job.key}"), bar, deadline)
                bar.advance(job.total)
                launches.append(dict(launch, round=rnd, job=job.key))
                parts.append((job.key, _load(raw, args.workers, job.key)))
        link_stats = ([cluster.link_stats(r) for r in range(args.workers)]
                      if cluster is not None else None)
    except RuntimeError as exc:
        bar.close()
        print(f"pipe-horovod bench: the Keras benchmark failed:\n{exc}", file=sys.stderr)
        return 1
    finally:
        if cluster is not None:
            cluster.close()
    bar.close()
    data = merge(parts, args.rounds)
    data["launch"] = {"command": command_line(args, configs), "emulate": args.emulate,
                      "wall_s": time.time() - started, "launches": launches,
                      "launcher": "pipe_horovod.tools.bench.keras_launch", "log": logs}
    if link_stats:
        data["launch"]["link_stats"] = link_stats
    with open(raw_path, "w") as f:
        json.dump(data, f)
    return _report(raw_path, out, args.name, extra=[raw_path])


def _report(raw_path, out, name, extra=()):
    text, paths = keras_report.write_report(raw_path, out, name)
    print(text)
    print("wrote " + ", ".join([*extra, *paths.values()]))
    return 0


def _error(message):
    print(f"pipe-horovod bench: error: {message}", file=sys.stderr)
    return 2
