"""The collectives and their per-hop codecs as PyTorch DDP communication hooks.

DDP users get LP or ring with int8 (and error feedback) without our
optimizer: `model.register_comm_hook(*ddp_hooks.hook("ring", Compression.int8_ef))`.
The hook hands DDP's bucket to the collectives' thread and returns a torch
Future completed by that thread, so DDP's own overlap with backward is kept.
DDP launches buckets in the same order on every rank, which is what the
collectives need. Error-feedback residuals are kept per DDP bucket (DDP
re-buckets after its first iteration; a bucket of a new size starts at zero).
"""
from .. import engine as _engine
from ..compression import Compression, accumulator
from ..engine.base import Average
from ..engine.process_sets import global_process_set
from .api import checked_job
from .communicator import communicator
from .spec import check_collective


class HookState:
    """What the hook keeps between iterations: the choice and the residuals."""

    def __init__(self, collective, compression):
        self.collective = check_collective(collective, compression)
        if self.collective is None:
            raise ValueError("a DDP hook needs a collective (lp, ring, mst, be); DDP's own "
                             "allreduce is the hook-less default")
        self.compression = compression
        self.residuals = {}                  # DDP bucket index -> residual

    def residual(self, bucket):
        if not getattr(self.compression, "error_feedback", False):
            return None
        import torch

        flat = bucket.buffer()
        acc = accumulator(flat.dtype)
        kept = self.residuals.get(bucket.index())
        if kept is None or kept.numel() != flat.numel():
            kept = self.residuals[bucket.index()] = torch.zeros(flat.numel(), dtype=acc)
        return kept


def hook(collective="ring", compression=Compression.none):
    """(state, hook) for `model.register_comm_hook(state, hook)`.

    Starts pipe_horovod's torch engine on DDP's process group if no engine runs.
    """
    if not _engine.is_initialized():
        _engine.init("torch")
    state = HookState(collective, compression)
    communicator(_engine.current())      # collective: every rank registers its hook
    return state, allreduce_hook


def allreduce_hook(state, bucket):
    """Average DDP's bucket with the state's collective and codec."""
    import torch

    tensor = bucket.buffer()
    job = checked_job("allreduce", tensor, Average, state.collective, state.compression,
                      global_process_set, residual=state.residual(bucket))
    work = communicator(_engine.current()).start(job)
    result = torch.futures.Future()

    def landed(_):
        try:
            result.set_result(work.wait())
        except Exception as exc:         # DDP raises it from its wait
            result.set_exception(exc)

    future = getattr(work, "future", None)
    if future is None:                   # one rank: complete already
        landed(None)
    else:
        future.add_done_callback(landed)
    return result
