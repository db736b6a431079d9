"""Turn the benchmark's raw per-step times into medians, ratios, predictions and a plot.

Shared machines are noisy, so every figure is a median (over all timed
steps of all rounds, pooled), with the inter-quartile range and the spread
of per-round medians beside it. For each run (one raw JSON from
`pipe_horovod.tools.bench.worker`) the report gives, per configuration:

* step time, samples/s (all workers), forward+backward time;
* communication (the allreduce of a model-sized buffer of the same wire
  dtype, plus encode/decode for fp16/bf16), exposed communication (measured
  wait: ours' `opt.timings["wait_s"]`, Horovod's `synchronize()`), step minus
  compute (what communication costs the step, CPU contention included), and
  fraction hidden = 1 - exposed / communication;
* the timing model's prediction (`pipe_horovod.pipeline.timing_model.predict`, alpha/beta
  fitted from the allreduce sweep, or beta from the allreduce measurement);
* CPU cores each worker used (every thread of the process), and how busy the
  whole machine was meanwhile;

then the ratios the issue sets targets for, each marked met / not met.
Outputs: markdown (printed and saved), a JSON summary, a PNG of stacked
bars (compute + exposed communication) with Pipe-SGD's ideal bound.
"""
import argparse
import dataclasses
import functools
import json
import math
import os
import statistics
import sys

from pipe_horovod.collectives import cost_model
from pipe_horovod.pipeline import timing_model
from pipe_horovod.tools import planner
from pipe_horovod.tools.bench import models

TRAIN_ORDER = ("horovod", "horovod-fp16", "ddp")
UNPREDICTED = ("ddp-powersgd", "ours-auto")
TARGETS = {
    # key: (description, comparison, threshold)
    "k2_vs_ideal": ("ours-k2 step / max(compute, comm)", "<=", 1.10),
    "k2_speedup_vs_horovod": ("Horovod step / ours-k2 step", ">=", 1.6),
    # Replayed compute: against what the overlap-aware model predicts for
    # this run's own F, B and links, since Horovod also hides comm behind backward.
    "k2_speedup_vs_horovod_of_model": ("(Horovod / ours-k2 step) / the model's (Horovod "
                                       "sync / ours-k2) for this run", ">=", 0.95),
    "k1_vs_horovod": ("Horovod step / ours-k1 step", ">=", 0.97),
    "k1_vs_ddp": ("DDP step / ours-k1 step", ">=", 0.97),
    "bf16_speedup_vs_horovod": ("Horovod step / ours-k2-bf16 step", ">=", 2.5),
    "fp16_speedup_vs_horovod": ("Horovod step / ours-k2-fp16 step", ">=", 2.5),
    "max_prediction_error": ("largest prediction error of a training step, "
                             "abs(predicted − measured) / measured", "<=", 0.20),
    "wrapper_overhead": ("ours-k1 / plain optimizer - 1 (one process)", "<=", 0.03),
}


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _quartiles(xs):
    xs = sorted(x for x in xs if x is not None)
    if len(xs) < 2:
        return (xs[0], xs[0]) if xs else (None, None)
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def _pooled(rounds, key):
    return [x for block in rounds for x in block.get(key) or []]


def _cpu(rounds):
    """Per rank: CPU seconds / wall seconds over the timed blocks (cores used)."""
    if not rounds or not rounds[0].get("per_rank"):
        return []
    ranks = len(rounds[0]["per_rank"])
    out = []
    for r in range(ranks):
        cpu = sum(b["per_rank"][r]["cpu_s"] for b in rounds)
        wall = sum(b["per_rank"][r]["wall_s"] for b in rounds)
        out.append(cpu / wall if wall > 0 else None)
    return out


def _windows(steps, width):
    """Means of consecutive `width`-step windows of one block. A K-deep pipeline's steps
    may alternate (one finds its reduction landed, the next waits for the link), so
    their median can sit below the link's own bound; a window of K steps holds one
    whole period, and its mean is the throughput. Fewer steps than K: their mean."""
    if len(steps) < width:
        return [statistics.fmean(steps)] if steps else []
    return [statistics.fmean(steps[i:i + width])
            for i in range(0, len(steps) - width + 1, width)]


def _config_stats(name, cfg):
    rounds = cfg["rounds"]
    width = max(cfg.get("pipeline_depth") or 1, 1)
    steps = [x for b in rounds for x in _windows(b["step_s"], width)]
    q1, q3 = _quartiles(steps)
    per_round = [_median(_windows(b["step_s"], width)) for b in rounds]
    exposed = _pooled(rounds, "exposed_s")
    cores = _cpu(rounds)
    timed = sum(len(b["step_s"]) for b in rounds)
    return {
        "name": name, "kind": cfg["kind"], "compression": cfg.get("compression", "none"),
        "pipeline_depth": cfg.get("pipeline_depth"),
        "samples": timed, "step_s": _median(steps), "q1_s": q1, "q3_s": q3,
        "round_medians_s": per_round,
        "wall_step_s": (sum(b["wall_s"] for b in rounds) / timed
                        if timed and all("wall_s" in b for b in rounds) else None),
        "fwdbwd_s": _median(_pooled(rounds, "fwdbwd_s")),
        "opt_s": _median(_pooled(rounds, "opt_s")),
        "compensation_s": _median(_pooled(rounds, "compensation_s")),
        "exposed_wait_s": _median(exposed) if any(x is not None for x in exposed) else None,
        "cpu_cores_per_worker": cores,
        "machine_busy_cores": _median([b.get("machine_busy_cores") for b in rounds]),
    }


def _cpu_per_step(s):
    """CPU seconds a worker spends per step (mean over ranks), or None."""
    cores = [c for c in s["cpu_cores_per_worker"] if c is not None]
    if not cores or not s["step_s"]:
        return None
    return statistics.fmean(cores) * s["step_s"]


def _network(raw, stats, p, model_bytes):
    """(Network, description) from the sweep fit, else from the allreduce median."""
    sweep = raw.get("sweep")
    if p < 2:
        return cost_model.Network(0.0, 0.0), {"source": "one process: no communication"}
    if sweep and len(sweep["sizes"]) >= 2:
        med = [statistics.median(t) for t in sweep["seconds"]]
        # Absolute least squares: the predictions are for model-sized transfers, and the
        # emulated links pass small messages faster per byte (the token bucket's burst).
        fit = planner.fit(sweep["sizes"], med, p, relative=False)
        return fit.network, {"source": f"least-squares fit (absolute error) of a {len(med)}-size "
                                       f"allreduce sweep ({sweep['sizes'][0]} B .. "
                                       f"{sweep['sizes'][-1]} B)",
                             "alpha_s": fit.alpha, "beta_s_per_byte": fit.beta,
                             "r2": fit.r2, "max_rel_error": fit.max_rel_error,
                             "sweep_sizes": sweep["sizes"], "sweep_median_s": med}
    ar = stats.get("allreduce")
    if ar and ar["step_s"]:
        unit = timing_model.allreduce_time(cost_model.Network(0.0, 1.0), p, model_bytes)
        beta = ar["step_s"] / unit
        return cost_model.Network(0.0, beta), {"source": "beta from the model-sized allreduce "
                                                     "(alpha = 0; run with --fit for a sweep)",
                                           "alpha_s": 0.0, "beta_s_per_byte": beta}
    return None, {"source": "no allreduce measured: no prediction"}


def _target(key, value):
    desc, op, threshold = TARGETS[key]
    if value is None:
        return None
    met = value <= threshold if op == "<=" else value >= threshold
    return {"key": key, "what": desc, "value": value, "target": f"{op} {threshold:g}", "met": met}


def summarize(raw):
    """Everything the markdown, JSON summary and plot show, for one raw run."""
    from pipe_horovod.tools.bench.worker import exchange_of, is_ddp

    meta = raw["meta"]
    p = meta["workers"]
    model_bytes = meta["model_bytes"]
    batch = meta["batch_size"]
    stats = {name: _config_stats(name, cfg) for name, cfg in raw["configs"].items()}
    codec = raw.get("codec_s") or {}

    compute = stats.get("compute")
    replayed_model = (meta.get("compute") or {}).get("mode") == "replay" and p > 1
    compute_s = compute["step_s"] if compute else None
    comm = {}
    for codec_name, ar_name in (("none", "allreduce"), ("fp16", "allreduce-fp16"),
                                ("bf16", "allreduce-bf16")):
        if ar_name in stats:
            comm[codec_name] = stats[ar_name]["step_s"] + codec.get(codec_name, 0.0)
    # A per-hop codec's allreduce as training runs it: beside compute, on the same cores
    # (`contention-<codec>`'s step: the allreduce launched, a plain step, its wait).
    for name, cfg in stats.items():
        if name.startswith("contention-"):
            comm[cfg["compression"]] = cfg["step_s"]
    ideal = {c: max(compute_s, t) for c, t in comm.items()} if compute_s else {}
    # With every worker on one machine, compute and communication threads (and, when
    # emulated, the kernel's network path) share cpu_count cores: a step cannot take less
    # than the CPU time both need, divided by the cores each worker has.
    cores_per_worker = (meta.get("cpu_count") or 1) / p
    cpu_per_step = {name: _cpu_per_step(s) for name, s in stats.items()}
    cpu_bound = {}
    if compute and cpu_per_step.get("compute") is not None:
        for codec_name, ar_name in (("none", "allreduce"), ("fp16", "allreduce-fp16"),
                                    ("bf16", "allreduce-bf16")):
            if cpu_per_step.get(ar_name) is not None and codec_name in ideal:
                need = (cpu_per_step["compute"] + cpu_per_step[ar_name]
                        + codec.get(codec_name, 0.0))
                cpu_bound[codec_name] = max(ideal[codec_name], need / cores_per_worker)

    network, model_info = _network(raw, stats, p, model_bytes)
    predictions = None
    bf16_ratio = 1.0 if meta.get("horovod_bf16_as_float32") else 0.5
    wire_ratio = {"none": 1.0, "fp16": 0.5, "bf16": bf16_ratio}
    # Per-hop codecs (ring in pipe_horovod.collectives) run on a thread of the worker, on
    # the cores compute uses: what they take from compute is charged to the compute side,
    # as the Horovod-style codecs' encode is (hop_codec: seconds per gradient byte).
    hop_costs = raw.get("hop_codec_s_per_byte") or {}
    hop_codec = {name: timing_model.hop_codec_time(p, model_bytes, "ring", costs) / model_bytes
                 for name, costs in hop_costs.items()}
    hop_source = {name: "codec work measured alone" for name in hop_codec}
    if hop_codec:
        from pipe_horovod.tools import hop_codecs
        wire_ratio.update({name: hop_codecs.wire_ratio(name) for name in hop_codec})
    two_stage = _two_stage_codecs(raw, stats)
    wire_ratio.update({name: codec["wire_ratio"] for name, codec in two_stage.items()})
    # What communication takes from compute on shared cores: the `contention`
    # configuration's compute time (while a model-sized allreduce runs) minus the
    # `compute` configuration's, per byte on the wire; scaled to each codec's bytes.
    cont = stats.get("contention")
    cpu_per_byte, comm_cpu = 0.0, {}
    if cont and compute and cont["fwdbwd_s"] is not None:
        cpu_per_byte = max(0.0, cont["fwdbwd_s"] - compute_s) / model_bytes
        comm_cpu = {c: cpu_per_byte * model_bytes * wire_ratio[c] for c in wire_ratio}
    # Better, where measured: compute's slowdown while ring runs with that codec per hop
    # (`contention-<codec>`: codec, the collective's Python, the network stack), less the
    # network stack's share that comm_cpu charges already.
    for name in hop_codec:
        hop_cont = stats.get(f"contention-{name}")
        if hop_cont and compute and hop_cont["fwdbwd_s"] is not None:
            slowdown = hop_cont["fwdbwd_s"] - compute_s - comm_cpu.get(name, 0.0)
            hop_codec[name] = max(0.0, slowdown) / model_bytes
            hop_source[name] = f"contention-{name}"
    # The two-stage rows' CPU floor: every rank's CPU per step over the cores the ranks
    # had (timing_model.cpu_floor; its parts: _floor_parts).
    cores_had = _cores_had(meta, p)
    step_costs = raw.get("optimizer_step_costs")
    cpu_floor = {}                                # row name -> its floor
    if compute and cpu_per_step.get("compute") is not None:
        for name, s in stats.items():
            two = two_stage.get(s["compression"])
            if s["kind"] != "train" or two is None or two["cpu_s_per_byte"] is None:
                continue
            parts = _floor_parts(name, s, cpu_per_step, two, model_bytes, step_costs)
            need = sum(parts.values())
            cpu_floor[name] = {"cpu_s_per_step": need,
                               **{f"{k}_cpu_s": v for k, v in parts.items()},
                               "cores": cores_had,
                               "floor_s": timing_model.cpu_floor(need, p, cores_had)}
    if network is not None and compute:
        compressions = {"fp16": (0.5, codec.get("fp16", 0.0) / model_bytes),
                        "bf16": (bf16_ratio, codec.get("bf16", 0.0) / model_bytes),
                        **{name: (wire_ratio[name], per_byte)
                           for name, per_byte in hop_codec.items()},
                        # beside compute, on the communicator's thread: 0 s on the training
                        # thread, a bucket's link no shorter than its codec work
                        **{name: (two["wire_ratio"], 0.0, two["wall_s_per_byte"] or 0.0)
                           for name, two in two_stage.items()}}
        depths = sorted({s["pipeline_depth"] for s in stats.values()
                         if (s["pipeline_depth"] or 0) >= 2}) or [2]
        workload = timing_model.Workload.aggregate(compute["fwdbwd_s"], compute["opt_s"], model_bytes)
        bucketings = {}                          # one aggregate gradient: no system's buckets
        model_info["overlap"] = 0.0
        if replayed_model:
            workload = _replay_workload(meta["compute"], compute)
            bucketings = _bucketings(meta)
            model_info["workload"] = ("per layer: the replayed layer times scaled to the "
                                      "measured compute, each system's own buckets")

        @functools.cache
        def predictions(system, compensation_s, exchange=None):
            """{depth: timing_model.Prediction} of one system, pipelined steps charged
            `compensation_s` (Schedule's P) and `exchange` (prediction_exchange's)."""
            work = dataclasses.replace(workload, compensation_s=compensation_s)
            return {d: timing_model.predict(work, p, network, compressions=compressions,
                                      pipeline_depth=d, comm_cpu_per_byte=cpu_per_byte,
                                      bucketing=bucketings.get(system, timing_model.OURS),
                                      exchange=exchange)
                    for d in depths}
        model_info["comm_cpu_s_per_byte"] = cpu_per_byte
        model_info["compressions"] = {k: {"wire_ratio": v[0], "codec_s": v[1] * model_bytes,
                                          **({"source": hop_source[k]} if k in hop_source
                                             else {}),
                                          **({"beside_codec_s": v[2] * model_bytes}
                                             if len(v) > 2 else {})}
                                      for k, v in compressions.items()}
    model_info["two_stage"] = {codec: {**two, "cpu_floor": {
        name: floor for name, floor in cpu_floor.items()
        if stats[name]["compression"] == codec}} for codec, two in two_stage.items()}
    model_info["optimizer_step_costs"] = step_costs

    for name, s in stats.items():
        s["samples_per_s"] = (batch * p / s["step_s"]
                              if s["kind"] == "train" and s["step_s"] else None)
        c = s["compression"]
        s["comm_s"] = comm.get(c) if s["kind"] == "train" and name != "compute" else None
        s["step_minus_compute_s"] = (s["step_s"] - compute_s
                                     if s["kind"] == "train" and name != "compute" and compute_s
                                     else None)
        exposed = s["exposed_wait_s"] if s["kind"] == "train" else None
        s["hidden_fraction"] = (1 - exposed / s["comm_s"]
                                if exposed is not None and s["comm_s"] else None)
        s["hidden_fraction_step"] = (1 - max(s["step_minus_compute_s"], 0) / s["comm_s"]
                                     if s["step_minus_compute_s"] is not None and s["comm_s"]
                                     else None)
        s["ideal_s"] = ideal.get(c) if name.startswith("ours-k") and s["pipeline_depth"] >= 2 \
            else None
        system = "horovod" if name.startswith("horovod") else "ddp" if is_ddp(name) else "ours"
        charged = (s["compensation_s"] or 0.0) if (s["pipeline_depth"] or 1) > 1 else 0.0
        prediction = predictions and predictions(system, charged, exchange_of(name))
        s["predicted_s"] = _predicted(name, s, prediction, network, p, model_bytes, compute,
                                      wire_ratio)
        row = _planner_row(prediction, s) if s["predicted_s"] is not None else None
        s["prediction_bound"] = row.bottleneck if row is not None else None
        floor = cpu_floor.get(name, {}).get("floor_s")
        if row is not None and floor is not None:
            s["planner_step_s"] = row.step_s
            if floor > row.step_s:
                s["predicted_s"], s["prediction_bound"] = floor, "CPU"
        s["prediction_error"] = (abs(s["predicted_s"] - s["step_s"]) / s["step_s"]
                                 if s["predicted_s"] is not None and s["step_s"] else None)
        # The same step model fed the measured communication instead of the fitted network:
        # separates the error of the step model from the error of the alpha-beta fit.
        s["predicted_measured_comm_s"] = None
        if s["kind"] == "train" and name != "compute" and compute and s["comm_s"] is not None:
            s["predicted_measured_comm_s"] = timing_model.step_time(
                compute["fwdbwd_s"], compute["opt_s"] + charged, s["comm_s"],
                s["pipeline_depth"] or 1,
                comm_cpu_s=comm_cpu.get(c, 0.0) + hop_codec.get(c, 0.0) * model_bytes)
        s["prediction_error_measured_comm"] = (
            abs(s["predicted_measured_comm_s"] - s["step_s"]) / s["step_s"]
            if s["predicted_measured_comm_s"] is not None and s["step_s"] else None)
        s["cpu_s_per_step"] = cpu_per_step[name]
        s["compute"] = models.compute_label(meta.get("compute"))
        s["cpu_bound_s"] = cpu_bound.get(c) if s["ideal_s"] is not None else None

    def step(name):
        return stats[name]["step_s"] if name in stats else None

    def ratio(a, b):
        return a / b if a and b else None

    ratios = {
        "k2_vs_ideal": ratio(step("ours-k2"), ideal.get("none")),
        "k2_speedup_vs_horovod": ratio(step("horovod"), step("ours-k2")),
        "k1_vs_horovod": ratio(step("horovod"), step("ours-k1")),
        "k1_vs_ddp": ratio(step("ddp"), step("ours-k1")),
        "bf16_speedup_vs_horovod": ratio(step("horovod"), step("ours-k2-bf16")),
        "fp16_speedup_vs_horovod": ratio(step("horovod"), step("ours-k2-fp16")),
        "max_prediction_error": max((s["prediction_error"] for s in stats.values()
                                     if s["prediction_error"] is not None
                                     and s["kind"] == "train"), default=None),
        "k2_speedup_vs_horovod_of_model": ratio(
            ratio(step("horovod"), step("ours-k2")),
            ratio(stats.get("horovod", {}).get("predicted_s"),
                  stats.get("ours-k2", {}).get("predicted_s"))) if replayed_model else None,
        "wrapper_overhead": (ratio(step("ours-k1"), step("compute")) - 1
                             if p == 1 and step("ours-k1") and step("compute") else None),
    }
    extra = {
        "k2_speedup_vs_ddp": ratio(step("ddp"), step("ours-k2")),
        "k2_fraction_of_ideal": ratio(ideal.get("none"), step("ours-k2")),
        "k2_vs_cpu_bound": ratio(step("ours-k2"), cpu_bound.get("none")),
        "max_prediction_error_measured_comm": max(
            (s["prediction_error_measured_comm"] for s in stats.values()
             if s["prediction_error_measured_comm"] is not None), default=None),
        "k2_speedup_vs_k1": ratio(step("ours-k1"), step("ours-k2")),
        "fp16_k2_vs_ideal": ratio(step("ours-k2-fp16"), ideal.get("fp16")),
        "bf16_k2_vs_ideal": ratio(step("ours-k2-bf16"), ideal.get("bf16")),
        "horovod_fp16_speedup_vs_horovod": ratio(step("horovod"), step("horovod-fp16")),
        "comm_over_compute": ratio(comm.get("none"), compute_s),
        "max_allreduce_prediction_error": max(
            (s["prediction_error"] for s in stats.values()
             if s["prediction_error"] is not None and s["kind"] == "allreduce"), default=None),
    }
    targets = [t for k, v in ratios.items() if (t := _target(k, v)) is not None]
    process = raw.get("process") or []
    return {
        "meta": meta, "launch": raw.get("launch", {}), "configs": stats,
        "compute_s": compute_s, "comm_s": comm, "ideal_s": ideal, "codec_s": codec,
        "cpu_bound_s": cpu_bound, "cores_per_worker": cores_per_worker,
        "timing_model": model_info, "ratios": ratios, "extra_ratios": extra,
        "targets": targets, "process": process,
    }


def _replay_workload(replayed, measured):
    """timing_model.Workload of a replayed run: its layers' configured times, scaled so forward
    + backward equal the measured `compute` configuration's, and their gradient bytes."""
    configured = replayed["forward_s"] + replayed["backward_s"]
    scale = measured["fwdbwd_s"] / configured if configured else 1.0
    return timing_model.Workload.from_layers(
        [(layer["forward_s"] * scale, layer["backward_s"] * scale,
          tuple(4 * n for n in layer["param_numel"])) for layer in replayed["layers"]],
        update_s=measured["opt_s"])


def _bucketings(meta):
    """Each system's buckets in this run: ours and DDP at --bucket-cap-mb, Horovod's fusion
    at --horovod-fusion-mb (0: no fusion, one allreduce per tensor) or its default."""
    cap = meta.get("bucket_cap_mb", 25.0)
    fusion = meta.get("horovod_fusion_mb")
    systems = timing_model.bucketings(
        (timing_model.DDP.cap_bytes if cap is None else cap * timing_model.MIB),
        *(() if fusion is None else (max(fusion * timing_model.MIB, 1.0),)))
    if cap is None:              # --bucket-cap-mb auto: ours as the optimizer sized it
        systems["ours"] = timing_model.Bucketing("cap", meta["bucket_cap_auto_mb"] * timing_model.MIB,
                                            first_cap_bytes=meta["bucket_first_mb"] * timing_model.MIB)
    return systems


def _predicted(name, s, prediction, network, p, model_bytes, compute, wire_ratio):
    # No model here for PowerSGD's low-rank exchange nor for what tune="auto" picks.
    if s["kind"] == "contention" or name in UNPREDICTED:
        return None
    if name == "compute":
        return (compute["fwdbwd_s"] + compute["opt_s"]) if compute else None
    if name.startswith("allreduce"):
        if network is None:
            return None
        return timing_model.allreduce_time(network, p, model_bytes * wire_ratio[s["compression"]])
    row = _planner_row(prediction, s)
    return None if row is None else row.step_s


def _planner_row(prediction, s):
    """The timing_model.Row that predicts training configuration `s` ({depth: Prediction}
    of its system), or None."""
    if not prediction or s["kind"] != "train" or s["name"] == "compute":
        return None
    depth = s["pipeline_depth"] or 1
    pred = prediction.get(depth) or next(iter(prediction.values()))
    row = "sync" if depth == 1 else "pipelined"
    if s["compression"] != "none":
        row += "+" + s["compression"]
    return pred.rows.get(row)


def _two_stage_codecs(raw, stats):
    """{two-stage codec of this run ('int8eng', 'int4eng'): what the planner needs of it}:
    its compression, the wire bytes per gradient byte (measured_run.wire_ratio, i.e.
    timing_model.two_stage_wire_ratio of its block size and value bytes), and, where the worker
    measured the codec (two_stage_codec_s_per_byte), the sums of its stages' wall and
    CPU seconds per gradient byte (None where not)."""
    from pipe_horovod.pipeline import measured_run
    from pipe_horovod.tools.bench.worker import is_two_stage, two_stage_compression

    measured = raw.get("two_stage_codec_s_per_byte") or {}
    out = {}
    for name in sorted({s["compression"] for s in stats.values()
                        if s["kind"] == "train" and is_two_stage(s["compression"])}):
        costs = measured.get(name) or {}
        compression = costs.get("compression") or two_stage_compression(name)
        out[name] = {"compression": compression,
                     "wire_ratio": measured_run.wire_ratio(compression),
                     **{key: sum(costs[key]) if key in costs else None
                        for key in ("wall_s_per_byte", "cpu_s_per_byte")},
                     "stages_cpu_s_per_byte": costs.get("cpu_s_per_byte")}
    return out


FLOOR_PARTS = ("compute", "communication", "codec", "bucket_copy", "lookahead")


def _floor_parts(name, s, cpu_per_step, two, model_bytes, step_costs):
    """{part: CPU seconds a rank spends on it a step} for two-stage row `name` (stats `s`,
    its codec's `two`): the `compute` row's CPU (forward, backward, the SGD update: the
    same work in every row), the `allreduce` row's scaled to the codec's wire bytes, the
    codec's stages (two_stage_codec_s_per_byte), and the wrapped optimizer's own work
    beside compute, measured alone by the worker (optimizer_step_costs, absent from raw
    files before it: then not counted): copying the gradients into the buckets, and for a
    pipelined row whose staleness compensation is lookahead (the default) its one-pass
    prediction. Each is measured apart from the row predicted, never read off it."""
    from pipe_horovod.pipeline import staleness
    from pipe_horovod.tools.bench.worker import staleness_of

    parts = {"compute": cpu_per_step["compute"],
             "communication": (cpu_per_step.get("allreduce") or 0.0) * two["wire_ratio"],
             "codec": two["cpu_s_per_byte"] * model_bytes}
    if not step_costs:
        return parts
    parts["bucket_copy"] = step_costs["bucket_copy"]["cpu_s"]
    explicit, option = staleness_of(name)
    compensation = option if explicit else staleness.DEFAULT
    if (s["pipeline_depth"] or 1) > 1 and compensation == "lookahead" \
            and step_costs.get("lookahead"):
        parts["lookahead"] = step_costs["lookahead"]["cpu_s"]
    return parts


def _cores_had(meta, p):
    """The cores this run's `p` ranks had: the machine's cpu_count, shared fairly (as
    the kernel's scheduler shares them among runnable threads) with the load everything
    else kept busy while every worker slept (b: the median of the worker's idle probes),
    cpu_count * p / max(p + b, cpu_count); with no other load, cpu_count (p >= cores)."""
    cores = meta.get("cpu_count") or 1
    background = _median(meta.get("background_busy_cores") or []) or 0.0
    return cores * p / max(p + background, cores)


# ------------------------------------------------------------------- markdown

def _ms(x, digits=1):
    return "–" if x is None else f"{x * 1e3:.{digits}f}"


def _pct(x):
    return "–" if x is None else f"{x * 100:.0f}%"


def _num(x, fmt="{:.2f}"):
    return "–" if x is None else fmt.format(x)


def hidden_cell(row):
    """The 'hidden' column: by exposed wait, and (in brackets) by step − compute."""
    cell = _pct(row["hidden_fraction"])
    if row["hidden_fraction_step"] is not None:
        cell += f" ({_pct(row['hidden_fraction_step'])})"
    return cell


def _buckets_label(meta):
    cap = meta.get("bucket_cap_mb", 25.0)
    if cap is None:
        return (f"auto ({meta.get('bucket_cap_auto_mb', float('nan')):.1f} MiB, first "
                f"{meta.get('bucket_first_mb', float('nan')):g}; DDP 25)")
    return f"{cap:g} MB"


def title(summary):
    meta, launch = summary["meta"], summary["launch"]
    link = launch.get("emulate")
    where = (f"emulated {link} links" if link else
             ("one process" if meta["workers"] == 1 else "local launch (loopback)"))
    return (f"engine {meta['engine']}, {meta['workers']} worker(s), {where}, "
            f"{meta['model'].upper()} {meta['model_bytes'] / 1e6:.1f} MB "
            f"({meta['params'] / 1e6:.2f} M params), batch {meta['batch_size']}/worker, "
            f"buckets {_buckets_label(meta)}, "
            f"{models.compute_label(meta.get('compute'))}")


def markdown(summary, heading="##"):
    meta = summary["meta"]
    lines = [f"{heading} {title(summary)}", ""]
    launch = summary["launch"]
    if launch.get("command"):
        lines += [f"Command: `{launch['command']}`", ""]
    lines += [f"{meta['rounds']} interleaved rounds x {meta['steps']} timed steps "
              f"(after {meta['warmup']} warm-up steps per block), medians over all "
              f"{meta['rounds'] * meta['steps']} steps (a K-deep pipeline's: over the means "
              "of K consecutive steps, one period of its alternating steps); wall / steps = "
              "the timed blocks' wall time over their steps; torch threads per worker: "
              f"{meta['threads']}; machine cores: {meta['cpu_count']}; "
              f"versions: {', '.join(f'{k} {v}' for k, v in meta['versions'].items() if v)}.",
              ""]
    replayed = (meta.get("compute") or {}).get("mode") == "replay"
    if replayed:
        lines += [f"**Every row: {models.compute_label(meta['compute'])}** (timed waits, "
                  "no CPU; `pipe_horovod.tools.workloads.replay`): configured forward "
                  f"{_ms(meta['compute']['forward_s'])} ms, backward "
                  f"{_ms(meta['compute']['backward_s'])} ms per step.", ""]
    lines += ["| config | step ms | wall / steps ms | IQR ms | round medians ms | samples/s "
              f"| {'replayed ' if replayed else ''}fwd+bwd ms "
              "| comm ms | exposed (wait) ms | step − compute ms | hidden | predicted ms "
              "| pred. err | pred. w/ measured comm | CPU cores/worker | machine busy |",
              "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for name, s in summary["configs"].items():
        hidden = hidden_cell(s)
        cores = ", ".join(_num(c) for c in s["cpu_cores_per_worker"]) or "–"
        lines.append(
            f"| {name} | **{_ms(s['step_s'])}** | {_ms(s['wall_step_s'])} "
            f"| {_ms(s['q1_s'])}–{_ms(s['q3_s'])} "
            f"| {' / '.join(_ms(x, 0) for x in s['round_medians_s'])} "
            f"| {_num(s['samples_per_s'], '{:.0f}')} | {_ms(s['fwdbwd_s'])} "
            f"| {_ms(s['comm_s'])} | {_ms(s['exposed_wait_s'] if s['kind'] == 'train' else None)} "
            f"| {_ms(s['step_minus_compute_s'])} | {hidden} | {_ms(s['predicted_s'])} "
            f"| {_pct(s['prediction_error'])} "
            f"| {_ms(s['predicted_measured_comm_s'])} ({_pct(s['prediction_error_measured_comm'])}) "
            f"| {cores} | {_num(s['machine_busy_cores'])} |")
    lines += ["", "comm = allreduce of a model-sized buffer in the configuration's wire dtype "
              "(+ encode/decode for fp16/bf16); exposed (wait) = time blocked waiting for "
              "reductions (ours: `opt.timings['wait_s']`, Horovod: `synchronize()`; DDP waits "
              "inside backward, so none is shown); hidden = 1 − exposed/comm, in brackets "
              "1 − (step − compute)/comm, which also charges the slowdown communication "
              "threads cause to compute; CPU cores/worker = process CPU time / wall time "
              "over the timed blocks (all threads); machine busy = cores busy on the whole "
              "machine meanwhile (our workers and anything else).", ""]
    skipped = meta.get("skipped") or {}
    for name, why in skipped.items():
        lines.append(f"- not measured: `{name}`: {why}")
    if skipped:
        lines.append("")
    if meta.get("horovod_bf16_as_float32") and any(
            s["compression"] == "bf16" for s in summary["configs"].values()):
        lines += ["- engine horovod: Horovod 0.28.1 cannot reduce bfloat16, so bf16 "
                  "gradients travel as float32 (no bytes saved); fp16 is the compression "
                  "figure on this engine.", ""]

    lines += [f"{heading}# Ratios against the issue's targets", "",
              "| ratio | measured | target | met? |", "|---|---:|---:|---|"]
    for t in summary["targets"]:
        lines.append(f"| {t['what']} | {t['value']:.3f} | {t['target']} "
                     f"| {'yes' if t['met'] else '**no**'} |")
    extra_names = {
        "k2_speedup_vs_ddp": "DDP step / ours-k2 step",
        "k2_fraction_of_ideal": "fraction of Pipe-SGD's ideal reached by ours-k2",
        "k2_vs_cpu_bound": "ours-k2 step / CPU-contention bound (see CPU)",
        "max_prediction_error_measured_comm": "largest prediction error of a training step "
                                              "with the measured comm instead of the fit",
        "k2_speedup_vs_k1": "ours-k1 step / ours-k2 step",
        "fp16_k2_vs_ideal": "ours-k2-fp16 step / max(compute, fp16 comm)",
        "bf16_k2_vs_ideal": "ours-k2-bf16 step / max(compute, bf16 comm)",
        "horovod_fp16_speedup_vs_horovod": "Horovod step / Horovod-fp16 step",
        "comm_over_compute": "communication / compute",
        "max_allreduce_prediction_error": "largest prediction error of an allreduce alone",
    }
    for key, value in summary["extra_ratios"].items():
        if value is not None:
            lines.append(f"| {extra_names[key]} | {value:.3f} | | |")
    lines.append("")

    model = summary["timing_model"]
    lines += [f"{heading}# Timing model", "", f"- network: {model['source']}"]
    if "alpha_s" in model:
        bw = 1 / model["beta_s_per_byte"] / 1e6 if model["beta_s_per_byte"] else float("inf")
        lines.append(f"- alpha = {model['alpha_s'] * 1e6:.1f} us, beta = "
                     f"{model['beta_s_per_byte'] * 1e9:.3f} ns/byte (= {bw:.0f} MB/s per link, "
                     "reduction arithmetic included)"
                     + (f", r² = {model['r2']:.4f}, worst point off by "
                        f"{model['max_rel_error'] * 100:.0f}%" if "r2" in model else ""))
    if "overlap" in model:
        codecs = ""
        if summary["codec_s"]:
            codecs = ("; codec costs measured in the worker (encode+decode of the model; "
                      "per hop (bf16hop, int8): what ring with the codec takes from compute, "
                      "charged to compute): " +
                      ", ".join(f"{k} {v['codec_s'] * 1e3:.1f} ms (wire x{v['wire_ratio']:.3g}"
                                f"{', from ' + v['source'] if 'source' in v else ''})"
                                for k, v in model["compressions"].items()
                                if "beside_codec_s" not in v))
        if model.get("workload"):
            lines.append("- step prediction: `timing_model.predict` (ring allreduce, overlap-aware) "
                         "of a per-layer `Workload`: " + model["workload"] + codecs)
        else:
            lines.append("- step prediction: `timing_model.predict(compute_s=fwd+bwd, update_s=local "
                         "step, ...)` of the `compute` configuration, ring allreduce, overlap = 0 "
                         "for sync rows" + codecs)
        lines += _two_stage_lines(summary)
        charged = {n: s["compensation_s"] for n, s in summary["configs"].items()
                   if s["compensation_s"] and (s["pipeline_depth"] or 1) > 1}
        if charged:
            lines.append("- staleness compensation, charged to the pipelined step's update "
                         "(Schedule's P; `opt.timings['compensation_s']`, median per step): "
                         + ", ".join(f"{n} {_ms(v)} ms" for n, v in charged.items()))
        if model.get("comm_cpu_s_per_byte"):
            lines.append("- CPU contention: pipelined rows add to compute what a concurrent "
                         "allreduce costs it (`comm_cpu_per_byte` = "
                         f"{model['comm_cpu_s_per_byte'] * 1e9:.2f} ns per wire byte: the "
                         "`contention` configuration's compute minus `compute`'s, over the "
                         "model's bytes)")
    if model.get("sweep_sizes"):
        lines.append("- sweep (size: median allreduce ms): " + ", ".join(
            f"{_size(n)}: {t * 1e3:.2f}" for n, t in zip(model["sweep_sizes"],
                                                       model["sweep_median_s"])))
    lines.append("")

    lines += [f"{heading}# CPU", ""]
    proc = summary["process"]
    if proc:
        lines.append("- whole-process CPU seconds per worker (startup included): "
                     + ", ".join(f"rank {i}: {r['cpu_s']:.1f} s ({r.get('threads')} threads)"
                                 for i, r in enumerate(proc)))
    launch_cpu = launch.get("cpu_s")
    if launch_cpu:
        lines.append("- CPU seconds per worker process as reaped by the launcher: "
                     + ", ".join(f"{x:.1f}" for x in launch_cpu))
    cs = summary["configs"]
    if summary["cpu_bound_s"] and "compute" in cs and "allreduce" in cs:
        lines.append(
            f"- CPU per step and worker: compute {_ms(cs['compute']['cpu_s_per_step'])} ms, "
            f"allreduce alone {_ms(cs['allreduce']['cpu_s_per_step'])} ms; with "
            f"{summary['cores_per_worker']:.2f} core(s) per worker, a step that overlaps both "
            f"cannot take less than max(compute, comm, CPU needed / cores) = "
            f"{_ms(summary['cpu_bound_s']['none'])} ms (ideal without contention: "
            f"{_ms(summary['ideal_s']['none'])} ms). Process CPU only: the kernel's work for "
            "the emulated links is partly charged elsewhere, so this bound is optimistic.")
    cores = meta.get("cpu_count") or 0
    busy = [s["machine_busy_cores"] for s in summary["configs"].values()
            if s["machine_busy_cores"] is not None]
    if busy and cores:
        med = statistics.median(busy)
        lines.append(f"- the machine has {cores} cores for {meta['workers']} worker(s); during "
                     f"the timed blocks {med:.2f} cores were busy (median over blocks)"
                     + (", i.e. saturated: compute and communication threads competed for "
                        "the same cores" if med >= 0.9 * cores else "") + ".")
    links = launch.get("link_stats")
    if links:
        lines.append("- emulated links, whole run: " + "; ".join(
            f"worker {i} sent {l['tx_bytes'] / 1e9:.2f} GB, received {l['rx_bytes'] / 1e9:.2f} GB, "
            f"tbf held packets back {l['overlimits']} times" for i, l in enumerate(links)))
    background = meta.get("background_busy_cores") or []
    if background:
        lines.append("- load from everything else (all workers asleep, start of each round): "
                     + ", ".join(f"{b:.2f}" for b in background) + " cores busy")
    lines.append("")
    return "\n".join(lines)


def _two_stage_lines(summary):
    """The timing model's account of each two-stage codec (ours-kK-int8eng / -int4eng):
    its bytes, its codec's work, the CPU floor and which bound each row's prediction took."""
    lines = []
    p = summary["meta"]["workers"]
    costs = summary["timing_model"].get("optimizer_step_costs")
    for name, two in summary["timing_model"].get("two_stage", {}).items():
        text = (f"- two stages, {name} ({two['compression']}): wire x{two['wire_ratio']:.4f} "
                "(timing_model.two_stage_wire_ratio), reduced like a ring allreduce of those bytes; ")
        if two["wall_s_per_byte"] is None:
            lines.append(text + "its codec was not measured in this run: the bytes alone")
            continue
        model_bytes = summary["meta"]["model_bytes"]
        stages = ", ".join(f"{stage} {_ms(x * model_bytes)}" for stage, x in zip(
            ("first_stage", "reduce_shard", "decode"), two["stages_cpu_s_per_byte"]))
        text += ("its codec runs on the communicator's thread beside compute, "
                 f"{_ms(two['wall_s_per_byte'] * model_bytes)} ms a step (measured at the "
                 "bucket size by every rank at once; CPU "
                 f"{_ms(two['cpu_s_per_byte'] * model_bytes)} ms: {stages}), a bucket's link "
                 "time no shorter than its share")
        floors = two.get("cpu_floor") or {}
        if floors:
            text += (f"; CPU floor: {p} rank(s) x the CPU each takes a step (the compute "
                     "row's, the allreduce's x the wire ratio, the codec's"
                     + (", the optimizer's own bucket copy and lookahead prediction, "
                        "measured alone" if costs else "; the optimizer's own bucket copy "
                        "and lookahead prediction not measured in this run: not counted")
                     + (" (this optimizer has no one-pass lookahead rule: its prediction "
                        "not measured, not counted)" if costs and not costs["lookahead"]
                        else "")
                     + ") / the cores the run had (the machine's, shared with its "
                     "background load)")
        rows = []
        for n, s in summary["configs"].items():
            if s["compression"] != name or s["predicted_s"] is None:
                continue
            row = f"{n} {_ms(s['predicted_s'])} ms, bound: {s['prediction_bound']}"
            extra = [f"planner {_ms(s['planner_step_s'])} ms"] if "planner_step_s" in s else []
            if n in floors:
                floor = floors[n]
                parts = " + ".join(f"{_ms(floor[f'{part}_cpu_s'])} {part.replace('_', ' ')}"
                                   for part in FLOOR_PARTS if f"{part}_cpu_s" in floor)
                extra.append(f"floor {p} x ({parts} ms) / {floor['cores']:.2f} cores = "
                             f"{_ms(floor['floor_s'])} ms")
            rows.append(row + (f" ({'; '.join(extra)})" if extra else ""))
        lines.append(text + (": " + "; ".join(rows) if rows else ""))
    return lines


def _size(n):
    for unit, scale in (("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


# ------------------------------------------------------------------------ plot

def plot(summaries, path):
    """Stacked bars per configuration: compute, then exposed communication; ideal as a line."""
    from pipe_horovod.tools.plotting import pyplot

    plt = pyplot()

    n = len(summaries)
    fig, axes = plt.subplots(n, 1, figsize=(14, 4.4 * n), squeeze=False)
    for ax, summary in zip(axes[:, 0], summaries):
        compute = summary["compute_s"]
        names, bottoms, tops, comm_only, waits = [], [], [], [], []
        for name, s in summary["configs"].items():
            if s["step_s"] is None:
                continue
            names.append(name)
            if s["kind"] == "allreduce":
                bottoms.append(0.0)
                tops.append(0.0)
                comm_only.append(s["step_s"] * 1e3)
                waits.append(None)
                continue
            base = min(compute, s["step_s"]) if compute and name != "compute" else s["step_s"]
            bottoms.append(base * 1e3)
            tops.append(max(s["step_s"] - base, 0.0) * 1e3)
            comm_only.append(0.0)
            waits.append(s["exposed_wait_s"] * 1e3 if s["exposed_wait_s"] is not None else None)
        x = range(len(names))
        ax.bar(x, bottoms, color="#4c72b0", label="compute (fwd+bwd+update, no communication)")
        ax.bar(x, tops, bottom=bottoms, color="#dd8452",
               label="exposed communication (step − compute)")
        ax.bar(x, comm_only, color="#8c8c8c", label="allreduce alone (communication)")
        wx = [i for i, w in zip(x, waits) if w is not None]
        wy = [bottoms[i] + w for i, w in zip(x, waits) if w is not None]
        if wx:
            ax.scatter(wx, wy, marker="_", s=400, color="black", zorder=3,
                       label="compute + measured wait")
        mean = [(i, s["wall_step_s"] * 1e3) for i, s in
                enumerate(summary["configs"][n] for n in names) if s.get("wall_step_s")]
        if mean:
            ax.scatter(*zip(*mean), marker="x", color="#55a868", zorder=3,
                       label="wall time / steps (throughput)")
        styles = {"none": "-", "fp16": "--", "bf16": ":", "bf16hop": "-.", "int8": (0, (1, 3))}
        for codec, ideal in summary["ideal_s"].items():
            label = "Pipe-SGD ideal max(compute, comm)" + ("" if codec == "none"
                                                           else f" with {codec}")
            ax.axhline(ideal * 1e3, color="#c44e52", linestyle=styles[codec], linewidth=1.4,
                       label=label)
        for i, name in enumerate(names):
            s = summary["configs"][name]
            ax.text(i, max(bottoms[i] + tops[i], comm_only[i]) * 1.01, f"{s['step_s'] * 1e3:.0f}",
                    ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, rotation=20, ha="right")
        ax.set_ylabel("median ms per step")
        ax.set_title(title(summary), fontsize=9)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        ax.set_ylim(0, max([b + t for b, t in zip(bottoms, tops)] + comm_only
                           + [v * 1e3 for v in summary["ideal_s"].values()] + [1e-3]) * 1.25)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------ files

def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def write_report(raw_paths, out_dir, name="report"):
    """Reads raw JSONs, writes <name>.md, <name>.json, <name>.png; returns (markdown, paths)."""
    os.makedirs(out_dir, exist_ok=True)
    summaries = []
    for path in raw_paths:
        with open(path) as f:
            raw = json.load(f)
        if raw.get("format") != "pipe_horovod.bench/1":
            raise ValueError(f"{path} is not a pipe_horovod benchmark result")
        summary = summarize(raw)
        summary["raw_path"] = os.path.abspath(path)
        summaries.append(summary)
    heading = "##" if len(summaries) > 1 else "#"
    text = "\n".join(markdown(s, heading) for s in summaries)
    paths = save_outputs(out_dir, name, text,
                         summaries if len(summaries) > 1 else summaries[0])
    plot(summaries, paths["png"])
    return text, paths


def save_outputs(out_dir, name, text, summary):
    """Writes <name>.md (`text`) and <name>.json (`summary`) under out_dir; returns the
    paths of those and of <name>.png, which the caller plots."""
    paths = {k: os.path.join(out_dir, f"{name}.{k}") for k in ("md", "json", "png")}
    with open(paths["md"], "w") as f:
        f.write(text)
    with open(paths["json"], "w") as f:
        json.dump(_jsonable(summary), f, indent=1)
    return paths


def main(argv=None):
    parser = argparse.ArgumentParser(description="Report pipe_horovod benchmark results.")
    parser.add_argument("raw", nargs="+", help="raw JSON(s) written by the benchmark worker")
    parser.add_argument("--out", default=".", help="directory for report.md/.json/.png")
    parser.add_argument("--name", default="report", help="file name stem (default report)")
    args = parser.parse_args(argv)
    text, paths = write_report(args.raw, args.out, args.name)
    print(text)
    print("wrote " + ", ".join(paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
