"""`horovod.tensorflow.util`'s one name that Horovod's users and tests import.

Horovod's own TensorFlow tests (and scripts written against them) do
`from horovod.tensorflow.util import _executing_eagerly` and call
`hvd._executing_eagerly()` / `hvd.util._executing_eagerly()`; with the import
changed to pipe_horovod.tensorflow those must resolve here.
"""
import tensorflow as tf


def _executing_eagerly():
    """True where TensorFlow runs eagerly (not inside a tf.function or a TF1 graph)."""
    return tf.executing_eagerly()
