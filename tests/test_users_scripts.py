"""Horovod scripts as users write them, run after changing only their import.

The scripts in tests/workers are genuine Horovod scripts (one of them is
also run under Horovod itself); the tests copy them, switch
`import horovod.torch as hvd` to `import pipe_horovod.torch as hvd`, and
run the copy under horovodrun and torchrun.
"""
import re
import shutil

import pytest

import launcher

pytestmark = pytest.mark.timeout(600)
ORIGINAL = "import horovod.torch as hvd"


def switched(tmp_path, name):
    """A copy of tests/workers/`name` whose only change is the import line."""
    original = (launcher.WORKERS / name).read_text()
    text = original.replace(ORIGINAL, "import pipe_horovod.torch as hvd")
    changed = [(a, b) for a, b in zip(original.splitlines(), text.splitlines()) if a != b]
    assert len(changed) == 1, changed
    script = tmp_path / name
    script.write_text(text)
    return script


def needs_horovod():
    pytest.importorskip("horovod.torch")


def test_horovod_script_runs_after_changing_only_its_import(tmp_path):
    needs_horovod()
    # The default, as a user's shell has it (the suite runs with tuning off): fp16 is a
    # codec auto does not take, so the configuration as given applies, and a warning says so.
    _, out = launcher.run("horovod", 2, switched(tmp_path, "horovod_style_script.py"),
                          "--fp16-allreduce", timeout=200, env={"PIPE_HOROVOD_TUNE": ""})
    assert "test accuracy" in out
    assert "tune='auto' (the default) does not apply: compression='fp16'" in out, out


def run_twice(tmp_path, launch, script, *options):
    """Epochs 0-1, then a new job that resumes from the checkpoint and runs epochs 2-3."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    fmt = str(tmp_path / "checkpoint-{epoch}.pth.tar")
    common = ("--checkpoint-format", fmt, *options)
    _, first = launcher.run(launch, 2, script, "--epochs", 2, *common, timeout=240)
    _, second = launcher.run(launch, 2, script, "--epochs", 4, *common, timeout=240)
    assert "resumed from epoch 2" in second and "resumed" not in first, second
    assert "Traceback" not in first + second, first + second
    return first + second


def metrics(output):
    return re.findall(r"epoch \d+ (?:train loss|val accuracy) [0-9.]+", output)


def test_users_script_is_a_real_horovod_script(tmp_path):
    # The unchanged script under Horovod 0.28.1 itself (its SyncBatchNorm needs a GPU).
    needs_horovod()
    out = run_twice(tmp_path, "horovod", "horovod_users_script.py", "--no-sync-bn", "--uneven",
                    "--sparse-as-dense")
    assert len(metrics(out)) == 8, out


def test_users_script_with_uneven_data_and_join(tmp_path):
    # Rank 0 has one batch more each epoch; hvd.join() lets it finish while rank 1
    # contributes zeros (Horovod's join, which allows no allgather: sparse_as_dense,
    # no SyncBatchNorm). Our join flushes the pipeline first and realigns the steps.
    # With int8_ef in two stages, whose alltoall a joined rank cannot answer either:
    # the steps after a join take the engine's allreduce (tests/workers/misuse_worker.py
    # checks its values exactly).
    needs_horovod()
    out = run_twice(tmp_path / "ours", "horovod", switched(tmp_path, "horovod_users_script.py"),
                    "--uneven", "--sparse-as-dense", "--no-sync-bn",
                    "--gradient-predivide-factor", "2", "--compression", "int8_ef")
    assert len(metrics(out)) == 8, out
    # join() at the end of each epoch flushed the pipeline: nothing is left unapplied.
    assert "not applied" not in out, out


def test_users_script_gives_the_same_numbers_under_horovodrun_and_torchrun(tmp_path):
    # SyncBatchNorm, the sparse embedding's allgather, per-batch metric allreduce,
    # allgather of predictions, join, rank-0 resume: both engines, same numbers. The
    # torchrun job resumes from the horovodrun job's checkpoint of epoch 2 (one launch
    # fewer than two runs of all four epochs): epochs 2-3 must repeat horovodrun's.
    needs_horovod()
    script = switched(tmp_path, "horovod_users_script.py")
    horovod = run_twice(tmp_path / "horovod", "horovod", script)
    assert len(metrics(horovod)) == 8, horovod
    (tmp_path / "torch").mkdir()
    shutil.copy(tmp_path / "horovod" / "checkpoint-2.pth.tar", tmp_path / "torch")
    _, torch_out = launcher.run("torch", 2, script, "--epochs", 4, "--checkpoint-format",
                                tmp_path / "torch" / "checkpoint-{epoch}.pth.tar", timeout=240)
    assert "resumed from epoch 2" in torch_out and "Traceback" not in torch_out, torch_out
    assert metrics(torch_out) == metrics(horovod)[4:], (horovod, torch_out)
