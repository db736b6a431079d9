"""How to get Horovod: one text for every error of a path that needs it.

pipe_horovod runs without Horovod: `torchrun` selects the torch engine and
plain `python` the local one. Only the horovod engine needs it (`horovodrun`,
`mpirun` unless PIPE_HOROVOD_ENGINE=torch, or the engine asked for by name),
and a user who reaches it without Horovod must learn how to install it: a
bare `pip install horovod` does not work, because PyPI has only Horovod's
0.28.1 source and its CMake asks for C++14, which torch >= 2.1's headers
reject.
"""
HOROVOD_VERSION = "0.28.1"

# The environment scripts/install_horovod.sh builds with (Gloo controller, PyTorch ops).
BUILD_ENV = ("CXX=<pipe_horovod>/scripts/cxx17 HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 "
             "HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1")


def how_to_install():
    """The commands that install Horovod into this environment, as one paragraph."""
    return (f"install Horovod {HOROVOD_VERSION} (built against the installed torch) with "
            "`PYTHON=python bash scripts/install_horovod.sh` from a clone of pipe_horovod (it "
            "builds once and caches the wheel; run scripts/install_openmpi.sh first for the "
            f"MPI controller), or with pip after torch: `{BUILD_ENV} pip install "
            f"--no-build-isolation horovod=={HOROVOD_VERSION} cffi` (scripts/cxx17 turns "
            "Horovod's -std=c++14 into the -std=c++17 that torch's headers need; a C++ "
            "compiler and CMake must be installed)")


def without_horovod():
    """What works without Horovod, for an error raised where Horovod was expected."""
    return ("without Horovod, launch with torchrun (the torch engine) or plain python (one "
            "process), or set PIPE_HOROVOD_ENGINE=torch under mpirun")
