"""tune="auto" in a real launch (tests/test_auto.py; torchrun, 2 ranks, one launch).

Timings are injected, not waited for on a real network: every step sleeps COMPUTE_S in
the training loop (compute, as the run record counts it), and the "network-bound"
cases also sleep WAIT_S inside every wait for a reduction (pipe_horovod.engine.wait, the
call the step machine blocks in: exposed wait). With compute alone the run is compute
bound and auto must stay at K=1; with the wait it must choose K=2 (no codec: at
max(compute, link) every codec ties with none, and the tie goes to none).

Cases:
- k1: compute-bound; the decision is K=1, no codec, the buckets as run, the same on
  every rank; the weights equal, bit for bit, a run of K=1 with warmup_steps=N.
- k2: network-bound; the decision is K=2, no codec, the same on every rank; the weights
  equal, bit for bit, a run of pipeline_depth=2 (default lookahead) with warmup_steps=N.
- resume: a K=2 decision saved in the optimizer's state_dict; a new optimizer with
  tune="auto" that loads it applies it at once (no measuring), and training on from it
  equals, bit for bit, the run that never stopped.
- codec: the link far slower than compute (WAIT_S * 4 against COMPUTE_S / 4): K=2 with
  a two-stage codec the rule allows; every rank applies it (the gloo group it needs is
  opened at the decision) and trains on to the same weights (the average is the same on
  every rank).
- differ: rank 0 asks for tune="auto", rank 1 not: every rank raises at wrap time,
  naming tune and both values.
"""
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import launcher  # noqa: E402
import pipe_horovod.engine as engine_module  # noqa: E402
import pipe_horovod.torch as hvd  # noqa: E402
from pipe_horovod.compression import Compression  # noqa: E402

STEPS = 8                         # PIPE_HOROVOD_TUNE_STEPS for this launch
AFTER = 4                         # steps trained after the decision
COMPUTE_S = 0.08
WAIT_S = 0.04


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _optimizer(model, **options):
    return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                    named_parameters=model.named_parameters(), **options)


def _train(model, optimizer, steps, first=0, compute_s=0.0):
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(1009 * hvd.rank() + step)
        x, y = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        if compute_s:
            time.sleep(compute_s)


class _SlowWaits:
    """Every wait for a reduction blocks WAIT_S longer: an exposed wait, as a slow link's."""

    def __init__(self, seconds=WAIT_S):
        self.seconds = seconds

    def __enter__(self):
        self.wait = engine_module.wait

        def slow(handle):
            time.sleep(self.seconds)
            return self.wait(handle)
        engine_module.wait = slow

    def __exit__(self, *exc):
        engine_module.wait = self.wait


def _auto_run(slow, steps=STEPS + AFTER):
    model = _model()
    optimizer = _optimizer(model, tune="auto")
    if slow:
        with _SlowWaits():
            _train(model, optimizer, steps, compute_s=COMPUTE_S)
    else:
        _train(model, optimizer, steps, compute_s=COMPUTE_S)
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
    model, optimizer = _auto_run(slow)
    decision = optimizer._machine.tuner.decision
    assert decision is not None, "auto did not decide"
    assert (decision.pipeline_depth, decision.compression, decision.bucket_cap_mb) == (
        depth, "none", None), decision
    assert optimizer._machine.fifo.pipeline_depth == depth
    assert optimizer._machine.run_config()["auto"] == decision.as_dict()
    _same_everywhere(decision)
    optimizer.flush()
    oracle, fixed = _chosen_run(decision)
    fixed.flush()
    _assert_equal(model, oracle, f"auto (K={depth}) against its oracle")


def k1():
    _outcome(slow=False, depth=1)


def k2():
    _outcome(slow=True, depth=2)


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


def codec():
    model = _model()
    optimizer = _optimizer(model, tune="auto")
    with _SlowWaits(4 * WAIT_S):
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


def differ():
    model = _model()
    try:
        _optimizer(model, tune="auto" if hvd.rank() == 0 else None)
    except ValueError as exc:
        assert "tune is None on rank 1 but auto (8 steps) on rank 0" in str(exc), exc
    else:
        raise AssertionError("ranks whose tune differs were not told")


if __name__ == "__main__":
    os.environ["PIPE_HOROVOD_TUNE_STEPS"] = str(STEPS)
    hvd.init()
    launcher.worker_cases({"k1": k1, "k2": k2, "resume": resume,
                                                "codec": codec, "differ": differ}, sys.argv[1], hvd.rank)
    print(f"WORKER_OK rank={hvd.rank()}", flush=True)
