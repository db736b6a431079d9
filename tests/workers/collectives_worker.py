"""Launched on N ranks: pipe_horovod.collectives against oracles, every case in one run.

Each rank's input is derived from (rank, case), so every rank computes the
exact float64 result alone. Failures are collected and reported together;
the last line checks that every rank saw the same bytes for every case.

Error bounds (elementwise, S = sum over ranks of |x_i|, f = 1/p for Average
else 1, u = unit roundoff of the wire type: float64 2^-53, float32 2^-24,
float16 2^-11, bfloat16 2^-8): a value is encoded at most p times on its
way (partial sums, then the final value), each time losing at most u*S for
a cast and M/254 for int8, M/14 for int4 (M: the largest S of the message), so
|result - exact| <= f*p*(E + 2^-23*S) + 2*u_out*|exact|, with u_out the
output dtype's roundoff. Against the engine's own allreduce: twice that.
"""
import hashlib
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import launcher  # noqa: E402
import oracle  # noqa: E402
import pipe_horovod.torch as phvd  # noqa: E402
from pipe_horovod import collectives, engine  # noqa: E402
from tolerance import THREADS, fan_ins, relative_error, training_rtol  # noqa: E402
from pipe_horovod.compression import Compression  # noqa: E402

torch.set_num_threads(THREADS)
ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.float16: 2.0**-11,
            torch.bfloat16: 2.0**-8}
CODECS = [Compression.none, Compression.fp16, Compression.bf16, Compression.int8,
          Compression.int4]
HALF_STEPS = {"int8": 254, "int4": 14}      # 2 * qmax: a block's error is max|x| / this
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
OPS = [engine.Sum, engine.Average]
failures, digests = [], []


def inputs(rank, numel, dtype, seed):
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    return (torch.randn(numel, generator=g, dtype=torch.float64) * (1 + rank)).to(dtype)


def bound(xs, exact, p, op, dtype, codec):
    s = sum(x.double().abs() for x in xs)
    f = 1.0 / p if op is engine.Average else 1.0
    if codec.name in HALF_STEPS:
        per_encode = s.max() / HALF_STEPS[codec.name]
    else:
        wire = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(codec.name, dtype)
        per_encode = ROUNDOFF[wire] * s
    return f * p * (per_encode + 2.0**-23 * s) + 2 * ROUNDOFF[dtype] * exact.abs() + 1e-30


def check(what, got, exact, limit):
    err = (got.double() - exact).abs()
    worst = (err - limit).max().item()
    if worst > 0:
        i = int((err - limit).argmax())
        failures.append(f"{what}: error {err[i].item():.3g} > bound {limit[i].item():.3g} "
                        f"at {i}")
    digests.append(hashlib.sha1(got.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest())


def allreduce_cases(r, p):
    seed = 0
    sizes = sorted({1, max(1, p - 1), 7, 1001})
    for algorithm in collectives.ALGORITHMS:
        for codec in CODECS:
            # Every dtype uncompressed; the codecs from float32 and from a 16-bit type.
            for dtype in DTYPES if codec is Compression.none else DTYPES[:2]:
                for op in OPS:
                    for numel in sizes:
                        seed += 1
                        one(r, p, algorithm, codec, dtype, op, numel, seed)
        big = 2 * 2**20                                   # 8 MB of float32
        for codec in (Compression.none, Compression.int8):
            seed += 1
            one(r, p, algorithm, codec, torch.float32, engine.Average, big, seed)


def one(r, p, algorithm, codec, dtype, op, numel, seed):
    xs = [inputs(q, numel, dtype, seed) for q in range(p)]
    exact = sum(x.double() for x in xs) / (p if op is engine.Average else 1)
    what = f"{algorithm} {codec.name} {dtype} {op.name} n={numel}"
    limit = bound(xs, exact, p, op, dtype, codec)
    t = xs[r].clone()
    try:
        out = collectives.allreduce(t, f"case.{seed}", op, collective=algorithm,
                                    compression=codec)
    except Exception as exc:                               # report, keep going
        failures.append(f"{what}: {type(exc).__name__}: {exc}")
        return
    assert out is t and t.dtype == dtype
    check(what, t, exact, limit)
    if codec is Compression.none:
        own = engine.wait(engine.allreduce_async(xs[r].clone(), f"own.{seed}", op))
        err = (t.double() - own.double()).abs()
        if (err > 2 * limit).any():
            failures.append(f"{what}: differs from the engine's own allreduce by "
                            f"{err.max().item():.3g}")


def rooted_cases(r, p):
    seed = 10_000
    for algorithm in collectives.ALGORITHMS:
        for root in sorted({0, p - 1, p // 2}):
            for codec in (Compression.none, Compression.int8, Compression.int4):
                for numel in (1, 1001):
                    seed += 1
                    xs = [inputs(q, numel, torch.float32, seed) for q in range(p)]
                    what = f"reduce {algorithm} root={root} {codec.name} n={numel}"
                    exact = sum(x.double() for x in xs)
                    t = xs[r].clone()
                    collectives.reduce(t, root, f"reduce.{seed}", engine.Sum,
                                       collective=algorithm, compression=codec)
                    if r == root:
                        limit = bound(xs, exact, p, engine.Sum, torch.float32, codec)
                        err = (t.double() - exact).abs()
                        if (err > limit).any():
                            failures.append(f"{what}: error {err.max().item():.3g}")
                    elif not torch.equal(t, xs[r]):
                        failures.append(f"{what}: a non-root tensor changed")
                    what = f"broadcast {algorithm} root={root} {codec.name} n={numel}"
                    t = xs[r].clone()
                    collectives.broadcast(t, root, f"bcast.{seed}", collective=algorithm,
                                          compression=codec)
                    limit = (xs[root].double().abs().max() / HALF_STEPS[codec.name]
                             if codec.name in HALF_STEPS else 0)
                    if ((t.double() - xs[root].double()).abs() > limit).any():
                        failures.append(f"{what}: not the root's tensor")
                    digests.append(hashlib.sha1(t.numpy().tobytes()).hexdigest())


def in_flight_out_of_order(r, p):
    """Many handles at once, mixed algorithms and the engine's own, waited in reverse."""
    started = []
    for i in range(24):
        numel = 1 + 997 * i
        x = inputs(r, numel, torch.float32, 50_000 + i)
        if i % 5 == 4:
            handle = engine.allreduce_async(x, f"mixed.own.{i}", engine.Sum)
        else:
            algorithm = list(collectives.ALGORITHMS)[i % 4]
            handle = collectives.allreduce_async(x, f"mixed.{i}", engine.Sum,
                                                 collective=algorithm)
        started.append((i, numel, x, handle))
    for *_, handle in started:
        engine.poll(handle)            # allowed at any time, done or not
    for i, numel, x, handle in reversed(started):
        out = engine.wait(handle)
        xs = [inputs(q, numel, torch.float32, 50_000 + i) for q in range(p)]
        exact = sum(x.double() for x in xs)
        limit = bound(xs, exact, p, engine.Sum, torch.float32, Compression.none)
        err = (out.double() - exact).abs()
        if (err > limit).any():
            failures.append(f"in flight #{i}: error {err.max().item():.3g} beyond rounding's "
                            f"bound")


def mismatched_calls(r, p):
    """A call whose size, dtype, op, collective, codec or root differs between ranks: a
    ValueError on every rank naming each rank's value (before anything is sent), and the
    next call works. Sizes no other case uses: each signature is new to every rank, so
    every rank checks it (two verified signatures that differ end at the timeout instead)."""
    others = [q for q in range(p) if q != r]
    cases = [
        ("numel", f"rank {r} {300 + r}",
         lambda: collectives.allreduce(torch.ones(300 + r), collective="ring")),
        ("dtype", f"rank {r} {'float32' if r == 0 else 'float64'}",
         lambda: collectives.allreduce(torch.ones(311, dtype=torch.float64 if r else torch.float32),
                                       collective="lp")),
        ("op", f"rank {r} {'AVERAGE' if r == 0 else 'SUM'}",
         lambda: collectives.allreduce(torch.ones(313), op=engine.Sum if r else engine.Average,
                                       collective="be")),
        ("collective", f"rank {r} {'ring' if r == 0 else 'mst'}(",
         lambda: collectives.allreduce(torch.ones(317), collective="mst" if r else "ring")),
        ("codec", f"rank {r} {'Int8Hop' if r == 0 else 'CastHop(torch.bfloat16)'}",
         lambda: collectives.allreduce(torch.ones(319), collective="lp",
                                       compression=Compression.bf16 if r else Compression.int8)),
        ("codec", f"rank {r} {'Int8Hop' if r == 0 else 'Int4Hop'}",
         lambda: collectives.allreduce(torch.ones(321), collective="ring",
                                       compression=Compression.int4 if r else Compression.int8)),
        ("root", f"rank {r} {r % 2}",
         lambda: collectives.broadcast(torch.ones(323), r % 2, collective="ring")),
    ]
    for field, own, call in cases:
        try:
            call()
        except ValueError as exc:
            text = str(exc)
            if f"ranks disagree on {field}:" not in text or own not in text or not all(
                    f"rank {q} " in text for q in others):
                failures.append(f"mismatched {field}: unexpected message {text}")
        else:
            failures.append(f"mismatched {field} across ranks was not refused")
    out = collectives.allreduce(torch.ones(5), None, engine.Sum, collective="ring")
    if not torch.equal(out, torch.full((5,), float(p))):
        failures.append(f"after the mismatches: allreduce gave {out}")


def error_feedback(r, p):
    """50 steps of a gradient with a persistent component: the sum of int8 (int4)
    results drifts from the exact sum without feedback, and stays near it with."""
    for algorithm in ("ring", "lp"):
        for plain_codec, fed_codec in ((Compression.int8, Compression.int8_ef),
                                       (Compression.int4, Compression.int4_ef)):
            numel, steps = 4099, 50
            residual = torch.zeros(numel)
            total = {"exact": torch.zeros(numel, dtype=torch.float64),
                     "plain": torch.zeros(numel, dtype=torch.float64),
                     "feedback": torch.zeros(numel, dtype=torch.float64)}
            for t in range(steps):
                xs = [(torch.linspace(-1, 1, numel) * (q + 1)
                       + 0.01 * inputs(q, numel, torch.float32, 70_000 + t)) for q in range(p)]
                total["exact"] += sum(x.double() for x in xs) / p
                plain = collectives.allreduce(xs[r].clone(), f"ef.plain.{t}",
                                              collective=algorithm, compression=plain_codec)
                fed = collectives.allreduce(xs[r].clone(), f"ef.fed.{t}", collective=algorithm,
                                            compression=fed_codec, residual=residual)
                total["plain"] += plain.double()
                total["feedback"] += fed.double()
            e_plain = (total["plain"] - total["exact"]).norm().item()
            e_fed = (total["feedback"] - total["exact"]).norm().item()
            what = f"{algorithm} {plain_codec.name}"
            print(f"rank {r} {what}: error after {steps} steps {e_plain:.4g}, with feedback "
                  f"{e_fed:.4g} (ratio {e_plain / max(e_fed, 1e-30):.1f})", flush=True)
            if not e_fed * 5 < e_plain:
                failures.append(f"error feedback {what}: {e_fed:.3g} is not 5x below "
                                f"{e_plain:.3g}")


# --- the optimizer -------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def data(rank, step):
    g = torch.Generator().manual_seed(10007 * rank + 101 * step)
    return [(torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g))]


def wrap(model, **kw):
    kw.setdefault("staleness_compensation", None)
    return phvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                     named_parameters=model.named_parameters(),
                                     bucket_cap_mb=0.0003, **kw)   # a few buckets


def train(model, opt, start, stop):
    for t in range(start, stop):
        opt.zero_grad()
        for x, y in data(phvd.rank(), t):
            F.cross_entropy(model(x), y).backward()
        opt.step()


def optimizer_matches_oracle(p, steps=12):
    for algorithm in ("lp", "ring"):
        for depth in (1, 2, 3) if p == 2 else (1, 2):     # K=3 at 2 ranks, on both engines
            torch.manual_seed(0)
            model = MLP()
            ref = MLP()
            ref.load_state_dict(model.state_dict())
            opt = wrap(model, collective=algorithm, pipeline_depth=depth)
            train(model, opt, 0, steps)
            opt.flush()
            oracle.reference(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9),
                             F.cross_entropy, data, p, steps, depth, 0)
            rtol = training_rtol(steps=steps, fan_ins=fan_ins(ref), batch=6, ranks=p,
                                 optimizer="momentum")
            for (name, a), b in zip(model.named_parameters(), ref.parameters()):
                err = relative_error(a, b)
                if err > rtol:
                    failures.append(f"optimizer {algorithm} K={depth}: {name} off by {err:.3g} "
                                    f"(rounding allows {rtol:.3g})")


def resume_with_feedback_is_exact(steps=12, cut=5):
    def fresh():
        torch.manual_seed(1)
        return MLP()

    options = {"collective": "ring", "compression": Compression.int8_ef, "pipeline_depth": 2}
    full = fresh()
    opt = wrap(full, **options)
    train(full, opt, 0, steps)
    opt.flush()
    first = fresh()
    opt = wrap(first, **options)
    train(first, opt, 0, cut)
    saved = {"model": {k: v.clone() for k, v in first.state_dict().items()},
             "opt": opt.state_dict()}
    fed = saved["opt"]["pipe_horovod"]["error_feedback"]
    if phvd.size() > 1 and not any(t.abs().sum() > 0 for s in fed.values() for t in s.values()):
        failures.append("int8_ef: no residual in the checkpoint")
    resumed = fresh()
    resumed.load_state_dict(saved["model"])
    opt = wrap(resumed, **options)
    opt.load_state_dict(saved["opt"])
    train(resumed, opt, cut, steps)
    opt.flush()
    for (name, a), b in zip(full.named_parameters(), resumed.parameters()):
        if not torch.equal(a, b):
            failures.append(f"int8_ef resume: {name} differs from the uninterrupted run")


def collective_differs_between_ranks(r):
    model = MLP()
    try:
        wrap(model, collective="lp" if r == 0 else "ring")
    except ValueError as exc:
        if "collective" not in str(exc):
            failures.append(f"mismatched collective: unexpected message {exc}")
    else:
        failures.append("mismatched collective across ranks was not refused")


def ddp_hooks_match_ddp(r, steps=4, lr=0.1):
    """DDP with each collective's hook against DDP's own allreduce (float32 sums:
    summation order only), and with int8 + feedback within the codec's error.

    int8's bound, from the module docstring's: each step's averaged gradient is off by at
    most (1/p) * p * M/254 per element (M: the largest sum over ranks of |local gradient|),
    plus float32's; error feedback only moves that error to a later step, so after `steps`
    SGD steps a weight is off by at most 2 * lr * steps * M/254, plus the float32 runs'."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from pipe_horovod.collectives import ddp_hooks

    largest = []                       # per step: this rank's largest |local gradient|

    def run(hooked):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(50, 400), nn.Tanh(), nn.Linear(400, 10))
        ddp = DDP(model, bucket_cap_mb=0.05)
        if hooked:
            ddp.register_comm_hook(*ddp_hooks.hook(*hooked))
        opt = torch.optim.SGD(ddp.parameters(), lr=lr)
        for t in range(steps):
            x = inputs(r, 8 * 50, torch.float32, 90_000 + t).view(8, 50)
            opt.zero_grad()
            if not hooked:             # the inner module: a local backward, no reduction
                local = torch.autograd.grad(model(x).pow(2).mean(), list(model.parameters()))
                largest.append(max(g.abs().max().item() for g in local))
            ddp(x).pow(2).mean().backward()
            opt.step()
        return model, [p.detach().clone() for p in model.parameters()]

    model, base = run(None)
    p = phvd.size()
    rtol = training_rtol(steps=steps, fan_ins=fan_ins(model), batch=8, ranks=p, optimizer="sgd")
    m = p * max(max(theirs) for theirs in phvd.allgather_object(largest))
    for algorithm in collectives.ALGORITHMS:
        for codec in (Compression.none, Compression.int8_ef):
            got = run((algorithm, codec))[1]
            for a, b in zip(got, base):
                limit = rtol * b.abs().max().item()
                if codec is Compression.int8_ef:
                    limit += 2 * lr * steps * m / 254
                err = (a - b).abs().max().item()
                if err > limit:
                    failures.append(f"ddp hook {algorithm} {codec.name}: off by {err:.3g} "
                                    f"(bound {limit:.3g})")


def check_all(engine_name, scope):
    """Every case of `scope` ("all", or "collectives" only); exits at once on a failure."""
    eng = phvd.init(engine_name)
    r, p = eng.rank(), eng.size()
    allreduce_cases(r, p)
    rooted_cases(r, p)
    in_flight_out_of_order(r, p)
    mismatched_calls(r, p)
    if scope == "all":
        optimizer_matches_oracle(p)
    if engine_name == "torch" and scope == "all":
        ddp_hooks_match_ddp(r)
    if p == 2:
        error_feedback(r, p)
        resume_with_feedback_is_exact()
        collective_differs_between_ranks(r)
    everyone = eng.allgather_object(hashlib.sha1("".join(digests).encode()).hexdigest())
    if len(set(everyone)) != 1:
        failures.append(f"results differ between ranks: {everyone}")
    if failures:
        print(f"rank {r}: {len(failures)} failure(s):\n  " + "\n  ".join(failures[:60]),
              flush=True)
        sys.exit(1)


def digits_int8(folder):
    import digits_int8_worker           # imports the digits example: only where it runs
    digits_int8_worker.check(folder)


def main():
    """CASES ENGINE_NAME SIZE: api_worker.py's checks (api: first, on the fresh engine), this
    file's (collectives, collectives-all), digits_int8_worker.py's (digits-int8: its runs
    shut the engine down) and then quantized_worker.py's (quantized: the allreduce only,
    quantized-all), in one launch (launcher.run_case). The quantized checks end by shutting
    the engine down: last."""
    cases, engine_name, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with tempfile.TemporaryDirectory() as tmp:
        if "api" in cases.split(","):
            # it sets HOROVOD_TIMELINE=DYNAMIC, read by Horovod's init; its set-adding check
            # expects Horovod's static sets (of the horovod launches only the 2-rank one has
            # the api case, and no other case there adds a set)
            import api_worker
            sets = list(api_worker.sets_at_init(size)) or None
        else:
            os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"  # Horovod: add_process_set after init
            sets = None
        r = phvd.init(engine_name, process_sets=sets).rank()
        import quantized_worker

        quantized = quantized_worker.check_all
        launcher.worker_cases({"api": lambda: api_worker.check_all(engine_name, size, tmp),
                               "collectives": lambda: check_all(engine_name, "collectives"),
                               "collectives-all": lambda: check_all(engine_name, "all"),
                               "digits-int8": lambda: digits_int8(Path(tmp)),
                               "quantized": lambda: quantized(engine_name, "allreduce"),
                               "quantized-all": lambda: quantized(engine_name, "all")},
                              cases, lambda: r)
    print(f"WORKER_OK rank={r}", flush=True)


if __name__ == "__main__":
    main()
