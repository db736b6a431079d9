"""Ranks that build different models must all get the same clear error, not a hang."""
import sys

import torch

import pipe_horovod.torch as phvd


def main():
    phvd.init()
    rank, what = phvd.rank(), sys.argv[1]
    width = 5 if (what == "shape" and rank == 1) else 4
    model = torch.nn.Sequential(torch.nn.Linear(3, width))
    if what == "dtype" and rank == 1:
        model = model.double()
    named = list(model.named_parameters())
    if what == "names" and rank == 1:
        named = [("renamed." + n, p) for n, p in named]
    depth = 3 if (what == "options" and rank == 1) else 2
    try:
        phvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=named, pipeline_depth=depth)
    except ValueError as exc:
        assert "differs between ranks" in str(exc) and "rank 1" in str(exc), exc
        print(f"raised: {exc}", flush=True)
    else:
        raise AssertionError("models differ between ranks but no error was raised")
    print(f"WORKER_OK rank={rank}", flush=True)


if __name__ == "__main__":
    main()
