"""What a local variable's gradient is multiplied by: one rule for every adapter.

A local variable (Horovod's register_local_var / local_layers) is not
reduced; with scale_local_gradients its gradient is divided by the number
of ranks reducing the others (Horovod's rule), so a shared learning rate
scaled for the averaged gradients does not move it `size` times too far.
The number is read at each use, not when the adapter is built: an elastic
reset changes it (4 ranks -> 2 halves the local layers' step if kept).
"""


class LocalScale:
    """The factor for local gradients, read now.

    Args:
        enabled: scale_local_gradients (False: the factor is 1).
        size: a callable giving the number of ranks reducing now.
    """

    def __init__(self, enabled, size):
        self.enabled = bool(enabled)
        self._size = size

    @property
    def value(self):
        return 1.0 / self._size() if self.enabled else 1.0

    def __float__(self):
        return self.value

    def apply(self, gradient):
        """`gradient` times the factor (a new tensor; the input itself where it is 1)."""
        factor = self.value
        return gradient if factor == 1.0 else gradient * factor
