"""`pipe-horovod bench-collectives`' report: bus bandwidth, the model's prediction, targets.

From the worker's raw JSON (`pipe_horovod.tools.bench.collectives_worker`):
each repetition's time is the slowest rank's (the allreduce is done when
every rank has its result), each figure the median over repetitions.
Bandwidths follow nccl-tests' allreduce definitions: algbw = bytes / time,
busbw = algbw * 2(p-1)/p, comparable with the link's rate whatever p is.
The prediction is `pipe_horovod.pipeline.timing_model.allreduce_time` of the algorithm
(the engine's own allreduce as "ring") for the bytes on the wire, plus
`timing_model.hop_codec_time` for a per-hop codec (its encode/add/decode cost
measured by the workers at several block sizes, the part on the critical
path), our collectives' per-message software cost (measured by the workers,
timing_model.with_message_cost) added to alpha, with alpha and beta fitted (`planner.fit`, ring
formula) to the engine's own allreduce at the sizes >= 1 MB, all for the emulated cluster's
topology (launch.topology, star where absent): on a chain lp's links carry one stream each
way, and mst and be have no prediction (timing_model.MODELLED). With the worker's `unmatched/none`
(plain torch.distributed all_reduce, --unmatched; no prediction), a table of what the
engine's name-matched allreduce costs per collective beyond it (`name_matching`: both
medians, their difference and ratio), one at a time and IN_FLIGHT at once. Outputs:
markdown (printed and saved), a JSON summary, a PNG of bus bandwidth against size (log x).
"""
import json

from pipe_horovod.collectives import cost_model
from pipe_horovod.pipeline import timing_model
from pipe_horovod.tools import planner
from pipe_horovod.tools.bench.collectives_worker import FORMAT, IN_FLIGHT, NATIVE, TWO_STAGES, \
    UNMATCHED, in_flight
from pipe_horovod.tools.bench.report import _median, _num, _pct, _quartiles, save_outputs

LARGE_BYTES = 16 * 2**20      # the "at >= 16 MB"
MODEL_BYTES = 2**20           # the "prediction within 15% at >= 1 MB"
CODEC_BYTES = 64 * 2**20      # the "64 MB float32 tensor"
# --unmatched's configurations: yardsticks for the engine's own overhead, not modelled
YARDSTICKS = (UNMATCHED, in_flight(NATIVE), in_flight(UNMATCHED))


def size_label(nbytes):
    """4 KB, 1 MB, 64 MB: binary units, as the sizes are powers of two."""
    for unit, scale in (("MB", 2**20), ("KB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def bus_bandwidth(nbytes, seconds, p):
    """nccl-tests' allreduce busbw in bytes/s: (nbytes / seconds) * 2(p-1)/p."""
    return nbytes / seconds * 2 * (p - 1) / p


def wire_bytes(nbytes, codec, algorithm=None):
    """Bytes an uncompressed float32 message of `nbytes` puts on the wire under `codec`
    (in the two-stage reduction: one byte per value plus a float32 scale per block)."""
    if algorithm in TWO_STAGES:
        return nbytes * timing_model.two_stage_wire_ratio()
    return nbytes * (1.0 if codec == "none" else timing_model.DEFAULT_COMPRESSIONS[codec][0])


def blocks(p, nbytes, algorithm, codec):
    """How many blocks pipe_horovod.collectives cuts a float32 message of `nbytes` into
    under `codec` (its own layout: LP's chunks, ring's pieces, BE's q blocks)."""
    from pipe_horovod import collectives

    numel, wire = max(1, nbytes // 4), int(wire_bytes(nbytes, codec))
    spec = collectives.Collective(algorithm)
    return len(spec.module.blocks("allreduce", numel, p, wire, spec))


def predicted_seconds(network, p, nbytes, config, codec_costs=None, message_s=None,
                      topology="star"):
    """planner's cost of `config` ("algorithm/codec") for a float32 message of `nbytes`:
    the bytes on the wire, for our collectives with each message's software cost
    `message_s` (timing_model.with_message_cost), plus the per-hop codec's CPU on the critical
    path (timing_model.hop_codec_time) where `codec_costs` has the codec's measured (encode,
    decode-add, decode) s per byte, one triple or {block bytes: triple}. None where
    the planner does not model the algorithm on `topology`."""
    algorithm, codec = config.split("/")
    if algorithm in TWO_STAGES:    # an alltoall + an allgather at the fitted rates
        return timing_model.two_stage_allreduce(network, p, nbytes) if topology == "star" else None
    wire = wire_bytes(nbytes, codec)
    if algorithm == NATIVE:
        return timing_model.allreduce_time(network, p, wire, "ring", topology)
    if algorithm in YARDSTICKS:
        return None
    if algorithm not in timing_model.MODELLED[topology]:
        return None
    net = timing_model.with_message_cost(network, message_s or 0.0)
    # lp: the chunks the collective cut, which it picks for a star whatever the wiring
    count = blocks(p, nbytes, algorithm, codec)
    if algorithm == "lp":
        seconds = timing_model.allreduce_time(net, p, wire, "lp", topology, chunks=count)
    else:
        seconds = timing_model.allreduce_time(net, p, wire, algorithm, topology)
    costs = (codec_costs or {}).get(codec)
    if not costs:
        return seconds
    per_block = isinstance(costs, dict)
    return seconds + timing_model.hop_codec_time(p, nbytes, algorithm, costs,
                                           count if per_block else None)


def _slowest_rank(per_rank, config, size):
    return [max(reps) for reps in zip(*(r[config][size] for r in per_rank))]


def _fit(sizes, native, p):
    """The network fitted to the engine's own allreduce at >= 1 MB (the sizes the
    prediction target is about: Horovod's small-message latency does not follow
    alpha + n*beta and pulled a 4-worker fit to alpha 5.3 ms), or at every size
    where fewer than two are that large; None if it cannot be fitted."""
    points = [(s, t) for s, t in zip(sizes, native) if t]
    large = [(s, t) for s, t in points if s >= MODEL_BYTES]
    if len({s for s, _ in large}) >= 2:
        points, which = large, ">= 1 MB"
    else:
        which = "all"
    if p < 2 or len({s for s, _ in points}) < 2:
        return None
    fit = planner.fit([s for s, _ in points], [t for _, t in points], p, "ring")
    return {"alpha_s": fit.alpha, "beta_s_per_byte": fit.beta, "r2": fit.r2,
            "source": f"planner.fit (ring formula, relative error) of the engine's own "
                      f"allreduce at {len(points)} sizes ({which})"}


def summarize(raw):
    meta, p = raw["meta"], raw["meta"]["workers"]
    rate = raw.get("launch", {}).get("emulate")
    topology = raw.get("launch", {}).get("topology") or "star"
    link_bytes_per_s = planner.parse_bandwidth(rate) if rate else None
    sizes = meta["sizes"]
    rows = []
    for config in meta["configs"]:
        algorithm, codec = config.split("/")
        for nbytes in sizes:
            reps = _slowest_rank(raw["times"], config, str(nbytes))
            seconds = _median(reps)
            rows.append({"config": config, "algorithm": algorithm, "codec": codec,
                         "bytes": nbytes, "time_s": seconds, "time_iqr_s": _quartiles(reps),
                         "reps_s": reps, "algbw_bytes_per_s": nbytes / seconds,
                         "busbw_bytes_per_s": bus_bandwidth(nbytes, seconds, p)})
    native = [r["time_s"] for r in rows if r["algorithm"] == NATIVE]
    network = _fit(sizes, native, p)
    for r in rows:
        r["predicted_s"] = r["prediction_error"] = None
        if network is not None:
            net = cost_model.Network(network["alpha_s"], network["beta_s_per_byte"])
            costs = (meta.get("codec_costs_s_per_byte_by_block")
                     or meta.get("codec_costs_s_per_byte"))
            r["predicted_s"] = predicted_seconds(net, p, r["bytes"], r["config"], costs,
                                                 meta.get("message_s"), topology)
            if r["predicted_s"] is not None:
                r["prediction_error"] = abs(r["predicted_s"] - r["time_s"]) / r["time_s"]
    summary = {"meta": meta, "launch": raw.get("launch", {}), "topology": topology,
               "network": network, "link_bytes_per_s": link_bytes_per_s, "rows": rows,
               "name_matching": name_matching(rows, sizes)}
    summary["targets"] = targets(summary)
    return summary


def name_matching(rows, sizes):
    """Per size, the engine's allreduce (`native/none`, matched by name) against plain
    torch.distributed all_reduce (`unmatched/none`): both medians per collective, the
    overhead (their difference) and the ratio; the same IN_FLIGHT at once under
    "in_flight" where measured. [] without `unmatched/none`."""
    def compare(matched, plain):
        if matched is None or plain is None:
            return None
        return {"plain_s": plain["time_s"], "matched_s": matched["time_s"],
                "overhead_s": matched["time_s"] - plain["time_s"],
                "ratio": matched["time_s"] / plain["time_s"]}

    out = []
    for nbytes in sizes:
        alone = compare(_at(rows, f"{NATIVE}/none", nbytes), _at(rows, f"{UNMATCHED}/none",
                                                                   nbytes))
        if alone is None:
            continue
        out.append({"bytes": nbytes, **alone, "in_flight": compare(
            _at(rows, f"{in_flight(NATIVE)}/none", nbytes),
            _at(rows, f"{in_flight(UNMATCHED)}/none", nbytes))})
    return out


def _at(rows, config, nbytes):
    return next((r for r in rows if r["config"] == config and r["bytes"] == nbytes), None)


def targets(summary):
    """The issue's targets, each with the measured figure and met / not met (None: not
    measurable in this run)."""
    rows, p = summary["rows"], summary["meta"]["workers"]
    sizes = summary["meta"]["sizes"]
    large = [s for s in sizes if s >= LARGE_BYTES]
    out = []

    def add(what, value, ok, note=""):
        out.append({"target": what, "value": value, "met": ok, "note": note})

    def worst(values, pick):
        values = [v for v in values if v is not None]
        return pick(values) if values else None

    link = summary["link_bytes_per_s"]
    lp_busbw = [r["busbw_bytes_per_s"] for r in rows if r["config"] == "lp/none"
                and r["bytes"] in large]
    if link and lp_busbw:
        value = min(lp_busbw) / link
        add("lp busbw / link rate at >= 16 MB (worst size) >= 0.85", value, value >= 0.85)
    ratios = [_ratio(rows, "lp/none", f"{NATIVE}/none", s) for s in large]
    value = worst(ratios, max)
    if value is not None:
        add("lp time / engine's allreduce time at >= 16 MB (worst size) <= 1.10", value,
            value <= 1.10)
    if p >= 4:
        value = worst([_ratio(rows, "mst/none", "lp/none", s) for s in large], min)
        if value is not None:
            add(f"mst time / lp time at >= 16 MB, {p} workers (worst size) >= 1.5", value,
                value >= 1.5)
    codec_size = CODEC_BYTES if CODEC_BYTES in sizes else large[-1] if large else None
    note = "" if codec_size in (None, CODEC_BYTES) else f"at {size_label(codec_size)}, not 64 MB"
    for codec, bound in (("int8", 3.0), ("bf16", 1.8)) if codec_size else ():
        for algorithm in ("ring", "lp"):
            value = _ratio(rows, f"{algorithm}/none", f"{algorithm}/{codec}", codec_size)
            if value is not None:
                add(f"{algorithm}/none time / {algorithm}/{codec} time >= {bound}", value,
                    value >= bound, note)
    for config in summary["meta"]["configs"]:
        if config.split("/")[0] in TWO_STAGES and codec_size:
            value = _ratio(rows, f"{NATIVE}/none", config, codec_size)
            if value is not None:
                add(f"{NATIVE}/none time / {config} time >= 3.0", value, value >= 3.0, note)
    for config in summary["meta"]["configs"]:
        errors = [r["prediction_error"] for r in rows if r["config"] == config
                  and r["bytes"] >= MODEL_BYTES]
        value = worst(errors, max)
        if value is not None:
            add(f"{config}: largest prediction error at >= 1 MB <= 15%", value, value <= 0.15)
    return out


def _ratio(rows, num, den, nbytes):
    a, b = _at(rows, num, nbytes), _at(rows, den, nbytes)
    return a["time_s"] / b["time_s"] if a and b else None


# ------------------------------------------------------------------- markdown

def title(summary):
    meta = summary["meta"]
    link = summary["launch"].get("emulate")
    where = (f"emulated {link} links, {summary['topology']}" if link
             else "local launch (loopback)")
    return (f"allreduce bus bandwidth: engine {meta['engine']}, {meta['workers']} workers, "
            f"{where}, float32, median of {meta['reps']} interleaved repetitions")


def _mbps(x):
    return "–" if x is None else f"{x / 1e6:.1f}"


def markdown(summary, heading="#"):
    meta, rows = summary["meta"], summary["rows"]
    configs, sizes = meta["configs"], meta["sizes"]
    lines = [f"{heading} {title(summary)}", ""]
    if summary["launch"].get("command"):
        lines += ["```", summary["launch"]["command"], "```", ""]
    lines += [f"busbw (MB/s) = bytes / time × 2(p−1)/p; `{NATIVE}/none` is the engine's own "
              f"allreduce; codecs are per hop, except in `{TWO_STAGES[0]}/…` (the two-stage "
              f"quantized allreduce on the engine's collectives: once per stage) and "
              f"`{TWO_STAGES[1]}/…` (the same, point to point).", ""]
    lines.append("| size | " + " | ".join(f"`{c}`" for c in configs) + " |")
    lines.append("|---" * (len(configs) + 1) + "|")
    for nbytes in sizes:
        lines.append(f"| {size_label(nbytes)} | " + " | ".join(
            _mbps(_at(rows, c, nbytes)["busbw_bytes_per_s"]) for c in configs) + " |")
    lines += ["", "Time (ms), measured / predicted (error):", ""]
    lines.append("| size | " + " | ".join(f"`{c}`" for c in configs) + " |")
    lines.append("|---" * (len(configs) + 1) + "|")
    for nbytes in sizes:
        cells = []
        for c in configs:
            r = _at(rows, c, nbytes)
            cell = f"{r['time_s'] * 1e3:.3g}"
            if r["predicted_s"] is not None:
                cell += f" / {r['predicted_s'] * 1e3:.3g} ({_pct(r['prediction_error'])})"
            cells.append(cell)
        lines.append(f"| {size_label(nbytes)} | " + " | ".join(cells) + " |")
    lines.append("")
    lines += speedup_table(summary)
    net = summary["network"]
    if net:
        rate = 1 / net["beta_s_per_byte"] / 1e6 if net["beta_s_per_byte"] else None
        lines.append(f"- model: alpha {net['alpha_s'] * 1e6:.0f} us, 1/beta "
                     f"{_num(rate, '{:.1f}')} MB/s ({net['source']}, R² {net['r2']:.3f})")
    unmodelled = sorted({r["algorithm"] for r in rows
                         if r["algorithm"] not in (NATIVE, *TWO_STAGES)
                         and r["algorithm"] not in YARDSTICKS
                         and r["algorithm"] not in timing_model.MODELLED[summary["topology"]]})
    if unmodelled:
        lines.append(f"- no prediction for {', '.join(unmodelled)} on a "
                     f"{summary['topology']}: not modelled (their exchanges between "
                     "non-neighbours share links)")
    if meta.get("message_s") is not None:
        lines.append(f"- our collectives' per-message cost (half a small round trip, "
                     f"measured): {meta['message_s'] * 1e6:.0f} us, added to alpha")
    if summary["link_bytes_per_s"]:
        lines.append(f"- link rate: {summary['link_bytes_per_s'] / 1e6:.1f} MB/s per direction")
    for key, what in (("machine_busy_cores", "while measuring (every process)"),
                      ("background_busy_cores", "from everything else (all workers asleep "
                                                "before each size)")):
        busy = [v for v in (meta.get(key) or {}).values() if v is not None]
        if busy:
            lines.append(f"- machine load {what}: {min(busy):.2f}–{max(busy):.2f} of "
                         f"{meta['cpu_count']} cores busy")
    if summary.get("name_matching"):
        lines += ["", *name_matching_table(summary["name_matching"])]
    lines += ["", "| target | measured | met |", "|---|---:|---|"]
    for t in summary["targets"]:
        met = "yes" if t["met"] else "**no**"
        lines.append(f"| {t['target']}{' (' + t['note'] + ')' if t['note'] else ''} | "
                     f"{_num(t['value'])} | {met} |")
    lines.append("")
    return "\n".join(lines)


def speedup_table(summary):
    """Markdown lines: each configuration's speed-up over the engine's own allreduce
    (`native/none` median time / the configuration's), per size."""
    meta, rows = summary["meta"], summary["rows"]
    others = [c for c in meta["configs"] if c != f"{NATIVE}/none"]
    if not others:
        return []
    lines = [f"Speed-up over the engine's own allreduce (`{NATIVE}/none` time / time; "
             "> 1 is faster):", "",
             "| size | " + " | ".join(f"`{c}`" for c in others) + " |",
             "|---" + "|---:" * len(others) + "|"]
    for nbytes in meta["sizes"]:
        cells = [_num(_ratio(rows, f"{NATIVE}/none", c, nbytes), "{:.2f}x") for c in others]
        lines.append(f"| {size_label(nbytes)} | " + " | ".join(cells) + " |")
    return lines + [""]


def name_matching_table(matching):
    """Markdown lines: what name matching costs per collective (summary's name_matching)."""
    def cells(m):
        if m is None:
            return "– | – | – | –"
        return (f"{m['plain_s'] * 1e6:.0f} | {m['matched_s'] * 1e6:.0f} | "
                f"{m['overhead_s'] * 1e6:+.0f} | {m['ratio']:.2f}x")

    head = "plain (us) | matched (us) | overhead (us) | ratio"
    lines = [f"Cost of name matching per collective: `{NATIVE}/none` (the engine's allreduce, "
             f"matched by name) against `{UNMATCHED}/none` (plain torch.distributed "
             "all_reduce of the same tensor, then the same division), median per "
             f"collective; then the same with {IN_FLIGHT} started at once, then waited for "
             f"(`{in_flight(NATIVE)}`, `{in_flight(UNMATCHED)}`; time per collective):", "",
             f"| size | one at a time: {head} | {IN_FLIGHT} in flight: {head} |",
             "|---|" + "---:|" * 8]
    for m in matching:
        lines.append(f"| {size_label(m['bytes'])} | {cells(m)} | {cells(m.get('in_flight'))} |")
    return lines


# ------------------------------------------------------------------------ plot

def plot(summary, path):
    """busbw against size, one line per algorithm/codec (colour: algorithm; style: codec)."""
    from pipe_horovod.tools.plotting import pyplot

    plt = pyplot()

    colours = {NATIVE: "black", UNMATCHED: "#937860", in_flight(NATIVE): "#666666",
               in_flight(UNMATCHED): "#da8bc3", "lp": "#c44e52", "ring": "#4c72b0",
               "mst": "#55a868", "be": "#8172b2", TWO_STAGES[0]: "#dd8452",
               TWO_STAGES[1]: "#937860"}
    styles = {"none": "-", "bf16": "--", "int8": ":", "fp8_e4m3": "-.", "fp8_e5m2": "-."}
    fig, ax = plt.subplots(figsize=(10, 6))
    for config in summary["meta"]["configs"]:
        rows = [r for r in summary["rows"] if r["config"] == config]
        algorithm, codec = config.split("/")
        ax.plot([r["bytes"] for r in rows], [r["busbw_bytes_per_s"] / 1e6 for r in rows],
                color=colours[algorithm], linestyle=styles[codec], marker="o", markersize=3,
                label=config)
    if summary["link_bytes_per_s"]:
        ax.axhline(summary["link_bytes_per_s"] / 1e6, color="grey", linewidth=0.8,
                   label="link rate")
    ax.set_xscale("log", base=2)
    ticks = summary["meta"]["sizes"]
    ax.set_xticks(ticks)
    ax.set_xticklabels([size_label(s) for s in ticks], rotation=30)
    ax.set_xlabel("message size (float32)")
    ax.set_ylabel("bus bandwidth of the float32 message (MB/s)")
    ax.set_title(title(summary), fontsize=9)
    ax.legend(fontsize=7, ncol=2, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------ files

def write_report(raw_path, out_dir, name):
    """Reads the raw JSON, writes <name>.md, <name>.json, <name>.png; returns (markdown, paths)."""
    with open(raw_path) as f:
        raw = json.load(f)
    if raw.get("format") != FORMAT:
        raise ValueError(f"{raw_path} is not a bench-collectives result")
    summary = summarize(raw)
    text = markdown(summary)
    paths = save_outputs(out_dir, name, text, summary)
    plot(summary, paths["png"])
    return text, paths
