"""Gradients as views of the flat buckets at synchronous steps (DDP's gradient_as_bucket_view).

In one process a gradient predivide factor of 2 (exact in floating point) sends the
gradients through the engine, so the buckets fill as on many ranks. The oracles: the
plain optimizer, bit for bit (one rank's average is its own gradient); the tensor census
at the busiest point of the step, the moment backward's last gradient is final, in units
of the parameters' bytes; and where each `.grad` lives.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pipe_horovod.torch as phvd
from pipe_horovod.tools.bench.memory_worker import live_bytes, watch_the_peak
from tests.tolerance import fan_ins, relative_error, training_rtol

THROUGH_THE_PIPELINE = {"gradient_predivide_factor": 2.0}
CPU = torch.device("cpu")
OPTIMIZERS = {"sgd-momentum": (lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9), 1),
              "adamw": (lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1), 2)}


@pytest.fixture(autouse=True)
def local():
    phvd.init("local")
    yield
    phvd.shutdown()


def _model(sparse=False):
    torch.manual_seed(0)
    layers = [nn.Linear(64, 64) for _ in range(6)]
    if sparse:
        return nn.ModuleDict({"embedding": nn.Embedding(20, 64, sparse=True),
                              "body": nn.Sequential(*layers)})
    return nn.Sequential(*layers)


def _loss(model, t):
    g = torch.Generator().manual_seed(t)
    if isinstance(model, nn.ModuleDict):
        x = model["embedding"](torch.randint(0, 20, (8,), generator=g))
        return model["body"](x).square().mean()
    return F.mse_loss(model(torch.randn(8, 64, generator=g)), torch.randn(8, 64, generator=g))


def _peak(kind, wrap, steps=4):
    """The census when backward's last gradient is final, before anything of ours handles
    it (`pipe-horovod memory`'s hooks, registered before wrapping, run first), at the last
    of `steps` K=1 steps, minus what was live before training; and that last gradient's
    share."""
    model = _model()
    params = list(model.parameters())
    make, _ = OPTIMIZERS[kind]
    peak = watch_the_peak(model, CPU)
    opt = make(params)
    if wrap:
        opt = phvd.DistributedOptimizer(opt, pipeline_depth=1, **THROUGH_THE_PIPELINE)
    before = live_bytes(CPU)
    for t in range(steps):
        peak["now"] = t == steps - 1
        opt.zero_grad()
        _loss(model, t).backward()
        opt.step()
    size = sum(p.numel() * p.element_size() for p in params)
    return (peak["bytes"] - before) / size, peak["last"] / size


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_k1_peaks_where_the_plain_optimizer_does(kind):
    # The plain optimizer: its gradients (1) and state. Ours at K=1 keeps each gradient in
    # its bucket as backward finishes it, so only the last one (not yet moved) lives beside
    # the buckets: the plain optimizer's peak plus that one layer, not plus a whole copy.
    plain, _ = _peak(kind, wrap=False)
    # (beside them: the batch, 4 KiB, and AdamW's step counters, 0.04 of the parameters)
    assert plain == pytest.approx(1 + OPTIMIZERS[kind][1], abs=0.05)
    ours, last = _peak(kind, wrap=True)
    assert ours == pytest.approx(plain + last, abs=1e-6)
    assert last < 0.2                                # one of 12 tensors: not a whole copy


def _train(depth, steps=5, set_to_none=True, clip=None, sparse=False, wrap=True, check=None):
    model = _model(sparse)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if wrap:
        opt = phvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                        pipeline_depth=depth, **THROUGH_THE_PIPELINE)
    for t in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        _loss(model, t).backward()
        if check is not None and t >= 1:     # (step 0's buckets are replanned at its end, in
            check(opt, model)                # the order backward agreed on: new buffers)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
    if wrap:
        opt.flush()
    return [p.detach().clone() for p in params]


def _views_a_bucket(opt, grad):
    flats = list(opt._machine._buffers.values())
    return any(f.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr()
               for f in flats)


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("clip", [None, 0.05])
def test_k1_is_the_plain_optimizer_bit_for_bit(set_to_none, clip):
    """zero_grad either way, and clipping after backward (it applies to the average, as
    with DDP): the same weights as the plain optimizer's, every `.grad` a bucket's view."""
    def every_grad_views_a_bucket(opt, model):
        assert all(_views_a_bucket(opt, p.grad) for p in model.parameters())

    ours = _train(1, set_to_none=set_to_none, clip=clip, check=every_grad_views_a_bucket)
    plain = _train(1, set_to_none=set_to_none, clip=clip, wrap=False)
    assert all(torch.equal(a, b) for a, b in zip(ours, plain))


def test_a_gradient_on_the_wire_is_never_a_view():
    """K=2: after backward `.grad` is this rank's own gradient, intact, while its bucket is
    reduced in place; only the warm-up's synchronous step moves it into the bucket."""
    def own_gradient_kept(opt, model):
        fifo = opt._machine.fifo
        synchronous = fifo.threshold(fifo.steps) == 1
        for name, p in model.named_parameters():
            on_the_wire = opt._machine.part(name)        # this step's bucket
            same = p.grad.untyped_storage().data_ptr() == on_the_wire.untyped_storage().data_ptr()
            assert same == synchronous, (name, fifo.steps)

    model = _model()
    opt = phvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                    named_parameters=model.named_parameters(),
                                    pipeline_depth=2, warmup_steps=2,
                                    staleness_compensation=None, **THROUGH_THE_PIPELINE)
    for t in range(4):
        opt.zero_grad()
        _loss(model, t).backward()
        if t >= 1:
            own_gradient_kept(opt, model)
        opt.step()


def test_sparse_gradients_stay_apart():
    def sparse_kept(opt, model):
        assert model["embedding"].weight.grad.is_sparse
        assert all(_views_a_bucket(opt, p.grad) for p in model["body"].parameters())

    ours = _train(1, sparse=True, check=sparse_kept)
    plain = _train(1, sparse=True, wrap=False)
    # A sparse gradient travels as its rows and is summed again on arrival (in another
    # order than autograd's coalescing): within the rounding of that training.
    rtol = training_rtol(steps=5, fan_ins=fan_ins(_model(sparse=True)), batch=8, ranks=1,
                         optimizer="momentum")
    assert max(relative_error(a, b) for a, b in zip(ours, plain)) <= rtol


def test_a_grad_the_user_replaces_is_what_step_applies():
    """K=1: a `.grad` replaced after backward (a new tensor, not the bucket's view) is what
    step() applies, as with DDP and the plain optimizer."""
    def halve(opt, model):
        for p in model.parameters():
            p.grad = p.grad * 0.5

    def train(wrap):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        if wrap:
            opt = phvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                            pipeline_depth=1, **THROUGH_THE_PIPELINE)
        for t in range(4):
            opt.zero_grad()
            _loss(model, t).backward()
            halve(opt, model)
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(train(True), train(False)))
