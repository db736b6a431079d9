"""Replayed compute: a model whose layers are timed waits instead of arithmetic.

On a GPU cluster forward and backward run on the accelerator and leave the
CPU to communication; on a CPU-only machine they compete for the same cores,
and a benchmark cannot tell what the pipeline hides from what contention
costs. `ReplayModel` keeps everything but the arithmetic: it owns the real
parameters (names, shapes, order from `architectures.layer_table`), and each
layer's forward and backward is an autograd Function that sleeps (releasing
the GIL, using no CPU) for that layer's time. Backward runs layer by layer in
reverse, each layer returning gradients of its parameters' real sizes with
cheap deterministic values (layer i's are all `grad_value(i)`), so autograd
accumulates them and fires the post-accumulate-grad hooks of our optimizer,
Horovod's DistributedOptimizer and DDP at the time that layer's gradient
would be ready on the device. Everything after that is the real code path.

Layer times: forward = forward FLOPs / (T TFLOP/s), backward = 2 x forward
(`layer_times`); or measured ones from a profile file (`load_profile`), so a
profile taken on a real GPU can be replayed. The profile is JSON:

    {"format": "pipe_horovod.replay-profile/1",
     "model": "resnet50", "batch_size": 64,
     "seq_len": 128,                      # bert-base only (default 128)
     "device": "any text, e.g. A100-SXM4-40GB, torch 2.4, AMP",   # optional
     "layers": [{"name": "conv1", "forward_ms": 0.41, "backward_ms": 0.83},
                ...]}

with one entry per layer of `layer_table(model, batch_size)` (names as
there, any order), times in milliseconds, finite and >= 0.

Waits absorb their own lateness: a sleep that overshoots (by ~0.1 ms on
Linux) shortens the next one, so a pass of a hundred layers takes its
configured total rather than that plus a hundred overshoots. The time to
fill a layer's gradients counts inside that layer's backward time.
"""
import dataclasses
import math
import time

import torch
import torch.nn as nn

from pipe_horovod.tools.validators import read_json
from pipe_horovod.tools.workloads import architectures

PROFILE_FORMAT = "pipe_horovod.replay-profile/1"
BACKWARD_PER_FORWARD = 2.0
OUTPUTS = 2          # width of the stand-in logits the bench's cross-entropy reads


@dataclasses.dataclass(frozen=True)
class LayerTime:
    name: str
    forward_s: float
    backward_s: float


def layer_times(table, device_tflops):
    """Forward = FLOPs / device throughput, backward = 2 x forward, per layer of `table`."""
    if isinstance(device_tflops, bool) or not isinstance(device_tflops, (int, float)) \
            or not math.isfinite(device_tflops) or device_tflops <= 0:
        raise ValueError(f"device_tflops must be a finite number > 0, got {device_tflops!r}")
    rate = device_tflops * 1e12
    return [LayerTime(layer.name, layer.forward_flops / rate,
                      BACKWARD_PER_FORWARD * layer.forward_flops / rate) for layer in table]


def load_profile(path, table, model, batch_size, seq_len=architectures.DEFAULT_SEQ_LEN):
    """Per-layer times of `table` (`model`'s at `batch_size`) from a profile file (format
    in the module doc); ValueError says what is wrong with it."""
    data = read_json(path, "profile")
    where = f"profile {path}"
    if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
        raise ValueError(f"{where}: expected an object with \"format\": \"{PROFILE_FORMAT}\"")
    expected = {"model": model, "batch_size": batch_size}
    if model == "bert-base":
        data.setdefault("seq_len", architectures.DEFAULT_SEQ_LEN)
        expected["seq_len"] = seq_len
    for key, value in expected.items():
        if data.get(key) != value:
            raise ValueError(f"{where}: {key} is {data.get(key)!r}, this run's is {value!r} "
                             "(layer times depend on it)")
    entries = data.get("layers")
    if not isinstance(entries, list):
        raise ValueError(f"{where}: \"layers\" must be a list of "
                         "{\"name\", \"forward_ms\", \"backward_ms\"} objects")
    known = {layer.name for layer in table}
    given = {}
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise ValueError(f"{where}: layers[{index}] must be an object with a \"name\"")
        name = entry["name"]
        if name not in known:
            raise ValueError(f"{where}: layers[{index}] names {name!r}, which is not a layer "
                             f"of {model} (first layers: {', '.join(sorted(known)[:3])} ...)")
        if name in given:
            raise ValueError(f"{where}: layer {name!r} is given twice")
        times = []
        for key in ("forward_ms", "backward_ms"):
            value = entry.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0:
                raise ValueError(f"{where}: layer {name!r}: {key} must be a finite number "
                                 f">= 0, got {value!r}")
            times.append(value / 1e3)
        given[name] = LayerTime(name, *times)
    missing = [layer.name for layer in table if layer.name not in given]
    if missing:
        raise ValueError(f"{where}: {len(missing)} of {model}'s {len(table)} layers have no "
                         f"times: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    return [given[layer.name] for layer in table]


class _Pacer:
    """Sleeps until deadlines, carrying each overshoot into the next wait."""

    def __init__(self):
        self.late = 0.0

    def wait(self, seconds, start=None):
        start = time.perf_counter() if start is None else start
        target = start + seconds - self.late
        remaining = target - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        self.late = max(0.0, time.perf_counter() - target)


class _ReplayLayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, carry, layer, *params):
        ctx.layer = layer
        layer.model.pacer.wait(layer.time.forward_s)
        return carry.clone()

    @staticmethod
    def backward(ctx, grad):
        layer = ctx.layer
        start = time.perf_counter()
        grads = tuple(torch.full(shape, layer.grad_value, dtype=dtype)
                      for shape, dtype in layer.shapes)
        layer.model.pacer.wait(layer.time.backward_s, start)
        return (grad, None, *grads)


@dataclasses.dataclass(eq=False)
class _LayerState:
    model: "ReplayModel"
    time: LayerTime
    grad_value: float
    shapes: tuple


def grad_value(index):
    """The value of every gradient element of layer `index` (0 = first in forward order)."""
    return (index + 1) / 1024.0


class ReplayModel(nn.Module):
    """Stands in for `table`'s model: its parameters (zeros, real names), its layers'
    times. forward(x) returns (len(x), OUTPUTS) stand-in logits after the forward waits."""

    def __init__(self, table, times, dtype=torch.float32):
        super().__init__()
        if [t.name for t in times] != [layer.name for layer in table]:
            raise ValueError("times must list the table's layers, in its order")
        self.pacer = _Pacer()
        self._layers = []
        for index, (layer, timing) in enumerate(zip(table, times)):
            params = []
            for name, shape in layer.params:
                *path, leaf = name.split(".")
                owner = self
                for part in path:
                    if not hasattr(owner, part):
                        owner.add_module(part, nn.Module())
                    owner = getattr(owner, part)
                param = nn.Parameter(torch.zeros(shape, dtype=dtype))
                owner.register_parameter(leaf, param)
                params.append(param)
            state = _LayerState(self, timing, grad_value(index),
                                tuple((p.shape, p.dtype) for p in params))
            self._layers.append((state, params))
        self.table, self.times = list(table), list(times)

    @property
    def forward_s(self):
        return sum(t.forward_s for t in self.times)

    @property
    def backward_s(self):
        return sum(t.backward_s for t in self.times)

    def forward(self, x):
        self.pacer.late = 0.0
        carry = torch.zeros(())
        for state, params in self._layers:
            carry = _ReplayLayer.apply(carry, state, *params)
        return carry.reshape(1, 1).expand(x.shape[0], OUTPUTS)


def replay_model(model, batch_size, *, device_tflops=None, profile=None,
                 seq_len=architectures.DEFAULT_SEQ_LEN, model_mb=50.0, layers=5):
    """ReplayModel of `model` at `batch_size`: times from device_tflops or a profile file
    (exactly one of them)."""
    if (device_tflops is None) == (profile is None):
        raise ValueError("replayed compute needs exactly one of device_tflops (forward = "
                         "FLOPs / throughput, backward = 2 x forward) or a profile file")
    table = architectures.layer_table(model, batch_size, seq_len=seq_len, model_mb=model_mb,
                                      layers=layers)
    return ReplayModel(table, table_times(table, model, batch_size, device_tflops=device_tflops,
                                          profile=profile, seq_len=seq_len))


def table_times(table, model, batch_size, *, device_tflops=None, profile=None,
                seq_len=architectures.DEFAULT_SEQ_LEN):
    """`table`'s layer times: from the profile file when one is given, else at device_tflops."""
    if profile is None:
        return layer_times(table, device_tflops)
    return load_profile(profile, table, model, batch_size, seq_len)
