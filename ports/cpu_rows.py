"""KV-cache row writes on XLA:CPU in place, many buffers per call, through `csrc/cache_rows.cc`.

XLA lowers a per-row `dynamic_update_slice` of a cache buffer to a scatter kernel plus an index fusion, one pair per
buffer, each compiled on its own (the layers' kernels are identical but not shared), and a path commit to a gather
and a scatter per buffer. These calls write every buffer they are given in one custom call whose results alias the
buffers: no kernel to compile, and only the written slots are touched. The values written are those of the XLA
ops (`ports.cache` keeps those for other backends and `JSPEC_CPU_ROWS=0`).
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from ports import cpu_dot as CD

WRITE_TARGET, MOVE_TARGET = CD.ROW_TARGETS
SWITCH = "JSPEC_CPU_ROWS"  # "0": cache writes stay with XLA's scatters


def enabled() -> bool:
    """Whether cache writes traced now go to the kernel (XLA:CPU with the kernel library built, JSPEC_CPU_ROWS not
    "0")."""
    return os.environ.get(SWITCH, "1") != "0" and CD.enabled()


def write_reference(buf: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """What `write_rows` does to one buffer, in XLA ops: buf [N, S, D] <- new [N, T, D] at slot start[n] of row n."""
    return jax.vmap(lambda b, n, s: jax.lax.dynamic_update_slice(b, n, (s, 0)))(buf, new.astype(buf.dtype), start)


def move_reference(buf: jax.Array, src: jax.Array, start: jax.Array) -> jax.Array:
    """What `move_rows` does to one buffer, in XLA ops (a gather, then `write_reference`)."""
    return write_reference(buf, jnp.take_along_axis(buf, src[:, :, None], axis=1), start)


def _check(bufs, what: str) -> None:
    for b in bufs:
        if b.ndim != 3:
            raise ValueError(f"{what} takes cache buffers [N, S, D], got shape {b.shape}")


@jax.custom_jvp
def write_rows(bufs: tuple, news: tuple, start: jax.Array) -> tuple:
    """bufs[i] [N, S, D] with news[i] [N, T_i, D] written at slots start[n] .. start[n] + T_i - 1 of each row n
    (a start below 0 counts from the end; then clamped to [0, S - T_i], as `dynamic_update_slice` places it).
    Returns the new buffers, in place."""
    _check(bufs, "write_rows")
    if len(bufs) != len(news):
        raise ValueError(f"write_rows: {len(bufs)} buffers but {len(news)} updates")
    args = [start.astype(jnp.int32)]
    for b, n in zip(bufs, news):
        if n.ndim != 3 or n.shape[0] != b.shape[0] or n.shape[2] != b.shape[2] or n.shape[1] > b.shape[1]:
            raise ValueError(f"write_rows: rows {n.shape} do not fit buffer {b.shape}")
        args += [b, n.astype(b.dtype)]
    outs = [jax.ShapeDtypeStruct(b.shape, b.dtype) for b in bufs]
    aliases = {1 + 2 * i: i for i in range(len(bufs))}
    return tuple(jax.ffi.ffi_call(WRITE_TARGET, outs, input_output_aliases=aliases, vmap_method="sequential")(*args))


@write_rows.defjvp
def _write_rows_jvp(primals, tangents):
    bufs, news, start = primals
    dbufs, dnews, _ = tangents
    return write_rows(bufs, news, start), tuple(write_reference(b, n, start) for b, n in zip(dbufs, dnews))


@jax.custom_jvp
def move_rows(bufs: tuple, src: jax.Array, start: jax.Array) -> tuple:
    """In each buffer [N, S, D]: slots src[n, 0..P-1] of row n (read before any write; a slot outside [0, S) is
    clamped into it) copied to slots start[n] .. start[n] + P - 1 (start placed as in `write_rows`). In place."""
    _check(bufs, "move_rows")
    if src.ndim != 2 or any(b.shape[0] != src.shape[0] for b in bufs):
        raise ValueError(f"move_rows: source slots {src.shape} do not match buffers of {bufs[0].shape[0]} rows")
    outs = [jax.ShapeDtypeStruct(b.shape, b.dtype) for b in bufs]
    aliases = {2 + i: i for i in range(len(bufs))}
    call = jax.ffi.ffi_call(MOVE_TARGET, outs, input_output_aliases=aliases, vmap_method="sequential")
    return tuple(call(src.astype(jnp.int32), start.astype(jnp.int32), *bufs))


@move_rows.defjvp
def _move_rows_jvp(primals, tangents):
    bufs, src, start = primals
    dbufs, _, _ = tangents
    return move_rows(bufs, src, start), tuple(move_reference(b, src, start) for b in dbufs)


__all__ = ["enabled", "move_reference", "move_rows", "write_reference", "write_rows"]
