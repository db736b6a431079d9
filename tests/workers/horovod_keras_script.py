"""A Keras training script in the shape of Horovod's TensorFlow 2 Keras MNIST
example, switched to pipe_horovod by its import line alone.

What a Horovod user writes and this must run unchanged: the optimizer
wrapped with Horovod's keyword arguments, the learning rate scaled by
size() and warmed up with Horovod's `initial_lr`, a repeating, shuffled
tf.data pipeline with steps_per_epoch, checkpoints written by rank 0 only,
progress on rank 0 only, and no flush() anywhere. (Keras 3 itself no longer
accepts compile's experimental_run_tf_function nor .h5 checkpoints of whole
models: those two lines change with or without pipe_horovod.)

`python horovod_keras_script.py OUT_DIR EPOCHS`: trains up to EPOCHS; the final weights
go to OUT_DIR. Launched again on the same OUT_DIR with more EPOCHS, it resumes as
Horovod's Keras ImageNet example does: rank 0 finds the last checkpoint and broadcasts
its epoch, loads it alone with hvd.load_model, and BroadcastGlobalVariablesCallback
gives the others its state.
"""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import pipe_horovod.keras as hvd  # was: import horovod.tensorflow.keras as hvd  # noqa: E402


def main(out_dir, epochs):
    hvd.init()
    digits = load_digits()
    images = (digits.images[..., np.newaxis] / 16.0).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((images, digits.target.astype("int64")))
    dataset = dataset.repeat().shuffle(2000, seed=hvd.rank()).batch(32)

    checkpoint_format = os.path.join(out_dir, "checkpoint-{epoch}.keras")
    resume_from_epoch = 0
    for try_epoch in range(epochs, 0, -1):
        if os.path.exists(checkpoint_format.format(epoch=try_epoch)):
            resume_from_epoch = try_epoch
            break
    resume_from_epoch = int(hvd.broadcast(resume_from_epoch, 0, name="resume_from_epoch"))
    scaled_lr = 0.001 * hvd.size()
    if resume_from_epoch > 0 and hvd.rank() == 0:
        model = hvd.load_model(checkpoint_format.format(epoch=resume_from_epoch))
    else:
        model = compiled_model(scaled_lr)
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                 hvd.callbacks.MetricAverageCallback(),
                 hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=1,
                                                          verbose=1)]
    if hvd.rank() == 0:
        callbacks.append(tf.keras.callbacks.ModelCheckpoint(checkpoint_format))
    history = model.fit(dataset, steps_per_epoch=40 // hvd.size(), callbacks=callbacks,
                        initial_epoch=resume_from_epoch, epochs=epochs,
                        verbose=1 if hvd.rank() == 0 else 0)

    # Every rank trained the same model: the same weights everywhere.
    mine = np.concatenate([w.ravel() for w in model.get_weights()])
    assert np.array_equal(hvd.allreduce(mine, op=hvd.Sum), mine * hvd.size()), "ranks differ"
    assert np.isfinite(history.history["loss"]).all()
    if hvd.rank() == 0:
        np.save(os.path.join(out_dir, f"weights-{epochs}.npy"), mine)
    print(f"WORKER_OK rank={hvd.rank()} resumed_from={resume_from_epoch}", flush=True)


def compiled_model(scaled_lr):
    model = tf.keras.Sequential([
        tf.keras.Input((8, 8, 1)),
        tf.keras.layers.Conv2D(8, 3, activation="relu"),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dropout(0.25),
        tf.keras.layers.Dense(32, activation="relu"),
        tf.keras.layers.Dense(10, activation="softmax"),
    ])
    opt = hvd.DistributedOptimizer(tf.optimizers.Adam(scaled_lr), backward_passes_per_step=1,
                                   average_aggregated_gradients=True)
    model.compile(loss=tf.losses.SparseCategoricalCrossentropy(), optimizer=opt,
                  metrics=["accuracy"])
    return model


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
