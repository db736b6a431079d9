"""The optimizer defects a review found, each reproduced on real workers and checked
against the oracle: concurrent hooks, a GradScaler-skipped last step, a
mid-run rollback, and wrapping the same parameters twice."""
import pytest

import launcher
import shared_launches

# One launch per engine runs them all, and test_misuse_optimizer.py's cases last
# (tests/shared_launches.py).
MODES = ["threads", "skipped", "rollback", "rewrap"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("engine_name, np", shared_launches.HARDENING_LAUNCHES)
def test_defect_is_fixed(engine_name, np, mode):
    shared_launches.hardening_case(engine_name, np, mode)


def test_wrapping_a_wrapped_optimizer_is_refused():
    import torch
    import pipe_horovod.torch as phvd
    phvd.init("local")
    try:
        model = torch.nn.Linear(2, 2)
        opt = phvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters())
        with pytest.raises(ValueError, match="DistributedOptimizer already; wrap the original"):
            phvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    finally:
        phvd.shutdown()


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("engine_name, np", [("local", 1), ("torch", 2)])
def test_cpu_and_cuda_parameters_in_one_backward(engine_name, np):
    launcher.run(engine_name, np, "hardening_worker.py", "mixed", timeout=240)
