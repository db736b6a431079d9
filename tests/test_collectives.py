"""pipe_horovod.collectives and the per-hop codecs: real ranks, both engines.

One launch per (engine, ranks) runs every algorithm x op x dtype x size x
codec case, reduce and broadcast, handles of mixed algorithms in flight,
calls whose arguments differ between ranks, and (scope "all") the optimizer
with collective= against the oracle (tests/workers/collectives_worker.py
states the error bounds); the 2-rank launches add error feedback, a
bit-exact resume with its residuals, and a collective that differs between
ranks at wrap time.
"""
import json
import threading
import time

import pytest
import torch

import shared_launches
import pipe_horovod.torch as phvd
from pipe_horovod import collectives
from pipe_horovod.collectives import cost_model
from pipe_horovod.collectives import layout
from pipe_horovod.collectives.arrivals import InOrder
from pipe_horovod.compression import Compression
from pipe_horovod.compression.hops import Int4Hop, Int8Hop
from pipe_horovod.compression.two_stage import pack_int4

pytestmark = pytest.mark.timeout(600)


# 2, 3 and 4 ranks; where one engine already runs the optimizer and DDP cases at that
# size, the other runs the collectives only (the cheaper launch). The collectives send on
# a torch.distributed gloo group under both engines; under Horovod only the group's start
# differs (collectives.group.start_beside), which 2 and 3 ranks cover, so 4 ranks run on
# the torch engine alone (a Horovod 4-rank launch cost 26 s of the suite's 20 minutes).
@pytest.mark.parametrize("engine_name, np, scope", [
    ("horovod", 2, "all"), ("horovod", 3, "all"),
    ("torch", 2, "all"), ("torch", 3, "collectives"), ("torch", 4, "all")])
def test_collectives_match_the_oracles(engine_name, np, scope):
    # In the launches test_quantized_allreduce.py shares (tests/shared_launches.py).
    shared_launches.collectives_case(engine_name, np,
                                     "collectives-all" if scope == "all" else "collectives")


# --- one process ----------------------------------------------------------------
@pytest.fixture
def local():
    phvd.init("local")
    yield
    phvd.shutdown()


def test_one_rank_is_exact_and_in_place(local):
    t = torch.arange(5.0)
    for algorithm in collectives.ALGORITHMS:
        out = collectives.allreduce(t, None, phvd.Sum, collective=algorithm,
                                    compression=Compression.int8)
        assert out is t and torch.equal(t, torch.arange(5.0))


def test_int8_codec_round_trip_error_is_half_a_step():
    hop = Int8Hop()
    x = torch.randn(1000, dtype=torch.float32) * 3
    wire = torch.empty(hop.wire_numel(1000), dtype=torch.uint8)
    residual, out = torch.empty(1000), torch.zeros(1000)
    hop.encode(x, wire, torch.empty(1000), residual)
    hop.decode_into(wire, out)
    assert (x - out).abs().max() <= x.abs().max() / 254 * 1.0001
    assert torch.equal(residual, x - out)           # what was lost, to the bit
    hop.encode(torch.zeros(7), wire[:hop.wire_numel(7)], torch.empty(7))
    hop.decode_into(wire[:hop.wire_numel(7)], out[:7])
    assert not out[:7].any()


@pytest.mark.parametrize("numel", [1, 2, 7, 1000, 1001])
def test_int4_codec_is_the_two_stage_format_on_one_block(numel):
    """Per hop, a chunk is one block: its scale max|x| / 7 and its nibbles as the two-stage
    format packs them (pack_int4), so the two paths agree on what 4 bits mean; the error
    is at most half a step, and the residual is what was lost, to the bit."""
    hop = Int4Hop()
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3
    wire = torch.empty(hop.wire_numel(numel), dtype=torch.uint8)
    assert hop.wire_numel(numel) == 4 + -(-numel // 8) * 4          # bytes padded to 4
    residual, out = torch.empty(numel), torch.zeros(numel)
    hop.encode(x, wire, torch.empty(numel), residual)
    scale = wire[:4].view(torch.float32).item()
    assert scale == pytest.approx(x.abs().max().item() / 7, rel=2.0**-23)
    q = torch.round(x / (x.abs().max().item() / 7)).clamp(-7, 7)
    assert torch.equal(wire[4:4 + -(-numel // 2)], pack_int4(q))
    hop.decode_into(wire, out)
    assert (x - out).abs().max() <= x.abs().max() / 14 * 1.0001
    assert torch.equal(residual, x - out)
    acc = torch.ones(numel)
    hop.decode_add(wire, acc)                # 1 + q * scale: two roundings at most, fused or not
    assert ((acc - (1 + out)).abs() <= 2.0**-23 * (1 + out.abs())).all()


class _GlooLikeRecv:
    """Like c10d's gloo RecvWork: is_completed() stays False until wait() returned."""

    def __init__(self, error=None):
        self.landed, self.error = threading.Event(), error

    def is_completed(self):
        return False

    def wait(self):
        self.landed.wait()
        if self.error:
            raise self.error


def _until(predicate, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.001)
    return predicate()


def test_arrivals_counts_receives_that_cannot_be_polled():
    works = [_GlooLikeRecv(), None, _GlooLikeRecv()]
    arrivals = InOrder(works)
    time.sleep(0.01)
    assert arrivals.count() == 0                  # nothing landed: no forward yet
    works[0].landed.set()
    assert _until(lambda: arrivals.count() == 2)  # None (an empty range) counts at once
    works[2].landed.set()
    arrivals.wait(2)
    assert arrivals.count() == 3


def test_arrivals_raises_a_failed_receive_where_it_is_waited():
    works = [_GlooLikeRecv(), _GlooLikeRecv(RuntimeError("Timed out waiting"))]
    arrivals = InOrder(works)
    works[0].landed.set()
    arrivals.wait(0)
    works[1].landed.set()
    with pytest.raises(RuntimeError, match="Timed out"):
        arrivals.wait(1)
    with pytest.raises(RuntimeError, match="Timed out"):
        arrivals.count()


def test_an_abandoned_thread_fails_every_call_not_finished_at_once():
    """An elastic reset after a failure must not wait for a call blocked on a peer
    that will never send (communicator._Thread.abandon)."""
    from pipe_horovod.collectives.communicator import _Thread
    from pipe_horovod.engine.faults import WaitError

    release, started = threading.Event(), threading.Event()
    thread = _Thread("test-abandon")
    done = thread.submit(lambda: 1)
    blocked = thread.submit(lambda: (started.set(), release.wait(10), 2)[-1])
    queued = thread.submit(lambda: 3)
    assert done.result(timeout=5) == 1 and started.wait(5)
    thread.abandon(WaitError("abandoned"))
    for future in (blocked, queued):                 # at once, not when the call returns
        with pytest.raises(WaitError, match="abandoned"):
            future.result(timeout=0)
    release.set()
    assert _until(lambda: not thread._thread.is_alive())
    with pytest.raises(WaitError, match="abandoned"):
        blocked.result(timeout=0)                    # what the call returned is dropped
    with pytest.raises(RuntimeError, match="abandoned"):
        thread.submit(lambda: 4)


def _abort_rank(rank, port, out):
    """A gloo rank with a receive its peer never answers; rank 0 aborts the group."""
    import datetime

    import torch.distributed as dist

    from pipe_horovod.collectives.communicator import _abort

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=60))
    work = dist.irecv(torch.zeros(1), src=1 - rank, tag=7 + rank)   # never sent
    dist.barrier()
    if rank == 0:
        _abort(dist.group.WORLD, rank)
    start = time.monotonic()
    try:
        work.wait()
        out.put((rank, "completed", 0.0))
    except RuntimeError as exc:
        out.put((rank, str(exc), time.monotonic() - start))


def test_abort_fails_the_waits_of_a_gloo_group_on_every_rank():
    """communicator._abort: both ranks' waits fail within seconds (the group's timeout is
    a minute), here by the timeout's pair closure, at the peer by the closed connection."""
    import multiprocessing

    from pipe_horovod.collectives.group import free_port

    ctx = multiprocessing.get_context("spawn")
    out, port = ctx.Queue(), free_port("127.0.0.1")
    procs = [ctx.Process(target=_abort_rank, args=(r, port, out), daemon=True) for r in (0, 1)]
    for proc in procs:
        proc.start()
    results = sorted(out.get(timeout=50) for _ in procs)
    for proc in procs:
        proc.join(10)
    assert [r for r, _, _ in results] == [0, 1]
    for rank, message, seconds in results:
        assert "completed" != message and seconds < 20, (rank, message, seconds)
    assert "Connection closed by peer" in results[1][1], results


class _FailingWork:
    """A gloo point-to-point work whose wait blocks `seconds`, then raises `text`."""

    def __init__(self, seconds, text):
        self.seconds, self.text = seconds, text

    def wait(self):
        time.sleep(self.seconds)
        raise RuntimeError(self.text)


class _Job:
    """What the communicator's thread reads of a collective (communicator.Job)."""
    kind, ranks, me, set_id, op, root = "allreduce", [0, 1], 0, 0, None, None
    tensor = torch.zeros(3)
    spec = type("Spec", (), {"describe": staticmethod(lambda: "ring")})()
    codec = "none"

    def __init__(self, work):
        self.work = work

    def instead(self):
        return None

    def run(self, channel, pool):           # an algorithm's first receive, and its wait
        channel.recv(torch.zeros(1), 1, 0).wait()


def _thread_run(monkeypatch, work, check=lambda job, channel, sequence: 0, timeout_s=0.4):
    """Communicator._run (what its thread runs) of a job whose first wait does `work`."""
    import collections as _collections

    from pipe_horovod.collectives import communicator as comm_module

    monkeypatch.setattr(torch.distributed, "irecv", lambda *a, **k: work)
    comm = comm_module.Communicator.__new__(comm_module.Communicator)
    comm.group, comm.pool, comm.timeout_s = None, None, timeout_s
    comm._sequence = _collections.Counter()
    comm.agreement = type("Agreement", (), {"check": staticmethod(check)})()
    return comm._run(_Job(work))


def test_a_point_to_point_failure_is_told_by_what_happened_not_by_its_words(monkeypatch):
    """A wait that blocked for the group's whole timeout is WaitTimeoutError, one that
    failed sooner WaitError: both HorovodInternalError, so elastic resets on them (a
    peer that hangs raised ValueError when any "timed out" text was taken for an argument
    mismatch). gloo's words are swapped here, so only what happened can tell them."""
    from pipe_horovod.engine import HorovodInternalError, WaitError, WaitTimeoutError

    with pytest.raises(WaitTimeoutError, match=r"waited 0 s .*for a peer's message that "
                       r"never came: a peer stopped or hangs.*Connection closed by peer"):
        _thread_run(monkeypatch, _FailingWork(0.4, "Connection closed by peer [127.0.0.1]"))
    with pytest.raises(WaitError, match="a peer closed the connection") as closed:
        _thread_run(monkeypatch, _FailingWork(0.0, "Timed out waiting 2000ms for recv "
                                                   "operation to complete"))
    assert not isinstance(closed.value, WaitTimeoutError)
    assert isinstance(closed.value, HorovodInternalError)


def test_an_argument_mismatch_stays_a_value_error(monkeypatch):
    """The agreement check found ranks passing other arguments: ValueError, as it said it
    (elastic must not retry a misuse), not a failure of a peer."""
    def mismatch(job, channel, sequence):
        raise ValueError("collectives.allreduce (call #0 on this process set): the ranks "
                         "disagree on numel: rank 0 3, rank 1 4")

    with pytest.raises(ValueError, match="the ranks disagree on numel") as info:
        _thread_run(monkeypatch, _FailingWork(0.0, "unused"), check=mismatch)
    from pipe_horovod.engine import HorovodInternalError
    assert not isinstance(info.value, HorovodInternalError)


def test_collective_config_round_trips():
    """What a saved Keras model keeps of `collective=` rebuilds the same Collective."""
    for spec in (collectives.Collective("ring"),
                 collectives.Collective("lp", chunks=32,
                                        network=cost_model.Network(alpha=2e-4, beta=1e-8))):
        back = collectives.Collective.from_config(json.loads(json.dumps(spec.config())))
        assert back.describe() == spec.describe()
        assert back.network == spec.network


def test_lp_chunks_follow_the_cost_model():
    net = cost_model.Network(alpha=1e-4, beta=8e-9)
    # The allreduce's optimum sqrt(n ((2p-3) beta - 2 beta) / a) = sqrt(6000) = 77.5 (two
    # streams share the busiest link in k-2 steps); a broadcast's one-way chain of 4,
    # sqrt(fill * n * b / a) with fill 2.
    assert layout.lp_chunks(4, 25e6, net) == cost_model.lp_allreduce_chunks(net, 4, 25e6) == 77
    assert layout.lp_chunks(4, 25e6, net, hops=4) == cost_model.optimal_chunks(net, 4, 25e6) == 63
    assert layout.lp_chunks(1, 25e6, net) == 1
    spec = collectives.Collective("lp", chunks=3)
    assert collectives.linear_pipeline.blocks("allreduce", 2, 4, 8, spec) == [1, 1]   # never more than numel


@pytest.mark.parametrize("kw, error, text", [
    ({"collective": "tree"}, ValueError, "unknown collective 'tree'; choose one of lp, ring"),
    ({"collective": 3}, TypeError, "collective must be None or one of lp, ring, mst, be"),
    ({"compression": Compression.fp8_e4m3, "collective": "ring"}, ValueError,
     "runs only in the two-stage reduction"),
    ({"collective": "ring", "compression": object()}, TypeError, "compression must provide"),
])
def test_bad_collective_or_codec_is_refused_at_wrap(local, kw, error, text):
    model = torch.nn.Linear(3, 2)
    with pytest.raises(error, match=text.replace("(", r"\(").replace(")", r"\)")):
        phvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(), **kw)


def test_codec_a_collective_cannot_carry(local):
    class Horovodish:                      # Horovod's codec shape: no per-hop form
        @staticmethod
        def compress(t):
            return t, None

        @staticmethod
        def decompress(t, ctx):
            return t

    with pytest.raises(ValueError, match="carries only pipe_horovod's codecs"):
        collectives.check_collective("lp", Horovodish)


def test_int8_has_no_compress_of_a_whole_tensor(local):
    with pytest.raises(ValueError, match="quantizes inside the reduction"):
        phvd.grouped_allreduce([torch.ones(3)], compression=Compression.int8)
    assert Compression.by_name("int8_ef") is Compression.int8_ef
    with pytest.raises(ValueError, match="int8, int8_ef, int4, int4_ef"):
        Compression.by_name("int2")


@pytest.mark.parametrize("call, error, text", [
    (lambda: collectives.allreduce(torch.ones(3, dtype=torch.int32), collective="lp"),
     ValueError, "floating-point"),
    (lambda: collectives.allreduce(torch.ones(3), op=phvd.Max, collective="lp"),
     ValueError, "supports only Average, Sum"),
    (lambda: collectives.allreduce(torch.ones(3), collective=None), ValueError, "name an algorithm"),
    (lambda: collectives.allreduce(torch.ones(3), collective="ring", residual=torch.ones(2)),
     ValueError, "residual must be"),
    (lambda: collectives.broadcast(torch.ones(3), 1, collective="ring"), ValueError, "root rank 1"),
    (lambda: collectives.Collective("lp", chunks=0), ValueError, "chunks must be a positive int"),
    (lambda: collectives.allreduce(torch.ones(4, 2).t(), collective="lp"), ValueError,
     "contiguous"),
])
def test_bad_calls_are_refused(local, call, error, text):
    with pytest.raises(error, match=text):
        call()


def test_digits_with_int8_feedback_stays_within_a_point_of_sync():
    # In the 2-rank horovod collectives launch (digits_int8_worker.py).
    shared_launches.collectives_case("horovod", 2, "digits-int8")
