"""Each engine launched for real, as users launch it."""
import pytest

import launcher
import shared_launches
from pipe_horovod import engine
from pipe_horovod.engine import EngineError

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return shared_launches.optimizer_folder(tmp_path_factory)


def engine_case(folder, engine_name, np):
    """engine_worker's checks, the first case of test_optimizer.py's launch of that engine
    and size (tests/shared_launches.py)."""
    shared_launches.optimizer_case(folder, engine_name, np, f"engine-{engine_name}-{np}")


@pytest.mark.parametrize("np", [1, 3])
def test_horovod_engine(folder, np):
    # np=1: bfloat16 reductions take the no-communication path; np=3: shards of
    # unequal size, and empty ones for tensors with fewer elements than ranks.
    # 2 ranks: over MPI in test_mpi.py.
    pytest.importorskip("horovod.torch")
    if np == 3:
        engine_case(folder, "horovod", 3)
    else:
        launcher.run("horovod", np, "engine_worker.py", "horovod", np)


@pytest.mark.parametrize("numel, size", [(0, 1), (0, 3), (1, 3), (2, 3), (3, 3), (10, 3), (7, 2),
                                         (12_500_000, 2), (5, 8)])
def test_horovod_bf16_shards_cover_the_tensor(numel, size):
    from pipe_horovod.engine.horovod import shard_sizes

    sizes = shard_sizes(numel, size)
    assert len(sizes) == size and sum(sizes) == numel
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_torch_engine(folder):
    # 2 ranks: under mpirun in test_mpi.py (the same checks, ranks from Open MPI's variables).
    engine_case(folder, "torch", 3)


def test_local_engine(folder):
    engine_case(folder, "local", 1)


def test_environment_override_picks_engine():
    # torchrun's environment, but the user forces the local engine... which then
    # sees one rank per process: each of the two processes is its own world.
    launcher.run("torch", 1, "engine_worker.py", "local", 1, env={"PIPE_HOROVOD_ENGINE": "local"})


@pytest.mark.parametrize("env, want", [
    ({}, "local"),
    ({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"}, "horovod"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, "torch"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "local"),
    ({"HOROVOD_RANK": "0", "PIPE_HOROVOD_ENGINE": "torch"}, "torch"),
])
def test_detect_from_launcher_environment(env, want):
    assert engine.detect(env) == want


def test_unknown_engine_is_named():
    with pytest.raises(ValueError, match=r"unknown engine 'mpich'.*horovod, local, torch"):
        engine.create("mpich")


def test_unknown_engine_from_environment(monkeypatch):
    monkeypatch.setenv("PIPE_HOROVOD_ENGINE", "bogus")
    with pytest.raises(ValueError, match="unknown engine 'bogus'"):
        engine.init()
    assert not engine.is_initialized()


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(engine.ENGINES, "horovod",
                        ("horovod", "HorovodEngine", "horovod_not_installed_here", "run `make install`"))
    with pytest.raises(EngineError, match=r"horovod_not_installed_here.*make install"):
        engine.create("horovod")


def test_calls_before_init_are_refused():
    with pytest.raises(ValueError, match="init"):
        engine.rank()


def test_local_roundtrip_in_process():
    eng = engine.init("local")
    try:
        import torch

        t = torch.arange(4.0)
        assert engine.wait(engine.allreduce_async(t, "x")) is t
        with pytest.raises(EngineError, match="already initialized"):
            engine.init("torch")
    finally:
        engine.shutdown()
    assert eng.in_flight() == 0
