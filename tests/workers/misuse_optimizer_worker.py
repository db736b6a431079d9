"""On N ranks: optimizer-side misuse, every case in one launch (hardening_worker.py's
`misuse` case).

Each case either matches the oracle (the use is honoured) or raises / warns with
the message it names, on every rank. Cases that leave reductions in flight
(an error raised inside step()) run last.
"""
import copy
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import oracle  # noqa: E402
from optimizer_worker import MLP, STEPS, assert_close, data_for, fresh, train  # noqa: E402
import pipe_horovod.torch as phvd  # noqa: E402
from tolerance import THREADS  # noqa: E402

torch.set_num_threads(THREADS)


def wrap(model, depth, compensation="lookahead", lr=0.1, **kw):
    return phvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
                                     named_parameters=model.named_parameters(),
                                     pipeline_depth=depth, staleness_compensation=compensation,
                                     **kw)


def raises(kind, text, call):
    try:
        call()
    except kind as e:
        assert text in str(e), f"expected {text!r} in: {e}"
        return str(e)
    raise AssertionError(f"expected {kind.__name__} containing {text!r}")


def warns(text, call):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    assert any(text in str(w.message) for w in caught), [str(w.message) for w in caught]


def clip(params):
    torch.nn.utils.clip_grad_norm_(params, 0.05)


def mask(params):
    for p in params:
        p.grad[..., ::2] = 0


def check_grad_edits_at_depth_one():
    """clip_grad_norm_ and a mask between backward() and step(), no synchronize(): applied
    to the averaged gradient, as DDP does (the oracle edits the average)."""
    size = phvd.size()
    for edit in (clip, mask):
        model, ref = fresh(MLP), fresh(MLP)
        opt = wrap(model, 1)
        for t in range(STEPS):
            opt.zero_grad()
            for x, y in data_for()(phvd.rank(), t):
                F.cross_entropy(model(x), y).backward()
            edit(list(model.parameters()))
            opt.step()
        oracle.reference(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9),
                         F.cross_entropy, data_for(), size, STEPS, 1, 0, edit_grads=edit)
        assert_close(model, ref, f"{edit.__name__} between backward and step at K=1")


def check_weight_edits_between_steps():
    """A WGAN clamp of p.data after step() under the default lookahead lands on the real
    weights (the oracle clamps them); state_dict() between steps holds the real weights,
    the same on every rank."""
    size = phvd.size()

    def clamp(params):
        for p in params:
            p.clamp_(-0.05, 0.05)
    model, ref = fresh(MLP), fresh(MLP)
    opt = wrap(model, 2)
    for t in range(STEPS):
        opt.zero_grad()
        for x, y in data_for()(phvd.rank(), t):
            F.cross_entropy(model(x), y).backward()
        opt.step()
        for p in model.parameters():
            p.data.clamp_(-0.05, 0.05)
        saved = model.state_dict()
        everyone = phvd.allgather_object({k: v.clone() for k, v in saved.items()})
        for theirs in everyone:
            for name, value in theirs.items():
                assert torch.equal(value, saved[name]), f"step {t}: {name} differs between ranks"
        assert max(v.abs().max().item() for v in saved.values()) <= torch.tensor(0.05).item()
    opt.flush()
    # One process alone applies each update at once (K=1: its prediction is exact).
    oracle.reference(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9),
                     F.cross_entropy, data_for(), size, STEPS, 1 if size == 1 else 2, 0,
                     compensation="lookahead", edit_weights=clamp)
    assert_close(model, ref, "clamp between steps under the default lookahead")


def check_options_and_models():
    model = fresh(MLP)
    for kw, text in (({"bucket_cap_mb": float("inf")}, "bucket_cap_mb must be a finite"),
                     ({"bucket_cap_mb": float("nan")}, "bucket_cap_mb must be a finite"),
                     ({"bucket_cap_mb": -1}, "bucket_cap_mb must be a finite"),
                     ({"pipeline_depth": 1000}, "depths above 64 are refused")):
        depth = kw.pop("pipeline_depth", 2)
        raises(ValueError, text, lambda: wrap(model, depth, **kw))
    # The compression and bucket options: a codec the chosen path cannot carry, a block size out of range,
    # a link description that is not a number (read for the automatic bucket size).
    raises(ValueError, "runs only in the two-stage reduction",
           lambda: wrap(model, 2, compression=phvd.Compression.fp8_e4m3, collective="ring"))
    raises(ValueError, "block_size must be between",
           lambda: phvd.Compression.int8_ef.with_block_size(8))
    os.environ["PIPE_HOROVOD_LINK_GBPS"] = "fast"
    try:
        raises(ValueError, "PIPE_HOROVOD_LINK_GBPS must be a number", lambda: wrap(model, 2))
    finally:
        del os.environ["PIPE_HOROVOD_LINK_GBPS"]
    # prediction_exchange: a format the exchange has not, without the lookahead
    # it feeds, and one that differs between ranks (every rank raises, naming it).
    raises(ValueError, "prediction_exchange must be None, 'auto' or one of int4, int8; got 'fp16'",
           lambda: wrap(model, 2, prediction_exchange="fp16"))
    raises(ValueError, "it needs staleness_compensation='lookahead', got None",
           lambda: wrap(model, 2, compensation=None, prediction_exchange="int4"))
    if phvd.size() > 1:
        raises(ValueError, "the model differs between ranks: option prediction_exchange is int8 "
                          "on rank 1 but int4 on rank 0",
               lambda: wrap(model, 2, prediction_exchange="int8" if phvd.rank() else "int4"))
    with torch.device("meta"):
        meta = MLP()
    raises(ValueError, "is on the meta device", lambda: wrap(meta, 2))
    if phvd.size() > 1:
        # Per-rank hyper-parameters, as Horovod's test_broadcast_state_options builds them:
        # a warning on every rank at the first step, then broadcast_optimizer_state makes
        # them rank 0's (not refused at wrap time, since Horovod's own test runs it).
        model = fresh(MLP)
        opt = wrap(model, 2, lr=0.1 + phvd.rank())
        (x, y), = data_for()(phvd.rank(), 0)

        def first_step():
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        warns(f"param_groups[0]['lr'] is {1.1!r} against rank 0's 0.1 on rank 1", first_step)
        phvd.broadcast_optimizer_state(opt, root_rank=0)
        assert opt.param_groups[0]["lr"] == 0.1, opt.param_groups[0]["lr"]
        first_step()
        opt.flush()


def check_calls():
    """synchronize() twice warns; fewer backward passes than declared warns; a second
    backward after K=1's average raises; a wrapper's state_dict with gradients in flight
    fails to load into a plain optimizer, and loads after flush()."""
    model = fresh(MLP)
    (x, y), = data_for()(phvd.rank(), 0)
    opt = wrap(model, 2, None)
    F.cross_entropy(model(x), y).backward()
    opt.synchronize()
    warns("synchronize() called twice", opt.synchronize)
    with opt.skip_synchronize():
        opt.step()
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    plain = torch.optim.SGD(fresh(MLP).parameters(), lr=0.1, momentum=0.9)
    raises(ValueError, "different number of parameter groups",
           lambda: plain.load_state_dict(opt.state_dict()))
    # The documented way: flush_into loads it into a plain optimizer and applies
    # the gradient in flight as flush() does, to the bit.
    saved, weights = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
    opt.flush()
    elsewhere = fresh(MLP)
    elsewhere.load_state_dict(weights)
    plain = torch.optim.SGD(elsewhere.parameters(), lr=0.1, momentum=0.9)
    assert phvd.flush_into(plain, saved, elsewhere.named_parameters()) == 1
    for (name, p), q in zip(model.named_parameters(), elsewhere.parameters()):
        assert torch.equal(p, q), f"flush_into: {name} differs from flush()"
    plain.load_state_dict(opt.state_dict())
    again = wrap(fresh(MLP), 2, None)
    again.load_state_dict(opt.state_dict())

    accumulating = wrap(model, 1, backward_passes_per_step=2)
    accumulating.zero_grad()
    F.cross_entropy(model(x), y).backward()
    warns("backward_passes_per_step=2", accumulating.step)

    opt1 = wrap(model, 1)
    opt1.zero_grad()
    F.cross_entropy(model(x), y).backward()
    raises(RuntimeError, "computed again after backward() had averaged",
           lambda: F.cross_entropy(model(x), y).backward())
    opt1.zero_grad()                             # discards the average, as DDP would
    F.cross_entropy(model(x), y).backward()
    opt1.step()


def check_habits():
    """An LR scheduler built on the optimizer before wrapping it (a common order; its
    step-counting wrapper was bound to the original and stepped it instead): matches the
    oracle at K=1 and K=2 under the default lookahead, with no warning."""
    size = phvd.size()
    for depth in (1, 2):
        model, ref = fresh(MLP), fresh(MLP)
        inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(inner, step_size=4, gamma=0.5)
        opt = phvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                        pipeline_depth=depth)
        with warnings.catch_warnings():
            warnings.simplefilter("error")       # nor "scheduler before optimizer" warnings
            train(model, opt, data_for(), scheduler=sched)
        opt.flush()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        oracle.reference(ref, ref_opt, F.cross_entropy, data_for(), size, STEPS,
                         1 if size == 1 else depth, 0,
                         scheduler=torch.optim.lr_scheduler.StepLR(ref_opt, step_size=4,
                                                                  gamma=0.5),
                         compensation="lookahead")
        assert_close(model, ref, f"StepLR built before wrapping, K={depth}")
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]


def check_errors_inside_step():
    """Last: these raise with reductions in flight."""
    size = phvd.size()
    (x, y), = data_for()(phvd.rank(), 0)
    model = fresh(MLP)
    opt = wrap(model, 2)
    for t in range(3):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        clip(list(model.parameters()))
        if size == 1:                            # one process: nothing sent, the edit applies
            opt.step()
            continue
        raises(RuntimeError, "changed between backward() and step()", opt.step)
        break
    if size > 1:
        model = fresh(MLP)
        opt = wrap(model, 2)
        model.double()
        raises(RuntimeError, "when the DistributedOptimizer was wrapped",
               lambda: F.cross_entropy(model(x.double()), y).backward())

        class Embed(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(10, 4, sparse=phvd.rank() == 0)

            def forward(self, i):
                return self.emb(i).sum()
        embed = Embed()
        opt = phvd.DistributedOptimizer(torch.optim.SGD(embed.parameters(), lr=0.1),
                                        named_parameters=embed.named_parameters())
        embed(torch.tensor([1, 2])).backward()
        raises(ValueError, "is sparse on rank 0 but dense on rank 1", opt.step)

        # Another optimizer class per rank: refused at the first step on every rank, as no
        # broadcast can make them one.
        model = fresh(MLP)
        other = (torch.optim.SGD(model.parameters(), lr=0.1) if phvd.rank() == 0
                 else torch.optim.Adam(model.parameters(), lr=0.1))
        opt = phvd.DistributedOptimizer(other, named_parameters=model.named_parameters())
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        raises(ValueError, "the optimizer differs between ranks: it is torch.optim.adam.Adam "
               "on rank 1 but torch.optim.sgd.SGD on rank 0", opt.step)


def check_all():
    """hardening_worker.py's `misuse` case, the last of its launch."""
    check_grad_edits_at_depth_one()
    check_weight_edits_between_steps()
    check_options_and_models()
    check_calls()
    check_habits()
    check_errors_inside_step()
