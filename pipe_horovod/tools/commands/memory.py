"""`pipe-horovod memory`: live tensor memory per configuration, side by side in one run.

One launch per engine (`horovodrun --gloo` for engine horovod, which also
measures Horovod's DistributedOptimizer and DDP in a gloo group of its own;
`torch.distributed.run --standalone` for engine torch) of
`pipe_horovod.tools.bench.memory_worker` on `--workers` processes. The table
gives, per model width, optimizer and configuration, the live tensor bytes
after a few steps in units of the parameters' bytes (Horovod with Adam:
4.0), the compensation's milliseconds per step (median over the steps after
the first two) beside one step of the bare optimizer on a twin of the same
parameters (on CPU timed right after each of those steps, under the same
load), and, with `--device cuda` (one process),
torch.cuda.max_memory_allocated in the same units.
"""
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from pipe_horovod.tools.bench import memory_worker

REPO = Path(__file__).resolve().parents[3]
MODULE = "pipe_horovod.tools.bench.memory_worker"


def add_arguments(parser):
    parser.add_argument("--engines", default="horovod,torch",
                        help="comma-separated: horovod (horovodrun), torch (torchrun)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--widths", default="2048",
                        help="comma-separated MLP widths: two width x width layers each "
                             "(2048: 8.4 M parameters)")
    parser.add_argument("--configs", default=",".join(memory_worker.CONFIGS),
                        help="comma-separated, from " + ", ".join(memory_worker.CONFIGS))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--optimizers", default="sgd-momentum,adam",
                        help=f"comma-separated, from {', '.join(memory_worker.OPTIMIZERS)}")
    parser.add_argument("--device", default="cpu",
                        help="cpu, or cuda: one process, torch.cuda.max_memory_allocated")
    parser.add_argument("--timeout", type=float, default=600)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(engine, workers, worker_args):
    py = sys.executable
    if engine == "horovod":
        horovodrun = Path(py).parent / "horovodrun"
        horovodrun = str(horovodrun) if horovodrun.exists() else shutil.which("horovodrun")
        if horovodrun is None:
            raise SystemExit("pipe-horovod memory: horovodrun was not found")
        return [horovodrun, "-np", str(workers), "-H", f"localhost:{workers}", "--gloo", py,
                "-m", MODULE, *worker_args]
    if engine == "torch":
        return [py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                str(workers), "-m", MODULE, *worker_args]
    if engine == "local":
        return [py, "-m", MODULE, *worker_args]
    raise SystemExit(f"pipe-horovod memory: unknown engine {engine!r} (horovod, torch)")


def collect(engine, args):
    worker_args = ["--widths", args.widths, "--steps", str(args.steps),
                   "--optimizers", args.optimizers, "--configs", args.configs,
                   "--device", args.device]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")])), OMP_NUM_THREADS="1")
    env[memory_worker.DDP_ENV] = f"127.0.0.1:{_free_port()}"
    proc = subprocess.run(_command(engine, args.workers, worker_args), env=env,
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
    head = ["parameters (M)", "optimizer", "engine", "configuration", "live tensors (x params)"]
    head += ["CUDA peak (x params)"] if cuda else []
    head += ["compensation ms/step", "optimizer step ms", "compensation / step"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"{2 * r['width'] * (r['width'] + 1) / 1e6:.1f}", r["optimizer"],
                 r["engine"], r["config"], f"{r['live']:.2f}"]
        cells += [f"{r['cuda_peak']:.2f}" if "cuda_peak" in r else "–"] if cuda else []
        ms = r.get("compensation_ms")
        cells += [f"{ms:.2f}" if ms else "–", f"{r['optimizer_step_ms']:.2f}",
                  f"{ms / r['optimizer_step_ms']:.2f}" if ms else "–"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(args):
    engines = ["local"] if args.device != "cpu" else args.engines.split(",")
    rows = []
    for engine in engines:
        rows += collect(engine, args)
    sizes = ", ".join(f"{mb:.1f}" for mb in dict.fromkeys(r["param_mb"] for r in rows))
    print(f"Live tensor memory after {args.steps} steps, {args.workers} workers, MLPs of "
          f"{sizes} MiB of parameters (units: the parameters' bytes)")
    print(table(rows))
    return 0
