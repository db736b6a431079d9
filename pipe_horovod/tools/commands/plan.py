"""`pipe-horovod plan`: predicted step time of a real model on a cluster, per system.

What a user asks before spending cluster time: for this model, batch,
device and network, how fast is Horovod's synchronous training, DDP's, ours
at K=1 and K=2, and with each codec, and what limits each. The per-layer
FLOPs and parameter sizes come from the real architecture
(pipe_horovod.tools.workloads.architectures.layer_table); all timing arithmetic
lives in pipe_horovod.pipeline.timing_model (Workload, Bucketing, predict); this module
parses, picks the rows, formats and plots.
"""
import dataclasses
import math

from pipe_horovod.collectives import cost_model
from pipe_horovod.pipeline import measured_run, timing_model
from pipe_horovod.tools import run_advice
from pipe_horovod.tools.commands.model import add_cluster_arguments
from pipe_horovod.tools.validators import checked, number

FP32 = 4  # bytes per gradient element


def _model(text):
    from pipe_horovod.tools.workloads.architectures import check_model  # torch: only when planning

    check_model(text)
    return text


# Required unless --from-run, which takes the model, the workers and the link from a run.
MODEL_ARGUMENTS = ("--model", "--batch-size", "--device-tflops", "--workers", "--bandwidth")


def add_arguments(parser):
    parser.add_argument("--from-run", metavar="SUMMARY", type=checked(_run_summary),
                        help="advise from a measured run instead: the JSON summary rank 0 wrote "
                             "(PIPE_HOROVOD_RUN_SUMMARY=path, or optimizer.write_run_summary); "
                             "prints the K, compression and bucket size that the planner "
                             "predicts fastest among those that meet the convergence rule "
                             "(docs/convergence.md), with the gain over the measured step")
    parser.add_argument("--model", type=checked(_model),
                        help="resnet50, vgg16, bert-base or gpt2-small (sequence 128), or the bench's mlp / cnn")
    parser.add_argument("--batch-size", type=number(1, kind=int, what="batch size"),
                        help="samples per worker per step")
    parser.add_argument("--device-tflops", type=number(0, what="device throughput", strict=True),
                        help="sustained TFLOP/s of one worker's accelerator")
    add_cluster_arguments(parser)
    parser.set_defaults(parser=parser)
    for action in parser._actions:       # plan also takes lists: one table per model, a sweep
        if action.dest in ("workers", "bandwidth"):
            action.required = False          # (MODEL_ARGUMENTS: checked in run)
            action.type = _list_of(action.type)
            action.help += "; a comma-separated list prints the sweep table of ours vs Horovod"
    parser.add_argument("--bucket-cap-mb", type=number(0, what="bucket cap", strict=True), default=None,
                        help="bucket cap of ours and DDP in MiB, as their bucket_cap_mb (default: "
                             "auto, ours as DistributedOptimizer(bucket_cap_mb=None) picks it for "
                             "the workers and link, DDP at its 25)")
    parser.add_argument("--int8-two-stage", action="store_true",
                        help="add rows for int8 and for int4_ef:32 (blocks of 32: the block size "
                             "that meets the transformer convergence target, docs/convergence.md) "
                             "in two stages on the engine's alltoall and allgather (no "
                             "collective=), beside int8 and int4 per ring hop")
    parser.add_argument("--plot", metavar="PNG", help="also draw the table as a bar chart")


def _run_summary(path):
    """(path, the run summary it holds, checked: run_advice.load)."""
    return path, run_advice.load(path)


def _list_of(convert):
    """An argparse type for one value or a comma-separated list of them (a list)."""
    def parse(text):
        return [convert(part.strip()) for part in str(text).split(",")]
    parse.__name__ = getattr(convert, "__name__", "value")
    return parse


def _codecs(two_stage=False):
    """The K=2 codec rows: name -> (wire ratio, codec seconds per byte). Codecs run on
    the device beside backward, so they cost no time here. int8 (int4) carries one float32
    scale per block of at most PIECE_BYTES of the float32 gradient per ring hop, and
    one per block of the engine's block size in two stages ("int8-2stage": a ring
    allreduce of that many bytes costs what timing_model.two_stage_allreduce does, its
    reduction's gamma aside)."""
    from pipe_horovod.tools.hop_codecs import PER_HOP, wire_ratio

    codecs = {"fp16": (0.5, 0.0), **{name: (wire_ratio(name), 0.0) for name in PER_HOP}}
    if two_stage:                 # int8 values, the runtime's default block of scales
        codecs["int8-2stage"] = (timing_model.two_stage_wire_ratio(), 0.0)
        # int4 values at blocks of 32 (measured_run.wire_ratio("int4_ef:32"))
        codecs["int4-2stage"] = (measured_run.wire_ratio(INT4_TWO_STAGE), 0.0)
    return codecs


# (row name, what the configuration is, bucketing, predict's row)
ROWS = (
    ("horovod", "Horovod DistributedOptimizer, sync", "horovod", "sync"),
    ("ddp", "torch DDP, sync", "ddp", "sync"),
    ("ours-k1", "ours, K=1", "ours", "sync"),
    ("ours-k2", "ours, K=2", "ours", "pipelined"),
    ("ours-k2-fp16", "ours, K=2, fp16 on the wire", "ours", "pipelined+fp16"),
    ("ours-k2-bf16hop", "ours, K=2, bf16 per ring hop", "ours", "pipelined+bf16hop"),
    ("ours-k2-int8", "ours, K=2, int8 per ring hop", "ours", "pipelined+int8"),
    ("ours-k2-int4", "ours, K=2, int4 per ring hop", "ours", "pipelined+int4"),
    ("ours-k2-x4", "ours, K=2, lookahead from an int4 exchange: prediction_exchange",
     "ours-x4", "pipelined"),
)
# The planner's one topology: every worker its own full link, nothing shared. SimGrid
# (`pipe-horovod simulate`, docs/simulate.md) agrees with it exactly on a full-bisection
# star and finds it 2.8-3.8x too fast on a 4:1 fat-tree with ranks scattered over racks,
# 1.3-3.7x too fast for the two-stage codecs behind shared uplinks or a node's one NIC.
TOPOLOGY_LIMIT = (
    "Limit: full bisection, no contention, flat rings: behind oversubscribed rack uplinks or "
    "a NIC shared by a node's GPUs this step can be 1.3-3.8x too short (ranks scattered over "
    "racks, the two-stage codecs' alltoall) and hierarchical allreduce is not modelled; run "
    "`pipe-horovod simulate --topology fattree:4,nodes:8` (docs/simulate.md).")
INT4_TWO_STAGE = "int4_ef:32"    # int4_ef's block size that meets the convergence rule
TWO_STAGE_ROWS = (
    ("ours-k2-int8-2stage", "ours, K=2, int8 in two stages on the engine's collectives",
     "ours", "pipelined+int8-2stage"),
    ("ours-k2-int4-2stage", f"ours, K=2, {INT4_TWO_STAGE} in two stages on the engine's "
     "collectives", "ours", "pipelined+int4-2stage"))


def workload(layers, device_tflops, times=None):
    """timing_model.Workload of `layers` (architectures.Layer, forward order), timed as the
    benchmark's replay times them (replay.layer_times: FLOPs / device throughput,
    backward twice forward), or by `times` (replay.LayerTime per layer, a measured
    profile's: replay.load_profile) when given."""
    from pipe_horovod.tools.workloads.replay import layer_times

    times = layer_times(layers, device_tflops) if times is None else times
    return timing_model.Workload.from_layers(
        (t.forward_s, t.backward_s, tuple(FP32 * math.prod(shape) for _, shape in layer.params))
        for t, layer in zip(times, layers))


def rows_of(two_stage=False):
    """ROWS, and the two-stage rows when asked for."""
    return ROWS + (TWO_STAGE_ROWS if two_stage else ())


def plan(layers, device_tflops, workers, network, bucket_cap_bytes=None, work=None,
         two_stage=False):
    """(timing_model.Workload, {row name: timing_model.Row} for rows_of(two_stage)); speedup is over
    the "horovod" row. bucket_cap_bytes None: ours at its automatic size
    (timing_model.auto_bucketing), DDP at 25 MiB. `work`: the workload of `layers`, when the
    caller has it already."""
    work = workload(layers, device_tflops) if work is None else work
    systems = timing_model.bucketings(bucket_cap_bytes, workers=workers, network=network)
    predictions = {name: timing_model.predict(work, workers, network,
                                         compressions=_codecs(two_stage) if name == "ours" else {},
                                         bucketing=b)
                   for name, b in systems.items()}
    predictions["ours-x4"] = timing_model.predict(work, workers, network, bucketing=systems["ours"],
                                             exchange="int4")
    rows = {name: predictions[system].rows[row] for name, _, system, row in rows_of(two_stage)}
    base = rows["horovod"].step_s
    return work, {name: dataclasses.replace(r, name=name, speedup=base / r.step_s if r.step_s > 0 else 1.0)
                  for name, r in rows.items()}


def format_table(args, work, rows):
    n_params = work.model_bytes / FP32
    lines = [
        f"Plan: {args.model}, batch {args.batch_size} per worker, {args.workers} workers, "
        f"{args.device_tflops:g} TFLOP/s per device, {args.bandwidth * 8 / 1e9:g} Gbit/s links, "
        f"latency {args.latency * 1e6:g} us, buckets {_buckets(args, work.model_bytes)}",
        f"Model: {n_params / 1e6:.1f} M parameters ({work.model_bytes / 1e6:.1f} MB of fp32 gradients); "
        f"forward {work.forward_s * 1e3:.2f} ms, backward {work.backward_s * 1e3:.2f} ms per step",
        "",
        "| configuration | K | wire MB | comm ms | step ms | samples/s | vs Horovod | bottleneck |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, desc, _, _ in rows_of(getattr(args, "int8_two_stage", False)):
        r = rows[name]
        lines.append(f"| {name} ({desc}) | {r.pipeline_depth} | {r.wire_bytes / 1e6:.1f} | "
                     f"{r.comm_s * 1e3:.2f} | {r.step_s * 1e3:.2f} | "
                     f"{args.batch_size * args.workers / r.step_s:,.0f} | {r.speedup:.2f}x | {r.bottleneck} |")
    lines += [
        "",
        "Assumptions: ring allreduce on a full-bisection network (every worker sends and receives at "
        "the full link bandwidth at once); one worker per device at the given throughput; "
        "forward = layer FLOPs / device throughput (matrix products and convolutions only), "
        "backward = 2 x forward, the optimizer update not counted; fp32 gradients; codecs run on the "
        "device at no cost; one link per worker carries buckets in the order backward makes them "
        "ready. Ours and DDP bucket by --bucket-cap-mb (DDP's first bucket 1 MiB; by default ours at "
        "the automatic size, its first bucket closing at 4 MiB, and DDP at 25 MiB); Horovod fuses "
        "whatever is ready, up to 128 MiB (its defaults; its 1 ms cycle not counted). "
        "comm ms: the link's busy time per step; step ms: max(compute, comm) for K=2, "
        "forward + the last bucket's landing for sync (see pipe_horovod/pipeline/timing_model.py).",
        TOPOLOGY_LIMIT,
    ]
    return "\n".join(lines)


def plot(path, args, work, rows):
    from pipe_horovod.tools.plotting import pyplot

    plt = pyplot()

    names = [name for name, *_ in rows_of(getattr(args, "int8_two_stage", False))][::-1]  # Horovod on top
    compute = work.forward_s + work.backward_s
    steps = [rows[n].step_s * 1e3 for n in names]
    busy = [min(compute * 1e3, s) for s in steps]
    fig, ax = plt.subplots(figsize=(9, 4.8))
    ax.barh(names, busy, color="tab:blue", label="forward + backward")
    ax.barh(names, [s - b for s, b in zip(steps, busy)], left=busy, color="tab:orange",
            label="communication not hidden")
    for y, name in enumerate(names):
        r = rows[name]
        ax.text(r.step_s * 1e3, y, f" {r.step_s * 1e3:.1f} ms, {r.speedup:.2f}x, {r.bottleneck}",
                va="center", fontsize=9)
    ax.set_xlim(0, max(steps) * 1.45)
    ax.set_xlabel("predicted step time (ms)")
    ax.set_title(f"{args.model}, batch {args.batch_size}, {args.workers} workers, "
                 f"{args.device_tflops:g} TFLOP/s, {args.bandwidth * 8 / 1e9:g} Gbit/s, "
                 f"{args.latency * 1e6:g} us, buckets {_buckets(args, work.model_bytes)}", fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, fontsize=9, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _buckets(args, model_bytes):
    """The header's bucket size: the cap given, or the automatic one for this model."""
    if args.bucket_cap_mb is not None:
        return f"{args.bucket_cap_mb:g} MiB"
    ours = timing_model.auto_bucketing(args.workers, _network(args))
    return (f"auto ({ours.cap_for(model_bytes) / timing_model.MIB:.1f} MiB, first "
            f"{ours.first_cap_bytes / timing_model.MIB:g} MiB; DDP 25 MiB)")


def _network(args):
    return cost_model.Network(alpha=args.latency, beta=1.0 / args.bandwidth)


def sweep(layers, device_tflops, workers, bandwidths, latency, bucket_cap_bytes=None):
    """[(workers, bandwidth bytes/s, our cap in bytes, {row name: timing_model.Row})] for every
    pair: the rows of `plan` (speedup over Horovod) at each cluster size and link."""
    work, out = workload(layers, device_tflops), []
    for p in workers:
        for bandwidth in bandwidths:
            network = cost_model.Network(alpha=latency, beta=1.0 / bandwidth)
            cap = (timing_model.auto_bucketing(p, network).cap_for(work.model_bytes)
                   if bucket_cap_bytes is None else bucket_cap_bytes)
            _, rows = plan(layers, device_tflops, p, network, bucket_cap_bytes, work=work)
            out.append((p, bandwidth, cap, rows))
    return work, out


def format_sweep(args, work, results):
    """Our K=1 and K=2 against Horovod per cluster size and link, with DDP for reference."""
    cap = "auto" if args.bucket_cap_mb is None else f"{args.bucket_cap_mb:g} MiB"
    lines = [
        f"Sweep: {args.model}, batch {args.batch_size} per worker, {args.device_tflops:g} TFLOP/s "
        f"per device, latency {args.latency * 1e6:g} us, our buckets {cap}",
        f"Model: {work.model_bytes / FP32 / 1e6:.1f} M parameters; forward {work.forward_s * 1e3:.2f} ms, "
        f"backward {work.backward_s * 1e3:.2f} ms per step",
        "",
        "| workers | link | our bucket MiB | Horovod step ms | ours K=1 | ours K=2 | DDP | bottleneck (Horovod) |",
        "|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for p, bandwidth, cap_bytes, rows in results:
        lines.append(f"| {p} | {bandwidth * 8 / 1e9:g} Gbit/s | {cap_bytes / timing_model.MIB:.1f} | "
                     f"{rows['horovod'].step_s * 1e3:.2f} | {rows['ours-k1'].speedup:.3f}x | "
                     f"{rows['ours-k2'].speedup:.3f}x | {rows['ddp'].speedup:.3f}x | "
                     f"{rows['horovod'].bottleneck} |")
    lines += ["", "ours K=1, K=2, DDP: step-time ratio to Horovod's DistributedOptimizer (above 1: "
                  "faster), same assumptions as the single-cluster table (ring allreduce, "
                  "full-bisection network, Horovod fusing up to 128 MiB, its cycle not counted).",
              TOPOLOGY_LIMIT]
    return "\n".join(lines)


def _check_arguments(args):
    """--from-run, or every one of MODEL_ARGUMENTS (argparse's error, exit 2)."""
    given = [flag for flag in MODEL_ARGUMENTS
             if getattr(args, flag[2:].replace("-", "_")) is not None]
    if args.from_run is not None and given:
        args.parser.error(f"--from-run takes the model, workers and link from the run; "
                          f"drop {', '.join(given)}")
    missing = [flag for flag in MODEL_ARGUMENTS if flag not in given]
    if args.from_run is None and missing:
        args.parser.error(f"the following arguments are required: {', '.join(missing)} "
                          f"(or --from-run SUMMARY)")


def run(args):
    from pipe_horovod.tools.workloads.architectures import layer_table

    _check_arguments(args)
    if args.from_run is not None:
        try:
            print(run_advice.report(args.from_run[1], args.latency, args.from_run[0]))
        except ValueError as exc:
            args.parser.error(str(exc))
        return 0

    layers = layer_table(args.model, args.batch_size)
    cap_bytes = None if args.bucket_cap_mb is None else args.bucket_cap_mb * timing_model.MIB
    if len(args.workers) > 1 or len(args.bandwidth) > 1:
        if args.plot:
            raise SystemExit("pipe-horovod plan: --plot draws one cluster; give one --workers "
                             "and one --bandwidth")
        work, results = sweep(layers, args.device_tflops, args.workers, args.bandwidth,
                              args.latency, cap_bytes)
        print(format_sweep(args, work, results))
        return 0
    args.workers, args.bandwidth = args.workers[0], args.bandwidth[0]
    work, rows = plan(layers, args.device_tflops, args.workers, _network(args), cap_bytes,
                      two_stage=args.int8_two_stage)
    print(format_table(args, work, rows))
    if args.plot:
        plot(args.plot, args, work, rows)
        print(f"\nwrote {args.plot}")
    return 0
