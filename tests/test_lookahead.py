"""The lookahead prediction (torch/lookahead.py) for every torch.optim optimizer, in one process.

With one rank its own gradient is the average, so the prediction is exactly the
update the pipeline applies a step later: K=2 with "lookahead" must equal K=1 bit
for bit (as tests/oracle.py's reference says for one rank). A gradient predivide
factor of 2 (exact in floating point) sends the one process's gradients through the
engine, so the FIFO, the kept gradients and the prediction run as on many ranks.
Whatever the optimizer, its flags or its gradients (sparse, GradScaler-scaled),
that equality is the oracle (fused groups: within rounding, as their kernel's order
allows); the few that cannot run are refused at wrap time.
"""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pipe_horovod.torch as phvd
from pipe_horovod.tools.bench.memory_worker import live_bytes
from pipe_horovod.torch import lookahead
from tests.tolerance import fan_ins, relative_error, training_rtol

THROUGH_THE_PIPELINE = {"gradient_predivide_factor": 2.0}
STEPS = 7
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def local():
    phvd.init("local")
    yield
    phvd.shutdown()


class Net(nn.Module):
    """Dense layers, and an embedding that is sparse where the optimizer needs it."""

    def __init__(self, sparse=False, embedding=True):
        super().__init__()
        self.embedding = nn.Embedding(20, 8, sparse=sparse) if embedding else None
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, tokens, x):
        if self.embedding is not None:
            x = x + self.embedding(tokens)
        return self.body(x)


class Centered(torch.optim.SGD):
    """A user's subclass with its own state: SGD on the gradient minus its running mean."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                mean = state.setdefault("mean", torch.zeros_like(p))
                mean.mul_(0.5).add_(p.grad, alpha=0.5)
                p.add_(p.grad - 0.5 * mean, alpha=-group["lr"])
        return None


def _batch(t):
    g = torch.Generator().manual_seed(t)
    return (torch.randint(0, 20, (6,), generator=g), torch.randn(6, 8, generator=g),
            torch.randint(0, 4, (6,), generator=g))


O = torch.optim
# name -> (make(params), Net options). The one-pass rules and every fallback.
OPTIMIZERS = {
    "sgd": (lambda ps: O.SGD(ps, lr=0.1), {}),
    "sgd-momentum": (lambda ps: O.SGD(ps, lr=0.1, momentum=0.9), {}),
    "sgd-nesterov-wd-maximize": (lambda ps: O.SGD(ps, lr=0.1, momentum=0.9, nesterov=True,
                                                  weight_decay=0.01, maximize=True), {}),
    "sgd-dampening-wd": (lambda ps: O.SGD(ps, lr=0.1, momentum=0.9, dampening=0.3,
                                          weight_decay=0.01), {}),
    "sgd-dampening-foreach": (lambda ps: O.SGD(ps, lr=0.1, momentum=0.9, dampening=0.3,
                                               foreach=True), {}),
    "sgd-fused": (lambda ps: O.SGD(ps, lr=0.1, momentum=0.9, fused=True), {}),
    "sgd-sparse": (lambda ps: O.SGD(ps, lr=0.1), {"sparse": True}),
    "adam": (lambda ps: O.Adam(ps, lr=0.01), {}),
    "adam-amsgrad-wd-maximize": (lambda ps: O.Adam(ps, lr=0.01, amsgrad=True, weight_decay=0.1,
                                                   maximize=True), {}),
    "adam-foreach": (lambda ps: O.Adam(ps, lr=0.01, foreach=True), {}),
    "adam-fused": (lambda ps: O.Adam(ps, lr=0.01, fused=True), {}),
    "adamw": (lambda ps: O.AdamW(ps, lr=0.01, betas=(0.9, 0.95), weight_decay=0.1), {}),
    "adamw-amsgrad-foreach": (lambda ps: O.AdamW(ps, lr=0.01, amsgrad=True, foreach=True), {}),
    "adamax": (lambda ps: O.Adamax(ps, lr=0.01, weight_decay=0.01), {}),
    "nadam": (lambda ps: O.NAdam(ps, lr=0.01, decoupled_weight_decay=True,
                                 weight_decay=0.01), {}),
    "radam": (lambda ps: O.RAdam(ps, lr=0.01, foreach=True), {}),
    "adagrad": (lambda ps: O.Adagrad(ps, lr=0.1, lr_decay=0.01), {}),
    "adagrad-sparse": (lambda ps: O.Adagrad(ps, lr=0.1), {"sparse": True}),
    "adadelta": (lambda ps: O.Adadelta(ps, lr=1.0, maximize=True), {}),
    "rmsprop": (lambda ps: O.RMSprop(ps, lr=0.01, momentum=0.5, centered=True), {}),
    "rprop": (lambda ps: O.Rprop(ps, lr=0.01), {}),
    "asgd": (lambda ps: O.ASGD(ps, lr=0.01, t0=2), {}),
    "sparse-adam": (lambda ps: O.SparseAdam(ps, lr=0.01), {"sparse": True, "only": "embedding"}),
    "adafactor": (lambda ps: O.Adafactor(ps, lr=0.01), {}),
    "subclass": (lambda ps: Centered(ps, lr=0.1), {}),
}
if hasattr(O, "Muon"):
    OPTIMIZERS["muon"] = (lambda ps: O.Muon(ps, lr=0.01), {"embedding": False, "only": "2d"})
# differentiable=True is left out: its step works on non-leaf parameters only (torch
# raises for a model's leaves, wrapped or not).
ONE_PASS = {"sgd", "sgd-momentum", "sgd-nesterov-wd-maximize", "sgd-dampening-wd",
            "sgd-dampening-foreach", "sgd-fused", "adam",
            "adam-amsgrad-wd-maximize", "adam-foreach", "adam-fused", "adamw",
            "adamw-amsgrad-foreach"}
# Predicted in one pass by the formula torch's fused kernel evaluates in its own order:
# within rounding of it (tests/test_lookahead_flavours.py), so K=2 follows K=1 within the
# rounding of training (the gradient is taken at weights an ulp or so apart).
FUSED = {"sgd-fused", "adam-fused"}


def _same(name, got, want):
    if name not in FUSED:
        return torch.equal(got, want)
    rtol = training_rtol(steps=STEPS, fan_ins=fan_ins(Net()), batch=6, ranks=1,
                         optimizer="adam" if name.startswith("adam") else "momentum",
                         predicted=1)
    return relative_error(got, want) <= rtol


def _params(model, only):
    if only == "embedding":
        return model.embedding.parameters()
    if only == "2d":
        return [p for p in model.parameters() if p.dim() == 2]
    return model.parameters()


def _train(name, depth, compensation, scaler=False):
    make, options = OPTIMIZERS[name]
    options = dict(options)
    only = options.pop("only", None)
    torch.manual_seed(0)
    model = Net(**options)
    if only is not None:                         # the rest stays where it is
        for p in model.parameters():
            p.requires_grad_(False)
        for p in _params(model, only):
            p.requires_grad_(True)
    base = make([p for p in _params(model, only)])
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4) if scaler else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = phvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                        pipeline_depth=depth, staleness_compensation=compensation,
                                        grad_scaler=grad_scaler, **THROUGH_THE_PIPELINE)
    stepped = []
    real_stepped = lookahead.stepped
    lookahead.stepped = lambda *a: (stepped.append(1), real_stepped(*a))
    try:
        for t in range(STEPS):
            tokens, x, y = _batch(t)
            opt.zero_grad()
            loss = F.cross_entropy(model(tokens, x), y)
            if grad_scaler is None:
                loss.backward()
                opt.step()
            else:                                # Horovod's AMP pattern
                grad_scaler.scale(loss).backward()
                opt.synchronize()
                grad_scaler.unscale_(opt)
                with opt.skip_synchronize():
                    grad_scaler.step(opt)
                grad_scaler.update()
        opt.flush()
    finally:
        lookahead.stepped = real_stepped
    warned = [str(w.message) for w in caught if "no one-pass prediction" in str(w.message)]
    return [p.detach().clone() for p in model.parameters()], warned, len(stepped)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_lookahead_matches_its_reference_for_every_optimizer(name):
    sync, _, _ = _train(name, 1, None)
    ahead, warned, stepped = _train(name, 2, "lookahead")
    for a, b in zip(sync, ahead):
        assert _same(name, a, b), f"{name}: lookahead at K=2 differs from its reference"
    if name == "sgd-sparse":                     # a rule, but not for sparse gradients
        assert not warned and stepped == STEPS - 1
    elif name in ONE_PASS:
        assert not warned, warned
        # the first prediction (Adam: before any state exists) steps; the others do not
        assert stepped <= (1 if name.startswith("adam") else 0)
    else:
        assert len(warned) == 1, warned          # once, at wrap time, naming it
        # one prediction per step, made at the next forward: none after the last step
        assert stepped == STEPS - 1


@pytest.mark.parametrize("name", sorted(ONE_PASS))
def test_one_pass_in_pieces_and_batches_matches_too(name, monkeypatch):
    # Parameters larger than a piece of the per-tensor rules' temporaries and groups larger
    # than a batch of the multi-tensor ones: computed elementwise, the same numbers.
    monkeypatch.setattr(lookahead, "_PIECE", 48)
    monkeypatch.setattr(lookahead, "_BATCH", 100)
    sync, _, _ = _train(name, 1, None)
    ahead, _, _ = _train(name, 2, "lookahead")
    for a, b in zip(sync, ahead):
        assert _same(name, a, b), f"{name}: lookahead in pieces differs from its reference"


def test_the_prediction_swaps_storage_and_leaves_the_real_weights_in_place():
    # One pass: the parameters take the prediction's storage at the forward pass and give
    # it back in step(); the real weights are never copied, so a reference to them taken
    # between steps keeps reading the real weights.
    torch.manual_seed(0)
    model = Net(embedding=False)
    opt = phvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01),
                                    named_parameters=model.named_parameters(),
                                    **THROUGH_THE_PIPELINE)
    weight = model.body[0].weight
    for t in range(4):
        tokens, x, y = _batch(t)
        opt.zero_grad()
        real_storage, real = weight.data, weight.detach().clone()
        out = model(tokens, x)                   # the prediction is made here
        if t >= 2:                               # (t=1: AdamW has no state yet, it steps)
            assert weight.data_ptr() != real_storage.data_ptr()
            assert not torch.equal(weight.detach(), real)
            assert torch.equal(real_storage, real)   # the real weights, where they were
        F.cross_entropy(out, y).backward()
        opt.step()
        if t >= 2:                               # the real weights back, then updated
            assert weight.data_ptr() == real_storage.data_ptr()
    opt.flush()


@pytest.mark.parametrize("name", ["sgd-momentum", "adamw"])
def test_gradscaler_scaled_gradients_predict_exactly(name):
    sync, _, _ = _train(name, 1, None, scaler=True)
    ahead, _, _ = _train(name, 2, "lookahead", scaler=True)
    for a, b in zip(sync, ahead):
        assert torch.equal(a, b)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_lbfgs_is_refused_at_wrap_time(depth):
    model = Net()
    with pytest.raises(TypeError, match="LBFGS .* first-order optimizer"):
        phvd.DistributedOptimizer(torch.optim.LBFGS(model.parameters()), pipeline_depth=depth)


def _live_after(kind, depth, compensation, wrap=True):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 256))
    params = list(model.parameters())
    base = (torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1) if kind == "adamw"
            else torch.optim.SGD(params, lr=0.01, momentum=0.9))
    opt = base if not wrap else phvd.DistributedOptimizer(
        base, pipeline_depth=depth, staleness_compensation=compensation,
        **THROUGH_THE_PIPELINE)
    x = torch.randn(4, 256)
    before = live_bytes(CPU)
    for _ in range(5):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    # The prediction is made at the next forward pass (torch/compensation.py): until then the
    # local gradient it needs is alive too, as it was inside step() before; measure after it.
    model(x)
    after = live_bytes(CPU) - before
    size = sum(p.numel() * p.element_size() for p in params)
    return after / size


@pytest.mark.parametrize("kind, state", [("sgd", 1), ("adamw", 2)])
def test_the_default_lives_at_two_copies_beyond_the_plain_optimizer(kind, state):
    # Live tensors grow by the optimizer's state and the gradients: the plain optimizer
    # keeps `.grad` (1) and its state; the default keeps the applied gradient's bucket
    # (as `.grad`), the one in flight and the real weights: the plain optimizer + 2.
    plain = _live_after(kind, 1, None, wrap=False)
    assert plain == pytest.approx(1 + state, abs=0.01)
    assert _live_after(kind, 2, None) == pytest.approx(plain + 1, abs=0.01)
    assert _live_after(kind, 2, "lookahead") == pytest.approx(plain + 2, abs=0.01)
