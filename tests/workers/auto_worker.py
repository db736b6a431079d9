"""tune="auto" in a real launch (tests/test_auto.py; torchrun, 2 ranks, one launch).

Timings are injected, not waited for on a real network: every step sleeps COMPUTE_S in
the training loop (compute, as the run record counts it), and the "network-bound"
cases model a slow link: a reduction lands WAIT_S after its launch (the wait for it,
pipe_horovod.engine.wait, where the step machine blocks, sleeps until then: exposed at
K=1, hidden behind the next step's compute at K=2). With compute alone the run is compute
bound and auto must stay at K=1; with the link it must try K=2 (no codec: at
max(compute, link) every codec ties with none, and the tie goes to none) and keep it.

Cases:
- k1: compute-bound; the decision is K=1, no codec, the buckets as run, the same on
  every rank; the weights equal, bit for bit, a run of K=1 with warmup_steps=N.
- k2: network-bound; the decision is a K=2 trial, no codec, kept once its steps measured
  faster, the same on every rank; the weights equal, bit for bit, a run of
  pipeline_depth=2 (default lookahead) with warmup_steps=N.
- undone: network-bound while measured, then compute grows (SLOWER_S) during the trial:
  the trial measures slower than K=1 and is undone, the gradient in flight applied at
  once; the weights equal, bit for bit, a fixed K=2 run (warmup_steps=N) of the steps up
  to the trial's end, flushed, its state_dict loaded by a K=1 optimizer that trains on.
- resume: a K=2 decision saved in the optimizer's state_dict; a new optimizer with
  tune="auto" that loads it applies it at once (no measuring), and training on from it
  equals, bit for bit, the run that never stopped.
- adopt: a checkpoint of a fixed K=2 run (a gradient in flight, no decision) loaded by an
  optimizer with tune="auto", which measures at K=1: the gradient in flight is applied at
  the first step with that step's own; the weights equal, bit for bit, the fixed run one
  step further, flushed, its state_dict loaded by a K=1 optimizer. (Without staleness
  compensation: at K=1 auto makes no prediction, so a lookahead due at the checkpoint
  is not made there, and the fixed run would make it.)
- codec: the link far slower than compute (WAIT_S * 4 against COMPUTE_S / 4): K=2 with
  a two-stage codec the rule allows; every rank applies it (the gloo group it needs is
  opened at the decision) and trains on to the same weights (the average is the same on
  every rank).
- codec_undone: as codec, but compute grows (SLOWER_S) once the codec's own trial
  begins: the codec measures slower than K=2 alone, which stays, and the codec's
  error-feedback residuals are added to the next reductions; the weights equal, bit for
  bit, a fixed K=2 run to the first trial's end whose state_dict a K=2 run with the codec
  loads for the codec's trial, whose state_dict (residuals included) a K=2 run without
  codec loads and trains on.
- differ: rank 0 asks for tune="auto", rank 1 not: every rank raises at wrap time,
  naming tune and both values.
"""
import copy
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import launcher  # noqa: E402
import pipe_horovod.torch as hvd  # noqa: E402
from slow_link import SlowLink  # noqa: E402
from pipe_horovod.compression import Compression  # noqa: E402

STEPS = 8                         # PIPE_HOROVOD_TUNE_STEPS for this launch
TRIAL = 5                         # its trial's steps (auto.Tuner(STEPS).trial_steps)
AFTER = TRIAL + 2                 # steps trained after the decision
COMPUTE_S = 0.08
WAIT_S = 0.04
SLOWER_S = 0.2                    # "undone": compute during and after the trial
BOUND_S = 0.25                    # "k1": compute alone


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _optimizer(model, **options):
    return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                    named_parameters=model.named_parameters(), **options)


def _train(model, optimizer, steps, first=0, compute_s=0.0):
    """`compute_s`: seconds each step sleeps, or a function of the step."""
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(1009 * hvd.rank() + step)
        x, y = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        seconds = compute_s(step) if callable(compute_s) else compute_s
        if seconds:
            time.sleep(seconds)


def _SlowLink(seconds=WAIT_S):
    return SlowLink(seconds)


def _auto_run(slow, steps=STEPS + AFTER, compute_s=COMPUTE_S):
    model = _model()
    optimizer = _optimizer(model)       # the default: tune="auto" (the launch unsets the suite's off)
    if slow:
        with _SlowLink():
            _train(model, optimizer, steps, compute_s=compute_s)
    else:
        _train(model, optimizer, steps, compute_s=compute_s)
    return model, optimizer


def _same_everywhere(decision):
    everyone = hvd.allgather_object(decision.as_dict())
    assert all(d == everyone[0] for d in everyone), everyone


def _chosen_run(decision, steps=STEPS + AFTER):
    """The oracle: the chosen configuration, fixed, with warmup_steps=N."""
    model = _model()
    optimizer = _optimizer(model, pipeline_depth=decision.pipeline_depth,
                           compression=Compression.by_name(decision.compression),
                           bucket_cap_mb=decision.bucket_cap_mb, warmup_steps=STEPS)
    _train(model, optimizer, steps)
    return model, optimizer


def _assert_equal(a, b, what):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{what}: {name} differs by {(p - q).abs().max().item()}"


def _outcome(slow, depth):
    model, optimizer = _auto_run(slow, compute_s=COMPUTE_S if slow else BOUND_S)
    decision = optimizer._machine.tuner.decision
    assert decision is not None, "auto did not decide"
    assert (decision.pipeline_depth, decision.compression, decision.bucket_cap_mb) == (
        depth, "none", None), decision
    # Compute-bound, the real reductions' wait is about 2 ms on loopback, but a busy
    # machine's can pass TRIAL_MARGIN of the step: K=2 is then rightly tried, and undone.
    tried = not math.isnan(decision.tried_s)
    assert not decision.trying and (depth == 2) <= tried, decision
    assert optimizer._machine.fifo.pipeline_depth == depth
    assert optimizer._machine.run_config()["auto"] == decision.as_dict()
    # The summary holds the chosen configuration's steps only (as plan --from-run reads it)
    decided_at = STEPS + (TRIAL if tried else 0)
    steps = optimizer._machine.record.summary()["steps"]
    assert steps and min(s["step"] for s in steps) == decided_at, steps
    _same_everywhere(decision)
    optimizer.flush()
    if depth == 1 and tried:
        oracle = _k2_then_k1(STEPS + TRIAL, STEPS + AFTER, warmup_steps=STEPS)
    else:
        oracle, fixed = _chosen_run(decision)
        fixed.flush()
    _assert_equal(model, oracle, f"auto (K={depth}) against its oracle")


def k1():
    _outcome(slow=False, depth=1)


def k2():
    _outcome(slow=True, depth=2)


def undone():
    steps = STEPS + AFTER
    slower = lambda step: COMPUTE_S if step < STEPS else SLOWER_S    # noqa: E731
    model, optimizer = _auto_run(True, steps, compute_s=slower)
    decision = optimizer._machine.tuner.decision
    assert (decision.pipeline_depth, decision.compression, decision.trying) == (
        1, "none", False), decision
    assert decision.tried_s > decision.measured_s and "tried K=2" in decision.reason, decision
    assert optimizer._machine.fifo.pipeline_depth == 1 and len(optimizer._machine.fifo) == 0
    _same_everywhere(decision)
    optimizer.flush()
    oracle = _k2_then_k1(STEPS + TRIAL, steps, warmup_steps=STEPS)
    _assert_equal(model, oracle, "auto with its trial undone against its oracle")


def _k2_then_k1(switch_at, total, **options):
    """The oracle of a run that leaves K=2 at step `switch_at`: a fixed K=2 run (with
    `options`) of that many steps, flushed, its state_dict loaded by a K=1 optimizer that
    trains on to `total` steps."""
    oracle = _model()
    fixed = _optimizer(oracle, pipeline_depth=2, **options)
    _train(oracle, fixed, switch_at)
    fixed.flush()
    saved = fixed.state_dict()
    after = _optimizer(oracle, pipeline_depth=1)      # (the K=2 wrapper retires)
    after.load_state_dict(saved)
    _train(oracle, after, total - switch_at, first=switch_at)
    after.flush()
    return oracle


def resume():
    total = STEPS + AFTER + 1
    straight, straight_opt = _auto_run(True, total)
    straight_opt.flush()
    model, optimizer = _auto_run(True, STEPS + 2)
    saved = optimizer.state_dict()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    assert saved["pipe_horovod"]["tune"]["pipeline_depth"] == 2, saved["pipe_horovod"]["tune"]
    resumed = _model()
    resumed.load_state_dict(weights)
    again = _optimizer(resumed, tune="auto")
    again.load_state_dict(saved)
    tuner = again._machine.tuner
    assert tuner.decision is not None and tuner.decision.as_dict() == saved["pipe_horovod"][
        "tune"], tuner.decision
    assert again._machine.fifo.pipeline_depth == 2 and not tuner.due(again._machine.fifo.steps)
    _train(resumed, again, total - (STEPS + 2), first=STEPS + 2)
    again.flush()
    _assert_equal(resumed, straight, "resumed auto run against the one that never stopped")


def adopt():
    saved_at, more = 3, 4                 # fewer than STEPS after it: auto stays measuring
    model = _model()
    fixed = _optimizer(model, pipeline_depth=2, staleness_compensation=None)
    _train(model, fixed, saved_at)
    # (a copy: a state_dict views the optimizer's state, which flush() then updates)
    saved = copy.deepcopy(fixed.state_dict())
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    assert len(saved["pipe_horovod"]["in_flight"]) == 1 and "tune" not in saved["pipe_horovod"]
    fixed.flush()
    resumed = _model()
    resumed.load_state_dict(weights)
    tuned = _optimizer(resumed, tune="auto")
    tuned.load_state_dict(saved)
    assert tuned._machine.fifo.pipeline_depth == 1 and len(tuned._machine.fifo) == 1
    _train(resumed, tuned, more, first=saved_at)
    assert tuned._machine.tuner.decision is None and len(tuned._machine.fifo) == 0
    assert tuned.timings["steps"] == more
    tuned.flush()
    # The oracle: the fixed run one step further, flushed, then K=1 from its state_dict
    oracle = _k2_then_k1(saved_at + 1, saved_at + more, staleness_compensation=None)
    _assert_equal(resumed, oracle, "auto resumed from a fixed K=2 checkpoint against its oracle")


def codec():
    model = _model()
    optimizer = _optimizer(model, tune="auto")
    with _SlowLink(4 * WAIT_S):
        _train(model, optimizer, STEPS + AFTER, compute_s=COMPUTE_S / 4)
    decision = optimizer._machine.tuner.decision
    assert decision.pipeline_depth == 2 and decision.compression in ("int8_ef", "int4_ef:32"), \
        decision
    assert optimizer._machine.wire is not None and optimizer._machine.feedback is not None
    _same_everywhere(decision)
    optimizer.flush()
    weights = hvd.allgather_object([p.detach().clone() for p in model.parameters()])
    for theirs in weights[1:]:
        assert all(torch.equal(a, b) for a, b in zip(weights[0], theirs))


def codec_undone():
    total = STEPS + 2 * TRIAL + 3
    slower = lambda step: COMPUTE_S / 4 if step < STEPS + TRIAL else SLOWER_S  # noqa: E731
    model = _model()
    optimizer = _optimizer(model, tune="auto")
    with _SlowLink(4 * WAIT_S):
        _train(model, optimizer, total, compute_s=slower)
    decision = optimizer._machine.tuner.decision
    assert (decision.pipeline_depth, decision.compression, decision.trying) == (
        2, "none", False), decision
    assert decision.reason.startswith("tried K=2 + int") and decision.reason.endswith(
        "; K=2 without it kept"), decision.reason
    assert optimizer._machine.feedback is None and optimizer._machine._folding is None
    _same_everywhere(decision)
    optimizer.flush()
    codec = decision.reason.removeprefix("tried K=2 + ").split(": ")[0]
    # The oracle: fixed runs handing over, the pipeline kept full, through state_dict and
    # the weights (a new model each, as a resume has: the last wrapper's hooks stay on its)
    oracle, handed = _model(), None
    for compression, first, steps in (("none", 0, STEPS + TRIAL), (codec, STEPS + TRIAL, TRIAL),
                                      ("none", STEPS + 2 * TRIAL, 3)):
        if handed is not None:
            weights = {k: v.clone() for k, v in oracle.state_dict().items()}
            oracle = _model()
            oracle.load_state_dict(weights)
        fixed = _optimizer(oracle, pipeline_depth=2, warmup_steps=STEPS,
                           compression=Compression.by_name(compression))
        if handed is not None:
            fixed.load_state_dict(handed)
        _train(oracle, fixed, steps, first=first)
        handed = copy.deepcopy(fixed.state_dict())
    # the residuals were added to the first reductions without the codec, once
    assert handed["pipe_horovod"]["error_feedback"] is None
    fixed.flush()
    _assert_equal(model, oracle, "auto with its codec's trial undone against its oracle")


def differ():
    model = _model()
    try:
        _optimizer(model, tune="auto" if hvd.rank() == 0 else "off")
    except ValueError as exc:
        assert "tune is None on rank 1 but auto (8 steps) on rank 0" in str(exc), exc
    else:
        raise AssertionError("ranks whose tune differs were not told")


if __name__ == "__main__":
    os.environ["PIPE_HOROVOD_TUNE_STEPS"] = str(STEPS)
    hvd.init()
    launcher.worker_cases({"k1": k1, "k2": k2, "undone": undone, "resume": resume,
                           "adopt": adopt, "codec": codec, "codec_undone": codec_undone,
                           "differ": differ}, sys.argv[1], hvd.rank)
    print(f"WORKER_OK rank={hvd.rank()}", flush=True)
