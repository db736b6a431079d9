"""The messages each allreduce sends, as rounds of concurrent flows.

A round is a set of flows (source rank, destination rank, bytes) that start together;
the next round starts when all of them have landed (each step of a ring waits for the
piece it forwards, so the ring moves at its slowest flow's pace). `repeat` counts
identical consecutive rounds: the 2(p-1) steps of a ring are one round repeated. The
simulator (engine.py) runs a round on the network and, unless told to run every round,
takes a repeat to cost what the first did: on a flow-level model with nothing else on the
network (one collective at a time, as one background thread per rank runs them) each
repeat is the same computation.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Round:
    repeat: int
    flows: tuple            # ((src rank, dst rank, bytes), ...)


def ring(ranks, nbytes):
    """Reduce-scatter then allgather around `ranks` in order (Horovod's, NCCL's and gloo's
    ring): 2(p-1) steps, each rank sending nbytes/p to the next."""
    p = len(ranks)
    if p < 2:
        return []
    return [Round(2 * (p - 1), _ring_flows(ranks, nbytes / p))]


def _ring_flows(ranks, piece):
    p = len(ranks)
    return tuple((ranks[i], ranks[(i + 1) % p], piece) for i in range(p))


def hierarchical(ranks, per_node, nbytes):
    """Horovod's HOROVOD_HIERARCHICAL_ALLREDUCE on nodes of `per_node` ranks: a ring
    reduce-scatter inside every node (nbytes/G pieces, G-1 steps), then local rank j of
    every node allreduces its shard with the j-th of the others (G rings over the nodes at
    once, nbytes/G each), then a ring allgather inside every node."""
    p = len(ranks)
    if p % per_node:
        raise ValueError(f"{p} ranks do not fill nodes of {per_node}")
    nodes = [ranks[i:i + per_node] for i in range(0, p, per_node)]
    if len(nodes) == 1:
        return ring(ranks, nbytes)
    if per_node == 1:
        return ring(ranks, nbytes)
    shard = nbytes / per_node
    inside = Round(per_node - 1, sum((_ring_flows(node, shard) for node in nodes), ()))
    across = [ring([node[j] for node in nodes], shard) for j in range(per_node)]
    m = len(nodes)
    cross = Round(2 * (m - 1), sum((r[0].flows for r in across), ()))
    return [inside, cross, inside]


def two_stage(ranks, wire_bytes):
    """The two-stage quantized allreduce (compression/two_stage.py) of `wire_bytes` of
    codes and scales: an alltoall of the shards (p-1 rounds, round k rank i sending its
    shard for rank i+k, wire/p bytes, as pairwise exchange does), each rank reduces its
    shard, then a ring allgather of the reduced shards (p-1 steps of wire/p)."""
    p = len(ranks)
    if p < 2:
        return []
    piece = wire_bytes / p
    shifts = [Round(1, tuple((ranks[i], ranks[(i + k) % p], piece) for i in range(p)))
              for k in range(1, p)]
    return shifts + [Round(p - 1, _ring_flows(ranks, piece))]


def linear_pipeline(ranks, nbytes, chunks):
    """pipe_horovod.collectives.linear_pipeline's allreduce: `chunks` chunks reduced along
    the chain ranks[0] -> ranks[-1] and broadcast back, overlapped, so each chunk crosses
    2p-2 hops of a one-way chain of 2p-1 positions and the whole takes chunks + 2p - 3
    steps; at each step every hop with a chunk on it sends nbytes/chunks."""
    p = len(ranks)
    if p < 2:
        return []
    if chunks != int(chunks) or chunks < 1:
        raise ValueError(f"chunks must be an integer >= 1, got {chunks!r}")
    hops = [(ranks[q], ranks[q + 1]) for q in range(p - 1)] + \
           [(ranks[2 * p - 2 - q], ranks[2 * p - 3 - q]) for q in range(p - 1, 2 * p - 2)]
    piece = nbytes / chunks
    rounds = []
    for step in range(chunks + 2 * p - 3):
        flows = tuple((s, d, piece) for q, (s, d) in enumerate(hops) if 0 <= step - q < chunks)
        if rounds and rounds[-1].flows == flows:
            rounds[-1] = Round(rounds[-1].repeat + 1, flows)
        else:
            rounds.append(Round(1, flows))
    return rounds


def flow_count(rounds):
    """Flows the simulator starts for `rounds` when it runs every round."""
    return sum(r.repeat * len(r.flows) for r in rounds)
