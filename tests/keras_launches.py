"""The Keras fit launches that several test files read (launcher.run_once): one per engine
and backend, each running many modes of tests/workers/keras_worker.py, since every rank pays
7-8 s of Keras and TensorFlow imports. test_keras.py checks the fit modes and the checkpoint
test's first half, test_tensorflow.py the custom-loop cases (tf.*) of the TensorFlow ones,
test_memory.py the Keras adapter's memory (memory) in the one-process TensorFlow launch."""

import launcher

# The overlap check runs in one process on the torch backend (a real engine, the fp16 codec
# so buckets go through it) and on 2 ranks under torchrun on TensorFlow, timed per step
# (keras_worker.StepClock says why).
# The staleness compensation's cases run in the launches that exist anyway; under horovodrun
# on the torch backend only (its TensorFlow traces would add ~12 s to the suite). In one
# TensorFlow process only the oracle runs: the torchrun launch checks the rest on
# TensorFlow with the same code (42 s of the suite's 20 minutes otherwise).
# On several ranks `staleness` runs `settings` too (it was also a mode of its own in the
# torchrun launches: its two fits ran twice).
MODES = {"local": "oracle,staleness,errors,callbacks,overlap",
         "torch": "oracle,staleness,errors,callbacks,aggregation",
         "horovod": "oracle,callbacks,metrics"}
EXTRA_MODES = {("horovod", "torch"): ",staleness", ("torch", "tensorflow"): ",auto,overlap",
               ("torch", "torch"): ",auto"}
ONLY_MODES = {("local", "tensorflow"): "memory,oracle"}
# test_memory's measurement of the Keras adapter on TensorFlow (keras_memory_worker with
# these arguments) needs one fresh TensorFlow process started with the BFC allocator: the
# one-process TensorFlow launch, first (a TensorFlow start-up of its own spared; the
# allocator does not change what the oracle computes).
MEMORY_ARGS = ("--widths", "1024", "--steps", "3", "--optimizers", "sgd-momentum",
               "--predivide", "2", "--configs", "keras,ours-k2,ours-k2-default")
MEMORY_LAUNCH = ("local", "tensorflow")
LAST_MODE = ",api"           # rank 0 alone builds optimizers there: nothing may follow
# The path GPU tensors take on TensorFlow (tf.py_function + DLPack) is forced on CPU in the
# horovodrun launch; the others take NumPy's (a launch of its own cost 19 s).
DLPACK_LAUNCH = ("horovod", "tensorflow")
# pipe_horovod.tensorflow's custom-loop cases (tensorflow_worker.py, test_tensorflow.py) run
# in the TensorFlow fit launch of their engine, before the checkpoint modes: one TensorFlow
# start-up per engine instead of two (three launches, 8-13 s of start-up each, saved).
TF_CASES = ("api", "tape", "optimizer", "checkpoint", "align", "errors", "partial",
            "autodiff", "auto")
TF_MODES = "".join(f",tf.{case}" for case in TF_CASES)
# The checkpoint test's first launch (fit, and save with gradients in flight) is the fit
# launch of its engine and backend (two launches of ~10 s start-up each saved); before
# overlap (its slowed reductions stay) and api. Its resume stays a launch of its own: new
# processes are the point.
# midsave (files written mid-epoch hold the real weights) rides along on TensorFlow: its
# prediction shows on several ranks only.
CHECKPOINT_MODES = {("torch", "tensorflow"): ",full,save,midsave",
                    ("horovod", "torch"): ",full,save"}
CHECKPOINT_DEPTH = 3
_FIT_DIRS = {}


def fit_launch(tmp_path_factory, engine_name, backend, np_):
    """The fit launch of this engine and backend, run once in the session, since the
    checkpoint test reads it too: (its folder, exit code, output)."""
    key = (engine_name, backend)
    if key not in _FIT_DIRS:
        _FIT_DIRS[key] = tmp_path_factory.mktemp(f"keras-{engine_name}-{backend}")
    tmp = _FIT_DIRS[key]
    modes = ONLY_MODES.get(key, MODES[engine_name]) + (TF_MODES if backend == "tensorflow" else "")
    if key not in ONLY_MODES:
        modes += CHECKPOINT_MODES.get(key, "") + EXTRA_MODES.get(key, "") + LAST_MODE
    args = (CHECKPOINT_DEPTH, tmp / "full.npz", tmp / "m.keras") if key in CHECKPOINT_MODES \
        else ()
    env = {"KERAS_BACKEND": backend, "PIPE_HOROVOD_TEST_DIR": str(tmp)}
    if key == MEMORY_LAUNCH:
        env["TF_CPU_ALLOCATOR_USE_BFC"] = "true"    # counts its bytes only as BFC
    if key == DLPACK_LAUNCH:
        env["PIPE_HOROVOD_KERAS_TRANSFER"] = "dlpack"
    return (tmp, *launcher.run_once(engine_name, np_, "keras_worker.py", modes, *args,
                                    timeout=600, env=env))
