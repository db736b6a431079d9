"""Ranks that build different models, or pass different pipeline options, must all get
the same clear error, not a hang (optimizer_worker.py's `mismatch` case, on 2 ranks)."""
import torch

import pipe_horovod.torch as phvd


def check_all():
    rank = phvd.rank()
    # Every kind in turn: a failed check leaves the engine usable (the launch goes on).
    for what in ("shape", "dtype", "names", "options"):
        width = 5 if (what == "shape" and rank == 1) else 4
        model = torch.nn.Sequential(torch.nn.Linear(3, width))
        if what == "dtype" and rank == 1:
            model = model.double()
        named = list(model.named_parameters())
        if what == "names" and rank == 1:
            named = [("renamed." + n, p) for n, p in named]
        if what == "options":
            # Every pipeline option, one at a time: rank 1 passes another value.
            for option, usual, other in OPTIONS:
                expect_mismatch(model, named, f"option {option} is",
                                **{option: other if rank == 1 else usual})
        else:
            # a renamed parameter is one that rank 1 lacks
            expect_mismatch(model, named,
                            "is <missing> on rank 1" if what == "names" else "parameter")


OPTIONS = [("pipeline_depth", 2, 3), ("warmup_steps", 0, 1), ("backward_passes_per_step", 1, 2),
           ("compression", phvd.Compression.none, phvd.Compression.fp16),
           ("compression", phvd.Compression.int8_ef, phvd.Compression.int4_ef),
           ("op", phvd.Average, phvd.Sum), ("bucket_cap_mb", 25, 1),
           ("gradient_predivide_factor", 1.0, 2.0), ("groups", None, 1),
           ("staleness_compensation", "lookahead", None), ("collective", None, "ring")]


def expect_mismatch(model, named, what, **options):
    try:
        phvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=named, **options)
    except ValueError as exc:
        assert "differs between ranks" in str(exc) and "rank 1" in str(exc), exc
        assert what in str(exc), (what, exc)
        print(f"raised: {exc}", flush=True)
    else:
        raise AssertionError(f"ranks differ ({what} {options}) but no error was raised")
