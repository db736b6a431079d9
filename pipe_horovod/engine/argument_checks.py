"""Checks of what callers pass to an engine, before any library sees it.

A bad argument must be a ValueError or TypeError naming the problem, on the
rank that passed it, not a C++ abort, a hang of the other ranks, or a
silently wrong result; so every engine runs these same checks first.
"""
from .ops import ReduceOp


class UnsupportedOperation(ValueError, NotImplementedError):
    """An op a collective does not support: a ValueError here, and the
    RuntimeError Horovod raises for it, which Horovod's callers catch (its
    TensorFlow module raises NotImplementedError, a RuntimeError)."""


def check_tensor(tensor, what="allreduce_async"):
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} expects a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ValueError(f"{what} needs a dense tensor; reduce a sparse one's indices and "
                         "values (sparse_allreduce_async) or call .to_dense()")
    if not tensor.is_contiguous():
        raise ValueError(
            f"{what} needs a contiguous tensor (the C++ side would work on a copy); "
            "call .contiguous() first")


# What Horovod 0.28.1's reductions take (horovod_torch_allreduce_async_* and
# reducescatter: Int, Long, Half, Float, Double tensors), plus bfloat16, which
# every engine here reduces (the horovod engine by alltoall + allgather).
_REDUCIBLE = ("int32", "int64", "float16", "bfloat16", "float32", "float64")


def check_reducible(tensor, what):
    """Refuse, on every engine, the dtypes Horovod cannot reduce.

    Horovod answers uint8, int8, int16, bool and complex reductions with
    "Tensor type ... is not supported"; torch.distributed would instead wrap
    8-bit sums around, average bool to False and fail int16 inside gloo, so
    a script would behave differently per launcher. One error everywhere."""
    dtype = str(tensor.dtype).replace("torch.", "")
    if dtype not in _REDUCIBLE:
        raise ValueError(
            f"{what} cannot reduce {tensor.dtype} tensors (Horovod's reductions take int32, "
            f"int64, float16, float32, float64; pipe_horovod adds bfloat16): convert the "
            f"tensor first, e.g. .to(torch.int32) or .double()")


def check_tensors(tensors, what):
    if isinstance(tensors, (str, bytes)) or not hasattr(tensors, "__iter__"):
        raise TypeError(f"{what} expects a list of tensors, got {type(tensors).__name__}")
    tensors = list(tensors)
    if not tensors:
        raise ValueError(f"{what} needs at least one tensor")
    for tensor in tensors:
        check_tensor(tensor, what)
    return tensors


def check_op(op, allowed=None, what="allreduce"):
    if not isinstance(op, ReduceOp):
        raise ValueError(f"unknown reduce op {op!r}: use one of pipe_horovod's Average, Sum, "
                         "Adasum, Min, Max, Product")
    if allowed is not None and op not in allowed:
        raise UnsupportedOperation(
            f"{what} supports only {', '.join(o.name.title() for o in allowed)} "
            f"(as in Horovod), got {op.name.title()}")


def check_scale(factor, what):
    if isinstance(factor, bool) or not isinstance(factor, (int, float)):
        raise TypeError(f"{what} must be a number, got {factor!r}")


def check_name(name, what):
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"{what} needs a non-empty string name (or None), got {name!r}")


def check_rows(tensor, what):
    if tensor.dim() == 0:
        raise ValueError(f"{what} works on rows (dimension 0); got a 0-dimensional tensor, "
                         "use tensor.reshape(1)")


def check_splits(splits, rows, size):
    """alltoall's splits as a list of `size` row counts summing to `rows`."""
    if splits is None:
        if rows % size:
            raise ValueError(f"alltoall without splits divides the {rows} row(s) equally among "
                             f"{size} rank(s), which is not possible; pass splits")
        return [rows // size] * size
    if hasattr(splits, "tolist"):
        if getattr(splits, "is_floating_point", lambda: False)():
            raise ValueError(f"alltoall splits must be integers, got {splits!r}")
        splits = splits.tolist()
    if isinstance(splits, (str, bytes)) or not hasattr(splits, "__iter__"):
        raise TypeError(f"alltoall splits must be a list or tensor of row counts, got {splits!r}")
    splits = list(splits)
    if any(isinstance(s, bool) or not isinstance(s, int) for s in splits):
        raise ValueError(f"alltoall splits must be integers, got {splits!r}")
    if len(splits) != size or any(s < 0 for s in splits) or sum(splits) != rows:
        raise ValueError(f"alltoall splits {splits} must be {size} non-negative row counts "
                         f"summing to the tensor's {rows} row(s)")
    return splits


def check_root(root, size):
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < size:
        raise ValueError(f"root rank {root!r} is out of range for {size} rank(s)")
