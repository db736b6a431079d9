"""Exercises one engine across ranks; every value is checked exactly.

Each rank contributes values derived from its rank, so the expected result
is known in closed form on every rank without further communication.
"""
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


def main():
    want_engine, want_size = sys.argv[1], int(sys.argv[2])
    eng = engine.init()
    rank, size = engine.rank(), engine.size()
    assert eng.name == want_engine, (eng.name, want_engine)
    assert size == want_size and 0 <= rank < size and engine.local_rank() == rank

    # Every dtype and op, one element and 16 MB.
    seed = 0
    for dtype in DTYPES:
        for op in (engine.Average, engine.Sum):
            for numel in (1, BIG // torch.finfo(dtype).bits * 8):
                seed += 1
                t = contribution(rank, numel, dtype, seed)
                h = engine.allreduce_async(t, f"t.{dtype}.{op.value}.{numel}", op)
                out = engine.wait(h)
                assert out.data_ptr() == t.data_ptr(), "allreduce must be in place"
                check_equal(out, expected(size, numel, dtype, seed, op), f"{dtype} {op} {numel}")

    # Many handles in flight at once, waited for out of order.
    tensors = {i: contribution(rank, 1000 + i, torch.float32, i) for i in range(24)}
    handles = {i: engine.allreduce_async(t, f"many.{i}") for i, t in tensors.items()}
    assert eng.in_flight() == 24
    for i in sorted(handles, key=lambda i: (i * 7) % 24):
        check_equal(engine.wait(handles[i]), expected(size, 1000 + i, torch.float32, i, engine.Average),
                    f"many.{i}")
    assert eng.in_flight() == 0

    # poll turns true without wait (bounded).
    t = contribution(rank, 10, torch.float32, 3)
    h = engine.allreduce_async(t, "polled", engine.Sum)
    deadline = time.monotonic() + 60
    while not engine.poll(h):
        if time.monotonic() > deadline:
            raise AssertionError("poll never reported completion within 60 s")
        time.sleep(0.001)                        # spinning would starve gloo's thread on 2 cores
    check_equal(engine.wait(h), expected(size, 10, torch.float32, 3, engine.Sum), "polled")

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
    print(f"WORKER_OK rank={rank}", flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()
