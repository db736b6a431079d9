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


def plan_buckets(members, cap_bytes, groups=None):
    """Split `members` [(name, numel, element_size, kind)], in ready order, into buckets.

    A bucket closes when adding the next member would exceed `cap_bytes` or
    the next member is of another kind; a member larger than the cap gets a
    bucket of its own. `groups` replaces the cap as Horovod's optimizer
    defines it: an int n cuts the members into n buckets of near-equal
    count; lists of names each make one bucket (members named in none get
    a bucket each). Either way a bucket still never mixes kinds.
    """
    if groups is None:
        return _fill(members, lambda i, used, nbytes: used and used + nbytes > cap_bytes)
    if isinstance(groups, int):
        base, extra = divmod(len(members), groups)
        cuts = {sum(base + (i < extra) for i in range(g)) for g in range(1, groups)}
        return _fill(members, lambda i, used, nbytes: i in cuts)
    group_of = {name: i for i, names in enumerate(groups) for name in names}
    # Buckets launch in index order, so a group sits where its last member is ready.
    order = list(dict.fromkeys(reversed([group_of.get(name, name) for name, *_ in members])))
    order.reverse()
    grouped = {key: [m for m in members if group_of.get(m[0], m[0]) == key] for key in order}
    buckets = []
    for key in order:
        for bucket in _fill(grouped[key], lambda i, used, nbytes: False):
            bucket.index = len(buckets)
            buckets.append(bucket)
    return buckets


def _fill(members, cut):
    """Buckets in member order; a new one starts on a new kind or where
    `cut(index, bytes used so far, bytes of this member)` says."""
    buckets = []
    current, used = None, 0
    for i, (name, numel, element_size, kind) in enumerate(members):
        nbytes = numel * element_size
        if current is None or current.kind != kind or cut(i, used, nbytes):
            current = Bucket(len(buckets), kind)
            buckets.append(current)
            used = 0
        current.names.append(name)
        current.numels.append(numel)
        used += nbytes
    return buckets
