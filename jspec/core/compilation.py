"""How jspec's programs are compiled: XLA options per backend and kind of program (`jit`), and the persistent
compilation cache (`enable_cache`)."""
from __future__ import annotations

import functools
import logging
import os
import threading
import time

import jax

log = logging.getLogger(__name__)

# XLA options by backend for programs whose matmuls take thousands of rows (prefills; `jit(options=PREFILL)`).
# On CPU their dots go to YNNPACK one at a time: by default XLA:CPU also fuses a dot's producers into it, including
# a row reduction such as RMSNorm's, which made a normed [4096, 768] x [768, 4096] matmul 1.7x slower than the
# matmul alone and a chunked 8k-token prefill ~20% slower. Decode steps (a few rows) are ~3% faster fused, so
# they keep XLA's defaults (docs/performance-notes.md). Edit before the first call.
PREFILL: dict[str, dict[str, str]] = {
    "cpu": {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"},
}

CACHE_ENV = "JSPEC_COMPILE_CACHE"


class BackendJit:
    """`jax.jit(fun, **kwargs)` compiled with `options[backend]` for the default backend when called (so importing
    jspec does not initialise a backend). Other attributes (`lower`, `_cache_size`, ...) are the jitted
    function's."""

    def __init__(self, fun, options: dict[str, dict], kwargs: dict):
        functools.update_wrapper(self, fun)
        self._fun, self._options, self._kwargs, self._by_backend = fun, options, kwargs, {}

    def jitted(self):
        backend = jax.default_backend()
        f = self._by_backend.get(backend)
        if f is None:  # setdefault: threads compiling at once (the demo) share one jitted function
            opts = self._options.get(backend) or None
            f = self._by_backend.setdefault(backend, jax.jit(self._fun, compiler_options=opts, **self._kwargs))
        return f

    def __call__(self, *args, **kwargs):
        return self.jitted()(*args, **kwargs)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.jitted(), name)


def jit(fun=None, /, *, options: dict[str, dict], **kwargs):
    """`jax.jit` with XLA options per backend (e.g. `PREFILL`): `@jit(options=PREFILL, static_argnames=...)`."""
    if fun is None:
        return lambda f: BackendJit(f, options, kwargs)
    return BackendJit(fun, options, kwargs)


class Ahead:
    """`fn` compiled for `args` (which may hold `jax.ShapeDtypeStruct`s) on a background thread, so that a later
    `fn(...)` on arrays of those shapes finds its program compiled: JAX keeps the executable of a lowering for its
    calls. It is lowered on the caller's thread (tracing and lowering are Python: two threads would only take turns
    with the GIL) and compiled on the background one (XLA releases the GIL), while the caller goes on (compiles or
    runs the prefill). `wait()` joins. A failure is kept in `error` and not raised: the real call compiles again
    and raises it where it belongs."""

    def __init__(self, fn, args: tuple):
        self.error: BaseException | None = None
        self.compile_s: float | None = None
        self._thread = None
        try:
            lowered = fn.lower(*args)
        except Exception as e:  # noqa: BLE001 (reported by the real call)
            self.error = e
            return
        self._thread = threading.Thread(target=self._compile, args=(lowered,), name="jspec-compile-ahead",
                                        daemon=True)
        self._thread.start()

    def _compile(self, lowered):
        t0 = time.perf_counter()
        try:
            lowered.compile()
        except Exception as e:  # noqa: BLE001
            self.error = e
            return
        self.compile_s = time.perf_counter() - t0
        log.info("compiled the decode loop in %.2f s (beside the prefill)", self.compile_s)

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()


def enable_cache(path: str | None = None, min_compile_s: float = 0.5) -> str | None:
    """Keep every program that took at least `min_compile_s` to compile under `path` (default: $JSPEC_COMPILE_CACHE,
    else ~/.cache/jspec/xla; "off": no cache), so that a later process with the same model, shapes and jax version
    loads it instead of compiling (JAX's persistent compilation cache; CPU, GPU and TPU). Returns the directory."""
    path = path or os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "jspec", "xla")
    if path == "off":
        return None
    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_s))
    return path
