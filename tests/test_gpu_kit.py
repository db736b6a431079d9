"""The GPU kit (docs/gpu.md), rehearsed without a GPU so it cannot rot between the rare
calls on a lent GPU machine: `make gpu-kit` builds it (cached: seconds after the first),
`run.sh --no-gpu` installs it into a scratch directory, as the GPU machine will, and runs
every step that has a CPU form; the refusals the issue names are checked too.

The rehearsal runs in the kit's own build environment, which has the GPU machine's Python
and torch and, of the rest, only what its image has (scripts/gpu_kit/target.env), so a
check that would import something the machine lacks fails here first.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
KIT = REPO / "build" / "gpu-kit"
sys.path.insert(0, str(REPO / "tests" / "gpu_kit"))
sys.path.insert(0, str(REPO / "scripts" / "gpu_kit"))
import checks  # noqa: E402
import manifest  # noqa: E402

# The first `make gpu-kit` on a machine fetches a CUDA torch and builds Horovod twice.
pytestmark = pytest.mark.timeout(3600)


@pytest.fixture(scope="module")
def kit():
    """The kit, built (or found current) by `make gpu-kit`, and its rehearsal Python."""
    res = subprocess.run(["make", "-s", "gpu-kit"], cwd=REPO, capture_output=True, text=True,
                         timeout=3500)
    assert res.returncode == 0, f"make gpu-kit failed:\n{res.stdout[-6000:]}\n{res.stderr[-6000:]}"
    built = json.loads((KIT / "manifest.json").read_text())
    return KIT, built["built"]["python_path"]


# The rehearsal's budget: the GPU machine's 420 s are for 16 cores and a GPU.
REHEARSAL_BUDGET_S = 2400


def run_sh(python, *args, kit_dir=KIT, timeout=REHEARSAL_BUDGET_S + 300):
    env = {**os.environ, "PYTHON": python}
    env.pop("OUT", None)
    return subprocess.run(["bash", str(kit_dir / "run.sh"), *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_the_rehearsal_runs_every_step_that_needs_no_gpu(kit, tmp_path):
    kit_dir, python = kit
    res = run_sh(python, "--no-gpu", "--budget", REHEARSAL_BUDGET_S, tmp_path / "report")
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    statuses = {step["name"]: step["status"] for step in report["steps"]}
    assert res.returncode == 0, (statuses, res.stdout[-4000:], res.stderr[-4000:],
                                 (tmp_path / "report" / "logs.txt").read_text()[-20000:])
    assert list(statuses) == [name for name, *_ in checks.STEPS]
    for name, _, _, needs_gpu, _ in checks.STEPS:
        assert statuses[name] == ("SKIP" if needs_gpu else "PASS"), (name, statuses)
    md = (tmp_path / "report" / "report.md").read_text()
    assert "| step | status | seconds |" in md and "the rehearsal: no GPU" in md
    codecs = next(s for s in report["steps"] if s["name"] == "codecs")["data"]
    assert codecs["compared"] > 500 and codecs["mismatches"] == []


def test_without_a_gpu_run_sh_says_so_in_one_line(kit, tmp_path):
    kit_dir, python = kit
    res = run_sh(python, tmp_path / "report")
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0, res.stderr
    assert "no GPU on this machine" in res.stderr and "--no-gpu" in res.stderr
    assert not (tmp_path / "report").exists()


@pytest.mark.parametrize("field, value, words", [
    ("torch", "9.9.9+cu999", "the kit is built for torch 9.9.9+cu999, this machine has torch"),
    ("python", "3.99", "the kit is built for Python 3.99, this machine's python is")])
def test_a_kit_for_another_python_or_torch_is_refused_before_installing(
        kit, tmp_path, field, value, words):
    kit_dir, python = kit
    copy = tmp_path / "build" / "gpu-kit"
    shutil.copytree(kit_dir, copy)
    for part in ("scripts", "tests"):                 # run.sh finds them at ../..
        (tmp_path / part).symlink_to(REPO / part)
    data = json.loads((copy / "manifest.json").read_text())
    data["target"][field] = value
    (copy / "manifest.json").write_text(json.dumps(data))
    res = run_sh(python, "--no-gpu", tmp_path / "report", kit_dir=copy, timeout=120)
    assert res.returncode == 2 and words in res.stderr, res.stderr
    assert "installed from the kit" not in res.stdout


def test_a_changed_kit_file_is_refused(kit, tmp_path):
    kit_dir, python = kit
    copy = tmp_path / "build" / "gpu-kit"
    shutil.copytree(kit_dir, copy)
    for part in ("scripts", "tests"):
        (tmp_path / part).symlink_to(REPO / part)
    wheel = next((copy / "wheels" / "common").glob("keras-*.whl"))
    wheel.write_bytes(wheel.read_bytes()[:-1])
    res = run_sh(python, "--no-gpu", tmp_path / "report", kit_dir=copy, timeout=120)
    assert res.returncode == 2
    assert f"the kit's file wheels/common/{wheel.name} changed since it was built" in res.stderr


def test_a_failing_step_is_marked_and_the_next_one_runs(tmp_path):
    """The runner itself, with steps that raise, fail and pass (no kit needed)."""
    def raises(ctx):
        raise RuntimeError("broken on purpose")

    def fails(ctx):
        return checks.Result("FAIL", ["it failed"])

    def passes(ctx):
        return checks.Result("PASS", ["it passed"])

    def gpu(ctx):
        raise AssertionError("a GPU step must not run without a GPU")

    steps = [("a", "A", "raises", False, raises), ("b", "B", "fails", False, fails),
             ("g", "G", "needs a GPU", True, gpu), ("c", "C", "passes", False, passes)]
    ctx = checks.Context(tmp_path, tmp_path, tmp_path, no_gpu=True, budget_s=120)
    header = {"date": "today", "device": "none", "command": "test",
              "kit": {"python": "3.12", "torch": "x", "cuda_cc": "90", "commit": "c",
                      "uncommitted_changes": False}}
    results = checks.run_steps(ctx, steps, header)
    assert [r.status for _, _, _, r, _ in results] == ["FAIL", "FAIL", "SKIP", "PASS"]
    assert "the step raised RuntimeError: broken on purpose" in results[0][3].summary[0]
    md = (tmp_path / "report.md").read_text()
    assert "| A | FAIL |" in md and "| C | PASS |" in md and "| G | SKIP |" in md
    assert "broken on purpose" in (tmp_path / "logs.txt").read_text()


def test_a_kit_over_the_device_calls_limit_is_refused(tmp_path):
    (tmp_path / "big.bin").write_bytes(b"\0" * (2 * 2**20))
    with pytest.raises(SystemExit, match=r"over the 1(\.0)? MiB the device call may carry"):
        manifest.main(["write", str(tmp_path), "--python", "3.12", "--torch", "t", "--cc",
                       "90", "--repo", str(tmp_path), "--max-mib", "1"])
