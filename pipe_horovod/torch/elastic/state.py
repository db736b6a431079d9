"""Training state that elastic `run` commits, restores and synchronizes.

The names, arguments and life cycle are Horovod's (`horovod.torch.elastic.TorchState`
on State and ObjectState, which pipe_horovod.common.elastic holds for every
adapter), implemented on pipe_horovod's engine so they behave the same under
horovodrun, torchrun and plain python. What differs, and why:

* A pipelined DistributedOptimizer holds gradients whose reduction is still
  in flight. `commit()` captures them through the optimizer's own
  `state_dict()` (which waits for them to land), and `restore()` first
  drops whatever the optimizer has on the wire (after a failed collective
  it will never complete) and then loads the committed state, so the
  restored state is bit for bit the one committed: training continues as
  if the steps since the commit never happened. A commit is therefore a
  point where the pipeline drains its reductions (not its FIFO: nothing is
  applied early); commit every few batches, as Horovod advises anyway.
* A commit is all or nothing: every handler's snapshot is taken before any
  is kept, so a collective failing half-way through a commit (a peer died
  while this rank waited for a gradient) leaves the previous commit whole.
* Committed values are deep copies, and `restore()` hands out copies again:
  changing a list held in the state in place after a commit does not
  change what was committed (Horovod keeps a reference).
* The sync gives every rank rank 0's optimizer state, but a rank whose state
  is rank 0's but for what it holds of its own (the gradients lookahead
  predicts from, error-feedback residuals: it restored the same commit)
  keeps its own, as a run without the failure would have
  (pipeline/own_state.py); a worker that joined takes rank 0's.
* `reset()` (after the engine was reset, before the sync) re-attaches
  optimizers to the new engine (rank and size may have changed) and
  re-partitions ElasticSamplers, even when the sync is skipped.
"""
import copy

import torch

from ...common.elastic import ObjectState, State
from .. import mpi_ops
from ..functions import broadcast_optimizer_state, broadcast_parameters
from ...pipeline.own_state import OWN, identical
from ..optimizer import is_distributed
from .sampler import ElasticSampler


class StateHandler:
    """Commits, restores and syncs one kind of object held by a TorchState."""

    def __init__(self, value):
        self.value = value
        self.saved = self.snapshot()

    def snapshot(self):
        """A copy of the value's state, independent of the live object."""
        raise NotImplementedError

    def save(self):
        self.saved = self.snapshot()

    def restore(self):
        raise NotImplementedError

    def sync(self):
        raise NotImplementedError

    def reset(self):
        """After the engine was reset (rank and size may differ), before the sync."""

    def set_value(self, value):
        self.value = value
        self.save()


class ModelStateHandler(StateHandler):
    def snapshot(self):
        return copy.deepcopy(self.value.state_dict())

    def restore(self):
        self.value.load_state_dict(self.saved)

    def sync(self):
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(StateHandler):
    """A torch optimizer; for a pipelined DistributedOptimizer its state_dict
    carries the gradients in flight, so they are committed and restored too."""

    def snapshot(self):
        return copy.deepcopy(self.value.state_dict())

    def restore(self):
        if is_distributed(self.value):
            self.value.drop_in_flight()
        # A copy: load_state_dict keeps tensors it is given (momentum buffers, the
        # gradients in flight), and training would then change the commit in place.
        self.value.load_state_dict(copy.deepcopy(self.saved))

    def sync(self):
        mine = self.value.state_dict() if is_distributed(self.value) else None
        broadcast_optimizer_state(self.value, root_rank=0)
        if mine is not None and identical(_shared(mine), _shared(self.value.state_dict())):
            self.value.load_state_dict(mine)

    def detach(self):
        # An engine about to be reset must not report the committed gradients in
        # flight as "never applied" at its shutdown: they will be, after the reset.
        if is_distributed(self.value):
            self.value.release_engine()

    def reset(self):
        if is_distributed(self.value):
            self.value.rebind_engine()


def _shared(state_dict):
    pipe = {k: v for k, v in state_dict.get("pipe_horovod", {}).items() if k not in OWN}
    return {**state_dict, "pipe_horovod": pipe}


class SamplerStateHandler(StateHandler):
    def snapshot(self):
        return copy.deepcopy(self.value.state_dict())

    def restore(self):
        self.value.load_state_dict(self.saved)

    def sync(self):
        self.value.load_state_dict(_bcast_from_rank0(self.value.state_dict()))

    def reset(self):
        self.value.reset()


_handler_registry = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def get_handler_registry():
    """[(type, handler class)]: how TorchState treats each kind of keyword argument."""
    return _handler_registry


def set_handler_registry(registry):
    global _handler_registry
    _handler_registry = registry


def _handler_for(value):
    for kind, handler_cls in _handler_registry:
        if isinstance(value, kind):
            return handler_cls(value)
    return None


class TorchState(ObjectState):
    """Horovod's `TorchState`: models, optimizers, ElasticSamplers and plain values.

    Args:
        model: a torch.nn.Module (optional).
        optimizer: a torch optimizer, typically pipe_horovod's DistributedOptimizer
            (optional); its gradients in flight are part of the state.
        kwargs: more state, exposed as attributes. Modules, optimizers and
            ElasticSamplers get their own handler (state_dict based); anything
            else is a plain value, broadcast from rank 0 as one object.
    """

    def __init__(self, model=None, optimizer=None, **kwargs):
        kwargs.update(model=model, optimizer=optimizer)
        self._handlers = {}
        plain = {}
        for name, value in kwargs.items():
            handler = _handler_for(value)
            if handler is None:
                plain[name] = value
            else:
                self._handlers[name] = handler
                setattr(self, name, value)
        super().__init__(bcast_object=_bcast_from_rank0, get_rank=mpi_ops.rank, **plain)

    def save(self):
        # All snapshots first: if one fails (a gradient in flight whose reduction
        # failed), the previous commit stays whole.
        handlers = {name: h.snapshot() for name, h in self._handlers.items()}
        super().save()
        for name, saved in handlers.items():
            self._handlers[name].saved = saved

    def restore(self):
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self):
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def reset(self):
        for handler in self._handlers.values():
            handler.reset()

    def _before_engine_reset(self):
        for handler in self._handlers.values():
            if isinstance(handler, OptimizerStateHandler):
                handler.detach()

    def __setattr__(self, name, value):
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers and name in self.__dict__:
            handlers[name].set_value(value)
        super().__setattr__(name, value)


def _bcast_from_rank0(obj):
    return mpi_ops.broadcast_object(obj, root_rank=0)


__all__ = ["State", "ObjectState", "TorchState", "StateHandler", "ModelStateHandler",
           "OptimizerStateHandler", "SamplerStateHandler", "get_handler_registry",
           "set_handler_registry"]
