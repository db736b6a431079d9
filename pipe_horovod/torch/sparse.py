"""Sparse gradients in the pipelined optimizer: which are reduced apart from the buckets.

An `nn.Embedding(sparse=True)` gives a sparse `.grad`. As in Horovod, each
rank sends only the rows it touched: the indices and values are
allgathered (the sum over ranks is their concatenation), unless
`sparse_as_dense=True`, which reduces them densely in the buckets and
makes them sparse again for the wrapped optimizer.

Which gradients are sparse is agreed once, at the first step: every rank
says which of its gradients were sparse and which dense (a model that
differs there raises on every rank); until then a sparse gradient sits in
its bucket as zeros and goes through the allgather instead.

A mixin of _PipelinedOptimizer (torch/optimizer.py). Its state:
`_sparse_as_dense`, `_sparse` (name -> sparse_dim, agreed by every rank),
`_seen_sparse` (this process's, until the agreement). It reads from the
optimizer: `_machine` (engine, size, prefix, slot), `_op`, `_process_set`,
`_param_of` (name -> parameter), `_order` (bucket order, names) and
`_order_agreed`.
"""
import functools

import torch

from .. import engine


class _SparseReduction:
    """One sparse gradient of one step: its indices and values allgathered, as Horovod does.

    Each rank sends only the rows it touched; the sum over ranks is the
    concatenation (duplicate indices add up when the optimizer coalesces).
    """

    __slots__ = ("name", "shape", "indices", "values", "scale", "result")

    def __init__(self, name, shape, indices, values, scale):
        self.name, self.shape, self.indices, self.values = name, shape, indices, values
        self.scale = scale                       # applied to the gathered values
        self.result = None

    def results(self):
        if self.result is None:
            values = engine.wait(self.values)
            indices = engine.wait(self.indices)
            if self.scale != 1.0:
                values = values * self.scale
            # Indices come from every rank's coalesced gradient: valid, no check needed.
            self.result = torch.sparse_coo_tensor(indices.t(), values, self.shape,
                                                  check_invariants=False)
            self.indices = self.values = None
        yield self.name, self.result


class _SparseGradients:
    """The sparse-gradient path of _PipelinedOptimizer (module docstring)."""

    def _setup_sparse(self, sparse_as_dense):
        self._sparse_as_dense = sparse_as_dense
        self._sparse = {}                        # name -> sparse_dim, agreed by every rank
        self._seen_sparse = {}                   # this process's, until the next agreement

    def _in_buckets(self, name):
        """Whether `name`'s gradient is reduced in a bucket (else: allgathered)."""
        return self._sparse_as_dense or name not in self._sparse

    def _bucket_sparse(self, name, grad, part):
        """A sparse `grad`'s place in its bucket, `part`: dense, or zeros before the
        agreement (that step allgathers it instead)."""
        self._seen_sparse[name] = grad.sparse_dim()
        if self._sparse_as_dense or self._order_agreed:
            part.copy_(grad.to_dense().reshape(-1))
        else:                                    # first step: reduced by _launch_sparse instead
            part.zero_()

    def _sparse_seen_here(self):
        """What this rank brings to the agreement: its sparse gradients (name ->
        sparse_dim) and the names of its dense ones."""
        dense = sorted(name for name, p in self._param_of.items()
                       if p.grad is not None and not p.grad.is_sparse)
        return self._seen_sparse, dense

    def _forget_seen_sparse(self):
        """Forget this process's sparse gradients not agreed yet (elastic's
        drop_in_flight: the step that saw them is dropped)."""
        self._seen_sparse = {}

    def _adopt_sparse(self, everyone):
        """Every rank's `_sparse_seen_here()`: check they agree, keep the union."""
        _check_sparse_agrees(everyone)
        for theirs, _ in everyone:
            self._sparse.update(theirs)
        self._seen_sparse = {}

    def _launch_sparse(self):
        """Allgather this step's sparse gradients (not in buckets), in the agreed order."""
        if self._sparse_as_dense:
            return []
        machine = self._machine
        scale = 1.0 / machine.size if self._op is engine.Average else 1.0
        gather = functools.partial(machine.engine.allgather_async, process_set=self._process_set)
        reductions = []
        for name in (n for n in self._order if n in self._sparse):
            p = self._param_of[name]
            grad = p.grad
            if grad is None:                     # unused on this rank: sends no rows
                sparse_dim = self._sparse[name]
                indices = torch.empty(0, sparse_dim, dtype=torch.int64, device=p.device)
                values = p.new_empty((0, *p.shape[sparse_dim:]))
            else:
                grad = grad.coalesce()
                indices, values = grad.indices().t().contiguous(), grad.values().contiguous()
            tag = f"{machine.prefix}.sparse.{name}.{machine.slot}"
            reductions.append(_SparseReduction(name, p.shape, gather(indices, f"{tag}.i"),
                                               gather(values, f"{tag}.v"), scale))
        return reductions

    def _sparse_again(self, name, grad, p):
        """A gradient reduced densely (sparse_as_dense) as `.grad`: sparse again, as
        Horovod does."""
        return grad.view_as(p).to_sparse(self._sparse[name])


def _check_sparse_agrees(everyone):
    """Raise on every rank if a parameter's gradient is sparse on one rank and dense on another
    (nn.Embedding(sparse=...) differing between ranks): they would be reduced differently."""
    sparse_on = {}
    for rank, (sparse, _) in enumerate(everyone):
        for name in sparse:
            sparse_on.setdefault(name, rank)
    for rank, (_, dense) in enumerate(everyone):
        for name in dense:
            if name in sparse_on:
                raise ValueError(
                    f"the gradient of {name!r} is sparse on rank {sparse_on[name]} but dense on "
                    f"rank {rank} (nn.Embedding(sparse=...) differs between ranks?); every rank "
                    "must build the same model, or pass sparse_as_dense=True")
