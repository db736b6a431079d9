"""`pipe-horovod convergence`: the report's arithmetic on hand-made curves, argument
errors, and one tiny real run (2 workers, 2 epochs, 1 seed, sync and k2) whose sync
curve must equal `examples/pytorch_digits.py`'s own run with the same seed.

The benchmark itself (3 tasks x 6 configurations x 5 seeds) is not run here:
docs/convergence.md records it.
"""
import json
import math
import os
import subprocess
import sys

import pytest

import launcher

from pipe_horovod.tools import cli
from pipe_horovod.tools.bench import convergence_report as report
from pipe_horovod.tools.bench import convergence_worker as cw

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _raw():
    """Two configurations x two seeds, 4 epochs of 10 steps, with known answers."""
    curves = {("sync", 1): [0.50, 0.90, 0.96, 1.00], ("sync", 2): [0.60, 0.80, 0.98, 0.96],
              ("k2", 1): [0.30, 0.60, 0.94, 0.97], ("k2", 2): [0.20, 0.50, 0.70, 0.90]}
    runs = [{"config": c, "seed": s, "pipeline_depth": 1 if c == "sync" else 2,
             "staleness_compensation": None, "accuracy": acc, "train_time_s": 1.0,
             "ranks_agree": True} for (c, s), acc in curves.items()]
    return {"format": cw.FORMAT, "task": {"name": "t", "summary": "hand-made",
                                          "batch_size_per_worker": 8, "lr": 0.1,
                                          "schedule": "constant", "momentum": 0.5},
            "engine": "torch", "workers": 2, "epochs": 4, "steps_per_epoch": 10,
            "seeds": [1, 2], "configs": ["sync", "k2"], "n_train": 80, "n_test": 20,
            "runs": runs}


def test_epochs_to_reach_and_seed_median():
    assert report.epochs_to_reach([0.1, 0.5, 0.5, 0.9], 0.5) == 2        # >= counts
    assert report.epochs_to_reach([0.1, 0.4], 0.5) is None
    assert report.median_epochs([2, None, 5]) == 5                       # never = last
    assert report.median_epochs([1, 2, None]) == 2
    assert report.median_epochs([None, None, 1]) is None
    assert report.median_epochs([4, 3]) == 3.5
    assert report.median_epochs([3, None]) is None


def test_summary_on_hand_made_curves(tmp_path):
    steps = tmp_path / "steps.json"
    steps.write_text(json.dumps({"sync": 0.010, "k2": 0.005}))
    times = report.load_step_times([f"t={steps}"], ["t"], ["sync", "k2"])
    s = report.summarize_task(_raw(), times["t"])

    assert s["sync_final_mean"] == pytest.approx(0.98)
    assert s["thresholds"]["95"] == pytest.approx(0.931)
    assert s["thresholds"]["99"] == pytest.approx(0.9702)
    sync, k2 = s["configs"]["sync"], s["configs"]["k2"]
    assert sync["mean_curve"] == pytest.approx([0.55, 0.85, 0.97, 0.98])
    assert sync["final_std"] == pytest.approx(math.sqrt(0.0008))
    # sync: mean curve 0.97 >= 0.931 at epoch 3; 0.97 < 0.9702, so 99% at epoch 4
    assert sync["to"]["95"]["epochs"] == 3
    assert sync["to"]["95"]["epochs_per_seed"] == [3, 3]
    assert sync["to"]["95"]["epochs_seed_median"] == 3
    assert sync["to"]["99"]["epochs"] == 4
    assert sync["to"]["99"]["epochs_per_seed"] == [4, 3]
    assert sync["to"]["99"]["epochs_seed_median"] == 3.5
    assert sync["to"]["95"]["time_s"] == pytest.approx(3 * 10 * 0.010)
    assert sync["to"]["99"]["time_s"] == pytest.approx(4 * 10 * 0.010)

    assert k2["final_mean"] == pytest.approx(0.935)
    assert k2["final_std"] == pytest.approx(math.sqrt(0.00245))
    assert k2["final_vs_sync_pp"] == pytest.approx(-4.5)
    assert k2["mean_curve"] == pytest.approx([0.25, 0.55, 0.82, 0.935])
    assert k2["to"]["95"]["epochs"] == 4
    assert k2["to"]["95"]["epochs_per_seed"] == [3, None]
    assert k2["to"]["95"]["epochs_seed_median"] is None
    assert k2["to"]["95"]["epochs_vs_sync"] == pytest.approx(4 / 3)
    assert k2["to"]["95"]["time_s"] == pytest.approx(4 * 10 * 0.005)
    assert k2["to"]["95"]["speedup_vs_sync"] == pytest.approx(0.3 / 0.2)
    assert k2["to"]["99"]["epochs"] is None and k2["to"]["99"]["time_s"] is None
    assert sync["meets_targets"] is None and k2["meets_targets"] is False

    text = report.markdown(report.summarize([_raw()], times))
    assert "| sync | 98.00 ± 2.83 | +0.00 | 3 (3) | 4 (3.5) | 1.00 | 10.00 | 0.30 (1.00x) " \
           "| 0.40 (1.00x) |" in text
    assert "| k2 | 93.50 ± 4.95 | -4.50 | 4 (never) | never (never) | – | 5.00 | " \
           "0.20 (1.50x) | – |" in text
    assert "targets (99% of sync's final accuracy in <= 1.05 x sync's epochs, final " \
           "accuracy at most 0.3 pp below sync's): met by none." in text


def test_targets_met_when_k2_tracks_sync():
    raw = _raw()
    sync_curves = {r["seed"]: r["accuracy"] for r in raw["runs"] if r["config"] == "sync"}
    for r in raw["runs"]:
        if r["config"] == "k2":
            r["accuracy"] = list(sync_curves[r["seed"]])
    s = report.summarize_task(raw)
    assert s["configs"]["k2"]["meets_targets"] is True
    assert s["configs"]["k2"]["to"]["99"]["epochs_vs_sync"] == 1.0
    assert "met by k2." in report.markdown(report.summarize([raw]))


def test_step_times_from_a_bench_summary(tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"meta": {}, "configs": {
        "ours-k1": {"step_s": 0.02}, "ours-k2-none": {"step_s": 0.01},
        "ours-k2-dc": {"step_s": 0.012}, "ours-k2": {"step_s": 0.5}}}))
    times = report.load_step_times([f"a={bench}"], ["a", "b"], ["sync", "k2", "k2-dc"])
    assert {c: v["step_s"] for c, v in times["a"].items()} == {
        "sync": 0.02, "k2": 0.01, "k2-dc": 0.012}
    assert times["b"] == {}
    with pytest.raises(ValueError, match="TASK=FILE"):
        report.load_step_times([str(bench)], ["a"], ["sync"])


def test_configs():
    assert cw.parse_configs("sync, k2 k2-dc,k2") == ["sync", "k2", "k2-dc"]
    assert cw.config_settings("sync") == (1, None)
    assert cw.config_settings("k2-lookahead") == (2, "lookahead")
    assert [cw.bench_config(c) for c in ("sync", "k2", "k2-predict")] == [
        "ours-k1", "ours-k2-none", "ours-k2-predict"]


@pytest.mark.parametrize("argv, message", [
    (["--configs", "sync,k2-bogus"], "argument --configs: unknown configuration 'k2-bogus'"),
    (["--tasks", "mnist"], "argument --tasks: unknown task 'mnist'"),
    (["--seeds", "0"], "argument --seeds: must be >= 1"),
])
def test_bad_arguments_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["convergence", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.timeout(240)
def test_tiny_run_matches_the_digits_example(tmp_path):
    """1 task, 2 epochs, 1 seed, sync + k2 on 2 torch workers: the JSON's shape, and
    sync's per-epoch accuracies equal to the example's own run with that seed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env.pop("PIPE_HOROVOD_ENGINE", None)
    out = tmp_path / "conv"
    cmd = [sys.executable, "-m", "pipe_horovod.tools.cli", "convergence", "--tasks", "digits-cnn",
           "--configs", "sync,k2", "--seeds", "1", "--first-seed", "3", "--epochs", "2",
           "--workers", "2", "--no-progress", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=200,
                         stdin=subprocess.DEVNULL)
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"
    for name in ("convergence.md", "convergence.json", "convergence.png",
                 "convergence-digits-cnn-raw.json", "convergence-digits-cnn.log"):
        assert (out / name).is_file(), name
    assert "\r" not in res.stderr                         # no bar redraws when not a terminal
    summary = json.loads((out / "convergence.json").read_text())
    assert summary["format"] == report.SUMMARY_FORMAT
    (task,) = summary["tasks"]
    assert task["task"]["name"] == "digits-cnn" and task["epochs"] == 2
    assert task["steps_per_epoch"] == 23 and task["seeds"] == [3]
    assert list(task["configs"]) == ["sync", "k2"]
    for c in task["configs"].values():
        assert len(c["mean_curve"]) == 2 and c["ranks_agree"]
        assert set(c["to"]) == {"95", "99"} and c["step_s"] is None
    raw = json.loads((out / "convergence-digits-cnn-raw.json").read_text())
    assert [(r["config"], r["seed"]) for r in raw["runs"]] == [("sync", 3), ("k2", 3)]
    assert raw["engine"] == "torch" and raw["workers"] == 2
    assert raw["command"].startswith("pipe-horovod convergence --tasks digits-cnn "
                                     "--configs sync,k2 --seeds 1 --first-seed 3 --epochs 2")
    # --report-only rebuilds the same report from the raw JSON, with the run's command
    before = (out / "convergence.md").read_text()
    assert cli.main(["convergence", "--report-only", "--tasks", "digits-cnn",
                     "--out", str(out)]) == 0
    assert (out / "convergence.md").read_text() == before

    example = tmp_path / "example.json"
    rc, log = launcher.run("torch", 2, os.path.join(ROOT, "examples", "pytorch_digits.py"),
                           "--pipeline-depth", "1", "--seed", "3", "--epochs", "2",
                           "--no-progress",
                           "--json", example, timeout=120, expect_ok=False)
    assert rc == 0, log
    expected = [h["accuracy"] for h in json.loads(example.read_text())["history"]]
    assert raw["runs"][0]["accuracy"] == expected


def test_codec_suffix_reduces_on_the_engines_two_stage_path():
    from pipe_horovod.tools.bench import convergence_worker as cw

    assert cw.parse_configs("sync,sync-int8_ef k2-lookahead-int8_ef") == [
        "sync", "sync-int8_ef", "k2-lookahead-int8_ef"]
    assert cw.config_settings("sync-int8_ef") == (1, None)
    assert cw.config_settings("k2-lookahead-int8_ef") == (2, "lookahead")
    assert [cw.config_compression(c) for c in ("k2", "k2-int8_ef")] == ["none", "int8_ef"]
    assert cw.bench_config("k2-lookahead-int8_ef") == "ours-k2-int8eng-lookahead"
    assert cw.bench_config("sync-int8_ef") == "ours-k1-int8eng"
    assert cw.bench_config("k2-lookahead-int4_ef") == "ours-k2-int4eng-lookahead"
    assert cw.config_compression("k2-lookahead-int4_ef:64") == "int4_ef:64"
    with pytest.raises(ValueError, match="unknown configuration"):
        cw.parse_configs("k2-int4")
