"""SimGrid against the emulated cluster's measured replay runs (2 and 4 workers).

Each run in docs/bench/*.json replayed a model's compute (timed waits of each layer's
FLOPs over a device throughput: the planner's own layer times) on emulated 1 Gbit/s
links. This script gives SimGrid the same inputs (model, batch, the replay's TFLOP/s,
workers, the emulation's nominal link rate, our 25 MiB buckets, Horovod's 128 MiB
fusion) and prints the measured step, SimGrid's (cm02: links as given; lv08: SimGrid's
TCP calibration, bandwidth x 0.97) and the planner's side by side. Nothing here is fitted
to the measurement: the link is the emulation's rate, not the bench's fitted beta.

    .venv/bin/python scripts/simulate_replay_runs.py [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipe_horovod.tools.commands import plan as plan_command  # noqa: E402
from pipe_horovod.tools.commands.simulate import RowKind  # noqa: E402
from pipe_horovod.tools.simulate import engine, schedule  # noqa: E402
from pipe_horovod.tools.workloads.architectures import layer_table  # noqa: E402

LINK = 1e9 / 8          # the emulation's tbf rate, 1gbit, bytes/s
LATENCY = 20e-6         # the emulation adds no delay (tbf only): veth's own, about 20 us
CAP_MIB = 25            # the bench's bucket_cap_mb
STEPS = 200             # K=2 with the link 1-2% slower than compute needs ~60 steps to fill its slack

# measured config name -> the row that sends what it sends
KINDS = {
    "horovod": RowKind("horovod", "Horovod, sync", "horovod", 1, "ring"),
    "ddp": RowKind("ddp", "DDP, sync", "ddp", 1, "ring"),
    "ours-k1": RowKind("ours-k1", "ours K=1", "ours", 1, "ring"),
    "ours-k2": RowKind("ours-k2", "ours K=2", "ours", 2, "ring"),
    "ours-k2-none": RowKind("ours-k2-none", "ours K=2, no compensation", "ours", 2, "ring"),
    "ours-k2-int8eng": RowKind("ours-k2-int8eng", "int8_ef two-stage", "ours", 2,
                               "two_stage", "int8_ef"),
    "ours-k2-int8eng-none": RowKind("ours-k2-int8eng-none", "int8_ef two-stage", "ours", 2,
                                    "two_stage", "int8_ef"),
    "ours-k2-int4eng": RowKind("ours-k2-int4eng", "int4_ef two-stage", "ours", 2,
                               "two_stage", "int4_ef"),
    "ours-k2-int4eng:32": RowKind("ours-k2-int4eng:32", "int4_ef:32 two-stage", "ours", 2,
                                  "two_stage", "int4_ef:32"),
}
RUNS = ("replay-r50-p2-onepass", "replay-r50-p4", "replay-r50-p4-quiet", "replay-r50-p4-torch",
        "replay-vgg16-p2-fifo", "issue40-r50-p2-int4kernels", "issue40-r50-p4-int4kernels",
        "issue40-r50-p2-none", "issue40-r50-p2-torch", "issue40-bert-p2", "issue40-bert-p4")


def simulate_run(name):
    data = json.loads((ROOT / "docs" / "bench" / f"{name}.json").read_text())
    meta = data["meta"]
    replay = meta["compute"]
    model, batch, workers = meta["model"], meta["batch_size"], meta["workers"]
    assert data["launch"]["emulate"] == "1gbit", name
    assert meta["bucket_cap_mb"] == CAP_MIB, name
    work = plan_command.workload(layer_table(model, batch), replay["device_tflops"])
    # the replay timed these very layers: its configured forward is the planner's
    assert abs(work.forward_s - replay["forward_s"]) < 1e-6 * replay["forward_s"], name
    measured = {c: v["step_s"] for c, v in data["configs"].items()
                if v.get("step_s") and c in KINDS}
    kinds = [KINDS[c] for c in measured]
    network = schedule.network_of(LINK, LATENCY)
    planned = schedule.rows(kinds, work, workers, network, CAP_MIB * 2**20)
    sims = {}
    for model_name in ("cm02", "lv08"):
        spec = {"topology": "star", "placement": "packed", "workers": workers,
                "bandwidth": LINK, "latency": LATENCY, "intra_bandwidth": LINK,
                "intra_latency": LATENCY, "network_model": model_name,
                "every_round": False, "steps": STEPS, "rows": [row for _, row, _ in planned]}
        sims[model_name] = engine.run(spec)["rows"]
    out = []
    for kind, _, predicted in planned:
        out.append({"run": name, "engine": meta["engine"], "model": model, "batch": batch,
                    "tflops": replay["device_tflops"], "workers": workers,
                    "config": kind.name, "measured_s": measured[kind.name],
                    "compute_s": data["compute_s"], "allreduce_s": data["comm_s"]["none"],
                    "sim_cm02_s": sims["cm02"][kind.name]["step_s"],
                    "sim_lv08_s": sims["lv08"][kind.name]["step_s"],
                    "planner_s": predicted.step_s,
                    "sim_compute_s": work.forward_s + work.backward_s + work.update_s})
    return out


def table(rows):
    lines = ["| run | engine | model, batch, TFLOP/s | p | config | measured ms | SimGrid cm02 ms "
             "(error) | SimGrid lv08 ms (error) | planner ms (error) |",
             "|---|---|---|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        m = r["measured_s"]

        def cell(v):
            return f"{v * 1e3:.1f} ({(v - m) / m:+.1%})"

        lines.append(f"| {r['run']} | {r['engine']} | {r['model']}, {r['batch']}, {r['tflops']:g} | "
                     f"{r['workers']} | {r['config']} | {m * 1e3:.1f} | {cell(r['sim_cm02_s'])} | "
                     f"{cell(r['sim_lv08_s'])} | {cell(r['planner_s'])} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows as JSON")
    parser.add_argument("runs", nargs="*", default=RUNS)
    args = parser.parse_args()
    rows = [r for name in args.runs for r in simulate_run(name)]
    print(table(rows))
    print()
    for name in args.runs:
        r = next(r for r in rows if r["run"] == name)
        print(f"{name}: measured compute {r['compute_s'] * 1e3:.1f} ms vs replayed "
              f"{r['sim_compute_s'] * 1e3:.1f}; measured allreduce of the model "
              f"{r['allreduce_s'] * 1e3:.1f} ms")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
