"""The pipelined Keras 3 optimizer, shared by pipe_horovod.keras and pipe_horovod.tensorflow
(as horovod/_keras is by horovod.keras and horovod.tensorflow.keras).

Keras-library code only: it imports keras and pipe_horovod's engine, compression,
collectives, pipeline and common, never an adapter (torch/, tensorflow/, keras/). The
data path of each Keras backend lives with the adapter it runs on, which hands it down
(optimizer.use_data_path): TensorFlow's in pipe_horovod.tensorflow (the TF<->torch
bridge), torch's in pipe_horovod.keras (on the PyTorch adapter). So Keras on the torch
backend never needs TensorFlow, and pipe_horovod.tensorflow never imports
pipe_horovod.keras.
"""
