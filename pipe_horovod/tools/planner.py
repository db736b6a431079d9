"""What the toolbox adds to the timing model: fitting a link to a measured sweep, and
the units the command line reads.

The model itself (collective costs, Schedule, Workload, Bucketing, predict) is the
runtime's, pipe_horovod/pipeline/timing_model.py, because a run that tunes itself
predicts its candidates with it; `pipe-horovod model`, `plan`, the benchmark's
"predicted" column and the fit below all use that one model. numpy is needed here only
(the least-squares fit).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from pipe_horovod.collectives.cost_model import Network
from pipe_horovod.pipeline.timing_model import allreduce_time


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
