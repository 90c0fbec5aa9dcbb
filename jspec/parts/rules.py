"""Acceptance rules: which drafted tree path the target accepts, and the token that follows it.

A rule is a small pytree object (its numbers, e.g. a relaxation bound or a neighbour table, are leaves: changing
them does not recompile). `Rule.accept` maps a drafted tree and the target's logits to a `Verdict`: the accepted
path (node ids by depth), how many drafts it holds, and the bonus token. Greedy decoding takes the longest path
that matches the target's argmax under every rule. Sampling walks the tree from the root (`stochastic`) and asks
the rule three things at each candidate x: the target mass it may accept (`target_mass`), the draft mass it is
compared with (`draft_mass`), and the residual after a rejection (`reject`). A chain is the tree whose nodes each
have one child, so one walk serves both.

`Residual` is exact multi-draft speculative sampling (children drawn without replacement, `draws = True`);
`Q1` is EAGLE-2's q = 1 rule (exact whatever tokens are offered). The relaxed rules `LanternRule` (additive delta) and
`LanternPPRule` (LANTERN++'s multiplicative lambda) accept a drafted image token for the target mass of its latent
neighbours too (a `jspec.parts.neighbours.NeighbourTable` in their fields): they override `target_mass` and `reject`,
are lossy by design (`exact = False`; delta = 0, lambda = 1 or k = 0 give the target back) and come with sampled
drafts (static trees) or deterministic ones (`drafts="deterministic"`: the q = 1 form for EAGLE-2 dynamic trees).
Greedy decoding ignores the relaxation (it stays equal to AR).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jspec.core import rowkeys as RK
from jspec.core import sampling as SM
from jspec.parts.protocols import Proposal, Verdict
from jspec.parts.trees import TreeArrays


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
        return jnp.take_along_axis(resid, x[:, None], axis=1)[:, 0]

    def draft_mass(self, q: jax.Array | None, x: jax.Array) -> jax.Array:
        """[B] the draft mass x is compared with: accept when u * draft_mass <= target_mass, u ~ U(0, 1)."""
        return jnp.ones(x.shape, jnp.float32)

    def reject(self, resid: jax.Array, q: jax.Array | None, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """(residual, q) after x was rejected. Every rule defines it (the walk cannot continue without it)."""
        raise TypeError(f"rule {type(self).__name__} defines no `reject` (the residual after a rejection)")

    def accept(self, key: jax.Array, prop: "Proposal", logits: jax.Array, max_depth: int,
               sampling: SM.SamplingConfig, sp: SM.SamplingParams) -> "Verdict":
        """The verdict on one drafted tree per row (`prop`, the target's logits [B, N, V] at its nodes): greedy
        matching when decoding greedily, else `stochastic` (below) over the sampler's target
        distribution, asking this rule's `target_mass`, `draft_mass` and `reject` at each candidate."""
        if sampling.greedy:
            return greedy(prop.tokens, logits, prop.valid, prop.tree, max_depth)
        return stochastic(key, prop.tokens, SM.probs(logits, sampling, sp), prop.q, prop.valid, prop.tree,
                                max_depth, self)

    def accept_root(self, key: jax.Array, logits: jax.Array, max_depth: int, width: int,
                    sampling: SM.SamplingConfig, sp: SM.SamplingParams) -> "Verdict":
        """The verdict `accept` gives when no row offers a draft (only the root is valid), from the target's logits
        [B, V] at the root alone: no draft accepted, the bonus the walk would draw there with the same key
        (`width`: the tree's children per node). Equal to `accept`'s, token for token, at a fraction of its cost; a rule
        that overrides `accept` overrides this too."""
        return root_verdict(key, logits, max_depth, width, sampling, sp)

    def check(self) -> None:
        """Raise ValueError for out-of-range numbers (host side, before any compute)."""


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


RESIDUAL_MODES = ("principled", "lumina_code", "llamagen_code")
DRAFT_MODES = ("sampled", "deterministic")


def _zero_at(a: jax.Array, ids: jax.Array, mask: jax.Array) -> jax.Array:
    """a [B, V] with a[b, ids[b, j]] = 0 wherever mask[b, j]."""
    B, V = a.shape
    idx = jnp.where(mask, ids, V)  # V is out of range: dropped
    return a.at[jnp.arange(B)[:, None], idx].set(0.0, mode="drop")


def _prefix(ok: jax.Array) -> jax.Array:
    """[B, K] bool: the leading run of True in each row of ok."""
    return jnp.cumprod(ok.astype(jnp.int32), axis=1).astype(bool)


class _RelaxedRule(Rule):
    """Latent-neighbour relaxation (LANTERN and LANTERN++; shared by `LanternRule` and `LanternPPRule`).

    For a candidate x against the current target residual r [B, V] (in jspec's notation r is the TARGET's and q
    the draft's; the paper writes them the other way round): nb = the first k entries of table.ids[x] (entries
    that are -1 end the list: non-image tokens have none, so they are never relaxed), S_m = r(nb_1) + ... +
    r(nb_m), m* = the largest m <= k with S_m <= bound (a prefix: S is non-decreasing; m* = 0 when S_1 > bound),
    A = {x} u nb_{1..m*}, and the relaxed target mass q~(x) = r(x) + S_m*. The subclass gives the bound.

    Sampled drafts (`drafts="sampled"`, `draws = True`: EAGLE-1 / LANTERN++ static trees): accept x when
    u * q'(x) <= q~(x), q' the draft distribution renormalised without the siblings tried before (as `Residual`).
    After a rejection q' loses x and is renormalised (as `Residual`); the target residual follows `residual`:
      "principled":    norm(max(q~ - q', 0)), the residual of q~, the distribution that moved A's mass onto x:
                       r zeroed on A - {x} with r(x) raised to q~(x). Rejection implies q~(x) < q'(x), so this is
                       also norm(max(r' - q', 0)) with r' = r zeroed on A - {x}.
      "lumina_code":   LANTERN's Lumina-mGPT code (jadohu/LANTERN@3a56e45 models/ea_model_lumina_mgpt.py,
                       `evaluate_posterior`, lines 705-713: `if (indices != -1): gtp[nearest_latents[xi - offset,
                       :lantern_k+1] + offset] = 0`, then `gtp = gtp - q; gtp[gtp < 0] = 0`): when m* >= 1, r is
                       zeroed on the first k + 1 neighbours of x, then norm(max(r - q', 0)).
      "llamagen_code": LANTERN's LlamaGen / Anole code (models/ea_model_llamagen.py `evaluate_posterior_v1`, lines
                       646-656: q' rebuilt with the earlier siblings zeroed and renormalised, then `if (indices !=
                       -1): q[nearest_latents[xi, :lantern_k + 1]] = 0`, `gtp = gtp - q`; ea_model_anole.py the
                       same at line 654): when m* >= 1, the SUBTRACTED draft distribution is zeroed on the first
                       k + 1 neighbours (not renormalised) and r is untouched: norm(max(r - q'_0, 0)). The draft's
                       own q' for the next sibling is not affected.
    In both code modes "the first k + 1 neighbours" are k + 1 OTHER codes, self not among them: the code zeroes
    `nearest_latents[x, :lantern_k + 1]`, and its table (entrypoints/generate_codebook.py lines 56-59) is
    `torch.topk(distances, L - 1, largest=False)` of the cdist matrix after `fill_diagonal_(inf)`, so self ranks
    last (column L - 1, cut off) and never enters the first k + 1. The spec's "N_{1..k+1}" is therefore k + 1
    neighbours, not self + k; `indices != -1` is m* >= 1. Zeroing covers all k + 1 once m* >= 1 (not only A), and
    x itself is not zeroed there (in the sampled form its mass leaves through the subtraction: r(x) <= q~(x) <
    q'(x)). These modes need a table with kmax >= k + 1. At m* = 0 the three modes coincide (plain `Residual`).
    Where a residual sums to 0, every mode falls back to the residual before the rejection, as `Residual` does
    (the code falls back to uniform).

    Deterministic drafts (`drafts="deterministic"`, `draws = False`: EAGLE-2 dynamic trees, spec 2.6): accept x
    with probability min(1, q~(x)) (q' = 1); on rejection r(x) = 0 and, "principled", r = 0 on A - {x} (the q = 1
    rule applied to q~), or, in both code modes (their q = 1 paths agree: `gtp[xi] = 0` and, when m* >= 1,
    `gtp[nearest_latents[x, :lantern_k + 1]] = 0`: ea_model_llamagen.py `evaluate_posterior` lines 769-773,
    ea_model_lumina_mgpt.py with eagle_version 2, lines 705-712), r = 0 on the first k + 1 neighbours when
    m* >= 1; then renormalised.

    Lossless only where nothing is relaxed (m* = 0 everywhere: lambda = 1, delta = 0 or k = 0, on targets with no
    zero-mass neighbour; under a top-k or grammar mask neighbours of mass 0 give m* >= 1 with S = 0, which leaves
    q~ = r and the principled residual exact but lets the code modes zero k + 1 neighbours). Greedy decoding does
    not relax (jspec keeps greedy == AR; LANTERN's LlamaGen code relaxes its greedy matching too).
    The fields `table` (its ids), `k` and the bound are pytree leaves: new values do not recompile.
    """

    exact = False

    @property
    def draws(self) -> bool:
        return self.drafts == "sampled"

    def bound(self, rx: jax.Array) -> jax.Array:
        """[B] the bound on S_m given r(x) [B] (each relaxed rule defines its own)."""
        raise NotImplementedError(f"{type(self).__name__} defines no bound (LanternPPRule: (lam - 1) r(x); "
                                  "LanternRule: delta)")

    def relax(self, resid: jax.Array, x: jax.Array):
        """(nb [B, kmax] neighbour ids, in_a [B, kmax] the neighbours in A, m* [B], q~(x) [B]) of candidates x."""
        ids = self.table.ids
        if ids.shape[0] != resid.shape[-1]:
            raise ValueError(f"the neighbour table is for a vocabulary of {ids.shape[0]} tokens, the target's "
                             f"distribution has {resid.shape[-1]}: build the table for this model")
        nb = jnp.take(ids, x, axis=0)  # [B, kmax]
        j = jnp.arange(nb.shape[1])[None]
        win = _prefix((nb >= 0) & (j < self.k))
        mass = jnp.where(win, jnp.take_along_axis(resid, jnp.maximum(nb, 0), axis=1), 0.0)
        s = jnp.cumsum(mass, axis=1)
        rx = _at(resid, x)
        in_a = win & (s <= self.bound(rx)[:, None])
        m = jnp.sum(in_a, axis=1).astype(jnp.int32)
        s_m = jnp.where(m > 0, jnp.take_along_axis(s, jnp.maximum(m - 1, 0)[:, None], axis=1)[:, 0], 0.0)
        return nb, in_a, m, rx + s_m

    def target_mass(self, resid, x):
        return self.relax(resid, x)[3]

    def draft_mass(self, q, x):
        return _at(q, x) if self.draws else jnp.ones(x.shape, jnp.float32)

    def _code_window(self, nb: jax.Array, m: jax.Array) -> jax.Array:
        """[B, kmax]: the first k + 1 neighbours where m* >= 1 (what the official code zeroes)."""
        j = jnp.arange(nb.shape[1])[None]
        return _prefix((nb >= 0) & (j < self.k + 1)) & (m >= 1)[:, None]

    def reject(self, resid, q, x):
        rows = jnp.arange(x.shape[0])
        nb, in_a, m, qt = self.relax(resid, x)
        if not self.draws:
            zap = in_a if self.residual == "principled" else self._code_window(nb, m)
            return _renorm(_zero_at(resid, nb, zap).at[rows, x].set(0.0), resid), q
        new_q = _renorm(q.at[rows, x].set(0.0), q)
        if self.residual == "principled":
            base, sub = _zero_at(resid, nb, in_a).at[rows, x].set(qt), q
        elif self.residual == "lumina_code":
            base, sub = _zero_at(resid, nb, self._code_window(nb, m)), q
        else:  # "llamagen_code"
            base, sub = resid, _zero_at(q, nb, self._code_window(nb, m))
        return _renorm(jnp.maximum(base - sub, 0.0), resid), new_q

    def _check_common(self, vocab_size, codebook) -> None:
        from jspec.parts.neighbours import NeighbourTable

        name = type(self).__name__
        if not isinstance(self.table, NeighbourTable):
            raise ValueError(f"{name}: table must be a jspec.parts.neighbours.NeighbourTable, "
                             f"got {type(self.table).__name__}")
        if self.residual not in RESIDUAL_MODES:
            raise ValueError(f"{name}: unknown residual mode {self.residual!r}; use one of {RESIDUAL_MODES}")
        if self.drafts not in DRAFT_MODES:
            raise ValueError(f"{name}: unknown drafts {self.drafts!r}; use one of {DRAFT_MODES}")
        k = float(jnp.asarray(self.k))
        if k != int(k) or k < 0:
            raise ValueError(f"{name}: k (neighbours) must be a non-negative integer, got {self.k!r}")
        k = int(k)
        if k > self.table.kmax:
            raise ValueError(f"{name}: k={k} neighbours but the table holds {self.table.kmax} per token: build it "
                             f"with k >= {k}")
        if self.residual != "principled" and k >= 1 and k + 1 > self.table.kmax:
            raise ValueError(f"{name}: residual={self.residual!r} zeroes the first k + 1 = {k + 1} neighbours, but "
                             f"the table holds {self.table.kmax}: build it with k >= {k + 1}")
        if vocab_size is not None or codebook is not None:
            self.table.check(self.table.vocab_size if vocab_size is None else vocab_size, codebook)


@struct.dataclass
class LanternPPRule(_RelaxedRule):
    """LANTERN++: the relaxation of `_RelaxedRule` with the multiplicative bound S_m <= (lam - 1) r(x), so that
    q~(x) <= lam * r(x). lam = 1 is exact. Paper settings: k = 10, lam in {2, 3}."""

    table: Any  # jspec.parts.neighbours.NeighbourTable
    k: Any  # neighbours considered (<= table.kmax)
    lam: Any  # lambda >= 1
    residual: str = struct.field(pytree_node=False, default="principled")
    drafts: str = struct.field(pytree_node=False, default="sampled")

    def bound(self, rx):
        return (self.lam - 1.0) * rx

    def check(self, vocab_size: int | None = None, codebook=None) -> None:
        """ValueError for lam < 1, k out of [0, table.kmax], an unknown mode; with `vocab_size` / `codebook` also
        for a table made for another vocabulary or codebook."""
        if not float(jnp.asarray(self.lam)) >= 1.0:
            raise ValueError(f"LanternPPRule: lam must be >= 1 (lam = 1 is the exact rule), got {self.lam!r}")
        self._check_common(vocab_size, codebook)


@struct.dataclass
class LanternRule(_RelaxedRule):
    """LANTERN: the relaxation of `_RelaxedRule` with the additive bound S_m <= delta (the total variation between r
    and q~ is S_m*). delta = 0 is exact. LANTERN's default: k = 1000, delta = 0.1; LANTERN++'s ablation: delta in
    {1e-4, 2e-4, 5e-4}."""

    table: Any
    k: Any
    delta: Any  # >= 0
    residual: str = struct.field(pytree_node=False, default="principled")
    drafts: str = struct.field(pytree_node=False, default="sampled")

    def bound(self, rx):
        return jnp.broadcast_to(jnp.asarray(self.delta, jnp.float32), rx.shape)

    def check(self, vocab_size: int | None = None, codebook=None) -> None:
        """ValueError for delta < 0, k out of [0, table.kmax], an unknown mode; with `vocab_size` / `codebook` also
        for a table made for another vocabulary or codebook."""
        if not float(jnp.asarray(self.delta)) >= 0.0:
            raise ValueError(f"LanternRule: delta must be >= 0 (delta = 0 is the exact rule), got {self.delta!r}")
        self._check_common(vocab_size, codebook)


RULES = {"residual": Residual, "q1": Q1}  # the relaxed rules need a neighbour table: build them, no names


def as_rule(rule) -> Rule:
    """A rule object from a rule or its name ("residual", "q1")."""
    if isinstance(rule, str):
        if rule not in RULES:
            raise ValueError(f"unknown verification rule {rule!r}; use one of {sorted(RULES)} or a jspec.parts.rules.Rule")
        return RULES[rule]()
    if not isinstance(rule, Rule):
        raise ValueError(f"a rule must be a name ({sorted(RULES)}) or a jspec.parts.rules.Rule, got {type(rule).__name__}")
    return rule


def _walk_keys(key: jax.Array, max_depth: int, width: int) -> jax.Array:
    """[B, n] the walk's keys, each row its own: one per (depth, child), the bonus's last."""
    return RK.split(key, max_depth * width + 1)


def root_verdict(key: jax.Array, logits: jax.Array, max_depth: int, width: int, sampling, sp) -> Verdict:
    """The verdict of `greedy` / `stochastic` on a tree whose root alone is valid, from the root's logits [B, V]:
    nothing accepted (the path is the root's), the bonus the target's argmax, or its draw with the walk's bonus key
    (a rule's residual is the target's distribution until a child is tried)."""
    B = logits.shape[0]
    path = jnp.zeros((B, max_depth + 1), jnp.int32)
    if sampling.greedy:
        bonus = jnp.argmax(logits, axis=-1)
    else:
        p = SM.probs(logits[:, None], sampling, sp)[:, 0]
        bonus = RK.categorical(_walk_keys(key, max_depth, width)[:, -1], jnp.log(jnp.maximum(p, 0.0)))
    return Verdict(path, jnp.zeros((B,), jnp.int32), bonus.astype(jnp.int32))


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
    keys = _walk_keys(key, max_depth, M)

    def try_child(d, k, cur, carry):
        """Child k of each row's current node: accepted (the walk moves there) or rejected (the rule's residual)."""
        resid, qd, new_cur, moved, alive = carry
        c = t.children[rows, cur, k]  # [B]
        cc = jnp.maximum(c, 0)
        live = alive & ~moved & (c >= 0) & node_valid[rows, cc]
        x = tokens[rows, cc]
        u = RK.uniform(keys[:, d * M + k])
        acc = live & (u * rule.draft_mass(qd, x) <= rule.target_mass(resid, x))
        rej = live & ~acc
        rej_resid, rej_q = rule.reject(resid, qd, x)
        resid = jnp.where(rej[:, None], rej_resid, resid)
        if qd is not None:
            qd = jnp.where(rej[:, None], rej_q, qd)
        resid = jnp.where(acc[:, None], p[rows, cc], resid)
        return resid, qd, jnp.where(acc, cc, new_cur), moved | acc, alive

    def level(d, carry):  # one depth: the children of each row's current node in order, until one is accepted
        cur, resid, alive, accepted = carry
        qd = None if q is None else q[rows, cur]  # [B, V]
        resid, _, new_cur, moved, _ = jax.lax.fori_loop(
            0, M, lambda k, c: try_child(d, k, cur, c), (resid, qd, cur, jnp.zeros((B,), bool), alive))
        return new_cur, resid, alive & moved, accepted + moved.astype(jnp.int32)

    init = (jnp.zeros((B,), jnp.int32), p[:, 0], jnp.ones((B,), bool), jnp.zeros((B,), jnp.int32))
    cur, resid, _, accepted = jax.lax.fori_loop(0, max_depth, level, init)
    bonus = RK.categorical(keys[:, -1], jnp.log(jnp.maximum(resid, 0.0))).astype(jnp.int32)
    return Verdict(_path_of(cur, t, max_depth), accepted, bonus)
