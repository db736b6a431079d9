"""The C kernels of the two-stage int8/fp8 reduction on CPU tensors (cpu_kernels.c).

Why: the torch form of the math (two_stage.py) is one pass over memory per
operation, about 2.3 ns per gradient byte over the three stages on one core, more
than the 1 Gbit wire needs for the int8 bytes; the kernels do each stage in one
pass, block by block, with the same operations in the same order, so the bits are
the same (tests/test_native_codec.py checks them against the torch form).

The source ships in the package and is compiled on first use with the system C
compiler (`$CC`, else cc, gcc or clang) into a per-user cache
(`$PIPE_HOROVOD_CACHE`, else `$XDG_CACHE_HOME` or ~/.cache, then
pipe_horovod/native/), named by a hash of the source, the compiler, its version,
the flags and the platform; a rank writes a private temporary file and renames it
into place, so ranks compiling at once do not race. The flags keep IEEE semantics:
no -ffast-math, no FMA contraction, no -march=native (a cache shared between
machines must not carry instructions another CPU lacks: on x86-64 the kernels come
in a baseline and an AVX2 copy instead, chosen at load time from the CPU's features).

Without a compiler (the runtime Docker image has none), when compiling or loading
fails, or with PIPE_HOROVOD_NATIVE_CODEC=0, `library()` returns None and the torch
form runs; the reason is logged once (INFO).
"""
import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ENV = "PIPE_HOROVOD_NATIVE_CODEC"
ABI_VERSION = 2                     # cpu_kernels.c's ABI_VERSION
FLAGS = ["-O3", "-std=c99", "-fPIC", "-shared", "-fno-fast-math", "-ffp-contract=off",
         "-fno-trapping-math"]
SOURCE = Path(__file__).with_name("cpu_kernels.c")

log = logging.getLogger(__name__)
_lock = threading.Lock()
_state = {"tried": False, "lib": None}


def enabled():
    """False when PIPE_HOROVOD_NATIVE_CODEC is 0/false/off/no (read at every call)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def library():
    """The loaded kernels (a ctypes.CDLL with typed functions), or None."""
    if not enabled():
        return None
    if not _state["tried"]:
        with _lock:
            if not _state["tried"]:
                try:
                    _state["lib"] = _load()
                except Exception as exc:          # any failure: the torch form runs
                    log.info("pipe_horovod: native int8/fp8 codec unavailable (%s); using the "
                             "torch implementation", exc)
                _state["tried"] = True
    return _state["lib"]


def _cache_dir():
    root = (os.environ.get("PIPE_HOROVOD_CACHE")
            or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                            os.path.join(os.path.expanduser("~"), ".cache"), "pipe_horovod"))
    return Path(root) / "native"


def _compiler():
    """(command as a list, first line of its --version); $CC may hold words ("ccache gcc")."""
    cc = (shlex.split(os.environ.get("CC", "")) or
          [next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)])
    if not cc[0]:
        raise RuntimeError("no C compiler (cc, gcc, clang) on PATH")
    version = subprocess.run([*cc, "--version"], capture_output=True, text=True,
                             timeout=60).stdout.splitlines()
    return cc, (version[0] if version else "")


def _load():
    source = SOURCE.read_bytes()
    cc, version = _compiler()
    key = hashlib.sha256(b"\0".join([
        source, " ".join(cc).encode(), version.encode(), " ".join(FLAGS).encode(),
        platform.machine().encode(), sys.platform.encode()])).hexdigest()[:20]
    folder = _cache_dir()
    path = folder / f"cpu_kernels-{key}.so"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".cpu_kernels-", suffix=".so", dir=folder)
        os.close(fd)
        try:
            done = subprocess.run([*cc, *FLAGS, "-o", tmp, str(SOURCE), "-lm"],
                                  capture_output=True, text=True, timeout=120)
            if done.returncode:
                raise RuntimeError(f"{' '.join(cc)} failed: {done.stderr.strip()[:500]}")
            os.replace(tmp, path)             # atomic: a concurrent rank sees all or nothing
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(path))
    if lib.phv_abi_version() != ABI_VERSION:
        raise RuntimeError(f"{path}: ABI {lib.phv_abi_version()}, expected {ABI_VERSION}")
    p, i64, dbl, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, ctypes.c_int
    for s in ("f32", "f64"):
        fn = getattr(lib, f"phv_encode_{s}")
        fn.argtypes, fn.restype = [p, p, p, i64, i64, p, p, i32, dbl, p], i64
        fn = getattr(lib, f"phv_decode_{s}")
        fn.argtypes, fn.restype = [p, p, i64, i64, p, i32, p], i64
        fn = getattr(lib, f"phv_reduce_{s}")
        fn.argtypes = [p, i64, i64, i64, i64, dbl, i32, i32, dbl, i32, p, p, p, i32, dbl, p]
        fn.restype = i64
    log.debug("pipe_horovod: native int8/fp8 codec loaded from %s", path)
    return lib


def reset():
    """Forget the loaded library so that the next `library()` loads it again (tests)."""
    with _lock:
        _state.update(tried=False, lib=None)
