"""Verification rules: which drafted tree path the target accepts, and the token that follows it.

Every rule maps (node tokens [B, N], target logits or probs per node, draft probs per node, a batched
`TreeArrays`, key) to a `Verdict`: the accepted path (node ids by depth), how many drafts it holds, and the bonus
token. A chain is the tree whose nodes each have one child, so one implementation serves both.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jspec.trees import TreeArrays


class Verdict(NamedTuple):
    path: jax.Array  # [B, D+1] node ids of the accepted path by depth (entries past `accepted` are 0)
    accepted: jax.Array  # [B] drafts accepted (bonus excluded)
    bonus: jax.Array  # [B] the token after the accepted path


def _path_of(best: jax.Array, t: TreeArrays, max_depth: int) -> jax.Array:
    """Ancestor chain of node best[b], by depth, as [B, D+1] node ids."""
    anc = jnp.take_along_axis(t.ancestor, best[:, None, None], axis=1)[:, 0]  # [B, N]
    onehots = anc[:, None, :] & (t.depth[:, None, :] == jnp.arange(max_depth + 1)[None, :, None])
    return jnp.argmax(onehots, axis=-1).astype(jnp.int32)


def greedy(tokens: jax.Array, target_logits: jax.Array, node_valid: jax.Array, t: TreeArrays,
           max_depth: int) -> Verdict:
    """Longest path whose every draft equals the target's argmax at its parent; bonus = argmax at its end.

    Ties between equally deep paths (possible only with duplicate sibling tokens) go to the lowest node id.
    """
    g = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, N]
    parent = jnp.maximum(t.parent, 0)
    match = (tokens == jnp.take_along_axis(g, parent, axis=1)) & node_valid
    match = match.at[:, 0].set(True)
    ok = jnp.all(match[:, None, :] | ~t.ancestor, axis=-1)  # [B, N]: every node on the path matches
    best = jnp.argmax(jnp.where(ok, t.depth, -1), axis=-1)
    bonus = jnp.take_along_axis(g, best[:, None], axis=1)[:, 0]
    depth = jnp.take_along_axis(t.depth, best[:, None], axis=1)[:, 0]
    return Verdict(_path_of(best, t, max_depth), depth.astype(jnp.int32), bonus)


def _renorm(x: jax.Array, fallback: jax.Array) -> jax.Array:
    s = jnp.sum(x, axis=-1, keepdims=True)
    return jnp.where(s > 1e-30, x / jnp.where(s > 1e-30, s, 1.0), fallback)


def stochastic(key: jax.Array, tokens: jax.Array, p: jax.Array, q: jax.Array | None, node_valid: jax.Array,
               t: TreeArrays, max_depth: int, rule: str = "residual") -> Verdict:
    """Multi-draft speculative sampling over a tree (a chain is the one-child case).

    p [B, N, V]: target distribution after each node; q [B, N, V]: the draft distribution each node's children
    were drawn from, without replacement and in child order. From the root, children are tried in order: child x
    is accepted with probability min(1, r(x) / q'(x)), where r is the current target residual and q' the draft
    distribution renormalised without the siblings already tried. On rejection r <- norm(max(0, r - q')) and
    q'(x) <- 0. On acceptance the walk moves to the child with r = p(child). The bonus is drawn from r where the
    walk stops. With rule="residual" (default) the output follows p exactly (recursive rejection sampling for
    draws without replacement).

    rule="q1" is EAGLE-2's rule, which treats each draft as certain (q'(x) = 1): accept with probability r(x),
    on rejection zero r(x) and renormalise. It yields p exactly whatever tokens are offered and however they were
    chosen (q is not read), which is why dynamic trees, whose shape depends on the drafted tokens, use it; for
    the same offered drafts it accepts with probability r(x) <= min(1, r/q'), so a sampled chain commits fewer
    tokens per step under it; tests/test_sd_sampling.py measures both facts.
    """
    B, N, V = p.shape
    M = t.children.shape[2]
    rows = jnp.arange(B)
    cur = jnp.zeros((B,), jnp.int32)
    resid = p[:, 0]
    alive = jnp.ones((B,), bool)
    accepted = jnp.zeros((B,), jnp.int32)
    keys = jax.random.split(key, max_depth * M + 1)
    q1 = rule == "q1"
    for d in range(max_depth):
        qd = None if q1 else q[rows, cur]  # [B, V]
        moved = jnp.zeros((B,), bool)
        new_cur = cur
        for k in range(M):
            c = t.children[rows, cur, k]  # [B]
            cc = jnp.maximum(c, 0)
            live = alive & ~moved & (c >= 0) & node_valid[rows, cc]
            x = tokens[rows, cc]
            px = resid[rows, x]
            u = jax.random.uniform(keys[d * M + k], (B,))
            if q1:
                acc = live & (u <= px)
                rej_resid = _renorm(resid.at[rows, x].set(0.0), resid)
            else:
                acc = live & (u * qd[rows, x] <= px)
                rej_resid = _renorm(jnp.maximum(resid - qd, 0.0), resid)
            rej = live & ~acc
            resid = jnp.where(rej[:, None], rej_resid, resid)
            if not q1:
                qd = jnp.where(rej[:, None], _renorm(qd.at[rows, x].set(0.0), qd), qd)
            new_cur = jnp.where(acc, cc, new_cur)
            resid = jnp.where(acc[:, None], p[rows, cc], resid)
            moved = moved | acc
        cur = new_cur
        accepted = accepted + moved.astype(jnp.int32)
        alive = alive & moved
    bonus = jax.random.categorical(keys[-1], jnp.log(jnp.maximum(resid, 0.0)), axis=-1).astype(jnp.int32)
    return Verdict(_path_of(cur, t, max_depth), accepted, bonus)
