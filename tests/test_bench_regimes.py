"""`pipe-horovod bench --regimes` and the rows it adds: DDP with PyTorch's PowerSGD and bf16
hooks, ours with tune="auto". The regime table and its targets are checked on injected
results (known step times, so every ratio and verdict is exact); one short real launch
trains the new DDP rows. Speed is never asserted."""
import json
import os
import subprocess
import sys

import pytest

from pipe_horovod.tools import cli
from pipe_horovod.tools.bench import regimes, worker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------ configurations

def test_new_rows_parse_and_name_their_choices():
    assert worker.parse_configs("ddp-powersgd, ddp-bf16 ours-auto ddp") == [
        "ddp-powersgd", "ddp-bf16", "ours-auto", "ddp"]
    for bad in ("ddp-fp16", "ours-auto-int8eng", "ddp-powersgd4", "auto"):
        with pytest.raises(ValueError) as err:
            worker.parse_configs(bad)
        message = str(err.value)
        assert message.startswith(f"unknown configuration {bad!r}; choose from horovod, "
                                  "horovod-fp16, ddp, ddp-powersgd")
        for choice in ("ddp-bf16", "ours-auto", "ours-kK-int4eng", "compute"):
            assert choice in message
    assert [worker.is_ddp(n) for n in ("ddp", "ddp-powersgd", "ddp-bf16", "ours-k2",
                                       "horovod")] == [True, True, True, False, False]
    assert worker.compression_of("ddp-bf16") == "bf16"        # its wire dtype
    assert worker.compression_of("ddp-powersgd") == "none"
    assert worker.pipeline_depth_of("ours-auto") is None
    assert worker.config_backends(["ddp-powersgd", "ours-auto"], "horovod") == {
        "ddp-powersgd": "torch.distributed gloo (a process group next to Horovod)",
        "ours-auto": "pipe_horovod engine horovod"}


def test_powersgd_is_run_as_its_authors_do_and_the_hooks_are_recorded():
    assert worker.POWERSGD == {"matrix_approximation_rank": 4, "start_powerSGD_iter": 2,
                               "use_error_feedback": True, "warm_start": True}
    # compression starts inside every block's untimed warm-up
    assert regimes.REGIME_WARMUP >= worker.POWERSGD["start_powerSGD_iter"]
    meta = worker.ddp_hook_meta("ddp-powersgd")
    assert meta["hook"].endswith("powerSGD_hook.powerSGD_hook")
    assert meta["matrix_approximation_rank"] == 4
    assert worker.ddp_hook_meta("ddp-bf16")["hook"].endswith("default_hooks.bf16_compress_hook")
    assert worker.ddp_hook_meta("ddp") is None


def test_which_engine_runs_the_new_rows(monkeypatch):
    assert worker.skip_reason("ddp-powersgd", "horovod", 2) is None
    assert worker.skip_reason("ddp-bf16", "torch", 2) is None
    assert "one-process" in worker.skip_reason("ddp-bf16", "local", 1)
    monkeypatch.setattr(worker, "_tune_supported", lambda: False)
    assert worker.skip_reason("ours-auto", "torch", 2) == (
        "this pipe_horovod's DistributedOptimizer has no tune argument: tune=\"auto\" (the "
        "run choosing K, codec and buckets from its first steps) is not built in this "
        "checkout")
    monkeypatch.setattr(worker, "_tune_supported", lambda: True)
    assert worker.skip_reason("ours-auto", "torch", 2) is None


# ------------------------------------------------------------------ regimes: sizing

def test_regime_rows():
    fixed = ["ours-k1", "ours-k2", "ours-k2-bf16", "ours-k2-int8eng", "ours-k2-int4eng:32"]
    assert regimes.configs_for("balanced", "horovod") == [
        "horovod", *fixed, "ours-auto", "compute", "allreduce"]
    assert regimes.configs_for("compute-bound", "torch") == [
        "ddp", *fixed, "ours-auto", "compute", "allreduce"]
    assert regimes.configs_for("network-bound", "horovod") == [
        "horovod", *fixed, "ours-auto", "horovod-fp16", "ddp-powersgd", "ddp-bf16",
        "compute", "allreduce"]
    assert regimes.configs_for("network-bound", "torch") == [   # Horovod cannot start there
        "ddp", *fixed, "ours-auto", "ddp-powersgd", "ddp-bf16", "compute", "allreduce"]
    assert regimes.DEFAULT_ROW in fixed
    # every row is a configuration the worker knows
    for regime in regimes.REGIMES:
        for engine in regimes.ENGINES:
            names = regimes.configs_for(regime, engine)
            assert worker.parse_configs(names) == names
    with pytest.raises(ValueError, match="unknown regime 'slow'; choose from compute-bound, "
                                         "balanced, network-bound"):
        regimes.configs_for("slow", "torch")
    with pytest.raises(ValueError, match="unknown engine 'mpi'; choose from horovod, torch"):
        regimes.configs_for("balanced", "mpi")


def test_regime_sizing_follows_the_link_and_the_ratio():
    gbit = 125e6                                      # bytes/s of 1 Gbit
    # 2 workers: each sends and receives the whole gradient once, at 0.9 of the rate
    assert regimes.expected_comm_s(8e6, 2, gbit) == pytest.approx(8e6 / (gbit * 0.9))
    assert regimes.expected_comm_s(8e6, 4, gbit) == pytest.approx(1.5 * 8e6 / (gbit * 0.9))
    with pytest.raises(ValueError, match="at least 2 workers"):
        regimes.expected_comm_s(8e6, 1, gbit)
    # forward + backward = 3 x forward FLOPs: 1e9 FLOPs forward in 30 ms -> 0.1 TFLOP/s
    assert regimes.replay_tflops(1e9, 0.03) == pytest.approx(0.1)
    comm = 8e6 / (gbit * 0.9)
    net = regimes.sizing(regimes.REGIMES["network-bound"], 1e9, 8e6, 2, gbit)
    assert net["compute_s"] == pytest.approx(comm / 6)
    assert net["expected_comm_s"] == pytest.approx(comm)
    assert net["device_tflops"] == pytest.approx(3e9 / (comm / 6) / 1e12)
    bal = regimes.sizing(regimes.REGIMES["balanced"], 1e9, 8e6, 2, gbit)
    assert bal["compute_s"] == pytest.approx(comm)
    fast = regimes.sizing(regimes.REGIMES["compute-bound"], 1e9, 8e6, 2, gbit)
    assert fast["expected_comm_s"] == pytest.approx(comm / 10)          # 10 Gbit
    assert fast["expected_comm_s"] / fast["compute_s"] <= regimes.REGIMES["compute-bound"].band[1]


def test_step_time_is_the_median_of_two_step_means():
    cfg = {"rounds": [{"step_s": [0.1, 0.3, 0.2, 0.2, 9.0]},     # (0.2, 0.2); 9.0 unpaired
                      {"step_s": [0.5, 0.7]}]}                    # 0.6
    assert regimes.step_s(cfg) == pytest.approx(0.2)
    assert regimes.step_s({"rounds": [{"step_s": [0.4]}]}) == pytest.approx(0.4)
    assert regimes.step_s({"rounds": []}) is None


# ------------------------------------------------------------------ regimes: table

def _result(steps, compute, comm, skipped=None):
    return {"steps": {**steps, "compute": compute, "allreduce": comm},
            "skipped": skipped or {}, "compute_s": compute, "comm_s": comm,
            "comm_over_compute": comm / compute, "auto_decision": None, "error": None,
            "run": {"steps": 10, "rounds": 2, "warmup": 3, "auto_warmup": 20,
                    "time": "2026-11-29T06:00:00+0000", "commit": "abc1234", "wall_s": 60.0,
                    "command": "pipe-horovod bench"}}


NO_TUNE = {"ours-auto": "no tune argument here"}


def _results():
    fixed = {"ours-k1": 0.110, "ours-k2": 0.100, "ours-k2-bf16": 0.104,
             "ours-k2-int8eng": 0.101, "ours-k2-int4eng:32": 0.102}
    return {
        # auto at 0.103: 0.100 / 0.103 = 0.971 of the best fixed (holds), Horovod 0.100 /
        # 0.103 = 0.971 (< 0.98: does not hold)
        "compute-bound": {"horovod": _result({"horovod": 0.100, **fixed, "ours-auto": 0.103},
                                             0.095, 0.020)},
        "network-bound": {
            "horovod": _result({"horovod": 0.200, "ours-k1": 0.210, "ours-k2": 0.180,
                                "ours-k2-int4eng:32": 0.050, "ours-auto": 0.052,
                                "horovod-fp16": 0.150, "ddp-powersgd": 0.051,
                                "ddp-bf16": 0.120}, 0.030, 0.180),
            "torch": _result({"ddp": 0.190, "ours-k2": 0.170, "ours-k2-int8eng": 0.060,
                              "ddp-powersgd": 0.090, "ddp-bf16": 0.110}, 0.030, 0.090,
                             skipped=NO_TUNE)},
    }


def test_targets_from_injected_results():
    targets = {(t.regime, t.engine, t.what): t for t in regimes.check_targets(_results())}

    def value(regime, engine, start):
        hits = [t for (r, e, what), t in targets.items()
                if r == regime and e == engine and what.startswith(start)]
        assert len(hits) == 1, (regime, engine, start, list(targets))
        return hits[0]

    t = value("compute-bound", "horovod", "auto vs the best fixed candidate (ours-k2:")
    assert t.value == pytest.approx(0.100 / 0.103) and t.holds is True
    t = value("compute-bound", "horovod", "auto vs Horovod")
    assert t.value == pytest.approx(0.100 / 0.103) and t.holds is False
    t = value("compute-bound", "horovod", "measured comm / compute")
    assert t.value == pytest.approx(0.020 / 0.095) and t.holds is True
    # network-bound: the peers too; auto 0.052 is behind PowerSGD's 0.051
    assert value("network-bound", "horovod", "auto vs horovod-fp16").holds is True
    t = value("network-bound", "horovod", "auto vs ddp-powersgd")
    assert t.value == pytest.approx(0.051 / 0.052) and t.holds is False
    assert value("network-bound", "horovod", "auto vs ddp-bf16").holds is True
    t = value("network-bound", "horovod", "auto vs the best fixed candidate "
                                          "(ours-k2-int4eng:32:")
    assert t.value == pytest.approx(0.050 / 0.052) and t.holds is False      # 0.962 < 0.97
    assert value("network-bound", "horovod", "measured comm / compute").holds is True  # 6.0
    # torch engine: DDP is the sync baseline; auto did not run, so nothing of it is judged
    t = value("network-bound", "torch", "auto vs DDP")
    assert t.holds is None and t.why_not_measured == "no tune argument here"
    assert not [k for k in targets if k[1] == "torch" and "horovod-fp16" in k[2]]
    t = value("network-bound", "torch", "measured comm / compute")
    assert t.value == pytest.approx(3.0) and t.holds is False                 # below 4
    assert len(targets) == 3 + 6 + 5        # ratio + 2 (compute-bound); + 2 + 3 peers


def test_regime_table_from_injected_results(tmp_path):
    results = _results()
    rows = {n: (st, vb, vf) for n, st, vb, vf in
            regimes.rows_of(results["network-bound"]["horovod"], "horovod")}
    assert list(rows) == ["horovod", "ours-k1", "ours-k2", "ours-k2-int4eng:32", "ours-auto",
                          "horovod-fp16", "ddp-powersgd", "ddp-bf16"]   # no compute/allreduce
    assert rows["ours-auto"] == pytest.approx((0.052, 0.200 / 0.052, 0.050 / 0.052))
    assert rows["horovod"][1] == pytest.approx(1.0)
    assert regimes.best_fixed(results["network-bound"]["torch"]) == ("ours-k2-int8eng", 0.060)
    text = regimes.markdown(results)
    lines = text.splitlines()
    net = lines.index("### network-bound: 1 Gbit, comm ≈ 4–8 × compute")
    assert ("| config | horovod: ms | × Horovod | × best fixed | torch: ms | × DDP "
            "| × best fixed |") in lines[net:]
    assert "| **ours-auto** | 52.0 | 3.85x | 0.96x | – | – | – |" in lines[net:]
    assert "| ours-k2 (default) | 180.0 | 1.11x | 0.28x | 170.0 | 1.12x | 0.35x |" in lines[net:]
    assert "| ddp | – | – | – | 190.0 | 1.00x | 0.32x |" in lines[net:]
    assert "- not measured: `ours-auto` (torch engine): no tune argument here" in lines
    assert "- auto vs today's default (horovod engine): 0.971 (default's step / auto's)" in lines
    assert "### Targets: 6 of 10 measured hold" in lines
    assert ("- does NOT hold (network-bound, horovod engine): auto vs ddp-powersgd (its step "
            "/ auto's) = 0.981 (≥ 1)") in lines
    assert ("- holds (compute-bound, horovod engine): measured comm / compute (the regime's "
            "ratio) = 0.211 (within 0–0.5)") in lines
    head = regimes.heading(results, 2, {"model": "mlp", "model_mb": 8.0, "batch_size": 32})
    assert head.startswith("2 workers on the emulated cluster, model mlp 8 MB (batch 32), "
                           "replayed compute; 10 timed steps x 2 rounds per row")
    assert "commit abc1234" in head
    summary = regimes.summary(results)
    json.dumps(summary)                                   # JSON-ready as it is
    assert summary["all_hold"] is False
    assert sum(t["holds"] is True for t in summary["targets"]) == 6
    path = tmp_path / "r.png"
    regimes.plot(results, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_failed_run_is_said_not_judged():
    results = {"balanced": {"torch": {"error": "the workers failed", "steps": {},
                                      "skipped": {}}}}
    [target] = regimes.check_targets(results)
    assert target.holds is None and "the run failed: the workers failed" in target.line()
    assert "torch engine: the run failed (the workers failed)" in regimes.markdown(results)


@pytest.mark.parametrize("argv, message", [
    (["--regimes", "slow"], "unknown regime 'slow'; choose from compute-bound, balanced, "
                            "network-bound"),
    (["--regimes", "--regime-engines", "mpi"], "unknown engine 'mpi'; choose from horovod, "
                                               "torch"),
    (["--regimes", "--framework", "keras"], "--regimes runs the PyTorch benchmark"),
])
def test_regimes_bad_arguments(argv, message, capsys, tmp_path):
    try:
        code = cli.main(["bench", "--out", str(tmp_path), *argv])
    except SystemExit as exc:
        code = exc.code
    assert code == 2 and message in capsys.readouterr().err


# ------------------------------------------------------------------ a real launch

@pytest.mark.timeout(150)
def test_new_ddp_rows_train_under_the_torch_engine(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env.pop("PIPE_HOROVOD_ENGINE", None)
    raw = tmp_path / "raw.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", "-m", "pipe_horovod.tools.bench.worker", "--model-mb", "0.2", "--batch-size",
           "8", "--steps", "2", "--warmup", "2", "--rounds", "1", "--idle-probe-s", "0.05",
           "--configs", "ddp-powersgd,ddp-bf16", "--out", str(raw)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=140,
                         stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads(raw.read_text())
    assert data["meta"]["configs"] == ["ddp-powersgd", "ddp-bf16"]
    for name in ("ddp-powersgd", "ddp-bf16"):
        [block] = data["configs"][name]["rounds"]
        assert len(block["step_s"]) == 2 and all(t > 0 for t in block["step_s"])
    hooks = data["meta"]["ddp_comm_hooks"]
    assert hooks["ddp-powersgd"]["matrix_approximation_rank"] == 4
    # on a CPU-only torch DDP refuses the hook by its name; where CUDA + NCCL is, as is
    registered = hooks["ddp-bf16"]["registered"]
    assert registered == "as is" or registered.startswith("through a wrapper of another name")


def test_what_auto_says_is_kept_for_the_raw_result():
    import logging

    lines = worker.AutoLines()
    logger = logging.getLogger("pipe_horovod")
    logger.addHandler(lines)
    try:
        logger.warning("%s", "pipe_horovod auto: compute 12 ms, exposed wait 60 ms -> K=2")
        logger.warning("something else")
    finally:
        logger.removeHandler(lines)
    assert lines.lines == ["pipe_horovod auto: compute 12 ms, exposed wait 60 ms -> K=2"]
    raw = {"meta": {"skipped": {}, "steps": 10, "rounds": 2, "warmup": 3, "auto_warmup": 20,
                    "time": "t", "auto_decision": lines.lines[-1]},
           "configs": {"ours-auto": {"rounds": [{"step_s": [0.1, 0.3]}]},
                       "compute": {"rounds": [{"step_s": [0.05, 0.05]}]},
                       "allreduce": {"rounds": [{"step_s": [0.2, 0.2]}]}}}
    result = regimes.run_result(raw)
    assert result["auto_decision"] == lines.lines[-1]
    assert result["steps"]["ours-auto"] == pytest.approx(0.2)
    assert result["comm_over_compute"] == pytest.approx(4.0)
    text = regimes.markdown({"network-bound": {"torch": result}})
    assert f"- auto's decision (torch engine): {lines.lines[-1]}" in text
