"""The one-pass prediction (torch/lookahead.py) of every kernel flavour of SGD, Adam and AdamW
against its oracle: stepping a deep copy of the optimizer with its own kernel.

Plain, foreach and capturable groups are predicted with torch's own operations in its own
order: bit for bit. Fused groups run torch's fused kernel, which computes the same formula
per element in its own order: within the rounding of two evaluations of the rule,
2 * gamma_n (tests/tolerance.py) of n = the rule's rounded operations per element,
relative to the largest weight (the prediction is w minus an update no larger than w here).
capturable=True steps only on accelerators in torch; its kernel's arithmetic is
device-independent, so the oracle runs it on CPU with torch's device check widened.
"""
import copy
import importlib
import warnings

import pytest
import torch

import pipe_horovod.torch as phvd
from pipe_horovod.torch import lookahead
from tests.tolerance import OPTIMIZER_OPS, gamma, relative_error

O = torch.optim
SGD_KINDS = {"momentum": dict(momentum=0.9),
             "nesterov-wd": dict(momentum=0.9, nesterov=True, weight_decay=0.01),
             "dampening-maximize": dict(momentum=0.9, dampening=0.3, maximize=True)}
ADAM_KINDS = {"adam": (O.Adam, dict(lr=0.01)),
              "adam-amsgrad-wd": (O.Adam, dict(lr=0.01, amsgrad=True, weight_decay=0.1)),
              "adamw": (O.AdamW, dict(lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)),
              "adamw-amsgrad-maximize": (O.AdamW, dict(lr=0.01, amsgrad=True, maximize=True))}
FLAVOURS = {"plain": dict(foreach=False), "foreach": dict(foreach=True),
            "fused": dict(fused=True), "capturable": dict(capturable=True, foreach=False),
            "capturable-foreach": dict(capturable=True, foreach=True)}
CASES = ([(f"sgd-{k}-{f}", O.SGD, dict(lr=0.1, **kw, **fl), "momentum")
          for k, kw in SGD_KINDS.items() for f, fl in FLAVOURS.items() if "capturable" not in f]
         + [(f"{k}-{f}", cls, dict(**kw, **fl), "adamw" if cls is O.AdamW else "adam")
            for k, (cls, kw) in ADAM_KINDS.items() for f, fl in FLAVOURS.items()])


@pytest.fixture(autouse=True)
def capturable_on_cpu(monkeypatch):
    monkeypatch.setattr(importlib.import_module("torch.optim.adam"),
                        "_get_capturable_supported_devices",
                        lambda *a, **k: ["cpu", "cuda"])


def _model():
    g = torch.Generator().manual_seed(0)
    # one parameter larger than a piece (set small below), one strided (not contiguous)
    return [torch.nn.Parameter(torch.randn(*shape, generator=g))
            for shape in ((40, 30), (17,), (6, 5))]


def _grads(t, params):
    g = torch.Generator().manual_seed(100 + t)
    return [torch.randn(p.shape, generator=g) for p in params]


# (Adam's first prediction, before it has state, steps instead: SGD's only)
RUNS = [(c, False) for c in CASES] + [(c, True) for c in CASES if c[1] is O.SGD]


@pytest.mark.parametrize("case, first", RUNS,
                         ids=[c[0] + ("-first" if f else "") for c, f in RUNS])
def test_prediction_equals_stepping_a_copy(case, first, monkeypatch):
    name, cls, options, ops = case
    monkeypatch.setattr(lookahead, "_PIECE", 256)
    monkeypatch.setattr(lookahead, "_BATCH", 600)
    params = _model()
    opt = cls(params, **options)
    for t in range(0 if first else 3):
        for p, g in zip(params, _grads(t, params)):
            p.grad = g
        opt.step()
    grads = _grads(9, params)
    oracle = copy.deepcopy(opt)
    for p, g in zip((p for grp in oracle.param_groups for p in grp["params"]), grads):
        p.grad = g.clone()
    oracle.step()
    want = [p.detach() for grp in oracle.param_groups for p in grp["params"]]
    before = copy.deepcopy(opt.state_dict())
    real = [p.detach().clone() for p in params]
    owned = {p: g.clone() for p, g in zip(params, grads)}
    predicted = lookahead.predict(cls, opt.param_groups, opt.state, owned)
    assert predicted is not None, f"{name}: no one-pass prediction"
    for p, r in zip(params, real):
        assert torch.equal(p.detach(), r)                # the real weights untouched
    after = opt.state_dict()
    for key, st in before["state"].items():              # and the state
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(after["state"][key][k]), torch.as_tensor(v))
    for p, w in zip(params, want):
        if options.get("fused"):
            assert relative_error(predicted[p], w) <= 2 * gamma(OPTIMIZER_OPS[ops],
                                                                torch.float32), name
        else:
            assert torch.equal(predicted[p], w), f"{name}: not bit-exact"


def test_device_rules_read_step_as_a_tensor_without_a_host_read(monkeypatch):
    # capturable/fused keep `step` on the device: the rule computes the bias corrections
    # with tensor arithmetic; a float() or .item() on it would wait for the device.
    params = _model()
    opt = O.AdamW(params, lr=0.01, capturable=True)
    for p, g in zip(params, _grads(0, params)):
        p.grad = g
    opt.step()

    class NoHostRead(torch.Tensor):
        def __float__(self):
            raise AssertionError("step read on the host")
        item = __float__

    for st in opt.state.values():
        st["step"] = st["step"].as_subclass(NoHostRead)
    owned = {p: g for p, g in zip(params, _grads(1, params))}
    assert lookahead.predict(O.AdamW, opt.param_groups, opt.state, owned) is not None


@pytest.mark.parametrize("make, named", [
    (lambda ps: O.Adam([{"params": ps[:1]}, {"params": ps[1:], "lr": torch.tensor(0.01)}],
                       lr=0.01, capturable=True),
     "Adam param group 1 (tensor lr)"),
    (lambda ps: O.Adagrad(ps, lr=0.1), "Adagrad has no one-pass rule"),
])
def test_a_group_without_an_exact_rule_warns_once_naming_it_and_the_fallback(make, named):
    phvd.init("local")
    try:
        params = _model()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            phvd.DistributedOptimizer(make(params), pipeline_depth=2,
                                      gradient_predivide_factor=2.0)
        said = [str(w.message) for w in caught if "no one-pass prediction" in str(w.message)]
        assert len(said) == 1, said
        assert f"no one-pass prediction for {named} " in said[0]
        assert "falls back to running its step once more on a temporary copy" in said[0]
    finally:
        phvd.shutdown()


def test_differentiable_groups_are_named_with_the_flag():
    params = _model()
    groups = [{"params": params[:1], "differentiable": False, "lr": 0.1},
              {"params": params[1:], "differentiable": True, "lr": 0.1}]
    assert lookahead.fallback(O.SGD, groups) == "SGD param group 1 (differentiable)"
    assert lookahead.fallback(O.SGD, groups[:1]) is None
