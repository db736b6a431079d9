#!/usr/bin/env python
"""Run a training script with Keras's MNIST loader answering synthetic data, then
say how the script left its Keras models (scripts/horovod_compat_keras.py reads it).

    python run_with_synthetic_mnist.py SCRIPT [ARGS...]

Horovod's Keras examples download MNIST, and nothing can be downloaded here.
Every `keras.datasets.mnist.load_data` (the `keras.` and the `tf.keras.` module
alike) returns arrays of MNIST's shapes and dtypes instead: 28x28 uint8 images,
labels 0-9, SYNTHETIC_MNIST_TRAIN (default 2048) training and
SYNTHETIC_MNIST_TEST (512) test images. Each image is noise with a bright band
whose rows encode its label, so a model can learn them and its accuracy means
something. The script itself runs unchanged (`runpy`, as `__main__`, with
SCRIPT and ARGS as its argv).

After it returns, each rank prints one line:
`EXAMPLE_END rank=R models=M in_flight=F weights=SHA` with, over the Keras
models it trained (kept from their `fit`), how many gradients their optimizers
hold unapplied and a hash of their trainable weights (the same on every rank
when they agree). Non-trainable state is left out: BatchNormalization's moving
statistics follow each rank's own batches, in Horovod as well (its synthetic
benchmark's MobileNetV2 ends with them different on every rank).
"""
import hashlib
import os
import runpy
import sys

import numpy as np


def synthetic_mnist(path="mnist.npz"):
    """MNIST's ((x_train, y_train), (x_test, y_test)), made up: see the module docstring."""
    rng = np.random.default_rng(0)

    def part(n):
        labels = rng.integers(0, 10, n).astype("uint8")
        images = rng.integers(0, 64, (n, 28, 28)).astype("uint8")
        for label in range(10):
            images[labels == label, 2 + 2 * label:4 + 2 * label, 4:24] = 255
        return images, labels
    return (part(int(os.environ.get("SYNTHETIC_MNIST_TRAIN", 2048))),
            part(int(os.environ.get("SYNTHETIC_MNIST_TEST", 512))))


_trained = []      # every model fit() ran on, kept past the script's own scopes


def patch_keras():
    """Synthetic MNIST, and note each model fit() trains."""
    import keras
    import tensorflow as tf

    for module in (keras.datasets.mnist, tf.keras.datasets.mnist):
        module.load_data = synthetic_mnist
    fit = keras.Model.fit

    def noted_fit(model, *args, **kwargs):
        if not any(m is model for m in _trained):
            _trained.append(model)
        return fit(model, *args, **kwargs)
    keras.Model.fit = noted_fit


def keras_value(variable):
    import keras
    return keras.ops.convert_to_numpy(variable)


def report():
    """The EXAMPLE_END line (module docstring)."""
    models = _trained
    digest = hashlib.sha256()
    in_flight = 0
    for model in models:
        for weight in model.trainable_weights:
            digest.update(np.ascontiguousarray(keras_value(weight)).tobytes())
        in_flight += int(getattr(getattr(model, "optimizer", None), "in_flight", 0) or 0)
    rank = os.environ.get("HOROVOD_RANK", os.environ.get("RANK", "0"))
    print(f"EXAMPLE_END rank={rank} models={len(models)} in_flight={in_flight} "
          f"weights={digest.hexdigest()[:16]}", flush=True)


def main():
    script, *args = sys.argv[1:]
    patch_keras()
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
    report()


if __name__ == "__main__":
    main()
