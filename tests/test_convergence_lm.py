"""The transformer task of the convergence study (pipe_horovod/tools/bench/convergence_lm.py),
briefly: the data, the schedule and the report in-process, and a few steps of a tiny
model through the real worker (PyTorch: sync, default, plain K=2, default + int8_ef;
Keras on the torch backend: the default) in one process each.

The study itself (2 ranks, 3 seeds, hundreds of steps) is not run here:
docs/convergence.md records it. The Keras TensorFlow backend runs the same
train_keras as the torch backend; it is left out because its first trace alone
takes longer than this file's budget.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from pipe_horovod.tools.bench import convergence_lm as lm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = lm.Settings(steps=4, batch=2, context=8, d_model=8, layers=1, heads=2, warmup=2,
                   eval_every=2, train_chars=2000, val_chars=200, val_windows=4)


def test_data_schedule_and_report(tmp_path):
    train, vx, vy = lm.data(TINY)
    assert train.shape == (2000,) and vx.shape == vy.shape == (4, 8)
    assert 0 <= train.min() and train.max() < lm.VOCAB
    np.testing.assert_array_equal(vx[:, 1:], vy[:, :-1])           # targets: the next char
    b0, b1 = lm.batches(train, TINY, 1, 0), lm.batches(train, TINY, 1, 1)
    assert b0.shape == (4, 2, 9) and not np.array_equal(b0, b1)     # each rank its own windows
    np.testing.assert_array_equal(b0, lm.batches(train, TINY, 1, 0))
    lrs = [lm.lr_at(TINY, 2, t) for t in range(4)]
    assert lrs[1] == pytest.approx(2 * TINY.lr)                     # peak after warm-up, x size
    assert lrs[0] == pytest.approx(TINY.lr) and lrs[3] < lrs[2] == lrs[1]

    runs = [{"config": c, "seed": s, "steps": [2, 4], "val_loss": [3.0, v],
             "train_time_s": 1.0, "ranks_agree": True}
            for c, s, v in [("sync", 1, 2.0), ("sync", 2, 2.2), ("k2", 1, 2.5), ("k2", 2, 2.7)]]
    raw = {"framework": "torch", "workers": 2, "configs": ["sync", "k2"], "seeds": [1, 2],
           "runs": runs}
    rows = lm.summarize(raw)
    assert rows["sync"]["final_mean"] == pytest.approx(2.1)
    assert rows["k2"]["curve"] == pytest.approx([3.0, 2.6])
    text = lm.markdown([raw], "cmd")
    assert "| torch | plain K=2 (staleness_compensation=None) | 2.6000 ± 0.1414" in text
    assert "+0.5000" in text
    lm.plot([raw], tmp_path / "lm.png")
    assert (tmp_path / "lm.png").stat().st_size > 0

    # The int8_ef configuration (issue 28's engine path) and --engine horovod: PyTorch only.
    parser = __import__("argparse").ArgumentParser()
    lm.add_arguments(parser)
    lm.check_args(parser.parse_args(["--configs", "sync,k2-lookahead-int8_ef", "--engine",
                                     "horovod"]))
    for argv in (["--frameworks", "keras-tf", "--configs", "k2-lookahead-int8_ef"],
                 ["--frameworks", "torch,keras-torch", "--engine", "horovod"],
                 ["--configs", "k3"]):
        with pytest.raises(SystemExit):
            lm.check_args(parser.parse_args(argv))
    raw["engine"] = "horovod"
    assert "| torch (horovod engine) | sync (K=1) |" in lm.markdown([raw], "cmd")


@pytest.mark.parametrize("framework,configs", [("torch", "sync,k2-lookahead,k2,k2-lookahead-int8_ef"),
                                               ("keras-torch", "k2-lookahead")])
def test_worker_runs_a_few_steps(tmp_path, framework, configs):
    out = tmp_path / "raw.json"
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    env = {k: v for k, v in env.items() if not k.startswith(("HOROVOD_", "OMPI_", "PMI"))}
    res = subprocess.run(
        [sys.executable, "-m", "pipe_horovod.tools.bench.convergence_lm", "--worker", "--framework",
         framework, "--configs", configs, "--seeds", "1", "--out", str(out), "--settings",
         json.dumps(lm.asdict(TINY))],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    raw = json.loads(out.read_text())
    assert [r["config"] for r in raw["runs"]] == configs.split(",")
    for run in raw["runs"]:
        assert run["steps"] == [2, 4] and run["ranks_agree"]
        assert all(t > 0 for t in run["train_loss"])              # no empty batches
        assert all(np.isfinite(run["val_loss"])) and run["val_loss"][-1] < np.log(lm.VOCAB) + 1
    if framework == "torch":       # one process: lookahead predicts the next update exactly
        by = {r["config"]: r["val_loss"] for r in raw["runs"]}
        assert by["k2-lookahead"] == by["sync"]


def test_predict_unclipped_lifts_clipping_inside_the_prediction_only():
    """predict_unclipped goes through the Keras optimizer's public prediction_scope, which the
    torch backend's prediction enters around its steps (state saved and put back)."""
    code = """
import os
os.environ["KERAS_BACKEND"] = "torch"
import keras
import pipe_horovod.keras as hvd
from pipe_horovod.tools.bench import convergence_lm as lm
hvd.init()
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
opt = hvd.DistributedOptimizer(keras.optimizers.AdamW(0.1, global_clipnorm=1.0),
                               pipeline_depth=2)
lm.predict_unclipped(opt)
opt.build(model.trainable_variables)
stand_in = opt._path.torch_optimizer
seen = []
with stand_in.pipe_horovod_state_restored():
    seen.append(opt.global_clipnorm)
    opt.iterations.assign(7)
seen += [opt.global_clipnorm, int(opt.iterations.numpy())]
assert seen == [None, 1.0, 0], seen
assert opt.time_handoffs(lambda key, fn: fn) is False       # nothing to time on torch
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    env = {k: v for k, v in env.items()
           if not k.startswith(("HOROVOD_", "OMPI_", "PMI", "PIPE_HOROVOD_ENGINE"))}
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=240)
    assert res.returncode == 0 and "ok" in res.stdout, res.stdout[-2000:] + res.stderr[-2000:]
