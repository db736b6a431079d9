"""The per-hop codecs' device form (what CUDA tensors run: the scale a 0-dim tensor on the
device, no host sync) gives the reference's bits, run here on CPU tensors through
hops.DEVICE_FORM_ON_CPU, so CUDA's arithmetic is tested without a GPU. The reference
(the CPU form) is held to its own oracles in tests/test_collectives.py."""
import pytest
import torch

from pipe_horovod.compression import hops
from pipe_horovod.compression.hops import Int4Hop, Int8Hop

SIZES = [1, 7, 4097, (1 << 20) + 3]
_BITS = {torch.float32: torch.int32, torch.float64: torch.int64}


def data(n, dtype, kind, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "+0":
        return torch.zeros(n, dtype=dtype)
    if kind == "-0":
        return torch.full((n,), -0.0, dtype=dtype)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    x *= torch.exp2(torch.randint(-20, 20, (n,), generator=g).double())    # many magnitudes
    x = x.to(dtype)
    if kind == "subnormal":           # the scale itself subnormal or below
        x *= torch.finfo(dtype).tiny * 2.0 ** -12
    elif n >= 100:                    # ties of .5 steps, zeros of both signs
        x[:20] = torch.arange(-10, 10, dtype=dtype) / 2 * (x[20:].abs().max() / 127 * 2)
        x[40:50], x[50:60] = 0.0, -0.0
    return x


def run(codec, x, residual, device_form):
    """wire, residual, decode_add into a running sum, decode_into: in one form. Buffers
    start with junk where the codec must write and zeros where it never writes (the
    wire's padding), so both forms are compared on everything they produce."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hops, "DEVICE_FORM_ON_CPU", device_form)
        wire = torch.zeros(codec.wire_numel(x.numel()), dtype=torch.uint8)
        scratch = torch.full_like(x, 3.25)
        res = torch.full_like(x, -1.5) if residual else None
        total = torch.linspace(-2, 2, x.numel(), dtype=x.dtype)
        into = torch.full_like(x, 9.0)
        codec.encode(x, wire, scratch, res)
        codec.decode_add(wire, total)
        codec.decode_into(wire, into)
    return {"wire": wire, "residual": res, "decode_add": total, "decode_into": into}


def same_bits(a, b):
    if a.dtype == torch.uint8:
        return torch.equal(a, b)
    return a.dtype == b.dtype and torch.equal(a.view(_BITS[a.dtype]), b.view(_BITS[b.dtype]))


@pytest.mark.parametrize("codec", [Int8Hop(), Int4Hop()], ids=repr)
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "feedback"])
def test_device_form_is_the_reference_bit_for_bit(codec, numel, residual):
    x = data(numel, torch.float32, "random", numel)
    ref, got = run(codec, x, residual, False), run(codec, x, residual, True)
    for key, value in ref.items():
        if value is not None:
            assert same_bits(got[key], value), key


@pytest.mark.parametrize("codec", [Int8Hop(), Int4Hop()], ids=repr)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("kind", ["random", "+0", "-0", "subnormal"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "feedback"])
def test_device_form_edge_blocks_and_float64(codec, dtype, kind, residual):
    """All-zero blocks (the reference's scale is -0.0 for +0.0 and its residual keeps
    the zeros' signs), scales that underflow, and float64 accumulators."""
    x = data(4097, dtype, kind, 11)
    ref, got = run(codec, x, residual, False), run(codec, x, residual, True)
    for key, value in ref.items():
        if value is not None:
            assert same_bits(got[key], value), key
    if kind == "+0":                  # the reference's Python max(-low, high): -0.0
        assert got["wire"][:4].view(torch.float32).item() == 0.0
        assert torch.signbit(got["wire"][:4].view(torch.float32)).item()


@pytest.mark.parametrize("codec", [Int8Hop(), Int4Hop()], ids=repr)
def test_device_form_never_reads_a_tensor_into_python(codec, monkeypatch):
    """encode and decode_into in the device form leave the scale on the device: reading
    a tensor into a Python number (a host sync on CUDA) raises here."""
    x = data(4097, torch.float32, "random", 3)
    wire = torch.zeros(codec.wire_numel(x.numel()), dtype=torch.uint8)
    scratch, residual, out = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)
    monkeypatch.setattr(hops, "DEVICE_FORM_ON_CPU", True)

    def sync(*args):
        raise AssertionError("a tensor was read into Python")

    for name in ("__float__", "__bool__", "__int__", "item", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, sync)
    codec.encode(x, wire, scratch, residual)
    codec.decode_into(wire, out)
    monkeypatch.undo()
    assert torch.equal(out + residual, x)     # what was lost and what arrived: all of x
