"""Topologies a simulation runs on, parsed from a spec such as "fattree:4".

Rank r runs on host r. Every path's end-to-end latency is the cluster's per-message
latency (the planner's alpha), so a difference from the planner comes from bandwidth
sharing, not from counting switch hops; NVLink-class paths inside a node have their own.

- "star": full bisection, every host one full-duplex link of the given bandwidth to one
  non-blocking switch (what the planner assumes).
- "fattree:R[:H]": racks of H hosts (default 16), each host's link as in the star, each
  rack one full-duplex uplink of H x bandwidth / R to a non-blocking core: R = 1 is a
  full-bisection fat-tree, R = 4 the usual 4:1 oversubscription.
- "nodes:G": nodes of G GPUs (default 8) on an NVLink-class switch (each GPU one link
  of the intra-node bandwidth) and one NIC per node of the given bandwidth to a
  non-blocking core; traffic between nodes goes NIC to NIC.

Placement says which host each rank gets: "packed" (rank r on host r: a rack's or a
node's ranks are consecutive, so a ring in rank order leaves a rack once per step),
"spread" (round-robin over the racks: every hop of the ring crosses racks, the worst
case) or "random" (a seeded shuffle: a scheduler that takes free hosts wherever they
are). Nodes are always packed: horovodrun numbers a host's slots consecutively, and
the hierarchical allreduce groups ranks by node.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

KINDS = ("star", "fattree", "nodes")
PLACEMENTS = ("packed", "spread", "random")
DEFAULT_RACK = 16
DEFAULT_GPUS = 8


@dataclass(frozen=True)
class Topology:
    kind: str
    ratio: float = 1.0              # fattree: oversubscription of each rack's uplink
    group: int = 1                  # hosts per rack (fattree) or GPUs per node (nodes)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown topology {self.kind!r}; choose one of {', '.join(KINDS)}")
        if not self.ratio >= 1:
            raise ValueError(f"topology {self.spec}: the oversubscription ratio must be >= 1, "
                             f"got {self.ratio:g}")
        if self.group != int(self.group) or self.group < 1:
            raise ValueError(f"topology {self.kind}: the group size must be an integer >= 1, "
                             f"got {self.group!r}")

    @property
    def spec(self):
        """The spec that parses back to this topology."""
        if self.kind == "fattree":
            return f"fattree:{self.ratio:g}:{self.group}"
        if self.kind == "nodes":
            return f"nodes:{self.group}"
        return "star"

    def group_of(self, rank):
        """The rack or node of `rank` (0 for every rank of a star)."""
        return 0 if self.kind == "star" else rank // self.group

    def check_workers(self, workers):
        """Nodes hold whole groups of GPUs: a hierarchical allreduce needs every node full."""
        if self.kind == "nodes" and workers % self.group:
            raise ValueError(f"topology {self.spec}: {workers} workers do not fill nodes of "
                             f"{self.group} GPUs; give a multiple of {self.group}")


def placement(topology, workers, how="packed", seed=0):
    """[host of rank r] for `workers` ranks placed `how` (module doc)."""
    if how not in PLACEMENTS:
        raise ValueError(f"unknown placement {how!r}; choose one of {', '.join(PLACEMENTS)}")
    hosts = list(range(workers))
    if how == "packed":
        return hosts
    if topology.kind == "nodes":
        raise ValueError(f"placement {how!r} is not for nodes: a node's GPUs hold consecutive "
                         "ranks (horovodrun's slots), so nodes are always packed")
    if how == "random":
        random.Random(seed).shuffle(hosts)
        return hosts
    group = topology.group if topology.kind == "fattree" else workers
    racks = [hosts[i:i + group] for i in range(0, workers, group)]
    return [h for i in range(group) for rack in racks if i < len(rack) for h in [rack[i]]]


def parse_topology(text):
    """"star", "fattree:R[:H]" or "nodes:G" (module doc) -> Topology; ValueError names the
    part that is wrong."""
    parts = [p.strip() for p in str(text).strip().lower().split(":")]
    kind, args = parts[0], parts[1:]
    usage = 'expected "star", "fattree:RATIO[:HOSTS_PER_RACK]" or "nodes:GPUS_PER_NODE"'
    if kind not in KINDS:
        raise ValueError(f"unknown topology {text!r}; {usage}")

    def number(value, what, kind=float):
        try:
            return kind(value)
        except ValueError:
            raise ValueError(f"topology {text!r}: {what} must be {'an integer' if kind is int else 'a number'}, "
                             f"got {value!r}") from None

    if kind == "star":
        if args:
            raise ValueError(f"topology {text!r}: star takes no parameters; {usage}")
        return Topology("star")
    if kind == "fattree":
        if not 1 <= len(args) <= 2:
            raise ValueError(f"topology {text!r}: {usage}")
        ratio = number(args[0], "the oversubscription ratio")
        group = number(args[1], "hosts per rack", int) if len(args) > 1 else DEFAULT_RACK
        return Topology("fattree", ratio, group)
    if len(args) > 1:
        raise ValueError(f"topology {text!r}: {usage}")
    return Topology("nodes", 1.0, number(args[0], "GPUs per node", int) if args else DEFAULT_GPUS)
