"""Speculative decoding with a separate draft model: tree drafting, tree-attention verification, commit.

One step, for every static tree (a chain is a one-child-per-node tree):
  1. draft: one forward over the tokens the draft has not seen yet ([accepted drafts..., bonus] of the last
     step; padded to D+1), which also gives the root's distribution; then one forward per tree level with the
     tree's ancestor mask, writing each level's K/V into the draft cache's scratch slots;
  2. verify: one target forward over all N nodes (positions = committed length + depth, ancestor mask);
  3. a verification rule picks the accepted path and the bonus token;
  4. the accepted nodes' K/V move into the target's committed prefix with one gather; the draft cache keeps
     only committed tokens and re-reads the accepted ones at the next step.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jspec import cache as kvc
from jspec import loop
from jspec import sampling as S
from jspec import verify as V
from jspec.trees import StaticTree


@struct.dataclass
class DraftState:
    cache: kvc.KVCache  # committed length = tokens the draft has read, `last` excluded
    pending: jax.Array  # [B, D+1] committed tokens the draft has not read yet, ending with `last`
    n_pending: jax.Array  # [B] int32


def init_draft(draft, tokens, lengths, max_len: int, first: jax.Array, width: int) -> DraftState:
    """Prefill the draft on its prompt; the first target token waits in `pending`."""
    cache = loop.new_cache_for(draft, tokens.shape[0], max_len)
    _, _, cache = loop.prefill(draft, tokens, lengths, cache)
    pending = jnp.zeros((tokens.shape[0], width), jnp.int32).at[:, 0].set(first)
    return DraftState(cache, pending, jnp.ones((tokens.shape[0],), jnp.int32))


def _choose_children(key, q: jax.Array, m: int, greedy: bool) -> jax.Array:
    """m child tokens per parent from q [B, n, V]: top-m when greedy, else m draws without replacement, in draw
    order (Gumbel top-k)."""
    if greedy:
        return jax.lax.top_k(q, m)[1].astype(jnp.int32)
    g = jax.random.gumbel(key, q.shape)
    return jax.lax.top_k(jnp.log(q) + g, m)[1].astype(jnp.int32)


def draft_tree(ctx: loop.StepContext, draft, tree: StaticTree, ds: DraftState, last: jax.Array, key, sp):
    """Expand the static tree with the draft model. Returns (node tokens [B, N], draft probs per node [B, N, V],
    node_valid [B, N], draft cache with the root committed)."""
    B = last.shape[0]
    N, D = tree.num_nodes, tree.max_depth
    P = ds.pending.shape[1]
    dc = ds.cache
    pos = dc.length[:, None] + jnp.arange(P, dtype=jnp.int32)[None]
    fo = draft.forward(ds.pending, pos, dc, logits_at=(ds.n_pending - 1)[:, None])
    dc = kvc.commit(fo.cache, ds.n_pending)  # the root (`last`) is now committed in the draft
    root_pos = dc.length - 1
    logits = fo.logits  # [B, 1, V]: distribution over the root's children
    vocab = logits.shape[-1]
    tokens = jnp.zeros((B, N), jnp.int32).at[:, 0].set(last)
    q_all = jnp.zeros((B, N, vocab), jnp.float32)
    valid = jnp.ones((B, N), bool)
    depth = jnp.asarray(tree.depth)
    anc = jnp.asarray(tree.ancestor)
    keys = jax.random.split(key, D)
    for d in range(D):
        s, e = tree.levels[d]
        q = S.probs(logits, ctx.sampling, sp)  # [B, e - s, V]
        q_all = q_all.at[:, s:e].set(q)
        cs, ce = tree.levels[d + 1]
        m = int(max(tree.rank[cs:ce]) + 1)
        choice = _choose_children(keys[d], q, m, ctx.sampling.greedy)  # [B, e - s, m]
        par = tree.parent[cs:ce] - s
        rk = tree.rank[cs:ce]
        kids = choice[:, par, rk]  # [B, ce - cs]
        tokens = tokens.at[:, cs:ce].set(kids)
        qk = jnp.take_along_axis(q[:, par], kids[..., None], axis=-1)[..., 0]
        valid = valid.at[:, cs:ce].set(qk > 0)
        if d + 1 < D:
            # level d+1 nodes: node i sits in scratch slot i - 1 (the root is committed)
            mask = jnp.broadcast_to(anc[cs:ce, 1:ce], (B, ce - cs, ce - 1))
            pos = root_pos[:, None] + depth[None, cs:ce]
            fo = draft.forward(kids, pos, dc, mask, write_offset=cs - 1)
            dc = fo.cache
            logits = fo.logits
    return tokens, q_all, valid, dc


def sd_step(ctx: loop.StepContext, target, draft, tree: StaticTree, rule: str, state: loop.DecodeState):
    """One draft-verify-commit round for every row."""
    ds: DraftState = state.aux
    B = state.last.shape[0]
    D = tree.max_depth
    k_draft, k_verify = jax.random.split(loop.step_key(state))
    tokens, q, node_valid, dcache = draft_tree(ctx, draft, tree, ds, state.last, k_draft, state.sp)
    t = V.tree_arrays(tree)
    tc = state.cache
    pos = tc.length[:, None] + t.depth[None]
    fo = target.forward(tokens, pos, tc, jnp.broadcast_to(t.ancestor, (B,) + t.ancestor.shape))
    if ctx.sampling.greedy:
        verdict = V.greedy(tokens, fo.logits, node_valid, t, D)
    else:
        p = S.probs(fo.logits, ctx.sampling, state.sp)
        verdict = V.stochastic(k_verify, tokens, p, q, node_valid, t, D, rule)
    a = verdict.accepted
    path_tokens = jnp.take_along_axis(tokens, verdict.path, axis=1)  # [B, D+1], root first
    new = jnp.concatenate([path_tokens[:, 1:], jnp.zeros((B, 1), jnp.int32)], axis=1)
    new = new.at[jnp.arange(B), a].set(verdict.bonus)  # [accepted drafts..., bonus]
    active = ~state.done
    tc = kvc.commit_path(fo.cache, verdict.path, jnp.where(active, a + 1, 0))
    state = state.replace(cache=tc, last=jnp.where(active, verdict.bonus, state.last))
    state, n_eff = loop.commit_tokens(ctx, state, new, a + 1)
    ds = DraftState(dcache, new, jnp.where(active, a + 1, 1))
    # finished rows must not move the draft: feed nothing new (re-feed `last` at the same slot)
    ds = ds.replace(cache=ds.cache.replace(length=jnp.where(active, ds.cache.length, ds.cache.length - 1)),
                    pending=jnp.where(active[:, None], ds.pending, state.last[:, None]))
    state = state.replace(aux=ds)
    drafted = jnp.where(active, jnp.sum(node_valid[:, 1:], axis=1), 0).astype(jnp.int32)
    return loop.record_step(state, n_eff, drafted)
