"""`pipe-horovod check`: what this installation can run, like `horovodrun --check-build`.

Answers before a user spends cluster time: which engines import, which
controllers and collectives Horovod was built with, which frameworks are
present, and whether the int8/fp8 codec runs its C kernels on CPU tensors (one
line: the library, or why the torch form runs). Exits non-zero when something the
user asked for is missing.
"""
import importlib
import os
import shutil
import sys

from pipe_horovod.compression import native
from pipe_horovod.engine import ENGINES, missing_package


def _version(module):
    try:
        return importlib.import_module(module).__version__
    except Exception:  # noqa: BLE001 - any failure means "not usable here"
        return None


def _horovod_build():
    """(controllers, tensor operations), each {name: built?}, as `horovodrun --check-build`
    lists them; two empty dicts without Horovod."""
    try:
        import horovod.torch as hvd
    except Exception:  # noqa: BLE001
        return {}, {}
    controllers = {"mpi": hvd.mpi_built(), "gloo": hvd.gloo_built()}
    ops = {"nccl": bool(hvd.nccl_built()), "ddl": hvd.ddl_built(), "ccl": hvd.ccl_built(),
           **controllers}
    return controllers, ops


def _launchers():
    """Which launch commands are found: on PATH, or beside this Python (a venv not activated)."""
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    return {name: shutil.which(name, path=path) is not None
            for name in ("horovodrun", "mpirun", "torchrun")}


def _torch_backends():
    try:
        import torch.distributed as dist
    except Exception:  # noqa: BLE001
        return {}
    return {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(),
            "mpi": dist.is_mpi_available()}


def _gpus():
    """{"cuda <version>": built?, "<device name>": True, ...}: what torch was built for and sees."""
    try:
        import torch
    except Exception:  # noqa: BLE001
        return {}
    import warnings

    with warnings.catch_warnings():  # torch warns when it finds no driver; the line below says it
        warnings.simplefilter("ignore")
        count = torch.cuda.device_count() if torch.version.cuda else 0
    return {f"cuda {torch.version.cuda or '(CPU build of torch)'}": bool(torch.version.cuda),
            **{f"{i}: {torch.cuda.get_device_name(i)}": True for i in range(count)}}


def no_gpu_line(gpus):
    """One line when torch sees no GPU (None when it sees one), saying why where it can."""
    cuda_built, *devices = gpus.values()
    if devices:
        return None
    if not cuda_built:
        return "no GPU: this torch is a CPU build; training runs on the CPU"
    return ("no GPU visible (no NVIDIA driver or device here; in a container, run it with "
            "--gpus all): training runs on the CPU")


# The adapters a script imports, and the frameworks each needs (pipe_horovod.tensorflow is
# Horovod's TF2 custom-loop API: tf.GradientTape, tf.function, Keras 3 optimizers).
ADAPTERS = {"pipe_horovod.torch": ("torch",), "pipe_horovod.keras": ("keras",),
            "pipe_horovod.tensorflow": ("tensorflow", "keras")}


def report():
    """{section: {item: available?}} plus framework versions."""
    controllers, ops = _horovod_build()
    frameworks = {"torch": _version("torch"), "tensorflow": _version("tensorflow"),
                  "keras": _version("keras"), "horovod": _version("horovod")}
    return {
        "engines": {name: missing_package(name) is None for name in ENGINES},
        "horovod controllers": controllers,
        "horovod tensor operations": ops,
        "launchers": _launchers(),
        "torch.distributed backends": _torch_backends(),
        "gpus": _gpus(),
        "frameworks": frameworks,
        "adapters": {name: all(frameworks[f] for f in needs) for name, needs in ADAPTERS.items()},
    }


# How to install each framework that `report` finds missing.
INSTALL_FRAMEWORK = {
    "torch": "pip install 'torch>=2.1'",
    "keras": "pip install 'pipe_horovod[keras]' (Keras 3; its torch backend needs nothing more)",
    "tensorflow": "for pipe_horovod.tensorflow and Keras's TensorFlow backend: pip install "
                  "'pipe_horovod[tensorflow]' (or tensorflow-cpu, or tensorflow[and-cuda]), "
                  "2.16 or newer",
}


def missing(info):
    """One line per engine and framework this installation lacks: what it is, how to get it."""
    return ([missing_package(name) for name, usable in info["engines"].items() if not usable]
            + [f"{name} is not installed: {how}" for name, how in INSTALL_FRAMEWORK.items()
               if not info["frameworks"][name]])


def add_arguments(parser):
    parser.add_argument("--engine", choices=sorted(ENGINES), help="fail unless this engine is usable")
    parser.add_argument("--controller", choices=["gloo", "mpi"],
                        help="fail unless Horovod was built with this controller")
    parser.add_argument("--ops", choices=["nccl", "ddl", "ccl", "mpi", "gloo"],
                        help="fail unless Horovod was built with these tensor operations")
    parser.add_argument("--framework", choices=["torch", "keras", "tensorflow"],
                        help="fail unless installed")


def run(args):
    info = report()
    mark = lambda ok: "[X]" if ok else "[ ]"  # noqa: E731
    for section, items in info.items():
        print(f"{section}:")
        if not items:
            print("    (not installed)")
        for item, value in items.items():
            version = "" if isinstance(value, bool) else f" {value or ''}"
            print(f"    {mark(value)} {item}{version}")
    if info["gpus"] and (line := no_gpu_line(info["gpus"])):
        print(line)
    print(f"int8/fp8 codec on CPU: {native.status()}")
    lacking = missing(info)
    if lacking:
        print("missing:")
        for line in lacking:
            print(f"    {line}")
    problems = []
    if args.engine and not info["engines"][args.engine]:
        problems.append(missing_package(args.engine))
    if args.controller and not info["horovod controllers"].get(args.controller):
        problems.append(f"Horovod with the {args.controller} controller is not available here")
    if args.ops and not info["horovod tensor operations"].get(args.ops):
        problems.append(f"Horovod with {args.ops} tensor operations is not available here")
    if args.framework and not info["frameworks"][args.framework]:
        problems.append(f"framework {args.framework!r} is not installed: "
                        f"pip install 'pipe_horovod[{args.framework}]'")
    for problem in problems:
        print(f"error: {problem}")
    return 1 if problems else 0
