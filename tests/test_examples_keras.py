"""examples/keras_digits.py under the launchers users run it with, and the clean
output of `examples/compare_digits.py --framework keras` (the second half of `make run`).

Short runs (1-2 epochs): these check that the example runs and reports, not
its accuracy (`make run` checks that, pipelined within 1 point of sync).
"""
import importlib.util
import json
import re
import subprocess
import sys

import pytest

import launcher
import shared_launches

EXAMPLES = launcher.REPO / "examples"
KERAS_EXAMPLE = EXAMPLES / "keras_digits.py"


def _missing_tensorflow():
    if importlib.util.find_spec("tensorflow") is None:
        return "tensorflow is not installed (pip install -e '.[keras]')"
    if importlib.util.find_spec("keras") is None:
        return "keras is not installed (pip install -e '.[keras]')"
    return None


def _missing_horovodrun():
    if not (launcher.BIN / "horovodrun").exists():
        return f"horovodrun is not installed next to {sys.executable} (make install)"
    return launcher.horovod_missing()


needs_tensorflow = pytest.mark.skipif(_missing_tensorflow() is not None,
                                      reason=str(_missing_tensorflow()))


def _run_example(launch, np, backend, json_path, epochs, timeout):
    cmd = launcher.command(launch, np, [KERAS_EXAMPLE, "--epochs", epochs, "--json", json_path])
    rc, out = launcher.run_command(cmd, np, timeout=timeout, expect_ok=False,
                                   env={"KERAS_BACKEND": backend})
    assert rc == 0, out
    return json.loads(json_path.read_text()), out


@needs_tensorflow
@pytest.mark.parametrize("launch, np, backend", [("local", 1, "tensorflow"),
                                                 ("torch", 2, "torch")])
def test_keras_digits_runs_and_reports(tmp_path, launch, np, backend):
    epochs = 2
    # a hang guard: at a load of 20 the torchrun launch finished training and then took
    # past 150 s to exit (23 s idle), so as the other Keras launches: 300 s
    result, out = _run_example(launch, np, backend, tmp_path / "result.json", epochs,
                               timeout=300)
    assert result["framework"] == "keras" and result["backend"] == backend
    assert result["size"] == np and result["epochs"] == epochs
    assert result["ranks_agree"] is True
    assert isinstance(result["accuracy"], float) and 0.3 < result["accuracy"] <= 1.0, result
    assert result["train_time_s"] > 0
    assert [h["epoch"] for h in result["history"]] == list(range(1, epochs + 1))
    # The last validation ran on the flushed weights, batched as the final evaluate is.
    assert result["history"][-1]["accuracy"] == result["accuracy"]
    assert result["timings"]["in_flight"] == 0, "PipelineFlushCallback must leave none in flight"
    # Rank 0 alone prints one parseable line per epoch (stdout is a pipe: no progress bar).
    lines = re.findall(r"^epoch\s+(\d+)/(\d+)\s+train loss.*held-out accuracy [\d.]+%$",
                       out, re.M)
    assert lines == [(str(e), str(epochs)) for e in range(1, epochs + 1)], out
    assert "\r" not in out


@needs_tensorflow
def test_compare_digits_keras_output_is_clean(tmp_path_factory):
    missing = _missing_horovodrun()
    if missing:
        pytest.skip(missing)
    # The run test_image.py compares with the image's (tests/shared_launches.py).
    rc, out, folder = shared_launches.digits_comparison(tmp_path_factory, "keras")
    assert rc == 0, out
    # Everything compare_digits prints is ours: the workers' output went to the logs.
    assert "\r" not in out, out
    assert not re.search(r"\[\d+\]<std(out|err)>", out), out
    assert re.search(r"^\s*sync: epoch\s+1/1\s+held-out accuracy\s+[\d.]+%$", out, re.M), out
    assert re.search(r"^\s*default: epoch\s+1/1\s+held-out accuracy\s+[\d.]+%$", out, re.M), out
    assert re.search(r"^## Digits CNN, Keras 3\.\S+ \(tensorflow backend\), 2 horovodrun workers",
                     out, re.M), out
    table = [line for line in out.splitlines() if line.startswith("|")]
    assert len(table) == 5 and "difference (default - sync)" in table[-1], out
    # Tuning off (shared_launches.DIGITS_ENV): the default row ran K=2 as given, no decision
    assert re.search(r"^default: train time [\d.]+x synchronous; tuning off", out,
                     re.M), out
    assert "PASS" in out
    comparison = json.loads((folder / "comparison.json").read_text())
    assert comparison["framework"] == "keras"
    for run in comparison["runs"]:
        assert run["rc"] == 0 and 0.0 < run["accuracy"] <= 1.0, run
        depth = run["pipeline_depth"] or "auto"
        log = (folder / f"keras_digits_depth{depth}.log").read_text()
        assert run["log"].endswith(f"keras_digits_depth{depth}.log")
        assert "[0]<stdout>:epoch   1/1" in log, "the full raw log is kept"


def test_compare_digits_torch_stays_the_default():
    out = subprocess.run([sys.executable, EXAMPLES / "compare_digits.py", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert re.search(r"--framework \{keras,torch\}.*\(default: torch\)", " ".join(out.stdout.split())), (
        out.stdout)
