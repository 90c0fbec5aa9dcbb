"""Building and loading the CPU kernel library (`csrc/`): compiled on first use with the system C++ compiler, cached
on disk, its entry points registered with XLA's FFI.

The build target is `$JSPEC_CPU_KERNELS_MARCH` (default `native`: this CPU's instruction set) and floating-point
contraction is off (`-ffp-contract=off`): every sum and product happens in the order the source writes it, so the
kernels' bit-for-bit promises (a row's result does not depend on the rows beside it) hold whatever vector width and
fused multiply-adds the target offers. With contraction on, a skylake-avx512 build broke them while a znver4 one kept
them; the test module `tests/test_cpu_kernels.py` checks both targets.

The library lives in `$JSPEC_KERNELS_DIR`, else `~/.cache/jspec/kernels`, named by a hash of the sources, the flags,
jaxlib and the CPU.
"""
from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings

import jax

SOURCES = tuple(os.path.join(os.path.dirname(__file__), "csrc", f) for f in ("small_m_dot.cc", "cache_attention.cc",
                                                                        "cache_rows.cc"))
SWITCH = "JSPEC_CPU_KERNELS"  # "1" turns the kernels on; unset or anything else, every op stays with XLA
MARCH_ENV = "JSPEC_CPU_KERNELS_MARCH"
DIR_ENV = "JSPEC_KERNELS_DIR"

# (python name, C symbol) of every entry point
TARGETS = (("jspec_small_m_dot", "JspecSmallMDot"), ("jspec_packed_dot", "JspecPackedDot"),
           ("jspec_cache_attention", "JspecCacheAttention"), ("jspec_cache_attention2", "JspecCacheAttention2"),
           ("jspec_long_attention", "JspecLongAttention"), ("jspec_write_rows", "JspecWriteRows"),
           ("jspec_move_rows", "JspecMoveRows"))


def flags(march: str | None = None) -> tuple[str, ...]:
    """The compiler flags for a build target (default `$JSPEC_CPU_KERNELS_MARCH`, else native)."""
    march = march or os.environ.get(MARCH_ENV) or "native"
    return ("-O3", f"-march={march}", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC", "-w")


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def library_path(march: str | None = None) -> str:
    """Where the compiled library for these sources, flags, jaxlib and CPU lives."""
    h = hashlib.sha256()
    for source in SOURCES:
        with open(source, "rb") as f:
            h.update(f.read())
    h.update(" ".join(flags(march)).encode())
    h.update(jax.__version__.encode())
    h.update(_cpu_signature().encode())
    root = os.path.expanduser(os.environ.get(DIR_ENV) or os.path.join("~", ".cache", "jspec", "kernels"))
    return os.path.join(root, f"jspec_cpu-{h.hexdigest()[:16]}.so")


def build(path: str, march: str | None = None) -> str:
    """Compile the library to `path` (once: concurrent callers wait on a lock file beside it)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(path):
            return path
        cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
        if cxx is None:
            raise RuntimeError("no C++ compiler (g++ or c++) on PATH")
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
        os.close(fd)
        cmd = [cxx, *flags(march), "-I", jax.ffi.include_dir(), *SOURCES, "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            os.unlink(tmp)
            raise RuntimeError(f"compiling {' '.join(SOURCES)} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, path)
    return path


@functools.cache
def load() -> bool:
    """Build (if needed) and register the library once per process; False, with a warning, where it cannot."""
    try:
        lib = ctypes.cdll.LoadLibrary(build(library_path()))
        for target, symbol in TARGETS:
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except (OSError, RuntimeError) as e:
        warnings.warn(f"jspec's CPU kernels (products, attention, cache writes) are unavailable, XLA's ops are used "
                      f"instead: {e}", stacklevel=3)
        return False
    return True


def available() -> bool:
    """Whether the library is built and registered (it needs a C++ compiler); the switch aside."""
    return load()


def enabled() -> bool:
    """Whether ops traced now go to the kernels: the switch is "1", the default backend is the CPU and the library
    is available."""
    return os.environ.get(SWITCH, "0") == "1" and jax.default_backend() == "cpu" and load()
