"""Staleness compensation (pipeline/staleness.py): oracle math on real ranks, bad input."""
import inspect
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import oracle
import pipe_horovod.torch as phvd
import shared_launches
from pipe_horovod.pipeline import staleness
from pipe_horovod.torch import compensation as compensation_module
from tolerance import fan_ins, relative_error, training_rtol

pytestmark = pytest.mark.timeout(600)   # the shared launches run the optimizer's cases too


@pytest.fixture
def local():
    phvd.init("local")
    yield
    phvd.shutdown()


# staleness_worker's checks (every option named explicitly) and optimizer_worker's feature
# and process-set checks under the default option (default-MODE) run in optimizer_worker's
# shared launches (tests/shared_launches.py): one process, both engines, 2 and 3 ranks.
@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return shared_launches.optimizer_folder(tmp_path_factory)


@pytest.mark.parametrize("engine_name, np", [("horovod", 2), ("torch", 3), ("local", 1)])
def test_every_option_matches_its_oracle_and_resumes_exactly(folder, engine_name, np):
    shared_launches.optimizer_case(folder, engine_name, np, "staleness")


@pytest.mark.parametrize("engine_name, np, mode", [("horovod", 2, "features"),
                                                   ("torch", 3, "process-set")])
def test_the_default_keeps_every_feature_exact(folder, engine_name, np, mode):
    """The optimizer's feature checks (frozen and rank-local parameters, accumulation,
    bucket groups, LR scheduler, GradScaler overflow, process sets) under the default
    option, against the oracle computing that option's math."""
    shared_launches.optimizer_case(folder, engine_name, np, f"default-{mode}")


def test_the_default_is_lookahead():
    assert staleness.DEFAULT == "lookahead"
    default = inspect.signature(phvd.DistributedOptimizer).parameters["staleness_compensation"]
    assert default.default == staleness.DEFAULT


def _train(opt, model, steps=12, flush=True, start=0):
    for t in range(start, steps):
        g = torch.Generator().manual_seed(t)
        x, y = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    if flush:
        opt.flush()


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


# A predivide factor of 2 (exact in floating point) sends one process's gradients
# through the engine, so the pipeline and the predictions run as on many ranks.
THROUGH_THE_PIPELINE = {"gradient_predivide_factor": 2.0}


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("path", ["alone", "through the pipeline"])
def test_lookahead_on_one_rank_is_synchronous_sgd(local, kind, depth, path):
    # With one rank its own gradient is the average: the predicted point is exactly
    # the weights the delayed update will be applied to, so K>=2 equals K=1 bit for bit.
    # Alone (nothing to send) the optimizer takes that update at once instead.
    weights = []
    extra = THROUGH_THE_PIPELINE if path != "alone" else {}
    for k, compensation in ((1, None), (depth, "lookahead")):
        model = _model()
        base = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if kind == "sgd"
                else torch.optim.Adam(model.parameters(), lr=0.01))
        opt = phvd.DistributedOptimizer(base, pipeline_depth=k,
                                        staleness_compensation=compensation, **extra)
        _train(opt, model, steps=11, flush=False)
        if compensation:
            assert len(opt._fifo) == (0 if path == "alone" else depth - 1)
            # the last step's prediction waits for the next forward pass
            assert (opt in compensation_module._due) == (path != "alone")
            # what the timing model charges the pipelined step (alone: no prediction runs)
            assert (opt.timings["compensation_s"] > 0) == (path != "alone")
        else:
            assert opt.timings["compensation_s"] == 0.0
        opt.flush()
        weights.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*weights):
        assert torch.equal(a, b)


def test_a_checkpoint_with_gradients_in_flight_resumes_alone(local):
    # Saved where gradients were in flight (here: through the pipeline), loaded by one
    # process alone, which applies them at its next step: the same numbers as K=1.
    def run(resume_alone):
        model = _model()
        opt = phvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1,
                                                        momentum=0.9), pipeline_depth=3,
                                        **THROUGH_THE_PIPELINE)
        _train(opt, model, steps=5, flush=False)
        if resume_alone:
            state = {"model": model.state_dict(), "opt": opt.state_dict()}
            assert len(state["opt"]["pipe_horovod"]["in_flight"]) == 2
            model = _model()
            opt = phvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1,
                                                            momentum=0.9), pipeline_depth=3)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
        _train(opt, model, steps=9, start=5)
        return [p.detach().clone() for p in model.parameters()]
    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("compensation", [None, "lookahead"])
def test_step_hooks_run_once_per_step(local, compensation):
    # torch wraps the user's class's step and ours with the hook runner: once per
    # step() call, not again for the wrapped step nor for a prediction's steps.
    model = _model()
    opt = phvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                    pipeline_depth=2, staleness_compensation=compensation,
                                    **THROUGH_THE_PIPELINE)
    calls = []
    opt.register_step_post_hook(lambda *_: calls.append(1))
    _train(opt, model)
    # 12 step() calls (the first applies nothing) + 1 step flush() applies.
    assert len(calls) == 13, "one hook call per step, none for the predictions"


@pytest.mark.parametrize("compensation", ["predict", "lookahead"])
def test_flush_mid_run_puts_the_real_weights_back(local, compensation):
    # Evaluation after flush() must see the real weights, not the predicted ones,
    # and training goes on from them as the oracle (flushing at the same step) does.
    model, ref = _model(), _model()
    opt = phvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                    pipeline_depth=2, staleness_compensation=compensation,
                                    **THROUGH_THE_PIPELINE)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)

    def data(rank, step):
        g = torch.Generator().manual_seed(step)
        return [(torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g))]
    _train(opt, model, steps=7)                  # ends with flush()
    oracle.reference(ref, ref_opt, F.cross_entropy, data, 1, 7, 2, 0, compensation=compensation)
    assert not opt._predicted
    rtol = training_rtol(steps=7, fan_ins=fan_ins(ref), batch=6, ranks=1, optimizer="momentum",
                         predicted=1)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert relative_error(a, b) <= rtol


@pytest.mark.parametrize("value, error, text", [
    ("lookahed", ValueError, "one of lookahead, predict, dc, momentum"),
    (True, TypeError, "must be None or a string"),
])
def test_unknown_option_is_named(local, value, error, text):
    model = _model()
    with pytest.raises(error, match=text):
        phvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  staleness_compensation=value)


@pytest.mark.parametrize("value, compensation, error, text", [
    ("int2", "lookahead", ValueError, "prediction_exchange must be None, 'auto' or one of "
                                      "int4, int8; got 'int2'"),
    (4, "lookahead", TypeError, "prediction_exchange must be None or a string, got int"),
    ("int4", None, ValueError, "it needs staleness_compensation='lookahead', got None"),
    ("int4", "dc", ValueError, "it needs staleness_compensation='lookahead', got 'dc'"),
])
def test_a_bad_prediction_exchange_is_named(local, value, compensation, error, text):
    model = _model()
    with pytest.raises(error, match=re.escape(text)):
        phvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  staleness_compensation=compensation,
                                  prediction_exchange=value)


@pytest.mark.parametrize("compensation, resolved", [("lookahead", "int4"), (None, None),
                                                     ("dc", None), ("momentum", None)])
def test_auto_exchange_is_int4_where_lookahead_predicts(compensation, resolved):
    """"auto" (the Keras default) needs no lookahead to be valid: without one it is off."""
    assert staleness.check_prediction_exchange("auto", compensation) == resolved


@pytest.mark.parametrize("make", [lambda ps: torch.optim.SGD(ps, lr=0.1),
                                  lambda ps: torch.optim.Adagrad(ps, lr=0.1)])
def test_momentum_option_needs_momentum(local, make):
    model = _model()
    with pytest.raises(ValueError, match="has none in param_groups\\[0\\]"):
        phvd.DistributedOptimizer(make(model.parameters()), staleness_compensation="momentum")
