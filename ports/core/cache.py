"""KV cache: a preallocated pytree with a per-row committed length.

Layout per layer: keys and values `[B * kv_heads, S_max, head_dim]`, row b * kv_heads + h holding kv head h of batch
row b. The rows are flat so that attention's batched matmuls read the buffer in its stored shape: with a
[B, kv_heads, ...] buffer XLA reshapes it for each dot, and on CPU that made it copy every layer's cache several
times per decode step (the in-place update and the reshaped read cannot share a buffer).
`length[b]` counts the committed tokens of row b; slots at and after it hold scratch (drafted, unverified or padding) entries that attention never sees
unless the current forward wrote them. A token's RoPE position is its slot + `pos_offset[b]` (0 unless the
prompt's positions were compressed, as Qwen2-VL's M-RoPE does for images). Slots before `start[b]` are never visible (0 for an ordinary cache; a row
whose prompt was placed right-aligned, as the guided streams of `jspec.core.guidance` are, starts later). Writes are functional (`dynamic_update_slice` per row); rolling back is
moving `length`; committing a tree path is one gather (`commit_path`).

A hybrid model (Qwen3.5: linear-attention layers beside attention ones) also carries `rec`, the committed
recurrent state (`ports.core.recurrent.State`), and after a forward `rec_new`, what each new token would add to it
(`ports.core.recurrent.Pending`). Every operation that advances `length` (`commit`, `commit_path`, `rollback` forward)
advances the state by the same tokens and drops `rec_new`; a recurrent state cannot move back.

This module and `ForwardOut` are the leaf every port and the engine import; it imports neither (only
`ports.core.recurrent`, a leaf too).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from ports.core import recurrent as RC


@struct.dataclass
class KVCache:
    k: list | jax.Array  # per layer [B * KVH, S, Dh], or stacked [L, B * KVH, S, Dh] (a scanned model's)
    v: list | jax.Array
    length: jax.Array  # [B] int32
    start: jax.Array  # [B] int32: first visible slot
    pos_offset: jax.Array  # [B] int32: the RoPE position of the token at slot j is j + pos_offset[b]
    rec: RC.State | None = None  # a hybrid model's committed recurrent state
    rec_new: RC.Pending | None = None  # what the last forward's new tokens would add to it (uncommitted)

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]

    @property
    def batch(self) -> int:
        return self.length.shape[0]

    @property
    def kv_heads(self) -> int:
        return self.k[0].shape[0] // self.length.shape[0]

    @property
    def stacked(self) -> bool:
        """Keys and values in one [L, ...] array each (`ports.core.scanned`), not a list per layer."""
        return not isinstance(self.k, (list, tuple))


class ForwardOut(NamedTuple):
    """What every model forward returns (`ports.families.llama.forward` gives the contract)."""

    logits: jax.Array | None  # [B, T or K, V] float32
    hidden: tuple  # requested hidden states, each [B, T, D]
    cache: KVCache
    attn: jax.Array | None = None  # [B, S] attention scores when asked (`attn_query_weights`)
    # with `defer_writes`: the new keys and values per layer, ([B * KVH, T, Dh], ...) each (stacked [L, ...] for a
    # scanned model), not yet in `cache`
    pending: tuple | None = None


def init_cache(num_layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int, dtype,
               stacked: bool = False) -> KVCache:
    """An empty cache: a buffer per layer, or with `stacked` one [num_layers, ...] array for a scanned model."""
    shape = (batch * kv_heads, max_len, head_dim)
    new = (lambda: jnp.zeros((num_layers,) + shape, dtype)) if stacked else (
        lambda: [jnp.zeros(shape, dtype) for _ in range(num_layers)])
    return KVCache(
        k=new(),
        v=new(),
        length=jnp.zeros((batch,), jnp.int32),
        start=jnp.zeros((batch,), jnp.int32),
        pos_offset=jnp.zeros((batch,), jnp.int32),
    )


def write_layer(k_buf, v_buf, k_new, v_new, start):
    """Write one layer's new keys/values [B, KVH, T, Dh] at slots start[b] .. start[b]+T-1."""
    B, H, T, D = k_new.shape
    rows = jnp.repeat(start, H)
    k_new, v_new = k_new.reshape(B * H, T, D), v_new.reshape(B * H, T, D)
    return write_rows_xla(k_buf, k_new, rows), write_rows_xla(v_buf, v_new, rows)


def write_rows_xla(buf: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """buf [N, S, D] with new [N, T, D] written at slot start[n] of each row n (placed as `dynamic_update_slice`
    places it)."""
    return jax.vmap(lambda b, n, s: jax.lax.dynamic_update_slice(b, n, (s, 0)))(buf, new.astype(buf.dtype), start)


def move_rows_xla(buf: jax.Array, src: jax.Array, start: jax.Array) -> jax.Array:
    """buf [N, S, D] with slots src[n] of row n (read before any write) copied to slots start[n].. (a gather, then
    `write_rows_xla`)."""
    return write_rows_xla(buf, jnp.take_along_axis(buf, src[:, :, None], axis=1), start)


def _each_layer(fn, bufs, *per_layer):
    """fn(buffer, *that layer's arrays) over every layer of a cache's keys or values, in its layout."""
    if not isinstance(bufs, (list, tuple)):
        return jax.vmap(fn)(bufs, *per_layer)
    return [fn(b, *xs) for b, *xs in zip(bufs, *per_layer)]


def write_pending(cache: KVCache, ks, vs, offset: int = 0) -> KVCache:
    """The cache with a deferred forward's new keys / values (`ForwardOut.pending`: per layer [B * KVH, T, Dh], or
    stacked [L, B * KVH, T, Dh]) at slots length[b] + offset.. of each row, as the forward would have written them
    (length not advanced)."""
    k, v = write_new_rows(cache.k, cache.v, ks, vs, cache.length + offset)
    return cache.replace(k=k, v=v)


def write_new_rows(k, v, ks, vs, start: jax.Array):
    """Keys and values (per layer [B * KVH, S, Dh] each, or stacked [L, B * KVH, S, Dh]) with new ones
    ([B * KVH, T, Dh] per layer, or stacked [L, B * KVH, T, Dh]) written at slots start[b].. of batch row b."""
    kvh = (k[0] if isinstance(k, (list, tuple)) else k[0]).shape[0] // start.shape[0]
    rows = jnp.repeat(start, kvh)
    write = lambda b, n: write_rows_xla(b, n, rows)  # noqa: E731
    return _each_layer(write, k, ks), _each_layer(write, v, vs)


def positions(cache: KVCache, offsets: jax.Array) -> jax.Array:
    """RoPE positions of new tokens at `offsets` [B, T] past each row's committed length (a tree node's offset is
    its depth). Models whose prompts compress positions (M-RoPE) set `pos_offset` at prefill."""
    return (cache.length + cache.pos_offset)[:, None] + offsets.astype(jnp.int32)


def _advance_rec(cache: KVCache, src: jax.Array | None, n: jax.Array) -> KVCache:
    """A hybrid cache's recurrent state advanced by the new tokens at scratch offsets src[b, :n[b]] (None: the
    first n[b], in order), `rec_new` dropped; any other cache as it is."""
    if cache.rec_new is None:
        return cache
    if src is None:
        src = jnp.broadcast_to(jnp.arange(cache.rec_new.width, dtype=jnp.int32), (n.shape[0], cache.rec_new.width))
    return cache.replace(rec=RC.advance(cache.rec, cache.rec_new, src, n), rec_new=None)


def commit(cache: KVCache, n: jax.Array) -> KVCache:
    """Advance each row's committed length by n[b] (the entries were written in place by the last forward), and a
    hybrid cache's recurrent state by the same tokens."""
    n = n.astype(jnp.int32)
    return _advance_rec(cache, None, n).replace(length=cache.length + n)


def rollback(cache: KVCache, length: jax.Array) -> KVCache:
    """The cache with each row's committed length set to `length`: a rollback, or (after a prefill's forward) a
    commit of the first length - cache.length new tokens. A hybrid cache's recurrent state only moves forward: it
    takes those tokens from `rec_new`; with nothing pending, its length may not change (not checked on device)."""
    length = length.astype(jnp.int32)
    return _advance_rec(cache, None, jnp.maximum(length - cache.length, 0)).replace(length=length)


def commit_state(cache: KVCache, src: jax.Array, n: jax.Array) -> KVCache:
    """A hybrid cache's recurrent state advanced along the path src[b, :n[b]] (as `commit_path` would), `rec_new`
    dropped and the KV entries and `length` untouched; any other cache as it is. For a caller that commits the KV
    entries in branches (which must not change the cache's structure)."""
    return _advance_rec(cache, src, n.astype(jnp.int32))


def pad_pending(cache: KVCache, width: int) -> KVCache:
    """A hybrid cache's `rec_new` padded to `width` new tokens (so that forwards of different widths return caches
    of one structure); any other cache as it is."""
    return cache if cache.rec_new is None else cache.replace(rec_new=RC.pad_pending(cache.rec_new, width))


def commit_path(cache: KVCache, src: jax.Array, n: jax.Array) -> KVCache:
    """Move scratch entries into the committed prefix and advance it.

    src [B, P] holds, per row, the scratch offsets (relative to `length`) of the entries to keep, in order;
    entry src[b, i] moves to slot length[b] + i for i < n[b] (later ones are copied too but stay uncommitted).
    One gather and one write per layer; no per-node loop.
    """
    start = cache.length
    H = cache.kv_heads
    idx = jnp.repeat((start[:, None] + src).astype(jnp.int32), H, axis=0)  # [B * H, P]
    rows = jnp.repeat(start, H)
    length = start + n.astype(jnp.int32)
    move = lambda b: move_rows_xla(b, idx, rows)  # noqa: E731
    cache = _advance_rec(cache, src, n.astype(jnp.int32))
    return cache.replace(k=_each_layer(move, cache.k), v=_each_layer(move, cache.v), length=length)


def visibility(length: jax.Array, max_len: int, num_new: int, new_mask: jax.Array | None = None,
               offset: int = 0, start: jax.Array | None = None) -> jax.Array:
    """Which cache slots each new token attends to: bool [B, T, S].

    The T new tokens sit at slots length[b] + offset + t. Slot j is visible to new token t of row b if it is
    committed (start[b] <= j < length[b]), or if it is a scratch slot j = length[b] + s with s < offset + T and
    new_mask[b, t, s] (default: causal over the new tokens, no earlier scratch), and j >= start[b].
    new_mask is [B, T, S] with S >= offset + T (entries past offset + T are False); `offset` may be traced.
    """
    W = offset + num_new if new_mask is None else new_mask.shape[-1]
    j = jnp.arange(max_len)[None, None, :]
    rel = j - length[:, None, None]  # [B, 1, S]
    committed = rel < 0
    in_scratch = (rel >= 0) & (rel < W)
    if new_mask is None:
        t = jnp.arange(num_new)[None, :, None]
        vis = (rel >= offset) & (rel <= offset + t)
    else:
        relc = jnp.broadcast_to(jnp.clip(rel, 0, W - 1), (length.shape[0], num_new, max_len))
        vis = jnp.take_along_axis(jnp.broadcast_to(new_mask.astype(bool), (length.shape[0], num_new, W)), relc, axis=2)
    out = committed | (in_scratch & vis)
    return out if start is None else out & (j >= start[:, None, None])


def committed_visibility(cache: KVCache, num_new: int) -> jax.Array:
    """bool [B, T, S]: the committed slots (start[b] <= j < length[b]), which every new token sees."""
    j = jnp.arange(cache.max_len)[None, None, :]
    vis = (j >= cache.start[:, None, None]) & (j < cache.length[:, None, None])
    return jnp.broadcast_to(vis, (cache.batch, num_new, cache.max_len))


def cache_visibility(cache: KVCache, num_new: int, new_mask: jax.Array | None = None, offset: int = 0) -> jax.Array:
    """`visibility` of T new tokens written at cache.length + offset.. against this cache (its start included)."""
    return visibility(cache.length, cache.max_len, num_new, new_mask, offset, cache.start)
