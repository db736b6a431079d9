"""The FIFO of averaged gradients that defines Pipe-SGD (DESIGN.md, "Semantics").

Each step pushes g_t, then pops (to apply) while the FIFO holds at least
`pipeline_depth` entries, or at least one during warm-up. So w_{t+1} =
w_t - lr * g_{t-K+1}, the first K-1 pipelined steps apply nothing, and
`drain` hands back everything still in flight so no gradient is lost.
Entries are opaque: adapters put whatever represents a step's reduction.
"""
from collections import deque


class GradientFifo:
    def __init__(self, pipeline_depth, warmup_steps=0):
        self.pipeline_depth = pipeline_depth
        self.warmup_steps = warmup_steps
        self.steps = 0          # gradients pushed so far (the step counter)
        self._entries = deque()

    def threshold(self, step):
        """Entries the FIFO must hold, after pushing step `step`, before one pops."""
        return 1 if step < self.warmup_steps else self.pipeline_depth

    def push(self, entry):
        """Add this step's gradient; return the entries to apply now, oldest first."""
        self._entries.append(entry)
        self.steps += 1
        return self.pop_ready()

    def pop_ready(self):
        """The entries to apply after the step pushed last, oldest first: push's, and
        again after the depth was lowered (what it no longer holds in flight)."""
        ready = []
        while self._entries and len(self._entries) >= self.threshold(self.steps - 1):
            ready.append(self._entries.popleft())
        return ready

    def drain(self):
        """Every entry still in flight, oldest first; the FIFO is empty afterwards."""
        ready = list(self._entries)
        self._entries.clear()
        return ready

    def __len__(self):
        return len(self._entries)

    def __iter__(self):
        return iter(self._entries)

    def replace(self, entries, steps):
        """Restore from a checkpoint: `entries` oldest first, `steps` pushed so far."""
        if len(entries) > max(self.pipeline_depth - 1, 0):
            raise ValueError(
                f"a checkpoint with {len(entries)} averaged gradient(s) in flight (saved at "
                f"pipeline_depth >= {len(entries) + 1}) cannot resume with pipeline_depth="
                f"{self.pipeline_depth}, which holds at most {self.pipeline_depth - 1}: "
                f"resume with pipeline_depth={len(entries) + 1}, or call optimizer.flush() "
                "before optimizer.state_dict() when saving, so that nothing is in flight")
        self._entries = deque(entries)
        self.steps = steps
