"""A small cluster on one machine: one network namespace per worker.

Benchmarks of pipelined SGD mean little over loopback, where bandwidth is
many GB/s and latency ~0. Here each worker gets its own namespace, joined
to the others as a star (every worker's link to a Linux bridge in a
"switch" namespace) or a chain (`pipe_horovod.tools.emulate.network` builds
either), and every link is capped both ways with a token bucket (tbf;
netem is not available on these machines). Horovod and torch.distributed
then talk over real TCP through links that behave like a NIC of the
chosen rate. This module runs the cluster's life: building, launching
workers into it, waiting, tearing down whatever happens.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN for ``ip netns``). Only
addresses inside the namespaces created here are used. Stdlib only, so it
imports without torch or horovod.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import NamedTuple

from . import guard as emulate_guard
from . import network as emulate_network
from .network import KILL_GRACE as _KILL_GRACE, POLL as _POLL
from .network import cleanup, leftovers, unavailable_reason

__all__ = ["EmulatedCluster", "Launch", "ClusterError", "leftovers", "cleanup",
           "unavailable_reason", "cpu_times", "CpuTimes"]

# Inherited variables that would make a worker join the wrong job.
_SCRUB = re.compile(r"^(HOROVOD_|OMPI_|PMI_|PMIX_|TORCHELASTIC_)"
                    r"|^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK|"
                    r"GROUP_WORLD_SIZE|ROLE_RANK|ROLE_NAME|ROLE_WORLD_SIZE|MASTER_ADDR|"
                    r"MASTER_PORT|GLOO_SOCKET_IFNAME|NCCL_SOCKET_IFNAME|"
                    r"PIPE_HOROVOD_ENGINE)$")


class ClusterError(RuntimeError):
    """A worker failed or timed out; the message carries every worker's log tail."""


def _kill_group(pid, sig):
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class CpuTimes(NamedTuple):
    user: float
    system: float

    @property
    def total(self):
        return self.user + self.system


def wait_polling(cluster, job, poll, interval=0.5):
    """`cluster.wait(job)`, calling `poll()` every `interval` seconds meanwhile
    (a progress bar that follows the workers' output). Returns the exit codes."""
    outcome = {}

    def waiter():
        try:
            outcome["codes"] = cluster.wait(job)
        except BaseException as exc:  # noqa: BLE001 - handed to the calling thread
            outcome["error"] = exc

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    while thread.is_alive():
        poll()
        thread.join(interval)
    if "error" in outcome:
        raise RuntimeError(str(outcome["error"]))
    return outcome["codes"]


def read_progress(path):
    """The workers' progress file as JSON, or None while it is missing or half-written."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def cpu_times(proc):
    """CPU seconds of a launched worker, waited-for children included.

    Lets a benchmark say how much of the 2 shared cores each worker (and its
    communication threads) used. Works while the worker runs and after
    `EmulatedCluster.wait`, which keeps the rusage it reaped.
    """
    usage = getattr(proc, "pipe_horovod_rusage", None)
    if usage is not None:
        return CpuTimes(usage.ru_utime, usage.ru_stime)
    try:
        with open(f"/proc/{proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        raise ValueError(f"pid {proc.pid} is gone and was not reaped by EmulatedCluster.wait")
    tick = os.sysconf("SC_CLK_TCK")
    # fields[0] is the state (3rd field of stat): utime, stime, cutime, cstime are 14..17
    ut, st, cut, cst = (int(x) / tick for x in fields[11:15])
    return CpuTimes(ut + cut, st + cst)


class Launch:
    """One launch: a process per worker, their logs, and (horovod) the rendezvous helper."""

    def __init__(self, procs, logs, deadline, helper=None):
        self.procs = procs
        self.logs = logs
        self.deadline = deadline
        self.helper = helper

    def __iter__(self):
        return iter(self.procs)

    def __len__(self):
        return len(self.procs)

    def log(self, rank):
        with open(self.logs[rank], errors="replace") as f:
            return f.read()

    def tail(self, rank, lines=30):
        return tail_file(self.logs[rank], lines)


def tail_file(path, lines=30):
    """The last `lines` lines of a worker's log, for error messages; never raises."""
    try:
        with open(path, errors="replace") as f:
            return "\n".join(f.read().splitlines()[-lines:])
    except OSError:
        return "<no log>"


_RENDEZVOUS = r"""
import sys
from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
from horovod.runner.http.http_server import RendezvousServer
hosts = sys.argv[1].split(",")
server = RendezvousServer()
port = server.start()
server.init(get_host_assignments(parse_hosts(",".join(h + ":1" for h in hosts)), len(hosts)))
print(port, flush=True)
sys.stdin.read()   # serve until the launcher closes the pipe or dies
"""

_FREE_PORT = ("import socket; s = socket.socket(); s.bind(('', 0)); "
              "print(s.getsockname()[1])")


class EmulatedCluster:
    """``with EmulatedCluster(workers=2, rate="1gbit") as cluster: ...``

    Worker i runs in namespace ``<prefix>-w<i>`` and binds interface ``<prefix>w<i>``,
    address ``.<i+1>``. ``topology="star"`` (the default): that interface is a veth
    whose other end ``<prefix>s<i>`` is on bridge ``<prefix>br`` (address ``.254``) in
    namespace ``<prefix>-sw``. ``topology="chain"``: namespaces i and i+1 are linked
    directly, the middle ones forward (`emulate_network.Chain`); ``switch``,
    ``bridge``, ``bridge_address`` and ``switch_ports`` are None. The prefix is random
    per instance so parallel runs never collide. ``rate=None`` leaves links uncapped.
    Everything is torn down on exit, exceptions, SIGINT/SIGTERM, and at interpreter
    exit; pass ``log_dir`` to keep worker logs afterwards (a temporary one goes with the
    cluster). An owner killed by SIGKILL runs no handler: a guard process
    (`emulate_guard`) then tears down for it.
    """

    def __init__(self, workers=2, rate="1gbit", *, subnet="10.213.0.0/24",
                 latency="25ms", prefix=None, log_dir=None, python=None, topology="star"):
        self.prefix = prefix or f"ph{os.urandom(3).hex()}"
        self.network = emulate_network.topology(topology, workers, rate, prefix=self.prefix,
                                                subnet=subnet, latency=latency)
        self.topology = topology
        self.workers = workers
        self.rate = rate
        self.latency = latency
        self.python = python or sys.executable
        net = self.network
        self.prefixlen = net.prefixlen
        self.namespaces, self.interfaces, self.addresses = (
            net.namespaces, net.interfaces, net.addresses)
        self.switch, self.bridge, self.bridge_address, self.switch_ports = (
            net.switch, net.bridge, net.bridge_address, net.switch_ports)
        self._own_log_dir = log_dir is None
        self.log_dir = log_dir
        self._jobs = []
        self._active = False
        self._closing = False
        self._pending_signal = None
        self._old_handlers = {}
        self._guard = None   # tears down if we die by SIGKILL (emulate_guard)
        self._lock = threading.RLock()

    # -- setup -------------------------------------------------------------

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def start(self):
        if os.geteuid() != 0:
            raise PermissionError("EmulatedCluster needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN "
                                  "for 'ip netns'); run as root or skip the emulated cluster")
        with self._lock:
            if self._active:
                return self
            self._active = True
            atexit.register(self.close)
            self._install_signal_handlers()
            self._guard = emulate_guard.start(self.prefix)
            try:
                self._build()
            except BaseException:
                self.close()
                raise
        return self

    def _build(self):
        if self.log_dir is None:
            self.log_dir = tempfile.mkdtemp(prefix=f"{self.prefix}-logs-")
        os.makedirs(self.log_dir, exist_ok=True)
        self.network.build()

    def link_stats(self, rank):
        """Bytes worker ``rank`` put on / took off its wires and how often tbf held
        packets back on them (`emulate_network.Topology.link_stats`)."""
        return self.network.link_stats(rank)

    # -- launching ---------------------------------------------------------

    def _exec(self, ns, argv):
        return ["ip", "netns", "exec", ns, *argv]

    def _helper_output(self, argv, timeout, keep=False):
        """Runs a helper in a namespace and returns its first stdout line (bounded)."""
        errpath = os.path.join(self.log_dir, f"helper{len(self._jobs)}.log")
        with open(errpath, "wb") as err:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=err, start_new_session=True, text=True)
        deadline = time.monotonic() + timeout
        line = ""
        try:
            while time.monotonic() < deadline and proc.poll() is None:
                ready, _, _ = select.select([proc.stdout], [], [], _POLL * 4)
                if ready:
                    line = proc.stdout.readline().strip()
                    break
            if not line:
                _kill_group(proc.pid, signal.SIGKILL)
                proc.wait(timeout=_KILL_GRACE)
                raise RuntimeError(f"helper gave no answer within {timeout:.0f} s: "
                                   f"{' '.join(argv[:6])}...\n{tail_file(errpath)}")
        except BaseException:
            _kill_group(proc.pid, signal.SIGKILL)
            raise
        if not keep:
            proc.stdin.close()
            proc.wait(timeout=_KILL_GRACE)
            proc.stdout.close()
            return line, None
        return line, proc

    def free_port(self, rank=0):
        """A port free inside worker ``rank``'s namespace (ports are per namespace)."""
        line, _ = self._helper_output(self._exec(self.namespaces[rank],
                                                 [self.python, "-c", _FREE_PORT]), 30.0)
        return int(line)

    def worker_env(self, rank, engine, **extra):
        """The variables a launcher (torchrun / horovodrun) would give worker ``rank``."""
        size, iface = self.workers, self.interfaces[rank]
        if engine == "torch":
            env = {"RANK": rank, "WORLD_SIZE": size, "LOCAL_RANK": 0, "LOCAL_WORLD_SIZE": 1,
                   "MASTER_ADDR": self.addresses[0], "MASTER_PORT": extra["master_port"],
                   "GLOO_SOCKET_IFNAME": iface}
        elif engine == "horovod":
            env = {"HOROVOD_RANK": rank, "HOROVOD_SIZE": size, "HOROVOD_LOCAL_RANK": 0,
                   "HOROVOD_LOCAL_SIZE": 1, "HOROVOD_CROSS_RANK": rank,
                   "HOROVOD_CROSS_SIZE": size, "HOROVOD_HOSTNAME": self.namespaces[rank],
                   "HOROVOD_GLOO_RENDEZVOUS_ADDR": self.network.rendezvous[1],
                   "HOROVOD_GLOO_RENDEZVOUS_PORT": extra["rendezvous_port"],
                   "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
                   "HOROVOD_GLOO_IFACE": iface,
                   # Horovod reads only HOROVOD_GLOO_IFACE; this is for a torch.distributed
                   # gloo group the worker may start next to Horovod (the bench's ddp).
                   "GLOO_SOCKET_IFNAME": iface}
        else:
            raise ValueError(f"engine must be 'torch' or 'horovod', not {engine!r}")
        env["PIPE_HOROVOD_ENGINE"] = engine
        env["PYTHONUNBUFFERED"] = "1"
        return {k: str(v) for k, v in env.items()}

    def launch(self, argv, engine="torch", env=None, timeout=600.0):
        """Starts ``argv`` once per worker, inside its namespace, in its own process group.

        ``env`` is added to (and overrides) the launcher variables. ``timeout`` is the
        default bound for `wait`. Output (stdout and stderr) goes to ``job.logs[rank]``.
        """
        if not self._active:
            raise RuntimeError("launch() outside the 'with EmulatedCluster(...)' block")
        argv = [str(a) for a in argv]
        base = {k: v for k, v in os.environ.items() if not _SCRUB.search(k)}
        extra, helper = {}, None
        if engine == "torch":
            extra["master_port"] = self.free_port(0)
        elif engine == "horovod":
            line, helper = self._helper_output(
                self._exec(self.network.rendezvous[0], [self.python, "-c", _RENDEZVOUS,
                                                        ",".join(self.namespaces)]),
                60.0, keep=True)
            extra["rendezvous_port"] = int(line)
        run_id = len(self._jobs)
        procs, logs = [], []
        job = Launch(procs, logs, time.monotonic() + timeout, helper)
        with self._lock:
            self._jobs.append(job)
            for rank, ns in enumerate(self.namespaces):
                wenv = {**base, **self.worker_env(rank, engine, **extra), **(env or {})}
                path = os.path.join(self.log_dir, f"job{run_id}-worker{rank}.log")
                logs.append(path)
                with open(path, "wb") as log:
                    procs.append(subprocess.Popen(self._exec(ns, argv), env=wenv,
                                                  stdin=subprocess.DEVNULL, stdout=log,
                                                  stderr=subprocess.STDOUT,
                                                  start_new_session=True))
        return job

    def wait(self, job, timeout=None):
        """Exit codes once every worker is done. Raises `ClusterError` with every worker's
        log tail if one fails or the time runs out; the rest are then killed, so it never
        hangs on a worker stuck in a collective whose peer died."""
        procs = job.procs if isinstance(job, Launch) else list(job)
        deadline = (time.monotonic() + timeout if timeout is not None
                    else getattr(job, "deadline", time.monotonic() + 600.0))
        failed = None
        while True:
            for p in procs:
                _reap(p)
            codes = [p.returncode for p in procs]
            failed = next((c for c in codes if c not in (None, 0)), None)
            if failed is not None or None not in codes or time.monotonic() >= deadline:
                break
            time.sleep(_POLL)
        if failed is not None or None in codes:
            self._stop(procs)
        if isinstance(job, Launch):
            self._stop_helper(job)
        if failed is None and None not in codes:
            return codes
        why = "timed out" if failed is None else "a worker failed"
        lines = [f"emulated cluster {self.prefix}: {why}; exit codes {codes}"]
        for rank, p in enumerate(procs):
            tail = job.tail(rank) if isinstance(job, Launch) else "<log in job.logs>"
            lines.append(f"--- worker {rank} (exit {p.returncode}) ---\n{tail}")
        raise ClusterError("\n".join(lines))

    def _stop(self, procs):
        for p in procs:
            if p.returncode is None:
                _kill_group(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + _KILL_GRACE
        while time.monotonic() < deadline and any(_reap(p) is None for p in procs):
            time.sleep(_POLL)
        for p in procs:
            if _reap(p) is None:
                _kill_group(p.pid, signal.SIGKILL)
                p.wait(timeout=_KILL_GRACE)

    def _stop_helper(self, job):
        if job.helper is not None:
            try:
                job.helper.stdin.close()
            except OSError:
                pass
            self._stop([job.helper])
            job.helper.stdout.close()
            job.helper = None

    # -- teardown ----------------------------------------------------------

    def close(self):
        """Idempotent teardown: processes first (they pin namespaces), then the namespaces
        this instance created (which takes their veths and bridge with them) and their
        /etc/netns entries."""
        with self._lock:
            if not self._active or self._closing:
                return
            self._closing = True
        try:
            for job in self._jobs:
                try:
                    self._stop(job.procs)
                finally:
                    self._stop_helper(job)
            self.network.remove()
            if self._own_log_dir and self.log_dir:
                shutil.rmtree(self.log_dir, ignore_errors=True)
        finally:
            if self._guard is not None:
                emulate_guard.stop(self._guard)
                self._guard = None
            self._active = False
            self._closing = False
            atexit.unregister(self.close)
            self._restore_signal_handlers()
        if self._pending_signal is not None:
            sig, self._pending_signal = self._pending_signal, None
            self._chain(sig, None)

    def _install_signal_handlers(self):
        if threading.current_thread() is not threading.main_thread():
            return   # only the main thread may set handlers; atexit still cleans up
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def _restore_signal_handlers(self):
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
        self._old_handlers = {}

    def _on_signal(self, sig, frame):
        if self._closing:
            self._pending_signal = sig   # finish tearing down, then deliver
            return
        old = self._old_handlers.get(sig)
        self.close()
        self._chain(sig, frame, old)

    @staticmethod
    def _chain(sig, frame, old=None):
        """Hands the signal on as if we had never been there (KeyboardInterrupt, or death)."""
        if old is None:
            old = signal.getsignal(sig)
        if callable(old):
            old(sig, frame)
        elif old == signal.SIG_DFL:
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)


def _reap(proc):
    """Reaps with wait4 so the worker's rusage (CPU time) survives its exit."""
    if proc.returncode is None:
        try:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        except ChildProcessError:
            return proc.poll()
        if pid == proc.pid:
            proc.pipe_horovod_rusage = usage
            proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode
