"""Why a wait cannot complete, in words, from what every rank posted (stall.py).

A wait that has lasted STATUS_AFTER_S and that some rank has not started
reads every other rank's posts and names the first cause they show:

1. another rank raised, and it is why this wait cannot complete: the error
   was raised in the call this rank waits in, it ended that rank's script,
   or that rank declared it (`Engine.refuse`, e.g. a `.grad` edit at
   pipeline_depth >= 2): "rank 1 raised ValueError: ... in allreduce
   'metric'" (StepMismatchError);
2. another rank ended without raising: lost (RankLostError, the cause that
   rank posted), or it finished while this rank waits; only where it ran
   fewer steps than this one began, the uneven-data advice with `hvd.join()`;
3. every rank waits in the same call, described differently (a count, root
   or shape the library does not compare): MismatchError, as the library's
   own comparison would say it;
4. every rank waits, each in a collective some other rank has not started
   (a different order of blocking calls, a call on some ranks only, a
   barrier against an allreduce): seen at two ticks in a row, each other rank
   having renewed its post in between (stall.Stall.renew), so neither a
   wait that just completed nor a stale post whose "running" was lost is
   mistaken for one.

Otherwise nothing yet: the rank that has not started it may be computing.
Every rank composes its message from the same posts, so each says the same
thing from its side. An error is raised to this rank once per post.
"""
from .faults import RankLostError
from .mismatch import MismatchError
from .stall_words import CHECK_VARIABLE, StepMismatchError, describe

_SHARED = {"StepMismatchError": StepMismatchError, "RankLostError": RankLostError,
           "MismatchError": MismatchError}
JOIN_HINT = ("The ranks ran different numbers of steps (uneven data, or a batch skipped on "
             "some rank): give every rank the same number of batches, or call hvd.join() on "
             "each rank when its data runs out (Horovod's way for uneven data)")
ORDER_HINT = ("Every rank must start the same collectives, named alike, in an order in which "
              "each can complete: blocking calls in a different order per rank, or a "
              "collective called on some ranks only (e.g. under `if hvd.rank() == 0:`), "
              "wait forever")


def find(stall, others, now):
    """The error naming why `stall`'s wait (not matched) cannot complete, or None."""
    return (raised(stall, others) or ended(stall, others, now)
            or mismatched(stall, others) or deadlock(stall, others, now))


def _after(step):
    return "" if step is None else f" after {step} step(s)"


def waited(status, now):
    """How long a rank has waited, by its own clock: the seconds it posted, and since this
    rank first read that post (`seen`, set by summary.Look), `now` being this rank's
    monotonic clock."""
    seen = status.get("seen")
    return status.get("waited", 0.0) + (0.0 if seen is None else max(0.0, now - seen))


def doing(rank, status, now):
    """One rank's part of a report: what it does, at which step, for how long (`now`:
    this rank's monotonic clock at the look)."""
    if status is None:
        return (f"rank {rank} is not waiting in any collective (computing, or stopped outside "
                "pipe_horovod)")
    step = _after(status.get("step"))
    if status["state"] == "ended":
        cause = f", as {status['lost']}" if status.get("lost") else ""
        return f"rank {rank} ended (shut down{step}{cause})"
    if status["state"] == "failed":
        return f"rank {rank} gave up waiting in {status['what']}{step} (it raised)"
    if status["state"] == "waiting":
        return (f"rank {rank} waits in {status['what']}{step} (for "
                f"{max(0.0, waited(status, now)):.0f} s)")
    return f"rank {rank} runs{step}"


def everyone(stall, others, now):
    return "; ".join(doing(r, stall.mine() if r == stall.me else others.get(r), now)
                     for r in range(stall.engine.size()))


def _begun(step, stepping):
    """The steps a rank began: those it finished, and the one whose collectives its
    pipeline launched since (a rank in its 4th step's allreduce began a step that a rank
    which ended after 3 never did)."""
    return None if step is None else step + bool(stepping)


def _hint(stall, others, ranks):
    """The hint of a labelled call some rank waits in (stall.labelled: its caller knows
    the cause), else the uneven-data advice where `ranks` began other steps than this
    rank, else the advice to call the same collectives."""
    mine = _begun(stall.engine.step, stall.engine.stepping)
    posts = [others.get(r) or {} for r in ranks]
    labelled = [stall.call.posted()] + [post.get("call") or {} for post in posts]
    said = next((call["hint"] for call in labelled if call.get("hint")), None)
    if said:
        return said
    begun = [_begun(post.get("step"), post.get("stepping")) for post in posts]
    if mine is not None and any(s is not None and s != mine for s in begun):
        return JOIN_HINT
    return ORDER_HINT


def _raised_posts(stall):
    """{rank: its raised errors}: as the stall's last look read them (summary.py), or
    read now (a failed collective's one look, reporting.FailureReports._who_ended)."""
    if stall.raised_view is not None:
        return stall.raised_view
    engine = stall.engine
    return engine._board.raised([r for r in range(engine.size()) if r != stall.me])


def raised(stall, others):
    """1. Another rank's error that this wait cannot complete without."""
    engine, board = stall.engine, stall.engine._board
    for rank, posts in _raised_posts(stall).items():
        for post in posts:
            if (rank, post["seq"]) in engine._told or engine.raised_alike(post):
                continue
            status = others.get(rank)
            exited = status is not None and status["state"] == "ended"
            if post.get("wires"):   # a cause about given waits: only those, even once
                if stall.call.wire not in post["wires"]:    # that rank has ended
                    continue
            elif not (post.get("final") or exited or post.get("name") in (
                    stall.call.name, stall.call.wire)):
                continue        # raised elsewhere and went on: it may still start this one
            engine._told.add((rank, post["seq"]))
            if post.get("final"):
                engine._raisers.add(rank)       # it leaves: this rank leaves after it
            board.acknowledge(stall.me, rank, post["seq"])
            if post.get("shared"):  # a cause that rank read off the board: every rank's
                kind, _, text = post["error"].partition(": ")
                return _SHARED.get(kind, StepMismatchError)(text)
            where = f" in {post['call']}" if post.get("call") else (
                f" at {post['where']}" if post.get("where") else "")
            then = ", and exited" if exited else ""
            return StepMismatchError(
                f"rank {rank} raised {post['error']}{where}{_after(post.get('step'))}{then}; "
                f"rank {stall.me} waits in {stall.what}{_after(engine.step)}, which rank "
                f"{rank} did not start")
    return None


def concluded(stall, wires):
    """This rank raised its own cause for the waits `wires`: the same cause another rank
    concluded at the same tick and posted is no news to a later wait of this rank."""
    engine = stall.engine
    for rank, posts in _raised_posts(stall).items():
        for post in posts:
            if set(post.get("wires") or ()) & set(wires):
                engine._told.add((rank, post["seq"]))


def ended(stall, others, now, ranks=None):
    """2. Ranks that ended while this one waits (`ranks`: those; None: read them)."""
    if ranks is None:
        ranks = [r for r, s in others.items() if s and s["state"] == "ended"]
    if not ranks:
        return None
    lost = [(r, others[r]["lost"]) for r in ranks if others[r].get("lost")]
    if lost:                        # it stopped because a rank died: name that one, not steps
        rank, cause = lost[0]
        stall.engine._lost = cause  # and this rank's own end passes the cause on
        return RankLostError(f"rank {rank} stopped while rank {stall.me} waits in "
                             f"{stall.what}: {cause}; {everyone(stall, others, now)}")
    lead = (f"{', '.join(f'rank {r}' for r in ranks)} ended while rank {stall.me} waits in "
            f"{stall.what}, which {'it' if len(ranks) == 1 else 'they'} never started")
    return StepMismatchError(f"{lead}: {everyone(stall, others, now)}"
                             f"{stall.engine._missing(stall.call)}. "
                             f"{_hint(stall, others, ranks)}")


_SAID = {   # field -> how Horovod's coordinator words a difference in it
    "kind": "Mismatched collective operations: One rank did {a}, but another rank did {b}.",
    "root": "Mismatched {kind} root ranks: One rank specified root rank {a}, but another rank "
            "specified root rank {b}.",
    "count": "Mismatched {kind} tensor counts: One rank sent {a} tensor(s), but another rank "
             "sent {b}.",
    "shapes": "Mismatched {kind} tensor shapes: One rank sent tensors of shapes {a}, but "
              "another rank sent {b}.",
    "dtypes": "Mismatched data types: One rank had types {a}, but another rank had {b}.",
}


def mismatched(stall, others):
    """3. Every rank waits in the same call, described differently."""
    mine = stall.call.posted()
    calls = {stall.me: mine}
    for rank, status in others.items():
        if status is None or not status.get("call") or status["call"]["name"] != mine["name"] \
                or not (status["state"] == "waiting" or stall.gave_up(status)):
            return None
        calls[rank] = status["call"]
    ranks = sorted(calls)
    first = calls[ranks[0]]
    rows = first["kind"] in ("allgather", "grouped_allgather", "alltoall")
    for field, said in _SAID.items():
        def value(call):
            if field == "shapes" and rows:      # their first dimensions may differ
                return [shape[1:] for shape in call.get("shapes") or []]
            return call.get(field)
        other = next((r for r in ranks if value(calls[r]) != value(first)), None)
        if other is not None:
            text = said.format(kind=first["kind"], a=value(first), b=value(calls[other]))
            error = MismatchError(f"{text} ({describe(first['kind'], first['name'])}: rank "
                                  f"{ranks[0]} and rank {other})")
            error.wires = sorted({call["wire"] for call in calls.values()})
            return error
    return None


def deadlock(stall, others, now, confirmed=False):
    """4. Every rank waits in a collective some other rank has not started.

    `confirmed`: the stall time passed: raise now with what the posts tell."""
    engine = stall.engine
    blocked = _blocked(stall, others)
    if blocked is None and not confirmed:
        return None
    if not confirmed:
        seen = tuple((r, (others.get(r) or {}).get("wait"), w) for r, (w, _) in
                     sorted(blocked.items()))
        beats = {r: (others.get(r) or {}).get("beat") for r in blocked if r != stall.me}
        if seen != stall.seen_deadlock:
            stall.seen_deadlock = seen      # again at the next tick, or it was a passing view
            stall.seen_beats = beats
            return None
        if any(beats[r] == stall.seen_beats.get(r) for r in beats):
            return None     # a post not renewed since: its rank may have left that wait
    if blocked:
        lines = []
        for rank in range(engine.size()):
            status = stall.mine() if rank == stall.me else others[rank]
            _, missing = blocked[rank]
            lines.append(f"rank {rank} waits in {status['what']}{_after(status.get('step'))}, "
                         f"which {_ranks(missing)} {'has' if len(missing) == 1 else 'have'} "
                         f"not started")
        lead = "the ranks wait in different collectives, each one that another rank has not "\
               "started, so none can complete"
        body = "; ".join(lines)
    else:
        lead = (f"every rank waits for a collective that another rank never starts (for more "
                f"than {stall.check_s:g} s, {CHECK_VARIABLE})")
        body = everyone(stall, others, now)
    error = StepMismatchError(f"{lead}: {body}{engine._missing(stall.call)}. "
                              f"{_hint(stall, others, list(others))}")
    error.wires = sorted({w for w, _ in blocked.values()}) if blocked else [stall.call.wire] + [
        s["call"]["wire"] for s in others.values() if s and s.get("call")]
    return error


def report(stall, others, now, lead):
    """A stall that must end (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS): what every rank does."""
    return StepMismatchError(f"{lead}: {everyone(stall, others, now)}"
                             f"{stall.engine._missing(stall.call)}. "
                             f"{_hint(stall, others, list(others))}")


def _ranks(ranks):
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _blocked(stall, others):
    """{rank: (the name it waits on, [ranks that have not started it])} when every rank
    waits, each blocked by another; None otherwise (or when the posts cannot tell)."""
    engine = stall.engine
    waits = {stall.me: (stall.call.wire, set(engine.names_in_flight()), False)}
    for rank, status in others.items():
        if status is None or status["state"] != "waiting" or "names" not in status:
            return None
        waits[rank] = (status["call"]["wire"], set(status["names"]), status.get("partial"))
    if any(status["call"]["kind"] == "join" for status in
           [stall.mine()] + [others[r] for r in others]):
        return None                 # a joined rank stands in for what it never started
    blocked = {}
    for rank, (wire, _, _) in waits.items():
        missing = [other for other, (theirs, names, partial) in sorted(waits.items())
                   if other != rank and wire != theirs and wire not in names and not partial]
        if not missing:
            return None             # every rank started it: it completes
        blocked[rank] = (wire, missing)
    return blocked
