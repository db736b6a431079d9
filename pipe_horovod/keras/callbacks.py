"""Callbacks for `model.fit`, named and behaving like Horovod's Keras callbacks.

PipelineFlushCallback is ours: a pipelined optimizer holds the last K-1
gradients in flight, and whatever reads the weights (validation,
ModelCheckpoint, EarlyStopping, evaluate after fit) should see them applied.
"""
import warnings

import keras
import numpy as np
import torch

from .. import engine


def broadcast_variables(variables, root_rank):
    """Overwrite `variables` (Keras variables) with root's values, in place."""
    for variable in variables:
        value = torch.from_numpy(np.array(keras.ops.convert_to_numpy(variable.value), copy=True))
        engine.broadcast(value, root_rank)
        variable.assign(value.numpy())


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """At the start of training, give every rank root's weights and optimizer state.

    Runs at on_train_begin, once the model and its optimizer are built, so
    the first step already computes on the same weights everywhere. The
    optimizer's state travels whole (iterations, slots and, for a
    pipelined optimizer, the gradients in flight), so Horovod's resume
    pattern (rank 0 alone loads a checkpoint) continues exactly.
    """

    def __init__(self, root_rank=0):
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False

    def on_train_begin(self, logs=None):
        if self.broadcast_done:
            return
        model = self.model
        broadcast_variables(model.variables, self.root_rank)
        optimizer = getattr(model, "optimizer", None)
        _say_if_not_pipelined(optimizer)
        if optimizer is not None:
            if not optimizer.built:
                optimizer.build(model.trainable_variables)
            if hasattr(optimizer, "_join"):      # a pipelined optimizer: every rank is here
                optimizer._join()
            root = engine.rank() == self.root_rank
            store = {}
            if root:
                optimizer.save_own_variables(store)
            store = engine.broadcast_object(store if root else None, self.root_rank)
            if not root:
                optimizer.load_own_variables(store)
        self.broadcast_done = True


def _say_if_not_pipelined(optimizer):
    """Warn (every rank) where the broadcast callback trains with an unwrapped optimizer:
    legal, as with Horovod, but each rank then trains alone from the same start."""
    from .optimizer import _PipelinedKeras

    inner = getattr(optimizer, "inner_optimizer", None)      # LossScaleOptimizer
    if optimizer is None or engine.size() == 1 or isinstance(optimizer, _PipelinedKeras) \
            or isinstance(inner, _PipelinedKeras):
        return
    warnings.warn(
        f"BroadcastGlobalVariablesCallback: the model's optimizer "
        f"({type(optimizer).__name__}) is not a pipe_horovod DistributedOptimizer, so the "
        f"{engine.size()} ranks start from rank 0's weights but never average their "
        "gradients: each trains alone and their weights drift apart. Compile with "
        "optimizer=hvd.DistributedOptimizer(optimizer)", stacklevel=2)


class MetricAverageCallback(keras.callbacks.Callback):
    """Replace each epoch's metrics (training and validation) by their average over ranks.

    Put it before callbacks that read the metrics (ModelCheckpoint,
    EarlyStopping, ReduceLROnPlateau), so every rank decides alike.
    """

    def on_epoch_end(self, epoch, logs=None):
        if not logs or engine.size() == 1:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
        values = torch.tensor([float(logs[k]) for k in keys], dtype=torch.float64)
        engine.wait(engine.allreduce_async(values, f"pipe_horovod.metrics.{epoch}",
                                           engine.Average))
        logs.update(zip(keys, values.tolist()))


class LearningRateWarmupCallback(keras.callbacks.Callback):
    """Goyal et al.'s gradual warm-up: the learning rate ramps, batch by batch, from
    initial_learning_rate / size() to initial_learning_rate over `warmup_epochs`.

    As Horovod's (which calls the rate `initial_lr`), with one difference:
    Keras 3 reads an optimizer's momentum when it traces the train step, so
    `momentum_correction` is accepted but momentum is not rescaled.
    """

    def __init__(self, initial_learning_rate=None, warmup_epochs=5, momentum_correction=True,
                 steps_per_epoch=None, verbose=0, *, initial_lr=None):
        super().__init__()
        if not warmup_epochs > 0:
            raise ValueError(f"warmup_epochs must be > 0, got {warmup_epochs}")
        self.initial_learning_rate = _initial_rate(initial_learning_rate, initial_lr)
        self.warmup_epochs = warmup_epochs
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self.current_epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.current_epoch >= self.warmup_epochs:
            return
        steps = self.steps_per_epoch or self.params.get("steps")
        if not steps:
            raise ValueError("LearningRateWarmupCallback needs steps_per_epoch when fit() "
                             "cannot tell the number of steps per epoch")
        epoch = self.current_epoch + batch / steps
        size = engine.size()
        rate = self.initial_learning_rate / size * (epoch * (size - 1) / self.warmup_epochs + 1)
        self.model.optimizer.learning_rate = min(rate, self.initial_learning_rate)

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.warmup_epochs - 1:
            self.model.optimizer.learning_rate = self.initial_learning_rate
            if self.verbose and engine.rank() == 0:
                print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                      f"{self.initial_learning_rate:g}.")
        if logs is not None:
            logs["lr"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """initial_learning_rate * multiplier(epoch) from start_epoch until end_epoch, as
    Horovod's: `multiplier` is a number or a function of the epoch; with
    staircase=False the epoch is fractional and the rate changes every batch.
    momentum_correction is accepted and not applied (see LearningRateWarmupCallback).
    """

    def __init__(self, initial_learning_rate=None, multiplier=None, start_epoch=0,
                 end_epoch=None, staircase=True, momentum_correction=True, steps_per_epoch=None,
                 *, initial_lr=None):
        super().__init__()
        if multiplier is None:
            raise TypeError("LearningRateScheduleCallback needs a multiplier: a number or a "
                            "function of the epoch")
        self.initial_learning_rate = _initial_rate(initial_learning_rate, initial_lr)
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier)
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase = staircase
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0

    def _active(self, epoch):
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _set(self, epoch):
        rate = self.initial_learning_rate * self.multiplier(epoch)
        self.model.optimizer.learning_rate = rate

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch
        if self.staircase and self._active(epoch):
            self._set(epoch)

    def on_train_batch_begin(self, batch, logs=None):
        if self.staircase or not self._active(self.current_epoch):
            return
        steps = self.steps_per_epoch or self.params.get("steps")
        if not steps:
            raise ValueError("LearningRateScheduleCallback(staircase=False) needs "
                             "steps_per_epoch when fit() cannot tell the number of steps")
        self._set(self.current_epoch + batch / steps)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))


def _initial_rate(initial_learning_rate, initial_lr):
    """The rate given once, under Keras's name or Horovod's `initial_lr`."""
    if (initial_learning_rate is None) == (initial_lr is None):
        raise TypeError("give the target rate once, as initial_learning_rate (or "
                        "Horovod's initial_lr)")
    return float(initial_lr if initial_learning_rate is None else initial_learning_rate)


class PipelineFlushCallback(keras.callbacks.Callback):
    """Apply every gradient in flight after each epoch's last batch and at the end of fit.

    The flush comes after the last training batch, before fit() validates,
    so validation, ModelCheckpoint and EarlyStopping see weights with every
    computed gradient applied. The pipeline restarts with the next epoch.
    """

    def _flush(self):
        flush = getattr(self.model.optimizer, "flush", None)
        if flush is not None:
            flush()

    def on_train_batch_end(self, batch, logs=None):
        if batch + 1 == self.params.get("steps"):
            self._flush()

    def on_epoch_end(self, epoch, logs=None):
        self._flush()

    def on_train_end(self, logs=None):
        self._flush()
