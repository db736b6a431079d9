"""What an elastic sync leaves to each rank of its pipelined optimizer's state.

After a failure every rank restores its own commit, and the sync then gives
every rank rank 0's state. Part of a pipelined optimizer's state differs
between ranks by design: the own gradients lookahead predicts from and the
error-feedback residuals. Replaced by rank 0's, the restored run is no
longer the run without the failure. So a rank whose state, but for those
parts, is bit for bit rank 0's (it restored the same commit) keeps its own;
a rank that joined, or one astray, takes rank 0's whole.
"""
import numpy as np

# What a pipelined optimizer saves of this rank's own, by the names its checkpoint gives
# them (torch/checkpoint.py's "pipe_horovod" entry; the Keras adapter's saved variables
# under "pipe_horovod.<name>."): the own gradients kept for lookahead, error feedback's
# residuals.
OWN = ("kept", "error_feedback")


def identical(a, b):
    """Bitwise equality of nested dicts, lists and tuples of arrays, tensors and values."""
    if isinstance(a, dict):
        return (isinstance(b, dict) and a.keys() == b.keys()
                and all(identical(a[k], b[k]) for k in a))
    if isinstance(a, (list, tuple)):
        return (isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(identical(x, y) for x, y in zip(a, b)))
    if a is None or b is None:
        return a is b
    if type(a).__module__.startswith("torch"):
        import torch

        return (torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
                and bool(torch.equal(a, b.to(a.device))))
    if isinstance(a, (np.ndarray, np.generic)) or isinstance(b, (np.ndarray, np.generic)):
        return np.array_equal(np.asarray(a), np.asarray(b))
    return a == b
