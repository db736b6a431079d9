"""The engine's collectives on its own tensors, blocking and without autograd.

Every engine moves torch tensors (its wire), so the math of a collective is
written once, here: what argument shape the engine takes, the copy that
keeps the caller's tensor untouched, a codec around the reduction (int8 and
fp8 quantize inside it, in two stages), and a failed wait raised as
HorovodInternalError. The adapters add their framework around it:
pipe_horovod.torch gives these Horovod's autograd backward passes and
`*_async` handles; pipe_horovod.tensorflow hands TensorFlow values to them
through DLPack. Horovod's layers are the same: one core in horovod/common,
each framework's mpi_ops on it.
"""
from typing import Any, List, Optional, Sequence

import torch

from .. import engine as _engine
from ..collectives import quantized
from ..compression import Compression, wire_format
from ..engine import Average, HorovodInternalError, ProcessSet, ReduceOp, Sum, global_process_set


def wait(handle) -> Any:
    """The engine's result of `handle`; a failed collective raised as HorovodInternalError
    (Horovod's type, which elastic training and retry loops catch)."""
    try:
        return _engine.current().wait(handle)
    except (HorovodInternalError, NotImplementedError):
        raise
    except RuntimeError as exc:
        raise HorovodInternalError(exc) from exc


def copy_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy without autograd history (engines work in place)."""
    tensor = tensor.detach()
    if tensor.layout != torch.strided:
        return tensor                       # the engine names the problem
    return tensor.clone(memory_format=torch.contiguous_format)


def source_of(tensor: torch.Tensor) -> torch.Tensor:
    """The input of an operation that does not write to it, made contiguous."""
    tensor = tensor.detach()
    return tensor.contiguous() if tensor.layout == torch.strided else tensor


def allreduce(tensor: torch.Tensor, name: Optional[str] = None, op: ReduceOp = Average,
              compression: Any = Compression.none, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """The reduction of `tensor` across the set's ranks, as a new tensor (`tensor` is not
    modified); `compression`'s codec on what travels."""
    fmt = wire_format(compression)
    if fmt is not None:
        return quantized.allreduce(tensor.detach().clone(), name, op=op, fmt=fmt,
                                   prescale_factor=prescale_factor,
                                   postscale_factor=postscale_factor, process_set=process_set)
    wire, ctx = compression.compress(tensor)
    reduced = wait(_engine.current().allreduce_async(
        copy_of(wire), name, op, process_set=process_set, prescale_factor=prescale_factor,
        postscale_factor=postscale_factor))
    return compression.decompress(reduced, ctx)


def grouped_allreduce(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                      op: ReduceOp = Average, compression: Any = Compression.none,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> List[torch.Tensor]:
    """allreduce of each of `tensors` as one operation (one negotiation, one fused
    transfer); new tensors, in order."""
    pairs = [compression.compress(t) for t in tensors]
    reduced = wait(_engine.current().grouped_allreduce_async(
        [copy_of(wire) for wire, _ in pairs], name, op, process_set=process_set,
        prescale_factor=prescale_factor, postscale_factor=postscale_factor))
    return [compression.decompress(t, ctx) for t, (_, ctx) in zip(reduced, pairs)]


def allgather(tensor: torch.Tensor, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Every rank's `tensor` concatenated along dimension 0, in rank order."""
    return wait(_engine.current().allgather_async(source_of(tensor), name,
                                                  process_set=process_set))


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Root's `tensor`, as a new tensor on every rank (`tensor` is not modified)."""
    return wait(_engine.current().broadcast_async(copy_of(tensor), root_rank, name,
                                                  process_set=process_set))


def alltoall(tensor: torch.Tensor, splits=None, name: Optional[str] = None,
             process_set: ProcessSet = global_process_set):
    """(the rows every rank sent here, the int32 tensor of rows received from each)."""
    return wait(_engine.current().alltoall_async(source_of(tensor), splits, name,
                                                 process_set=process_set))


def reducescatter(tensor: torch.Tensor, name: Optional[str] = None, op: ReduceOp = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """This rank's block of rows of the reduction (the first ranks take one more row
    when the rows do not divide evenly)."""
    return wait(_engine.current().reducescatter_async(
        source_of(tensor), name, op, process_set=process_set,
        prescale_factor=prescale_factor, postscale_factor=postscale_factor))


def reducescatter_grad_factor(op: ReduceOp, process_set: ProcessSet, prescale_factor: float,
                              postscale_factor: float) -> float:
    """Horovod's reducescatter backward scaling, before the allgather (every adapter's):
    the set's size for Sum, 1 for Average, times both scale factors."""
    return ((process_set.size() if op is Sum else 1) * prescale_factor * postscale_factor)


__all__ = ["allgather", "allreduce", "alltoall", "broadcast", "copy_of", "grouped_allreduce",
           "reducescatter", "reducescatter_grad_factor", "source_of", "wait"]
