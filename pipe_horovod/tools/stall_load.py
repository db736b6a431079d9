"""Load test of the stall checks' control plane: many simulated ranks on the real stores.

The stall checks (engine/stall.py, summary.py, causes.py) are the only part of pipe_horovod
whose cost grows with the number of ranks while nothing is computed: every rank whose wait
lasts a second looks at the others' posts each second. This runs only that code, on the
stores a job really uses, with light simulated ranks (threads in a few processes, no
torch collectives):

- `http`: horovodrun's rendezvous server (horovod.runner's RendezvousServer with its
  RendezvousHandler, started as horovodrun starts it), which the Horovod engine posts to;
- `tcp`: torch's TCPStore (as torchrun's agent or rank 0 serves it), which the torch engine
  and the Horovod engine under MPI post to.

Scenarios: `straggler` (one rank computes while the others wait: the stall warning, at
HOROVOD_STALL_CHECK_TIME_SECONDS, must name it) and `failed` (one rank raises an error that
ends its script while the others wait: each must raise it, naming that rank). Measured:
requests per second at the store during the storm (the mean of per-second counts, per
rank), the seconds until every waiting rank named the cause (median and slowest rank), and
how long the store takes to answer a new key (a probe that sets and reads one every 100 ms
during the storm: median and worst).

Tooling only: the runtime never imports it.
"""
import argparse
import collections
import json
import math
import multiprocessing
import os
import re
import statistics
import threading
import time
import urllib.request

STRAGGLER_CHECK_S = 5.0     # HOROVOD_STALL_CHECK_TIME_SECONDS in the straggler scenario
FAIL_AT_S = 5.0             # when the failing rank raises, after the others began to wait
END_AT_S = 16.0             # a simulated rank stops waiting this long after the start
SPREAD_S = 0.3              # ranks reach the collective this far apart (uniformly)
PROBE_EVERY_S = 0.1


# --- the stores ------------------------------------------------------------------------
def start_store(kind):
    """(spec for the workers, stop()) of a real store served from this process."""
    if kind == "http":
        from horovod.runner.http.http_server import RendezvousServer
        server = RendezvousServer(verbose=0)
        port = server.start()
        server.init([])                 # horovodrun: init(host_alloc_plan)
        return ("http", "127.0.0.1", port), server.stop
    if kind == "tcp":
        import datetime

        import torch.distributed as dist
        store = dist.TCPStore("127.0.0.1", 0, None, True,
                              timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
        return ("tcp", "127.0.0.1", store.port), lambda: store.num_keys()   # kept alive till then
    raise ValueError(f"unknown store {kind!r}: http or tcp")


def client(spec):
    """(put(key, value), get(key) -> bytes or None) of a new client of the store."""
    kind, addr, port = spec
    if kind == "http":
        base = f"http://{addr}:{port}/probe"

        def put(key, value):
            request = urllib.request.Request(f"{base}/{key}", data=value, method="PUT")
            urllib.request.urlopen(request, timeout=10).close()

        def get(key):
            with urllib.request.urlopen(f"{base}/{key}", timeout=10) as reply:
                return reply.read()
        return put, get
    store = tcp_client(spec)
    return store.set, store.get


def tcp_client(spec):
    import datetime

    import torch.distributed as dist
    _, addr, port = spec
    return dist.TCPStore(addr, port, None, False, timeout=datetime.timedelta(seconds=30))


def board_of(spec, size, shared, counted):
    """A simulated rank's board on the store, its requests counted."""
    from pipe_horovod.engine.stall import HTTP_SERVES_PER_S, Board, http_store, torch_store
    kind, addr, port = spec
    put, get = http_store(addr, port) if kind == "http" else torch_store(shared())
    board = Board(counted.wrap(put), counted.wrap(get), size)
    if kind == "http":          # as http_board says
        board.serves_per_s = HTTP_SERVES_PER_S
    return board


# --- a simulated rank ------------------------------------------------------------------
def simulated_rank(rank, size, board):
    """An engine as the stall checks read it (Stall, causes, FailureReports), for rank
    `rank` of `size` that waits in allreduce 'grad.0' in its 5th step, posting on `board`."""
    return _sim_rank_class()(rank, size, board)


def _sim_rank_class():
    import collections

    from pipe_horovod.engine.reporting import FailureReports
    from pipe_horovod.engine.stall import POSTED_RAISES

    class SimRank(FailureReports):
        """What Stall, causes and FailureReports read of an engine, for one rank that
        waits in allreduce 'grad.0' at its 5th step (or raises)."""

        def __init__(self, rank, size, board):
            self._rank, self._size, self._board = rank, size, board
            self._closed, self._lost, self._peers, self._uncaught = False, None, None, False
            self.step, self.stepping = 4, True
            self._raises, self._posted = 0, collections.deque(maxlen=POSTED_RAISES)
            self._final, self._raised, self._told, self._raisers = None, set(), set(), set()

        def rank(self):
            return self._rank

        def size(self):
            return self._size

        def names_in_flight(self):
            return ["grad.0"]

        def _missing(self, call):
            return ""

        def _object_calls(self):
            return []
    return SimRank


class _Counted:
    """Requests the simulated ranks of this process sent, by second."""

    def __init__(self):
        self.lock = threading.Lock()
        self.by_second = {}

    def wrap(self, request):
        def counted(*args):
            self.add()
            return request(*args)
        return counted

    def add(self):
        second = int(time.time())
        with self.lock:
            self.by_second[second] = self.by_second.get(second, 0) + 1


class _Said:
    """stall.py's `warnings`, as seen by the simulated ranks: what each rank's stall
    warning said, and when."""

    def __init__(self):
        self.local = threading.local()

    def warn(self, message, *args, **kwargs):
        if getattr(self.local, "said", None) is None:
            self.local.said = (time.time(), str(message))


def _run_rank(rank, size, spec, scenario, odd, t0, fail_at_s, shared, counted, said,
              results):
    import random

    from pipe_horovod.engine.stall import STATUS_AFTER_S, Call, Stall
    from pipe_horovod.engine.summary import phase
    board = board_of(spec, size, shared, counted)
    board.session = ".load"
    engine = simulated_rank(rank, size, board)
    time.sleep(max(0.0, t0 + random.Random(rank).uniform(0, SPREAD_S) - time.time()))
    if rank == odd:
        if scenario == "failed":    # it computes, then its script ends with an error
            time.sleep(max(0.0, t0 + fail_at_s - time.time()))
            results.append((rank, "raised", time.time(), ""))
            engine.refuse(ValueError(f"the data of rank {rank} is broken"))
            board.post(rank, state="ended", step=engine.step, stepping=False)
        return                      # the straggler: it computes past the end
    start = time.monotonic()
    time.sleep(STATUS_AFTER_S + phase(rank, size, STATUS_AFTER_S))   # as Engine._wait_for
    stall = Stall(engine, Call("allreduce", "grad.0"), start)
    end = start + END_AT_S
    try:
        while time.monotonic() < end:
            stall.tick(lambda: False)
            if getattr(said.local, "said", None) is not None:
                at, text = said.local.said
                results.append((rank, "warned", at, text))
                return
            for _ in range(2):
                time.sleep(STATUS_AFTER_S / 2)
                stall.renew()
        results.append((rank, "nothing", time.time(), ""))
    except Exception as exc:
        results.append((rank, "named", time.time(), f"{type(exc).__name__}: {exc}"))
    finally:
        stall.end(failed=True)


def _worker(ranks, size, spec, scenario, odd, fail_at_s, start, queue):
    """One process of simulated ranks, each a thread; says it is ready, then starts them
    at the time the driver sets in `start`; puts (results, requests by second)."""
    os.nice(10)     # the store's server (this driver) first: on a cluster it has a host of its own
    os.environ["HOROVOD_STALL_CHECK_TIME_SECONDS"] = \
        str(STRAGGLER_CHECK_S if scenario == "straggler" else 60)
    from pipe_horovod.engine import stall as stall_module
    if spec[0] == "tcp":
        import torch.distributed  # noqa: F401  (imported before the clock starts)
    queue.put("ready")
    while start.value == 0.0:
        time.sleep(0.01)
    t0 = start.value
    said = _Said()
    stall_module.warnings = said
    counted, results = _Counted(), []
    shared_store = []
    lock = threading.Lock()

    def shared():               # one TCPStore client per process, as a rank has one
        with lock:
            if not shared_store:
                shared_store.append(tcp_client(spec))
            return shared_store[0]
    threads = [threading.Thread(target=_run_rank, args=(r, size, spec, scenario, odd, t0,
                                                         fail_at_s, shared, counted, said,
                                                         results),
                                daemon=True) for r in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(END_AT_S + 30)
    queue.put((results, counted.by_second))


def _probe(spec, t0, until, latencies):
    """A new key set and read back every PROBE_EVERY_S, as a rendezvous or elastic
    client would: its seconds, for those sent during the storm."""
    put, get = client(spec)
    n = 0
    while time.time() < until:
        n += 1
        began = time.time()
        try:
            put(f"probe.{n}", b"x")
            get(f"probe.{n}")
            took = time.time() - began
        except Exception:
            took = float("inf")
        if began >= t0 + 1.5:
            latencies.append(took)
        time.sleep(PROBE_EVERY_S)


def run(size, store, scenario, processes=4, fail_at_s=FAIL_AT_S):
    """One load test: {size, store, scenario, rate (requests per rank per second, the mean
    over the storm's whole seconds), named_s (median, slowest), named (ranks that named
    the cause of the waiting ones), probe_ms (median, worst), example (one rank's words)}.
    fail_at_s: when the failing rank raises (a longer storm weighs the leader's sweeps,
    one second in four, at their share; END_AT_S bounds it)."""
    if not 0 < fail_at_s < END_AT_S - 4:
        raise ValueError(f"fail_at_s={fail_at_s}: between 0 and {END_AT_S - 4} s, so that "
                         f"the ranks name the cause before they stop waiting")
    spec, stop = start_store(store)
    odd = size // 2 if size > 2 else 1      # the straggler, or the rank that fails
    context = multiprocessing.get_context("spawn")
    queue, start = context.Queue(), context.Value("d", 0.0)
    per = [list(range(size))[i::processes] for i in range(processes)]
    procs = [context.Process(target=_worker, args=(ranks, size, spec, scenario, odd,
                                                  fail_at_s, start, queue), daemon=True)
             for ranks in per if ranks]
    for proc in procs:
        proc.start()
    for _ in procs:
        assert queue.get(timeout=300) == "ready"
    t0 = start.value = time.time() + 1.0 + 0.002 * size     # the threads' start
    latencies = []
    storm_end = t0 + (STRAGGLER_CHECK_S if scenario == "straggler" else fail_at_s)
    probe = threading.Thread(target=_probe, args=(spec, t0, storm_end, latencies), daemon=True)
    probe.start()
    results, by_second = [], {}
    for _ in procs:
        got, counts = queue.get(timeout=END_AT_S + 120)
        results.extend(got)
        for second, count in counts.items():
            by_second[second] = by_second.get(second, 0) + count
    for proc in procs:
        proc.join(10)
    probe.join(5)
    stop()
    # The storm: the whole seconds from when every rank has posted (a second after it
    # began to wait, and its phase within the next) to the cause; a second that began
    # earlier would count the ranks' first posts, not the checks' steady load.
    seconds = [by_second.get(s, 0) for s in range(math.ceil(t0 + SPREAD_S + 2.0),
                                                   int(storm_end))]
    if scenario == "straggler":
        began, word, kind = t0, f"rank {odd} is not waiting in any collective", "warned"
    else:
        began = next(at for r, what, at, _ in results if what == "raised")
        word, kind = f"rank {odd} raised ValueError: the data of rank {odd} is broken", "named"
    named = [(at - began, text) for r, what, at, text in results
             if what == kind and word in text]
    first = sorted((at - began, r) for r, what, at, text in results if what == kind)[:3]
    waiting = size - 1
    times = sorted(t for t, _ in named)
    return {"size": size, "store": store, "scenario": scenario,
            "rate": sum(seconds) / len(seconds) / size if seconds else float("nan"),
            "peak": max(seconds) / size if seconds else float("nan"),
            "named": f"{len(named)}/{waiting}",
            "named_s": (statistics.median(times), times[-1]) if times else (None, None),
            "probe_ms": (1000 * statistics.median(latencies), 1000 * max(latencies))
            if latencies else (None, None),
            "probe_over_100ms": f"{sum(t > 0.1 for t in latencies)}/{len(latencies)}",
            "per_second": seconds, "times": [round(t, 2) for t in times], "first": first,
            "unnamed": sorted(collections.Counter(
                (what, re.sub(r"\d+", "N", text)[:160]) for r, what, at, text in results
                if not (what == kind and word in text)).items())[:3],
            "example": named[0][1][:300] if named else
            next((text[:300] for r, what, at, text in results if text), "")}


def table(rows):
    """The rows as a Markdown table."""
    lines = ["| store | ranks | scenario | requests/rank/s | ranks that named it | "
             "cause named after (median / slowest) | new key answered in (median / worst) | "
             "probes over 100 ms |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        med, worst = row["named_s"]
        pmed, pworst = row["probe_ms"]
        named = "-" if med is None else f"{med:.1f} s / {worst:.1f} s"
        probe = "-" if pmed is None else f"{pmed:.0f} ms / {pworst:.0f} ms"
        lines.append(f"| {row['store']} | {row['size']} | {row['scenario']} | "
                     f"{row['rate']:.2f} (peak {row['peak']:.2f}) | {row['named']} | {named} | "
                     f"{probe} | {row['probe_over_100ms']} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m pipe_horovod.tools.stall_load",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="2,64,256,1024",
                        help="numbers of simulated ranks, comma-separated")
    parser.add_argument("--stores", default="http,tcp")
    parser.add_argument("--scenarios", default="straggler,failed")
    parser.add_argument("--processes", type=int, default=4,
                        help="processes the simulated ranks run in (threads in each)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    rows = []
    for store in args.stores.split(","):
        for size in [int(s) for s in args.sizes.split(",")]:
            for scenario in args.scenarios.split(","):
                row = run(size, store, scenario, min(args.processes, size))
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
