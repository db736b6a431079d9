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
import numpy as np
import tensorflow as tf
import torch


# TensorFlow's CPU kernels require 64-byte aligned buffers (a DLPack import of anything
# else aborts the process); torch allocates so aligned, but slices need not be.
ALIGNMENT = 64


def to_torch(tensor):
    """A torch tensor sharing `tensor`'s memory where DLPack allows, else a copy."""
    tensor = tf.convert_to_tensor(tensor)
    try:
        return torch.from_dlpack(tf.experimental.dlpack.to_dlpack(tensor))
    except Exception:                    # noqa: BLE001 -- e.g. a dtype DLPack lacks
        return torch.from_numpy(np.array(tensor.numpy(), copy=True))


def to_tf(tensor, dtype=None):
    """A TensorFlow tensor with `tensor`'s values (shared through DLPack where possible)."""
    tensor = tensor.detach().contiguous()
    if tensor.data_ptr() % ALIGNMENT:    # a view into a bucket: TF refuses unaligned memory
        tensor = tensor.clone()
    try:
        out = tf.experimental.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(tensor))
    except Exception:                    # noqa: BLE001
        out = tf.convert_to_tensor(tensor.cpu().numpy())
    return out if dtype is None or out.dtype == dtype else tf.cast(out, dtype)


def run(func, inputs, types, name):
    """`func(*eager inputs)` now (eager), or as a graph op inside a tf.function.

    `types` are the output dtypes (a list: `func` returns a list). In a graph the
    outputs' static shapes are unknown; callers set what they know.
    """
    if tf.executing_eagerly():
        return list(func(*inputs))
    return tf.py_function(func, list(inputs), list(types), name=name)


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
