"""Framework-neutral core of the pipeline: what is reduced, when, and in which order.

Adapters (torch, keras) know where gradients live; this package owns what
happens to them as flat engine tensors (StepMachine), so both frameworks
share one implementation of the Pipe-SGD math.
"""
from .buckets import Bucket, plan_buckets
from .option_checks import check_options, check_reduction, compare_across_ranks
from .depth import DEPTH_VARIABLE, announce_depth, report_unapplied, resolve_depth
from .fifo import GradientFifo
from .staleness import check_prediction_exchange, check_staleness
from .step_machine import BucketReduction, StepGradient, StepMachine, opens_group

__all__ = ["Bucket", "plan_buckets", "check_options", "check_reduction", "compare_across_ranks",
           "DEPTH_VARIABLE", "announce_depth", "report_unapplied", "resolve_depth", "GradientFifo",
           "BucketReduction", "StepGradient", "StepMachine", "check_prediction_exchange",
           "check_staleness", "opens_group"]
