"""The worker of `pipe-horovod bench-collectives`: allreduce time per algorithm, codec, size.

Every rank runs this (launched by `pipe_horovod.tools.commands.bench_collectives`
like `pipe-horovod bench`'s worker). For each message size (float32), in
`--reps` repetitions, it times every configuration once per repetition, the
configurations interleaved so the machine's drifting load hits them all
alike: the engine's own allreduce (`native/none`) and each
`pipe_horovod.collectives` algorithm with each per-hop codec. One untimed
run per configuration and size comes first (it allocates the collectives'
persistent buffers). Small messages are timed as `inner` back-to-back
calls, averaged. Every rank times its own calls after a barrier; rank 0
gathers them and writes the raw JSON (format pipe_horovod.bench_collectives/1)
with the machine's load (busy cores from /proc/stat) during each size, and
before it, while every worker sleeps (the load from everything else), and
each per-hop codec's encode/add/decode cost measured by every rank at once
at several block sizes (the median over ranks: timing_model.hop_codec_time's
calibration), and the one-way time of a small point-to-point message on the
collectives' own group, every pair of ranks at once (the per-message cost of
our collectives: timing_model.with_message_cost).

`--algorithms ...,two-stage,two-stage-p2p` adds the two-stage quantized allreduce
(`two-stage/int8`, `two-stage/fp8_e4m3`: collectives/quantized.py on the
engine's own alltoall and allgather, what the optimizer runs for GPU buckets with
compression=int8/int8_ef/fp8 and no collective=; `two-stage-p2p/...`: the same
point to point, what it runs for CPU buckets), beside the per-hop codecs.

With --unmatched (torch engine only) a configuration `unmatched/none` is
timed beside the others: a plain `torch.distributed.all_reduce` of the same
tensor on the default group, then the same division by the world size
(Average), as a DDP or torchrun script calls it: no name matching, no
checks, no handle. `native/none` minus `unmatched/none` is what the torch
engine adds to each collective (engine/negotiation.py's cycle, its thread's
hand-off, the checks and the wait): the price of the safety checks per collective.
It also times both with IN_FLIGHT collectives started at once (distinct
tensors, names `<name>.<i>`), then waited for (`native-8/none`,
`unmatched-8/none`: async_op=True, then each Work's wait), as a pipeline's
buckets are: requests started together share one negotiation cycle. Their
times are per collective (the burst's time / IN_FLIGHT).
"""
import argparse
import json
import os
import sys
import time

from pipe_horovod.tools.bench.worker import Progress, _machine_ticks, _versions

FORMAT = "pipe_horovod.bench_collectives/1"
NATIVE = "native"
UNMATCHED = "unmatched"     # --unmatched: plain dist.all_reduce, no name matching (torch)
IN_FLIGHT = 8               # --unmatched also times bursts of this many collectives in flight
ALGORITHMS = ("lp", "ring", "mst", "be")
CODECS = ("none", "bf16", "int8")
# Also accepted, not run by default: the engine's two-stage quantized allreduce
# (collectives/quantized.py: quantize, the engine's alltoall, sum the own shard in float32,
# quantize, the engine's allgather), which runs only the codecs with a wire format; and the
# fp8 codecs, which have no per-hop form (they run only in "two-stage").
TWO_STAGE = "two-stage"
TWO_STAGE_P2P = "two-stage-p2p"     # the same, point to point: what CPU buckets run
TWO_STAGES = (TWO_STAGE, TWO_STAGE_P2P)
ALL_ALGORITHMS = ALGORITHMS + TWO_STAGES
FP8_CODECS = ("fp8_e4m3", "fp8_e5m2")
ALL_CODECS = CODECS + FP8_CODECS
# Messages up to this size are timed as INNER calls in a row (one call is too short to time).
SMALL_BYTES = 1 << 20
INNER = 8
# Before each size every rank sleeps this long while the machine's load from
# everything else is read (as `pipe-horovod bench` does at each round).
IDLE_PROBE_S = 0.5


def in_flight(algorithm):
    """The engine's or plain allreduce IN_FLIGHT at once: `native-8`, `unmatched-8`."""
    return f"{algorithm}-{IN_FLIGHT}"


def runs(algorithm, codec):
    """Whether `algorithm` carries `codec`: two-stage only the codecs with a wire format
    (int8, fp8), our per-hop collectives every codec but fp8."""
    if algorithm in TWO_STAGES:
        return codec not in ("none", "bf16")
    return codec not in FP8_CODECS


def config_names(algorithms=ALGORITHMS, codecs=CODECS, unmatched=False):
    """`native/none` (the engine's own allreduce); with `unmatched`, `unmatched/none`
    (plain torch.distributed.all_reduce) and both IN_FLIGHT at once; then every
    algorithm/codec the algorithm carries (`runs`)."""
    extra = [f"{UNMATCHED}/none", f"{in_flight(NATIVE)}/none",
             f"{in_flight(UNMATCHED)}/none"] if unmatched else []
    return [f"{NATIVE}/none"] + extra + [f"{a}/{c}" for a in algorithms for c in codecs
                                         if runs(a, c)]


def per_call(config):
    """Collectives one call of `config` runs (IN_FLIGHT for a burst)."""
    return IN_FLIGHT if config.split("/")[0].endswith(f"-{IN_FLIGHT}") else 1


def inner_calls(nbytes):
    return INNER if nbytes <= SMALL_BYTES else 1


def _name(config, nbytes):
    return f"bench.collectives.{config.replace('/', '.')}.{nbytes}"


def _allreduce(eng, config, buf, name, burst=()):
    """One call of `config` on `buf` (a burst: on each tensor of `burst`, at once)."""
    from pipe_horovod import collectives, engine
    from pipe_horovod.compression import Compression

    algorithm, codec = config.split("/")
    if algorithm == NATIVE:
        return eng.wait(eng.allreduce_async(buf, name, engine.Average))
    if algorithm == UNMATCHED:              # what the engine's path does, minus the engine
        import torch.distributed as dist

        dist.all_reduce(buf)
        return buf.div_(eng.size())
    if algorithm == in_flight(NATIVE):
        handles = [eng.allreduce_async(t, f"{name}.{i}", engine.Average)
                   for i, t in enumerate(burst)]
        return [eng.wait(h) for h in handles]
    if algorithm == in_flight(UNMATCHED):
        import torch.distributed as dist

        works = [dist.all_reduce(t, async_op=True) for t in burst]
        for work, t in zip(works, burst):
            work.wait()
            t.div_(eng.size())
        return burst
    if algorithm in TWO_STAGES:
        from pipe_horovod.collectives import quantized
        from pipe_horovod.compression import wire_format

        return quantized.allreduce(buf, name, engine.Average,
                                   fmt=wire_format(Compression.by_name(codec)),
                                   transport="p2p" if algorithm == TWO_STAGE_P2P else "engine")
    return collectives.allreduce(buf, name, engine.Average, collective=algorithm,
                                 compression=Compression.by_name(codec))


def _timed(eng, config, buf, name, calls, burst=()):
    """Seconds per collective of `calls` calls in a row."""
    eng.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        _allreduce(eng, config, buf, name, burst)
    return (time.perf_counter() - t0) / (calls * per_call(config))


# Block sizes (float32 bytes) at which the codecs are measured: the collectives' blocks
# run from LP's small chunks to BE's quarter of a 64 MB message.
COST_BLOCKS = tuple(4 << (2 * i) for i in range(6, 12))     # 16 KiB ... 16 MiB
COST_BYTES = 1 << 20                                        # the single figure kept as before
# The per-message probe: round trips of a message this small between rank pairs.
PROBE_BYTES, PROBE_TRIPS = 4, 30


def _codec_costs(codecs):
    """codec -> {block bytes: (encode, decode-add, decode) s per float32 byte}
    (hop_codecs.measure_costs at each of COST_BLOCKS)."""
    import torch

    from pipe_horovod.compression import Compression
    from pipe_horovod.tools.hop_codecs import measure_costs

    return {c: {b: measure_costs(Compression.by_name(c).hop(torch.float32), b // 4)
                for b in COST_BLOCKS} for c in codecs if runs("ring", c) and c != "none"}


def _message_seconds(eng):
    """One-way seconds of a PROBE_BYTES message on the collectives' gloo group (half the
    median round trip), ranks 2i and 2i+1 paired, all pairs at once; None for a rank
    without a partner. What each dependent hop of our collectives pays beyond its
    bytes: posting isend/irecv from Python, gloo, the kernel, waking the waiter."""
    import torch
    import torch.distributed as dist

    from pipe_horovod.collectives.communicator import communicator

    group, me = communicator(eng).group, eng.rank()
    peer, tensor, trips = me ^ 1, torch.zeros(max(1, PROBE_BYTES // 4)), []
    eng.barrier()
    if peer >= eng.size():
        return None
    for _ in range(PROBE_TRIPS + 1):
        t0 = time.perf_counter()
        if me % 2 == 0:
            dist.isend(tensor, peer, group=group, tag=1).wait()
            dist.irecv(tensor, peer, group=group, tag=2).wait()
        else:
            dist.irecv(tensor, peer, group=group, tag=1).wait()
            dist.isend(tensor, peer, group=group, tag=2).wait()
        trips.append(time.perf_counter() - t0)
    return sorted(trips[1:])[PROBE_TRIPS // 2] / 2


def _median_costs(costs_per_rank, codec, block):
    values = [r[codec][block] for r in costs_per_rank]
    return [sorted(v[i] for v in values)[len(values) // 2] for i in range(3)]


def _busy_cores(ticks0, ticks1):
    if not (ticks0 and ticks1) or ticks1[1] <= ticks0[1]:
        return None
    return (ticks1[0] - ticks0[0]) / (ticks1[1] - ticks0[1]) * (os.cpu_count() or 1)


def run(args):
    """Time every configuration at every size; rank 0 returns (and writes) the raw result."""
    import torch

    from pipe_horovod import engine

    torch.set_num_threads(args.threads)
    eng = engine.init()
    rank, size = eng.rank(), eng.size()
    if args.unmatched and eng.name != "torch":
        raise SystemExit(f"--unmatched needs the torch engine, not {eng.name}")
    configs = config_names(args.algorithms, args.codecs, args.unmatched)
    progress = Progress(args.progress if rank == 0 else None,
                        len(args.sizes) * (args.reps + 1), rank == 0)
    base = torch.randn(max(args.sizes) // 4, generator=torch.Generator().manual_seed(rank))
    times = {c: {} for c in configs}              # config -> str(bytes) -> [seconds per rep]
    eng.barrier()
    codec_costs = _codec_costs(args.codecs)       # every rank at once: the cores are shared
    load, background = {}, {}
    for nbytes in args.sizes:
        eng.barrier()
        ticks0 = _machine_ticks()
        time.sleep(IDLE_PROBE_S)
        background[str(nbytes)] = _busy_cores(ticks0, _machine_ticks())
        buf = base[: max(1, nbytes // 4)]
        burst = [buf.clone() for _ in range(IN_FLIGHT)] if args.unmatched else []
        calls = inner_calls(nbytes)
        for config in configs:                    # warm-up: buffers, connections
            _allreduce(eng, config, buf, _name(config, nbytes), burst)
        progress(f"{nbytes} B warm-up")
        ticks0 = _machine_ticks()
        for rep in range(args.reps):
            for config in configs:
                seconds = _timed(eng, config, buf, _name(config, nbytes), calls, burst)
                times[config].setdefault(str(nbytes), []).append(seconds)
            progress(f"{nbytes} B rep {rep + 1}/{args.reps}")
        load[str(nbytes)] = _busy_cores(ticks0, _machine_ticks())
    message_s = [m for m in eng.allgather_object(_message_seconds(eng)) if m is not None]
    per_rank = eng.allgather_object(times)
    costs_per_rank = eng.allgather_object(codec_costs)
    raw = None
    if rank == 0:
        raw = {
            "format": FORMAT,
            "meta": {"engine": eng.name, "workers": size, "sizes": list(args.sizes),
                     "configs": configs, "reps": args.reps, "in_flight": IN_FLIGHT,
                     "inner_calls_up_to_bytes":
                     [SMALL_BYTES, INNER], "threads": args.threads, "dtype": "float32",
                     "op": "average", "cpu_count": os.cpu_count(), "versions": _versions(),
                     "machine_busy_cores": load, "background_busy_cores": background,
                     "codec_costs_s_per_byte": {c: _median_costs(costs_per_rank, c, COST_BYTES)
                                                for c in codec_costs},
                     "codec_costs_s_per_byte_by_block": {
                         c: {str(b): _median_costs(costs_per_rank, c, b) for b in COST_BLOCKS}
                         for c in codec_costs},
                     "message_s": sorted(message_s)[len(message_s) // 2] if message_s else None,
                     "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
            "times": per_rank,                    # [rank][config][bytes] -> seconds per rep
        }
        if args.out:
            tmp = f"{args.out}.tmp"
            with open(tmp, "w") as f:
                json.dump(raw, f)
            os.replace(tmp, args.out)
    eng.barrier()
    progress.write("done")
    engine.shutdown()
    return raw


def add_arguments(parser):
    """What the worker and `pipe-horovod bench-collectives` (which forwards it) accept."""
    from pipe_horovod.tools.validators import names, positive_int

    parser.add_argument("--algorithms", type=names(ALL_ALGORITHMS, "algorithm"),
                        default=list(ALGORITHMS),
                        help="comma-separated algorithms (default lp,ring,mst,be); "
                             f"{TWO_STAGE}: the two-stage quantized allreduce on the engine's "
                             f"alltoall and allgather, {TWO_STAGE_P2P}: point to point (what "
                             "the optimizer runs for CPU buckets with compression=int8/fp8 "
                             "and no collective=), both run with the codecs among --codecs "
                             "that have a wire format")
    parser.add_argument("--codecs", type=names(ALL_CODECS, "codec"), default=list(CODECS),
                        help="comma-separated codecs (default none,bf16,int8): per hop in "
                             f"lp/ring/mst/be, once per stage in {'/'.join(TWO_STAGES)}; "
                             f"{', '.join(FP8_CODECS)} run in those only")
    parser.add_argument("--reps", type=positive_int("reps"), default=5,
                        help="timed repetitions per size, configurations interleaved "
                             "(default 5)")
    parser.add_argument("--threads", type=positive_int("threads"), default=1,
                        help="torch threads per worker (default 1)")
    parser.add_argument("--unmatched", action="store_true",
                        help=f"also time {UNMATCHED}/none: a plain torch.distributed "
                             "all_reduce of the same tensors, without the engine's name "
                             f"matching, and both {IN_FLIGHT} in flight at once (--engine "
                             "torch only); the report shows what matching costs per "
                             "collective")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    parser.add_argument("--sizes", required=True,
                        type=lambda t: [int(x) for x in t.split(",")],
                        help="comma-separated message sizes in bytes")
    parser.add_argument("--out", help="raw JSON written by rank 0")
    parser.add_argument("--progress", help="progress file rank 0 keeps up to date")
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
