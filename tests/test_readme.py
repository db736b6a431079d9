"""Every code block a user would copy, from README.md and the docs pages that teach the
API, run as written: a documented call that stopped working must fail a test, not a user.

Python blocks are fragments of a training script: each runs unchanged after a prelude
that defines only the names it uses and does not define (a model, data, an optimizer),
so a block that stops working as written fails here. `pipe-horovod plan`'s example in
docs/planner.md runs and must print the table that page shows. Shell blocks that
install, build or need a cluster (make, pip, docker) are not run here; test_deploy
checks what a parser can of those.
"""
import re
import textwrap
import subprocess
import sys
from pathlib import Path

import pytest

import launcher

ROOT = Path(__file__).resolve().parent.parent
# The pages whose python blocks are the API's examples (the quick starts, and the
# adapters' pages they link to).
PAGES = ("README.md", "docs/pytorch.md", "docs/keras.md", "docs/compression.md",
         "docs/faults.md")
FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```", re.S | re.M)
BLOCKS = [(page, lang, code) for page in PAGES
          for _, lang, code in FENCE.findall((ROOT / page).read_text())]
PLANNER = FENCE.findall((ROOT / "docs" / "planner.md").read_text())
# The plan example the test re-prints: docs/planner.md's "At the example setting".
PLAN_COMMAND = ("pipe-horovod plan --model resnet50 --batch-size 64 --device-tflops 312 "
                "--bandwidth 25gbit --latency 5us --workers 64")

TORCH = """
import torch, torch.nn.functional as F
import pipe_horovod.torch as hvd
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
"""
# Prelude per block, keyed by a line that identifies the block.
PRELUDES = {
    "import pipe_horovod.torch as hvd          # was:": TORCH + """
loader = [(torch.randn(8, 4), torch.randint(0, 2, (8,))) for _ in range(3)]
loss_fn = F.cross_entropy
""",
    "opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), grad_scaler":
        TORCH + """
hvd.init()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
loss = model(torch.randn(8, 4)).square().mean()
""",
    'collective="ring"': TORCH + """
hvd.init()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
""",
    "compression=hvd.Compression.int8_ef)  # two stages": TORCH + """
hvd.init()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
""",
    "import pipe_horovod.keras as hvd": """
import numpy as np, keras
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
y = np.arange(32) % 3
""",
    "with pipe_horovod.Preemption() as preempt:": TORCH + """
import sys, pipe_horovod
hvd.init()
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
start, steps = 0, 3
""",
    "import pipe_horovod.tensorflow as hvd": """
import numpy as np, keras
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
loss_fn = keras.losses.SparseCategoricalCrossentropy()
rng = np.random.default_rng(0)
dataset = [(rng.standard_normal((8, 4)).astype("float32"), rng.integers(0, 3, 8))
           for _ in range(3)]
""",
}

# Blocks that run in the Keras process (TensorFlow is imported there anyway).
KERAS_PROCESS = ("pipe_horovod.keras", "pipe_horovod.tensorflow")


def _python_blocks():
    return [textwrap.dedent(code) for _, lang, code in BLOCKS if lang == "python"]


def _prelude(code):
    found = [prelude for key, prelude in PRELUDES.items() if key in code]
    assert len(found) == 1, f"python block without a prelude here (add one):\n{code}"
    return found[0]


def test_every_python_block_has_a_prelude():
    blocks = _python_blocks()
    for code in blocks:
        _prelude(code)
    unused = [key for key in PRELUDES if not any(key in code for code in blocks)]
    assert not unused, f"preludes whose block was removed from {PAGES}: {unused}"


# One process for every PyTorch block (each in a fresh namespace, the engine shut down
# after it) and one for Keras: a process start costs more than a block here.
RUNNER = """
import sys, traceback
for index, source in enumerate(BLOCKS):
    try:
        exec(compile(source, f"docs block {index}", "exec"), {"__name__": "__main__"})
    except SystemExit:
        raise
    except BaseException:
        print(f"BLOCK_FAILED {index}\\n{traceback.format_exc()}", flush=True)
        continue
    finally:
        import pipe_horovod
        if pipe_horovod.engine.is_initialized():
            pipe_horovod.engine.shutdown()
    print(f"BLOCK_OK {index}", flush=True)
"""


@pytest.mark.parametrize("framework", ["torch", "keras"])
def test_python_blocks_run_as_written(framework, tmp_path):
    blocks = [code for code in _python_blocks()
              if any(name in code for name in KERAS_PROCESS) == (framework == "keras")]
    sources = [_prelude(code) + "\n" + code for code in blocks]
    script = tmp_path / "blocks.py"
    script.write_text(f"BLOCKS = {sources!r}\n{RUNNER}")
    rc, out = launcher.run_command([sys.executable, script], 1, timeout=240, expect_ok=False,
                                   env={"PIPE_HOROVOD_TUNE": ""})     # the default, as a user
    done = set(map(int, re.findall(r"BLOCK_OK (\d+)", out)))
    failed = [blocks[i] for i in range(len(blocks)) if i not in done]
    assert rc == 0 and not failed, (f"documented block(s) failed as written:\n"
                                    + "\n---\n".join(failed) + f"\noutput:\n{out[-4000:]}")


def test_plan_block_prints_the_documented_table():
    at = next(i for i, (_, _, code) in enumerate(PLANNER) if code.strip() == PLAN_COMMAND)
    command, shown = PLANNER[at][2], PLANNER[at + 1][2]
    assert shown.startswith("Plan: ")
    argv = command.split()
    out = subprocess.run([str(Path(sys.executable).parent / argv[0]), *argv[1:]],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.strip() == shown.strip()
