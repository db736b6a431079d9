"""A Horovod loop as users write it: no flush(), no shutdown(), a slower rank
(optimizer_worker.py's case no-flush-DEPTH, the last of its launch, which then ends
without shutdown() as a script does).

At exit the faster rank still has its last reductions in flight; the slower
one has not started them yet. Both must exit cleanly, and rank 0 must warn
that the gradients still in the pipeline were not applied.
"""
import time

import torch
import torch.nn.functional as F

from optimizer_worker import MLP, data_for, fresh
import pipe_horovod.torch as hvd

_left = []          # the optimizer lives on to the exit, as in a script


def check(depth):
    model = fresh(MLP)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(),
                                         pipeline_depth=depth)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    for step in range(5):
        if hvd.rank() == 1 and step == 4:
            time.sleep(2)                            # rank 0 reaches exit first
        optimizer.zero_grad()
        for x, y in data_for()(hvd.rank(), step):
            F.cross_entropy(model(x), y).backward()
        optimizer.step()
    _left.append(optimizer)
