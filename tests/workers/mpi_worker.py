"""Under an MPI launch (horovodrun --mpi, mpirun): the engine checks, then the
optimizer against the single-process oracle, in one launch per launcher; last, on
the horovod engine, rank ENDER ends after 3 steps while the other takes a 4th: that
one raises StepMismatchError naming ENDER and its step count (the status
board on MPI is a TCPStore rank 0 hosts, which stays up until the others read that
rank 0 ended), not Horovod's "has been shut down".

`python mpi_worker.py ENGINE SIZE [ENDER]`: ENGINE is the engine the environment must
pick; ENDER 1 by default.
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine_worker  # noqa: E402
import optimizer_worker  # noqa: E402
from pipe_horovod import engine  # noqa: E402


def main():
    engine_worker.check_engine(sys.argv[1], int(sys.argv[2]))
    # Horovod under mpirun must run on its MPI controller, not fall back to Gloo.
    want_mpi = engine.current().name == "horovod"
    assert engine.current().capabilities()["mpi_enabled"] is want_mpi, engine.current().capabilities()
    optimizer_worker.check_oracle()        # K in 1..3 on the engine already running
    if want_mpi:
        check_rank_that_ended(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
    print(f"WORKER_OK rank={engine.rank()}", flush=True)
    engine.shutdown()


def check_rank_that_ended(ender):
    import torch

    import pipe_horovod.torch as hvd

    rank = hvd.rank()
    model = torch.nn.Linear(4, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), pipeline_depth=1)

    def step():
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    for _ in range(3):
        step()
    if rank == ender:
        return                               # ends: main() shuts the engine down
    # Let the ender shut down first, so the 4th step's allreduce fails at its launch
    # (Horovod shut down), before this rank finished the step (CI saw the hint then name
    # a collective called on some ranks only, not uneven data).
    time.sleep(1.0)
    start = time.monotonic()
    try:
        step()
    except hvd.HorovodInternalError as exc:
        text = str(exc)
    else:
        raise AssertionError(f"rank {rank} took a step that rank {ender} never took")
    took = time.monotonic() - start
    assert f"rank {ender} ended while rank {rank} waits in allreduce" in text, text
    assert f"rank {ender} ended (shut down after 3 step(s))" in text and "hvd.join()" in text, text
    assert took < 5.0, took                  # it ends at once: no stall time, no timeout
    print(f"ENDED_NAMED rank={rank} after {took:.2f} s", flush=True)


if __name__ == "__main__":
    main()
