"""What the Keras optimizer's modules need to know about variables and gradients, in one
place below them all: optimizer.py, callbacks.py and keras2_gradients.py (here and in
pipe_horovod.keras) import these, and none of them imports another for them (no import
circle between the three)."""


def backend():
    import keras
    return keras.backend.backend()


def same_variable(variable, other):
    """Whether `other` names `variable`: the Keras variable itself or its backend variable."""
    return other is variable or other is getattr(variable, "value", None) or \
        variable is getattr(other, "value", None)


def dense(grad):
    """A gradient as the engine takes it: a TensorFlow IndexedSlices (an Embedding's)
    made dense; None (no gradient) and dense tensors as they are."""
    if grad is None or backend() != "tensorflow":
        return grad
    import tensorflow as tf
    if isinstance(grad, tf.IndexedSlices):
        return tf.convert_to_tensor(grad)
    return grad
