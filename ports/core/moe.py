"""Mixture-of-experts feed-forward block (Qwen3-MoE's `Qwen3MoeSparseMoeBlock`): a softmax router picks each
token's top-k experts, and each expert is a SwiGLU MLP.

The experts run on the token-expert pairs only: the N x k pairs are sorted by expert, and each expert's
contiguous run of rows is multiplied by that expert's weights (a grouped matmul), so the work is N x k expert
MLPs, whatever the number of experts stored. Shapes are static (N x k rows always). The grouped matmul is
`jax.lax.ragged_dot` where XLA lowers it as one (GPU, TPU); XLA:CPU lowers `ragged_dot` to a dense product over
every expert for every row (measured on this 2-core CPU, 64 experts of [512, 256]: 40 ms for 4 rows against
0.5 ms for the grouped form below), so there the same grouping runs as tiles: each expert's rows padded to a
multiple of a tile of t = ceil(rows / experts) rows, and each tile multiplied by its expert's weights (at most
2 x rows padded rows and 2 x experts tiles; t = 1 when rows <= experts, as in a decode step).

Params of one MoE layer (the run layout; `ports.core.fused` stacks the checkpoint's per-expert matrices):
    router [D, E]; we_gate, we_up [E, D, F]; we_down [E, F, D]      (F = moe_intermediate_size)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

EXPERT_KEYS = ("we_gate", "we_up", "we_down")
# "auto": ragged_dot except on XLA:CPU (tiles); "ragged" or "tiled" force one (tests compare them)
GROUPED = "auto"


def route(x: jax.Array, router: jax.Array, top_k: int, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
    """(weights [N, k] in x's dtype, experts [N, k] int32) of tokens x [N, D]: transformers' `Qwen3MoeTopKRouter`
    (logits in the param dtype, softmax in float32 over all experts, the top k, renormalised to sum 1 when
    `norm_topk_prob`)."""
    logits = jnp.einsum("nd,de->ne", x, router)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top, experts = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top.astype(x.dtype), experts.astype(jnp.int32)


def _tiled_dot(x: jax.Array, w: jax.Array, sizes: jax.Array, row_expert: jax.Array) -> jax.Array:
    """`ragged_dot(x, w, sizes)` as tiles: x [M, K] rows sorted by expert (row_expert [M]), w [E, K, N]."""
    M, E = x.shape[0], w.shape[0]
    t = max(1, -(-M // E))
    if t == 1:  # one row per tile: each row times its own expert's matrix
        return jnp.einsum("mk,mkn->mn", x, w[row_expert])
    n_tiles = (M + min(E, M) * (t - 1)) // t  # sum over experts of ceil(rows / t), at most
    tiles = (sizes + t - 1) // t
    tile_end = jnp.cumsum(tiles)
    pad_start = (tile_end - tiles) * t  # first padded row of each expert
    group_start = jnp.cumsum(sizes) - sizes
    dest = pad_start[row_expert] + jnp.arange(M) - group_start[row_expert]
    padded = jnp.zeros((n_tiles * t, x.shape[1]), x.dtype).at[dest].set(x)
    tile_expert = jnp.minimum(jnp.searchsorted(tile_end, jnp.arange(n_tiles), side="right"), E - 1)
    y = jnp.einsum("itk,ikn->itn", padded.reshape(n_tiles, t, -1), w[tile_expert])
    return y.reshape(n_tiles * t, -1)[dest]


def grouped_dot(x: jax.Array, w: jax.Array, sizes: jax.Array, row_expert: jax.Array) -> jax.Array:
    """[M, N]: row m of x [M, K] (rows sorted by expert, sizes [E] of each expert's run, row_expert [M]) times
    its expert's matrix w[row_expert[m]] [K, N]; `GROUPED` picks the form (module docstring)."""
    how = GROUPED if GROUPED != "auto" else ("tiled" if jax.default_backend() == "cpu" else "ragged")
    if how == "ragged":
        return jax.lax.ragged_dot(x, w, sizes)
    return _tiled_dot(x, w, sizes, row_expert)


def experts_mlp(x: jax.Array, weights: jax.Array, experts: jax.Array, p: dict) -> jax.Array:
    """sum over j of weights[n, j] * SwiGLU_{experts[n, j]}(x[n]) for tokens x [N, D]: transformers'
    `Qwen3MoeExperts`, computed on the N x k token-expert pairs sorted by expert."""
    N, k = experts.shape
    E = p["we_gate"].shape[0]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    row_expert = flat[order]
    xs = jnp.take(x, order // k, axis=0)  # [N * k, D], grouped by expert
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    h = jax.nn.silu(grouped_dot(xs, p["we_gate"], sizes, row_expert)) * grouped_dot(xs, p["we_up"], sizes,
                                                                                  row_expert)
    out = grouped_dot(h, p["we_down"], sizes, row_expert) * jnp.take(weights.reshape(-1), order)[:, None]
    back = jnp.argsort(order)  # pair n * k + j's row in the sorted order
    return jnp.sum(jnp.take(out, back, axis=0).reshape(N, k, -1), axis=1)


def sparse_moe(cfg, p: dict, x: jax.Array) -> jax.Array:
    """The MoE block over x [..., D]: route (`route`), then the chosen experts (`experts_mlp`)."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    weights, experts = route(flat, p["router"], cfg.num_experts_per_tok, cfg.norm_topk_prob)
    return experts_mlp(flat, weights, experts, p).reshape(shape)
