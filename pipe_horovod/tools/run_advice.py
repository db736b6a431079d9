"""Advice from a measured run: `pipe-horovod plan --from-run SUMMARY`.

The summary (pipe_horovod/pipeline/run_record.py: PIPE_HOROVOD_RUN_SUMMARY or
optimizer.write_run_summary) holds what the user's own run measured: per step its
compute and the time it blocked on reductions, per bucket its bytes, launch and
landing, and the configuration (K, codec, bucket cap, workers, buckets). From it:

- the measured step: compute C (median), exposed wait W (median), step C + W;
- the workload as planner.Workload sees it: one step of compute C (the update and
  forward counted in it, at its start), each parameter's gradient ready when its
  bucket was launched (the parameters of a bucket spread evenly since the previous
  bucket's launch: backward makes them one by one);
- the link: the per-byte cost (planner.Network's beta, at --latency's alpha) at which
  planner.predict's row for the measured configuration gives the measured step. With
  nothing exposed (W = 0) that is the largest beta still hidden, so what the advice
  predicts for communication is an upper bound;
- then planner.predict for every candidate (K 1 and 2, each codec, each bucket cap):
  the fastest candidate that meets the convergence rule (CONVERGENCE) is recommended,
  with its predicted gain over the measured step, and every faster one skipped is
  named with the reason. All timing arithmetic is planner's (one model).

Codecs' CPU time is not modelled (as in `plan`: on an accelerator they run beside
backward); every codec is priced at the measured link's rate per wire byte.
"""
import math
import statistics
from dataclasses import dataclass

from pipe_horovod.tools import planner
from pipe_horovod.tools.validators import read_json

FORMAT = "pipe_horovod.run_summary/1"       # pipeline/run_record.py writes it
MIB = planner.MIB

# The convergence rule (docs/convergence.md, "With int4_ef on the engine path"): a codec
# is recommended only where it was measured within the targets (0.02 val loss on the
# transformer tasks, PyTorch and Keras; 0.5 points on the CNN ones). int4_ef's loss falls
# with its block size: blocks of 256 (+0.037) and 64 (+0.025) miss the transformer
# target, 32 (+0.015) meets it. Not measured (fp16, fp8, per-hop int4): not recommended.
CONVERGENCE = {
    "none": None,
    "int8_ef": None,                       # +0.010 (transformer, 3 seeds)
    "int4_ef:32": None,                    # +0.0145 PyTorch, +0.017 Keras
    "int4_ef": "int4_ef at blocks of 256 missed the transformer target (+0.037 val loss "
               "vs 0.02, docs/convergence.md); int4_ef:32 meets it",
}
DEPTHS = (1, 2)                            # K=2 with the default lookahead: +0.012
CAPS_MB = (1, 4, 16, 25, 64)               # bucket caps tried beside the measured buckets


def convergence_failure(codec):
    """None if `codec` (a config name, "int4_ef:32") meets the convergence rule, else why not."""
    if codec in CONVERGENCE:
        return CONVERGENCE[codec]
    base, _, block = codec.partition(":")
    if base == "int4_ef" and block.isdigit():
        if int(block) <= 32:
            return None
        return (f"int4_ef at blocks of {block} missed the transformer target (blocks of 64: "
                f"+0.025 val loss vs 0.02, docs/convergence.md); int4_ef:32 meets it")
    return f"{codec}'s convergence was not measured (docs/convergence.md)"


def wire_ratio(codec, collective=None):
    """Wire bytes per float32 gradient byte of `codec` (a config name): per hop with a
    collective (hop_codecs.wire_ratio), else the engine's allreduce (fp16, bf16) or two
    stages (int8/int4/fp8, one float32 scale per block: planner.two_stage_wire_ratio)."""
    base, _, block = codec.partition(":")
    if base == "none":
        return 1.0
    if base in ("fp16", "bf16"):
        return 0.5
    if collective is not None:
        from pipe_horovod.tools.hop_codecs import PER_HOP, wire_ratio as hop_ratio

        for name, (hop_codec, _) in PER_HOP.items():
            if hop_codec.split("_")[0] == base.split("_")[0]:
                return hop_ratio(name)
    values = planner.TWO_STAGE_VALUE_BYTES.get(base.split("_")[0])
    if values is None:
        raise ValueError(f"run summary: unknown compression {codec!r}")
    return planner.two_stage_wire_ratio(int(block) if block else planner.DEFAULT_BLOCK_SIZE,
                                        values)


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
    wire_ratio(config["compression"], config["collective"])   # a codec this knows


@dataclass(frozen=True)
class Measured:
    """What the run measured, per step (medians over its steady steps)."""

    compute_s: float
    wait_s: float
    launch_s: tuple            # per bucket: launch after the step's compute began
    landed_s: tuple            # per bucket: landing after its launch (when waited for)
    exposed_s: tuple           # per bucket: what waiting for it blocked
    steps: int                 # how many steps the medians are of

    @property
    def step_s(self):
        return self.compute_s + self.wait_s


def measure(summary):
    """Measured from a checked summary. The first two recorded steps (the bucket order
    agreed, buffers allocated) are left out where five or more are recorded."""
    steps = summary["steps"]
    steady = steps[2:] if len(steps) >= 5 else steps
    start = {s["step"]: s["finished_s"] - s["compute_s"] for s in steady}
    n = len(summary["config"]["buckets"])
    launch, landed, exposed = ([[] for _ in range(n)] for _ in range(3))
    for r in summary["reductions"]:
        if r["step"] in start:
            launch[r["bucket"]].append(r["launched_s"] - start[r["step"]])
            if r["landed_s"] is not None:
                landed[r["bucket"]].append(r["landed_s"] - r["launched_s"])
                exposed[r["bucket"]].append(r["wait_s"])

    def median(xs):
        return statistics.median(xs) if xs else math.nan
    return Measured(statistics.median(s["compute_s"] for s in steady),
                    statistics.median(s["wait_s"] for s in steady),
                    tuple(map(median, launch)), tuple(map(median, landed)),
                    tuple(map(median, exposed)), len(steady))


def workloads(summary, measured):
    """(per-parameter Workload, per-bucket Workload): the run's compute, gradients ready
    at their bucket's measured launch (a bucket's parameters spread evenly since the
    previous launch); the second has one gradient per measured bucket."""
    compute = measured.compute_s
    launches, last = [], 0.0
    for t in measured.launch_s:           # ascending, within the step (buckets launch in order)
        last = min(compute, max(last, 0.0 if math.isnan(t) else t))
        launches.append(last)
    params, previous = [], None
    for sizes, at in zip(summary["config"]["buckets"], launches):
        begin = at if previous is None else previous
        params += [(begin + (at - begin) * (i + 1) / len(sizes), n) for i, n in enumerate(sizes)]
        previous = at
    return (planner.Workload(0.0, compute, 0.0, tuple(params)),
            planner.Workload(0.0, compute, 0.0, tuple(
                (at, sum(sizes)) for sizes, at in zip(summary["config"]["buckets"], launches))))


# --------------------------------------------------------------------- advice

AS_MEASURED = planner.Bucketing("cap", 1)   # on the per-bucket workload: the run's own buckets


@dataclass(frozen=True)
class Candidate:
    depth: int
    codec: str
    cap: str                   # "as run" or "N MiB"
    step_s: float
    comm_s: float
    failure: str = None        # why the convergence rule refuses it; None: it meets it


def predict_one(work, workers, network, depth, codec, bucketing):
    """planner.predict's row for one configuration."""
    ratio = wire_ratio(codec)
    prediction = planner.predict(work, workers, network, compressions={codec: (ratio, 0.0)},
                                 bucketing=bucketing)
    mode = "sync" if depth == 1 else "pipelined"
    return prediction.rows[mode if codec == "none" else f"{mode}+{codec}"]


def calibrate(summary, measured, per_bucket, latency_s):
    """The link (planner.Network at alpha = latency_s) whose beta makes predict's row of
    the measured configuration take the measured step: the largest beta that does not
    exceed it (bisection; predicted time grows with beta)."""
    config = summary["config"]
    codec, depth, p = config["compression"], config["pipeline_depth"], config["workers"]
    ratio = wire_ratio(codec, config["collective"])

    def step(beta):
        net = planner.Network(latency_s, beta)
        prediction = planner.predict(per_bucket, p, net, compressions={"run": (ratio, 0.0)},
                                     bucketing=AS_MEASURED)
        return prediction.rows["sync+run" if depth == 1 else "pipelined+run"].step_s

    target = measured.step_s
    if step(0.0) > target * (1 + 1e-9):
        raise ValueError(f"run summary: the latency {latency_s * 1e6:g} us alone predicts a "
                         f"step longer than the measured {target * 1e3:.2f} ms; give a "
                         f"smaller --latency")
    lo, hi = 0.0, 1e-12
    while step(hi) <= target and hi < 1.0:
        lo, hi = hi, hi * 4
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if step(mid) <= target else (lo, mid)
    return planner.Network(latency_s, lo)


def candidates(summary, measured, latency_s=0.0):
    """(network, [Candidate], measured-as-run Candidate): every configuration predicted."""
    config = summary["config"]
    p = config["workers"]
    per_param, per_bucket = workloads(summary, measured)
    network = calibrate(summary, measured, per_bucket, latency_s)
    out = []
    for depth in DEPTHS:
        for codec in CONVERGENCE:
            for cap, work, bucketing in (("as run", per_bucket, AS_MEASURED), *(
                    (f"{mb} MiB", per_param, planner.Bucketing("cap", mb * MIB))
                    for mb in CAPS_MB)):
                row = predict_one(work, p, network, depth, codec, bucketing)
                out.append(Candidate(depth, codec, cap, row.step_s, row.comm_s,
                                     convergence_failure(codec)))
    return network, out


def preference(candidate):
    """The order among candidates: the fastest first; between equal predictions the
    fewer wire bits lost (CONVERGENCE's order, none first), the run's own buckets, then
    the smaller K."""
    codecs = ["none"] + [c for c in CONVERGENCE if c != "none"]
    return (candidate.step_s, codecs.index(candidate.codec), candidate.cap != "as run",
            candidate.depth)


def recommend(all_candidates):
    """(the fastest candidate that meets the convergence rule, the faster ones refused)."""
    ok = [c for c in all_candidates if c.failure is None]
    best = min(ok, key=preference)
    refused = sorted((c for c in all_candidates if c.failure and c.step_s < best.step_s),
                     key=preference)
    return best, refused


def best_per_configuration(all_candidates):
    """Per (K, compression): its fastest bucket size (the table `report` prints)."""
    best = {}
    for c in sorted(all_candidates, key=preference):
        best.setdefault((c.depth, c.codec), c)
    return list(best.values())


def report(summary, latency_s=0.0, path="the run"):
    """The advice as text (what `plan --from-run` prints)."""
    config = summary["config"]
    measured = measure(summary)
    network, every = candidates(summary, measured, latency_s)
    best, refused = recommend(every)
    ratio = wire_ratio(config["compression"], config["collective"])
    costs = [planner.allreduce_time(network, config["workers"], sum(b) * ratio)
             for b in config["buckets"]]
    collective = f", collective={config['collective']}" if config["collective"] else ""
    lines = [
        f"Measured run ({path}): K={config['pipeline_depth']}, compression="
        f"{config['compression']}{collective}, {len(config['buckets'])} buckets (cap "
        f"{config['bucket_cap_bytes'] / MIB:g} MiB), {config['workers']} workers, "
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
    for c in best_per_configuration(refused):
        lines.append(f"Skipped, though predicted faster ({c.step_s * 1e3:.2f} ms, K={c.depth}, "
                     f"{c.codec}, buckets {c.cap}): {c.failure}")
    lines += ["", "Each K and compression at its fastest bucket size:", "",
              "| K | compression | buckets | predicted step ms | comm ms | vs measured | "
              "convergence rule |", "|---:|---|---|---:|---:|---:|---|"]
    for c in best_per_configuration(every):
        lines.append(f"| {c.depth} | {c.codec} | {c.cap} | {c.step_s * 1e3:.2f} | "
                     f"{c.comm_s * 1e3:.2f} | {measured.step_s / c.step_s:.2f}x | "
                     f"{'meets' if c.failure is None else 'fails'} |")
    lines += ["", "Predictions: pipe_horovod/tools/planner.py's model (ring allreduce of the "
                  "wire bytes on the link above; codec CPU time not counted; K=2 with the "
                  "default staleness compensation). Only codecs that met the convergence "
                  "targets in docs/convergence.md are recommended."]
    if config["compression"] != "none":
        lines.append(f"The link was derived from {config['compression']}'s wire bytes: where "
                     f"its codec runs on the CPU beside the communication (CPU workers), its "
                     f"time counts as link time, so the rows with more wire bytes are "
                     f"pessimistic there.")
    return "\n".join(lines)
