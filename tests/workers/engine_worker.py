"""Exercises one engine across ranks; every value is checked exactly.

Each rank contributes values derived from its rank, so the expected result
is known in closed form on every rank without further communication.
"""
import os
import sys
import time

import torch

from pipe_horovod import engine

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
BIG = 16 * 2**20  # bytes


def contribution(rank, numel, dtype, seed):
    # Small integers: sums and averages of them are exact in every dtype tested.
    base = (torch.arange(numel, dtype=torch.float64) + seed) % 7 + 1
    return (base * (rank + 1)).to(dtype)


def expected(size, numel, dtype, seed, op):
    base = (torch.arange(numel, dtype=torch.float64) + seed) % 7 + 1
    total = base * (size * (size + 1) / 2)
    return (total / size if op is engine.Average else total).to(dtype)


def check_equal(got, want, what):
    if not torch.equal(got, want):
        bad = (got != want).nonzero()[:5].flatten().tolist()
        raise AssertionError(f"{what}: mismatch at {bad}: got {got[bad]} want {want[bad]}")


def expect_error(exc_type, text, fn, *args):
    try:
        fn(*args)
    except exc_type as exc:
        assert text in str(exc), f"{exc_type.__name__} without {text!r}: {exc}"
    else:
        raise AssertionError(f"expected {exc_type.__name__} containing {text!r}")


def bf16_input(rank, shape, seed):
    """Arbitrary bfloat16 values over a wide range of magnitudes and both signs:
    sums of them are not exact, so only the exact algorithm matches the oracle."""
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    numel = torch.Size(shape).numel()
    values = torch.randn(numel, generator=g) * torch.exp(torch.randn(numel, generator=g) * 4)
    return values.reshape(shape).to(torch.bfloat16)


def bf16_oracle(size, shape, seed, op):
    """The float32 sum of every rank's bfloat16 input in rank order, divided by
    size for Average, rounded to bfloat16 once."""
    total = bf16_input(0, shape, seed).float()
    for r in range(1, size):
        total += bf16_input(r, shape, seed).float()
    if op is engine.Average:
        total /= size
    return total.to(torch.bfloat16)


def check_bits(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, (
        what, got.dtype, got.shape, want.shape)
    check_equal(got.view(torch.int16), want.view(torch.int16), what)


def check_horovod_bf16(eng, rank, size):
    """Horovod's bfloat16 path (alltoall + float32 sum + allgather) against an exact oracle."""
    seed = 100
    # Sizes around the rank count (empty shards when numel < size), multi-dim, odd sizes.
    shapes = [(0,), (1,), (2,), (size - 1,), (size,), (size + 1,), (3, 5), (7, 11, 13), (100003,)]
    for shape in shapes:
        for op in (engine.Average, engine.Sum):
            seed += 1
            t = bf16_input(rank, shape, seed)
            out = engine.wait(engine.allreduce_async(t, f"bf16.exact.{seed}", op))
            assert out is t, "bf16 allreduce must return the caller's tensor, reduced in place"
            check_bits(out, bf16_oracle(size, shape, seed, op), f"bf16 {shape} {op}")

    # Several in flight, ops mixed, waited for out of order.
    jobs = {}
    for i, numel in enumerate([1, 2, 5, 1000, 4097, 3, 65536, 10]):
        seed += 1
        op = engine.Sum if i % 2 else engine.Average
        t = bf16_input(rank, (numel,), seed)
        jobs[i] = (t, seed, op, engine.allreduce_async(t, f"bf16.many.{i}", op))
    assert eng.in_flight() == len(jobs)
    for i in sorted(jobs, key=lambda i: (i * 5 + 3) % len(jobs)):
        t, s, op, h = jobs[i]
        check_bits(engine.wait(h), bf16_oracle(size, t.shape, s, op), f"bf16.many.{i}")
    assert eng.in_flight() == 0

    # Ranks start them in different orders, and all but rank 0 wait for the
    # last one before starting the rest: Horovod's allreduce allows this, so
    # phase 2 of one reduction must never queue behind another's phase 1.
    names = [f"bf16.order.{i}" for i in range(4)]
    seeds = {n: seed + 1 + i for i, n in enumerate(names)}
    inputs = {n: bf16_input(rank, (257,), seeds[n]) for n in names}
    order = names if rank == 0 else names[::-1]
    started = {}

    def finish(n):
        want = bf16_oracle(size, (257,), seeds[n], engine.Average)
        check_bits(engine.wait(started.pop(n)), want, n)

    for n in order:
        started[n] = engine.allreduce_async(inputs[n], n)
        if rank != 0 and n == names[-1]:
            finish(n)
    for n in names[::-1]:
        if n in started:
            finish(n)
    assert eng.in_flight() == 0


def check_engine(want_engine, want_size):
    """Every check, on the engine the launcher's environment picks (left running)."""
    eng = engine.init()
    rank, size = engine.rank(), engine.size()
    assert eng.name == want_engine, (eng.name, want_engine)
    assert size == want_size and 0 <= rank < size and engine.local_rank() == rank

    # Every dtype and op, one element and 16 MB.
    seed = 0
    for dtype in DTYPES:
        for op in (engine.Average, engine.Sum):
            for numel in (1, 2, BIG // torch.finfo(dtype).bits * 8):
                seed += 1
                t = contribution(rank, numel, dtype, seed)
                h = engine.allreduce_async(t, f"t.{dtype}.{op.value}.{numel}", op)
                out = engine.wait(h)
                assert out.data_ptr() == t.data_ptr(), "allreduce must be in place"
                check_equal(out, expected(size, numel, dtype, seed, op), f"{dtype} {op} {numel}")

    # Many handles in flight at once, float32 and bfloat16 mixed, waited for out of order.
    def many_dtype(i):
        return torch.bfloat16 if i % 3 == 0 else torch.float32

    tensors = {i: contribution(rank, 1000 + i, many_dtype(i), i) for i in range(24)}
    handles = {i: engine.allreduce_async(t, f"many.{i}") for i, t in tensors.items()}
    assert eng.in_flight() == 24
    for i in sorted(handles, key=lambda i: (i * 7) % 24):
        out = engine.wait(handles[i])
        assert out.data_ptr() == tensors[i].data_ptr(), f"many.{i} not in place"
        check_equal(out, expected(size, 1000 + i, many_dtype(i), i, engine.Average), f"many.{i}")
    assert eng.in_flight() == 0

    if eng.name == "horovod":
        check_horovod_bf16(eng, rank, size)
        # the engine keeps reductions in enqueue order across steps (engine/horovod.py)
        assert os.environ.get("HOROVOD_CACHE_CAPACITY") == "0", os.environ.get(
            "HOROVOD_CACHE_CAPACITY")

    # poll turns true without wait (bounded); bfloat16 takes the horovod engine's own path.
    for dtype in (torch.float32, torch.bfloat16):
        t = contribution(rank, 10, dtype, 3)
        h = engine.allreduce_async(t, f"polled.{dtype}", engine.Sum)
        deadline = time.monotonic() + 60
        while not engine.poll(h):
            if time.monotonic() > deadline:
                raise AssertionError(f"poll never reported a {dtype} reduction done within 60 s")
            time.sleep(0.001)                    # spinning would starve gloo's thread on 2 cores
        check_equal(engine.wait(h), expected(size, 10, dtype, 3, engine.Sum), f"polled {dtype}")

    # Broadcast tensors from the last rank, objects from rank 0.
    root = size - 1
    t = torch.full((5,), float(rank), dtype=torch.float64)
    check_equal(engine.broadcast(t, root), torch.full((5,), float(root), dtype=torch.float64), "bcast")
    obj = engine.broadcast_object({"from": rank, "list": [rank] * 3} if rank == 0 else None, 0)
    assert obj == {"from": 0, "list": [0, 0, 0]}, obj
    assert engine.allgather_object(rank * 10) == [r * 10 for r in range(size)]

    # Bad input: clear errors, raised before anything reaches the wire.
    expect_error(ValueError, "contiguous", engine.allreduce_async, torch.zeros(4, 4).t(), "nc")
    expect_error(TypeError, "torch.Tensor", engine.allreduce_async, [1.0, 2.0], "list")
    expect_error(ValueError, "unknown reduce op", engine.allreduce_async, torch.zeros(2), "op", "max")
    h = engine.allreduce_async(torch.ones(3), "dup")
    expect_error(ValueError, "already in flight", engine.allreduce_async, torch.ones(3), "dup")
    engine.wait(h)
    expect_error(ValueError, "unknown handle", engine.wait, h)
    expect_error(ValueError, "unknown handle", engine.wait, 12345)
    expect_error(ValueError, "out of range", engine.broadcast, torch.ones(1), size)

    engine.barrier()


def main():
    check_engine(sys.argv[1], int(sys.argv[2]))
    print(f"WORKER_OK rank={engine.rank()}", flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()
