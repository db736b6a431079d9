"""What a user's own run measured, recorded as it runs: the input of `pipe-horovod plan --from-run`.

A step as the optimizer sees it: it finishes (`StepMachine.finish_step`: backward done,
every bucket launched), the adapter then blocks on the reductions it applies now and
updates, the user's forward and backward follow, and the next step finishes. So a
step's compute (forward + backward + update + whatever the script does between) is
the time between two finishes less the time blocked on reductions in between, and each
bucket reduction has a launch (when backward completed it), a landing (when the wait
for it returned) and an exposed wait (how long that wait blocked). Everything is read
off `time.perf_counter()` on this rank at points the step passes anyway: no
synchronisation, no communication, no tensor touched, so recording cannot change what
a run computes. Times are seconds since the record began, one clock for all. Only the
last RECENT_STEPS steps are kept (between RECENT_STEPS and twice that: bounded memory,
trimmed now and then), with running totals.

`PIPE_HOROVOD_RUN_SUMMARY=path` has rank 0 write the summary (`summary()`, JSON) when
the engine shuts down (at exit); `optimizer.write_run_summary(path)` writes it on demand.
"""
import json
import logging
import os
import time
import weakref

RECENT_STEPS = 100
FORMAT = "pipe_horovod.run_summary/1"
SUMMARY_VARIABLE = "PIPE_HOROVOD_RUN_SUMMARY"
_log = logging.getLogger("pipe_horovod")

_records = weakref.WeakSet()                  # the live records, for the at-exit summary


class RunRecord:
    """One wrapped optimizer's measured steps and bucket reductions."""

    def __init__(self, timings, config):
        # The adapter's `timings` dict: the record keeps its own keys in it up to date,
        # so users read one dict (steps, wait_s, applied, ... and these).
        self.timings = timings
        self._origin = time.perf_counter()
        self._last_finish = None              # when the previous step finished
        self.last_step_at = None              # the same, on perf_counter's own clock
        self._blocked = 0.0                   # blocked on reductions since then
        timings["compute_s"] = 0.0
        # Plain lists (users json.dump their timings), trimmed to the last RECENT_STEPS.
        timings["recent_steps"] = []
        timings["reductions"] = []
        self.config = config                  # () -> what produced the run (StepMachine.run_config)
        _records.add(self)

    def now(self):
        return time.perf_counter() - self._origin

    def launched(self, reduction, step):
        """`reduction` (a BucketReduction of step `step`) went on the wire just now."""
        bucket = reduction.bucket
        entry = {"step": step, "bucket": bucket.index,
                 "bytes": bucket.numel * bucket.kind[0].itemsize, "launched_s": self.now(),
                 "landed_s": None, "wait_s": None}
        reduction.record = (self, entry)
        reductions = self.timings["reductions"]
        reductions.append(entry)
        if reductions[0]["step"] <= step - 2 * RECENT_STEPS:     # trimmed now and then
            reductions[:] = [r for r in reductions if r["step"] > step - RECENT_STEPS]

    def landed(self, entry, called, returned):
        """The wait for `entry`'s reduction, called at `called`, returned at `returned`
        (perf_counter): it had landed by then, and blocked the step that long."""
        entry["landed_s"] = returned - self._origin
        entry["wait_s"] = returned - called
        self._blocked += returned - called

    def finished(self, step):
        """Step `step` finished (all its buckets launched)."""
        now = self.now()
        if self._last_finish is not None:     # the first step's start is not known
            compute = max(0.0, now - self._last_finish - self._blocked)
            self.timings["compute_s"] += compute
            recent = self.timings["recent_steps"]
            recent.append({"step": step, "finished_s": now, "compute_s": compute,
                           "wait_s": self._blocked})
            if len(recent) >= 2 * RECENT_STEPS:
                del recent[:-RECENT_STEPS]
        self._last_finish, self._blocked = now, 0.0
        self.last_step_at = now + self._origin

    def begin_anew(self):
        """Keep the steps and reductions from here on only (the totals go on): the
        configuration changed (tune="auto" decided), and a summary describes one, as
        `plan --from-run` reads it."""
        self.timings["recent_steps"][:] = []
        self.timings["reductions"][:] = []

    def summary(self):
        """The measured run as plain data (what write() saves): its last RECENT_STEPS steps."""
        steps = self.timings["recent_steps"][-RECENT_STEPS:]
        first = steps[0]["step"] if steps else None
        return {"format": FORMAT, "config": self.config(),
                "totals": {"steps": self.timings.get("steps", 0),
                           "compute_s": self.timings["compute_s"],
                           "wait_s": self.timings.get("wait_s", 0.0)},
                "steps": steps,
                "reductions": [dict(r) for r in self.timings["reductions"]
                               if first is not None and r["step"] >= first - 1]}

    def write(self, path):
        """Save summary() to `path` as JSON (the caller decides which rank writes)."""
        with open(path, "w") as f:
            json.dump(self.summary(), f, indent=1)
        return path


def write_at_exit(rank):
    """At engine shutdown: with PIPE_HOROVOD_RUN_SUMMARY set, rank 0 writes the summary
    of the optimizer that took the last step (the one training the model). A path it
    cannot write is logged, not raised: the run has trained, and shutdown must still
    complete the reductions other ranks wait for."""
    path = os.environ.get(SUMMARY_VARIABLE)
    stepped = [r for r in _records if r.last_step_at is not None]
    if not path or rank != 0 or not stepped:
        return None
    try:
        return max(stepped, key=lambda r: r.last_step_at).write(path)
    except OSError as exc:
        _log.warning("pipe_horovod: cannot write the run summary to %s=%s: %s",
                     SUMMARY_VARIABLE, path, exc.strerror or exc)
        return None
