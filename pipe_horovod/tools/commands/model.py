"""`pipe-horovod model`: predicted sync vs pipelined step time, before running.

Lets a user see whether pipelining (and which compression) can pay off on
their cluster from four numbers: workers, bandwidth, latency, model size and
compute time. All arithmetic lives in pipe_horovod.tools.planner; this module only
parses, formats and plots.
"""
import re

from pipe_horovod.collectives import cost_model
from pipe_horovod.pipeline import timing_model
from pipe_horovod.tools import planner
from pipe_horovod.tools.validators import checked, number


def add_cluster_arguments(parser):
    """--workers, --bandwidth, --latency: the cluster every prediction command describes."""
    # argparse reads "-10gbit" as an unknown option and answers "expected one
    # argument"; treating anything that starts like a negative number as a
    # value lets the converter say "must not be negative" instead. (A private
    # attribute: if a future argparse drops it, only that message degrades.)
    parser._negative_number_matcher = re.compile(r"^-\.?\d")
    parser.add_argument("--workers", type=number(1, kind=int, what="workers"), required=True,
                        help="number of workers (p)")
    parser.add_argument("--bandwidth", type=checked(planner.parse_bandwidth), required=True,
                        help="per-link bandwidth, e.g. 10gbit, 1.25GB/s")
    parser.add_argument("--latency", type=checked(planner.parse_latency), default=planner.parse_latency("20us"),
                        help="per-message latency, e.g. 20us, 0.1ms (default 20us)")


def add_arguments(parser):
    add_cluster_arguments(parser)
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--model-mb", type=number(0, what="model size in MB", strict=True),
                      help="gradient size in MB (10^6 bytes)")
    size.add_argument("--model-size", type=checked(planner.parse_size), help="gradient size with unit, e.g. 233MB")
    parser.add_argument("--compute-ms", type=number(0, what="compute time"), required=True,
                        help="forward + backward time per step on one worker, ms")
    parser.add_argument("--update-ms", type=number(0, what="update time"), default=0.0,
                        help="optimizer update time per step, ms (default 0)")
    parser.add_argument("--algorithm", choices=sorted(timing_model.ALLREDUCE), default="ring",
                        help="allreduce algorithm: ring, lp (linear pipeline), mst (binomial tree), "
                             "be (bidirectional exchange) (default ring)")
    parser.add_argument("--pipeline-depth", type=number(2, kind=int, what="pipeline depth"), default=2,
                        help="K for the pipelined rows (default 2)")
    parser.add_argument("--overlap", type=number(0, 1, what="overlap"), default=0.0,
                        help="fraction of communication that sync hides behind backward (default 0)")
    parser.add_argument("--codec-ns-per-byte", type=number(0, what="codec cost"), default=None,
                        help="encode+decode cost per gradient byte for every compression "
                             "(default: CPU figures in pipe_horovod.tools.planner; use 0 for GPU)")
    parser.add_argument("--plot", metavar="PNG", help="also plot speedup over bandwidth and over workers")


def _inputs(args):
    """The keyword arguments of timing_model.predict, shared by the table and the sweeps."""
    compressions = timing_model.DEFAULT_COMPRESSIONS
    if args.codec_ns_per_byte is not None:
        compressions = {name: (ratio, args.codec_ns_per_byte * 1e-9) for name, (ratio, _) in compressions.items()}
    model_bytes = args.model_size if args.model_size is not None else args.model_mb * 1e6
    return dict(
        workload=timing_model.Workload.aggregate(args.compute_ms / 1e3, args.update_ms / 1e3, model_bytes),
        workers=args.workers,
        network=cost_model.Network(alpha=args.latency, beta=1.0 / args.bandwidth),
        algorithm=args.algorithm,
        compressions=compressions,
        pipeline_depth=args.pipeline_depth,
        overlap=args.overlap,
    )


def _ordered(rows):
    # Sync rows first, then pipelined, each in compression order.
    return sorted(rows.values(), key=lambda r: r.pipeline_depth)


def format_table(pred, workload):
    net, compute_s, update_s = pred.network, workload.backward_s, workload.update_s
    lines = [
        f"Timing model: {pred.algorithm} allreduce, {pred.workers} workers, "
        f"{8 / net.beta / 1e9:g} Gbit/s ({1 / net.beta / 1e9:g} GB/s), latency {net.alpha * 1e6:g} us, "
        f"model {pred.model_bytes / 1e6:g} MB, compute {compute_s * 1e3:g} ms, update {update_s * 1e3:g} ms",
        "",
        "| configuration | pipeline depth | compression | wire MB | comm ms | step ms | speedup vs sync |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in _ordered(pred.rows):
        lines.append(f"| {r.name} | {r.pipeline_depth} | {r.compression} | {r.wire_bytes / 1e6:.1f} | "
                     f"{r.comm_s * 1e3:.1f} | {r.step_s * 1e3:.1f} | {r.speedup:.2f}x |")
    bound = "compute" if pred.rows["pipelined"].bottleneck == "compute" else "communication"
    lines += ["", f"Pipelined (uncompressed) is {bound}-bound: step = max(compute + update, comm)."]
    return "\n".join(lines)


def plot(path, inputs):
    from pipe_horovod.tools.plotting import pyplot

    plt = pyplot()
    import numpy as np

    net, workers = inputs["network"], inputs["workers"]
    bandwidth = 1.0 / net.beta
    bandwidths = bandwidth * np.logspace(-2, 2, 41)
    worker_counts = sorted({int(round(w)) for w in np.geomspace(1, max(64, 4 * workers), 30)} | {workers})
    sweeps = [
        ("bandwidth (Gbit/s)", bandwidths * 8 / 1e9, bandwidth * 8 / 1e9,
         [timing_model.predict(**{**inputs, "network": cost_model.Network(net.alpha, 1.0 / b, net.gamma)}) for b in bandwidths]),
        ("workers", worker_counts, workers, [timing_model.predict(**{**inputs, "workers": p}) for p in worker_counts]),
    ]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, (xlabel, xs, given, preds) in zip(axes, sweeps):
        for name in (r.name for r in _ordered(preds[0].rows)):
            ax.plot(xs, [p.rows[name].speedup for p in preds], label=name,
                    linestyle="-" if name.startswith("pipelined") else "--")
        ax.axvline(given, color="grey", linewidth=0.8, linestyle=":")
        ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("speedup vs sync")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_title(f"{inputs['algorithm']}, {workers} workers")
    axes[1].set_title(f"{inputs['algorithm']}, {bandwidth * 8 / 1e9:g} Gbit/s")
    axes[1].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args):
    inputs = _inputs(args)
    print(format_table(timing_model.predict(**inputs), inputs["workload"]))
    if args.plot:
        plot(args.plot, inputs)
        print(f"\nwrote {args.plot}")
    return 0
