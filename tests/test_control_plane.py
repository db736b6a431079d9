"""The stall checks' control plane at scale: O(1) store requests per rank per look
(engine/summary.py), the same words as before, message tags safe for any process-set id
(collectives/channel.py), and a small run of the load test (tools/stall_load.py)."""
import collections
import time

import pytest

from pipe_horovod.engine import causes
from pipe_horovod.engine.stall import Board, Call, Stall, StepMismatchError
from pipe_horovod.tools import stall_load

WORDS = ("StepMismatchError: rank {bad} raised ValueError: the data of rank {bad} is broken "
         "after 4 step(s), and exited; rank {me} waits in allreduce 'grad.0' after 4 step(s), "
         "which rank {bad} did not start")


class _Store:
    """A dict as the board's store, counting each rank's requests."""

    def __init__(self):
        self.values, self.requests = {}, collections.Counter()

    def board(self, rank, size):
        def put(key, value):
            self.requests[rank] += 1
            self.values[key] = value.encode() if isinstance(value, str) else value

        def get(key):
            self.requests[rank] += 1
            return self.values.get(key)
        return Board(put, get, size)


def _job(size, odd):
    """`size` simulated ranks on one counting store: every rank but `odd` in a wait that
    has just lasted a second (its Stall posted), `odd` computing."""
    store = _Store()
    engines = {r: stall_load.simulated_rank(r, size, store.board(r, size)) for r in range(size)}
    stalls = {r: Stall(engines[r], Call("allreduce", "grad.0"), time.monotonic() - 1.0)
              for r in range(size) if r != odd}
    return store, engines, stalls


def _round(store, stalls, named):
    """One period of every waiting rank (a look, two renewals, as Engine._wait_for):
    {rank: the store requests it made}; a rank that raises its cause leaves `stalls`."""
    made = {}
    for rank, stall in list(stalls.items()):
        before = store.requests[rank]
        try:
            stall.tick(lambda: False)
            stall.renew()
            stall.renew()
        except StepMismatchError as exc:
            named[rank] = f"{type(exc).__name__}: {exc}"
            del stalls[rank]
        made[rank] = store.requests[rank] - before
    return made


@pytest.mark.parametrize("odd", [32, 0])
def test_a_look_costs_each_rank_one_request_and_names_the_failed_rank(odd):
    """64 ranks, one computing (rank 32; rank 0, the leader, in the second case): each
    look costs a waiting rank one read of the summary and nothing else, the leader a read
    of each rank's post at most (when news says a post changed, and every 4th period; it
    used to be 2 x 63 reads for every rank every period, and a renewal twice a period). When that rank raises an error that ends
    its script, every waiting rank raises it, in the words of a direct look, within the
    periods a sweep, a takeover (rank 0 gone) and a read take."""
    size = 64
    store, engines, stalls = _job(size, odd)
    named = {}
    rounds = [_round(store, stalls, named) for _ in range(6)]
    leader = 1 if odd == 0 else 0
    for made in rounds[4:]:                 # settled: rank 1 took over from the straggler
        for rank, count in made.items():
            assert count <= (size + 2 if rank == leader else 1), (rank, count, made)
    assert sum(sum(made.values()) for made in rounds[4:]) <= 1.5 * size * 2 + 4
    assert not named
    engines[odd].refuse(ValueError(f"the data of rank {odd} is broken"))
    engines[odd]._board.post(odd, state="ended", step=4, stepping=False)
    for _ in range(4):
        _round(store, stalls, named)
    assert sorted(named) == [r for r in range(size) if r != odd]
    for rank, text in named.items():
        assert text == WORDS.format(bad=odd, me=rank), text


def test_every_rank_waiting_asks_for_renewals_and_confirms_a_deadlock_for_all():
    """Every rank waits, half in 'a' and half in 'b', each in a collective the other half
    never starts: the summary asks for renewals (the beats a deadlock is confirmed by)
    and every rank names both calls, as with two ranks."""
    size = 8
    store = _Store()
    stalls = {}
    for rank in range(size):
        engine = stall_load.simulated_rank(rank, size, store.board(rank, size))
        name = "a" if rank % 2 else "b"
        engine.names_in_flight = lambda name=name: [name]
        stalls[rank] = Stall(engine, Call("allreduce", name), time.monotonic() - 1.0)
    named = {}
    for _ in range(8):
        _round(store, stalls, named)
    assert sorted(named) == list(range(size))
    for rank, text in named.items():
        assert text.startswith("StepMismatchError: the ranks wait in different collectives, "
                               "each one that another rank has not started, so none can "
                               "complete: rank 0 waits in allreduce 'b' after 4 step(s), "
                               "which ranks 1, 3, 5, 7 have not started; rank 1 waits in "
                               "allreduce 'a'"), text
        assert text.endswith(causes.ORDER_HINT), text


def test_a_wait_is_timed_by_each_ranks_own_clock():
    """'(for N s)' is the seconds the rank posted plus how long ago this rank first read
    that post, both monotonic: no wall clock is compared across hosts."""
    status = {"state": "waiting", "what": "allreduce 'x'", "step": 2, "waited": 3.0,
              "seen": 100.0}
    assert causes.waited(status, 105.0) == 8.0
    assert causes.doing(1, status, 105.0) == "rank 1 waits in allreduce 'x' after 2 step(s) (for 8 s)"


def test_process_sets_16_apart_send_on_different_tags(monkeypatch):
    """Tags kept 4 bits of the process-set id: sets 1 and 17 on the same ranks sent
    messages the other could receive. A set's tag slot is the lowest no live set sharing
    two of its ranks holds, whatever its id; disjoint sets share one; more than the tag
    has room for, all overlapping, are refused when added."""
    from pipe_horovod import engine
    from pipe_horovod.collectives import channel
    from pipe_horovod.engine.process_set_registry import TAG_SLOTS, ProcessSetRegistry
    from pipe_horovod.engine.process_sets import ProcessSet

    class Eight(ProcessSetRegistry):
        def __init__(self):
            self.ids = iter(range(1, 1000, 16))         # 1, 17, 33, ...: alike mod 16
            self._process_sets = {0: (ProcessSet(list(range(8))), None)}
            self._tag_slots = {0: 0}

        def size(self):
            return 8

        def _add_library_set(self, ps):
            return next(self.ids), None

        def _remove_library_set(self, ps, library_set):
            pass

    registry = Eight()
    monkeypatch.setattr(engine, "_current", registry)
    first = registry.add_process_set([0, 1])
    second = registry.add_process_set([0, 1, 2])
    apart = registry.add_process_set([4, 5])
    assert (first.process_set_id, second.process_set_id, apart.process_set_id) == (1, 17, 33)
    # Before: the id's low 4 bits, the same for both.
    assert channel.tag_base(5, 1, slot=1 % 16) == channel.tag_base(5, 17, slot=17 % 16)
    assert channel.tag_base(5, 1) != channel.tag_base(5, 17)
    assert [registry.tag_slot(i) for i in (0, 1, 17, 33)] == [0, 1, 2, 1]
    for extra in range(2, 2 + TAG_SLOTS - 3):       # all on ranks 0 and 1
        registry.add_process_set([0, 1] + [r for r in range(2, 8) if extra >> (r - 2) & 1]
                                 + ([] if extra & 1 else [7]))
    with pytest.raises(ValueError, match=r"process set \[0, 1, 3, 4, 5, 6\] shares two or "
                                         r"more ranks with 16 registered process sets already"):
        registry.add_process_set([0, 1, 3, 4, 5, 6])
    registry.remove_process_set(second)             # its slot is free again
    assert registry.tag_slot(registry.add_process_set([0, 1, 3, 4, 5, 6]).process_set_id) == 2


@pytest.mark.timeout(120)
def test_the_load_test_on_horovodruns_server_names_the_failed_rank():
    """64 simulated ranks on horovodrun's rendezvous server, one raising an error that
    ends its script: every other rank names it, in the engine's words, and the store sees
    at most 2 requests per rank per second. (The raise comes 9 s in, not the tool's 5: the
    leader's sweep, one second in four, doubles the load of its second, and in the two or
    three whole seconds of a 5 s storm it can land twice.)"""
    pytest.importorskip("horovod.runner.http.http_server")
    row = stall_load.run(64, "http", "failed", processes=2, fail_at_s=9.0)
    assert row["named"] == "63/63", row
    assert row["example"].startswith("StepMismatchError: rank 32 raised ValueError: the data "
                                     "of rank 32 is broken after 4 step(s), and exited; rank "), row
    assert row["rate"] <= 2.0, row
