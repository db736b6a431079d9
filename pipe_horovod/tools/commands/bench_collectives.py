"""`pipe-horovod bench-collectives`: bus bandwidth of each collective and per-hop codec.

Launches `pipe_horovod.tools.bench.collectives_worker` on --workers workers the
way `pipe-horovod bench` launches its worker (locally over loopback, or with
--emulate RATE inside `pipe_horovod.tools.emulate.EmulatedCluster`; the same
launch code; --topology chain links the emulated workers as a chain
instead of a star), follows rank 0's progress file with a tqdm bar, then prints
and saves the report (`pipe_horovod.tools.bench.collectives_report`) under --out
as <name>.md, <name>.json and <name>.png, next to the raw <name>-raw.json.
--unmatched (torch engine) adds plain torch.distributed all_reduce beside
the engine's, and the report the per-collective cost of name matching.
"""
import argparse
import os
import re
import shlex
import sys

from pipe_horovod.collectives.cost_model import TOPOLOGIES
from pipe_horovod.tools.bench import collectives_worker
from pipe_horovod.tools.commands import bench
from pipe_horovod.tools.launch import UsageError, check
from pipe_horovod.tools.validators import link_rate, positive_int

# 4 KB, 16 KB, ... 64 MB
DEFAULT_SIZES = [4 * 2**10 * 4**i for i in range(8)]
WORKER = collectives_worker.__name__


def _sizes(text):
    from pipe_horovod.tools import planner

    try:
        sizes = sorted({int(planner.parse_size(t)) for t in text.split(",") if t})
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not sizes or sizes[0] < 4:
        raise argparse.ArgumentTypeError(f"sizes must be >= 4 bytes, got {text!r}")
    return sizes


def add_arguments(parser):
    parser._negative_number_matcher = re.compile(r"^-\.?\d")
    parser.add_argument("--emulate", metavar="RATE", type=link_rate,
                        help="run the workers in an emulated cluster whose links are capped at "
                             "RATE (e.g. 1gbit); needs root")
    parser.add_argument("--topology", choices=TOPOLOGIES, default="star",
                        help="with --emulate: star (every worker's link to one switch) or chain "
                             "(worker i linked to i-1 and i+1 only, the ones between forwarding; "
                             "what linear pipelining was designed for) (default star)")
    parser.add_argument("--workers", type=positive_int("workers"), default=2,
                        help="worker processes (default 2)")
    parser.add_argument("--engine", choices=("torch", "horovod"), default="torch",
                        help="engine whose own allreduce is the baseline (and whose launcher "
                             "starts the workers) (default torch)")
    parser.add_argument("--sizes", type=_sizes, default=DEFAULT_SIZES,
                        help="comma-separated message sizes, e.g. 4KiB,1MiB,64MiB (a bare "
                             "number is bytes; default 4 KiB to 64 MiB, x4)")
    collectives_worker.add_arguments(parser)
    bench.add_output_arguments(parser, "collectives")


def command_line(args):
    """The canonical command that reproduces this run (recorded in the report)."""
    parts = ["pipe-horovod", "bench-collectives"]
    if args.emulate:
        parts += ["--emulate", args.emulate]
    if args.topology != "star":
        parts += ["--topology", args.topology]
    parts += ["--workers", str(args.workers), "--engine", args.engine,
              "--sizes", ",".join(str(s) for s in args.sizes),
              "--algorithms", ",".join(args.algorithms), "--codecs", ",".join(args.codecs),
              "--reps", str(args.reps), "--out", args.out, "--name", args.name]
    if args.threads != 1:
        parts += ["--threads", str(args.threads)]
    if args.unmatched:
        parts.append("--unmatched")
    return shlex.join(parts)


def _worker_argv(args, raw, progress):
    return ["--sizes", ",".join(str(s) for s in args.sizes),
            "--algorithms", ",".join(args.algorithms), "--codecs", ",".join(args.codecs),
            "--reps", str(args.reps), "--threads", str(args.threads),
            "--out", raw, "--progress", progress] + (["--unmatched"] if args.unmatched else [])


def _error(message):
    print(f"pipe-horovod bench-collectives: error: {message}", file=sys.stderr)
    return 2


def run(args):
    from pipe_horovod.tools.bench import collectives_report

    out = os.path.abspath(args.out)
    raw = os.path.join(out, f"{args.name}-raw.json")
    if not args.report_only:
        if args.workers < 2:
            return _error("an allreduce needs --workers >= 2")
        if args.unmatched and args.engine != "torch":
            return _error("--unmatched times torch.distributed's all_reduce beside the "
                          "torch engine's: it needs --engine torch")
        if args.topology != "star" and not args.emulate:
            return _error(f"--topology {args.topology} needs --emulate (a local launch "
                          "runs over loopback)")
        try:
            check(args)
        except UsageError as exc:
            return _error(str(exc))
        failed = bench.run_workers(args, out, lambda progress: _worker_argv(args, raw, progress),
                                   command_line(args), WORKER, "bench-collectives")
        if failed:
            return failed
    elif not os.path.exists(raw):
        return _error(f"--report-only: {raw} does not exist; run the benchmark first")
    text, paths = collectives_report.write_report(raw, out, args.name)
    print(text)
    print("wrote " + ", ".join([raw, *paths.values()]))
    return 0
