"""The Keras benchmark's report: the PyTorch report's tables, plus the Keras comparison.

`report.summarize` / `report.markdown` / `report.plot` do the common part
(medians, IQR, comm, exposed wait, hidden = 1 − exposed/comm, the plot).
This adds what the Keras benchmark must show: each row against
tf-keras + MultiWorkerMirroredStrategy and against our K=1, the three
targets, and the per-step time breakdown of our TensorFlow path. Rows of
TensorFlow custom loops (`--framework tf-loop`: loop-kK, and
MWMS's loop tf-mwms-loop) compare against their own kind: loop-k1 and
tf-mwms-loop are their "K=1" and "MWMS" columns.

Definitions (as docs/bench/log.md for PyTorch): comm = the allreduce of a
model-sized float32 buffer alone; compute = the plain Keras step (no
communication); ideal pipelined step = max(compute, comm); the ideal
pipelining ratio = (compute + comm) / max(compute, comm), what Pipe-SGD
gains over a sync step that overlaps nothing.
"""
import json
import os

from . import report
from .keras_worker import TIMERS
from .mwms_worker import LOOP_NAME as MWMS_LOOP
from .mwms_worker import NAME as MWMS

KERAS_TARGETS = {
    "k2_hidden": ("communication hidden by ours-k2, 1 − exposed wait / comm", ">=", 0.80),
    "k1_vs_mwms": ("ours-k1 step / tf-keras+MWMS step", "<=", 1.05),
    "k2_speedup_vs_mwms_over_ideal": (
        "(tf-keras+MWMS step / ours-k2 step) / ideal pipelining ratio "
        "(compute + comm) / max(compute, comm)", ">=", 0.90),
}


def _pooled(raw, name, key):
    cfg = raw["configs"].get(name)
    return report._pooled(cfg["rounds"], key) if cfg else []


def breakdown(raw):
    """Per ours row: median seconds per step of each timer, and derived figures."""
    out = {}
    for name in raw["configs"]:
        if not name.startswith(("ours-k", "torch-ours-k", "loop-k")):
            continue
        row = {k: report._median(_pooled(raw, name, k)) for k in TIMERS + ("handoffs", "step_s")}
        if name.startswith(("torch-", "loop-k")):   # no Keras hand-offs: engine timers only
            row.update(fill_s=None, handoff_s=None, finish_s=None, handoffs=None)
        elif row["handoff_s"] is not None and row["finish_s"] is not None:
            # Python time in the hand-offs other than blocking on the network.
            row["handoff_python_s"] = row["handoff_s"] + row["finish_s"] - (row["wait_s"] or 0)
        out[name] = row
    return out


def keras_summary(raw, summary):
    cs = summary["configs"]

    def step(name):
        return cs[name]["step_s"] if name in cs else None

    compute, comm = summary["compute_s"], summary["comm_s"].get("none")
    ideal = max(compute, comm) if compute and comm else None
    ideal_ratio = (compute + comm) / ideal if ideal else None
    mwms, k1, k2 = step(MWMS), step("ours-k1"), step("ours-k2")
    loop_mwms, loop_k1, loop_k2 = step(MWMS_LOOP), step("loop-k1"), step("loop-k2")
    rows = {}
    for name, s in cs.items():
        if s["kind"] != "train":
            continue
        # Each kind against its own baselines; compute against fit's when there is one.
        loop = _is_loop(name) or (name == "compute" and not (mwms or k1))
        base, base_k1 = (loop_mwms, loop_k1) if loop else (mwms, k1)
        rows[name] = {"step_s": s["step_s"], "q1_s": s["q1_s"], "q3_s": s["q3_s"],
                      "speedup_vs_mwms": base / s["step_s"] if base and s["step_s"] else None,
                      "speedup_vs_k1": base_k1 / s["step_s"] if base_k1 and s["step_s"] else None,
                      "exposed_wait_s": s["exposed_wait_s"],
                      "hidden_fraction": s["hidden_fraction"],
                      "hidden_fraction_step": s["hidden_fraction_step"],
                      "step_minus_compute_s": s["step_minus_compute_s"],
                      "backend": (summary["meta"].get("config_backends") or {}).get(name)}
    values = {
        "k2_hidden": cs["ours-k2"]["hidden_fraction"] if "ours-k2" in cs else None,
        "k1_vs_mwms": k1 / mwms if k1 and mwms else None,
        "k2_speedup_vs_mwms_over_ideal": (mwms / k2 / ideal_ratio
                                          if mwms and k2 and ideal_ratio else None),
    }
    targets = []
    for key, value in values.items():
        desc, op, threshold = KERAS_TARGETS[key]
        if value is not None:
            met = value >= threshold if op == ">=" else value <= threshold
            targets.append({"key": key, "what": desc, "value": value,
                            "target": f"{op} {threshold:g}", "met": met})
    return {"rows": rows, "compute_s": compute, "comm_s": comm, "ideal_s": ideal,
            "ideal_pipelining_ratio": ideal_ratio,
            "comm_over_compute": comm / compute if comm and compute else None,
            "k2_speedup_vs_mwms": mwms / k2 if mwms and k2 else None,
            "k2_vs_ideal": k2 / ideal if k2 and ideal else None,
            "mwms_over_ideal": mwms / ideal if mwms and ideal else None,
            "targets": targets, "breakdown": breakdown(raw),
            # ours-auto: what each round's launch chose (rank 0's last words)
            "auto_decisions": [r.get("auto_decision") for r in
                               (raw["configs"].get("ours-auto") or {}).get("rounds", [])],
            "loop": {"k2_speedup_vs_mwms_loop": (loop_mwms / loop_k2
                                                 if loop_mwms and loop_k2 else None),
                     "k1_speedup_vs_mwms_loop": (loop_mwms / loop_k1
                                                 if loop_mwms and loop_k1 else None),
                     "k2_speedup_vs_k1": loop_k1 / loop_k2 if loop_k1 and loop_k2 else None,
                     "k2_vs_ideal": loop_k2 / ideal if loop_k2 and ideal else None,
                     "k2_hidden": (cs["loop-k2"]["hidden_fraction"] if "loop-k2" in cs
                                   else None)}}


def _is_loop(name):
    """A TensorFlow custom loop's row (ours or MWMS's)."""
    return name.startswith("loop-k") or name == MWMS_LOOP


def markdown(summary, keras, heading="#"):
    ms, num = report._ms, report._num
    fit = any(name.startswith("ours-k") or name == MWMS for name in keras["rows"])
    title = ("Keras: ours vs tf-keras + MultiWorkerMirroredStrategy" if fit else
             "TensorFlow custom loops: ours vs MultiWorkerMirroredStrategy")
    lines = [f"{heading} {title}", "",
             f"compute {ms(keras['compute_s'])} ms, comm {ms(keras['comm_s'])} ms "
             f"(comm/compute {num(keras['comm_over_compute'])}), ideal pipelined step "
             f"max(compute, comm) {ms(keras['ideal_s'])} ms, ideal pipelining ratio "
             f"(compute + comm)/max {num(keras['ideal_pipelining_ratio'])}.", "",
             "| config | step ms | IQR ms | speedup vs MWMS | speedup vs K=1 "
             "| exposed wait ms | hidden | step − compute ms | communication by |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, r in keras["rows"].items():
        hidden = report.hidden_cell(r)
        lines.append(f"| {name} | **{ms(r['step_s'])}** | {ms(r['q1_s'])}–{ms(r['q3_s'])} "
                     f"| {num(r['speedup_vs_mwms'])} | {num(r['speedup_vs_k1'])} "
                     f"| {ms(r['exposed_wait_s'])} | {hidden} | {ms(r['step_minus_compute_s'])} "
                     f"| {r['backend'] or 'none'} |")
    lines += ["", "hidden = 1 − exposed wait/comm (in brackets 1 − (step − compute)/comm). "
              "tf-keras+MWMS waits inside its graph, so no wait is shown for it."
              + (" TensorFlow custom loops (loop-kK: DistributedGradientTape in a "
                 "tf.function step, plain SGD; tf-mwms-loop: strategy.run + strategy.reduce) "
                 "are compared with their own kind: their speedups are against "
                 f"{MWMS_LOOP} and loop-k1." if any(map(_is_loop, keras["rows"])) else ""),
              "", *_loop_lines(keras["loop"], heading)]
    if keras.get("auto_decisions"):
        lines += ["ours-auto's decision in each round (a launch of its own, so it decides "
                  "each time):", "", *(f"- round {i + 1}: {d or 'none logged'}"
                                      for i, d in enumerate(keras["auto_decisions"])), ""]
    if fit:
        lines += _fit_target_lines(keras, heading)
    ratio = keras["comm_over_compute"]
    if ratio is not None and not 0.67 <= ratio <= 1.5:
        lines += [f"Note: comm/compute is {ratio:.2f} here, not ≈ 1: the hidden-fraction "
                  "target is defined where comm ≈ compute.", ""]
    if keras["breakdown"]:
        lines += [f"{heading}# Where a step of our path goes (medians per step, ms)", "",
                  "| config | step | copy into buckets | bucket hand-offs (copy + launch) "
                  "| launch allreduce | final hand-off (rest + wait + copy out) | wait "
                  "| hand-off Python excl. wait | hand-offs/step |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for name, b in keras["breakdown"].items():
            lines.append(f"| {name} | {ms(b['step_s'])} | {ms(b['fill_s'], 2)} "
                         f"| {ms(b['handoff_s'], 2)} | {ms(b['launch_s'], 2)} "
                         f"| {ms(b['finish_s'], 2)} | {ms(b['wait_s'], 2)} "
                         f"| {ms(b.get('handoff_python_s'), 2)} | {num(b['handoffs'], '{:.0f}')} |")
        lines += ["", "TensorFlow rows: timers wrapped around the engine's allreduce_async/wait "
                  "and the TensorFlowPath's numpy_function bodies (bench-only). The hand-offs "
                  "run on TF's inter-op threads, partly in parallel with the rest of the graph, "
                  "so the columns do not add up to the step. torch-* and loop-* rows: only the "
                  "engine timers apply.", ""]
    return "\n".join(lines)


def _fit_target_lines(keras, heading):
    """The Keras benchmark's targets for the fit rows."""
    num, three = report._num, "{:.3f}"
    lines = [f"{heading}# Keras targets", "",
             "| target | measured | threshold | met? |", "|---|---:|---:|---|"]
    for t in keras["targets"]:
        lines.append(f"| {t['what']} | {t['value']:.3f} | {t['target']} "
                     f"| {'yes' if t['met'] else '**no**'} |")
    return lines + [
        f"| tf-keras+MWMS step / ours-k2 step | {num(keras['k2_speedup_vs_mwms'], three)} | | |",
        f"| ours-k2 step / max(compute, comm) | {num(keras['k2_vs_ideal'], three)} | | |",
        f"| tf-keras+MWMS step / max(compute, comm) (the most K=2 could gain on it) "
        f"| {num(keras['mwms_over_ideal'], three)} | | |", ""]


def _loop_lines(loop, heading):
    """The custom loops' ratios side by side, when both kinds of loop ran."""
    if not any(v is not None for v in loop.values()):
        return []
    rows = [(f"{MWMS_LOOP} step / loop-k2 step", "k2_speedup_vs_mwms_loop"),
            (f"{MWMS_LOOP} step / loop-k1 step", "k1_speedup_vs_mwms_loop"),
            ("loop-k1 step / loop-k2 step", "k2_speedup_vs_k1"),
            ("loop-k2 step / max(compute, comm)", "k2_vs_ideal"),
            ("communication hidden by loop-k2, 1 − exposed wait / comm", "k2_hidden")]
    return [f"{heading}# TensorFlow custom loop: DistributedGradientTape vs "
            "MultiWorkerMirroredStrategy's loop", "",
            "| ratio | measured |", "|---|---:|",
            *(f"| {what} | {report._num(loop[key], '{:.3f}')} |" for what, key in rows), ""]


def write_report(raw_path, out_dir, name):
    with open(raw_path) as f:
        raw = json.load(f)
    summary = report.summarize(raw)
    summary["raw_path"] = os.path.abspath(raw_path)
    keras = keras_summary(raw, summary)
    summary["keras"] = keras
    text = markdown(summary, keras) + "\n" + report.markdown(summary, "##")
    paths = {k: os.path.join(out_dir, f"{name}.{k}") for k in ("md", "json", "png")}
    with open(paths["md"], "w") as f:
        f.write(text)
    with open(paths["json"], "w") as f:
        json.dump(report._jsonable(summary), f, indent=1)
    report.plot([summary], paths["png"])
    return text, paths
