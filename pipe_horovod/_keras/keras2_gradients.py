"""Horovod's Keras 2 gradient entry points, on a Keras 3 optimizer (TensorFlow backend).

Keras 2's optimizers computed gradients in `_compute_gradients(loss, var_list,
grad_loss, tape)` (and `compute_gradients`), which Horovod's DistributedOptimizer
overrides to hand them back reduced; `apply_gradients(...,
experimental_aggregate_gradients=False)` then applies them as they are. Keras 3
has none of these (its train step calls `apply` with this rank's gradients,
which pipe_horovod pipelines), but scripts written for Horovod, and Horovod's
own tests, call them. Here they do what Horovod's do: the gradients come back
reduced, summed over backward_passes_per_step passes first, local variables'
divided by size() instead; the next apply() applies them as they are, at once
(the caller holds them, so no reduction is left to overlap: this path is
synchronous at every pipeline depth).
"""
import numpy as np

from ..common import global_process_set, tensor_ops
from ..engine import Average
from .variables import backend as _backend, dense as _dense, same_variable as _same_variable


class _Keras2Gradients:
    """Mixin of the pipelined Keras optimizer (optimizer.py): the methods above. It reads
    the optimizer's `_pipe_options`, `_local`, `_agg_helper`, `_path` and `_prefix`, calls
    its `_build_for`, `_join` and `_base_apply`, and sets `_reduced` for the next apply."""

    def compute_gradients(self, loss, var_list, tape=None):
        """Horovod's: `_compute_gradients(loss, var_list, None, tape)`."""
        return self._compute_gradients(loss, var_list, None, tape)

    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        """Keras 2's gradient computation, reduced as Horovod's DistributedOptimizer does.

        Args:
            loss: a tensor (computed under `tape`) or a callable returning the loss.
            var_list: the variables (or a callable returning them).
            grad_loss: the gradient of the loss's output (Keras 2's), or None.
            tape: the tf.GradientTape the loss was computed under (required for a tensor).

        Returns:
            [(gradient, variable)]: on every backward_passes_per_step-th call the reduced
            sum, else this rank's sum so far (Horovod's). The next apply_gradients() or
            apply() applies them without reducing again.
        """
        import tensorflow as tf

        if _backend() != "tensorflow":
            raise RuntimeError("_compute_gradients is Keras 2's TensorFlow API; on Keras's "
                               f"{_backend()} backend use fit, or apply() with this rank's "
                               "gradients (pipe_horovod reduces them)")
        if not callable(loss) and tape is None:
            raise ValueError("`tape` is required when a `Tensor` loss is passed.")
        tape = tape if tape is not None else tf.GradientTape()
        if callable(loss):
            with tape:
                if not callable(var_list):
                    tape.watch(var_list)
                loss = loss()
                if callable(var_list):
                    var_list = var_list()
        var_list = tf.nest.flatten(var_list)
        grads = tape.gradient(loss, var_list, grad_loss)
        self._build_for(var_list)
        self._join()
        grads = self._reduce_now([_dense(g) for g in grads], var_list)
        self._reduced = True
        return list(zip(grads, var_list))

    def apply_gradients(self, grads_and_vars, name=None, experimental_aggregate_gradients=True):
        """Keras's, with Keras 2's `experimental_aggregate_gradients`: False says the
        gradients are reduced already (as after _compute_gradients), so they are applied
        as they are. `name` is accepted and unused, as in Keras 3."""
        grads, variables = zip(*list(grads_and_vars))
        if not experimental_aggregate_gradients:
            self._reduced = True
        self.apply(grads, variables)
        return self._iterations

    # --- inside -----------------------------------------------------------------------
    def _reduce_now(self, grads, variables):
        import tensorflow as tf

        aggregation = self._agg_helper
        if aggregation is None:
            return self._reduced_now(grads, [self._local[self._index(v)] for v in variables])
        present = [i for i, g in enumerate(grads) if g is not None]
        sums = [aggregation.sums[self._index(variables[i])] for i in present]
        aggregation.counter.assign_add(1)

        def reduce():
            total = [s.value + grads[i] for s, i in zip(sums, present)]
            if aggregation.average:
                total = [t / aggregation.passes for t in total]
            out = self._reduced_now(total, [self._local[self._index(variables[i])]
                                            for i in present])
            aggregation.start_cycle()
            return out

        def accumulate():
            for s, i in zip(sums, present):
                s.assign_add(grads[i])
            return [tf.identity(s.value) for s in sums]
        out = tf.cond(tf.equal(aggregation.counter.value, aggregation.passes), reduce,
                      accumulate)
        result = [None] * len(grads)
        for i, g in zip(present, out):
            result[i] = g
        return result

    def _index(self, variable):
        return next(i for i, v in enumerate(self._path.variables) if _same_variable(v, variable))

    def _reduced_now(self, grads, local=None):
        """Each gradient reduced now (None stays None); a local one divided by size()
        (scale_local_gradients) instead."""
        import tensorflow as tf

        if local is None:
            local = [False] * len(grads)
        options = self._pipe_options
        process_set = options["process_set"] or global_process_set
        size = process_set.size()
        reduced = [i for i, (g, own) in enumerate(zip(grads, local)) if g is not None and not own]
        out = list(grads)
        for i, (g, own) in enumerate(zip(grads, local)):
            if g is not None and own and options["scale_local_gradients"]:
                out[i] = g / size
        if reduced and process_set.included():
            results = tf.numpy_function(self._allreduce_arrays, [grads[i] for i in reduced],
                                        [grads[i].dtype for i in reduced], stateful=True,
                                        name="pipe_horovod_compute_gradients")
            if not isinstance(results, (list, tuple)):      # eager, one output: a tensor
                results = [results]
            for i, r in zip(reduced, results):
                out[i] = tf.ensure_shape(r, grads[i].shape)
        return out

    def _allreduce_arrays(self, *arrays):
        import torch

        options = self._pipe_options
        factor = options["gradient_predivide_factor"]
        scaling = ({"prescale_factor": 1.0 / factor, "postscale_factor": factor}
                   if options["op"] is Average and factor != 1.0 else {})
        tensors = [torch.from_numpy(np.array(a, copy=True)) for a in arrays]
        reduced = tensor_ops.grouped_allreduce(
            tensors, name=f"{self._prefix}.compute_gradients", op=options["op"],
            compression=options["compression"],
            process_set=options["process_set"] or global_process_set, **scaling)
        return tuple(r.numpy() for r in reduced)

    def _apply_reduced(self, grads, variables):
        """Gradients reduced already (by _compute_gradients): applied as they are, at once;
        with backward_passes_per_step, only on the pass that reduced them (the others
        count an iteration), as Horovod's."""
        import keras

        self._path.put_real_back()
        aggregation = self._agg_helper

        def step():
            self._base_apply(grads, variables)
            return keras.ops.convert_to_tensor(True)
        if aggregation is None:
            return step()

        def count():
            self.iterations.assign_add(1)
            return keras.ops.convert_to_tensor(False)
        return keras.ops.cond(keras.ops.equal(aggregation.counter.value, 0), step, count)
