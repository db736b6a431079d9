"""The tasks of `pipe-horovod convergence`: model, data, optimizer settings.

Every task trains on scikit-learn's digits (1,797 8x8 images, shipped with
scikit-learn: nothing is downloaded), with the train/test split of
`examples/pytorch_digits.py` (80/20, stratified, fixed seed), so all runs of
all tasks are scored on the same 360 held-out images.

* ``digits-cnn``: the job of `make run`, taken from
  `examples/pytorch_digits.py` itself (its `Net`, `load_data`,
  `learning_rate` and its argparse defaults: lr 0.15 with a 1-epoch linear
  warm-up then cosine to 0, momentum 0.5, batch 32 per worker, 25 epochs),
  so the two cannot drift apart.
* ``hvd-mnist``: the shape of Horovod's `examples/pytorch/pytorch_mnist.py`:
  the digits upsampled to 28x28 (bilinear), Horovod's MNIST net (conv 1->10
  k5, conv 10->20 k5, Dropout2d, fc 320->50, dropout, fc 50->10,
  log-softmax + NLL), SGD with lr 0.05 x size, momentum 0.5, batch 64 per
  worker, constant learning rate, 15 epochs.
* ``hvd-mnist-lr2x``: the same at twice the learning rate (0.1 x size),
  the task where the one-step delay hurts more (docs/convergence.md says
  how it was picked among the candidates below).

Candidates tried for the third task, kept so the choice can be re-checked
(`--tasks hvd-mnist-deep,hvd-mnist-m09`): ``hvd-mnist-deep`` (a third 3x3
convolution and a 2-layer head, Horovod's other settings), ``hvd-mnist-m09``
(momentum 0.9 instead of 0.5).

No torch import at module level: `pipe-horovod` lists the task names
without torch.
"""
import functools
import importlib.util
import math
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
DIGITS_EXAMPLE = REPO / "examples" / "pytorch_digits.py"
MNIST_SIDE = 28


@dataclass(frozen=True)
class Task:
    name: str
    summary: str
    epochs: int
    batch_size: int                 # per worker
    momentum: float
    lr: float                       # peak learning rate per worker count 1; see lr_scaled
    lr_scaled_by_size: bool         # Horovod's examples: lr x size
    schedule: str                   # "digits-example" (warm-up + cosine) or "constant"
    model: str                      # key of MODELS
    data: str                       # key of DATA
    loss: str                       # "cross_entropy" (logits) or "nll" (log-probabilities)
    input_shape: tuple
    extra: dict = field(default_factory=dict)

    def base_lr(self, size):
        return self.lr * size if self.lr_scaled_by_size else self.lr

    def lr_at(self, step, total_steps, steps_per_epoch, size):
        """Learning rate of global step `step` (0-based)."""
        if self.schedule == "constant":
            return self.base_lr(size)
        if self.schedule == "digits-example":
            ex = digits_example()
            return ex.learning_rate(_example_defaults(), step, total_steps, steps_per_epoch)
        raise ValueError(f"unknown schedule {self.schedule!r}")

    def describe(self, size):
        """The settings, as recorded in the raw and summary JSON."""
        return {"name": self.name, "summary": self.summary, "epochs": self.epochs,
                "batch_size_per_worker": self.batch_size, "momentum": self.momentum,
                "lr": self.base_lr(size), "lr_per_worker_count_1": self.lr,
                "lr_scaled_by_size": self.lr_scaled_by_size, "schedule": self.schedule,
                "model": self.model, "data": self.data, "loss": self.loss,
                "input_shape": list(self.input_shape), **self.extra}


# ----------------------------------------------------------- the digits example

@functools.lru_cache(maxsize=None)
def digits_example():
    """examples/pytorch_digits.py as a module (not a package: loaded from its path)."""
    if not DIGITS_EXAMPLE.is_file():
        raise FileNotFoundError(
            f"{DIGITS_EXAMPLE} not found: the digits-cnn task uses the example's own model, "
            "data and hyperparameters; run from a checkout of the repository")
    spec = importlib.util.spec_from_file_location("pipe_horovod_example_pytorch_digits",
                                                  DIGITS_EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=None)
def _example_defaults():
    return digits_example().parse_args([])


def _digits_cnn_task():
    d = _example_defaults()
    return Task(name="digits-cnn",
                summary="the digits CNN of `make run` (examples/pytorch_digits.py, its defaults)",
                epochs=d.epochs, batch_size=d.batch_size, momentum=d.momentum, lr=d.lr,
                lr_scaled_by_size=False, schedule="digits-example", model="digits-cnn",
                data="digits-8x8", loss="cross_entropy", input_shape=(1, 8, 8),
                extra={"lr_warmup_epochs": d.lr_warmup_epochs})


def _hvd_mnist(name, summary, lr=0.05, momentum=0.5, model="hvd-mnist", epochs=15):
    return Task(name=name, summary=summary, epochs=epochs, batch_size=64, momentum=momentum,
                lr=lr, lr_scaled_by_size=True, schedule="constant", model=model,
                data="digits-28x28", loss="nll", input_shape=(1, MNIST_SIDE, MNIST_SIDE))


def _tasks():
    return {
        "digits-cnn": _digits_cnn_task,
        "hvd-mnist": lambda: _hvd_mnist(
            "hvd-mnist", "Horovod's pytorch_mnist.py shape: digits at 28x28, its net, "
                         "SGD lr 0.05 x size, momentum 0.5, batch 64"),
        "hvd-mnist-lr2x": lambda: _hvd_mnist(
            "hvd-mnist-lr2x", "hvd-mnist at twice the learning rate (0.1 x size)", lr=0.1),
        "hvd-mnist-deep": lambda: _hvd_mnist(
            "hvd-mnist-deep", "hvd-mnist with a deeper net (3 convolutions, 2-layer head)",
            model="hvd-mnist-deep"),
        "hvd-mnist-m09": lambda: _hvd_mnist(
            "hvd-mnist-m09", "hvd-mnist with momentum 0.9", momentum=0.9),
    }


TASK_NAMES = ("digits-cnn", "hvd-mnist", "hvd-mnist-lr2x", "hvd-mnist-deep", "hvd-mnist-m09")
DEFAULT_TASKS = ("digits-cnn", "hvd-mnist", "hvd-mnist-lr2x")
# The bench models (`pipe-horovod bench --model NAME`): one per distinct task model.
MODEL_NAMES = ("digits-cnn", "hvd-mnist", "hvd-mnist-deep")


def get_task(name):
    try:
        return _tasks()[name]()
    except KeyError:
        raise ValueError(f"unknown task {name!r}; choose from {', '.join(TASK_NAMES)}") from None


# --------------------------------------------------------------------- models

def _hvd_mnist_net():
    import torch.nn as nn
    import torch.nn.functional as F

    class HorovodMnistNet(nn.Module):
        """Horovod's examples/pytorch/pytorch_mnist.py `Net`, layer for layer."""

        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
            self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
            self.conv2_drop = nn.Dropout2d()
            self.fc1 = nn.Linear(320, 50)
            self.fc2 = nn.Linear(50, 10)

        def forward(self, x):
            x = F.relu(F.max_pool2d(self.conv1(x), 2))
            x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
            x = x.view(-1, 320)
            x = F.relu(self.fc1(x))
            x = F.dropout(x, training=self.training)
            x = self.fc2(x)
            return F.log_softmax(x, dim=1)

    return HorovodMnistNet()


def _hvd_mnist_deep_net():
    import torch.nn as nn
    import torch.nn.functional as F

    class DeepMnistNet(nn.Module):
        """Horovod's MNIST net with one more convolution and one more dense layer."""

        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
            self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
            self.conv3 = nn.Conv2d(20, 40, kernel_size=3, padding=1)
            self.conv3_drop = nn.Dropout2d()
            self.fc1 = nn.Linear(640, 100)
            self.fc2 = nn.Linear(100, 50)
            self.fc3 = nn.Linear(50, 10)

        def forward(self, x):
            x = F.relu(F.max_pool2d(self.conv1(x), 2))        # 10 x 12 x 12
            x = F.relu(self.conv2(x))                          # 20 x 8 x 8
            x = F.relu(F.max_pool2d(self.conv3_drop(self.conv3(x)), 2))   # 40 x 4 x 4
            x = F.relu(self.fc1(x.flatten(1)))
            x = F.dropout(x, training=self.training)
            x = F.relu(self.fc2(x))
            return F.log_softmax(self.fc3(x), dim=1)

    return DeepMnistNet()


def build_model(name):
    """A fresh model (weights from torch's global RNG, as the examples do)."""
    if name == "digits-cnn":
        return digits_example().Net()
    if name == "hvd-mnist":
        return _hvd_mnist_net()
    if name == "hvd-mnist-deep":
        return _hvd_mnist_deep_net()
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODEL_NAMES)}")


def bench_model(name):
    """(model, input shape, classes) for `pipe-horovod bench --model NAME`."""
    shape = (1, 8, 8) if name == "digits-cnn" else (1, MNIST_SIDE, MNIST_SIDE)
    return build_model(name), shape, 10


def bench_sgd(name):
    """SGD settings of the tasks on bench model `name` (all use momentum 0.5), else None."""
    if name not in MODEL_NAMES:
        return None
    return {"lr": 0.05, "momentum": 0.5}


# ----------------------------------------------------------------------- data

@functools.lru_cache(maxsize=None)
def load_data(name):
    """(x_train, y_train, x_test, y_test): the example's split and standardization;
    'digits-28x28' upsamples its images bilinearly to 28x28 and standardizes again
    by the training set's statistics (as MNIST's Normalize does with MNIST's)."""
    x_tr, y_tr, x_te, y_te = digits_example().load_data()
    if name == "digits-8x8":
        return x_tr, y_tr, x_te, y_te
    if name == "digits-28x28":
        import torch.nn.functional as F

        def up(x):
            return F.interpolate(x, size=(MNIST_SIDE, MNIST_SIDE), mode="bilinear",
                                 align_corners=False)

        x_tr, x_te = up(x_tr), up(x_te)
        mean, std = x_tr.mean(), x_tr.std()
        return (x_tr - mean) / std, y_tr, (x_te - mean) / std, y_te
    raise ValueError(f"unknown data {name!r}")


def loss_fn(task):
    import torch.nn.functional as F

    return F.cross_entropy if task.loss == "cross_entropy" else F.nll_loss


def evaluate(model, x, y):
    """(held-out accuracy, loss), with the example's own evaluation; cross-entropy of
    log-probabilities equals their NLL, so it serves both losses."""
    return digits_example().evaluate(model, x, y)


def steps_per_epoch(task, n_train, size):
    """The example's equal shards: len(train) // size images, in batches of batch_size."""
    return math.ceil((n_train // size) / task.batch_size)
