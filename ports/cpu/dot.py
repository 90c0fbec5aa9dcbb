"""Float32 weight products of a few rows on XLA:CPU, through `csrc/small_m_dot.cc` called by XLA's FFI.

XLA:CPU multiplies 2-16 activation rows by a weight matrix at about twice the cost of one row, where a
memory-bound product should cost about what streaming the weights once does. The kernel streams them once for up to
`MAX_ROWS` rows, on the threads of XLA's intra-op pool. Each output is accumulated in an order that depends only on
the contracted length, so a row's result is the same whatever rows share its call (XLA's own products differ in the
last bits between one row and several). `packed_dot` does the same for any number of rows over a weight stored as
column panels (`pack`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ports.cpu.library import enabled

MAX_ROWS = 16  # rows up to which the kernel beats XLA:CPU's dot (measured on SmolLM2's matrices)
TARGET = "jspec_small_m_dot"
PACKED_TARGET = "jspec_packed_dot"
PANEL = 32  # columns per panel of a packed weight (`csrc/small_m_dot.cc`'s kPanel)


def _call(x: jax.Array, w: jax.Array, nk: bool) -> jax.Array:
    n = w.shape[0] if nk else w.shape[1]
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(x, w, nk=nk)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def dot(x: jax.Array, w: jax.Array, nk: bool = False) -> jax.Array:
    """x [M, K] . w for float32 x and w, M <= MAX_ROWS: w [K, N] (nk False) or w [N, K] (nk True) -> [M, N].
    Differentiable (the tangents are XLA dots); call only when `enabled()`."""
    if x.ndim != 2 or w.ndim != 2 or x.dtype != jnp.float32 or w.dtype != jnp.float32:
        raise ValueError(f"ports.cpu.dot.dot takes 2-D float32 operands, got {x.shape} {x.dtype} and {w.shape} {w.dtype}")
    if x.shape[1] != w.shape[1 if nk else 0]:
        raise ValueError(f"ports.cpu.dot.dot: x {x.shape} and w {w.shape} ({'[N, K]' if nk else '[K, N]'}) do not contract")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"ports.cpu.dot.dot takes at most {MAX_ROWS} rows, got {x.shape[0]}")
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
