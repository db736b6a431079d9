"""Bounded waits, and naming the rank that is gone when a collective fails.

A pipelined step waits on reductions other ranks must take part in; a rank
that died or stopped would otherwise leave the others blocked for good:
Horovod's own `synchronize` spins in C++ until the handle completes and
torch.distributed's gloo waits up to its process group's timeout (30
minutes by default). So every engine wait polls the handle against a
deadline (`PIPE_HOROVOD_TIMEOUT` or `init(timeout=...)`, default
DEFAULT_TIMEOUT_S) and raises WaitTimeoutError past it.

The default is ten minutes: long enough for one rank to evaluate or write
a large checkpoint while the others wait on a flush (the slowest legitimate
wait), as torch's NCCL default; short enough that a hung job is noticed.

A peer killed mid-step makes the library fail fast (its sockets close), but
with a message about a socket ("Connection reset by peer [127.0.0.1]:port").
At start-up every rank learns every other's host and process id; when a
collective fails, the ranks on this host that no longer run are named
(RankLostError). Ranks on other hosts cannot be checked from here; the
error says so.
"""
import math
import os
import socket
import time

try:  # Horovod's own classes when it is installed, so `except hvd.HorovodInternalError`
    # catches what horovod.torch raises under the horovod engine as well.
    from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
except ImportError:
    class HorovodInternalError(RuntimeError):
        """A collective failed on some rank (elastic training resets on it)."""

    class HostsUpdatedInterrupt(RuntimeError):
        """The set of hosts changed (elastic training resets without restoring)."""

        def __init__(self, skip_sync):
            super().__init__(skip_sync)
            self.skip_sync = skip_sync

TIMEOUT_VARIABLE = "PIPE_HOROVOD_TIMEOUT"
DEFAULT_TIMEOUT_S = 600.0
# Longest sleep between two polls of a handle still in flight: the most a
# wait can return late. Horovod's own wait spins a core instead.
POLL_CAP_S = 250e-6
# How long a failed collective looks for the dead peer (its sockets close a
# moment before the kernel marks the process dead).
_LOOK_S = 2.0


class EngineError(RuntimeError):
    """A communication engine cannot be used as asked."""


class WaitError(HorovodInternalError):
    """A wait of the pipeline failed because of another rank. A HorovodInternalError, so
    Horovod's elastic training resets on it as on the library's own failures."""


class WaitTimeoutError(WaitError, TimeoutError):
    """A wait passed its deadline (PIPE_HOROVOD_TIMEOUT)."""


class RankLostError(WaitError):
    """A collective failed and a rank it needs no longer runs."""


def resolve_timeout(value=None):
    """Seconds a wait may block: `value`, else $PIPE_HOROVOD_TIMEOUT, else the default.

    math.inf (or "inf") waits forever with the library's own blocking wait.
    """
    source = "timeout"
    if value is None:
        value = os.environ.get(TIMEOUT_VARIABLE)
        source = TIMEOUT_VARIABLE
        if value is None or value.strip() == "":
            return DEFAULT_TIMEOUT_S
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"{TIMEOUT_VARIABLE} must be a number of seconds > 0 (or inf), "
                             f"got {os.environ[TIMEOUT_VARIABLE]!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{source} must be a number of seconds, got {type(value).__name__} "
                        f"{value!r}")
    if math.isnan(value) or value <= 0:
        raise ValueError(f"{source} must be a number of seconds > 0 (or inf), got {value!r}")
    return float(value)


def wait_until(poll, deadline, nap=None):
    """True once `poll()` is, False at `deadline` (time.monotonic()) if it never was.

    Sleeps between polls grow from 20 us to POLL_CAP_S, so a short wait costs
    a few polls and a long one at most POLL_CAP_S of extra latency; `nap(seconds)`,
    when given, pauses instead (one the operation can end early when it completes).
    """
    if poll():
        return True
    nap = nap or time.sleep
    pause = 20e-6
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        nap(min(pause, left))
        pause = min(2 * pause, POLL_CAP_S)
        if poll():
            return True


def whoami():
    """What other ranks need to check from their host that this process still runs."""
    return socket.gethostname(), os.getpid()


def _runs(pid):
    """False once process `pid` has exited (a zombie no longer runs)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def runs_here(peer):
    """Whether `peer` (host, pid) still runs; None when it runs on another host."""
    host, pid = peer
    return _runs(pid) if host == socket.gethostname() else None


def lost_ranks(peers, me, look_s=_LOOK_S):
    """The ranks in `peers` [(host, pid) by rank] on this host that no longer run.

    Looks for up to `look_s`: a peer's sockets close a moment before it is dead.
    """
    host = socket.gethostname()
    here = [r for r, (h, _) in enumerate(peers) if h == host and r != me]
    deadline = time.monotonic() + look_s
    while True:
        gone = [r for r in here if not _runs(peers[r][1])]
        if gone or not here or time.monotonic() >= deadline:
            return gone
        time.sleep(0.05)


def describe_lost(peers, me, gone):
    """The sentence that names the lost ranks, or says which could not be checked."""
    if gone:
        which = ", ".join(f"rank {r} (pid {peers[r][1]} on {peers[r][0]})" for r in gone)
        return f"{which} no longer runs"
    # By host, with their ranks: a node that vanished (its link cut, its power off) is
    # then named with the ranks it took along, which is what the user looks for.
    elsewhere = {}
    for r, (h, _) in enumerate(peers):
        if r != me and h != socket.gethostname():
            elsewhere.setdefault(h, []).append(r)
    if elsewhere:
        which = " and ".join(f"{'ranks' if len(rs) > 1 else 'rank'} "
                             f"{', '.join(map(str, rs))} on {h}"
                             for h, rs in sorted(elsewhere.items()))
        return f"every other rank on this host still runs; {which} cannot be checked from here"
    return "every other rank still runs"
