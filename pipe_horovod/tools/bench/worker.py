"""One benchmark worker: every configuration on the same synthetic model, interleaved.

Shaped like Horovod's `pytorch_synthetic_benchmark.py` (synthetic inputs,
SGD, zero_grad / forward / cross-entropy / backward / step), but it times
several ways of averaging the gradient in one process, in rounds A B C A B
C ..., so a slow minute on a shared machine hits every configuration alike:

  horovod, horovod-fp16  Horovod's own hvd.DistributedOptimizer (engine horovod)
  ddp                    torch.nn.parallel.DistributedDataParallel over torch.distributed
                         gloo: the engine's own group (engine torch), or, under engine
                         horovod, a gloo group started next to Horovod in the same
                         processes (rank = hvd.rank(), world = hvd.size()), so Horovod
                         and DDP are measured side by side in one run
  ours-kK[-fp16|-bf16]   pipe_horovod's DistributedOptimizer, pipeline_depth=K
  ours-kK-int8|-int4|-bf16hop  the same, reduced by collective="ring" with the codec per
                         hop (int8, int4: with error feedback; bf16hop: bfloat16 at every hop)
  ours-kK-int8eng|-int4eng[:B]  the same with compression=int8_ef (int4_ef[:B]) and no
                         collective=: the two-stage quantized allreduce (collectives/
                         quantized.py; point to point for CPU buckets, the engine's
                         alltoall and allgather for GPU ones)
  compute                forward + backward + local SGD step, no communication
  contention             compute while a model-sized allreduce runs: how much the
                         communication slows compute on shared cores (timing model input)
  contention-int8|-int4|-bf16hop  the same while ring reduces with that codec per hop (its
                         codec and Python run on the cores compute uses)
  allreduce              one allreduce of a model-sized flat float32 buffer
                         (plus allreduce-fp16 / -bf16 when those codecs run)

With `--compute replay` every configuration trains a replayed model
(`pipe_horovod.tools.bench.models`): timed waits instead of arithmetic, real
gradient sizes and times, so the cores are left to communication.

Each configuration has its own model copy (same seed, same weights), so
their hooks never see each other's backward. Each block is `--warmup`
untimed steps, `--steps` timed steps, then `flush()` for ours, so a block
leaves no gradient in flight. Rank 0 writes the raw per-step times, per-rank
CPU seconds and the machine's load during each block to `--out` (JSON), and
its progress to `--progress` for the launcher's progress bar.

Run it under any launcher: `horovodrun -np 2 -H localhost:2 --gloo python -m
pipe_horovod.tools.bench.worker --out raw.json`, `torchrun --nproc_per_node 2 -m
pipe_horovod.tools.bench.worker ...`, or `python -m pipe_horovod.tools.bench.worker` (one
process, local engine: the wrapper-overhead measurement).

Under engine horovod the DDP group meets at PIPE_HOROVOD_BENCH_DDP_ADDR /
PIPE_HOROVOD_BENCH_DDP_PORT (set by `pipe-horovod bench`: 127.0.0.1 and a free
port under horovodrun on one host, rank 0's namespace address under
--emulate). Bench-specific names, not MASTER_ADDR / RANK / WORLD_SIZE, which
would make `pipe_horovod.engine.detect()` pick the torch engine. Without
them (plain horovodrun) rank 0 picks a free port and Horovod broadcasts it.
Gloo binds to GLOO_SOCKET_IFNAME, else to Horovod's HOROVOD_GLOO_IFACE.
"""
import argparse
import gc
import json
import logging
import math
import os
import platform
import re
import socket
import sys
import time

from pipe_horovod.pipeline import auto
from pipe_horovod.tools.bench import convergence_tasks, models
# Re-exported: examples and the Keras bench build the same synthetic models.
from pipe_horovod.tools.bench.models import (MLP_CLASSES, MLP_IN, build_model,  # noqa: F401
                                       mlp_width, model_numel, synthetic_batch)
from pipe_horovod.collectives.group import free_port, start_beside  # noqa: F401 -- free_port: launchers import it from here
from pipe_horovod.tools.hop_codecs import PER_HOP
from pipe_horovod.tools.validators import bucket_cap, checked, number, positive

DEFAULT_CONFIGS = ["horovod", "ddp", "ours-k1", "ours-k2", "ours-k2-fp16", "ours-k2-bf16",
                   "compute", "contention", "allreduce"]
_CONFIG = re.compile(r"^(?:horovod(?:-fp16)?|ddp(?:-powersgd|-bf16)?|ours-auto|compute"
                     r"|contention(?:-int8|-int4|-bf16hop)?"
                     r"|allreduce(?:-fp16|-bf16)?"
                     r"|tf-keras-mwms|tf-mwms-loop"
                     r"|(?:ours|loop)-k([1-9][0-9]*)"
                     r"(?:-(?:fp16|bf16|bf16hop|int8|int4|(?:int8|int4)eng(?::[0-9]+)?))?"
                     r"(?:-(none|momentum|dc|predict|lookahead))?(?:-(x4|x8))?)$")
DDP_ADDR_ENV = "PIPE_HOROVOD_BENCH_DDP_ADDR"
DDP_PORT_ENV = "PIPE_HOROVOD_BENCH_DDP_PORT"
DDP_BACKEND = "torch.distributed gloo"


# --------------------------------------------------------------------- configs

def parse_configs(value):
    """'a,b c' or a list -> validated, de-duplicated names in the given order."""
    items = value if isinstance(value, (list, tuple)) else [value]
    names = []
    for item in items:
        for name in re.split(r"[,\s]+", str(item).strip()):
            if not name:
                continue
            m = _CONFIG.match(name)
            if not m or (m.group(1) and int(m.group(1)) > 16) or (
                    m.group(3) and m.group(2) not in (None, "lookahead")):
                raise ValueError(
                    f"unknown configuration {name!r}; choose from horovod, horovod-fp16, ddp, "
                    "ddp-powersgd (PowerSGD hook, rank 4), ddp-bf16 (bf16 compression hook), "
                    "ours-auto (tune=\"auto\"), ours-kK, ours-kK-fp16, ours-kK-bf16, "
                    "ours-kK-int8, ours-kK-int4, ours-kK-bf16hop, ours-kK-int8eng, ours-kK-int4eng (a block size: "
                    "ours-kK-int4eng:32) "
                    "(K = pipeline depth 1..16; any of "
                    "them -none, -momentum, -dc, -predict, -lookahead: that "
                    "staleness_compensation; then -x4 / -x8: prediction_exchange int4 / "
                    "int8, with lookahead), compute, contention, contention-int8, "
                    "contention-int4, contention-bf16hop, allreduce, tf-keras-mwms "
                    "(--framework keras), loop-kK, tf-mwms-loop (--framework tf-loop)")
            if name not in names:
                names.append(name)
    if not names:
        raise ValueError("no configuration given")
    return names


def compression_of(name):
    """'fp16' / 'bf16' / 'bf16hop' / 'int8' / 'int4' / 'int8eng' / 'int4eng' (with a block
    size: 'int4eng:32') / 'none' for a configuration name."""
    for codec in ("fp16", "bf16", "bf16hop", "int8", "int4", r"int[48]eng(?::[0-9]+)?"):
        found = re.search(rf"-({codec})(?:-(?:none|momentum|dc|predict|lookahead))?"
                          rf"(?:-x[48])?$", name)
        if found:
            return found.group(1)
    return "none"


def is_two_stage(codec):
    """Whether a compression_of() codec trains in two stages ('int8eng', 'int4eng:32')."""
    return codec.partition(":")[0].endswith("eng")


def two_stage_compression(codec):
    """'int8eng' / 'int4eng' / 'int4eng:32' -> the Compression name ('int8_ef' /
    'int4_ef' / 'int4_ef:32') that an ours-kK-<codec> configuration trains with, no
    collective=: the two-stage path."""
    if not is_two_stage(codec):
        raise ValueError(f"{codec!r} is not a two-stage codec (int8eng, int4eng[:BLOCK])")
    family, colon, block = codec.partition(":")
    return family.removesuffix("eng") + "_ef" + colon + block


def staleness_of(name):
    """ours-kK[-codec]-OPTION -> (True, OPTION or None for -none); else (False, None):
    the optimizer's default staleness_compensation."""
    m = _CONFIG.match(name)
    if not m or not name.startswith("ours-k") or m.group(2) is None:
        return False, None
    return True, (None if m.group(2) == "none" else m.group(2))


def exchange_of(name):
    """ours-kK[...]-x4 / -x8 -> prediction_exchange "int4" / "int8"; else None."""
    m = _CONFIG.match(name)
    return {"x4": "int4", "x8": "int8"}.get(m.group(3)) if m else None


def _staleness_supported():
    import inspect

    import pipe_horovod.torch as phvd

    return "staleness_compensation" in inspect.signature(phvd.DistributedOptimizer).parameters


def pipeline_depth_of(name):
    m = re.match(r"^(?:ours|loop)-k(\d+)", name)
    return int(m.group(1)) if m else None


def expand_configs(names):
    """Add the allreduce of each compressed wire dtype in use, right after 'allreduce'."""
    if "allreduce" not in names:
        return list(names)
    extra = [f"allreduce-{c}" for c in ("fp16", "bf16")
             if any(compression_of(n) == c for n in names if not n.startswith("allreduce"))]
    out = []
    for name in names:
        if name in extra:
            continue
        out.append(name)
        if name == "allreduce":
            out.extend(extra)
    return out


def skip_reason(name, engine_name, size):
    """Why `name` cannot run under this engine, or None.

    ddp runs under engine torch (its own group) and under engine horovod (a
    torch.distributed gloo group next to Horovod, see `DdpGroup`); Horovod's
    optimizer needs Horovod's own launcher, so it never runs under engine torch.
    """
    if name == "tf-keras-mwms":
        return "the Keras benchmark's baseline (pipe-horovod bench --framework keras)"
    if name == "tf-mwms-loop" or name.startswith("loop-k"):
        return "the TensorFlow custom loop's (pipe-horovod bench --framework tf-loop)"
    explicit, option = staleness_of(name)
    if explicit and option is not None and not _staleness_supported():
        return "this pipe_horovod's DistributedOptimizer has no staleness_compensation argument"
    if name.startswith("horovod") and engine_name != "horovod":
        if engine_name == "torch":
            return ("Horovod's DistributedOptimizer needs Horovod's launcher and engine; the "
                    "torch engine (torch.distributed.run) cannot start Horovod. Use "
                    "--engine horovod, which measures horovod and ddp side by side")
        return ("Horovod's DistributedOptimizer needs the horovod engine "
                "(launch with horovodrun, or pipe-horovod bench --engine horovod)")
    if name == "ours-auto" and not _tune_supported():
        return ("this pipe_horovod's DistributedOptimizer has no tune argument: "
                "tune=\"auto\" (the run choosing K, codec and buckets from its first steps) "
                "is not built in this checkout")
    if is_ddp(name):
        if engine_name not in ("torch", "horovod"):
            return ("DistributedDataParallel needs several workers in a process group "
                    "(pipe-horovod bench --engine horovod or --engine torch); not measured "
                    "in this one-process run")
        problem = _torch_distributed_missing()
        if problem:
            return problem
    if name.startswith(("allreduce", "contention")) and size < 2:
        return "one process: there is nothing to communicate"
    return None


def is_ddp(name):
    """Whether `name` trains with DistributedDataParallel (ddp, ddp-powersgd, ddp-bf16)."""
    return name == "ddp" or name.startswith("ddp-")


def _tune_supported():
    import inspect

    import pipe_horovod.torch as phvd

    return "tune" in inspect.signature(phvd.DistributedOptimizer).parameters


def _torch_distributed_missing():
    try:
        import torch.distributed as dist
    except ImportError as exc:
        return f"DistributedDataParallel needs torch.distributed, which does not import ({exc})"
    if not dist.is_available() or not dist.is_gloo_available():
        return "DistributedDataParallel needs torch.distributed with gloo, not built in this torch"
    return None


def config_backends(configs, engine_name):
    """What carries each measured configuration's communication (recorded in the raw meta)."""
    out = {}
    for name in configs:
        if name.startswith("horovod"):
            out[name] = "horovod (hvd.DistributedOptimizer, Horovod's gloo controller)"
        elif is_ddp(name):
            out[name] = (f"{DDP_BACKEND} (a process group next to Horovod)"
                         if engine_name == "horovod" else f"{DDP_BACKEND} (engine torch's group)")
        elif name == "compute":
            out[name] = None
        else:
            out[name] = f"pipe_horovod engine {engine_name}"
    return out


# ------------------------------------------------------- DDP next to Horovod

class DdpGroup:
    """A torch.distributed gloo process group started next to Horovod, so DDP runs
    in the same processes as hvd.DistributedOptimizer (rank = hvd rank, world =
    hvd size). Horovod keeps its own gloo connections; this group has its own."""

    def __init__(self, eng):
        import torch.distributed as dist

        self.dist = dist
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialized in this process")
        self.addr, self.port, self.iface, self.source = start_beside(
            eng, os.environ.get(DDP_ADDR_ENV), os.environ.get(DDP_PORT_ENV))

    def describe(self):
        return {"backend": DDP_BACKEND, "init_method": f"tcp://{self.addr}:{self.port}",
                "address_from": self.source, "gloo_interface": self.iface}

    def close(self):
        """Barrier first: a fast rank must not tear down connections a slow one still uses."""
        if self.dist.is_initialized():
            self.dist.barrier()
            self.dist.destroy_process_group()


# --------------------------------------------------------------------- runners

class TrainRunner:
    """zero_grad, forward, cross-entropy, backward, step: one training step."""

    kind = "train"

    def __init__(self, name, mode, model, optimizer, data, target):
        self.name, self.mode = name, mode
        self.model, self.opt = model, optimizer
        self.data, self.target = data, target

    def step(self):
        import torch.nn.functional as F

        perf = time.perf_counter
        t0 = perf()
        self.opt.zero_grad()
        loss = F.cross_entropy(self.model(self.data), self.target)
        loss.backward()
        self._sync()
        t1 = perf()
        exposed = compensation = None
        if self.mode == "horovod":
            # Horovod's documented split: the wait for the reductions, then the local update.
            self.opt.synchronize()
            exposed = perf() - t1
            with self.opt.skip_synchronize():
                self.opt.step()
        elif self.mode == "ours":
            before = dict(self.opt.timings)
            self.opt.step()
            exposed = self.opt.timings["wait_s"] - before["wait_s"]
            compensation = self.opt.timings["compensation_s"] - before["compensation_s"]
        else:
            self.opt.step()
        self._sync()
        t2 = perf()
        return {"step_s": t2 - t0, "fwdbwd_s": t1 - t0, "opt_s": t2 - t1, "exposed_s": exposed,
                "compensation_s": compensation}

    def _sync(self):
        """On a GPU, the clock waits for the compute stream's kernels (not for the other
        streams, where communication may still run, as it would during training)."""
        if self.data.is_cuda:
            import torch

            torch.cuda.current_stream(self.data.device).synchronize()

    def end_block(self):
        if self.mode == "ours":
            self.opt.flush()      # every gradient applied: the block leaves nothing in flight


class AllreduceRunner:
    """One allreduce of a flat buffer as large as the model (the communication alone):
    the engine's, or with `per_hop` (a codec name) pipe_horovod.collectives' ring."""

    kind = "allreduce"

    def __init__(self, name, eng, numel, dtype, per_hop=None):
        import torch

        from pipe_horovod.compression import Compression

        self.name, self.eng = name, eng
        self.buf = torch.randn(numel, generator=torch.Generator().manual_seed(eng.rank()))
        self.buf = self.buf.to(dtype)
        self.tag = f"bench.{name}"
        # as the training configurations run it (int8: with error feedback)
        self.codec = None if per_hop is None else Compression.by_name(PER_HOP[per_hop][0])
        self.residual = (torch.zeros(numel) if getattr(self.codec, "error_feedback", False)
                         else None)

    def launch(self):
        from pipe_horovod import collectives, engine

        if self.codec is None:
            return self.eng.allreduce_async(self.buf, self.tag, engine.Average)
        return collectives.allreduce_async(self.buf, self.tag, engine.Average,
                                           collective="ring", compression=self.codec,
                                           residual=self.residual)

    def step(self):
        t0 = time.perf_counter()
        self.eng.wait(self.launch())
        dt = time.perf_counter() - t0
        return {"step_s": dt, "fwdbwd_s": None, "opt_s": None, "exposed_s": dt}

    def end_block(self):
        pass


class ContentionRunner:
    """A plain training step while a model-sized allreduce is on the wire.

    Its compute time minus the `compute` configuration's is what communication
    costs compute on shared cores (reduction, copies, the kernel's network
    stack, and any polling threads): the timing model's comm_cpu input. Process
    CPU time cannot give it: Horovod's threads poll while they wait, which
    shows as a busy core but yields to compute.
    """

    kind = "contention"

    def __init__(self, name, train, allreduce):
        self.name, self.train, self.allreduce = name, train, allreduce

    def step(self):
        eng = self.allreduce.eng
        t0 = time.perf_counter()
        handle = self.allreduce.launch()
        compute_s = self.train.step()["step_s"]
        t1 = time.perf_counter()
        eng.wait(handle)
        t2 = time.perf_counter()
        return {"step_s": t2 - t0, "fwdbwd_s": compute_s, "opt_s": None, "exposed_s": t2 - t1}

    def end_block(self):
        pass


# PowerSGD as its authors and torch's docs run it: rank 4, error feedback and warm start on.
# Compression starts at DDP's iteration 2, the earliest torch accepts with error feedback
# or warm start (DDP's first iterations rebuild its buckets): every benchmark block's
# untimed warm-up (>= 2 steps, REGIME_WARMUP in regimes) covers it, so every timed step
# is compressed. Training runs would start later (torch suggests ~10% of the steps) for
# accuracy; a step time is the same once compression runs.
POWERSGD = {"matrix_approximation_rank": 4, "start_powerSGD_iter": 2,
            "use_error_feedback": True, "warm_start": True}


# How each ddp-<hook> configuration's hook was registered in this process (raw meta).
_HOOKS_REGISTERED = {}


def ddp_hook_meta(name):
    """What a ddp-<hook> configuration registers (recorded in the raw meta)."""
    if name == "ddp-powersgd":
        return {"hook": "torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook."
                        "powerSGD_hook", **POWERSGD}
    if name == "ddp-bf16":
        return {"hook": "torch.distributed.algorithms.ddp_comm_hooks.default_hooks."
                        "bf16_compress_hook",
                "registered": _HOOKS_REGISTERED.get(name, "not built in this process")}
    return None


def _bf16_hook_under_another_name(state, bucket):
    """PyTorch's bf16_compress_hook itself. DDP refuses that function by its name unless
    CUDA with NCCL >= 2.10 (or XPU) is there, yet its casts and gloo's bfloat16 allreduce
    run on CPU: registered under this name, the hook's own code runs on a CPU-only machine
    exactly as it would on a GPU one."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(state, bucket)


def register_ddp_hook(ddp, name):
    """ddp-powersgd / ddp-bf16: PyTorch's own compression hook on `ddp` (plain ddp: none),
    what a DDP user who wants fewer bytes on the wire would pick."""
    if name == "ddp-powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        state = powerSGD_hook.PowerSGDState(process_group=None, **POWERSGD)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif name == "ddp-bf16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        try:
            ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
            _HOOKS_REGISTERED[name] = "as is"
        except TypeError as exc:              # no CUDA + NCCL here: the same hook, renamed
            if "BF16" not in str(exc):
                raise
            ddp.register_comm_hook(None, _bf16_hook_under_another_name)
            _HOOKS_REGISTERED[name] = ("through a wrapper of another name: DDP said "
                                       f"{exc} (a check on the hook's name)")


def runner_kind(name):
    """The `kind` of make_runner(name, ...)'s runner, without building it."""
    return next((k for k in ("allreduce", "contention") if name.startswith(k)), "train")


def make_runner(name, args, eng):
    import torch

    kind = runner_kind(name)
    if kind == "allreduce":
        numel = model_numel(args)
        dtype = {"none": torch.float32, "fp16": torch.float16,
                 "bf16": torch.bfloat16}[compression_of(name)]
        return AllreduceRunner(name, eng, numel, dtype)
    if kind == "contention":
        per_hop = compression_of(name)
        return ContentionRunner(name, make_runner("compute", args, eng),
                                AllreduceRunner(name, eng, model_numel(args), torch.float32,
                                                None if per_hop == "none" else per_hop))

    torch.manual_seed(args.seed)            # every configuration starts from the same weights
    model, shape, classes = models.bench_model(args)
    data, target = synthetic_batch(shape, classes, args.batch_size, args.seed + 1 + eng.rank())
    device = models.worker_device(args.device, eng.local_rank())
    model, data, target = model.to(device), data.to(device), target.to(device)
    # The convergence tasks' models get their task's SGD (momentum: what 'momentum' adjusts).
    sgd = convergence_tasks.bench_sgd(args.model) or {"lr": 0.01}
    if is_ddp(name):
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, bucket_cap_mb=25.0 if args.bucket_cap_mb is None
                                      else args.bucket_cap_mb)
        register_ddp_hook(ddp, name)
        return TrainRunner(name, "ddp", ddp, torch.optim.SGD(ddp.parameters(), **sgd),
                           data, target)
    opt = torch.optim.SGD(model.parameters(), **sgd)
    if name == "compute":
        return TrainRunner(name, "plain", model, opt, data, target)
    if name.startswith("horovod"):
        import horovod.torch as hvd

        compression = hvd.Compression.fp16 if name.endswith("fp16") else hvd.Compression.none
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=compression)
        return TrainRunner(name, "horovod", model, opt, data, target)
    import pipe_horovod.torch as phvd

    if name == "ours-auto":               # the run chooses K, codec and buckets itself
        opt = phvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                        tune="auto")
        return TrainRunner(name, "ours", model, opt, data, target)
    codec, collective = compression_of(name), None
    if codec in PER_HOP:                  # per-hop codecs ride collectives' ring
        codec, collective = PER_HOP[codec][0], "ring"
    elif is_two_stage(codec):             # two stages (CPU buckets point to point)
        codec = two_stage_compression(codec)
    compression = phvd.Compression.by_name(codec)
    explicit, option = staleness_of(name)
    extra = ({"staleness_compensation": option}
             if explicit and _staleness_supported() else {})
    if exchange_of(name):
        extra["prediction_exchange"] = exchange_of(name)
    opt = phvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                    pipeline_depth=pipeline_depth_of(name),
                                    compression=compression, bucket_cap_mb=args.bucket_cap_mb,
                                    **({"collective": collective} if collective else {}), **extra)
    return TrainRunner(name, "ours", model, opt, data, target)


# ------------------------------------------------------------------ measuring

AUTO_LINE = "pipe_horovod auto:"


class AutoLines(logging.Handler):
    """Keeps what tune="auto" says on the pipe_horovod logger (its decision, or that the
    run was too short to decide), so the raw result records what the ours-auto row ran."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        text = record.getMessage()
        if text.startswith(AUTO_LINE):
            self.lines.append(text)


def _cpu_s():
    t = os.times()          # every thread of this process: compute and communication
    return t.user + t.system


def _machine_ticks():
    """(busy, total) jiffies of the whole machine, from /proc/stat (None if unreadable)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


def _threads():
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


def auto_bucket_meta(bucket_cap_mb, size):
    """With --bucket-cap-mb auto: the size the optimizer picks in this run (the runtime's
    own function, for `size` ranks and this environment's link) and its first bucket, so
    the report predicts the buckets that ran; {} for a number."""
    if bucket_cap_mb is not None:
        return {}
    from pipe_horovod.pipeline.buckets import AUTO_FIRST_MB, resolve_bucket_cap_mb

    return {"bucket_cap_auto_mb": float(resolve_bucket_cap_mb(None, world_size=size)),
            "bucket_first_mb": AUTO_FIRST_MB}


def codec_seconds(numel, bucket_cap_mb, reps=5):
    """Median compress+decompress time of the model's gradient, per codec.

    Done bucket by bucket (bucket_cap_mb of float32 each), as the optimizer
    does: whole-model-sized temporaries would be slower (fresh pages).
    """
    import torch

    from pipe_horovod.compression import Compression

    chunk = max(1, int(bucket_cap_mb * 2**20 // 4))
    buckets = [torch.randn(min(chunk, numel - start)) for start in range(0, numel, chunk)]
    out = {}
    for codec in ("fp16", "bf16"):
        comp = Compression.by_name(codec)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for flat in buckets:
                wire, ctx = comp.compress(flat)
                comp.decompress(wire, ctx)
            times.append(time.perf_counter() - t0)
        out[codec] = sorted(times)[len(times) // 2]
    return out


def hop_codec_costs(names):
    """{per-hop codec: (encode, decode-add, decode) s per float32 byte} at ring's piece
    size, measured by every worker at once as the collectives' own benchmark does: the
    report charges the codec work of a training step with it."""
    import torch

    from pipe_horovod.collectives.layout import PIECE_BYTES
    from pipe_horovod.compression import Compression
    from pipe_horovod.tools.hop_codecs import measure_costs

    return {name: measure_costs(Compression.by_name(PER_HOP[name][0]).hop(torch.float32),
                                PIECE_BYTES // 4) for name in names}


def two_stage_codec_costs(names, bucket_numel, size, me, reps=5):
    """{two-stage codec ('int8eng', ...): {"compression", "bucket_bytes", "wall_s_per_byte",
    "cpu_s_per_byte"}}: the codec work of one bucket of `bucket_numel` float32 values on
    `size` ranks as the two-stage reduction does it on rank `me`, chunk by chunk
    (compression.two_stage.chunks): (first_stage of every chunk with the first residual,
    reduce_shard of this rank's part from `size` copies with the second residual, decode of
    every rank's reduced part), each in seconds per float32 byte of the bucket, the median
    of `reps` passes, as wall time (perf_counter) and as this thread's CPU time. Every rank
    measures at once, as hop_codec_costs does, so the wall times include their contention
    for the cores; the CPU times are what the report's CPU floor adds up over the ranks."""
    import statistics

    import torch

    from pipe_horovod.compression import Compression, config_name, wire_format
    from pipe_horovod.compression.two_stage import (chunks, decode_chunk, first_stage_chunk,
                                                    reduce_shard)

    clocks = (time.perf_counter, time.thread_time)
    out = {}
    for name in names:
        compression = Compression.by_name(two_stage_compression(name))
        fmt = wire_format(compression)
        flat = torch.randn(bucket_numel, generator=torch.Generator().manual_seed(me))
        result, first = torch.empty_like(flat), torch.zeros_like(flat)
        parts = chunks(bucket_numel, size, fmt)
        seconds = [torch.zeros(ranges[me][1]) for ranges in parts]
        passes = []
        for _ in range(reps):
            times = []
            t0 = [clock() for clock in clocks]
            sends = [first_stage_chunk(flat, ranges, fmt, first) for ranges in parts]
            times.append([clock() - t for clock, t in zip(clocks, t0)])
            # what the peers send this rank: its own part, `size` times
            boxes = [send[sum(splits[:me]):sum(splits[:me + 1])].repeat(size)
                     for send, splits in sends]
            t0 = [clock() for clock in clocks]
            for box, ranges, second in zip(boxes, parts, seconds):
                reduce_shard(box, size, ranges[me][1], fmt, torch.float32, True,
                             residual=second)
            times.append([clock() - t for clock, t in zip(clocks, t0)])
            t0 = [clock() for clock in clocks]
            for (send, _), ranges in zip(sends, parts):   # a send buffer is laid out as
                decode_chunk(send, ranges, fmt, result)   # the gathered reduced parts
            times.append([clock() - t for clock, t in zip(clocks, t0)])
            passes.append(times)
        nbytes = bucket_numel * 4
        out[name] = {"compression": config_name(compression), "bucket_bytes": nbytes,
                     **{key: [statistics.median(p[stage][i] for p in passes) / nbytes
                              for stage in range(3)]
                        for i, key in enumerate(("wall_s_per_byte", "cpu_s_per_byte"))}}
    return out


def optimizer_step_costs(opt, bucket_cap_mb, size, reps=5):
    """{"bucket_copy", "lookahead": {"wall_s", "cpu_s"} a step, "bucket_bytes": [...]}: the
    wrapped optimizer's own work a step beside what the `compute` row does (forward,
    backward, the same SGD update), measured part by part at `opt`'s real parameters
    (an ours-kK runner's, after its blocks: its momentum state) and the buckets the
    optimizer makes of them on `size` ranks (`bucket_cap_mb`, None: automatic), so the
    report's CPU floor need not read it off the row it predicts. bucket_copy: every
    gradient copied into its bucket's persistent flat buffer (the adapter's fill at each
    gradient's hook, pipeline.buckets' layout); lookahead: the default compensation's
    one-pass prediction (torch.lookahead.predict with the user's optimizer class's rule,
    into scratch gradients, as the adapter predicts into its own local gradient; None
    where that class has no one-pass rule). After a warm-up pass, the median of `reps`
    passes, wall (perf_counter) and this thread's CPU (thread_time: all of it with one
    intra-op thread, --threads 1, the default); every rank measures at once, as
    two_stage_codec_costs does."""
    import statistics

    import torch

    from pipe_horovod.pipeline.buckets import (bucket_cap_bytes, plan_buckets,
                                               resolve_bucket_cap_mb)
    from pipe_horovod.torch import lookahead

    params = [p for group in opt.param_groups for p in group["params"]]
    param_of = {str(i): p for i, p in enumerate(params)}
    members = [(name, p.numel(), p.element_size(), (p.dtype, p.device))   # ready order:
               for name, p in reversed(param_of.items())]                  # last layer first
    buckets = plan_buckets(members, bucket_cap_bytes(
        resolve_bucket_cap_mb(bucket_cap_mb, world_size=size)))
    flats = [torch.empty(b.numel, dtype=b.kind[0], device=b.kind[1]) for b in buckets]
    grads = {p: torch.randn_like(p) for p in params}
    user_class = next(c for c in type(opt).__mro__
                      if not c.__module__.startswith("pipe_horovod"))
    clocks = (time.perf_counter, time.thread_time)

    def copy():
        for bucket, flat in zip(buckets, flats):
            for name, start, numel in bucket.offsets():
                flat[start:start + numel].copy_(grads[param_of[name]].reshape(-1))

    def predict():
        return lookahead.predict(user_class, opt.param_groups, opt.state, grads)

    out = {"bucket_bytes": [flat.numel() * flat.element_size() for flat in flats],
           "lookahead": None}                          # None: no one-pass rule
    parts = {"bucket_copy": copy}
    copy()                                             # the warm-up passes
    if predict() is not None:
        parts["lookahead"] = predict
    for key, work in parts.items():
        passes = []
        for _ in range(reps):
            t0 = [clock() for clock in clocks]
            work()
            passes.append([clock() - t for clock, t in zip(clocks, t0)])
        out[key] = {k: statistics.median(p[i] for p in passes)
                    for i, k in enumerate(("wall_s", "cpu_s"))}
    return out


def sweep_sizes(max_bytes, min_bytes=1024):
    """1 KB, 4 KB, 16 KB, ... (x4) up to max_bytes, which is always the last size."""
    sizes, size = [], min_bytes
    while size < max_bytes:
        sizes.append(size)
        size *= 4
    sizes.append(int(max_bytes))
    return sizes


def allreduce_sweep(eng, max_bytes, progress):
    """Per-size allreduce seconds (float32), 1 KB .. max_bytes: the input of planner.fit."""
    import torch

    from pipe_horovod import engine

    result = {"sizes": [], "seconds": []}
    for size in sweep_sizes(max_bytes):
        buf = torch.ones(max(1, size // 4))
        reps = 20 if size <= 2**20 else 5
        times = []
        for rep in range(reps + 2):
            eng.barrier()
            t0 = time.perf_counter()
            eng.wait(eng.allreduce_async(buf, f"bench.sweep.{size}", engine.Average))
            if rep >= 2:                              # two warm-ups per size
                times.append(time.perf_counter() - t0)
        result["sizes"].append(buf.numel() * 4)
        result["seconds"].append(times)
        progress(f"sweep {size} B")
    return result


def write_json(path, obj):
    """Atomically: a reader polling `path` never sees half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


class Progress:
    """Rank 0 writes {"done", "total", "current"} atomically; the launcher polls it."""

    def __init__(self, path, total, enabled):
        self.path, self.total, self.done = path, total, 0
        self.enabled = enabled and path
        self.write("starting")

    def write(self, current):
        if self.enabled:
            write_json(self.path, {"done": self.done, "total": self.total, "current": current})

    def __call__(self, current):
        self.done += 1
        self.write(current)


def _versions():
    out = {"python": platform.python_version()}
    for mod in ("torch", "horovod"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - absent is fine
            out[mod] = None
    return out


def run_benchmark(args):
    """Run every configuration in interleaved rounds; return the raw result (rank 0)."""
    import torch

    from pipe_horovod import engine

    torch.set_num_threads(args.threads)
    # Horovod reads its tuning knobs at init (launchers scrub HOROVOD_* from the env).
    if args.horovod_fusion_mb is not None:
        os.environ["HOROVOD_FUSION_THRESHOLD"] = str(int(args.horovod_fusion_mb * 2**20))
    if args.horovod_cycle_ms is not None:
        os.environ["HOROVOD_CYCLE_TIME"] = f"{args.horovod_cycle_ms:g}"
    eng = engine.init()
    rank, size = eng.rank(), eng.size()
    requested = expand_configs(parse_configs(args.configs))
    skipped = {n: r for n in requested if (r := skip_reason(n, eng.name, size))}
    configs = [n for n in requested if n not in skipped]
    log = (lambda *a: print("[bench]", *a, flush=True)) if rank == 0 else (lambda *a: None)
    for name, why in skipped.items():
        log(f"skipping {name}: {why}")
    auto_lines = AutoLines()
    if "ours-auto" in configs:
        logging.getLogger("pipe_horovod").addHandler(auto_lines)
    ddp_group = None
    if any(map(is_ddp, configs)) and eng.name == "horovod":
        ddp_group = DdpGroup(eng)
        log(f"ddp: {DDP_BACKEND} group next to Horovod at {ddp_group.describe()['init_method']}")

    sweep_n = len(sweep_sizes(args.fit_max_mb * 1e6)) if args.fit and size > 1 else 0
    progress = Progress(args.progress, args.rounds * len(configs) + sweep_n + len(configs),
                        rank == 0)
    runners = {}
    threads_before = _threads()
    for name in configs:                       # same order on every rank (collectives inside)
        runners[name] = None if args.one_model else make_runner(name, args, eng)
        progress(f"{'built' if runners[name] else 'builds at its block:'} {name}")
    numel = model_numel(args)

    results = {n: {"kind": runner_kind(n), "compression": compression_of(n),
                   "pipeline_depth": pipeline_depth_of(n), "rounds": []} for n in configs}
    background, step_costs = [], None
    for rnd in range(args.rounds):
        # The machine's load while every worker sleeps: what others (and idle
        # communication threads) take from the cores during this round.
        eng.barrier()
        ticks0 = _machine_ticks()
        time.sleep(args.idle_probe_s)
        ticks1 = _machine_ticks()
        if ticks0 and ticks1 and ticks1[1] > ticks0[1]:
            background.append((ticks1[0] - ticks0[0]) / (ticks1[1] - ticks0[1])
                              * (os.cpu_count() or 1))
        for name in configs:
            runner = runners[name] or make_runner(name, args, eng)
            eng.barrier()
            # tune="auto" measures its first steps and decides: the timed steps run what
            # it chose, as a long training run would.
            settle = args.auto_warmup if name == "ours-auto" and (
                rnd == 0 or args.one_model) else 0
            for _ in range(args.warmup + settle):
                runner.step()
            ticks0, cpu0, wall0 = _machine_ticks(), _cpu_s(), time.perf_counter()
            recs = [runner.step() for _ in range(args.steps)]
            wall = time.perf_counter() - wall0
            cpu = _cpu_s() - cpu0
            ticks1 = _machine_ticks()
            runner.end_block()
            per_rank = eng.allgather_object({"cpu_s": cpu, "wall_s": wall,
                                             "threads": _threads()})
            busy = None
            if ticks0 and ticks1 and ticks1[1] > ticks0[1]:
                busy = (ticks1[0] - ticks0[0]) / (ticks1[1] - ticks0[1]) * (os.cpu_count() or 1)
            block = {key: [r[key] for r in recs] for key in recs[0]}
            block.update(round=rnd, wall_s=wall, per_rank=per_rank, machine_busy_cores=busy)
            results[name]["rounds"].append(block)
            # The wrapped optimizer's own work, measured on the first pipelined runner of
            # ours after its last block (with --one-model it is freed next).
            if (step_costs is None and rnd == args.rounds - 1 and size > 1
                    and runner.kind == "train" and runner.mode == "ours"
                    and (pipeline_depth_of(name) or 1) > 1):
                step_costs = optimizer_step_costs(runner.opt, args.bucket_cap_mb, size)
            if args.one_model:                 # its memory back before the next is built
                del runner
                gc.collect()
            med = sorted(block["step_s"])[len(recs) // 2]
            log(f"round {rnd + 1}/{args.rounds} {name:>14}: median step {med * 1e3:8.1f} ms, "
                f"cpu {cpu / wall:4.2f} cores (rank 0), machine busy "
                f"{busy if busy is None else round(busy, 2)} cores")
            progress(f"round {rnd + 1}/{args.rounds} {name}")

    auto_cap = auto_bucket_meta(args.bucket_cap_mb, size).get("bucket_cap_auto_mb")
    sweep = None
    if args.fit and size > 1:
        sweep = allreduce_sweep(eng, args.fit_max_mb * 1e6, progress)
    codecs = None
    if any(compression_of(n) != "none" for n in configs):
        codecs = codec_seconds(numel, auto_cap or args.bucket_cap_mb)
    per_hop = sorted({compression_of(n) for n in configs} & set(PER_HOP))
    hop_costs = hop_codec_costs(per_hop) if per_hop else None
    two_stage = sorted({compression_of(n) for n in configs if is_two_stage(compression_of(n))})
    two_stage_costs = (two_stage_codec_costs(
        two_stage, min(numel, int((auto_cap or args.bucket_cap_mb) * 2**20 // 4)), size, rank)
        if two_stage and size > 1 else None)

    raw = {
        "format": "pipe_horovod.bench/1",
        "meta": {
            "engine": eng.name, "workers": size, "model": args.model,
            "model_mb_requested": args.model_mb, "layers": args.layers,
            "compute": models.compute_meta(args),
            "horovod_fusion_mb": args.horovod_fusion_mb, "horovod_cycle_ms": args.horovod_cycle_ms,
            "params": numel, "model_bytes": numel * 4, "batch_size": args.batch_size,
            "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
            "auto_warmup": args.auto_warmup if "ours-auto" in configs else None,
            # rank 0's words (the rank that decides logs the decision)
            "auto_decision": auto_lines.lines[-1] if auto_lines.lines else None,
            "auto_lines": auto_lines.lines,
            "bucket_cap_mb": args.bucket_cap_mb, "threads": args.threads,
            "one_model": args.one_model,
            **auto_bucket_meta(args.bucket_cap_mb, size),
            "configs": configs, "requested": requested, "skipped": skipped,
            "cpu_count": os.cpu_count(), "hostname": socket.gethostname(),
            "threads_before_configs": threads_before, "versions": _versions(),
            "config_backends": config_backends(configs, eng.name),
            "ddp_backend": DDP_BACKEND if any(map(is_ddp, configs)) else None,
            "ddp_process_group": (ddp_group.describe() if ddp_group is not None else
                                  "engine torch's group" if any(map(is_ddp, configs))
                                  else None),
            "ddp_comm_hooks": {n: ddp_hook_meta(n) for n in configs if n.startswith("ddp-")},
            "background_busy_cores": background,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
        "configs": results,
        "sweep": sweep,
        "codec_s": codecs,
        "hop_codec_s_per_byte": hop_costs,
        "two_stage_codec_s_per_byte": two_stage_costs,
        "optimizer_step_costs": step_costs,
        "process": eng.allgather_object({"cpu_s": _cpu_s(), "threads": _threads()}),
    }
    for runner in filter(None, runners.values()):
        if runner.kind == "train" and runner.mode == "ours":
            runner.opt.flush()
    eng.barrier()
    if rank == 0 and args.out:
        tmp = f"{args.out}.tmp"
        with open(tmp, "w") as f:
            json.dump(raw, f)
        os.replace(tmp, args.out)
        log(f"wrote {args.out}")
    progress.write("done")
    runners.clear()                 # DDP's reducer holds the group: drop it first
    if ddp_group is not None:
        ddp_group.close()
    engine.shutdown()
    return raw if rank == 0 else None


# ------------------------------------------------------------------- command line

def add_model_arguments(parser):
    """Arguments shared by the worker and `pipe-horovod bench` (which forwards them)."""
    parser.add_argument("--model", choices=models.MODEL_CHOICES, default="mlp",
                        help="synthetic model: an MLP, or a small CNN whose classifier head "
                             "carries the size (default mlp); a real architecture (resnet50, "
                             "vgg16, bert-base: --compute replay only); or a model of "
                             "`pipe-horovod convergence` (its own size: --model-mb is "
                             "ignored) on synthetic inputs of its shape")
    parser.add_argument("--compute", choices=models.COMPUTE_MODES, default="cpu",
                        help="cpu: forward and backward run on the workers' cores (default); "
                             "replay: each layer's forward/backward is a timed wait that "
                             "uses no CPU, gradients of the real sizes appear at their "
                             "layer's time, as on an accelerator "
                             "(pipe_horovod.tools.workloads.replay)")
    parser.add_argument("--device", choices=models.DEVICES, default="cpu",
                        help="where each worker's model and batch live: cpu (default), or "
                             "cuda (the worker's local GPU, cuda:local_rank modulo the GPUs "
                             "it sees: workers on a one-GPU machine share it)")
    parser.add_argument("--device-tflops", type=positive(float), default=None, metavar="T",
                        help="replay: the device's throughput; forward = layer FLOPs / T, "
                             "backward = 2 x forward")
    parser.add_argument("--profile", default=None, metavar="FILE",
                        help="replay: measured per-layer times (JSON, format in "
                             "pipe_horovod.tools.workloads.replay) instead of --device-tflops")
    parser.add_argument("--seq-len", type=positive(int), default=128,
                        help="bert-base: tokens per sample (default 128)")
    parser.add_argument("--horovod-fusion-mb", type=number(0, what="fusion threshold"),
                        default=None, metavar="MB",
                        help="HOROVOD_FUSION_THRESHOLD for the horovod configurations, MiB "
                             "(default: Horovod's own)")
    parser.add_argument("--horovod-cycle-ms", type=positive(float), default=None, metavar="MS",
                        help="HOROVOD_CYCLE_TIME, ms (default: Horovod's own)")
    parser.add_argument("--model-mb", type=positive(float), default=50.0,
                        help="model size in MB of float32 parameters (default 50)")
    parser.add_argument("--layers", type=int, default=5, choices=range(2, 33), metavar="N",
                        help="Linear layers of the MLP (default 5)")
    parser.add_argument("--batch-size", type=positive(int), default=32,
                        help="samples per worker per step (default 32)")
    parser.add_argument("--steps", type=positive(int), default=20,
                        help="timed steps per configuration per round (default 20)")
    parser.add_argument("--warmup", type=int, default=5, choices=range(0, 10001), metavar="N",
                        help="untimed steps before each timed block (default 5)")
    parser.add_argument("--rounds", type=positive(int), default=3,
                        help="rounds of all configurations, interleaved (default 3)")
    parser.add_argument("--one-model", action="store_true",
                        help="build each configuration's model for its block and free it "
                             "after (memory for one at a time, for models as large as "
                             "bert-base; each block starts from the same weights, its "
                             "pipeline empty)")
    parser.add_argument("--configs", type=checked(parse_configs), nargs="+", default=None,
                        help=f"configurations (default: {' '.join(DEFAULT_CONFIGS)}; the ones "
                             "the engine cannot run are skipped and noted)")
    parser.add_argument("--bucket-cap-mb", type=bucket_cap, default=25.0,
                        help="bucket size of ours and DDP in MiB (default 25); auto: ours at "
                             "bucket_cap_mb=None (the size it picks for the workers and "
                             "$PIPE_HOROVOD_LINK_GBPS / _LATENCY_US), DDP at its 25")
    parser.add_argument("--fit", action="store_true",
                        help="also sweep allreduce sizes 1 KB..--fit-max-mb for planner.fit")
    parser.add_argument("--fit-max-mb", type=positive(float), default=64.0,
                        help="largest allreduce of the sweep, MB (default 64)")
    parser.add_argument("--threads", type=positive(int), default=1,
                        help="torch compute threads per worker (default 1)")
    parser.add_argument("--idle-probe-s", type=float, default=0.5,
                        help="seconds all workers sleep at the start of each round while the "
                             "machine's load from everything else is measured (default 0.5)")
    parser.add_argument("--auto-warmup", type=int, default=auto.settle_steps(),
                        choices=range(0, 10001), metavar="N",
                        help="untimed steps ours-auto trains before its first block, beyond "
                             "--warmup: its measured first steps, its decision and its trials' "
                             "steps, so the timed steps run the configuration it chose "
                             f"(default {auto.settle_steps()})")
    parser.add_argument("--seed", type=int, default=0)


def flatten_configs(value):
    """argparse gives a list of lists (nargs + type=list); None means the default."""
    if value is None:
        return list(DEFAULT_CONFIGS)
    return parse_configs([n for group in value for n in group])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--out", help="raw JSON written by rank 0")
    parser.add_argument("--progress", help="progress file rank 0 keeps up to date")
    args = parser.parse_args(argv)
    args.configs = flatten_configs(args.configs)
    problem = models.check_compute(args)
    if problem:
        parser.error(problem)
    run_benchmark(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
