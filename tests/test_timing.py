import dataclasses
import math

import numpy as np
import pytest

from pipe_horovod.collectives import cost_model
from pipe_horovod.pipeline import timing_model
from pipe_horovod.collectives.cost_model import Network
from pipe_horovod.tools import planner
from pipe_horovod.tools.cli import main

NET = Network(alpha=1e-5, beta=1e-9, gamma=1e-10)
N = 1e8


# ------------------------------------------------------------ cost formulas

def test_hand_computed_values():
    # p=4: (p-1)/p = 0.75, ceil(log2 4) = 2.
    assert timing_model.ring_allreduce(NET, 4, N) == pytest.approx(6e-5 + 1.5 * 0.1 + 0.75 * 0.01)
    assert timing_model.be_allreduce(NET, 4, N) == pytest.approx(4e-5 + 1.5 * 0.1 + 0.75 * 0.01)
    assert timing_model.mst_broadcast(NET, 4, N) == pytest.approx(2 * (1e-5 + 0.1))
    assert timing_model.mst_reduce(NET, 4, N) == pytest.approx(2 * (1e-5 + 0.11))
    assert timing_model.mst_allreduce(NET, 4, N) == pytest.approx(2 * (1e-5 + 0.1) + 2 * (1e-5 + 0.11))
    # LP with k chunks: (p + k - 2) steps of one chunk each, per phase.
    k = 10
    assert timing_model.lp_broadcast(NET, 4, N, chunks=k) == pytest.approx(12 * (1e-5 + 0.01))
    assert timing_model.lp_reduce(NET, 4, N, chunks=k) == pytest.approx(12 * (1e-5 + 0.011))
    # Allreduce: both phases at once, a chain of 2p-1 = 7 (15 steps); on a star the
    # busiest link (rank p-2's) sends a reduce and a broadcast chunk at once in k-2 of
    # them (one more chunk's beta each); at p=2 there is no middle.
    assert timing_model.lp_allreduce(NET, 4, N, chunks=k) == pytest.approx(
        15 * (1e-5 + 0.011) + 8 * 0.01)
    assert timing_model.lp_allreduce(NET, 2, N, chunks=k) == pytest.approx(11 * (1e-5 + 0.011))
    assert timing_model.ring_broadcast(NET, 4, N) == pytest.approx(5e-5 + 0.15)
    assert timing_model.be_broadcast(NET, 4, N) == pytest.approx(4e-5 + 0.15)
    # BE at p=3: the exchange of q=2 (n beta, n/2 added), then the fold before and the
    # hand-back after it (2n beta, n added, 2 latencies).
    assert timing_model.be_allreduce(NET, 3, N) == pytest.approx(4e-5 + 0.3 + 0.015)
    assert timing_model.be_broadcast(NET, 3, N) == pytest.approx(3e-5 + 0.2)
    assert timing_model.be_reduce(NET, 3, N) == pytest.approx(3e-5 + 0.2 + 0.015)


def test_hop_codec_time_counts_the_busiest_ranks_codec_work():
    costs = (1e-9, 2e-9, 3e-9)    # encode, decode-add, decode: seconds per byte
    # one encode and one decode of the message; adds: ring (p-1)/p, mst log p, be at p=3
    # the exchange's half plus the folded vector
    assert timing_model.hop_codec_time(4, N, "ring", costs) == pytest.approx(N * (1 + 1.5 + 3) * 1e-9)
    assert timing_model.hop_codec_time(4, N, "mst", costs) == pytest.approx(N * (1 + 4 + 3) * 1e-9)
    assert timing_model.hop_codec_time(3, N, "be", costs) == pytest.approx(N * (1 + 3 + 3) * 1e-9)
    assert timing_model.hop_codec_time(4, N, "lp", costs) == pytest.approx(N * 6e-9)
    assert timing_model.hop_codec_time(1, N, "lp", costs) == 0.0
    with pytest.raises(ValueError, match="unknown algorithm 'tree'"):
        timing_model.hop_codec_time(4, N, "tree", costs)


def test_hop_codec_time_counts_only_the_exposed_part_of_pipelined_codecs():
    costs = (1e-9, 2e-9, 3e-9)
    # ring, 4 ranks, 16 blocks = 4 pieces per segment: one piece's encode (1/4) and
    # decode-add (3/4 / 4) per step lie on the path, the final decode (1) whole
    assert timing_model.hop_codec_time(4, N, "ring", costs, blocks=16) == pytest.approx(
        N * (0.25 * 1 + 0.1875 * 2 + 3) * 1e-9)
    # one piece per segment: nothing overlaps, the total as without blocks
    assert timing_model.hop_codec_time(4, N, "ring", costs, blocks=4) == pytest.approx(
        timing_model.hop_codec_time(4, N, "ring", costs))
    # lp, 4 ranks, 10 chunks: chunk 0 encoded at 4 positions, decode-added at 3
    assert timing_model.hop_codec_time(4, N, "lp", costs, blocks=10) == pytest.approx(
        N * (0.4 * 1 + 0.3 * 2 + 3) * 1e-9)
    # be waits for each whole round: everything counts, blocks or not
    assert timing_model.hop_codec_time(4, N, "be", costs, blocks=4) == pytest.approx(
        N * (1 + 1.5 + 3) * 1e-9)


def test_codec_costs_at_interpolates_seconds_per_call_between_block_sizes():
    table = {"1000": (1e-9, 2e-9, 3e-9), "3000": (2e-9, 2e-9, 2e-9)}
    # per call: 1 / 2 / 3 us at 1000 B, 6 / 6 / 6 us at 3000 B; halfway 3.5 / 4 / 4.5 us
    assert timing_model.codec_costs_at(table, 2000) == pytest.approx((1.75e-9, 2e-9, 2.25e-9))
    assert timing_model.codec_costs_at(table, 1000) == pytest.approx((1e-9, 2e-9, 3e-9))
    # below the smallest a call costs what it costs there; above the largest, per byte
    assert timing_model.codec_costs_at(table, 500) == pytest.approx((2e-9, 4e-9, 6e-9))
    assert timing_model.codec_costs_at(table, 9000) == pytest.approx((2e-9, 2e-9, 2e-9))
    # a table in hop_codec_time: the costs at nbytes / blocks (here 2000 B blocks)
    assert timing_model.hop_codec_time(2, 4000, "be", table, blocks=2) == pytest.approx(
        4000 * (1.75e-9 + 0.5 * 2e-9 + 2.25e-9))
    with pytest.raises(ValueError, match="empty"):
        timing_model.codec_costs_at({}, 1000)


def test_with_message_cost_adds_to_alpha_only():
    net = timing_model.with_message_cost(NET, 5e-5)
    assert (net.alpha, net.beta, net.gamma) == pytest.approx((6e-5, 1e-9, 1e-10))
    assert timing_model.ring_allreduce(net, 4, N) == pytest.approx(
        timing_model.ring_allreduce(NET, 4, N) + 6 * 5e-5)
    with pytest.raises(ValueError, match="message_s"):
        timing_model.with_message_cost(NET, -1.0)


@pytest.mark.parametrize("table", [timing_model.ALLREDUCE, timing_model.BROADCAST, timing_model.REDUCE])
def test_one_worker_costs_nothing(table):
    assert set(table) == {"ring", "lp", "mst", "be"}
    for cost in table.values():
        assert cost(NET, 1, N) == 0.0
        assert cost(NET, 8, N) > 0.0


def test_bad_inputs():
    with pytest.raises(ValueError, match="workers"):
        timing_model.ring_allreduce(NET, 0, N)
    with pytest.raises(ValueError, match="unknown algorithm"):
        timing_model.allreduce_time(NET, 4, N, "tree")
    with pytest.raises(ValueError, match="chunks"):
        timing_model.lp_allreduce(NET, 4, N, chunks=0)
    with pytest.raises(ValueError, match="alpha"):
        Network(-1.0, 1e-9)


@pytest.mark.parametrize("cost, optimum", [(timing_model.lp_broadcast, cost_model.optimal_chunks),
                                           (timing_model.lp_allreduce, cost_model.lp_allreduce_chunks)])
def test_optimal_chunks_minimises_lp(cost, optimum):
    net = Network(2e-5, 8e-10)
    k = optimum(net, 16, N)
    best = cost(net, 16, N, chunks=k)
    assert all(best <= cost(net, 16, N, chunks=c) * (1 + 1e-12)
               for c in (1, k // 2, k - 1, k + 1, 2 * k))
    assert cost_model.optimal_chunks(net, 2, N) == 1  # a chain of two gains nothing from chunks
    assert cost(net, 16, N) == best  # chunks=None means optimal


def test_lp_nearly_independent_of_p_mst_grows_with_log_p():
    net = Network(2e-5, 8e-10)
    n = 1e9
    lp4, lp64 = timing_model.lp_allreduce(net, 4, n), timing_model.lp_allreduce(net, 64, n)
    assert lp64 / lp4 < 1.10
    mst = {p: timing_model.mst_allreduce(net, p, n) for p in (4, 64)}
    assert mst[64] / mst[4] == pytest.approx(math.log2(64) / math.log2(4), rel=1e-3)
    assert lp64 < mst[64] / 5


def test_the_emulator_builds_every_topology_the_cost_model_names():
    """One list of topologies (cost_model.TOPOLOGIES): the emulator, stdlib only, keeps
    its own table of classes and must build exactly those."""
    from pipe_horovod.tools.emulate import network

    assert tuple(network.CLASSES) == cost_model.TOPOLOGIES


def test_lp_on_a_chain_carries_one_stream_per_link_direction():
    net = Network(2e-5, 8e-9, 1e-10)
    n, k = 64 * 2**20, 50
    # every p has the p=2 shape: (2p-1 positions - 2 + k) steps of one chunk's beta + gamma
    for p in (2, 3, 4, 8):
        assert timing_model.lp_allreduce(net, p, n, chunks=k, topology="chain") == pytest.approx(
            (2 * p - 3 + k) * (2e-5 + n / k * (8e-9 + 1e-10)))
    assert timing_model.lp_allreduce(net, 2, n, chunks=k, topology="chain") == \
        timing_model.lp_allreduce(net, 2, n, chunks=k)
    chain = timing_model.allreduce_time(net, 4, n, "lp", topology="chain")
    assert chain < timing_model.ring_allreduce(net, 4, n) < timing_model.lp_allreduce(net, 4, n)
    assert chain == timing_model.lp_allreduce(net, 4, n, chunks=cost_model.lp_allreduce_chunks(
        net, 4, n, topology="chain"), topology="chain")
    # ring's formula holds on a chain; mst's and be's would be wrong there, so none
    assert timing_model.allreduce_time(net, 4, n, "ring", topology="chain") == \
        timing_model.ring_allreduce(net, 4, n)
    for algorithm in ("mst", "be"):
        with pytest.raises(ValueError, match="not modelled on a chain"):
            timing_model.allreduce_time(net, 4, n, algorithm, topology="chain")
    with pytest.raises(ValueError, match="star, chain"):
        timing_model.allreduce_time(net, 4, n, "lp", topology="torus")


def test_ring_bandwidth_term_approaches_2n_beta():
    net = Network(0.0, 1e-9)
    assert timing_model.ring_allreduce(net, 1024, N) == pytest.approx(2 * N * 1e-9, rel=1e-3)
    assert timing_model.be_allreduce(net, 1024, N) == pytest.approx(2 * N * 1e-9, rel=1e-3)


# ---------------------------------------------------------------- step time

@pytest.mark.parametrize("compute,update,comm", [(0.1, 0.0, 0.3), (0.3, 0.01, 0.1), (0.0, 0.0, 0.2), (0.2, 0.1, 0.0)])
@pytest.mark.parametrize("overlap", [0.0, 0.5, 1.0])
def test_pipelined_is_max_and_never_slower_than_sync(compute, update, comm, overlap):
    sync = timing_model.step_time(compute, update, comm, 1, overlap)
    for depth in (2, 3, 8):
        piped = timing_model.step_time(compute, update, comm, depth)
        assert piped == max(compute + update, comm)
        assert piped <= sync + 1e-15
    if overlap == 0.0:
        assert sync == pytest.approx(compute + update + comm)


def test_predict_rows_and_speedups():
    net = Network(2e-5, 8e-10)
    pred = timing_model.predict(timing_model.Workload.aggregate(0.12, 0.0, 233e6), 4, net, algorithm="ring",
                          compressions={"fp16": (0.5, 0.0), "int8": (0.25, 1e-10)})
    assert list(pred.rows) == ["sync", "pipelined", "sync+fp16", "pipelined+fp16", "sync+int8", "pipelined+int8"]
    comm = timing_model.ring_allreduce(net, 4, 233e6)
    assert pred.sync_s == pytest.approx(0.12 + comm)
    assert pred.pipelined_s == pytest.approx(max(0.12, comm))
    assert pred.rows["sync"].speedup == 1.0
    assert pred.rows["pipelined"].speedup == pytest.approx(pred.sync_s / pred.pipelined_s)
    assert pred.rows["pipelined+fp16"].comm_s == pytest.approx(timing_model.ring_allreduce(net, 4, 116.5e6))
    assert pred.rows["pipelined+int8"].comm_s == pytest.approx(timing_model.ring_allreduce(net, 4, 58.25e6))
    assert pred.rows["pipelined+int8"].compute_s == pytest.approx(0.12 + 233e6 * 1e-10)
    for row in pred.rows.values():
        if row.pipeline_depth > 1:
            assert row.step_s <= pred.rows["sync" + row.name[len("pipelined"):]].step_s
    single = timing_model.predict(timing_model.Workload.aggregate(0.12, 0.0, 233e6), 1, net)
    assert all(r.step_s == pytest.approx(0.12) for r in single.rows.values())


def test_comm_cpu_stretches_only_the_pipelined_step():
    # compute 0.1 s fills the cores; communication needs 0.03 s of CPU on them.
    assert timing_model.step_time(0.1, 0.0, 0.08, 2, comm_cpu_s=0.03) == pytest.approx(0.13)
    assert timing_model.step_time(0.1, 0.0, 0.2, 2, comm_cpu_s=0.03) == pytest.approx(0.2)
    assert timing_model.step_time(0.1, 0.0, 0.08, 1, comm_cpu_s=0.03) == pytest.approx(0.18)
    with pytest.raises(ValueError, match="comm_cpu_s"):
        timing_model.step_time(0.1, 0.0, 0.1, 2, comm_cpu_s=-1)


def test_predict_charges_codec_and_comm_cpu_to_compute_when_pipelined():
    net = Network(0.0, 1e-9)
    pred = timing_model.predict(timing_model.Workload.aggregate(0.1, 0.0, 100e6), 2, net, compressions={"bf16": (0.5, 2e-10)},
                          comm_cpu_per_byte=5e-10)
    comm, comm16 = timing_model.ring_allreduce(net, 2, 100e6), timing_model.ring_allreduce(net, 2, 50e6)
    assert pred.sync_s == pytest.approx(0.1 + comm)                  # no overlap, no contention
    assert pred.pipelined_s == pytest.approx(max(0.1 + 100e6 * 5e-10, comm))
    assert pred.rows["pipelined+bf16"].step_s == pytest.approx(
        max(0.1 + 0.02 + 50e6 * 5e-10, comm16))
    assert pred.rows["sync+bf16"].step_s == pytest.approx(0.1 + 0.02 + comm16)


# ------------------------------------------------------ overlap-aware schedule

F, B, U = 0.1, 0.2, 0.01
READY = (0.05, 0.12, 0.2)   # three buckets, seconds after backward starts


@pytest.mark.parametrize("costs,landing,sync,pipelined", [
    # hidden: 0.05->0.09, 0.12->0.18, 0.2->0.25; the link idles between buckets.
    ((0.04, 0.06, 0.05), 0.25, F + 0.25 + U, F + B + U),
    # dominated: 0.05->0.15, then back to back 0.15->0.45->0.65; the link sets the pace.
    ((0.1, 0.3, 0.2), 0.65, F + 0.65 + U, 0.6),
])
def test_schedule_of_three_buckets(costs, landing, sync, pipelined):
    sched = timing_model.Schedule(F, B, U, tuple(zip(READY, costs)))
    assert sched.comm_s == pytest.approx(sum(costs))
    assert sched.landing_s == pytest.approx(landing)
    assert sched.step_s(1) == pytest.approx(sync)
    assert sched.step_s(1) < F + B + U + sum(costs)   # what "compute + comm" would say
    for depth in (2, 3):
        assert sched.step_s(depth) == pytest.approx(pipelined)
    assert sched.step_s(2, comm_cpu_s=0.5) == pytest.approx(F + B + U + 0.5)


def test_compensation_lengthens_only_the_pipelined_update():
    sched = timing_model.Schedule(F, B, U, tuple(zip(READY, (0.04, 0.06, 0.05))), compensation_s=0.03)
    assert sched.step_s(1) == pytest.approx(F + 0.25 + U)             # nothing to compensate
    assert sched.step_s(2) == pytest.approx(F + B + U + 0.03)
    # comm-bound: the compensation hides under the link until compute catches up
    slow = timing_model.Schedule(F, B, U, tuple(zip(READY, (0.1, 0.3, 0.2))), compensation_s=0.03)
    assert slow.step_s(2) == pytest.approx(0.6)
    work = timing_model.Workload.from_layers(LAYERS, update_s=0.005)
    charged = timing_model.predict(dataclasses.replace(work, compensation_s=0.1), 2,
                             Network(0.0, 1e-9), bucketing=timing_model.Bucketing("cap", 10e6))
    plain = timing_model.predict(work, 2, Network(0.0, 1e-9), bucketing=timing_model.Bucketing("cap", 10e6))
    assert charged.sync_s == pytest.approx(plain.sync_s)
    assert charged.pipelined_s == pytest.approx(plain.pipelined_s + 0.1)


def test_the_prediction_exchange_waits_on_the_compute_path_and_adds_to_the_link():
    """prediction_exchange: each bucket's exchange starts when it is ready; step() waits
    for the last (W = D - B); the reductions start after backward, behind them."""
    exchange = tuple(zip(READY, (0.01, 0.01, 0.03)))      # lands 0.06, 0.13, 0.23: W = 0.03
    hidden = timing_model.Schedule(F, B, U, tuple(zip(READY, (0.04, 0.06, 0.05))), exchange=exchange)
    assert hidden.step_s(1) == pytest.approx(F + 0.25 + U)              # sync exchanges nothing
    assert hidden.step_s(2) == pytest.approx(F + B + 0.03 + U)
    slow = timing_model.Schedule(F, B, U, tuple(zip(READY, (0.1, 0.3, 0.2))), exchange=exchange)
    assert slow.step_s(2) == pytest.approx(0.6 + 0.05)                 # the link: C + sum x
    # One bucket at the end of backward, int4's two stages at 1 GB/s: 1e8 float32 bytes go
    # as 0.5 + 4/256 bytes a value, (p-1)/p of them per stage.
    work = timing_model.Workload.aggregate(0.3, 0.01, 1e8)
    net = Network(0.0, 1e-9)
    x = 2 * 0.5 * 1e8 * (0.5 + 4 / 256) / 4 * 1e-9
    plain = timing_model.predict(work, 2, net)
    exchanged = timing_model.predict(work, 2, net, exchange="int4")
    assert exchanged.sync_s == pytest.approx(plain.sync_s)
    assert exchanged.pipelined_s == pytest.approx(0.3 + 0.01 + x)
    assert timing_model.predict(work, 1, net, exchange="int4").pipelined_s == pytest.approx(0.31)


def test_schedule_rejects_bad_input():
    with pytest.raises(ValueError, match="pipeline_depth"):
        timing_model.Schedule(F, B, U).step_s(0)
    with pytest.raises(ValueError, match="backward_s must be >= 0"):
        timing_model.Schedule(F, -1.0, U)
    with pytest.raises(ValueError, match="compensation_s must be >= 0"):
        timing_model.Workload(F, B, U, ((0.1, 1.0),), compensation_s=-0.1)
    with pytest.raises(ValueError, match="exchange: ready times and costs must be >= 0"):
        timing_model.Schedule(F, B, U, exchange=((0.1, -1.0),))
    with pytest.raises(ValueError, match="ascending"):
        timing_model.Workload(F, B, U, ((0.1, 1.0), (0.05, 1.0)))


def test_bucketings_match_our_optimizer_and_torch_ddp():
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    from pipe_horovod.pipeline import plan_buckets

    numels = (1, 2, 5, 1, 7, 3)                        # float32: 4 bytes each
    grads = tuple((0.01 * i, 4.0 * n) for i, n in enumerate(numels))
    ours = timing_model.Bucketing("cap", 24).buckets(grads, None)
    members = [(str(i), n, 4, None) for i, n in enumerate(numels)]
    assert [b.numel * 4 for b in plan_buckets(members, 24)] == [n for _, n in ours] == [12, 24, 28, 12]
    assert [r for r, _ in ours] == [0.01, 0.03, 0.04, 0.05]   # each bucket's last member
    ddp = timing_model.Bucketing("ddp", 24, first_cap_bytes=8).buckets(grads, None)
    indices, _ = dist._compute_bucket_assignment_by_size([torch.empty(n) for n in numels], [8, 24])
    assert [sum(4 * numels[i] for i in b) for b in indices] == [n for _, n in ddp] == [12, 24, 28, 12]


def test_horovod_fusion_takes_what_is_ready_when_the_link_frees():
    grads = ((0.01, 10e6), (0.02, 20e6), (0.03, 30e6), (0.04, 5e6), (0.2, 1e6))
    fused = timing_model.Bucketing("fusion", 128 * 2**20).buckets(grads, lambda n: n * 1e-9)
    # 10 MB at 0.01 (lands 0.02); 20 MB at 0.02 (lands 0.04); 30+5 MB at 0.04 (lands 0.075);
    # the last waits for its own ready time.
    assert fused == [(0.01, 10e6), (0.02, 20e6), (0.04, 35e6), (0.2, 1e6)]
    capped = timing_model.Bucketing("fusion", 32e6).buckets(grads, lambda n: n * 1e-9)
    assert capped == [(0.01, 10e6), (0.02, 20e6), (0.04, 30e6), (0.07, 5e6), (0.2, 1e6)]


LAYERS = ((0.01, 0.02, (4e6,)), (0.02, 0.04, (8e6, 1e6)), (0.03, 0.06, (20e6,)))


def test_workload_from_layers_runs_backward_in_reverse():
    work = timing_model.Workload.from_layers(LAYERS, update_s=0.005)
    assert (work.forward_s, work.backward_s, work.update_s) == pytest.approx((0.06, 0.12, 0.005))
    assert np.allclose(work.gradients, ((0.06, 20e6), (0.1, 1e6), (0.1, 8e6), (0.12, 4e6)), rtol=1e-12)
    coded = work.with_codec(1e-9)     # 20 ms, 1 ms, 8 ms, 4 ms of encoding, in ready order
    assert np.allclose(coded.gradients, ((0.08, 20e6), (0.121, 1e6), (0.129, 8e6), (0.153, 4e6)), rtol=1e-12)
    assert coded.backward_s == pytest.approx(0.153)


@pytest.mark.parametrize("beta,sync,pipelined,bottleneck", [
    # buckets (0.06, 20 MB), (0.10, 9 MB), (0.12, 4 MB); 2-worker ring: cost = n * beta.
    (1e-9, 0.06 + 0.124 + 0.005, 0.185, "compute"),       # lands 0.08, 0.109, 0.124
    (1e-8, 0.06 + 0.39 + 0.005, 0.33, "network"),         # lands 0.26, 0.35, 0.39
])
def test_predict_per_layer_workload(beta, sync, pipelined, bottleneck):
    work = timing_model.Workload.from_layers(LAYERS, update_s=0.005)
    pred = timing_model.predict(work, 2, Network(0.0, beta), compressions={"fp16": (0.5, 0.0)},
                          bucketing=timing_model.Bucketing("cap", 10e6))
    assert pred.sync_s == pytest.approx(sync)
    assert pred.pipelined_s == pytest.approx(pipelined)
    assert pred.rows["pipelined"].bottleneck == bottleneck
    assert pred.rows["pipelined"].comm_s == pytest.approx(33e6 * beta)
    assert pred.rows["pipelined+fp16"].comm_s == pytest.approx(16.5e6 * beta)
    with pytest.raises(ValueError, match="overlap is for an aggregate"):
        timing_model.predict(work, 2, Network(0.0, beta), overlap=0.5)


def test_a_codec_beside_compute_holds_the_link_not_compute():
    # the two-stage codec on the communicator's thread: 0 s on the training thread, each
    # bucket's link time max(its bytes, its codec work); 2-worker ring of 33 MB x 0.25
    work = timing_model.Workload.from_layers(LAYERS, update_s=0.005)
    net = Network(0.0, 1e-9)
    quick, slow = (timing_model.predict(work, 2, net, compressions={"q": (0.25, 0.0, codec)},
                                  bucketing=timing_model.Bucketing("cap", 10e6)).rows["pipelined+q"]
                   for codec in (1e-10, 2e-8))
    assert quick.comm_s == pytest.approx(33e6 * 0.25 * 1e-9) and quick.bottleneck == "compute"
    assert quick.compute_s == pytest.approx(0.185)               # nothing on the training thread
    assert slow.comm_s == pytest.approx(33e6 * 2e-8) and slow.bottleneck == "codec"
    assert slow.step_s == pytest.approx(33e6 * 2e-8)
    # the CPU floor: all ranks' CPU a step over the cores they share
    assert timing_model.cpu_floor(0.2, 4, 2) == pytest.approx(0.4)
    for bad, match in (((-1, 4, 2), "cpu_s_per_step"), ((0.2, 0, 2), "workers"),
                       ((0.2, 4, 0), "cores")):
        with pytest.raises(ValueError, match=match):
            timing_model.cpu_floor(*bad)


def test_latency_bottleneck():
    pred = timing_model.predict(timing_model.Workload.aggregate(1e-4, 0.0, 1e3), 64, Network(1e-5, 1e-10))
    assert pred.rows["pipelined"].bottleneck == "latency"   # 126 alphas vs 2 KB of bytes


# ---------------------------------------------------------------------- fit

SIZES = np.geomspace(1e3, 1e8, 12)


@pytest.mark.parametrize("algorithm,p,kwargs", [("ring", 4, {}), ("be", 8, {}), ("mst", 8, {}), ("lp", 8, {"chunks": 16})])
def test_fit_recovers_exact_parameters(algorithm, p, kwargs):
    truth = Network(3e-5, 8e-10)
    times = [timing_model.allreduce_time(truth, p, n, algorithm, **kwargs) for n in SIZES]
    res = planner.fit(SIZES, times, p, algorithm, **kwargs)
    assert res.alpha == pytest.approx(truth.alpha, rel=1e-6)
    assert res.beta == pytest.approx(truth.beta, rel=1e-6)
    assert res.r2 == pytest.approx(1.0)
    assert res.max_rel_error < 1e-9


def test_fit_with_one_percent_noise():
    truth = Network(3e-5, 8e-10)
    rng = np.random.default_rng(0)
    times = np.array([timing_model.ring_allreduce(truth, 4, n) for n in SIZES]) * (1 + 0.01 * rng.standard_normal(SIZES.size))
    res = planner.fit(SIZES, times, 4)
    assert res.alpha == pytest.approx(truth.alpha, rel=0.05)
    assert res.beta == pytest.approx(truth.beta, rel=0.05)
    assert res.r2 > 0.999
    assert res.max_rel_error < 0.05
    assert res.network == Network(res.alpha, res.beta)


def test_absolute_fit_follows_bulk_bandwidth_when_small_messages_burst():
    # A token bucket lets messages up to 1 MB through at 4x the link rate.
    times = [timing_model.ring_allreduce(Network(1e-4, 2e-9 / (4 if n <= 1e6 else 1)), 2, n)
             for n in SIZES]
    bulk = planner.fit(SIZES, times, 2, relative=False)
    assert bulk.beta == pytest.approx(2e-9, rel=0.05)
    assert planner.fit(SIZES, times, 2).beta < 0.9 * bulk.beta


@pytest.mark.parametrize("sizes,seconds,match", [
    ([1e6], [1e-3], "at least 2"),
    ([1e6, 2e6], [1e-3], "has 2 values"),
    ([0, 2e6], [1e-3, 2e-3], "sizes_bytes must be positive"),
    ([1e6, 2e6], [1e-3, -2e-3], "seconds must be positive"),
    ([1e6, 1e6], [1e-3, 2e-3], "distinct sizes"),
])
def test_fit_rejects_bad_data(sizes, seconds, match):
    with pytest.raises(ValueError, match=match):
        planner.fit(sizes, seconds, 4)


def test_fit_lp_needs_fixed_chunks():
    with pytest.raises(ValueError, match="chunks"):
        planner.fit([1e3, 1e6], [1e-4, 1e-3], 4, "lp")


# -------------------------------------------------------------------- units

@pytest.mark.parametrize("text,value", [
    ("10gbit", 1.25e9), ("10Gbit/s", 1.25e9), ("100mbit", 12.5e6), ("1tbit", 125e9), ("8bit", 1.0),
    ("1.25GB/s", 1.25e9), ("100MB/s", 1e8), ("1kib/s", 1024.0), ("2e3kbit", 2.5e5),
])
def test_parse_bandwidth(text, value):
    assert planner.parse_bandwidth(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["-1gbit", "0gbit", "10gbits", "10", "fast", "10 GB"])
def test_parse_bandwidth_errors_name_value_and_units(text):
    with pytest.raises(ValueError) as info:
        planner.parse_bandwidth(text)
    assert repr(text) in str(info.value)
    if text in ("10gbits", "10", "fast", "10 GB"):
        assert "gbit" in str(info.value) and "mb/s" in str(info.value)


def test_parse_latency_and_size():
    assert planner.parse_latency("20us") == pytest.approx(2e-5)
    assert planner.parse_latency("5ns") == pytest.approx(5e-9)
    assert planner.parse_latency("0.1ms") == pytest.approx(1e-4)
    assert planner.parse_latency("1s") == 1.0
    assert planner.parse_latency("0us") == 0.0
    assert planner.parse_size("233MB") == 233e6
    assert planner.parse_size("1MiB") == 2**20
    assert planner.parse_size("4096") == 4096
    for bad, parse in (("20", planner.parse_latency), ("20 minutes", planner.parse_latency),
                       ("-1us", planner.parse_latency), ("0MB", planner.parse_size)):
        with pytest.raises(ValueError, match=repr(bad)):
            parse(bad)


# ---------------------------------------------------------------------- CLI

GOOD = ["model", "--workers", "4", "--bandwidth", "10gbit", "--latency", "20us", "--model-mb", "233", "--compute-ms", "120"]


def test_cli_table(capsys):
    assert main(GOOD) == 0
    out = capsys.readouterr().out
    assert "ring allreduce" in out
    for row in ("sync", "pipelined", "pipelined+fp16", "pipelined+bf16", "pipelined+int8"):
        assert f"| {row} |" in out
    assert "| sync | 1 | none | 233.0 | 279.7 | 399.7 | 1.00x |" in out


def test_cli_algorithm_and_codec_override(capsys):
    assert main(GOOD + ["--algorithm", "lp", "--codec-ns-per-byte", "0", "--update-ms", "5"]) == 0
    out = capsys.readouterr().out
    assert "lp allreduce" in out and "update 5 ms" in out


@pytest.mark.parametrize("flag,value,message", [
    ("--bandwidth", "-10gbit", "must not be negative"),
    ("--bandwidth", "10gbits", "accepted units"),
    ("--workers", "0", "workers must be >= 1"),
    ("--compute-ms", "-1", "compute time must be >= 0"),
    ("--latency", "20", "accepted units"),
    ("--algorithm", "tree", "invalid choice"),
])
def test_cli_bad_arguments_exit_2_with_message(capsys, flag, value, message):
    argv = list(GOOD)
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and message in err
    assert "Traceback" not in err


def test_cli_plot_writes_png(tmp_path, capsys):
    path = tmp_path / "model.png"
    assert main(GOOD + ["--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 1000
    assert str(path) in capsys.readouterr().out
