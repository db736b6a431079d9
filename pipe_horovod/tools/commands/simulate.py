"""`pipe-horovod simulate`: the step's messages run on SimGrid, beside the planner's prediction.

`plan` predicts a step from the timing model, which assumes a full-bisection network.
This command builds the same step (the same per-layer times and buckets) and runs the
messages each system really sends on SimGrid's flow-level network model, over a
topology built in code (pipe_horovod.tools.simulate): a star, oversubscribed fat-trees,
nodes of 8 GPUs behind one NIC. Each row prints the simulated step time and the planner's
own prediction, so where the planner stops holding is visible.
"""
import importlib.util
import json
import os
import time
from dataclasses import dataclass

from pipe_horovod.tools import planner
from pipe_horovod.tools.commands import plan as plan_command
from pipe_horovod.tools.commands.model import add_cluster_arguments
from pipe_horovod.tools.simulate import engine, schedule
from pipe_horovod.tools.simulate.topology import PLACEMENTS, parse_topology, placement
from pipe_horovod.tools.validators import checked, number

MISSING_SIMGRID = (
    "pipe-horovod simulate needs SimGrid's Python module (simgrid >= 3.32), which this Python "
    "cannot import. `make` installs it where apt-get is available (Debian's python3-simgrid, "
    "made importable in .venv by scripts/install_simgrid.sh); elsewhere `pip install simgrid` "
    "builds it from source (needs cmake, a C++17 compiler and Boost), or install your "
    "distribution's package and make its simgrid module importable by this Python.")

# The rows: each system as it runs (which buckets, K, which collective carries a bucket).
INT8_TWO_STAGE = "int8_ef"


@dataclass(frozen=True)
class RowKind:
    name: str
    description: str
    system: str          # "horovod" (fusion) or "ours" (automatic cap)
    depth: int           # K
    collective: str      # engine.simulate's collective kind
    codec: str = "none"  # two-stage codec (a config name) or "none"
    planner_algorithm: str = "ring"


ROWS = (
    RowKind("horovod", "Horovod DistributedOptimizer, sync, fused ring", "horovod", 1, "ring"),
    RowKind("ours-k1", "ours, K=1, ring", "ours", 1, "ring"),
    RowKind("ours-k2", "ours, K=2, ring", "ours", 2, "ring"),
    RowKind("ours-k2-int8-2stage", "ours, K=2, int8_ef in two stages (alltoall + allgather)",
            "ours", 2, "two_stage", INT8_TWO_STAGE),
    RowKind("ours-k2-int4-2stage", f"ours, K=2, {plan_command.INT4_TWO_STAGE} in two stages",
            "ours", 2, "two_stage", plan_command.INT4_TWO_STAGE),
    RowKind("ours-k2-lp", "ours, K=2, linear pipeline (collective='lp')", "ours", 2,
            "linear_pipeline", planner_algorithm="lp"),
)
# Horovod's HOROVOD_HIERARCHICAL_ALLREDUCE, on nodes only; ours on the Horovod engine
# reduces through Horovod's allreduce, so the variable reaches it too. The planner knows no
# hierarchy: its flat ring is shown beside these rows.
HIERARCHICAL_ROWS = (
    RowKind("horovod-hier", "Horovod, sync, hierarchical allreduce", "horovod", 1,
            "hierarchical"),
    RowKind("ours-k1-hier", "ours, K=1, hierarchical allreduce", "ours", 1, "hierarchical"),
    RowKind("ours-k2-hier", "ours, K=2, hierarchical allreduce", "ours", 2, "hierarchical"),
)
ALL_ROWS = ROWS + HIERARCHICAL_ROWS


def row_kinds(topology, names=None):
    """The rows for `topology` (hierarchical ones on nodes only), or those named, checked."""
    known = {r.name: r for r in ALL_ROWS}
    if names is None:
        return ROWS + (HIERARCHICAL_ROWS if topology.kind == "nodes" else ())
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown row {', '.join(unknown)}; choose from {', '.join(known)}")
    if topology.kind != "nodes" and any(known[n].collective == "hierarchical" for n in names):
        raise ValueError(f"hierarchical rows need a nodes topology, not {topology.spec}")
    return tuple(known[n] for n in names)


def add_arguments(parser):
    parser.add_argument("--model", type=checked(plan_command._model), required=True,
                        help="resnet50, vgg16, bert-base, gpt2-small (sequence 128), mlp or cnn")
    parser.add_argument("--batch-size", type=number(1, kind=int, what="batch size"), required=True,
                        help="samples per worker per step")
    timing = parser.add_mutually_exclusive_group(required=True)
    timing.add_argument("--device-tflops", type=number(0, what="device throughput", strict=True),
                        help="sustained TFLOP/s of one worker's accelerator (layer FLOPs over "
                             "it, backward twice forward)")
    timing.add_argument("--profile", metavar="JSON",
                        help="per-layer forward and backward times measured on a device (the "
                             "replay profile format, pipe_horovod/tools/workloads/replay.py)")
    add_cluster_arguments(parser)
    for action in parser._actions:
        if action.dest == "workers":
            action.type = plan_command._list_of(action.type)
            action.help += "; a comma-separated list simulates each"
        if action.dest == "bandwidth":
            action.help = ("bandwidth of each worker's link (star, fat-tree) or of each node's "
                           "NIC (nodes), e.g. 25gbit")
    parser.add_argument("--topology", type=plan_command._list_of(checked(parse_topology)),
                        default=[parse_topology("star")],
                        help="star, fattree:RATIO[:HOSTS_PER_RACK] (racks of 16 by default) or "
                             "nodes:GPUS (GPUs per node, 8 by default); a comma-separated list "
                             "simulates each (default star)")
    parser.add_argument("--placement", choices=PLACEMENTS, default="packed",
                        help="which host each rank gets on a fat-tree: packed (a rack's ranks "
                             "consecutive; default), spread (round-robin over the racks: every "
                             "ring hop leaves its rack) or random (a seeded shuffle)")
    parser.add_argument("--intra-node-bandwidth", type=checked(planner.parse_bandwidth),
                        default=planner.parse_bandwidth("2400gbit"),
                        help="nodes: each GPU's NVLink-class link (default 2400gbit, 300 GB/s)")
    parser.add_argument("--intra-node-latency", type=checked(planner.parse_latency),
                        default=planner.parse_latency("2us"),
                        help="nodes: per-message latency inside a node (default 2us)")
    parser.add_argument("--bucket-cap-mb", type=number(0, what="bucket cap", strict=True),
                        default=None, help="our bucket cap in MiB (default: the automatic size)")
    parser.add_argument("--rows", type=plan_command._list_of(str), default=None,
                        help="comma-separated rows to simulate (default: all for the topology): "
                             + ", ".join(r.name for r in ALL_ROWS))
    parser.add_argument("--network-model", choices=sorted(engine.NETWORK_MODELS), default="cm02",
                        help="SimGrid's network model: cm02 (links as given, max-min fair "
                             "sharing; default) or lv08 (SimGrid's TCP calibration)")
    parser.add_argument("--steps", type=number(4, kind=int, what="steps"), default=200,
                        help="steps simulated per row; the step time is the mean of the second "
                             "half (default 200: K=2 with a link d slower than compute fills "
                             "its one step of slack in about compute/d steps, 60 at 2%%, and "
                             "until then shows compute's step; a repeated step costs little)")
    parser.add_argument("--every-round", action="store_true",
                        help="run every round of every collective on the network, rather than "
                             "taking a repeated round (a ring's 2(p-1) steps, a bucket seen in "
                             "an earlier step) to cost what the first did; slow, for checking")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--plot", metavar="PNG",
                        help="also draw SimGrid's step beside the planner's, per configuration")
    parser.set_defaults(parser=parser)


def simulate_cluster(args, work, workers, topology):
    """[(RowKind, SimGrid's {step_s, comm_s, steps}, planner's timing_model.Row)] of one
    cluster."""
    topology.check_workers(workers)
    network = schedule.network_of(args.bandwidth, args.latency)
    kinds = row_kinds(topology, args.rows)
    cap = None if args.bucket_cap_mb is None else args.bucket_cap_mb * 2**20
    planned = schedule.rows(kinds, work, workers, network, cap)
    spec = {"topology": topology.spec, "placement": args.placement, "workers": workers,
            "bandwidth": args.bandwidth, "latency": args.latency,
            "intra_bandwidth": args.intra_node_bandwidth,
            "intra_latency": args.intra_node_latency, "network_model": args.network_model,
            "every_round": args.every_round, "steps": args.steps,
            "rows": [row for _, row, _ in planned]}
    result = engine.run(spec)
    return [(kind, result["rows"][kind.name], predicted) for kind, _, predicted in planned]


def format_table(args, work, results):
    lines = [
        f"Simulated on SimGrid ({args.network_model}): {args.model}, batch {args.batch_size} per "
        f"worker, " + (f"{args.device_tflops:g} TFLOP/s per device" if args.profile is None
                       else f"layer times from {args.profile}") +
        f", {args.bandwidth * 8 / 1e9:g} Gbit/s "
        f"links (a node's NIC on nodes), latency {args.latency * 1e6:g} us, ranks placed "
        f"{args.placement}",
        f"Model: {work.model_bytes / 4 / 1e6:.1f} M parameters ({work.model_bytes / 1e6:.1f} MB of "
        f"fp32 gradients); forward {work.forward_s * 1e3:.2f} ms, backward "
        f"{work.backward_s * 1e3:.2f} ms per step",
        "",
        "| workers | topology | configuration | K | SimGrid step ms | planner step ms | planner off by "
        "| SimGrid comm ms | planner comm ms | vs Horovod (SimGrid) |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for workers, topology, rows in results:
        base = next((sim["step_s"] for kind, sim, _ in rows if kind.name == "horovod"), None)
        for kind, sim, predicted in rows:
            off = (predicted.step_s - sim["step_s"]) / sim["step_s"]
            flat = " (flat ring)" if kind.collective == "hierarchical" else ""
            lines.append(
                f"| {workers} | {topology.spec} | {kind.name} | {kind.depth} | "
                f"{sim['step_s'] * 1e3:.2f} | {predicted.step_s * 1e3:.2f}{flat} | {off:+.1%} | "
                f"{sim['comm_s'] * 1e3:.2f} | {predicted.comm_s * 1e3:.2f} | "
                + (f"{base / sim['step_s']:.2f}x |" if base else "- |"))
    shown = {kind.name: kind for _, _, rows in results for kind, _, _ in rows}
    lines += ["", *(f"{kind.name}: {kind.description}" for kind in shown.values())]
    lines += [
        "",
        "SimGrid step ms: the mean step of the second half of the simulated steps, all ranks in "
        "lockstep; comm ms: the link's busy time in the last step. planner: "
        "pipe_horovod.pipeline.timing_model's prediction for the same buckets (full bisection "
        "at the given bandwidth; no hierarchy); planner off by: (planner - SimGrid) / SimGrid.",
    ]
    return "\n".join(lines)


def plot(path, args, results):
    """Horizontal bars: per cluster and configuration, SimGrid's step and the planner's."""
    from pipe_horovod.tools.plotting import pyplot

    plt = pyplot()
    labels, simulated, planned = [], [], []
    for workers, topology, rows in results:
        for kind, sim, predicted in rows:
            labels.append(f"{workers} on {topology.spec}: {kind.name}")
            simulated.append(sim["step_s"] * 1e3)
            planned.append(predicted.step_s * 1e3)
    y = range(len(labels))[::-1]                     # the table's order, top down
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.32 * len(labels)))
    ax.barh([v + 0.2 for v in y], simulated, height=0.4, color="tab:blue", label="SimGrid")
    ax.barh([v - 0.2 for v in y], planned, height=0.4, color="tab:gray", label="planner")
    ax.set_yticks(list(y), labels, fontsize=8)
    ax.set_xlabel("step time (ms)")
    ax.set_title(f"{args.model}, batch {args.batch_size}, {args.bandwidth * 8 / 1e9:g} Gbit/s, "
                 f"{args.latency * 1e6:g} us, ranks {args.placement}", fontsize=10)
    ax.set_xlim(0, 1.3 * max(simulated + planned))      # room for the legend beside the bars
    ax.legend(loc="lower right", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args):
    from pipe_horovod.tools.workloads.architectures import layer_table  # torch: only here

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        for topology in args.topology:
            for workers in args.workers:
                topology.check_workers(workers)
                placement(topology, workers, args.placement)
                schedule.check_size(workers, memory)
        for topology in args.topology:
            row_kinds(topology, args.rows)
    except ValueError as exc:
        args.parser.error(str(exc))
    layers = layer_table(args.model, args.batch_size)
    times = None
    if args.profile is not None:
        from pipe_horovod.tools.workloads.replay import load_profile

        try:
            times = load_profile(args.profile, layers, args.model, args.batch_size)
        except ValueError as exc:
            args.parser.error(str(exc))
    work = plan_command.workload(layers, args.device_tflops, times)
    if importlib.util.find_spec("simgrid") is None:     # after the input: say what is wrong first
        raise SystemExit(MISSING_SIMGRID)
    results = []
    for topology in args.topology:
        for workers in args.workers:
            began = time.monotonic()
            rows = simulate_cluster(args, work, workers, topology)
            print(f"simulated {workers} workers on {topology.spec} in "
                  f"{time.monotonic() - began:.1f} s", flush=True)
            results.append((workers, topology, rows))
    print()
    print(format_table(args, work, results))
    if args.plot:
        plot(args.plot, args, results)
        print(f"\nwrote {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"workers": w, "topology": t.spec, "model": args.model,
                        "bandwidth": args.bandwidth, "latency": args.latency,
                        "network_model": args.network_model, "placement": args.placement,
                        "rows": [{"name": k.name, "depth": k.depth, "sim_step_s": s["step_s"],
                                  "sim_comm_s": s["comm_s"], "planner_step_s": p.step_s,
                                  "planner_comm_s": p.comm_s} for k, s, p in rows]}
                       for w, t, rows in results], f, indent=1)
        print(f"\nwrote {args.json}")
    return 0
