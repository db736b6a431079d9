"""Persistent buffers of the collectives, reused from step to step.

Fresh large tensors page-fault on first touch (6-19 ms per step measured
here for a model's worth of gradients), so the accumulator, the three wire
buffers and the codec's scratch are kept and reused. The communicator runs
one collective at a time, so one set per shape serves every pipeline slot:
a K-deep pipeline of the same buckets reuses the same few sets.
"""
import collections

# Distinct shapes kept (buckets of one model have a handful); older ones are freed.
KEEP = 16


class Buffers:
    __slots__ = ("work", "wires", "scratch")

    def __init__(self, numel, acc_dtype, wire_numel, wire_dtype, needs_scratch, needs_work):
        import torch

        self.work = torch.empty(numel if needs_work else 0, dtype=acc_dtype)
        self.wires = tuple(torch.empty(wire_numel, dtype=wire_dtype) for _ in range(3))
        self.scratch = torch.empty(numel if needs_scratch else 0, dtype=acc_dtype)


class Pool:
    """Buffers by (numel, accumulator dtype, wire size, wire dtype, scratch?, accumulator?),
    least recently used dropped beyond KEEP. Used by the communicator's one thread only."""

    def __init__(self, keep=KEEP):
        self.keep = keep
        self._sets = collections.OrderedDict()

    def get(self, numel, acc_dtype, wire_numel, wire_dtype, needs_scratch, needs_work):
        key = (numel, acc_dtype, wire_numel, wire_dtype, needs_scratch, needs_work)
        found = self._sets.pop(key, None)
        if found is None:
            found = Buffers(*key)
        self._sets[key] = found
        while len(self._sets) > self.keep:
            self._sets.popitem(last=False)
        return found

    def clear(self):
        self._sets.clear()
