"""`pipe-horovod bench --framework keras` (and `tf-loop`): a tiny real run over loopback
reports every row.

No speed assertions (shared, small machines): every row ran, the report
has its Keras sections, the outputs exist. No root needed.
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_TF_KERAS = importlib.util.find_spec("tf_keras") is not None
pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None,
                                reason="needs the keras extra (tensorflow-cpu)")


def _bench(out, *args, timeout=400):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    for key in ("PIPE_HOROVOD_ENGINE", "KERAS_BACKEND", "TF_USE_LEGACY_KERAS"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "pipe_horovod.tools.cli", "bench", "--framework", "keras",
           "--no-progress", "--out", str(out), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.mark.timeout(430)
def test_tiny_keras_run_reports_every_row(tmp_path):
    # The TensorFlow custom loops' rows (loop-kK in our worker's launch, the
    # MultiWorkerMirroredStrategy loop in the baseline's) ride in the same run.
    # ours-auto (tune="auto") too: its first block trains the measured and trial steps more.
    configs = ["ours-k1", "ours-k2", "ours-auto", "compute", "allreduce", "loop-k1", "loop-k2",
               "tf-mwms-loop"]
    if HAS_TF_KERAS:
        configs.append("tf-keras-mwms")
    res = _bench(tmp_path, "--engine", "torch", "--workers", "2", "--model-mb", "0.05",
                 "--batch-size", "4", "--steps", "2", "--warmup", "1", "--rounds", "1",
                 "--keras-torch", "--configs", *configs)
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout}\n{res.stderr}"
    for name in ("bench-raw.json", "bench.md", "bench.json", "bench.png"):
        assert (tmp_path / name).is_file(), name
    with open(tmp_path / "bench.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    table = (tmp_path / "bench.md").read_text()
    assert table in res.stdout                                 # printed and saved
    assert "# Keras: ours vs tf-keras + MultiWorkerMirroredStrategy" in table
    assert "Where a step of our path goes" in table

    rows = configs + ["torch-ours-k1", "torch-ours-k2", "torch-ours-auto", "torch-compute"]
    summary = json.loads((tmp_path / "bench.json").read_text())
    assert list(summary["configs"]) == rows
    for name, s in summary["configs"].items():
        assert s["step_s"] > 0 and s["samples"] == 2, (name, s)
        assert len(s["cpu_cores_per_worker"]) == 2, name
    keras = summary["keras"]
    train_rows = [r for r in rows if r != "allreduce"]
    assert list(keras["rows"]) == train_rows
    for name in train_rows:
        assert f"| {name} | **" in table, name
    if HAS_TF_KERAS:
        assert {t["key"] for t in keras["targets"]} == {
            "k2_hidden", "k1_vs_mwms", "k2_speedup_vs_mwms_over_ideal"}
        assert keras["rows"]["ours-k2"]["speedup_vs_mwms"] > 0
    # The TensorFlow path's breakdown: one hand-off per bucket (one bucket here) per step.
    for name in ("ours-k1", "ours-k2"):
        b = keras["breakdown"][name]
        assert b["handoffs"] == 1 and b["fill_s"] > 0 and b["launch_s"] > 0, b
        assert b["wait_s"] is not None and b["handoff_python_s"] is not None, b
    # The custom loops: against their own kind, and their ratios side by side.
    for name in ("loop-k1", "loop-k2"):
        b = keras["breakdown"][name]
        assert b["launch_s"] > 0 and b["wait_s"] is not None and b["handoffs"] is None, b
    assert keras["rows"]["tf-mwms-loop"]["speedup_vs_mwms"] == 1.0
    assert keras["rows"]["loop-k1"]["speedup_vs_k1"] == 1.0
    assert all(v is not None for v in keras["loop"].values()), keras["loop"]
    assert "## TensorFlow custom loop: DistributedGradientTape vs" in table
    # ours-auto decided in its launch (after --auto-warmup's untimed steps), and says what
    (decision,) = keras["auto_decisions"]
    assert decision.startswith("pipe_horovod auto: compute ") and " -> " in decision, decision
    assert f"- round 1: {decision}" in table
    raw = json.loads((tmp_path / "bench-raw.json").read_text())
    assert raw["launch"]["command"].startswith("pipe-horovod bench --framework keras")
    assert raw["meta"]["framework"] == "keras" and raw["meta"]["workers"] == 2


@pytest.mark.parametrize("args, text", [
    (["--model", "cnn"], "MLP only"),
    (["--configs", "ddp"], "not part of the Keras benchmark"),
    (["--configs", "ours-k2-x4"], "'ours-k2-x4' is not part of the Keras benchmark"),
    (["--engine", "local", "--workers", "1"], "--engine torch or horovod"),
])
def test_bad_arguments_exit_2(tmp_path, args, text, capsys):
    """Refused before anything is launched: run in this process (as test_bench.py's bad
    arguments), not as a subprocess paying the CLI's imports (4 s each)."""
    from pipe_horovod.tools import cli

    try:
        code = cli.main(["bench", "--framework", "keras", "--no-progress", "--out",
                         str(tmp_path), *args])
    except SystemExit as exc:
        code = exc.code
    assert code == 2, capsys.readouterr()
    assert text in capsys.readouterr().err
    assert not list(tmp_path.iterdir()), "nothing written"
