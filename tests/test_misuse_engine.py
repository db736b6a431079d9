"""Issues 31 and 39: the same refusals, and the cause of every stall, on every rank under
torchrun as under horovodrun.

One launch per engine runs every case (tests/workers/misuse_worker.py) and one more
ends a script with an uncaught error (tests/workers/exits_worker.py); each test below
reads one case of the launch its engine ran (launcher.run_once), the message compared
exactly per rank, and across engines where Horovod's own words allow (it orders the two
values of a mismatch by arrival), with the seconds the rank took to say it.
"""
import re

import pytest

import launcher
from pipe_horovod.engine import causes

pytestmark = pytest.mark.timeout(400)

ENGINES = ["torch", "horovod"]
STEPS = r"( after \d+ step\(s\))?"

REFUSED = {
    "shape": ("Mismatched ALLREDUCE tensor shapes: One rank sent a tensor of shape {[2, 3]}, but "
              "another rank sent a tensor of shape {[3, 3]}.", "allreduce 'x.shape'"),
    "dtype": ("Mismatched data types: One rank had type {float32}, but another rank had type "
              "{float64}.", "allreduce 'x.dtype'"),
    "op": ("Mismatched reduction operation: One rank sent reduction op {Sum}, but another rank "
           "sent reduction op {Average}.", "allreduce 'x.op'"),
    "bsize": ("Mismatched BROADCAST tensor shapes: One rank sent a tensor of shape {[4]}, but "
              "another rank sent a tensor of shape {[6]}.", "broadcast 'x.bsize'"),
    "broot": ("Mismatched BROADCAST root ranks: One rank specified root rank {0}, but another "
              "rank specified root rank {1}.", "broadcast 'x.broot'"),
    "agshape": ("Mismatched ALLGATHER tensor shapes: One rank sent a tensor with dimension 1 "
                "equal to {3}, but another rank sent a tensor with dimension 1 equal to {4}.",
                "allgather 'x.ag'"),
}


def launch(engine_name):
    """(exit code, output, {(case, rank): (outcome, seconds)}) of the engine's misuse launch.

    Keras's uneven fit runs on TensorFlow under torchrun, on torch under horovodrun. The
    stall time is long (30 s): every case must name its cause from the posts, well before."""
    launcher.skip_without(engine_name)
    backend = {"torch": "tensorflow", "horovod": "torch"}[engine_name]
    if backend == "tensorflow":
        pytest.importorskip("tensorflow")
    pytest.importorskip("keras")
    code, out = launcher.run_once(engine_name, 2, "misuse_worker.py", timeout=300,
                                  env={"HOROVOD_STALL_CHECK_TIME_SECONDS": "30",
                                       "PIPE_HOROVOD_TIMEOUT": "60", "KERAS_BACKEND": backend})
    found = {}
    for case, rank, text, took in re.findall(r"CASE (\S+) rank=(\d): (.*?) \[([\d.]+) s\]", out):
        found[case, int(rank)] = (text, float(took))
    return code, out, found


def refused_texts(case, engine_name):
    """The messages a rank may print: torch says the values in rank order and names the
    ranks; Horovod orders them as they reached its coordinator and names no rank."""
    template, what = REFUSED[case]
    first, second = re.findall(r"\{(.*?)\}", template)
    plain = template.replace("{", "").replace("}", "")
    if engine_name == "torch":
        return {f"MismatchError: {plain} ({what}: rank 0 and rank 1)"}
    swapped = plain.replace(first, "\0").replace(second, first).replace("\0", second)
    return {f"MismatchError: {plain} ({what})", f"MismatchError: {swapped} ({what})"}


@pytest.mark.parametrize("engine_name", ENGINES)
def test_async_collectives_started_in_another_order_pair_by_name(engine_name):
    _, out, got = launch(engine_name)
    for rank in (0, 1):
        assert got["order", rank][0] == "ok [3.0, 30.0]", out


@pytest.mark.parametrize("engine_name", ENGINES)
def test_a_mismatch_is_horovods_error_on_every_rank(engine_name):
    _, out, got = launch(engine_name)
    for rank in (0, 1):
        for case in REFUSED:
            text, took = got[case, rank]
            assert text in refused_texts(case, engine_name), (case, rank, text)
            assert took < 1.0, (case, took)          # no lost-rank search, no timeout


@pytest.mark.parametrize("engine_name", ENGINES)
def test_join_stands_in_as_horovod(engine_name):
    _, out, got = launch(engine_name)
    for rank in (0, 1):
        assert got["join.last", rank][0] == "ok 0"
        # An empty shard joins; rank 0's 4 steps averaged with the joined rank's zeros.
        assert got["join.empty", rank][0] == ("ok [0, -2.115]", "ok [0, -0.515]")[rank], out
    assert got["join.average", 0][0] == "ok [0.5, 0.5]"      # Horovod divides by both ranks
    # int8's alltoall, or its point-to-point messages, which a joined rank cannot
    # answer: the engine's allreduce instead.
    assert got["join.int8", 0][0] == "ok [True, True, True, True]", out
    assert got["join.bf16", 0][0] == f"ok {[0.75, -1.5, 2.0 ** -131]}", out
    assert got["join.allgather", 0][0] == (
        "MismatchError: Allgather is not supported with Join at this time. Specify "
        "sparse_to_dense=True if using DistributedOptimizer (allgather 'j.ag')")


def different_collectives(text, waits):
    """The cause every rank raises when each waits in a collective another never started:
    `waits` [(rank, what)] in rank order."""
    lines = "; ".join(f"rank {rank} waits in {re.escape(what)}{STEPS}, which rank {1 - rank} "
                      "has not started" for rank, what in waits)
    return re.fullmatch(
        r"StepMismatchError: the ranks wait in different collectives, each one that another "
        rf"rank has not started, so none can complete: {lines}(; missing ranks: .*)?\. "
        r"(" + re.escape(causes.ORDER_HINT) + "|" + re.escape(causes.JOIN_HINT) + ")", text)


@pytest.mark.parametrize("engine_name", ENGINES)
@pytest.mark.parametrize("case, waits", [
    ("deadlock", [(0, "allreduce 'd.a'"), (1, "allreduce 'd.b'")]),
    ("blocking", [(0, "allreduce 'o.loss'"), (1, "allreduce 'o.acc'")]),
    ("barrier", [(0, "barrier()"), (1, "allreduce 'o.x'")]),
])
def test_ranks_in_different_collectives_name_each_others_call(engine_name, case, waits):
    """A name each rank waits for and the other never starts; blocking allreduces in a
    different order per rank; a barrier against an allreduce: every rank names every
    rank's call, about 2 s in (two looks at the posts a second apart), long before the
    stall time (30 s here)."""
    _, out, got = launch(engine_name)
    for rank in (0, 1):
        text, took = got[case, rank]
        assert different_collectives(text, waits), (case, rank, text)
        assert 1.0 <= took < 4.5, (case, rank, took)


@pytest.mark.parametrize("engine_name", ENGINES)
def test_a_collective_on_rank_0_alone_names_both_calls(engine_name):
    """broadcast_parameters on rank 0 only, then a step: rank 0 waits in the broadcast,
    rank 1 in the step's first reduction; both say so."""
    _, out, got = launch(engine_name)
    for rank in (0, 1):
        text, took = got["rank0only", rank]
        assert re.match(
            r"StepMismatchError: the ranks wait in different collectives, each one that "
            r"another rank has not started, so none can complete: rank 0 waits in broadcast "
            rf"'broadcast\.noname\.\d+'{STEPS}, which rank 1 has not started; rank 1 waits in "
            rf"allreduce 'pipe\d+\.agree\.sizes'{STEPS}, which rank 0 has not started", text), text
        assert took < 4.5, took


@pytest.mark.parametrize("engine_name", ENGINES)
def test_a_param_group_added_on_one_rank_names_the_group(engine_name):
    """add_param_group on rank 0 alone: rank 0 waits in the group's check, rank 1 in its next
    step. Both named the check 'pipeN.agree.sizes' and blamed uneven data (hvd.join()), as the
    step counts differ; both name the group, its check, and what to do."""
    _, out, got = launch(engine_name)
    hint = ("Parameter group 1 (2 parameter(s)) was added on some ranks only: every rank must "
            "call add_param_group with the same group, between the same two steps")
    for rank in (0, 1):
        text, took = got["paramgroup", rank]
        assert text.startswith("StepMismatchError: ") and text.endswith(hint), (rank, text)
        assert re.search(r"so none can complete: rank 0 waits in add_param_group's check of "
                         rf"parameter group 1{STEPS}, which rank 1 has not started; rank 1 "
                         r"waits in allreduce 'pipe\d+\.", text), (rank, text)
        assert "agree" not in text and "param_group1" not in text and "join" not in text, text
        assert took < 4.5, took


@pytest.mark.parametrize("engine_name", ENGINES)
def test_a_rank_that_raises_alone_is_named_by_the_others(engine_name):
    """Rank 1's allreduce of a complex64 metric is refused there (caught); rank 0, waiting in
    the same call, raises rank 1's error naming the call, within about a second."""
    _, out, got = launch(engine_name)
    text, took = got["metric", 1]
    refusal = "ValueError: allreduce cannot reduce torch.complex64 tensors"
    assert text.startswith(refusal) and took < 0.5, (text, took)
    text, took = got["metric", 0]
    assert text.startswith(f"StepMismatchError: rank 1 raised {refusal}"), text
    assert re.search(r" in allreduce 'metric'; rank 0 waits in allreduce 'metric'"
                     rf"{STEPS}, which rank 1 did not start$", text), text
    assert took < 2.5, took


@pytest.mark.parametrize("engine_name", ENGINES)
def test_grouped_and_object_collectives_are_compared(engine_name):
    """grouped_allreduce of 2 tensors against 3, broadcast_object with different roots,
    allgather_object against broadcast_object: the same MismatchError on both ranks."""
    _, out, got = launch(engine_name)
    counts = ("MismatchError: Mismatched grouped_allreduce tensor counts: One rank sent 2 "
              "tensor(s), but another rank sent 3. (grouped_allreduce 'g': rank 0 and rank 1)")
    where = r"\((object collective|broadcast_object|allgather_object) 'object\.noname\.\d+'" \
            r"(: rank 0 and rank 1)?\)"
    for rank in (0, 1):
        text, took = got["grouped", rank]
        assert text == counts and took < 4.5, (rank, text, took)
        text, took = got["grouped.root", rank]
        assert re.fullmatch(r"MismatchError: Mismatched broadcast_object root ranks: One rank "
                            r"specified root rank (0|1), but another rank specified root rank "
                            rf"(0|1)\. {where}", text), text
        assert took < 4.5, took
        text, took = got["grouped.kind", rank]
        assert re.fullmatch(r"MismatchError: Mismatched collective operations: One rank did "
                            r"(allgather_object|broadcast_object), but another rank did "
                            rf"(allgather_object|broadcast_object)\. {where}", text), text
        assert took < 4.5, took


@pytest.mark.parametrize("engine_name", ENGINES)
def test_a_depth_change_on_resume_says_to_flush_on_every_rank(engine_name):
    """A K=2 checkpoint (one gradient in flight) resumed at K=1 on rank 0 alone: rank 0's
    ValueError says to flush before saving; rank 1, at its next step, raises it too."""
    _, out, got = launch(engine_name)
    error = ("ValueError: a checkpoint with 1 averaged gradient(s) in flight (saved at "
             "pipeline_depth >= 2) cannot resume with pipeline_depth=1, which holds at most 0: "
             "resume with pipeline_depth=2, or call optimizer.flush() before "
             "optimizer.state_dict() when saving, so that nothing is in flight")
    assert got["resume", 0][0] == error, out
    text, took = got["resume", 1]
    assert text.startswith(f"StepMismatchError: rank 0 raised {error}") and took < 2.5, (text, took)


@pytest.mark.parametrize("engine_name", ENGINES)
def test_an_edit_of_grad_on_one_rank_reaches_the_others(engine_name):
    """K=2, rank 1 alone clips .grad at its third step: it raises the edit's error; rank 0
    raises it too, naming rank 1, at its first wait for a gradient rank 1 never sent."""
    _, out, got = launch(engine_name)
    edit = ("RuntimeError: the gradient of 'bias' was changed between backward() and step() "
            "(a clip, a scaling, a mask or GradScaler.unscale_ of .grad), but at "
            "pipeline_depth=2 backward() sent it already")
    fix = "then `with optimizer.skip_synchronize(): optimizer.step()`"
    text, took = got["edited", 1]
    assert text.startswith(edit) and fix in text and took < 1.0, (text, took)
    text, took = got["edited", 0]
    assert re.fullmatch(
        r"StepMismatchError: waiting for the gradients of step 3, bucket 0 \(2 parameter\(s\): "
        r"bias, weight\): rank 1 raised " + re.escape(edit) + r".* after 2 step\(s\); rank 0 "
        r"waits in allreduce 'pipe\d+\.0\.5\.1' after 5 step\(s\), which rank 1 did not start",
        text), text
    assert fix in text and took < 1.0 + 3.0, (text, took)   # STATUS_AFTER_S + 3 short steps


@pytest.mark.parametrize("engine_name", ENGINES)
def test_keras_uneven_batches_name_both_ranks_waits(engine_name):
    """Keras fit, 6 batches on rank 0 and 4 on rank 1, which then waits in an
    allgather_object: both name both waits and the steps."""
    _, out, got = launch(engine_name)
    assert got["keras", 1][0] == "ok trained", out
    cause = (r"the ranks wait in different collectives, each one that another rank has not "
             r"started, so none can complete: rank 0 waits in allreduce "
             r"'(?:keras|pipe)\d+\.0\.19\.0' after 6 step\(s\), which rank 1 has not started; "
             r"rank 1 waits in allgather_object 'keras\.next' after 4 step\(s\), which rank 0 "
             r"has not started(; missing ranks: .*)?\. " + re.escape(causes.JOIN_HINT))
    text, took = got["keras", 0]
    outer = "UnknownError" if engine_name == "torch" else "StepMismatchError"
    assert re.fullmatch(outer + r": (StepMismatchError: )?(waiting for the gradients of step 4, "
                        r"bucket 0 \(4 parameter\(s\): [^)]*\): )?" + cause, text), text
    assert took < 15.0, took                     # the fit's own start-up included
    text, took = got["keras.next", 1]
    assert re.fullmatch("StepMismatchError: " + cause, text) and took < 4.5, (text, took)


@pytest.mark.parametrize("engine_name", ENGINES)
def test_a_rank_that_ends_early_is_named_and_every_rank_exits_cleanly(engine_name):
    """Rank 1 trains 3 steps and exits; rank 0 is told so within a second or two, with the
    uneven-data advice. Last case: the launch itself exits 0 (no rank aborts at exit after
    the errors above, whose waits were abandoned)."""
    code, out, got = launch(engine_name)
    assert got["ended", 1][0] == "ok trained"
    text, _ = got["ended", 0]
    assert re.fullmatch(
        r"StepMismatchError: waiting for the gradients of step 3, bucket 0 \(2 parameter\(s\): "
        r"bias, weight\): rank 1 ended while rank 0 waits in allreduce '(pipe\d+\.0\.5\.0)', "
        r"which it never started: rank 0 waits in allreduce '\1' after 4 step\(s\) \(for \d+ s\)"
        r"; rank 1 ended \(shut down after 3 step\(s\)\)(; missing ranks: .*)?\. "
        + re.escape(causes.JOIN_HINT), text), text
    ended = float(re.search(r"ENDING rank=1 at ([\d.]+)", out).group(1))
    raised = float(re.search(r"RAISED rank=0 at ([\d.]+)", out).group(1))
    assert raised - ended < 3.5, (raised - ended, out)
    launcher.assert_finished(code, out, 2, "misuse_worker.py")
    assert "terminate called" not in out, out


@pytest.mark.parametrize("engine_name", ENGINES)
def test_an_engine_started_again_takes_none_of_the_last_ones_posts_as_news(engine_name):
    """Shut down and initialized again in one launch, the engine posts under a session of
    its own: a wait of 2.5 s completes instead of naming the last engine's end (a false
    StepMismatchError "rank 0 ended (shut down after N step(s))")."""
    _, out, got = launch(engine_name)
    for rank in (0, 1):
        text, took = got["again", rank]
        assert text == "ok [3.0]", out
    assert got["again", 1][1] >= 2.0, out       # it did wait past the board's first look


@pytest.mark.parametrize("engine_name", ENGINES)
def test_an_uncaught_error_ends_every_rank_with_status_1(engine_name):
    """Rank 1's script raises; rank 0, waiting, raises rank 1's error with where it was
    raised, within about a second. Both tracebacks print, and no rank dies by SIGABRT:
    rank 1 exits 1 and rank 0 exits 1 (or is stopped by the launcher once rank 1 exited,
    after printing its error). Rank 0 leaves after rank 1, so the launcher names rank 1
    as the first to fail (rank 0 used to exit first at times, under load)."""
    launcher.skip_without(engine_name)
    code, out = launcher.run_once(engine_name, 2, "exits_worker.py", timeout=120)
    assert code not in (None, 0), out
    assert "terminate called" not in out and "SIGABRT" not in out and "signal 6" not in out, out
    assert "ValueError: the data of rank 1 is broken" in out, out
    assert re.search(r"StepMismatchError: rank 1 raised ValueError: the data of rank 1 is broken "
                     r"at exits_worker\.py:\d+ in main, and exited; rank 0 waits in allreduce "
                     r"'second', which rank 1 did not start", out), out
    raised = {int(r): float(t) for r, t in re.findall(r"RAISING rank=(\d) at ([\d.]+)", out)}
    assert set(raised) == {0, 1} and raised[0] - raised[1] < 2.5, (raised, out)
    if engine_name == "torch":                     # torchrun's report of each rank
        statuses = dict(re.findall(r"rank\s*:\s*(\d) \(local_rank.*?\n\s*exitcode\s*:\s*(-?\d+)",
                                   out, re.S))
        assert statuses.get("1") == "1" and statuses.get("0", "1") in ("1", "-15"), (statuses, out)
        assert re.search(r"Root Cause \(first observed failure\):\s*\[0\]:.*?rank\s*:\s*1 ",
                         out, re.S), out
    else:                                          # horovodrun's
        statuses = dict(re.findall(r"Process (\d) exit with status code (\d+)", out))
        assert statuses.get("1") == "1" and statuses.get("0", "1") in ("1", "143"), (statuses, out)
        assert re.search(r"The first process to do so was:\s*Process name: 1\s", out), out
