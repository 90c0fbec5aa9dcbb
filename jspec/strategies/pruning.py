"""Which of a prompt's vision tokens a draft keeps (SpecVLM's two-stage selection and its ablations), jit-able.

Every selector maps scores a [B, V] (the target's attention on each vision token, SpecVLM Eq. 4-5; only `specvlm`
and `attention` read them) and per-row counts n [B] (row b's vision tokens are a[b, :n[b]]) to a keep mask
[B, V] with exactly K_b = int(n_b (1 - ratio)) kept tokens per row (`frames` keeps whole frames: at most K_b):

- `specvlm`: stage I keeps the top-scored tokens until they hold `top_p` of the attention mass (at least one,
  at most K_b); stage II keeps K_b - c of the rest, in their original order, at the indices floor(linspace(0,
  |rest| - 1, K_b - c)) (the budget-preserving stride of the authors' code);
- `uniform`: stage II alone over all n_b tokens; `attention`: the K_b top-scored; `random`: K_b uniformly at
  random (`key`); `front` / `middle` / `end`: a contiguous window; `frames`: whole frames of `frame_tokens`
  tokens at regular intervals.
`keep_indices` turns a mask into fixed-size index vectors [B, K] (ascending; padded with -1).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

SELECTORS = ("specvlm", "uniform", "attention", "random", "front", "middle", "end", "frames")


def budget(n, ratio: float):
    """K = int(n (1 - ratio)): the vision tokens a row keeps (SpecVLM's float floor, to within 1e-3)."""
    return jnp.floor(jnp.asarray(n, jnp.float32) * (1.0 - ratio) + 1e-3).astype(jnp.int32)  # f32 ratios: 1 - 0.6 < 0.4


def check_ratio(ratio: float) -> None:
    if not 0.0 <= float(ratio) < 1.0:
        raise ValueError(f"the pruning ratio must be in [0, 1), got {ratio}")


def _stride_pick(eligible: jax.Array, count: jax.Array) -> jax.Array:
    """Among the True entries of `eligible` [V] (in index order), those at ranks floor(i (m - 1) / (count - 1)),
    i < count, with m the number of True entries (count <= m): linspace(0, m - 1, count) floored, in exact integer
    arithmetic."""
    V = eligible.shape[0]
    m = jnp.sum(eligible).astype(jnp.int32)
    rank = jnp.cumsum(eligible) - 1
    i = jnp.arange(V, dtype=jnp.int32)
    targets = jnp.where(count > 1, (i * (m - 1)) // jnp.maximum(count - 1, 1), 0)
    hit = jnp.zeros((V,), bool).at[jnp.where(i < count, targets, V)].set(True, mode="drop")
    return eligible & hit[jnp.clip(rank, 0, V - 1)]


def _stage_one_row(a, n, k, top_p):
    """(c, the score order): stage I's count for one row."""
    V = a.shape[0]
    live = jnp.arange(V) < n
    a = jnp.where(live, a, -jnp.inf)
    order = jnp.argsort(-a, stable=True)
    sorted_a = jnp.where(jnp.isfinite(a[order]), a[order], 0.0)
    cs = jnp.cumsum(sorted_a)
    c = jnp.minimum(jnp.searchsorted(cs, top_p * cs[-1], side="left") + 1, k)
    return jnp.minimum(c, n), order


def _specvlm_row(a, n, k, top_p):
    V = a.shape[0]
    live = jnp.arange(V) < n
    c, order = _stage_one_row(a, n, k, top_p)
    rank_of = jnp.zeros((V,), jnp.int32).at[order].set(jnp.arange(V, dtype=jnp.int32))
    in_r = live & (rank_of < c)
    return in_r | _stride_pick(live & ~in_r, k - c)


def _top_row(a, n, k):
    V = a.shape[0]
    live = jnp.arange(V) < n
    order = jnp.argsort(-jnp.where(live, a, -jnp.inf), stable=True)
    rank_of = jnp.zeros((V,), jnp.int32).at[order].set(jnp.arange(V, dtype=jnp.int32))
    return live & (rank_of < k)


def _window_row(n, k, where: str, V: int):
    j = jnp.arange(V)
    start = {"front": 0, "middle": (n - k) // 2, "end": n - k}[where]
    return (j >= start) & (j < start + k)


def _frames_row(n, k, frame_tokens: int, V: int):
    frames = n // frame_tokens
    keep_frames = jnp.minimum(k // frame_tokens, frames)
    frame = jnp.arange(V) // frame_tokens
    chosen = _stride_pick(jnp.arange(V) < frames, keep_frames)  # frame indices at a regular stride
    return (jnp.arange(V) < frames * frame_tokens) & chosen[jnp.clip(frame, 0, V - 1)]


def select(scores: jax.Array, n: jax.Array, ratio: float, method: str = "specvlm", top_p: float = 0.4,
           key: jax.Array | None = None, frame_tokens: int | None = None) -> jax.Array:
    """Keep mask [B, V] (module docstring). `ratio` and `top_p` may be traced; `method` and `frame_tokens` are
    static."""
    if method not in SELECTORS:
        raise ValueError(f"unknown vision-token selector {method!r}; choose one of {SELECTORS}")
    scores = jnp.asarray(scores, jnp.float32)
    B, V = scores.shape
    if V > 46340:
        raise ValueError(f"{V} vision tokens per row: the selectors' integer stride supports at most 46340")
    n = jnp.broadcast_to(jnp.asarray(n, jnp.int32), (B,))
    k = jnp.minimum(budget(n, ratio), n)
    if method == "specvlm":
        return jax.vmap(_specvlm_row, in_axes=(0, 0, 0, None))(scores, n, k, jnp.asarray(top_p, jnp.float32))
    if method == "uniform":
        return jax.vmap(lambda n, k: _stride_pick(jnp.arange(V) < n, k))(n, k)
    if method == "attention":
        return jax.vmap(_top_row)(scores, n, k)
    if method == "random":
        if key is None:
            raise ValueError("the random selector needs a key")
        noise = jax.random.uniform(key, (B, V))
        return jax.vmap(_top_row)(noise, n, k)
    if method == "frames":
        if not frame_tokens or frame_tokens < 1:
            raise ValueError("the frames selector needs frame_tokens >= 1 (vision tokens per frame)")
        return jax.vmap(lambda n, k: _frames_row(n, k, int(frame_tokens), V))(n, k)
    return jax.vmap(lambda n, k: _window_row(n, k, method, V))(n, k)


def stage_one(scores: jax.Array, n: jax.Array, ratio: float, top_p: float = 0.4) -> jax.Array:
    """[B] int32: the tokens SpecVLM's stage I keeps per row (the top-scored holding `top_p` of the mass, at least
    one, at most K_b); stage II keeps the other K_b - c. Every K_b: stage I filled the budget."""
    scores = jnp.asarray(scores, jnp.float32)
    B = scores.shape[0]
    n = jnp.broadcast_to(jnp.asarray(n, jnp.int32), (B,))
    k = jnp.minimum(budget(n, ratio), n)
    c = jax.vmap(_stage_one_row, in_axes=(0, 0, 0, None))(scores, n, k, jnp.asarray(top_p, jnp.float32))[0]
    return c.astype(jnp.int32)


def keep_indices(mask: jax.Array, size: int) -> jax.Array:
    """[B, V] keep mask -> [B, size] kept indices in ascending order, -1 past each row's count."""
    V = mask.shape[1]
    idx = jnp.where(mask, jnp.arange(V)[None], V)
    idx = jnp.sort(idx, axis=1)[:, :size]
    return jnp.where(idx < V, idx, -1).astype(jnp.int32)


def specvlm_keep(a, ratio: float, top_p: float = 0.4) -> np.ndarray:
    """SpecVLM's selection for one row of scores a [V] (host convenience): the kept indices, ascending, exactly
    int(|V| (1 - ratio)) of them."""
    check_ratio(ratio)
    a = np.asarray(a, np.float32)
    m = np.asarray(select(a[None], a.shape[0], ratio, "specvlm", top_p))[0]
    return np.flatnonzero(m)


__all__ = ["SELECTORS", "budget", "check_ratio", "keep_indices", "select", "specvlm_keep", "stage_one"]
