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

    # The codec configurations (the engine's two-stage path) in every adapter; --engine
    # horovod: PyTorch only.
    parser = __import__("argparse").ArgumentParser()
    lm.add_arguments(parser)
    lm.check_args(parser.parse_args(["--configs", "sync,k2-lookahead-int8_ef", "--engine",
                                     "horovod"]))
    lm.check_args(parser.parse_args(["--frameworks", "keras-tf,keras-torch", "--configs",
                                     "k2-lookahead-int8_ef,k2-lookahead-int4_ef:64"]))
    assert lm.label("k2-lookahead-int4_ef:64") == (
        "default + int4_ef:64 (engine path, no collective=)")
    for argv in (["--configs", "k2-lookahead-int2_ef"], ["--configs", "k2-lookahead-int4_ef:"],
                 ["--frameworks", "torch,keras-torch", "--engine", "horovod"],
                 ["--configs", "k3"]):
        with pytest.raises(SystemExit):
            lm.check_args(parser.parse_args(argv))
    raw["engine"] = "horovod"
    assert "| torch (horovod engine) | sync (K=1) |" in lm.markdown([raw], "cmd")


@pytest.mark.parametrize("framework,configs", [("torch", "sync,k2-lookahead,k2,k2-lookahead-int8_ef"),
                                               ("keras-torch", "k2-lookahead,k2-lookahead-int4_ef")])
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


def test_keras_settings_and_the_sweep_design_and_report(tmp_path):
    """The sweep of Keras settings: the schedules a Keras user passes (peak lr x size), the fractional
    design's balance, the cell syntax, and the per-cell report from raw files."""
    os.environ.setdefault("KERAS_BACKEND", "torch")
    keras = pytest.importorskip("keras")
    from pipe_horovod.tools.bench import convergence_sweep as sweep

    s = lm.Settings(steps=400)
    peak = 2 * s.lr
    for name, at, want in [("cosine", [0, 50, 400], [0.0, peak, 0.0]),
                           ("exponential", [0, 100], [peak, peak / 2]),
                           ("piecewise", [200, 201, 301], [peak, peak / 4, peak / 16]),
                           ("warmup-cosine", [0, 49], [lm.lr_at(s, 2, 0), peak])]:
        schedule = lm.keras_schedule(keras, lm.Settings(steps=400, schedule=name), 2)
        got = [float(keras.ops.convert_to_numpy(schedule(t))) for t in at]
        assert got == pytest.approx(want, rel=1e-6), name
    assert lm.keras_schedule(keras, lm.Settings(schedule="constant"), 2) == peak
    opt = lm.keras_optimizer(keras, lm.Settings(clipping="norm", weight_decay=0.0), 2)
    assert type(opt).__name__ == "Adam" and opt.clipnorm == s.clip and not opt.global_clipnorm
    opt = lm.keras_optimizer(keras, lm.Settings(), 2)
    assert type(opt).__name__ == "AdamW" and opt.global_clipnorm == s.clip
    small = dict(d_model=64, heads=2, layers=1, context=8)
    linear = 64 ** -0.5                            # nn.Linear's bound for the head: 0.125
    for init, low, high in [("torch", 0.0, linear),
                            ("keras", linear, (6 / (64 + lm.VOCAB)) ** 0.5)]:   # glorot
        model = lm.keras_model(keras, lm.Settings(init=init, **small))
        head = model.layers[-1].kernel            # Dense(VOCAB) after the last LayerNorm
        top = float(np.abs(keras.ops.convert_to_numpy(head)).max())   # of 6144 draws
        assert low < top <= high * (1 + 1e-6), (init, top)
    with pytest.raises(ValueError, match="unknown init 'xavier'"):
        lm.keras_model(keras, lm.Settings(init="xavier", **small))

    cells = sweep.issue36()
    assert len({(c.schedule, c.clipping) for c in cells}) == 12 == len(cells)
    for attr in ("schedule", "clipping"):          # each level meets both of each binary
        for level in {getattr(c, attr) for c in cells}:
            mine = [c for c in cells if getattr(c, attr) == level]
            assert {c.weight_decay for c in mine} == {0.0, 0.1}, (attr, level)
            assert {c.framework for c in mine} == {"keras-tf", "keras-torch"}, (attr, level)
    assert {(c.weight_decay, c.framework) for c in cells} == {
        (w, f) for w in (0.0, 0.1) for f in ("keras-tf", "keras-torch")}
    assert {c.steps for c in cells} == {400, 800, 1600}
    assert sweep.cells_of("keras-torch:piecewise:none:0:800") == [
        sweep.Cell("keras-torch", "piecewise", "none", 0.0, 800)]
    for bad in ("keras-tf:cosine:global:0.1", "torch:cosine:global:0.1:400",
                "keras-tf:linear:global:0.1:400"):
        with pytest.raises(SystemExit):
            sweep.cells_of(bad)
    parser = __import__("argparse").ArgumentParser()
    lm.add_arguments(parser)
    for keras_only in (["--schedule", "cosine"], ["--clipping", "none"]):
        with pytest.raises(SystemExit):            # schedules and clipping are Keras's
            lm.check_args(parser.parse_args(["--frameworks", "torch", *keras_only]))
    lm.check_args(parser.parse_args(["--frameworks", "torch", "--init", "keras"]))
    # --init keras in the PyTorch model: Keras's glorot_uniform with the fans Keras counts
    # (a query/key/value kernel: fan_in heads x d, fan_out head_dim x d), zero biases
    import torch
    model = lm.torch_model(lm.Settings(d_model=128, heads=4, init="keras"))
    bounds = {"qkv": (6 / (4 * 128 + 32 * 128)) ** 0.5, "proj": (6 / (128 + 4 * 128)) ** 0.5,
              "fc1": (6 / (128 + 512)) ** 0.5, "fc2": (6 / (512 + 128)) ** 0.5}
    for name, bound in bounds.items():
        weight = getattr(model.blocks[0], name).weight
        assert bound * 0.9 < float(weight.abs().max()) <= bound, (name, bound)
        assert not getattr(model.blocks[0], name).bias.any()
    assert float(model.head.weight.abs().max()) <= (6 / (128 + lm.VOCAB)) ** 0.5
    torch.manual_seed(0)
    own = lm.torch_model(lm.Settings(d_model=128, heads=4))
    assert float(own.blocks[0].qkv.weight.abs().max()) > bounds["qkv"] * 2   # nn.Linear's

    cell = sweep.Cell("keras-tf", "cosine", "global", 0.1, 400)
    runs = [{"config": c, "seed": seed, "steps": [400], "val_loss": [v], "train_time_s": 2.0,
             "ranks_agree": True}
            for c, seed, v in [("sync", 1, 1.90), ("sync", 2, 1.92), ("k2-lookahead", 1, 1.91),
                               ("k2-lookahead", 2, 1.94)]]
    raw = {"framework": "keras-tf", "settings": lm.asdict(s), "runs": runs}
    with open(tmp_path / f"lm-{cell.key}-keras-tf-raw.json", "w") as f:
        json.dump(raw, f)
    args = parser.parse_args(["--sweep", "keras-tf:cosine:global:0.1:400", "--report-only",
                              "--out", str(tmp_path), "--name", "lm"])
    assert lm.run(args, ["--sweep", "..."]) == 0
    text = (tmp_path / "lm.md").read_text()
    assert "| keras-tf | cosine | global | 0.1 | 400 | 1.9100 | 1.9250 | +0.0100 / +0.0200 | " \
           "**+0.0150** | yes | 2 |" in text, text
    assert "the worst gap: +0.0150" in text and (tmp_path / "lm.png").stat().st_size > 0
