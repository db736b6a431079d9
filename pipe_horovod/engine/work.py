"""How an engine finishes an operation: poll it, then wait for its result.

Libraries hand back their own handles (a Horovod handle id, a
torch.distributed Work); an engine wraps them in these when finishing
needs more than the library's wait: trimming a padded allgather, dividing
a sum, combining the parts of a grouped operation.
"""


class Work:
    """Backend state of an operation that knows how to poll and finish itself.

    Engines return one from a `_start_*` hook when finishing needs more than
    the library's own wait (trimming a padded allgather, dividing a sum);
    `wait` returns what `finish` makes of it.
    """

    def poll(self):
        raise NotImplementedError

    def wait(self):
        raise NotImplementedError


class WorkList(Work):
    """Several operations finished together (a grouped operation run one by one)."""

    def __init__(self, works):
        self.works = works

    def poll(self):
        return all(work.poll() for work in self.works)

    def wait(self):
        return [work.wait() for work in self.works]


class Then(Work):
    """Another operation's result, passed through `fn` when it completes."""

    def __init__(self, work, fn):
        self.work = work
        self.fn = fn

    def poll(self):
        return self.work.poll()

    def wait(self):
        return self.fn(self.work.wait())


class Done(Work):
    """An operation complete when it started (one rank, nothing to send)."""

    def __init__(self, result):
        self.result = result

    def poll(self):
        return True

    def wait(self):
        return self.result
