"""The per-hop codecs as the benchmark and the planner see them: their names,
wire bytes per gradient byte, and their measured CPU cost on this machine.

The codecs themselves (pipe_horovod.compression.hops) are runtime; what is
here only measures and predicts them, so it lives with the tooling (and
compression/hops.py imports nothing above itself). torch and the runtime are
imported where a function needs them.
"""


# Per-hop codecs as the benchmark and the planner name them: (the Compression a user
# trains with, wire bytes per float32 byte before the block scales).
PER_HOP = {"bf16hop": ("bf16", 0.5), "int8": ("int8_ef", 0.25), "int4": ("int4_ef", 0.125)}


def wire_ratio(name):
    """Bytes on the wire per float32 gradient byte of a per-hop codec run by ring, which
    cuts messages into blocks of at most PIECE_BYTES: int8 and int4 add one scale per block."""
    from pipe_horovod.collectives.layout import PIECE_BYTES
    from pipe_horovod.compression import SCALE_BYTES

    codec, ratio = PER_HOP[name]
    return ratio + (SCALE_BYTES / PIECE_BYTES if codec.startswith("int") else 0.0)


def measure_costs(hop, numel=1 << 18, seconds=0.02, span_bytes=32 << 20):
    """(encode, decode-add, decode) seconds per accumulator (float32) byte of `hop` on this
    machine, for blocks of `numel` elements: the collectives' codec works block by block
    (collectives/layout.py: LP's chunks, ring's pieces, BE's halves), and a block's cost
    is not proportional to its size (a fixed per-call overhead of ~10 torch calls below
    64 KB; caches: 1 MB blocks stay in L2, 16 MB ones go to memory at 2-4x the cost per
    byte). Each step runs back to back for at least `seconds`, the mean taken, on blocks
    walking through `span_bytes` of memory, so they come cold from memory as in a
    collective (a hot, repeated block measured 3-7x below the codec time inside a
    4-worker collective). Run by every worker at once (the benchmark does), it includes
    their contention for the cores. pipe_horovod.pipeline.timing_model.hop_codec_time's calibration."""
    import time

    import torch

    count = max(1, span_bytes // (numel * 4))
    src = torch.randn(count * numel, generator=torch.Generator().manual_seed(0))
    dst, scratch = torch.zeros(count * numel), torch.empty(numel)
    wire_numel = hop.wire_numel(numel)
    wire = torch.empty(count * wire_numel, dtype=hop.wire_dtype)

    def block(i):
        j = i % count
        return (src[j * numel:(j + 1) * numel], dst[j * numel:(j + 1) * numel],
                wire[j * wire_numel:(j + 1) * wire_numel])

    steps = (lambda s, d, w: hop.encode(s, w, scratch), lambda s, d, w: hop.decode_add(w, d),
             lambda s, d, w: hop.decode_into(w, d))
    for i in range(count):                        # every block encoded once, pages touched
        steps[0](*block(i))
    costs = []
    for step in steps:
        calls, t0 = 0, time.perf_counter()
        while calls < 3 or time.perf_counter() - t0 < seconds:
            step(*block(calls))
            calls += 1
        costs.append((time.perf_counter() - t0) / calls / (numel * src.element_size()))
    return tuple(costs)
