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
quantization of the reduced shard this rank owns lost; full size, only
that shard's range used). Checkpoints hold stage 1 under the slot's
number and stage 2 under -1 - slot, so every adapter's {int: {name:
tensor}} format carries both.

Residuals are kept as flat tensors per (slot, bucket), views named by
parameter: a new bucket plan (the first step's agreed order) or a
checkpoint moves them by name, not by offset. They are this rank's own:
each rank must load its own checkpoint to resume them exactly.
"""


class ErrorFeedback:
    def __init__(self):
        self._flat = {}          # (slot, bucket index) -> flat residual of that bucket
        self._named = {}         # slot -> {name: residual}, views of the flats or loaded ones

    def residual(self, slot, bucket, stage=1):
        """The persistent residual of `bucket` in `slot` (of quantization `stage`), in
        the accumulator's type, on the bucket's device."""
        import torch

        key = (slot, bucket.index, stage)
        flat = self._flat.get(key)
        if flat is None or flat.numel() != bucket.numel:
            dtype, device = bucket.kind
            acc = torch.float64 if dtype == torch.float64 else torch.float32
            flat = torch.zeros(bucket.numel, dtype=acc, device=device)
            named = self._named.setdefault(slot if stage == 1 else -1 - slot, {})
            for name, start, numel in bucket.offsets():
                kept = named.get(name)
                if kept is not None:
                    flat[start:start + numel].copy_(kept.reshape(-1))
                named[name] = flat[start:start + numel]
            self._flat[key] = flat
        return flat

    def replan(self):
        """Buckets change: keep the residuals by name only, to be laid out again by
        the next `residual` calls. The names keep viewing the old flats, not copies:
        a reduction still in flight (the first step's, re-planned right after it
        launched) writes its residual there, and the slot's next launch, which
        comes after that reduction landed, reads it through the view."""
        self._flat = {}

    def state(self):
        return {slot: {n: t.clone() for n, t in named.items()}
                for slot, named in self._named.items()}

    def load(self, state):
        self._named = {int(slot): {n: t.clone() for n, t in named.items()}
                       for slot, named in (state or {}).items()}
        self._flat = {}
