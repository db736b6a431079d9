"""The failures every adapter raises and elastic training tells apart.

HorovodInternalError (a collective failed: elastic restores the last commit
and resets) and HostsUpdatedInterrupt (hosts were added or removed: elastic
keeps the state and resets) are defined where the engine raises them
(engine/faults.py: Horovod's own classes when Horovod is installed, so
`except hvd.HorovodInternalError` catches what horovod.torch raises too).
They are re-exported here, the layer the adapters take them from, rather
than moved, so the engine never imports upward.

RepeatedFailureError is the common layer's own: the failure elastic
training does not retry, because restoring did not make it go away.
"""
from ..engine import (HorovodInternalError, HostsUpdatedInterrupt, RankLostError, WaitError,
                      WaitTimeoutError)


class RepeatedFailureError(RuntimeError):
    """The same failure ended several elastic attempts in a row, each started from the
    same commit: restoring does not cure it (a misuse that raises the same error at the
    same point every time), so elastic `run` stops instead of looping forever.

    Not a HorovodInternalError, so no elastic loop (Horovod's included) catches it.

    Attributes:
        cause: the failure of the last attempt (also `__cause__`).
        count: how many attempts in a row it ended.
    """

    def __init__(self, cause, count, variable):
        self.cause, self.count = cause, count
        super().__init__(
            f"elastic training stopped: the same failure ended {count} attempts in a row, "
            f"each restored from the same commit, so restoring does not cure it: "
            f"{type(cause).__name__}: {cause}. Fix its cause (it is raised above); "
            f"{variable} sets how many identical failures in a row end the run")


__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "RankLostError",
           "RepeatedFailureError", "WaitError", "WaitTimeoutError"]
