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
    assert len(steps) == 7
    assert steps["ours-k2-int8"] < steps["ours-k2-fp16"] < steps["ours-k2"] < steps["ours-k1"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and str(png) in out
