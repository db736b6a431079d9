"""hvd.elastic: run, TorchState, ElasticSampler, with the pipeline's gradients in flight.

The multi-process tests train under `run` twice, once without and once with
a failure after a commit, and require the same final weights bit for bit
(the failure-free run is the oracle) and every sample processed exactly
once per epoch (checked by the workers). Under horovodrun's elastic mode
the failure is raised on one rank and recovered by Horovod's reset in the
same processes; torchrun and plain python recover in-process from a
failure every rank raises. The workers run the default compensation
(lookahead): each rank's kept own gradient must survive the sync after a
restore, or the restored run predicts from rank 0's.
"""
import copy
import re
import sys
import types

import pytest
import torch
import torch.nn.functional as F

import launcher
import pipe_horovod.torch as phvd
from pipe_horovod.engine import HorovodInternalError, HostsUpdatedInterrupt
from pipe_horovod.torch.elastic import sampler as sampler_module

pytestmark = pytest.mark.timeout(600)
WORKER = launcher.WORKERS / "elastic_worker.py"


def _horovodrun_elastic(tmp_path, np, hosts, args, final_np=None, timeout=240):
    """horovodrun's elastic mode on this machine, starting `np` workers: hosts from a
    discovery script that prints the file `hosts` (so a worker can change it)."""
    hosts_file = tmp_path / "hosts.txt"
    hosts_file.write_text(hosts)
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts_file}\n")
    script.chmod(0o755)
    # --network-interface lo: without it Horovod wants two hosts to find common interfaces.
    cmd = [str(launcher.BIN / "horovodrun"), "-np", str(np), "--min-np", "1", "--max-np", "2",
           "--host-discovery-script", str(script), "--network-interface", "lo", "--gloo",
           sys.executable, str(WORKER), *map(str, args)]
    return launcher.run_command(cmd, final_np or np, timeout=timeout)[1]


def _same_run(clean, failed):
    a, b = torch.load(clean), torch.load(failed)
    assert a["seen"] == b["seen"], "the restored run processed other samples"
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), f"{name} differs after restore"


# 2:int8_ef: the two stages point to point on pipe_horovod's gloo group, where rank 0
# waits for messages the failed rank never sends; the reset abandons them.
@pytest.mark.parametrize("depth", ["2", "2:int8_ef"])
def test_horovodrun_elastic_failure_on_one_rank_restores_bit_exactly(tmp_path, depth):
    pytest.importorskip("horovod.torch")
    clean, failed = tmp_path / "clean.pt", tmp_path / "failed.pt"
    _horovodrun_elastic(tmp_path, 2, "localhost:2\n", ["clean", depth, clean])
    out = _horovodrun_elastic(tmp_path, 2, "localhost:2\n", ["fail-one", depth, failed])
    assert "INJECTED_FAILURE rank=1" in out
    # Both ranks went through Horovod's reset (rank 0 by the failed collectives).
    resets = re.findall(r"ELASTIC_RESET rank=(\d+) size=2 session=(\S+)", out)
    assert {int(r) for r, _ in resets} == {0, 1}, out
    # ... into one new board session, every rank's the same (the worker: not the last one).
    assert len({s for _, s in resets}) == 1 and resets[0][1] != "None", out
    _same_run(clean, failed)


def test_horovodrun_elastic_survives_a_worker_process_dying(tmp_path):
    # Two "hosts" on this machine (127.0.0.1 is local to horovodrun, so no ssh): rank 1's
    # process exits mid-step; Horovod blacklists its host, rank 0's collectives fail, and
    # it restores the last commit and finishes alone, every sample processed once.
    pytest.importorskip("horovod.torch")
    out = _horovodrun_elastic(tmp_path, 2, "localhost:1\n127.0.0.1:1\n",
                              ["crash", 2, tmp_path / "out.pt"], final_np=1)
    assert "INJECTED_CRASH rank=1" in out and "ELASTIC_RESET rank=0 size=1" in out, out


def test_horovodrun_elastic_worker_added_receives_the_state(tmp_path):
    # One host at first; rank 0 lists a second after a commit, Horovod starts a
    # worker there, the next commit raises HostsUpdatedInterrupt, and the new worker
    # gets rank 0's state (gradients in flight included) by the sync.
    pytest.importorskip("horovod.torch")
    out = _horovodrun_elastic(tmp_path, 1, "localhost:1\n",
                              ["scale", 2, tmp_path / "out.pt", tmp_path / "hosts.txt"], final_np=2)
    assert "ELASTIC_RESET rank=0 size=2" in out, out
    assert re.search(r"WORKER_OK rank=1 size=2", out), out


# torchrun and plain python: the clean run and the failing one in the same processes, one
# launch (the worker asserts each run's count of resets: none, then one).
@pytest.mark.parametrize("depth", [2])
def test_torchrun_failure_on_every_rank_restores_bit_exactly(tmp_path, depth):
    clean, failed = tmp_path / "clean.pt", tmp_path / "failed.pt"
    _, out = launcher.run("torch", 2, WORKER, "clean", depth, clean, "fail-all", depth, failed,
                          timeout=240)
    assert out.count("ELASTIC_RESET") == 2, out
    _same_run(clean, failed)


def test_local_failure_restores_bit_exactly(tmp_path):
    runs = {depth: (tmp_path / f"clean-{depth}.pt", tmp_path / f"failed-{depth}.pt")
            for depth in (1, 3)}
    _, out = launcher.run("local", 1, WORKER, *[arg for depth, (clean, failed) in runs.items()
                                               for arg in ("clean", depth, clean,
                                                           "fail-all", depth, failed)],
                          timeout=240)
    assert out.count("ELASTIC_RESET rank=0 size=1") == 2, out
    for clean, failed in runs.values():
        _same_run(clean, failed)


# --- in one process, local engine ---------------------------------------------
@pytest.fixture
def local():
    phvd.init("local")
    yield
    phvd.shutdown()


def _setup(depth=2):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = phvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                    named_parameters=model.named_parameters(),
                                    pipeline_depth=depth, staleness_compensation=None)
    return model, opt


def _step(model, opt, seed, step=True):
    g = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    F.mse_loss(model(torch.randn(5, 3, generator=g)), torch.randn(5, 2, generator=g)).backward()
    if step:
        opt.step()


def _equal_states(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal_states(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal_states(x, y) for x, y in zip(a, b))
    return a == b


def test_restore_returns_to_the_commit_with_its_gradients_in_flight(local):
    model, opt = _setup(depth=3)
    state = phvd.elastic.TorchState(model, opt, epoch=0, log=[])
    for seed in range(4):
        _step(model, opt, seed)
    state.epoch, state.log = 1, ["a"]
    state.commit()
    weights, committed = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    assert len(committed["pipe_horovod"]["in_flight"]) == 2
    for seed in range(4, 7):
        _step(model, opt, seed)
    state.epoch = 2
    state.log.append("changed in place")
    _step(model, opt, 7, step=False)            # fails between backward and step
    state.restore()
    assert state.epoch == 1 and state.log == ["a"]
    assert _equal_states(model.state_dict(), weights)
    assert _equal_states(opt.state_dict(), committed)
    # ...and continues exactly as training on from the commit would.
    twin_model, twin_opt = _setup(depth=3)
    twin_model.load_state_dict(weights)
    twin_opt.load_state_dict(copy.deepcopy(committed))
    for seed in range(4, 8):
        _step(model, opt, seed)
        _step(twin_model, twin_opt, seed)
    opt.flush()
    twin_opt.flush()
    assert _equal_states(model.state_dict(), twin_model.state_dict())


def test_a_commit_that_fails_half_way_keeps_the_previous_one(local, monkeypatch):
    model, opt = _setup()
    state = phvd.elastic.TorchState(model=model, optimizer=opt, batch=0)
    _step(model, opt, 0)
    state.batch = 1
    state.commit()
    weights = copy.deepcopy(model.state_dict())
    _step(model, opt, 1)
    state.batch = 2

    def failing():
        raise HorovodInternalError("a peer failed while the gradient was in flight")

    monkeypatch.setattr(opt, "state_dict", failing)
    with pytest.raises(HorovodInternalError):
        state.commit()
    monkeypatch.undo()
    state.restore()
    assert state.batch == 1 and _equal_states(model.state_dict(), weights)


def test_assigning_a_tracked_object_commits_it(local):
    model, opt = _setup()
    state = phvd.elastic.TorchState(model=model, optimizer=opt)
    other, _ = _setup()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1)
    state.model = other
    weights = copy.deepcopy(other.state_dict())
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    state.restore()
    assert state.model is other and _equal_states(other.state_dict(), weights)


def test_host_updates_interrupt_at_commit(local):
    state = phvd.elastic.TorchState(epoch=0)
    state.commit()                               # nothing heard: no interrupt
    state.on_hosts_updated(10, 2)                # hosts added: the new ones need the state
    with pytest.raises(HostsUpdatedInterrupt) as added:
        state.commit()
    assert added.value.skip_sync is False
    state.on_hosts_updated(5, 1)                 # older than the last one seen: ignored
    state.check_host_updates()
    state.on_hosts_updated(11, 1)                # only removed: survivors need no sync
    with pytest.raises(HostsUpdatedInterrupt) as removed:
        state.check_host_updates()
    assert removed.value.skip_sync is True


def test_run_restores_on_internal_error_and_keeps_state_on_host_update(local):
    state = phvd.elastic.TorchState(step=0)
    events = []
    state.register_reset_callbacks([lambda: events.append(("reset", state.step))])
    plan = [HorovodInternalError("lost a peer"), HostsUpdatedInterrupt(True), None]

    @phvd.elastic.run
    def train(state, stop):
        while state.step < stop:
            state.step += 1
            if state.step == 3:
                state.commit()
            if state.step == 4 and plan:
                error = plan.pop(0)
                if error is not None:
                    raise error
        return state.step

    assert train(state, 6) == 6
    # Internal error: back to the commit (3). Host update: state kept (4), no restore.
    assert events == [("reset", 3), ("reset", 4)]


def _attempts(failures):
    """A training function that raises `failures` in order (None: returns), counting its
    calls; past the list it stops the test instead of looping on."""
    calls = []

    def train(state):
        calls.append(state.step)
        if len(calls) > len(failures):
            raise AssertionError(f"called {len(calls)} times: the loop did not end")
        failure = failures[len(calls) - 1]
        if failure is not None:
            state.step += 1
            if callable(failure):
                failure = failure(state)
            raise failure
        return "done"
    return train, calls


def test_the_same_failure_after_every_restore_ends_the_run(local, monkeypatch):
    """A failure that restoring does not cure (the same error at the same point every
    time) ends `run` after PIPE_HOROVOD_ELASTIC_MAX_SAME_FAILURES (default 3) attempts in
    a row, naming it and the count, instead of looping forever with nothing printed."""
    from pipe_horovod.common import RepeatedFailureError

    monkeypatch.delenv("PIPE_HOROVOD_ELASTIC_MAX_SAME_FAILURES", raising=False)
    same = HorovodInternalError("rank 1 passed another size")
    train, calls = _attempts([same] * 4)
    with pytest.raises(RepeatedFailureError) as info:
        phvd.elastic.run(train)(phvd.elastic.TorchState(step=0))
    assert calls == [0, 0, 0]                   # each attempt restored to the commit
    assert info.value.count == 3 and info.value.cause is same and info.value.__cause__ is same
    assert str(info.value) == (
        "elastic training stopped: the same failure ended 3 attempts in a row, each restored "
        "from the same commit, so restoring does not cure it: HorovodInternalError: rank 1 "
        "passed another size. Fix its cause (it is raised above); "
        "PIPE_HOROVOD_ELASTIC_MAX_SAME_FAILURES sets how many identical failures in a row "
        "end the run")
    assert not isinstance(info.value, HorovodInternalError)    # no elastic loop retries it

    monkeypatch.setenv("PIPE_HOROVOD_ELASTIC_MAX_SAME_FAILURES", "1")
    train, calls = _attempts([same])
    with pytest.raises(RepeatedFailureError, match="ended 1 attempts in a row"):
        phvd.elastic.run(train)(phvd.elastic.TorchState(step=0))
    assert calls == [0]


def test_failures_that_differ_or_follow_progress_are_retried(local, monkeypatch):
    monkeypatch.delenv("PIPE_HOROVOD_ELASTIC_MAX_SAME_FAILURES", raising=False)
    same = HorovodInternalError("lost a peer")
    train, calls = _attempts([same, same, None])            # twice, then it works
    assert phvd.elastic.run(train)(phvd.elastic.TorchState(step=0)) == "done"
    assert calls == [0, 0, 0]
    other = HorovodInternalError("lost another peer")
    train, calls = _attempts([same, same, other, same, same, None])   # never 3 alike in a row
    assert phvd.elastic.run(train)(phvd.elastic.TorchState(step=0)) == "done"

    def after_a_commit(state):                          # progress: the count starts again
        state.commit()
        return HorovodInternalError("lost a peer")
    train, calls = _attempts([same, same, after_a_commit, same, None])
    assert phvd.elastic.run(train)(phvd.elastic.TorchState(step=0)) == "done"
    assert calls == [0, 0, 0, 1, 1]


@pytest.mark.parametrize("value", ["0", "three", "-2"])
def test_a_bad_bound_on_repeated_failures_is_named(local, monkeypatch, value):
    monkeypatch.setenv("PIPE_HOROVOD_ELASTIC_MAX_SAME_FAILURES", value)
    train, _ = _attempts([None])
    with pytest.raises(ValueError, match=rf"PIPE_HOROVOD_ELASTIC_MAX_SAME_FAILURES must be an "
                                         rf"integer >= 1 .*got '{value}'"):
        phvd.elastic.run(train)(phvd.elastic.TorchState(step=0))


def test_a_reset_chooses_an_automatic_bucket_cap_again(local, monkeypatch):
    """bucket_cap_mb=None depends on the world size: after a reset to another size the
    optimizer's handler (TorchState.on_reset -> rebind_engine) chooses it again and plans
    the buckets with it; an explicit cap stays as set."""
    from pipe_horovod import engine
    from pipe_horovod.pipeline.buckets import bucket_cap_bytes, resolve_bucket_cap_mb

    model, opt = _setup()                                   # bucket_cap_mb=None
    other = torch.nn.Linear(3, 2)
    explicit = phvd.DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=0.1),
                                         named_parameters=other.named_parameters(),
                                         bucket_cap_mb=3)
    state = phvd.elastic.TorchState(model=model, optimizer=opt)
    _step(model, opt, 0)

    def cap(size):
        return int(bucket_cap_bytes(resolve_bucket_cap_mb(None, world_size=size)))
    assert int(opt._machine.cap_bytes) == cap(1) != cap(64)
    monkeypatch.setattr(engine.current(), "size", lambda: 64)   # the world after a resize
    state.on_reset()
    explicit.rebind_engine()
    assert int(opt._machine.cap_bytes) == cap(64)
    assert explicit._machine.cap_bytes == 3 * 2**20
    assert sorted(n for b in opt._machine.buckets for n in b.names) == sorted(
        n for n, _ in model.named_parameters())
    monkeypatch.undo()                                      # and back: training goes on
    state.on_reset()
    assert int(opt._machine.cap_bytes) == cap(1)
    _step(model, opt, 1)
    opt.flush()


# --- ElasticSampler -------------------------------------------------------------
def _as_rank(monkeypatch, rank, size):
    monkeypatch.setattr(sampler_module, "mpi_ops",
                        types.SimpleNamespace(rank=lambda: rank, size=lambda: size))


def test_sampler_repartitions_the_rest_of_an_epoch_after_a_resize(monkeypatch):
    data = list(range(30))
    processed = []
    samplers = []
    for r in range(2):
        _as_rank(monkeypatch, r, 2)
        samplers.append(phvd.elastic.ElasticSampler(data, seed=3))
        samplers[-1].set_epoch(1)
    for batch in range(2):                       # two batches of 3 on each of 2 ranks
        for s in samplers:
            got = s.get_indices(batch, 3)
            assert got == list(iter(s))[batch * 3:batch * 3 + 3]
            processed += got
            s.record_batch(batch, 3)
    state = samplers[0].state_dict()
    assert state == {"epoch": 1, "processed_num": 12}
    assert samplers[0].processed_indices == set(processed)
    rest = []
    for r in range(3):                           # a reset to 3 ranks
        _as_rank(monkeypatch, r, 3)
        s = phvd.elastic.ElasticSampler(data, seed=3)
        s.load_state_dict(state)
        assert len(s) == 6
        rest += list(s)
    assert sorted(processed + rest) == data      # nothing repeated, nothing skipped


def test_sampler_pads_so_every_rank_gets_as_many(monkeypatch):
    _as_rank(monkeypatch, 2, 4)
    s = phvd.elastic.ElasticSampler(list(range(2)), shuffle=False)
    assert len(s) == 1 and list(s) == [0]


def test_sampler_order_is_horovods(monkeypatch):
    horovod_sampler = pytest.importorskip("horovod.torch.elastic.sampler")
    data = list(range(23))
    for rank, size in [(0, 1), (1, 2), (2, 3)]:
        monkeypatch.setattr(horovod_sampler, "rank", lambda: rank)
        monkeypatch.setattr(horovod_sampler, "size", lambda: size)
        _as_rank(monkeypatch, rank, size)
        theirs = horovod_sampler.ElasticSampler(data, shuffle=True, seed=5)
        ours = phvd.elastic.ElasticSampler(data, shuffle=True, seed=5)
        for s in (theirs, ours):
            s.set_epoch(2)
            s.record_batch(0, 2)
            s.load_state_dict(s.state_dict())
        assert list(ours) == list(theirs) and len(ours) == len(theirs)
        assert ours.state_dict() == theirs.state_dict()
