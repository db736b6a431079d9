"""Wrap-time checks shared by the adapters: bad options and ranks that disagree.

A model that differs between ranks would otherwise surface as a hang or a
C++ error deep inside a collective; gathering every rank's description and
comparing it on every rank makes all of them raise the same readable error.
"""
import math
import numbers
import re


def _int_at_least(name, value, low):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


# Each step in flight holds a copy of the model's gradients, and a reduction needs K-1
# steps of compute to hide it: Pipe-SGD's gain is reached at K=2 or 3 (DESIGN.md). A depth
# beyond this is a typo (or steps per epoch), never a useful pipeline.
MAX_PIPELINE_DEPTH = 64


def check_options(pipeline_depth, warmup_steps, backward_passes_per_step, bucket_cap_mb):
    _int_at_least("pipeline_depth", pipeline_depth, 1)
    if pipeline_depth > MAX_PIPELINE_DEPTH:
        raise ValueError(
            f"pipeline_depth={pipeline_depth} would keep {pipeline_depth - 1} copies of the "
            f"gradients in flight and apply each gradient {pipeline_depth - 1} steps late; "
            f"depths above {MAX_PIPELINE_DEPTH} are refused: use 2 (the default) or 3, "
            "enough to hide a reduction that takes up to two steps of compute")
    _int_at_least("warmup_steps", warmup_steps, 0)
    _int_at_least("backward_passes_per_step", backward_passes_per_step, 1)
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, numbers.Real):
        raise TypeError(f"bucket_cap_mb must be a number, got {type(bucket_cap_mb).__name__}")
    if not (bucket_cap_mb > 0 and math.isfinite(bucket_cap_mb)):
        raise ValueError(f"bucket_cap_mb must be a finite number of megabytes > 0 (or None, "
                         f"the default: chosen from the ranks and the link), got {bucket_cap_mb}")


def check_reduction(op, gradient_predivide_factor):
    """Horovod's op and gradient_predivide_factor, as an optimizer wrapper accepts them."""
    from .. import engine

    if op not in (engine.Average, engine.Sum):
        raise ValueError(f"op must be pipe_horovod.Average or pipe_horovod.Sum, got {op!r}")
    if isinstance(gradient_predivide_factor, bool) or not isinstance(
            gradient_predivide_factor, numbers.Real) or not gradient_predivide_factor > 0:
        raise ValueError(f"gradient_predivide_factor must be a number > 0, got "
                         f"{gradient_predivide_factor!r}")
    if gradient_predivide_factor != 1.0 and op is not engine.Average:
        raise ValueError("gradient_predivide_factor is supported only with op=Average "
                         "(it splits the average around the sum), as in Horovod")


def refuse_double_wrapping(first, second, original):
    """Raise: `second` (a wrapper's public name) was handed what `first` made already.

    Why: each wrapper reduces every gradient it sees; two in a row average twice and,
    pipelined, delay twice (K=2 each: an effective depth of 3, and a zero update counted
    while the second fills), with nothing said. `original`: what to wrap instead.
    """
    raise ValueError(f"this optimizer is a DistributedOptimizer already; wrap the original "
                     f"{original} once: {first} wraps it, and {second} would reduce every "
                     "gradient a second time")


def _in_order(key):
    """Keys sorted with their numbers as numbers, so the first position that differs is
    the one named ("variable 2" before "variable 10")."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(key))]


def compare_across_ranks(allgather_object, description, what="model"):
    """Raise on every rank if any rank's `description` differs from rank 0's.

    `description` is a dict {key: value}; the error names the first key
    that differs and both ranks' values.
    """
    everyone = allgather_object(description)
    reference = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        if theirs == reference:
            continue
        for key in sorted(set(reference) | set(theirs), key=_in_order):
            mine, other = reference.get(key, "<missing>"), theirs.get(key, "<missing>")
            if mine != other:
                raise ValueError(f"the {what} differs between ranks: {key} is {other} on rank "
                                 f"{rank} but {mine} on rank 0; every rank must build the same "
                                 f"{what}")
