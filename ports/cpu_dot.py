"""Float32 weight products of a few rows on XLA:CPU, through a small C++ kernel called by XLA's FFI.

XLA:CPU multiplies 2-16 activation rows by a weight matrix at about twice the cost of one row, where a
memory-bound product should cost about what streaming the weights once does. `csrc/small_m_dot.cc` streams them
once for up to `MAX_ROWS` rows, on the threads of XLA's intra-op pool. Each output is accumulated in an order that
depends only on the contracted length, so a row's result is the same whatever rows share its call (XLA's own
products differ in the last bits between one row and several).

The kernel is compiled on first use with the system C++ compiler for this CPU (`-march=native`, about 3 s) into
`$JSPEC_KERNELS_DIR`, else `~/.cache/jspec/kernels`, keyed by the source, the flags, jaxlib and the CPU. Without a
compiler, or with `JSPEC_CPU_DOT=0`, `available()` is False and callers keep XLA's dot.
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
import jax.numpy as jnp
import numpy as np

MAX_ROWS = 16  # rows up to which the kernel beats XLA:CPU's dot (measured on SmolLM2's matrices)
TARGET = "jspec_small_m_dot"
PACKED_TARGET = "jspec_packed_dot"
PANEL = 32  # columns per panel of a packed weight (`csrc/small_m_dot.cc`'s kPanel)
SOURCES = tuple(os.path.join(os.path.dirname(__file__), "csrc", f) for f in ("small_m_dot.cc", "cache_attention.cc",
                                                                        "cache_rows.cc"))
ATTENTION_TARGETS = ("jspec_cache_attention", "jspec_cache_attention2")  # one segment; two, one softmax
LONG_ATTENTION_TARGET = "jspec_long_attention"  # more query rows than ATTENTION_MAX_ROWS, one segment
ROW_TARGETS = ("jspec_write_rows", "jspec_move_rows")  # in-place cache row writes (`ports.cpu_rows`)
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")
ENV_SWITCH = "JSPEC_CPU_DOT"
DIR_ENV = "JSPEC_KERNELS_DIR"


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def library_path() -> str:
    """Where the compiled kernel for this source, compiler flags, jaxlib and CPU lives."""
    h = hashlib.sha256()
    for source in SOURCES:
        with open(source, "rb") as f:
            h.update(f.read())
    h.update(" ".join(FLAGS).encode())
    h.update(jax.__version__.encode())
    h.update(_cpu_signature().encode())
    root = os.path.expanduser(os.environ.get(DIR_ENV) or os.path.join("~", ".cache", "jspec", "kernels"))
    return os.path.join(root, f"small_m_dot-{h.hexdigest()[:16]}.so")


def build(path: str) -> str:
    """Compile the kernel to `path` (once: concurrent callers wait on a lock file beside it)."""
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
        cmd = [cxx, *FLAGS, "-I", jax.ffi.include_dir(), *SOURCES, "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            os.unlink(tmp)
            raise RuntimeError(f"compiling {' '.join(SOURCES)} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, path)
    return path


@functools.cache
def _load() -> bool:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return False
    try:
        lib = ctypes.cdll.LoadLibrary(build(library_path()))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JspecSmallMDot), platform="cpu")
        jax.ffi.register_ffi_target(PACKED_TARGET, jax.ffi.pycapsule(lib.JspecPackedDot), platform="cpu")
        for target, fn in zip(ATTENTION_TARGETS + (LONG_ATTENTION_TARGET,),
                              (lib.JspecCacheAttention, lib.JspecCacheAttention2, lib.JspecLongAttention)):
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(fn), platform="cpu")
        for target, fn in zip(ROW_TARGETS, (lib.JspecWriteRows, lib.JspecMoveRows)):
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(fn), platform="cpu")
    except (OSError, RuntimeError) as e:
        warnings.warn(f"jspec's CPU kernels (products, attention, cache writes) are unavailable, XLA's ops are used "
                      f"instead: {e}", stacklevel=3)
        return False
    return True


def available() -> bool:
    """Whether the kernel is compiled and registered (False with JSPEC_CPU_DOT=0 or without a compiler)."""
    return _load()


def enabled() -> bool:
    """Whether products traced now go to the kernel: the default backend is the CPU and the kernel is available."""
    return jax.default_backend() == "cpu" and available()


def _call(x: jax.Array, w: jax.Array, nk: bool) -> jax.Array:
    n = w.shape[0] if nk else w.shape[1]
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(x, w, nk=nk)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def dot(x: jax.Array, w: jax.Array, nk: bool = False) -> jax.Array:
    """x [M, K] . w for float32 x and w, M <= MAX_ROWS: w [K, N] (nk False) or w [N, K] (nk True) -> [M, N].
    Differentiable (the tangents are XLA dots); call only when `enabled()`."""
    if x.ndim != 2 or w.ndim != 2 or x.dtype != jnp.float32 or w.dtype != jnp.float32:
        raise ValueError(f"cpu_dot.dot takes 2-D float32 operands, got {x.shape} {x.dtype} and {w.shape} {w.dtype}")
    if x.shape[1] != w.shape[1 if nk else 0]:
        raise ValueError(f"cpu_dot.dot: x {x.shape} and w {w.shape} ({'[N, K]' if nk else '[K, N]'}) do not contract")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"cpu_dot.dot takes at most {MAX_ROWS} rows, got {x.shape[0]}")
    return _call(x, w, nk)


@dot.defjvp
def _dot_jvp(nk, primals, tangents):
    x, w = primals
    dx, dw = tangents
    spec = "mk,nk->mn" if nk else "mk,kn->mn"
    return dot(x, w, nk), jnp.einsum(spec, dx, w) + jnp.einsum(spec, x, dw)


def pack(w) -> jax.Array:
    """A [K, N] weight as column panels [ceil(N / PANEL), K, PANEL] (the last one zero-padded): the layout
    `packed_dot` streams. numpy or jax in, the same kind out."""
    xp = np if isinstance(w, np.ndarray) else jnp
    if w.ndim != 2:
        raise ValueError(f"pack takes a 2-D [K, N] weight, got shape {w.shape}")
    k, n = w.shape
    panels = -(-n // PANEL)
    if panels * PANEL != n:
        w = xp.concatenate([w, xp.zeros((k, panels * PANEL - n), w.dtype)], axis=1)
    return w.reshape(k, panels, PANEL).transpose(1, 0, 2)


def unpack(wp, n: int) -> jax.Array:
    """Inverse of `pack`: the [K, N] weight of panels [P, K, PANEL]."""
    p, k, _ = wp.shape
    return wp.transpose(1, 0, 2).reshape(k, p * PANEL)[:, :n]


def _packed_call(x: jax.Array, wp: jax.Array, n: int) -> jax.Array:
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    return jax.ffi.ffi_call(PACKED_TARGET, out, vmap_method="sequential")(x, wp)


def _packed_einsum(x: jax.Array, wp: jax.Array, n: int) -> jax.Array:
    y = jnp.einsum("mk,pkj->mpj", x, wp, preferred_element_type=jnp.float32)
    return y.reshape(x.shape[0], -1)[:, :n]


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def packed_dot(x: jax.Array, wp: jax.Array, n: int) -> jax.Array:
    """x [M, K] . W for a weight packed by `pack` (wp [P, K, PANEL], N = n columns) -> [M, N] float32, any M.
    Through the kernel for float32 operands on the CPU when it is available, else an einsum over the panels.
    Each output sums over k in increasing order whatever M is, so a row's result does not depend on the rows beside
    it. Differentiable (the tangents are einsums)."""
    if x.ndim != 2 or wp.ndim != 3 or wp.shape[2] != PANEL:
        raise ValueError(f"packed_dot takes x [M, K] and panels [P, K, {PANEL}], got {x.shape} and {wp.shape}")
    if x.shape[1] != wp.shape[1]:
        raise ValueError(f"packed_dot: x {x.shape} and panels {wp.shape} do not contract")
    if not (wp.shape[0] - 1) * PANEL < n <= wp.shape[0] * PANEL:
        raise ValueError(f"packed_dot: {wp.shape[0]} panels cannot hold {n} columns")
    if x.dtype == wp.dtype == jnp.float32 and enabled() and x.shape[0] > 0:
        return _packed_call(x, wp, n)
    return _packed_einsum(x, wp, n)


@packed_dot.defjvp
def _packed_dot_jvp(n, primals, tangents):
    x, wp = primals
    dx, dwp = tangents
    return packed_dot(x, wp, n), _packed_einsum(dx, wp, n) + _packed_einsum(x, dwp, n)


ATTENTION_MAX_ROWS = 64  # query rows per cache row (query heads per KV head x new tokens) the kernel takes
ATTENTION_SWITCH = "JSPEC_CPU_ATTENTION"  # "0": attention stays with XLA's einsums


def _rows(q: jax.Array, n: int) -> int:
    """Query rows per cache row of q [N, Q, D] (grouped) or [B, T, H, D] (the model's layout) over N cache rows."""
    if q.ndim == 3:
        return q.shape[1]
    B, T, H, _ = q.shape
    return H // (n // B) * T


def attention(q: jax.Array, segments, scale: float) -> jax.Array:
    """Softmax attention of queries over one or two segments (k [N, S, D], v [N, S, D], visible bool [B, T, S]),
    one softmax over all visible slots, through the kernel: float32, D a multiple of 16 (<= 256). q is grouped,
    [N, Q, D] (row r: query group r // T at position r % T), or in the model's layout [B, T, H, D] (query head h
    reads cache row b * KVH + h // (H / KVH)), which spares the grouping transposes; the result has q's layout.
    Up to ATTENTION_MAX_ROWS rows per cache row run the decode kernel (the slots split among the threads); more,
    over one segment (a prefill), the long-query kernel, which skips the slots no row of a block sees and sums in
    another order. A row sees nothing -> zeros. Each row is computed alone, so a row's result does not depend on
    the rows beside it. Differentiable (the tangents are those of `attention_reference`). Call only when
    `enabled()`."""
    if not 1 <= len(segments) <= 2:
        raise ValueError(f"attention takes one or two segments, got {len(segments)}")
    ks, vs, viss = zip(*segments)
    if _rows(q, ks[0].shape[0]) > ATTENTION_MAX_ROWS and len(segments) != 1:
        raise ValueError(f"attention over two segments takes at most {ATTENTION_MAX_ROWS} query rows per cache row")
    return _attention(q, tuple(ks), tuple(vs), tuple(v.astype(bool) for v in viss), float(scale))


def _group(q: jax.Array, kv_heads: int) -> jax.Array:
    B, T, H, D = q.shape
    return q.reshape(B, T, kv_heads, H // kv_heads, D).transpose(0, 2, 3, 1, 4).reshape(B * kv_heads, -1, D)


def _ungroup(out: jax.Array, shape) -> jax.Array:
    B, T, H, D = shape
    kvh = out.shape[0] // B
    return out.reshape(B, kvh, H // kvh, T, D).transpose(0, 3, 1, 2, 4).reshape(shape)


def attention_reference(qg, ks, vs, viss, scale: float) -> jax.Array:
    """What `attention` computes, as XLA einsums (its tangents are `attention`'s)."""
    n, q, _ = qg.shape
    b, t, _ = viss[0].shape
    groups = q // t

    def rows_mask(vis):  # [B, T, S] -> [N, Q, S]: cache row n reads batch row n // (N / B); query row r position r % T
        return jnp.tile(jnp.repeat(vis, n // b, axis=0), (1, groups, 1))

    scores = jnp.concatenate([jnp.einsum("nqd,nsd->nqs", qg, k) * scale for k in ks], axis=-1)
    mask = jnp.concatenate([rows_mask(v) for v in viss], axis=-1)
    probs = jax.nn.softmax(jnp.where(mask, scores, jnp.finfo(jnp.float32).min), axis=-1)
    out = jnp.einsum("nqs,nsd->nqd", probs, jnp.concatenate(vs, axis=1))
    return jnp.where(jnp.any(mask, axis=-1, keepdims=True), out, 0.0)


@functools.partial(jax.custom_jvp, nondiff_argnums=(4,))
def _attention(q, ks, vs, viss, scale):
    args = [q]
    for k, v, vis in zip(ks, vs, viss):
        args += [k, v, vis]
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    long = _rows(q, ks[0].shape[0]) > ATTENTION_MAX_ROWS
    target = LONG_ATTENTION_TARGET if long else ATTENTION_TARGETS[len(ks) - 1]
    return jax.ffi.ffi_call(target, out, vmap_method="sequential")(*args, scale=np.float32(scale))


@_attention.defjvp
def _attention_jvp(scale, primals, tangents):
    q, ks, vs, viss = primals
    dq, dks, dvs, _ = tangents

    def ref(q, k, v):
        if q.ndim == 3:
            return attention_reference(q, k, v, viss, scale)
        return _ungroup(attention_reference(_group(q, k[0].shape[0] // q.shape[0]), k, v, viss, scale), q.shape)

    _, dout = jax.jvp(ref, (q, ks, vs), (dq, dks, dvs))
    return _attention(q, ks, vs, viss, scale), dout


def attention_applies(q: jax.Array, *arrays) -> bool:
    """Whether `attention` takes these operands here: q as `attention` takes it, then k, v and (a second segment)
    the new k, v; the kernel is enabled, float32, the head width limits, and at most ATTENTION_MAX_ROWS rows per
    cache row over two segments."""
    d = q.shape[-1]
    if os.environ.get(ATTENTION_SWITCH, "1") == "0":
        return False
    return (all(a.dtype == jnp.float32 for a in (q, *arrays)) and d % 16 == 0 and d <= 256
            and (_rows(q, arrays[0].shape[0]) <= ATTENTION_MAX_ROWS or len(arrays) <= 2) and enabled())
