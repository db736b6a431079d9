"""Launched on N ranks: the optimizer defects a review found, each against the oracle.

`python hardening_worker.py MODE[,MODE...]` (one launch runs several, launcher.run_case):
  threads   backward runs on two threads at once (as CPU and CUDA leaves do)
  mixed     one backward over CPU and CUDA parameters (needs a GPU; gloo for CUDA)
  skipped   a GradScaler skips the last step's update, then flush()
  rollback  a mid-run return to an in-memory checkpoint, reductions in flight
  rewrap    a second DistributedOptimizer over the same parameters
  misuse    misuse_optimizer_worker.py's cases (last: they leave reductions in flight)
"""
import copy
import gc
import os
import sys
import threading
import weakref
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import launcher  # noqa: E402
import oracle  # noqa: E402
from optimizer_worker import (MLP, STEPS, assert_close, data_for, fresh,  # noqa: E402
                              make_optimizer, oracle_rtol, train)
import pipe_horovod.torch as phvd  # noqa: E402
from tolerance import THREADS, gamma  # noqa: E402

torch.set_num_threads(THREADS)


class TwoTowers(nn.Module):
    """Two towers with no parameter in common, so each can run its own backward."""

    def __init__(self, layers=24, width=16):
        super().__init__()
        self.a = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
        self.b = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

    def forward(self, x):
        return self.a(x), self.b(x)


def tower_loss(out, _y):
    return out[0].pow(2).mean() + out[1].pow(2).mean()


def tower_data(rank, step):
    g = torch.Generator().manual_seed(1009 * rank + step)
    return [(torch.randn(4, 16, generator=g) * 0.5, None)]


def codec_rtol(ref, codec, steps):
    """The oracle's bound, and with fp16 one more rounding to half precision of each step's
    gradient (a relative error of u16 in an update no larger than the weights here)."""
    fp16 = gamma(steps, "float16") if codec is phvd.Compression.fp16 else 0.0
    return oracle_rtol(ref, steps) + fp16


def check_threads():
    """Each tower's backward on its own thread: the hooks fire concurrently, and
    every bucket (one per layer) must still launch exactly once, in index order."""
    codec = phvd.Compression.fp16 if phvd.size() == 1 else phvd.Compression.none
    model = fresh(TwoTowers)
    ref = copy.deepcopy(model)
    opt = phvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters(),
                                    compression=codec, bucket_cap_mb=512 / 2**20,
                                    pipeline_depth=2, staleness_compensation=None)
    assert len(opt._buckets) == 96, len(opt._buckets)
    start = threading.Barrier(2)
    errors = []

    def backward(loss):
        start.wait()
        try:
            loss.backward()
        except BaseException as e:          # reported by the main thread
            errors.append(e)

    steps = 12
    for t in range(steps):
        opt.zero_grad()
        (x, _), = tower_data(phvd.rank(), t)
        out_a, out_b = model(x)
        threads = [threading.Thread(target=backward, args=(loss,))
                   for loss in (out_a.pow(2).mean(), out_b.pow(2).mean())]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors, f"step {t}: backward on two threads raised {errors[0]!r}"
        opt.step()
    opt.flush()
    oracle.reference(ref, torch.optim.SGD(ref.parameters(), lr=0.1), tower_loss, tower_data,
                     phvd.size(), steps, 2, 0)
    assert_close(model, ref, "two-thread backward", rtol=codec_rtol(ref, codec, steps))


def check_mixed():
    """A CPU tower and a CUDA tower in one model: autograd runs the CUDA leaves'
    hooks on its device thread while the CPU ones run on this thread."""
    codec = phvd.Compression.fp16 if phvd.size() == 1 else phvd.Compression.none
    model = fresh(TwoTowers)
    ref = copy.deepcopy(model)
    model.b.cuda()
    opt = phvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters(),
                                    compression=codec, bucket_cap_mb=512 / 2**20,
                                    pipeline_depth=2, staleness_compensation=None)
    steps = 20
    for t in range(steps):
        opt.zero_grad()
        (x, _), = tower_data(phvd.rank(), t)
        loss = model.a(x).pow(2).mean() + model.b(x.cuda()).pow(2).mean().cpu()
        loss.backward()
        opt.step()
    opt.flush()
    oracle.reference(ref, torch.optim.SGD(ref.parameters(), lr=0.1), tower_loss, tower_data,
                     phvd.size(), steps, 2, 0)
    assert_close(model.cpu(), ref, "CPU and CUDA parameters in one backward",
                 rtol=codec_rtol(ref, codec, steps))


def check_skipped():
    """The overflow reaches the last step's update (K=2 applies it one step late):
    GradScaler skips opt.step(), and flush() must still apply the rest."""
    size = phvd.size()
    for depth in (1, 2, 3):
        model, ref = fresh(MLP), fresh(MLP)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
        opt = phvd.DistributedOptimizer(make_optimizer("sgd", model),
                                        named_parameters=model.named_parameters(),
                                        pipeline_depth=depth, grad_scaler=scaler,
                                        staleness_compensation=None)
        bad = STEPS - depth                      # applied by the last step()
        poisoned = data_for(poison=(size - 1, bad))
        train(model, opt, poisoned, scaler=scaler)
        assert scaler.get_scale() == 2.0**9, "the last step must have overflowed"
        opt.flush()
        oracle.reference(ref, make_optimizer("sgd", ref), F.cross_entropy, poisoned, size,
                         STEPS, depth, 0, skip={bad})
        assert_close(model, ref, f"flush after a skipped step, K={depth}")


def check_rollback():
    """Return to a snapshot taken mid-run (gradients in flight then and now);
    the run continues exactly as if the steps after the snapshot never happened."""
    for kind in ("sgd", "adam"):
        for depth, warmup in ((1, 0), (2, 0), (3, 2)):
            what = f"rollback {kind} K={depth} W={warmup}"
            model, ref = fresh(MLP), fresh(MLP)
            opts = [phvd.DistributedOptimizer(make_optimizer(kind, m),
                                              named_parameters=m.named_parameters(),
                                              pipeline_depth=depth, warmup_steps=warmup,
                                              staleness_compensation=None)
                    for m in (model, ref)]
            opt, ref_opt = opts
            train(model, opt, data_for(), steps=7)
            snapshot = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
            train(model, opt, data_for(), steps=12, start=7)
            assert len(opt._fifo) == depth - 1, what
            model.load_state_dict(snapshot["model"])
            opt.load_state_dict(snapshot["opt"])
            train(model, opt, data_for(), start=7)
            opt.flush()
            train(ref, ref_opt, data_for())          # the same steps, uninterrupted
            ref_opt.flush()
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                assert torch.equal(p, q), f"{what}: {name} differs from the uninterrupted run"


def check_rewrap():
    """A second training phase wraps the same parameters again."""
    size = phvd.size()
    model, ref = fresh(MLP), fresh(MLP)
    first = phvd.DistributedOptimizer(make_optimizer("sgd", model),
                                      named_parameters=model.named_parameters(), pipeline_depth=2,
                                      staleness_compensation=None)
    train(model, first, data_for(), steps=5)
    assert len(first._fifo) == 1
    # Phase two, without flush() or deleting the first: its last gradient is
    # applied (by the first optimizer, as Horovod would have) and its hooks go.
    second = phvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters(),
                                       pipeline_depth=2, staleness_compensation=None)
    assert len(first._fifo) == 0, "wrapping again must apply the first optimizer's gradients"
    train(model, second, data_for(), steps=10, start=5)
    second.flush()
    ref_first = make_optimizer("sgd", ref)
    oracle.reference(ref, ref_first, F.cross_entropy, data_for(), size, 5, 2, 0)
    oracle.reference(ref, torch.optim.Adam(ref.parameters(), lr=0.01), F.cross_entropy,
                     lambda r, t: data_for()(r, t + 5), size, 5, 2, 0)
    assert_close(model, ref, "second phase after re-wrapping")

    # The replaced optimizer refuses to run instead of reducing a second time.
    model(torch.ones(2, 8)).sum().backward()
    try:
        first.step()
    except RuntimeError as e:
        assert "replaced" in str(e) and "fc1.weight" in str(e), e
    else:
        raise AssertionError("the replaced optimizer stepped")
    second.step()
    second.flush()

    # Dropped without flush() or del: its hooks must not keep it alive or fire.
    third = phvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(), pipeline_depth=1,
                                      staleness_compensation=None)
    dead = weakref.ref(third)
    del third
    gc.collect()
    assert dead() is None, "a DistributedOptimizer nobody holds must be collected"
    model.zero_grad()
    model(torch.ones(2, 8)).sum().backward()
    plain = fresh(MLP)
    plain.load_state_dict(model.state_dict())
    plain(torch.ones(2, 8)).sum().backward()
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad), "a dead optimizer's hook touched .grad"


def check_misuse():
    import misuse_optimizer_worker        # it imports optimizer_worker, as this module does
    misuse_optimizer_worker.check_all()


def main():
    if "mixed" in sys.argv[1].split(",") and "WORLD_SIZE" in os.environ:
        # Two ranks share this machine's one GPU: gloo reduces the CUDA buckets
        # (NCCL refuses two ranks on one device); the torch engine adopts the group.
        torch.distributed.init_process_group("gloo")
    phvd.init()
    launcher.worker_cases({"threads": check_threads, "mixed": check_mixed, "skipped": check_skipped,
                           "rollback": check_rollback, "rewrap": check_rewrap,
                           "misuse": check_misuse},
                          sys.argv[1], phvd.rank)
    print(f"WORKER_OK rank={phvd.rank()}", flush=True)
    phvd.shutdown()


if __name__ == "__main__":
    main()
