"""Under an MPI launch (horovodrun --mpi, mpirun): the engine checks, then the
optimizer against the single-process oracle, in one launch per launcher.

`python mpi_worker.py ENGINE SIZE`: ENGINE is the engine the environment must pick.
"""
import sys
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
    print(f"WORKER_OK rank={engine.rank()}", flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()
