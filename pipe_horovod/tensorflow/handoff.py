"""How a TensorFlow value reaches the engines, which work on torch tensors, and back.

The engines are torch's and Horovod's torch ops (Horovod's TensorFlow ops do
not build against TensorFlow >= 2.16, DESIGN.md), so every collective here
runs on a torch view of the TensorFlow buffer: DLPack shares the memory
(a GPU tensor stays on its device, where NCCL reduces it), NumPy is the
fallback for what DLPack refuses. Inside a `tf.function` the same Python
runs as a `tf.py_function` (stateful, so the automatic control dependencies
keep collectives in program order on every rank, which is what matches
unnamed collectives across ranks); in eager mode it runs directly.
"""
import functools

import numpy as np
import tensorflow as tf
import torch

from ..engine.mismatch import MismatchError


# TensorFlow's CPU kernels require 64-byte aligned buffers (a DLPack import of anything
# else aborts the process); torch allocates so aligned, but slices need not be.
ALIGNMENT = 64

# Horovod's TensorFlow ops take dtypes its torch ops and gloo, the engines here, do not:
# 16-bit integers travel as pairs of int8 (gloo has no int16) and unsigned 32- and 64-bit
# ones as the signed type of their width, bit for bit; 8- and 16-bit integers are reduced
# in int32 and cast back (a sum that overflows wraps around, as Horovod's does; an
# Average divides before the wrap, where Horovod's divides after).
WIRE = {tf.int16: tf.int8, tf.uint16: tf.int8, tf.uint32: tf.int32, tf.uint64: tf.int64}
WIDE = {tf.uint8: tf.int32, tf.int8: tf.int32, tf.uint16: tf.int32, tf.int16: tf.int32}


def to_torch(tensor, reduced=False):
    """A torch tensor sharing `tensor`'s memory where DLPack allows, else a copy; in a
    dtype the engines move (WIRE: a 16-bit tensor gains a last dimension of 2), or with
    `reduced`, one they reduce (WIDE)."""
    tensor = tf.convert_to_tensor(tensor)
    if reduced and tensor.dtype in WIDE:
        tensor = tf.cast(tensor, WIDE[tensor.dtype])
    elif tensor.dtype in WIRE:
        tensor = tf.bitcast(tensor, WIRE[tensor.dtype])
    try:
        return torch.from_dlpack(tf.experimental.dlpack.to_dlpack(tensor))
    except Exception:                    # noqa: BLE001 -- e.g. a dtype DLPack lacks
        return torch.from_numpy(np.array(tensor.numpy(), copy=True))


def to_tf(tensor, dtype=None):
    """A TensorFlow tensor with `tensor`'s values (shared through DLPack where possible),
    of `dtype` (what to_torch sent: WIRE's bits back, or WIDE's values cast back)."""
    tensor = tensor.detach().contiguous()
    if tensor.data_ptr() % ALIGNMENT:    # a view into a bucket: TF refuses unaligned memory
        tensor = tensor.clone()
    try:
        out = tf.experimental.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(tensor))
    except Exception:                    # noqa: BLE001
        out = tf.convert_to_tensor(tensor.cpu().numpy())
    if dtype is None or out.dtype == dtype:
        return out
    return tf.bitcast(out, dtype) if WIRE.get(dtype) == out.dtype else tf.cast(out, dtype)


def run(func, inputs, types, name):
    """`func(*eager inputs)` now (eager), or as a graph op inside a tf.function.

    `types` are the output dtypes (a list: `func` returns a list). In a graph the
    outputs' static shapes are unknown; callers set what they know.

    Errors are TensorFlow's too, as Horovod's ops raise them: eagerly a mismatch
    between ranks is also a tf.errors.FailedPreconditionError, and a ValueError or
    TypeError from the collective also a tf.errors.InvalidArgumentError (what
    TensorFlow makes of those in a graph, where every other Python exception,
    a mismatch included, becomes its UnknownError: py_function's rule; an engine
    failure is kept for elastic `run`, keeping_failures).
    """
    if tf.executing_eagerly():
        try:
            return list(func(*inputs))
        except (ValueError, TypeError) as exc:
            raise as_tf_error(exc) from exc
    from pipe_horovod.keras.tensorflow_path import keeping_failures

    return tf.py_function(keeping_failures(func), list(inputs), list(types), name=name)


def as_tf_error(exc):
    """`exc` as an instance of its own class and of the TensorFlow error Horovod raises."""
    kind = (tf.errors.FailedPreconditionError if isinstance(exc, MismatchError)
            else tf.errors.InvalidArgumentError)
    if isinstance(exc, kind):
        return exc
    error = _both(type(exc), kind).__new__(_both(type(exc), kind))
    kind.__init__(error, None, None, str(exc))
    error.args = exc.args
    return error


@functools.lru_cache(maxsize=None)
def _both(cls, kind):
    return type(cls.__name__, (cls, kind), {"__module__": cls.__module__,
                                            "__str__": kind.__str__})


def refuse_xla(what):
    """A collective here is a Python call: XLA cannot compile it (jit_compile=True)."""
    from pipe_horovod.keras.tensorflow_path import in_xla_context

    if in_xla_context():
        raise ValueError(f"{what} cannot run inside an XLA-compiled tf.function "
                         "(jit_compile=True): pipe_horovod's collectives run outside the graph; "
                         "use tf.function(jit_compile=False) for the step that calls it")


def is_keras_variable(value):
    """A Keras 3 variable (model.variables on the TensorFlow backend): assignable, and
    converted to a tensor by tf.convert_to_tensor."""
    import keras

    return isinstance(value, keras.Variable)
