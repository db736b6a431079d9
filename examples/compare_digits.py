"""Synchronous vs pipelined SGD on the digits CNN, under horovodrun: the job of `make run`.

Runs examples/pytorch_digits.py on N Horovod (Gloo) workers twice with the
same seed and settings, first with --pipeline-depth 1 (synchronous, the
math of Horovod's DistributedOptimizer), then with --pipeline-depth 2
(Pipe-SGD: each gradient is applied one step late while the next step
computes). Streams both runs' output, then prints a markdown table of the
final held-out accuracy of each and their difference.

Exit status: 0 when pipelined accuracy is at most --tolerance percentage
points (default 1) below synchronous; 1 when it is further below; 2 when a
run failed, timed out or wrote no result.

    python examples/compare_digits.py --np 2
    python examples/compare_digits.py --np 2 --epochs 10 -- --compression fp16
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
EXAMPLE = HERE / "pytorch_digits.py"
RUNS = [("sync", 1), ("pipelined", 2)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--np", type=int, default=2, help="number of horovodrun workers (on localhost)")
    p.add_argument("--epochs", type=int, help="passed on; the example's default when omitted")
    p.add_argument("--seed", type=int, default=42, help="the same seed for both runs")
    p.add_argument("--timeout", type=float, default=300, help="seconds allowed per run")
    p.add_argument("--tolerance", type=float, default=1.0,
                   help="largest accepted drop of pipelined vs sync accuracy, in percentage points")
    p.add_argument("--out-dir", help="keep each run's JSON here (default: a temporary folder)")
    p.add_argument("--json", metavar="PATH", help="write the comparison here as JSON")
    p.add_argument("extra", nargs="*",
                   help="more flags for pytorch_digits.py, after `--` (e.g. -- --compression fp16)")
    return p.parse_args(argv)


def find_horovodrun():
    """horovodrun of the Python running this script (the venv's), else the one on PATH."""
    candidate = Path(sys.executable).parent / "horovodrun"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("horovodrun")
    if found:
        return found
    sys.exit(f"horovodrun not found next to {sys.executable} nor on PATH; "
             "run `make install` (it builds Horovod with Gloo)")


def run_one(label, depth, args, horovodrun, json_path):
    """Run the example under horovodrun; its output goes straight to ours. Returns (rc, seconds)."""
    cmd = [horovodrun, "-np", str(args.np), "-H", f"localhost:{args.np}", "--gloo",
           sys.executable, str(EXAMPLE), "--pipeline-depth", str(depth), "--seed", str(args.seed),
           "--json", str(json_path)]
    if args.epochs is not None:
        cmd += ["--epochs", str(args.epochs)]
    cmd += args.extra
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # Run from the repo so `import pipe_horovod` works from a plain checkout too.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    print(f"\n=== {label}: pipeline_depth={depth}, {args.np} workers ===", flush=True)
    print("$ " + " ".join(cmd), flush=True)
    start = time.perf_counter()
    # Own process group, so a timeout ends horovodrun and every worker it started.
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        print(f"\n{label}: no result after {args.timeout:.0f}s; stopping it", file=sys.stderr,
              flush=True)
        _stop(proc)
        rc = None
    except KeyboardInterrupt:
        _stop(proc)
        raise
    return rc, time.perf_counter() - start


def _stop(proc):
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def table(rows, diff_pp, tolerance):
    lines = ["| run | pipeline_depth | held-out accuracy | train time | wall time |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        acc = f"{100 * r['accuracy']:.2f}%" if r["accuracy"] is not None else "failed"
        train = f"{r['train_time_s']:.1f} s" if r["train_time_s"] is not None else "-"
        lines.append(f"| {r['label']} | {r['pipeline_depth']} | {acc} | {train} | "
                     f"{r['wall_s']:.1f} s |")
    if diff_pp is not None:
        verdict = "ok" if diff_pp >= -tolerance else f"more than {tolerance:g} pp below sync"
        lines.append(f"| difference (pipelined - sync) | | {diff_pp:+.2f} pp ({verdict}) | | |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if args.np < 1:
        sys.exit("--np must be at least 1")
    horovodrun = find_horovodrun()
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="compare_digits_"))
    out_dir.mkdir(parents=True, exist_ok=True)

    rows, failed = [], False
    for label, depth in RUNS:
        json_path = out_dir / f"digits_depth{depth}.json"
        json_path.unlink(missing_ok=True)
        rc, wall = run_one(label, depth, args, horovodrun, json_path)
        row = {"label": label, "pipeline_depth": depth, "rc": rc, "wall_s": wall,
               "accuracy": None, "train_time_s": None}
        if rc == 0 and json_path.exists():
            result = json.loads(json_path.read_text())
            row.update(accuracy=result["accuracy"], train_time_s=result["train_time_s"],
                       epochs=result["epochs"], result=str(json_path))
        else:
            why = "timed out" if rc is None else f"exited with {rc}"
            if rc == 0:
                why = f"wrote no {json_path}"
            print(f"{label} run {why}", file=sys.stderr, flush=True)
            failed = True
        rows.append(row)

    sync, pipe = rows
    diff_pp = None
    if sync["accuracy"] is not None and pipe["accuracy"] is not None:
        diff_pp = 100 * (pipe["accuracy"] - sync["accuracy"])
    print(f"\n## Digits CNN, {args.np} horovodrun workers, seed {args.seed}\n")
    print(table(rows, diff_pp, args.tolerance))
    print(flush=True)

    if args.json:
        Path(args.json).write_text(json.dumps(
            {"np": args.np, "seed": args.seed, "tolerance_pp": args.tolerance, "runs": rows,
             "difference_pp": diff_pp}, indent=2))
    if failed or diff_pp is None:
        return 2
    if diff_pp < -args.tolerance:
        print(f"FAIL: pipelined accuracy is {-diff_pp:.2f} pp below sync "
              f"(accepted: {args.tolerance:g} pp)", flush=True)
        return 1
    print(f"PASS: pipelined is within {args.tolerance:g} pp of sync ({diff_pp:+.2f} pp)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
