"""horovod.tensorflow.keras.load_model: a saved model back, its optimizer pipelined.

Horovod's resume pattern loads the last checkpoint on rank 0 alone and
broadcasts it (BroadcastGlobalVariablesCallback). The checkpoint may hold
a plain Keras optimizer (saved before switching to pipe_horovod, or by
Horovod) or a pipe_horovod one; either way the model comes back compiled
as it was saved, with a pipelined optimizer holding the saved state:
iterations and slots, and for a pipe_horovod checkpoint the gradients in
flight too.
"""
from .._keras.optimizer import PipelinedKeras, pipe_options
from ..compression import Compression
from .optimizer import DistributedOptimizer


def load_model(filepath, custom_optimizers=None, custom_objects=None,
               compression=Compression.none, legacy_opts=False):
    """Load a Keras model saved with model.save(), its optimizer a DistributedOptimizer.

    custom_optimizers: optimizer classes of the user's own that the file names.
    custom_objects: passed to keras.models.load_model. compression: for a
    plain optimizer, the wrapper's; a pipe_horovod checkpoint keeps its own
    (a different one given here is a ValueError). Keras 3 has no legacy
    optimizers, so legacy_opts=True is a ValueError.
    """
    import keras

    if legacy_opts:
        raise ValueError("legacy_opts=True loads tf.keras.optimizers.legacy optimizers, which "
                         "Keras 3 does not have; pipe_horovod.keras loads Keras 3 models")
    objects = {cls.__name__: cls for cls in custom_optimizers or ()}
    objects.update(custom_objects or {})
    model = keras.models.load_model(filepath, custom_objects=objects)
    saved = getattr(model, "optimizer", None)
    if saved is None:
        return model                              # saved uncompiled: nothing to wrap
    if isinstance(saved, PipelinedKeras):
        own = pipe_options(saved)["compression"]
        if compression is not Compression.none and compression is not own:
            raise ValueError(f"{filepath} was saved with compression {own.name}; load_model's "
                             f"compression={compression.name} would change it mid-run (the "
                             "error-feedback residuals belong to the codec): leave it out")
        return model
    wrapped = DistributedOptimizer(type(saved).from_config(saved.get_config()),
                                   compression=compression)
    if saved.built:
        wrapped.build(model.trainable_variables)
        state = {}
        saved.save_own_variables(state)
        wrapped.load_own_variables(state)
    config = dict(model.get_compile_config())     # the loss and metrics, as saved
    config.pop("optimizer")
    with keras.saving.custom_object_scope(objects):
        config = keras.saving.deserialize_keras_object(config)
    model.compile(optimizer=wrapped, **config)
    return model
