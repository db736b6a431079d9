"""The Horovod compatibility harness's own logic (scripts/horovod_compat.py):
import rewriting, reading horovodrun + pytest output, the markdown table.
Needs neither Horovod nor its test file."""
import importlib.util
import subprocess
import time
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _load_script(name):
    """scripts/<name>.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hc = _load_script("horovod_compat")


# ---------------------------------------------------------------- imports

def test_rewrites_the_alias_import_and_nothing_else():
    src = ("import os\n"
           "import horovod.torch as hvd\n"
           "from horovod.common.util import env\n"
           "x = 'import horovod.torch as hvd'\n"
           "# import horovod.torch as hvd in a comment\n")
    new, changes = hc.rewrite_imports(src)
    assert changes == [(2, "import horovod.torch as hvd", "import pipe_horovod.torch as hvd")]
    assert new == src.replace("import horovod.torch as hvd\n", "import pipe_horovod.torch as hvd\n", 1)


@pytest.mark.parametrize("line, want", [
    ("from horovod.torch import Compression", "from pipe_horovod.torch import Compression"),
    ("from horovod.torch.mpi_ops import allreduce_async, poll",
     "from pipe_horovod.torch.mpi_ops import allreduce_async, poll"),
    ("    import horovod.torch.elastic as elastic  # lazily",
     "    import pipe_horovod.torch.elastic as elastic  # lazily"),
    ("import horovod.torch as hvd\r", "import pipe_horovod.torch as hvd\r"),
])
def test_rewrites_every_form_of_torch_import(line, want):
    new, changes = hc.rewrite_imports(line + "\n")
    assert new == want + "\n" and len(changes) == 1


def test_keeps_line_endings():
    new, _ = hc.rewrite_imports("import horovod.torch as hvd\r\nx = 1\r\n")
    assert new == "import pipe_horovod.torch as hvd\r\nx = 1\r\n"


def test_horovod_torch_lookalikes_are_left_alone():
    src = "import horovod.torch_utils as u\nimport horovod.torch as hvd\nfrom horovod.torchx import y\n"
    new, changes = hc.rewrite_imports(src)
    assert [c[0] for c in changes] == [2]
    assert "horovod.torch_utils" in new and "from horovod.torchx" in new


def test_bare_import_is_refused_and_so_is_nothing_to_do():
    with pytest.raises(ValueError, match="bare"):
        hc.rewrite_imports("import horovod.torch\nhorovod.torch.init()\n")
    with pytest.raises(ValueError, match="no `horovod.torch` import"):
        hc.rewrite_imports("import torch\n")


def test_diff_shows_only_the_import():
    src = "a = 1\nimport horovod.torch as hvd\nb = 2\n"
    new, _ = hc.rewrite_imports(src)
    diff = hc.import_diff(src, new)
    changed = [l for l in diff.splitlines() if l[:1] in "+-" and not l.startswith(("+++", "---"))]
    assert changed == ["-import horovod.torch as hvd", "+import pipe_horovod.torch as hvd"]


# ---------------------------------------------------------------- output
# Trimmed from real `horovodrun -np 2 -H localhost:2 --gloo python -m pytest -x -q -rfEs ...` runs.

PASSED = """\
[1]<stdout>:.                                                                        [100%]
[1]<stdout>:=============================== warnings summary ===============================
[1]<stdout>:test_torch.py:44
[1]<stdout>:-- Docs: https://docs.pytest.org/en/stable/how-to/capture-warnings.html
[1]<stdout>:1 passed, 2 warnings in 9.18s
[0]<stdout>:.                                                                        [100%]
[0]<stdout>:1 passed, 2 warnings in 7.69s
"""

SKIPPED = """\
[1]<stdout>:s
[1]<stdout>:=========================== short test summary info ============================
[1]<stdout>:SKIPPED [1] test_torch.py:81: No GPUs available
[1]<stdout>:1 skipped, 2 warnings in 4.37s
[0]<stdout>:s
[0]<stdout>:SKIPPED [1] test_torch.py:81: No GPUs available
[0]<stdout>:1 skipped, 2 warnings in 5.00s
"""

FAILED = """\
[1]<stdout>:F
[1]<stdout>:=================================== FAILURES ===================================
[1]<stdout>:___________________ TorchTests.test_horovod_allgather_error ____________________
[1]<stdout>:>           hvd.allgather(tensor)
[1]<stdout>:E           AttributeError: module 'pipe_horovod.torch' has no attribute 'allgather'
[1]<stdout>:test_torch.py:906: AttributeError
[1]<stdout>:=========================== short test summary info ============================
[1]<stdout>:FAILED test_torch.py::TorchTests::test_horovod_allgather_error - AttributeError: module 'pipe_horovod.torch' has no attribute 'allgather'
[1]<stdout>:!!!!!!!!!!!!!!!!!!!!!!!!!! stopping after 1 failures !!!!!!!!!!!!!!!!!!!!!!!!!!!
[1]<stdout>:1 failed, 2 warnings in 2.29s
[0]<stdout>:F
[0]<stdout>:FAILED test_torch.py::TorchTests::test_horovod_allgather_error - AttributeError: module 'pipe_horovod.torch' has no attribute 'allgather'
[0]<stdout>:1 failed, 2 warnings in 2.38s
Process 1 exit with status code 1.
Terminating remaining workers after failure of Process 1.
Process 0 exit with status code 1.
Traceback (most recent call last):
  File "/work/main/.venv/bin/horovodrun", line 6, in <module>
RuntimeError: Horovod detected that one or more processes exited with non-zero status, thus causing the job to be terminated.
"""

CRASHED = """\
[0]<stdout>:.
[0]<stdout>:1 passed in 3.10s
[1]<stderr>:Traceback (most recent call last):
[1]<stderr>:  File "/x/pipe_horovod/pipeline/core.py", line 10, in _launch
[1]<stderr>:    raise HorovodInternalError("Horovod has been shut down")
[1]<stderr>:horovod.common.exceptions.HorovodInternalError: Horovod has been shut down
Process 1 exit with status code 1.
"""


def test_pass_on_every_rank_is_pass():
    assert hc.parse_run(PASSED, 0) == ("PASS", None)


def test_skip_on_every_rank_is_skip():
    assert hc.parse_run(SKIPPED, 0) == ("SKIP", None)


def test_skip_on_one_rank_pass_on_the_other_is_pass():
    mixed = "[0]<stdout>:1 passed in 1.0s\n[1]<stdout>:1 skipped in 1.0s\n"
    assert hc.parse_run(mixed, 0)[0] == "PASS"


def test_failure_reports_pytests_one_line_reason():
    assert hc.parse_run(FAILED, 1) == (
        "FAIL", "AttributeError: module 'pipe_horovod.torch' has no attribute 'allgather'")


def test_failure_without_short_summary_falls_back_to_the_E_line():
    out = "[0]<stdout>:E       assert False\n[0]<stdout>:1 failed in 1.0s\n[1]<stdout>:1 passed in 1.0s\n"
    assert hc.parse_run(out, 1) == ("FAIL", "assert False")


def test_a_rank_that_printed_no_result_fails_with_its_exception():
    status, error = hc.parse_run(CRASHED, 1)
    assert status == "FAIL"
    assert "[1]" in error and "HorovodInternalError: Horovod has been shut down" in error


def test_passed_but_nonzero_exit_is_a_failure():
    status, error = hc.parse_run(PASSED, 1)
    assert status == "FAIL" and "exited with 1" in error


def test_errors_and_empty_runs_fail():
    err = "[0]<stdout>:ERROR test_torch.py::T::t - ImportError: nope\n[0]<stdout>:1 error in 0.5s\n" \
          "[1]<stdout>:1 error in 0.5s\n"
    assert hc.parse_run(err, 1) == ("FAIL", "ImportError: nope")
    none = "[0]<stdout>:no tests ran in 0.01s\n[1]<stdout>:no tests ran in 0.01s\n"
    assert hc.parse_run(none, 4)[0] == "FAIL"


def test_timeout():
    status, error = hc.parse_run("[0]<stdout>:.\n", None, timed_out=True, timeout=120)
    assert status == "TIMEOUT" and error.startswith("no result after 120 s")


def test_rank_outcome_reads_verbose_summary_lines_too():
    assert hc.rank_outcome(["==== 1 passed, 1 warning in 2.50s ===="]) == "passed"
    assert hc.rank_outcome(["==== 1 failed in 2.50s (0:00:02) ===="]) == "failed"
    assert hc.rank_outcome(["nothing here"]) is None
    # One test of test_tensorflow.py alone: its TF1 and eager halves are subtests.
    assert hc.rank_outcome(["1 passed, 2 subtests passed in 44.82s"]) == "passed"
    assert hc.rank_outcome(["1 passed, 1 subtests failed, 1 subtests passed in 4.1s"]) \
        == "failed"


# ---------------------------------------------------------------- environment

def test_config_environment(monkeypatch):
    monkeypatch.setenv(hc.DEPTH_ENV, "7")
    monkeypatch.setenv("PIPE_HOROVOD_ENGINE", "local")
    assert hc.DEPTH_ENV not in hc.config_env("horovod")
    assert hc.config_env("ours-k2")[hc.DEPTH_ENV] == "2"
    env = hc.config_env("ours-k1")
    assert env[hc.DEPTH_ENV] == "1" and "PIPE_HOROVOD_ENGINE" not in env
    assert env["PYTHONPATH"].split(":")[0] == str(hc.REPO)


def test_command_is_one_test_in_its_own_horovodrun():
    cmd = hc.horovodrun_command("horovodrun", "python", "test_torch.py::TorchTests::test_x")
    assert cmd[:6] == ["horovodrun", "-np", "2", "-H", "localhost:2", "--gloo"]
    assert cmd[-1] == "test_torch.py::TorchTests::test_x" and "-x" in cmd


def test_copies_keep_utils_next_to_the_tests_and_collect(tmp_path):
    tests = tmp_path / "test" / "parallel"
    tests.mkdir(parents=True)
    (tmp_path / "test" / "utils").mkdir()
    (tmp_path / "test" / "utils" / "common.py").write_text("X = 1\n")
    (tests / "test_fake.py").write_text(
        "import os, sys\n"
        "sys.path.append(os.path.join(os.path.dirname(__file__), os.pardir, 'utils'))\n"
        "from common import X\n"
        "class TestT:\n"
        "    def test_a(self):\n"
        "        import horovod.torch as hvd\n"
        "    def test_b(self):\n"
        "        pass\n")
    copies, diff = hc.prepare_copies(tests / "test_fake.py", ["horovod", "ours-k1"], tmp_path / "work")
    assert "+        import pipe_horovod.torch as hvd" in diff
    assert "import horovod.torch" in copies["horovod"].read_text()
    assert "import pipe_horovod.torch" in copies["ours-k1"].read_text()
    assert (copies["ours-k1"].parent.parent / "utils" / "common.py").exists()
    assert hc.collect(copies["_collect"], sys.executable) == ["test_fake.py::TestT::test_a", "test_fake.py::TestT::test_b"]
    assert hc.collect(copies["_collect"], sys.executable, keyword="test_b") == ["test_fake.py::TestT::test_b"]


def test_a_module_the_tests_import_that_is_missing_stops_the_run_naming_it(tmp_path):
    tests = tmp_path / "test" / "parallel"
    tests.mkdir(parents=True)
    (tmp_path / "test" / "utils").mkdir()
    (tmp_path / "test" / "utils" / "common.py").write_text(
        "import os\nimport pytest\nimport no_such_module_hc\n")
    (tests / "base.py").write_text("from no_such_module_hc2.sub import x\n")
    (tests / "test_fake.py").write_text(
        "import os, sys\n"
        "sys.path.append(os.path.join(os.path.dirname(__file__), os.pardir, 'utils'))\n"
        "from common import X\n"
        "from base import *\n"
        "try:\n    import optional_module_hc\nexcept ImportError:\n    pass\n"
        "def test_a():\n    import inside_a_test_hc\n")
    needed = hc.module_imports(tests / "test_fake.py")
    assert needed == {"pytest": "common.py", "no_such_module_hc": "common.py",
                      "no_such_module_hc2": "base.py"}, needed
    with pytest.raises(SystemExit) as stop:
        hc.check_imports([tests / "test_fake.py"], sys.executable, hc.config_env("horovod"))
    message = str(stop.value)
    assert ("cannot find: no_such_module_hc (imported by common.py), "
            "no_such_module_hc2 (imported by base.py).") in message
    assert f"{sys.executable} -m {hc.INSTALL}" in message and "pytest (" not in message
    (tmp_path / "test" / "utils" / "common.py").write_text("import pytest\n")
    (tests / "base.py").write_text("")
    hc.check_imports([tests / "test_fake.py"], sys.executable, hc.config_env("horovod"))


def test_the_install_command_names_an_extra_that_exists():
    extra = hc.INSTALL.split("[")[1].split("]")[0]
    pyproject = (SCRIPTS.parent / "pyproject.toml").read_text()
    assert f"\n{extra} = [" in pyproject
    assert f"[test,keras,{extra}]" in (SCRIPTS.parent / "Makefile").read_text()


# ---------------------------------------------------------------- markdown

def _results():
    return {"meta": {"horovod": "0.28.1", "tests_collected": 5}, "results": {
        "TorchTests::test_ok": {"horovod": {"status": "PASS"}, "ours-k2": {"status": "PASS"},
                                "ours-k1": {"status": "PASS"}},
        "TorchTests::test_missing": {
            "horovod": {"status": "PASS"},
            "ours-k2": {"status": "FAIL", "error": "AttributeError: module 'pipe_horovod.torch' has no attribute 'allgather'"},
            "ours-k1": {"status": "FAIL", "error": "AttributeError: module 'pipe_horovod.torch' has no attribute 'allgather'"}},
        "TorchTests::test_sig": {
            "horovod": {"status": "PASS"},
            "ours-k2": {"status": "FAIL", "error": "TypeError: broadcast_object() got an unexpected keyword argument 'root_rank'"}},
        "TorchTests::test_k2": {
            "horovod": {"status": "PASS"},
            "ours-k2": {"status": "FAIL", "error": "AssertionError: weights differ"},
            "ours-k1": {"status": "PASS"}},
        "TorchTests::test_gpu": {"horovod": {"status": "SKIP"}, "ours-k2": {"status": "SKIP"}},
        "TorchTests::test_broken": {"horovod": {"status": "FAIL", "error": "RuntimeError: gloo"},
                                    "ours-k2": {"status": "FAIL", "error": "x"}},
    }}


def test_markdown_table_summary_and_causes():
    md = hc.render_markdown(_results(), "python scripts/horovod_compat.py --tests X", notes="Hand-written.")
    assert "python scripts/horovod_compat.py --tests X" in md
    assert "| `test_ok` | PASS | PASS | PASS |" in md
    assert "| `test_gpu` | SKIP | SKIP | — |" in md
    assert "| Horovod | 4 | 1 | 1 | 0 | 0 |" in md
    assert "| ours K=2 | 1 | 4 | 1 | 0 | 0 |" in md
    assert "Of the 4 tests that pass on Horovod: 1 pass on ours at K=2, 2 at K=1." in md
    assert "### missing name (1)" in md and "`allgather` (1)" in md
    assert "### different signature (1)" in md
    assert "### passes at K=1, fails at K=2 (pipelining semantics) (1)" in md
    assert "- `TorchTests::test_k2` (ours K=2: FAIL): `AssertionError: weights differ`" in md
    assert "not met yet" in md
    assert "## Failing on Horovod 0.28.1 itself" in md and "`TorchTests::test_broken`: FAIL" in md
    assert f"{hc.NOTES_BEGIN}\nHand-written.\n{hc.NOTES_END}" in md


@pytest.mark.parametrize("error, cause", [
    ("ValueError: pipe_horovod has not been initialized; call pipe_horovod.init() first",
     "needs init() where Horovod does not"),
    ("AttributeError: module 'pipe_horovod.torch' has no attribute 'join'", "missing name"),
    ("TypeError: allreduce() got an unexpected keyword argument 'average'", "different signature"),
    ("AssertionError: hvd.allreduce_async did not throw error", "no error raised where Horovod raises"),
    ("assert 0.0 > 0.0", "different result"),
    ("tests passed but horovodrun exited with 1", "crash at exit"),
    ("RuntimeError: something else", "other error"),
])
def test_causes(error, cause):
    assert hc.classify("t", {"horovod": {"status": "PASS"}, "ours-k2": {"status": "FAIL", "error": error}}) == cause


def test_notes_survive_a_re_render(tmp_path):
    path = tmp_path / "compat.md"
    path.write_text(hc.render_markdown(_results(), "cmd", notes="Why K=2 differs:\n- a\n"))
    notes = hc.read_notes(path)
    assert notes == "Why K=2 differs:\n- a"
    assert hc.read_notes(tmp_path / "missing.md") is None


def test_acceptance_counts_listed_k2_exceptions(monkeypatch):
    data = _results()
    data["results"] = {k: v for k, v in data["results"].items() if k in ("TorchTests::test_ok", "TorchTests::test_k2")}
    assert "2 — met" not in hc.render_markdown(data, "cmd")
    monkeypatch.setattr(hc, "BY_DESIGN_K2", {"TorchTests::test_k2": "applies the gradient one step late"})
    md = hc.render_markdown(data, "cmd")
    assert "2/2 — met." in md and "applies the gradient one step late" in md


def test_results_file_round_trip_and_resume_key(tmp_path):
    path = tmp_path / "r.json"
    data = hc.load_results(path)
    assert data == {"meta": {}, "results": {}}
    data["results"][hc.test_key("test_torch.py::TorchTests::test_a")] = {"horovod": {"status": "PASS"}}
    hc.save_results(data, path)
    assert hc.load_results(path)["results"] == {"TorchTests::test_a": {"horovod": {"status": "PASS"}}}


def test_render_only_needs_no_test_file(tmp_path):
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    hc.save_results(_results(), out)
    proc = subprocess.run([sys.executable, str(SCRIPTS / "horovod_compat.py"), "--render-only", "--out", str(out), "--markdown", str(md)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "| `test_ok` | PASS | PASS | PASS |" in md.read_text()


# ---------------------------------------------------------------- running (a fake horovodrun)

FAKE_LAUNCHER = """\
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
open(os.environ["FAKE_PID_FILE"], "w").write(str(child.pid))
print("[0]<stdout>:1 passed in 0.1s", flush=True)
print("[1]<stdout>:1 passed in 0.1s", flush=True)
if os.environ.get("FAKE_HANG"):
    time.sleep(300)
child.kill()
"""


def _fake_horovodrun(tmp_path):
    path = tmp_path / "horovodrun"
    path.write_text(f"#!{sys.executable}\n" + FAKE_LAUNCHER)
    path.chmod(0o755)
    return str(path)


def test_run_one_reads_the_result_and_keeps_a_log(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_PID_FILE", str(tmp_path / "pid"))
    res = hc.run_one(tmp_path, "t.py::T::test_x", "ours-k1", _fake_horovodrun(tmp_path), sys.executable,
                     timeout=60, log_dir=tmp_path / "logs")
    assert res["status"] == "PASS" and res["rc"] == 0
    assert "1 passed" in (tmp_path / "logs" / "ours-k1" / "test_x.log").read_text()


def test_timeout_kills_every_process_it_started(tmp_path, monkeypatch):
    psutil = pytest.importorskip("psutil")
    monkeypatch.setenv("FAKE_PID_FILE", str(tmp_path / "pid"))
    monkeypatch.setenv("FAKE_HANG", "1")
    res = hc.run_one(tmp_path, "t.py::T::test_x", "horovod", _fake_horovodrun(tmp_path), sys.executable,
                     timeout=3)
    assert res["status"] == "TIMEOUT"
    child = int((tmp_path / "pid").read_text())
    for _ in range(50):
        if not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"grandchild {child} in its own session survived the timeout")


HUNG = """\
[1]<stdout>:.
[0]<stderr>:Timeout (0:01:40)!
[0]<stderr>:Thread 0x00007f3f3e8cb6c0 (most recent call first):
[0]<stderr>:  File "/usr/lib/python3.11/threading.py", line 982 in run
[0]<stderr>:  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap
[0]<stderr>:
[0]<stderr>:Thread 0x00007f3f41002b80 (most recent call first):
[0]<stderr>:  File "/x/pipe_horovod/engine/horovod.py", line 88 in wait
[0]<stderr>:  File "/x/pipe_horovod/torch/optimizer.py", line 301 in step
[0]<stderr>:  File "/tmp/h/test/parallel/test_torch.py", line 3025 in test_optimizer_process_sets
[0]<stderr>:  File "/venv/lib/python3.11/site-packages/_pytest/python.py", line 187 in pytest_pyfunc_call
Process 0 exit with status code -15.
RuntimeError: Horovod detected that one or more processes exited with non-zero status
"""


def test_timeout_says_where_it_hung_from_the_faulthandler_dump():
    status, error = hc.parse_run(HUNG, 1, timed_out=True, timeout=120)
    assert status == "TIMEOUT"
    assert error == ("no result after 120 s; rank 0 hung in wait (horovod.py:88), "
                     "called from test_torch.py:3025 test_optimizer_process_sets")


def test_timeout_without_a_dump_does_not_blame_the_launcher():
    out = "Process 0 exit with status code -15.\nRuntimeError: Horovod detected that one or more processes\n"
    assert hc.parse_run(out, 1, timed_out=True, timeout=120) == (
        "TIMEOUT", "no result after 120 s; workers printed nothing")


def test_copies_carry_a_faulthandler_timeout_below_the_kill(tmp_path):
    tests = tmp_path / "t"
    tests.mkdir()
    (tests / "test_f.py").write_text("import horovod.torch as hvd\n")
    copies, _ = hc.prepare_copies(tests / "test_f.py", ["ours-k2"], tmp_path / "w", timeout=120)
    assert "faulthandler_timeout = 100" in (copies["ours-k2"].parent / "pytest.ini").read_text()


# ---------------------------------------------------------------- the Keras suite

hk = _load_script("horovod_compat_keras")


def test_keras_conversion_is_the_imports_and_the_listed_renames():
    src = ("import tensorflow as tf\n"
           "import horovod.keras as hvd_keras\n"
           "import horovod.tensorflow.keras as hvd\n"
           "from horovod.common.util import is_version_greater_equal_than\n"
           "opt = keras.optimizers.RMSprop(lr=0.0001)\n"
           "cb = hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.1)\n"
           "model.compile(loss=keras.losses.mean_squared_error,\n"
           "              optimizer=opt,\n"
           "              experimental_run_tf_function=False)\n"
           "config = tf.ConfigProto()\n"
           "config.gpu_options.allow_growth = True\n"
           "K.set_session(tf.Session(config=config))\n"
           "lr = self.model.optimizer.lr.numpy()\n")
    new, changes = hk.convert(src)
    assert new == ("import tensorflow as tf\n"
                   "import pipe_horovod.keras as hvd_keras\n"
                   "import pipe_horovod.keras as hvd\n"
                   "from horovod.common.util import is_version_greater_equal_than\n"
                   "opt = keras.optimizers.RMSprop(learning_rate=0.0001)\n"
                   "cb = hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.1)\n"
                   "model.compile(loss=keras.losses.MSE,\n"
                   "              optimizer=opt)\n"
                   "lr = self.model.optimizer.learning_rate.numpy()\n")
    assert sum(count for _, count in changes) == 7 and len(changes) == 7
    assert all(len(why) > 20 for _, _, why in hk.RENAMES), "each rename says why"


def test_keras_example_outcome():
    ok = ("[0]<stdout>:EXAMPLE_END rank=0 models=1 in_flight=0 weights=ab12\n"
          "[1]<stdout>:EXAMPLE_END rank=1 models=1 in_flight=0 weights=ab12\n")
    res = hk.parse_example(ok, 0)
    assert res["status"] == "PASS" and res["weights_agree"] and res["in_flight"] == 0
    assert res["unapplied_warning"] is False
    apart = ok.replace("rank=1 models=1 in_flight=0 weights=ab12",
                       "rank=1 models=1 in_flight=1 weights=cd34") + \
        "pipe_horovod: 1 computed gradient(s) were not applied because flush() was not called\n"
    res = hk.parse_example(apart, 0)
    assert res["status"] == "PASS" and not res["weights_agree"] and res["in_flight"] == 1
    assert res["unapplied_warning"] is True
    died = "[0]<stderr>:ValueError: apply() got other variables\n"
    assert hk.parse_example(died, 1) == {"unapplied_warning": False, "status": "FAIL",
                                         "error": "ValueError: apply() got other variables"}


def test_keras_section_replaces_itself_and_survives_the_torch_render(tmp_path):
    md = tmp_path / "compat.md"
    md.write_text(hc.render_markdown(_results(), "cmd"))
    built = "ImportError: Extension horovod.tensorflow has not been built"
    data = {"meta": {"horovod_ref": "v0.28.1"}, "examples": {},
            "tests": {"Tf2KerasTests::test_a": {"ours-k2": {"status": "PASS"},
                                                "ours-k1": {"status": "PASS"},
                                                "horovod": {"status": "FAIL", "error": built}},
                      "Tf2KerasTests::test_session": {"ours-k2": {"status": "SKIP"}},
                      "Tf2KerasTests::test_legacy_optimizer": {"ours-k2": {"status": "FAIL"}}}}
    hk.write_section(md, hk.render_keras(data, "python scripts/horovod_compat_keras.py"))
    hk.write_section(md, hk.render_keras(data, "python scripts/horovod_compat_keras.py"))
    text = md.read_text()
    assert text.count(hk.KERAS_BEGIN) == 1 and "| `test_a` | FAIL | PASS | PASS |" in text
    assert "ours K=2: 1/1 of the tests" in text and "target met" in text, "test_session apart"
    assert "every run made fails at `import horovod.tensorflow.keras`" in text
    out = tmp_path / "r.json"
    hc.save_results(_results(), out)
    hc.main(["--render-only", "--out", str(out), "--markdown", str(md)])
    assert "| `test_a` | FAIL | PASS | PASS |" in md.read_text(), "the torch render kept it"


# ---------------------------------------------------------------- several tests a launch

# Trimmed from a real `horovodrun ... python -m pytest -v -s -rfE A B C` run of Horovod's
# test_tensorflow.py (run_all_in_graph_and_eager_modes: each test's halves are subtests).
BATCH = """\
[1]<stdout>:test_tensorflow.py::TensorFlowTests::test_a SUBPASSED[graph_mode]
[0]<stdout>:test_tensorflow.py::TensorFlowTests::test_a SUBPASSED[graph_mode]
[0]<stdout>:test_tensorflow.py::TensorFlowTests::test_a SUBFAILED[eager_mode]
[0]<stdout>:test_tensorflow.py::TensorFlowTests::test_a PASSED                    [ 33%]
[1]<stdout>:test_tensorflow.py::TensorFlowTests::test_a SUBPASSED[eager_mode]
[1]<stdout>:test_tensorflow.py::TensorFlowTests::test_a PASSED                    [ 33%]
[0]<stdout>:test_tensorflow.py::TensorFlowTests::test_gpu SUBSKIPPED[graph_mode]
[0]<stdout>:test_tensorflow.py::TensorFlowTests::test_gpu SUBSKIPPED[eager_mode]
[0]<stdout>:test_tensorflow.py::TensorFlowTests::test_gpu PASSED                  [ 66%]
[1]<stdout>:test_tensorflow.py::TensorFlowTests::test_gpu SUBSKIPPED[graph_mode]
[1]<stdout>:test_tensorflow.py::TensorFlowTests::test_gpu SUBSKIPPED[eager_mode]
[1]<stdout>:test_tensorflow.py::TensorFlowTests::test_gpu PASSED                  [ 66%]
[0]<stdout>:test_tensorflow.py::TensorFlowTests::test_c I0000 a log line
[0]<stdout>:test_tensorflow.py::TensorFlowTests::test_c SUBPASSED[graph_mode]
[0]<stdout>:=================================== FAILURES ===================================
[0]<stdout>:___________________ TensorFlowTests.test_a [eager_mode] ___________________
[0]<stdout>:>           state = hvd.elastic.TensorFlowState(vars1)
[0]<stdout>:E           AttributeError: module 'pipe_horovod.tensorflow' has no attribute 'elastic'
"""
BATCH_IDS = [f"test_tensorflow.py::TensorFlowTests::{t}" for t in ("test_a", "test_gpu", "test_c")]


def test_batch_reads_each_tests_halves_on_every_rank():
    got = hc.parse_batch(BATCH, BATCH_IDS)
    elastic = "AttributeError: module 'pipe_horovod.tensorflow' has no attribute 'elastic'"
    assert got == {
        "TensorFlowTests::test_a": {
            "status": "FAIL", "error": elastic,
            "modes": {"eager_mode": {"status": "FAIL", "error": elastic},
                      "graph_mode": {"status": "PASS", "error": None}}},
        "TensorFlowTests::test_gpu": {
            "status": "SKIP", "error": None,
            "modes": {"eager_mode": {"status": "SKIP", "error": None},
                      "graph_mode": {"status": "SKIP", "error": None}}}}, \
        "test_c, unfinished on both ranks, is left for a later run"
    timed_out = hc.parse_batch(BATCH, BATCH_IDS, timed_out=True, timeout=300)
    assert timed_out["TensorFlowTests::test_c"]["status"] == "TIMEOUT"


def test_batch_reads_the_outcome_of_a_test_that_printed_after_its_id():
    # pytest -v -s: the id and a space, the test's own output, then the outcome on a line
    # of its own; a line of output that only starts like an outcome is not one.
    output = "".join(f"[{r}]<stdout>:{line}\n" for r in (0, 1) for line in (
        "test_k.py::T::test_fit ", "1/5 ━━━━ 0s 206ms/step - loss: 0.4391", "ERROR in a log line",
        "PASSED", "test_k.py::T::test_skip ", "some output", "SKIPPED (Not a test.)     [ 66%]",
        "test_k.py::T::test_cut ", "Epoch 1/20",
        "=============================== warnings summary ===============================",
        "test_k.py::T::test_cut", "PASSED"))
    got = hc.parse_batch(output, [f"test_k.py::T::{t}" for t in ("test_fit", "test_skip", "test_cut")])
    assert {k: v["status"] for k, v in got.items()} == {"T::test_fit": "PASS", "T::test_skip": "SKIP"}


def test_batch_command_runs_every_test_and_shows_live_outcomes():
    cmd = hc.horovodrun_command("horovodrun", "python", BATCH_IDS)
    assert cmd[-3:] == BATCH_IDS and "-x" not in cmd and {"-v", "-s"} <= set(cmd)


def test_common_is_cut_to_the_imported_helpers():
    common = ("import os\nimport mock\nfrom horovod.runner.util.threads import in_thread\n\n"
              "def wanted():\n    return os.sep\n\ndef other():\n    return mock\n")
    cut = hc.common_helpers(common, "from common import wanted\n")
    assert cut == "import os\n\ndef wanted():\n    return os.sep\n"
    with pytest.raises(ValueError, match="missing"):
        hc.common_helpers(common, "from common import missing\n")


# ---------------------------------------------------------------- the TensorFlow suite

ht = _load_script("horovod_compat_tensorflow")


def test_tensorflow_conversion_is_the_imports_only():
    src = ("from horovod.tensorflow.util import _executing_eagerly\n"
           "import horovod.tensorflow as hvd\n"
           "from base_test_tensorflow import *\n")
    new, changes = hk.convert(src, ht.TENSORFLOW)
    assert new == src.replace("horovod.tensorflow", "pipe_horovod.tensorflow")
    assert len(changes) == 2
    assert hk.convert("import os\n", ht.TENSORFLOW) == ("import os\n", []), "a helper module"


def test_tensorflow_categories_come_from_the_code():
    src = ("class T:\n"
           "    def test_gpu(self):\n"
           "        if not tf.test.is_gpu_available(cuda_only=True):\n"
           "            self.skipTest('No GPUs available')\n"
           "    def test_tf1(self):\n"
           "        if hvd.util._executing_eagerly():\n"
           "            self.skipTest('Not in eager execution mode')\n"
           "    def test_elastic(self):\n"
           "        if not hvd._executing_eagerly() and _IS_TF2:\n"
           "            return\n"
           "    def test_plain(self):\n"
           "        pass\n")
    assert ht.classify(src) == {"test_gpu": "GPU-only", "test_tf1": "TF1-only",
                                "test_elastic": "TF2", "test_plain": "TF2"}


def test_tensorflow_section_counts_the_eager_halves(tmp_path):
    md = tmp_path / "compat.md"
    md.write_text(hc.render_markdown(_results(), "cmd"))
    half = lambda e, g: {"status": hc._combine([e, g]), "modes": {  # noqa: E731
        "eager_mode": {"status": e}, "graph_mode": {"status": g}}}
    data = {"meta": {"categories": {"test_a": "TF2", "test_b": "TF2", "test_g": "GPU-only"}},
            "tests": {"TensorFlowTests::test_a": {"ours-k2": half("PASS", "FAIL"),
                                                  "ours-k1": half("PASS", "PASS")},
                      "TensorFlowTests::test_b": {"ours-k2": half("FAIL", "PASS")},
                      "TensorFlowTests::test_g": {"ours-k2": half("SKIP", "SKIP")},
                      "TensorFlowTests::test_session": {"ours-k2": {"status": "SKIP"}}}}
    hk.write_section(md, ht.render_tensorflow(data, "cmd"), ht.TENSORFLOW.begin, ht.TENSORFLOW.end)
    open_, close = hk.SECTION_NOTES
    md.write_text(md.read_text().replace(f"{open_}\n{close}", f"{open_}\nwhy it fails\n{close}"))
    hk.write_section(md, ht.render_tensorflow(data, "cmd"), ht.TENSORFLOW.begin, ht.TENSORFLOW.end)
    text = md.read_text()
    assert "why it fails" in text, "a re-render keeps the section's notes"
    assert "ours K=2: 1/2 of the TF2 tests run pass eagerly." in text
    assert "ours K=1: 1/1 of the TF2 tests run pass eagerly (1 not run at this depth)." in text
    assert "| `test_a` | TF2 | PASS | FAIL | PASS | PASS |" in text
    assert "| `test_session` | not Horovod's | SKIP | SKIP | — | — |" in text
    out = tmp_path / "r.json"
    hc.save_results(_results(), out)
    hc.main(["--render-only", "--out", str(out), "--markdown", str(md)])
    assert text.count(hc.TENSORFLOW_BEGIN) == 1 and "| `test_a` | TF2 |" in md.read_text(), \
        "the torch render kept it"
