"""One rank of `pipe-horovod memory`: live tensor memory of each configuration, side by side.

Each configuration trains the same MLP for a few steps on this rank's own
synthetic batches, then counts the bytes of every distinct tensor storage
reachable from Python (the parameters, `.grad`, the optimizer's state, the
buckets, what a staleness compensation keeps), in units of the parameters'
bytes; the same census at the step's busiest point, the moment backward's last
gradient is final (before the wrapper's own hook sees it: a hook registered before
wrapping); on CUDA also torch.cuda.max_memory_allocated over those steps. Rank 0
prints one JSON line per (width, optimizer, configuration), with the median
over steps of the milliseconds the compensation took (putting the real
weights back in step() and the prediction at the next forward) and the
median of one step of the bare optimizer on the same parameters, each as
wall-clock time and (on CPU) as this thread's CPU time, and the median of
the per-step ratios of the two.

Configurations: horovod (Horovod's DistributedOptimizer; engine horovod
only), ddp (DistributedDataParallel; under engine horovod in a gloo group
of its own at $PIPE_HOROVOD_MEMORY_DDP), ours-k1, ours-k2 (plain Pipe-SGD),
ours-k2-default (K=2 with the default lookahead). One process (plain python:
engine local; or `horovodrun -np 1`, where Horovod's own optimizer runs on
its NCCL ops, as the GPU kit measures it) sends the gradients through the
pipeline by a predivide factor of 2, and adds "plain" (the bare optimizer);
under engine local it stands in for horovod and ddp.

`--model gpt2-small` measures GPT-2 small's 124 M parameters
(tools/workloads/networks.py) on a batch of token sequences instead of the MLP.
"""
import argparse
import gc
import json
import os
import statistics
import time

import torch
import torch.nn as nn

import pipe_horovod.torch as phvd
from pipe_horovod import engine
from pipe_horovod.tools.workloads import networks

CONFIGS = ("horovod", "ddp", "ours-k1", "ours-k2", "ours-k2-default")
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.01),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1),
}
DDP_ENV = "PIPE_HOROVOD_MEMORY_DDP"
WARM_STEPS = 2           # steps before the compensation is timed
MODELS = ("mlp", "gpt2-small")
GPT2_BATCH, GPT2_TOKENS = 4, 256


def live_bytes(device, extra=()):
    """Bytes of the distinct storages of every tensor on `device` reachable from Python,
    and of `extra` (tensors autograd holds that Python has not seen yet: a gradient
    backward just made has no Python object until `.grad` is read)."""
    gc.collect()
    seen = {}
    for obj in [*gc.get_objects(), *extra]:
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type == device.type:
                storage = obj.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, ReferenceError):
            continue
    return sum(seen.values())


def model_for(kind, width, device):
    torch.manual_seed(0)
    if kind == "gpt2-small":
        return networks.GPT2Small().to(device)
    return nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width)).to(device)


def batch_for(kind, width, device, rank):
    """This rank's inputs, and the loss of a forward pass on them."""
    g = torch.Generator().manual_seed(rank)
    if kind == "gpt2-small":
        tokens = torch.randint(networks.GPT2_SMALL["vocab"], (GPT2_BATCH, GPT2_TOKENS + 1),
                               generator=g).to(device)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        return lambda net: nn.functional.cross_entropy(net(inputs).flatten(0, 1),
                                                       targets.flatten())
    x = torch.randn(8, width, generator=g).to(device)
    return lambda net: net(x).square().mean()


def build(config, make, model, one_process):
    params = list(model.parameters())
    base = make(params)
    extra = {"gradient_predivide_factor": 2.0} if one_process else {}
    if config in ("plain",):
        return model, base
    if config == "horovod":
        import horovod.torch as hvd
        return model, hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    if config == "ddp":
        ddp = nn.parallel.DistributedDataParallel(model)
        return ddp, make(list(ddp.parameters()))
    depth = 1 if config == "ours-k1" else 2
    compensation = "lookahead" if config == "ours-k2-default" else None
    return model, phvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                            pipeline_depth=depth,
                                            staleness_compensation=compensation, **extra)


def measure(config, kind, model_kind, width, steps, device, one_process, twin=None):
    rank = phvd.rank()
    base_bytes = live_bytes(device)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        cuda_base = torch.cuda.memory_allocated()
    model = model_for(model_kind, width, device)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    peak = watch_the_peak(model, device)
    net, opt = build(config, OPTIMIZERS[kind], model, one_process)
    loss = batch_for(model_kind, width, device, rank)
    timings = getattr(opt, "timings", None)
    charged, bare = [], []                       # compensation, bare step: seconds per step
    charged_cpu, bare_cpu = [], []               # the same in the thread's CPU seconds
    for t in range(steps):
        peak["now"] = t == steps - 1             # (a census takes time: the last step's)
        before = timings["compensation_s"] if timings else 0.0
        before_cpu = timings.get("compensation_cpu_s", 0.0) if timings else 0.0
        opt.zero_grad()
        loss(net).backward()                     # the prediction: at this forward
        opt.step()                               # the real weights back: in this step
        if timings and t >= WARM_STEPS:          # the first predictions build state: skipped
            charged.append(timings["compensation_s"] - before)
            charged_cpu.append(timings.get("compensation_cpu_s", 0.0) - before_cpu)
            if twin is not None:                 # under the same load, side by side
                wall, cpu = timed_step(twin, device, cpu=True)
                bare.append(wall)
                bare_cpu.append(cpu)
    if hasattr(opt, "flush") and config.startswith("ours"):
        live = live_bytes(device) - base_bytes    # before flush: the pipeline is full
        opt.flush()
    else:
        live = live_bytes(device) - base_bytes
    row = {"optimizer": kind, "config": config, "live": live / size,
           "backward_peak": (peak["bytes"] - base_bytes) / size,
           "param_mb": size / 2**20, "model": model_kind,
           "params": sum(p.numel() for p in model.parameters())}
    if device.type == "cuda":
        torch.cuda.synchronize()
        row["cuda_peak"] = (torch.cuda.max_memory_allocated() - cuda_base) / size
    if charged and any(charged):
        row["compensation_ms"] = 1e3 * statistics.median(charged)
        if bare:
            row["optimizer_step_ms"] = 1e3 * statistics.median(bare)
            row["ratio"] = statistics.median(c / b for c, b in zip(charged, bare))
        if bare_cpu and any(charged_cpu) and device.type == "cpu":
            # CPU seconds of this thread: other jobs on a shared machine preempt the wall
            # clock of either side; this counts only the work (one intra-op thread).
            row["compensation_cpu_ms"] = 1e3 * statistics.median(charged_cpu)
            row["optimizer_step_cpu_ms"] = 1e3 * statistics.median(bare_cpu)
            row["cpu_ratio"] = statistics.median(c / b for c, b in zip(charged_cpu, bare_cpu))
    del net, opt, model
    return row


def watch_the_peak(model, device):
    """Hooks that take the census when the last gradient of a backward pass is final; in
    the returned dict ("bytes", and "last": that gradient's bytes) while its "now" is
    true. Registered before wrapping, they run before the wrapper's hook on the same
    gradient (hooks run in registration order)."""
    params = list(model.parameters())
    seen, peak = [], {"now": False}

    def hook(param):
        seen.append(param)
        if len(seen) == len(params):
            seen.clear()
            if peak["now"]:
                peak["bytes"] = live_bytes(device, [p.grad for p in params
                                                    if p.grad is not None])
                peak["last"] = param.numel() * param.element_size()
    for p in params:
        p.register_post_accumulate_grad_hook(hook)
    return peak


def bare_optimizer(kind, model_kind, width, device):
    """The bare optimizer on a twin of the parameters, with gradients and state built."""
    model = model_for(model_kind, width, device)
    opt = OPTIMIZERS[kind](list(model.parameters()))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return opt


def timed_step(opt, device, cpu=False):
    """Seconds of one step of `opt` (with cpu=True: and this thread's CPU seconds)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start, start_cpu = time.perf_counter(), time.thread_time()
    opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    return (wall, time.thread_time() - start_cpu) if cpu else wall


def parse_args(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--widths", default="2048", help="comma-separated MLP widths")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--optimizers", default="sgd-momentum,adam")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="mlp", choices=MODELS)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    phvd.init()
    one_process = phvd.size() == 1
    name = engine.current().name
    configs = [c for c in args.configs.split(",")
               if not (c == "horovod" and name != "horovod")
               and not (c == "ddp" and name == "local")]
    if one_process:
        configs = ["plain"] + configs
    if "ddp" in configs and not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://{os.environ[DDP_ENV]}", rank=phvd.rank(),
            world_size=phvd.size())
    widths = [int(w) for w in args.widths.split(",")] if args.model == "mlp" else [0]
    for width in widths:
        for kind in args.optimizers.split(","):
            twin = bare_optimizer(kind, args.model, width, device)
            step_ms = 1e3 * statistics.median(timed_step(twin, device) for _ in range(9))
            for config in configs:
                row = measure(config, kind, args.model, width, args.steps, device, one_process,
                              twin if device.type == "cpu" else None)
                row["engine"] = name
                row["width"] = width
                row.setdefault("optimizer_step_ms", step_ms)
                if phvd.rank() == 0:
                    print("MEMORY " + json.dumps(row), flush=True)
            del twin
    phvd.shutdown()


if __name__ == "__main__":
    main()
