"""Synchronous SGD vs the default on the digits CNN, under horovodrun: the job of `make run`.

Runs the digits example of one framework (--framework torch:
examples/pytorch_digits.py; keras: examples/keras_digits.py, Keras 3 on
its TensorFlow backend unless `-- --backend torch`) on N Horovod (Gloo)
workers twice with the same seed and settings, first with
--pipeline-depth 1 (synchronous, the math of Horovod's
DistributedOptimizer), then as a user who names no depth gets it (the
default, tune='auto': synchronous first steps, measured, then Pipe-SGD
where it was faster, each gradient applied one step late while the next
step computes). Then prints a markdown table of the final held-out accuracy
and train time of each, their difference, and what auto chose; --k2 adds a
third row, Pipe-SGD fixed at depth 2 from the first step.

The workers' output is not streamed (horovodrun's `[0]<stdout>:` prefixes
and progress bars make an unreadable mix): each run's full log goes to the
out dir, and the terminal shows one progress display per run, driven by
rank 0's per-epoch lines (a bar at a terminal, one line per epoch
otherwise). A failed run prints the tail of its log.

Exit status: 0 when the default's accuracy is at most --tolerance percentage
points (default 1) below synchronous; 1 when it is further below; 2 when a
run failed, timed out or wrote no result.

    python examples/compare_digits.py --np 2
    python examples/compare_digits.py --np 2 --framework keras
    python examples/compare_digits.py --np 2 --epochs 10 -- --compression fp16
    python examples/compare_digits.py --np 2 --framework keras --k2     # + fixed K=2
"""
import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# framework: (example script, name in titles, stem of each run's JSON and log)
FRAMEWORKS = {
    "torch": (HERE / "pytorch_digits.py", "PyTorch", "digits"),
    "keras": (HERE / "keras_digits.py", "Keras 3", "keras_digits"),
}
EXAMPLE = FRAMEWORKS["torch"][0]
# label, --pipeline-depth (None: not passed, the default)
RUNS = [("sync", 1), ("default", None)]
FIXED_K2 = ("K=2", 2)
TAIL_LINES = 40

# horovodrun prefixes each worker line with "[rank]<stdout>:" or "[rank]<stderr>:".
PREFIX = re.compile(r"^\[(\d+)\]<std(?:out|err)>:")
# Rank 0's per-epoch line, as both examples print it.
EPOCH = re.compile(r"^epoch\s+(\d+)(?:/(\d+))?\s.*held-out accuracy\s+([\d.]+)%")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--framework", choices=sorted(FRAMEWORKS), default="torch",
                   help="torch: examples/pytorch_digits.py; keras: examples/keras_digits.py")
    p.add_argument("--np", type=int, default=2, help="number of horovodrun workers (on localhost)")
    p.add_argument("--epochs", type=int, help="passed on; the example's default when omitted")
    p.add_argument("--seed", type=int, default=42, help="the same seed for both runs")
    p.add_argument("--timeout", type=float, default=300, help="seconds allowed per run")
    p.add_argument("--tolerance", type=float, default=1.0,
                   help="largest accepted drop of the default vs sync accuracy, in percentage "
                        "points")
    p.add_argument("--out-dir", help="keep each run's JSON and full log here "
                                     "(default: a temporary folder)")
    p.add_argument("--json", metavar="PATH", help="write the comparison here as JSON")
    p.add_argument("--k2", action="store_true",
                   help="also run it at --pipeline-depth 2 (Pipe-SGD from the first step, "
                        "tuning off), a third row")
    p.add_argument("extra", nargs="*",
                   help="more flags for the example, after `--` (e.g. -- --compression fp16)")
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


class Progress:
    """One display per run on our stdout: a tqdm bar over epochs at a terminal,
    else one plain line per epoch (no carriage returns in logs and pipes)."""

    def __init__(self, label, epochs):
        self.label = label
        self.total = epochs
        self.bar = None
        if sys.stdout.isatty():
            from tqdm import tqdm
            # A fixed size: ptys without one report 0 x 0, for which tqdm draws nothing.
            columns, rows = shutil.get_terminal_size((100, 24))
            self.bar = tqdm(total=epochs, desc=f"{label:>9}", unit="epoch", file=sys.stdout,
                            ncols=min(columns, 140), nrows=max(rows, 24), leave=True,
                            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
                                       "epochs [{elapsed}<{remaining}{postfix}]")
            self.bar.set_postfix_str("starting workers")

    def epoch(self, epoch, total, accuracy):
        total = total or self.total
        if self.bar is not None:
            if total and self.bar.total != total:
                self.bar.total = total
            self.bar.update(epoch - self.bar.n)
            self.bar.set_postfix_str(f"held-out accuracy {accuracy:.2f}%")
        else:
            of = f"/{total}" if total else ""
            print(f"{self.label:>9}: epoch {epoch:3d}{of}  held-out accuracy {accuracy:6.2f}%",
                  flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _reader(stream, log, progress, last_epoch):
    """Copy the workers' output to the log; feed rank 0's epoch lines to the display."""
    for raw in stream:
        log.write(raw)
        log.flush()
        line = raw.rstrip("\r\n").split("\r")[-1]
        m = PREFIX.match(line)
        if m:
            if m.group(1) != "0":
                continue
            line = line[m.end():]
        m = EPOCH.match(line.strip())
        if m:
            epoch, total, accuracy = int(m.group(1)), m.group(2), float(m.group(3))
            last_epoch[0] = epoch
            progress.epoch(epoch, int(total) if total else None, accuracy)


def run_one(label, depth, args, horovodrun, json_path, log_path, example):
    """Run the example under horovodrun, its output to log_path. Returns (rc, seconds)."""
    cmd = [horovodrun, "-np", str(args.np), "-H", f"localhost:{args.np}", "--gloo",
           sys.executable, str(example),
           *([] if depth is None else ["--pipeline-depth", str(depth)]),
           "--seed", str(args.seed), "--json", str(json_path), "--no-progress"]
    if args.epochs is not None:
        cmd += ["--epochs", str(args.epochs)]
    cmd += args.extra
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2")
    # Run from the repo so `import pipe_horovod` works from a plain checkout too.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    print(f"\n=== {label}: pipeline_depth={depth or 'auto (the default)'}, {args.np} workers "
          "===", flush=True)
    print("$ " + " ".join(cmd), flush=True)
    progress = Progress(label, args.epochs)
    start = time.perf_counter()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        # Own process group, so a timeout ends horovodrun and every worker it started.
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace")
        last_epoch = [0]
        reader = threading.Thread(target=_reader, args=(proc.stdout, log, progress, last_epoch),
                                  daemon=True)
        reader.start()
        timed_out = False
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _stop(proc)
            rc = None
        except KeyboardInterrupt:
            _stop(proc)
            progress.close()
            raise
        finally:
            reader.join(timeout=10)
        progress.close()
        if timed_out:
            log.write(f"\n[compare_digits] no result after {args.timeout:.0f}s; stopped\n")
    wall = time.perf_counter() - start
    if timed_out:
        print(f"{label}: no result after {args.timeout:.0f}s (epoch {last_epoch[0]}); "
              "stopped it", file=sys.stderr, flush=True)
    print(f"log: {log_path}", flush=True)
    return rc, wall


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


def print_tail(log_path, lines=TAIL_LINES):
    try:
        text = Path(log_path).read_text(errors="replace")
    except OSError:
        return
    tail = [line.split("\r")[-1] for line in text.splitlines()[-lines:]]
    print(f"--- last {len(tail)} lines of {log_path} ---", file=sys.stderr)
    print("\n".join(tail), file=sys.stderr)
    print("--- end of log ---", file=sys.stderr, flush=True)


def table(rows, diff_pp, tolerance):
    lines = ["| run | pipeline_depth | held-out accuracy | train time | wall time |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        acc = f"{100 * r['accuracy']:.2f}%" if r["accuracy"] is not None else "failed"
        train = f"{r['train_time_s']:.1f} s" if r["train_time_s"] is not None else "-"
        lines.append(f"| {r['label']} | {r['pipeline_depth'] or 'auto'} | {acc} | {train} | "
                     f"{r['wall_s']:.1f} s |")
    if diff_pp is not None:
        verdict = "ok" if diff_pp >= -tolerance else f"more than {tolerance:g} pp below sync"
        lines.append(f"| difference (default - sync) | | {diff_pp:+.2f} pp ({verdict}) | | |")
    return "\n".join(lines)


def title(framework, rows, args):
    name = FRAMEWORKS[framework][1]
    results = [r["result_data"] for r in rows if r.get("result_data")]
    if framework == "keras" and results:
        name = (f"Keras {results[0].get('keras_version', '3')} "
                f"({results[0].get('backend', '?')} backend)")
    epochs = f", {results[0]['epochs']} epochs" if results else ""
    return f"## Digits CNN, {name}, {args.np} horovodrun workers, seed {args.seed}{epochs}"


def chosen(json_path):
    """What the default's auto chose, and why, from the run summary the example wrote
    beside its JSON."""
    summary = Path(f"{json_path}.run_summary")
    decision = json.loads(summary.read_text())["config"].get("auto") if summary.is_file() \
        else None
    if not decision:
        return "tuning off ($PIPE_HOROVOD_TUNE): the configuration as given"
    if "measuring" in decision:
        return (f"auto was still measuring ({decision['measuring']} steps) when the run "
                f"ended: it trained at K=1")
    why = decision.get("reason") or "predicted faster"
    if not decision.get("reason") and decision.get("tried_s"):
        why = (f"kept after its trial: {decision['tried_s'] * 1e3:.1f} ms a step against "
               f"{decision['measured_s'] * 1e3:.1f} ms at K=1")
    return (f"auto chose K={decision.get('pipeline_depth')}, compression "
            f"{decision.get('compression')} ({why})")


def main(argv=None):
    args = parse_args(argv)
    if args.np < 1:
        sys.exit("--np must be at least 1")
    example, name, stem = FRAMEWORKS[args.framework]
    horovodrun = find_horovodrun()
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="compare_digits_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"# {name}: synchronous vs the default, {args.np} horovodrun workers "
          f"(full logs under {out_dir})", flush=True)

    rows, failed = [], False
    for label, depth in RUNS + ([FIXED_K2] if args.k2 else []):
        json_path = out_dir / f"{stem}_depth{depth or 'auto'}.json"
        log_path = out_dir / f"{stem}_depth{depth or 'auto'}.log"
        json_path.unlink(missing_ok=True)
        Path(f"{json_path}.run_summary").unlink(missing_ok=True)     # (chosen() reads it)
        rc, wall = run_one(label, depth, args, horovodrun, json_path, log_path, example)
        row = {"label": label, "pipeline_depth": depth, "rc": rc, "wall_s": wall,
               "accuracy": None, "train_time_s": None, "log": str(log_path)}
        if rc == 0 and json_path.exists():
            result = json.loads(json_path.read_text())
            row.update(accuracy=result["accuracy"], train_time_s=result["train_time_s"],
                       epochs=result["epochs"], result=str(json_path), result_data=result)
        else:
            why = "timed out" if rc is None else f"exited with {rc}"
            if rc == 0:
                why = f"wrote no {json_path}"
            print(f"{label} run {why}", file=sys.stderr, flush=True)
            print_tail(log_path)
            failed = True
        rows.append(row)

    sync, default = rows[:2]
    diff_pp = None
    if sync["accuracy"] is not None and default["accuracy"] is not None:
        diff_pp = 100 * (default["accuracy"] - sync["accuracy"])
    print(f"\n{title(args.framework, rows, args)}\n")
    print(table(rows, diff_pp, args.tolerance))
    if default["train_time_s"] and sync["train_time_s"]:
        print(f"\ndefault: train time {default['train_time_s'] / sync['train_time_s']:.2f}x "
              f"synchronous; {chosen(default.get('result'))}")
    print(flush=True)
    for row in rows:
        row.pop("result_data", None)

    if args.json:
        Path(args.json).write_text(json.dumps(
            {"framework": args.framework, "np": args.np, "seed": args.seed,
             "tolerance_pp": args.tolerance, "runs": rows, "difference_pp": diff_pp}, indent=2))
    if failed or diff_pp is None:
        return 2
    if diff_pp < -args.tolerance:
        print(f"FAIL: the default's accuracy is {-diff_pp:.2f} pp below sync "
              f"(accepted: {args.tolerance:g} pp)", flush=True)
        return 1
    print(f"PASS: the default is within {args.tolerance:g} pp of sync ({diff_pp:+.2f} pp)",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
