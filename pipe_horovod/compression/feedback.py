"""Error feedback for lossy per-hop codecs, kept per bucket and pipeline slot.

Quantization loses a little of every reduction; feedback adds what this
rank's encodes lost back into a later reduction of the same bucket, so the
applied updates sum to the uncompressed ones up to the newest loss
(Seide et al. 2014; Karimireddy et al. 2019). In a K-deep pipeline the
loss of step t is known only once its reduction lands, after step t+1 has
already launched; so the loss of step t is added at step t+K, when that
slot is reused, which is the first step that can see it on every rank at
the same point (K=1: the next step). Deterministic, so a checkpoint that
carries the residuals resumes bit-exactly.

The two-stage reduction on the engine's collectives (two_stage.py)
quantizes twice and keeps two residuals per (slot, bucket): stage 1 (what
this rank's quantization of the whole bucket lost) and stage 2 (what the
quantization of the reduced shard this rank owns lost: kept for that
shard's range only, whole parameters with zeros elsewhere in checkpoints).
Checkpoints hold stage 1 under the slot's number and stage 2 under
-1 - slot, so every adapter's {int: {name: tensor}} format carries both.

Going back from the codec (tune="auto" undoing a codec's trial, or a
checkpoint with residuals loaded where no such codec runs) loses nothing:
`fold_into` adds each slot's residuals to that slot's next uncompressed
reduction, stage 2's times the ranks where the reduction averages (it is
kept in averaged units, on the one rank that reduced the shard), so the
applied updates sum to the uncompressed ones once more.

Residuals are kept as flat tensors per (slot, bucket), views named by
parameter: a new bucket plan (the first step's agreed order) or a
checkpoint moves them by name, not by offset. They are this rank's own:
each rank must load its own checkpoint to resume them exactly.
"""
from .arithmetic import accumulator


class ErrorFeedback:
    def __init__(self):
        self._flat = {}          # (slot, bucket index, stage) -> flat residual (or its part)
        self._layout = {}        # same key -> (bucket numel, part start, part numel)
        self._named = {}         # slot (stage 2: -1 - slot) -> {name: (offset, residual)}:
        #                          views of the flats covering the parameter's elements
        #                          [offset, offset + numel), or whole loaded ones
        self._numel = {}         # name -> its parameter's numel (for the checkpoints)

    def residual(self, slot, bucket, stage=1, part=None):
        """The persistent residual of `bucket` in `slot` (of quantization `stage`), in
        the accumulator's type, on the bucket's device. `part` (start, numel): keep only
        that range of the bucket (stage 2: the shard this rank reduces)."""
        import torch

        key = (slot, bucket.index, stage)
        low, size = (0, bucket.numel) if part is None else part
        flat = self._flat.get(key)
        if flat is None or self._layout.get(key) != (bucket.numel, low, size):
            dtype, device = bucket.kind
            flat = torch.zeros(size, dtype=accumulator(dtype), device=device)
            named = self._named.setdefault(slot if stage == 1 else -1 - slot, {})
            for name, start, numel in bucket.offsets():
                self._numel[name] = numel
                first, last = max(start, low), min(start + numel, low + size)
                if first >= last:
                    continue                 # outside the part: kept as it was
                view = flat[first - low:last - low]
                kept = named.get(name)
                if kept is not None:         # the overlap, in the parameter's elements
                    offset, values = kept[0], kept[1].reshape(-1)
                    a = max(first - start, offset)
                    b = min(last - start, offset + values.numel())
                    if a < b:
                        view[a - (first - start):b - (first - start)].copy_(
                            values[a - offset:b - offset])
                named[name] = (first - start, view)
            self._flat[key] = flat
            self._layout[key] = (bucket.numel, low, size)
        return flat

    def fold_into(self, flat, bucket, slot, depth, second_factor):
        """Add the residuals of every slot that `slot` reuses at `depth` (slot % depth),
        of `bucket`'s members, to `flat` (that bucket's gradients, about to be reduced
        without codec) and forget them. `second_factor` scales stage 2's (the ranks, for
        an average). Returns whether residuals remain to fold (other buckets, slots)."""
        for key in list(self._named):
            own = key if key >= 0 else -1 - key
            if own % depth != slot:
                continue                     # a slot whose reduction may still be in flight
            named, factor = self._named[key], 1 if key >= 0 else second_factor
            for name, start, _ in bucket.offsets():
                kept = named.pop(name, None)
                if kept is not None:
                    offset, values = kept[0], kept[1].reshape(-1)
                    flat[start + offset:start + offset + values.numel()].add_(
                        values.to(flat.dtype), alpha=factor)
            if not named:
                del self._named[key]
        return bool(self._named)

    def replan(self):
        """Buckets change: keep the residuals by name only, to be laid out again by
        the next `residual` calls. The names keep viewing the old flats, not copies:
        a reduction still in flight (the first step's, re-planned right after it
        launched) writes its residual there, and the slot's next launch, which
        comes after that reduction landed, reads it through the view."""
        self._flat, self._layout = {}, {}

    def state(self):
        """{slot (stage 2: -1 - slot): {name: residual of the whole parameter}}."""
        out = {}
        for slot, named in self._named.items():
            tensors = out[slot] = {}
            for name, (offset, values) in named.items():
                total = self._numel.get(name, offset + values.numel())
                if offset == 0 and values.numel() == total:
                    tensors[name] = values.clone()
                else:                        # a part: zeros elsewhere
                    whole = values.new_zeros(total)
                    whole[offset:offset + values.numel()] = values
                    tensors[name] = whole
        return out

    def load(self, state):
        self._named = {int(slot): {n: (0, t.clone()) for n, t in named.items()}
                       for slot, named in (state or {}).items()}
        self._flat, self._layout = {}, {}
