"""Alpha-beta-gamma cost model of collectives and of sync vs pipelined steps.

Pipe-SGD's argument is quantitative: a pipelined step costs
max(compute + update, communication) where a sync step pays the sum, so
whether pipelining (or compression) helps depends on latency, bandwidth,
cluster size and model size. This module turns those into predicted step
times, so a user can decide before running, and so the benchmark can print
predictions beside measurements. It is pure Python + numpy on purpose: the
`pipe-horovod model` command must work where torch is not installed.

Costs follow the usual model (Thakur, Rabenseifner & Gropp 2005; Wang et
al. 2016): sending m bytes costs alpha + m*beta, reducing m bytes costs
m*gamma. All sizes are bytes, all times seconds. log p means ceil(log2 p),
the number of rounds a binomial / recursive-doubling scheme needs when p
is not a power of two (a slight underestimate there; ignore it).
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Network:
    """Link parameters; frozen so one instance can be shared across sweeps."""

    alpha: float  # seconds per message (latency)
    beta: float  # seconds per byte on the wire (1 / bandwidth)
    gamma: float = 0.0  # seconds per byte of reduction arithmetic

    def __post_init__(self):
        for name in ("alpha", "beta", "gamma"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"Network.{name} must be >= 0, got {getattr(self, name)!r}")


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


def _chunks(net, p, nbytes, chunks):
    if chunks is None:
        return optimal_chunks(net, p, nbytes)
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
def lp_allreduce(net, p, nbytes, chunks=None):
    """Reduce along the chain, then broadcast back along it. The phases are
    not overlapped (a full-duplex chain could start broadcasting chunk 1 while
    later chunks still reduce), so this is an upper bound."""
    k = _chunks(net, p, nbytes, chunks)
    return lp_reduce(net, p, nbytes, k) + lp_broadcast(net, p, nbytes, k)


def optimal_chunks(net, p, nbytes):
    """Chunk count minimising (p+k-2)(a + b/k): more chunks fill the chain
    sooner but pay alpha more often; the optimum is k* = sqrt((p-2) b / a),
    rounded to whichever neighbouring integer is cheaper. gamma enters b at
    half weight (allreduce's average of reduce and broadcast) so one count
    serves all three LP collectives."""
    a, b = net.alpha, net.beta + net.gamma / 2
    if p <= 2 or nbytes * b <= 0:
        return 1
    limit = max(1, int(nbytes))  # no chunk smaller than a byte
    if a <= 0:
        return limit
    k = math.sqrt((p - 2) * nbytes * b / a)
    candidates = {min(limit, max(1, math.floor(k))), min(limit, max(1, math.ceil(k)))}
    return min(candidates, key=lambda c: _lp_cost(p, c, a, b, nbytes))


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


@_collective
def be_allreduce(net, p, nbytes):
    """Bidirectional exchange (Rabenseifner: recursive-halving reduce-scatter,
    recursive-doubling allgather): ring's bandwidth with log p latency."""
    f = (p - 1) / p
    return 2 * _log2(p) * net.alpha + 2 * f * nbytes * net.beta + f * nbytes * net.gamma


@_collective
def be_broadcast(net, p, nbytes):
    """Binomial scatter then recursive-doubling allgather."""
    return 2 * _log2(p) * net.alpha + 2 * (p - 1) / p * nbytes * net.beta


@_collective
def be_reduce(net, p, nbytes):
    """Recursive-halving reduce-scatter then binomial gather."""
    return be_broadcast(net, p, nbytes) + (p - 1) / p * nbytes * net.gamma


# Callers (CLI, benchmark, fit) pick an algorithm by name.
ALLREDUCE = {"ring": ring_allreduce, "lp": lp_allreduce, "mst": mst_allreduce, "be": be_allreduce}
BROADCAST = {"ring": ring_broadcast, "lp": lp_broadcast, "mst": mst_broadcast, "be": be_broadcast}
REDUCE = {"ring": ring_reduce, "lp": lp_reduce, "mst": mst_reduce, "be": be_reduce}


def allreduce_time(net, p, nbytes, algorithm="ring", **kwargs):
    """Dispatch by name so an unknown name fails with the list of valid ones."""
    try:
        cost = ALLREDUCE[algorithm]
    except KeyError:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {sorted(ALLREDUCE)}") from None
    return cost(net, p, nbytes, **kwargs)


# ----------------------------------------------------------------- step time

def step_time(compute_s, update_s, comm_s, pipeline_depth=1, overlap=0.0, comm_cpu_s=0.0):
    """Predicted seconds per training step.

    Sync (pipeline_depth=1) pays compute + update + the communication not
    hidden behind backward. `overlap` is the fraction of communication that
    per-layer/bucket overlap hides; it can hide at most compute_s of it, which
    keeps sync >= pipelined for every input.

    Pipelined (pipeline_depth=K>=2) runs step t's allreduce while step t+1
    computes, so the slower of the two sets the pace: max(compute + update,
    comm). A deeper pipeline (K>2) only absorbs jitter; it cannot raise the
    steady-state throughput above this bound, so K does not appear here.

    `comm_cpu_s` is the CPU time communication takes away from compute when
    both run at once: on CPU workers whose compute already fills their cores,
    the reduction, the copies and the kernel's network stack run on those
    same cores, so overlapping stretches compute by that much. On a GPU, or
    with idle cores, it is ~0. A sync step does not overlap, so it pays none.
    """
    if pipeline_depth < 1:
        raise ValueError(f"pipeline_depth must be >= 1, got {pipeline_depth}")
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap must be in [0, 1], got {overlap}")
    if not comm_cpu_s >= 0:
        raise ValueError(f"comm_cpu_s must be >= 0, got {comm_cpu_s}")
    if pipeline_depth == 1:
        return compute_s + update_s + comm_s - min(overlap * comm_s, compute_s)
    return max(compute_s + update_s + comm_cpu_s, comm_s)


# name -> (wire ratio, codec seconds per byte of the fp32 gradient, encode +
# decode). The codec costs are torch CPU round trips (one thread, 10M floats)
# measured on this project's 2-core machines: fp16 1.4, bf16 1.6, int8 5.5
# ns/byte. On CPU they can outweigh the bytes saved; on a GPU they are
# near zero, so pass your own figures there. The codec runs where the
# gradient is produced (the training thread or stream), so in a pipelined
# step it adds to compute, not to the communication it overlaps.
DEFAULT_COMPRESSIONS = {
    "fp16": (0.5, 1.5e-9),
    "bf16": (0.5, 1.5e-9),
    "int8": (0.25, 5.5e-9),
}


@dataclass(frozen=True)
class Row:
    """One configuration's prediction; speedup is against uncompressed sync."""

    name: str
    pipeline_depth: int
    compression: str
    wire_bytes: float
    comm_s: float
    step_s: float
    speedup: float


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


def predict(compute_s, update_s, model_bytes, workers, network, algorithm="ring",
            compressions=None, pipeline_depth=2, overlap=0.0, comm_cpu_per_byte=0.0):
    """Predict every (sync | pipelined) x compression combination at once, so
    the CLI table and the benchmark's "predicted" column come from one place.

    Rows are named "sync", "pipelined", "sync+fp16", "pipelined+fp16", ...
    (compression "none" adds no suffix; it is always included as the
    baseline). `compressions` maps a name to (wire ratio, codec seconds per
    byte of the uncompressed gradient); default DEFAULT_COMPRESSIONS.
    `overlap` applies to the sync rows only (see step_time).
    `comm_cpu_per_byte`: CPU seconds per byte on the wire that communication
    takes from compute when they overlap (step_time's comm_cpu_s); measure it
    as the slowdown of compute while an allreduce runs, over its bytes.
    Row.comm_s includes the codec.
    """
    if pipeline_depth < 2:
        raise ValueError(f"pipeline_depth must be >= 2 for the pipelined rows, got {pipeline_depth}")
    compressions = {"none": (1.0, 0.0), **(DEFAULT_COMPRESSIONS if compressions is None else compressions)}
    rows, base = {}, None
    for comp, (ratio, codec_per_byte) in compressions.items():
        wire = model_bytes * ratio
        if workers == 1:  # nothing to send, so nothing to compress
            allreduce_s = codec_s = cpu_s = 0.0
        else:
            allreduce_s = allreduce_time(network, workers, wire, algorithm)
            codec_s = codec_per_byte * model_bytes
            cpu_s = comm_cpu_per_byte * wire
        for mode, depth in (("sync", 1), ("pipelined", pipeline_depth)):
            name = mode if comp == "none" else f"{mode}+{comp}"
            step = step_time(compute_s + codec_s, update_s, allreduce_s, depth,
                             overlap if depth == 1 else 0.0, cpu_s)
            base = step if base is None else base
            speedup = base / step if step > 0 else 1.0
            rows[name] = Row(name, depth, comp, wire, allreduce_s + codec_s, step, speedup)
    return Prediction(algorithm, workers, model_bytes, network, rows)


# ----------------------------------------------------------------------- fit

@dataclass(frozen=True)
class FitResult:
    alpha: float
    beta: float  # effective: includes gamma, which is collinear with beta
    r2: float
    rmse: float  # seconds
    max_rel_error: float

    @property
    def network(self):
        return Network(self.alpha, self.beta)


def fit(sizes_bytes, seconds, p, algorithm="ring", relative=True, **kwargs):
    """Estimate alpha and beta from an allreduce sweep.

    For fixed p and algorithm each cost is a*alpha + b*beta, so the design
    matrix is read off the cost function itself (evaluated with unit alpha,
    then unit beta) rather than restating every formula. With `relative`
    rows are weighted by 1/time: sweeps span orders of magnitude and
    unweighted least squares would let the largest messages drown out the
    latency term. Pass relative=False to predict bulk transfers (a model's
    gradient): real links are faster per byte for small messages (a token
    bucket's burst, TCP windows), and relative weighting then fits a beta
    too optimistic for large ones. Negative estimates
    are unphysical, so if one appears the other parameter is refitted alone.
    gamma multiplies the same byte count as beta and cannot be separated;
    the returned beta includes it. For "lp" pass a fixed `chunks=`: with the
    optimal count the cost is not linear in alpha and beta.
    """
    x = np.asarray(sizes_bytes, dtype=float).ravel()
    y = np.asarray(seconds, dtype=float).ravel()
    if x.size != y.size:
        raise ValueError(f"sizes_bytes has {x.size} values but seconds has {y.size}")
    if x.size < 2:
        raise ValueError(f"need at least 2 measurements to fit alpha and beta, got {x.size}")
    if not (np.all(x > 0) and np.all(np.isfinite(x))):
        raise ValueError(f"sizes_bytes must be positive, got {x.tolist()}")
    if not (np.all(y > 0) and np.all(np.isfinite(y))):
        raise ValueError(f"seconds must be positive, got {y.tolist()}")
    if p < 2:
        raise ValueError(f"p must be >= 2 to fit (one worker does not communicate), got {p}")
    if algorithm == "lp" and not kwargs.get("chunks"):
        raise ValueError("fitting 'lp' needs a fixed chunks= (the optimal count depends on alpha and beta)")
    if np.unique(x).size < 2:
        raise ValueError("need at least 2 distinct sizes to separate alpha from beta")

    design = np.array([[allreduce_time(Network(1.0, 0.0), p, n, algorithm, **kwargs),
                        allreduce_time(Network(0.0, 1.0), p, n, algorithm, **kwargs)] for n in x])
    w = 1.0 / y if relative else np.ones_like(y)
    coef = _weighted_lstsq(design, y, w)
    if np.any(coef < 0):
        singles = []
        for j in (0, 1):
            c = np.zeros(2)
            c[j] = max(0.0, _weighted_lstsq(design[:, [j]], y, w)[0])
            singles.append(c)
        coef = min(singles, key=lambda c: np.sum((w * (design @ c - y)) ** 2))

    pred = design @ coef
    resid = y - pred
    ss_tot = np.sum((y - y.mean()) ** 2)
    r2 = 1.0 - np.sum(resid**2) / ss_tot if ss_tot > 0 else 1.0
    return FitResult(float(coef[0]), float(coef[1]), float(r2),
                     float(np.sqrt(np.mean(resid**2))), float(np.max(np.abs(resid) / y)))


def _weighted_lstsq(a, y, w):
    return np.linalg.lstsq(a * w[:, None], y * w, rcond=None)[0]


# --------------------------------------------------------------------- units

_DECIMAL = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BINARY = {"ki": 1024.0, "mi": 1024.0**2, "gi": 1024.0**3, "ti": 1024.0**4}
_SIZE_UNITS = {f"{pre}b": mult for pre, mult in {**_DECIMAL, **_BINARY}.items()}  # -> bytes
_BANDWIDTH_UNITS = {  # -> bytes per second
    **{f"{pre}bit{s}": mult / 8 for pre, mult in _DECIMAL.items() for s in ("", "/s")},
    **{f"{unit}/s": mult for unit, mult in _SIZE_UNITS.items()},
}
_LATENCY_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}  # -> seconds
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z/]*)\s*$", re.IGNORECASE)


def _parse(text, units, what, allow_zero, default_unit=None):
    """One parser for every quantity so all give the same style of error:
    the bad value plus the full list of units accepted."""
    accepted = ", ".join(units)
    if str(text).strip().startswith("-"):
        raise ValueError(f"{what} must not be negative, got {text!r}")
    m = _QUANTITY.match(str(text))
    if not m:
        raise ValueError(f"cannot parse {what} {text!r}: expected a number and a unit ({accepted})")
    unit = m.group(2).lower() or default_unit
    if unit not in units:
        raise ValueError(f"unknown {what} unit in {text!r}; accepted units: {accepted}")
    value = float(m.group(1)) * units[unit]
    if value < 0 or (value == 0 and not allow_zero) or not math.isfinite(value):
        raise ValueError(f"{what} must be {'>= 0' if allow_zero else '> 0'}, got {text!r}")
    return value


def parse_bandwidth(text):
    """'10gbit' -> 1.25e9 bytes/s. A unit is required: bits vs bytes is the
    classic factor-of-8 mistake, so a bare number is refused."""
    return _parse(text, _BANDWIDTH_UNITS, "bandwidth", allow_zero=False)


def parse_latency(text):
    """'20us' -> 2e-5 s. Zero is allowed (an idealised network)."""
    return _parse(text, _LATENCY_UNITS, "latency", allow_zero=True)


def parse_size(text):
    """'233MB' -> 2.33e8 bytes (decimal prefixes; KiB/MiB/... are binary).
    A bare number is bytes."""
    return _parse(text, _SIZE_UNITS, "size", allow_zero=False, default_unit="b")
