"""The TensorFlow <-> torch bridge (pipe_horovod/tensorflow/bridge.py) and the seams around it.

In one process, on the local engine. A gradient_predivide_factor other than 1 keeps
the local engine's step machine sending (not `solo`), so the tape's gradients land in
its slot buffers as they do across ranks. What a GPU needs is checked with TensorFlow's
and torch's device queries faked: none is here.
"""
import gc
import os
import subprocess
import sys
import textwrap
import weakref

import pytest

tf = pytest.importorskip("tensorflow")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
keras = pytest.importorskip("keras")
torch = pytest.importorskip("torch")

import pipe_horovod.tensorflow as hvd  # noqa: E402
from pipe_horovod.engine import HorovodInternalError  # noqa: E402
from pipe_horovod.pipeline.local_scale import LocalScale  # noqa: E402
from pipe_horovod.tensorflow import bridge, gradient_tape  # noqa: E402

SENDING = {"gradient_predivide_factor": 2.0}     # exact: a split of a power of two


@pytest.fixture
def local():
    hvd.init(engine="local")
    yield
    hvd.shutdown()


def _tape_gradient(variable, factor, depth, **options):
    """d/dv sum(v * factor) = factor everywhere, through a DistributedGradientTape."""
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(variable * factor)
    tape = hvd.DistributedGradientTape(tape, pipeline_depth=depth, **SENDING, **options)
    return tape.gradient(loss, [variable])[0]


# --- returned gradients keep their values -------------------------------------------------
@pytest.mark.parametrize("depth", [1, 2])
def test_an_eagerly_returned_gradient_keeps_its_value(local, depth):
    """Step s's gradient is 2s+1 (returned at step s + depth - 1; zeros before). Each one
    kept, and an accumulation `accum = grads, then accum + next`, must read what it was
    when returned: a view of a slot buffer changed when the slot was refilled."""
    v = tf.Variable(tf.zeros(3))
    kept, accum = [], None
    for step in range(5):
        g = _tape_gradient(v, float(2 * step + 1), depth)
        kept.append(g)
        accum = g if accum is None else accum + g
    expected = [0.0] * (depth - 1) + [2.0 * s + 1 for s in range(5 - depth + 1)]
    assert [g.numpy().tolist() for g in kept] == [[e] * 3 for e in expected]
    assert accum.numpy().tolist() == [sum(expected)] * 3
    left = hvd.flush([v])
    assert [[g.numpy().tolist() for g in grads] for grads in left] == [[[9.0] * 3]] * (depth - 1)


@pytest.mark.parametrize("depth", [1, 2])
def test_a_gradient_a_tf_function_returns_keeps_its_value(local, depth):
    v = tf.Variable(tf.zeros(2))

    @tf.function
    def step(factor):
        return _tape_gradient(v, factor, depth)
    kept = [step(tf.constant(float(2 * s + 1))) for s in range(4)]
    expected = [0.0] * (depth - 1) + [2.0 * s + 1 for s in range(4 - depth + 1)]
    assert [g.numpy().tolist() for g in kept] == [[e] * 2 for e in expected]


# --- devices ------------------------------------------------------------------------------
@pytest.fixture
def second_gpu_only(monkeypatch):
    """TensorFlow as after tf.config.set_visible_devices(gpus[1]) on a 2-GPU machine (Horovod's
    recipe for local_rank 1): its one GPU, GPU:0, is the CUDA device torch calls cuda:1."""
    gpus = [tf.config.PhysicalDevice(f"/physical_device:GPU:{i}", "GPU") for i in range(2)]
    monkeypatch.setattr(tf.config, "get_visible_devices",
                        lambda kind=None: gpus[1:] if kind == "GPU" else gpus[1:])
    monkeypatch.setattr(tf.config, "get_logical_device_configuration", lambda device: None)
    bridge.torch_ordinals.cache_clear()
    yield
    bridge.torch_ordinals.cache_clear()


def test_the_torch_device_is_the_physical_gpu_not_tensorflows_number(second_gpu_only):
    name = "/job:localhost/replica:0/task:0/device:GPU:0"
    assert bridge.torch_device(name) == torch.device("cuda", 1)

    class Placed:                                 # a tf.Variable or tensor placed there
        device = name
    assert bridge.torch_device(Placed()) == torch.device("cuda", 1)
    assert bridge.torch_device("/job:localhost/replica:0/task:0/device:CPU:0") == \
        torch.device("cpu")
    with pytest.raises(ValueError, match="GPU:1 is not among its visible GPUs"):
        bridge.torch_device("/device:GPU:1")


def test_a_dlpack_capsule_carries_the_device_of_the_framework_that_reads_it(second_gpu_only):
    """TensorFlow writes its logical number into the capsules it makes and reads its own
    numbering from those it takes; torch does the same with its own. The bridge renumbers
    each GPU capsule on its way across (checked on a CPU capsule marked as a GPU's: the
    struct is the same)."""
    capsule = tf.experimental.dlpack.to_dlpack(tf.constant([1.0, 2.0]))
    head = bridge._DLTensorHead.from_address(bridge._capsule_pointer(capsule, bridge._CAPSULE))
    assert bridge.capsule_device(capsule) == (1, 0)                 # kDLCPU, 0
    head.device.device_type = bridge._CUDA
    bridge._renumber(capsule, bridge._physical)                     # TensorFlow -> torch
    assert bridge.capsule_device(capsule) == (bridge._CUDA, 1)
    bridge._renumber(capsule, bridge._logical)                      # torch -> TensorFlow
    assert bridge.capsule_device(capsule) == (bridge._CUDA, 0)
    head.device.device_type = 1
    assert torch.from_dlpack(capsule).tolist() == [1.0, 2.0]        # the capsule still works
    with pytest.raises(ValueError, match="cuda:0 is not a GPU TensorFlow sees"):
        bridge._logical(0)


def test_torch_streams_settle_before_tensorflow_reads(monkeypatch):
    synced = []

    class Stream:
        def __init__(self, device):
            self.device = device

        def synchronize(self):
            synced.append(self.device)
    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    bridge._note(torch.device("cpu"))
    bridge._note(torch.device("cuda", 1))
    bridge.settle()                               # what a hand-off does before it returns
    assert synced == [torch.device("cuda", 1)]
    bridge.settle()
    assert synced == [torch.device("cuda", 1)]    # once: the set is cleared


def test_memory_growth_leaves_torch_room(monkeypatch):
    gpus = [tf.config.PhysicalDevice(f"/physical_device:GPU:{i}", "GPU") for i in range(2)]
    grown = {}
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind=None: gpus)
    monkeypatch.setattr(tf.config, "get_logical_device_configuration",
                        lambda device: ["split"] if device is gpus[1] else None)
    monkeypatch.setattr(tf.config.experimental, "get_memory_growth",
                        lambda device: grown.get(device.name, False))
    monkeypatch.setattr(tf.config.experimental, "set_memory_growth",
                        lambda device, on: grown.__setitem__(device.name, on))
    monkeypatch.delenv("TF_FORCE_GPU_ALLOW_GROWTH", raising=False)
    monkeypatch.setenv(bridge.MEMORY_GROWTH, "0")
    assert bridge.leave_torch_room() == [] and grown == {}          # the user said no
    monkeypatch.delenv(bridge.MEMORY_GROWTH)
    assert bridge.leave_torch_room() == [gpus[0]]                   # GPU 1 was configured
    assert grown == {"/physical_device:GPU:0": True}


# --- no silent host fallback ---------------------------------------------------------------
def test_a_dlpack_failure_raises_naming_the_tensor(monkeypatch):
    def refused(_):
        raise ValueError("refused by the test")
    monkeypatch.setattr(tf.experimental.dlpack, "to_dlpack", refused)
    with pytest.raises(RuntimeError, match=r"a tensor of shape \(2, 3\) and dtype float32 could "
                       "not be shared with torch through DLPack: ValueError: refused by the test"):
        bridge.to_torch(tf.ones((2, 3)))
    monkeypatch.setattr(tf.experimental.dlpack, "from_dlpack", refused)
    with pytest.raises(RuntimeError, match=r"a torch tensor of shape \(4,\) and dtype "
                       "torch.float64 on cpu could not be handed to TensorFlow through DLPack: "
                       "ValueError: refused by the test"):
        bridge.to_tf(torch.zeros(4, dtype=torch.float64))


def test_strings_are_refused_before_dlpack_is_asked():
    with pytest.raises(TypeError, match=r"a tensor of shape \(1,\) and dtype string cannot reach "
                       "the engines"):
        bridge.to_torch(tf.constant(["a"]))


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16, tf.float64, tf.int8, tf.uint8,
                                   tf.int16, tf.uint16, tf.uint32, tf.uint64, tf.int64,
                                   tf.bool, tf.complex64])
def test_every_numeric_dtype_crosses_by_dlpack(dtype):
    value = tf.cast(tf.constant([1, 0, 3]), dtype)
    shared = bridge.share_with_torch(value)
    assert shared.data_ptr() == bridge.share_with_torch(value).data_ptr()   # no copy
    back = bridge.to_tf(bridge.to_torch(value), dtype)
    assert back.dtype == dtype and back.numpy().tolist() == value.numpy().tolist()


# --- pipelines go with their models -----------------------------------------------------
def test_tape_pipelines_go_with_their_models(local):
    """A k-fold loop of throwaway models: each model's pipeline (its slot buffers and its
    gradient in flight) goes with it."""
    freed = []
    for _ in range(3):
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64)])
        _tape_gradient(model.trainable_variables[0], 1.0, 2)
        pipe = gradient_tape._pipelines[next(reversed(gradient_tape._pipelines))]
        assert len(pipe.machine.fifo) == 1                       # a gradient in flight
        freed += [weakref.ref(pipe)] + [weakref.ref(b) for b in pipe.machine._buffers.values()]
        del model, pipe
        gc.collect()
    gc.collect()                                  # what the last model's cycles left
    assert len(freed) == 6 and [ref() for ref in freed] == [None] * 6
    assert not gradient_tape._pipelines and not list(gradient_tape._built)


def test_no_false_unapplied_warning_at_exit_for_models_gone(tmp_path):
    script = tmp_path / "kfold.py"
    script.write_text(textwrap.dedent("""
        import gc, sys
        import tensorflow as tf
        import pipe_horovod.tensorflow as hvd
        hvd.init(engine="local")
        kept = []

        def train(fold):
            v = tf.Variable(tf.zeros(1000))
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(v)
            hvd.DistributedGradientTape(tape, gradient_predivide_factor=2.0).gradient(loss, [v])
            if fold == 2 and sys.argv[1] == "keep":
                kept.append(v)
        for fold in range(3):
            train(fold)
            gc.collect()
        print("FOLDS_DONE", flush=True)
    """))
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3")

    def run(mode):
        done = subprocess.run([sys.executable, str(script), mode], capture_output=True,
                              text=True, timeout=300, env=env)
        out = done.stdout + done.stderr
        assert done.returncode == 0 and "FOLDS_DONE" in out, out
        return out
    assert "were not applied" not in run("free")
    assert "1 computed gradient(s) were not applied" in run("keep")     # still told


# --- one local-scale rule -----------------------------------------------------------------
def test_the_local_scale_is_read_at_use():
    ranks = [4]
    scale = LocalScale(True, lambda: ranks[0])
    assert scale.value == 0.25 and float(scale) == 0.25
    ranks[0] = 2                                  # an elastic reset: 4 ranks -> 2
    assert scale.value == 0.5
    assert scale.apply(torch.ones(2)).tolist() == [0.5, 0.5]
    assert LocalScale(False, lambda: ranks[0]).value == 1.0


def test_the_tape_and_the_keras_path_follow_a_new_size(local):
    v = tf.Variable(tf.zeros(2))
    _tape_gradient(v, 1.0, 1)
    pipe = gradient_tape._existing([v], None)
    pipe.machine.size = 4                         # as attach() after a reset to 4 ranks
    assert pipe.local_scale == 0.25
    if keras.backend.backend() != "tensorflow":
        return
    import pipe_horovod.keras as hvd_keras

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    opt = hvd_keras.PartialDistributedOptimizer(keras.optimizers.SGD(0.1),
                                                local_layers=[model.layers[0]])
    opt.apply_gradients(zip([tf.ones_like(w) for w in model.trainable_variables],
                            model.trainable_variables))
    assert opt._path.local_scale == 1.0
    opt._path.machine.size = 2
    assert opt._path.local_scale == 0.5


# --- engine failures through TensorFlow's error path ------------------------------------
def test_only_the_error_a_failure_raised_maps_back_to_it():
    def collective(x):
        raise HorovodInternalError("a peer left")
    step = tf.function(lambda x: tf.numpy_function(bridge.keeping_failures(collective), [x],
                                                   tf.float32))
    with pytest.raises(tf.errors.OpError) as raised:
        step(tf.constant(1.0))
    later = tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor")
    assert bridge.failure_behind(later) is None            # an unrelated error stays itself
    failure = bridge.failure_behind(raised.value)
    assert isinstance(failure, HorovodInternalError) and str(failure) == "a peer left"
    assert bridge.failure_behind(raised.value) is None     # once
