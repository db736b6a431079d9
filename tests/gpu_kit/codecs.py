"""The GPU kit's codec step: the two-stage formats and the per-hop codecs on DEVICE,
bit for bit against the CPU reference, and their throughput.

The reference is the torch form on CPU (PIPE_HOROVOD_NATIVE_CODEC=0, the form
tests/test_native_codec.py holds the C kernels to). On a GPU every function of
compression/two_stage.py and compression/hops.py runs in that same torch form on CUDA
tensors, so any difference is CUDA's arithmetic or a step that leaves the device; on
CPU (the rehearsal, --device cpu) the C kernels run against it, and the per-hop codecs'
device form (the sync-free one CUDA runs, hops.DEVICE_FORM_ON_CPU) against their CPU form.

A reduction over RANKS simulated ranks runs both stages twice (so the error feedback's
residuals are used once), and every intermediate is compared: each rank's send buffer
and first residual, each shard's reduced wire and second residual, the decoded result.
Prints `CODECS <json>` and exits 1 on a mismatch.

    python tests/gpu_kit/codecs.py --device cuda
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

from pipe_horovod.compression import hops, native, two_stage
from pipe_horovod.compression.hops import CastHop, Int4Hop, Int8Hop
from pipe_horovod.compression.two_stage import WireFormat

RANKS = 4
SIZES = (1, 255, 4099, 2 ** 18 + 7)
KINDS = [k for k in two_stage.FORMATS if k not in two_stage.FLOAT8 or hasattr(torch, k)]


def data(n, seed):
    """Values over many magnitudes, with .5 ties, zeros and -0 (as test_native_codec)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    x *= torch.exp2(torch.randint(-20, 20, (n,), generator=g).double())
    x = x.float()
    if n >= 100:
        x[:40] = torch.arange(-20, 20, dtype=torch.float32) / 2 * 2.0 ** -5 * 127 / 10
        x[40:60] = 0.0
        x[60:64] = -0.0
    return x


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same(a, b, fmt=None):
    """The same bits, but for a NaN's payload, which is the hardware's: inf - inf, where
    a 16-bit cast overflowed, is 0xffc00000 on x86 and 0x7fffffff on CUDA, and either
    is the same NaN to every later step. An unscaled format's wire is compared as its
    values."""
    a, b = a.cpu(), b.cpu()
    if fmt is not None and a.dtype == torch.uint8 and not fmt.scaled:
        a, b = a.view(fmt.dtype), b.view(fmt.dtype)
    if not a.is_floating_point():
        return torch.equal(a, b)
    nan = a.isnan()
    if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(nan, b.isnan()):
        return False
    bits = _BITS[a.element_size()]
    return torch.equal(a[~nan].view(bits), b[~nan].view(bits))


def two_stage_reduction(flats, fmt, device, rounds=2):
    """Every intermediate of `rounds` averaged two-stage reductions of `flats` (one per
    simulated rank), computed on `device`."""
    numel = flats[0].numel()
    sizes = two_stage.shard_sizes(numel, RANKS)
    first = [torch.zeros(numel, device=device) for _ in range(RANKS)]
    second = [torch.zeros(sizes[r], device=device) for r in range(RANKS)]
    seen = {}
    for rnd in range(rounds):
        sends = [two_stage.first_stage(f.to(device), sizes, fmt, first[r])
                 for r, f in enumerate(flats)]
        wires = []
        for s in range(RANKS):                       # the alltoall: shard s of every rank
            parts = []
            for send, splits in sends:
                at = sum(splits[:s])
                parts.append(send[at:at + splits[s]])
            wires.append(two_stage.reduce_shard(torch.cat(parts), RANKS, sizes[s], fmt,
                                                torch.float32, True, residual=second[s]))
        out = torch.empty(numel, device=device)
        two_stage.decode(torch.cat(wires), sizes, fmt, out)
        for r in range(RANKS):
            seen[f"round {rnd} rank {r} send"] = sends[r][0]
            seen[f"round {rnd} rank {r} first residual"] = first[r].clone()
            seen[f"round {rnd} shard {r} wire"] = wires[r]
            seen[f"round {rnd} shard {r} second residual"] = second[r].clone()
        seen[f"round {rnd} result"] = out
    return seen


def per_hop(codec, x, device):
    """One hop's encode (with residual), decode_add of `x` into a running sum and
    decode_into."""
    x = x.to(device)
    # zeros: the padding after a block's values is never written, and must compare equal
    wire = torch.zeros(codec.wire_numel(x.numel()), dtype=getattr(codec, "wire_dtype", None)
                       or torch.uint8, device=device)
    scratch, residual = torch.empty_like(x), torch.empty_like(x)
    codec.encode(x, wire, scratch, residual)
    total = torch.ones_like(x)
    codec.decode_add(wire, total)
    into = torch.full_like(x, 9.0)
    codec.decode_into(wire, into)
    return {"wire": wire, "residual": residual, "sum": total, "decoded": into}


def hop_codecs():
    return {"int8": Int8Hop(), "int4": Int4Hop(), "float16": CastHop(torch.float16),
            "bfloat16": CastHop(torch.bfloat16)}


def cpu_reference(fn):
    """fn() with the C kernels off: the torch form on CPU."""
    saved = os.environ.get(native.ENV)
    os.environ[native.ENV] = "0"
    try:
        return fn()
    finally:
        if saved is None:
            del os.environ[native.ENV]
        else:
            os.environ[native.ENV] = saved


def device_form(fn):
    """fn() with the per-hop codecs in their device form, also on CPU tensors (on CUDA
    they take it anyway)."""
    saved, hops.DEVICE_FORM_ON_CPU = hops.DEVICE_FORM_ON_CPU, True
    try:
        return fn()
    finally:
        hops.DEVICE_FORM_ON_CPU = saved


def timed(fn, device, reps):
    """Median seconds of fn() (two warm-ups), waiting for the device each time."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for rep in range(reps + 2):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if rep >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def throughput(device, mib, reps):
    """GB/s (float32 input bytes per second) of each stage on one `mib` MiB tensor, as one
    rank of two runs them: the first stage (quantize + residual), the second (sum of two
    copies of a shard, requantize + residual), the decode of the gathered result."""
    numel = mib * 2 ** 20 // 4
    x = data(numel, 7).to(device)
    out = {}
    for kind in KINDS:
        fmt = WireFormat(kind)
        sizes = two_stage.shard_sizes(numel, 2)
        residual = torch.zeros(numel, device=device)
        send, splits = two_stage.first_stage(x, sizes, fmt, residual)
        received = torch.cat([send[:splits[0]], send[:splits[0]]])
        second = torch.zeros(sizes[0], device=device)
        wire = two_stage.reduce_shard(received, 2, sizes[0], fmt, torch.float32, True,
                                      residual=second)
        gathered = torch.cat([wire, wire]) if sizes[0] == sizes[1] else None
        result = torch.empty(numel, device=device)
        stages = {
            "first stage": (lambda: two_stage.first_stage(x, sizes, fmt, residual), numel),
            "second stage": (lambda: two_stage.reduce_shard(
                received, 2, sizes[0], fmt, torch.float32, True, residual=second), sizes[0]),
        }
        if gathered is not None:
            stages["decode"] = (lambda: two_stage.decode(gathered, sizes, fmt, result), numel)
        out[kind] = {name: round(n * 4 / timed(fn, device, reps) / 1e9, 2)
                     for name, (fn, n) in stages.items()}
    # Per hop: one call per 4 MiB chunk, as a ring piece (collectives/layout.PIECE_BYTES of
    # int8 wire) is encoded, so launches and host syncs count as they do in a collective.
    # On CPU the device form (what CUDA runs) is timed beside the CPU form.
    forms = [("", lambda fn: fn())] + ([(" device form", device_form)]
                                       if device.type == "cpu" else [])
    for name, codec in hop_codecs().items():
        piece = x[:2 ** 20]
        wire = torch.empty(codec.wire_numel(piece.numel()), dtype=getattr(
            codec, "wire_dtype", None) or torch.uint8, device=device)
        scratch, residual = torch.empty_like(piece), torch.empty_like(piece)
        for suffix, form in forms:
            if suffix and isinstance(codec, CastHop):
                continue                              # one form only
            calls = {"encode": lambda: codec.encode(piece, wire, scratch, residual),
                     "decode_add": lambda: codec.decode_add(wire, scratch),
                     "decode_into": lambda: codec.decode_into(wire, scratch)}
            out[f"per hop {name}{suffix}"] = {
                call: round(piece.numel() * 4 / form(lambda: timed(fn, device, reps)) / 1e9, 2)
                for call, fn in calls.items()}
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--mib", type=int, default=64, help="throughput's tensor, MiB")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(1)            # the CPU side as one rank's thread runs it
    mismatches, compared = [], 0
    for kind in KINDS:
        for n in SIZES:
            flats = [data(n, 100 * r + n) for r in range(RANKS)]
            fmt = WireFormat(kind)
            ref = cpu_reference(lambda: two_stage_reduction(flats, fmt, torch.device("cpu")))
            got = two_stage_reduction(flats, fmt, device)
            for key, value in ref.items():
                compared += 1
                if not same(got[key], value, fmt):
                    mismatches.append(f"two-stage {kind} n={n}: {key}")
    for name, codec in hop_codecs().items():
        for n in SIZES:
            x = data(n, n)
            ref = cpu_reference(lambda: per_hop(codec, x, torch.device("cpu")))
            got = device_form(lambda: per_hop(codec, x, device))
            for key, value in ref.items():
                compared += 1
                if not same(got[key], value):
                    mismatches.append(f"per hop {name} n={n}: {key}")
    result = {"device": str(device), "kinds": KINDS, "sizes": SIZES, "ranks": RANKS,
              "compared": compared, "mismatches": mismatches,
              "native": native.status() if device.type == "cpu" else "torch form on CUDA",
              "gbps": throughput(device, args.mib, args.reps), "mib": args.mib}
    print("CODECS " + json.dumps(result), flush=True)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
