"""The alpha-beta cost formulas the collectives use at run time.

Sending m bytes costs alpha + m*beta, reducing m bytes costs m*gamma
(Thakur, Rabenseifner & Gropp 2005; Wang et al. 2016); sizes in bytes,
times in seconds. The linear pipeline (collectives/linear_pipeline.py) cuts a message
into the chunk count that minimises its cost under these formulas
(layout.lp_chunks), and a `Collective("lp", network=Network(...))` names the
link it is tuned for. The timing model (pipe_horovod.pipeline.timing_model) builds every
other collective's cost and the step-time predictions on top of this module.
Pure Python on purpose.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Network:
    """Link parameters; frozen so one instance can be shared across sweeps.

    Args:
        alpha: seconds per message (latency).
        beta: seconds per byte on the wire (1 / bandwidth).
        gamma: seconds per byte of reduction arithmetic (default 0).

    Raises:
        ValueError: a parameter is negative or not a number.
    """

    alpha: float  # seconds per message (latency)
    beta: float  # seconds per byte on the wire (1 / bandwidth)
    gamma: float = 0.0  # seconds per byte of reduction arithmetic

    def __post_init__(self):
        for name in ("alpha", "beta", "gamma"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"Network.{name} must be >= 0, got {getattr(self, name)!r}")


# How the workers are wired. star: each worker's one full-duplex link to a switch (real
# clusters; pipe_horovod.tools.emulate's default). chain: each worker linked to its two
# neighbours only (a PCIe chain; emulate's topology="chain"), what passes between
# non-neighbours forwarded by the ranks in between.
TOPOLOGIES = ("star", "chain")


def check_topology(topology):
    """Raises ValueError naming TOPOLOGIES unless `topology` is one of them."""
    if topology not in TOPOLOGIES:
        raise ValueError(f"unknown topology {topology!r}; choose one of {', '.join(TOPOLOGIES)}")


def lp_streams(p, topology="star"):
    """Chunks the busiest link carries at once, each way, in the linear pipeline's
    allreduce while both its streams pass (lp_allreduce_cost)."""
    check_topology(topology)
    return 1 if p <= 2 or topology == "chain" else 2


def best_chunks(fill, a, b, nbytes):
    """k minimising (fill + k)(a + nbytes*b/k): more chunks fill the chain sooner
    but pay alpha more often; k* = sqrt(fill*nbytes*b/a), rounded to whichever
    neighbouring integer is cheaper."""
    if fill <= 0 or nbytes * b <= 0:
        return 1
    limit = max(1, int(nbytes))  # no chunk smaller than a byte
    if a <= 0:
        return limit
    k = math.sqrt(fill * nbytes * b / a)
    candidates = {min(limit, max(1, math.floor(k))), min(limit, max(1, math.ceil(k)))}
    return min(candidates, key=lambda c: (fill + c) * (a + nbytes * b / c))


def optimal_chunks(net, p, nbytes):
    """Chunks for a one-way chain of p ranks (lp_broadcast, lp_reduce): gamma
    enters at half weight (the mean of the two)."""
    return best_chunks(p - 2, net.alpha, net.beta + net.gamma / 2, nbytes)


def lp_allreduce_cost(net, p, nbytes, chunks, topology="star"):
    """The linear pipeline's allreduce in `chunks` chunks (pipe_horovod.pipeline.
    timing_model.lp_allreduce says what runs): a chain of 2p-1 positions, 2p-3+k steps
    of one chunk each. On a star (p >= 3) a worker's one link also sends a broadcast chunk
    back while it still sends reduce chunks on: worker p-2, the busiest, sends two at once
    in k-2 of those steps, each costing one more chunk's beta. SimGrid's flow model
    agrees within 1% at 4-32 workers (docs/simulate.md), where charging two chunks in
    every step was 4-10% too slow."""
    if p <= 1:
        return 0.0
    chunk = nbytes / chunks
    steps = 2 * p - 3 + chunks
    doubled = max(0, chunks - 2) if lp_streams(p, topology) == 2 else 0
    return steps * (net.alpha + chunk * (net.beta + net.gamma)) + doubled * chunk * net.beta


def lp_allreduce_chunks(net, p, nbytes, topology="star"):
    """Chunks minimising lp_allreduce_cost: the count collectives.linear_pipeline picks
    (for a star: the collective does not know how it is wired). In k the cost is
    k alpha + n ((2p-3)(beta + gamma) - 2 s beta) / k plus terms free of k (s = 1 where
    two streams share a link): best_chunks' cost with fill 1 and that per-byte term,
    up to a constant."""
    if p <= 1:
        return 1
    doubled = lp_streams(p, topology) - 1
    per_byte = (2 * p - 3) * (net.beta + net.gamma) - 2 * doubled * net.beta
    return best_chunks(1, net.alpha, per_byte, nbytes)
