"""What each row of `pipe-horovod simulate` sends, and what the planner predicts for it.

A row is a system as it runs: which buckets (Horovod's fusion, our automatic cap), which
K, which collective carries a bucket. The buckets and per-layer times are the planner's
own (the workload the caller gives, commands/plan.workload's: FLOPs over device
throughput, backward twice forward; timing_model.bucketings: the caps the runtime picks), so the simulation and the planner
differ only where the network does: SimGrid shares real links between real flows where
the planner assumes every worker sends at its link's rate.
"""
from __future__ import annotations

from pipe_horovod.collectives import cost_model
from pipe_horovod.pipeline import measured_run, timing_model

def network_of(bandwidth, latency):
    """The planner's network: one link of `bandwidth` per worker, `latency` per message."""
    return cost_model.Network(alpha=latency, beta=1.0 / bandwidth)


def rows(kinds, work, workers, network, bucket_cap_bytes=None):
    """[(kind, engine row spec, planner's timing_model.Row)] of `kinds` for one cluster: each
    kind names the row and says its system ("horovod": fusion, "ours": the automatic cap),
    depth (K), collective (engine.simulate's), codec (a two-stage config name, or "none")
    and planner_algorithm (commands/simulate.py's RowKind)."""
    systems = timing_model.bucketings(bucket_cap_bytes, workers=workers, network=network)
    out = []
    for kind in kinds:
        spec = {"name": kind.name, "depth": kind.depth, "forward_s": work.forward_s,
                "backward_s": work.backward_s, "update_s": work.update_s,
                "buckets": None, "fusion": None, "collective": {"kind": kind.collective}}
        bucketing = systems[kind.system]
        if bucketing.kind == "fusion":
            spec["fusion"] = {"gradients": [list(g) for g in work.gradients],
                              "cap": bucketing.cap_bytes}
        else:
            spec["buckets"] = [list(b) for b in bucketing.buckets(work.gradients, None)]
        compressions = {}
        if kind.codec != "none":
            ratio = measured_run.wire_ratio(kind.codec)
            spec["collective"]["wire_ratio"] = ratio
            compressions = {kind.codec: (ratio, 0.0)}
        if kind.collective == "linear_pipeline":
            spec["collective"]["chunks"] = [
                cost_model.lp_allreduce_chunks(network, workers, n) for _, n in spec["buckets"]]
        prediction = timing_model.predict(work, workers, network, kind.planner_algorithm,
                                          compressions=compressions, pipeline_depth=max(2, kind.depth),
                                          bucketing=bucketing)
        mode = "sync" if kind.depth == 1 else "pipelined"
        name = mode if kind.codec == "none" else f"{mode}+{kind.codec}"
        out.append((kind, spec, prediction.rows[name]))
    return out


# What one route costs SimGrid's full routing zone: 256 ranks' 65,280 routes took 20 MB
# beyond the module's own 42 MB (measured here, SimGrid 3.32), about 300 bytes each.
ROUTE_BYTES = 400


def check_size(workers, memory_bytes):
    """The bytes `workers` ranks' routes need; ValueError with that estimate if it is more
    than half of `memory_bytes`, before anything starts."""
    need = workers * (workers - 1) * ROUTE_BYTES
    if need > memory_bytes / 2:
        raise ValueError(f"a simulation of {workers} ranks needs about {need / 1e9:.1f} GB for "
                         f"its {workers * (workers - 1):,} routes, more than half of this "
                         f"machine's {memory_bytes / 1e9:.1f} GB; simulate fewer workers")
    return need
