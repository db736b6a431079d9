"""Sparse gradients (nn.Embedding(sparse=True)) on N ranks against the oracle
(optimizer_worker.py's `sparse` case).

Each rank looks up its own rows; rank 0 alone uses the second embedding, so
other ranks have no gradient for it at all. Covers the allgather path and
sparse_as_dense, with SGD over everything and with SparseAdam + Adam as two
wrapped optimizers (how sparse models are trained).
"""
import copy
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import oracle  # noqa: E402
from optimizer_worker import STEPS, assert_close, train  # noqa: E402
import pipe_horovod.torch as phvd  # noqa: E402


class Bag(nn.Module):
    def __init__(self, use_extra):
        super().__init__()
        self.emb = nn.Embedding(30, 4, sparse=True)
        self.extra = nn.Embedding(30, 4, sparse=True)
        self.fc = nn.Linear(4, 3)
        self.use_extra = use_extra

    def forward(self, ids):
        h = self.emb(ids).mean(1)
        if self.use_extra:
            h = h + self.extra(ids).mean(1)
        return self.fc(h)


def data(rank, step):
    g = torch.Generator().manual_seed(31 * rank + step)
    return [(torch.randint(0, 30, (5, 3), generator=g), torch.randint(0, 3, (5,), generator=g))]


def check(depth, sparse_as_dense, two_optimizers):
    size, rank = phvd.size(), phvd.rank()
    torch.manual_seed(0)
    model = Bag(use_extra=(rank == 0))
    ref = copy.deepcopy(model)
    ref.use_extra = True

    def optimizers(m):
        if two_optimizers:
            return [torch.optim.SparseAdam([m.emb.weight, m.extra.weight], lr=0.05),
                    torch.optim.Adam(m.fc.parameters(), lr=0.05)]
        return [torch.optim.SGD(m.parameters(), lr=0.5)]

    opts = [phvd.DistributedOptimizer(o, named_parameters=model.named_parameters(),
                                      pipeline_depth=depth, sparse_as_dense=sparse_as_dense,
                                      staleness_compensation=None)
            for o in optimizers(model)]

    class Both:                                  # one step() for the training loop
        def zero_grad(self):
            for o in opts:
                o.zero_grad()

        def step(self):
            for o in opts:
                o.step()

    train(model, Both(), data)
    for o in opts:
        o.flush()
    ref_opts = optimizers(ref)

    class RefBoth:
        def step(self):
            for o in ref_opts:
                o.step()

    def ref_data(r, t):
        ref.use_extra = (r == 0)
        return data(r, t)
    oracle.reference(ref, RefBoth(), F.cross_entropy, ref_data, size, STEPS, depth, 0)
    what = f"K={depth} sparse_as_dense={sparse_as_dense} two_optimizers={two_optimizers}"
    assert_close(model, ref, what)
    weights = [p.detach().clone() for p in model.parameters()]
    for theirs in phvd.allgather_object(weights):
        assert all(torch.equal(a, b) for a, b in zip(theirs, weights)), f"{what}: replicas differ"


def check_all():
    """Every combination; optimizer_worker's `sparse` case."""
    for depth in (1, 2):
        for sparse_as_dense in (False, True):
            for two in (False, True):
                check(depth, sparse_as_dense, two)
