"""Issue 39, clean exits: rank 1's script raises (uncaught) while rank 0 waits for it.

Rank 1 raises a ValueError of its own after one collective; rank 0 waits in
the next one and raises, uncaught too, the StepMismatchError naming rank 1's
error. Each rank must exit with status 1 and a Python traceback (the
launcher may stop the last one first), never SIGABRT ("terminate called
without an active exception", which a negotiation thread of the torch
engine returning from torch while Python finalized used to cause). Each
rank prints "RAISING rank=<r> at <time>" before its error propagates.
"""
import time

import torch

import pipe_horovod.torch as hvd


def main():
    hvd.init()
    r = hvd.rank()
    hvd.allreduce(torch.ones(2), name="first")
    if r == 1:
        print(f"RAISING rank=1 at {time.time():.3f}", flush=True)
        raise ValueError("the data of rank 1 is broken")
    try:
        hvd.allreduce(torch.ones(2), name="second")
    finally:
        print(f"RAISING rank=0 at {time.time():.3f}", flush=True)


if __name__ == "__main__":
    main()
