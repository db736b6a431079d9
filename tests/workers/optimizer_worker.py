"""Launched on N ranks: the pipelined optimizer against the single-process oracle.

`python optimizer_worker.py MODE[,MODE...] [FOLDER]` (one launch runs several,
launcher.run_case; the process-set cases last, as they leave a set behind); every rank
runs the same scenarios on its own data shard and checks its weights against the oracle,
which every rank can compute alone because all data is derived from (rank, step).
The cases of engine_worker, sparse_worker, staleness_worker, horovod_compare_worker (the
horovod engine), hardening_engine_worker, mismatch_worker (2 ranks), checkpoint_worker (its
files in FOLDER) and
no_flush_worker (the last case: the launch then ends without shutdown()) run in the same
launch (tests/shared_launches.py lists the launches), and default-MODE runs MODE under the
default staleness compensation.
"""
import copy
import functools
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import launcher  # noqa: E402
import oracle  # noqa: E402
import pipe_horovod.torch as phvd  # noqa: E402
from pipe_horovod.pipeline import staleness  # noqa: E402
from tolerance import THREADS, fan_ins, relative_error, training_rtol  # noqa: E402

torch.set_num_threads(THREADS)
# The GPU kit's CPU rehearsal runs fewer (ORACLE_STEPS): it proves the kit runs, not the math.
STEPS = int(os.environ.get("ORACLE_STEPS", "20"))
# Plain Pipe-SGD unless a launch asks for an option (the GPU kit's two-rank steps; test_staleness
# runs cases under the default as default-MODE, under_the_default).
COMPENSATION = os.environ.get("ORACLE_COMPENSATION") or None
# Where models and batches live (the GPU kit: cuda); the oracle computes on the same device,
# so both sides run the same kernels and differ only by the order of the average's sums.
DEVICE = torch.device(os.environ.get("ORACLE_DEVICE", "cpu"))
if DEVICE.type == "cuda":
    DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", os.environ.get(
        "HOROVOD_LOCAL_RANK", "0"))) % torch.cuda.device_count())
    # float32 throughout, as the rounding bound assumes (tests/tolerance.py): no TF32, and
    # cuDNN's deterministic kernels, so a forward repeated on the same input repeats its bits.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
# A torch.distributed backend to start before the engine (the GPU kit: gloo, for two ranks
# sharing one GPU, where the engine's default NCCL refuses).
BACKEND = os.environ.get("ORACLE_TORCH_BACKEND")


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x.flatten(1))))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3)
        self.fc = nn.Linear(3 * 6 * 6, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x.view(-1, 1, 8, 8))).flatten(1))


class Branchy(MLP):
    """`extra` runs only on rank 0: other ranks produce no gradient for it."""

    def __init__(self, use_extra):
        super().__init__()
        self.extra = nn.Linear(8, 4)
        self.use_extra = use_extra

    def forward(self, x):
        out = super().forward(x)
        return out + self.extra(x.flatten(1)) if self.use_extra else out


def data_for(micro=1, poison=None):
    """data(rank, step): deterministic per-rank batches; `poison`=(rank, step) injects inf."""
    def data(rank, step):
        batches = []
        for m in range(micro):
            g = torch.Generator().manual_seed(10007 * rank + 101 * step + m)
            x = torch.randn(6, 8, generator=g)
            if (rank, step) == poison:
                x[0, 0] = float("inf")
            batches.append((x.to(DEVICE), torch.randint(0, 4, (6,), generator=g).to(DEVICE)))
        return batches
    return data


def conv_data(rank, step):
    g = torch.Generator().manual_seed(7919 * rank + step)
    return [(torch.randn(5, 64, generator=g).to(DEVICE),
             torch.randint(0, 4, (5,), generator=g).to(DEVICE))]


def make_optimizer(kind, model):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=0.01)


def oracle_rtol(model, steps=STEPS):
    """Rounding's bound (tests/tolerance.py) on the longest chain the workers' checks run on
    `model`: `steps` Adam updates on two micro-batches of 6, predicting two updates ahead
    (lookahead at K=3)."""
    return training_rtol(steps=steps, fan_ins=fan_ins(model), batch=12, ranks=phvd.size(),
                         optimizer="adam", predicted=2)


def assert_close(model, ref, what, rtol=None):
    rtol = oracle_rtol(ref) if rtol is None else rtol
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        err = relative_error(p, q)
        assert err <= rtol, (f"{what}: {name} differs from the oracle by {err:.3g} (relative; "
                             f"rounding allows {rtol:.3g})")


def train(model, opt, data, steps=STEPS, micro=1, scheduler=None, scaler=None, start=0,
          set_to_none=True):
    rank = phvd.rank()
    for t in range(start, steps):
        if set_to_none:
            opt.zero_grad()                  # Horovod's optimizer takes no argument
        else:
            opt.zero_grad(set_to_none=False)
        for x, y in data(rank, t):
            loss = F.cross_entropy(model(x), y)
            if scaler is None:
                loss.backward()
            else:
                scaler.scale(loss).backward()
        if scaler is None:
            opt.step()
        else:
            opt.synchronize()
            scaler.unscale_(opt)
            with opt.skip_synchronize():
                scaler.step(opt)
            scaler.update()
        if scheduler is not None:
            scheduler.step()


def fresh(model_cls, seed=0, **kw):
    torch.manual_seed(seed)
    return model_cls(**kw).to(DEVICE)


def check_oracle():
    """MLP and CNN, SGD+momentum and Adam, K in 1..3, warm-up 0 and 3."""
    size = phvd.size()
    for model_cls, data in ((MLP, data_for()), (CNN, conv_data)):
        for kind in ("sgd", "adam"):
            for depth in (1, 2, 3):
                for warmup in (0, 3):
                    model = fresh(model_cls)
                    ref = copy.deepcopy(model)
                    opt = phvd.DistributedOptimizer(make_optimizer(kind, model),
                                                    named_parameters=model.named_parameters(),
                                                    pipeline_depth=depth, warmup_steps=warmup,
                                                    staleness_compensation=COMPENSATION)
                    train(model, opt, data)
                    expected_applied = STEPS - (0 if depth == 1 else depth - 1)
                    assert opt.timings["applied"] == expected_applied, opt.timings
                    opt.flush()
                    assert opt.timings["applied"] == STEPS, "flush must apply every gradient"
                    oracle.reference(ref, make_optimizer(kind, ref), F.cross_entropy, data, size,
                                     STEPS, depth, warmup, compensation=COMPENSATION)
                    assert_close(model, ref, f"{model_cls.__name__}/{kind}/K={depth}/W={warmup}")


def check_features():
    size, rank = phvd.size(), phvd.rank()
    # Unused branch on every rank but 0: no deadlock, zero contribution.
    model = fresh(Branchy, use_extra=(rank == 0))
    ref = fresh(Branchy, use_extra=True)
    opt = phvd.DistributedOptimizer(make_optimizer("sgd", model),
                                    named_parameters=model.named_parameters(),
                                    staleness_compensation=COMPENSATION)
    train(model, opt, data_for())
    opt.flush()

    def branchy_grads(r, t):
        ref.use_extra = (r == 0)
        return data_for()(r, t)
    oracle.reference(ref, make_optimizer("sgd", ref), F.cross_entropy, branchy_grads, size,
                     STEPS, 2, 0, compensation=COMPENSATION)
    assert_close(model, ref, "unused parameter")

    # Frozen first layer: never reduced, never changed.
    model, ref = fresh(MLP), fresh(MLP)
    for m in (model, ref):
        m.fc1.requires_grad_(False)
    before = model.fc1.weight.clone()
    opt = phvd.DistributedOptimizer(
        torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters(), staleness_compensation=COMPENSATION)
    train(model, opt, data_for())
    opt.flush()
    oracle.reference(ref, torch.optim.SGD([p for p in ref.parameters() if p.requires_grad],
                                          lr=0.1, momentum=0.9),
                     F.cross_entropy, data_for(), size, STEPS, 2, 0, compensation=COMPENSATION)
    assert torch.equal(model.fc1.weight, before)
    assert_close(model, ref, "frozen layer")

    # Gradient accumulation: two micro-batches, one reduction per step.
    model, ref = fresh(MLP), fresh(MLP)
    opt = phvd.DistributedOptimizer(make_optimizer("adam", model),
                                    named_parameters=model.named_parameters(),
                                    backward_passes_per_step=2, pipeline_depth=2,
                                    staleness_compensation=COMPENSATION)
    train(model, opt, data_for(micro=2))
    opt.flush()
    oracle.reference(ref, make_optimizer("adam", ref), F.cross_entropy, data_for(micro=2), size,
                     STEPS, 2, 0, compensation=COMPENSATION)
    assert_close(model, ref, "backward_passes_per_step=2")

    # zero_grad(set_to_none=False): backward accumulates into `.grad`, which views
    # the buffers the optimizer reduces in; a mid-run flush restarts the pipeline.
    for depth, warmup in ((1, 0), (2, 0), (3, 2)):
        model, ref = fresh(MLP), fresh(MLP)
        opt = phvd.DistributedOptimizer(make_optimizer("sgd", model),
                                        named_parameters=model.named_parameters(),
                                        backward_passes_per_step=2, pipeline_depth=depth,
                                        warmup_steps=warmup, staleness_compensation=COMPENSATION)
        half = STEPS // 2
        train(model, opt, data_for(micro=2), steps=half, set_to_none=False)
        opt.flush()
        train(model, opt, data_for(micro=2), start=half, set_to_none=False)
        opt.flush()
        ref_opt = make_optimizer("sgd", ref)
        oracle.reference(ref, ref_opt, F.cross_entropy, data_for(micro=2), size, half, depth,
                         warmup, compensation=COMPENSATION)
        oracle.reference(ref, ref_opt, F.cross_entropy,
                         lambda r, t: data_for(micro=2)(r, t + half), size, STEPS - half, depth, 0,
                         compensation=COMPENSATION)
        assert_close(model, ref, f"set_to_none=False K={depth} W={warmup}")

    # Horovod's gradient_predivide_factor and explicit groups: the same average.
    for kw in ({"gradient_predivide_factor": 4.0}, {"groups": 2},
               {"groups": "fc2-with-fc1.bias"}):
        model, ref = fresh(CNN), fresh(CNN)
        if kw.get("groups") == "fc2-with-fc1.bias":
            kw = {"groups": [[model.fc.weight, model.conv.bias]]}
        opt = phvd.DistributedOptimizer(make_optimizer("sgd", model),
                                        named_parameters=model.named_parameters(), **kw,
                                        staleness_compensation=COMPENSATION)
        train(model, opt, conv_data)
        opt.flush()
        if "groups" in kw:
            expected = (2 if kw["groups"] == 2 else 3)
            assert len(opt._buckets) == expected, [b.names for b in opt._buckets]
        oracle.reference(ref, make_optimizer("sgd", ref), F.cross_entropy, conv_data, size,
                         STEPS, 2, 0, compensation=COMPENSATION)
        assert_close(model, ref, f"options {sorted(kw)}")

    # LR scheduler stepping every iteration, with the delayed gradient.
    model, ref = fresh(MLP), fresh(MLP)
    opt = phvd.DistributedOptimizer(make_optimizer("sgd", model),
                                    named_parameters=model.named_parameters(), pipeline_depth=3,
                                    warmup_steps=2, staleness_compensation=COMPENSATION)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")           # no "scheduler before optimizer" warning
        train(model, opt, data_for(), scheduler=sched)
    opt.flush()
    ref_opt = make_optimizer("sgd", ref)
    oracle.reference(ref, ref_opt, F.cross_entropy, data_for(), size, STEPS, 3, 2,
                     scheduler=torch.optim.lr_scheduler.StepLR(ref_opt, step_size=4, gamma=0.5),
                     compensation=COMPENSATION)
    assert_close(model, ref, "StepLR")
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]

    # GradScaler: rank 1's step-5 batch overflows; every rank skips that gradient. A CPU
    # GradScaler (torch.amp.GradScaler) exists from torch 2.3; older ones have only CUDA's.
    cpu_scaler = hasattr(torch.amp, "GradScaler")
    if not cpu_scaler:
        print(f"features: GradScaler part skipped: torch {torch.__version__} has no CPU "
              "GradScaler (torch >= 2.3)")
    for depth in (1, 2) if cpu_scaler else ():
        model, ref = fresh(MLP), fresh(MLP)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=4)
        opt = phvd.DistributedOptimizer(make_optimizer("sgd", model),
                                        named_parameters=model.named_parameters(),
                                        pipeline_depth=depth, grad_scaler=scaler,
                                        staleness_compensation=COMPENSATION)
        poisoned = data_for(poison=(size - 1, 5))
        train(model, opt, poisoned, scaler=scaler)
        opt.flush()
        assert scaler.get_scale() < 2.0**12 * 2**(STEPS // 4), "the overflow must lower the scale"
        oracle.reference(ref, make_optimizer("sgd", ref), F.cross_entropy, poisoned, size, STEPS,
                         depth, 0, skip={5}, compensation=COMPENSATION)
        assert_close(model, ref, f"GradScaler K={depth}")
    # All ranks agree (the skipped step was skipped everywhere).
    weights = [p.detach().clone() for p in model.parameters()]
    gathered = phvd.allgather_object(weights)
    assert all(torch.equal(a, b) for w in gathered for a, b in zip(w, weights))


def check_param_group():
    """Unfreezing a layer mid-run: the group added after wrapping is reduced too."""
    size = phvd.size()
    half = STEPS // 2
    for depth in (1, 2):
        model, ref = fresh(MLP), fresh(MLP)
        for m in (model, ref):
            m.fc1.requires_grad_(False)
        opt = phvd.DistributedOptimizer(torch.optim.SGD(model.fc2.parameters(), lr=0.1,
                                                        momentum=0.9),
                                        named_parameters=model.named_parameters(),
                                        pipeline_depth=depth, staleness_compensation=COMPENSATION)
        ref_opt = torch.optim.SGD(ref.fc2.parameters(), lr=0.1, momentum=0.9)
        train(model, opt, data_for(), steps=half)
        opt.flush()
        oracle.reference(ref, ref_opt, F.cross_entropy, data_for(), size, half, depth, 0,
        compensation=COMPENSATION)
        for m, o in ((model, opt), (ref, ref_opt)):
            m.fc1.requires_grad_(True)
            o.add_param_group({"params": list(m.fc1.parameters()), "lr": 0.05})
        train(model, opt, data_for(), start=half)
        opt.flush()
        oracle.reference(ref, ref_opt, F.cross_entropy, lambda r, t: data_for()(r, t + half),
                         size, STEPS - half, depth, 0, compensation=COMPENSATION)
        assert_close(model, ref, f"add_param_group K={depth}")
        weights = [p.detach().clone() for p in model.parameters()]
        for theirs in phvd.allgather_object(weights):
            assert all(torch.equal(a, b) for a, b in zip(theirs, weights)), "replicas diverged"


@functools.cache
def first_two_ranks():
    """The process set of ranks 0 and 1, added once: check_process_set runs under each
    compensation in one launch (default-process-set), and a set is added only once."""
    return phvd.add_process_set([0, 1])


def check_process_set():
    """Ranks 0 and 1 reduce over their process set; rank 2, outside it, applies its own
    gradients (Horovod's rule), through the same pipeline depth."""
    ps = first_two_ranks()
    inside = phvd.rank() < 2
    for depth in (1, 2):
        model, ref = fresh(MLP), fresh(MLP)
        opt = phvd.DistributedOptimizer(make_optimizer("sgd", model),
                                        named_parameters=model.named_parameters(),
                                        pipeline_depth=depth, process_set=ps,
                                        staleness_compensation=COMPENSATION)
        train(model, opt, data_for())
        opt.flush()
        if inside:
            oracle.reference(ref, make_optimizer("sgd", ref), F.cross_entropy, data_for(), 2,
                             STEPS, depth, 0, compensation=COMPENSATION)
        else:
            oracle.reference(ref, make_optimizer("sgd", ref), F.cross_entropy,
                             lambda r, t: data_for()(phvd.rank(), t), 1, STEPS, depth, 0,
                             compensation=COMPENSATION)
        assert_close(model, ref, f"process set K={depth} rank {phvd.rank()}")
    phvd.barrier()


def check_sparse():
    import sparse_worker                  # it imports this module: imported when run
    sparse_worker.check_all()


def check_staleness():
    import staleness_worker               # every option explicitly: ORACLE_COMPENSATION aside
    staleness_worker.check_oracle()
    staleness_worker.check_resume()


def under_the_default(check):
    """`check` with the default staleness compensation (test_staleness's default-MODE cases),
    whatever ORACLE_COMPENSATION says: the launch of the plain cases runs them too."""
    global COMPENSATION
    saved, COMPENSATION = COMPENSATION, staleness.DEFAULT
    try:
        check()
    finally:
        COMPENSATION = saved


def check_horovod_compare():
    import horovod_compare_worker
    horovod_compare_worker.check()


def check_mismatch():
    import mismatch_worker
    mismatch_worker.check_all()


def argument_checks(cases, folder):
    """The cases among `cases` that carry arguments in their names: engine_worker's
    engine-ENGINE-SIZE (the engine and size the launch must give), checkpoint_worker's
    save and resume runs, MODE-KIND-DEPTH-COMPENSATION (mode save, resume or
    resume-rank0; their files go to `folder`), run_summary_worker's run-summary (its
    files too), hardening_engine_worker's hardening-MODE and no_flush_worker's
    no-flush-DEPTH.
    (Those modules import this one: imported when named.)"""
    checks = {}
    for case in cases.split(","):
        if case.startswith("engine-"):
            import engine_worker
            _, name, size = case.split("-")
            checks[case] = functools.partial(engine_worker.check_engine, name, int(size))
        elif case.startswith(("save-", "resume-")):
            import checkpoint_worker
            mode, kind, depth, compensation = case.rsplit("-", 3)
            checks[case] = functools.partial(checkpoint_worker.check, mode, kind, int(depth),
                                             compensation, Path(folder))
        elif case == "run-summary":
            import run_summary_worker
            checks[case] = functools.partial(run_summary_worker.check, Path(folder))
        elif case.startswith("hardening-"):
            import hardening_engine_worker
            from pipe_horovod import engine
            mode = case.split("-", 1)[1]
            checks[case] = hardening_engine_worker.checks(engine.current().name)[mode]
        elif case.startswith("no-flush-"):
            import no_flush_worker
            checks[case] = functools.partial(no_flush_worker.check, int(case.rsplit("-", 1)[1]))
    return checks


def main():
    if BACKEND:
        torch.distributed.init_process_group(BACKEND)
    phvd.init()
    cases = sys.argv[1]
    checks = {"oracle": check_oracle, "features": check_features,
              "param-group": check_param_group, "process-set": check_process_set,
              "sparse": check_sparse, "staleness": check_staleness,
              "horovod-compare": check_horovod_compare,
              "mismatch": check_mismatch}
    checks.update(argument_checks(cases, sys.argv[2] if len(sys.argv) > 2 else None))
    checks.update({case: functools.partial(under_the_default, checks[case.split("-", 1)[1]])
                   for case in cases.split(",") if case.startswith("default-")})
    launcher.worker_cases(checks, cases, phvd.rank)
    print(f"WORKER_OK rank={phvd.rank()}", flush=True)
    if not cases.split(",")[-1].startswith("no-flush-"):   # that one ends as a script does
        phvd.shutdown()


if __name__ == "__main__":
    main()
