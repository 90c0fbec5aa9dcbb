"""Memory-efficient attention for long query blocks (prefills): a blockwise pass with an online softmax that never
holds more than one [q_block, k_block] tile of scores per (row, head), in plain JAX (CPU, GPU, TPU).

The mask is described by its structure, not a [B, T, S] boolean: query t of row b sees key j when j <= t (causal)
and j >= start[b] (a right-aligned row's padding is never seen), and with a sliding `window` (Mistral) only when
j > t - window. This is the fresh prefill's visibility (`ports.core.cache.visibility` with an empty cache and no tree
mask; `ports.core.layers.windowed` for the window).

On a GPU a fresh prefill in bfloat16 / float16 whose rows all start at slot 0 (the causal mask alone) runs cuDNN's
flash attention (`jax.nn.dot_product_attention`) instead; `FUSED` says when (see `fused_attention`).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

NEG = jnp.finfo(jnp.float32).min
BLOCK = 512  # default query and key block: 512 x 512 tiles were the fastest on CPU (docs/performance-notes.md)
FUSED_MODES = ("auto", "off", "cudnn", "xla")
# "auto": cuDNN on a GPU for bfloat16 / float16; "off": always blockwise; "cudnn" / "xla": that implementation of
# jax.nn.dot_product_attention wherever it traces ("xla" builds [T, T] scores: for tests on small prompts)
FUSED = "auto"


def fused_attention(q: jax.Array, k: jax.Array, v: jax.Array, window: int | None = None):
    """Causal attention of q [B, T, H, Dh] over k, v [B, T, KVH, Dh] (every key from slot 0 visible; with a
    sliding `window` only keys j > t - window, its `local_window_size` (window - 1, 0)) by
    `jax.nn.dot_product_attention` with the implementation `FUSED` picks, or None where none applies: "auto" off a
    GPU or in float32, or an implementation that cannot take these shapes (cuDNN's limits on head size, dtype and
    version are checked as it traces)."""
    mode = FUSED
    if mode not in FUSED_MODES:
        raise ValueError(f"ports.core.blockwise.FUSED must be one of {FUSED_MODES}, got {mode!r}")
    if mode == "auto":
        if jax.default_backend() != "gpu" or q.dtype not in (jnp.bfloat16, jnp.float16):
            return None
        mode = "cudnn"
    if mode == "off":
        return None
    try:
        local = None if window is None else (window - 1, 0)
        return jax.nn.dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype), is_causal=True,
                                            local_window_size=local, implementation=mode)
    except (NotImplementedError, RuntimeError, ValueError, TypeError):
        return None


def _blocks(x: jax.Array, n: int, size: int) -> jax.Array:
    """[B, T, ...] padded to n * size along T and split into [n, B, size, ...]."""
    B, T = x.shape[:2]
    x = jnp.pad(x, ((0, 0), (0, n * size - T)) + ((0, 0),) * (x.ndim - 2))
    return jnp.moveaxis(x.reshape((B, n, size) + x.shape[2:]), 1, 0)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, start: jax.Array, score_weights: jax.Array | None = None,
                     q_block: int = BLOCK, k_block: int = BLOCK, window: int | None = None):
    """Grouped-query causal attention of q [B, T, H, Dh] over the same positions' keys / values k, v [B, T, KVH, Dh]
    (row b's keys before start[b] hidden; with a sliding `window`, query t's keys before t - window + 1 too).
    Returns [B, T, H, Dh] in q's dtype, equal to `ports.core.layers.attention` on the visible queries (a query that sees
    no key, i.e. one before its row's start, gets a meaningless output in both). Scores and softmax run in float32
    (in cuDNN's kernel too, when `fused_attention` applies).

    With `score_weights` [B, T] it returns (out, scores [B, T]): the attention probabilities averaged over heads and
    summed over queries with those weights, with the full softmax denominators (a second pass over the query
    blocks that carry weight, reading each query's log-sum-exp from the first). This is `prefix_attention` with
    nothing cached before the queries.
    """
    B, T, KVH, Dh = k.shape

    def rows(x):  # the flat cache rows [B * KVH, T, Dh]
        return x.transpose(0, 2, 1, 3).reshape(B * KVH, T, Dh)

    def blockwise(q, k, v, start):
        return prefix_attention(q, rows(k), rows(v), start, jnp.zeros((B,), jnp.int32), score_weights, q_block,
                                k_block, window)

    fused = None if score_weights is not None else fused_attention(q, k, v, window)
    if fused is None:
        return blockwise(q, k, v, start)
    # the fused kernels know causality but not a per-row first slot: a row that starts later attends blockwise
    return jax.lax.cond(jnp.all(start == 0), lambda q, k, v, start: fused_attention(q, k, v, window), blockwise, q, k,
                        v, start)


def prefix_attention(q: jax.Array, k_buf: jax.Array, v_buf: jax.Array, start: jax.Array, offset: jax.Array,
                     score_weights: jax.Array | None = None, q_block: int = BLOCK, k_block: int = BLOCK,
                     window: int | None = None):
    """Grouped-query attention of a block of new queries q [B, T, H, Dh] over a cache that already holds their
    keys: the flat cache rows k_buf, v_buf [B * KVH, S, Dh] (`ports.core.cache`), query t of row b at slot
    offset[b] + t, seeing slot j when start[b] <= j <= offset[b] + t (a chunk of a prefill after the earlier
    chunks) and, with a sliding `window`, j > offset[b] + t - window. Never holds more than one [q_block, k_block]
    tile of scores per (row, head); key blocks past a query block's last visible slot (or wholly before its window)
    are not read. Returns [B, T, H, Dh] in q's dtype, equal to `ports.core.layers.attention`
    under `ports.core.cache.visibility` of a cache of lengths `offset` and T causal new tokens; with `score_weights`
    [B, T] also the scores [B, S] of that function (full softmax denominators, from each query's log-sum-exp)."""
    B, T, H, Dh = q.shape
    N, S, _ = k_buf.shape
    KVH = N // B
    G = H // KVH
    qb, kb = min(q_block, T), min(k_block, S)
    nq, nk = -(-T // qb), -(-S // kb)
    # queries laid out per block as [B, KVH, G, qb, Dh] (each tile is one batched matmul per kv head) and scaled
    # before the matmul where that is exact (float32, or a power-of-two scale); else the float32 scores are scaled
    pre_scale = q.dtype == jnp.float32 or math.log2(Dh) % 2 == 0
    scale = Dh ** -0.5
    Q = _blocks((q * jnp.asarray(scale, q.dtype) if pre_scale else q).reshape(B, T, KVH, G, Dh), nq, qb)
    Q = Q.transpose(0, 1, 3, 4, 2, 5)  # [nq, B, KVH, G, qb, Dh]
    K, Vv = k_buf.reshape(B, KVH, S, Dh), v_buf.reshape(B, KVH, S, Dh)
    start, offset = start.astype(jnp.int32), offset.astype(jnp.int32)

    def keys(j):
        """Key block j [B, KVH, kb, Dh] x2 and its slots [kb]; the last block is read from S - kb (a dynamic slice
        cannot run past the end) and its slots before j * kb, which the block before holds, are masked."""
        s0 = jnp.minimum(j * kb, S - kb)
        kp = s0 + jnp.arange(kb)
        return (jax.lax.dynamic_slice_in_dim(K, s0, kb, axis=2), jax.lax.dynamic_slice_in_dim(Vv, s0, kb, axis=2),
                kp, kp >= j * kb)

    def tile(i, j, masked: bool = True):
        """Scores [B, KVH, G, qb, kb] (float32) of query block i against key block j, masked unless the caller
        knows every query of the block sees every key of it in every row; and the values."""
        kj, vj, kp, fresh_slot = keys(j)
        s = jnp.einsum("bkgqd,bksd->bkgqs", Q[i], kj, preferred_element_type=jnp.float32)
        s = s if pre_scale else s * scale
        if not masked:
            return s, vj
        qp = offset[:, None] + i * qb + jnp.arange(qb)[None]  # [B, qb] slots of the queries
        vis = (kp[None, None, :] <= qp[:, :, None]) & (kp[None, None, :] >= start[:, None, None]) & fresh_slot
        if window is not None:
            vis = vis & (kp[None, None, :] > qp[:, :, None] - window)
        return jnp.where(vis[:, None, None], s, NEG), vj

    def last_block(i):
        return jnp.minimum((jnp.max(offset) + i * qb + qb - 1) // kb, nk - 1)

    def forward(i):
        # key blocks [j0, end): those every row and query of the block sees whole, [a, b), skip the mask (most of
        # a long prefill's tiles); the ones before (a row's start inside them) and after (the causal edge) keep it
        # and run in one loop, its k-th block a + ... mapped past [a, b)
        j0, end = jnp.min(start) // kb, last_block(i) + 1
        a = -(-jnp.max(start) // kb)
        if window is not None:  # the first slot any query of the block sees, and the first every query sees
            j0 = jnp.min(jnp.maximum(start, offset + i * qb - window + 1)) // kb
            a = jnp.maximum(a, -(-(jnp.max(offset) + i * qb + qb - window) // kb))
        a = jnp.clip(a, j0, end)
        b = jnp.clip((jnp.min(offset) + i * qb + 1) // kb, a, end)

        def body(masked):
            def run(j, carry):
                m, l, acc = carry
                j = jnp.where(j < a, j, j - a + b) if masked else j
                s, vj = tile(i, j, masked)
                m_new = jnp.maximum(m, s.max(-1))
                p = jnp.exp(s - m_new[..., None])
                corr = jnp.exp(m - m_new)
                pv = jnp.einsum("bkgqs,bksd->bkgqd", p.astype(vj.dtype), vj, preferred_element_type=jnp.float32)
                return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv
            return run

        m0 = jnp.full((B, KVH, G, qb), NEG, jnp.float32)
        carry = (m0, jnp.zeros_like(m0), jnp.zeros((B, KVH, G, qb, Dh), jnp.float32))
        carry = jax.lax.fori_loop(a, b, body(False), carry)
        m, l, acc = jax.lax.fori_loop(j0, a + end - b, body(True), carry)
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
                s, _ = tile(i, j)
                part = jnp.einsum("bkgqs,bq->bs", jnp.exp(s - lse[i][..., None]), W[i]) / H
                s0 = jnp.minimum(j * kb, S - kb)
                return jax.lax.dynamic_update_slice(acc, jax.lax.dynamic_slice(acc, (0, s0), (B, kb)) + part, (0, s0))
            return jax.lax.fori_loop(jnp.min(start) // kb, last_block(i) + 1, body, acc)

        return jax.lax.cond(jnp.any(W[i] != 0), run, lambda a: a, acc), None

    acc, _ = jax.lax.scan(scores, jnp.zeros((B, S), jnp.float32), jnp.arange(nq))
    return res, acc
