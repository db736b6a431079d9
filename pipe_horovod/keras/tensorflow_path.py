"""Keras 3 on TensorFlow: gradients leave the graph through numpy_function hand-offs.

A reduction must outlive the graph step that starts it (step t's runs
while step t+1 computes), so it cannot be a graph op. Each bucket gets one
stateful `tf.numpy_function` that copies the bucket's gradients (numpy
views of TensorFlow's buffers: no copy on the way in) into the step
machine's flat buffer and starts its allreduce without waiting. TF's
executor runs it as soon as that bucket's gradients exist, so the rest of
backward hides the send. A last op pushes the step into the FIFO and
returns what pops; the user's own update runs under `tf.cond` only when
something popped, so its iteration counter counts updates, not steps.

The hand-offs are chained by a token: the engine matches collectives by
name (Horovod) or by issue order (torch.distributed), and TF would
otherwise start them in whatever order their inputs become ready, which
differs between ranks.

Gradients on a GPU cross by DLPack instead (`tf.py_function`, then
`torch.from_dlpack`): they stay on the device, where NCCL reduces them.
PIPE_HOROVOD_KERAS_TRANSFER=numpy|dlpack overrides the choice, so the
DLPack path is tested on CPU too.
"""
import os
import time

import numpy as np
import tensorflow as tf
import torch

from ..pipeline import StepGradient, StepMachine
from .paths import next_prefix, variable_names


class TensorFlowPath:
    def __init__(self, optimizer, variables, options):
        self.optimizer = optimizer
        self.variables = variables
        self.names = variable_names(variables)
        self.shapes = dict(zip(self.names, (tuple(v.shape) for v in variables)))
        devices = [_torch_device(v) for v in variables]
        choice = os.environ.get("PIPE_HOROVOD_KERAS_TRANSFER")
        if choice not in (None, "numpy", "dlpack"):
            raise ValueError(f"PIPE_HOROVOD_KERAS_TRANSFER must be numpy or dlpack, got {choice!r}")
        dlpack = choice == "dlpack" or (choice is None and any(d.type != "cpu" for d in devices))
        self.transfer = DLPack() if dlpack else NumPy()
        self.machine = StepMachine(
            next_prefix(), options["pipeline_depth"], options["warmup_steps"],
            compression=options["compression"], op=options["op"],
            predivide=options["gradient_predivide_factor"], process_set=options["process_set"],
            cap_bytes=int(options["bucket_cap_mb"] * 2**20), groups=options["groups"])
        # Ready order: backward produces the last layer's gradients first.
        self.machine.plan([(name, int(np.prod(v.shape)), np.dtype(v.dtype).itemsize,
                            (getattr(torch, np.dtype(v.dtype).name), device))
                           for name, v, device in reversed(list(zip(self.names, variables,
                                                                    devices)))])
        self._arrays = {}                        # this step's gradients (torch views), by name
        self._zeros = None
        self.timings = {"steps": 0, "wait_s": 0.0, "applied": 0}

    # --- graph side (runs once per trace) -------------------------------------
    def apply(self, grads, variables):
        _refuse_xla()
        if [id(v) for v in variables] != [id(v) for v in self.variables]:
            raise ValueError("apply() got other variables than the optimizer was built with")
        index = {name: i for i, name in enumerate(self.names)}
        grads = [tf.zeros(v.shape, v.dtype) if g is None else tf.convert_to_tensor(g, v.dtype)
                 for g, v in zip(grads, variables)]
        token = tf.constant(0, tf.int64)
        for bucket in self.machine.buckets:
            members = [grads[index[name]] for name in bucket.names]
            token = self.transfer.op(self._handoff_for(bucket), [token, *members], tf.int64,
                                     f"pipe_horovod_bucket_{bucket.index}")
        out = self.transfer.op(self._finish, [token],
                               [tf.as_dtype(v.dtype) for v in variables] + [tf.bool],
                               "pipe_horovod_finish")
        averaged = [tf.ensure_shape(g, v.shape) for g, v in zip(out[:-1], variables)]
        popped = tf.ensure_shape(out[-1], ())

        def update():
            self.optimizer._base_apply(averaged, variables)
            return tf.constant(True)

        return tf.cond(popped, update, lambda: tf.constant(False))

    # --- Python side (runs every step) -------------------------------------------
    def _handoff_for(self, bucket):
        def handoff(token, *arrays):
            self._arrays.update(zip(bucket.names, map(self.transfer.to_torch, arrays)))
            for name in bucket.names:
                self.machine.ready(name, self._fill)
            return token
        return handoff

    def _fill(self, bucket, flat):
        for name, start, numel in bucket.offsets():
            flat[start:start + numel].copy_(self._arrays.pop(name).reshape(-1))

    def _finish(self, token):
        machine = self.machine
        if machine.solo:                         # TF reuses its buffers after the hand-off
            entry = StepGradient(loaded={n: a.clone() for n, a in self._arrays.items()})
        else:
            machine.launch_rest(self._fill)
            entry = StepGradient(machine.launched)
        self._arrays = {}
        ready = machine.finish_step(entry)
        self.timings["steps"] += 1
        if not ready:
            if self._zeros is None:
                self._zeros = [self.transfer.to_tf(torch.zeros(self.shapes[n], dtype=b.kind[0],
                                                               device=b.kind[1]))
                               for n, b in ((n, self.machine.bucket_of[n]) for n in self.names)]
            return (*self._zeros, self.transfer.flag(False))
        (oldest,) = ready                        # restore() refuses what would pop several
        start = time.perf_counter()
        grads = oldest.gradients()
        self.timings["wait_s"] += time.perf_counter() - start
        self.timings["applied"] += 1
        return (*[self.transfer.to_tf(grads[n].reshape(self.shapes[n])) for n in self.names],
                self.transfer.flag(True))

    # --- outside the step ---------------------------------------------------------
    def flush(self):
        for entry in self.machine.drain():
            grads = entry.gradients()
            self.optimizer._base_apply(
                [tf.convert_to_tensor(self.transfer.to_tf(grads[n].reshape(self.shapes[n])))
                 for n in self.names], self.variables)
            self.timings["applied"] += 1

    def in_flight(self):
        return len(self.machine.fifo)

    def state(self):
        state = self.machine.state()
        state.pop("scales")
        state.pop("kept")                        # no staleness compensation on this path yet
        return state

    def restore(self, in_flight, state):
        steps = state["steps"]
        fifo = self.machine.fifo
        if in_flight and len(in_flight) >= fifo.threshold(steps):   # would pop several at once
            raise ValueError(f"a checkpoint with {len(in_flight)} gradients in flight at step "
                             f"{steps} cannot resume inside warm-up (warmup_steps="
                             f"{fifo.warmup_steps}): resume with the warm-up it was saved with")
        self.machine.settle()
        self.machine.restore([{n: torch.from_numpy(np.array(g, copy=True)).reshape(-1).to(
                                   self.machine.bucket_of[n].kind[1]) for n, g in grads.items()}
                              for grads in in_flight],
                             [None] * len(in_flight), steps)


def _refuse_xla():
    from tensorflow.python.ops import control_flow_util

    if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        raise ValueError("the pipelined DistributedOptimizer cannot run inside an XLA-compiled "
                         "train step: its reductions outlive the step. Compile the model with "
                         "model.compile(..., jit_compile=False)")


class NumPy:
    """CPU tensors: numpy_function's inputs are views of TF's buffers (no copy in)."""

    @staticmethod
    def op(func, inputs, types, name):
        return tf.numpy_function(func, inputs, types, stateful=True, name=name)

    to_torch = staticmethod(torch.from_numpy)

    @staticmethod
    def to_tf(tensor):
        return tensor.cpu().numpy()

    flag = staticmethod(np.bool_)


class DLPack:
    """Tensors stay on their device: TF and torch share the memory through DLPack."""

    @staticmethod
    def op(func, inputs, types, name):
        return tf.py_function(func, inputs, types, name=name)

    @staticmethod
    def to_torch(tensor):
        return torch.from_dlpack(tf.experimental.dlpack.to_dlpack(tensor))

    @staticmethod
    def to_tf(tensor):
        return tf.experimental.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(
            tensor.contiguous()))

    @staticmethod
    def flag(value):
        return tf.constant(value)


def _torch_device(variable):
    """The torch device of a TF variable ("/job:.../device:GPU:1" -> cuda:1)."""
    spec = tf.DeviceSpec.from_string(variable.value.device or "/device:CPU:0")
    if spec.device_type == "GPU":
        return torch.device("cuda", spec.device_index or 0)
    return torch.device("cpu")
