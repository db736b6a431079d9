"""What a measured run predicts: its medians, its workload, the link that reproduces it,
every candidate configuration's step, and the one recommended.

The input is a run summary (pipeline/run_record.py's RunRecord.summary(), which the step
machine keeps as it trains). From it:

- the measured step: compute C (median), exposed wait W (median), step C + W;
- the workload as timing_model.Workload sees it: one step of compute C (the update and
  forward counted in it, at its start), each parameter's gradient ready when its
  bucket was launched (the parameters of a bucket spread evenly since the previous
  bucket's launch: backward makes them one by one);
- the link: the per-byte cost (Network's beta, at a given latency alpha) at which
  timing_model.predict's row for the measured configuration gives the measured step.
  With nothing exposed (W = 0) that is the largest beta still hidden, so what is
  predicted for communication is an upper bound;
- then timing_model.predict for every candidate (K, codec, bucket cap): the fastest
  candidate that meets the convergence rule (pipeline/convergence_rule.py) is
  recommended, and every faster one refused is named with the reason.

It is the runtime's because a run that tunes itself (pipeline/auto.py) decides with it
while it trains; `pipe-horovod plan --from-run` (tools/run_advice.py) prints the same
candidates and recommendation, so the advice and the choice come from one model. Codecs'
CPU time is not modelled (on an accelerator they run beside backward); every codec is
priced at the measured link's rate per wire byte.
"""
import math
import statistics
from dataclasses import dataclass

from ..collectives.cost_model import Network
from ..compression import DEFAULT_BLOCK_SIZE
from .convergence_rule import CAPS_MB, CONVERGENCE, DEPTHS, convergence_failure
from .timing_model import (MIB, TWO_STAGE_VALUE_BYTES, Bucketing, Workload, predict,
                           two_stage_wire_ratio)


def wire_ratio(codec):
    """Wire bytes per float32 gradient byte of `codec` (a config name) on the engine's path
    (no collective=): the engine's allreduce (fp16, bf16) or two stages (int8/int4/fp8,
    one float32 scale per block: timing_model.two_stage_wire_ratio). A per-hop
    collective's ratio is the toolbox's (tools/run_advice.py path_wire_ratio)."""
    base, _, block = codec.partition(":")
    if base == "none":
        return 1.0
    if base in ("fp16", "bf16"):
        return 0.5
    values = TWO_STAGE_VALUE_BYTES.get(base.split("_")[0])
    if values is None:
        raise ValueError(f"run summary: unknown compression {codec!r}")
    return two_stage_wire_ratio(int(block) if block else DEFAULT_BLOCK_SIZE, values)


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
    return (Workload(0.0, compute, 0.0, tuple(params)),
            Workload(0.0, compute, 0.0, tuple(
                (at, sum(sizes)) for sizes, at in zip(summary["config"]["buckets"], launches))))


# --------------------------------------------------------------------- advice

AS_MEASURED = Bucketing("cap", 1)   # on the per-bucket workload: the run's own buckets


@dataclass(frozen=True)
class Candidate:
    depth: int
    codec: str
    cap: str                   # "as run" or "N MiB"
    step_s: float
    comm_s: float
    failure: str = None        # why the convergence rule refuses it; None: it meets it
    cap_mb: float = None       # the cap in MiB; None: the run's own buckets ("as run")


def predict_one(work, workers, network, depth, codec, bucketing, exchange=None):
    """predict's row for one configuration; `exchange`: the prediction exchange a
    pipelined step also sends ("int4", "int8"; timing_model.predict's)."""
    ratio = wire_ratio(codec)
    prediction = predict(work, workers, network, compressions={codec: (ratio, 0.0)},
                         bucketing=bucketing, exchange=exchange)
    mode = "sync" if depth == 1 else "pipelined"
    return prediction.rows[mode if codec == "none" else f"{mode}+{codec}"]


def calibrate(summary, measured, per_bucket, latency_s, ratio=None):
    """The link (Network at alpha = latency_s) whose beta makes predict's row of
    the measured configuration take the measured step: the largest beta that does not
    exceed it (bisection; predicted time grows with beta). `ratio`: the wire bytes per
    gradient byte of the run's codec on its path; None: wire_ratio's (the engine's path,
    so a run with a codec per hop on a collective must pass its own)."""
    config = summary["config"]
    codec, depth, p = config["compression"], config["pipeline_depth"], config["workers"]
    if ratio is None:
        if config["collective"] is not None and codec != "none":
            raise ValueError(f"run summary: {codec} per hop on collective "
                             f"{config['collective']!r}: pass its wire ratio")
        ratio = wire_ratio(codec)

    def step(beta):
        net = Network(latency_s, beta)
        prediction = predict(per_bucket, p, net, compressions={"run": (ratio, 0.0)},
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
    return Network(latency_s, lo)


def candidates(summary, measured, latency_s=0.0, ratio=None, depths=DEPTHS,
               codecs=tuple(CONVERGENCE), caps_mb=CAPS_MB, exchange=None):
    """(network, [Candidate]): every configuration predicted, K in `depths`, each codec
    of `codecs` (config names), the run's own buckets and each cap of `caps_mb` (a run
    that tunes itself narrows them to what the user pinned). `ratio`: calibrate's.
    `exchange`: the prediction exchange K >= 2 adds on the wire where the adapter's
    compensation sends one (the Keras default's int4); None: none."""
    config = summary["config"]
    p = config["workers"]
    per_param, per_bucket = workloads(summary, measured)
    network = calibrate(summary, measured, per_bucket, latency_s, ratio)
    out = []
    for depth in depths:
        for codec in codecs:
            for cap, mb, work, bucketing in (("as run", None, per_bucket, AS_MEASURED), *(
                    (f"{mb:g} MiB", mb, per_param, Bucketing("cap", mb * MIB))
                    for mb in caps_mb)):
                row = predict_one(work, p, network, depth, codec, bucketing, exchange)
                out.append(Candidate(depth, codec, cap, row.step_s, row.comm_s,
                                     convergence_failure(codec), mb))
    return network, out


def preference(candidate):
    """The order among candidates: the fastest first; between equal predictions the
    fewer wire bits lost (CONVERGENCE's order, none first), the run's own buckets, then
    the smaller K."""
    codecs = ["none"] + [c for c in CONVERGENCE if c != "none"]
    rank = codecs.index(candidate.codec) if candidate.codec in codecs else len(codecs)
    return (candidate.step_s, rank, candidate.cap != "as run", candidate.depth)


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
