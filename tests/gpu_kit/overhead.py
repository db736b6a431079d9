"""The GPU kit's overhead step: what the wrapper costs one process, beside plain torch.

GPT-2 small (124 M parameters, tools/workloads/networks.py) with AdamW, one process
(engine local: the reduction is a copy), three configurations on their own copies of the
same weights, in interleaved rounds so that a slow moment hits each alike: plain torch
(zero_grad, forward, backward, AdamW's step), ours at K=1, ours at K=2 with the
lookahead (whose extra pass of AdamW's rule predicts the weights in flight), and ours at
the default, tune="auto" (its decision, from the run summary, is printed beside). A
step's clock waits for the compute stream. Prints `OVERHEAD <json>`: each configuration's
median step, its ratio to plain torch, and for K=2 the median share of the step its
prediction took (the optimizer's own `timings["compensation_s"]`).

    python tests/gpu_kit/overhead.py --device cuda [--autocast bf16]
"""
import argparse
import contextlib
import functools
import json
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

import pipe_horovod.torch as phvd
from pipe_horovod.tools.workloads import networks

# name -> None (plain torch) or (pipeline_depth, staleness_compensation, tune)
CONFIGS = {"plain torch": None, "ours K=1": (1, None, None),
           "ours K=2 (lookahead)": (2, "lookahead", None),
           "ours default (tune='auto')": (None, "lookahead", "auto")}
SMALL = {"vocab": 512, "hidden": 64, "layers": 2, "heads": 4, "intermediate": 128,
         "max_positions": 64}                       # the CPU rehearsal's stand-in


def make(config, device, small, seed=0):
    torch.manual_seed(seed)
    model = (networks.GPT2Small(**SMALL) if small else networks.GPT2Small()).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    spec = CONFIGS[config]
    if spec is not None:
        depth, compensation, tune = spec
        # Alone, the lookahead's prediction would be the next update itself and it would run
        # as K=1 (StepMachine.solo); a predivide factor makes the one rank's "average" a
        # gradient of its own, so the prediction runs as it does with several ranks (as
        # pipe-horovod memory measures it).
        opt = phvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                        pipeline_depth=depth,
                                        staleness_compensation=compensation,
                                        gradient_predivide_factor=2.0, tune=tune)
    return model, opt


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--autocast", choices=("bf16",), default=None,
                        help="forward and loss under bf16 autocast, as GPU users train: the "
                             "step shrinks and the prediction's share grows")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    small = device.type != "cuda"
    tokens = min(args.tokens, SMALL["max_positions"]) if small else args.tokens
    vocab = SMALL["vocab"] if small else networks.GPT2_SMALL["vocab"]
    phvd.init("local")
    g = torch.Generator().manual_seed(1)
    batch = torch.randint(vocab, (args.batch, tokens + 1), generator=g).to(device)
    inputs, targets = batch[:, :-1], batch[:, 1:].flatten()
    sync = (lambda: torch.cuda.current_stream(device).synchronize()) if device.type == "cuda" \
        else (lambda: None)
    autocast = (functools.partial(torch.autocast, device.type, dtype=torch.bfloat16)
                if args.autocast else contextlib.nullcontext)
    runs = {name: make(name, device, small) for name in CONFIGS}
    steps = {name: [] for name in CONFIGS}
    shares = []
    for rnd in range(args.rounds):
        for name, (model, opt) in runs.items():
            timings = getattr(opt, "timings", None)
            for t in range(args.steps + 2):              # two untimed steps each round
                before = timings["compensation_s"] if timings else 0.0
                sync()
                t0 = time.perf_counter()
                opt.zero_grad()
                with autocast():
                    loss = F.cross_entropy(model(inputs).flatten(0, 1).float(), targets)
                loss.backward()
                opt.step()
                sync()
                dt = time.perf_counter() - t0
                if t >= 2:
                    steps[name].append(dt)
                    if timings and CONFIGS[name][1] and CONFIGS[name][2] is None:
                        shares.append((timings["compensation_s"] - before) / dt)
    decisions = {}
    for name, (model, opt) in runs.items():
        if hasattr(opt, "flush"):
            opt.flush()
        if CONFIGS[name] and CONFIGS[name][2]:           # what tune="auto" chose, and why
            with tempfile.TemporaryDirectory() as scratch:
                path = opt.write_run_summary(f"{scratch}/summary.json")
                decisions[name] = json.load(open(path))["config"].get("auto")
    plain = statistics.median(steps["plain torch"])
    rows = {name: {"median_ms": round(1e3 * statistics.median(v), 3),
                   "vs_plain": round(statistics.median(v) / plain, 3)}
            for name, v in steps.items()}
    params = sum(p.numel() for p in runs["plain torch"][0].parameters())
    result = {"device": str(device), "autocast": args.autocast,
              "model": "gpt2-small" if not small else "gpt2 (tiny)",
              "params": params, "batch": [args.batch, tokens], "steps": args.steps,
              "rounds": args.rounds, "configs": rows, "auto": decisions,
              "prediction_share_of_step": round(statistics.median(shares), 4) if shares else None}
    print("OVERHEAD " + json.dumps(result), flush=True)
    phvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
