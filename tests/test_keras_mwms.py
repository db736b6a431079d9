"""Keeps visible that tf.distribute.MultiWorkerMirroredStrategy does not run Keras 3.

docs/keras.md says that Keras 3 on TensorFlow has no working
multi-worker path today (keras-team/keras#20585, tensorflow/tensorflow#72388):
`fit` on 2 CPU workers with TF 2.21 / Keras 3.15.1 raises
`ValueError: Attempt to convert a value (PerReplica:{...})`. Two real local
workers with TF_CONFIG on loopback ports check it. When Keras fixes it this
test fails, so the claim gets re-checked and rewritten.
"""
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tensorflow", reason="tensorflow is not installed (the keras extra)")

WORKER = Path(__file__).resolve().parent / "workers" / "keras_mwms_worker.py"
FAILURE = "ValueError: Attempt to convert a value (PerReplica:"
TIMEOUT = 300     # two TensorFlow start-ups; 60 s ran out at a load of 12-16


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def test_multiworker_mirrored_strategy_fails_with_keras3():
    workers = [f"127.0.0.1:{p}" for p in free_ports(2)]
    procs = []
    for index in range(2):
        env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2",
                   OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
                   TF_CONFIG=json.dumps({"cluster": {"worker": workers},
                                         "task": {"type": "worker", "index": index}}))
        env.pop("TF_USE_LEGACY_KERAS", None)
        procs.append(subprocess.Popen([sys.executable, str(WORKER)], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, env=env,
                                      start_new_session=True))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=TIMEOUT)[0])
    except subprocess.TimeoutExpired:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        outputs = [proc.communicate()[0] for proc in procs]
        pytest.fail(f"MultiWorkerMirroredStrategy workers did not finish in {TIMEOUT} s:\n"
                    + "\n".join(f"--- worker {i}\n{o[-3000:]}" for i, o in enumerate(outputs)))
    report = "\n".join(f"--- worker {i} (exit {p.returncode})\n{o[-3000:]}"
                       for i, (p, o) in enumerate(zip(procs, outputs)))
    if all("MWMS_FIT_OK" in o for o in outputs):
        pytest.fail("Keras 3 fit under tf.distribute.MultiWorkerMirroredStrategy now works: Keras "
                    "fixed it. Update docs/keras.md's claim that it fails (and "
                    "reconsider the baselines of the Keras benchmark), then this test.\n" + report)
    assert all(FAILURE in o for o in outputs), (
        f"expected every worker to fail with {FAILURE!r}, got:\n{report}")
    assert all(p.returncode != 0 for p in procs), report
