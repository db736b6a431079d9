"""Issues 31 and 39, engine side: collectives that ranks start differently, ranks that
raise alone, and ranks that stop early.

One launch runs every case in turn, on 2 ranks (the engine's checks leave it
usable after each refusal). Each case prints "CASE <name> rank=<r>: <outcome>"
with the exception's type and message, which the test compares exactly across
ranks and engines; then:
  order     two async allreduces started in the opposite order per rank pair by name;
  refused   shape, dtype, op, broadcast size and root, allgather trailing shape:
            Horovod's error on every rank, and a refused broadcast leaves the tensor as it was;
  join      rank 1 joins at once: rank 0's Average divides by 2 (Horovod's join) and an
            allgather is refused; then a DistributedOptimizer with an empty shard on
            rank 1 and 4 steps on rank 0 joins and ends with the same weights on both engines;
  deadlock  rank 0 waits for 'a', rank 1 for 'b': each raises StepMismatchError naming
            both waits, once two looks at the status board a second apart agree;
  blocking  blocking allreduces in a different order per rank ('loss' then 'acc' on rank 0),
            and a barrier on rank 0 against an allreduce on rank 1: the same, naming each
            rank's call (broadcast_parameters on rank 0 alone before a step, after the Keras
            case);
  metric    rank 1 allreduces a complex64 tensor (a ValueError there, caught), rank 0 a
            float one: rank 0 raises rank 1's error, naming the call, about 1 s in;
  grouped   grouped_allreduce of 2 tensors on rank 0 and 3 on rank 1: MismatchError naming
            the counts on both; object collectives with different roots, and
            allgather_object against broadcast_object: MismatchError on both;
  resume    a K=2 checkpoint (one gradient in flight) resumed at K=1 on rank 0 alone: rank 0's
            ValueError says to flush before saving; rank 1, at its next step, raises it too;
  edited    at pipeline_depth=2 rank 1 alone clips .grad between backward and step at its
            third step: it raises there (torch/edits.py), and rank 0 raises the same error,
            naming rank 1, at its next wait for a gradient rank 1 never sends;
  keras     Keras `fit` (KERAS_BACKEND: the test runs TensorFlow under torchrun, torch under
            horovodrun) on 6 batches on rank 0 and 4 on rank 1, which then waits in an
            allgather_object: both raise StepMismatchError naming both ranks' waits and
            steps (rank 0 on TensorFlow inside its UnknownError, the text of which the case
            prints);
  paramgroup  add_param_group on rank 0 alone after a step: both ranks name the group's
            check (rank 0's wait) and say every rank must add the group, not uneven data;
  again     both ranks shut the engine down and start it again in the same launch; rank 0
            then sleeps 2.5 s before an allreduce rank 1 already waits in: rank 1 waits
            and completes, reading none of the last engine's posts (every rank "ended",
            the errors above) off the launcher's store as news;
  ended     rank 1 trains 3 steps and exits; rank 0, at its 5th step, raises
            StepMismatchError naming rank 1 and its step count (last: rank 1 is gone).
"""
import importlib.util
import re
import sys
import time

if importlib.util.find_spec("triton") is not None:
    import triton  # noqa: F401 -- before TensorFlow (tests/conftest.py says why)
import torch

import pipe_horovod.torch as hvd
from pipe_horovod import engine
from pipe_horovod.collectives import quantized
from pipe_horovod.compression import two_stage


def wrapped(model, depth=None, **options):
    """`model`'s DistributedOptimizer: SGD, lr 0.1, named parameters."""
    return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters(),
                                    pipeline_depth=depth, **options)


def linear():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 1)


def outcome(case, fn):
    start = time.monotonic()
    try:
        result = fn()
    except Exception as exc:
        text = f"{type(exc).__name__}: {exc}"
    else:
        text = f"ok {result}"
    # One write per line: the launcher merges both ranks' output.
    sys.stdout.write(f"CASE {case} rank={hvd.rank()}: {text} [{time.monotonic() - start:.1f} s]\n")
    sys.stdout.flush()


def order(r):
    a, b = torch.tensor([1.0 + r]), torch.tensor([10.0 + 10 * r])
    if r == 0:
        ha = hvd.allreduce_async(a, name="m.a", op=hvd.Sum)
        hb = hvd.allreduce_async(b, name="m.b", op=hvd.Sum)
    else:
        hb = hvd.allreduce_async(b, name="m.b", op=hvd.Sum)
        ha = hvd.allreduce_async(a, name="m.a", op=hvd.Sum)
    return [hvd.synchronize(ha).item(), hvd.synchronize(hb).item()]


def refused(r):
    outcome("shape", lambda: hvd.allreduce(torch.ones(2 + r, 3), name="x.shape"))
    outcome("dtype", lambda: hvd.allreduce(
        torch.ones(4, dtype=(torch.float32, torch.float64)[r]), name="x.dtype"))
    outcome("op", lambda: hvd.allreduce(torch.ones(4), name="x.op",
                                        op=(hvd.Sum, hvd.Average)[r]))
    mine = torch.full((4 + 2 * r,), float(r))
    outcome("bsize", lambda: hvd.broadcast_(mine, 0, name="x.bsize"))
    assert torch.equal(mine, torch.full((4 + 2 * r,), float(r))), mine   # untouched
    outcome("broot", lambda: hvd.broadcast(torch.ones(3), r, name="x.broot"))
    outcome("agshape", lambda: hvd.allgather(torch.ones(2, 3 + r), name="x.ag"))


def joined_int8():
    """int8 in two stages (an alltoall, which a joined rank cannot stand in for) with
    the other rank joined: the engine's allreduce of this rank's first stage instead,
    the joined rank adding zeros: this rank's quantized values, halved (Average). In
    one chunk, and in four (all of whose alltoalls are refused); then the same on the
    point-to-point transport."""
    fmt, same = two_stage.WireFormat(hvd.Compression.int8.wire), []
    for numel in (1000, 4 * two_stage.CHUNK_NUMEL):
        x, at, want = torch.linspace(-3, 5, numel), 0, []
        for shard in two_stage.shard_sizes(numel, hvd.size()):
            want.append(two_stage.quantize(x[at:at + shard], fmt)[1] / hvd.size())
            at += shard
        got = hvd.allreduce(x, name=f"j.int8.{numel}", compression=hvd.Compression.int8)
        same.append(torch.equal(got, torch.cat(want)))
        # The optimizer's buckets on a CPU: point to point, which first learns that a
        # rank joined (before this rank ever opened the group: it opens none then).
        got = engine.current().wait(quantized.allreduce_async(
            x.clone(), f"j.p2p.{numel}", fmt=fmt, transport="p2p"))
        same.append(torch.equal(got, torch.cat(want)))
    return same


def join(r):
    if r == 1:
        outcome("join.last", hvd.join)
    else:
        outcome("join.average", lambda: hvd.allreduce(torch.ones(2), name="j.avg").tolist())
        outcome("join.allgather", lambda: hvd.allgather(torch.ones(2), name="j.ag"))
        outcome("join.int8", joined_int8)
        # bfloat16, which the horovod engine reduces in two stages too (Horovod's CPU
        # ops have no bfloat16 sum).
        outcome("join.bf16", lambda: hvd.allreduce(
            torch.tensor([1.5, -3.0, 2.0 ** -130], dtype=torch.bfloat16), name="j.bf16").tolist())
        outcome("join.last", hvd.join)
    model = linear()
    opt = wrapped(model)
    for _ in range((4, 0)[r]):                          # rank 1's shard is empty
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    outcome("join.empty", lambda: [hvd.join(), round(model.weight.sum().item(), 4)])


def deadlock(r):
    outcome("deadlock", lambda: hvd.allreduce(torch.ones(1), name="d.a" if r == 0 else "d.b"))


def blocking(r):
    names = ("o.loss", "o.acc") if r == 0 else ("o.acc", "o.loss")
    outcome("blocking", lambda: [hvd.allreduce(torch.ones(1), name=n) for n in names])
    if r == 0:
        outcome("barrier", hvd.barrier)
    else:
        outcome("barrier", lambda: hvd.allreduce(torch.ones(1), name="o.x"))


def rank0_only(r):
    """broadcast_parameters on rank 0 alone, then a step (after the Keras case: its
    automatic names are not used again, and rank 1 waits in this wrap's comparison)."""
    model = linear()
    opt = wrapped(model, 1)

    def start():
        if r == 0:
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()

    outcome("rank0only", start)


def metric(r):
    def reduce():
        value = torch.ones(2, dtype=torch.complex64 if r == 1 else torch.float32)
        return hvd.allreduce(value, name="metric")
    outcome("metric", reduce)


def grouped(r):
    outcome("grouped", lambda: hvd.grouped_allreduce([torch.ones(2)] * (2 + r), name="g"))
    outcome("grouped.root", lambda: hvd.broadcast_object({"rank": r}, root_rank=r))
    outcome("grouped.kind", lambda: hvd.allgather_object(r) if r == 0
            else hvd.broadcast_object(r, root_rank=0))


def resume(r):
    model = linear()
    opt = wrapped(model, 2, staleness_compensation=None)
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    saved = opt.state_dict()                    # one averaged gradient in flight
    opt.flush()
    again = wrapped(model, 1, staleness_compensation=None)

    def step():
        if r == 0:
            again.load_state_dict(saved)        # rank 0 alone resumes, as Horovod scripts do
        again.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        again.step()
    outcome("resume", step)


def edited(r):
    model = linear()
    opt = wrapped(model, 2)

    def train():
        for t in range(8):
            opt.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            if t == 2 and r == 1:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
        return "trained"

    outcome("edited", train)


def keras_uneven(r):
    import keras
    import numpy as np

    import pipe_horovod.keras as khvd

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    # The own gradient's lookahead (not the Keras default's exchange): rank 0 then waits for
    # the gradients of step 4, where the later cases of this launch expect it. At the
    # default it waits in step 5's exchange, names the same cause, but may still wait when
    # rank 1, done with keras.next, starts the next case's comparison, which then (rightly)
    # raises the mismatch there.
    model.compile(optimizer=khvd.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                      prediction_exchange=None), loss="mse")
    n = (6, 4)[r] * 2                                  # batches of 2: 6 steps on rank 0, 4 on 1
    x, y = np.ones((n, 4), "float32"), np.ones((n, 1), "float32")
    start = time.monotonic()
    try:
        model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0,
                  callbacks=[khvd.callbacks.BroadcastGlobalVariablesCallback(0)])
        text = "ok trained"
    except Exception as exc:
        # TensorFlow wraps the error of a hand-off in its own (UnknownError: Graph execution
        # error: ... StepMismatchError: ...): print the outer type and the inner line.
        inner = re.search(r"^(?:\S+: )?(StepMismatchError: .*)$", str(exc), re.M)
        text = f"{type(exc).__name__}: {inner.group(1) if inner else exc}"
    sys.stdout.write(f"CASE keras rank={r}: {text} [{time.monotonic() - start:.1f} s]\n")
    sys.stdout.flush()
    if r == 1:      # on to a collective rank 0 does not start now: both name both waits
        outcome("keras.next", lambda: hvd.allgather_object(r, name="keras.next"))


def param_group(r):
    """A frozen head unfrozen by add_param_group on rank 0 alone, after a step: rank 0 waits
    in the group's check, rank 1 in its next step's reduction; both name the group's check
    and say what to do, not uneven data (the step counts differ) nor internal names."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    head = list(model[1].parameters())
    for p in head:
        p.requires_grad_(False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model[0].parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), pipeline_depth=1)

    def step():
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    step()

    def unfreeze_and_step():
        if r == 0:
            for p in head:
                p.requires_grad_(True)
            opt.add_param_group({"params": head})
        step()
    outcome("paramgroup", unfreeze_and_step)


def again(r):
    hvd.shutdown()
    hvd.init()

    def reduce():
        if r == 0:
            time.sleep(2.5)          # past STATUS_AFTER_S: rank 1's wait reads the board
        return hvd.allreduce(torch.tensor([1.0 + r]), name="again", op=hvd.Sum).tolist()
    outcome("again", reduce)


def ended(r):
    model = linear()
    opt = wrapped(model, 1)

    def train():
        for _ in range((5, 3)[r]):
            opt.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
        return "trained"

    outcome("ended", train)
    if r == 1:
        print(f"ENDING rank=1 at {time.time():.3f}", flush=True)
    else:
        print(f"RAISED rank=0 at {time.time():.3f}", flush=True)


def main():
    hvd.init()
    r = hvd.rank()
    outcome("order", lambda: order(r))
    refused(r)
    join(r)
    deadlock(r)
    blocking(r)
    metric(r)
    grouped(r)
    resume(r)
    edited(r)
    keras_uneven(r)
    rank0_only(r)
    param_group(r)
    again(r)
    ended(r)
    print(f"WORKER_OK rank={r}", flush=True)


if __name__ == "__main__":
    main()
