"""Callbacks for `model.fit`, named and behaving like Horovod's Keras callbacks.

BroadcastGlobalVariablesCallback, MetricAverageCallback,
LearningRateScheduleCallback, LearningRateWarmupCallback and
BestModelCheckpoint take horovod.tensorflow.keras's arguments and do what its
do. PipelineFlushCallback is ours: a pipelined optimizer holds the last K-1
gradients in flight (and, with "lookahead", this rank's predicted weights), and
whatever reads the weights (validation, ModelCheckpoint, EarlyStopping,
evaluate after fit) should see the real ones with every gradient applied.
A DistributedOptimizer with flush_in_fit=True (the default) gets one in every
fit, evaluate and predict without being asked (flush_in_every_fit).
"""
import numbers
import warnings

import keras
import numpy as np
import torch

from .. import engine
from .._keras.callbacks import (PipelineFlushCallback, join, pipelined_optimizer,  # noqa: F401
                                running_sums)
from .._keras.variables import same_variable as _same_variable


def broadcast_variables(variables, root_rank):
    """Overwrite `variables` (Keras variables) with root's values, in place."""
    for variable in variables:
        value = torch.from_numpy(np.array(keras.ops.convert_to_numpy(variable.value), copy=True))
        engine.broadcast(value, root_rank)
        variable.assign(value.numpy())


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Give every rank root's weights and optimizer state, once, as training starts.

    As Horovod's: `local_variables` (a variable or a collection of them) keep
    each rank's own values; `device` is accepted (the engine places the
    broadcast). The optimizer's state travels whole (iterations, slots and,
    for a pipelined optimizer, the gradients in flight), so Horovod's resume
    pattern (rank 0 alone loads a checkpoint) continues exactly; only a
    backward_passes_per_step cycle's running sums stay each rank's own.

    When: at on_train_begin when the model has its variables by then (the
    first step then computes on the same weights everywhere); a model built by
    its first batch (a Sequential without an Input, a subclassed model) has
    none yet, so, as Horovod does, after the first batch, which each rank
    computed from its own start and which the broadcast then overrides.
    """

    def __init__(self, root_rank=0, device="", local_variables=None):
        super().__init__()
        if isinstance(root_rank, bool) or not isinstance(root_rank, numbers.Integral):
            raise TypeError(f"BroadcastGlobalVariablesCallback: root_rank must be a rank (an "
                            f"int), got {root_rank!r}")
        if not isinstance(device, str):
            raise TypeError(f"BroadcastGlobalVariablesCallback: device must be a device name "
                            f"(a str, '' for the default), got {device!r}")
        self.root_rank = int(root_rank)
        self.device = device
        self.broadcast_done = False
        if local_variables is None:
            local_variables = []
        elif _is_variable(local_variables):
            local_variables = [local_variables]
        else:
            local_variables = list(local_variables)
        bad = [v for v in local_variables if not _is_variable(v)]
        if bad:
            raise TypeError(f"BroadcastGlobalVariablesCallback: local_variables must be "
                            f"variables (Keras or tf.Variable), got {type(bad[0]).__name__}")
        self._local_vars = list(local_variables)

    def register_local_var(self, var):
        """Keep `var` out of the broadcast (Horovod's method of the same name)."""
        self._local_vars.append(var)

    def on_train_begin(self, logs=None):
        if not 0 <= self.root_rank < engine.size():
            raise ValueError(f"BroadcastGlobalVariablesCallback: root_rank={self.root_rank} is "
                             f"not a rank of this job (size {engine.size()})")
        if not self.broadcast_done and self.model.built and self.model.variables:
            optimizer = getattr(self.model, "optimizer", None)
            if optimizer is not None and not optimizer.built:
                optimizer.build(self.model.trainable_variables)
            self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        if not self.broadcast_done:
            self._broadcast()

    def _broadcast(self):
        model = self.model
        broadcast_variables([v for v in model.variables
                             if not any(_same_variable(v, local) for local in self._local_vars)],
                            self.root_rank)
        optimizer = getattr(model, "optimizer", None)
        _say_if_not_pipelined(optimizer)
        if optimizer is not None and optimizer.built:
            pipelined = pipelined_optimizer(optimizer)
            if pipelined is not None:
                join(pipelined)                  # every rank is here
            own = running_sums(pipelined)
            root = engine.rank() == self.root_rank
            store = {}
            if root:
                optimizer.save_own_variables(store)
            store = engine.broadcast_object(store if root else None, self.root_rank)
            if not root:
                optimizer.load_own_variables(store)
                for variable, value in own:
                    variable.assign(value)
        self.broadcast_done = True


def _is_variable(value):
    if isinstance(value, keras.Variable):
        return True
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf
        return isinstance(value, tf.Variable)
    return False


def _say_if_not_pipelined(optimizer):
    """Warn (every rank) where the broadcast callback trains with an unwrapped optimizer:
    legal, as with Horovod, but each rank then trains alone from the same start."""
    if optimizer is None or engine.size() == 1 or pipelined_optimizer(optimizer) is not None:
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
    EarlyStopping, ReduceLROnPlateau), so every rank decides alike. `device`
    is Horovod's argument, accepted (the engine places the reduction).
    """

    def __init__(self, device=""):
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch, logs=None):
        if not logs or engine.size() == 1:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
        values = torch.tensor([float(logs[k]) for k in keys], dtype=torch.float64)
        engine.wait(engine.allreduce_async(values, f"pipe_horovod.metrics.{epoch}",
                                           engine.Average))
        logs.update(zip(keys, values.tolist()))


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """initial_lr * multiplier(epoch) from start_epoch until end_epoch, as Horovod's.

    `multiplier` is a function of the epoch, or a number m, which means
    m ** (epoch - start_epoch). staircase=True sets the rate at the first
    batch of each epoch (an integer epoch); False at every batch, the epoch
    then fractional (epoch + batch / steps_per_epoch). momentum_correction
    (Goyal et al.): when the rate changes from r to r', an optimizer with
    momentum (SGD, RMSprop) has its momentum buffers scaled by r'/r before
    that batch's update, which is what Horovod's momentum * r'/r for one
    batch does (Keras 3 fixes the `momentum` number when it traces the step,
    so the buffers are scaled instead). The rate is given once, as
    `initial_lr` (Horovod's name) or `initial_learning_rate`.
    """

    def __init__(self, initial_lr=None, multiplier=None, start_epoch=0, end_epoch=None,
                 staircase=True, momentum_correction=True, steps_per_epoch=None, *,
                 initial_learning_rate=None):
        super().__init__()
        if multiplier is None:
            raise TypeError(f"{type(self).__name__} needs a multiplier: a number or a "
                            "function of the epoch")
        self.initial_lr = _initial_rate(type(self).__name__, initial_lr, initial_learning_rate)
        self.multiplier = multiplier if callable(multiplier) else (
            lambda epoch: multiplier ** (epoch - start_epoch))
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = None
        self._told = False

    @property
    def initial_learning_rate(self):
        return self.initial_lr

    def on_train_begin(self, logs=None):
        optimizer = self.model.optimizer
        try:                                     # a LearningRateSchedule's rate is not settable
            optimizer.learning_rate = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
        except TypeError as e:
            raise ValueError(f"{type(self).__name__} sets the optimizer's learning rate, but "
                             f"this {type(optimizer).__name__} follows a LearningRateSchedule "
                             f"({e}); give it a number, or drop the callback") from None
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self.params.get("steps")
            if not self.steps_per_epoch:
                raise ValueError(f"{type(self).__name__}: could not tell the number of steps "
                                 "per epoch; pass steps_per_epoch=")

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        epoch = self.current_epoch
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if self.staircase and batch == 0:
            self._adjust(epoch)
        elif not self.staircase:
            self._adjust(epoch + batch / self.steps_per_epoch)

    def _adjust(self, epoch):
        optimizer = self.model.optimizer
        old = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
        new = self.initial_lr * self.multiplier(epoch)
        optimizer.learning_rate = new
        if self.momentum_correction and old and new != old:
            self._correct_momentum(new / old)

    def _correct_momentum(self, ratio):
        optimizer = getattr(self.model.optimizer, "inner_optimizer", self.model.optimizer)
        momentum = getattr(optimizer, "momentum", None)
        if not isinstance(momentum, numbers.Real) or not momentum or not optimizer.built:
            return                               # no momentum (or none accumulated yet)
        buffers = getattr(optimizer, "momentums", None) or getattr(optimizer, "_momentums", None)
        if not buffers:
            if not self._told:
                self._told = True
                warnings.warn(f"{type(self).__name__}: momentum_correction found no momentum "
                              f"buffers in {type(optimizer).__name__} to correct; its momentum "
                              "is left as it is", stacklevel=2)
            return
        for buffer in buffers:
            buffer.assign(buffer * ratio)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Goyal et al.'s gradual warm-up, as Horovod's: over `warmup_epochs` the rate goes,
    batch by batch, from initial_lr / size() to initial_lr:
    lr(epoch) = initial_lr / size * (epoch * (size - 1) / warmup_epochs + 1), with
    epoch = full epochs + (batch + 1) / steps_per_epoch."""

    def __init__(self, initial_lr=None, warmup_epochs=5, momentum_correction=True,
                 steps_per_epoch=None, verbose=0, *, initial_learning_rate=None):
        if not warmup_epochs > 0:
            raise ValueError(f"LearningRateWarmupCallback: warmup_epochs must be > 0, got "
                             f"{warmup_epochs}")

        def multiplier(epoch):
            epoch += 1.0 / self.steps_per_epoch
            size = engine.size()
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)
        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch,
                         initial_learning_rate=initial_learning_rate)
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and engine.rank() == 0:
            rate = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {rate:g}.")


def _initial_rate(callback, initial_lr, initial_learning_rate):
    """The rate given once, under Horovod's name `initial_lr` or Keras's."""
    if (initial_learning_rate is None) == (initial_lr is None):
        raise TypeError(f"{callback}: give the target rate once, as initial_lr (or "
                        "initial_learning_rate)")
    return float(initial_lr if initial_learning_rate is None else initial_learning_rate)


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Horovod's: a ModelCheckpoint that keeps the best model only (save_best_only=True),
    whose `filepath` is set after construction (`callback.filepath = ...`, as Horovod's
    estimators do) and checked when training starts."""

    def __init__(self, monitor="val_loss", verbose=0, save_weights_only=False, mode="auto",
                 save_freq="epoch"):
        # Keras 3 checks the file's extension here; the real path comes later.
        super().__init__(filepath="best.weights.h5" if save_weights_only else "best.keras",
                         monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)
        self.filepath = None

    def on_train_begin(self, logs=None):
        want = ".weights.h5" if self.save_weights_only else ".keras"
        if not self.filepath or not str(self.filepath).endswith(
                (want,) if self.save_weights_only else (".keras", ".h5")):
            raise ValueError(f"BestModelCheckpoint needs its filepath, ending in {want}: set "
                             f"callback.filepath before fit (got {self.filepath!r})")
        super().on_train_begin(logs)
