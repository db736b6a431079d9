"""The MPI path: Horovod's MPI controller and plain mpirun, and what `pipe-horovod check` says.

One launch per launcher and engine runs every engine check and the optimizer
oracle (K in 1..3) on 2 ranks: the same workers as the Gloo/torchrun tests.
"""
import argparse
import re
import subprocess

import pytest

import launcher
from pipe_horovod import engine
from pipe_horovod.collectives.group import free_port
from pipe_horovod.tools.commands import check
from pipe_horovod.engine import EngineError
from pipe_horovod.engine.torch_dist import env_from_mpirun

pytestmark = pytest.mark.timeout(400)


@pytest.mark.parametrize("launch, engine_name", [
    ("horovod-mpi", "horovod"),     # horovodrun --mpi: mpirun underneath, no HOROVOD_RANK
    ("mpirun", "horovod"),          # plain mpirun: the MPI environment picks Horovod
    ("mpirun", "torch"),            # plain mpirun, torch.distributed (gloo) told by the user
])
def test_engine_and_oracle_under_mpi(launch, engine_name):
    why = launcher.mpi_missing() if engine_name == "horovod" else launcher.mpirun_missing()
    if why:
        pytest.skip(why)
    env = {}
    if engine_name == "torch":
        env = {"PIPE_HOROVOD_ENGINE": "torch", "MASTER_PORT": str(free_port("127.0.0.1"))}
    # On the horovod engine one rank ends early and the other names it: rank 1
    # under horovodrun --mpi; under mpirun rank 0, which hosts the status board.
    ender = 1 if launch == "horovod-mpi" else 0
    _, out = launcher.run(launch, 2, "mpi_worker.py", engine_name, 2, ender, env=env,
                          timeout=300)
    if engine_name == "horovod":
        assert f"ENDED_NAMED rank={1 - ender}" in out, out


def check_build_marks():
    """`horovodrun --check-build`'s [X]/[ ] per line, by section: the oracle for ours."""
    out = subprocess.run([str(launcher.BIN / "horovodrun"), "--check-build"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    sections, current = {}, None
    for line in out.splitlines():
        if line.strip().endswith(":") and not line.strip().startswith("Horovod"):
            current = sections.setdefault(line.strip()[:-1], {})
        elif m := re.match(r"\s*\[(X| )\] (\w+)", line):
            current[m.group(2).lower()] = m.group(1) == "X"
    return sections


def test_check_reports_horovods_controllers_and_ops(capsys):
    pytest.importorskip("horovod.torch")
    theirs = check_build_marks()
    ours = check.report()
    assert ours["horovod controllers"] == theirs["Available Controllers"]
    assert ours["horovod tensor operations"] == theirs["Available Tensor Operations"]

    def run(*argv):
        parser = argparse.ArgumentParser()
        check.add_arguments(parser)
        return check.run(parser.parse_args(argv)), capsys.readouterr().out

    mpi = theirs["Available Controllers"]["mpi"]
    rc, out = run("--controller", "mpi")
    assert (rc, "error: Horovod with the mpi controller is not available here" in out) == (
        (0, False) if mpi else (1, True)), out
    assert ("    [X] mpi" if mpi else "    [ ] mpi") in out.split("horovod controllers:")[1]
    rc, out = run("--ops", "nccl")
    nccl = theirs["Available Tensor Operations"]["nccl"]
    assert (rc, "error: Horovod with nccl tensor operations is not available here" in out) == (
        (0, False) if nccl else (1, True)), out


def test_check_says_in_one_line_why_there_is_no_gpu():
    import torch

    gpus = check.report()["gpus"]
    assert next(iter(gpus)) == f"cuda {torch.version.cuda or '(CPU build of torch)'}"
    assert check.no_gpu_line({"cuda (CPU build of torch)": False}) == (
        "no GPU: this torch is a CPU build; training runs on the CPU")
    assert "no GPU visible" in check.no_gpu_line({"cuda 13.0": True})
    assert check.no_gpu_line({"cuda 13.0": True, "0: NVIDIA H100": True}) is None


def test_mpirun_environment_picks_horovod_and_feeds_torch():
    ompi = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert engine.detect(ompi) == "horovod"
    assert engine.detect({**ompi, "PIPE_HOROVOD_ENGINE": "torch"}) == "torch"

    env = dict(ompi)
    env_from_mpirun(env)
    assert env == {**ompi, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    torchrun = {**ompi, "RANK": "0", "WORLD_SIZE": "2"}     # torchrun's own variables win
    env = dict(torchrun)
    env_from_mpirun(env)
    assert env == torchrun

    across_nodes = {**ompi, "OMPI_COMM_WORLD_SIZE": "4"}
    with pytest.raises(EngineError, match=r"4 ranks, 2 on this node.*-x MASTER_ADDR="):
        env_from_mpirun(dict(across_nodes))
    env = {**across_nodes, "MASTER_ADDR": "node1", "MASTER_PORT": "1234"}
    env_from_mpirun(env)
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["WORLD_SIZE"]) == ("node1", "1234", "4")
