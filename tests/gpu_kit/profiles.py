"""The GPU kit's profiles step: each layer's forward and backward time of ResNet-50,
BERT-base and GPT-2 small, measured on the device, written as replay profiles
(pipe_horovod/tools/workloads/replay.py's format) for `pipe-horovod simulate --profile`
and the replay bench: the planner's FLOP model gives norms and element-wise work no
time, and a real accelerator's per-layer times are what the simulated tables lack.

How: the real modules (tools/workloads/networks.py) on the device, under bf16 autocast
as GPU users train. A layer's forward time runs from its first forward call to the next
layer's (the element-wise work between layers counts to the layer before it); its
backward time runs from the previous gradient ready (or backward's start) to the last of
its own parameters' gradients accumulated (post-accumulate-grad hooks), so the layers'
times add up to the measured forward and backward. Times are CUDA events on a GPU,
the clock on a CPU; medians over the measured iterations. Each profile is read back
through replay.load_profile before it is written. Prints `PROFILES <json>`.

    python tests/gpu_kit/profiles.py --device cuda --out DIR
"""
import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from pipe_horovod.tools.workloads import architectures, networks, replay

# the simulated tables' batch sizes per worker (docs/simulate.md); seq_len 128
BATCHES = {"resnet50": 64, "bert-base": 32, "gpt2-small": 16}


class Clock:
    """Marks on the device's stream (CUDA events) or the host's clock, read as ms."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms(self, a, b):
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3


def build(model, batch, device):
    torch.manual_seed(0)
    if model == "resnet50":
        module = networks.ResNet50()
        example = torch.randn(batch, *networks.IMAGE_SHAPE)
    else:
        module = networks.BertBase() if model == "bert-base" else networks.GPT2Small()
        example = torch.randint(0, 1000, (batch, architectures.DEFAULT_SEQ_LEN))
    return module.to(device).train(), example.to(device)


def profile(model, batch, device, warmup, iterations):
    """{layer: (forward_ms, backward_ms)} medians over `iterations`, and the step's."""
    module, example = build(model, batch, device)
    table = architectures.layer_table(model, batch)
    names = [layer.name for layer in table]
    modules = dict(module.named_modules())
    clock = Clock(device)
    marks = {}

    def forward_mark(name):
        def hook(_mod, _args):
            marks.setdefault(("f", name), clock.mark())
        return hook

    def grad_mark(name):
        def hook(_param):
            marks[("b", name)] = clock.mark()        # the layer's last parameter wins
        return hook

    handles = [modules[name].register_forward_pre_hook(forward_mark(name)) for name in names]
    for layer in table:
        for pname, _ in layer.params:
            handles.append(module.get_parameter(pname).register_post_accumulate_grad_hook(
                grad_mark(layer.name)))
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if clock.cuda
                else contextlib.nullcontext())
    runs = []
    try:
        for i in range(warmup + iterations):
            marks.clear()
            module.zero_grad(set_to_none=True)
            start = clock.mark()
            with autocast:
                loss = module(example).float().mean()
            forward_end = clock.mark()
            loss.backward()
            end = clock.mark()
            if clock.cuda:
                torch.cuda.synchronize()
            if i >= warmup:
                runs.append(_times(names, marks, start, forward_end, end, clock))
    finally:
        for handle in handles:
            handle.remove()
    times = {name: tuple(statistics.median(run[name][k] for run in runs) for k in (0, 1))
             for name in names}
    step = statistics.median(run["_step"] for run in runs)
    return times, step


def _times(names, marks, start, forward_end, end, clock):
    out = {}
    firsts = [marks[("f", n)] for n in names]
    for i, name in enumerate(names):
        later = firsts[i + 1] if i + 1 < len(names) else forward_end
        out[name] = [clock.ms(firsts[i], later), 0.0]
    ready = sorted(names, key=lambda n: clock.ms(forward_end, marks[("b", n)]))
    previous = forward_end
    for name in ready:
        out[name][1] = max(0.0, clock.ms(previous, marks[("b", name)]))
        previous = marks[("b", name)]
    out["_step"] = clock.ms(start, end)
    out[names[0]][0] += clock.ms(start, firsts[0])    # before the first layer: its own
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=None,
                        help="one batch size for every model (the CPU rehearsal's)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=10)
    args = parser.parse_args()
    where = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16 autocast"
             if torch.device(args.device).type == "cuda" else f"CPU, torch {torch.__version__}")
    result = {}
    for model, batch in BATCHES.items():
        batch = args.batch or batch
        times, step = profile(model, batch, args.device, args.warmup, args.iterations)
        data = {"format": replay.PROFILE_FORMAT, "model": model, "batch_size": batch,
                "device": where, "step_ms": round(step, 4),
                "layers": [{"name": n, "forward_ms": round(f, 4), "backward_ms": round(b, 4)}
                           for n, (f, b) in times.items()]}
        if model == "bert-base":
            data["seq_len"] = architectures.DEFAULT_SEQ_LEN
        path = args.out / f"profile-{model}.json"
        path.write_text(json.dumps(data, indent=1) + "\n")
        replay.load_profile(path, architectures.layer_table(model, batch), model, batch)
        result[model] = {"batch": batch, "layers": len(times), "step_ms": round(step, 2),
                         "forward_ms": round(sum(f for f, _ in times.values()), 2),
                         "backward_ms": round(sum(b for _, b in times.values()), 2),
                         "file": path.name}
    print("PROFILES " + json.dumps({"device": where, "models": result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
