"""Allreduce, reduce and broadcast on pipe_horovod's own algorithms, as engine handles.

Each call returns the engine's Handle: `engine.poll(h)`, `engine.wait(h)`
(the result, in place in the caller's tensor), names checked like every
engine operation, and the engine's shutdown completes what is in flight.
Unlike Horovod's name matching, ranks must start these in the same order
(as with torch.distributed): the optimizer's buckets do.
"""
from .. import engine as _engine
from ..compression import Compression, accumulator
from ..engine.base import Average, Sum
from ..engine.argument_checks import check_op, check_root, check_scale, check_tensor
from .communicator import Job, communicator
from .spec import check_collective, check_dtype


def checked_job(kind, tensor, op, collective, compression, ps, **job):
    """The Job for `tensor` on registered process set `ps`, every argument checked."""
    check_tensor(tensor, f"collectives.{kind}_async")
    check_dtype(tensor, f"collectives.{kind}_async")
    spec = check_collective(collective, compression)
    if spec is None:
        raise ValueError("collective must name an algorithm here (lp, ring, mst, be); "
                         "for the engine's own allreduce call engine.allreduce_async")
    codec = (compression or Compression.none).hop(tensor.dtype)
    ranks = list(ps.ranks)
    return Job(kind, tensor, spec, codec, op, ranks=ranks, me=ranks.index(_engine.rank()),
               set_id=ps.process_set_id, **job)


def _start(kind, tensor, name, op, collective, compression, process_set, **job):
    eng = _engine.current()
    comm = communicator(eng)

    def start(ps):
        return comm.start(checked_job(kind, tensor, op, collective, compression, ps, **job))

    return eng.adopt_async(kind, tensor, name, op, start, process_set=process_set)


def allreduce_async(tensor, name=None, op=Average, *, collective="ring",
                    compression=Compression.none, process_set=None, prescale_factor=1.0,
                    postscale_factor=1.0, residual=None):
    """Reduce `tensor` in place: postscale * op(prescale * tensor), op Sum or Average.

    residual: error feedback's carry, a flat tensor of the accumulator type
    (float32; float64 for float64 tensors) and size: added to this reduction's
    input, then overwritten with what this rank's encodes lost, for the next one.
    """
    check_op(op, (Average, Sum), "collectives.allreduce")
    check_scale(prescale_factor, "prescale_factor")
    check_scale(postscale_factor, "postscale_factor")
    _check_residual(residual, tensor)
    return _start("allreduce", tensor, name, op, collective, compression, process_set,
                  prescale=prescale_factor, postscale=postscale_factor, residual=residual)


def reduce_async(tensor, root, name=None, op=Average, *, collective="lp",
                 compression=Compression.none, process_set=None):
    """Reduce to global rank `root`: its tensor gets the result, the others' are unchanged."""
    check_op(op, (Average, Sum), "collectives.reduce")
    _check_root(root, process_set)
    return _start("reduce", tensor, name, op, collective, compression, process_set,
                  root=_index(root, process_set))


def broadcast_async(tensor, root, name=None, *, collective="lp", compression=Compression.none,
                    process_set=None):
    """Overwrite `tensor` with global rank `root`'s; with a lossy codec the root's
    own tensor becomes the decoded value too, so every rank holds the same."""
    _check_root(root, process_set)
    return _start("broadcast", tensor, name, None, collective, compression, process_set,
                  root=_index(root, process_set))


def allreduce(tensor, name=None, op=Average, **options):
    return _engine.wait(allreduce_async(tensor, name, op, **options))


def reduce(tensor, root, name=None, op=Average, **options):
    return _engine.wait(reduce_async(tensor, root, name, op, **options))


def broadcast(tensor, root, name=None, **options):
    return _engine.wait(broadcast_async(tensor, root, name, **options))


def _ranks(process_set):
    return (process_set.ranks if process_set is not None
            else list(range(_engine.current().size())))


def _check_root(root, process_set):
    check_root(root, _engine.current().size())
    if root not in _ranks(process_set):
        raise ValueError(f"root rank {root} is not a member of {process_set}")


def _index(root, process_set):
    return _ranks(process_set).index(root)


def _check_residual(residual, tensor):
    if residual is None:
        return
    import torch

    acc = accumulator(tensor.dtype)
    if (not isinstance(residual, torch.Tensor) or residual.dtype != acc
            or residual.numel() != tensor.numel() or not residual.is_contiguous()
            or residual.device.type != "cpu"):
        raise ValueError(f"residual must be a contiguous CPU {acc} tensor of {tensor.numel()} "
                         f"elements (the accumulator of this reduction), got {residual!r:.80}")
