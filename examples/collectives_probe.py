"""How long pipe_horovod.collectives take to allreduce one large gradient, per
algorithm and per-hop codec, beside the engine's own allreduce, on an emulated
capped cluster. A probe, not the full `bench-collectives` of issue 10. As root:

    python examples/collectives_probe.py [WORKERS] [RATE] [MB] [ENGINE]

It starts itself on WORKERS (default 2) workers in
`pipe_horovod.emulate.EmulatedCluster` (RATE default 1gbit, each link capped
both ways) and prints rank 0's median time (of 3, after one warm-up) for a
float32 tensor of MB megabytes (default 64), with the engine's prediction
from `pipe_horovod.timing` for the link rate alone (alpha = 0).
"""
import json
import os
import statistics
import sys
import time

CONFIGS = [("engine", "none"), ("ring", "none"), ("lp", "none"), ("mst", "none"),
           ("be", "none"), ("ring", "bf16"), ("lp", "bf16"), ("ring", "int8"), ("lp", "int8")]


def probe(mb):
    import torch

    from pipe_horovod import collectives, engine
    from pipe_horovod.compression import Compression

    torch.set_num_threads(1)
    eng = engine.init()
    x = torch.randn(int(mb * 2**20) // 4)
    results = {}
    for algorithm, codec in CONFIGS:
        times = []
        for i in range(4):
            t = x.clone()
            engine.barrier()
            t0 = time.perf_counter()
            if algorithm == "engine":
                engine.wait(engine.allreduce_async(t, f"own.{i}"))
            else:
                collectives.allreduce(t, f"{algorithm}.{codec}.{i}", collective=algorithm,
                                      compression=Compression.by_name(codec))
            times.append(time.perf_counter() - t0)
        results[f"{algorithm}/{codec}"] = statistics.median(times[1:])
    if eng.rank() == 0:
        print("RESULTS " + json.dumps(results), flush=True)
    engine.shutdown()


def main():
    from pipe_horovod import timing
    from pipe_horovod.emulate import EmulatedCluster, tail_file

    workers = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    rate = sys.argv[2] if len(sys.argv) > 2 else "1gbit"
    mb = float(sys.argv[3]) if len(sys.argv) > 3 else 64.0
    engine_name = sys.argv[4] if len(sys.argv) > 4 else "torch"
    with EmulatedCluster(workers=workers, rate=rate) as cluster:
        job = cluster.launch([sys.executable, os.path.abspath(__file__), "--probe", str(mb)],
                             engine=engine_name, timeout=590)
        cluster.wait(job)
        out = tail_file(job.logs[0], 200)
    results = json.loads(out.split("RESULTS ", 1)[1].splitlines()[0])
    net = timing.Network(alpha=0.0, beta=1 / timing.parse_bandwidth(rate))
    nbytes = mb * 2**20
    print(f"{workers} workers, {rate} links, {mb:g} MB float32, engine {engine_name}")
    print("| algorithm/codec | time (s) | vs engine | model, link rate only (s) |")
    print("|---|---|---|---|")
    for name, seconds in results.items():
        algorithm, codec = name.split("/")
        wire = nbytes * {"none": 1, "bf16": 0.5, "int8": 0.25}[codec]
        model = timing.allreduce_time(net, workers, wire, "ring" if algorithm == "engine"
                                      else algorithm, **({"chunks": 64} if algorithm == "lp"
                                                         else {}))
        print(f"| {name} | {seconds:.3f} | {results['engine/none'] / seconds:.2f}x | "
              f"{model:.3f} |")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--probe":
        probe(float(sys.argv[2]))
    else:
        main()
