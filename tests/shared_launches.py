"""Launches that several test files share (launcher.run_case): start-up is most of a small
launch's time, so the checks of one engine and size run in one launch whichever file
they belong to. A file run alone starts the launch itself; in one session the first test
that needs a launch starts it and the others read its output (launcher.run_once).
"""

import sys

import launcher

# The files that read one launch (below, and keras_launches.fit_launch): under pytest-xdist
# they run on one worker (conftest.py), which then starts the launch once.
SHARING = [
    {"test_optimizer", "test_engine", "test_hardening_engine", "test_plan_from_run",
     "test_staleness"},                                             # OPTIMIZER, RESUMED
    {"test_collectives", "test_quantized_allreduce", "test_horovod_api"},  # collectives_case
    {"test_hardening_optimizer", "test_misuse_optimizer"},          # hardening_case
    {"test_image", "test_examples_keras"},                          # digits_comparison
    {"test_keras", "test_memory", "test_tensorflow"},               # keras_launches
]


def worker_share(nodeid):
    """What must run on one worker: a test's file, or the files that share its launches."""
    module = nodeid.split("::")[0].rsplit("/", 1)[-1].removesuffix(".py")
    return next((min(files) for files in SHARING if module in files), module)


# --- tests/workers/optimizer_worker.py: test_optimizer.py and test_engine.py ----------------
# Beside the optimizer's own cases (oracle, features, param-group, process-set: last of
# those, as it leaves a set behind) they run engine_worker's checks (engine-ENGINE-SIZE:
# first, on the fresh engine), sparse_worker's, horovod_compare_worker's, mismatch_worker's,
# hardening_engine_worker's (test_hardening_engine: hardening-MODE, before the mismatches),
# checkpoint_worker's saving runs (save-KIND-DEPTH-COMPENSATION) and no_flush_worker's
# (no-flush-DEPTH: last, the launch then ends without shutdown() as a script does),
# run_summary_worker's (run-summary: the measured-run record, test_plan_from_run.py),
# staleness_worker's (staleness: every option named) and the feature and process-set checks
# under the default compensation (default-MODE; both test_staleness.py); a second launch per
# engine resumes the checkpoints (RESUMED).
HARDENING_ENGINE = ["hardening-names", "hardening-intavg", "hardening-autograd",
                    "hardening-optstate"]
OPTIMIZER = {("local", 1): ["engine-local-1", "oracle", "features", "param-group", "sparse",
                            "staleness", *HARDENING_ENGINE],
             ("horovod", 2): ["features", "default-features", "param-group", "sparse",
                              "staleness", "horovod-compare",
                              *HARDENING_ENGINE, "mismatch", "save-sgd-3-none",
                              "save-sgd-2-none", "no-flush-3"],
             ("horovod", 3): ["engine-horovod-3", "oracle", "features", "process-set"],
             ("torch", 2): ["features", "hardening-intavg", "hardening-optstate", "mismatch",
                            "run-summary", "no-flush-2"],
             ("torch", 3): ["engine-torch-3", "oracle", "features", "param-group", "sparse",
                            "staleness", "save-adam-3-none", "save-sgd-2-lookahead",
                            "process-set", "default-process-set"]}
RESUMED = {("horovod", 2): ["resume-sgd-3-none", "resume-rank0-sgd-2-none", "no-flush-2"],
           ("torch", 3): ["resume-adam-3-none", "resume-rank0-sgd-2-lookahead"]}


def optimizer_folder(tmp_path_factory):
    """Where the checkpoint cases keep their files: one for the session, as the launches
    are (the folder is one of the launch's arguments, so every test names the same)."""
    path = tmp_path_factory.getbasetemp() / "optimizer-launches"
    path.mkdir(exist_ok=True)
    return path


def optimizer_case(folder, engine_name, np, case, launches=OPTIMIZER):
    """Asserts `case` of its launch (OPTIMIZER or RESUMED); returns the launch's output."""
    launcher.skip_without(engine_name)
    # Horovod adds a set after init only with HOROVOD_DYNAMIC_PROCESS_SETS=1, as users must.
    args = ("optimizer_worker.py", launches[engine_name, np], case, folder)
    kw = {"timeout": 480, "env": {"HOROVOD_DYNAMIC_PROCESS_SETS": "1"}}
    launcher.run_case(engine_name, np, *args, **kw)
    return launcher.run_once(engine_name, np, args[0], ",".join(args[1]), folder, **kw)[1]


# --- tests/workers/collectives_worker.py: test_collectives.py, test_quantized_allreduce.py,
# test_horovod_api.py -----------------------------------------------------------------------
# api: Horovod's non-optimizer API against its oracle (api_worker.py), first, on the engine
# fresh from init with the worker's static process set (so the 2-rank horovod launch runs
# Horovod's static sets only: nothing else there adds one); its 3-rank horovod case stays a
# launch of its own, as quantized adds a set to the dynamic mode there after another set
# was used (Horovod 0.28.1 with Gloo hung in that order). collectives: every algorithm x op x
# dtype x size x codec case; collectives-all adds the optimizer with collective= (and DDP's
# hooks on torch). digits-int8: the digits example synchronous and with int8 + error
# feedback (digits_int8_worker.py). quantized: the two-stage allreduce against its
# reference (quantized_worker.py); quantized-all adds training and the resume. The
# quantized cases end by shutting the engine down with a reduction in flight, so they
# come last.
COLLECTIVES = {("horovod", 2): ["api", "collectives-all", "digits-int8", "quantized-all"],
               ("horovod", 3): ["collectives-all", "quantized"],
               ("horovod", 4): ["quantized"],
               ("torch", 2): ["api", "collectives-all", "quantized"],
               ("torch", 3): ["api", "collectives", "quantized-all"],
               ("torch", 4): ["collectives-all", "quantized"],
               ("local", 1): ["api", "quantized-all"]}


def collectives_case(engine_name, np, case):
    launcher.skip_without(engine_name)
    launcher.run_case(engine_name, np, "collectives_worker.py", COLLECTIVES[engine_name, np],
                      case, engine_name, np, timeout=420, env={"PIPE_HOROVOD_TIMEOUT": "120"})


# --- tests/workers/hardening_worker.py: test_hardening_optimizer.py, test_misuse_optimizer.py
# The optimizer defects a review found, then optimizer misuse (misuse_optimizer_worker.py:
# last, as its errors raised inside step() leave reductions in flight).
HARDENING_LAUNCHES = [("local", 1), ("horovod", 2), ("torch", 2)]
HARDENING = ["threads", "skipped", "rollback", "rewrap", "misuse"]


def hardening_case(engine_name, np, case):
    launcher.skip_without(engine_name)
    launcher.run_case(engine_name, np, "hardening_worker.py", HARDENING, case, timeout=300)


# --- examples/compare_digits.py on this machine: test_examples_keras.py, test_image.py -------
# test_examples_keras checks the Keras comparison's output; test_image compares the image's
# accuracies with this machine's, the same runs (2 workers, the default seed). One epoch:
# any difference between what the two compute shows after the epoch's 23 steps as after 69.
# --tolerance 100: a run that finishes exits 0 (1 epoch is too short for `make run`'s
# 1-point verdict); --timeout: each run's start-up alone can pass the default 300 s on a
# loaded machine.
# PIPE_HOROVOD_TUNE=off: the default row's auto decides on step times, which differ between
# the container and here; the comparison checks the same arithmetic, so both run the
# configuration as given (K=2). make run itself runs the real default.
DIGITS_ARGS = ("--np", "2", "--epochs", "1", "--tolerance", "100", "--timeout", "900")
DIGITS_ENV = {"PIPE_HOROVOD_TUNE": "off"}
_DIGITS = {}


def digits_comparison(tmp_path_factory, framework):
    """`compare_digits.py --framework FRAMEWORK` here, once per session: (exit code, output,
    the folder of its logs and comparison.json)."""
    if framework not in _DIGITS:
        out = tmp_path_factory.mktemp(f"digits-{framework}")
        cmd = [sys.executable, launcher.REPO / "examples" / "compare_digits.py",
               "--framework", framework, *DIGITS_ARGS, "--out-dir", out,
               "--json", out / "comparison.json"]
        _DIGITS[framework] = (*launcher.run_command(cmd, 1, timeout=2 * 900 + 60,
                                                    env=DIGITS_ENV, expect_ok=False), out)
    return _DIGITS[framework]
