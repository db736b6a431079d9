"""`pipe-horovod memory`: its tables, and the Keras adapter's live memory at the floor.

The Keras measurement runs in another process: TensorFlow's CPU allocator counts its
bytes only when $TF_CPU_ALLOCATOR_USE_BFC is set before TensorFlow starts; the process is
test_keras's one-process TensorFlow fit launch (tests/keras_launches.py), which measures
first and then runs its fits (a TensorFlow start-up spared). One process
with a gradient predivide factor of 2 sends the gradients through the pipeline (the
FIFO, the slot buffers, the lookahead's shadow weights) as on many ranks.
"""
import json

import pytest

import launcher
from keras_launches import MEMORY_LAUNCH, fit_launch
from pipe_horovod.tools.commands import memory


def test_the_tables_show_every_column():
    torch_rows = [{"width": 64, "optimizer": "adam", "engine": "torch", "config": "ours-k2-default",
                   "live": 6.0, "backward_peak": 7.0, "compensation_ms": 2.0, "optimizer_step_ms": 4.0, "ratio": 0.45,
                   "compensation_cpu_ms": 1.0, "optimizer_step_cpu_ms": 2.5, "cpu_ratio": 0.4},
                  {"width": 64, "optimizer": "adam", "engine": "torch", "config": "ours-k1",
                   "live": 4.0, "optimizer_step_ms": 4.0}]
    text = memory.table(torch_rows)
    assert "| 0.0 | adam | torch | ours-k2-default | 6.00 | 7.00 | 2.00 | 4.00 | 0.45 | 1.00 " \
           "| 2.50 | 0.40 |" in text
    assert "| ours-k1 | 4.00 | – | – | 4.00 | – | – | – | – |" in text
    keras_rows = [{"params": 2_100_000, "optimizer": "sgd-momentum", "backend": "tensorflow",
                   "engine": "torch", "config": "ours-k2-default", "live": 5.01, "tf": 3.01,
                   "torch": 2.0, "tf_peak": 5.0},
                  {"params": 2_100_000, "optimizer": "adam", "backend": "torch",
                   "engine": "torch", "config": "keras", "live": 4.0, "tf": 0.0, "torch": 4.0}]
    text = memory.keras_table(keras_rows)
    assert "| 2.10 | sgd-momentum | tensorflow | torch | ours-k2-default | 5.01 | 3.01 | 2.00 " \
           "| 5.00 |" in text
    assert "| 2.10 | adam | torch | torch | keras | 4.00 | 0.00 | 4.00 | – |" in text


def test_keras_on_tensorflow_default_is_the_unwrapped_optimizer_plus_two_copies(
        tmp_path_factory):
    # Between steps the default holds, beyond the unwrapped Keras optimizer, the averaged
    # gradient in flight (one slot buffer: the slot applied at this step is let go, since
    # TensorFlow keeps no gradient between steps) and the real weights (the shadow
    # variables), as the PyTorch adapter does (+ 3 before the shadow copy went). Plain K=2:
    # the gradient in flight alone. No cached zeros for the steps that fill the pipeline
    # (a whole copy until 2026-11-25), no saved optimizer state.
    pytest.importorskip("tensorflow")
    pytest.importorskip("keras")
    _, code, out = fit_launch(tmp_path_factory, *MEMORY_LAUNCH, 1)
    launcher.assert_case(code, out, 1, "memory", "keras_worker.py on local tensorflow")
    configs = ("keras", "ours-k2", "ours-k2-default")
    rows = {r["config"]: r for r in (json.loads(line.split("MEMORY ", 1)[1])
                                     for line in out.splitlines() if "MEMORY " in line)}
    assert set(rows) == set(configs), out[-4000:]
    # (2.1 M parameters: on small models TensorFlow's own allocations of ~100 kB come and go
    # between measurements.)
    unwrapped = rows["keras"]["live"]
    for config, extra in zip(configs, (0.0, 1.0, 2.0)):
        assert rows[config]["live"] - unwrapped == pytest.approx(extra, abs=0.05), (config, rows)
    # The pipeline's torch side: the one slot in flight; TensorFlow's side grows by the
    # real weights alone under the default.
    assert rows["ours-k2"]["torch"] == pytest.approx(1.0, abs=0.01), rows
    assert rows["ours-k2-default"]["torch"] == pytest.approx(1.0, abs=0.01), rows
    assert rows["ours-k2-default"]["tf"] - rows["ours-k2"]["tf"] == pytest.approx(1.0, abs=0.05), \
        rows


@pytest.mark.parametrize("framework, parse", [("torch", "memory_worker"),
                                               ("keras", "keras_memory_worker")])
def test_the_command_line_passes_what_each_worker_reads(framework, parse):
    """`pipe-horovod memory --framework keras` once passed the PyTorch worker's --model to
    the Keras worker, which exited with a usage error: each worker parses what it gets."""
    import argparse
    import importlib

    parser = argparse.ArgumentParser()
    memory.add_arguments(parser)
    args = parser.parse_args(["--framework", framework, "--configs", "ours-k1"])
    worker = importlib.import_module(f"pipe_horovod.tools.bench.{parse}")
    backend = None if framework == "torch" else "tensorflow"
    worker.parse_args(memory.worker_arguments(args, backend))
