"""Adasum's combination rule, for engines whose library has no Adasum.

Adasum (Maleki et al., "Scaling Distributed Training with Adaptive
Summation", MLSys 2021) adds two gradients a and b as

    (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

which is their sum when they are orthogonal and their average when they
are equal, and combines 2^k ranks pairwise in a binary tree: ranks (0,1),
(2,3), ... first, then the pairs' results, as Horovod's recursive halving
does. Horovod runs it only through MPI (a Gloo-only Horovod 0.28.1 answers
"No Adasum operation enabled"), so the torch engine and the horovod engine
on Gloo gather every rank's tensor and apply the rule here: the same result
on every rank, computed in float64 and rounded once, at p times the bytes
of a ring allreduce.
"""


def _pair(a, b):
    dot = float((a * b).sum())
    a_sq, b_sq = float((a * a).sum()), float((b * b).sum())
    # Horovod skips the correction for (numerically) zero vectors.
    a_coeff = 1.0 - dot / (2 * a_sq) if a_sq >= 1e-8 else 1.0
    b_coeff = 1.0 - dot / (2 * b_sq) if b_sq >= 1e-8 else 1.0
    return a_coeff * a + b_coeff * b


def combine(parts):
    """Adasum of a power-of-2 number of same-shape tensors, in rank order."""
    level = [p.double() for p in parts]
    while len(level) > 1:
        level = [_pair(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0].to(parts[0].dtype)
