"""Time to accuracy on an emulated 1 Gbit cluster: Horovod vs pipe_horovod K=1 vs K=2.

The second half of `make run`. On loopback (examples/compare_digits.py)
communication costs nothing, so pipelining cannot win there. Here 2 workers
run in an `pipe_horovod.tools.emulate.EmulatedCluster` (one network namespace per
worker, every link capped at --rate both ways; needs root and `tc`) with the
horovod engine, and train the same model three ways, side by side in the
same processes: Horovod's own `horovod.torch.DistributedOptimizer`, ours at
pipeline_depth=1 (sync) and ours at pipeline_depth=2 (Pipe-SGD with
lookahead; what the default, tune="auto", chooses on such a link after its
first measured steps, fixed here from the first step so the three train the
same steps). Same seed, same initial weights, same batches.

The model is an MLP on scikit-learn's digits (8x8 images, no download),
2 hidden layers of 1536 (2.5M parameters, 9.9 MB of gradients), wide enough
that allreducing its gradient over 1 Gbit (~90 ms) takes about as long as
one worker's forward+backward of 256 images (~90-150 ms with one torch
thread; the digits CNN's 0.16 MB gradient would cross the link in ~1 ms):
the regime Pipe-SGD is for, where sync pays compute + communication per
step and the pipeline about the max of the two. Each worker gets one torch
thread (2 workers share 2 cores). The worker measures both at start
(compute alone, allreduce alone) and the report prints them. 2x2048 (17 MB)
shows the same with steps twice as long; 60 steps of 2x1536 keep this part
of `make run` near a minute here.

The configurations take turns in chunks of --eval-every steps (order
rotated each chunk, so machine load falls on all alike); each has its own
clock that runs only during its own steps (including the flush that ends a
chunk, so a pipelined run pays for draining), stops for evaluation, and
gives the held-out accuracy vs wall-clock seconds plotted in
<out>/time_to_accuracy.png beside the table (.md, .json).

Without root (or `ip netns`/`tc`) it prints one line saying why it skipped
and exits 0. Exit 2 when the cluster run fails.

    python examples/emulated_digits.py                    # 1gbit, 60 steps, bench-out/
    python examples/emulated_digits.py --rate 4gbit --steps 60
"""
import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO)]     # pytorch_digits' data and schedule; a plain checkout

# name, label in the table and plot, pipeline_depth (None: Horovod's own optimizer)
CONFIGS = [("horovod", "Horovod DistributedOptimizer", None),
           ("ours-k1", "pipe_horovod K=1 (sync)", 1),
           ("ours-k2", "pipe_horovod K=2", 2)]
STEM = "time_to_accuracy"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rate", default="1gbit", help="link rate of every worker (tc units)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1536, help="width of the MLP's hidden layers")
    p.add_argument("--layers", type=int, default=2, help="hidden layers")
    p.add_argument("--batch-size", type=int, default=256, help="images per worker per step")
    p.add_argument("--steps", type=int, default=60, help="steps per configuration")
    p.add_argument("--eval-every", type=int, default=6,
                   help="steps per turn; held-out accuracy is measured after each")
    p.add_argument("--lr", type=float, default=0.1, help="peak learning rate (warm-up, cosine)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--target", type=float, default=96.0,
                   help="held-out accuracy (%%) whose time to reach is reported")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--out", default="bench-out", help="table, plot, JSON and worker logs go here")
    p.add_argument("--timeout", type=float, default=240, help="seconds allowed for the workers")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--progress-file", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 1 or args.eval_every < 1 or args.workers < 2:
        p.error("--steps and --eval-every must be >= 1, --workers >= 2")
    return args


# ---------------------------------------------------------------- worker side

def _mlp(args):
    import torch.nn as nn

    layers, width = [], 64
    for _ in range(args.layers):
        layers += [nn.Linear(width, args.hidden), nn.ReLU()]
        width = args.hidden
    return nn.Sequential(*layers, nn.Linear(width, 10))


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def _probe(model, x, y, hvd, reps=7):
    """Median seconds of one forward+backward alone, and of one allreduce of all gradients."""
    import torch
    import torch.nn.functional as F

    compute = []
    for _ in range(reps):
        t0 = time.perf_counter()
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        compute.append(time.perf_counter() - t0)
    flat = torch.zeros(sum(p.numel() for p in model.parameters()))
    comm = []
    for i in range(reps):
        t0 = time.perf_counter()
        hvd.allreduce(flat, name=f"probe.{i}")
        comm.append(time.perf_counter() - t0)
    return _median(compute), _median(comm[1:])      # the first allreduce sets up buffers


def worker(args):
    import torch
    import torch.nn.functional as F

    import horovod.torch as hvd
    import pipe_horovod.torch as phvd
    from pipe_horovod import engine
    from pytorch_digits import evaluate, learning_rate, load_data

    torch.set_num_threads(1)
    phvd.init()
    eng = engine.current()
    rank, size = phvd.rank(), phvd.size()
    x_tr, y_tr, x_te, y_te = load_data()
    x_tr, x_te = x_tr.flatten(1), x_te.flatten(1)
    per_rank = len(x_tr) // size
    steps_per_epoch = max(1, per_rank // args.batch_size)
    schedule = SimpleNamespace(lr=args.lr, lr_warmup_epochs=5 / steps_per_epoch)

    runs = {}
    for name, label, depth in CONFIGS:          # same order on every rank: broadcasts inside
        torch.manual_seed(args.seed)            # same initial weights for all
        model = _mlp(args)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
        if depth is None:
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        else:
            opt = phvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                            pipeline_depth=depth)
        phvd.broadcast_parameters(model.state_dict(), root_rank=0)
        runs[name] = SimpleNamespace(model=model, opt=opt, depth=depth, label=label, clock=0.0,
                                     step=0, step_s=[], history=[],
                                     order=torch.Generator().manual_seed(args.seed), shard=[])
    params = sum(p.numel() for p in runs["horovod"].model.parameters())
    compute_s, allreduce_s = _probe(_mlp(args), x_tr[:args.batch_size],
                                    y_tr[:args.batch_size], hvd)

    def batch(run):
        """The run's next batch: every run draws the same permutations, so the same data."""
        if len(run.shard) < args.batch_size:
            perm = torch.randperm(len(x_tr), generator=run.order)
            run.shard = perm[rank::size][:per_rank].tolist()
        idx, run.shard = run.shard[:args.batch_size], run.shard[args.batch_size:]
        return x_tr[idx], y_tr[idx]

    def progress(done, total, current):
        if rank == 0 and args.progress_file:
            tmp = args.progress_file + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"done": done, "total": total, "current": current}, f)
            os.replace(tmp, args.progress_file)

    chunks = math.ceil(args.steps / args.eval_every)
    names = [c[0] for c in CONFIGS]
    for chunk in range(chunks):
        n = min(args.eval_every, args.steps - chunk * args.eval_every)
        for name in names[chunk % 3:] + names[:chunk % 3]:
            run = runs[name]
            eng.barrier()
            start = time.perf_counter()
            for _ in range(n):
                t0 = time.perf_counter()
                for group in run.opt.param_groups:
                    group["lr"] = learning_rate(schedule, run.step, args.steps, steps_per_epoch)
                x, y = batch(run)
                run.opt.zero_grad()
                F.cross_entropy(run.model(x), y).backward()
                run.opt.step()
                run.step += 1
                run.step_s.append(time.perf_counter() - t0)
            if run.depth is not None:
                run.opt.flush()                 # every computed gradient applied
            run.clock += time.perf_counter() - start
            accuracy, loss = evaluate(run.model, x_te, y_te)
            run.history.append({"step": run.step, "time_s": run.clock,
                                "accuracy": 100 * accuracy, "test_loss": loss})
        progress(chunk + 1, chunks, " ".join(
            f"{n.replace('ours-', '')} {runs[n].history[-1]['accuracy']:.1f}%" for n in names))

    if rank == 0 and args.result:
        result = {"meta": {"workers": size, "rate": args.rate, "hidden": args.hidden,
                           "layers": args.layers, "params": params, "grad_mb": params * 4e-6,
                           "batch_size": args.batch_size, "steps": args.steps,
                           "eval_every": args.eval_every, "lr": args.lr,
                           "momentum": args.momentum, "seed": args.seed,
                           "target": args.target, "engine": eng.name,
                           "compute_s": compute_s, "allreduce_s": allreduce_s,
                           "time": time.strftime("%Y-%m-%d %H:%M:%S %z")},
                  "runs": {n: {"label": r.label, "pipeline_depth": r.depth,
                               "step_s": r.step_s, "history": r.history}
                           for n, r in runs.items()}}
        with open(args.result, "w") as f:
            json.dump(result, f)
    phvd.shutdown()
    return 0


# ---------------------------------------------------------------- launcher side

def summarize(result):
    """Rows of the table: median step, speedup vs Horovod, final accuracy, time to target."""
    target = result["meta"]["target"]
    rows = []
    for name, run in result["runs"].items():
        # 342/360 in float32 is 94.99999...%: compare at the table's precision
        reached = next((h["time_s"] for h in run["history"]
                        if round(h["accuracy"], 2) >= target), None)
        rows.append({"name": name, "label": run["label"],
                     "median_step_s": _median(run["step_s"]),
                     "final_accuracy": run["history"][-1]["accuracy"],
                     "train_s": run["history"][-1]["time_s"], "time_to_target_s": reached})
    base = rows[0]
    for row in rows:
        row["speedup"] = base["median_step_s"] / row["median_step_s"]
        row["tta_speedup"] = (base["time_to_target_s"] / row["time_to_target_s"]
                              if base["time_to_target_s"] and row["time_to_target_s"] else None)
    return rows


def table(result, rows):
    m = result["meta"]
    target = f"{m['target']:g}%"
    lines = [f"## Digits MLP ({m['layers']}x{m['hidden']}, {m['grad_mb']:.1f} MB of gradients), "
             f"{m['workers']} workers on emulated {m['rate']} links, {m['steps']} steps, "
             f"seed {m['seed']}",
             "",
             f"One worker alone: forward+backward {m['compute_s'] * 1e3:.0f} ms/step "
             f"({m['batch_size']} images); allreduce of the gradients "
             f"{m['allreduce_s'] * 1e3:.0f} ms.",
             "",
             f"| configuration | median step | speedup vs Horovod | final held-out accuracy "
             f"| training time | time to {target} | speedup to {target} |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        tta = f"{r['time_to_target_s']:.1f} s" if r["time_to_target_s"] else "not reached"
        tta_x = f"{r['tta_speedup']:.2f}x" if r["tta_speedup"] else "-"
        lines.append(f"| {r['label']} | {r['median_step_s'] * 1e3:.0f} ms | {r['speedup']:.2f}x "
                     f"| {r['final_accuracy']:.2f}% | {r['train_s']:.1f} s | {tta} | {tta_x} |")
    return "\n".join(lines)


def plot(result, path):
    """Held-out accuracy vs each configuration's own training clock, one curve each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = result["meta"]
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, run in result["runs"].items():
        t = [0.0] + [h["time_s"] for h in run["history"]]
        acc = [10.0] + [h["accuracy"] for h in run["history"]]    # untrained: chance
        ax.plot(t, acc, marker="o", markersize=3, label=run["label"])
    ax.axhline(m["target"], color="gray", linestyle="--", linewidth=1,
               label=f"target {m['target']:g}%")
    ax.set_ylim(max(0, min(80, m["target"] - 15)), 100)
    ax.set_xlabel("training wall-clock seconds (evaluation excluded)")
    ax.set_ylabel("held-out accuracy (%)")
    ax.set_title(f"Digits MLP, {m['grad_mb']:.1f} MB gradients, {m['workers']} workers, "
                 f"emulated {m['rate']} links")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class _Display:
    """A tqdm bar at a terminal, else one line per turn (no carriage returns in logs)."""

    def __init__(self, path, enabled):
        self.path, self.enabled, self.done, self.bar = path, enabled, 0, None
        if enabled and sys.stdout.isatty():
            from tqdm import tqdm

            # A fixed size, as in compare_digits: ptys without one report 0 x 0.
            columns, rows = shutil.get_terminal_size((100, 24))
            self.bar = tqdm(desc="emulated cluster", unit="turn", file=sys.stdout,
                            ncols=min(columns, 140), nrows=max(rows, 24))
            self.bar.set_postfix_str("starting workers")

    def poll(self):
        from pipe_horovod.tools.emulate import read_progress

        state = read_progress(self.path) if self.enabled else None
        if not state or state["done"] == self.done:
            return
        self.done = state["done"]
        if self.bar is not None:
            self.bar.total = state["total"]
            self.bar.n = state["done"]
            self.bar.set_postfix_str(state["current"])
        else:
            print(f"  turn {state['done']:3d}/{state['total']}: held-out accuracy "
                  f"{state['current']}", flush=True)

    def close(self):
        self.poll()
        if self.bar is not None:
            self.bar.close()


def skip_reason():
    """None when the emulated comparison can run here, else why not (one line)."""
    from pipe_horovod.tools import emulate
    from pipe_horovod.engine import missing_package

    return emulate.unavailable_reason() or missing_package("horovod")


def launch(args):
    why = skip_reason()
    if why:
        print(f"emulated {args.rate} cluster comparison skipped: {why}", flush=True)
        return 0
    from pipe_horovod.tools import emulate

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    result_path, progress_path = out / f"{STEM}.json", out / f"{STEM}-progress.json"
    logs = out / f"{STEM}-logs"
    shutil.rmtree(logs, ignore_errors=True)
    for stale in (result_path, progress_path):
        stale.unlink(missing_ok=True)
    worker_argv = [sys.executable, str(Path(__file__).resolve()), "--worker",
                   "--result", str(result_path), "--progress-file", str(progress_path)]
    for flag in ("rate", "hidden", "layers", "batch_size", "steps", "eval_every", "lr",
                 "momentum", "target", "seed"):
        worker_argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    print(f"\n# Emulated {args.rate} cluster: {args.workers} workers, each in its own network "
          f"namespace; Horovod vs pipe_horovod K=1 vs K=2, {args.steps} steps each "
          f"(worker logs under {logs})", flush=True)
    display = _Display(str(progress_path), not args.no_progress)
    start = time.perf_counter()
    try:
        with emulate.EmulatedCluster(workers=args.workers, rate=args.rate,
                                     log_dir=str(logs)) as cluster:
            job = cluster.launch(worker_argv, engine="horovod", env=env, timeout=args.timeout)
            emulate.wait_polling(cluster, job, display.poll)
    except (RuntimeError, OSError) as exc:
        display.close()
        print(f"emulated cluster run failed:\n{exc}", file=sys.stderr, flush=True)
        return 2
    display.close()
    progress_path.unlink(missing_ok=True)
    if not result_path.exists():
        print(f"emulated cluster run wrote no {result_path}", file=sys.stderr, flush=True)
        return 2
    result = json.loads(result_path.read_text())
    rows = summarize(result)
    result["summary"] = rows
    result["meta"]["wall_s"] = time.perf_counter() - start
    result_path.write_text(json.dumps(result, indent=1))
    text = table(result, rows)
    (out / f"{STEM}.md").write_text(text + "\n")
    png = out / f"{STEM}.png"
    plot(result, png)
    print(f"\n{text}\n")
    print(f"time-to-accuracy plot: {png}\ntable and data: {out / (STEM + '.md')}, {result_path} "
          f"({result['meta']['wall_s']:.0f} s with cluster setup)", flush=True)
    return 0


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
