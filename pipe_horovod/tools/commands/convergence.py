"""`pipe-horovod convergence`: time to accuracy, sync vs pipelined with each staleness option.

For each task (`pipe_horovod.tools.bench.convergence_tasks`) one launch of
`--workers` processes on loopback (`python -m torch.distributed.run
--standalone`, or `horovodrun --gloo` with --engine horovod) runs
`pipe_horovod.tools.bench.convergence_worker`: every configuration x seed,
interleaved (seed 1: sync, k2, k2-momentum, ...; seed 2: ...), recording
the held-out accuracy after every epoch. The workers' output goes to
<out>/<name>-<task>.log; a progress bar per task follows rank 0's progress
file (plain lines instead when stderr is not a terminal).

Wall-clock time to accuracy needs each configuration's step time on a
cluster: with `--emulate RATE` (root) each distinct model is timed by
`pipe-horovod bench --emulate RATE --model <model>` on synthetic inputs of
the task's shape and batch (configs ours-k1 for sync, ours-k2-none for k2,
ours-k2-OPTION for k2-OPTION), outputs <out>/<name>-bench-<model>.*; or
`--step-times` reads them from files (see --help). Without either, the time
columns show '–'.

Outputs under --out: <name>.md, <name>.json, <name>.png and the raw
<name>-<task>-raw.json per task (`--report-only` rebuilds the report from
them, e.g. with step times added).
"""
import json
import os
import shlex
import subprocess
import sys
import time

from pipe_horovod.tools.bench import convergence_tasks as tasks_mod
from pipe_horovod.tools.bench import convergence_worker as cw
from pipe_horovod.tools.commands.bench import wait_group
from pipe_horovod.tools.emulate import read_progress, tail_file
from pipe_horovod.tools.launch import REPO, horovodrun, run_files, worker_env
from pipe_horovod.tools.validators import checked, link_rate, names, positive_int, seconds

_POLL = 0.5


def add_arguments(parser):
    _positive_int = positive_int()

    others = [t for t in tasks_mod.TASK_NAMES if t not in tasks_mod.DEFAULT_TASKS]
    parser.add_argument("--tasks", type=names(tasks_mod.TASK_NAMES, "task"), default=list(tasks_mod.DEFAULT_TASKS),
                        help=f"comma-separated tasks (default {','.join(tasks_mod.DEFAULT_TASKS)}"
                             f"; also: {', '.join(others)})")
    parser.add_argument("--configs", type=checked(cw.parse_configs), default=list(cw.DEFAULT_CONFIGS),
                        help="comma-separated configurations (default "
                             f"{','.join(cw.DEFAULT_CONFIGS)}): sync = pipeline_depth 1; kK = pipeline_depth K, no staleness "
                             "compensation; kK-OPTION = staleness_compensation=OPTION; any of them "
                             "-CODEC (int8_ef, int4_ef): compression=CODEC on the engine's own collectives "
                             "(the two-stage quantized allreduce, no collective=)")
    parser.add_argument("--seeds", type=_positive_int, default=5,
                        help="seeds per configuration: --first-seed .. +N-1 (default 5)")
    parser.add_argument("--first-seed", type=int, default=1, help="(default 1)")
    parser.add_argument("--epochs", type=_positive_int, default=None,
                        help="epochs of every task (default: each task's own)")
    parser.add_argument("--workers", type=_positive_int, default=2,
                        help="worker processes (default 2)")
    parser.add_argument("--engine", choices=("torch", "horovod"), default="torch",
                        help="torch: torch.distributed.run (gloo); horovod: horovodrun --gloo "
                             "(default torch)")
    parser.add_argument("--emulate", metavar="RATE", type=link_rate,
                        help="time each task's model with `pipe-horovod bench --emulate RATE` "
                             "(an emulated cluster with RATE links, e.g. 1gbit; needs root) for "
                             "the wall-clock columns")
    parser.add_argument("--bench-steps", type=_positive_int, default=50,
                        help="with --emulate: timed steps per block (default 50)")
    parser.add_argument("--bench-rounds", type=_positive_int, default=5,
                        help="with --emulate: interleaved rounds (default 5)")
    parser.add_argument("--step-times", action="append", metavar="[TASK=]FILE",
                        help="step times for the wall-clock columns, repeatable: a `pipe-horovod "
                             "bench` result (its <name>-raw.json or <name>.json, run with "
                             "--model <the task's model> --configs ours-k1 ours-k2-none "
                             "ours-k2-OPTION ...) as TASK=FILE; or a JSON {config: seconds} "
                             "(TASK=FILE, or FILE for every task), or {task: {config: seconds}}")
    parser.add_argument("--out", default="docs/convergence",
                        help="output directory (default docs/convergence)")
    parser.add_argument("--name", default="convergence",
                        help="file name stem of the outputs (default convergence)")
    parser.add_argument("--timeout", type=seconds("timeout"), default=7200.0,
                        help="give up on a task's launch after this many seconds (default 7200)")
    parser.add_argument("--report-only", action="store_true",
                        help="do not train: rebuild the report from <out>/<name>-<task>-raw.json "
                             "(and <out>/<name>-bench-<model>.json when present)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar or lines")


def _error(message):
    print(f"pipe-horovod convergence: error: {message}", file=sys.stderr)
    return 2


def command_line(args):
    parts = ["pipe-horovod", "convergence", "--tasks", ",".join(args.tasks),
             "--configs", ",".join(args.configs), "--seeds", str(args.seeds)]
    if args.first_seed != 1:
        parts += ["--first-seed", str(args.first_seed)]
    if args.epochs:
        parts += ["--epochs", str(args.epochs)]
    parts += ["--workers", str(args.workers), "--engine", args.engine]
    if args.emulate:
        parts += ["--emulate", args.emulate, "--bench-steps", str(args.bench_steps),
                  "--bench-rounds", str(args.bench_rounds)]
    for spec in args.step_times or []:
        parts += ["--step-times", spec]
    parts += ["--out", args.out]
    if args.name != "convergence":
        parts += ["--name", args.name]
    return shlex.join(parts)


def launch_command(args, worker_argv):
    module = ["-m", "pipe_horovod.tools.bench.convergence_worker", *worker_argv]
    if args.engine == "horovod":
        n = args.workers
        return [horovodrun(), "-np", str(n), "-H", f"localhost:{n}", "--gloo", sys.executable,
                *module]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", str(args.workers), *module]


class Progress:
    """One tqdm bar per task over rank 0's progress file (epochs of all runs), postfix =
    the current seed/config; at no terminal, one plain line per finished run instead."""

    def __init__(self, path, desc, total, epochs, enabled):
        self.path, self.desc, self.epochs = path, desc, epochs
        self.total_runs = total // epochs
        self.runs_done = 0
        self.bar = None
        self.enabled = enabled
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="epoch", dynamic_ncols=True,
                            file=sys.stderr)

    def poll(self):
        if not self.enabled:
            return
        state = read_progress(self.path)
        if state is None:
            return
        if self.bar is not None:
            self.bar.n = min(state["done"], self.bar.total)
            self.bar.set_postfix_str(state.get("current", ""), refresh=False)
            self.bar.refresh()
            return
        runs = state["done"] // self.epochs
        if runs > self.runs_done:
            self.runs_done = runs
            print(f"{self.desc}: {runs}/{self.total_runs} runs done ({state.get('current', '')})",
                  file=sys.stderr, flush=True)

    def close(self):
        self.poll()
        if self.bar is not None:
            self.bar.close()


def run_task(args, task, out, command):
    """Train every config x seed of one task; returns the raw result (with launch info)."""
    raw_path, progress_path, log_path = run_files(out, f"{args.name}-{task.name}")
    epochs = args.epochs or task.epochs
    worker = ["--task", task.name, "--configs", ",".join(args.configs),
              "--seeds", str(args.seeds), "--first-seed", str(args.first_seed),
              "--epochs", str(epochs), "--out", raw_path, "--progress", progress_path]
    cmd = launch_command(args, worker)
    bar = Progress(progress_path, task.name, args.seeds * len(args.configs) * epochs, epochs,
                   not args.no_progress)
    started = time.time()
    with open(log_path, "wb") as log:
        log.write(f"$ {shlex.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env=worker_env(), cwd=REPO,
                                start_new_session=True)
    deadline = time.monotonic() + args.timeout
    try:
        wait_group(proc, bar, deadline)
    finally:
        bar.close()
    if proc.returncode is None or time.monotonic() >= deadline:
        raise RuntimeError(f"{task.name}: timed out after {args.timeout:.0f} s: "
                           f"{shlex.join(cmd)}\n{tail_file(log_path, 40)}")
    if proc.returncode != 0 or not os.path.exists(raw_path):
        raise RuntimeError(f"{task.name}: workers failed (exit {proc.returncode}): "
                           f"{shlex.join(cmd)}\n{tail_file(log_path, 40)}")
    if os.path.exists(progress_path):
        os.remove(progress_path)
    with open(raw_path) as f:
        raw = json.load(f)
    raw["command"] = command                  # what --report-only records again
    raw["launch"] = {"command": shlex.join(cmd), "log": log_path,
                     "wall_s": time.time() - started}
    with open(raw_path, "w") as f:
        json.dump(raw, f)
    return raw


def bench_models(args, tasks, out):
    """Time each distinct model with `pipe-horovod bench --emulate`; {task: bench JSON path}."""
    by_model = {}
    for task in tasks:
        by_model.setdefault(task.model, []).append(task)
    found = {}
    configs = [cw.bench_config(c) for c in args.configs]
    for model, users in by_model.items():
        name = f"{args.name}-bench-{model}"
        cmd = [sys.executable, "-m", "pipe_horovod.tools.cli", "bench", "--emulate", args.emulate,
               "--workers", str(args.workers), "--engine", args.engine, "--model", model,
               "--batch-size", str(users[0].batch_size), "--steps", str(args.bench_steps),
               "--warmup", "5", "--rounds", str(args.bench_rounds),
               "--configs", *configs, "compute", "allreduce", "--out", out, "--name", name]
        if args.no_progress or not sys.stderr.isatty():     # no bar redraws in logs
            cmd.append("--no-progress")
        print(f"timing {model} on the emulated cluster: {shlex.join(cmd)}", file=sys.stderr,
              flush=True)
        res = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
                             env=worker_env(), cwd=REPO)
        if res.returncode != 0:
            raise RuntimeError(f"pipe-horovod bench for {model} failed (exit "
                               f"{res.returncode}):\n{res.stdout[-3000:]}")
        for task in users:
            found[task.name] = os.path.join(out, f"{name}.json")
    return found


def _existing_bench(args, tasks, out):
    found = {}
    for task in tasks:
        path = os.path.join(out, f"{args.name}-bench-{task.model}.json")
        if os.path.exists(path):
            found[task.name] = path
    return found


def run(args):
    from pipe_horovod.tools.bench import convergence_report as report

    out = os.path.abspath(args.out)
    task_objs = [tasks_mod.get_task(n) for n in args.tasks]
    if args.report_only:
        raws = []
        for task in task_objs:
            path = os.path.join(out, f"{args.name}-{task.name}-raw.json")
            if not os.path.exists(path):
                return _error(f"--report-only: {path} does not exist; run the benchmark first")
            with open(path) as f:
                raws.append(json.load(f))
        args.configs = [c for c in args.configs if any(c in r["configs"] for r in raws)]
        bench_files = _existing_bench(args, task_objs, out)
        command = raws[0].get("command") or command_line(args)
    else:
        if args.emulate:
            from pipe_horovod.tools import emulate

            if os.geteuid() != 0:
                return _error("--emulate needs root (ip netns, tc); or pass --step-times")
            reason = emulate.unavailable_reason()
            if reason:
                return _error(f"--emulate is not possible here: {reason}")
        if args.engine == "horovod" and horovodrun() is None:
            return _error("--engine horovod: horovodrun was not found next to this Python "
                          "or on PATH; use --engine torch")
        missing = cw.unsupported(args.configs)
        if missing:
            return _error(f"{', '.join(missing)} need DistributedOptimizer("
                          "staleness_compensation=...), which this pipe_horovod does not have; "
                          "leave them out of --configs (e.g. --configs sync,k2)")
        os.makedirs(out, exist_ok=True)
        command = command_line(args)
        raws = []
        started = time.time()
        for task in task_objs:
            try:
                raw = run_task(args, task, out, command)
            except RuntimeError as exc:
                print(f"pipe-horovod convergence: the benchmark failed:\n{exc}", file=sys.stderr)
                return 1
            raws.append(raw)
            print(f"{task.name}: {len(raw['runs'])} runs in {raw['launch']['wall_s']:.0f} s",
                  file=sys.stderr, flush=True)
        bench_files = {}
        if args.emulate:
            try:
                bench_files = bench_models(args, task_objs, out)
            except RuntimeError as exc:
                print(f"pipe-horovod convergence: {exc}", file=sys.stderr)
                return 1
        print(f"total {time.time() - started:.0f} s", file=sys.stderr, flush=True)
    specs = list(args.step_times or [])
    explicit = {s.partition("=")[0] for s in specs if "=" in s}
    if not any("=" not in s for s in specs):        # a file for every task wins over bench runs
        specs += [f"{t}={p}" for t, p in bench_files.items() if t not in explicit]
    try:
        step_times = report.load_step_times(specs, [t.name for t in task_objs], args.configs)
    except (OSError, ValueError) as exc:
        return _error(str(exc))
    text, paths = report.write_report(raws, out, args.name, step_times, command)
    print(text)
    print("wrote " + ", ".join(paths.values()))
    return 0
