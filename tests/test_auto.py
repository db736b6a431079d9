"""tune="auto" (pipeline/auto.py): the decision against hand-computed predictions, the
pins and conflicts at wrap time, the too-short run, and a real launch.

The summaries are built here, as the run record writes them, for one bucket of B bytes
launched at the end of each step's compute C and waited for W (exposed): K=1 measures
C + W, so on a link without latency (alpha 0) the model's ring allreduce of the bucket
on 2 ranks takes W, and a candidate at K=2 with a codec of wire ratio r takes
max(C, r * W) (timing_model: T_2 = max(F + B + U, C_link, (F + L + U) / 2)). Those are
the oracles below; measured_run and timing_model hold the same arithmetic in one place.
"""
import logging
import math
from dataclasses import replace

import pytest
import torch

import launcher
import pipe_horovod.torch as phvd
from pipe_horovod.compression import Compression
from pipe_horovod.pipeline import auto, measured_run
from pipe_horovod.pipeline.auto import Decision, Pins, check_pins, decide, describe
from pipe_horovod.pipeline.measured_run import wire_ratio

INT8 = wire_ratio("int8_ef")            # (1 + 4/256) / 4
INT4_32 = wire_ratio("int4_ef:32")      # (0.5 + 4/32) / 4
INT4_256 = wire_ratio("int4_ef")        # refused by the convergence rule


def summary(compute, wait, nbytes=4_000_000, steps=20, workers=2, codec="none"):
    """A run summary of `steps` synchronous steps: compute, then the one bucket launched,
    then the wait for it (counted, as the record counts it, in the next step)."""
    recorded, reductions, finish = [], [], 1.0
    for step in range(1, steps):
        recorded.append({"step": step, "finished_s": finish, "compute_s": compute,
                         "wait_s": wait})
        reductions.append({"step": step, "bucket": 0, "bytes": nbytes, "launched_s": finish,
                           "landed_s": finish + wait, "wait_s": wait})
        finish += wait + compute
    return {"format": "pipe_horovod.run_summary/1",
            "config": {"pipeline_depth": 1, "compression": codec, "collective": None,
                       "bucket_cap_bytes": 2**25, "workers": workers, "model_bytes": nbytes,
                       "buckets": [[nbytes]]},
            "totals": {}, "steps": recorded, "reductions": reductions}


def chosen(decision):
    return decision.pipeline_depth, decision.compression, decision.bucket_cap_mb


# --- the decision ------------------------------------------------------------------------

def test_compute_bound_stays_at_k1():
    # K=2 would take max(C, W) = 100 ms against 102 measured: 1.02x, under the 5% margin
    d = decide(summary(0.100, 0.002))
    assert chosen(d) == (1, "none", None)
    assert d.reason.startswith("nothing predicted 5% faster")
    assert d.compute_s == pytest.approx(0.100) and d.wait_s == pytest.approx(0.002)


def test_network_bound_chooses_k2_and_the_smallest_codec_the_rule_allows():
    # C = 50 ms, W = 200 ms: K=2 none 200 ms, int8_ef max(50, 0.254 * 200) = 50.8 ms,
    # int4_ef:32 max(50, 0.156 * 200) = 50 ms (int4_ef at 256 ties at 50 but is refused)
    d = decide(summary(0.050, 0.200))
    assert chosen(d) == (2, "int4_ef:32", None)
    assert d.predicted_s == pytest.approx(0.050, rel=1e-6)
    assert d.gain == pytest.approx(0.250 / 0.050, rel=1e-6)
    assert d.link_gbps == pytest.approx(8 * 4_000_000 / 0.200 / 1e9, rel=1e-6)


def test_a_faster_codec_the_convergence_rule_refuses_is_never_chosen():
    # C = 10 ms: int4_ef at blocks of 256 would take 0.129 * 200 = 25.8 ms, faster than
    # int4_ef:32's 31.25 ms, but it missed the transformer target
    assert 0.010 < 0.200 * INT4_256 < 0.200 * INT4_32
    d = decide(summary(0.010, 0.200))
    assert chosen(d) == (2, "int4_ef:32", None)
    assert d.predicted_s == pytest.approx(0.200 * INT4_32, rel=1e-6)


def test_balanced_chooses_k2_without_codec():
    # C = 100 ms, W = 60 ms: every K=2 candidate takes max(100, r * 60) = 100 ms; the tie
    # goes to the fewest bits lost (none) and the run's own buckets
    d = decide(summary(0.100, 0.060))
    assert chosen(d) == (2, "none", None)
    assert d.gain == pytest.approx(0.160 / 0.100, rel=1e-6)


@pytest.mark.parametrize("wait, depth", [(0.004, 1), (0.006, 2)])
def test_the_margin(wait, depth):
    # K=2 predicted 100 ms against 104 (1.04x: stays) or 106 measured (1.06x: goes)
    assert decide(summary(0.100, wait)).pipeline_depth == depth


def test_k2_is_priced_with_the_prediction_exchange():
    # The Keras default's lookahead sends an int4 exchange of each bucket at K=2, on the
    # same link, before the step's reductions: T_2 = C + x (x: its two-stage allreduce at
    # the calibrated link; timing_model's Schedule with exchange)
    from pipe_horovod.collectives.cost_model import Network
    from pipe_horovod.pipeline.timing_model import two_stage_allreduce

    def exchange_s(d):
        beta = 8 / (d.link_gbps * 1e9)
        return two_stage_allreduce(Network(0.0, beta), 2, 4_000_000, value_bytes=0.5)
    d = decide(summary(0.100, 0.060), Pins(exchange="int4"))
    assert chosen(d) == (2, "none", None)
    assert d.predicted_s == pytest.approx(0.100 + exchange_s(d), rel=1e-9)
    assert d.predicted_s > decide(summary(0.100, 0.060)).predicted_s
    # 1.055x without it (K=2), under the 5% margin with it (K=1 as run)
    assert decide(summary(0.100, 0.0055)).pipeline_depth == 2
    d = decide(summary(0.100, 0.0055), Pins(exchange="int4"))
    assert chosen(d) == (1, "none", None) and d.reason.startswith("nothing predicted 5%")


@pytest.mark.parametrize("compute, wait", [(0.050, 0.200), (0.010, 0.200), (0.100, 0.060)])
def test_auto_chooses_what_plan_from_run_recommends(compute, wait):
    # one table, one model: where the gain passes the margin, the same configuration
    s = summary(compute, wait)
    best, _ = measured_run.recommend(measured_run.candidates(s, measured_run.measure(s))[1])
    assert chosen(decide(s)) == (best.depth, best.codec, best.cap_mb)


def test_pinned_depth_is_honoured():
    # K=1 pinned, network-bound: the codec alone, C + r * W: int4_ef:32 50 + 31.25 ms
    d = decide(summary(0.050, 0.200), Pins(pipeline_depth=1))
    assert chosen(d) == (1, "int4_ef:32", None)
    assert d.predicted_s == pytest.approx(0.050 + 0.200 * INT4_32, rel=1e-6)
    # K=2 pinned, compute-bound: nothing beats K=2 as run by 5%: K=2 stays, no codec
    d = decide(summary(0.100, 0.002), Pins(pipeline_depth=2))
    assert chosen(d) == (2, "none", None) and d.reason


def test_pinned_codec_and_cap_are_honoured():
    # int8_ef pinned (the measured steps ran with it: W is its wire time)
    d = decide(summary(0.050, 0.200, codec="int8_ef"), Pins(compression="int8_ef"))
    assert chosen(d) == (2, "int8_ef", None)
    assert d.predicted_s == pytest.approx(0.200, rel=1e-6)
    d = decide(summary(0.050, 0.200), Pins(bucket_cap_mb=8.0))
    assert chosen(d) == (2, "int4_ef:32", 8.0)


def test_one_rank_and_too_few_steps_stay():
    assert chosen(decide(summary(0.05, 0.2, workers=1))) == (1, "none", None)
    assert decide(summary(0.05, 0.2, steps=2)).reason == "too few steps measured"


def test_the_line_and_the_round_trip():
    # at K=2 int8_ef and int4_ef:32 both hide under the 182 ms of compute: the tie goes
    # to the fewer bits lost; 422 / 182 = 2.32x
    d = decide(summary(0.182, 0.240))
    line = describe(d)
    assert line.startswith("pipe_horovod auto: compute 182 ms, exposed wait 240 ms, link ")
    assert line.endswith("-> K=2 + int8_ef (two-stage), buckets as run: predicted 2.32x "
                         "over K=1"), line
    assert Decision.from_dict(d.as_dict()) == d
    stay = decide(summary(0.100, 0.002))
    assert describe(stay).endswith(f"-> K=1, no codec, buckets as run: {stay.reason}")


# --- the trial: K=2 without codec tried, then kept or undone by its own steps -----------

def trial_steps(first, step_s, count=6):
    """Recorded steps `first`.. of `step_s` each (compute, no wait: a K=2 step)."""
    return [{"step": first + i, "finished_s": 100.0 + i * step_s, "compute_s": step_s,
             "wait_s": 0.0} for i in range(count)]


def test_a_gain_under_the_margin_is_tried_where_the_adapter_can_go_back():
    # 100 + 3 ms measured, K=2 predicted 100: 1.03x, under MARGIN, over TRIAL_MARGIN
    measured = summary(0.100, 0.003)
    assert chosen(decide(measured)) == (1, "none", None)
    d = decide(measured, may_try=True)
    assert (chosen(d), d.trying) == ((2, "none", None), True)
    assert d.measured_s == pytest.approx(0.103)
    # under TRIAL_MARGIN nothing is tried
    assert not decide(summary(0.100, 0.001), may_try=True).trying
    assert chosen(decide(summary(0.100, 0.001), may_try=True)) == (1, "none", None)


def test_k2_with_a_codec_is_tried_without_it_then_with_it():
    measured = summary(0.182, 0.240)                    # K=1: 422 ms a step
    d = decide(measured, may_try=True)
    assert (chosen(d), d.trying, d.then_compression) == ((2, "none", None), True, "int8_ef")
    # K=2 alone: max(182, 240) ms predicted
    assert d.trial_predicted_s == pytest.approx(0.240, rel=0.02), d
    assert "trying K=2, no codec, buckets as run for 5 steps, then + int8_ef" in describe(d, 5)
    # it ran as predicted (within TRIAL_TOLERANCE), though it gained little over K=1: the
    # codec's own trial follows, for as many steps
    run = {**measured, "steps": measured["steps"] + trial_steps(20, 0.27)}
    coded = auto.confirm(run, d, 20)
    assert (chosen(coded), coded.trying, coded.then_compression) == ((2, "int8_ef", None),
                                                                     True, None)
    assert (coded.alone_s, coded.measured_s) == (pytest.approx(0.27), pytest.approx(0.422))
    assert Decision.from_dict(coded.as_dict()) == coded
    assert describe(coded, 5).endswith(
        "trying K=2 + int8_ef (two-stage), buckets as run for 5 steps: predicted 2.32x over "
        "K=1; K=2 without it measured 1.56x (270.0 ms a step against 422.0 ms)"), \
        describe(coded, 5)
    # far slower than predicted and than K=1 (K=2 costs what the model misses): undone,
    # no codec ever used
    run = {**measured, "steps": measured["steps"] + trial_steps(20, 0.5)}
    undone = auto.confirm(run, d, 20)
    assert chosen(undone) == (1, "none", None), undone
    assert undone.reason.endswith("240.0 ms predicted before + int8_ef"), undone.reason


@pytest.mark.parametrize("step_s, outcome", [
    (0.19, (2, "int8_ef", None)),        # faster than both by KEEP_MARGIN: the codec stays
    (0.265, (2, "none", None)),          # not 2% faster than K=2 alone (270 ms): K=2 stays
    (0.60, (2, "none", None)),
])
def test_the_codecs_trial_keeps_it_only_where_it_measured_faster(step_s, outcome):
    measured = summary(0.182, 0.240)
    coded = replace(decide(measured, may_try=True), compression="int8_ef",
                    then_compression=None, measured_s=0.422, alone_s=0.27)
    run = {**measured, "steps": measured["steps"] + trial_steps(30, step_s)}
    after = auto.confirm(run, coded, 30)
    assert chosen(after) == outcome and not after.trying, after
    if outcome[1] == "int8_ef":
        assert after.tried_s == pytest.approx(step_s) and not after.reason
        assert describe(after).endswith(f"kept: its trial measured {0.422 / step_s:.2f}x "
                                        f"({step_s * 1e3:.1f} ms a step against 422.0 ms)")
    else:
        assert after.reason == (f"tried K=2 + int8_ef: {step_s * 1e3:.1f} ms a step against "
                                "270.0 ms without it and 422.0 ms at K=1; K=2 without it "
                                "kept"), after.reason


def test_the_codecs_trial_goes_back_to_k1_where_k2_alone_did_not_gain():
    # as on a GPU whose tensors Horovod stages through the host: K=1 65.6 ms, K=2 alone
    # 70.3 (within TRIAL_TOLERANCE of its prediction), K=2 + int4_ef:32 86.4
    measured = summary(0.006, 0.060)
    coded = replace(decide(measured, may_try=True), compression="int4_ef:32",
                    then_compression=None, measured_s=0.0656, alone_s=0.0703)
    run = {**measured, "steps": measured["steps"] + trial_steps(30, 0.0864)}
    after = auto.confirm(run, coded, 30, Pins(bucket_cap_mb=4))
    assert chosen(after) == (1, "none", 4) and not after.trying, after
    assert after.reason == ("tried K=2 + int4_ef:32: 86.4 ms a step against 70.3 ms "
                            "without it and 65.6 ms at K=1"), after.reason
    assert describe(after).endswith("-> K=1, no codec, buckets 4 MiB: " + after.reason)
    assert Decision.from_dict(after.as_dict()) == after


def test_a_pinned_codec_or_depth_is_never_tried():
    assert not decide(summary(0.100, 0.050), Pins(pipeline_depth=2), may_try=True).trying
    d = decide(summary(0.182, 0.240, codec="int8_ef"), Pins(compression="int8_ef"),
               may_try=True)
    assert (chosen(d), d.trying) == ((2, "int8_ef", None), False)


def test_a_trial_is_kept_where_its_steps_measured_faster():
    measured = summary(0.100, 0.050)
    trial = decide(measured, may_try=True)
    assert trial.trying and trial.measured_s == pytest.approx(0.150)
    run = {**measured, "steps": measured["steps"] + trial_steps(20, 0.101)}
    kept = auto.confirm(run, trial, 20)
    assert (chosen(kept), kept.trying) == ((2, "none", None), False)
    # measure() leaves out the trial's first two steps: the median of the other four
    assert kept.tried_s == pytest.approx(0.101)
    line = describe(kept)
    assert line.endswith("predicted 1.50x over K=1, kept: its trial measured 1.49x (101.0 "
                         "ms a step against 150.0 ms)"), line
    assert "trying K=2, no codec, buckets as run for 5 steps" in describe(trial, 5)


@pytest.mark.parametrize("tried", [0.150, 0.148, 0.200])
def test_a_trial_not_keep_margin_faster_is_undone(tried):
    measured = summary(0.100, 0.050)
    trial = decide(measured, may_try=True)
    run = {**measured, "steps": measured["steps"] + trial_steps(20, tried)}
    undone = auto.confirm(run, trial, 20, Pins(bucket_cap_mb=4))
    assert chosen(undone) == (1, "none", 4) and not undone.trying
    assert undone.tried_s == pytest.approx(tried) and undone.measured_s == trial.measured_s
    assert undone.reason == (f"tried K=2, no codec (predicted 1.50x): {tried * 1e3:.1f} ms a "
                             "step against 150.0 ms at K=1")
    assert Decision.from_dict(undone.as_dict()) == undone


def test_a_trial_is_compared_with_the_k1_steps_just_before_it():
    # the first K=1 steps were slow (the run's own warm-up), the last ones not: the trial
    # is measured against the last as many steps as it ran, not the decision's median
    measured = summary(0.100, 0.050)
    for s in measured["steps"][-6:]:
        s["compute_s"], s["wait_s"] = 0.100, 0.0
    trial = decide(summary(0.100, 0.050), may_try=True)
    run = {**measured, "steps": measured["steps"] + trial_steps(20, 0.1005)}
    undone = auto.confirm(run, trial, 20)
    assert chosen(undone) == (1, "none", None) and undone.measured_s == pytest.approx(0.100)
    # a trial resumed from a checkpoint has no K=1 steps before it: the decision's median
    resumed = {**measured, "steps": trial_steps(20, 0.1005)}
    assert chosen(auto.confirm(resumed, trial, 20)) == (2, "none", None)


def test_the_trial_is_due_after_its_steps():
    tuner = auto.Tuner(8)
    assert tuner.trial_steps == auto.MIN_TRIAL_STEPS and auto.Tuner(20).trial_steps == 10
    assert tuner.due(8) and not tuner.due(7)
    tuner.decision, tuner.tried_from = Decision(2, "none", trying=True), 8
    assert not tuner.due(12) and tuner.due(13)
    tuner.decision = Decision(2, "none")
    assert not tuner.due(100)


def test_the_fifo_applies_what_a_lowered_depth_no_longer_holds():
    from pipe_horovod.pipeline.fifo import GradientFifo
    fifo = GradientFifo(2)
    assert fifo.push("g0") == [] and fifo.push("g1") == ["g0"]
    fifo.pipeline_depth = 1
    assert fifo.pop_ready() == ["g1"] and fifo.push("g2") == ["g2"]


# --- pins and conflicts ------------------------------------------------------------------

@pytest.mark.parametrize("options, words", [
    ({"pipeline_depth": 3}, "pipeline_depth=3 with tune='auto': auto chooses K in (1, 2)"),
    ({"compression": "fp16"}, "compression='fp16' with tune='auto': auto chooses only codecs "
                              "that meet the convergence rule (fp16's convergence was not "
                              "measured"),
    ({"compression": "int4_ef"}, "compression='int4_ef' with tune='auto'"),
    ({"warmup_steps": 5}, "warmup_steps=5 with tune='auto': auto trains the first 20 steps "
                          "synchronously"),
    ({"compression": "int8_ef", "collective": "ring"},
     "compression='int8_ef' with collective='ring' and tune='auto'"),
])
def test_conflicting_pins_are_refused_naming_both(options, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        check_pins(20, **options)


def test_pins_auto_can_honour():
    assert check_pins(20, pipeline_depth=2, compression="int8_ef", bucket_cap_mb=8,
                      warmup_steps=30) == Pins(2, "int8_ef", 8, True)
    assert auto.warmup_steps(20, 30) == 30 and auto.warmup_steps(20, 0) == 20


def test_the_argument_and_the_environment(monkeypatch):
    # The default: auto, unless a depth is given (argument or environment); the tape's
    # default (None) stays as given.
    assert auto.resolve_tune(None, False, environ={}) == "auto"
    assert auto.resolve_tune(None, True, environ={}) is None
    assert auto.resolve_tune(None, False, default=None, environ={}) is None
    # The environment decides where the argument is not given, a given depth then pinned.
    for off in ("off", "0", "none", "False"):
        assert auto.resolve_tune(None, False, environ={"PIPE_HOROVOD_TUNE": off}) is None
    assert auto.resolve_tune(None, True, environ={"PIPE_HOROVOD_TUNE": "auto"}) == "auto"
    assert auto.resolve_tune(None, False, default=None,
                             environ={"PIPE_HOROVOD_TUNE": "AUTO"}) == "auto"
    # The argument wins over both.
    assert auto.resolve_tune("auto", True, environ={"PIPE_HOROVOD_TUNE": "off"}) == "auto"
    assert auto.resolve_tune("off", False, environ={"PIPE_HOROVOD_TUNE": "auto"}) is None
    with pytest.raises(ValueError, match="tune must be 'auto', 'off' or None .the default., "
                                         "got 'fast'"):
        auto.resolve_tune("fast", False)
    with pytest.raises(ValueError, match="PIPE_HOROVOD_TUNE must be 'auto' or 'off' .or unset., "
                                         "got 'yes'"):
        auto.resolve_tune(None, False, environ={"PIPE_HOROVOD_TUNE": "yes"})
    assert auto.tune_steps({}) == 20 and auto.tune_steps({"PIPE_HOROVOD_TUNE_STEPS": "8"}) == 8
    with pytest.raises(ValueError, match="PIPE_HOROVOD_TUNE_STEPS must be an integer >= 3"):
        auto.tune_steps({"PIPE_HOROVOD_TUNE_STEPS": "2"})


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


def test_wrap_time_errors_name_both():
    phvd.init("local")
    try:
        model = _model()
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(ValueError, match=r"pipeline_depth=3 with tune='auto'"):
            phvd.DistributedOptimizer(sgd, tune="auto", pipeline_depth=3)
        with pytest.raises(ValueError, match=r"compression='fp16' with tune='auto'"):
            phvd.DistributedOptimizer(sgd, tune="auto", compression=Compression.fp16)
        with pytest.raises(ValueError, match=r"warmup_steps=4 with tune='auto'"):
            phvd.DistributedOptimizer(sgd, tune="auto", warmup_steps=4)
        with pytest.raises(ValueError, match="tune must be 'auto', 'off' or None"):
            phvd.DistributedOptimizer(sgd, tune="on")
    finally:
        phvd.shutdown()


def test_the_default_is_auto_unless_the_configuration_is_given(monkeypatch, caplog):
    """Nothing given: auto. A depth given (argument or environment), tune='off', or an
    option auto cannot honour: the configuration as given, the last with a warning that
    names the option (not an error: the user did not ask for auto)."""
    monkeypatch.delenv("PIPE_HOROVOD_TUNE")            # the suite's "off" (conftest.py)
    monkeypatch.delenv("PIPE_HOROVOD_PIPELINE_DEPTH", raising=False)
    phvd.init("local")
    try:
        def wrapped(**options):
            model = _model()
            opt = phvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                            **options)
            return opt._machine.tuner, opt._pipeline_depth       # (one rank: runs at 1 anyway)

        with caplog.at_level(logging.WARNING, logger="pipe_horovod"):
            tuner, depth = wrapped()
        assert tuner is not None and tuner.steps == 20 and depth == 1
        assert "tune='auto': the first 20 steps train synchronously" in caplog.text
        assert wrapped(pipeline_depth=2) == (None, 2)
        assert wrapped(tune="off") == (None, 2)
        monkeypatch.setenv("PIPE_HOROVOD_PIPELINE_DEPTH", "1")
        assert wrapped() == (None, 1)
        monkeypatch.delenv("PIPE_HOROVOD_PIPELINE_DEPTH")
        for options, words in (({"warmup_steps": 4}, "warmup_steps=4 with tune='auto'"),
                               ({"compression": Compression.fp16},
                                "compression='fp16' with tune='auto'")):
            with pytest.warns(UserWarning, match=r"tune='auto' \(the default\) does not apply: "
                                                 + words) as said:
                assert wrapped(**options) == (None, 2)
            assert said[0].filename == __file__          # names the user's line
    finally:
        phvd.shutdown()


def test_a_run_shorter_than_the_measured_steps_says_so_once(caplog, monkeypatch):
    monkeypatch.setenv("PIPE_HOROVOD_TUNE", "auto")     # the environment alone turns it on
    phvd.init("local")
    try:
        model = _model()
        opt = phvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        with caplog.at_level(logging.WARNING, logger="pipe_horovod"):
            opt.state_dict()            # before any step (the ranks' agreement reads it): quiet
            for _ in range(3):
                opt.zero_grad()
                model(torch.ones(2, 4)).sum().backward()
                opt.step()
            opt.flush()
            opt.state_dict()
        said = [r.getMessage() for r in caplog.records if "measured of the" in r.getMessage()]
        assert said == ["pipe_horovod auto: 3 step(s) measured of the 20 auto needs "
                        "(PIPE_HOROVOD_TUNE_STEPS) before it decides: the run trains at K=1 "
                        "without codec until then (a run that ends sooner, throughout)"]
        assert opt._machine.tuner.decision is None
        assert opt._machine.run_config()["auto"] == {"measuring": 20}
        assert opt._machine.fifo.pipeline_depth == 1
    finally:
        phvd.shutdown()


def test_a_decision_for_another_number_of_ranks_is_measured_again():
    # an elastic reset to other ranks: what was measured no longer holds
    phvd.init("local")
    try:
        model = _model()
        opt = phvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        tune="auto")
        for _ in range(2):
            opt.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
        state = opt.state_dict()
        assert state["pipe_horovod"]["tune"] is None
        state["pipe_horovod"]["tune"] = Decision(2, "int8_ef", None, workers=2).as_dict()
        opt.load_state_dict(state)
        tuner = opt._machine.tuner
        assert tuner.decision is None and tuner.measure_from == 2
        assert opt._machine.fifo.pipeline_depth == 1 and opt._machine.compression is \
            Compression.none
        state["pipe_horovod"]["tune"] = Decision(1, "none", None, workers=1).as_dict()
        opt.load_state_dict(state)                      # taken for one rank: kept
        assert tuner.decision == Decision(1, "none", None, workers=1)
    finally:
        phvd.shutdown()


# --- a real launch: torchrun, 2 ranks, one launch for every case ---------------------------

CASES = ["k1", "k2", "undone", "resume", "adopt", "codec", "codec_undone", "differ"]


@pytest.mark.parametrize("case", CASES)
def test_auto_launch(case):
    """K=1 and K=2 outcomes forced by injected timings, bit for bit against the chosen
    configuration with warmup_steps=N; the same decision on every rank; the resume keeps
    it; a codec chosen and applied on every rank; ranks whose tune differs are told at
    wrap time (tests/workers/auto_worker.py)."""
    launcher.skip_without("torch")
    launcher.run_case("torch", 2, "auto_worker.py", CASES, case, timeout=300,
                      env={"PIPE_HOROVOD_TUNE": ""})      # what a user gets: the default


def test_isnan_is_none_in_the_summary():
    d = auto.unchanged(2, "why")
    assert d.as_dict()["compute_s"] is None and math.isnan(Decision.from_dict(d.as_dict()).compute_s)
