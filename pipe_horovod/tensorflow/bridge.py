"""The one bridge between TensorFlow and the engines, which work on torch tensors.

Horovod's TensorFlow ops do not build against TensorFlow >= 2.16 (DESIGN.md),
so every collective of pipe_horovod.tensorflow and of Keras on TensorFlow runs
on a torch view of a TensorFlow buffer. What crossing needs, said once here:

- Memory is shared through DLPack, never copied behind the user's back: a
  GPU tensor stays on its GPU, where NCCL reduces it. Every numeric dtype
  (floats, bfloat16, complex, bool, signed and unsigned integers) crosses
  this way. No dtype falls back to NumPy: a DLPack failure raises, naming the
  tensor and the reason (a silent `.numpy()` was a copy to the host and a
  reduction on the CPU). tf.string, resource and variant tensors are refused
  with a TypeError before DLPack is asked (TensorFlow aborts the process on
  them). The one NumPy route is a choice, not a fallback: Keras's CPU data
  path (`NumPy` below) takes its gradients through `tf.numpy_function`,
  whose inputs are zero-copy views of TensorFlow's buffers.
- The torch device is where the tensor's memory is, not TensorFlow's name for
  it. TensorFlow numbers its GPUs among those it sees (after
  `tf.config.set_visible_devices(gpus[local_rank])`, its GPU:0 is the physical
  GPU local_rank) and writes that logical number into the DLPack capsules it
  makes; torch numbers every GPU the process sees. Each GPU capsule's device
  is translated both ways through TensorFlow's own map (`torch_ordinals`).
- TensorFlow's CPU kernels need 64-byte aligned buffers (misaligned memory
  aborts the process in Eigen): a torch view that starts elsewhere (a
  gradient inside a bucket) crosses as an aligned copy (ALIGNMENT).
- Streams: TensorFlow's `to_dlpack` returns once the memory is ready, but
  TensorFlow knows nothing of torch's streams. Before a torch result is handed
  to TensorFlow, and before a hand-off returns (TensorFlow may then reuse the
  buffers torch was reading), torch's current stream on each GPU involved is
  synchronized (`settle`).
- TensorFlow's GPU allocator takes nearly all of a GPU's memory at start-up,
  leaving torch none for its buckets: `leave_torch_room` turns on memory
  growth (Horovod's TF2 examples do this by hand), unless the user chose.

Inside a `tf.function` a hand-off is a `tf.py_function` (stateful, so the
automatic control dependencies keep collectives in program order on every
rank, which is what matches unnamed collectives across ranks); eagerly it runs
directly (`run`). An engine failure raised inside a graph comes out of
TensorFlow as its own error; the failure travels with that error alone
(`keeping_failures`, `failure_behind`).
"""
import contextlib
import ctypes
import functools
import os
import threading
import warnings

import numpy as np
import tensorflow as tf
import torch

from .. import engine
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

# Dtypes DLPack has no code for: TensorFlow aborts the process when asked to export them.
_NOT_NUMERIC = (tf.string, tf.resource, tf.variant)


# --- devices ----------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def torch_ordinals():
    """torch's CUDA ordinal of each TensorFlow logical GPU, in TensorFlow's order.

    TensorFlow makes its logical GPUs from the visible physical ones in order, one
    each or one per virtual device configured on it; a physical device's number is
    the CUDA ordinal, which torch uses too. Kept after the first call: the map is
    fixed once TensorFlow has a GPU tensor (set_visible_devices refuses after that).
    """
    ordinals = []
    for device in tf.config.get_visible_devices("GPU"):
        physical = int(device.name.rsplit(":", 1)[1])
        virtual = tf.config.get_logical_device_configuration(device)
        ordinals += [physical] * (len(virtual) if virtual else 1)
    return tuple(ordinals)


def torch_device(value):
    """The torch device holding `value`'s memory.

    Args:
        value: a tf.Tensor, tf.Variable or Keras variable, or a TensorFlow device
            name ("/job:localhost/replica:0/task:0/device:GPU:0").

    Returns:
        cpu, or cuda:<the CUDA ordinal of the GPU TensorFlow placed it on> (not
        TensorFlow's logical index: the two differ after set_visible_devices).
    """
    if isinstance(value, str):
        name = value
    else:
        if hasattr(value, "path"):                    # a Keras 3 variable: its tf.Variable
            value = value.value
        name = getattr(value, "backing_device", None) or getattr(value, "device", None)
    spec = tf.DeviceSpec.from_string(name or "/device:CPU:0")
    if spec.device_type != "GPU":
        return torch.device("cpu")
    return torch.device("cuda", _physical(spec.device_index or 0))


def _physical(logical):
    ordinals = torch_ordinals()
    if logical >= len(ordinals):
        raise ValueError(f"TensorFlow's GPU:{logical} is not among its visible GPUs "
                         f"(torch's CUDA ordinals {list(ordinals)})")
    return ordinals[logical]


def _logical(ordinal):
    ordinals = torch_ordinals()
    if ordinal not in ordinals:
        raise ValueError(f"torch's cuda:{ordinal} is not a GPU TensorFlow sees (its GPUs are "
                         f"torch's {['cuda:%d' % o for o in ordinals]}): "
                         "tf.config.set_visible_devices hid it")
    return ordinals.index(ordinal)


# A DLPack capsule's DLTensor starts with its data pointer and its device.
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLTensorHead(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice)]


_CAPSULE = b"dltensor"
_CUDA = 2                                   # DLPack's kDLCUDA
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def capsule_device(capsule):
    """The DLPack device (type, id) a capsule carries."""
    head = _DLTensorHead.from_address(_capsule_pointer(capsule, _CAPSULE))
    return head.device.device_type, head.device.device_id


def _renumber(capsule, number):
    """Give a CUDA capsule's device the id number(id): TensorFlow's logical index and
    torch's ordinal are both written there, by whichever framework made it."""
    head = _DLTensorHead.from_address(_capsule_pointer(capsule, _CAPSULE))
    if head.device.device_type == _CUDA:
        head.device.device_id = number(head.device.device_id)
    return capsule


# --- streams ------------------------------------------------------------------------------
_touched = threading.local()                # the GPUs a hand-off on this thread read from


def _note(device):
    if device.type == "cuda":
        if not hasattr(_touched, "devices"):
            _touched.devices = set()
        _touched.devices.add(device)


def settle(devices=None):
    """Wait for torch's current stream on `devices` (default: every GPU the hand-offs of
    this thread read from since the last settle): what torch enqueued on a TensorFlow
    buffer or result must be done before TensorFlow, which runs on its own streams, reads
    or reuses that memory."""
    if devices is None:
        devices, _touched.devices = getattr(_touched, "devices", set()), set()
    for device in devices:
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()


# --- values across ---------------------------------------------------------------------
def _described(tensor):
    try:
        name = tensor.name                   # a graph tensor's or a variable's
    except AttributeError:                   # an EagerTensor has none
        name = None
    return (f"{'tensor ' + repr(name) + ' ' if name else 'a tensor '}of shape "
            f"{tuple(tensor.shape)} and dtype {tensor.dtype.name}")


def _refuse_non_numeric(tensor):
    if tensor.dtype in _NOT_NUMERIC:
        raise TypeError(f"{_described(tensor)} cannot reach the engines: only numeric and "
                        f"bool tensors cross to torch (DLPack has no {tensor.dtype.name})")


def to_torch(tensor, reduced=False):
    """A torch tensor sharing `tensor`'s memory (share_with_torch), in a dtype the engines
    move (WIRE: a 16-bit tensor gains a last dimension of 2), or with `reduced`, one
    they reduce (WIDE)."""
    tensor = tf.convert_to_tensor(tensor)
    _refuse_non_numeric(tensor)
    if reduced and tensor.dtype in WIDE:
        return share_with_torch(tf.cast(tensor, WIDE[tensor.dtype]), tensor)
    if tensor.dtype in WIRE:
        return share_with_torch(tf.bitcast(tensor, WIRE[tensor.dtype]), tensor)
    return share_with_torch(tensor)


def share_with_torch(tensor, described=None):
    """A torch tensor sharing `tensor`'s memory through DLPack, on the torch device that
    holds it (not TensorFlow's logical index: torch_ordinals).

    Raises:
        TypeError: a string, resource or variant tensor.
        RuntimeError: DLPack failed: the message names the tensor (`described`, where
            `tensor` is a converted form of it) and the reason.
    """
    _refuse_non_numeric(tensor)
    try:
        out = torch.from_dlpack(_renumber(tf.experimental.dlpack.to_dlpack(tensor), _physical))
    except Exception as exc:             # noqa: BLE001 -- said, with the tensor
        raise RuntimeError(f"{_described(tensor if described is None else described)} could "
                           f"not be shared with torch through DLPack: {type(exc).__name__}: "
                           f"{exc}") from exc
    _note(out.device)
    return out


def to_tf(tensor, dtype=None):
    """A TensorFlow tensor with `tensor`'s values (share_with_tf), of `dtype` (what
    to_torch sent: WIRE's bits back, or WIDE's values cast back)."""
    out = share_with_tf(tensor)
    if dtype is None or out.dtype == dtype:
        return out
    return tf.bitcast(out, dtype) if WIRE.get(dtype) == out.dtype else tf.cast(out, dtype)


def share_with_tf(tensor):
    """A TensorFlow tensor sharing `tensor`'s memory through DLPack (an aligned copy where
    the view starts off ALIGNMENT), on the GPU TensorFlow knows it by, once torch's
    stream has finished writing it.

    Raises:
        RuntimeError: DLPack failed: the message names the tensor and the reason.
    """
    tensor = tensor.detach().contiguous()
    if tensor.data_ptr() % ALIGNMENT:    # a view into a bucket: TF refuses unaligned memory
        tensor = tensor.clone()
    if tensor.is_cuda:                   # TensorFlow reads it on its own stream
        settle([tensor.device])
    try:
        return tf.experimental.dlpack.from_dlpack(
            _renumber(torch.utils.dlpack.to_dlpack(tensor), _logical))
    except Exception as exc:             # noqa: BLE001 -- said, with the tensor
        raise RuntimeError(f"a torch tensor of shape {tuple(tensor.shape)} and dtype "
                           f"{tensor.dtype} on {tensor.device} could not be handed to "
                           f"TensorFlow through DLPack: {type(exc).__name__}: {exc}") from exc


def run(func, inputs, types, name):
    """`func(*eager inputs)` now (eager), or as a graph op inside a tf.function.

    `types` are the output dtypes (a list: `func` returns a list). In a graph the
    outputs' static shapes are unknown; callers set what they know.

    Errors are TensorFlow's too, as Horovod's ops raise them: eagerly a mismatch
    between ranks is also a tf.errors.FailedPreconditionError, and a ValueError or
    TypeError from the collective also a tf.errors.InvalidArgumentError (what
    TensorFlow makes of those in a graph, where every other Python exception,
    a mismatch included, becomes its UnknownError: py_function's rule; an engine
    failure travels with that error, keeping_failures).
    """
    if tf.executing_eagerly():
        try:
            return list(func(*inputs))
        except (ValueError, TypeError) as exc:
            raise as_tf_error(exc) from exc
        finally:
            settle()
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


# --- engine failures through TensorFlow's error path ----------------------------------------
# A failure raised inside a hand-off, by its own words, which its TensorFlow error's message
# carries: only that error maps back (failure_behind), once; an unread one goes with the
# oldest. The words are the failure's own, so what the user reads is unchanged.
_carried = []
_KEPT = 16


def _words(failure):
    return f"{type(failure).__name__}: {failure}"


def keeping_failures(fn):
    """`fn` (a hand-off the graph calls back), its engine failures kept for the TensorFlow
    error they become: TensorFlow reports an exception inside a py_function (or
    numpy_function) as its own UnknownError, and elastic training must see the
    HorovodInternalError or HostsUpdatedInterrupt behind it (failure_behind). Also
    settles torch's streams before TensorFlow has its buffers back (settle)."""
    @functools.wraps(fn)
    def call(*args):
        try:
            return fn(*args)
        except (engine.HorovodInternalError, engine.HostsUpdatedInterrupt) as failure:
            _carried.append(failure)
            del _carried[:-_KEPT]
            raise
        finally:
            settle()
    return call


def failure_behind(error):
    """The engine failure a TensorFlow error raised by a train step stands for, or None.

    Args:
        error: an exception that left model.fit (or a train step).

    Returns:
        The HorovodInternalError or HostsUpdatedInterrupt a hand-off raised, when `error`
        is the TensorFlow error that carried it (its message holds the failure's own
        words: type and text); once (it is forgotten). None for any other error,
        TensorFlow's own included: a later out-of-memory error is not the failure.
    """
    if not isinstance(error, tf.errors.OpError):
        return None
    message = getattr(error, "message", None) or str(error)
    for i in range(len(_carried) - 1, -1, -1):
        if _words(_carried[i]) in message:
            return _carried.pop(i)
    return None


# --- graphs -------------------------------------------------------------------------------
def in_xla_context():
    """Whether the graph being traced is XLA-compiled (jit_compile=True): a hand-off to
    Python (tf.py_function, numpy_function) cannot run there."""
    from tensorflow.python.ops import control_flow_util

    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def refuse_xla(what, remedy="use tf.function(jit_compile=False) for the step that calls it"):
    """A collective here is a Python call: XLA cannot compile it (jit_compile=True).

    Raises:
        ValueError: inside an XLA-compiled graph, naming `what` and the `remedy`.
    """
    if in_xla_context():
        raise ValueError(f"{what} cannot run inside an XLA-compiled tf.function "
                         f"(jit_compile=True): pipe_horovod's collectives run outside the "
                         f"graph; {remedy}")


@contextlib.contextmanager
def eager_variables():
    """Variables made in this context are made eagerly, initialized at once, and not
    reported to a tf.function being traced: it traces its function again when that
    function made variables on its first trace, and a train step's trace is most of a
    short fit (the optimizer is Keras's to build inside it). Only for variables that
    exist once per Python object, as an optimizer's do: a later trace finds them built."""
    def made_here(next_creator, **kwargs):
        kwargs["experimental_enable_variable_lifting"] = False
        return next_creator(**kwargs)
    with tf.init_scope(), tf.variable_creator_scope(made_here):
        yield


def is_keras_variable(value):
    """A Keras 3 variable (model.variables on the TensorFlow backend): assignable, and
    converted to a tensor by tf.convert_to_tensor."""
    import keras

    return isinstance(value, keras.Variable)


# --- graph ops that hand whole buckets over (Keras's data path) ---------------------------
class NumPy:
    """CPU tensors: numpy_function's inputs are views of TF's buffers (no copy in)."""

    @staticmethod
    def op(func, inputs, types, name):
        return tf.numpy_function(func, inputs, types, stateful=True, name=name)

    to_torch = staticmethod(torch.from_numpy)

    @staticmethod
    def to_tf(tensor):
        return tensor.cpu().numpy()

    flag = staticmethod(np.bool_)
    count = staticmethod(np.int64)


class DLPack:
    """Tensors stay on their device: TF and torch share the memory through DLPack."""

    @staticmethod
    def op(func, inputs, types, name):
        return tf.py_function(func, inputs, types, name=name)

    to_torch = staticmethod(share_with_torch)
    to_tf = staticmethod(share_with_tf)

    @staticmethod
    def flag(value):
        return tf.constant(value)

    @staticmethod
    def count(value):
        return tf.constant(value, tf.int64)


# --- GPU memory ---------------------------------------------------------------------------
MEMORY_GROWTH = "PIPE_HOROVOD_TF_MEMORY_GROWTH"


def leave_torch_room():
    """Turn on TensorFlow's memory growth on every GPU, so torch (the engines' buckets,
    NCCL) finds memory beside it: TensorFlow's allocator otherwise takes nearly all of a
    GPU when it starts. Left alone: GPUs given virtual devices or a memory limit, and
    everything when TF_FORCE_GPU_ALLOW_GROWTH is set or $PIPE_HOROVOD_TF_MEMORY_GROWTH=0
    (the user's choice). Too late once TensorFlow has started on its GPUs: said once.

    Returns:
        The physical GPUs it turned memory growth on for.
    """
    if os.environ.get(MEMORY_GROWTH, "1") == "0" or "TF_FORCE_GPU_ALLOW_GROWTH" in os.environ:
        return []
    grown = []
    for gpu in tf.config.list_physical_devices("GPU"):
        if tf.config.get_logical_device_configuration(gpu):
            continue
        try:
            if not tf.config.experimental.get_memory_growth(gpu):
                tf.config.experimental.set_memory_growth(gpu, True)
                grown.append(gpu)
        except RuntimeError as exc:          # TensorFlow initialized its GPUs already
            warnings.warn(f"pipe_horovod could not turn on TensorFlow's memory growth ({exc}):"
                          " TensorFlow may hold the GPU memory torch's buckets need; import "
                          "pipe_horovod.tensorflow before TensorFlow touches the GPU, or call "
                          "tf.config.experimental.set_memory_growth yourself", stacklevel=2)
            break
    return grown


leave_torch_room()          # before TensorFlow starts on its GPUs, where it can still count
