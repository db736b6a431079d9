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
into place, so ranks compiling at once do not race. A build also removes the
libraries no process has loaded for STALE_DAYS (each load refreshes its file's
time; a new release, compiler or flag leaves the old one behind) and temporary
files a killed build left. The flags keep IEEE semantics:
no -ffast-math, no FMA contraction, no -march=native (a cache shared between
machines must not carry instructions another CPU lacks: on x86-64 the kernels come
in a baseline and an AVX2 copy instead, chosen at load time from the CPU's features).

A prebuilt library: `python -m pipe_horovod.compression.native OUTPUT.so` (or
`python native.py OUTPUT.so`: this file needs only the standard library) compiles it
with the same compiler choice and flags (`build`), and `$PIPE_HOROVOD_NATIVE_LIBRARY`
naming a file makes `library()` load that file instead of compiling (the Docker
image: built in its build stage, which has the compiler; the runtime stage has none).
The same ABI check applies, and the first use of each kind and dtype checks the bits
against torch's (two_stage._self_check) as for a compiled one.

Without a compiler and no prebuilt library, when compiling or loading fails (a
prebuilt library that does not load included), or with PIPE_HOROVOD_NATIVE_CODEC=0,
`library()` returns None and the torch form runs; the reason is logged once (INFO).
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
import time
from pathlib import Path

ENV = "PIPE_HOROVOD_NATIVE_CODEC"
LIBRARY_ENV = "PIPE_HOROVOD_NATIVE_LIBRARY"   # a prebuilt library to load instead of compiling
ABI_VERSION = 3                     # cpu_kernels.c's ABI_VERSION
FLAGS = ["-O3", "-std=c99", "-fPIC", "-shared", "-fno-fast-math", "-ffp-contract=off",
         "-fno-trapping-math"]
SOURCE = Path(__file__).with_name("cpu_kernels.c")
STALE_DAYS = 30              # a cached library unused this long is removed by the next build

log = logging.getLogger(__name__)
_lock = threading.Lock()
_state = {"tried": False, "lib": None, "path": None, "error": None}


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
                    _state["error"] = str(exc)
                    log.info("pipe_horovod: native int8/fp8 codec unavailable (%s); using the "
                             "torch implementation", exc)
                _state["tried"] = True
    return _state["lib"]


def status():
    """One line for `pipe-horovod check`: the library in use, or why the torch form runs."""
    if library() is not None:
        return f"native kernels ({_state['path']})"
    if not enabled():
        return f"torch form ({ENV}={os.environ.get(ENV)})"
    return f"torch form ({_state['error']})"


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


def build(output, cc=None):
    """Compile cpu_kernels.c with FLAGS into the file `output` (written to a private
    temporary file beside it, then renamed: readers never see a partial library).
    `cc`: the compiler command as a list (default: `_compiler()`'s)."""
    cc = cc or _compiler()[0]
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".cpu_kernels-", suffix=".so", dir=output.parent)
    os.close(fd)
    try:
        # Seconds on an idle machine; the limit is for a compiler that hangs, not for a
        # loaded one (ranks compiling at once beside other work have run past 120 s on a
        # loaded 2-core machine).
        done = subprocess.run([*cc, *FLAGS, "-o", tmp, str(SOURCE), "-lm"],
                              capture_output=True, text=True, timeout=600)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cc)} failed: {done.stderr.strip()[:500]}")
        os.chmod(tmp, 0o755)                  # mkstemp's 0600 would hide it from other users
        os.replace(tmp, output)               # atomic: a concurrent rank sees all or nothing
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return output


def _load():
    prebuilt = os.environ.get(LIBRARY_ENV, "").strip()
    if prebuilt:
        path = Path(prebuilt)
        if not path.is_file():
            raise RuntimeError(f"{LIBRARY_ENV}={prebuilt} is not a file")
        try:
            return _open(path)
        except Exception as exc:
            raise RuntimeError(f"{LIBRARY_ENV}={prebuilt}: {exc}") from exc
    source = SOURCE.read_bytes()
    cc, version = _compiler()
    key = hashlib.sha256(b"\0".join([
        source, " ".join(cc).encode(), version.encode(), " ".join(FLAGS).encode(),
        platform.machine().encode(), sys.platform.encode()])).hexdigest()[:20]
    path = _cache_dir() / f"cpu_kernels-{key}.so"
    if path.exists():
        try:
            os.utime(path)                    # in use: not stale (_prune)
        except OSError:                       # a read-only cache shared by a cluster
            pass
    else:
        build(path, cc)
        _prune(path)
    return _open(path)


def _prune(keep):
    """Remove the cache's other libraries unused for STALE_DAYS, and build temporaries
    over an hour old (a build takes seconds: those of a killed process)."""
    now = time.time()
    for pattern, age in (("cpu_kernels-*.so", STALE_DAYS * 86400), (".cpu_kernels-*.so", 3600)):
        for old in keep.parent.glob(pattern):
            try:
                if old != keep and now - old.stat().st_mtime > age:
                    old.unlink()
            except OSError:                   # another rank removed it first, or no right to
                pass


def _open(path):
    """The library at `path`, its ABI checked and its functions typed."""
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
    _state["path"] = str(path)
    log.debug("pipe_horovod: native int8/fp8 codec loaded from %s", path)
    return lib


def reset():
    """Forget the loaded library so that the next `library()` loads it again (tests)."""
    with _lock:
        _state.update(tried=False, lib=None, path=None, error=None)


def main(argv=None):
    """`python -m pipe_horovod.compression.native OUTPUT.so`: build the library there."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m pipe_horovod.compression.native",
        description=f"Compile the int8/fp8 codec's C kernels into OUTPUT, for {LIBRARY_ENV} "
                    "(compiler: $CC, else cc, gcc or clang).")
    parser.add_argument("output", help="the shared library to write, e.g. cpu_kernels.so")
    args = parser.parse_args(argv)
    try:
        path = build(args.output)
        _open(path)                           # it loads and its ABI is this module's
    except Exception as exc:                  # one line, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{path} (ABI {ABI_VERSION})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
