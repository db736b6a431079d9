"""One worker of tf.distribute.MultiWorkerMirroredStrategy running Keras 3 `fit`.

TF_CONFIG comes from the test. Prints MWMS_FIT_OK after a successful fit;
otherwise the exception propagates (non-zero exit, traceback on stderr).
"""
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)
strategy = tf.distribute.MultiWorkerMirroredStrategy()
print("keras", keras.__version__, "tensorflow", tf.__version__,
      "replicas", strategy.num_replicas_in_sync, flush=True)
rng = np.random.default_rng(0)
x = rng.standard_normal((64, 8)).astype("float32")
y = rng.integers(0, 2, 64)
with strategy.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, activation="relu"),
                              keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(x, y, batch_size=16, epochs=1, verbose=0)
print("MWMS_FIT_OK", flush=True)
