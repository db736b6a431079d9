"""Fusing gradients into buckets in the order backward produces them.

A bucket goes on the wire as soon as its last gradient is ready, so the
order decides how much of backward hides the communication: the first
layers of backward (the model's last) should fill the first bucket.
Buckets never mix dtypes or devices, because each is one flat tensor.

How big a bucket may be: `bucket_cap_mb` when the user sets it; otherwise
(`bucket_cap_mb=None`, "auto") `auto_bucket_cap_mb` picks it from the
number of ranks that reduce and the link (resolve_bucket_cap_mb, called by
both adapters at wrap time). The planner (pipe_horovod.tools.planner) uses
the same function, so `pipe-horovod plan` predicts what training runs.
"""
import logging
import math
import os
from dataclasses import dataclass, field

# The link the auto bucket size is chosen for, when the launcher cannot know it.
LINK_GBPS_VARIABLE = "PIPE_HOROVOD_LINK_GBPS"            # Gbit/s per worker, e.g. 100
LINK_LATENCY_VARIABLE = "PIPE_HOROVOD_LINK_LATENCY_US"   # microseconds per message, e.g. 5
DEFAULT_LINK_GBPS = 25.0      # a common data-centre Ethernet link
DEFAULT_LINK_LATENCY_US = 20.0  # the planner's default (`pipe-horovod model/plan --latency`)
# The auto rule (docs/planner.md, "Bucket size"): a ring allreduce of one bucket pays
# 2(p-1) latencies alpha plus 2(p-1)/p of its bytes on the wire.
AUTO_LATENCY_SHARE = 0.05     # latency terms at most 5% of a bucket's wire time ...
AUTO_FULL_FUSION_S = 2e-3     # ... and Horovod's fusion size once they reach 2 ms
AUTO_MIN_MB = 32.0
AUTO_MAX_MB = 128.0           # Horovod's HOROVOD_FUSION_THRESHOLD default (0.21 and later)
AUTO_FIRST_MB = 4.0           # auto only: the first bucket goes once it holds this much
AUTO_SPLIT_LATENCY_S = 2 * AUTO_FULL_FUSION_S   # a backward pass on an accelerator (2 x forward)
_log = logging.getLogger("pipe_horovod")


def link_from_environment(environ=None):
    """(bandwidth in bytes/s, latency in s) of one worker's link: $PIPE_HOROVOD_LINK_GBPS
    and $PIPE_HOROVOD_LINK_LATENCY_US, each defaulting (25 Gbit/s, 20 us) when unset.

    Raises:
        ValueError: a variable is set but is not a finite number (> 0 for the
            bandwidth, >= 0 for the latency); the message names it.
    """
    environ = os.environ if environ is None else environ

    def read(name, default, allow_zero):
        text = environ.get(name)
        if text is None or not text.strip():
            return default
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            raise ValueError(f"{name} must be a number {'>= 0' if allow_zero else '> 0'} "
                             f"({'microseconds' if allow_zero else 'Gbit/s'}), got {text!r}")
        return value

    gbps = read(LINK_GBPS_VARIABLE, DEFAULT_LINK_GBPS, allow_zero=False)
    latency_us = read(LINK_LATENCY_VARIABLE, DEFAULT_LINK_LATENCY_US, allow_zero=True)
    return gbps * 1e9 / 8, latency_us * 1e-6


def auto_bucket_cap_mb(world_size, bandwidth=None, latency=None):
    """The bucket cap (MiB) that `bucket_cap_mb=None` means for `world_size` ranks on a
    link of `bandwidth` bytes/s and `latency` s (None: link_from_environment's).

    A ring allreduce of S bytes over p ranks costs 2(p-1)*latency + 2(p-1)/p*S/bandwidth.
    The cap is the larger of
      - p*latency*bandwidth/AUTO_LATENCY_SHARE: a bucket's latency terms at most 5% of
        its wire time, and
      - AUTO_MAX_MB * 2(p-1)*latency / AUTO_FULL_FUSION_S: as the latency of one
        allreduce grows towards 2 ms (a forward pass on an accelerator), as few
        allreduces as Horovod's fusion makes,
    bounded to [AUTO_MIN_MB, AUTO_MAX_MB] (one rank: AUTO_MIN_MB). Monotonic in
    world_size, latency and bandwidth.
    """
    if isinstance(world_size, bool) or int(world_size) != world_size or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if bandwidth is None or latency is None:
        env_bandwidth, env_latency = link_from_environment()
        bandwidth = env_bandwidth if bandwidth is None else bandwidth
        latency = env_latency if latency is None else latency
    if not (bandwidth > 0 and math.isfinite(bandwidth)):
        raise ValueError(f"bandwidth must be a finite number of bytes/s > 0, got {bandwidth!r}")
    if not (latency >= 0 and math.isfinite(latency)):
        raise ValueError(f"latency must be a finite number of seconds >= 0, got {latency!r}")
    p = int(world_size)
    if p == 1:
        return AUTO_MIN_MB                   # nothing is sent: no latency to amortize
    amortized = p * latency * bandwidth / AUTO_LATENCY_SHARE / 2**20
    fused = AUTO_MAX_MB * 2 * (p - 1) * latency / AUTO_FULL_FUSION_S
    return min(AUTO_MAX_MB, max(AUTO_MIN_MB, amortized, fused))


def auto_splits_model(world_size, latency):
    """Whether an automatic cap also keeps every bucket to half the model (split_cap_bytes).

    With one bucket after the small first one, the link waits for the end of backward,
    where Horovod's fusion sends whatever is ready whenever the link frees. Two halves
    let backward hide the first, which pays while one allreduce's 2(p-1) latencies
    stay below a backward pass on an accelerator (AUTO_SPLIT_LATENCY_S); beyond, the
    extra allreduce costs more than the overlap gains (planner: ResNet-50 at 64
    workers on 100 Gbit/s 0.875x -> 1.000x Horovod, at 256 it would lose 20%)."""
    return world_size > 1 and 2 * (world_size - 1) * latency < AUTO_SPLIT_LATENCY_S


def split_cap_bytes(cap_bytes, total_bytes):
    """The cap of an automatic size that splits the model (auto_splits_model): at most
    half of `total_bytes`, the gradients the buckets hold, and not below AUTO_MIN_MB."""
    return min(cap_bytes, max(AUTO_MIN_MB * 2**20, total_bytes / 2))


class AutoBucketCap(float):
    """A cap in MiB that auto_bucket_cap_mb chose (bucket_cap_mb=None): a float equal to
    the size, remembered as automatic so its buckets also get an early first bucket,
    and (split_model, from auto_splits_model) at most half the model each."""

    __slots__ = ("split_model",)

    def __new__(cls, value, split_model=False):
        cap = super().__new__(cls, value)
        cap.split_model = bool(split_model)
        return cap

    def __repr__(self):
        return f"{float(self)!r}"


class BucketCapBytes(int):
    """A cap in bytes whose first bucket closes once it holds `first_bytes` and, with
    split_model, whose buckets hold at most half the model (auto caps)."""

    first_bytes = int(AUTO_FIRST_MB * 2**20)
    split_model = False


def resolve_bucket_cap_mb(bucket_cap_mb, process_set=None, world_size=None, environ=None):
    """The cap in force: `bucket_cap_mb` unchanged when set, else (None) an AutoBucketCap
    from auto_bucket_cap_mb for the ranks that reduce (the process set's, else every
    rank; `world_size` overrides) and the link ($PIPE_HOROVOD_LINK_GBPS and
    $PIPE_HOROVOD_LINK_LATENCY_US, or their defaults). Rank 0 of the set logs the choice
    once. Both adapters call it at wrap time; explicit values are checked by check_options."""
    if bucket_cap_mb is not None:
        return bucket_cap_mb
    if world_size is None:
        from .. import engine

        try:                                 # a set this rank is in: its size; else all
            world_size = process_set.size() if process_set.included() else None
        except (AttributeError, TypeError, ValueError):   # None, or not a ProcessSet
            world_size = None                # (the adapter's own check names it)
        world_size = world_size or engine.size()
    bandwidth, latency = link_from_environment(environ)
    cap = AutoBucketCap(auto_bucket_cap_mb(world_size, bandwidth, latency),
                        auto_splits_model(world_size, latency))
    key = (float(cap), world_size, bandwidth, latency)
    if key not in _told:
        _told.add(key)
        _say_cap(cap, world_size, bandwidth, latency, process_set, environ)
    return cap


_told = set()


def _say_cap(cap, world_size, bandwidth, latency, process_set, environ):
    try:
        from .. import engine

        first = process_set.ranks[0] if getattr(process_set, "ranks", None) else 0
        if engine.rank() != first:
            return
    except (RuntimeError, ValueError):       # no engine (a direct call): say it anyway
        pass
    environ = os.environ if environ is None else environ
    source = ("defaults" if LINK_GBPS_VARIABLE not in environ
              and LINK_LATENCY_VARIABLE not in environ else "environment")
    _log.info("pipe_horovod: bucket_cap_mb=None (auto): %.1f MiB buckets%s, the first "
              "closing at %g MiB, for %d ranks on a %g Gbit/s, %g us link (%s: %s, %s); pass "
              "bucket_cap_mb to choose", cap, " (at most half the model)" if cap.split_model
              else "", AUTO_FIRST_MB, world_size, bandwidth * 8 / 1e9, latency * 1e6, source,
              LINK_GBPS_VARIABLE, LINK_LATENCY_VARIABLE)


def bucket_cap_bytes(bucket_cap_mb):
    """The cap in bytes that plan_buckets takes: a BucketCapBytes (early first bucket)
    for an AutoBucketCap, else a plain int."""
    nbytes = int(bucket_cap_mb * 2**20)
    if not isinstance(bucket_cap_mb, AutoBucketCap):
        return nbytes
    cap = BucketCapBytes(nbytes)
    cap.split_model = bucket_cap_mb.split_model
    return cap


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
    a bucket each). Either way a bucket still never mixes kinds. A cap from
    bucket_cap_bytes of an automatic size (BucketCapBytes) also closes the first
    bucket as soon as it holds `first_bytes`, as DDP's 1 MiB first bucket does, so the
    link starts while backward has barely begun, and with split_model keeps every bucket
    to half the members' bytes (split_cap_bytes).
    """
    if groups is None:
        first = min(getattr(cap_bytes, "first_bytes", 0), cap_bytes)
        if getattr(cap_bytes, "split_model", False):
            cap_bytes = split_cap_bytes(cap_bytes, sum(m[1] * m[2] for m in members))
        if first:
            return _fill(members, lambda i, used, nbytes, bucket: used and (
                used + nbytes > cap_bytes or (bucket == 0 and used >= first)))
        return _fill(members, lambda i, used, nbytes, bucket: used and used + nbytes > cap_bytes)
    if isinstance(groups, int):
        base, extra = divmod(len(members), groups)
        cuts = {sum(base + (i < extra) for i in range(g)) for g in range(1, groups)}
        return _fill(members, lambda i, used, nbytes, bucket: i in cuts)
    group_of = {name: i for i, names in enumerate(groups) for name in names}
    # Buckets launch in index order, so a group sits where its last member is ready.
    order = list(dict.fromkeys(reversed([group_of.get(name, name) for name, *_ in members])))
    order.reverse()
    grouped = {key: [m for m in members if group_of.get(m[0], m[0]) == key] for key in order}
    buckets = []
    for key in order:
        for bucket in _fill(grouped[key], lambda i, used, nbytes, bucket: False):
            bucket.index = len(buckets)
            buckets.append(bucket)
    return buckets


def _fill(members, cut):
    """Buckets in member order; a new one starts on a new kind or where
    `cut(member index, bytes used so far, bytes of this member, bucket index)` says."""
    buckets = []
    current, used = None, 0
    for i, (name, numel, element_size, kind) in enumerate(members):
        nbytes = numel * element_size
        if current is None or current.kind != kind or cut(i, used, nbytes, current.index):
            current = Bucket(len(buckets), kind)
            buckets.append(current)
            used = 0
        current.names.append(name)
        current.numels.append(numel)
        used += nbytes
    return buckets
