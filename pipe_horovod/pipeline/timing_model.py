"""The timing model: alpha-beta-gamma costs of collectives and of sync vs pipelined steps.

Pipe-SGD's argument is quantitative: a pipelined step costs
max(compute + update, communication) where a sync step pays compute plus
whatever communication its backward does not hide (Schedule: the per-bucket
overlap of Horovod, DDP and our K=1), so whether pipelining (or
compression) helps depends on latency, bandwidth, cluster size, model size
and where in backward the bytes become ready. This module turns those into predicted step
times. It lives in the runtime because a run that tunes itself (pipeline/auto.py)
predicts its candidates with it while it trains; the toolbox (`pipe-horovod plan`,
`model`, the benchmark's "predicted" column, pipe_horovod.tools.planner's fit) predicts
with this same model, so there is one model in one place. Pure Python on purpose: no
torch, no numpy, so `pipe-horovod model` works where torch is not installed.

Costs follow the usual model (Thakur, Rabenseifner & Gropp 2005; Wang et
al. 2016): sending m bytes costs alpha + m*beta, reducing m bytes costs
m*gamma (collectives/cost_model.py holds Network and the linear pipeline's chunking).
All sizes are bytes, all times seconds. log p means ceil(log2 p),
the number of rounds a binomial / recursive-doubling scheme needs when p
is not a power of two (a slight underestimate there; ignore it).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace

from ..collectives.cost_model import (Network, check_topology, lp_allreduce_chunks,
                                      lp_allreduce_cost, optimal_chunks)
from ..compression import DEFAULT_BLOCK_SIZE, SCALE_BYTES
from .buckets import AUTO_FIRST_MB, auto_bucket_cap_mb, auto_splits_model, split_cap_bytes


def _log2(p):
    return math.ceil(math.log2(p))


def _collective(cost):
    """Shared guard for every cost function: validate p and n once, and make
    p == 1 free (one worker sends nothing) so formulas need not special-case it."""
    @functools.wraps(cost)
    def wrapper(net, p, nbytes, *args, **kwargs):
        if p != int(p) or p < 1:
            raise ValueError(f"number of workers p must be an integer >= 1, got {p!r}")
        if not nbytes >= 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
        return 0.0 if p == 1 else cost(net, int(p), nbytes, *args, **kwargs)
    return wrapper


# ---------------------------------------------------------------- collectives

@_collective
def ring_allreduce(net, p, nbytes):
    """Reduce-scatter then allgather around a ring: bandwidth-optimal, but
    latency grows linearly in p (Horovod's and NCCL's default)."""
    f = (p - 1) / p
    return 2 * (p - 1) * net.alpha + 2 * f * nbytes * net.beta + f * nbytes * net.gamma


@_collective
def ring_broadcast(net, p, nbytes):
    """Binomial scatter then ring allgather (van de Geijn): the large-message
    broadcast that ring libraries use."""
    return (_log2(p) + p - 1) * net.alpha + 2 * (p - 1) / p * nbytes * net.beta


@_collective
def ring_reduce(net, p, nbytes):
    """Ring reduce-scatter then binomial gather: the mirror of ring_broadcast."""
    return ring_broadcast(net, p, nbytes) + (p - 1) / p * nbytes * net.gamma


def _lp_cost(p, chunks, per_message, per_byte, nbytes):
    # A chain of p nodes moving k chunks: the last chunk leaves the head
    # after k-1 steps and needs p-1 hops; each step is one chunk send.
    return (p + chunks - 2) * (per_message + nbytes / chunks * per_byte)


def _chunks(net, p, nbytes, chunks, optimum=None):
    if chunks is None:
        return (optimum or optimal_chunks)(net, p, nbytes)
    if chunks != int(chunks) or chunks < 1:
        raise ValueError(f"chunks must be an integer >= 1, got {chunks!r}")
    return int(chunks)


@_collective
def lp_broadcast(net, p, nbytes, chunks=None):
    """Linear pipeline: chunks flow down a chain, so once the pipeline fills
    every link is busy and the cost approaches n*beta whatever p is."""
    return _lp_cost(p, _chunks(net, p, nbytes, chunks), net.alpha, net.beta, nbytes)


@_collective
def lp_reduce(net, p, nbytes, chunks=None):
    """Broadcast's chain run backwards, each hop also adding one chunk."""
    return _lp_cost(p, _chunks(net, p, nbytes, chunks), net.alpha, net.beta + net.gamma, nbytes)


@_collective
def lp_allreduce(net, p, nbytes, chunks=None, topology="star"):
    """What pipe_horovod.collectives.linear_pipeline runs: reduce along the chain 0..p-1
    and broadcast back, overlapped (chunk c returns while c+1 still goes
    out), so a one-way chain of 2p-1 positions. On a star each worker has one
    full-duplex link, so for p >= 3 a middle rank's link carries the reduce
    and the broadcast stream at once while both pass it, two chunks a step
    each way (cost_model.lp_allreduce_cost): the cost tends to 2n*beta where
    ring's is 2(p-1)/p*n*beta, so lp takes at least p/(p-1) ring's time (1.5x
    at 3 workers, 1.33x at 4). On a chain (the topology linear pipelining was
    designed for) link (i, i+1) carries the reduce stream one way and the
    broadcast the other, one chunk per step each way at every p: the cost
    tends to n*beta, below ring's for p >= 3.
    chunks=None: this cost's optimum (lp_allreduce_chunks)."""
    k = _chunks(net, p, nbytes, chunks,
                functools.partial(lp_allreduce_chunks, topology=topology))
    return lp_allreduce_cost(net, p, nbytes, k, topology)


@_collective
def mst_broadcast(net, p, nbytes):
    """Binomial tree: log p rounds, each carrying the whole message, so it
    wins on latency but its bandwidth term grows with log p."""
    return _log2(p) * (net.alpha + nbytes * net.beta)


@_collective
def mst_reduce(net, p, nbytes):
    return _log2(p) * (net.alpha + nbytes * (net.beta + net.gamma))


@_collective
def mst_allreduce(net, p, nbytes):
    """Reduce to a root then broadcast from it, both binomial trees."""
    return mst_reduce(net, p, nbytes) + mst_broadcast(net, p, nbytes)


def _exchanging(p):
    # BE's q = 2**floor(log2 p) exchanging ranks; the p - q others fold into a partner.
    return 1 << (p.bit_length() - 1)


def _be_bandwidth(p, nbytes, transfers=2):
    """(bytes on the busiest link's critical path, bytes it adds): for p not a
    power of two the partner of a folded rank first takes the whole vector in
    and at the end sends the result back (collectives/bidirectional_exchange.py), `transfers`
    whole messages beside the power-of-two exchange among q (allreduce 2,
    broadcast and reduce 1)."""
    q = _exchanging(p)
    f, extra = (q - 1) / q, 0 if p == q else 1
    return (2 * f + transfers * extra) * nbytes, (f + extra) * nbytes


@_collective
def be_allreduce(net, p, nbytes):
    """Bidirectional exchange (Rabenseifner: recursive-halving reduce-scatter,
    recursive-doubling allgather): ring's bandwidth with log p latency; for p
    not a power of two the fold and the hand-back, one whole message each
    (3n*beta at 3 workers, where ring needs 4n/3*beta)."""
    wire, added = _be_bandwidth(p, nbytes)
    extra = 0 if p == _exchanging(p) else 2
    return (2 * _log2(_exchanging(p)) + extra) * net.alpha + wire * net.beta + added * net.gamma


@_collective
def be_broadcast(net, p, nbytes):
    """Scatter then recursive-doubling allgather (and the hand-back for p != 2^k)."""
    q = _exchanging(p)
    extra = 0 if p == q else 1
    return ((2 * _log2(q) + extra) * net.alpha
            + (2 * (q - 1) / q + extra) * nbytes * net.beta)


@_collective
def be_reduce(net, p, nbytes):
    """Recursive-halving reduce-scatter then gather (after the fold for p != 2^k)."""
    return be_broadcast(net, p, nbytes) + _be_bandwidth(p, nbytes, 1)[1] * net.gamma


def with_message_cost(net, message_s):
    """The network as pipe_horovod.collectives' point-to-point algorithms see it: each
    dependent message also pays `message_s`, the software cost of one hop that the
    engine's own C++ allreduce (which the network is fitted to) does not: isend/irecv
    posted from Python, gloo's pair, the kernel, the waiting thread woken. Measure it
    apart from the collectives' timings, as half a small message's round trip between
    two ranks (pipe-horovod bench-collectives does, every pair at once: 75 us on the
    emulated 1gbit cluster, 4 workers on 2 cores, where the fit gave alpha 0)."""
    if not message_s >= 0:
        raise ValueError(f"message_s must be >= 0, got {message_s!r}")
    return replace(net, alpha=net.alpha + message_s)


# Callers (CLI, benchmark, fit) pick an algorithm by name.
ALLREDUCE = {"ring": ring_allreduce, "lp": lp_allreduce, "mst": mst_allreduce, "be": be_allreduce}
BROADCAST = {"ring": ring_broadcast, "lp": lp_broadcast, "mst": mst_broadcast, "be": be_broadcast}
REDUCE = {"ring": ring_reduce, "lp": lp_reduce, "mst": mst_reduce, "be": be_reduce}


# The allreduces each topology's costs hold for. On a chain every message of ring and lp
# goes to a neighbour but ring's wrap-around, which crosses each link once against the
# ring's direction, so no link carries two streams one way; mst's and be's exchanges
# between non-neighbours share links, which their formulas do not count.
MODELLED = {"star": tuple(ALLREDUCE), "chain": ("ring", "lp")}


def allreduce_time(net, p, nbytes, algorithm="ring", topology="star", **kwargs):
    """Dispatch by name so an unknown name fails with the list of valid ones, and an
    algorithm the topology's costs do not cover (MODELLED) fails rather than giving a
    wrong number."""
    try:
        cost = ALLREDUCE[algorithm]
    except KeyError:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {sorted(ALLREDUCE)}") from None
    check_topology(topology)
    if algorithm not in MODELLED[topology]:
        raise ValueError(f"{algorithm} allreduce is not modelled on a {topology}; it is for "
                         f"{', '.join(MODELLED[topology])}")
    if algorithm == "lp":
        kwargs["topology"] = topology
    return cost(net, p, nbytes, **kwargs)


def _hop_counts(p, algorithm, blocks=None):
    """(encodes, decode-adds, decodes) of the whole message on the critical path of
    pipe_horovod.collectives' allreduce. Every rank encodes each value it sends once
    (partial or final) and decodes the final message once at the end (never
    overlapped); the adds are where the algorithms differ (mst's root adds one child
    per round). With `blocks` (how many blocks the collective cuts the message into,
    collectives/layout.py) only the pipelined algorithms' exposed part counts: ring's
    pieces (blocks / p per segment) move on as soon as each is added, so per step one
    piece's decode-add and encode lie on the path, the rest under the next piece's
    transfer; lp's first chunk is encoded by rank 0 and decode-added and re-encoded at
    each of the p - 1 hops of the reduce chain, later chunks follow under the wire.
    be has no pieces: its halvings wait for each whole round, so all of it counts.
    Without `blocks`, every encode and add counts (the busiest rank's total)."""
    adds = {"ring": (p - 1) / p, "lp": 1.0, "mst": float(_log2(p)),
            "be": _be_bandwidth(p, 1.0)[1]}
    if algorithm not in adds:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {sorted(adds)}")
    if blocks is None or algorithm in ("be", "mst"):
        return 1.0, adds[algorithm], 1.0
    if algorithm == "ring":
        pieces = max(1.0, blocks / p)
        return 1.0 / pieces, adds["ring"] / pieces, 1.0
    return p / blocks, (p - 1) / blocks, 1.0


def two_stage_wire_ratio(block_size=DEFAULT_BLOCK_SIZE, value_bytes=1,
                         scale_bytes=SCALE_BYTES):
    """Wire bytes per byte of float32 gradient in the two-stage quantized allreduce
    (compression/two_stage.py, compression=int8 / int8_ef with no collective=): one
    `value_bytes` value per element plus one float32 scale per block of `block_size`
    (int8, 256: 0.2539, 1.6% above the values alone)."""
    if block_size != int(block_size) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    return (value_bytes + scale_bytes / block_size) / 4


@_collective
def two_stage_allreduce(net, p, nbytes, block_size=DEFAULT_BLOCK_SIZE, value_bytes=1,
                        scale_bytes=SCALE_BYTES):
    """The engine path of a quantized allreduce of `nbytes` float32 bytes: quantize, an
    alltoall of the shards (each rank sends and receives (p-1)/p of the wire bytes in
    p-1 messages), dequantize and sum the own shard in float32 ((p-1)/p of the float32
    bytes through gamma), quantize again, an allgather ((p-1)/p of the wire bytes, p-1
    messages on a ring). So 2(p-1) latencies and 2(p-1)/p of the quantized bytes, as a
    ring allreduce of them, one quantization per stage rather than per hop. Assumes the
    engine's alltoall and allgather run at the link rate, as its allreduce does (Horovod
    0.28.1's gloo ones reach about half of it, DESIGN.md; NCCL's do not lose it)."""
    wire = nbytes * two_stage_wire_ratio(block_size, value_bytes, scale_bytes)
    f = (p - 1) / p
    alltoall = (p - 1) * net.alpha + f * wire * net.beta
    allgather = (p - 1) * net.alpha + f * wire * net.beta
    return alltoall + f * nbytes * net.gamma + allgather


def codec_costs_at(table, block_bytes):
    """(encode, decode-add, decode) seconds per accumulator byte for blocks of
    `block_bytes`, from `table` = {block bytes: (encode, decode-add, decode) s per byte}
    measured at several block sizes (pipe_horovod.tools.hop_codecs.measure_costs). A
    block's cost is a fixed per-call part plus a per-byte part that grows once blocks
    leave the caches (measured on 2-core EPYC workers, 4 at once: int8 encode 6 ns/B
    at 16 KB, 0.5 ns/B at 1 MB, 0.9 ns/B at 16 MB), so neither one rate nor one size
    fits every algorithm: the seconds per call are interpolated linearly between the
    two measured sizes around `block_bytes`; below the smallest a call costs as much as
    there (the fixed part), above the largest each byte as much as there."""
    sizes = sorted(float(b) for b in table)
    if not sizes:
        raise ValueError("codec cost table is empty")
    costs = {float(b): tuple(c) for b, c in table.items()}
    if block_bytes >= sizes[-1]:
        return costs[sizes[-1]]
    if block_bytes <= sizes[0]:
        return tuple(c * sizes[0] / max(block_bytes, 1.0) for c in costs[sizes[0]])
    hi = next(b for b in sizes if b >= block_bytes)
    lo = sizes[sizes.index(hi) - 1]
    w = (block_bytes - lo) / (hi - lo)
    return tuple(((1 - w) * a * lo + w * b * hi) / block_bytes
                 for a, b in zip(costs[lo], costs[hi]))


def hop_codec_time(p, nbytes, algorithm, costs, blocks=None):
    """CPU seconds a per-hop codec adds to an allreduce of `nbytes` accumulator
    (float32) bytes: `costs` = (encode, decode-add, decode) seconds per accumulator
    byte, or a table {block bytes: that} measured at several block sizes
    (codec_costs_at picks the one for this collective's blocks), measured by
    pipe_horovod.tools.hop_codecs.measure_costs. `blocks`: how many blocks the
    collective cuts the message into (see _hop_counts); None counts all the busiest
    rank's codec work at the costs of one block per message. What counts adds to the
    wire time rather than hiding under it: a piece is decoded, added and encoded
    between its arrival and its forwarding, and on CPU workers the codec competes
    with the network stack for the same cores. Measured inside the collectives (4
    workers, 64 MB, int8): be spent 95 ms in the codec and took the wire time plus
    about that; ring spent as much but exposed only ~30 ms (its 4 pieces per segment),
    which is what one piece per step plus the final decode predicts."""
    if p < 2:
        return 0.0
    if isinstance(costs, dict):
        costs = codec_costs_at(costs, nbytes / (blocks or 1))
    return nbytes * sum(n * c for n, c in zip(_hop_counts(p, algorithm, blocks), costs))


# ----------------------------------------------------------------- step time
#
# One step as the link sees it. Forward takes F, backward B, the update U.
# Backward produces gradients in reverse layer order; a system groups them
# into buckets (fixed caps for DDP and our optimizer, Horovod's fusion of
# whatever is ready), bucket i is ready a_i after backward starts
# (0 <= a_1 <= ... <= a_n = B at most) and its allreduce costs c_i. One link
# carries them in ready order: a bucket starts at max(its ready time, the
# previous bucket's end). Two numbers summarise the schedule:
#   C = sum c_i, the link's busy time per step;
#   L = max_i (a_i + c_i + ... + c_n), when the last reduction lands,
#       counted from the start of backward on an idle link (L >= B, L >= C).
#
# Derivation (K = pipeline_depth). Let step t start at s_t, its backward at
# b_t = s_t + F, and let E_t be when its last reduction lands. Unrolling the
# serial link, E_t = max(b_t + L, E_{t-1} + C). The update of step t applies
# the gradient of step t-K+1, so it waits for E_{t-K+1}:
#   s_{t+1} = max(b_t + B, E_{t-K+1}) + U.
# In steady state s_t = tT and E_t = tT + e. The link forces T >= C (then
# e = L); the update's wait gives T = max(F + B + U, F + U + e - (K-1)T),
# whose fixed point is max(F + B + U, (F + L + U) / K). Hence
#   T_K = max(F + B + U, C, (F + L + U) / K).
# K = 1 (sync: Horovod, DDP, our K=1) gives F + L + U, because L >= B and
# L >= C: forward, then backward until the last bucket lands, then the update;
# not F + B + C + U, which ignores that buckets go out during backward.
# K = 2 gives max(F + B + U, C) — compute or the link, whichever is slower —
# plus an exposed remainder max(0, (F + L + U)/2 - max(F + B + U, C)) (a
# step's reductions must land within two steps). That remainder is zero on
# one serial link: every bucket is ready by B, so L <= B + C and
# (F + L + U)/2 <= the mean of F + B + U and C. What a measured K=2 step
# exposes beyond max(compute, comm) therefore comes from what this model
# leaves out (jitter, the CPU that communication takes: X below).
# `comm_cpu_s` (X) is CPU time communication takes from compute where both
# share cores; it stretches the compute term: max(F + B + U + X, C, ...).
# `compensation_s` (P) is what staleness compensation adds to the compute
# path of a pipelined step before its forward ("lookahead" replays the
# updates in flight: one more optimizer update at K=2); it lengthens the
# update, U -> U + P, for K >= 2 only (K = 1 has nothing to compensate).
# `exchange` (prediction_exchange, K >= 2 only): each bucket's quantized average for the
# prediction, ((a_i, x_i), ...) on the same link, each starting when its bucket is ready;
# the step's reductions start when backward ends, behind them. With D the exchanges'
# landing (as L, from x_i) and W = max(0, D - B) what step() waits for them:
#   T_K = max(F + B + W + U', C + sum x_i, (F + max(B, D) + C + U') / K).

# Bytes per value of the two-stage formats (compression/two_stage.py; the prediction's
# exchange takes int4 or int8, pipeline/staleness.EXCHANGES).
TWO_STAGE_VALUE_BYTES = {"int8": 1, "int4": 0.5, "fp8": 1}


@dataclass(frozen=True)
class Schedule:
    """One step's compute and the buckets the link carries (see the derivation above)."""

    forward_s: float
    backward_s: float
    update_s: float
    buckets: tuple = ()  # ((ready_s after backward starts, allreduce seconds), ...) in launch order
    compensation_s: float = 0.0  # P, pipelined steps only
    exchange: tuple = ()  # prediction_exchange's ((ready_s, seconds), ...), pipelined steps only

    def __post_init__(self):
        for name in ("forward_s", "backward_s", "update_s", "compensation_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"Schedule.{name} must be >= 0, got {getattr(self, name)!r}")
        for what in ("buckets", "exchange"):
            if any(not (ready >= 0 and cost >= 0) for ready, cost in getattr(self, what)):
                raise ValueError(f"{what}: ready times and costs must be >= 0, got "
                                 f"{getattr(self, what)!r}")

    @property
    def compute_s(self):
        return self.forward_s + self.backward_s + self.update_s

    @property
    def comm_s(self):
        """C: seconds the link is busy per step."""
        return sum(cost for _, cost in self.buckets)

    @property
    def exchange_s(self):
        """The link's busy time per pipelined step for the prediction's exchange."""
        return sum(cost for _, cost in self.exchange)

    @property
    def landing_s(self):
        """L: when the last reduction lands, from the start of backward, link idle before."""
        return max(self.backward_s, _landing(self.buckets))

    def step_s(self, pipeline_depth=1, comm_cpu_s=0.0):
        """T_K = max(F + B + U' + X, C, (F + L + U') / K), U' = U + P for K >= 2, else U."""
        if pipeline_depth != int(pipeline_depth) or pipeline_depth < 1:
            raise ValueError(f"pipeline_depth must be an integer >= 1, got {pipeline_depth!r}")
        if not comm_cpu_s >= 0:
            raise ValueError(f"comm_cpu_s must be >= 0, got {comm_cpu_s}")
        update = self.update_s + (self.compensation_s if pipeline_depth > 1 else 0.0)
        if pipeline_depth > 1 and self.exchange:
            exchanged = _landing(self.exchange)
            wait = max(0.0, exchanged - self.backward_s)
            return max(self.forward_s + self.backward_s + wait + update + comm_cpu_s,
                       self.comm_s + self.exchange_s,
                       (self.forward_s + max(self.backward_s, exchanged) + self.comm_s
                        + update) / pipeline_depth)
        return max(self.forward_s + self.backward_s + update + comm_cpu_s, self.comm_s,
                   (self.forward_s + self.landing_s + update) / pipeline_depth)


def _landing(buckets):
    """When the last of `buckets` ((ready_s, seconds), in order, on one link) lands."""
    free = 0.0
    for ready, cost in buckets:
        free = max(ready, free) + cost
    return free


def step_time(compute_s, update_s, comm_s, pipeline_depth=1, overlap=0.0, comm_cpu_s=0.0):
    """Predicted seconds per step from totals alone: a Schedule with one
    bucket holding the whole model, for when no per-layer profile exists.

    `overlap` is the fraction of communication a sync step hides behind
    backward (the bucket is taken as ready that much before backward ends,
    at most all of backward), so sync = compute + update + comm - hidden.
    Pipelined (K >= 2) is then max(compute + update + comm_cpu_s, comm).
    """
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap must be in [0, 1], got {overlap}")
    if not comm_s >= 0:
        raise ValueError(f"comm_s must be >= 0, got {comm_s}")
    ready = compute_s - min(overlap * comm_s, compute_s)
    return Schedule(0.0, compute_s, update_s, ((ready, comm_s),)).step_s(pipeline_depth, comm_cpu_s)


@dataclass(frozen=True)
class Workload:
    """What one worker computes per step: the input of `predict`.

    `gradients` are ((ready_s, nbytes), ...) in the order backward produces
    them, ready_s counted from the start of backward (<= backward_s).
    `compensation_s`: Schedule's P, what staleness compensation costs a pipelined step.
    """

    forward_s: float
    backward_s: float
    update_s: float
    gradients: tuple
    compensation_s: float = 0.0

    def __post_init__(self):
        Schedule(self.forward_s, self.backward_s, self.update_s,
                 compensation_s=self.compensation_s)  # validates the times
        ready = [r for r, _ in self.gradients]
        if not self.gradients:
            raise ValueError("a workload needs at least one gradient")
        if any(not (n > 0) for _, n in self.gradients):
            raise ValueError("every gradient must have nbytes > 0")
        if ready != sorted(ready) or ready[0] < 0 or ready[-1] > self.backward_s * (1 + 1e-12):
            raise ValueError(f"gradient ready times must be ascending within [0, backward_s], got {ready}")

    @classmethod
    def aggregate(cls, compute_s, update_s, model_bytes):
        """Totals only: the whole gradient ready when forward + backward ends."""
        return cls(0.0, compute_s, update_s, ((compute_s, model_bytes),))

    @classmethod
    def from_layers(cls, layers, update_s=0.0):
        """`layers`: ((forward_s, backward_s, (gradient nbytes, ...)), ...) in
        forward order. Backward runs them in reverse; a layer's gradients are
        ready when its backward ends, its last parameter's first (autograd's order)."""
        layers = list(layers)
        gradients, clock = [], 0.0
        for _, backward_s, sizes in reversed(layers):
            clock += backward_s
            gradients += [(clock, n) for n in reversed(sizes)]
        return cls(sum(f for f, _, _ in layers), clock, update_s, tuple(gradients))

    @property
    def model_bytes(self):
        return sum(n for _, n in self.gradients)

    def with_codec(self, seconds_per_byte):
        """The codec encodes each gradient on the training thread when it is
        ready, so it delays every later gradient and lengthens backward."""
        if seconds_per_byte == 0:
            return self
        shifted, delay = [], 0.0
        for ready, n in self.gradients:
            delay += n * seconds_per_byte
            shifted.append((ready + delay, n))
        return replace(self, backward_s=self.backward_s + delay, gradients=tuple(shifted))


@dataclass(frozen=True)
class Bucketing:
    """How a system groups gradients (in ready order) into allreduces.

    "cap" (our optimizer, pipeline/buckets.py): a bucket closes before the
    next gradient would take it past cap_bytes; with first_cap_bytes (our
    automatic size, bucket_cap_mb=None) the first bucket also closes once it
    holds that much, and with split_model no bucket holds more than half the model
    (pipeline.buckets.split_cap_bytes). "ddp" (torch's Reducer): a
    bucket closes once it reaches its limit, the first limit being
    first_cap_bytes. "fusion" (Horovod's tensor fusion): when the link
    frees, everything ready by then goes, up to cap_bytes per allreduce.
    Horovod's cycle (1 ms by default) is not modelled.
    """

    kind: str
    cap_bytes: float
    first_cap_bytes: float = None
    split_model: bool = False

    def __post_init__(self):
        if self.kind not in ("cap", "ddp", "fusion"):
            raise ValueError(f"unknown bucketing {self.kind!r}; choose cap, ddp or fusion")
        if not self.cap_bytes > 0:
            raise ValueError(f"bucket cap must be > 0 bytes, got {self.cap_bytes!r}")

    def buckets(self, gradients, cost):
        """((ready_s, nbytes), ...) per bucket; `cost(nbytes)` is one allreduce's
        seconds (fusion decides what is ready by when the link frees)."""
        if self.kind == "fusion":
            return self._fuse(gradients, cost)
        cap = self.cap_for(sum(n for _, n in gradients))
        out, ready, used = [], 0.0, 0.0
        limit = self.first_cap_bytes if self.kind == "ddp" and self.first_cap_bytes else cap
        for r, n in gradients:
            first = self.kind == "cap" and self.first_cap_bytes and not out
            if self.kind == "cap" and used and (
                    used + n > cap or (first and used >= self.first_cap_bytes)):
                out.append((ready, used))
                used = 0.0
            ready, used = r, used + n
            if self.kind == "ddp" and used >= limit:
                out.append((ready, used))
                used, limit = 0.0, self.cap_bytes
        return out + [(ready, used)] if used else out

    def cap_for(self, total_bytes):
        """The cap in force for `total_bytes` of gradients: cap_bytes, or with split_model
        the runtime's split_cap_bytes of it."""
        if not self.split_model:
            return self.cap_bytes
        return split_cap_bytes(self.cap_bytes, total_bytes)

    def _fuse(self, gradients, cost):
        out, free, i = [], 0.0, 0
        while i < len(gradients):
            start = max(free, gradients[i][0])
            used = 0.0
            while i < len(gradients) and gradients[i][0] <= start and (
                    not used or used + gradients[i][1] <= self.cap_bytes):
                used += gradients[i][1]
                i += 1
            out.append((start, used))
            free = start + cost(used)
        return out


MIB = 2**20
OURS = Bucketing("cap", 25 * MIB)                       # DistributedOptimizer(bucket_cap_mb=25)
# (its default, bucket_cap_mb=None, depends on the cluster: auto_bucketing(workers, network))
DDP = Bucketing("ddp", 25 * MIB, first_cap_bytes=MIB)   # torch's bucket_cap_mb=25, first bucket 1 MiB
HOROVOD = Bucketing("fusion", 128 * MIB)  # HOROVOD_FUSION_THRESHOLD default (128 MiB since 0.21, 0.28.1 too)


def auto_bucketing(workers, network):
    """Our optimizer's buckets at bucket_cap_mb=None: the cap the runtime picks for
    `workers` ranks on `network` (pipe_horovod.pipeline.buckets.auto_bucket_cap_mb, the
    function training calls), the first bucket closing once it holds AUTO_FIRST_MB."""
    bandwidth = 1.0 / network.beta if network.beta > 0 else 1e30    # beta 0: no byte cost
    cap = auto_bucket_cap_mb(workers, bandwidth, network.alpha)
    return Bucketing("cap", cap * MIB, first_cap_bytes=AUTO_FIRST_MB * MIB,
                     split_model=auto_splits_model(workers, network.alpha))


def bucketings(cap_bytes=OURS.cap_bytes, fusion_bytes=HOROVOD.cap_bytes, workers=None,
               network=None):
    """{"horovod", "ddp", "ours": Bucketing}: ours and DDP at one bucket cap (as their
    shared bucket_cap_mb), Horovod at its fusion threshold. cap_bytes=None: ours at its
    default, the automatic size for `workers` on `network` (auto_bucketing), and DDP at
    its own default (25 MiB)."""
    if cap_bytes is None:
        ours = auto_bucketing(workers, network)
        cap_bytes = DDP.cap_bytes
    else:
        ours = Bucketing("cap", cap_bytes)
    return {"horovod": Bucketing("fusion", fusion_bytes),
            "ddp": Bucketing("ddp", cap_bytes, first_cap_bytes=DDP.first_cap_bytes),
            "ours": ours}


# name -> (wire ratio, codec seconds per byte of the fp32 gradient, encode +
# decode). The codec costs are torch CPU round trips (one thread, 10M floats)
# measured on this project's 2-core machines: fp16 1.4, bf16 1.6, int8 5.5
# ns/byte. On CPU they can outweigh the bytes saved; on a GPU they are
# near zero, so pass your own figures there. The codec runs where the
# gradient is produced (the training thread or stream), so it adds to
# backward, not to the communication it overlaps.
DEFAULT_COMPRESSIONS = {
    "fp16": (0.5, 1.5e-9),
    "bf16": (0.5, 1.5e-9),
    "int8": (0.25, 5.5e-9),
}


@dataclass(frozen=True)
class Row:
    """One configuration's prediction; speedup is against the first row
    (uncompressed sync). compute_s: the compute side's busy time per step
    (codec and comm CPU included); comm_s: the link's (C); bottleneck: the
    busier of the two, the link's split into "network" (bytes) and
    "latency" (per-message terms) by which part of C is larger, or "codec"
    where a codec beside compute holds the link longer than its bytes."""

    name: str
    pipeline_depth: int
    compression: str
    wire_bytes: float
    comm_s: float
    step_s: float
    speedup: float
    compute_s: float = 0.0
    bottleneck: str = "compute"


@dataclass(frozen=True)
class Prediction:
    algorithm: str
    workers: int
    model_bytes: float
    network: Network
    rows: dict = field(default_factory=dict)  # row name -> Row

    @property
    def sync_s(self):
        return self.rows["sync"].step_s

    @property
    def pipelined_s(self):
        return self.rows["pipelined"].step_s


def predict(workload, workers, network, algorithm="ring", compressions=None, pipeline_depth=2,
            overlap=0.0, comm_cpu_per_byte=0.0, bucketing=OURS, exchange=None):
    """Predict every (sync | pipelined) x compression combination of one
    system at once, so the CLI tables and the benchmark's "predicted"
    column come from one place.

    `workload`: a Workload (per-gradient backward schedule, or
    Workload.aggregate from totals). `bucketing`: OURS, DDP or HOROVOD
    (which system's buckets the link carries). Rows are named "sync",
    "pipelined", "sync+fp16", "pipelined+fp16", ... (compression "none"
    adds no suffix; it is always included as the baseline). `compressions`
    maps a name to (wire ratio, codec seconds per byte of the uncompressed
    gradient); default DEFAULT_COMPRESSIONS. `overlap` (aggregate
    workloads only, see step_time) applies to the sync rows.
    `comm_cpu_per_byte`: CPU seconds per byte on the wire that
    communication takes from compute when they overlap (Schedule's X);
    measure it as the slowdown of compute while an allreduce runs, over its bytes.
    A compression may carry a third number, codec seconds per gradient byte spent
    beside compute rather than on the training thread: the two-stage codec on CPU
    buckets runs on the communicator's thread (collectives/quantized.py, point to
    point) while its chunks' bytes are on the wire, so a bucket holds the link for
    the longer of its allreduce and its codec work (bottleneck "codec" where that
    work is the longer); what that CPU, with compute's and the optimizer's own bucket
    and prediction work, takes from other ranks on shared cores is `cpu_floor`'s.
    `exchange`: the pipelined rows' prediction_exchange ("int4", "int8"): each bucket's
    two-stage quantized average for the prediction, on the same link (Schedule's
    exchange).
    """
    if pipeline_depth < 2:
        raise ValueError(f"pipeline_depth must be >= 2 for the pipelined rows, got {pipeline_depth}")
    if overlap and len(workload.gradients) > 1:
        raise ValueError("overlap is for an aggregate (one-gradient) workload; "
                         "a per-gradient workload's schedule gives the overlap itself")
    if workers != int(workers) or workers < 1:
        raise ValueError(f"number of workers must be an integer >= 1, got {workers!r}")
    compressions = {"none": (1.0, 0.0), **(DEFAULT_COMPRESSIONS if compressions is None else compressions)}
    bytes_only = Network(0.0, network.beta, network.gamma)
    rows, base = {}, None
    for comp, (ratio, codec_per_byte, *beside) in compressions.items():
        alone = workers == 1  # nothing to send, so nothing to compress
        work = workload if alone else workload.with_codec(codec_per_byte)
        beside = 0.0 if alone or not beside else beside[0]

        def transfer(nbytes, net=network):
            return allreduce_time(net, workers, nbytes * ratio, algorithm)

        def cost(nbytes, net=network):
            return max(transfer(nbytes, net), nbytes * beside)

        groups = bucketing.buckets(work.gradients, cost)
        buckets = [(ready, cost(n)) for ready, n in groups]
        if overlap:
            (ready, comm), = buckets
            buckets = [(work.backward_s - min(overlap * comm, work.backward_s), comm)]
        exchanged = () if alone or exchange is None else tuple(
            (ready, two_stage_allreduce(network, workers, n,
                                        value_bytes=TWO_STAGE_VALUE_BYTES[exchange]))
            for ready, n in groups)
        schedule = Schedule(work.forward_s, work.backward_s, work.update_s, tuple(buckets),
                            work.compensation_s, exchanged)
        wire = workload.model_bytes * ratio
        cpu_s = 0.0 if alone else comm_cpu_per_byte * wire
        compute, comm = schedule.compute_s + cpu_s, schedule.comm_s
        bottleneck = "compute"
        if comm > compute:
            bandwidth = sum(transfer(n, bytes_only) for _, n in groups)
            bottleneck = ("codec" if sum(n * beside for _, n in groups)
                          > sum(transfer(n) for _, n in groups)
                          else "latency" if comm - bandwidth > bandwidth else "network")
        # The pipelined rows' link also carries the exchange (its bytes, its time).
        more_wire = workload.model_bytes * two_stage_wire_ratio(
            value_bytes=TWO_STAGE_VALUE_BYTES[exchange]) if exchanged else 0.0
        more_comm = schedule.exchange_s
        for mode, depth in (("sync", 1), ("pipelined", pipeline_depth)):
            name = mode if comp == "none" else f"{mode}+{comp}"
            step = schedule.step_s(depth, cpu_s)
            base = step if base is None else base
            speedup = base / step if step > 0 else 1.0
            extra = depth > 1 and bool(exchanged)
            link = comm + more_comm * extra
            bound = "network" if extra and bottleneck == "compute" and link > compute \
                else bottleneck
            rows[name] = Row(name, depth, comp, wire + more_wire * extra, link, step, speedup,
                             compute, bound)
    return Prediction(algorithm, workers, workload.model_bytes, network, rows)


def cpu_floor(cpu_s_per_step, workers, cores):
    """The shortest step `workers` ranks can take when each needs `cpu_s_per_step` CPU
    seconds a step and all of them share `cores` cores (one machine, as the emulated
    cluster): their CPU over the cores. Replayed compute sleeps, so there the floor binds
    only once the ranks' codec and communication work exceeds the cores (4 workers on 2
    cores).

    What a rank's `cpu_s_per_step` should count (the bench report's two-stage rows,
    tools/bench/report.py _floor_parts, each part measured apart from the step it
    predicts, so the prediction never reads its answer off the row): the training step
    without communication (the `compute` row: forward, backward, the wrapped optimizer's
    update); the communication's CPU (a plain allreduce's, scaled to the codec's wire
    bytes); the codec's stages; and the wrapped optimizer's own work beside compute, which
    a plain step does not do: copying each gradient into its bucket and, with the default
    lookahead compensation, the one-pass prediction of the next weights (each a pass over
    the model's gradient, as large as the update's). Not counted, not measured apart yet:
    the Python of the messages (the step machine's launches, the communicator's loop, the
    waits)."""
    if not cpu_s_per_step >= 0:
        raise ValueError(f"cpu_s_per_step must be >= 0, got {cpu_s_per_step!r}")
    if workers != int(workers) or workers < 1:
        raise ValueError(f"number of workers must be an integer >= 1, got {workers!r}")
    if not cores > 0:
        raise ValueError(f"cores must be > 0, got {cores!r}")
    return cpu_s_per_step * workers / cores
