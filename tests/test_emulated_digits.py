"""examples/emulated_digits.py, the second half of `make run`: Horovod vs ours K=1 vs
K=2 on an emulated 1 Gbit cluster, a table and a time-to-accuracy PNG.

Kept brief (a narrow MLP, 6 steps: about 30 s of the suite's budget); the numbers
themselves are not checked here, only that every configuration trains, ends with a
real accuracy, and the table and plot come out. Without root the one-line skip is
checked instead.
"""
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "emulated_digits.py")


def _module():
    spec = importlib.util.spec_from_file_location("emulated_digits", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ED = _module()
_REASON = ED.skip_reason()


def test_without_the_cluster_it_says_why_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(ED, "skip_reason", lambda: "the emulated cluster needs root")
    assert ED.main(["--out", "unused-never-created"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["emulated 1gbit cluster comparison skipped: the emulated cluster needs root"]
    assert not os.path.exists("unused-never-created")


@pytest.mark.skipif(_REASON is not None, reason=str(_REASON))
@pytest.mark.timeout(60)
def test_emulated_comparison_prints_the_table_and_writes_the_plot(tmp_path):
    cmd = [sys.executable, SCRIPT, "--out", str(tmp_path), "--no-progress", "--steps", "6",
           "--eval-every", "3", "--hidden", "256", "--batch-size", "64", "--timeout", "45"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=55, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")][1:]
    labels = [label for _, label, _ in ED.CONFIGS]
    assert [r.split("|")[1].strip() for r in rows] == labels, proc.stdout
    png = tmp_path / "time_to_accuracy.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(png) in proc.stdout
    result = json.loads((tmp_path / "time_to_accuracy.json").read_text())
    assert [s["label"] for s in result["summary"]] == labels
    for s in result["summary"]:
        assert isinstance(s["final_accuracy"], float) and math.isfinite(s["final_accuracy"])
        assert 0.0 <= s["final_accuracy"] <= 100.0
        assert s["median_step_s"] > 0
    for run in result["runs"].values():
        assert [h["step"] for h in run["history"]] == [3, 6]
