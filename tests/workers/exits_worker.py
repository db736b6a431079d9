"""Clean exits: a script ends with an uncaught error of ours on some rank, and every
rank must still end.

Cases (argv[1], default "raise"), 2 ranks:
  raise    rank 1's script raises a ValueError of its own after one collective; rank 0,
           waiting in the next one, raises the StepMismatchError naming rank 1's error;
  complex  rank 1 allreduces a complex64 metric (our ValueError, uncaught), rank 0 a float;
  uneven   rank 1 allreduces 3 times, rank 0 5 times (run it with a short timeout);
  barrier  barrier() on rank 0, an allreduce on rank 1;
  loader   a DistributedOptimizer fed a DataLoader one batch short on rank 1;
  grouped  grouped_allreduce of 2 tensors on rank 0, 3 on rank 1.
Each rank must exit with status 1 and a Python traceback (the launcher may stop the
last one first), never SIGABRT ("terminate called without an active exception", which
a negotiation thread of the torch engine returning from torch while Python finalized
used to cause). Each rank prints "RAISING rank=<r> at <time>" before its error
propagates. tests/exits_loop.py runs every case many times under each launcher.
"""
import sys
import time

import torch

import pipe_horovod.torch as hvd


def main(case):
    hvd.init()
    r = hvd.rank()
    try:
        if case == "raise":
            hvd.allreduce(torch.ones(2), name="first")
            if r == 1:
                raise ValueError("the data of rank 1 is broken")
            hvd.allreduce(torch.ones(2), name="second")
        elif case == "complex":
            metric = torch.ones(2, dtype=(torch.float32, torch.complex64)[r])
            hvd.allreduce(metric, name="metric")
        elif case == "uneven":
            for i in range((5, 3)[r]):
                hvd.allreduce(torch.ones(1), name=f"s{i}")
        elif case == "barrier":
            if r == 0:
                hvd.barrier()
            else:
                hvd.allreduce(torch.ones(1), name="x")
        elif case == "loader":
            model = torch.nn.Linear(4, 1)
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters())
            for x in torch.utils.data.DataLoader(torch.ones(8 - 2 * r, 4), batch_size=2):
                opt.zero_grad()
                model(x).sum().backward()
                opt.step()
            opt.flush()
        elif case == "grouped":
            hvd.grouped_allreduce([torch.ones(2)] * (2 + r), name="g")
        else:
            raise SystemExit(f"unknown case {case!r}")
    finally:
        print(f"RAISING rank={r} at {time.time():.3f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "raise")
