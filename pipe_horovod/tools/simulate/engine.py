"""The SimGrid run: a platform built in code, one step schedule per row, on s4u actors.

Runs in its own process (`python -m pipe_horovod.tools.simulate.engine`, a JSON spec on
stdin, the results as JSON on stdout): SimGrid keeps one engine per process, and a
simulation that dies must not take the command with it. `run` starts that process.

The platform: every rank a host, every link split-duplex (full duplex: each direction
its own capacity), every route listed (a full routing zone), so the flows of a round
share the links they cross by SimGrid's max-min fair flow-level model. Network models:
"cm02" (SimGrid's CM02 without cross-traffic: links at their bandwidth and latency as
given, so on a star a lone flow takes exactly latency + bytes / bandwidth, the planner's
alpha + n beta) and "lv08" (SimGrid's default: TCP's calibration, latency x 13.01,
bandwidth x 0.97, and acknowledgements sharing the reverse direction).

A row's step, as the workers run it, all ranks in lockstep (same compute everywhere):
a compute actor does forward (F), then backward (B), releasing its gradients at their
ready times, then waits for the reductions that step's update needs (K=1: its own step's;
K=2: the previous step's) and updates (U). A link actor, the background thread every rank
has, takes the step's buckets in order, each no earlier than it is ready (Horovod's
fusion: when the link frees, everything ready by then, up to its threshold) and runs its
collective's rounds (collectives.py) as flows between the hosts. The step time is the
mean spacing of the last steps' starts, after the pipeline has filled.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from pipe_horovod.tools.simulate import collectives
from pipe_horovod.tools.simulate.topology import parse_topology, placement

NETWORK_MODELS = {
    "cm02": ("--cfg=network/model:CM02", "--cfg=network/crosstraffic:0"),
    "lv08": ("--cfg=network/model:LV08",),
}
HOST_SPEED = 1e12           # flop/s; compute is slept, never executed


def run(spec, timeout=None):
    """The results of `spec` (see simulate) from a fresh process: JSON in and out."""
    proc = subprocess.run([sys.executable, "-m", "pipe_horovod.tools.simulate.engine"],
                          input=json.dumps(spec), capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"the SimGrid run failed (exit {proc.returncode}):\n"
                           f"{proc.stderr.strip()[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _platform(simgrid, spec):
    """(engine, hosts) of spec's topology, one host per rank."""
    topology = parse_topology(spec["topology"])
    p, bandwidth, latency = spec["workers"], spec["bandwidth"], spec["latency"]
    engine = simgrid.Engine(["pipe-horovod-simulate", *NETWORK_MODELS[spec["network_model"]],
                             "--log=root.thres:critical", "--cfg=contexts/factory:thread"])
    zone = simgrid.NetZone.create_full_zone("cluster")
    hosts = [zone.create_host(f"rank{r}", HOST_SPEED) for r in range(p)]
    up, down = simgrid.LinkInRoute.Direction.UP, simgrid.LinkInRoute.Direction.DOWN

    def link(name, rate, delay):
        return zone.create_split_duplex_link(name, rate).set_latency(delay)

    if topology.kind == "nodes":
        own = [link(f"gpu{r}", spec["intra_bandwidth"], spec["intra_latency"] / 2)
               for r in range(p)]
        groups = [link(f"nic{g}", bandwidth, latency / 2)
                  for g in range((p + topology.group - 1) // topology.group)]
    else:
        own = [link(f"host{r}", bandwidth, latency / 2) for r in range(p)]
        groups = []
        if topology.kind == "fattree":
            for g in range((p + topology.group - 1) // topology.group):
                in_rack = min(topology.group, p - g * topology.group)
                groups.append(link(f"rack{g}", in_rack * bandwidth / topology.ratio, 0.0))
    for a in range(p):
        for b in range(p):
            if a == b:
                continue
            ga, gb = topology.group_of(a), topology.group_of(b)
            if topology.kind == "nodes" and ga != gb:
                path = [(groups[ga], up), (groups[gb], down)]
            elif topology.kind == "fattree" and ga != gb:
                path = [(own[a], up), (groups[ga], up), (groups[gb], down), (own[b], down)]
            else:
                path = [(own[a], up), (own[b], down)]
            zone.add_route(hosts[a].netpoint, hosts[b].netpoint, None, None,
                           [simgrid.LinkInRoute(lk, d) for lk, d in path], False)
    zone.seal()
    return engine, hosts


def simulate(spec):
    """Run `spec` in this process (once per process: SimGrid's engine is a singleton).

    spec: topology (a spec string), placement (topology.placement's; default packed),
    workers, bandwidth (bytes/s), latency (s),
    intra_bandwidth, intra_latency (nodes), network_model, every_round, steps, and
      probes: [[[repeat, [[src, dst, bytes], ...]], ...], ...]: rounds timed alone;
      rows: [{name, depth, forward_s, backward_s, update_s,
              buckets: [[ready_s, nbytes], ...] or None,
              fusion: {gradients: [[ready_s, nbytes], ...], cap: bytes} or None,
              collective: {kind: ring | hierarchical | two_stage | linear_pipeline,
                           wire_ratio (two_stage), chunks: [per bucket] (linear_pipeline)}}].
    Returns {"probes": [seconds, ...], "rows": {name: {step_s, comm_s, steps: [...]}},
    "flows": flows started}."""
    import simgrid

    engine, hosts = _platform(simgrid, spec)
    topology = parse_topology(spec["topology"])
    at = placement(topology, spec["workers"], spec.get("placement", "packed"))
    ranks = list(range(spec["workers"]))
    every_round = bool(spec.get("every_round"))
    out = {"probes": [], "rows": {}, "flows": 0}
    memo = {}

    def run_rounds(rounds):
        start = engine.clock
        for r in rounds:
            times = r.repeat if every_round else 1
            for _ in range(times):
                t0 = engine.clock
                comms = [simgrid.Comm.sendto_async(hosts[at[s]], hosts[at[d]], max(1, round(b)))
                         for s, d, b in r.flows]
                simgrid.Comm.wait_all(comms)
                out["flows"] += len(comms)
            if r.repeat > times:
                simgrid.this_actor.sleep_for((r.repeat - times) * (engine.clock - t0))
        return engine.clock - start

    def collective(how, nbytes, index):
        kind = how["kind"]
        chunks = how["chunks"][index] if kind == "linear_pipeline" else None
        key = (kind, nbytes, how.get("wire_ratio"), chunks)
        if not every_round and key in memo:     # the same rounds alone on the network again
            simgrid.this_actor.sleep_for(memo[key])
            return memo[key]
        if kind == "ring":
            rounds = collectives.ring(ranks, nbytes)
        elif kind == "hierarchical":
            rounds = collectives.hierarchical(ranks, topology.group, nbytes)
        elif kind == "two_stage":
            rounds = collectives.two_stage(ranks, nbytes * how["wire_ratio"])
        elif kind == "linear_pipeline":
            rounds = collectives.linear_pipeline(ranks, nbytes, chunks)
        else:
            raise ValueError(f"unknown collective {kind!r}")
        memo[key] = run_rounds(rounds)
        return memo[key]

    def row_actors(row):
        steps, depth = spec["steps"], row["depth"]
        backward_at, starts, busy = [], [], []
        began, landed = simgrid.Semaphore(0), simgrid.Semaphore(0)

        def compute():
            for t in range(steps):
                starts.append(engine.clock)
                simgrid.this_actor.sleep_for(row["forward_s"])
                backward_at.append(engine.clock)
                began.release()
                simgrid.this_actor.sleep_for(row["backward_s"])
                if t - depth + 1 >= 0:
                    landed.acquire()
                simgrid.this_actor.sleep_for(row["update_s"])
            starts.append(engine.clock)

        def link():
            for t in range(steps):
                began.acquire()
                b, seconds = backward_at[t], 0.0
                if row.get("fusion"):
                    pending = [(b + r, n) for r, n in row["fusion"]["gradients"]]
                    i = 0
                    while i < len(pending):
                        start = max(engine.clock, pending[i][0])
                        simgrid.this_actor.sleep_until(start)
                        used = 0.0
                        while i < len(pending) and pending[i][0] <= start and (
                                not used or used + pending[i][1] <= row["fusion"]["cap"]):
                            used += pending[i][1]
                            i += 1
                        seconds += collective(row["collective"], used, 0)
                else:
                    for index, (r, n) in enumerate(row["buckets"]):
                        simgrid.this_actor.sleep_until(max(engine.clock, b + r))
                        seconds += collective(row["collective"], n, index)
                busy.append(seconds)
                landed.release()

        return compute, link, starts, busy

    def main():
        for probe in spec.get("probes", []):
            out["probes"].append(run_rounds(
                [collectives.Round(int(rep), tuple(tuple(f) for f in flows))
                 for rep, flows in probe]))
        for row in spec.get("rows", []):
            compute, link, starts, busy = row_actors(row)
            actors = [simgrid.Actor.create(f"{row['name']}-compute", hosts[0], compute),
                      simgrid.Actor.create(f"{row['name']}-link", hosts[0], link)]
            for actor in actors:
                actor.join()
            spacing = [b - a for a, b in zip(starts, starts[1:])]
            tail = spacing[len(spacing) // 2:]
            out["rows"][row["name"]] = {"step_s": sum(tail) / len(tail), "steps": spacing,
                                        "comm_s": busy[-1]}

    simgrid.Actor.create("main", hosts[0], main)
    engine.run()
    return out


if __name__ == "__main__":
    print(json.dumps(simulate(json.loads(sys.stdin.read()))))
