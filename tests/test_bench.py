"""`pipe-horovod bench`: real (tiny) runs produce the report; bad arguments exit 2.

No speed assertions: the machines are shared and small. These check that
every configuration is measured and reported, and that the outputs exist.
"""
import json
import os
import subprocess
import sys

import pytest

import launcher

from pipe_horovod.collectives import cost_model
from pipe_horovod.pipeline import timing_model
from pipe_horovod.tools import cli, emulate
from pipe_horovod.tools.bench import report, worker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--model-mb", "0.2", "--batch-size", "8", "--steps", "2", "--warmup", "1",
        "--rounds", "2"]




def _bench(out, *args, timeout):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env.pop("PIPE_HOROVOD_ENGINE", None)
    cmd = [sys.executable, "-m", "pipe_horovod.tools.cli", "bench", "--no-progress",
           "--out", str(out), *args]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=timeout, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, f"{' '.join(cmd)} exited {res.returncode}\n{res.stdout}\n{res.stderr}"
    return res.stdout


def _check_outputs(out, stdout, measured, skipped=()):
    for name in ("bench-raw.json", "bench.md", "bench.json", "bench.png"):
        assert (out / name).is_file(), f"{name} missing in {sorted(os.listdir(out))}"
    with open(out / "bench.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    table = (out / "bench.md").read_text()
    assert table in stdout                                   # printed and saved
    rows = {line.split("|")[1].strip() for line in table.splitlines()
            if line.startswith("| ") and not line.startswith("| config")}
    for name in measured:
        assert name in rows, f"no table row for {name}:\n{table}"
    for name in skipped:
        assert f"not measured: `{name}`" in table
    summary = json.loads((out / "bench.json").read_text())
    assert set(summary["configs"]) == set(measured)
    for name, s in summary["configs"].items():
        assert s["step_s"] > 0 and len(s["round_medians_s"]) == 2, (name, s)
        assert s["cpu_cores_per_worker"], name
    raw = json.loads((out / "bench-raw.json").read_text())
    assert raw["launch"]["command"].startswith("pipe-horovod bench")
    return summary, raw


# One torch-engine run of 2 workers for the default configurations (horovod skipped) and the
# quantized ones (test_ours_int8eng_and_int4_train_on_both_quantized_paths): a run's
# start-up is most of its time.
QUANTIZED = ["ours-k2-int8eng", "ours-k2-int4eng", "ours-k2-int8-none", "ours-k2-int4"]
EXCHANGED = ["ours-k2-x4"]              # the default with prediction_exchange="int4"


@pytest.fixture(scope="module")
def torch_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-torch")
    stdout = _bench(out, "--engine", "torch", "--workers", "2", *TINY, "--fit", "--fit-max-mb",
                    "0.02", "--configs", *worker.DEFAULT_CONFIGS, *QUANTIZED, *EXCHANGED,
                    timeout=380)
    return out, stdout


@pytest.mark.timeout(400)
def test_local_torch_run_reports_every_configuration(torch_run):
    out, stdout = torch_run
    measured = ["ddp", "ours-k1", "ours-k2", "ours-k2-fp16", "ours-k2-bf16", "compute",
                "contention", "allreduce", "allreduce-fp16", "allreduce-bf16"]
    summary, raw = _check_outputs(out, stdout, measured + QUANTIZED + EXCHANGED,
                                  skipped=["horovod"])
    assert raw["meta"]["engine"] == "torch" and raw["meta"]["workers"] == 2
    # The exchange's bytes and wait are in the row's prediction: never below the default's.
    rows = summary["configs"]
    assert rows["ours-k2-x4"]["predicted_s"] > rows["ours-k2"]["predicted_s"] > 0
    assert raw["sweep"]["sizes"] == [1024, 4096, 16384, 20000]
    assert [len(t) for t in raw["sweep"]["seconds"]] == [20] * 4
    assert "fit (absolute error) of a 4-size allreduce sweep" in summary["timing_model"]["source"]
    for key in ("k2_vs_ideal", "k1_vs_ddp", "bf16_speedup_vs_horovod"):
        assert key in summary["ratios"]
    assert summary["ratios"]["k1_vs_ddp"] is not None
    # (the quantized ones: test_ours_int8eng_and_int4_train_on_both_quantized_paths)
    assert all(summary["configs"][name]["predicted_s"] is not None for name in measured
               if name != "contention")
    assert summary["timing_model"]["comm_cpu_s_per_byte"] >= 0


_HOROVOD = launcher.horovod_missing()


@pytest.mark.timeout(120)
@pytest.mark.skipif(_HOROVOD is not None, reason=f"no horovod: {_HOROVOD}")
def test_horovod_engine_measures_horovod_and_ddp_in_one_run(tmp_path):
    # One horovodrun job: hvd.DistributedOptimizer and DDP (over a torch.distributed gloo
    # group the workers start next to Horovod) in the same processes, interleaved; every
    # configuration on replayed compute: 0.005 TFLOP/s makes the 0.1 MB MLP's
    # forward 1.6 ms and backward 3.2 ms of timed waits. --one-model: each block builds its
    # configuration (Horovod's optimizer, DDP, ours) anew and frees it after (the other
    # tests build every configuration once).
    configs = ["horovod", "ddp", "ours-k1", "ours-k2", "compute"]
    stdout = _bench(tmp_path, "--engine", "horovod", "--workers", "2", "--model-mb", "0.1",
                    "--batch-size", "8", "--steps", "2", "--warmup", "1", "--rounds", "2",
                    "--idle-probe-s", "0.05", "--compute", "replay", "--device-tflops", "0.005",
                    "--horovod-fusion-mb", "0", "--one-model", "--configs", *configs,
                    timeout=110)
    summary, raw = _check_outputs(tmp_path, stdout, configs)
    meta = raw["meta"]
    assert meta["engine"] == "horovod" and meta["workers"] == 2 and not meta["skipped"]
    assert meta["one_model"] is True
    for name in ("horovod", "ddp"):
        steps = [t for block in raw["configs"][name]["rounds"] for t in block["step_s"]]
        assert len(steps) == 4 and all(t > 0 for t in steps), (name, steps)
    assert meta["ddp_backend"] == "torch.distributed gloo"
    assert meta["config_backends"]["ddp"].startswith("torch.distributed gloo")
    assert meta["config_backends"]["horovod"].startswith("horovod")
    group = meta["ddp_process_group"]
    assert group["address_from"] == "launcher" and group["init_method"].startswith(
        "tcp://127.0.0.1:")
    # Replayed: the FLOPs of the MLP's 5 Linear layers at batch 8 (2 per multiply-add).
    width = worker.mlp_width(0.1e6, 5)
    macs = 8 * (1024 * width + 3 * width * width + width * 1000)
    compute = meta["compute"]
    assert compute["mode"] == "replay" and compute["device_tflops"] == 0.005
    assert compute["forward_s"] == pytest.approx(2 * macs / 0.005e12)
    assert compute["backward_s"] == pytest.approx(2 * compute["forward_s"])
    assert meta["horovod_fusion_mb"] == 0
    assert "--compute replay --device-tflops 0.005" in raw["launch"]["command"]
    assert "buckets 25 MB, compute replayed at 0.005 TFLOP/s" in stdout
    assert stdout.count("compute replayed at 0.005 TFLOP/s") >= 2      # title and table
    for name, s in summary["configs"].items():
        assert s["compute"] == "compute replayed at 0.005 TFLOP/s", name
        # the waits never end early: forward + backward take at least their configured time
        assert s["fwdbwd_s"] >= compute["forward_s"] + compute["backward_s"], name


@pytest.mark.timeout(60)
def test_which_engine_runs_which_configuration():
    assert worker.skip_reason("ddp", "horovod", 2) is None
    assert worker.skip_reason("ddp", "torch", 2) is None
    assert worker.skip_reason("horovod", "horovod", 2) is None
    why = worker.skip_reason("horovod", "torch", 2)
    assert "Horovod's launcher" in why and "--engine horovod" in why
    assert "--engine horovod" in worker.skip_reason("horovod-fp16", "local", 1)
    assert "one-process" in worker.skip_reason("ddp", "local", 1)
    assert worker.DEFAULT_CONFIGS == ["horovod", "ddp", "ours-k1", "ours-k2", "ours-k2-fp16",
                                      "ours-k2-bf16", "compute", "contention", "allreduce"]
    assert not [n for n in worker.DEFAULT_CONFIGS if worker.skip_reason(n, "horovod", 2)]


@pytest.mark.timeout(200)
def test_one_process_measures_wrapper_overhead(tmp_path):
    stdout = _bench(tmp_path, "--engine", "local", "--workers", "1", *TINY, timeout=180)
    summary, _ = _check_outputs(tmp_path, stdout, ["compute", "ours-k1", "ours-k2"])
    assert summary["ratios"]["wrapper_overhead"] is not None
    assert "ours-k1 / plain optimizer - 1" in stdout


_EMULATE = emulate.unavailable_reason()


@pytest.mark.timeout(400)
@pytest.mark.skipif(_EMULATE is not None, reason=f"--emulate cannot run here: {_EMULATE}")
def test_emulated_run(tmp_path):
    engine = "horovod" if launcher.horovod_missing() is None else "torch"
    configs = (["horovod", "ddp"] if engine == "horovod" else ["ddp"]) + [
        "ours-k1", "ours-k2", "ours-k2-fp16", "compute", "allreduce"]
    stdout = _bench(tmp_path, "--emulate", "1gbit", "--engine", engine, "--workers", "2",
                    *TINY, "--configs", *configs, timeout=380)
    summary, raw = _check_outputs(tmp_path, stdout, configs + ["allreduce-fp16"])
    assert raw["launch"]["emulate"] == "1gbit"
    assert len(raw["launch"]["cpu_s"]) == 2 and all(c > 0 for c in raw["launch"]["cpu_s"])
    assert all(s["tx_bytes"] > 0 for s in raw["launch"]["link_stats"])
    assert "emulated 1gbit links" in stdout
    if engine == "horovod":           # ddp's gloo group met at rank 0's namespace address
        group = raw["meta"]["ddp_process_group"]
        assert group["init_method"].startswith("tcp://10.") and group["gloo_interface"]


# ---------------------------------------------------------------- argument errors

def _exit_code(argv, capsys):
    try:
        code = cli.main(["bench", *argv])
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv, message", [
    (["--emulate", "10gbits"], "unrecognised link rate '10gbits'"),
    (["--emulate", "-1gbit"], "must not be negative"),
    (["--workers", "-1"], "workers must be >= 1"),
    (["--workers", "0"], "workers must be >= 1"),
    (["--workers", "two"], "workers must be an integer"),
    (["--steps", "0"], "must be > 0"),
    (["--model-mb", "-5"], "must be > 0"),
    (["--configs", "ours-kx"], "unknown configuration 'ours-kx'"),
    (["--engine", "mpi"], "invalid choice"),
    (["--timeout", "0"], "timeout must be > 0"),
    (["--compute", "replay", "--model", "resnet50"], "exactly one of --device-tflops"),
    (["--model", "vgg16"], "--model vgg16 runs only with replayed compute"),
    (["--device-tflops", "10"], "add --compute replay"),
    (["--compute", "replay", "--profile", "/nonexistent.json"], "cannot read profile"),
    (["--compute", "replay", "--model", "hvd-mnist", "--device-tflops", "1"],
     "--compute replay needs one of the models resnet50"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
    (["--device", "cuda", "--compute", "replay", "--model", "resnet50", "--device-tflops", "8"],
     "--compute replay computes nowhere (timed waits): choose one"),
    (["--device", "cuda", "--framework", "keras"], "--device cuda is the PyTorch benchmark's"),
] + ([] if __import__("torch").cuda.is_available() else [
    (["--device", "cuda"], "--device cuda: torch "),
]))
def test_bad_arguments_exit_2_with_a_message(argv, message, capsys):
    code, err = _exit_code(argv, capsys)
    assert code == 2
    assert message in err


@pytest.mark.timeout(60)
def test_local_engine_needs_one_worker(capsys, tmp_path):
    code, err = _exit_code(["--engine", "local", "--workers", "2", "--out", str(tmp_path)],
                           capsys)
    assert code == 2 and "--engine local runs one process" in err


@pytest.mark.timeout(60)
def test_emulate_refused_without_root(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    code, err = _exit_code(["--emulate", "1gbit", "--engine", "torch", "--out", str(tmp_path)],
                           capsys)
    assert code == 2 and "--emulate needs root" in err
    assert not (tmp_path / "bench-raw.json").exists()


@pytest.mark.timeout(60)
def test_report_only_without_results(capsys, tmp_path):
    code, err = _exit_code(["--report-only", "--out", str(tmp_path)], capsys)
    assert code == 2 and "does not exist" in err


# ---------------------------------------------------------------- report arithmetic

def _block(step, exposed=None, fwdbwd=None, opt=None, n=4, cores=1.0):
    return {"step_s": [step] * n, "exposed_s": [exposed] * n, "fwdbwd_s": [fwdbwd] * n,
            "opt_s": [opt] * n, "round": 0, "wall_s": step * n, "machine_busy_cores": 2.0,
            "per_rank": [{"cpu_s": cores * step * n, "wall_s": step * n, "threads": 3}] * 2}


def _cfg(kind, blocks, compression="none", depth=None):
    return {"kind": kind, "compression": compression, "pipeline_depth": depth,
            "rounds": blocks}


@pytest.mark.timeout(60)
def test_report_ratios_from_known_times(tmp_path):
    raw = {"format": "pipe_horovod.bench/1",
           "meta": {"engine": "horovod", "workers": 2, "model": "mlp", "model_bytes": 50e6,
                    "params": 12_500_000, "batch_size": 32, "steps": 4, "warmup": 1,
                    "rounds": 1, "threads": 1, "cpu_count": 2, "versions": {"torch": "x"},
                    "skipped": {"ddp": "needs torch"}, "horovod_bf16_as_float32": True},
           "configs": {
               "horovod": _cfg("train", [_block(0.200, 0.110, 0.08, 0.12)]),
               "ours-k1": _cfg("train", [_block(0.190, 0.100, 0.08, 0.11)], depth=1),
               "ours-k2": _cfg("train", [_block(0.125, 0.010, 0.08, 0.045)], depth=2),
               "compute": _cfg("train", [_block(0.080, None, 0.07, 0.01)]),
               "allreduce": _cfg("allreduce", [_block(0.115, 0.115, cores=0.5)]),
               # a plain step takes 0.1375 s instead of 0.080 s while an allreduce runs
               "contention": _cfg("contention", [_block(0.150, 0.0125, 0.1375)]),
           },
           "sweep": None, "codec_s": None, "process": []}
    path = tmp_path / "raw.json"
    path.write_text(json.dumps(raw))
    text, paths = report.write_report([str(path)], str(tmp_path), "r")
    summary = json.loads(open(paths["json"]).read())
    ratios = summary["ratios"]
    assert ratios["k2_vs_ideal"] == pytest.approx(0.125 / 0.115)
    assert ratios["k2_speedup_vs_horovod"] == pytest.approx(0.200 / 0.125)
    assert ratios["k1_vs_horovod"] == pytest.approx(0.200 / 0.190)
    assert ratios["k1_vs_ddp"] is None and ratios["wrapper_overhead"] is None
    k2 = summary["configs"]["ours-k2"]
    assert k2["hidden_fraction"] == pytest.approx(1 - 0.010 / 0.115)
    assert k2["samples_per_s"] == pytest.approx(64 / 0.125)
    # beta from the allreduce alone, alpha 0: the model reproduces that allreduce
    assert summary["configs"]["allreduce"]["predicted_s"] == pytest.approx(0.115)
    # communication stretches compute by the contention configuration's 57.5 ms
    assert k2["predicted_s"] == pytest.approx(max(0.08 + 0.0575, 0.115))
    assert summary["configs"]["contention"]["predicted_s"] is None
    assert summary["configs"]["ours-k1"]["predicted_s"] == pytest.approx(0.08 + 0.115)
    met = {t["key"]: t["met"] for t in summary["targets"]}
    assert met["k2_speedup_vs_horovod"] and met["k1_vs_horovod"] and met["k2_vs_ideal"]
    assert "not measured: `ddp`" in text
    assert open(paths["png"], "rb").read(4) == b"\x89PNG"


@pytest.mark.timeout(60)
def test_report_predicts_per_hop_codecs_with_their_measured_codec_work(tmp_path):
    # ring at 2 ranks: every byte encoded and decoded once, half of them decode-added:
    # 1 + 0.5 * 2 + 1 = 3 ns per gradient byte, 150 ms for 50 MB, on the compute side.
    raw = {"format": "pipe_horovod.bench/1",
           "meta": {"engine": "torch", "workers": 2, "model": "mlp", "model_bytes": 50e6,
                    "params": 12_500_000, "batch_size": 32, "steps": 4, "warmup": 1,
                    "rounds": 1, "threads": 1, "cpu_count": 2, "versions": {}},
           "configs": {
               "ours-k2-int8-none": _cfg("train", [_block(0.240, 0.0, 0.22, 0.01)], "int8", 2),
               "compute": _cfg("train", [_block(0.080, None, 0.07, 0.01)]),
               "allreduce": _cfg("allreduce", [_block(0.115, 0.115, cores=0.5)]),
           },
           "sweep": None, "codec_s": {"fp16": 0.0, "bf16": 0.0}, "process": [],
           "hop_codec_s_per_byte": {"int8": [1e-9, 2e-9, 1e-9]}}
    path = tmp_path / "raw.json"
    path.write_text(json.dumps(raw))
    text, paths = report.write_report([str(path)], str(tmp_path), "r")
    summary = json.loads(open(paths["json"]).read())
    assert summary["timing_model"]["compressions"]["int8"]["codec_s"] == pytest.approx(0.15)
    assert summary["timing_model"]["compressions"]["int8"]["wire_ratio"] > 0.25
    row = summary["configs"]["ours-k2-int8-none"]
    assert row["predicted_s"] == pytest.approx(0.07 + 0.01 + 0.15)
    assert row["prediction_error"] == pytest.approx(abs(0.23 - 0.24) / 0.24)
    assert "int8 150.0 ms" in text
    # Measured where it matters: a plain step took 0.20 s instead of 0.08 while ring/int8 ran.
    raw["configs"]["contention-int8"] = _cfg("contention", [_block(0.21, 0.01, 0.20)], "int8")
    path.write_text(json.dumps(raw))
    text, paths = report.write_report([str(path)], str(tmp_path), "r")
    summary = json.loads(open(paths["json"]).read())
    assert summary["configs"]["ours-k2-int8-none"]["predicted_s"] == pytest.approx(0.20)
    assert summary["configs"]["contention-int8"]["predicted_s"] is None
    # ... and that allreduce took 0.21 s beside compute: the row's measured comm
    row = summary["configs"]["ours-k2-int8-none"]
    assert row["comm_s"] == pytest.approx(0.21)
    assert row["predicted_measured_comm_s"] == pytest.approx(max(0.07 + 0.01 + 0.12, 0.21))
    assert "int8 120.0 ms (wire x0.25, from contention-int8)" in text


@pytest.mark.timeout(60)
def test_report_predicts_two_stage_codecs_with_the_planner_and_the_cpu_floor():
    # ours-k2-int8eng (int8_ef in two stages) on 4 ranks of a 2-core machine, a 50 MB model
    # in one bucket: the wire is the two-stage ratio of the model, a ring allreduce of it;
    # the codec runs beside compute, so the bucket holds the link for max(bytes, codec
    # wall); and all 4 ranks' CPU (compute's, the allreduce's scaled to the wire, the
    # codec's) over the cores the run had is a floor under the step.
    model_bytes, p = 50e6, 4
    costs = {"compression": "int8_ef", "bucket_bytes": model_bytes,
             "wall_s_per_byte": [2e-9, 1e-9, 1e-9], "cpu_s_per_byte": [0.2e-9, 0.1e-9, 0.1e-9]}
    raw = {"format": "pipe_horovod.bench/1",
           "meta": {"engine": "horovod", "workers": p, "model": "mlp", "model_bytes": model_bytes,
                    "params": 12_500_000, "batch_size": 32, "steps": 4, "warmup": 1,
                    "rounds": 1, "threads": 1, "cpu_count": 2, "versions": {},
                    "background_busy_cores": [0.5, 0.4, 0.6]},
           "configs": {
               "ours-k2-int8eng": _cfg("train", [_block(0.40, 0.0, 0.07, 0.01)], "int8eng", 2),
               "compute": _cfg("train", [_block(0.080, None, 0.07, 0.01, cores=0.5)]),
               "allreduce": _cfg("allreduce", [_block(0.300, 0.300, cores=0.4)]),
           },
           "sweep": None, "codec_s": None, "process": [],
           "two_stage_codec_s_per_byte": {"int8eng": costs}}

    def summarize():                              # the report's text, without its plot
        summary = report.summarize(json.loads(json.dumps(raw)))
        return report.markdown(summary), summary

    # the oracle, from the planner's functions: beta from the model-sized allreduce
    net = cost_model.Network(0.0, 0.300 / timing_model.ring_allreduce(cost_model.Network(0.0, 1.0), p,
                                                                 model_bytes))
    ratio = timing_model.two_stage_wire_ratio(256, 1)
    link = timing_model.ring_allreduce(net, p, model_bytes * ratio)
    codec_wall = 4e-9 * model_bytes                               # 200 ms > the bytes' 76 ms
    planned = timing_model.step_time(0.07, 0.01, max(link, codec_wall), pipeline_depth=2)
    need = 0.5 * 0.080 + 0.4 * 0.300 * ratio + 0.4e-9 * model_bytes   # CPU a rank, a step
    # 4 ranks share 2 cores fairly with the median background's 0.5 busy cores
    floor = timing_model.cpu_floor(need, p, 2 * p / (p + 0.5))
    assert floor > planned
    text, summary = summarize()
    row = summary["configs"]["ours-k2-int8eng"]
    assert summary["timing_model"]["compressions"]["int8eng"]["wire_ratio"] == pytest.approx(
        0.2539, abs=1e-4)
    assert row["planner_step_s"] == pytest.approx(planned)
    assert row["predicted_s"] == pytest.approx(floor) and row["prediction_bound"] == "CPU"
    assert row["prediction_error"] == pytest.approx(abs(floor - 0.40) / 0.40)
    assert f"ours-k2-int8eng {floor * 1e3:.1f} ms, bound: CPU" in text
    # an idle machine: the floor is below the codec's hold on the link
    raw["meta"]["background_busy_cores"] = [0.0]
    text, summary = summarize()
    row = summary["configs"]["ours-k2-int8eng"]
    assert timing_model.cpu_floor(need, p, 2) < planned
    assert row["predicted_s"] == pytest.approx(planned) and row["prediction_bound"] == "codec"
    # int4_ef, its codec not measured (a raw from before the measurement): the bytes alone
    raw["configs"]["ours-k2-int4eng"] = _cfg("train", [_block(0.1, 0.0, 0.07, 0.01)],
                                             "int4eng", 2)
    text, summary = summarize()
    assert summary["configs"]["ours-k2-int4eng"]["predicted_s"] == pytest.approx(
        timing_model.step_time(0.07, 0.01, timing_model.ring_allreduce(
            net, p, model_bytes * timing_model.two_stage_wire_ratio(256, 0.5)), pipeline_depth=2))
    assert "int4eng (int4_ef): wire x0.1289" in text and "not measured in this run" in text
    # ... and without the optimizer's own work (a raw from before optimizer_step_costs):
    # not in the floor, and the text says so
    assert "the optimizer's own bucket copy and lookahead prediction not measured" in text
    assert "floor 4 x (" in text and "bucket copy" not in text.split("not measured")[-1]


@pytest.mark.timeout(60)
def test_cpu_floor_counts_the_optimizers_own_work_measured_alone():
    # The two-stage rows' floor adds the wrapped optimizer's own CPU a step, measured by
    # the worker apart from the rows (optimizer_step_costs): the bucket copy in every row,
    # the lookahead prediction only where the row compensates with it (the default), never
    # in -none. Known component times give a known floor.
    model_bytes, p = 50e6, 2
    costs = {"compression": "int8_ef", "bucket_bytes": model_bytes,
             "wall_s_per_byte": [2e-9, 1e-9, 1e-9], "cpu_s_per_byte": [0.2e-9, 0.1e-9, 0.1e-9]}
    step_costs = {"bucket_bytes": [25e6, 25e6],
                  "bucket_copy": {"wall_s": 0.02, "cpu_s": 0.015},
                  "lookahead": {"wall_s": 0.05, "cpu_s": 0.04}}
    raw = {"format": "pipe_horovod.bench/1",
           "meta": {"engine": "horovod", "workers": p, "model": "mlp", "model_bytes": model_bytes,
                    "params": 12_500_000, "batch_size": 32, "steps": 4, "warmup": 1,
                    "rounds": 1, "threads": 1, "cpu_count": 2, "versions": {},
                    "background_busy_cores": [1.0]},
           "configs": {
               "ours-k2-int8eng": _cfg("train", [_block(0.40, 0.0, 0.07, 0.01)], "int8eng", 2),
               "ours-k2-int8eng-none": _cfg("train", [_block(0.35, 0.0, 0.07, 0.01)],
                                            "int8eng", 2),
               "ours-k2-int8eng-dc": _cfg("train", [_block(0.35, 0.0, 0.07, 0.01)],
                                          "int8eng", 2),
               "compute": _cfg("train", [_block(0.080, None, 0.07, 0.01, cores=0.5)]),
               "allreduce": _cfg("allreduce", [_block(0.300, 0.300, cores=0.4)]),
           },
           "sweep": None, "codec_s": None, "process": [],
           "two_stage_codec_s_per_byte": {"int8eng": costs},
           "optimizer_step_costs": step_costs}
    summary = report.summarize(json.loads(json.dumps(raw)))
    text = report.markdown(summary)
    ratio = timing_model.two_stage_wire_ratio(256, 1)
    base = 0.5 * 0.080 + 0.4 * 0.300 * ratio + 0.4e-9 * model_bytes   # as before
    cores = 2 * p / (p + 1.0)                      # 2 ranks, 1 core busy elsewhere: 1.33
    expect = {"ours-k2-int8eng": base + 0.015 + 0.04,         # copy + lookahead (default)
              "ours-k2-int8eng-none": base + 0.015,           # copy only
              "ours-k2-int8eng-dc": base + 0.015}             # dc: no lookahead pass
    floors = summary["timing_model"]["two_stage"]["int8eng"]["cpu_floor"]
    for name, need in expect.items():
        floor = timing_model.cpu_floor(need, p, cores)
        assert floors[name]["cpu_s_per_step"] == pytest.approx(need), name
        assert floors[name]["floor_s"] == pytest.approx(floor), name
        row = summary["configs"][name]
        assert row["predicted_s"] == pytest.approx(max(floor, row["planner_step_s"])), name
    # the lookahead's 40 ms lift the default row's floor over the codec's 200 ms hold on
    # the link; without it (-none, dc) the codec binds
    bounds = {name: summary["configs"][name]["prediction_bound"] for name in expect}
    assert bounds == {"ours-k2-int8eng": "CPU", "ours-k2-int8eng-none": "codec",
                      "ours-k2-int8eng-dc": "codec"}
    assert floors["ours-k2-int8eng"]["bucket_copy_cpu_s"] == pytest.approx(0.015)
    assert floors["ours-k2-int8eng"]["lookahead_cpu_s"] == pytest.approx(0.04)
    assert "lookahead_cpu_s" not in floors["ours-k2-int8eng-none"]
    assert summary["timing_model"]["optimizer_step_costs"] == step_costs
    # the text prints each row's parts
    assert ("floor 2 x (40.0 compute + 30.5 communication + 20.0 codec + 15.0 bucket copy "
            "+ 40.0 lookahead ms) / 1.33 cores") in text
    assert "15.0 bucket copy ms) / 1.33 cores" in text        # the -none row
    assert "measured alone" in text and "not measured" not in text
    # an optimizer without a one-pass rule: the copy counted, the prediction said missing
    raw["optimizer_step_costs"] = dict(step_costs, lookahead=None)
    summary = report.summarize(json.loads(json.dumps(raw)))
    floors = summary["timing_model"]["two_stage"]["int8eng"]["cpu_floor"]
    assert floors["ours-k2-int8eng"]["cpu_s_per_step"] == pytest.approx(base + 0.015)
    assert "no one-pass lookahead rule" in report.markdown(summary)


@pytest.mark.timeout(60)
def test_report_takes_alternating_k2_steps_by_period_and_charges_compensation(tmp_path):
    # A comm-bound K=2 run alternates fast and slow steps: their median (0.05) is below
    # the link's bound; the mean of each 2-step period is not. Lookahead's 50 ms a step
    # are charged to the prediction.
    steps = [0.04, 0.20, 0.05, 0.22, 0.04]
    k2 = {"step_s": steps, "exposed_s": [0.0] * 5, "fwdbwd_s": [0.08] * 5,
          "opt_s": [0.04] * 5, "compensation_s": [0.05] * 5, "round": 0,
          "wall_s": sum(steps), "machine_busy_cores": 1.0,
          "per_rank": [{"cpu_s": 0.1, "wall_s": sum(steps), "threads": 3}] * 2}
    raw = {"format": "pipe_horovod.bench/1",
           "meta": {"engine": "torch", "workers": 2, "model": "mlp", "model_bytes": 50e6,
                    "params": 12_500_000, "batch_size": 32, "steps": 5, "warmup": 1,
                    "rounds": 1, "threads": 1, "cpu_count": 2, "versions": {}},
           "configs": {
               "ours-k2": _cfg("train", [k2], depth=2),
               "ours-k2-none": _cfg("train", [dict(k2, compensation_s=[0.0] * 5)], depth=2),
               "compute": _cfg("train", [_block(0.080, None, 0.07, 0.01)]),
               "allreduce": _cfg("allreduce", [_block(0.115, 0.115, cores=0.5)]),
           },
           "sweep": None, "codec_s": None, "process": []}
    path = tmp_path / "raw.json"
    path.write_text(json.dumps(raw))
    text, paths = report.write_report([str(path)], str(tmp_path), "r")
    configs = json.loads(open(paths["json"]).read())["configs"]
    assert configs["ours-k2"]["step_s"] == pytest.approx((0.12 + 0.135) / 2)
    assert configs["ours-k2"]["wall_step_s"] == pytest.approx(sum(steps) / 5)
    assert configs["ours-k2"]["samples"] == 5                       # timed steps, not windows
    assert configs["compute"]["step_s"] == pytest.approx(0.080)     # K=1: plain median
    # compute's fwd+bwd 0.07 + update 0.01 + compensation 0.05 > the link's 0.115
    assert configs["ours-k2"]["predicted_s"] == pytest.approx(0.07 + 0.01 + 0.05)
    assert configs["ours-k2-none"]["predicted_s"] == pytest.approx(0.115)
    assert "ours-k2 50.0 ms" in text


@pytest.mark.timeout(60)
def test_config_names():
    assert worker.parse_configs("ours-k2,compute ours-k3-bf16") == [
        "ours-k2", "compute", "ours-k3-bf16"]
    assert worker.expand_configs(["ours-k2-fp16", "allreduce", "compute"]) == [
        "ours-k2-fp16", "allreduce", "allreduce-fp16", "compute"]
    with pytest.raises(ValueError, match="unknown configuration"):
        worker.parse_configs(["ours-k0"])
    # -x4 / -x8: prediction_exchange, which feeds lookahead only.
    assert worker.parse_configs("ours-k2-x4 ours-k3-int8eng-lookahead-x8") == [
        "ours-k2-x4", "ours-k3-int8eng-lookahead-x8"]
    assert [worker.exchange_of(n) for n in ("ours-k2-x4", "ours-k3-int8eng-lookahead-x8",
                                            "ours-k2")] == ["int4", "int8", None]
    assert worker.compression_of("ours-k3-int8eng-lookahead-x8") == "int8eng"
    assert worker.staleness_of("ours-k3-int8eng-lookahead-x8") == (True, "lookahead")
    with pytest.raises(ValueError, match="unknown configuration"):
        worker.parse_configs(["ours-k2-none-x4"])
    width = worker.mlp_width(50e6, 5)
    params = 1024 * width + width + 3 * (width * width + width) + width * 1000 + 1000
    assert abs(params * 4 - 50e6) / 50e6 < 0.01


@pytest.mark.timeout(60)
def test_report_of_a_run_with_automatic_buckets(tmp_path):
    """--bucket-cap-mb auto: the worker records the size the optimizer picked and its first
    bucket; the report's title names them and its predictions bucket ours that way."""
    assert worker.auto_bucket_meta(25.0, 4) == {}
    meta = worker.auto_bucket_meta(None, 2)
    assert meta == {"bucket_cap_auto_mb": 32.0, "bucket_first_mb": 4.0}
    cfg = {"bucket_cap_mb": None, **meta}
    systems = report._bucketings(cfg)
    assert systems["ours"].cap_bytes == 32 * 2**20 and systems["ours"].first_cap_bytes == 4 * 2**20
    assert systems["ddp"].cap_bytes == 25 * 2**20
    assert report._buckets_label(cfg) == "auto (32.0 MiB, first 4; DDP 25)"
    assert report._buckets_label({"bucket_cap_mb": 25.0}) == "25 MB"
    assert report._bucketings({"bucket_cap_mb": 10.0})["ours"].first_cap_bytes is None


def test_bucket_cap_flag_round_trips():
    from pipe_horovod.tools.validators import bucket_cap, bucket_cap_flag

    assert bucket_cap("auto") is None and bucket_cap("12.5") == 12.5
    assert bucket_cap(bucket_cap_flag(None)) is None and bucket_cap(bucket_cap_flag(0.5)) == 0.5
    with pytest.raises(Exception, match="bucket cap must be > 0"):
        bucket_cap("0")


@pytest.mark.timeout(400)
def test_ours_int8eng_and_int4_train_on_both_quantized_paths(torch_run):
    # ours-kK-int8eng / -int4eng: compression=int8_ef / int4_ef with no collective= (the
    # two-stage quantized allreduce on the engine's own collectives), beside the per-hop
    # ring int8 and int4 (with their codec costs measured for the report)
    assert worker.compression_of("ours-k2-int8eng-none") == "int8eng"
    assert worker.compression_of("ours-k2-int4-lookahead") == "int4"
    assert worker.parse_configs("ours-k2-int8eng ours-k2-int8eng-none ours-k2-int4eng") == [
        "ours-k2-int8eng", "ours-k2-int8eng-none", "ours-k2-int4eng"]
    # A block size after a colon, as Compression.by_name reads it.
    assert worker.compression_of("ours-k2-int4eng:32-lookahead") == "int4eng:32"
    assert worker.two_stage_compression("int4eng:32") == "int4_ef:32"
    assert worker.two_stage_compression("int8eng") == "int8_ef"
    with pytest.raises(ValueError, match="'int4' is not a two-stage codec"):
        worker.two_stage_compression("int4")
    with pytest.raises(ValueError, match="unknown configuration 'ours-k2-int4:32'"):
        worker.parse_configs("ours-k2-int4:32")
    out, stdout = torch_run                       # the run above, with these configurations
    summary = json.loads((out / "bench.json").read_text())
    raw = json.loads((out / "bench-raw.json").read_text())
    configs = QUANTIZED
    assert {n: summary["configs"][n]["compression"] for n in configs[:4]} == {
        "ours-k2-int8eng": "int8eng", "ours-k2-int4eng": "int4eng",
        "ours-k2-int8-none": "int8", "ours-k2-int4": "int4"}
    assert set(raw["hop_codec_s_per_byte"]) == {"int8", "int4"}
    # the two-stage codec's stages measured at the bucket size, and the rows predicted
    costs = raw["two_stage_codec_s_per_byte"]
    assert {n: c["compression"] for n, c in costs.items()} == {"int8eng": "int8_ef",
                                                               "int4eng": "int4_ef"}
    assert all(len(c[key]) == 3 and min(c[key]) > 0 for c in costs.values()
               for key in ("wall_s_per_byte", "cpu_s_per_byte"))
    # the optimizer's own work a step, measured alone at the model's buckets (every
    # gradient byte in one of them), for the CPU floor
    step_costs = raw["optimizer_step_costs"]
    assert sum(step_costs["bucket_bytes"]) == raw["meta"]["model_bytes"]
    assert all(step_costs[k]["cpu_s"] > 0 and step_costs[k]["wall_s"] > 0
               for k in ("bucket_copy", "lookahead"))
    for name in configs[:2]:
        row = summary["configs"][name]
        assert row["predicted_s"] > 0 and row["prediction_bound"], (name, row)
    assert "bound: " in stdout
