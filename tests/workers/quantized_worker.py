"""collectives_worker.py's quantized cases, on N ranks (or one plain process): the
two-stage quantized allreduce, on the engine's own collectives and point to point,
against a single-process reference, bit for bit.

The reference below (`reference_two_stage`) runs every rank's part of the same math in
one process, without communication: the same chunks (two_stage.chunks) and shards, the same
quantize/dequantize of each shard, the sum in rank order in the accumulator's type,
and both residuals per rank. It is exact by construction, so every comparison is
`torch.equal` (no tolerance): outputs on every rank and every rank's residuals.

Then training with the wrapped optimizer (int8_ef, no collective=: point to point, the
buckets being on the CPU) at pipeline depth
1, 2 and 3, plain Pipe-SGD and the default compensation, against tests/oracle.py whose
average is replaced by the reference (the bucket layouts each step used are logged
from the step machine), and a checkpoint mid-pipeline that resumes bit-exactly.
"""
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import oracle  # noqa: E402
import pipe_horovod.torch as phvd  # noqa: E402
from pipe_horovod import engine  # noqa: E402
from pipe_horovod.collectives import quantized  # noqa: E402
from pipe_horovod.compression import Compression, accumulator, two_stage  # noqa: E402
from pipe_horovod.compression import wire_format  # noqa: E402
from pipe_horovod.compression.two_stage import WireFormat, dequantize, quantize  # noqa: E402
from pipe_horovod.pipeline import step_machine  # noqa: E402
from tolerance import THREADS  # noqa: E402

torch.set_num_threads(THREADS)
failures = []


def reference_two_stage(xs, fmt, average=True, prescale=1.0, postscale=1.0, first=None,
                        second=None):
    """Every rank's result (the same on all) of the two-stage reduction of `xs` (one flat
    tensor per rank); `first`/`second`: per-rank residuals, updated in place (`second[s]`
    of the tensor's size, rank s's own shard in its range). Chunk by chunk, as the
    engine path runs (two_stage.chunks: range s of a chunk is reduced by rank s)."""
    p, n, dtype = len(xs), xs[0].numel(), xs[0].dtype
    acc = accumulator(dtype)
    if p == 1:
        factor = prescale * postscale
        return xs[0].clone() if factor == 1 else (xs[0].to(acc) * factor).to(dtype)
    vs = [xs[r].to(acc) + (first[r] if first is not None else 0) for r in range(p)]
    out = torch.empty(n, dtype=acc)
    for ranges in two_stage.chunks(n, p, fmt):
        sent = []                               # sent[r][s]: rank r's range s, as decoded
        for r in range(p):
            parts = [dequantize(quantize(vs[r][a:a + m].clone(), fmt)[0], m, fmt, acc)
                     for a, m in ranges]
            sent.append(parts)
            if first is not None:
                for (a, m), part in zip(ranges, parts):
                    first[r][a:a + m] = vs[r][a:a + m] - part
        for s, (a, m) in enumerate(ranges):
            total = None
            for r in range(p):
                value = sent[r][s] * prescale if prescale != 1 else sent[r][s]
                total = value.clone() if total is None else total + value
            if average:
                total = total / p
            if postscale != 1:
                total = total * postscale
            if second is not None:
                total = total + second[s][a:a + m]
            back = dequantize(quantize(total.clone(), fmt)[0], m, fmt, acc)
            if second is not None:
                second[s][a:a + m] = total - back
            out[a:a + m] = back
    return out.to(dtype)


def inputs(p, numel, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(numel, generator=g, dtype=torch.float64) * (1 + r) for r in range(p)]
    for x in xs:                                # a large value, and a zero block
        if numel > 40:
            x[3] = 50.0
            x[-17:] = 0
    return [x.to(dtype) for x in xs]


def formats():
    kinds = ["int8", "int4", "float16", "bfloat16"] + [k for k in two_stage.FLOAT8
                                                       if hasattr(torch, k)]
    return [WireFormat(k) for k in kinds] + [WireFormat("int8", 16)]


def allreduce_cases(r, p):
    """Formats x dtypes x sizes x ops, scaling, several in flight, residuals over steps,
    on both transports (the engine's collectives, point to point)."""
    seed = 0
    for transport in quantized.TRANSPORTS:
        seed = transport_cases(r, p, transport, seed)
    uneven_sizes(r, p)


def transport_cases(r, p, transport, seed):
    eng = engine.current()
    sizes = sorted({1, max(1, p - 1), 7, 300, 1001, 4099})
    for fmt in formats():
        # int8/256 (the default) every dtype, size and op; the other formats float32,
        # the odd sizes, Sum and Average in turn (suite time: each case is a negotiation).
        default = fmt.describe() == "int8/256"
        for dtype in (torch.float32, torch.float64, torch.float16) if default else (
                torch.float32,):
            handles = []
            for numel in sizes if default else sizes[1::2]:
                for average in (True, False) if default else (numel % 2 == 1,):
                    seed += 1
                    xs = inputs(p, numel, dtype, seed)
                    mine = xs[r].clone()
                    op = engine.Average if average else engine.Sum
                    handles.append((quantized.allreduce_async(mine, f"q.{seed}", op, fmt=fmt,
                                                              transport=transport),
                                    mine, reference_two_stage(xs, fmt, average),
                                    f"{transport} {fmt.describe()} {dtype} n={numel} {op}"))
            for handle, mine, want, what in reversed(handles):   # waited out of order
                got = eng.wait(handle)
                if got is not mine or not torch.equal(got, want):
                    failures.append(f"allreduce {what}: differs from the reference "
                                    f"(max diff {(got.double() - want.double()).abs().max():.3g})")
    # Scaling (gradient_predivide_factor's split) and unnamed handles.
    fmt = WireFormat("int8")
    xs = inputs(p, 1001, torch.float32, 999)
    mine = xs[r].clone()
    got = eng.wait(quantized.allreduce_async(mine, None, engine.Average, fmt=fmt,
                                             prescale_factor=0.25, postscale_factor=4.0,
                                             transport=transport))
    if not torch.equal(got, reference_two_stage(xs, fmt, True, 0.25, 4.0)):
        failures.append(f"{transport}: allreduce with prescale/postscale differs from the "
                        "reference")
    if transport == "engine":
        # Horovod's functional allreduce with an int8 codec: the same two stages.
        xs = inputs(p, 1001, torch.float32, 998)
        got = phvd.allreduce(xs[r], name="functional", compression=Compression.int8_ef)
        if not torch.equal(got, reference_two_stage(xs, WireFormat("int8"))):
            failures.append("hvd.allreduce(compression=int8_ef) differs from the reference")
    # Error feedback over steps, both residuals, every rank's own.
    for fmt in (WireFormat("int8"), WireFormat("int8", 64), WireFormat("int4", 64),
                WireFormat("bfloat16")):
        for dtype in (torch.float32, torch.float64):
            n = 1003
            acc = accumulator(dtype)
            ref_first = [torch.zeros(n, dtype=acc) for _ in range(p)]
            ref_second = [torch.zeros(n, dtype=acc) for _ in range(p)]
            start, own = two_stage.own_shard(n, p, r)
            first, second = torch.zeros(n, dtype=acc), torch.zeros(own, dtype=acc)
            for step in range(3):
                seed += 1
                xs = inputs(p, n, dtype, seed)
                mine = xs[r].clone()
                got = eng.wait(quantized.allreduce_async(mine, f"ef.{seed}", fmt=fmt,
                                                         residuals=(first, second),
                                                         transport=transport))
                want = reference_two_stage(xs, fmt, True, first=ref_first, second=ref_second)
                what = f"{transport}: error feedback {fmt.describe()} {dtype} step {step}"
                if not torch.equal(got, want):
                    failures.append(f"{what}: result differs from the reference")
                if not (torch.equal(first, ref_first[r])
                        and torch.equal(second, ref_second[r][start:start + own])):
                    failures.append(f"{what}: residuals differ from the reference")
                if p > 1 and not (first.any() and second.any()):
                    failures.append(f"{what}: a residual stayed zero")
    return seed


def uneven_sizes(r, p):
    """A size that differs across ranks: an error on every rank, not a hang.

    Point to point, the communicator's agreement check compares every rank's size
    before a byte moves: a ValueError naming each rank's (collectives/agreement.py: a
    size one rank used before stops at the timeout instead). On the engine's collectives
    (the torch engine) an EngineError on every rank when a chunk's wire sizes differ (the
    negotiated records show every rank's; here, from 2 to 4 ranks, the same chunk count
    on every rank and the sizes of the second chunk or the only one differ; a rank with
    more chunks than the others would leave its extra alltoall unmatched). Sizes a few
    elements apart can give the same bytes (values padded to 4) and are not detected
    there; Horovod's alltoall shows each rank only what it received, so there only the
    ranks that received unexpected sizes raise, as in Horovod's bf16 path."""
    eng = engine.current()
    if p == 1:
        return
    try:         # sizes no rank used before (a verified one would meet a timeout instead)
        eng.wait(quantized.allreduce_async(torch.ones(2001 + 4 * r), "uneven.p2p",
                                           fmt=WireFormat("int8"), transport="p2p"))
        failures.append("p2p: sizes that differ across ranks were reduced without an error")
    except ValueError as exc:
        listed = ", ".join(f"rank {i} {2001 + 4 * i}" for i in range(p))
        if f"disagree on numel: {listed}" not in str(exc):
            failures.append(f"p2p: sizes that differ across ranks: unclear error {exc}")
    if eng.name == "torch":
        try:
            eng.wait(quantized.allreduce_async(torch.ones(1001 + 4 * r), "uneven",
                                               fmt=WireFormat("int8")))
            failures.append("sizes that differ across ranks were reduced without an error")
        except engine.EngineError as exc:
            if "differs across ranks" not in str(exc):
                failures.append(f"sizes that differ across ranks: unclear error {exc}")


def process_set_case(r, p):
    """Ranks 0 and 2 of 3 or more reduce on their own process set (shards, residuals and
    Average follow the set, not the world), on the engine, then point to point."""
    eng = engine.current()
    ps = eng.add_process_set([0, 2])             # collective: every rank
    if r in ps.ranks:
        fmt, n, index = WireFormat("int8"), 1001, ps.ranks.index(r)
        start, own = two_stage.own_shard(n, 2, index)
        ref_first, ref_second = [torch.zeros(n) for _ in range(2)], [torch.zeros(n)
                                                                      for _ in range(2)]
        first, second = torch.zeros(n), torch.zeros(own)
        for step in range(2):
            xs = inputs(2, n, torch.float32, 5000 + step)
            mine = xs[index].clone()
            got = eng.wait(quantized.allreduce_async(
                mine, f"set.{step}", fmt=fmt, residuals=(first, second), process_set=ps,
                transport=quantized.TRANSPORTS[step % 2]))
            want = reference_two_stage(xs, fmt, True, first=ref_first, second=ref_second)
            if not (torch.equal(got, want) and torch.equal(first, ref_first[index])
                    and torch.equal(second, ref_second[index][start:start + own])):
                failures.append(f"process set [0, 2], step {step}: differs from the reference")
    eng.barrier()
    eng.remove_process_set(ps)


# --- training ---------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 40), nn.Linear(40, 5)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def data(rank, step):
    g = torch.Generator().manual_seed(10007 * rank + 101 * step)
    return [(torch.randn(6, 8, generator=g), torch.randint(0, 5, (6,), generator=g))
            for _ in range(2)]


LAYOUTS = []      # (step, slot, bucket index, [(name, start, numel)]) of every launch


def _logged_launch(original):
    def launch(self, bucket, fill):
        LAYOUTS.append((self.fifo.steps, self.slot, bucket.index, list(bucket.offsets())))
        return original(self, bucket, fill)
    return launch


def oracle_reduce(model, p, fmt, feedback):
    """oracle.reference's `reduce`: the buckets each step launched, each reduced by the
    reference with per-rank residuals kept by (slot, stage) and parameter name."""
    names = [n for n, q in model.named_parameters() if q.requires_grad]
    index = {n: i for i, n in enumerate(names)}
    residuals = [{} for _ in range(p)]          # rank -> (slot, stage) -> {name: tensor}

    def flat(kept, offsets, total, acc):
        out = torch.zeros(total, dtype=acc)
        for name, start, numel in offsets:
            if name in kept:
                out[start:start + numel] = kept[name]
        return out

    def reduce(t, per_rank):
        layouts = [entry for entry in LAYOUTS if entry[0] == t]
        if not layouts:                         # one rank: nothing was launched
            return [oracle.average(gs, p) for gs in zip(*per_rank)]
        out = [None] * len(names)
        for _, slot, _, offsets in layouts:
            xs = [torch.cat([per_rank[r][index[n]].reshape(-1) for n, _, _ in offsets])
                  for r in range(p)]
            total, acc = xs[0].numel(), accumulator(xs[0].dtype)
            res = None
            if feedback:
                res = [[flat(residuals[r].get((slot, stage), {}), offsets, total, acc)
                        for r in range(p)] for stage in (1, 2)]
            reduced = reference_two_stage(xs, fmt, True, first=res and res[0],
                                          second=res and res[1])
            for name, start, numel in offsets:
                out[index[name]] = reduced[start:start + numel].view_as(per_rank[0][index[name]])
                if feedback:
                    for stage in (1, 2):
                        for r in range(p):
                            residuals[r].setdefault((slot, stage), {})[name] = \
                                res[stage - 1][r][start:start + numel].clone()
        for i, gs in enumerate(zip(*per_rank)):  # sparse gradients: allgathered, exact
            if out[i] is None:
                out[i] = oracle.average(gs, p)
        return out
    return reduce


def wrap(model, **kw):
    return phvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                     named_parameters=model.named_parameters(),
                                     backward_passes_per_step=2, bucket_cap_mb=0.0006,
                                     **kw)   # two micro-batches a step; a few buckets


def train(model, opt, start, stop):
    for t in range(start, stop):
        opt.zero_grad()
        for x, y in data(phvd.rank(), t):
            F.cross_entropy(model(x), y).backward()
        opt.step()


def training_matches_oracle(p, steps=8):
    for depth in (1, 2, 3):
        for compensation in (None, "lookahead"):
            if depth == 1 and compensation is not None:
                continue
            default = depth == 2 and compensation == "lookahead"
            for codec in (Compression.int8_ef, Compression.int8) + (
                    (Compression.int4_ef,) if default else ()):
                trains_as_the_oracle(p, steps, depth, codec, compensation=compensation)
    # prediction_exchange: every rank predicts from the two-stage average of the buckets
    # (the same layout as the step's reductions), at K=2 and 3, beside a codec too.
    for depth, codec, exchange in ((2, Compression.none, "int4"), (2, Compression.int8_ef, "int4"),
                                   (3, Compression.none, "int8")):
        trains_as_the_oracle(p, steps, depth, codec, prediction_exchange=exchange)


def trains_as_the_oracle(p, steps, depth, codec, compensation="lookahead",
                         prediction_exchange=None):
    """`steps` steps of the MLP with `codec` against oracle.reference, bit for bit."""
    what = f"training {codec.name} K={depth} {compensation}" + (
        f" prediction_exchange={prediction_exchange}" if prediction_exchange else "")
    torch.manual_seed(0)
    model, ref = MLP(), MLP()
    ref.load_state_dict(model.state_dict())
    LAYOUTS.clear()
    opt = wrap(model, compression=codec, pipeline_depth=depth,
               staleness_compensation=compensation, prediction_exchange=prediction_exchange)
    train(model, opt, 0, steps)
    opt.flush()
    if p > 1 and len({entry[2] for entry in LAYOUTS}) < 2:
        failures.append(f"{what}: expected several buckets, launched {LAYOUTS[:3]}")
    fmt = wire_format(codec)
    predict_from = None
    if prediction_exchange is not None:
        exchanged = oracle_reduce(ref, p, WireFormat(prediction_exchange), False)
        predict_from = lambda t, per_rank: [exchanged(t, per_rank)] * p  # noqa: E731
    oracle.reference(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9),
                     F.cross_entropy, data, p, steps, depth, 0, compensation=compensation,
                     reduce=None if fmt is None else oracle_reduce(ref, p, fmt,
                                                                   codec.error_feedback),
                     predict_from=predict_from)
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        if not torch.equal(a, b):
            failures.append(f"{what}: {name} differs from the oracle by "
                            f"{(a - b).abs().max():.3g}")


class Bag(nn.Module):
    """A sparse embedding (its gradients are allgathered, not quantized) and dense layers."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 6, sparse=True)
        self.fc1, self.fc2 = nn.Linear(6, 40), nn.Linear(40, 3)

    def forward(self, ids):
        return self.fc2(torch.tanh(self.fc1(self.emb(ids).mean(1))))


def bag_data(rank, step):
    g = torch.Generator().manual_seed(31 * rank + step)
    return [(torch.randint(0, 30, (5, 3), generator=g), torch.randint(0, 3, (5,), generator=g))
            for _ in range(2)]


def sparse_beside_quantized_buckets(p, steps=6):
    """int8_ef on the dense buckets beside a sparse embedding (allgathered, never
    quantized), K=2: it trains, every rank holds the same weights, the embedding is in
    no bucket after the first step. (Not bitwise against the oracle: a sparse gradient's sum over
    micro-batches and ranks rounds in another order there, 1e-7 apart.)"""
    torch.manual_seed(2)
    model = Bag()
    LAYOUTS.clear()
    opt = phvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                    named_parameters=model.named_parameters(),
                                    backward_passes_per_step=2, bucket_cap_mb=0.0006,
                                    compression=Compression.int8_ef, pipeline_depth=2)
    losses = []
    for t in range(steps):
        opt.zero_grad()
        for x, y in bag_data(0, t % 2):          # the same two batches on every rank
            loss = F.cross_entropy(model(x), y)
            loss.backward()
        losses.append(loss.item())
        opt.step()
    opt.flush()
    # (The first step's buckets hold every parameter: sparse ones are known after it.)
    bucketed = {name for entry in LAYOUTS if entry[0] > 0 for name, _, _ in entry[3]}
    if "emb.weight" in bucketed or (p > 1 and not bucketed):
        failures.append(f"sparse + int8_ef: buckets held {sorted(bucketed)}")
    mine = [t.detach().clone() for t in model.parameters()]
    everyone = engine.current().allgather_object(mine)
    if not all(torch.equal(a, b) for theirs in everyone for a, b in zip(theirs, mine)):
        failures.append("sparse + int8_ef: ranks hold different weights")
    if not losses[-1] < losses[1]:
        failures.append(f"sparse + int8_ef: the loss did not fall: {losses}")


def resume_is_exact(p, steps=9, cut=4, options=None):
    """K=2, default compensation, int8_ef: a checkpoint taken with a step in flight
    (and both residuals) resumes bit-exactly; with `options`, those instead (the
    prediction's exchange: the checkpoint carries what the prediction reads)."""
    def fresh():
        torch.manual_seed(1)
        return MLP()

    codec = options is None
    options = options or {"compression": Compression.int8_ef, "pipeline_depth": 2}
    full = fresh()
    opt = wrap(full, **options)
    train(full, opt, 0, steps)
    opt.flush()
    first = fresh()
    opt = wrap(first, **options)
    train(first, opt, 0, cut)
    saved = {"model": {k: v.clone() for k, v in first.state_dict().items()},
             "opt": opt.state_dict()}
    pipe = saved["opt"]["pipe_horovod"]
    fed = pipe["error_feedback"]
    if codec and p > 1 and (len(pipe["in_flight"]) != 1 or sorted(fed) != [-2, -1, 0, 1] or not all(
            any(t.abs().sum() > 0 for t in fed[key].values()) for key in fed)):
        failures.append(f"int8_ef checkpoint: expected a step in flight and residuals of "
                        f"both stages in both slots, got {len(pipe['in_flight'])} in flight "
                        f"and residual keys {sorted(fed)}")
    resumed = fresh()
    resumed.load_state_dict(saved["model"])
    opt = wrap(resumed, **options)
    opt.load_state_dict(saved["opt"])
    train(resumed, opt, cut, steps)
    opt.flush()
    for (name, a), b in zip(full.named_parameters(), resumed.parameters()):
        if not torch.equal(a, b):
            failures.append(f"{options} resume: {name} differs from the uninterrupted run by "
                            f"{(a - b).abs().max():.3g}")


def shutdown_completes_what_is_in_flight(r, p):
    """A reduction started and never waited for, as at the end of a script: shutdown
    completes it, though rank 0 starts it half a second after the others shut down."""
    x = torch.full((1001,), float(r + 1))
    if r == 0:
        time.sleep(0.5)
    quantized.allreduce_async(x, "left.in.flight", fmt=WireFormat("int8"))
    phvd.shutdown()
    mean = (p + 1) / 2
    if not (x - mean).abs().max() <= mean / 127:
        failures.append(f"shutdown: the reduction in flight gave {x[:3]}, not about {mean}")


def check_all(engine_name, scope):
    """Every case of `scope` ("all", or "allreduce" only), then shutdown with a reduction
    in flight (so last in a launch: collectives_worker.py runs it); exits on a failure."""
    eng = phvd.init(engine_name)
    r, p = eng.rank(), eng.size()
    # Chunks from 400 elements on (by default from 1 Mi): the sizes below then run in 1 to
    # 16 chunks, with every format, the residuals, and training and the resume (a bucket
    # in 2 chunks at 2 ranks); the engine path and the reference read the same rule
    # (two_stage.chunks) at each call.
    two_stage.CHUNK_NUMEL = 200
    step_machine.StepMachine._launch = _logged_launch(step_machine.StepMachine._launch)
    allreduce_cases(r, p)
    if p >= 3:
        process_set_case(r, p)
    if scope == "all":
        training_matches_oracle(p)
        sparse_beside_quantized_buckets(p)
        resume_is_exact(p)
        resume_is_exact(p, options={"pipeline_depth": 2, "prediction_exchange": "int4"})
    shutdown_completes_what_is_in_flight(r, p)
    if failures:
        print(f"rank {r}: {len(failures)} failure(s):\n  " + "\n  ".join(failures[:60]),
              flush=True)
        sys.exit(1)
