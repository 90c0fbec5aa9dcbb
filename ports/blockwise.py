"""Memory-efficient attention for long query blocks (prefills): a blockwise pass with an online softmax that never
holds more than one [q_block, k_block] tile of scores per (row, head), in plain JAX (CPU, GPU, TPU).

The mask is described by its structure, not a [B, T, S] boolean: query t of row b sees key j when j <= t (causal)
and j >= start[b] (a right-aligned row's padding is never seen). This is the fresh prefill's visibility
(`jspec.cache.visibility` with an empty cache and no tree mask).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

NEG = jnp.finfo(jnp.float32).min


def _blocks(x: jax.Array, n: int, size: int) -> jax.Array:
    """[B, T, ...] padded to n * size along T and split into [n, B, size, ...]."""
    B, T = x.shape[:2]
    x = jnp.pad(x, ((0, 0), (0, n * size - T)) + ((0, 0),) * (x.ndim - 2))
    return jnp.moveaxis(x.reshape((B, n, size) + x.shape[2:]), 1, 0)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, start: jax.Array, score_weights: jax.Array | None = None,
                     q_block: int = 512, k_block: int = 512):
    """Grouped-query causal attention of q [B, T, H, Dh] over the same positions' keys / values k, v [B, T, KVH, Dh]
    (row b's keys before start[b] hidden). Returns [B, T, H, Dh] in q's dtype, equal to `ports.layers.attention`
    on the visible queries (a query that sees no key, i.e. one before its row's start, gets a meaningless output in
    both). Scores and softmax run in float32.

    With `score_weights` [B, T] it returns (out, scores [B, T]): the attention probabilities averaged over heads and
    summed over queries with those weights, with the full softmax denominators (a second pass over the query
    blocks that carry weight, reading each query's log-sum-exp from the first).
    """
    B, T, H, Dh = q.shape
    KVH = k.shape[2]
    G = H // KVH
    qb, kb = min(q_block, T), min(k_block, T)
    nq, nk = -(-T // qb), -(-T // kb)
    scale = Dh ** -0.5
    Q = _blocks(q.reshape(B, T, KVH, G, Dh), nq, qb)  # [nq, B, qb, KVH, G, Dh]
    K, Vv = _blocks(k, nk, kb), _blocks(v, nk, kb)  # [nk, B, kb, KVH, Dh]
    start = start.astype(jnp.int32)

    def tile(i, j):
        """Scores [B, KVH, G, qb, kb] (float32) of query block i against key block j, masked."""
        s = jnp.einsum("bqkgd,bskd->bkgqs", Q[i], K[j], preferred_element_type=jnp.float32) * scale
        qp = i * qb + jnp.arange(qb)
        kp = j * kb + jnp.arange(kb)
        vis = (kp[None, :] <= qp[:, None])[None] & (kp[None, None, :] >= start[:, None, None]) & (kp < T)
        return jnp.where(vis[:, None, None], s, NEG)

    def last_block(i):
        return jnp.minimum((i * qb + qb - 1) // kb, nk - 1)

    def forward(i):
        def body(j, carry):
            m, l, acc = carry
            s = tile(i, j)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            corr = jnp.exp(m - m_new)
            pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(Vv.dtype), Vv[j], preferred_element_type=jnp.float32)
            return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv

        m0 = jnp.full((B, KVH, G, qb), NEG, jnp.float32)
        m, l, acc = jax.lax.fori_loop(0, last_block(i) + 1, body,
                                      (m0, jnp.zeros_like(m0), jnp.zeros((B, KVH, G, qb, Dh), jnp.float32)))
        return acc / l[..., None], m + jnp.log(l)

    out, lse = jax.lax.map(forward, jnp.arange(nq))  # [nq, B, KVH, G, qb, Dh], [nq, B, KVH, G, qb]
    res = jnp.moveaxis(out, 0, 3).reshape(B, KVH, G, nq * qb, Dh)[:, :, :, :T]
    res = res.transpose(0, 3, 1, 2, 4).reshape(B, T, H, Dh).astype(q.dtype)
    if score_weights is None:
        return res
    W = _blocks(score_weights.astype(jnp.float32), nq, qb)  # [nq, B, qb]

    def scores(acc, i):
        def run(acc):
            def body(j, acc):
                p = jnp.exp(tile(i, j) - lse[i][..., None])  # full-softmax probabilities
                part = jnp.einsum("bkgqs,bq->bs", p, W[i]) / H
                return jax.lax.dynamic_update_slice(acc, jax.lax.dynamic_slice(acc, (0, j * kb), (B, kb)) + part,
                                                    (0, j * kb))
            return jax.lax.fori_loop(0, last_block(i) + 1, body, acc)

        return jax.lax.cond(jnp.any(W[i] != 0), run, lambda a: a, acc), None

    acc, _ = jax.lax.scan(scores, jnp.zeros((B, nk * kb), jnp.float32), jnp.arange(nq))
    return res, acc[:, :T]
