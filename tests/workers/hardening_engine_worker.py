"""The engine-side defects a review found, each checked against exact expected values.

argv: MODE[,MODE...] ENGINE_NAME (one launch runs several in turn, launcher.run_case;
cuda alone)
  names      (defect 2) a bf16, pipeline_depth=2 DistributedOptimizer trains while
             unnamed broadcasts, allreduces, allgathers and broadcast_parameters run
             between backward and step and after step. Horovod names unnamed ops by
             a process-wide handle counter that the bf16 pool threads advance at
             different times per rank, so any unnamed op reaching Horovod can hang.
  intavg     (defect 5) integer Average/Sum as Horovod 0.28.1 computes them (the
             result truncated toward zero), and the dtypes Horovod refuses.
  autograd   (the note) gradients through allreduce, allgather and broadcast equal
             Horovod's (compared live with horovod.torch under horovodrun).
  optstate   (defect 6) rank 0 alone rolls back to a checkpoint, then
             broadcast_optimizer_state: every rank's state_dict (with the pipeline's
             in-flight gradients) equals root's, and training continues exactly as
             an uninterrupted run.
  cuda       (defect 6, GPU) rank 0's state on cuda:0, rank 1 CPU-only
             (CUDA_VISIBLE_DEVICES=""): rank 1 receives it on CPU and never
             initializes CUDA. Torch engine, 2 ranks.
Each rank prints "WORKER_OK rank=N" once its checks pass.
"""
import copy
import os
import sys
from pathlib import Path

if sys.argv[1:2] == ["cuda"] and os.environ.get("RANK", "0") != "0":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""     # before anything can initialize CUDA

import torch  # noqa: E402

import pipe_horovod.torch as hvd  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import launcher  # noqa: E402


def check_equal(got, want, what):
    """Exact equality of nested state (tensors: dtype, shape, values and device type)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{what}: got {type(got).__name__}, want a tensor"
        assert got.dtype == want.dtype and got.shape == want.shape, (
            f"{what}: got {got.dtype}{tuple(got.shape)}, want {want.dtype}{tuple(want.shape)}")
        assert torch.equal(got.cpu(), want.cpu()), f"{what}: got {got}, want {want}"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (
            f"{what}: keys {sorted(map(str, got))} != {sorted(map(str, want))}")
        for key in want:
            check_equal(got[key], want[key], f"{what}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), f"{what}: {got} != {want}"
        for i, (g, w) in enumerate(zip(got, want)):
            check_equal(g, w, f"{what}[{i}]")
    else:
        assert got == want, f"{what}: got {got!r}, want {want!r}"


def tensors_in(obj):
    """Every tensor in a nested state."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in tensors_in(item)]
    return []


def to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


# --- defect 2: names ----------------------------------------------------------
SIZES = (300, 7, 64, 1, 129)
LR = 0.5


def grad_for(rank, step, index, numel):
    """Rank `rank`'s gradient of parameter `index` at `step`: multiples of 1/4 in
    [-1, 1], so every sum, average and update below is exact in bf16 and float32."""
    j = torch.arange(numel, dtype=torch.float64)
    return ((j + 3 * index + 5 * step + 7 * rank) % 9 - 4) / 4


def expected_weights(applied, n):
    """-LR times the sum of the averaged gradients of the `applied` steps (float64, exact)."""
    return [-LR * sum((sum(grad_for(r, s, i, k) for r in range(n)) / n for s in applied),
                      torch.zeros(k, dtype=torch.float64)) for i, k in enumerate(SIZES)]


def unnamed_collectives(params, step, r, n, what):
    """Unnamed collectives of every kind; each result checked exactly."""
    b = torch.full((5,), float(r + step))
    hvd.broadcast_(b, 0)
    check_equal(b, torch.full((5,), float(step)), f"{what}: unnamed broadcast_")
    avg = hvd.allreduce(torch.full((3,), float((r + 1) * (step + 1))))
    check_equal(avg, torch.full((3,), (n + 1) / 2 * (step + 1)), f"{what}: unnamed allreduce")
    rows = hvd.allgather(torch.tensor([[r, step]]))
    check_equal(rows, torch.tensor([[q, step] for q in range(n)]), f"{what}: unnamed allgather")
    check_equal(hvd.broadcast_object({"step": step} if r == 0 else None),
                {"step": step}, f"{what}: unnamed broadcast_object")
    before = [p.detach().clone() for p in params]
    hvd.broadcast_parameters([(f"p{i}", p) for i, p in enumerate(params)], root_rank=0)
    for i, (p, old) in enumerate(zip(params, before)):
        check_equal(p.detach(), old, f"{what}: broadcast_parameters keeps equal weights p{i}")


def names():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    params = [torch.nn.Parameter(torch.zeros(k)) for k in SIZES]
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(params, lr=LR), named_parameters=[(f"p{i}", p) for i, p in enumerate(params)],
        compression=hvd.Compression.bf16, pipeline_depth=2, bucket_cap_mb=1e-4,
        staleness_compensation=None)
    steps = 8
    for t in range(steps):
        opt.zero_grad()
        loss = sum((p * grad_for(r, t, i, p.numel()).float()).sum() for i, p in enumerate(params))
        loss.backward()                  # bf16 reductions of step t start here, on pool threads
        unnamed_collectives(params, t, r, n, f"step {t}, between backward and step")
        opt.step()                       # K=2: applies step t-1's average
        for i, (p, want) in enumerate(zip(params, expected_weights(range(t), n))):
            check_equal(p.detach(), want.float(), f"p{i} after step {t}")
        unnamed_collectives(params, t, r, n, f"step {t}, after step")
    opt.flush()
    for i, (p, want) in enumerate(zip(params, expected_weights(range(steps), n))):
        check_equal(p.detach(), want.float(), f"p{i} after flush")


# --- defect 5: integer Average ---------------------------------------------------
# Two ranks' inputs, and what Horovod 0.28.1 returned for them under horovodrun
# -np 2 --gloo (int32 and int64 alike): Average truncates toward zero (-7/2 -> -3).
INPUTS = ([7, -7, 5, -5, 3, 0, 1, -1, 100, -100, 127],
          [0, 0, 0, 0, 0, 0, 0, 0, 2, -2, 126])
HOROVOD_2 = {"Average": [3, -3, 2, -2, 1, 0, 0, 0, 51, -51, 126],
             "Sum": [7, -7, 5, -5, 3, 0, 1, -1, 102, -102, 253]}


def horovod_rule(xs, op, prescale=1.0, postscale=1.0):
    """Horovod's integer reduction: each rank's value times prescale, truncated; the
    sum; times postscale (divided by the rank count for Average), truncated."""
    total = sum((x.double() * prescale).trunc() for x in xs)
    post = postscale / len(xs) if op == "Average" else postscale
    return (total * post).trunc()


def intavg(engine_name):
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    assert n in (1, 2), "the integer cases are written for 1 or 2 ranks"
    ops = {"Average": hvd.Average, "Sum": hvd.Sum}
    theirs = None
    if engine_name == "horovod":
        import horovod.torch as theirs      # the same process: compare with Horovod live
    for dtype in (torch.int32, torch.int64):
        xs = [torch.tensor(v, dtype=dtype) for v in INPUTS[:n]]
        mine = xs[r]
        for op_name, op in ops.items():
            want = horovod_rule(xs, op_name).to(dtype)
            if n == 2:
                check_equal(want, torch.tensor(HOROVOD_2[op_name], dtype=dtype),
                            f"the rule vs Horovod's measured {dtype} {op_name}")
            check_equal(hvd.allreduce(mine, op=op), want, f"allreduce {dtype} {op_name}")
            inplace = mine.clone()
            hvd.allreduce_(inplace, op=op)
            check_equal(inplace, want, f"allreduce_ {dtype} {op_name}")
            check_equal(hvd.synchronize(hvd.allreduce_async(mine, op=op)), want,
                        f"allreduce_async {dtype} {op_name}")
            check_equal(hvd.grouped_allreduce([mine, mine[:3]], op=op), [want, want[:3]],
                        f"grouped_allreduce {dtype} {op_name}")
            if theirs is not None:
                check_equal(theirs.allreduce(mine, op=getattr(theirs, op_name),
                                             name=f"horovod.{dtype}.{op_name}"),
                            want, f"horovod.torch's own allreduce {dtype} {op_name}")
        want = horovod_rule(xs, "Average", 0.5, 3.0).to(dtype)
        check_equal(hvd.allreduce(mine, prescale_factor=0.5, postscale_factor=3.0), want,
                    f"allreduce {dtype} Average, prescale 0.5, postscale 3")
        if theirs is not None:
            check_equal(theirs.allreduce(mine, op=theirs.Average, prescale_factor=0.5,
                                         postscale_factor=3.0, name=f"horovod.{dtype}.scaled"),
                        want, f"horovod.torch's own scaled allreduce {dtype}")
        # "Average a count": a 0-dimensional int64 metric.
        count = torch.tensor(INPUTS[r][0], dtype=dtype)
        check_equal(hvd.allreduce(count), horovod_rule([torch.tensor(v[0]) for v in INPUTS[:n]],
                                                       "Average").to(dtype), f"{dtype} count")
        # reducescatter: rows [2r, 2r+1] of the Average (equal blocks of 2 rows).
        rows = torch.tensor([INPUTS[q][:2 * n] for q in range(n)], dtype=dtype).view(n, 2 * n, 1)
        full = horovod_rule(list(rows.view(n, 2 * n)), "Average").to(dtype).view(2 * n, 1)
        check_equal(hvd.reducescatter(rows[r].view(2 * n, 1)), full[2 * r:2 * r + 2],
                    f"reducescatter {dtype} Average")
    for dtype in (torch.uint8, torch.int8, torch.int16, torch.bool):
        x = torch.ones(3, dtype=dtype)
        for call in (lambda: hvd.allreduce(x), lambda: hvd.allreduce_(x.clone(), op=hvd.Sum),
                     lambda: hvd.grouped_allreduce([x]), lambda: hvd.reducescatter(x)):
            expect_value_error(call, f"cannot reduce {dtype}", f"{dtype} reduction")
        if theirs is not None:
            expect_value_error(lambda: theirs.allreduce(x, name=f"horovod.{dtype}"),
                               "is not supported", f"horovod.torch's own {dtype} allreduce")


def expect_value_error(call, text, what):
    try:
        call()
    except ValueError as exc:
        assert text in str(exc), f"{what}: ValueError without {text!r}: {exc}"
    else:
        raise AssertionError(f"{what}: expected a ValueError containing {text!r}")


# --- the autograd note ---------------------------------------------------------------
def autograd(engine_name):
    """A loss built from hvd.allreduce / allgather / broadcast gives x.grad as Horovod's
    (Average backward: the average over ranks of each rank's coefficient)."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    libraries = {"pipe_horovod": hvd}
    if engine_name == "horovod":
        import horovod.torch as theirs
        libraries["horovod"] = theirs
    coef = torch.tensor([1.0, 2.0, 4.0]) * (r + 1)
    mean = torch.tensor([1.0, 2.0, 4.0]) * (n + 1) / 2       # average of the coefficients
    for lib_name, lib in libraries.items():
        def grad(fn):
            x = torch.arange(3.0, requires_grad=True)
            (fn(x) * coef).sum().backward()
            return x.grad

        check_equal(grad(lambda x: lib.allreduce(x, name=f"{lib_name}.ar")), mean,
                    f"{lib_name} allreduce Average backward")
        check_equal(grad(lambda x: lib.allreduce(x, op=lib.Sum, name=f"{lib_name}.ars")),
                    mean * n, f"{lib_name} allreduce Sum backward")
        check_equal(grad(lambda x: lib.allgather(x, name=f"{lib_name}.ag")[3 * r:3 * r + 3]),
                    coef / n, f"{lib_name} allgather backward (own rows, averaged)")
        check_equal(grad(lambda x: lib.broadcast(x, 0, name=f"{lib_name}.bc")),
                    mean if r == 0 else torch.zeros(3), f"{lib_name} broadcast backward")


# --- defect 6: broadcast_optimizer_state ---------------------------------------------
def build(kind="adam", device="cpu"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                torch.nn.Linear(8, 2)).to(device)
    base = {"adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
            "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
            "lbfgs": lambda ps: torch.optim.LBFGS(ps, lr=0.5, history_size=3)}[kind]
    return model, base(model.parameters())


def batch(rank, step, device="cpu"):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(5, 4, generator=g).to(device), torch.randn(5, 2, generator=g).to(device)


def train(model, opt, r, steps):
    for t in steps:
        x, y = batch(r, t)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def run(r, rollback):
    """Train steps 0..5 (pipeline_depth=2). With rollback, rank 0 keeps a checkpoint
    after step 2, every rank trains two other steps, rank 0 alone restores the
    checkpoint and the state is broadcast: then steps 3..5 as without rollback."""
    model, base = build()
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                   pipeline_depth=2, staleness_compensation=None)
    train(model, opt, r, range(3))
    if rollback:
        if r == 0:
            saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
        train(model, opt, r, (100, 101))         # a detour the rollback undoes
        if r == 0:
            model.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        state = opt.state_dict()
        assert len(state["pipe_horovod"]["in_flight"]) == 1, "step 2's gradient is in flight"
        check_equal(state, hvd.broadcast_object(state if r == 0 else None, 0),
                    f"rank {r}'s optimizer state after the broadcast vs root's")
        if r == 0:
            check_equal(state, saved[1], "root's state is its checkpoint")
        for i, (p, entry) in enumerate(zip(model.parameters(), state["state"].values())):
            assert entry["step"].device.type == "cpu" and entry["exp_avg"].device == p.device
    train(model, opt, r, range(3, 6))
    opt.flush()
    return [p.detach().clone() for p in model.parameters()]


def optstate():
    hvd.init()
    r = hvd.rank()
    uninterrupted = run(r, rollback=False)
    resumed = run(r, rollback=True)
    check_equal(resumed, uninterrupted, "weights after rollback + broadcast vs uninterrupted")
    check_equal(resumed, hvd.broadcast_object(resumed if r == 0 else None, 0),
                "weights agree across ranks")
    for kind in ("sgd", "lbfgs"):                # float state (LBFGS: lists, Python numbers)
        model, opt = build(kind)
        x, y = batch(r, 7)

        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        if r == 0:
            opt.step(closure)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        state = opt.state_dict()
        check_equal(state, hvd.broadcast_object(state if r == 0 else None, 0),
                    f"{kind}: rank {r}'s state vs root's")
    model, opt = build("adam")                   # fresh everywhere: zero gradients, no state
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert not opt.state
    for p in model.parameters():
        check_equal(p.grad, torch.zeros_like(p), "a fresh optimizer's zero gradient")


def cuda():
    import torch.distributed as dist

    dist.init_process_group("gloo")              # one backend on both ranks, CPU wire
    hvd.init()
    r = hvd.rank()
    assert hvd.size() == 2, "the cuda mode runs on 2 ranks"
    device = "cuda:0" if r == 0 else "cpu"
    model, opt = build("adam", device)
    if r == 0:
        for t in range(2):
            x, y = batch(0, t, device)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    state = opt.state_dict()
    roots = hvd.broadcast_object(to_cpu(state) if r == 0 else None, 0)
    check_equal(state, roots, f"rank {r}'s optimizer state vs root's")
    if r == 0:
        assert all(state["state"][i]["exp_avg"].is_cuda for i in state["state"])
    else:
        assert all(t.device.type == "cpu" for t in tensors_in(state)), "rank 1's state on CPU"
        assert not torch.cuda.is_initialized(), "rank 1 initialized CUDA"
    hvd.barrier()
    hvd.shutdown()
    dist.destroy_process_group()


def checks(engine_name):
    """The modes but cuda, by name (optimizer_worker's launches run them as hardening-MODE:
    tests/shared_launches.py)."""
    return {"names": names, "intavg": lambda: intavg(engine_name),
            "autograd": lambda: autograd(engine_name), "optstate": optstate}


def main():
    modes, engine_name = sys.argv[1], sys.argv[2]
    if modes == "cuda":                  # it shuts the engine and torch.distributed down
        cuda()
    else:
        launcher.worker_cases(checks(engine_name), modes, hvd.rank)
    print(f"WORKER_OK rank={hvd.rank() if hvd.is_initialized() else os.environ.get('RANK')}",
          flush=True)
    if hvd.is_initialized():
        hvd.shutdown()


if __name__ == "__main__":
    main()
