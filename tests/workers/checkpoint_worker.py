"""Checkpoint with gradients in flight, resumed in new processes.

`full OUT`: 20 steps uninterrupted, rank 0 saves the final weights.
`save CKPT`: 7 steps, rank 0 alone saves model + optimizer state.
`resume CKPT OUT`: new processes load it and train steps 7..19.
The test compares the two OUT files bit for bit.
"""
import sys

import torch
import torch.nn.functional as F

from optimizer_worker import MLP, data_for, fresh, train
import pipe_horovod.torch as phvd

STEPS, SAVE_AT = 20, 7


def build(kind):
    model = fresh(MLP)
    base = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if kind == "sgd"
            else torch.optim.Adam(model.parameters(), lr=0.01))
    opt = phvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                    pipeline_depth=3, warmup_steps=2)
    return model, opt


def main():
    phvd.init()
    mode, kind, path = sys.argv[1], sys.argv[2], sys.argv[3]
    model, opt = build(kind)
    if mode == "full":
        train(model, opt, data_for(), steps=STEPS)
    elif mode == "save":
        train(model, opt, data_for(), steps=SAVE_AT)
        assert len(opt._fifo) == 2, "the checkpoint must be taken with gradients in flight"
        if phvd.rank() == 0:                     # as users write it: rank 0 only
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
        phvd.barrier()
    elif mode == "resume":
        ckpt = torch.load(path, weights_only=False)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        train(model, opt, data_for(), steps=STEPS, start=SAVE_AT)
        path = sys.argv[4]
    if mode != "save":
        opt.flush()
        if phvd.rank() == 0:
            torch.save(model.state_dict(), path)
    print(f"WORKER_OK rank={phvd.rank()}", flush=True)
    phvd.shutdown()


if __name__ == "__main__":
    main()
