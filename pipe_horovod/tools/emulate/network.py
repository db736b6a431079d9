"""The emulated cluster's network: namespaces, veths, token-bucket caps, link counters.

`pipe_horovod.tools.emulate.EmulatedCluster` launches workers; this module builds
what they talk over, one topology at a time:

- star: every worker's single link goes to a Linux bridge in a "switch"
  namespace, as in a cluster of hosts on one switch.
- chain: namespace i is linked to i+1 only, and the middle namespaces
  route (IP forwarding) what passes between non-neighbours, as in a chain
  of devices (e.g. GPUs on a PCIe chain). Linear pipelining was designed
  for this: each link carries its reduce stream one way and its broadcast
  stream the other, where on a star a middle rank's one link carries both
  streams each way.

Every link is capped both ways by a token bucket (tbf; netem is not
available on these machines). Only namespaces created here are ever
deleted, and nothing is created in the root namespace. Stdlib only, like
`pipe_horovod.tools.emulate`.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time

NETNS_ETC = "/etc/netns"
CMD_TIMEOUT = 30.0        # any single ip/tc call
KILL_GRACE = 3.0          # SIGTERM -> SIGKILL
POLL = 0.05
# tbf's peak bucket (see Topology._cap): how far above the rate a burst may drain, and
# how many bytes may go early after an idle moment (one 64 KiB GSO packet and headers).
PEAK_OVER_RATE = 1.02
PEAK_BUCKET = 70000


def _run(cmd, check=True):
    """Runs ip/tc with a bound; a failure names the command, since that is what one debugs."""
    try:
        res = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                             timeout=CMD_TIMEOUT)
    except FileNotFoundError as e:
        raise RuntimeError(f"{cmd[0]!r} not found: the emulated cluster needs iproute2") from e
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"command timed out after {CMD_TIMEOUT:.0f} s: {' '.join(cmd)}") from e
    if check and res.returncode != 0:
        msg = (f"command failed (exit {res.returncode}): {' '.join(cmd)}\n"
               f"{res.stderr.strip()}")
        if "permitted" in res.stderr or "denied" in res.stderr:
            raise PermissionError(msg + "\n(needs root: CAP_NET_ADMIN and CAP_SYS_ADMIN)")
        raise RuntimeError(msg)
    return res


def rate_bytes(rate):
    """Bytes/s of a tc rate: tbf's burst is sized from it; `bench --emulate` checks by it.

    Args:
        rate: a number (bits/s) or a tc rate string ("1gbit", "500mbit", "10mbps"; a
            bare number is bits/s, "bps" bytes/s).

    Returns:
        The rate in bytes per second, as a float.

    Raises:
        ValueError: `rate` is not a number nor a tc rate.
    """
    if isinstance(rate, (int, float)):
        return float(rate) / 8
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]?)(bit|bps)?\s*", str(rate).lower())
    if not m:
        raise ValueError(f"unrecognised rate {rate!r}; use e.g. '1gbit', '100mbit'")
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
    return value if m.group(3) == "bps" else value / 8   # tc: bare number = bit/s


def _tc_rate(rate):
    return f"{int(rate)}bit" if isinstance(rate, (int, float)) else str(rate)


def _netns_list():
    res = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in res.stdout.splitlines() if line.strip()]


def leftovers(prefix):
    """Everything with this prefix still on the machine (namespaces, /etc/netns dirs,
    interfaces in the root namespace); empty after a clean teardown."""
    found = [f"netns:{n}" for n in _netns_list() if n.startswith(prefix)]
    if os.path.isdir(NETNS_ETC):
        found += [f"etc:{NETNS_ETC}/{d}" for d in sorted(os.listdir(NETNS_ETC))
                  if d.startswith(prefix)]
    res = _run(["ip", "-o", "link", "show"], check=False)
    for line in res.stdout.splitlines():
        parts = line.split(":")
        if len(parts) > 1 and parts[1].strip().split("@")[0].startswith(prefix):
            found.append(f"link:{parts[1].strip()}")
    return found


def _kill_netns(ns, deadline):
    """Kills what still runs in a namespace: `ip netns del` only unmounts it, and a
    live process would keep the namespace and its veths alive."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
        if not pids:
            return
        for p in pids:
            try:
                os.kill(int(p), sig)
            except (ProcessLookupError, ValueError):
                pass
        while time.monotonic() < deadline and _run(["ip", "netns", "pids", ns],
                                                   check=False).stdout.split():
            time.sleep(POLL)
        deadline = time.monotonic() + KILL_GRACE


def _remove_netns(ns):
    if ns in _netns_list():
        _kill_netns(ns, time.monotonic() + KILL_GRACE)
        _run(["ip", "netns", "del", ns], check=False)
    shutil.rmtree(os.path.join(NETNS_ETC, ns), ignore_errors=True)


def cleanup(prefix):
    """Removes what a killed (SIGKILL) run left behind; no handler can run then."""
    if len(prefix) < 3:
        raise ValueError("prefix too short to clean up safely")
    names = set(n for n in _netns_list() if n.startswith(prefix))
    if os.path.isdir(NETNS_ETC):
        names |= {d for d in os.listdir(NETNS_ETC) if d.startswith(prefix)}
    for ns in sorted(names):
        _remove_netns(ns)


def unavailable_reason():
    """None when namespaces can be made here, else why not (for test skips)."""
    if os.geteuid() != 0:
        return "the emulated cluster needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    probe = f"phprobe{os.getpid()}"
    res = _run(["ip", "netns", "add", probe], check=False)
    if res.returncode != 0:
        return f"'ip netns add' is not permitted here: {res.stderr.strip()}"
    _run(["ip", "netns", "del", probe], check=False)
    return None


class Topology:
    """One worker namespace per rank, ``<prefix>-w<i>``, whose address gloo binds to on
    interface ``<prefix>w<i>``; the subclasses join them. Keeps the list of namespaces it
    created, the only ones `remove` deletes."""

    # The star's switch; a topology without one leaves these None.
    switch = bridge = bridge_address = switch_ports = None

    def __init__(self, workers, rate, *, prefix, subnet, latency):
        if workers < 1:
            raise ValueError("workers must be >= 1")
        net = ipaddress.ip_network(subnet)
        if not net.is_private or net.num_addresses < workers + 3:
            raise ValueError(f"subnet {subnet} must be private and hold {workers} workers")
        if rate is not None:
            rate_bytes(rate)
        if len(prefix) + 1 + len(str(workers - 1)) > 15:
            raise ValueError("prefix too long for 15-character interface names")
        self.workers, self.rate, self.latency, self.prefix = workers, rate, latency, prefix
        self.hosts = list(net.hosts())
        self.prefixlen = net.prefixlen
        self.namespaces = [f"{prefix}-w{i}" for i in range(workers)]
        self.interfaces = [f"{prefix}w{i}" for i in range(workers)]
        self.addresses = [str(self.hosts[i]) for i in range(workers)]
        self.created = []

    @property
    def rendezvous(self):
        """(namespace, address) where a launcher's rendezvous helper serves the workers."""
        raise NotImplementedError

    def build(self):
        raise NotImplementedError

    def _wires(self, rank):
        """(namespace, device) of each link end in worker ``rank``'s namespace."""
        raise NotImplementedError

    def _far_ends(self, rank):
        """(namespace, device) of the other end of each of those links."""
        raise NotImplementedError

    def remove(self):
        while self.created:
            _remove_netns(self.created.pop())

    def link_stats(self, rank):
        """Bytes worker ``rank`` put on / took off its wires (on a chain, what it forwards
        too), and how often tbf held packets back at either end of them (both
        directions): evidence that the cap bit, and a way to see what compression saves
        on the wire."""
        stats = {"tx_bytes": 0, "rx_bytes": 0, "overlimits": 0, "drops": 0}
        for ns, dev in self._wires(rank):
            link = json.loads(_run(["ip", "-n", ns, "-s", "-j", "link", "show", "dev", dev]
                                   ).stdout)[0]["stats64"]
            stats["tx_bytes"] += link["tx"]["bytes"]
            stats["rx_bytes"] += link["rx"]["bytes"]
        if self.rate is not None:
            for ns, dev in [*self._wires(rank), *self._far_ends(rank)]:
                qdisc = json.loads(_run(["tc", "-n", ns, "-s", "-j", "qdisc", "show", "dev",
                                         dev]).stdout)[0]
                stats["overlimits"] += qdisc.get("overlimits", 0)
                stats["drops"] += qdisc.get("drops", 0)
        return stats

    def _add_netns(self, ns):
        _run(["ip", "netns", "add", ns])
        self.created.append(ns)

    def _add_worker(self, rank):
        ns = self.namespaces[rank]
        self._add_netns(ns)
        # Horovod 0.28.1's process-set Gloo context resolves the hostname and
        # ignores HOROVOD_GLOO_IFACE; `ip netns exec` bind-mounts this over /etc/hosts.
        etc = os.path.join(NETNS_ETC, ns)
        os.makedirs(etc, exist_ok=True)
        with open(os.path.join(etc, "hosts"), "w") as f:
            f.write(f"127.0.0.1 localhost\n{self.addresses[rank]} {socket.gethostname()}\n")
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _link(self, ns_a, dev_a, ns_b, dev_b):
        """A veth from ``ns_a`` to ``ns_b``, capped at both ends and up. Created directly
        inside the namespaces: no name ever appears in the root namespace."""
        _run(["ip", "-n", ns_a, "link", "add", dev_a, "type", "veth", "peer", "name", dev_b,
              "netns", ns_b])
        for ns, dev in ((ns_b, dev_b), (ns_a, dev_a)):
            if self.rate is not None:
                self._cap(ns, dev)
            _run(["ip", "-n", ns, "link", "set", dev, "up"])

    def _cap(self, ns, dev):
        """Egress tbf on both ends of a link caps it both ways. The burst holds ~2 ms of
        traffic (at least 64 KiB, a GSO super-packet) so TCP can reach the rate: with a
        64 KiB burst gloo's allreduce reached 96 MB/s at 1gbit, with 2 ms 119.

        That bucket alone is not a NIC: after the link idled it sends a whole burst at
        memory speed, so a sender that paused for CPU work (a per-hop codec) caught up
        for free, and any message under ~250 KB crossed a 1gbit link in no time. The
        peak bucket drains at 1.02x the rate and holds one GSO super-packet, so after
        an idle moment at most PEAK_BUCKET bytes go early, as on a wire that cannot
        bank time (docs/bench/log.md, "A link that cannot bank idle time")."""
        rate = rate_bytes(self.rate)
        burst = max(int(rate * 0.002), 64 * 1024)
        _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf",
              "rate", _tc_rate(self.rate), "burst", str(burst), "latency", self.latency,
              "peakrate", f"{int(rate * 8 * PEAK_OVER_RATE)}bit", "mtu", str(PEAK_BUCKET)])


class Star(Topology):
    """Switch namespace ``<prefix>-sw`` with bridge ``<prefix>br`` (address: the subnet's
    last host); worker i's veth ``<prefix>w<i>`` (address: host i+1) meets the bridge at
    ``<prefix>s<i>``."""

    def __init__(self, workers, rate, **kwargs):
        super().__init__(workers, rate, **kwargs)
        self.switch = f"{self.prefix}-sw"
        self.bridge = f"{self.prefix}br"
        self.bridge_address = str(self.hosts[-1])
        self.switch_ports = [f"{self.prefix}s{i}" for i in range(workers)]

    @property
    def rendezvous(self):
        return self.switch, self.bridge_address

    def build(self):
        sw = self.switch
        self._add_netns(sw)
        _run(["ip", "-n", sw, "link", "set", "lo", "up"])
        _run(["ip", "-n", sw, "link", "add", self.bridge, "type", "bridge"])
        _run(["ip", "-n", sw, "addr", "add", f"{self.bridge_address}/{self.prefixlen}",
              "dev", self.bridge])
        _run(["ip", "-n", sw, "link", "set", self.bridge, "up"])
        for rank, (ns, wif, sif, addr) in enumerate(zip(
                self.namespaces, self.interfaces, self.switch_ports, self.addresses)):
            self._add_worker(rank)
            self._link(sw, sif, ns, wif)
            _run(["ip", "-n", sw, "link", "set", sif, "master", self.bridge])
            _run(["ip", "-n", ns, "addr", "add", f"{addr}/{self.prefixlen}", "dev", wif])

    def _wires(self, rank):
        return [(self.namespaces[rank], self.interfaces[rank])]

    def _far_ends(self, rank):
        return [(self.switch, self.switch_ports[rank])]


class Chain(Topology):
    """Worker i's address (host i+1, a /32) sits on a dummy interface ``<prefix>w<i>``,
    so it stays the one address gloo binds to whichever link a peer lies behind; veth
    ``<prefix>r<i>`` in namespace i meets ``<prefix>l<i+1>`` in namespace i+1. Each
    namespace forwards, with a route per peer: lower ranks through the left veth, higher
    ones through the right. The rendezvous helper runs in worker 0's namespace."""

    # dummy is the natural device for an address of its own; these machines' kernels
    # lack it, and ifb does the same when nothing redirects traffic into it.
    ADDRESS_DEVICES = ("dummy", "ifb")

    def __init__(self, workers, rate, **kwargs):
        super().__init__(workers, rate, **kwargs)
        self.lefts = [f"{self.prefix}l{i}" for i in range(workers)]
        self.rights = [f"{self.prefix}r{i}" for i in range(workers)]

    @property
    def rendezvous(self):
        return self.namespaces[0], self.addresses[0]

    def build(self):
        # Every namespace forwards before any veth exists, so each veth takes rp_filter 0
        # from `default` (the effective value is the larger of `all` and the device's).
        for rank, ns in enumerate(self.namespaces):
            self._add_worker(rank)
            _run(["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.ip_forward=1",
                  "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0"])
            self._add_address_device(ns, self.interfaces[rank])
            _run(["ip", "-n", ns, "addr", "add", f"{self.addresses[rank]}/32",
                  "dev", self.interfaces[rank]])
            _run(["ip", "-n", ns, "link", "set", self.interfaces[rank], "up"])
        for i in range(self.workers - 1):
            self._link(self.namespaces[i], self.rights[i],
                       self.namespaces[i + 1], self.lefts[i + 1])
        for i, ns in enumerate(self.namespaces):
            for j, addr in enumerate(self.addresses):
                if j == i:
                    continue
                step = 1 if j > i else -1
                dev = self.rights[i] if j > i else self.lefts[i]
                # onlink: the neighbour's address is on no subnet of the veth; it answers
                # ARP for it (arp_ignore 0) all the same.
                _run(["ip", "-n", ns, "route", "add", f"{addr}/32",
                      "via", self.addresses[i + step], "dev", dev, "onlink",
                      "src", self.addresses[i]])

    def _add_address_device(self, ns, name):
        for kind in self.ADDRESS_DEVICES:
            res = _run(["ip", "-n", ns, "link", "add", name, "type", kind], check=False)
            if res.returncode == 0:
                return
        raise RuntimeError(f"cannot add a {' or '.join(self.ADDRESS_DEVICES)} interface in "
                           f"{ns}: {res.stderr.strip()}")

    def _wires(self, rank):
        ns = self.namespaces[rank]
        return ([(ns, self.lefts[rank])] if rank > 0 else []) + (
            [(ns, self.rights[rank])] if rank < self.workers - 1 else [])

    def _far_ends(self, rank):
        return ([(self.namespaces[rank - 1], self.rights[rank - 1])] if rank > 0 else []) + (
            [(self.namespaces[rank + 1], self.lefts[rank + 1])]
            if rank < self.workers - 1 else [])


# The class that builds each wiring pipe_horovod.collectives.cost_model.TOPOLOGIES names
# (the one list of topologies; not imported here, since this module is stdlib only:
# tests/test_timing.py checks the keys are those names).
CLASSES = {"star": Star, "chain": Chain}


def topology(name, workers, rate, *, prefix, subnet, latency):
    """The `Topology` called ``name`` (a key of CLASSES), not yet built."""
    try:
        cls = CLASSES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown topology {name!r}; choose one of "
                         f"{', '.join(CLASSES)}") from None
    return cls(workers, rate, prefix=prefix, subnet=subnet, latency=latency)
