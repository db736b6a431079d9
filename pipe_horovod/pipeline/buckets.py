"""Fusing gradients into buckets in the order backward produces them.

A bucket goes on the wire as soon as its last gradient is ready, so the
order decides how much of backward hides the communication: the first
layers of backward (the model's last) should fill the first bucket.
Buckets never mix dtypes or devices, because each is one flat tensor.
"""
from dataclasses import dataclass, field


@dataclass
class Bucket:
    index: int
    kind: object                 # (dtype, device) of every member: one flat tensor
    names: list = field(default_factory=list)
    numels: list = field(default_factory=list)

    @property
    def numel(self):
        return sum(self.numels)

    def offsets(self):
        """(name, start, numel) of each member inside the flat tensor."""
        start = 0
        for name, numel in zip(self.names, self.numels):
            yield name, start, numel
            start += numel


def plan_buckets(members, cap_bytes):
    """Split `members` [(name, numel, element_size, kind)], in ready order, into buckets.

    A bucket closes when adding the next member would exceed `cap_bytes` or
    the next member is of another kind; a member larger than the cap gets a
    bucket of its own.
    """
    buckets = []
    current, used = None, 0
    for name, numel, element_size, kind in members:
        nbytes = numel * element_size
        if current is None or current.kind != kind or (used and used + nbytes > cap_bytes):
            current = Bucket(len(buckets), kind)
            buckets.append(current)
            used = 0
        current.names.append(name)
        current.numels.append(numel)
        used += nbytes
    return buckets
