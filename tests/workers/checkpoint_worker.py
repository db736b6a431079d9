"""Checkpoint with gradients in flight, resumed in new processes: optimizer_worker.py's
cases MODE-KIND-DEPTH-COMPENSATION (KIND sgd or adam, COMPENSATION `none` or an option),
their files in a folder: the checkpoint `save-KIND-DEPTH-COMPENSATION.ckpt`, the final
weights `CASE.pt`.

`save`: 7 steps, rank 0 alone saves model + optimizer state,
then the run goes on uninterrupted to 20 steps and rank 0 saves the final
weights (saving mid-run and carrying on, as users do, must not change them).
`resume`: a later launch (new processes), every rank loads it, trains steps 7..19.
`resume-rank0`: Horovod's own resume pattern
(pytorch_imagenet_resnet50.py): rank 0 alone loads the checkpoint, then
every rank calls broadcast_parameters and broadcast_optimizer_state.
The test compares the final weights bit for bit.

Under `lookahead` each rank predicts its next point from its own gradient of the
step in flight, which rank 0's checkpoint holds only for rank 0: there `save` gives
every rank rank 0's optimizer state (that kept gradient) at step 7, which is exactly
what a resume from rank 0's checkpoint does.
"""
import torch

from optimizer_worker import MLP, data_for, fresh, train
import pipe_horovod.torch as phvd

STEPS, SAVE_AT = 20, 7


def build(kind, depth, compensation):
    model = fresh(MLP)
    base = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if kind == "sgd"
            else torch.optim.Adam(model.parameters(), lr=0.01))
    opt = phvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                    pipeline_depth=depth, warmup_steps=2,
                                    staleness_compensation=compensation)
    return model, opt


def check(mode, kind, depth, compensation, folder):
    ckpt_path = folder / f"save-{kind}-{depth}-{compensation}.ckpt"
    out_path = folder / f"{mode}-{kind}-{depth}-{compensation}.pt"
    compensation = None if compensation == "none" else compensation
    model, opt = build(kind, depth, compensation)
    if mode == "save":
        train(model, opt, data_for(), steps=SAVE_AT)
        assert len(opt._fifo) == depth - 1, "the checkpoint must hold the gradients in flight"
        if phvd.rank() == 0:                     # as users write it: rank 0 only
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, ckpt_path)
        phvd.barrier()
        if compensation == "lookahead":
            phvd.broadcast_optimizer_state(opt, root_rank=0)
        train(model, opt, data_for(), steps=STEPS, start=SAVE_AT)
    elif mode in ("resume", "resume-rank0"):
        if mode == "resume" or phvd.rank() == 0:
            ckpt = torch.load(ckpt_path, weights_only=False)
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["opt"])
        if mode == "resume-rank0":
            phvd.broadcast_parameters(model.state_dict(), root_rank=0)
            phvd.broadcast_optimizer_state(opt, root_rank=0)
        train(model, opt, data_for(), steps=STEPS, start=SAVE_AT)
    else:
        raise ValueError(f"unknown checkpoint mode {mode!r}")
    opt.flush()
    if phvd.rank() == 0:
        torch.save(model.state_dict(), out_path)
    phvd.barrier()                               # the file is there before the case is OK
