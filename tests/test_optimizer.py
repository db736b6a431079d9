"""The pipelined DistributedOptimizer: oracle math on real ranks, checkpoints, bad input."""
import pytest
import torch

import launcher
import shared_launches
import pipe_horovod.torch as phvd

pytestmark = pytest.mark.timeout(600)
# The launches: tests/shared_launches.py (test_engine.py's engine checks share them). The
# oracle at 2 ranks runs in test_mpi.py's launches (horovod over MPI, torch under mpirun).
CASES, RESUMED = shared_launches.OPTIMIZER, shared_launches.RESUMED
run_case = shared_launches.optimizer_case


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return shared_launches.optimizer_folder(tmp_path_factory)


@pytest.mark.parametrize("engine_name, np, mode", [
    (e, n, mode) for (e, n), cases in CASES.items() if e != "local"
    for mode in ("oracle", "features") if mode in cases])
def test_matches_single_process_oracle(folder, engine_name, np, mode):
    run_case(folder, engine_name, np, mode)


@pytest.mark.parametrize("mode", ["oracle", "features", "param-group"])
def test_single_process_matches_oracle(folder, mode):
    # One rank takes the no-copy path: a step's gradient is `.grad` itself.
    run_case(folder, "local", 1, mode)


@pytest.mark.parametrize("engine_name, np", [("horovod", 2), ("torch", 3)])
def test_param_group_added_after_wrapping_is_reduced(folder, engine_name, np):
    run_case(folder, engine_name, np, "param-group")


@pytest.mark.parametrize("engine_name, np", [("local", 1), ("horovod", 2), ("torch", 3)])
def test_sparse_gradients_match_the_oracle(folder, engine_name, np):
    # nn.Embedding(sparse=True): allgathered rows or sparse_as_dense, SGD and SparseAdam.
    run_case(folder, engine_name, np, "sparse")


@pytest.mark.parametrize("engine_name", ["horovod", "torch"])
def test_optimizer_reduces_over_a_process_set(folder, engine_name):
    run_case(folder, engine_name, 3, "process-set")


def test_depth_one_matches_horovods_optimizer(folder):
    run_case(folder, "horovod", 2, "horovod-compare")


def _resume_matches_uninterrupted(folder, engine_name, np, mode, run):
    """The saving launch's uninterrupted weights (`save-RUN`) against the resuming launch's."""
    run_case(folder, engine_name, np, f"save-{run}")
    run_case(folder, engine_name, np, f"{mode}-{run}", RESUMED)
    a, b = torch.load(folder / f"save-{run}.pt"), torch.load(folder / f"{mode}-{run}.pt")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs after resume"


# Each engine once, each optimizer once (test_staleness resumes every option on both too).
@pytest.mark.parametrize("engine_name, np, kind", [("horovod", 2, "sgd"), ("torch", 3, "adam")])
def test_checkpoint_resume_is_bit_identical(folder, engine_name, np, kind):
    _resume_matches_uninterrupted(folder, engine_name, np, "resume", f"{kind}-3-none")


# K=1 has nothing in flight at a save, which the checkpoint tests above cover already.
@pytest.mark.parametrize("engine_name, np, depth, compensation", [
    ("horovod", 2, 2, "none"), ("torch", 3, 2, "lookahead")])
def test_rank0_loads_then_broadcasts_resumes_bit_identically(folder, engine_name, np, depth,
                                                              compensation):
    # Horovod's resume pattern: only rank 0 loads; broadcast_optimizer_state must
    # carry the pipeline's state (in-flight gradients, step, bucket order) too.
    # Under lookahead the other ranks resume at rank 0's predicted point
    # (checkpoint_worker.py says why): the reference run moves them there too.
    _resume_matches_uninterrupted(folder, engine_name, np, "resume-rank0",
                                  f"sgd-{depth}-{compensation}")


@pytest.mark.parametrize("engine_name", ["horovod", "torch"])
def test_models_that_differ_between_ranks_raise_everywhere(folder, engine_name):
    """Shapes, dtypes, names and every pipeline option, each differing on rank 1 in turn."""
    run_case(folder, engine_name, 2, "mismatch")


# --- bad input, in one process ------------------------------------------------
@pytest.fixture
def local():
    phvd.init("local")
    yield
    phvd.shutdown()


def tiny():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))


def wrap(model=None, **kw):
    model = model or tiny()
    kw.setdefault("named_parameters", model.named_parameters())
    kw.setdefault("staleness_compensation", None)    # these tests check plain Pipe-SGD
    return model, phvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kw)


def backward(model):
    model(torch.ones(2, 3)).sum().backward()


@pytest.mark.parametrize("kw, error, text", [
    ({"pipeline_depth": 0}, ValueError, "pipeline_depth must be >= 1"),
    ({"pipeline_depth": 1.5}, TypeError, "pipeline_depth must be an int"),
    ({"pipeline_depth": True}, TypeError, "pipeline_depth must be an int"),
    ({"warmup_steps": -1}, ValueError, "warmup_steps must be >= 0"),
    ({"backward_passes_per_step": 0}, ValueError, "backward_passes_per_step"),
    ({"bucket_cap_mb": 0}, ValueError, "bucket_cap_mb"),
    ({"compression": "fp16"}, TypeError, "compression must provide"),
    ({"op": "max"}, ValueError, "op must be"),
    ({"grad_scaler": 3}, TypeError, "GradScaler"),
])
def test_bad_options_are_named(local, kw, error, text):
    with pytest.raises(error, match=text):
        wrap(**kw)


@pytest.mark.parametrize("kw, error, text", [
    ({"gradient_predivide_factor": 2.0, "op": phvd.Sum}, ValueError, "only with op=Average"),
    ({"gradient_predivide_factor": 0}, ValueError, "gradient_predivide_factor must be"),
    ({"groups": -1}, ValueError, "non-negative integer"),
    ({"groups": "all"}, TypeError, "groups must be an int or a list"),
    ({"groups": [[1.0]]}, TypeError, "torch.Tensor"),
    ({"groups": [[torch.ones(1)]]}, ValueError, "not one of the optimizer's"),
])
def test_bad_horovod_options_are_named(local, kw, error, text):
    with pytest.raises(error, match=text):
        wrap(**kw)


def test_horovods_positional_order(local):
    model = tiny()
    opt = phvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    model.named_parameters(), phvd.Compression.none, 2,
                                    phvd.Average, 1.0, 0, 2, True)
    assert opt._passes_per_step == 2 and len(opt._buckets) == 2 and opt._sparse_as_dense


def test_depth_comes_from_the_environment_and_is_announced(local, monkeypatch, caplog):
    from pipe_horovod.torch import optimizer
    monkeypatch.setattr(optimizer, "_announced", set())   # once per process: start afresh
    monkeypatch.setenv("PIPE_HOROVOD_PIPELINE_DEPTH", "1")
    with caplog.at_level("INFO", logger="pipe_horovod"):
        _, opt = wrap()
    assert opt._fifo.pipeline_depth == 1
    assert "pipeline_depth=1 (PIPE_HOROVOD_PIPELINE_DEPTH): synchronous" in caplog.text
    _, opt = wrap(pipeline_depth=3)                      # the argument wins
    assert opt._fifo.pipeline_depth == 3
    monkeypatch.delenv("PIPE_HOROVOD_PIPELINE_DEPTH")
    caplog.clear()
    with caplog.at_level("INFO", logger="pipe_horovod"):
        _, opt = wrap()
    assert opt._fifo.pipeline_depth == 2
    assert "pipeline_depth=2 (default): Pipe-SGD" in caplog.text and "flush()" in caplog.text
    monkeypatch.setenv("PIPE_HOROVOD_PIPELINE_DEPTH", "two")
    with pytest.raises(ValueError, match="PIPE_HOROVOD_PIPELINE_DEPTH must be an integer"):
        wrap()
    monkeypatch.setenv("PIPE_HOROVOD_PIPELINE_DEPTH", "0")
    with pytest.raises(ValueError, match="pipeline_depth must be >= 1"):
        wrap()


def test_not_an_optimizer(local):
    with pytest.raises(TypeError, match="wraps a torch.optim.Optimizer"):
        phvd.DistributedOptimizer(tiny())


def test_duplicate_and_missing_names(local):
    model = tiny()
    named = list(model.named_parameters())
    with pytest.raises(ValueError, match=r"duplicate names: \['0.weight'\]"):
        wrap(model, named_parameters=[named[0], ("0.weight", named[1][1])] + named[2:])
    with pytest.raises(ValueError, match="missing from named_parameters"):
        wrap(model, named_parameters=named[:2])
    with pytest.raises(TypeError, match=r"\(name, tensor\) pairs"):
        wrap(model, named_parameters=[p for _, p in named])


def test_wrapped_optimizer_is_the_users_class(local):
    model = tiny()
    base = torch.optim.Adam(model.parameters(), lr=0.123, betas=(0.8, 0.9))
    opt = phvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    assert isinstance(opt, torch.optim.Adam)
    assert opt.param_groups[0]["lr"] == 0.123 and opt.param_groups[0]["betas"] == (0.8, 0.9)


def test_step_twice_without_backward(local):
    model, opt = wrap()
    backward(model)
    opt.step()
    with pytest.raises(RuntimeError, match="without a backward pass"):
        opt.step()


def test_too_many_backward_passes(local):
    model, opt = wrap(backward_passes_per_step=2)
    backward(model)
    backward(model)
    with pytest.raises(RuntimeError, match="more than backward_passes_per_step=2"):
        backward(model)


def test_zero_grad_while_this_steps_reduction_is_in_flight(local):
    model, opt = wrap()
    backward(model)
    with pytest.raises(RuntimeError, match="zero_grad.*before.*step"):
        opt.zero_grad()
    opt.step()
    opt.zero_grad()


def test_flush_between_backward_and_step(local):
    model, opt = wrap()
    backward(model)
    with pytest.raises(RuntimeError, match="flush.*step"):
        opt.flush()


def test_first_pipelined_steps_apply_nothing_and_flush_applies_all(local):
    model, opt = wrap(pipeline_depth=3)
    before = [p.clone() for p in model.parameters()]
    for _ in range(2):
        opt.zero_grad()
        backward(model)
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert opt.timings["applied"] == 0
    opt.flush()
    assert opt.timings["applied"] == 2
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_checkpoint_must_fit_the_pipeline(local):
    model, opt = wrap(pipeline_depth=3)
    for _ in range(3):
        opt.zero_grad()
        backward(model)
        opt.step()
    state = opt.state_dict()
    assert len(state["pipe_horovod"]["in_flight"]) == 2
    _, shallow = wrap(tiny(), pipeline_depth=2)
    with pytest.raises(ValueError, match="cannot resume with pipeline_depth=2"):
        shallow.load_state_dict(state)


@pytest.mark.skipif(not hasattr(torch.amp, "GradScaler"),
                    reason="a CPU GradScaler (torch.amp.GradScaler) needs torch >= 2.3")
def test_flush_unscales_with_the_scalers_current_scale(local):
    # The delayed gradient was computed at scale 8; the scaler has since moved to 2.
    model = tiny()
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    ref = tiny()
    _, opt = wrap(model, pipeline_depth=2, grad_scaler=scaler)
    scaler.scale(model(torch.ones(2, 3)).sum()).backward()
    opt.synchronize()
    scaler.unscale_(opt)
    with opt.skip_synchronize():
        scaler.step(opt)                         # applies nothing: the pipeline is filling
    scaler.update(2.0)
    opt.flush()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref(torch.ones(2, 3)).sum().backward()
    ref_opt.step()
    # Scaling by 8 and unscaling by 1/8 are exact in binary: the same bits as unscaled.
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_add_param_group_with_gradients_in_flight(local):
    model, opt = wrap(pipeline_depth=2)
    backward(model)
    with pytest.raises(RuntimeError, match="add_param_group.*step"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
    opt.step()
    with pytest.raises(RuntimeError, match=r"1 gradient\(s\) in flight.*flush\(\)"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
    opt.flush()
    extra = torch.nn.Parameter(torch.ones(2))
    opt.add_param_group({"params": [extra], "lr": 0.5})
    opt.zero_grad()
    (model(torch.ones(2, 3)).sum() + extra.sum()).backward()
    opt.step()
    opt.flush()
    assert torch.equal(extra.detach(), torch.full((2,), 0.5))   # 1 - 0.5 * grad 1


def test_state_dict_between_backward_and_step(local):
    model, opt = wrap()
    backward(model)
    with pytest.raises(RuntimeError, match="state_dict.*step"):
        opt.state_dict()


@pytest.mark.parametrize("launch, np", [("local", 1), ("torch", 2)])
def test_digits_example_runs_under_each_launcher(tmp_path, launch, np):
    import json

    out = tmp_path / "result.json"
    script = launcher.REPO / "examples" / "pytorch_digits.py"
    rc, output = launcher.run(launch, np, script, "--epochs", "2", "--no-progress", "--json", out,
                              expect_ok=False, timeout=200)
    assert rc == 0, output
    result = json.loads(out.read_text())
    assert result["size"] == np and result["ranks_agree"] and result["accuracy"] > 0.5


def test_digits_example_says_a_save_was_cut(tmp_path):
    """A save killed before its rename (a grace time shorter than the save) leaves its
    temporary file beside the last complete checkpoint: the next run says so and resumes
    from the complete one."""
    script = launcher.REPO / "examples" / "pytorch_digits.py"
    folder = tmp_path / "ckpt"
    common = ("--no-progress", "--checkpoint-dir", folder)
    rc, first = launcher.run("local", 1, script, "--epochs", "1", *common, expect_ok=False,
                             timeout=200)
    assert rc == 0, first
    (folder / "digits.0.pt.tmp").write_bytes(b"cut short")
    rc, second = launcher.run("local", 1, script, "--epochs", "2", *common, expect_ok=False,
                              timeout=200)
    assert rc == 0, second
    assert ("rank 0: the previous run was killed while it saved its checkpoint (a grace time "
            "shorter than the save?): resuming from the last complete one") in second, second
    assert f"resumed from {folder}: epoch 2" in second, second
    assert not (folder / "digits.0.pt.tmp").exists()


@pytest.mark.parametrize("engine_name, depth", [("horovod", 2), ("horovod", 3), ("torch", 2)])
def test_exit_without_flush_completes_reductions_and_warns(folder, engine_name, depth):
    # Horovod scripts never call flush(): the faster rank must not leave (and
    # shut the engine down) while the slower one still needs its reductions.
    case = f"no-flush-{depth}"
    out = run_case(folder, engine_name, 2, case,
                   CASES if case in CASES[engine_name, 2] else RESUMED)
    warned = [line for line in out.splitlines() if "not applied" in line]
    assert len(warned) == 1, out
    assert f"{depth - 1} computed gradient(s)" in warned[0] and "flush()" in warned[0], warned
