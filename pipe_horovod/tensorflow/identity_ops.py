"""horovod.tensorflow's identity ops: rank, size and membership read when the op runs.

Horovod offers `rank_op()` beside `rank()` so a graph built in one job can run
in another (an elastic reset changes the rank and size under a traced
tf.function). Here each is a stateful graph op (bridge.run) that asks the
engine running at that moment; eagerly it is a scalar int32 tensor at once.
`process_set_included_op` answers with Horovod's error codes instead of
raising, as Horovod's does: -1 before init(), -3 for an unknown set.
"""
import numpy as np
import tensorflow as tf

from .. import engine
from . import bridge

NOT_INITIALIZED = -1        # HOROVOD_PROCESS_SET_ERROR_INIT
UNKNOWN_SET = -3            # HOROVOD_PROCESS_SET_ERROR_UNKNOWN_SET


def _scalar(value_of, name):
    out = bridge.run(lambda: [np.int32(value_of())], [], [tf.int32], name)[0]
    return tf.ensure_shape(tf.convert_to_tensor(out), ())


def _process_set(process_set_id):
    ps = engine.current().process_set_by_id(process_set_id)
    if ps is None:
        raise ValueError(f"no process set has id {process_set_id!r}: register it with "
                         "init(process_sets=[...]) or add_process_set() first")
    return ps


@tf.autograph.experimental.do_not_convert
def rank_op(name=None):
    """This process's rank, read when the op runs."""
    return _scalar(lambda: engine.current().rank(), name or "pipe_horovod_rank")


@tf.autograph.experimental.do_not_convert
def local_rank_op(name=None):
    """This process's rank on its machine, read when the op runs."""
    return _scalar(lambda: engine.current().local_rank(), name or "pipe_horovod_local_rank")


@tf.autograph.experimental.do_not_convert
def size_op(process_set_id=0, name=None):
    """The number of ranks (of the process set `process_set_id`), read when the op runs."""
    return _scalar(lambda: len(_process_set(process_set_id).ranks), name or "pipe_horovod_size")


@tf.autograph.experimental.do_not_convert
def local_size_op(name=None):
    """The number of ranks on this machine, read when the op runs."""
    return _scalar(lambda: engine.current().local_size(), name or "pipe_horovod_local_size")


@tf.autograph.experimental.do_not_convert
def process_set_included_op(process_set_id=0, name=None):
    """1 if this rank belongs to the process set `process_set_id`, else 0; -1 before
    init(), -3 for an id no set has (Horovod's codes)."""
    def included():
        if not engine.is_initialized():
            return NOT_INITIALIZED
        ps = engine.current().process_set_by_id(process_set_id)
        if ps is None:
            return UNKNOWN_SET
        return int(engine.current().rank() in ps.ranks)
    return _scalar(included, name or "pipe_horovod_process_set_included")


__all__ = ["local_rank_op", "local_size_op", "process_set_included_op", "rank_op", "size_op"]
