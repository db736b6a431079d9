"""`pipe-horovod plan`: the table against hand-computed schedules, bad input, a real model."""
import pytest

from pipe_horovod.tools.cli import main
from pipe_horovod.tools.workloads import architectures
from pipe_horovod.tools.workloads.architectures import Layer

# Forward order. At 1 TFLOP/s: forward 2, 4, 1 ms (backward 4, 8, 2 ms); fp32 gradients
# of 4, 8 and 12 MB. Backward makes them ready at 2 ms (12 MB), 10 ms (8 MB), 14 ms (4 MB).
STAND_IN = [Layer("a", (("a.weight", (1_000_000,)),), 2_000_000_000),
            Layer("b", (("b.weight", (2_000_000,)),), 4_000_000_000),
            Layer("c", (("c.weight", (3_000_000,)),), 1_000_000_000)]
ARGV = ["plan", "--model", "mlp", "--batch-size", "8", "--device-tflops", "1", "--bandwidth", "1GB/s",
        "--latency", "1ms", "--workers", "2", "--bucket-cap-mb", "10"]


def test_table_matches_hand_computed_schedules(monkeypatch, capsys):
    monkeypatch.setattr(architectures, "layer_table", lambda model, batch: STAND_IN)
    assert main(ARGV) == 0
    out = capsys.readouterr().out
    # 2-worker ring: a bucket of n bytes costs 2 ms + n / 1 GB/s. F = 7 ms, B = 14 ms.
    # Horovod fuses 12 MB at 2 ms (lands 16), then 8 + 4 MB at 16 (lands 30): 7 + 30 = 37 ms.
    # DDP: 12 MB (past its 1 MiB first bucket) at 2 ms, 8 + 4 MB at 14 ms: the same 37 ms.
    # Ours (10 MiB cap): 12, 8, 4 MB at 2, 10, 14 ms land 16, 26, 32: K=1 39 ms; the link is
    # busy 30 ms > 21 ms of compute, so K=2 takes 30 ms; fp16 halves it to 18 (compute-bound, 21).
    for line in [
        "| horovod (Horovod DistributedOptimizer, sync) | 1 | 24.0 | 28.00 | 37.00 | 432 | 1.00x | network |",
        "| ddp (torch DDP, sync) | 1 | 24.0 | 28.00 | 37.00 | 432 | 1.00x | network |",
        "| ours-k1 (ours, K=1) | 1 | 24.0 | 30.00 | 39.00 | 410 | 0.95x | network |",
        "| ours-k2 (ours, K=2) | 2 | 24.0 | 30.00 | 30.00 | 533 | 1.23x | network |",
        "| ours-k2-fp16 (ours, K=2, fp16 on the wire) | 2 | 12.0 | 18.00 | 21.00 | 762 | 1.76x | compute |",
        "| ours-k2-bf16hop (ours, K=2, bf16 per ring hop) | 2 | 12.0 | 18.00 | 21.00 | 762 | 1.76x | compute |",
        "| ours-k2-int8 (ours, K=2, int8 per ring hop) | 2 | 6.0 | 12.00 | 21.00 | 762 | 1.76x | compute |",
        # int4: 3 MB on the wire, three buckets' 2 ms each + 3 ms of bytes
        "| ours-k2-int4 (ours, K=2, int4 per ring hop) | 2 | 3.0 | 9.00 | 21.00 | 762 | 1.76x | compute |",
        # The int4 exchange of each bucket, two stages of 2 ms + 0.12890625 of its bytes at
        # 1 GB/s: 3.546875, 3.03125, 2.515625 ms from 2, 10, 14 ms (the last lands at
        # 16.52: step() waits 2.52 ms); the link carries 30 + 9.09 ms.
        "| ours-k2-x4 (ours, K=2, lookahead from an int4 exchange: prediction_exchange) | 2 | "
        "27.1 | 39.09 | 39.09 | 409 | 0.95x | network |",
    ]:
        assert line in out
    assert "forward 7.00 ms, backward 14.00 ms" in out
    assert "ring allreduce on a full-bisection network" in out and "backward = 2 x forward" in out


@pytest.mark.parametrize("flag,value,message", [
    ("--bandwidth", "-10gbit", "must not be negative"),
    ("--bandwidth", "0gbit", "bandwidth must be > 0"),
    ("--model", "alexnet", "unknown model 'alexnet'; choose from resnet50, vgg16"),
    ("--workers", "0", "workers must be >= 1"),
    ("--batch-size", "0", "batch size must be >= 1"),
    ("--device-tflops", "0", "device throughput must be > 0"),
])
def test_bad_input_exits_2_with_a_message(capsys, flag, value, message):
    argv = list(ARGV)
    argv[argv.index(flag) + 1] = value
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and message in err and "Traceback" not in err


def test_resnet50_plan_and_plot(tmp_path, capsys):
    png = tmp_path / "plan.png"
    # Batch 1: the table test_workloads builds too (layer_table caches it).
    assert main(["plan", "--model", "resnet50", "--batch-size", "1", "--device-tflops", "1",
                 "--bandwidth", "25gbit", "--latency", "5us", "--workers", "64", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    # 25,557,032 parameters; 8.18 GFLOP per image forward: at 1 TFLOP/s 8.18 ms.
    assert "25.6 M parameters (102.2 MB of fp32 gradients); forward 8.18 ms, backward 16.36 ms" in out
    steps = {line.split(" ")[1]: float(line.split("|")[5]) for line in out.splitlines()
             if line.startswith("| ours") or line.startswith("| horovod") or line.startswith("| ddp")}
    assert len(steps) == 9
    assert steps["ours-k2-int4"] <= steps["ours-k2-int8"] < steps["ours-k2-fp16"] < steps["ours-k2"] < steps["ours-k1"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and str(png) in out


# The automatic bucket size's promise: with bucket_cap_mb at its default (auto, pipeline.buckets.auto_bucket_cap_mb)
# our K=1 is >= 0.97x and K=2 >= 1.0x Horovod's DistributedOptimizer for ResNet-50 (batch 64,
# 100 TFLOP/s) and BERT-base (batch 32, 200 TFLOP/s) at 8, 64 and 256 workers on 10, 25 and
# 100 Gbit/s (20 us). One cell misses, and docs/planner.md says why: ResNet-50 at 64 workers on
# 100 Gbit/s, where no cap chosen from the cluster alone serves both models.
SCALES = [8, 64, 256]
LINKS = ["10gbit", "25gbit", "100gbit"]
SCALE_MODELS = {"resnet50": ("64", "100"), "bert-base": ("32", "200")}
MODEL_BYTES = {"resnet50": 25_557_032 * 4, "bert-base": 109_482_240 * 4}   # fp32 gradients
MIB = 2**20


def _sweep(capsys, model, *extra):
    batch, tflops = SCALE_MODELS[model]
    assert main(["plan", "--model", model, "--batch-size", batch, "--device-tflops", tflops,
                 "--workers", ",".join(map(str, SCALES)), "--bandwidth", ",".join(LINKS),
                 *extra]) == 0
    out = capsys.readouterr().out
    cells = {}
    for line in out.splitlines():
        parts = [p.strip() for p in line.strip("|").split("|")]
        if len(parts) == 8 and parts[0].isdigit():
            cells[(model, int(parts[0]), float(parts[1].split()[0]))] = (
                float(parts[2]), float(parts[4].rstrip("x")), float(parts[5].rstrip("x")))
    assert len(cells) == len(SCALES) * len(LINKS)
    return out, cells


@pytest.mark.parametrize("model", sorted(SCALE_MODELS))
def test_auto_buckets_keep_up_with_horovod_at_scale(capsys, model):
    out, cells = _sweep(capsys, model)
    assert "our buckets auto" in out
    for key, (cap, k1, k2) in cells.items():
        assert k2 >= 1.0, (key, cap, k2)
        assert k1 >= 0.97, (key, cap, k1)
        # the planner's cap is the runtime's, for this model's gradients
        from pipe_horovod.pipeline.buckets import (auto_bucket_cap_mb, auto_splits_model,
                                                   split_cap_bytes)
        runtime = auto_bucket_cap_mb(key[1], key[2] * 1e9 / 8, 20e-6)
        if auto_splits_model(key[1], 20e-6):
            runtime = split_cap_bytes(runtime * MIB, MODEL_BYTES[model]) / MIB
        assert cap == pytest.approx(runtime, abs=0.05)


def test_one_fused_bucket_is_what_missed_at_64_workers(capsys):
    # 128 MiB given (one bucket for ResNet-50, no early first one) misses K=1 >= 0.97x
    # where the automatic cap, at most half the model, meets it (test above); so does 64.
    _, cells = _sweep(capsys, "resnet50", "--bucket-cap-mb", "128")
    assert cells[("resnet50", 64, 100.0)][1] < 0.97
    _, cells = _sweep(capsys, "resnet50", "--bucket-cap-mb", "64")
    cap, k1, k2 = cells[("resnet50", 64, 100.0)]
    assert cap == 64 and k1 >= 0.97 and k2 >= 1.0
    # and 25 MiB, the old default, is what the issue measured: 0.93x at 64 workers, 25 Gbit/s
    _, cells = _sweep(capsys, "resnet50", "--bucket-cap-mb", "25")
    assert cells[("resnet50", 64, 25.0)][1] == pytest.approx(0.93, abs=0.005)


def test_sweep_refuses_a_plot(capsys, tmp_path):
    with pytest.raises(SystemExit, match="--plot draws one cluster"):
        main(["plan", "--model", "resnet50", "--batch-size", "1", "--device-tflops", "1",
              "--workers", "8,64", "--bandwidth", "25gbit", "--plot", str(tmp_path / "x.png")])


def test_two_stage_int8_model():
    from pipe_horovod.collectives import cost_model
    from pipe_horovod.pipeline import timing_model

    net = cost_model.Network(alpha=1e-3, beta=1e-9)
    n = 1e8                                            # float32 bytes
    # int8 values + a float32 scale per 256: 0.25 + 1/256 of the float32 bytes.
    assert timing_model.two_stage_wire_ratio() == pytest.approx(0.25 + 1 / 256)
    wire = n * (0.25 + 1 / 256)
    # 4 ranks: alltoall 3 messages + 3/4 of the wire, allgather the same.
    expected = 2 * (3 * 1e-3 + 0.75 * wire * 1e-9)
    assert timing_model.two_stage_allreduce(net, 4, n) == pytest.approx(expected)
    # what the plan's row uses: a ring allreduce of the wire bytes costs the same (gamma 0)
    assert timing_model.allreduce_time(net, 4, wire) == pytest.approx(expected)
    # the float32 sum of the own shard: (p-1)/p of the float32 bytes through gamma
    with_gamma = cost_model.Network(1e-3, 1e-9, gamma=1e-10)
    assert timing_model.two_stage_allreduce(with_gamma, 4, n) == pytest.approx(expected + 0.75 * n * 1e-10)
    assert timing_model.two_stage_allreduce(net, 1, n) == 0.0
    assert timing_model.two_stage_wire_ratio(16) == pytest.approx(0.25 + 1 / 16)
    with pytest.raises(ValueError, match="block_size"):
        timing_model.two_stage_wire_ratio(0)


def test_plan_shows_the_two_stage_row_on_request(monkeypatch, capsys):
    monkeypatch.setattr(architectures, "layer_table", lambda model, batch: STAND_IN)
    assert main(ARGV) == 0
    assert "2stage" not in capsys.readouterr().out
    assert main(ARGV + ["--int8-two-stage"]) == 0
    out = capsys.readouterr().out
    # 24 MB * (0.25 + 1/256) = 6.09 MB on the wire; 3 buckets of 2 ms latency + 6.09 ms of
    # bytes = 12.09 ms of link time, below 21 ms of compute: compute-bound as int8 per hop.
    assert ("| ours-k2-int8-2stage (ours, K=2, int8 in two stages on the engine's collectives) "
            "| 2 | 6.1 | 12.09 | 21.00 | 762 | 1.76x | compute |") in out
    # int4_ef at blocks of 32 (the block that meets the convergence rule): 24 MB *
    # (0.5 + 4/32) / 4 = 3.75 MB; 6 ms of latency + 3.75 ms of bytes, compute-bound
    assert ("| ours-k2-int4-2stage (ours, K=2, int4_ef:32 in two stages on the engine's "
            "collectives) | 2 | 3.8 | 9.75 | 21.00 | 762 | 1.76x | compute |") in out


def test_plan_states_its_topology_limit_and_points_to_simulate(monkeypatch, capsys):
    """The planner assumes full bisection; SimGrid finds it too fast behind shared uplinks
    and NICs (docs/simulate.md), so every table ends by saying so and naming the command
    that simulates the topology, one line, with a --topology that command accepts."""
    import re

    from pipe_horovod.tools.commands.plan import TOPOLOGY_LIMIT
    from pipe_horovod.tools.simulate.topology import parse_topology

    monkeypatch.setattr(architectures, "layer_table", lambda model, batch: STAND_IN)
    assert main(ARGV) == 0
    single = capsys.readouterr().out
    sweep = ARGV[:ARGV.index("--workers")] + ["--workers", "2,4", "--bucket-cap-mb", "10"]
    assert main(sweep) == 0
    swept = capsys.readouterr().out
    assert "Sweep: " in swept
    for out in (single, swept):
        assert out.rstrip().splitlines()[-1] == TOPOLOGY_LIMIT
    assert "\n" not in TOPOLOGY_LIMIT
    assert TOPOLOGY_LIMIT.startswith("Limit: full bisection, no contention, flat rings")
    command = re.search(r"`(pipe-horovod simulate [^`]*)`", TOPOLOGY_LIMIT).group(1)
    topologies = command.split("--topology ")[1].split()[0].split(",")
    assert [parse_topology(t).kind for t in topologies] == ["fattree", "nodes"]
