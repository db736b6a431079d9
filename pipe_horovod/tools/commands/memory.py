"""`pipe-horovod memory`: live tensor memory per configuration, side by side in one run.

One launch per engine (`horovodrun --gloo` for engine horovod, which also
measures Horovod's DistributedOptimizer and DDP in a gloo group of its own;
`torch.distributed.run --standalone` for engine torch) of
`pipe_horovod.tools.bench.memory_worker` on `--workers` processes. The table
gives, per model width, optimizer and configuration, the live tensor bytes
after a few steps in units of the parameters' bytes (Horovod with Adam:
4.0), the same census at the busiest point of the last step (when backward's
last gradient is final: where ours at K=1 holds no flat copy beside the
gradients, since they live in the buckets), the compensation's milliseconds per step (median over the steps after
the first two) beside one step of the bare optimizer on a twin of the same
parameters (on CPU timed right after each of those steps, under the same
load; the ratio is the median of the per-step ratios), the same in the
thread's CPU time (which other jobs on a shared machine do not inflate),
and, with `--device cuda` (one process per engine: `local`, or `horovod` under
`horovodrun -np 1`, where Horovod's optimizer and DDP run beside ours),
torch.cuda.max_memory_allocated in the same units. `--model gpt2-small`
measures GPT-2 small (124 M parameters) instead of the MLPs.

`--framework keras` does the same for the Keras adapter, one launch per
Keras backend (`--backends`) and engine, of
`pipe_horovod.tools.bench.keras_memory_worker`: the unwrapped Keras
optimizer (what Horovod's Keras optimizer holds visibly; Horovod's own
cannot run on Keras 3 here) beside ours K=1, K=2 plain and K=2 default,
counting TensorFlow's CPU allocator (as the BFC allocator, which the command
turns on) and the torch storages, and TensorFlow's peak over the steps.
"""
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from pipe_horovod.tools.bench import keras_memory_worker, memory_worker

REPO = Path(__file__).resolve().parents[3]
MODULE = "pipe_horovod.tools.bench.memory_worker"
KERAS_MODULE = "pipe_horovod.tools.bench.keras_memory_worker"
ENGINES_DEFAULT = "horovod,torch"


def add_arguments(parser):
    parser.add_argument("--engines", default=ENGINES_DEFAULT,
                        help="comma-separated: horovod (horovodrun), torch (torchrun)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--widths", default="2048",
                        help="comma-separated MLP widths: two width x width layers each "
                             "(2048: 8.4 M parameters)")
    parser.add_argument("--configs", default=None,
                        help="comma-separated, from " + ", ".join(memory_worker.CONFIGS)
                        + " (PyTorch; default all), or from "
                        + ", ".join(keras_memory_worker.CONFIGS) + " (--framework keras)")
    parser.add_argument("--framework", default="torch", choices=("torch", "keras"),
                        help="torch: the PyTorch adapter beside Horovod and DDP; keras: the "
                             "Keras adapter beside the unwrapped Keras optimizer")
    parser.add_argument("--backends", default="tensorflow,torch",
                        help="--framework keras: comma-separated Keras backends")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--optimizers", default="sgd-momentum,adam",
                        help=f"comma-separated, from {', '.join(memory_worker.OPTIMIZERS)}")
    parser.add_argument("--device", default="cpu",
                        help="cpu, or cuda: one process per engine (default engine: local), "
                             "torch.cuda.max_memory_allocated")
    parser.add_argument("--model", default="mlp", choices=memory_worker.MODELS,
                        help="mlp (of --widths) or gpt2-small (124 M parameters)")
    parser.add_argument("--timeout", type=float, default=600)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(engine, workers, worker_args, module=MODULE):
    py = sys.executable
    if engine == "horovod":
        horovodrun = Path(py).parent / "horovodrun"
        horovodrun = str(horovodrun) if horovodrun.exists() else shutil.which("horovodrun")
        if horovodrun is None:
            raise SystemExit("pipe-horovod memory: horovodrun was not found")
        return [horovodrun, "-np", str(workers), "-H", f"localhost:{workers}", "--gloo", py,
                "-m", module, *worker_args]
    if engine == "torch":
        return [py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                str(workers), "-m", module, *worker_args]
    if engine == "local":
        return [py, "-m", module, *worker_args]
    raise SystemExit(f"pipe-horovod memory: unknown engine {engine!r} (horovod, torch)")


def worker_arguments(args, backend=None):
    """The worker's command line: the PyTorch one's (backend None), or the Keras one's,
    which has no --device or --model (keras_memory_worker.parse_args)."""
    worker_args = ["--widths", args.widths, "--steps", str(args.steps),
                   "--optimizers", args.optimizers]
    if args.configs:
        worker_args += ["--configs", args.configs]
    if backend is None:
        worker_args += ["--device", args.device, "--model", args.model]
    return worker_args


def collect(engine, args, backend=None):
    """Rows of one launch: the PyTorch worker, or (backend given) the Keras one."""
    worker_args = worker_arguments(args, backend)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")])), OMP_NUM_THREADS="1")
    if backend is None:
        module = MODULE
        env[memory_worker.DDP_ENV] = f"127.0.0.1:{_free_port()}"
    else:
        module = KERAS_MODULE
        # TensorFlow's CPU allocator counts its bytes only as the BFC allocator.
        env.update(KERAS_BACKEND=backend, TF_CPU_ALLOCATOR_USE_BFC="true",
                   TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(_command(engine, args.workers, worker_args, module), env=env,
                          capture_output=True, text=True, timeout=args.timeout)
    rows = []
    for line in proc.stdout.splitlines():
        marker = line.find("MEMORY ")
        if marker >= 0:
            rows.append(json.loads(line[marker + len("MEMORY "):]))
    if proc.returncode != 0 or not rows:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"pipe-horovod memory: the {engine} launch failed "
                         f"(exit {proc.returncode})")
    return rows


def table(rows):
    cuda = any("cuda_peak" in r for r in rows)
    head = ["parameters (M)", "optimizer", "engine", "configuration", "live tensors (x params)",
            "backward peak (x params)"]
    head += ["CUDA peak (x params)"] if cuda else []
    head += ["compensation ms/step", "optimizer step ms", "compensation / step"]
    cpu = any("cpu_ratio" in r for r in rows)
    head += ["CPU: compensation ms", "CPU: step ms", "CPU: compensation / step"] if cpu else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [_millions(r), r["optimizer"], r["engine"], r["config"], f"{r['live']:.2f}",
                 f"{r['backward_peak']:.2f}" if "backward_peak" in r else "–"]
        cells += [f"{r['cuda_peak']:.2f}" if "cuda_peak" in r else "–"] if cuda else []
        ms = r.get("compensation_ms")
        step = r.get("optimizer_step_ms")
        ratio = r.get("ratio", ms / step if ms and step else None)
        cells += [_ms(ms), _ms(step), f"{ratio:.2f}" if ms and ratio else "–"]
        if cpu:
            cells += [_ms(r.get("compensation_cpu_ms")), _ms(r.get("optimizer_step_cpu_ms")),
                      f"{r['cpu_ratio']:.2f}" if "cpu_ratio" in r else "–"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _millions(row):
    """Parameters in millions: the row's own count, else the MLP's two width x width layers."""
    if "params" in row:
        return f"{row['params'] / 1e6:.2f}"
    return f"{2 * row['width'] * (row['width'] + 1) / 1e6:.1f}"


def _ms(value):
    return f"{value:.2f}" if value else "–"


def keras_table(rows):
    """The Keras adapter's rows: live bytes (TensorFlow's allocator + torch storages) and
    TensorFlow's peak over the steps, in the parameters' bytes."""
    head = ["parameters (M)", "optimizer", "Keras backend", "engine", "configuration",
            "live (x params)", "of it TensorFlow", "of it torch", "TensorFlow peak (x params)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        peak = r.get("tf_peak")
        cells = [_millions(r), r["optimizer"], r["backend"], r["engine"], r["config"],
                 f"{r['live']:.2f}", f"{r['tf']:.2f}", f"{r['torch']:.2f}",
                 f"{peak:.2f}" if peak is not None else "–"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(args):
    if args.framework == "keras":
        if args.device != "cpu":
            raise SystemExit("pipe-horovod memory --framework keras: CPU only")
        if args.model != "mlp":
            raise SystemExit("pipe-horovod memory --framework keras: the MLPs only (--model mlp)")
        rows = []
        for backend in args.backends.split(","):
            for engine in args.engines.split(","):
                rows += collect(engine, args, backend)
        workers = {r.get("workers", args.workers) for r in rows}
        print(f"Live memory of the Keras adapter after {args.steps} steps, "
              f"{'/'.join(map(str, sorted(workers)))} workers (units: the parameters' bytes)")
        print(keras_table(rows))
        return 0
    if args.device != "cpu":
        engines = ["local"] if args.engines == ENGINES_DEFAULT else args.engines.split(",")
        args.workers = 1                 # one GPU here: ranks would share it
    else:
        engines = args.engines.split(",")
    rows = []
    for engine in engines:
        rows += collect(engine, args)
    sizes = ", ".join(f"{mb:.1f}" for mb in dict.fromkeys(r["param_mb"] for r in rows))
    what = "GPT-2 small" if args.model == "gpt2-small" else "MLPs"
    print(f"Live tensor memory after {args.steps} steps, {args.workers} workers, {what} of "
          f"{sizes} MiB of parameters (units: the parameters' bytes)")
    print(table(rows))
    return 0
