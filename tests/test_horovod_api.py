"""Horovod's non-optimizer API in pipe_horovod.torch: names, signatures, results.

Each engine runs tests/workers/api_worker.py once per rank count (as the first case of
collectives_worker.py's launch of that engine and size, tests/shared_launches.py, or
alone); the worker checks every collective against values each rank computes itself. Bad input
is checked here, in one process, on the local engine: the checks live in
the engine base class, before any library call, so they are the same on
every engine.
"""
import inspect
import json
import warnings

import pytest
import torch

import launcher
import pipe_horovod.torch as hvd
import shared_launches
from tolerance import gamma, relative_error

pytestmark = pytest.mark.timeout(300)


@pytest.mark.timeout(600)      # the shared launch runs the collectives' cases too
@pytest.mark.parametrize("engine_name, np", [("horovod", 2), ("horovod", 3), ("torch", 2),
                                             ("torch", 3), ("local", 1)])
def test_api_against_oracle(engine_name, np, tmp_path):
    if "api" in shared_launches.COLLECTIVES.get((engine_name, np), ()):
        shared_launches.collectives_case(engine_name, np, "api")
    else:
        launcher.skip_without(engine_name)
        launcher.run(engine_name, np, "api_worker.py", engine_name, np, tmp_path, timeout=240)


# --- names and signatures, against horovod.torch itself ------------------------
HOROVOD_MODULES = {"check_extension", "compression", "elastic", "mpi_lib_v2", "mpi_ops",
                   "functions", "optimizer", "sync_batch_norm"}


def horovod_torch():
    if launcher.horovod_missing():
        pytest.skip(launcher.horovod_missing())
    import horovod.torch

    return horovod.torch


def test_every_horovod_name_exists():
    theirs = {n for n in dir(horovod_torch()) if not n.startswith("_")} - HOROVOD_MODULES
    assert sorted(theirs - set(dir(hvd))) == []


def parameters(fn):
    return [(p.name, p.kind, p.default is inspect.Parameter.empty)
            for p in inspect.signature(fn).parameters.values()]


def test_signatures_match_horovod():
    real = horovod_torch()
    names = {n for n in dir(real) if not n.startswith("_")} - HOROVOD_MODULES
    skip = {"init", "shutdown", "DistributedOptimizer"}   # *args wrappers there; optimizer elsewhere
    for name in sorted(names - skip):
        theirs, ours = getattr(real, name), getattr(hvd, name)
        if not inspect.isfunction(theirs):
            continue
        got, want = parameters(ours), parameters(theirs)
        if name == "allgather_object":      # ours adds process_set, after Horovod's parameters
            got = got[:len(want)]
        assert got == want, f"{name}: ours {got}, Horovod's {want}"
    # Horovod's own two, then ours (keyword-only): the engine, and how long any wait may
    # block (PIPE_HOROVOD_TIMEOUT)
    assert [p[0] for p in parameters(hvd.init)] == ["comm", "process_sets", "engine", "timeout"]


# --- the local engine, in this process -------------------------------------------
@pytest.fixture
def local():
    hvd.init("local")
    yield
    hvd.shutdown()


def test_init_names_the_engine_by_keyword_or_by_comm():
    with pytest.raises(ValueError, match="two engines: comm='torch' and engine='local'"):
        hvd.init("torch", engine="local")
    assert not hvd.is_initialized()
    hvd.init(engine="local")
    try:
        assert hvd.is_initialized() and hvd.size() == 1
    finally:
        hvd.shutdown()


def test_one_process_results(local, tmp_path):
    t = torch.arange(6.0).reshape(3, 2)
    for op in (hvd.Average, hvd.Sum, hvd.Min, hvd.Max, hvd.Product, hvd.Adasum):
        assert torch.equal(hvd.allreduce(t, op=op), t)
    assert torch.equal(hvd.allreduce(t, op=hvd.Sum, prescale_factor=2.0, postscale_factor=3.0), t * 6)
    ints = torch.tensor([3, 5])
    assert torch.equal(hvd.allreduce(ints, prescale_factor=1.5), torch.tensor([4, 7]))  # truncates
    assert torch.equal(hvd.allgather(t), t) and torch.equal(hvd.broadcast(t, 0), t)
    out, splits = hvd.alltoall(t, splits=[3])
    assert torch.equal(out, t) and splits.tolist() == [3] and splits.dtype == torch.int32
    assert torch.equal(hvd.alltoall(t), t)
    assert torch.equal(hvd.reducescatter(t), t)
    assert hvd.join() == 0 and hvd.barrier() is None
    assert hvd.broadcast_object({"a": 1}) == {"a": 1} and hvd.allgather_object(3) == [3]
    assert (hvd.rank(), hvd.size(), hvd.cross_rank(), hvd.cross_size()) == (0, 1, 0, 1)
    assert hvd.nccl_built() == 0 and hvd.gloo_enabled() is False
    path = tmp_path / "timeline.json"
    hvd.start_timeline(str(path))
    hvd.allreduce(t, name="traced")
    hvd.stop_timeline()
    assert [e["args"]["tensor"] for e in json.loads(path.read_text()) if e] == ["traced"]


def test_one_process_sync_batch_norm_is_batch_norm(local):
    torch.manual_seed(0)
    ours, plain = hvd.SyncBatchNorm(4), torch.nn.BatchNorm2d(4)
    x = torch.randn(5, 4, 3, 3)
    # Per channel, the mean and the variance are sums of n terms, then a few more roundings.
    rtol = 2 * gamma(2 * x[:, 0].numel() + 4, x.dtype)
    assert relative_error(ours(x), plain(x)) <= rtol
    assert relative_error(ours.running_var, plain.running_var) <= rtol


def test_autograd_in_one_process(local):
    x = torch.arange(4.0, requires_grad=True)
    (hvd.allreduce(x, op=hvd.Sum) * 3).sum().backward()
    assert x.grad.tolist() == [3.0] * 4


def test_legacy_average_argument(local):
    with pytest.warns(DeprecationWarning, match="replaced with `op`"):
        hvd.allreduce(torch.ones(2), average=True)
    with pytest.raises(ValueError, match="supersedes average"):
        hvd.allreduce(torch.ones(2), average=True, op=hvd.Sum)


def test_engine_interface_keeps_its_old_form(local):
    from pipe_horovod import engine

    t = torch.arange(4.0)
    h = engine.allreduce_async(t, "grad.0.0")
    assert engine.wait(h) is t
    h = engine.allreduce_async(t, "grad.0.1", engine.Sum, prescale_factor=2.0,
                               process_set=hvd.global_process_set)
    assert engine.wait(h).tolist() == [0.0, 2.0, 4.0, 6.0]


BAD_INPUT = [
    (lambda: hvd.allreduce_async_(torch.ones(4, 4).t()), ValueError, "contiguous"),
    (lambda: hvd.allreduce([1.0]), TypeError, "torch.Tensor"),
    (lambda: hvd.allreduce(torch.ones(2), op="max"), ValueError, "unknown reduce op"),
    (lambda: hvd.allreduce(torch.ones(2), prescale_factor="2"), TypeError, "prescale_factor"),
    (lambda: hvd.allreduce(torch.ones(2), name=""), ValueError, "non-empty string name"),
    (lambda: hvd.allreduce(torch.ones(2, dtype=torch.int32), op=hvd.Adasum), ValueError,
     "floating-point"),
    (lambda: hvd.grouped_allreduce([]), ValueError, "at least one tensor"),
    (lambda: hvd.grouped_allreduce(torch.ones(2)), TypeError, "list of tensors"),
    (lambda: hvd.reducescatter(torch.ones(2), op=hvd.Max), ValueError, "Average, Sum"),
    (lambda: hvd.allgather(torch.tensor(1.0)), ValueError, "0-dimensional"),
    (lambda: hvd.alltoall(torch.ones(3), splits=[1, 2]), ValueError, "1 non-negative"),
    (lambda: hvd.alltoall(torch.ones(3), splits=[2]), ValueError, "summing"),
    (lambda: hvd.alltoall(torch.ones(3), splits=[1.5]), ValueError, "integers"),
    (lambda: hvd.alltoall(torch.ones(3), splits="3"), TypeError, "splits"),
    (lambda: hvd.broadcast(torch.ones(2), 1), ValueError, "out of range"),
    (lambda: hvd.broadcast_object(1, root_rank=-1), ValueError, "out of range"),
    (lambda: hvd.synchronize(123), ValueError, "unknown handle"),
    (lambda: hvd.poll("h"), ValueError, "unknown handle"),
    (lambda: hvd.join("cpu"), TypeError, "device"),
    (lambda: hvd.barrier(process_set=[0]), TypeError, "ProcessSet"),
    (lambda: hvd.allreduce(torch.ones(2), process_set=hvd.ProcessSet([0])), ValueError,
     "not registered"),
    (lambda: hvd.add_process_set([0]), ValueError, "duplicates the global"),
    (lambda: hvd.add_process_set([0, 3]), ValueError, "there are 1 rank"),
    (lambda: hvd.add_process_set([]), ValueError, "no ranks"),
    (lambda: hvd.ProcessSet("01"), ValueError, "list of global ranks"),
    (lambda: hvd.ProcessSet([0.0]), ValueError, "integers"),
    (lambda: hvd.ProcessSet([1, 1]), ValueError, "distinct"),
    (lambda: hvd.init(process_sets="static"), ValueError, "'dynamic'"),
    (lambda: hvd.mpi_threads_supported(), ValueError, "MPI is not enabled"),
    (lambda: hvd.sparse_allreduce_async(torch.ones(2), "s", hvd.Sum), TypeError, "sparse COO"),
    (lambda: hvd.SyncBatchNorm(2)(torch.ones(2)), ValueError, "2D"),
    (lambda: hvd.SyncBatchNorm(2).train()(torch.ones(1, 2)), ValueError, "more than 1 value"),
]


@pytest.mark.parametrize("call, error, text", BAD_INPUT,
                         ids=[f"{i}-{t}" for i, (_, _, t) in enumerate(BAD_INPUT)])
def test_bad_input_is_a_clear_error(local, call, error, text):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(error, match=text):
            call()


def test_name_in_flight_is_refused_and_freed(local):
    h = hvd.allreduce_async(torch.ones(2), name="dup")
    with pytest.raises(ValueError, match="already in flight"):
        hvd.allreduce_async(torch.ones(2), name="dup")
    hvd.synchronize(h)
    hvd.synchronize(hvd.allreduce_async(torch.ones(2), name="dup"))


def test_process_set_queries_before_registration():
    ps = hvd.ProcessSet([2, 0])
    assert ps.ranks == [0, 2] and ps.size() is None and ps.rank() is None
    assert ps.process_set_id is None


def test_build_queries_answer_before_init(monkeypatch):
    # Horovod answers *_built before hvd.init() (its own tests skip on them first);
    # *_enabled describe a running library and need init, as in Horovod.
    import torch.distributed as dist

    assert not hvd.is_initialized()
    monkeypatch.delenv("PIPE_HOROVOD_ENGINE", raising=False)
    assert not hvd.gloo_built() and not hvd.mpi_built()          # plain python: local engine
    with pytest.raises(ValueError, match="not been initialized"):
        hvd.gloo_enabled()
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)                           # as under torchrun
    assert hvd.gloo_built() == dist.is_gloo_available()
    assert hvd.mpi_built() == dist.is_mpi_available()
    if launcher.horovod_missing() is None:
        monkeypatch.setenv("HOROVOD_RANK", "0")                   # as under horovodrun
        import horovod.torch as horovod
        assert hvd.gloo_built() == horovod.gloo_built()
        assert hvd.mpi_built() == horovod.mpi_built()
    assert not hvd.is_initialized()
