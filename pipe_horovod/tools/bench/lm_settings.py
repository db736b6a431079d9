"""The transformer task's settings and the choices its command offers, below both the task
(convergence_lm.py, which runs one study) and the sweep over it (convergence_sweep.py,
which runs many): each imports these, so neither imports the other for them."""
from dataclasses import dataclass

FRAMEWORKS = ("torch", "keras-tf", "keras-torch")
TARGET = 0.02          # the default ends within 0.02 validation loss of sync
SCHEDULES = ("warmup-cosine", "cosine", "exponential", "piecewise", "constant")
CLIPPINGS = ("global", "norm", "none")
INITS = ("own", "keras", "torch")


@dataclass
class Settings:
    steps: int = 500
    batch: int = 16              # windows per rank per step
    context: int = 64
    d_model: int = 64
    layers: int = 2
    heads: int = 4
    lr: float = 3e-3             # x size (Horovod's rule)
    warmup: int = 50
    min_lr_ratio: float = 0.1    # cosine from peak down to this fraction of it
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    clip: float = 1.0
    # Keras only (the sweep's): the LearningRateSchedule (SCHEDULES), how the
    # optimizer clips (CLIPPINGS: global_clipnorm=clip, clipnorm=clip, none) and whether it
    # decays weights (weight_decay > 0: AdamW; 0: Adam).
    schedule: str = "warmup-cosine"
    clipping: str = "global"
    # The kernels' initializer (INITS): "own", the framework's library's (Keras's
    # glorot_uniform and zero biases, torch.nn's bounds), or one library's in either model
    # (keras_model and torch_model say how): the sweep asks whether it decides the lag.
    init: str = "own"
    # The lookahead configurations' prediction_exchange ("int4", "int8"; "none": the own
    # gradient): the prediction from the ranks' exchanged average (the sweep's direction
    # (c)). None: the adapter's default (Keras: int4; PyTorch: the own gradient).
    exchange: str = None
    eval_every: int = 50
    train_chars: int = 1_000_000
    val_chars: int = 100_000
    val_windows: int = 256
