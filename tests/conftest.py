"""Suite-wide set-up that must happen before any test module is imported.

TensorFlow >= 2.20 loads its library with RTLD_GLOBAL, and a triton imported
after it binds to TensorFlow's LLVM and segfaults (tensorflow#124205).
Collecting tests/test_keras*.py imports TensorFlow, and a CUDA build of torch
imports triton the first time a test in this process makes a torch.optim
optimizer; the CPU build has no triton. So triton, where installed, is
imported here, before TensorFlow can be.

The optimizers tune themselves by default (tune="auto": their first 20 steps at
K=1, then what they measured fastest). Most tests check a fixed configuration
against its oracle (K=2 with the lookahead, where they name no depth), so the
suite runs with PIPE_HOROVOD_TUNE=off, inherited by every worker it launches;
the tests of the default itself (test_auto.py, the users' scripts, README and
examples) clear it where they run what a user gets.
"""
import importlib.util
import os

import pytest

if importlib.util.find_spec("triton") is not None:
    import triton  # noqa: F401

os.environ["PIPE_HOROVOD_TUNE"] = "off"


# `make test` runs the suite on two pytest-xdist workers (scripts/run_tests.sh): much of a
# launch is waiting (a stall's seconds, a rendezvous, an emulated link), so two files at a
# time use the 2-core machine that one leaves half idle. A file's tests stay on one worker
# (its module fixtures run once), and so do the files that read one shared launch
# (shared_launches.SHARING: launcher.run_once caches a launch per process).
@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    # xdist's own --dist loadgroup reads a group its hook writes into the node id, which
    # pytest 9 no longer lets a plugin change; a scheduler by scope does the same here.
    from xdist.scheduler import LoadScopeScheduling

    import shared_launches

    class ByWorkerShare(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return shared_launches.worker_share(nodeid)
    return ByWorkerShare(config, log)
