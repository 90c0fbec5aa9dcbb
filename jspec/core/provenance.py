"""Where and how a measurement ran: what every result file (benches, cost tables, training logs) records, so that
two numbers can be told apart by machine, versions, flags and code.

`provenance()` returns a JSON-ready dict: the date (UTC), the git commit of the code that ran (and whether its tree
had uncommitted changes), Python and the versions of the packages that change numbers, the backend, the device's
model (a CPU's model name from /proc/cpuinfo with its vector extensions, or a GPU's / TPU's device kind), the
cores this process may use, the device count, the load average when it was taken, and every environment switch
that changes numbers (`XLA_FLAGS`, `JAX_*`, `JSPEC_*`, thread counts). `device_model()` is the device's model
alone, the part of a cost table's cache key that tells two machines apart.
"""
from __future__ import annotations

import functools
import os
import platform
import subprocess
import sys
import time
from importlib import metadata

PACKAGES = ("jax", "jaxlib", "flax", "numpy", "transformers", "torch")
ENV_PREFIXES = ("XLA_", "JAX_", "JSPEC_", "TF_CPP_")
ENV_NAMES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "CUDA_VISIBLE_DEVICES",
             "TPU_VISIBLE_CHIPS", "HF_HUB_OFFLINE")
_ISA = ("avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "avx2", "fma", "sve", "neon", "asimd")


@functools.lru_cache(maxsize=1)
def cpu_model() -> dict:
    """The host CPU: {"name", "isa"} (the vector extensions numbers depend on), from /proc/cpuinfo where it exists."""
    name, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key in ("model name", "cpu model", "hardware") and not name:
                    name = value.strip()
                elif key in ("flags", "features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return {"name": name or platform.processor() or platform.machine(), "isa": [f for f in _ISA if f in flags]}


def device_model() -> str:
    """The model of the device jax computes on: the CPU's name and vector extensions, or the accelerator's kind."""
    import jax

    dev = jax.devices()[0]
    if dev.platform == "cpu":
        c = cpu_model()
        return f"cpu: {c['name']} [{' '.join(c['isa'])}]"
    return f"{dev.platform}: {dev.device_kind}"


@functools.lru_cache(maxsize=1)
def git_commit() -> dict:
    """The commit of the jspec checkout this code runs from, and whether its tree had changes; {} outside git."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        run = lambda *a: subprocess.run(["git", *a], cwd=root, capture_output=True, text=True,  # noqa: E731
                                        timeout=10)
        head = run("rev-parse", "HEAD")
        if head.returncode != 0:
            return {}
        dirty = run("status", "--porcelain", "--untracked-files=no", "--", "jspec", "ports")
        return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        return {}


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def switches() -> dict:
    """The environment variables that change what a run measures."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}


def provenance() -> dict:
    """Everything above as one JSON-ready dict (see the module docstring)."""
    import jax

    devs = jax.devices()
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **git_commit(),
            "python": sys.version.split()[0], "versions": {p: v for p in PACKAGES if (v := _version(p))},
            "backend": jax.default_backend(), "device_model": device_model(), "device_count": len(devs),
            "cpu": cpu_model(), "cores": cores, "host": platform.node(), "load_avg": load, "env": switches()}


__all__ = ["cpu_model", "device_model", "git_commit", "provenance", "switches"]
