"""Faults: bounded waits, a rank killed mid-training, preemption by SIGTERM and its resume."""
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

import launcher
import pipe_horovod as phvd
from pipe_horovod.engine import faults
from pipe_horovod.engine.base import Work
from pipe_horovod.pipeline import StepMachine

HOROVOD = launcher.horovod_missing()
BOUND_S = 60          # every surviving rank must be gone this long after the kill


# --- in one process ---------------------------------------------------------------
@pytest.mark.parametrize("value, expected", [(None, faults.DEFAULT_TIMEOUT_S), ("2.5", 2.5),
                                             ("inf", math.inf), ("", faults.DEFAULT_TIMEOUT_S)])
def test_timeout_from_the_environment(monkeypatch, value, expected):
    monkeypatch.delenv(faults.TIMEOUT_VARIABLE, raising=False)
    if value is not None:
        monkeypatch.setenv(faults.TIMEOUT_VARIABLE, value)
    assert faults.resolve_timeout() == expected
    assert faults.resolve_timeout(7) == 7.0            # init's argument wins


@pytest.mark.parametrize("value, error, text", [
    ("soon", ValueError, "PIPE_HOROVOD_TIMEOUT must be a number of seconds > 0 (or inf), "
                         "got 'soon'"),
    ("-1", ValueError, "PIPE_HOROVOD_TIMEOUT must be a number of seconds > 0 (or inf), got -1.0"),
    (0, ValueError, "timeout must be a number of seconds > 0 (or inf), got 0"),
    (True, TypeError, "timeout must be a number of seconds, got bool True"),
    ("5", TypeError, "timeout must be a number of seconds, got str '5'")])
def test_bad_timeouts_are_refused(monkeypatch, value, error, text):
    if isinstance(value, str) and value in ("soon", "-1"):
        monkeypatch.setenv(faults.TIMEOUT_VARIABLE, value)
        value = None
    with pytest.raises(error) as info:
        faults.resolve_timeout(value)
    assert str(info.value) == text


class _Never(Work):
    """A reduction no other rank ever starts."""
    polls = 0

    def poll(self):
        _Never.polls += 1
        return False

    def wait(self):
        raise AssertionError("wait() must not be reached past the deadline")


def test_a_bucket_that_never_lands_names_itself_and_its_step(monkeypatch):
    eng = phvd.init("local", timeout=0.3)
    try:
        machine = StepMachine("pipe_test", 2, 0)
        names = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "fc3.weight"]
        machine.plan([(n, 4, 4, (torch.float32, torch.device("cpu"))) for n in names])
        machine.solo = False                   # send, although alone
        for _ in range(3):                     # step 3 is the one that hangs
            machine.finish_step(None)
        monkeypatch.setattr(eng, "allreduce_async", lambda wire, name, op, **kw: eng.adopt_async(
            "allreduce", wire, name, op, lambda ps: _Never()))
        start = time.monotonic()
        machine.launch_rest(lambda bucket, flat: flat.zero_())
        with pytest.raises(phvd.engine.WaitTimeoutError) as info:
            machine.launched[0].wait()
        took = time.monotonic() - start
    finally:
        eng._in_flight.clear()
        eng._names.clear()
        phvd.shutdown()
    assert 0.3 <= took < 1.5, took
    assert str(info.value).startswith(
        "waiting for the gradients of step 3, bucket 0 (5 parameter(s): fc1.weight, fc1.bias, "
        "fc2.weight, fc2.bias, ... (5 in all)): allreduce 'pipe_test.0.20.1' did not complete "
        "within 0.3 s (PIPE_HOROVOD_TIMEOUT, or init(timeout=...)): a rank has not started it")
    assert isinstance(info.value, TimeoutError) and isinstance(info.value,
                                                               phvd.engine.HorovodInternalError)
    # The poll backs off to POLL_CAP_S: about 0.3 s / 250 us polls, not a busy spin.
    assert 0.3 / faults.POLL_CAP_S / 2 < _Never.polls <= 0.3 / faults.POLL_CAP_S + 20, _Never.polls


def test_a_dead_process_on_this_host_is_named():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    host = socket.gethostname()
    peers = [(host, os.getpid()), (host, child.pid), ("elsewhere", 1)]
    try:
        assert faults.lost_ranks(peers, 0, look_s=0.2) == []
        child.send_signal(signal.SIGKILL)
        assert faults.lost_ranks(peers, 0, look_s=5) == [1]   # a zombie until reaped: dead
    finally:
        child.kill()
        child.wait()
    assert faults.lost_ranks(peers, 0, look_s=0) == [1]
    assert faults.describe_lost(peers, 0, [1]) == f"rank 1 (pid {child.pid} on {host}) no longer runs"
    assert faults.describe_lost(peers, 0, []) == (
        "every other rank on this host still runs; rank 2 on elsewhere cannot be checked from here")
    two_hosts = [*peers, ("elsewhere", 2), ("node3", 3)]
    assert faults.describe_lost(two_hosts, 0, []) == (
        "every other rank on this host still runs; ranks 2, 3 on elsewhere and rank 4 on node3 "
        "cannot be checked from here")


def test_a_rank_that_ended_because_a_peer_died_passes_the_death_on():
    """Rank 0 saw rank 1 die and shut down; rank 2, still waiting, must name rank 1's death
    (RankLostError), not blame uneven steps on rank 0, and pass the cause on in turn. A rank
    that ended normally is named, with the uneven-data advice only where it ran fewer steps."""
    from pipe_horovod.engine import causes
    from pipe_horovod.engine.stall import Call, Stall
    lost = "rank 1 (pid 41 on node1) no longer runs"
    posted = {}

    class Board:
        def post(self, rank, **status):
            posted[rank] = status

    class Engine:
        _board, _closed, _lost, step, stepping = Board(), False, None, 7, False
        def rank(self):
            return 2
        def size(self):
            return 3
        def _missing(self, what):
            return ""
        def names_in_flight(self):
            return ["g"]

    engine = Engine()
    others = {0: {"state": "ended", "step": 7, "lost": lost}, 1: None}
    stall = Stall(engine, Call("allreduce", "g"), time.monotonic())
    error = causes.ended(stall, others, time.time())
    assert isinstance(error, faults.RankLostError), error
    assert str(error).startswith(f"rank 0 stopped while rank 2 waits in allreduce 'g': {lost}; "
                                 f"rank 0 ended (shut down after 7 step(s), as {lost})"), error
    assert engine._lost == lost
    others[0].pop("lost")                    # ended normally after as many steps
    error = causes.ended(stall, others, time.time())
    assert type(error).__name__ == "StepMismatchError", error
    assert str(error).endswith(causes.ORDER_HINT) and "hvd.join()" not in str(error), error
    engine.stepping = True                   # ... while this rank is in its 8th step:
    error = causes.ended(stall, others, time.time())     # uneven data (CI saw it at the
    assert str(error).endswith(causes.JOIN_HINT), error  # launch, as Horovod shut down)
    engine.stepping = False
    others[0]["step"] = 5                    # ... after fewer steps: uneven data
    error = causes.ended(stall, others, time.time())
    assert str(error).endswith(causes.JOIN_HINT), error
    others[0].update(step=7, stepping=True)  # it ended in the step this rank waits in
    engine.stepping = True
    error = causes.ended(stall, others, time.time())
    assert str(error).endswith(causes.ORDER_HINT), error


def test_a_peer_that_closed_its_sockets_after_it_ended_is_named_while_it_still_runs():
    """Rank 1 posted its end, then let go of the library: rank 0's collective fails on a
    closed connection while rank 1's process still runs (a loaded machine takes seconds to
    end one; CI saw "Connection closed by peer" raised bare). The post names the cause, at
    once, without the search for dead ranks. A timeout does not read ends: its own message
    says what it waited for."""
    from pipe_horovod.engine.local import LocalEngine
    from pipe_horovod.engine.stall import Call

    class Board:
        def read(self, ranks, key=None):
            return {r: {"state": "ended", "step": 3, "stepping": False} for r in ranks}

        def raised(self, ranks):
            return {r: [] for r in ranks}

    class Rank0(LocalEngine):
        def size(self):
            return 2

    engine = Rank0()
    engine._board, engine.step, engine.stepping = Board(), 3, True
    engine._peers = [(socket.gethostname(), os.getpid())] * 2     # rank 1 runs
    start = time.monotonic()
    error = engine._diagnose(RuntimeError("Connection closed by peer [127.0.0.1]:1"),
                             Call("allreduce", "g"))
    assert time.monotonic() - start < faults._LOOK_S / 2
    assert type(error).__name__ == "StepMismatchError", error
    assert str(error).startswith("rank 1 ended while rank 0 waits in allreduce 'g', which it "
                                 "never started: ") and "hvd.join()" in str(error), error
    timeout = faults.WaitTimeoutError("waited 600 s")
    error = engine._diagnose(timeout, Call("allreduce", "g"))
    assert isinstance(error, faults.WaitTimeoutError) and "every other rank" in str(error), error


def test_a_cause_another_rank_concluded_is_raised_only_by_the_waits_it_names():
    """Rank 1 concluded a deadlock of the waits 'o.loss' and 'o.acc' and posted it (CI saw
    rank 0 raise it again two cases later, once rank 1 had ended): a wait on another name
    passes it by, one it names raises it, and a rank that concluded the same cause itself
    takes the post as told."""
    from pipe_horovod.engine import causes
    from pipe_horovod.engine.stall import Board, Call, Stall
    store = {}
    text = "the ranks wait in different collectives: rank 0 waits in allreduce 'o.loss'"
    board = Board(store.__setitem__, store.get, 2)
    board.tell_raised(1, [dict(seq=1, error=f"StepMismatchError: {text}", call=None, name=None,
                               shared=True, wires=["o.acc", "o.loss"], key=["cause", text])])

    class Engine:
        _board, _closed, step, stepping = board, False, 4, False
        def __init__(self):
            self._told = set()
        def rank(self):
            return 0
        def size(self):
            return 2
        def names_in_flight(self):
            return []
        def raised_alike(self, post):
            return False

    ended = {1: {"state": "ended", "step": 3}}
    later = Stall(Engine(), Call("allreduce", "pipe0.0.5.0"), time.monotonic(), post=False)
    assert causes.raised(later, ended) is None
    same = Stall(Engine(), Call("allreduce", "o.loss"), time.monotonic(), post=False)
    error = causes.raised(same, ended)
    assert type(error).__name__ == "StepMismatchError" and str(error) == text, error
    again = Stall(Engine(), Call("allreduce", "o.loss"), time.monotonic(), post=False)
    causes.concluded(again, ["o.loss"])
    assert causes.raised(again, ended) is None


class _SecondOfTwo:
    """An engine as Stall and causes read it: rank 1 of 2, waiting for 'keras1.0.43.0'."""
    _closed, step, stepping = False, 2, False

    def __init__(self, board=None):
        self._board = board

    def rank(self):
        return 1

    def size(self):
        return 2

    def names_in_flight(self):
        return ["keras1.0.43.0"]

    def _missing(self, call):
        return ""

    def _tell_raised(self, cause, wires):
        pass


def test_a_stale_waiting_post_is_not_taken_for_a_deadlock():
    """test_tensorflow's horovod launch once raised 'rank 0 waits in allgather_object
    'object.noname.8' ...; rank 1 waits in allreduce 'keras1.0.43.0'' while rank 0's own
    traceback was past that allgather, launching the bucket rank 1 waited for: rank 0's
    "running" post had not landed (one PUT to horovodrun's store, lost or overtaken on a
    loaded machine), and its old "waiting" post read as a wait it was still in. A deadlock
    is concluded only once every other rank has renewed its post since the first sighting."""
    from pipe_horovod.engine import causes
    from pipe_horovod.engine.stall import Call, Stall

    def post(beat):
        return {0: {"state": "waiting", "what": "allgather_object 'object.noname.8'",
                    "call": Call("allgather_object", "object.noname.8",
                                 "object.noname.8.sz").posted(),
                    "step": 8, "wait": 8, "beat": beat, "names": ["object.noname.8.sz"],
                    "partial": False}}

    stale = Stall(_SecondOfTwo(), Call("allreduce", "keras1.0.43.0"), time.monotonic())
    for _ in range(4):                        # ticks reading the same, unrenewed post
        assert causes.deadlock(stale, post(3), time.time()) is None
    live = Stall(_SecondOfTwo(), Call("allreduce", "keras1.0.43.0"), time.monotonic())
    assert causes.deadlock(live, post(3), time.time()) is None      # first sighting
    assert causes.deadlock(live, post(3), time.time()) is None      # not renewed yet
    error = causes.deadlock(live, post(4), time.time())             # renewed: still there
    assert type(error).__name__ == "StepMismatchError" and (
        "rank 0 waits in allgather_object 'object.noname.8' after 8 step(s), which rank 1 has "
        "not started; rank 1 waits in allreduce 'keras1.0.43.0'") in str(error), error


def test_a_stale_waiting_post_is_not_taken_for_a_rank_stuck_past_the_stall_time():
    """The same lost "running" post, read past the stall time (HOROVOD_STALL_CHECK_TIME_SECONDS)
    when the posts cannot name the blocked collectives (no names posted): a rank counts as
    stuck only while it renews its post, as causes.deadlock's first path requires."""
    import warnings

    from pipe_horovod.engine.stall import Call, Stall

    class Board:
        beat = 3
        def read(self, ranks):
            return {0: {"state": "waiting", "what": "allgather_object 'object.noname.8'",
                        "call": Call("allgather_object", "object.noname.8").posted(),
                        "step": 8, "waited": 100.0, "beat": self.beat}}
        def raised(self, ranks):
            return {}

    board = Board()
    stall = Stall(_SecondOfTwo(board), Call("allreduce", "keras1.0.43.0"),
                  time.monotonic() - 100.0, post=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")           # the stall warning, once a period
        for _ in range(4):                        # past the stall time, the post not renewed
            stall.tick(lambda: False)
        board.beat = 4                            # renewed: rank 0 does wait there
        with pytest.raises(Exception, match="every rank waits for a collective that another "
                                            "rank never starts"):
            stall.tick(lambda: False)


# --- a rank killed, on real ranks -----------------------------------------------------
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _direct(np, argv, env):
    """Start `np` torch-engine ranks with no launcher watching them (as on separate nodes):
    only pipe_horovod can end the survivors. Returns {rank: (exit code, output, seconds)}."""
    base = dict(os.environ, PYTHONPATH=str(launcher.REPO), OMP_NUM_THREADS="1",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(np),
                LOCAL_WORLD_SIZE=str(np), **env)
    base.pop("PIPE_HOROVOD_ENGINE", None)
    procs = {r: subprocess.Popen([sys.executable, str(launcher.WORKERS / argv[0]), *argv[1:]],
                                 env=dict(base, RANK=str(r), LOCAL_RANK=str(r)), text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 start_new_session=True) for r in range(np)}
    results, start = {}, time.monotonic()
    try:
        for r, proc in procs.items():
            out, _ = proc.communicate(timeout=max(1, BOUND_S + 60 - (time.monotonic() - start)))
            results[r] = (proc.returncode, out, time.monotonic() - start)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return results


class _Listener:
    """A program other than torch's store on a port: it accepts, then says `banner` (or
    nothing), as a web server, an SSH server or a stale job would."""

    def __init__(self, banner=b""):
        import threading
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        self.banner, self.open = banner, []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.open.append(conn)
            if self.banner:
                conn.sendall(self.banner)

    def close(self):
        self.sock.close()
        for conn in self.open:
            conn.close()


@pytest.mark.parametrize("rank, banner, said", [
    (1, b"SSH-2.0-OpenSSH_9.2\r\n", "a program there answered b'SSH-2.0-OpenSSH_9.2\\r\\n'"),
    (1, b"", "a program there accepted the connection but did not answer torch's rendezvous "
             "handshake within 2 s"),
    (0, b"", "address already in use"),
])
def test_a_rendezvous_on_a_taken_port_names_what_answered(monkeypatch, rank, banner, said):
    """Under env:// (mpirun, ranks started by hand) a MASTER_PORT another program
    holds made rank 0 fail with EADDRINUSE and every other rank wait inside torch's
    handshake until killed. Each now raises at init, naming the address, the port and what
    answered there; a rank whose store has not started yet names the refusal."""
    from pipe_horovod import engine
    listener = _Listener(banner)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(listener.port))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    start = time.monotonic()
    try:
        with pytest.raises(engine.EngineError) as error:
            engine.init(engine="torch", timeout=5)
    finally:
        listener.close()
    text = str(error.value)
    assert text.startswith(f"rank {rank} cannot rendezvous at 127.0.0.1:{listener.port} "
                           "(MASTER_ADDR:MASTER_PORT"), text
    assert said in text and "a MASTER_PORT no other program uses" in text, text
    assert time.monotonic() - start < 15, text
    assert not engine.is_initialized()


def test_a_rendezvous_waits_for_rank_0_and_names_the_refusal(monkeypatch):
    """Nothing at MASTER_ADDR:MASTER_PORT: rank 1 retries until its timeout, then says so; a
    real store there (rank 0 up) answers the same handshake."""
    import datetime
    from pipe_horovod.engine import WaitTimeoutError, rendezvous
    port = _free_port()
    start = time.monotonic()
    with pytest.raises(WaitTimeoutError, match=rf"rank 1 cannot rendezvous at 127\.0\.0\.1:{port}"
                       r" .*: nothing answered there \(connection refused\) for 1 s"):
        rendezvous.check("127.0.0.1", port, 1, 1.0)
    assert time.monotonic() - start < 5
    store = torch.distributed.TCPStore("127.0.0.1", 0, None, True,
                                       timeout=datetime.timedelta(seconds=5),
                                       wait_for_workers=False)
    rendezvous.check("127.0.0.1", store.port, 1, 5.0)       # answers: no error
    store.set("still", "works")
    assert store.get("still") == b"works"


def test_killed_rank_is_named_by_every_survivor_without_a_launcher():
    """torch engine, 3 ranks, nobody watching: each survivor's own error names rank 1."""
    results = _direct(3, ["fault_worker.py", "kill", "1"], {})
    assert results[1][0] == -signal.SIGKILL, results[1][1]
    for rank in (0, 2):
        code, out, took = results[rank]
        assert code != 0 and took < BOUND_S, (rank, code, took, out)
        assert re.search(r"RankLostError: .*rank 1 \(pid \d+ on [^)]+\) no longer runs", out), out


@pytest.mark.parametrize("launch", ["horovod", "torch", "horovod-mpi", "mpirun"])
def test_killed_rank_ends_the_job_under_its_launcher(launch, tmp_path):
    """horovodrun (Gloo and MPI), torchrun and mpirun end the survivors themselves, naming
    the lost rank: the job fails within the bound and no worker outlives it."""
    why = HOROVOD if launch == "horovod" else launcher.mpi_missing() if "mpi" in launch \
        else None
    if why:
        pytest.skip(why)
    start = time.monotonic()
    code, out = launcher.run(launch, 3, "fault_worker.py", "kill", 1, timeout=BOUND_S + 60,
                             env={"FAULT_PIDS": str(tmp_path)}, expect_ok=False)
    took = time.monotonic() - start
    assert code != 0 and took < BOUND_S + 30, (code, took, out)    # launch included
    if launch == "horovod":
        assert "Process name: 1\nExit code: 137" in out, out
    elif launch == "torch":
        assert re.search(r"rank\s*: 1 .*\n\s*exitcode\s*: -9 .*\(SIGKILL\)", out), out
    else:   # Open MPI's own report, under horovodrun --mpi too
        assert re.search(r"rank 1 with PID \d+ on node \S+ exited on\s+signal 9", out), out
    pids = {int(p.name): int(p.read_text()) for p in tmp_path.iterdir()}
    assert sorted(pids) == [0, 1, 2], out
    deadline = time.monotonic() + 10
    while any(faults._runs(pid) for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [r for r, pid in pids.items() if faults._runs(pid)], out


@pytest.mark.skipif(bool(HOROVOD), reason=str(HOROVOD))
def test_a_stalled_rank_times_the_others_out():
    """Horovod's own wait would spin forever; ours ends at PIPE_HOROVOD_TIMEOUT. 10 s, not
    less: the wrap's comparison is an object collective, timed like any other since issue
    39, and ranks of a loaded machine reach it seconds apart."""
    start = time.monotonic()
    code, out = launcher.run("horovod", 2, "fault_worker.py", "stall", 1, timeout=90,
                             env={"PIPE_HOROVOD_TIMEOUT": "10"}, expect_ok=False)
    assert code != 0 and time.monotonic() - start < 60, out
    assert re.search(r"WaitTimeoutError: waiting for the gradients of step \d+, bucket \d+ "
                     r"\(\d+ parameter\(s\): [^)]*\): allreduce 'pipe0\.[^']+' did not complete "
                     r"within 10 s", out), out
    assert "every other rank still runs" in out, out


# --- preemption ---------------------------------------------------------------------
@pytest.mark.skipif(bool(HOROVOD), reason=str(HOROVOD))
def test_sigterm_saves_a_checkpoint_that_resumes_bit_identically(tmp_path):
    ckpt = tmp_path / "ckpt"
    out = launcher.run("horovod", 2, "fault_worker.py", "preempt", ckpt)[1]
    steps = set(re.findall(r"STOPPED rank=\d step=(\d+)", out))
    # Rank 0 got SIGTERM during step 5, its flag went out with the check of step 6,
    # and every rank stopped at the check of step 7.
    assert steps == {"7"}, out
    assert "SIGTERM received" in out
    out = launcher.run("horovod", 2, "fault_worker.py", "resume", ckpt)[1]
    assert out.count("resumed at step 7, bit-identical") == 2, out
