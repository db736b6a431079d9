"""The C kernels of the two-stage int8 and float8 reduction (compression/native.py,
cpu_kernels.c) against its torch operations, bit for bit.

The oracle of tests/test_quantized_allreduce.py calls the same quantize/dequantize
as the engine, so on CPU both run the kernels; this file is what proves that the
kernels give exactly the bits of the torch form (PIPE_HOROVOD_NATIVE_CODEC=0): every
public function of two_stage, float32 and float64, several block sizes, sizes that
are not a multiple of the block, ties, +-0, subnormals, values near float32's
limits, and blocks that are not finite (NaN, inf), which the kernels hand back to
torch from that block on.
"""
import logging

import pytest
import torch

from pipe_horovod.compression import native, two_stage
from pipe_horovod.compression.two_stage import WireFormat, same_bits

pytestmark = pytest.mark.skipif(native.library() is None,
                                reason="no C compiler: the torch form runs alone")


def _torch_only(monkeypatch):
    monkeypatch.setenv(native.ENV, "0")


def _native(monkeypatch):
    monkeypatch.delenv(native.ENV, raising=False)


def _data(n, dtype, seed, special=None):
    """Random values over many magnitudes, with ties, zeros, -0, subnormals, and
    `special` (nan, inf, big) put in one block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    x *= torch.exp2(torch.randint(-30, 30, (n,), generator=g).double())
    x = x.to(dtype)
    if n >= 300:
        x[:40] = torch.arange(-20, 20, dtype=dtype) / 2 * 2.0 ** -5 * 127 / 10   # .5 ties
        x[40:72] = 0.0
        x[72:80] = -0.0
        x[80:84] = torch.tensor([1e-40, -1e-42, 1e-45, -3e-39], dtype=dtype)   # subnormal
        x[90] = torch.finfo(torch.float32).max
        x[200:203] = torch.tensor([-1e-30, 3e-38, -2e-38], dtype=dtype)
    if special is not None and n >= 300:
        x[n // 2] = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"),
                     "big": 1e300 if dtype == torch.float64 else 3e38}[special]
    return x


def _both(monkeypatch, fn):
    """fn() with the torch form, then with the kernels."""
    _torch_only(monkeypatch)
    ref = fn()
    _native(monkeypatch)
    return ref, fn()


def _same(a, b):
    if isinstance(a, tuple):
        return all(_same(x, y) for x, y in zip(a, b))
    if a is None:
        return b is None
    if a.dtype in (torch.float32, torch.float64):
        return same_bits(a, b)
    return torch.equal(a, b)


DTYPES = [torch.float32, torch.float64]
KINDS = ["int8", "int4"] + [k for k in two_stage.FLOAT8 if hasattr(torch, k)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [16, 64, 256, 1000])
@pytest.mark.parametrize("n", [1, 15, 256, 1001, 4099])
@pytest.mark.parametrize("special", [None, "nan", "inf", "-inf", "big"])
def test_quantize_and_dequantize_give_torchs_bits(monkeypatch, kind, dtype, block, n,
                                                  special):
    fmt = WireFormat(kind, block)
    x = _data(n, dtype, n + block, special)
    ref, got = _both(monkeypatch, lambda: two_stage.quantize(x, fmt))
    assert _same(ref[0], got[0]) and _same(ref[1].contiguous(), got[1])
    ref, got = _both(monkeypatch, lambda: two_stage.dequantize(ref[0], n, fmt, dtype))
    assert _same(ref, got)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("block, n", [(16, 1000), (64, 4099), (256, 777), (256, 5)])
@pytest.mark.parametrize("special", [None, "nan", "inf"])
def test_the_whole_reduction_gives_torchs_bits(monkeypatch, kind, dtype, size, block, n,
                                               special):
    _check_reduction(monkeypatch, kind, dtype, size, block, n, special)


def test_the_build_without_cpu_specific_copies_gives_torchs_bits_too(monkeypatch, tmp_path):
    """On x86-64 the kernels also exist in AVX2 copies chosen at load time, which the
    tests above run on a machine that has AVX2; this builds without them."""
    monkeypatch.setattr(native, "FLAGS", native.FLAGS + ["-DPHV_NO_CLONES"])
    monkeypatch.setenv("PIPE_HOROVOD_CACHE", str(tmp_path))
    native.reset()
    try:
        for kind in KINDS:
            for dtype in DTYPES:
                for size, block, n, special in [(3, 16, 1000, None), (2, 64, 4099, "nan"),
                                                (4, 256, 777, "inf")]:
                    _check_reduction(monkeypatch, kind, dtype, size, block, n, special)
            if kind in two_stage.FLOAT8:
                test_float8_rounding_over_a_sweep_of_float32(monkeypatch, kind)
        assert len(list((tmp_path / "native").iterdir())) == 1       # its own build
    finally:
        native.reset()


def _check_reduction(monkeypatch, kind, dtype, size, block, n, special):
    """first_stage on every rank, reduce_shard of every shard (prescale, average,
    postscale, both residuals), decode: the bytes sent and every result the same."""
    fmt, acc = WireFormat(kind, block), dtype
    sizes = two_stage.shard_sizes(n, size)
    xs = [_data(n, dtype, 10 * r + size, special if r == 1 else None) for r in range(size)]
    firsts = [(_data(n, dtype, 99 + r) * 1e-3) for r in range(size)]

    def run(prescale, postscale, average, feedback):
        first = [f.clone() for f in firsts] if feedback else [None] * size
        sends = [two_stage.first_stage(x, sizes, fmt, f) for x, f in zip(xs, first)]
        wires, seconds = [], []
        for s, m in enumerate(sizes):
            received = torch.cat([send[sum(splits[:s]):sum(splits[:s + 1])]
                                  for send, splits in sends])
            second = (_data(m, dtype, 7 + s) * 1e-3) if feedback else None
            wires.append(two_stage.reduce_shard(received, size, m, fmt, acc, average,
                                                prescale, postscale, second))
            seconds.append(second)
        out = torch.empty(n, dtype=dtype)
        two_stage.decode(torch.cat(wires), sizes, fmt, out)
        return [s for s, _ in sends], first, wires, seconds, out

    for args in [(1.0, 1.0, True, True), (0.1, 3.0, True, False), (1.0, 1 / 3, False, True),
                 (0.7, 1.0, False, False)]:
        ref, got = _both(monkeypatch, lambda: run(*args))
        for what, a, b in zip(("sent", "first residual", "wire", "second residual", "out"),
                              ref, got):
            if isinstance(a, list):
                assert all(_same(u, v) for u, v in zip(a, b)), (what, args)
            else:
                assert _same(a, b), (what, args)


@pytest.mark.parametrize("kind", [k for k in KINDS if k in two_stage.FLOAT8])
def test_float8_rounding_over_a_sweep_of_float32(monkeypatch, kind):
    """Bit patterns spread over the whole range, each block led by the format's
    largest value so that the scale is 1 and every value is converted as it is (an
    exhaustive run over every float32 in range was done once: docs/compression.md)."""
    qmax = torch.finfo(getattr(torch, kind)).max
    top = torch.tensor([qmax], dtype=torch.float32).view(torch.int32).item()
    bits = torch.arange(0, top, 997, dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)
    x = torch.cat([x, -x])
    x[::1024] = qmax
    fmt = WireFormat(kind, 1024)
    ref, got = _both(monkeypatch, lambda: two_stage.quantize(x, fmt))
    assert ref[0][:4 * fmt.blocks(x.numel())].view(torch.float32).eq(1).all()
    assert _same(ref[0], got[0]) and _same(ref[1].contiguous(), got[1])


def test_float16_buckets_take_the_kernels_through_float32(monkeypatch):
    fmt = WireFormat("int8", 64)
    x = _data(3001, torch.float32, 5).clamp(-6e4, 6e4).half()
    res = torch.randn(3001) * 1e-3
    ref, got = _both(monkeypatch, lambda: (two_stage.first_stage(x, [1501, 1500], fmt,
                                                                 r := res.clone())[0], r))
    assert _same(ref, got)
    out_ref, out_got = torch.empty(3001).half(), torch.empty(3001).half()
    _torch_only(monkeypatch)
    two_stage.decode(ref[0], [1501, 1500], fmt, out_ref)
    _native(monkeypatch)
    two_stage.decode(ref[0], [1501, 1500], fmt, out_got)
    assert torch.equal(out_ref.view(torch.int16), out_got.view(torch.int16))


def _assert_the_torch_form_runs():
    """No kernels are offered, and quantize gives the torch form's bits."""
    fmt = WireFormat("int8", 64)
    x = _data(1000, torch.float32, 1)
    assert two_stage._kernels(fmt, x) is None
    wire, back = two_stage.quantize(x, fmt)
    ref_wire, ref_back = two_stage._quantize_torch(x, fmt)
    assert torch.equal(wire, ref_wire) and same_bits(back, ref_back)


def test_without_a_compiler_the_torch_form_runs(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("PIPE_HOROVOD_CACHE", str(tmp_path))
    native.reset()
    try:
        with caplog.at_level(logging.INFO, logger=native.__name__):
            assert native.library() is None
        assert "unavailable" in caplog.text
        _assert_the_torch_form_runs()
    finally:
        native.reset()                            # the next test loads the real cache


def test_a_fresh_cache_compiles_once_and_the_switch_turns_it_off(monkeypatch, tmp_path):
    import os
    import time

    monkeypatch.setenv("PIPE_HOROVOD_CACHE", str(tmp_path))
    cache = tmp_path / "native"
    cache.mkdir()
    # What earlier releases and a killed build left: unused for longer than STALE_DAYS,
    # a temporary over an hour old (removed), one library used lately and a build
    # still under way (kept).
    ages = {"cpu_kernels-old.so": (native.STALE_DAYS + 1) * 86400, ".cpu_kernels-x.so": 7200,
            "cpu_kernels-recent.so": (native.STALE_DAYS - 1) * 86400, ".cpu_kernels-y.so": 60}
    for name, age in ages.items():
        (cache / name).write_bytes(b"")
        os.utime(cache / name, (time.time() - age,) * 2)
    native.reset()
    try:
        assert native.library() is not None
        built = [p.name for p in cache.iterdir() if p.name not in ages]
        assert len(built) == 1 and built[0].startswith("cpu_kernels-")   # no temporary left
        assert sorted(p.name for p in cache.iterdir()) == sorted(
            [*built, "cpu_kernels-recent.so", ".cpu_kernels-y.so"])
        # Loading a cached library marks it used, so no later build removes it.
        os.utime(cache / built[0], (time.time() - 2 * native.STALE_DAYS * 86400,) * 2)
        native.reset()
        assert native.library() is not None
        assert time.time() - (cache / built[0]).stat().st_mtime < 3600
        monkeypatch.setenv(native.ENV, "0")
        assert native.library() is None
        assert two_stage._kernels(WireFormat("int8"), torch.zeros(4)) is None
    finally:
        native.reset()


def test_ranks_compiling_at_once_leave_one_library(tmp_path):
    """Three processes with an empty cache: each compiles to a private temporary
    file and renames it into place; all load it, and nothing else is left."""
    import os
    import subprocess
    import sys

    code = ("from pipe_horovod.compression import native, two_stage\n"
            "import torch\n"
            "assert native.library() is not None\n"
            "assert two_stage._kernels(two_stage.WireFormat('int8'), torch.zeros(4))\n")
    env = {**os.environ, "PIPE_HOROVOD_CACHE": str(tmp_path)}
    env.pop(native.ENV, None)
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env) for _ in range(3)]
    assert [p.wait(timeout=500) for p in procs] == [0, 0, 0]
    left = sorted(p.name for p in (tmp_path / "native").iterdir())
    assert len(left) == 1 and left[0].startswith("cpu_kernels-") and left[0].endswith(".so")


def test_cuda_and_other_formats_keep_the_torch_form():
    x = torch.zeros(10)
    assert two_stage._kernels(WireFormat("float16"), x) is None
    assert two_stage._kernels(WireFormat("bfloat16"), x) is None
    assert two_stage._kernels(WireFormat("int8"), x.half()) is None
    assert two_stage._kernels(WireFormat("int8"), torch.zeros(10, 2).t()) is None
    for kind in KINDS:                            # so the comparisons above test the kernels
        for dtype in DTYPES:
            assert two_stage._kernels(WireFormat(kind), x.to(dtype)) is not None


def _no_compiler(monkeypatch, tmp_path):
    """Compiling fails from here on: $CC names nothing and PATH holds no cc, gcc, clang."""
    empty = tmp_path / "empty-path"
    empty.mkdir(exist_ok=True)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setenv("PIPE_HOROVOD_CACHE", str(tmp_path / "cache"))


def test_a_library_built_by_the_cli_loads_from_the_variable_without_a_compiler(
        monkeypatch, tmp_path):
    """The Docker image's way: `python -m pipe_horovod.compression.native OUT.so` where
    there is a compiler, PIPE_HOROVOD_NATIVE_LIBRARY=OUT.so where there is none."""
    import subprocess
    import sys

    out = tmp_path / "lib" / "cpu_kernels.so"
    res = subprocess.run([sys.executable, "-m", "pipe_horovod.compression.native", str(out)],
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0 and out.is_file(), res.stderr
    assert str(out) in res.stdout
    assert sorted(p.name for p in out.parent.iterdir()) == ["cpu_kernels.so"]  # no temporary
    _no_compiler(monkeypatch, tmp_path)
    monkeypatch.setenv(native.LIBRARY_ENV, str(out))
    native.reset()
    try:
        assert native.library() is not None
        assert native.status() == f"native kernels ({out})"
        assert not (tmp_path / "cache").exists()                     # nothing compiled
        for kind in KINDS:
            fmt = WireFormat(kind, 64)
            x = _data(1001, torch.float32, 3, "nan")
            assert two_stage._kernels(fmt, x) is not None
            ref, got = _both(monkeypatch, lambda: two_stage.quantize(x, fmt))
            assert _same(ref[0], got[0]) and _same(ref[1].contiguous(), got[1])
        _check_reduction(monkeypatch, "int8", torch.float32, 3, 64, 1000, None)
    finally:
        native.reset()


@pytest.mark.parametrize("bad", ["garbage", "missing"])
def test_a_prebuilt_library_that_does_not_load_leaves_the_torch_form(monkeypatch, tmp_path,
                                                                     caplog, bad):
    path = tmp_path / "cpu_kernels.so"
    if bad == "garbage":
        path.write_bytes(b"not an ELF file\n" * 64)
    _no_compiler(monkeypatch, tmp_path)
    monkeypatch.setenv(native.LIBRARY_ENV, str(path))
    native.reset()
    try:
        with caplog.at_level(logging.INFO, logger=native.__name__):
            assert native.library() is None
        assert "unavailable" in caplog.text and native.LIBRARY_ENV in caplog.text
        assert native.status().startswith(f"torch form ({native.LIBRARY_ENV}={path}")
        _assert_the_torch_form_runs()
    finally:
        native.reset()


def test_the_cli_says_in_one_line_when_it_cannot_build(tmp_path):
    import os
    import subprocess
    import sys

    out = tmp_path / "cpu_kernels.so"
    res = subprocess.run([sys.executable, "-m", "pipe_horovod.compression.native", str(out)],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "CC": str(tmp_path / "no-such-cc")})
    assert res.returncode == 1 and res.stderr.startswith("error: ") and "Traceback" not in res.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []
