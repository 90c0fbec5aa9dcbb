"""Float32 attention of query rows over a KV cache on XLA:CPU, through `csrc/cache_attention.cc` called by XLA's FFI:
decode steps and verifies (one or two segments: the cache and a deferred forward's new keys / values, one softmax)
and long query blocks (prefills). Each row is computed alone, so a row's result does not depend on the rows beside
it; a row that sees nothing gives zeros (as `ports.layers.attention` does on XLA).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ports.cpu.library import enabled

ATTENTION_TARGETS = ("jspec_cache_attention", "jspec_cache_attention2")  # one segment; two, one softmax
LONG_ATTENTION_TARGET = "jspec_long_attention"  # more query rows than ATTENTION_MAX_ROWS, one segment
ATTENTION_MAX_ROWS = 64  # query rows per cache row (query heads per KV head x new tokens) the kernel takes


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
    return (all(a.dtype == jnp.float32 for a in (q, *arrays)) and d % 16 == 0 and d <= 256
            and (_rows(q, arrays[0].shape[0]) <= ATTENTION_MAX_ROWS or len(arrays) <= 2) and enabled())
