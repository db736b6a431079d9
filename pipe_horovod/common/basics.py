"""Start, stop and identity: what a script asks before and around its collectives.

Horovod keeps these in horovod/common (basics.py) so that every framework's
module answers them alike; here every adapter (pipe_horovod.torch,
.tensorflow, .keras) re-exports these very functions. Identity and
capability queries ask the running engine, so each raises ValueError before
init(), except the *_built ones, which Horovod answers before init() too
(scripts ask them first, to skip what the build lacks).
"""
from .. import engine as _engine


def _current():
    return _engine.current()


init = _engine.init                 # Horovod's signature; a string comm names the engine
shutdown = _engine.shutdown
is_initialized = _engine.is_initialized


def size() -> int:
    """The number of processes (ranks) in the job."""
    return _current().size()


def local_size() -> int:
    """The number of ranks on this machine, for choosing a GPU per rank."""
    return _current().local_size()


def cross_size() -> int:
    """The number of machines that run a rank with this local rank."""
    return _current().cross_size()


def rank() -> int:
    """This process's rank, 0 to size() - 1; rank 0 usually logs and saves."""
    return _current().rank()


def local_rank() -> int:
    """This process's rank on its machine: `torch.cuda.set_device(local_rank())`."""
    return _current().local_rank()


def cross_rank() -> int:
    """The index of this machine among those running this local rank."""
    return _current().cross_rank()


def is_homogeneous() -> bool:
    """True when every machine runs the same number of ranks."""
    return _current().is_homogeneous()


def _capability(name):
    if name.endswith("_built") and not _engine.is_initialized():
        return _engine.build_info()[name]       # as Horovod: answered before init()
    return _current().capabilities()[name]


def mpi_threads_supported() -> bool:
    """Whether MPI runs with multiple threads (MPI_THREAD_MULTIPLE), as Horovod reports it.

    Raises:
        ValueError: MPI is not enabled on the running engine (Horovod raises too).
    """
    supported = _capability("mpi_threads_supported")
    if supported is None:
        raise ValueError(f"MPI is not enabled on the {_current().name} engine; "
                         "mpi_threads_supported() is defined only with MPI (as in Horovod)")
    return supported


def mpi_enabled() -> bool:
    """True when the running engine talks MPI (Horovod's MPI controller)."""
    return _capability("mpi_enabled")


def mpi_built() -> bool:
    """True when the engine was built with MPI."""
    return _capability("mpi_built")


def gloo_enabled() -> bool:
    """True when the running engine talks Gloo."""
    return _capability("gloo_enabled")


def gloo_built() -> bool:
    """True when the engine was built with Gloo."""
    return _capability("gloo_built")


def nccl_built() -> int:
    """NCCL's version code when built with NCCL, else 0 (as in Horovod)."""
    return _capability("nccl_built")


def ddl_built() -> bool:
    """True when built with IBM DDL (never here; Horovod's name, kept)."""
    return _capability("ddl_built")


def ccl_built() -> bool:
    """True when built with oneCCL."""
    return _capability("ccl_built")


def cuda_built() -> bool:
    """True when the engine can reduce CUDA tensors."""
    return _capability("cuda_built")


def rocm_built() -> bool:
    """True when the engine can reduce ROCm tensors."""
    return _capability("rocm_built")


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record collectives to a Chrome-trace file, to see where a step waits.

    Rank 0 writes it. On the horovod engine Horovod does, and needs
    HOROVOD_TIMELINE=DYNAMIC at start for a timeline started at run time.

    Args:
        file_path: the trace file (chrome://tracing, Perfetto).
        mark_cycles: also mark Horovod's background cycles (horovod engine).
    """
    _current().start_timeline(file_path, mark_cycles)


def stop_timeline() -> None:
    """Stop the recording start_timeline began and close its file."""
    _current().stop_timeline()


__all__ = ["ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "gloo_built",
           "gloo_enabled", "init", "is_homogeneous", "is_initialized", "local_rank",
           "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built",
           "rank", "rocm_built", "shutdown", "size", "start_timeline", "stop_timeline"]
