"""The two-stage quantized allreduce on the engine's own collectives.

One launch per (engine, ranks) runs every reduction case against the single-process
reference of tests/workers/quantized_worker.py, bit for bit; the "all" launches add
training with the wrapped optimizer (int8 and int8_ef, K=1, 2 and 3, plain and the
default compensation) against tests/oracle.py and a bit-exact resume mid-pipeline
with both residuals, and a sparse embedding beside quantized buckets. From 3 ranks a
process set of two reduces alone; every launch ends with a reduction left in flight
that shutdown must complete. Every launch checks 2, 3 or 4 ranks on both engines;
training runs on Horovod at 2 ranks and torch.distributed at 3, and in one plain
process.
"""
import pytest
import torch

import shared_launches
import pipe_horovod.torch as phvd
from pipe_horovod.collectives import quantized
from pipe_horovod.compression import Compression, check_compression, two_stage
from pipe_horovod.compression.two_stage import WireFormat, dequantize, quantize

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("engine_name, np, scope", [
    ("horovod", 2, "all"), ("horovod", 3, "allreduce"), ("horovod", 4, "allreduce"),
    ("torch", 2, "allreduce"), ("torch", 3, "all"), ("torch", 4, "allreduce"),
    ("local", 1, "all")])
def test_quantized_allreduce_matches_the_reference(engine_name, np, scope):
    # In the launches test_collectives.py shares (tests/shared_launches.py).
    shared_launches.collectives_case(engine_name, np,
                                     "quantized-all" if scope == "all" else "quantized")


# --- the pure functions ---------------------------------------------------------
@pytest.mark.parametrize("kind", ["int8", "int4", "float8_e4m3fn", "float8_e5m2"])
def test_a_block_loses_at_most_half_a_step_and_the_loss_is_exact(kind):
    if not hasattr(torch, kind):
        pytest.skip(f"torch {torch.__version__} has no {kind}")
    fmt = WireFormat(kind, 64)
    x = torch.randn(1000, dtype=torch.float32) * 3
    x[100:164] = 0                                   # a block of zeros stays zeros
    wire, back = quantize(x, fmt)
    assert wire.dtype == torch.uint8 and wire.numel() == fmt.shard_bytes(1000)
    assert fmt.shard_bytes(1000) % 4 == 0
    assert torch.equal(back, dequantize(wire, 1000, fmt, torch.float32))   # what receivers see
    blocks = torch.nn.functional.pad(x, (0, 24)).view(-1, 64)
    step = blocks.abs().amax(1, keepdim=True) / fmt.qmax
    err = (torch.nn.functional.pad(x - back, (0, 24)).view(-1, 64)).abs()
    if kind in ("int8", "int4"):                     # uniform steps: half a step
        assert (err <= step / 2 * (1 + 1e-6)).all()
    else:                                            # relative to the value, plus subnormals
        mantissa = 3 if kind == "float8_e4m3fn" else 2
        tiny = torch.finfo(getattr(torch, kind)).smallest_normal
        limit = (blocks.abs() * 2.0 ** -(mantissa + 1) + step * tiny)
        assert (err <= limit * (1 + 1e-6)).all()
    assert not back[100:164].any()


def test_a_block_size_survives_a_saved_config():
    from pipe_horovod.compression import config_name

    codec = Compression.by_name(config_name(Compression.int8_ef.with_block_size(1024)))
    assert codec.name == "int8_ef" and codec.block_size == 1024 and codec.error_feedback
    assert config_name(Compression.int8_ef) == "int8_ef"
    assert config_name(Compression.fp16) == "fp16"
    assert Compression.by_name("fp8_e5m2:64").block_size == 64
    assert Compression.by_name("int4_ef:64").block_size == 64
    with pytest.raises(ValueError, match="only int8, int4 and fp8 codecs take a block size"):
        Compression.by_name("fp16:64")
    with pytest.raises(ValueError, match="block_size must be between"):
        Compression.by_name("int8:3")
    with pytest.raises(ValueError, match="int4 packs two values a byte.*must be even, got 65"):
        Compression.by_name("int4_ef:65")


def test_shards_and_wire_sizes_follow_one_rule():
    assert two_stage.shard_sizes(10, 4) == [3, 3, 2, 2]
    assert two_stage.shard_sizes(2, 3) == [1, 1, 0]
    fmt = WireFormat("int8", 16)
    assert fmt.shard_bytes(0) == 0
    assert fmt.shard_bytes(17) == 2 * 4 + 20         # two scales, 17 values padded to 20
    assert WireFormat("bfloat16").shard_bytes(3) == 8
    assert WireFormat("int4", 16).shard_bytes(17) == 2 * 4 + 12   # 9 bytes padded to 12
    x = torch.randn(5, dtype=torch.float64)
    wire, back = quantize(x, WireFormat("float16"))
    assert torch.equal(back, x.to(torch.float16).double())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_on_cuda_every_step_stays_on_the_device_and_matches_the_cpu():
    fmt = WireFormat("int8")
    x = torch.randn(4099)
    wire, back = quantize(x.cuda(), fmt)
    assert wire.is_cuda and back.is_cuda
    cpu_wire, cpu_back = quantize(x, fmt)
    assert torch.equal(wire.cpu(), cpu_wire) and torch.equal(back.cpu(), cpu_back)


# --- wrap-time refusals (item 5) --------------------------------------------------
@pytest.fixture
def local():
    phvd.init("local")
    yield
    phvd.shutdown()


def _wrap(**kw):
    model = torch.nn.Linear(3, 2)
    return phvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters(), **kw)


def test_int8_and_fp8_wrap_without_a_collective(local):
    for codec in (Compression.int8, Compression.int8_ef, Compression.int4,
                  Compression.int4_ef, Compression.fp8_e4m3_ef, Compression.fp8_e5m2,
                  Compression.int8.with_block_size(1024)):
        _wrap(compression=codec)
    _wrap(compression=Compression.int8_ef, collective="ring")      # per hop: still there
    _wrap(compression=Compression.int4_ef, collective="lp")
    odd = type("Odd", (Compression.int4_ef,), {"block_size": 255})
    with pytest.raises(ValueError, match="'int4_ef': int4 packs two values a byte"):
        _wrap(compression=odd)


@pytest.mark.parametrize("block_size, error, text", [
    (3, ValueError, "block_size must be between 16 and"),
    (2 ** 21, ValueError, "block_size must be between 16 and"),
    (0, ValueError, "block_size must be between"),
    (256.0, TypeError, "block_size must be an int"),
    (True, TypeError, "block_size must be an int")])
def test_a_bad_block_size_is_refused(local, block_size, error, text):
    with pytest.raises(error, match=text):
        Compression.int8.with_block_size(block_size)
    odd = type("Odd", (Compression.int8_ef,), {"block_size": block_size})
    with pytest.raises(error, match=text):
        _wrap(compression=odd)


def test_fp8_without_fp8_dtypes_is_refused_at_wrap(local, monkeypatch):
    monkeypatch.delattr(torch, "float8_e4m3fn", raising=False)
    with pytest.raises(ValueError, match="needs torch.float8_e4m3fn, which torch"):
        _wrap(compression=Compression.fp8_e4m3)
    with pytest.raises(ValueError, match="needs torch.float8_e4m3fn"):
        check_compression(Compression.fp8_e4m3_ef)


@pytest.mark.parametrize("kw, text", [
    ({"compression": Compression.fp8_e5m2, "collective": "lp"},
     "runs only in the two-stage reduction"),
    ({"compression": Compression.int8, "op": phvd.Max}, "Average or pipe_horovod.Sum"),
])
def test_what_the_two_stage_path_cannot_do_is_refused(local, kw, text):
    with pytest.raises(ValueError, match=text):
        _wrap(**kw)


def test_horovods_functional_allreduce_takes_int8(local):
    """hvd.allreduce(t, compression=int8): a new tensor, differentiable (one rank: exact)."""
    t = torch.randn(300, requires_grad=True)
    out = phvd.allreduce(t, compression=Compression.int8, op=phvd.Sum)
    assert out is not t and torch.equal(out, t.detach())
    out.sum().backward()
    assert torch.equal(t.grad, torch.ones(300))
    with pytest.raises(ValueError, match="Average, Sum"):
        phvd.allreduce(t, compression=Compression.int8, op=phvd.Max)


@pytest.mark.parametrize("transport", quantized.TRANSPORTS)
def test_a_lone_rank_quantizes_nothing_on_either_transport(local, transport):
    t = torch.randn(300)
    want = t.clone()
    out = phvd.synchronize(quantized.allreduce_async(t, "solo", fmt=WireFormat("int8"),
                                                     transport=transport))
    assert out is t and torch.equal(t, want)


def test_buckets_go_point_to_point_on_a_cpu_and_on_the_engine_elsewhere(monkeypatch):
    monkeypatch.delenv(quantized.TRANSPORT_VARIABLE, raising=False)
    cpu, other = torch.ones(4), torch.ones(4, device="meta")     # meta: a non-CPU device
    assert quantized.bucket_transport(cpu) == "p2p"
    assert quantized.bucket_transport(other) == "engine"
    monkeypatch.setenv(quantized.TRANSPORT_VARIABLE, "engine")
    assert quantized.bucket_transport(cpu) == "engine"
    monkeypatch.setenv(quantized.TRANSPORT_VARIABLE, "p2p")
    assert quantized.bucket_transport(cpu) == "p2p"
    with pytest.raises(ValueError, match="PIPE_HOROVOD_TWO_STAGE_TRANSPORT='p2p': choose "
                                         "one of engine, p2p .p2p for CPU tensors only; this "
                                         "tensor is on meta"):
        quantized.bucket_transport(other)
    monkeypatch.setenv(quantized.TRANSPORT_VARIABLE, "ring")
    with pytest.raises(ValueError, match="TRANSPORT='ring': choose one of engine, p2p"):
        quantized.bucket_transport(cpu)


def test_a_transport_that_cannot_carry_the_tensor_is_refused(local):
    for transport, t in (("ring", torch.ones(3)), ("p2p", torch.ones(3, device="meta"))):
        with pytest.raises(ValueError, match=f"^transport='{transport}': choose one of "
                                             "engine, p2p .p2p for CPU tensors only; this "
                                             f"tensor is on {t.device}"):
            quantized.allreduce_async(t, "bad", fmt=WireFormat("int8"), transport=transport)


# --- chunks (the stages pipelined) --------------------------------------------------
@pytest.mark.parametrize("numel, p, fmt, min_numel, count", [
    (1000, 2, WireFormat("int8"), None, 1),              # small: one chunk, the shards
    (4099, 3, WireFormat("int8"), 200, 6),               # smallest shard: 6 blocks
    (4099, 2, WireFormat("int8", 16), 200, 16),          # capped at MAX_CHUNKS
    (5000, 4, WireFormat("bfloat16"), 1200, 4),          # unscaled: 256-element units
    (2 ** 21 + 5, 3, WireFormat("int8"), None, 4),       # the default rule
    (7, 8, WireFormat("int8"), 1, 1)])                   # shards of 0 and 1 elements
def test_chunks_split_every_shard_in_whole_blocks(numel, p, fmt, min_numel, count):
    chunks = two_stage.chunks(numel, p, fmt, min_numel)
    assert len(chunks) == count == two_stage.chunk_count(numel, p, fmt, min_numel)
    unit = fmt.block_size or 256
    for r, size in enumerate(two_stage.shard_sizes(numel, p)):
        start = two_stage.own_shard(numel, p, r)[0]
        at = start
        for ranges in chunks:                    # rank r's parts: its shard, in order
            a, n = ranges[r]
            assert a == at and (n > 0 or count == 1)
            assert (a - start) % unit == 0       # blocks as in one chunk
            at += n
        assert at == start + size
    if count == 1:
        assert [n for _, n in chunks[0]] == two_stage.shard_sizes(numel, p)


@pytest.mark.parametrize("kind, dtype", [("int8", torch.float32), ("int8", torch.float64),
                                         ("int4", torch.float32),
                                         ("float16", torch.float32),
                                         ("float8_e4m3fn", torch.float32)])
def test_chunks_change_no_bit_of_the_result_or_the_residuals(kind, dtype):
    """The whole reduction in one process on the engine path's functions, in chunks and in
    one: the same result and residuals, bit for bit (blocks never straddle a chunk)."""
    if not hasattr(torch, kind):
        pytest.skip(f"torch {torch.__version__} has no {kind}")
    fmt, p, n = WireFormat(kind, 64) if kind != "float16" else WireFormat(kind), 3, 5003
    acc = two_stage.accumulator(dtype)
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(n, generator=g, dtype=dtype) * (r + 1) for r in range(p)]

    def run(min_numel):
        out = torch.empty(n, dtype=dtype)
        first = [torch.randn(n, generator=torch.Generator().manual_seed(r), dtype=acc) / 50
                 for r in range(p)]
        second = [torch.full((two_stage.own_shard(n, p, r)[1],), 0.01, dtype=acc)
                  for r in range(p)]
        chunks = two_stage.chunks(n, p, fmt, min_numel)
        for ranges in chunks:
            sends = [two_stage.first_stage_chunk(xs[r], ranges, fmt, first[r])
                     for r in range(p)]
            reduced = []
            for s, (a, m) in enumerate(ranges):  # rank s: everyone's part s, in rank order
                received = torch.cat([send[sum(splits[:s]):sum(splits[:s + 1])]
                                      for send, splits in sends])
                low = a - two_stage.own_shard(n, p, s)[0]
                reduced.append(two_stage.reduce_shard(received, p, m, fmt, acc, True,
                                                      residual=second[s][low:low + m]))
            two_stage.decode_chunk(torch.cat(reduced), ranges, fmt, out)
        return len(chunks), out, first, second

    one, *whole = run(None)
    many, *chunked = run(300)
    assert one == 1 and many > 2
    for a, b in zip(whole, chunked):
        for x, y in zip([a] if torch.is_tensor(a) else a, [b] if torch.is_tensor(b) else b):
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
