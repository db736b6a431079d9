"""pipeline_depth=1 against Horovod's own DistributedOptimizer on the same data."""
import copy

import horovod.torch as hvd
import torch

from optimizer_worker import MLP, assert_close, data_for, fresh, train
import pipe_horovod.torch as phvd


def check():
    """optimizer_worker's `horovod-compare` case; the horovod engine initialized hvd too."""
    for kind in ("sgd", "adam"):
        ours = fresh(MLP)
        theirs = copy.deepcopy(ours)
        make = ((lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)) if kind == "sgd"
                else (lambda m: torch.optim.Adam(m.parameters(), lr=0.01)))
        opt = phvd.DistributedOptimizer(make(ours), named_parameters=ours.named_parameters(),
                                        pipeline_depth=1, bucket_cap_mb=0.0005)
        hopt = hvd.DistributedOptimizer(make(theirs), named_parameters=theirs.named_parameters())
        train(ours, opt, data_for())
        train(theirs, hopt, data_for())
        assert len(opt._buckets) > 1, "several buckets: overlap bucket by bucket"
        assert_close(ours, theirs, f"K=1 vs hvd.DistributedOptimizer ({kind})")
