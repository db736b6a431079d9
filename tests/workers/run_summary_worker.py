"""The measured-run record (pipeline/run_record.py) in a real launch.

As optimizer_worker.py's case run-summary (torch engine, 2 ranks): training with the
record on and with it off (the machine's record set to None) ends at bit-identical
weights, K=1 and K=2, uncompressed and int8_ef; what it recorded is consistent (every
launched bucket of a step, its bytes, landings after launches, no negative time);
write_run_summary writes on rank 0 only; PIPE_HOROVOD_RUN_SUMMARY has rank 0 write one
at exit (tests/test_plan_from_run.py reads both files).

As a script, it records the runs tests/data/run-*.json hold (`record` below).
"""
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import pipe_horovod.torch as hvd
from pipe_horovod.compression import Compression


def _train(model, depth, compression, steps, record=True, batch=6, width=8):
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                         named_parameters=model.named_parameters(),
                                         pipeline_depth=depth, compression=compression,
                                         bucket_cap_mb=0.0005)
    if not record:
        optimizer._machine.record = None
    for step in range(steps):
        g = torch.Generator().manual_seed(1009 * hvd.rank() + step)
        x, y = torch.randn(batch, width, generator=g), torch.randint(0, 4, (batch,), generator=g)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    optimizer.flush()
    return optimizer


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(),
                         nn.Linear(16, 4))


def check(folder):
    folder = Path(folder)
    os.environ["PIPE_HOROVOD_RUN_SUMMARY"] = str(folder / "run-summary-at-exit.json")
    steps = 6
    for depth in (1, 2):
        for compression in (Compression.none, Compression.int8_ef):
            on, off = _model(), _model()
            recorded = _train(on, depth, compression, steps)
            _train(off, depth, compression, steps, record=False)
            for (name, p), q in zip(on.named_parameters(), off.parameters()):
                assert torch.equal(p, q), (f"K={depth} {compression.name}: recording changed "
                                           f"{name}")
            _check_recorded(recorded, depth, steps)
    path = recorded.write_run_summary(str(folder / "run-summary.json"))
    assert path == (str(folder / "run-summary.json") if hvd.rank() == 0 else None), path
    if path is not None:                       # the file holds what was recorded, exactly
        with open(path) as f:
            assert json.load(f) == recorded._machine.record.summary()


def _check_recorded(optimizer, depth, steps):
    timings = optimizer.timings
    machine = optimizer._machine
    sizes = [b.numel * 4 for b in machine.buckets]
    assert len(sizes) > 1, "the bucket cap should give several buckets"
    reductions = list(timings["reductions"])
    assert [(r["step"], r["bucket"]) for r in reductions] == [
        (t, b) for t in range(steps) for b in range(len(sizes))], reductions
    assert [r["bytes"] for r in reductions] == sizes * steps
    for r in reductions:       # every step's reductions were waited for (flush: the last)
        assert r["landed_s"] >= r["launched_s"] >= 0 and r["wait_s"] >= 0, r
    recent = list(timings["recent_steps"])
    assert [s["step"] for s in recent] == list(range(1, steps)), recent
    assert all(s["compute_s"] > 0 and s["wait_s"] >= 0 for s in recent), recent
    assert timings["compute_s"] == sum(s["compute_s"] for s in recent)
    config = machine.run_config()
    assert config["pipeline_depth"] == depth and config["workers"] == hvd.size()
    assert config["buckets"] == [[n * 4 for n in b.numels] for b in machine.buckets]
    assert config["model_bytes"] == sum(sizes)


def record(out, depth, codec, steps, batch, width=1024):
    """A run for tests/data: an MLP of about 4 M parameters (16 MB of gradients),
    `steps` steps of `batch` samples, the summary written by rank 0 to `out`."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width),
                          nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                          nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 4))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters(),
                                         pipeline_depth=depth,
                                         compression=Compression.by_name(codec),
                                         bucket_cap_mb=4)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(steps):
        g = torch.Generator().manual_seed(1009 * hvd.rank() + step)
        x = torch.randn(batch, width, generator=g)
        optimizer.zero_grad()
        F.cross_entropy(model(x), torch.randint(0, 4, (batch,), generator=g)).backward()
        optimizer.step()
    optimizer.flush()
    optimizer.write_run_summary(out)
    if hvd.rank() == 0:
        print(json.dumps(json.load(open(out))["config"]))


if __name__ == "__main__":
    hvd.init()
    torch.set_num_threads(1)
    _, mode, *args = sys.argv
    assert mode == "record", f"unknown mode {mode!r}"
    out, depth, codec, steps, batch = args
    record(out, int(depth), codec, int(steps), int(batch))
    hvd.shutdown()
