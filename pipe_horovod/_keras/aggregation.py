"""backward_passes_per_step > 1: gradients summed locally, reduced once every N passes.

Horovod's Keras DistributedOptimizer (its LocalGradientAggregationHelper) adds
each pass's gradient to a local sum and reduces the sum on every N-th pass
(divided by N with `average_aggregated_gradients`); the passes in between apply
nothing but still count an iteration, so `iterations` counts passes. Here the
N-th pass hands the sum to the pipeline as one step's gradient, so with K >= 2
a step's reduction overlaps the next N passes. Its state, the pass counter and
one sum per variable, are variables of the optimizer: checkpoints and
BroadcastGlobalVariablesCallback carry a cycle in progress. The optimizer
keeps this object as `_agg_helper`, Horovod's name, whose `counter` Horovod's
tests read.

TensorFlow: the sum is taken in the graph, and the N-th pass's hand-off runs
in a `tf.cond` branch. torch: Keras's train step sets every `.grad` to None
before backward (Model.zero_grad), so `prepare_backward` (called from the
optimizer's `scale_loss`, which Keras calls between the two) points `.grad`
at the running sum again, and backward adds to it in place, as plain torch
accumulation would; the last pass gets a copy, which the pipeline may keep.
With `average_aggregated_gradients` the torch backend scales each pass's loss
by 1/N, the same division done before the sum.
"""
import keras


class Aggregation:
    def __init__(self, optimizer, variables, passes, average):
        self.optimizer = optimizer
        self.variables = list(variables)
        self.passes, self.average = passes, average
        self.counter = optimizer.add_variable((), initializer="zeros", dtype="int32",
                                              name="pipe_horovod_passes")
        self.sums = [optimizer.add_variable(tuple(v.shape), initializer="zeros",
                                            dtype=keras.backend.standardize_dtype(v.dtype),
                                            name=f"pipe_horovod_sum_{i}")
                     for i, v in enumerate(self.variables)]
        self._prepared = False                   # torch: .grad points at the sums this pass

    # --- the pass ---------------------------------------------------------------------
    def apply(self, grads, last_pass, other_pass=None):
        """Add this pass's `grads`; on the N-th pass call `last_pass(sums)` (its result is
        returned; on torch the sums are in `.grad`: None) and start the next cycle, else
        call `other_pass()` (torch) and count the pass as an iteration."""
        if keras.backend.backend() == "torch":
            return self._apply_torch(last_pass, other_pass)
        import tensorflow as tf

        grads = [tf.convert_to_tensor(g, v.dtype) for g, v in zip(grads, self.sums)]
        self.counter.assign_add(1)

        def reduce():
            total = [s.value + g for s, g in zip(self.sums, grads)]
            if self.average:
                total = [t / self.passes for t in total]
            self.start_cycle()
            return tf.convert_to_tensor(last_pass(total), tf.bool)

        def accumulate():
            for s, g in zip(self.sums, grads):
                s.assign_add(g)
            self.optimizer.iterations.assign_add(1)
            return tf.constant(False)
        return tf.cond(tf.equal(self.counter.value, self.passes), reduce, accumulate)

    def start_cycle(self):
        self.counter.assign(0)
        for s in self.sums:
            s.assign(keras.ops.zeros_like(s))

    # --- torch ------------------------------------------------------------------------
    def loss_scale(self):
        return 1.0 / self.passes if self.average else 1.0

    def prepare_backward(self):
        """Before a torch backward: `.grad` = the running sum (a copy on the N-th pass)."""
        last = int(keras.ops.convert_to_numpy(self.counter.value)) + 1 == self.passes
        for v, s in zip(self.variables, self.sums):
            v.value.grad = s.value.detach().clone() if last else s.value.detach()
        self._prepared = True

    def _apply_torch(self, last_pass, other_pass):
        passes = int(keras.ops.convert_to_numpy(self.counter.value)) + 1
        if not self._prepared:
            # This pass's gradient is not in the sums: on the first pass ever (the optimizer
            # was built after its backward) add it here; later, backward ran outside Keras's
            # train step (no scale_loss), and the sum so far would be lost.
            if passes > 1:
                raise RuntimeError(
                    "backward_passes_per_step > 1 on Keras's torch backend sums the passes "
                    "in Keras's train step (fit, train_on_batch), which calls "
                    "optimizer.scale_loss(loss) before backward; in a custom loop call it on "
                    "the loss of every pass too")
            scale = self.loss_scale()
            for v, s in zip(self.variables, self.sums):
                if v.value.grad is not None:
                    s.value.detach().add_(v.value.grad, alpha=scale)
        self._prepared = False
        if passes < self.passes:
            self.counter.assign(passes)
            if other_pass is not None:
                other_pass()
            self.optimizer.iterations.assign_add(1)
            return False
        result = last_pass(None)
        self.start_cycle()
        return result
