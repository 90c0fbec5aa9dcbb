"""Acceptance rules: which drafted tree path the target accepts, and the token that follows it.

A rule is a small pytree object (its numbers, e.g. a relaxation bound or a neighbour table, are leaves: changing
them does not recompile). `Rule.verify` maps a drafted tree and the target's logits to a `Verdict`: the accepted
path (node ids by depth), how many drafts it holds, and the bonus token. Greedy decoding takes the longest path
that matches the target's argmax under every rule. Sampling walks the tree from the root (`stochastic`) and asks
the rule three things at each candidate x: the target mass it may accept (`target_mass`), the draft mass it is
compared with (`draft_mass`), and the residual after a rejection (`reject`). A chain is the tree whose nodes each
have one child, so one walk serves both.

`Residual` is exact multi-draft speculative sampling (children drawn without replacement, `draws = True`);
`Q1` is EAGLE-2's q = 1 rule (exact whatever tokens are offered). A relaxed rule (LANTERN's delta, LANTERN++'s
lambda over latent neighbours) overrides `target_mass` and `reject` and reads its table from its own fields.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from jspec import sampling as S
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


def _at(x: jax.Array, tok: jax.Array) -> jax.Array:
    """x[b, tok[b]] of x [B, V]."""
    return jnp.take_along_axis(x, tok[:, None], axis=1)[:, 0]


class Rule:
    """Base of acceptance rules (subclasses are `flax.struct` dataclasses; see the module docstring).

    draws: the rule needs the children of a node drawn without replacement from the draft distribution q, in draw
    order, and q itself (the plan then records q per node). exact: the rule claims to sample the target's
    distribution exactly (the conformance suite tests the claim).
    """

    draws: bool = False
    exact: bool = True

    def target_mass(self, resid: jax.Array, x: jax.Array) -> jax.Array:
        """[B] the target mass the candidate x [B] may be accepted with, from the current residual [B, V]."""
        return _at(resid, x)

    def draft_mass(self, q: jax.Array | None, x: jax.Array) -> jax.Array:
        """[B] the draft mass x is compared with: accept when u * draft_mass <= target_mass, u ~ U(0, 1)."""
        return jnp.ones(x.shape, jnp.float32)

    def reject(self, resid: jax.Array, q: jax.Array | None, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """(residual, q) after x was rejected. Every rule defines it (the walk cannot continue without it)."""
        raise TypeError(f"rule {type(self).__name__} defines no `reject` (the residual after a rejection)")

    def verify(self, key: jax.Array, tokens: jax.Array, logits: jax.Array, q: jax.Array | None, valid: jax.Array,
               tree: TreeArrays, max_depth: int, sampling: S.SamplingConfig, sp: S.SamplingParams) -> Verdict:
        """The verdict on one drafted tree per row: greedy matching when decoding greedily, else `stochastic`
        over the sampler's target distribution."""
        if sampling.greedy:
            return greedy(tokens, logits, valid, tree, max_depth)
        return stochastic(key, tokens, S.probs(logits, sampling, sp), q, valid, tree, max_depth, self)

    def check(self) -> None:
        """Raise ValueError for out-of-range numbers (host side, before any compute)."""


@struct.dataclass
class Residual(Rule):
    """Exact multi-draft speculative sampling: accept x with probability min(1, r(x) / q'(x)), where q' is the
    draft distribution renormalised without the siblings already tried; on rejection r <- norm(max(0, r - q'))."""

    draws = True

    def draft_mass(self, q, x):
        return _at(q, x)

    def reject(self, resid, q, x):
        new_q = _renorm(q.at[jnp.arange(x.shape[0]), x].set(0.0), q)
        return _renorm(jnp.maximum(resid - q, 0.0), resid), new_q


@struct.dataclass
class Q1(Rule):
    """EAGLE-2's rule: treat each offered draft as certain (q'(x) = 1): accept with probability r(x); on rejection
    zero r(x) and renormalise. Exact whatever tokens are offered and however they were chosen."""

    def reject(self, resid, q, x):
        return _renorm(resid.at[jnp.arange(x.shape[0]), x].set(0.0), resid), q


RULES = {"residual": Residual, "q1": Q1}


def as_rule(rule) -> Rule:
    """A rule object from a rule or its name ("residual", "q1")."""
    if isinstance(rule, str):
        if rule not in RULES:
            raise ValueError(f"unknown verification rule {rule!r}; use one of {sorted(RULES)} or a jspec.verify.Rule")
        return RULES[rule]()
    if not isinstance(rule, Rule):
        raise ValueError(f"a rule must be a name ({sorted(RULES)}) or a jspec.verify.Rule, got {type(rule).__name__}")
    return rule


def stochastic(key: jax.Array, tokens: jax.Array, p: jax.Array, q: jax.Array | None, node_valid: jax.Array,
               t: TreeArrays, max_depth: int, rule: Rule) -> Verdict:
    """Multi-draft speculative sampling over a tree (a chain is the one-child case), under `rule`'s hooks.

    p [B, N, V]: target distribution after each node; q [B, N, V]: the draft distribution each node's children
    were drawn from (read only by rules that draw). From the root, children are tried in order: child x is accepted
    when u * rule.draft_mass(q', x) <= rule.target_mass(r, x), r the current residual and q' the draft
    distribution as the rule leaves it after earlier rejections (`rule.reject`). On acceptance the walk moves to
    the child with r = p(child). The bonus is drawn from r where the walk stops. Under `Residual` the output
    follows p exactly (recursive rejection sampling for draws without replacement); under `Q1` too, whatever the
    offered tokens; tests/test_conformance.py measures both.
    """
    B, N, V = p.shape
    M = t.children.shape[2]
    rows = jnp.arange(B)
    cur = jnp.zeros((B,), jnp.int32)
    resid = p[:, 0]
    alive = jnp.ones((B,), bool)
    accepted = jnp.zeros((B,), jnp.int32)
    keys = jax.random.split(key, max_depth * M + 1)
    for d in range(max_depth):
        qd = None if q is None else q[rows, cur]  # [B, V]
        moved = jnp.zeros((B,), bool)
        new_cur = cur
        for k in range(M):
            c = t.children[rows, cur, k]  # [B]
            cc = jnp.maximum(c, 0)
            live = alive & ~moved & (c >= 0) & node_valid[rows, cc]
            x = tokens[rows, cc]
            u = jax.random.uniform(keys[d * M + k], (B,))
            acc = live & (u * rule.draft_mass(qd, x) <= rule.target_mass(resid, x))
            rej = live & ~acc
            rej_resid, rej_q = rule.reject(resid, qd, x)
            resid = jnp.where(rej[:, None], rej_resid, resid)
            if qd is not None:
                qd = jnp.where(rej[:, None], rej_q, qd)
            new_cur = jnp.where(acc, cc, new_cur)
            resid = jnp.where(acc[:, None], p[rows, cc], resid)
            moved = moved | acc
        cur = new_cur
        accepted = accepted + moved.astype(jnp.int32)
        alive = alive & moved
    bonus = jax.random.categorical(keys[-1], jnp.log(jnp.maximum(resid, 0.0)), axis=-1).astype(jnp.int32)
    return Verdict(_path_of(cur, t, max_depth), accepted, bonus)
