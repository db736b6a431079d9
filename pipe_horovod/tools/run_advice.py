"""Advice from a measured run: `pipe-horovod plan --from-run SUMMARY`.

The summary (pipe_horovod/pipeline/run_record.py: PIPE_HOROVOD_RUN_SUMMARY or
optimizer.write_run_summary) holds what the user's own run measured: per step its
compute and the time it blocked on reductions, per bucket its bytes, launch and
landing, and the configuration (K, codec, bucket cap, workers, buckets). What it
predicts (the medians, the workload, the link that reproduces the measured step, every
candidate's step, the recommendation under the convergence rule) is the runtime's
pipeline/measured_run.py, the very code a run that tunes itself decides with
(pipeline/auto.py); here: reading and checking the file, a per-hop codec's wire ratio
(the toolbox's hop_codecs), and the report a user reads.
"""
import math

from pipe_horovod.pipeline import measured_run, timing_model
from pipe_horovod.pipeline.run_record import FORMAT
from pipe_horovod.tools.validators import read_json

def path_wire_ratio(codec, collective=None):
    """Wire bytes per float32 gradient byte of `codec` (a config name) on the path the run
    took: per hop with a collective (hop_codecs.wire_ratio), else the engine's
    (measured_run.wire_ratio)."""
    base = codec.partition(":")[0]
    if collective is not None and base not in ("none", "fp16", "bf16"):
        from pipe_horovod.tools.hop_codecs import PER_HOP, wire_ratio as hop_ratio

        for name, (hop_codec, _) in PER_HOP.items():
            if hop_codec.split("_")[0] == base.split("_")[0]:
                return hop_ratio(name)
    return measured_run.wire_ratio(codec)


# ------------------------------------------------------------------ the summary

def load(path):
    """The run summary at `path`, checked: ValueError naming the file and the problem."""
    summary = read_json(path, "run summary")
    check(summary, path)
    return summary


def check(summary, path="run summary"):
    if not isinstance(summary, dict) or summary.get("format") != FORMAT:
        found = summary.get("format") if isinstance(summary, dict) else type(summary).__name__
        raise ValueError(f"{path} is not a pipe_horovod run summary of format {FORMAT!r} "
                         f"(found {found!r})")
    config = summary.get("config")
    needed = ("pipeline_depth", "compression", "collective", "bucket_cap_bytes", "workers",
              "model_bytes", "buckets")
    missing = [k for k in needed if not isinstance(config, dict) or k not in config]
    if missing:
        raise ValueError(f"{path}: its config lacks {', '.join(missing)}")
    if config["workers"] < 2:
        raise ValueError(f"{path}: a run on {config['workers']} worker(s) reduces nothing; "
                         f"record a run on 2 or more")
    steps = summary.get("steps") or []
    if len(steps) < 2:
        raise ValueError(f"{path}: {len(steps)} measured step(s); record at least 3 steps "
                         f"(the first has no start to measure from)")
    if not config["buckets"] or not summary.get("reductions"):
        raise ValueError(f"{path}: no bucket reduction recorded")
    try:
        for s in steps:
            float(s["step"]) + s["finished_s"] + s["compute_s"] + s["wait_s"]
        sizes = [sum(b) for b in config["buckets"]]
        for r in summary["reductions"]:
            if not 0 <= r["bucket"] < len(sizes) or r["bytes"] != sizes[r["bucket"]]:
                raise ValueError(f"{path}: reduction {r} does not match the config's buckets "
                                 f"(bytes {sizes})")
            float(r["step"]) + r["launched_s"]
    except (KeyError, TypeError) as exc:
        what = f"no {exc}" if isinstance(exc, KeyError) else str(exc)
        raise ValueError(f"{path}: a recorded step or reduction is malformed ({what})") from None
    path_wire_ratio(config["compression"], config["collective"])   # a codec this knows


def report(summary, latency_s=0.0, path="the run"):
    """The advice as text (what `plan --from-run` prints)."""
    config = summary["config"]
    ratio = path_wire_ratio(config["compression"], config["collective"])
    measured = measured_run.measure(summary)
    network, every = measured_run.candidates(summary, measured, latency_s, ratio)
    best, refused = measured_run.recommend(every)
    costs = [timing_model.allreduce_time(network, config["workers"], sum(b) * ratio)
             for b in config["buckets"]]
    collective = f", collective={config['collective']}" if config["collective"] else ""
    lines = [
        f"Measured run ({path}): K={config['pipeline_depth']}, compression="
        f"{config['compression']}{collective}, {len(config['buckets'])} buckets (cap "
        f"{config['bucket_cap_bytes'] / timing_model.MIB:g} MiB), {config['workers']} workers, "
        f"{config['model_bytes'] / 1e6:.2f} MB of gradients",
        f"Per step (median of {measured.steps} steady steps of {len(summary['steps'])} "
        f"recorded): compute "
        f"{measured.compute_s * 1e3:.2f} ms, exposed wait {measured.wait_s * 1e3:.2f} ms, "
        f"step {measured.step_s * 1e3:.2f} ms",
        f"Link that reproduces it: {1 / network.beta / 1e6 if network.beta else math.inf:.1f} "
        f"MB/s, {network.alpha * 1e6:g} us per message; communication {sum(costs) * 1e3:.2f} "
        f"ms per step" + ("" if measured.wait_s > 0 else
                          " at most (nothing was exposed: the link is at least this fast)"),
        "",
        "| bucket | MB | launched ms | landed after ms | exposed wait ms | predicted comm ms |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for i, (sizes, cost) in enumerate(zip(config["buckets"], costs)):
        lines.append(f"| {i} | {sum(sizes) / 1e6:.3f} | {measured.launch_s[i] * 1e3:.2f} | "
                     f"{measured.landed_s[i] * 1e3:.2f} | {measured.exposed_s[i] * 1e3:.2f} | "
                     f"{cost * 1e3:.2f} |")
    gain = measured.step_s / best.step_s if best.step_s > 0 else 1.0
    lines += ["", f"Recommended: K={best.depth}, compression={best.codec}, buckets "
                  f"{best.cap}: predicted step {best.step_s * 1e3:.2f} ms, {gain:.2f}x the "
                  f"measured {measured.step_s * 1e3:.2f} ms"]
    for c in measured_run.best_per_configuration(refused):
        lines.append(f"Skipped, though predicted faster ({c.step_s * 1e3:.2f} ms, K={c.depth}, "
                     f"{c.codec}, buckets {c.cap}): {c.failure}")
    lines += ["", "Each K and compression at its fastest bucket size:", "",
              "| K | compression | buckets | predicted step ms | comm ms | vs measured | "
              "convergence rule |", "|---:|---|---|---:|---:|---:|---|"]
    for c in measured_run.best_per_configuration(every):
        lines.append(f"| {c.depth} | {c.codec} | {c.cap} | {c.step_s * 1e3:.2f} | "
                     f"{c.comm_s * 1e3:.2f} | {measured.step_s / c.step_s:.2f}x | "
                     f"{'meets' if c.failure is None else 'fails'} |")
    lines += ["", "Predictions: pipe_horovod/pipeline/timing_model.py's model (ring allreduce of the "
                  "wire bytes on the link above; codec CPU time not counted; K=2 with the "
                  "default staleness compensation). Only codecs that met the convergence "
                  "targets in docs/convergence.md are recommended."]
    if config["compression"] != "none":
        lines.append(f"The link was derived from {config['compression']}'s wire bytes: where "
                     f"its codec runs on the CPU beside the communication (CPU workers), its "
                     f"time counts as link time, so the rows with more wire bytes are "
                     f"pessimistic there.")
    return "\n".join(lines)
