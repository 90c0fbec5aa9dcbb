"""KV-cache row writes on XLA:CPU in place, many buffers per call, through `csrc/cache_rows.cc`.

XLA lowers a per-row `dynamic_update_slice` of a cache buffer to a scatter kernel plus an index fusion, one pair per
buffer, each compiled on its own (the layers' kernels are identical but not shared), and a path commit to a gather
and a scatter per buffer. These calls write every buffer they are given in one custom call whose results alias the
buffers: no kernel to compile, and only the written slots are touched. The values written are those of the XLA
ops (`ports.cache` keeps those for other backends and with the kernels switched off).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

WRITE_TARGET, MOVE_TARGET = "jspec_write_rows", "jspec_move_rows"


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
    from ports.cache import write_rows_xla
    return write_rows(bufs, news, start), tuple(write_rows_xla(b, n, start) for b, n in zip(dbufs, dnews))


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
    from ports.cache import move_rows_xla
    return move_rows(bufs, src, start), tuple(move_rows_xla(b, src, start) for b in dbufs)


__all__ = ["move_rows", "write_rows"]
