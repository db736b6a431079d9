"""The automatic bucket size (bucket_cap_mb=None): pipe_horovod.pipeline.buckets.

One runtime function picks the cap from the ranks that reduce and the link; both adapters
resolve it at wrap time and the planner uses the same function (tests/test_plan.py checks
its predictions against Horovod's)."""
import json
import pickle

import pytest

from pipe_horovod.pipeline import check_options, plan_buckets
from pipe_horovod.pipeline.buckets import (AUTO_FIRST_MB, AUTO_MAX_MB, AUTO_MIN_MB,
                                           LINK_GBPS_VARIABLE, LINK_LATENCY_VARIABLE,
                                           AUTO_SPLIT_LATENCY_S, AutoBucketCap,
                                           auto_bucket_cap_mb, auto_splits_model,
                                           bucket_cap_bytes, link_from_environment,
                                           resolve_bucket_cap_mb)

GBIT = 1e9 / 8
MIB = 2**20


@pytest.mark.parametrize("gbps", [1, 10, 25, 100, 400])
@pytest.mark.parametrize("latency_us", [0, 5, 20, 100])
def test_monotonic_in_world_size_and_bounded(gbps, latency_us):
    caps = [auto_bucket_cap_mb(p, gbps * GBIT, latency_us * 1e-6) for p in range(1, 1025)]
    assert all(a <= b for a, b in zip(caps, caps[1:]))
    assert all(AUTO_MIN_MB <= c <= AUTO_MAX_MB for c in caps)


def test_grows_with_the_link_latency_and_bandwidth():
    assert auto_bucket_cap_mb(8, 100 * GBIT, 20e-6) > auto_bucket_cap_mb(8, 10 * GBIT, 20e-6)
    assert auto_bucket_cap_mb(8, 400 * GBIT, 20e-6) > auto_bucket_cap_mb(8, 400 * GBIT, 5e-6)
    # A free link or one rank: no latency to amortize, the floor.
    assert auto_bucket_cap_mb(256, 100 * GBIT, 0.0) == AUTO_MIN_MB
    assert auto_bucket_cap_mb(1, 100 * GBIT, 1e-3) == AUTO_MIN_MB


def test_the_rule_by_hand():
    # 8 ranks, 100 Gbit/s, 20 us: latency at 5% of the wire time needs
    # 8 * 20e-6 * 12.5e9 / 0.05 = 40 MB; the ring's 14 latencies (0.28 ms) ask 128 * 0.28 / 2
    # = 17.9 MiB: 40e6 / 2**20 = 38.1 MiB.
    assert auto_bucket_cap_mb(8, 100 * GBIT, 20e-6) == pytest.approx(40e6 / MIB)
    # 64 ranks: 126 latencies of 20 us = 2.52 ms >= 2 ms: Horovod's fusion size.
    assert auto_bucket_cap_mb(64, 10 * GBIT, 20e-6) == AUTO_MAX_MB
    # 16 ranks, 10 Gbit/s, 20 us: 30 latencies = 0.6 ms -> 128 * 0.6 / 2 = 38.4 MiB.
    assert auto_bucket_cap_mb(16, 10 * GBIT, 20e-6) == pytest.approx(38.4)


@pytest.mark.parametrize("value", [1e-5, 0.5, 25, 25.0, 500])
def test_explicit_values_are_kept_and_checked_as_before(value):
    assert resolve_bucket_cap_mb(value, world_size=256, environ={}) is value
    assert type(bucket_cap_bytes(value)) is int and bucket_cap_bytes(value) == int(value * MIB)
    check_options(2, 0, 1, value)


@pytest.mark.parametrize("value, error", [(0, ValueError), (-1, ValueError),
                                          (float("inf"), ValueError), ("25", TypeError),
                                          (True, TypeError)])
def test_bad_explicit_values_are_refused_as_before(value, error):
    with pytest.raises(error, match="bucket_cap_mb"):
        check_options(2, 0, 1, resolve_bucket_cap_mb(value, world_size=8, environ={}))


def test_none_resolves_from_the_environment():
    cap = resolve_bucket_cap_mb(None, world_size=8, environ={})
    assert isinstance(cap, AutoBucketCap) and cap == auto_bucket_cap_mb(8, 25 * GBIT, 20e-6)
    fast = resolve_bucket_cap_mb(None, world_size=8, environ={LINK_GBPS_VARIABLE: "100",
                                                              LINK_LATENCY_VARIABLE: "20"})
    assert fast == pytest.approx(40e6 / MIB)
    check_options(2, 0, 1, fast)                      # a valid explicit-looking number
    # What the optimizer records and the ranks compare: a plain number.
    assert repr(fast) == repr(float(fast)) and json.dumps(fast) == json.dumps(float(fast))
    assert pickle.loads(pickle.dumps(fast)) == fast
    assert bucket_cap_bytes(fast) == int(fast * MIB)
    assert bucket_cap_bytes(fast).first_bytes == AUTO_FIRST_MB * MIB


@pytest.mark.parametrize("name, text", [
    (LINK_GBPS_VARIABLE, "fast"), (LINK_GBPS_VARIABLE, "0"), (LINK_GBPS_VARIABLE, "-10"),
    (LINK_GBPS_VARIABLE, "nan"), (LINK_GBPS_VARIABLE, "inf"), (LINK_GBPS_VARIABLE, "10gbit"),
    (LINK_LATENCY_VARIABLE, "-1"), (LINK_LATENCY_VARIABLE, "5us"), (LINK_LATENCY_VARIABLE, "x"),
])
def test_bad_environment_values_are_a_clear_error(name, text):
    with pytest.raises(ValueError, match=f"{name} must be a number .* got '{text}'"):
        link_from_environment({name: text})
    with pytest.raises(ValueError, match=name):
        resolve_bucket_cap_mb(None, world_size=8, environ={name: text})


def test_link_from_environment_reads_both_and_defaults():
    assert link_from_environment({}) == pytest.approx((25 * GBIT, 20e-6))
    assert link_from_environment({LINK_GBPS_VARIABLE: "100", LINK_LATENCY_VARIABLE: "0"}) == (
        100 * GBIT, 0.0)
    assert link_from_environment({LINK_GBPS_VARIABLE: " "}) == pytest.approx((25 * GBIT, 20e-6))


def test_bad_arguments():
    for p in (0, 2.5, True):
        with pytest.raises(ValueError, match="world_size"):
            auto_bucket_cap_mb(p, GBIT, 0.0)
    with pytest.raises(ValueError, match="bandwidth"):
        auto_bucket_cap_mb(8, 0.0, 0.0)
    with pytest.raises(ValueError, match="latency"):
        auto_bucket_cap_mb(8, GBIT, -1.0)


def test_an_automatic_cap_sends_the_first_bucket_early():
    # ready order: 2 MiB, 3 MiB, 20 MiB, 1 KiB, 30 MiB (float32 elements)
    sizes = [2 * MIB, 3 * MIB, 20 * MIB, 1024, 30 * MIB]
    members = [(str(i), n // 4, 4, "f32") for i, n in enumerate(sizes)]
    auto = plan_buckets(members, bucket_cap_bytes(AutoBucketCap(32)))
    assert [b.numel * 4 for b in auto] == [5 * MIB, 20 * MIB + 1024, 30 * MIB]
    explicit = plan_buckets(members, bucket_cap_bytes(32.0))    # unchanged: cap only
    assert [b.numel * 4 for b in explicit] == [25 * MIB + 1024, 30 * MIB]
    # a cap below the first-bucket size: the cap rules
    tiny = plan_buckets(members, bucket_cap_bytes(AutoBucketCap(1)))
    assert [b.numel * 4 for b in tiny] == sizes


def test_an_automatic_cap_splits_the_model_while_latency_is_small():
    # 64 ranks, 20 us: 126 latencies = 2.52 ms < 4 ms -> at most half the model per bucket;
    # 256 ranks: 10.2 ms -> one fused bucket as before; one rank sends nothing.
    assert AUTO_SPLIT_LATENCY_S == pytest.approx(4e-3)
    assert auto_splits_model(64, 20e-6) and not auto_splits_model(256, 20e-6)
    assert not auto_splits_model(1, 0.0) and auto_splits_model(2, 20e-6)
    assert resolve_bucket_cap_mb(None, world_size=64, environ={}).split_model
    assert not resolve_bucket_cap_mb(None, world_size=256, environ={}).split_model
    # ResNet-50-like: 4 MiB ready first, then 94 MiB in 2 MiB gradients
    members = [("a", MIB, 4, "f32")] + [(f"g{i}", MIB // 2, 4, "f32") for i in range(47)]
    total = 98 * MIB
    split = plan_buckets(members, bucket_cap_bytes(AutoBucketCap(128, split_model=True)))
    assert [b.numel * 4 for b in split] == [4 * MIB, 48 * MIB, 46 * MIB]
    assert all(b.numel * 4 <= total / 2 for b in split)
    whole = plan_buckets(members, bucket_cap_bytes(AutoBucketCap(128)))
    assert [b.numel * 4 for b in whole] == [4 * MIB, 94 * MIB]
    # never below the floor: a small model keeps AUTO_MIN_MB buckets
    small = [(f"s{i}", MIB // 4, 4, "f32") for i in range(40)]           # 40 MiB
    assert [b.numel * 4 for b in plan_buckets(
        small, bucket_cap_bytes(AutoBucketCap(128, split_model=True)))] == [4 * MIB, 32 * MIB,
                                                                            4 * MIB]
    # what a checkpoint or a rank's description pickles keeps the flag
    assert pickle.loads(pickle.dumps(AutoBucketCap(128, split_model=True))).split_model


def test_the_torch_adapter_resolves_and_reports_the_automatic_size(monkeypatch, caplog):
    torch = pytest.importorskip("torch")
    import pipe_horovod.torch as phvd
    from pipe_horovod.pipeline import buckets

    monkeypatch.setenv(LINK_GBPS_VARIABLE, "100")
    monkeypatch.setattr(buckets, "_told", set())
    phvd.init("local")
    try:
        model = torch.nn.Linear(3, 2)
        with caplog.at_level("INFO", logger="pipe_horovod"):
            opt = phvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                            named_parameters=model.named_parameters())
        # one rank: nothing to amortize, the floor; recorded as a number, first bucket early
        assert opt._machine.cap_bytes == AUTO_MIN_MB * MIB
        assert opt._machine.cap_bytes.first_bytes == AUTO_FIRST_MB * MIB
        assert "bucket_cap_mb=None (auto): 32.0 MiB buckets" in caplog.text
        assert "1 ranks on a 100 Gbit/s, 20 us link (environment" in caplog.text
        explicit = phvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                             named_parameters=model.named_parameters(),
                                             bucket_cap_mb=25)
        assert type(explicit._machine.cap_bytes) is int
        assert explicit._machine.cap_bytes == 25 * MIB
        monkeypatch.setenv(LINK_LATENCY_VARIABLE, "soon")
        with pytest.raises(ValueError, match="PIPE_HOROVOD_LINK_LATENCY_US must be a number"):
            phvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters())
    finally:
        phvd.shutdown()
