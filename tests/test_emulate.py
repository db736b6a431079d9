"""The emulated cluster: real workers in network namespaces, capped links, clean teardown."""

import os
import re
import select
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import launcher

from pipe_horovod.tools import emulate
from pipe_horovod.tools.emulate import network as emulate_network
from pipe_horovod.tools.emulate import EmulatedCluster, cleanup, leftovers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_REASON = emulate.unavailable_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=str(_REASON))

# One compute thread per worker: the machine has 2 cores shared by all workers.
WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

TORCH_WORKER = """
import datetime, os, torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, size = dist.get_rank(), dist.get_world_size()
t = torch.full((1000,), float(rank + 1))
dist.all_reduce(t)
assert torch.equal(t, torch.full((1000,), size * (size + 1) / 2)), t[:4]
assert os.environ["PIPE_HOROVOD_ENGINE"] == "torch"
print("OK", rank, size, flush=True)
dist.destroy_process_group()
"""

HOROVOD_WORKER = """
import os, torch, horovod.torch as hvd
hvd.init()
rank, size = hvd.rank(), hvd.size()
t = hvd.allreduce(torch.full((1000,), float(rank + 1)), op=hvd.Sum, name="t")
assert torch.equal(t, torch.full((1000,), size * (size + 1) / 2)), t[:4]
assert os.environ["PIPE_HOROVOD_ENGINE"] == "horovod"
print("OK", rank, size, flush=True)
hvd.shutdown()
"""

BANDWIDTH_WORKER = """
import datetime, time, torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
t = torch.ones(4 * 1024 * 1024)          # 16 MiB of float32
dist.all_reduce(t)                       # warm-up: connections, buffers
reps = 3
dist.barrier()
start = time.perf_counter()
for _ in range(reps):
    dist.all_reduce(t)
elapsed = time.perf_counter() - start
if dist.get_rank() == 0:
    print("ALGBW_MBPS %.1f" % (reps * t.numel() * 4 / elapsed / 1e6), flush=True)
dist.destroy_process_group()
"""

# After an idle moment, rank 0 sends SMALL_BYTES to rank 1, which answers with one float.
SMALL_BYTES = 192 * 1024
IDLE_THEN_SEND_WORKER = """
import datetime, time, torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
msg, ack, trips = torch.ones(%d // 4), torch.zeros(1), []
for i in range(12):                      # the first three warm the connection up
    dist.barrier()
    time.sleep(0.05)                     # idle: any token bucket refills
    t0 = time.perf_counter()
    if rank == 0:
        dist.send(msg, 1)
        dist.recv(ack, 1)
        trips.append(time.perf_counter() - t0)
    else:
        dist.recv(msg, 0)
        dist.send(ack, 0)
if rank == 0:
    print("TRIP_MS %%.3f" %% (sorted(trips[3:])[4] * 1e3), flush=True)
dist.destroy_process_group()
""" % SMALL_BYTES


# Every rank serves on its own address; each connects to every other (reachability),
# then rank 0 sends BULK bytes to rank 2, which answers with the count when it has them.
CHAIN_WORKER = """
import os, socket, threading, time
rank, addrs, bulk = int(os.environ["RANK"]), os.environ["ADDRS"].split(","), int(os.environ["BULK"])
server = socket.create_server((addrs[rank], 5999), backlog=8)
def serve():
    for _ in range(len(addrs) - 1):
        conn, _ = server.accept()
        got = 0
        while True:
            data = conn.recv(1 << 20)
            if not data:
                break
            got += len(data)
        conn.sendall(str(got).encode())
        conn.close()
thread = threading.Thread(target=serve)
thread.start()
def send(peer, nbytes):
    for _ in range(200):
        try:
            conn = socket.create_connection((addrs[peer], 5999), timeout=20)
            break
        except OSError:
            time.sleep(0.05)
    start = time.perf_counter()
    conn.sendall(b"x" * nbytes)
    conn.shutdown(socket.SHUT_WR)
    assert int(conn.recv(64)) == nbytes
    return time.perf_counter() - start
for peer in range(len(addrs)):
    if peer != rank:
        seconds = send(peer, bulk if (rank, peer) == (0, 2) else 1)
        print("REACHED", peer, flush=True)
        if (rank, peer) == (0, 2):
            print("BULK_MBPS %.1f" % (bulk / seconds / 1e6), flush=True)
thread.join()
"""


def _dead(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:   # a zombie is dead too
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


def _allreduce_across_namespaces(engine, tmp_path, workers, **cluster):
    if engine == "horovod":
        missing = launcher.horovod_missing()
        if missing:
            pytest.skip(missing)
    script = tmp_path / "worker.py"
    script.write_text(TORCH_WORKER if engine == "torch" else HOROVOD_WORKER)
    prefix = None
    try:
        with EmulatedCluster(workers=workers, rate="1gbit", log_dir=str(tmp_path / "logs"),
                             **cluster) as c:
            prefix = c.prefix
            assert len(leftovers(prefix)) >= 3   # the test can see what it must not leave
            job = c.launch([sys.executable, str(script)], engine=engine, env=WORKER_ENV)
            assert c.wait(job, timeout=90) == [0] * workers
            for rank in range(workers):
                assert f"OK {rank} {workers}" in job.log(rank)
                assert emulate.cpu_times(job.procs[rank]).total > 0
        assert leftovers(prefix) == []
    finally:
        if prefix:
            cleanup(prefix)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine", ["torch", "horovod"])
def test_allreduce_across_namespaces(engine, tmp_path):
    _allreduce_across_namespaces(engine, tmp_path, 2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("engine", ["torch", "horovod"])
def test_allreduce_on_a_chain(engine, tmp_path):
    # 3 workers: ranks 0 and 2 talk through rank 1's namespace; Horovod's rendezvous
    # runs in rank 0's
    _allreduce_across_namespaces(engine, tmp_path, 3, topology="chain")


@pytest.mark.timeout(60)
def test_failure_reports_every_log_and_tears_down(tmp_path):
    prefix = None
    try:
        with pytest.raises(emulate.ClusterError) as err:
            with EmulatedCluster(workers=2, rate=None) as c:
                prefix = c.prefix
                flag = tmp_path / "rank0-printed"
                job = c.launch([sys.executable, "-c", textwrap.dedent(f"""
                    import os, sys, time
                    print("hello from", os.environ["RANK"], flush=True)
                    if os.environ["RANK"] == "0":
                        open({str(flag)!r}, "w").close()
                        time.sleep(60)
                    for _ in range(200):   # fail only once rank 0 has spoken
                        if os.path.exists({str(flag)!r}):
                            break
                        time.sleep(0.1)
                    sys.exit(3)
                """)], env=WORKER_ENV)
                c.wait(job, timeout=30)
        assert "hello from 0" in str(err.value) and "hello from 1" in str(err.value)
        assert _dead(job.procs[0].pid)
        assert leftovers(prefix) == []
    finally:
        if prefix:
            cleanup(prefix)


@pytest.mark.timeout(60)
def test_exception_inside_block_tears_down():
    prefix = None
    try:
        with pytest.raises(ValueError, match="boom"):
            with EmulatedCluster(workers=2) as c:
                prefix = c.prefix
                job = c.launch(["sleep", "60"])
                raise ValueError("boom")
        assert all(_dead(p.pid) for p in job.procs)
        assert leftovers(prefix) == []
    finally:
        if prefix:
            cleanup(prefix)


# The holder starts with Python's own SIGINT handling, as a user's script does from a
# terminal: a shell that starts the suite in the background hands its children SIGINT
# ignored, and the holder would then tear down and go on sleeping. (A suspected cause of
# two fresh-clone CI failures, not reproduced in shorter runs: the failure now shows the
# holder's stderr.)
HOLDER = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
from pipe_horovod.tools.emulate import EmulatedCluster
with EmulatedCluster(workers=2) as c:
    job = c.launch(["sleep", "60"])
    print("READY", c.prefix, *[p.pid for p in job.procs], flush=True)
    time.sleep(60)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_signal_tears_down(sig):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=dict(os.environ, PYTHONPATH=ROOT))
    prefix = None
    try:
        ready, _, _ = select.select([holder.stdout], [], [], 30)
        assert ready, "holder never printed READY"
        words = holder.stdout.readline().split()
        assert words[:1] == ["READY"], (words, holder.stderr.read())
        prefix, pids = words[1], [int(w) for w in words[2:]]
        assert leftovers(prefix)
        holder.send_signal(sig)
        try:
            rc = holder.wait(timeout=30)
        except subprocess.TimeoutExpired:
            holder.kill()
            pytest.fail(f"the holder outlived signal {sig} by 30 s; its stderr:\n"
                        f"{holder.communicate(timeout=10)[1]}")
        assert rc != 0
        if sig == signal.SIGINT:
            assert "KeyboardInterrupt" in holder.stderr.read()
        else:
            assert rc == -sig   # the default action still happens after teardown
        if sig == signal.SIGKILL:   # no handler ran: the guard process tears down
            deadline = time.monotonic() + 20
            while leftovers(prefix) and time.monotonic() < deadline:
                time.sleep(0.2)
        assert leftovers(prefix) == []
        assert all(_dead(p) for p in pids)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=10)
        if prefix:
            cleanup(prefix)


def test_the_guard_starts_and_stops_without_a_word():
    """Every emulated run starts a guard; `python -m` on it printed runpy's RuntimeWarning
    (the package imports the module first) into every run's output, `make run`'s too."""
    code = ("from pipe_horovod.tools.emulate import guard; "
            "guard.stop(guard.start('phguardtest'))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


def _on_two_capped_workers(tmp_path, source, label):
    """Runs `source` on 2 workers joined by 1gbit links; the float rank 0 printed after
    `label`, and worker 0's link counters. Nothing may be left behind."""
    script = tmp_path / "worker.py"
    script.write_text(source)
    prefix = None
    try:
        with EmulatedCluster(workers=2, rate="1gbit") as c:
            prefix = c.prefix
            job = c.launch([sys.executable, str(script)], env=WORKER_ENV)
            c.wait(job, timeout=50)
            value = float(re.search(label + r" ([0-9.]+)", job.log(0)).group(1))
            stats = c.link_stats(0)
        assert leftovers(prefix) == []
        return value, stats
    finally:
        if prefix:
            cleanup(prefix)


@pytest.mark.timeout(60)
def test_rate_cap_limits_allreduce_bandwidth(tmp_path):
    algbw, stats = _on_two_capped_workers(tmp_path, BANDWIDTH_WORKER, "ALGBW_MBPS")
    print(f"\n16 MiB gloo allreduce, 2 workers, 1gbit links: {algbw:.1f} MB/s; "
          f"worker 0 link: {stats}")
    # 1 Gbit/s is 125 MB/s on the wire; uncapped veths manage several times that
    # on an idle machine (a busy one can be slower, hence the tbf counters too).
    assert 10 < algbw < 200
    assert stats["tx_bytes"] >= 4 * 16 * 2**20   # 4 allreduces: >= one buffer each
    assert stats["overlimits"] > 0                # the token bucket held packets back


@pytest.mark.timeout(60)
def test_capped_link_cannot_bank_idle_time(tmp_path):
    """A message smaller than tbf's burst, sent after the link idled, still waits for
    the rate: only the peak bucket (PEAK_BUCKET bytes) may go early, so 192 KiB at
    1gbit needs at least (192 KiB - PEAK_BUCKET) at the peak rate, 0.99 ms, there and
    back. Measured (median of 9): 1.34-1.53 ms; with tbf's burst alone (no peak
    bucket) the burst banked while idle sent it in 0.58 ms."""
    trip_ms, _ = _on_two_capped_workers(tmp_path, IDLE_THEN_SEND_WORKER, "TRIP_MS")
    bound_ms = (SMALL_BYTES - emulate_network.PEAK_BUCKET) / (
        125e6 * emulate_network.PEAK_OVER_RATE) * 1e3
    print(f"\n{SMALL_BYTES} B after idling, 1gbit: {trip_ms:.2f} ms round trip "
          f"(no less than {bound_ms:.2f} ms)")
    assert trip_ms > bound_ms


def test_unknown_topology_names_the_choices():
    with pytest.raises(ValueError, match="star, chain"):
        EmulatedCluster(workers=3, topology="ring")


@pytest.mark.timeout(60)
def test_chain_forwards_between_non_neighbours_through_capped_links(tmp_path):
    script = tmp_path / "chain.py"
    script.write_text(CHAIN_WORKER)
    bulk = 32 * 2**20
    prefix = None
    try:
        with EmulatedCluster(workers=3, rate="1gbit", topology="chain") as c:
            prefix = c.prefix
            assert c.switch is None and c.bridge_address is None
            before = c.link_stats(1)
            job = c.launch([sys.executable, str(script)],
                           env={**WORKER_ENV, "ADDRS": ",".join(c.addresses), "BULK": str(bulk)})
            c.wait(job, timeout=50)
            after = c.link_stats(1)
            logs = [job.log(rank) for rank in range(3)]
        for rank, log in enumerate(logs):
            assert sorted(re.findall(r"REACHED (\d)", log)) == [str(p) for p in range(3)
                                                                 if p != rank], log
        mbps = float(re.search(r"BULK_MBPS ([0-9.]+)", logs[0]).group(1))
        forwarded = after["tx_bytes"] - before["tx_bytes"]
        print(f"\n32 MiB rank 0 -> rank 2 over a 1gbit chain: {mbps:.1f} MB/s; "
              f"rank 1 sent {forwarded} B; its links: {after}")
        # rank 1 runs no sender of that size: what it put on its wires is rank 0's bulk
        assert bulk <= forwarded < 1.1 * bulk
        assert bulk <= after["rx_bytes"] - before["rx_bytes"] < 1.1 * bulk
        assert 10 < mbps < 200                        # as the star's cap test allows
        assert after["overlimits"] > 0
        assert leftovers(prefix) == []
    finally:
        if prefix:
            cleanup(prefix)
