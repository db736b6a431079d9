"""horovod.tensorflow.functions: variables and Python objects across ranks.

`broadcast_variables` is how a TF2 custom loop starts every rank from the
same weights (and, after a restore on rank 0, from its checkpoint). The
object collectives are pipe_horovod.common's (one implementation; the engine
names their transfers, so ranks passing different types do not deadlock as
Horovod 0.28.1's did). Horovod's `session=` (TF1) is accepted and must be None.
"""
import tensorflow as tf

from ..engine import global_process_set
from ..common import objects
from ..pipeline.identity import broadcast_description
from ..pipeline.option_checks import compare_across_ranks
from . import bridge
from .mpi_ops import broadcast


@tf.autograph.experimental.do_not_convert   # Python at trace time (see mpi_ops)
def broadcast_variables(variables, root_rank, process_set=global_process_set, inplace=False):
    """Assign `root_rank`'s values to `variables` (tf.Variables) on every rank.

    Call it eagerly after the first step built the model and the optimizer's
    slots (Horovod's pattern: `if first_batch: hvd.broadcast_variables(...)`;
    inside a tf.function it runs as graph ops too). `inplace` is accepted for
    Horovod's signature: the assignment is always in place. Returns None (Horovod
    returns a TF1 group op in graph mode; TF2 runs the assignments in order).

    Raises:
        TypeError: an entry is not a tf.Variable (its index says which).
        ValueError: eagerly, on every rank, where a position holds another kind, shape or
            dtype on some rank (pipeline/identity.py: what is compared, and why): root's
            values would be assigned to the wrong variables, with nothing said.
    """
    variables = list(variables)
    for i, variable in enumerate(variables):
        if not (isinstance(variable, tf.Variable) or bridge.is_keras_variable(variable)):
            raise TypeError(f"broadcast_variables: entry {i} is a {type(variable).__name__}, "
                            "not a tf.Variable or Keras variable")
    bridge.refuse_xla("broadcast_variables")
    if tf.executing_eagerly() and process_set.included():
        compare_across_ranks(
            lambda obj: objects.allgather_object(obj, process_set=process_set),
            broadcast_description((getattr(v, "path", None) or v.name, v.shape,
                                   tf.as_dtype(v.dtype).name) for v in variables),
            what="list of variables to broadcast")
    for variable in variables:                   # in a graph: ordered by control dependencies
        variable.assign(broadcast(variable, root_rank, process_set=process_set))


def broadcast_global_variables(root_rank):
    """Horovod's TF1 helper: root's values into every global variable of the graph.

    Eagerly (TensorFlow 2) there are no global variables: a RuntimeError, Horovod's,
    pointing to broadcast_variables. In a TF1 graph, one op running the assignments one
    after the other (ranks match collectives by their order, which a graph fixes only
    through control dependencies)."""
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution. "
                           "Please use `hvd.broadcast_variables(<model/optimizer variables>)` "
                           "instead.")
    last = []
    for variable in tf.compat.v1.global_variables():
        with tf.control_dependencies(last):
            last = [variable.assign(broadcast(variable, root_rank))]
    return tf.group(*last)


def _no_session(session, what):
    if session is not None:
        raise ValueError(f"{what}(session=...) is TensorFlow 1's; pipe_horovod.tensorflow runs "
                         "TensorFlow 2 eagerly: pass no session")


def broadcast_object(obj, root_rank=0, session=None, name=None, process_set=global_process_set):
    """`root_rank`'s picklable `obj` on every rank (eager; see pipe_horovod.common.objects)."""
    _no_session(session, "broadcast_object")
    return objects.broadcast_object(obj, root_rank, name, process_set)


def broadcast_object_fn(root_rank=0, session=None, name=None, process_set=global_process_set):
    """A function that broadcasts its argument from `root_rank` (Horovod's helper)."""
    _no_session(session, "broadcast_object_fn")
    return lambda obj: broadcast_object(obj, root_rank, name=name, process_set=process_set)


def allgather_object(obj, session=None, name=None, process_set=global_process_set):
    """Every rank's picklable `obj`, in rank order."""
    _no_session(session, "allgather_object")
    return objects.allgather_object(obj, name, process_set)
