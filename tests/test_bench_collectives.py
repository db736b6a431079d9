"""`pipe-horovod bench-collectives`: a tiny real run reports every configuration (with
--unmatched: plain torch.distributed all_reduce beside the engine's); busbw math.

No speed assertions (shared 2-core machines): the run is on loopback, two
sizes, one repetition; the emulated-cluster figures live in docs/bench/log.md.
"""
import json
import os
import subprocess
import sys

import pytest

from pipe_horovod.collectives import cost_model
from pipe_horovod.pipeline import timing_model
from pipe_horovod.tools.bench import collectives_report, collectives_worker
from pipe_horovod.collectives import layout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bus_bandwidth_is_nccl_tests_allreduce_definition():
    # 64 MiB = 67108864 B in 0.5 s: algbw 134217728 B/s; x 2(p-1)/p = 1.5 at p = 4, 1 at p = 2
    assert collectives_report.bus_bandwidth(64 * 2**20, 0.5, 4) == pytest.approx(201326592.0)
    assert collectives_report.bus_bandwidth(64 * 2**20, 0.5, 2) == pytest.approx(134217728.0)


def test_prediction_uses_the_wire_bytes_of_the_codec():
    net = cost_model.Network(alpha=1e-4, beta=8e-9)
    assert collectives_report.predicted_seconds(net, 4, 2**26, "ring/int8") == pytest.approx(
        timing_model.ring_allreduce(net, 4, 2**24))
    assert collectives_report.predicted_seconds(net, 3, 2**26, "native/none") == pytest.approx(
        timing_model.ring_allreduce(net, 3, 2**26))
    # with measured codec costs, the busiest rank's per-hop codec CPU is added
    costs = {"int8": (1e-9, 2e-9, 3e-9)}
    assert collectives_report.predicted_seconds(net, 4, 2**26, "lp/int8", costs) == pytest.approx(
        timing_model.lp_allreduce(net, 4, 2**24, chunks=layout.lp_chunks(4, 2**24))
        + 2**26 * 6e-9)


def test_prediction_with_per_block_costs_and_message_cost():
    net = cost_model.Network(alpha=1e-4, beta=8e-9)
    p, n = 4, 2**26
    # ring/int8: 2^24 wire bytes, 4 MiB per segment -> 4 pieces of 1 MiB wire, 16 blocks
    # of 4 MiB float32; be: q = 4 blocks; lp: the collective's own chunk count
    assert collectives_report.blocks(p, n, "ring", "int8") == 16
    assert collectives_report.blocks(p, n, "be", "int8") == 4
    assert collectives_report.blocks(p, n, "lp", "int8") == layout.lp_chunks(p, 2**24)
    table = {"int8": {str(2**22): (1e-9, 2e-9, 3e-9), str(2**24): (4e-9, 4e-9, 4e-9)}}
    slow = cost_model.Network(alpha=1.5e-4, beta=8e-9)           # alpha + 50 us per message
    assert collectives_report.predicted_seconds(net, p, n, "ring/int8", table, 5e-5) == \
        pytest.approx(timing_model.ring_allreduce(slow, p, 2**24)
                      + n * (1e-9 / 4 + 0.75 * 2e-9 / 4 + 3e-9))
    # be: 16 MiB blocks, all of its codec work on the path
    assert collectives_report.predicted_seconds(net, p, n, "be/int8", table, 5e-5) == \
        pytest.approx(timing_model.be_allreduce(slow, p, 2**24) + n * (1 + 0.75 + 1) * 4e-9)
    # the engine's own allreduce pays neither
    assert collectives_report.predicted_seconds(net, p, n, "native/none", table, 5e-5) == \
        pytest.approx(timing_model.ring_allreduce(net, p, n))


def test_chain_run_predicts_lp_with_one_stream_and_no_mst():
    sizes, configs = [2**20, 2**24], ["native/none", "lp/none", "mst/none"]
    seconds = {"native/none": 0.2, "lp/none": 0.15, "mst/none": 0.4}
    times = {c: {str(n): [seconds[c] * n / 2**24] for n in sizes} for c in configs}
    raw = {"meta": {"workers": 3, "sizes": sizes, "configs": configs, "reps": 1,
                    "engine": "torch", "message_s": 5e-5},
           "times": [times] * 3, "launch": {"emulate": "1gbit", "topology": "chain"}}
    summary = collectives_report.summarize(raw)
    assert summary["topology"] == "chain"
    net = cost_model.Network(summary["network"]["alpha_s"], summary["network"]["beta_s_per_byte"])
    rows = {(r["config"], r["bytes"]): r for r in summary["rows"]}
    lp = rows["lp/none", 2**24]
    assert lp["predicted_s"] == pytest.approx(timing_model.lp_allreduce(
        timing_model.with_message_cost(net, 5e-5), 3, 2**24,
        chunks=collectives_report.blocks(3, 2**24, "lp", "none"), topology="chain"))
    assert all(rows["mst/none", n]["predicted_s"] is None for n in sizes)
    text = collectives_report.markdown(summary)
    assert "emulated 1gbit links, chain" in text
    assert "no prediction for mst on a chain" in text
    assert not any(t["target"].startswith("mst/none") for t in summary["targets"])


def test_name_matching_compares_the_engine_with_plain_all_reduce():
    sizes = [1024, 2**22]
    seconds = {"native/none": 3e-3, "unmatched/none": 1e-3, "native-8/none": 1e-3,
               "unmatched-8/none": 1.25e-3, "ring/none": 2e-3}
    configs = list(seconds)
    assert configs[:4] == collectives_worker.config_names((), (), unmatched=True)
    assert collectives_worker.config_names((), ()) == ["native/none"]
    times = {c: {str(n): [seconds[c] * (1 if n == 1024 else 4)] for n in sizes}
             for c in configs}
    raw = {"meta": {"workers": 2, "sizes": sizes, "configs": configs, "reps": 1,
                    "engine": "torch"}, "times": [times] * 2}
    summary = collectives_report.summarize(raw)
    first = summary["name_matching"][0]
    assert first["bytes"] == 1024
    assert first["overhead_s"] == pytest.approx(2e-3)
    assert first["ratio"] == pytest.approx(3.0)
    assert first["in_flight"]["ratio"] == pytest.approx(0.8)
    rows = {(r["config"], r["bytes"]): r for r in summary["rows"]}
    assert all(rows[c, n]["predicted_s"] is None for c in configs[1:4] for n in sizes)
    assert rows["ring/none", 2**22]["predicted_s"] is not None   # the others keep theirs
    text = collectives_report.markdown(summary)
    assert "| 1 KB | 1000 | 3000 | +2000 | 3.00x | 1250 | 1000 | -250 | 0.80x |" in text
    assert "no prediction for" not in text
    # without --unmatched: no table
    plain = {**raw, "meta": {**raw["meta"], "configs": ["native/none", "ring/none"]}}
    assert collectives_report.summarize(plain)["name_matching"] == []


def run_local_bench(tmp_path, name, *options):
    """`pipe-horovod bench-collectives` on 2 local torch workers at 4 KiB and 64 KiB, one
    rep, writing `name`.* under tmp_path; the finished process (exit 0 asserted)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    env.pop("PIPE_HOROVOD_ENGINE", None)
    cmd = [sys.executable, "-m", "pipe_horovod.tools.cli", "bench-collectives", "--no-progress",
           "--workers", "2", "--engine", "torch", "--sizes", "4KiB,64KiB", "--reps", "1",
           *options, "--out", str(tmp_path), "--name", name]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=110,
                         stdin=subprocess.DEVNULL)
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout}\n{res.stderr}"
    return res


@pytest.mark.timeout(120)
def test_local_torch_run_reports_every_algorithm_and_codec(tmp_path):
    res = run_local_bench(tmp_path, "bc", "--unmatched")
    for name in ("bc-raw.json", "bc.md", "bc.json", "bc.png"):
        assert (tmp_path / name).is_file(), name
    assert (tmp_path / "bc.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "bc.md").read_text() in res.stdout
    summary = json.loads((tmp_path / "bc.json").read_text())
    configs = collectives_worker.config_names(unmatched=True)
    yardsticks = ["unmatched/none", "native-8/none", "unmatched-8/none"]
    assert configs[:4] == ["native/none", *yardsticks] and len(configs) == 16
    assert summary["meta"]["configs"] == configs and summary["meta"]["workers"] == 2
    rows = {(r["config"], r["bytes"]): r for r in summary["rows"]}
    assert set(rows) == {(c, s) for c in configs for s in (4096, 65536)}
    for (config, nbytes), r in rows.items():
        assert (r["algorithm"], r["codec"]) == tuple(config.split("/"))
        assert r["time_s"] > 0 and r["algbw_bytes_per_s"] > 0
        assert r["busbw_bytes_per_s"] == pytest.approx(r["algbw_bytes_per_s"])   # p = 2
        assert (r["predicted_s"] is None) == (config in yardsticks)
    matching = summary["name_matching"]                # what name matching costs per call
    assert [m["bytes"] for m in matching] == [4096, 65536]
    for m in matching:
        for part in (m, m["in_flight"]):
            assert part["plain_s"] > 0 and part["matched_s"] > 0
            assert part["overhead_s"] == pytest.approx(part["matched_s"] - part["plain_s"])
    assert "Cost of name matching per collective" in res.stdout
    raw = json.loads((tmp_path / "bc-raw.json").read_text())
    assert raw["launch"]["command"].startswith("pipe-horovod bench-collectives --workers 2")
    assert raw["launch"]["command"].endswith(" --unmatched")
    assert len(raw["times"]) == 2                                        # every rank's times
    costs = raw["meta"]["codec_costs_s_per_byte"]           # (encode, add, decode) per codec
    assert set(costs) == {"bf16", "int8"} and all(0 < c < 1e-6 for v in costs.values() for c in v)
    by_block = raw["meta"]["codec_costs_s_per_byte_by_block"]
    assert set(by_block) == {"bf16", "int8"}
    assert set(by_block["int8"]) == {str(b) for b in collectives_worker.COST_BLOCKS}
    assert all(0 < c < 1e-6 for v in by_block["int8"].values() for c in v)
    assert 0 < raw["meta"]["message_s"] < 0.1               # one-way small message, seconds


@pytest.mark.timeout(60)
def test_one_worker_and_missing_results_exit_2(capsys, tmp_path):
    from pipe_horovod.tools import cli

    assert cli.main(["bench-collectives", "--workers", "1", "--out", str(tmp_path)]) == 2
    assert "--workers >= 2" in capsys.readouterr().err
    assert cli.main(["bench-collectives", "--report-only", "--out", str(tmp_path)]) == 2
    assert "run the benchmark first" in capsys.readouterr().err
    assert cli.main(["bench-collectives", "--topology", "chain", "--out", str(tmp_path)]) == 2
    assert "--topology chain needs --emulate" in capsys.readouterr().err
    assert cli.main(["bench-collectives", "--engine", "horovod", "--unmatched",
                     "--out", str(tmp_path)]) == 2
    assert "--unmatched" in capsys.readouterr().err


def test_two_stage_configs_run_only_codecs_with_a_wire_format():
    names = collectives_worker.config_names(("ring", "two-stage"), ("none", "int8", "fp8_e4m3"))
    assert names == ["native/none", "ring/none", "ring/int8", "two-stage/int8",
                     "two-stage/fp8_e4m3"]
    # the report predicts two-stage from timing_model.two_stage_allreduce and adds the speed-up
    net = cost_model.Network(alpha=1e-4, beta=8e-9)
    assert collectives_report.predicted_seconds(net, 4, 2**26, "two-stage/int8") == \
        pytest.approx(timing_model.two_stage_allreduce(net, 4, 2**26))
    # the target: int8 two-stage >= 3x the engine's allreduce at 64 MB
    sizes, configs = [2**20, 2**26], ["native/none", "two-stage/int8"]
    seconds = {"native/none": 0.6, "two-stage/int8": 0.15}
    times = {c: {str(n): [seconds[c] * n / 2**26] for n in sizes} for c in configs}
    raw = {"meta": {"workers": 2, "sizes": sizes, "configs": configs, "reps": 1,
                    "engine": "torch"}, "times": [times] * 2}
    summary = collectives_report.summarize(raw)
    target = next(t for t in summary["targets"] if t["target"].startswith("native/none time"))
    assert target["target"] == "native/none time / two-stage/int8 time >= 3.0"
    assert target["value"] == pytest.approx(4.0) and target["met"]
    assert "| 64 MB | 4.00x |" in collectives_report.markdown(summary)


@pytest.mark.timeout(120)
def test_local_run_times_the_engines_two_stage_quantized_allreduce(tmp_path):
    run_local_bench(tmp_path, "ts", "--algorithms", "ring,two-stage", "--codecs",
                    "none,int8,fp8_e4m3")
    summary = json.loads((tmp_path / "ts.json").read_text())
    configs = ["native/none", "ring/none", "ring/int8", "two-stage/int8", "two-stage/fp8_e4m3"]
    assert summary["meta"]["configs"] == configs
    rows = {(r["config"], r["bytes"]): r for r in summary["rows"]}
    assert set(rows) == {(c, n) for c in configs for n in (4096, 65536)}
    assert all(r["time_s"] > 0 and r["predicted_s"] is not None for r in rows.values())
    text = (tmp_path / "ts.md").read_text()
    assert "`two-stage/int8`" in text and "`two-stage/fp8_e4m3`" in text
    assert "Speed-up over the engine's own allreduce" in text
    speedups = [line for line in text.split("Speed-up over")[1].splitlines()
                if line.startswith("| 64 KB |")]
    assert len(speedups) == 1 and speedups[0].count("x |") == len(configs) - 1
    raw = json.loads((tmp_path / "ts-raw.json").read_text())
    assert set(raw["meta"]["codec_costs_s_per_byte"]) == {"int8"}    # fp8 has no per-hop form
