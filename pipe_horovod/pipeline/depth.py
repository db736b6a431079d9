"""Which pipeline depth is in force, and saying so once.

A Horovod user who switched imports must not be surprised by gradients
applied one step late: rank 0 logs the depth, where it came from, and how
to get Horovod's synchronous updates back. Shared by both adapters.
"""
import logging
import os

from .. import engine

DEPTH_VARIABLE = "PIPE_HOROVOD_PIPELINE_DEPTH"
_log = logging.getLogger("pipe_horovod")


def resolve_depth(pipeline_depth):
    """The depth in force: the argument, else $PIPE_HOROVOD_PIPELINE_DEPTH, else 2.

    Rank 0 says which (announce_depth, once per setting and adapter): a
    Horovod user who switched imports must not be surprised by gradients
    applied one step late.
    """
    source = "pipeline_depth argument"
    if pipeline_depth is None:
        value = os.environ.get(DEPTH_VARIABLE)
        if value is None:
            pipeline_depth, source = 2, "default"
        else:
            try:
                pipeline_depth = int(value)
            except ValueError:
                raise ValueError(f"{DEPTH_VARIABLE} must be an integer >= 1, got {value!r}") from None
            source = DEPTH_VARIABLE
    return pipeline_depth, source


def announce_depth(depth, warmup_steps, source, process_set, announced):
    """Log the depth on the first rank of the set, unless `announced` (the adapter's
    set of settings explained already) holds it."""
    first = 0 if process_set is None else process_set.ranks[0]
    if engine.rank() != first or (depth, warmup_steps, source) in announced:
        return
    announced.add((depth, warmup_steps, source))
    if depth == 1:
        meaning = "synchronous: each step applies its own averaged gradient, as Horovod does"
    else:
        meaning = (f"Pipe-SGD: each step applies the averaged gradient from {depth - 1} step(s) "
                   f"earlier (after {warmup_steps} synchronous warm-up step(s)); call flush() "
                   f"to apply the last ones; {DEPTH_VARIABLE}=1 or pipeline_depth=1 gives "
                   "Horovod's synchronous updates")
    _log.warning("pipe_horovod: pipeline_depth=%d (%s): %s", depth, source, meaning)


def report_unapplied(count, how="call optimizer.flush() at the end of training (and before "
                                   "evaluating or saving) to apply them"):
    """At shutdown: say (rank 0) how many computed gradients were never applied."""
    if count and engine.rank() == 0:
        _log.warning("pipe_horovod: %d computed gradient(s) were not applied because flush() "
                     "was not called after the last step(); %s", count, how)
