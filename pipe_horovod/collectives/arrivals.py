"""Which of a list of posted receives have completed, known without blocking.

torch's gloo point-to-point works cannot be polled: c10d's RecvWork sets
its completed flag only inside wait(), so `is_completed()` says False until
someone has waited, however long ago the bytes came in; and a wait with a
timeout that expires closes every pair of the gloo context. LP's middle
ranks must forward broadcast chunks while they still reduce: polling with
`is_completed()` found none, so every forward went out after the reduce had
ended, the link to the previous rank idle until then (3n bytes' time at
3-4 workers instead of the 2n its busiest link carries; measured 1.68 s
for 64 MB at 3 workers, every forward issued within 2 ms after the last
reduce chunk).

So a helper thread waits on the receives in order (wait releases the GIL)
and counts them; the collective's own thread reads the count and still
does every send itself. The helper only waits: nothing it touches is
shared but the count, behind a condition.
"""
import threading


class InOrder:
    """`count()`: how many of `works` (None: nothing to receive) have completed, in
    order; `wait(i)` blocks until work i has; a failed wait is raised there."""

    def __init__(self, works):
        self._works = list(works)
        self._done = 0
        self._error = None
        self._changed = threading.Condition()
        threading.Thread(target=self._watch, name="pipe_horovod-arrivals", daemon=True).start()

    def _watch(self):
        for work in self._works:
            try:
                if work is not None:
                    work.wait()
            except BaseException as exc:   # a peer gone, a timeout: raised to the collective
                with self._changed:
                    self._error = exc
                    self._changed.notify_all()
                return
            with self._changed:
                self._done += 1
                self._changed.notify_all()

    def count(self):
        with self._changed:
            if self._error is not None:
                raise self._error
            return self._done

    def wait(self, i):
        with self._changed:
            self._changed.wait_for(lambda: self._done > i or self._error is not None)
            if self._done <= i:
                raise self._error
