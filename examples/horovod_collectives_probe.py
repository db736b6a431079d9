"""How fast Horovod's gloo collectives move bytes on an emulated 1gbit cluster.

Why it exists: the horovod engine sends bfloat16 as an alltoall plus an
allgather (Horovod 0.28.1 cannot reduce bfloat16), and those two collectives
measured at about half the link rate where allreduce reaches it. Run as root:

    python examples/horovod_collectives_probe.py [RATE]

It starts itself on 2 workers in `pipe_horovod.tools.emulate.EmulatedCluster` and
prints rank 0's median times (5 of 7 repetitions) for a 3.125 M-element
gradient: float32 allreduce, the two halves of the bf16 path, and fp16.
"""
import os
import statistics
import sys
import time

N = 3_125_000


def probe():
    import horovod.torch as hvd
    import torch

    hvd.init()
    torch.set_num_threads(1)
    x = torch.randn(N)
    bits = x.to(torch.bfloat16).view(torch.int16)
    shard = bits[: N // 2].clone()

    def median_ms(op, reps=7):
        times = []
        for i in range(reps):
            t0 = time.perf_counter()
            op(i)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[2:]) * 1e3

    results = {
        "allreduce float32, 12.5 MB": median_ms(lambda i: hvd.allreduce(x, name=f"a{i}")),
        "alltoall int16, 6.25 MB": median_ms(
            lambda i: hvd.alltoall(bits, splits=[N // 2, N - N // 2], name=f"b{i}")),
        "allgather int16, 3.1 MB per rank": median_ms(lambda i: hvd.allgather(shard, name=f"c{i}")),
        "allreduce float16, 6.25 MB": median_ms(lambda i: hvd.allreduce(x.half(), name=f"d{i}")),
    }
    if hvd.rank() == 0:
        for what, ms in results.items():
            print(f"{what}: {ms:.1f} ms", flush=True)
    hvd.shutdown()


def main():
    from pipe_horovod.tools.emulate import EmulatedCluster, tail_file

    rate = sys.argv[1] if len(sys.argv) > 1 else "1gbit"
    with EmulatedCluster(workers=2, rate=rate) as cluster:
        job = cluster.launch([sys.executable, os.path.abspath(__file__)], engine="horovod",
                             timeout=240)
        cluster.wait(job)
        print(tail_file(job.logs[0], 10))


if __name__ == "__main__":
    probe() if "HOROVOD_RANK" in os.environ else main()
