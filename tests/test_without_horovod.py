"""pipe_horovod without Horovod: `pip install .` alone trains under plain python and torchrun,
and every path that needs Horovod says how to install it.

Horovod stays installed in the suite's environment (other tests need it): a sitecustomize on
PYTHONPATH makes `import horovod` fail in every process of a launch (torchrun's workers
inherit the variable), as it fails where Horovod was never installed. scripts/compat.sh runs
this file in environments that really lack Horovod.
"""
import subprocess
import sys

import pytest

import launcher
from pipe_horovod.engine.horovod_install import HOROVOD_VERSION

BLOCKER = '''"""Test helper: `import horovod` fails here as if Horovod were not installed."""
import importlib.abc
import sys


class _NoHorovod(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "horovod" or name.startswith("horovod."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NoHorovod())
'''

# What EngineError says when the horovod engine is chosen without Horovod.
MISSING = ("engine 'horovod' needs the package 'horovod.torch', which cannot be imported "
           "(No module named 'horovod')")
HOW = [MISSING, "launch with torchrun (the torch engine) or plain python",
       "PIPE_HOROVOD_ENGINE=torch under mpirun", "bash scripts/install_horovod.sh",
       f"pip install --no-build-isolation horovod=={HOROVOD_VERSION} cffi", "scripts/cxx17"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Launch environment: the blocker first on PYTHONPATH, then the repository."""
    blocker = tmp_path_factory.mktemp("no_horovod")
    (blocker / "sitecustomize.py").write_text(BLOCKER)
    return {"PYTHONPATH": f"{blocker}:{launcher.REPO}"}


def python(code, env, **extra_env):
    """Run `code` in a fresh interpreter under `env`; (exit code, stdout + stderr)."""
    full = {k: v for k, v in launcher.os.environ.items()
            if not k.startswith(("HOROVOD_", "OMPI_", "PIPE_HOROVOD_ENGINE"))
            and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**full, **env, **extra_env}, cwd=launcher.REPO)
    return res.returncode, res.stdout + res.stderr


def test_importing_the_torch_adapter_needs_no_horovod(env):
    rc, out = python(
        "import sys\n"
        "try:\n"
        "    import horovod\n"
        "    sys.exit('the blocker let horovod import')\n"
        "except ModuleNotFoundError:\n"
        "    pass\n"
        "import pipe_horovod.torch as hvd, pipe_horovod.torch.elastic\n"
        "print('loaded', sorted(m for m in sys.modules if m.split('.')[0] == 'horovod'))\n"
        "hvd.init()\n"
        "print('engine', hvd.size(), type(pipe_horovod.engine.current()).__name__)\n", env)
    assert rc == 0, out
    assert "loaded []" in out and "engine 1 LocalEngine" in out, out


@pytest.mark.parametrize("launch, np", [("local", 1), ("torch", 2)])
def test_training_matches_the_oracle_without_horovod(env, launch, np):
    """The optimizer at K = 1, 2, 3 against the single-process oracle (tests/oracle.py)."""
    launcher.run(launch, np, "optimizer_worker.py", "oracle", env=env, timeout=300)


@pytest.mark.parametrize("how", [{"PIPE_HOROVOD_ENGINE": "horovod"},
                                 {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"}],
                         ids=["asked-for", "under-mpirun"])
def test_the_horovod_engine_says_how_to_install_horovod(env, how):
    rc, out = python("import pipe_horovod.torch as hvd\nhvd.init()", env, **how)
    assert rc != 0
    last = out.strip().splitlines()[-1]
    assert last.startswith("pipe_horovod.engine.faults.EngineError: " + MISSING), out
    for text in HOW:
        assert text in last, (text, last)


def test_check_names_what_is_missing(env):
    # Both commands in one interpreter (its start-up is most of a command's time).
    rc, out = python("import sys; from pipe_horovod.tools import cli\n"
                     "print('RC', cli.main(['check']), flush=True)\n"
                     "print('SECOND', flush=True)\n"
                     "sys.exit(cli.main(['check', '--engine', 'horovod']))\n", env)
    first, second = out.split("SECOND\n", 1)
    assert "RC 0\n" in first, out
    assert "    [ ] horovod\n    [X] torch\n    [X] local\n" in first, out
    assert "horovod controllers:\n    (not installed)\n" in first, out
    assert f"missing:\n    {MISSING}" in first, out
    assert rc == 1 and f"error: {MISSING}" in second, out
