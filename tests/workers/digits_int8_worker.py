"""The digits example synchronous, then pipelined with int8 + error feedback inside a ring
allreduce, in the same processes; rank 0 compares. The digits-int8 case of
collectives_worker.py's 2-rank horovod launch (its engine shut down by the first run)."""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import pytorch_digits  # noqa: E402

EPOCHS = 6


def check(out):
    """Both runs, their results in folder `out` (rank 0 writes and reads them)."""
    common = ["--epochs", str(EPOCHS), "--no-progress"]
    runs = {"sync": ["--pipeline-depth", "1"],
            "int8_ef": ["--pipeline-depth", "2", "--collective", "ring",
                        "--compression", "int8_ef"]}
    rank = int(os.environ["HOROVOD_RANK"])      # each run shuts its engine down
    for name, argv in runs.items():
        assert pytorch_digits.main(common + argv + ["--json", str(out / f"{name}.json")]) == 0
    if rank == 0:
        sync, int8 = (json.loads((out / f"{n}.json").read_text())["accuracy"] for n in runs)
        print(f"digits: sync {100 * sync:.2f}%, K=2 ring int8+feedback {100 * int8:.2f}%",
              flush=True)
        assert int8 >= sync - 0.01, "int8 + error feedback lost more than 1 point"
