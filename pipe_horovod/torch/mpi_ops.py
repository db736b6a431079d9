"""Horovod's collective API (`horovod.torch.mpi_ops`) on whichever engine runs.

Names, signatures, positional order, defaults and documented behaviour are
Horovod 0.28.1's, so a script switches by changing its import. Each
function checks its arguments, starts the engine's operation and, for the
synchronous ones, waits for it; `*_async` functions return a handle for
`poll` and `synchronize`. The autograd Functions give allreduce, allgather,
broadcast, alltoall and reducescatter the backward passes Horovod defines,
including its conventions (allgather's and broadcast's backward average
the incoming gradients over ranks; reducescatter's multiplies a Sum's by
the set's size).

Start, identity, build queries, process sets, barrier, join and the object
collectives are pipe_horovod.common's, re-exported here under Horovod's
names (the TensorFlow and Keras adapters re-export the same functions); the
tensor collectives' math is common.tensor_ops, which the autograd Functions
run forward.

Unnamed operations get names the engine counts per kind, which agree
across ranks that start them in the same order (Horovod's own rule).
Under the horovod engine every call reaches `horovod.torch`; see
pipe_horovod/engine/ for what the torch and local engines do instead.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, List, Optional, Sequence, Union

import torch

from .. import engine as _engine
from ..collectives import quantized
from ..common import tensor_ops
from ..common.basics import (ccl_built, cross_rank, cross_size, cuda_built, ddl_built,
                             gloo_built, gloo_enabled, init, is_homogeneous, is_initialized,
                             local_rank, local_size, mpi_built, mpi_enabled,
                             mpi_threads_supported, nccl_built, rank, rocm_built, shutdown, size,
                             start_timeline, stop_timeline)
from ..common.exceptions import HorovodInternalError
from ..common.objects import allgather_object, barrier, broadcast_object, join
from ..common.process_sets import (ProcessSet, add_process_set, global_process_set,
                                   remove_process_set)
from ..common.tensor_ops import reducescatter_grad_factor
from ..compression import Compression, wire_format
from ..engine import Adasum, Average, Handle, Max, Min, Product, ReduceOp, Sum


def _current():
    return _engine.current()


# --- arguments -----------------------------------------------------------------
def _op(op, average):
    """Horovod's rule for the legacy `average=` argument next to `op=`."""
    if op is not None:
        if average is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of them.")
        return op
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in v1.0",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    return Average


def _checked(tensor, what):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} expects a torch.Tensor, got {type(tensor).__name__}")
    return tensor


def _tensor(tensor, what):
    """`tensor` without autograd history: engines write into it in place."""
    return _checked(tensor, what).detach()


def _copy(tensor, what):
    """A contiguous copy for an out-of-place operation (engines work in place)."""
    tensor = _tensor(tensor, what)
    if tensor.layout != torch.strided:
        return tensor                       # the engine names the problem
    return tensor.clone(memory_format=torch.contiguous_format)


def _source(tensor, what):
    """The input of an operation that does not write to it, made contiguous."""
    tensor = _tensor(tensor, what)
    return tensor.contiguous() if tensor.layout == torch.strided else tensor


def _tensors(tensors, what):
    if isinstance(tensors, torch.Tensor) or not hasattr(tensors, "__iter__"):
        raise TypeError(f"{what} expects a list of tensors, got {type(tensors).__name__}")
    return list(tensors)


# --- completion ----------------------------------------------------------------
def poll(handle: Union[Handle, Callable[[], torch.Tensor]]) -> bool:
    """Whether an `*_async` operation has finished, without waiting for it.

    Why: a training loop can do other work while a reduction runs and only
    block (synchronize) when the result is needed.

    Args:
        handle: what an `*_async` function returned.

    Returns:
        True when `synchronize(handle)` would return without blocking.
    """
    return _current().poll(handle)


def synchronize(handle: Union[Handle, Callable[[], torch.Tensor]]) -> Any:
    """Wait for an `*_async` operation and return its result.

    Args:
        handle: what an `*_async` function returned; each handle is synchronized once.

    Returns:
        The operation's result: the reduced, gathered or broadcast tensor (a list
        for the grouped operations, (output, received_splits) for alltoall).

    Raises:
        HorovodInternalError: the collective failed, as Horovod raises it, so elastic
            training and Horovod-style retry loops catch it; its subclasses
            RankLostError (a peer died) and WaitTimeoutError (no result within
            init(timeout=...)) say which.
    """
    if callable(handle) and not isinstance(handle, Handle):
        return handle()                     # sparse_allreduce_async's handle
    return tensor_ops.wait(handle)


# --- allreduce -----------------------------------------------------------------
def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None,
                    name: Optional[str] = None, op: Optional[ReduceOp] = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start reducing a copy of `tensor` across ranks, and return at once.

    Why async: the reduction runs while this rank computes; pipe_horovod's
    optimizer is built on exactly this overlap.

    Args:
        tensor: the tensor to reduce; its dtype and shape must match on every rank.
        average: Horovod's deprecated flag (True: Average, False: Sum); use `op`.
        name: a name that matches the operation across ranks; None: one counted
            per kind, which agrees where every rank starts the same operations in
            the same order.
        op: Average (the default), Sum, Adasum, Min, Max or Product.
        prescale_factor, postscale_factor: multiply the input before and the
            result after the reduction (Horovod's way to split an average).
        process_set: the ranks that take part; every one of them must call it.

    Returns:
        A handle for poll() and synchronize(), which returns the reduced copy
        (the input is not modified).

    Raises:
        TypeError, ValueError: a bad argument (not a tensor, an op the engine cannot
            run, `average` and `op` both given), on this rank, before anything is sent.
    """
    return _current().allreduce_async(
        _copy(tensor, "allreduce_async"), name, _op(op, average), process_set=process_set,
        prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None,
                     name: Optional[str] = None, op: Optional[ReduceOp] = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Start reducing `tensor` in place: no copy, for large buffers.

    Args:
        tensor, average, name, op, prescale_factor, postscale_factor, process_set:
            as for allreduce_async; `tensor` is overwritten with the result.

    Returns:
        A handle for poll() and synchronize(), which returns `tensor`.

    Raises:
        TypeError, ValueError: as for allreduce_async.
    """
    return _current().allreduce_async(
        _tensor(tensor, "allreduce_async_"), name, _op(op, average), process_set=process_set,
        prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None,
               name: Optional[str] = None, op: Optional[ReduceOp] = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce `tensor` in place and return it (allreduce_async_ then synchronize).

    Args:
        tensor, average, name, op, prescale_factor, postscale_factor, process_set:
            as for allreduce_async.

    Returns:
        `tensor`, now holding the result.

    Raises:
        TypeError, ValueError: as for allreduce_async; HorovodInternalError as for
            synchronize.
    """
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


class _Allreduce(torch.autograd.Function):
    """Backward: the same reduction of the incoming gradient (Horovod's definition)."""

    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor, process_set):
        ctx.options = dict(op=op, prescale_factor=prescale_factor,
                           postscale_factor=postscale_factor, process_set=process_set)
        return tensor_ops.allreduce(tensor, name, **ctx.options)

    @staticmethod
    def backward(ctx, grad_output):
        return (allreduce(grad_output, **ctx.options),) + (None,) * 5


class _QuantizedAllreduce(torch.autograd.Function):
    """A codec that quantizes inside the reduction (int8, fp8): two stages on the engine's
    alltoall and allgather (collectives/quantized.py); backward: the same reduction of the
    incoming gradient."""

    @staticmethod
    def forward(ctx, tensor, name, op, fmt, prescale_factor, postscale_factor, process_set):
        ctx.options = dict(op=op, fmt=fmt, prescale_factor=prescale_factor,
                           postscale_factor=postscale_factor, process_set=process_set)
        return quantized.allreduce(tensor.detach().clone(), name, **ctx.options)

    @staticmethod
    def backward(ctx, grad_output):
        return (quantized.allreduce(grad_output.clone(), None, **ctx.options),) + (None,) * 6


def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression: Any = Compression.none, op: Optional[ReduceOp] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """The reduction of `tensor` across ranks, as a new tensor.

    Differentiable, with Horovod's backward (the same reduction of the incoming
    gradient), so it can sit inside a model, e.g. to average a statistic.

    Args:
        tensor, average, name, op, prescale_factor, postscale_factor, process_set:
            as for allreduce_async.
        compression: a Compression codec applied to what travels (Compression.fp16
            halves the bytes); the result has `tensor`'s dtype again. int8 and fp8
            quantize inside the reduction, in two stages (Average or Sum; no error
            feedback here: `int8_ef` reduces as `int8`).

    Returns:
        A new tensor holding the result; `tensor` is not modified.

    Raises:
        TypeError, ValueError: as for allreduce_async; HorovodInternalError as for
            synchronize.
    """
    op = _op(op, average)
    _checked(tensor, "allreduce")
    fmt = wire_format(compression)
    if fmt is not None:
        return _QuantizedAllreduce.apply(tensor, name, op, fmt, prescale_factor,
                                         postscale_factor, process_set)
    wire, ctx = compression.compress(tensor)
    reduced = _Allreduce.apply(wire, name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(reduced, ctx)


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                            name: Optional[str] = None, op: Optional[ReduceOp] = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> Handle:
    """Start reducing copies of a list of tensors as one operation.

    Why grouped: one negotiation and one fused transfer for many small
    tensors, where one allreduce each would pay the latency each time.

    Args:
        tensors: the tensors to reduce (not modified).
        average, name, op, prescale_factor, postscale_factor, process_set: as for
            allreduce_async; `name` names the group.

    Returns:
        A handle; synchronize() returns the list of reduced copies.

    Raises:
        TypeError: `tensors` is one tensor or not iterable; else as allreduce_async.
    """
    copies = [_copy(t, "grouped_allreduce_async") for t in _tensors(tensors, "grouped_allreduce")]
    return _current().grouped_allreduce_async(
        copies, name, _op(op, average), process_set=process_set,
        prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                             name: Optional[str] = None, op: Optional[ReduceOp] = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> Handle:
    """Start reducing a list of tensors in place as one operation.

    Args:
        tensors, average, name, op, prescale_factor, postscale_factor, process_set:
            as for grouped_allreduce_async; each tensor is overwritten.

    Returns:
        A handle; synchronize() returns `tensors`.

    Raises:
        As grouped_allreduce_async.
    """
    tensors = [_tensor(t, "grouped_allreduce_async_")
               for t in _tensors(tensors, "grouped_allreduce_async_")]
    return _current().grouped_allreduce_async(
        tensors, name, _op(op, average), process_set=process_set,
        prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                       name: Optional[str] = None, op: Optional[ReduceOp] = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> List[torch.Tensor]:
    """Reduce a list of tensors in place as one operation and return them.

    Args:
        tensors, average, name, op, prescale_factor, postscale_factor, process_set:
            as for grouped_allreduce_async.

    Returns:
        `tensors`, now holding the results.

    Raises:
        As grouped_allreduce_async, and HorovodInternalError as for synchronize.
    """
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.options = dict(op=op, prescale_factor=prescale_factor,
                           postscale_factor=postscale_factor, process_set=process_set)
        return tuple(tensor_ops.grouped_allreduce(list(tensors), name, **ctx.options))

    @staticmethod
    def backward(ctx, *grad_outputs):
        return (None,) * 5 + tuple(grouped_allreduce(list(grad_outputs), **ctx.options))


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                      name: Optional[str] = None, compression: Any = Compression.none,
                      op: Optional[ReduceOp] = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> List[torch.Tensor]:
    """Reductions of a list of tensors, as new tensors; differentiable like allreduce.

    Args:
        tensors, average, name, op, prescale_factor, postscale_factor, process_set:
            as for grouped_allreduce_async.
        compression: as for allreduce, applied to each tensor.

    Returns:
        A list of new tensors, in the order of `tensors`.

    Raises:
        As grouped_allreduce_async, and HorovodInternalError as for synchronize.
    """
    op = _op(op, average)
    pairs = [compression.compress(_checked(t, "grouped_allreduce"))
             for t in _tensors(tensors, "grouped_allreduce")]
    reduced = _GroupedAllreduce.apply(name, op, prescale_factor, postscale_factor, process_set,
                                      *[wire for wire, _ in pairs])
    return [compression.decompress(t, ctx) for t, (_, ctx) in zip(reduced, pairs)]


def sparse_allreduce_async(tensor: torch.Tensor, name: Optional[str], op: ReduceOp,
                           process_set: ProcessSet = global_process_set
                           ) -> Callable[[], torch.Tensor]:
    """Start reducing a sparse COO tensor by allgathering its indices and values.

    Why not allreduce: ranks touch different rows (embeddings), so the sum of
    sparse tensors is their concatenation, which costs what was touched, not
    the whole table.

    Args:
        tensor: a sparse COO tensor of the same size on every rank.
        name: names the two allgathers (".indices", ".values"); None: counted names.
        op: Average divides the values by the set's size; Sum keeps them.
        process_set: as for allreduce_async.

    Returns:
        A callable handle: synchronize(handle), or handle(), returns the reduced
        sparse tensor (uncoalesced: indices may repeat).

    Raises:
        TypeError: `tensor` is not a sparse COO tensor.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        raise TypeError(f"sparse_allreduce_async expects a sparse COO tensor, got {tensor!r}")
    indices_name, values_name = (None, None) if name is None else (f"{name}.indices",
                                                                   f"{name}.values")
    # allgather concatenates rows: indices go as (nnz, ndim) and come back transposed.
    indices = allgather_async(tensor._indices().t().contiguous(), indices_name, process_set)
    values = allgather_async(tensor._values(), values_name, process_set)

    def handle():
        all_values = synchronize(values)
        all_indices = synchronize(indices)
        if op is Average:
            all_values = all_values / process_set.size()
        return torch.sparse_coo_tensor(all_indices.t(), all_values, tensor.size())

    return handle


# --- allgather -----------------------------------------------------------------
def allgather_async(tensor: torch.Tensor, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start concatenating every rank's `tensor` along dimension 0.

    Args:
        tensor, name, process_set: as for allgather (`tensor` is not modified).

    Returns:
        A handle; synchronize() returns the concatenated tensor.

    Raises:
        TypeError, ValueError: as for allgather, before anything is sent.
    """
    return _current().allgather_async(_source(tensor, "allgather_async"), name,
                                      process_set=process_set)


class _Allgather(torch.autograd.Function):
    """Backward: average the gradient over ranks, keep this rank's rows (Horovod's)."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        out = tensor_ops.allgather(tensor, name, process_set)
        ctx.rows, ctx.process_set = tensor.shape[0], process_set
        return out

    @staticmethod
    def backward(ctx, grad_output):
        grad = allreduce(grad_output, op=Average, process_set=ctx.process_set)
        rows = allgather(torch.tensor([ctx.rows], dtype=torch.int32), process_set=ctx.process_set)
        offset = int(rows[:ctx.process_set.rank()].sum())
        return grad.narrow(0, offset, ctx.rows), None, None


def allgather(tensor: torch.Tensor, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Every rank's `tensor` concatenated along dimension 0, in rank order.

    Differentiable: backward averages the gradient over ranks and keeps this
    rank's rows (Horovod's definition).

    Args:
        tensor: this rank's rows; the first dimension may differ between ranks, the
            others and the dtype must not.
        name, process_set: as for allreduce_async.

    Returns:
        A new tensor with the rows of every rank of `process_set`.

    Raises:
        TypeError, ValueError: not a tensor, or shapes or dtypes that differ between
            ranks beyond the first dimension; HorovodInternalError as for synchronize.
    """
    _checked(tensor, "allgather")
    return _Allgather.apply(tensor, name, process_set)


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                            process_set: ProcessSet = global_process_set) -> Handle:
    """Start allgathering a list of tensors as one operation (one negotiation).

    Args:
        tensors: this rank's rows of each; name, process_set: as for allgather.

    Returns:
        A handle; synchronize() returns the list of concatenated tensors.

    Raises:
        TypeError: `tensors` is one tensor or not iterable; else as allgather.
    """
    sources = [_source(t, "grouped_allgather_async")
               for t in _tensors(tensors, "grouped_allgather_async")]
    return _current().grouped_allgather_async(sources, name, process_set=process_set)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        out = synchronize(grouped_allgather_async(list(tensors), name, process_set))
        ctx.rows, ctx.process_set = [t.shape[0] for t in tensors], process_set
        return tuple(out)

    @staticmethod
    def backward(ctx, *grad_outputs):
        grads = grouped_allreduce(list(grad_outputs), op=Average, process_set=ctx.process_set)
        counts = grouped_allgather([torch.tensor([n], dtype=torch.int32) for n in ctx.rows],
                                   process_set=ctx.process_set)
        me = ctx.process_set.rank()
        return (None, None) + tuple(g.narrow(0, int(c[:me].sum()), n)
                                    for g, c, n in zip(grads, counts, ctx.rows))


def grouped_allgather(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                      process_set: ProcessSet = global_process_set) -> List[torch.Tensor]:
    """Allgather of each tensor of a list, as one operation; differentiable like allgather.

    Args:
        tensors, name, process_set: as for grouped_allgather_async.

    Returns:
        A list of new tensors, in the order of `tensors`.

    Raises:
        As grouped_allgather_async, and HorovodInternalError as for synchronize.
    """
    tensors = [_checked(t, "grouped_allgather")
               for t in _tensors(tensors, "grouped_allgather")]
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


# --- broadcast -----------------------------------------------------------------
def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start broadcasting global rank `root_rank`'s value into a copy of `tensor`.

    Args:
        tensor, root_rank, name, process_set: as for broadcast (`tensor` is not
            modified).

    Returns:
        A handle; synchronize() returns the copy holding root's value.

    Raises:
        TypeError, ValueError: as for broadcast, before anything is sent.
    """
    return _current().broadcast_async(_copy(tensor, "broadcast_async"), root_rank, name,
                                      process_set=process_set)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Start broadcasting root's value into `tensor` in place (no copy).

    Args:
        tensor, root_rank, name, process_set: as for broadcast.

    Returns:
        A handle; synchronize() returns `tensor`.

    Raises:
        TypeError, ValueError: as for broadcast, before anything is sent.
    """
    return _current().broadcast_async(_tensor(tensor, "broadcast_async_"), root_rank, name,
                                      process_set=process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Overwrite `tensor` with root's value and return it (no copy).

    Args:
        tensor, root_rank, name, process_set: as for broadcast.

    Returns:
        `tensor`, now holding root's value.

    Raises:
        As broadcast.
    """
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class _Broadcast(torch.autograd.Function):
    """Backward: the averaged gradient on the root, zero elsewhere (Horovod's)."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return tensor_ops.broadcast(tensor, root_rank, name, process_set)

    @staticmethod
    def backward(ctx, grad_output):
        grad = allreduce(grad_output, op=Average, process_set=ctx.process_set)
        if rank() != ctx.root_rank:
            grad = grad * 0
        return grad, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Root's `tensor`, as a new tensor on every rank.

    Differentiable: backward gives root the gradient averaged over ranks and
    the others zero (Horovod's definition).

    Args:
        tensor: root's value; on the other ranks a tensor of the same shape and
            dtype, whose values are ignored.
        root_rank: the global rank whose value everyone receives.
        name, process_set: as for allreduce_async.

    Returns:
        A new tensor holding root's value; `tensor` is not modified.

    Raises:
        TypeError, ValueError: not a tensor, or a root outside `process_set`;
            HorovodInternalError as for synchronize.
    """
    _checked(tensor, "broadcast")
    return _Broadcast.apply(tensor, root_rank, name, process_set)


# --- alltoall ------------------------------------------------------------------
def alltoall_async(tensor: torch.Tensor, splits: Union[torch.Tensor, Sequence[int], None] = None,
                   name: Optional[str] = None,
                   process_set: ProcessSet = global_process_set) -> Handle:
    """Start an alltoall.

    Args:
        tensor, splits, name, process_set: as for alltoall.

    Returns:
        A handle; synchronize() returns (output, received_splits).

    Raises:
        TypeError, ValueError: as for alltoall, before anything is sent.
    """
    return _current().alltoall_async(_source(tensor, "alltoall_async"), splits, name,
                                     process_set=process_set)


class _Alltoall(torch.autograd.Function):
    """Backward: the gradient goes back along the received splits (Horovod's)."""

    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        output, received = tensor_ops.alltoall(tensor, splits, name, process_set)
        ctx.received, ctx.process_set = received, process_set
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad_output, *_):
        grad, _ = alltoall(grad_output, splits=ctx.received, process_set=ctx.process_set)
        return grad, None, None, None


def alltoall(tensor: torch.Tensor, splits: Union[torch.Tensor, Sequence[int], None] = None,
             name: Optional[str] = None, process_set: ProcessSet = global_process_set):
    """Send rows `splits[i]` to the set's i-th rank, receive theirs; differentiable.

    Why: the exchange behind expert-parallel layers and data reshuffles, where
    each rank sends each other rank a different part.

    Args:
        tensor: the rows to send, in order of destination rank.
        splits: rows for each rank of the set (a list or integer tensor summing to
            tensor.shape[0]); None: the rows divide equally.
        name, process_set: as for allreduce_async.

    Returns:
        The received rows; with `splits`, (rows, the int32 tensor of rows received
        from each rank).

    Raises:
        TypeError, ValueError: not a tensor, or splits that do not fit the tensor or
            the set; HorovodInternalError as for synchronize.
    """
    _checked(tensor, "alltoall")
    return _Alltoall.apply(tensor, splits, name, process_set)


# --- reducescatter -------------------------------------------------------------
def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None,
                        op: ReduceOp = Average, process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """Start a reducescatter; the input is not modified.

    Args:
        tensor, name, op, process_set, prescale_factor, postscale_factor: as for
            reducescatter.

    Returns:
        A handle; synchronize() returns this rank's block of the result.

    Raises:
        TypeError, ValueError: as for reducescatter, before anything is sent.
    """
    return _current().reducescatter_async(
        _source(tensor, "reducescatter_async"), name, op, process_set=process_set,
        prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def _scatter_grad(grad, ctx):
    return grad * reducescatter_grad_factor(ctx.op, ctx.process_set, ctx.prescale_factor,
                                            ctx.postscale_factor)


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale_factor, postscale_factor):
        ctx.op, ctx.process_set = op, process_set
        ctx.prescale_factor, ctx.postscale_factor = prescale_factor, postscale_factor
        return tensor_ops.reducescatter(tensor, name, op, process_set, prescale_factor,
                                        postscale_factor)

    @staticmethod
    def backward(ctx, grad_output):
        grad = allgather(_scatter_grad(grad_output, ctx), process_set=ctx.process_set)
        return (grad,) + (None,) * 5


def reducescatter(tensor: torch.Tensor, name: Optional[str] = None,
                  compression: Any = Compression.none, op: ReduceOp = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce `tensor` across ranks and keep this rank's block of rows; differentiable.

    Why: half an allreduce, for sharded optimizers (ZeRO) that need only their
    own shard of the averaged gradient.

    Args:
        tensor: the same shape and dtype on every rank.
        name, process_set, prescale_factor, postscale_factor: as for allreduce_async.
        compression: as for allreduce.
        op: Average or Sum (Horovod's reducescatter takes no other).

    Returns:
        This rank's block of rows of the result (the first ranks take one more row
        when the rows do not divide evenly).

    Raises:
        TypeError, ValueError: not a tensor, or an op other than Average or Sum;
            HorovodInternalError as for synchronize.
    """
    _checked(tensor, "reducescatter")
    wire, ctx = compression.compress(tensor)
    reduced = _Reducescatter.apply(wire, name, op, process_set, prescale_factor,
                                   postscale_factor)
    return compression.decompress(reduced, ctx)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                                op: ReduceOp = Average,
                                process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> Handle:
    """Start a reducescatter of each tensor of a list, as one operation.

    Args:
        tensors: the tensors (not modified); name, op, process_set,
            prescale_factor, postscale_factor: as for reducescatter.

    Returns:
        A handle; synchronize() returns the list of this rank's blocks.

    Raises:
        TypeError: `tensors` is one tensor or not iterable; else as reducescatter.
    """
    sources = [_source(t, "grouped_reducescatter_async")
               for t in _tensors(tensors, "grouped_reducescatter_async")]
    return _current().grouped_reducescatter_async(
        sources, name, op, process_set=process_set, prescale_factor=prescale_factor,
        postscale_factor=postscale_factor)


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, process_set, prescale_factor, postscale_factor, *tensors):
        ctx.op, ctx.process_set = op, process_set
        ctx.prescale_factor, ctx.postscale_factor = prescale_factor, postscale_factor
        return tuple(synchronize(grouped_reducescatter_async(
            list(tensors), name, op, process_set, prescale_factor, postscale_factor)))

    @staticmethod
    def backward(ctx, *grad_outputs):
        grads = grouped_allgather([_scatter_grad(g, ctx) for g in grad_outputs],
                                  process_set=ctx.process_set)
        return (None,) * 5 + tuple(grads)


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                          compression: Any = Compression.none, op: ReduceOp = Average,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> List[torch.Tensor]:
    """Reducescatter of each tensor of a list, as one operation; differentiable.

    Args:
        tensors, name, op, process_set, prescale_factor, postscale_factor: as for
            grouped_reducescatter_async; compression: as for allreduce.

    Returns:
        The list of this rank's blocks, in the order of `tensors`.

    Raises:
        As grouped_reducescatter_async, and HorovodInternalError as for synchronize.
    """
    pairs = [compression.compress(_checked(t, "grouped_reducescatter"))
             for t in _tensors(tensors, "grouped_reducescatter")]
    reduced = _GroupedReducescatter.apply(name, op, process_set, prescale_factor,
                                          postscale_factor, *[wire for wire, _ in pairs])
    return [compression.decompress(t, ctx) for t, (_, ctx) in zip(reduced, pairs)]


__all__ = [
    "Adasum", "Average", "HorovodInternalError", "Max", "Min", "Product", "ProcessSet", "Sum",
    "add_process_set", "allgather", "allgather_async", "allgather_object", "allreduce",
    "allreduce_", "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async",
    "barrier", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "broadcast_object", "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built",
    "global_process_set", "gloo_built", "gloo_enabled", "grouped_allgather",
    "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
    "grouped_reducescatter_async", "init", "is_homogeneous", "is_initialized", "join",
    "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported",
    "nccl_built", "poll", "rank", "reducescatter", "reducescatter_async", "remove_process_set",
    "rocm_built", "shutdown", "size", "sparse_allreduce_async", "start_timeline",
    "stop_timeline", "synchronize",
]
