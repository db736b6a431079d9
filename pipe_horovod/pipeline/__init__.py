"""Framework-neutral core of the pipeline: what is reduced, when, and in which order.

Adapters (torch, keras) own tensors; this package owns the decisions, so
both frameworks share one implementation of the Pipe-SGD math.
"""
from .buckets import Bucket, plan_buckets
from .checks import check_options, compare_across_ranks
from .depth import DEPTH_VARIABLE, announce_depth, resolve_depth
from .fifo import GradientFifo
from .step_machine import BucketReduction, StepGradient, StepMachine

__all__ = ["Bucket", "plan_buckets", "check_options", "compare_across_ranks", "GradientFifo",
           "BucketReduction", "StepGradient", "StepMachine", "DEPTH_VARIABLE", "announce_depth",
           "resolve_depth"]
