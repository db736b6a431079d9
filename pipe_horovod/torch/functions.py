"""Start-up broadcasts with Horovod's names: parameters and optimizer state.

A Horovod script calls these after building its model and optimizer (and
after rank 0 alone restored a checkpoint), so every rank starts alike.
"""
from __future__ import annotations

import collections
import itertools
from typing import Iterable, Mapping, NamedTuple, Optional, Tuple, Union

import torch

from .. import engine


def broadcast_parameters(
        params: Union[Mapping[str, torch.Tensor], Iterable[Tuple[str, torch.Tensor]],
                      Iterable[torch.Tensor]],
        root_rank: int) -> None:
    """Copy root's parameters to every rank, in place.

    Why: ranks that start from different random weights average gradients
    computed at different points, and never converge to the same model;
    Horovod's resume pattern also restores a checkpoint on root alone and
    relies on this to hand it out.

    Args:
        params: a state_dict, model.named_parameters(), or a list of tensors,
            as Horovod accepts. A dict is sent in sorted key order, so ranks
            whose dicts were built in different orders still match.
        root_rank: the rank whose values every rank ends with.

    Raises:
        TypeError: an entry is not a tensor (the name says which).
    """
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    for item in items:
        name, tensor = item if isinstance(item, tuple) else (None, item)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"broadcast_parameters: {name!r} is a {type(tensor).__name__}, "
                            "not a tensor")
        with torch.no_grad():
            if tensor.is_contiguous():
                engine.broadcast(tensor, root_rank)
            else:
                tensor.copy_(engine.broadcast(tensor.contiguous(), root_rank))


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              model: Optional[torch.nn.Module] = None) -> None:
    """Give every rank root's optimizer state: momentum, Adam moments, LR, step counts,
    and for a DistributedOptimizer the pipeline's own (gradients in flight, step,
    bucket order).

    Horovod's resume pattern loads a checkpoint on rank 0 only and then calls
    this: the pipeline state must travel too, or rank 0 would wait for
    reductions its peers never start. Root's state_dict travels as one object
    with every tensor replaced by a _Slot (so optimizers Horovod cannot
    broadcast, LBFGS among them, work as well, and no zero-gradient step is
    needed to create missing state); the tensors then travel in place, each
    allocated on this rank's device for it. Pickling the tensors instead
    would unpickle CUDA storages onto root's device index on every rank. As
    Horovod does, a fresh optimizer's trainable parameters are left with a
    zero `.grad` (sparse for SparseAdam and for sparse embeddings of `model`).

    Args:
        optimizer: any torch optimizer, a DistributedOptimizer included; on the
            other ranks its state is replaced by root's (load_state_dict).
        root_rank: the rank whose state every rank ends with.
        model: only to find sparse embeddings, whose fresh `.grad` must be sparse.

    Raises:
        TypeError: `optimizer` is not a torch.optim.Optimizer, or its state holds a
            tensor that is neither dense nor sparse COO.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"broadcast_optimizer_state needs a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if not optimizer.state:
        _zero_gradients(optimizer, model)
    root = engine.rank() == root_rank
    tensors, sent = [], None
    if root:        # a fresh name prefix per call, chosen by root: it travels to the others
        sent = {"prefix": f"pipe_horovod.optimizer_state.{next(_calls)}",
                "skeleton": _skeleton(optimizer.state_dict(), tensors)}
    sent = engine.broadcast_object(sent, root_rank)
    prefix, skeleton = sent["prefix"], sent["skeleton"]
    slots = _slots(skeleton)
    devices = {} if root else _devices(skeleton, optimizer)
    staged = _staged_through_cpu(slots, devices, prefix)
    if not root:
        tensors = [None] * len(slots)
    received = _broadcast_tensors(slots, tensors, devices, staged, root_rank, prefix)
    if not root:
        optimizer.load_state_dict(_fill(skeleton, received))


class _Slot(NamedTuple):
    """What travels in the object broadcast in place of one of root's tensors."""

    index: int              # position in the tensor list, which every rank then broadcasts
    shape: tuple
    dtype: torch.dtype
    on_cpu: bool            # root had it on CPU: it stays on CPU (Adam's `step`)


class _SparseSlot(NamedTuple):
    """A sparse COO tensor: its indices and values travel as two dense tensors."""

    indices: _Slot
    values: _Slot
    size: tuple


_calls = itertools.count(1)     # root's call count: a fresh name prefix per call


def _skeleton(obj, tensors):
    """`obj` with each tensor replaced by a _Slot and appended to `tensors`, in order."""
    if isinstance(obj, torch.Tensor):
        obj = obj.detach()
        if obj.layout == torch.sparse_coo:
            obj = obj.coalesce()
            return _SparseSlot(_skeleton(obj.indices(), tensors), _skeleton(obj.values(), tensors),
                               tuple(obj.shape))
        if obj.layout != torch.strided:
            raise TypeError(f"broadcast_optimizer_state cannot send a {obj.layout} tensor "
                            "in the optimizer state (dense and sparse COO only)")
        tensors.append(obj)
        return _Slot(len(tensors) - 1, tuple(obj.shape), obj.dtype, obj.device.type == "cpu")
    return _rebuild(obj, lambda item: _skeleton(item, tensors))


def _fill(skeleton, tensors):
    """The inverse of _skeleton: each _Slot replaced by its received tensor."""
    if isinstance(skeleton, _Slot):
        return tensors[skeleton.index]
    if isinstance(skeleton, _SparseSlot):
        return torch.sparse_coo_tensor(_fill(skeleton.indices, tensors),
                                       _fill(skeleton.values, tensors), skeleton.size)
    return _rebuild(skeleton, lambda item: _fill(item, tensors))


def _rebuild(obj, convert):
    """`obj` with `convert` applied to each item of its dicts, lists and tuples."""
    if isinstance(obj, dict):
        items = [(key, convert(value)) for key, value in obj.items()]
        return obj.__class__(items) if type(obj) in (dict, collections.OrderedDict) else dict(items)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*map(convert, obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map(convert, obj))
    return obj


def _slots(skeleton):
    """Every _Slot in `skeleton`, in index order."""
    found = []

    def visit(node):
        if isinstance(node, _Slot):
            found.append(node)
        else:
            _rebuild(node, visit)
        return node

    visit(skeleton)
    return sorted(found, key=lambda slot: slot.index)


def _devices(skeleton, optimizer):
    """Where each tensor lands on this rank (slot index -> device): on CPU where root
    had it on CPU, else on the device of the parameter it belongs to (CPU when
    none is known). state[i] belongs to the i-th parameter in param_groups
    order; a DistributedOptimizer's in-flight gradients to the parameter they
    are named after."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    param_of = getattr(optimizer, "_param_of", {})
    cpu, where = torch.device("cpu"), {}

    def place(node, owner):
        for slot in _slots(node):
            where[slot.index] = cpu if slot.on_cpu or owner is None else owner.device

    for key, value in skeleton.items():
        if key == "state" and isinstance(value, dict):
            for index, entry in value.items():
                owned = isinstance(index, int) and 0 <= index < len(params)
                place(entry, params[index] if owned else None)
        elif key == "pipe_horovod" and isinstance(value, dict):
            for grads in value.get("in_flight", ()):
                for name, grad in grads.items():
                    place(grad, param_of.get(name))
            place({k: v for k, v in value.items() if k != "in_flight"}, None)
        else:
            place(value, None)
    return where


def _staged_through_cpu(slots, devices, prefix):
    """True when root's accelerator tensors must travel through CPU.

    Every rank must hand the library the same kind of device for one tensor
    (Horovod refuses a CPU/GPU mix; torch.distributed would pick gloo on one
    rank and NCCL on another), so where some rank places one of them on CPU
    (a CPU-only rank), all of them travel on CPU. Root's own places are its
    tensors' (devices is empty there). One small allgather decides it, only
    when root has a tensor off CPU."""
    if all(slot.on_cpu for slot in slots):
        return False
    mine = all(devices[slot.index].type != "cpu" for slot in slots
               if not slot.on_cpu and slot.index in devices)
    return not all(engine.allgather_object(mine, name=f"{prefix}.on_accelerator"))


def _broadcast_tensors(slots, tensors, devices, staged, root_rank, prefix):
    """Broadcast every slot's tensor from root; all are started before any is waited for.

    On root `tensors` holds the values to send; elsewhere each tensor is
    allocated here, on its device (on CPU first when staged). Returns the
    received tensors, each on its device."""
    eng, wires = engine.current(), []
    handles = []
    for slot in slots:
        wire, target = _wire(slot, tensors[slot.index], devices, staged)
        if wire.numel():
            flat = (torch.view_as_real(wire) if wire.is_complex() else wire).reshape(-1)
            handles.append(eng.broadcast_async(flat, root_rank, f"{prefix}.{slot.index}"))
        wires.append((wire, target))
    for handle in handles:
        eng.wait(handle)
    return [wire if wire.device == target else wire.to(target) for wire, target in wires]


def _wire(slot, source, devices, staged):
    """The tensor one slot travels in on this rank, and the device it ends on."""
    if source is None:                          # not root: allocate
        target = devices[slot.index]
        device = torch.device("cpu") if staged else target
        return torch.empty(slot.shape, dtype=slot.dtype, device=device), target
    wire = source.contiguous()
    return (wire.cpu() if staged else wire), source.device


def _zero_gradients(optimizer, model):
    sparse = {id(p) for m in (model.modules() if model is not None else ())
              if isinstance(m, torch.nn.Embedding) and m.sparse for p in m.parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
                if isinstance(optimizer, torch.optim.SparseAdam) or id(p) in sparse:
                    p.grad = p.grad.to_sparse()
