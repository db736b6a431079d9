"""matplotlib is an extra of the tools, not a requirement: training never draws, and a
tool asked for a figure without it says what to install."""
import subprocess
import sys

import pytest

from pipe_horovod.tools import plotting


def test_pyplot_without_matplotlib_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # what an absent package looks like
    with pytest.raises(ModuleNotFoundError, match=r"needs matplotlib.*pip install 'pipe_horovod\[tools\]'"):
        plotting.pyplot()


def test_pyplot_draws_to_files_only():
    plt = plotting.pyplot()
    import matplotlib
    assert matplotlib.get_backend().lower() == "agg"
    assert plt is sys.modules["matplotlib.pyplot"]


def test_the_runtime_and_the_cli_import_without_matplotlib():
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "import pipe_horovod, pipe_horovod.torch, pipe_horovod.tools.cli\n"
            "print('imported')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "imported" in out.stdout, out.stderr[-3000:]
