"""horovod.tensorflow's collectives on tf.Tensor, tf.Variable and tf.IndexedSlices.

Names, positional order and defaults are Horovod 0.28.1's (horovod/tensorflow
/__init__.py and mpi_ops.py), so a TF2 script switches by its import. Each
call checks its arguments, hands the value to the common layer's collective
of the same name (pipe_horovod.common.tensor_ops: one implementation of the
math, the PyTorch adapter's too, on every engine: horovodrun with Gloo or MPI,
torchrun, one process) and returns a TensorFlow
tensor. Eagerly it runs at once; inside a tf.function it is a stateful graph
op (bridge.py), so it runs in program order and unnamed operations get the
same counted names on every rank. The arguments Horovod uses to place ops
(`device_dense`, `device_sparse`, `ignore_name_scope`) are accepted and unused.

Horovod's TensorFlow module has no `*_async` forms (only horovod.torch has),
so neither does this one. Gradients flow through allreduce, grouped_allreduce,
allgather and broadcast of floating tensors as Horovod registers them: the
allreduce of the upstream gradient with the same op and factors; for
allgather this rank's rows of its average; for broadcast its average on the
root and zeros elsewhere (SyncBatchNormalization's statistics need them).
"""
import numbers
import warnings

import tensorflow as tf

from ..compression import Compression
from ..engine import Adasum, Average, ReduceOp, Sum, global_process_set
from ..engine.argument_checks import UnsupportedOperation
from ..common import tensor_ops
from ..common.basics import rank, size
from ..common.objects import join as _join
from . import bridge


# Called inside a tf.function, these are plain Python at trace time (their graph op is
# bridge.run's py_function): AutoGraph need not convert them, and converting them
# walks the modules they import (torch's deprecated names warn on the way).
_python = tf.autograph.experimental.do_not_convert


def _dense(tensor, what):
    if isinstance(tensor, tf.IndexedSlices):
        raise TypeError(f"{what} takes a dense tf.Tensor or tf.Variable, got tf.IndexedSlices "
                        "(convert it with tf.convert_to_tensor)")
    try:
        return tf.convert_to_tensor(tensor)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what} expects a tf.Tensor, tf.Variable or array-like, got "
                        f"{type(tensor).__name__}") from exc


def _op(op, average):
    """Horovod's rule for the deprecated `average=` next to `op=` (Average by default)."""
    if isinstance(average, ReduceOp):
        raise TypeError(f"average= is Horovod's deprecated flag (a bool), got {average!r}: "
                        f"pass the reduction as op={average!r}")
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if op is not None:
        return op
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in "
                      "v1.0", DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    return Average


def _static(out, like):
    out.set_shape(like.shape)
    return out


def _with_gradient(forward, backward, tensors):
    """forward(*tensors), its gradient backward(*upstream) (Horovod's registered
    gradients); integer tensors have none."""
    if not all(t.dtype.is_floating or t.dtype.is_complex for t in tensors):
        return forward(*tensors)

    @tf.custom_gradient
    def op(*values):
        def grad(*upstream):
            upstream = [tf.zeros_like(v) if g is None else g for g, v in zip(upstream, values)]
            return backward(*upstream)
        return forward(*values), grad
    return op(*tensors)


@_python
def allreduce(tensor, average=None, device_dense="", device_sparse="",
              compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, name=None, process_set=global_process_set,
              ignore_name_scope=False):
    """The reduction of `tensor` over the ranks of `process_set` (op: Average by default).

    A tf.IndexedSlices is reduced as Horovod does: its values and indices are
    allgathered (the values divided by the set's size for Average), so only Sum
    and Average apply and the scale factors are refused.

    Raises:
        ValueError: an op that cannot reduce IndexedSlices, or scale factors with one
            (also the NotImplementedError Horovod raises), average= with op=, a
            collective under XLA.
        TypeError: not a tensor.
    """
    bridge.refuse_xla("allreduce")
    op = _op(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        if op not in (Average, Sum):
            raise UnsupportedOperation(
                f"allreduce of tf.IndexedSlices (a sparse gradient) supports op=Sum and "
                f"op=Average only (it allgathers values and indices), got {op}: pass "
                "sparse_as_dense=True, or convert it with tf.convert_to_tensor")
        if prescale_factor != 1.0 or postscale_factor != 1.0:
            raise UnsupportedOperation("prescale_factor/postscale_factor are not supported "
                                       "with tf.IndexedSlices (as in Horovod)")
        values = allgather(tensor.values, process_set=process_set)
        indices = allgather(tensor.indices, process_set=process_set)
        if op is Average:
            values = values / tf.cast(_members(process_set), values.dtype)
        return tf.IndexedSlices(values, indices, dense_shape=tensor.dense_shape)
    tensor = _dense(tensor, "allreduce")

    def reduce(value):
        return [bridge.to_tf(tensor_ops.allreduce(
            bridge.to_torch(value, reduced=True), name, op, compression,
            prescale_factor, postscale_factor, process_set), value.dtype)]
    return _with_gradient(
        lambda value: _static(bridge.run(reduce, [value], [value.dtype],
                                          "pipe_horovod_allreduce")[0], value),
        lambda grad: allreduce(grad, op=op, prescale_factor=prescale_factor,
                               postscale_factor=postscale_factor, process_set=process_set),
        [tensor])


@_python
def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="",
                      compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set,
                      ignore_name_scope=False, name=None):
    """allreduce of each tensor of `tensors`, fused into one operation; a list back."""
    bridge.refuse_xla("grouped_allreduce")
    if isinstance(tensors, (tf.Tensor, tf.Variable)) or not hasattr(tensors, "__iter__"):
        raise TypeError(f"grouped_allreduce expects a list of tensors, got "
                        f"{type(tensors).__name__}")
    tensors = list(tensors)
    op = _op(op, average)
    if any(isinstance(t, tf.IndexedSlices) for t in tensors):
        return [allreduce(t, compression=compression, op=op, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor, process_set=process_set)
                for t in tensors]
    dense = [_dense(t, "grouped_allreduce") for t in tensors]

    def reduce(*values):
        out = tensor_ops.grouped_allreduce([bridge.to_torch(v, reduced=True) for v in values],
                                           name, op, compression, prescale_factor,
                                           postscale_factor, process_set)
        return [bridge.to_tf(t, v.dtype) for t, v in zip(out, values)]

    def forward(*values):
        out = bridge.run(reduce, values, [t.dtype for t in values],
                          "pipe_horovod_grouped_allreduce")
        return [_static(o, t) for o, t in zip(out, values)]
    return _with_gradient(forward, lambda *grads: grouped_allreduce(
        grads, op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
        process_set=process_set), dense)


@_python
def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Every rank's `tensor` concatenated on the first dimension, in rank order (the
    first dimension may differ between ranks)."""
    bridge.refuse_xla("allgather")
    tensor = _dense(tensor, "allgather")

    def gather(value):
        return [bridge.to_tf(tensor_ops.allgather(bridge.to_torch(value), name, process_set),
                              value.dtype)]

    def forward(value):
        out = bridge.run(gather, [value], [value.dtype], "pipe_horovod_allgather")[0]
        out.set_shape(tf.TensorShape([None]).concatenate(value.shape[1:])
                      if value.shape.rank else value.shape)
        return out

    def backward(grad):                  # this rank's rows of the average
        rows = allgather(tf.shape(tensor, out_type=tf.int64)[:1], process_set=process_set)
        me = rank() if process_set is global_process_set else process_set.rank()
        start = tf.reduce_sum(rows[:me])
        return allreduce(grad, op=Average, process_set=process_set)[start:start + rows[me]]
    return _with_gradient(forward, backward, [tensor])


def grouped_allgather(tensors, name=None, ignore_name_scope=False,
                      process_set=global_process_set):
    """allgather of each tensor of `tensors`, in one operation; a list back."""
    return [allgather(t, None if name is None else f"{name}.{i}", process_set=process_set)
            for i, t in enumerate(tensors)]


@_python
def broadcast(tensor, root_rank, name=None, ignore_name_scope=False,
              process_set=global_process_set):
    """`root_rank`'s `tensor` on every rank (its shape must agree across ranks)."""
    bridge.refuse_xla("broadcast")
    _check_root(root_rank)
    tensor = _dense(tensor, "broadcast")

    def send(value):
        return [bridge.to_tf(tensor_ops.broadcast(bridge.to_torch(value), root_rank, name,
                                                   process_set), value.dtype)]

    def backward(grad):                  # the average, on the root only
        averaged = allreduce(grad, op=Average, process_set=process_set)
        return averaged if rank() == root_rank else averaged * 0
    return _with_gradient(
        lambda value: _static(bridge.run(send, [value], [value.dtype],
                                          "pipe_horovod_broadcast")[0], value),
        backward, [tensor])


@_python
def broadcast_(variables, root_rank, name=None, process_set=global_process_set):
    """Assign root's values to each of `variables` (tf.Variable) in place; returns them."""
    for i, variable in enumerate(variables):
        if not (isinstance(variable, tf.Variable) or bridge.is_keras_variable(variable)):
            raise TypeError(f"broadcast_ assigns to tf.Variables or Keras variables; entry "
                            f"{i} is a {type(variable).__name__}")
        variable.assign(broadcast(variable, root_rank,
                                  None if name is None else f"{name}.{i}",
                                  process_set=process_set))
    return variables


@_python
def alltoall(tensor, splits=None, name=None, ignore_name_scope=False,
             process_set=global_process_set):
    """Slices of `tensor` (first dimension, `splits` rows to each rank; equal parts when
    None) sent to every rank; what every rank sent here, concatenated in rank order.
    With `splits`, also the rows received from each rank (Horovod's pair)."""
    bridge.refuse_xla("alltoall")
    tensor = _dense(tensor, "alltoall")
    given = splits is not None
    splits = tf.constant([], tf.int32) if splits is None else tf.cast(
        tf.convert_to_tensor(splits), tf.int32)

    def exchange(value, rows):
        rows = [int(r) for r in rows.numpy()] if int(tf.size(rows)) else None
        sent = bridge.to_torch(value)
        out, received = tensor_ops.alltoall(sent, rows, name, process_set)
        return [bridge.to_tf(out.reshape(int(received.sum()), *sent.shape[1:]), value.dtype),
                tf.constant(received.numpy(), tf.int32)]

    def forward(value):
        out, received = bridge.run(exchange, [value, splits], [value.dtype, tf.int32],
                                    "pipe_horovod_alltoall")
        out.set_shape(tf.TensorShape([None]).concatenate(value.shape[1:]))
        received.set_shape([None])
        return out, received

    if not (tensor.dtype.is_floating or tensor.dtype.is_complex):
        out, received = forward(tensor)
    else:
        @tf.custom_gradient
        def differentiable(value):
            out, received = forward(value)

            def grad(upstream, _received):   # back along the received splits (Horovod's)
                return alltoall(upstream, splits=received, process_set=process_set)[0]
            return (out, received), grad
        out, received = differentiable(tensor)
    return (out, received) if given else out


@_python
def reducescatter(tensor, device_dense="", compression=Compression.none, op=Average,
                  name=None, process_set=global_process_set, ignore_name_scope=False,
                  prescale_factor=1.0, postscale_factor=1.0):
    """The reduction of `tensor` split along the first dimension: this rank's part (the
    first ranks get one row more where the rows do not divide evenly)."""
    bridge.refuse_xla("reducescatter")
    if op not in (Average, Sum):
        raise ValueError(f"reducescatter supports op=Average and op=Sum, got {op}")
    tensor = _dense(tensor, "reducescatter")

    def scatter(value):
        wire, ctx = compression.compress(bridge.to_torch(value, reduced=True))
        out = tensor_ops.reducescatter(wire, name, op=op, process_set=process_set,
                                   prescale_factor=prescale_factor,
                                   postscale_factor=postscale_factor)
        return [bridge.to_tf(compression.decompress(out, ctx), value.dtype)]

    def forward(value):
        out = bridge.run(scatter, [value], [value.dtype], "pipe_horovod_reducescatter")[0]
        out.set_shape(tf.TensorShape([None]).concatenate(value.shape[1:]))
        return out

    def backward(grad):                  # Horovod's scaling, then every rank's part
        factor = tensor_ops.reducescatter_grad_factor(op, process_set, prescale_factor,
                                                  postscale_factor)
        return allgather(grad * tf.cast(factor, grad.dtype), process_set=process_set)
    return _with_gradient(forward, backward, [tensor])


def grouped_reducescatter(tensors, device_dense="", compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    """reducescatter of each tensor of `tensors`; a list back."""
    return [reducescatter(t, compression=compression, op=op, process_set=process_set,
                          prescale_factor=prescale_factor, postscale_factor=postscale_factor)
            for t in tensors]


def join():
    """This rank is out of data (see pipe_horovod.torch.join); the last rank to join."""
    return _join()


def _members(process_set):
    return size() if process_set is global_process_set else process_set.size()


def _check_root(root_rank):
    if isinstance(root_rank, bool) or not isinstance(root_rank, numbers.Integral):
        raise TypeError(f"root_rank must be an int, got {type(root_rank).__name__}")


__all__ = ["Adasum", "Average", "Sum", "allgather", "allreduce", "alltoall", "broadcast",
           "broadcast_", "grouped_allgather", "grouped_allreduce", "grouped_reducescatter",
           "join", "reducescatter"]
