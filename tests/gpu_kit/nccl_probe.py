"""The GPU kit's record of what NCCL says when two ranks share one GPU.

One allreduce of a CUDA tensor on cuda:0 from every rank, through torch.distributed's
NCCL backend (`torchrun`: --engine torch) or Horovod's NCCL ops (`horovodrun`: --engine
horovod). NCCL wants one GPU per rank, so an error (or a hang, which the step's time limit
ends) is the expected outcome; the step records the words. Prints `NCCL_PROBE ok <sum>`
or `NCCL_PROBE error <type>: <first line>` per rank.
"""
import argparse
import sys

import torch


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("torch", "horovod"), required=True)
    args = parser.parse_args(argv)
    rank = "?"
    try:
        x = torch.ones(1024, device="cuda:0")
        if args.engine == "torch":
            import torch.distributed as dist

            dist.init_process_group("nccl", device_id=torch.device("cuda:0"))
            rank = dist.get_rank()
            dist.all_reduce(x)
            torch.cuda.synchronize()
            dist.destroy_process_group()
        else:
            import horovod.torch as hvd

            hvd.init()
            rank = hvd.rank()
            x = hvd.allreduce(x, op=hvd.Sum, name="probe")
            hvd.shutdown()
        print(f"NCCL_PROBE ok rank={rank} sum={float(x[0])}", flush=True)
        return 0
    except Exception as exc:  # noqa: BLE001 - the words are the result
        first = (str(exc).strip().splitlines() or [""])[0]
        print(f"NCCL_PROBE error rank={rank} {type(exc).__name__}: {first}", flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
