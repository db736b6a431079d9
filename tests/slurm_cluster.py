"""A two-node Slurm cluster on this machine, for tests: munged, slurmctld, two slurmd.

Each node is a network namespace of the emulated cluster's star (no rate
cap) with its own hostname (a UTS namespace), so inside a job `node1` and
`node2` resolve to different addresses, `hostname` names the node, and the
launchers reach the other node over a real link, as on a cluster. The NIC
has the same name on both nodes (`eth0`), as launchers that pick a common
interface (horovodrun) expect. slurmctld runs on node1, as on a small
cluster whose head node also computes; client commands (sbatch, sinfo,
scontrol) run there too, through `SlurmCluster.run`.

Everything lives in a fresh directory (munge key and socket, slurm.conf,
state, spool, logs); `stop` kills every process left in the nodes'
namespaces (slurmstepd and job tasks included) and removes them, whatever
state the cluster was left in. Needs root, `ip netns` and Debian's
slurm-wlm and munge (scripts/install_slurm.sh).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time

from pipe_horovod.tools.emulate import guard as emulate_guard
from pipe_horovod.tools.emulate import network as emulate_network

PREFIX = "phsl"         # + 4 random hex digits: namespaces phslXXXX-w0, -w1, -sw
SUBNET = "10.217.0.0/24"           # apart from the emulated cluster's 10.213.0.0/24
NODES = ("node1", "node2")
NIC = "eth0"
CTLD_PORT, SLURMD_PORT = 6817, 6818
KILL_WAIT = 5                      # s between a job's SIGTERM and SIGKILL (requeue, scancel)
# A job step credential's lifetime, and how long a requeued job waits before it starts
# again (Slurm revokes the killed run's credential until then: started sooner, the batch
# job is killed as "Job credential revoked"). Slurm's default: 120 s.
CRED_EXPIRE = 20
START_TIMEOUT = 60.0
DAEMONS = ("munged", "slurmctld", "slurmd", "sinfo", "sbatch", "scontrol", "srun")


def unavailable_reason():
    """None when the cluster can start here, else why not (one line, for the skip)."""
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} not found): "
                "scripts/install_slurm.sh installs slurm-wlm and munge where root and apt-get are")
    reason = emulate_network.unavailable_reason()
    if reason is not None:
        return f"the Slurm test cluster puts each node in a network namespace: {reason}"
    if shutil.which("unshare") is None or shutil.which("nsenter") is None:
        return "unshare/nsenter (util-linux) not found: each node needs its own hostname"
    return None


def _ip(ns, *args):
    subprocess.run(["ip", "-n", ns, *args], check=True, capture_output=True, timeout=30)


class SlurmError(RuntimeError):
    """The cluster did not come up; the message carries the daemons' log tails."""


class SlurmCluster:
    """`start()`, then `run([...])` client commands on node1; `stop()` always."""

    def __init__(self):
        self.dir = None
        self.topology = None
        # Its own names, so that two test sessions on one machine never tear down each
        # other's cluster; a guard process tears it down if this process is SIGKILLed.
        self.prefix = f"{PREFIX}{os.urandom(2).hex()}"
        self._guard = None
        self.procs = {}              # name -> Popen of each daemon we started
        self.start_seconds = None

    # ---- life ----

    def start(self):
        began = time.monotonic()
        self.dir = tempfile.mkdtemp(prefix="pipe-horovod-slurm-")
        self._guard = emulate_guard.start(self.prefix)
        try:
            self._network()
            self._munge()
            self._config()
            self.procs["slurmctld"] = self._daemon(0, ["slurmctld", "-D", "-i"])
            for i, node in enumerate(NODES):
                self.procs[f"slurmd-{node}"] = self._daemon(i, ["slurmd", "-D", "-N", node])
            self._wait_idle(began + START_TIMEOUT)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - began
        return self

    def stop(self):
        """Kills everything this cluster started, in any state; safe to call twice."""
        if self.topology is not None:
            # slurmd forks slurmstepd, which forks the tasks: all live in the namespaces
            self.topology.remove()
            self.topology = None
        for name, proc in list(self.procs.items()):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(emulate_network.KILL_GRACE)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            self.procs.pop(name)
        emulate_network.cleanup(self.prefix)
        if self._guard is not None:
            emulate_guard.stop(self._guard)
            self._guard = None
        if self.dir is not None and not os.environ.get("PIPE_HOROVOD_KEEP_SLURM"):
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        return False

    # ---- use ----

    @property
    def env(self):
        """The environment client commands and jobs see (sbatch exports it to the job)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
        env["SLURM_CONF"] = os.path.join(self.dir, "slurm.conf")
        return env

    def run(self, argv, *, env=None, timeout=60, check=True, **kwargs):
        """`argv` on node1 (its namespace and hostname), as a user logged in there."""
        res = subprocess.run(self.on_node(0, argv), env={**self.env, **(env or {})}, capture_output=True,
                             text=True, timeout=timeout, **kwargs)
        if check and res.returncode != 0:
            raise SlurmError(f"{' '.join(argv)} failed (exit {res.returncode}):\n"
                             f"{res.stdout}{res.stderr}")
        return res

    def logs(self, lines=30):
        """The tail of every daemon's log, for failure messages."""
        out = []
        for name in ("munged.log", "slurmctld.log", *(f"slurmd.{n}.log" for n in NODES)):
            path = os.path.join(self.dir, "log", name)
            try:
                with open(path) as f:
                    tail = f.read().splitlines()[-lines:]
            except OSError:
                tail = ["(none)"]
            out.append(f"--- {name}\n" + "\n".join(tail))
        return "\n".join(out)

    def set_link(self, node, up):
        """Cuts (or restores) node `node`'s only link: to the others it is then lost
        without a word, as when a node loses power or its switch port."""
        _ip(self.topology.namespaces[node], "link", "set", NIC, "up" if up else "down")

    def node_states(self):
        res = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
        return dict(line.split() for line in res.stdout.splitlines() if line.strip())

    # ---- parts ----

    def _network(self):
        self.topology = emulate_network.topology("star", len(NODES), None, prefix=self.prefix,
                                                 subnet=SUBNET, latency="50ms")
        self.topology.build()
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{addr} {node}\n" for addr, node in zip(self.topology.addresses, NODES))
        with open(os.path.join(self.dir, "hosts"), "w") as f:
            f.write(hosts)
        for ns, dev in zip(self.topology.namespaces, self.topology.interfaces):
            _ip(ns, "link", "set", dev, "down")
            _ip(ns, "link", "set", dev, "name", NIC)
            _ip(ns, "link", "set", NIC, "up")

    def _munge(self):
        munge = os.path.join(self.dir, "munge")
        os.makedirs(munge, mode=0o711)
        key = os.path.join(munge, "munge.key")
        with open(os.open(key, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
            f.write(os.urandom(128))
        self.munge_socket = os.path.join(munge, "munge.socket")
        os.makedirs(os.path.join(self.dir, "log"))
        # In node1's namespace (its socket is a file, reached from every node), so that
        # the namespace cleanup of a killed earlier run ends it too.
        self.procs["munged"] = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{self.topology.namespaces[0]}",
             "munged", "--foreground", "--force", f"--key-file={key}",
             f"--socket={self.munge_socket}", f"--pid-file={munge}/munged.pid",
             f"--seed-file={munge}/munged.seed", f"--log-file={self.dir}/log/munged.log"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not os.path.exists(self.munge_socket):
            if self.procs["munged"].poll() is not None or time.monotonic() > deadline:
                raise SlurmError("munged did not start:\n" + self.logs())
            time.sleep(0.05)

    def _config(self):
        d = self.dir
        for sub in ("state", "spool", "tmp", "scratch", "runc", *(f"spool/{n}" for n in NODES),
                    *(f"tmp/{n}" for n in NODES), *(f"local/{n}" for n in NODES)):
            os.makedirs(os.path.join(d, sub), exist_ok=True)
        nodes = "".join(
            f"NodeName={n} NodeHostname={n} NodeAddr={a} CPUs=1 RealMemory=1000 Gres=gpu:4\n"
            for n, a in zip(NODES, self.topology.addresses))
        conf = f"""\
ClusterName=pipetest
SlurmctldHost={NODES[0]}({self.topology.addresses[0]})
SlurmctldPort={CTLD_PORT}
SlurmdPort={SLURMD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket},cred_expire={CRED_EXPIRE}
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
TmpFS={d}/tmp/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
MpiDefault=none
SwitchType=switch/none
JobRequeue=1
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SlurmctldTimeout=30
SlurmdTimeout=20
MessageTimeout=10
InactiveLimit=0
MinJobAge=600
KillWait={KILL_WAIT}
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
{nodes}PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""
        with open(os.path.join(d, "slurm.conf"), "w") as f:
            f.write(conf)
        # --container: runc runs a job's tasks in the OCI bundle it names (oci.conf beside
        # slurm.conf), one container per task, its state under the cluster's directory.
        runc = f"runc --root={d}/runc"
        with open(os.path.join(d, "oci.conf"), "w") as f:
            f.write(f'RunTimeQuery="{runc} state %n.%u.%j.%s.%t"\n'
                    f'RunTimeKill="{runc} kill -a %n.%u.%j.%s.%t"\n'
                    f'RunTimeDelete="{runc} delete --force %n.%u.%j.%s.%t"\n'
                    f'RunTimeRun="{runc} run %n.%u.%j.%s.%t -b %b"\n')
        # The digits script asks for GPUs (--gpus-per-node) and trains on the CPU: each
        # node declares 4, whose "device files" are empty files (Slurm only hands their
        # indices to the job in CUDA_VISIBLE_DEVICES; task/none constrains nothing).
        os.makedirs(os.path.join(d, "dev"))
        for i in range(4):
            open(os.path.join(d, "dev", f"gpu{i}"), "w").close()
        with open(os.path.join(d, "gres.conf"), "w") as f:
            f.write(f"Name=gpu File={d}/dev/gpu[0-3]\n")

    def _daemon(self, node, argv):
        return subprocess.Popen(self.on_node(node, argv), env=self.env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)

    def on_node(self, node, argv):
        """`argv` wrapped to run on node `node`: its network namespace, its hostname and its
        /etc/hosts. Not `ip netns exec`, which remounts /sys without the cgroup tree that
        slurmd needs."""
        d = self.dir
        return ["nsenter", f"--net=/run/netns/{self.topology.namespaces[node]}",
                "unshare", "--mount", "--uts", "--propagation", "private", "sh", "-c",
                f"mount --bind {d}/hosts /etc/hosts && "
                f"mount --bind {d}/local/{NODES[node]} {self.scratch} && "
                f'hostname {NODES[node]} && exec "$@"', "sh", *argv]

    def in_mounts_of(self, node, argv):
        """`argv` wrapped to run in node `node`'s mount namespace: what a test mounts for
        the nodes after they started (each mounted its own privately) goes there."""
        return ["nsenter", f"--mount=/proc/{self.procs[f'slurmd-{NODES[node]}'].pid}/ns/mnt",
                *argv]

    @property
    def scratch(self):
        """A node-local disk: the same path on every node, a different directory on each."""
        return os.path.join(self.dir, "scratch")

    def _wait_idle(self, deadline):
        states = {}
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise SlurmError(f"{name} exited ({proc.returncode}):\n" + self.logs())
            states = self.node_states()
            if all(states.get(n) == "idle" for n in NODES):
                return
            time.sleep(0.2)
        raise SlurmError(f"nodes not idle within {START_TIMEOUT:.0f} s ({states}):\n"
                         + self.logs())
