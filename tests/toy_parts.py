"""Toy plug-ins, one per seam of the engine, written against the public part protocols (tests/test_parts.py)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec.parts.controllers import Asks, Controller, Decision
from jspec.parts.drafters import Drafter, ModelDrafter
from jspec.parts.protocols import LayeredTree
from jspec.parts.protocols import PrefillHook
from jspec.parts.rules import Rule

HISTORY = 64


@struct.dataclass
class RecordingController(Controller):
    """Keeps, per row and committed token (the first, from the prefill, excluded), the target's and the drafter's
    log-probability of that token as the step's `Record` reported them."""

    asks = Asks(target_logits=True, draft_probs=True)

    def init(self, batch, max_depth):
        z = jnp.zeros((batch, HISTORY), jnp.float32)
        return {"t": z, "q": z, "q_known": jnp.zeros((batch, HISTORY), bool), "n": jnp.zeros((batch,), jnp.int32)}

    def decide(self, state, key):
        return Decision()

    def observe(self, state, record):
        B, P = record.tokens.shape
        j = jnp.arange(P)[None]
        keep = j < record.committed[:, None]
        idx = jnp.where(keep, state["n"][:, None] + j, HISTORY)  # out of range: dropped
        at = lambda x: jnp.take_along_axis(x, record.tokens[..., None], axis=-1)[..., 0]
        t = at(jax.nn.log_softmax(record.target_logits, axis=-1))
        q = jnp.log(at(record.draft_probs))
        rows = jnp.arange(B)[:, None]
        return {"t": state["t"].at[rows, idx].set(t, mode="drop"), "q": state["q"].at[rows, idx].set(q, mode="drop"),
                "q_known": state["q_known"].at[rows, idx].set(record.draft_known, mode="drop"),
                "n": state["n"] + record.committed}


@struct.dataclass
class CycleDepth(Controller):
    """Step s of a row drafts 1 + s % period levels; `period` is a number (a leaf): changing it does not recompile."""

    period: jax.Array

    def init(self, batch, max_depth):
        return jnp.zeros((batch,), jnp.int32)

    def decide(self, state, key):
        return Decision(depth=1 + state % self.period)

    def observe(self, state, record):
        return state + 1


@struct.dataclass
class ScheduledDepth(Controller):
    """Step s of every row drafts `depths[s % len(depths)]` levels (0: an AR step); `defers` as a guard sets it."""

    depths: tuple = struct.field(pytree_node=False)
    defers: int = struct.field(pytree_node=False, default=0)

    skips = True

    def init(self, batch, max_depth):
        return jnp.zeros((batch,), jnp.int32)

    def decide(self, state, key):
        return Decision(depth=jnp.asarray(self.depths, jnp.int32)[state % len(self.depths)])

    def observe(self, state, record):
        return state + 1


@struct.dataclass
class ResidualByHooks(Rule):
    """The exact residual rule, rewritten from the hooks alone."""

    draws = True

    def draft_mass(self, q, x):
        return q[jnp.arange(x.shape[0]), x]

    def reject(self, resid, q, x):
        r = jnp.maximum(resid - q, 0.0)
        r = jnp.where(r.sum(-1, keepdims=True) > 0, r / jnp.maximum(r.sum(-1, keepdims=True), 1e-30), resid)
        q2 = q.at[jnp.arange(x.shape[0]), x].set(0.0)
        q2 = jnp.where(q2.sum(-1, keepdims=True) > 0, q2 / jnp.maximum(q2.sum(-1, keepdims=True), 1e-30), q)
        return r, q2


@struct.dataclass
class ResampleFromTarget(ResidualByHooks):
    """A wrong rule: after a rejection it keeps drawing from the target's distribution instead of the residual."""

    exact = False

    def reject(self, resid, q, x):
        return resid, super().reject(resid, q, x)[1]


@struct.dataclass
class Relaxed(Rule):
    """A relaxed q = 1 rule: a draft x is accepted with probability min(1, lam * r(x)) (lam = 1: exact Q1)."""

    lam: jax.Array
    exact = False

    def target_mass(self, resid, x):
        return jnp.minimum(1.0, self.lam * resid[jnp.arange(x.shape[0]), x])

    def reject(self, resid, q, x):
        r = resid.at[jnp.arange(x.shape[0]), x].set(0.0)
        return r / jnp.maximum(r.sum(-1, keepdims=True), 1e-30), q


def per_row_trees(layout_levels, trees):
    """LayeredTree arrays [K, N] of K trees, each a list of (slot, parent slot, rank) over a layout's slots."""
    K, N = len(trees), layout_levels[-1][1]
    parent = np.full((K, N), -1, np.int32)
    rank = np.zeros((K, N), np.int32)
    valid = np.zeros((K, N), bool)
    valid[:, 0] = True
    for k, tree in enumerate(trees):
        for slot, par, r in tree:
            parent[k, slot], rank[k, slot], valid[k, slot] = par, r, True
    return LayeredTree(parent, rank, valid)


@struct.dataclass
class FixedTrees(Controller):
    """Hands the plan per-row trees every step, row b the b % K-th of `trees` [K, N] (a plan builder's input,
    SAGE-style)."""

    trees: LayeredTree

    def init(self, batch, max_depth):
        return jnp.arange(batch, dtype=jnp.int32) % self.trees.parent.shape[0]

    def decide(self, state, key):
        return Decision(tree=jax.tree.map(lambda x: jnp.take(x, state, axis=0), self.trees))


@struct.dataclass
class TwoViews(Drafter):
    """Two prompt views of one draft model (the whole prompt, and its last `tail` tokens), drafted as one and mixed
    in probability space with fixed weights `w` [2] (a leaf: new weights do not recompile)."""

    a: ModelDrafter
    b: ModelDrafter
    w: jax.Array
    tail: int = struct.field(pytree_node=False, default=3)

    def check(self, target):
        self.a.check(target)

    def map_models(self, fn):
        return self.replace(a=self.a.map_models(fn), b=self.b.map_models(fn))

    def prepare(self, setup):
        pa = self.a.prepare(setup)
        rows = [setup.tokens[i, :setup.lengths[i]][-self.tail:] for i in range(len(setup.lengths))]
        pb = self.b.prepare(setup._replace(draft_prompt=rows))
        return pa._replace(drafter=self.replace(a=pa.drafter, b=pb.drafter), prompt=(pa.prompt, pb.prompt))

    def init(self, env, prefill, prompt, max_len):
        return (self.a.init(env, prefill, prompt[0], max_len),
                self.b.init(env, prefill, prompt[1], max_len))

    def _mix(self, la, lb):
        w = jnp.log(self.w)
        return jnp.logaddexp(w[0] + la, w[1] + lb)

    def root(self, env, ds):
        la, _, sa = self.a.root(env, ds[0])
        lb, _, sb = self.b.root(env, ds[1])
        return self._mix(la, lb), None, (sa, sb)

    def level(self, env, ds, tokens, depth, mask, offset, run):
        la, _, sa = self.a.level(env, ds[0], tokens, depth, mask, offset, run)
        lb, _, sb = self.b.level(env, ds[1], tokens, depth, mask, offset, run)
        return self._mix(la, lb), None, (sa, sb)

    def commit(self, env, ds, catchup):
        return self.a.commit(env, ds[0], catchup), self.b.commit(env, ds[1], catchup)


@struct.dataclass
class AttendedPrompt(PrefillHook):
    """A prefill hook: the target's attention from the last `queries` prompt tokens picks the `keep` most attended
    prompt tokens (in prompt order) as the drafter's prompt."""

    keep: int = struct.field(pytree_node=False, default=3)
    queries: int = struct.field(pytree_node=False, default=2)

    def asks(self, tokens, lengths, inputs):
        j = jnp.arange(tokens.shape[1])[None]
        w = ((j >= lengths[:, None] - self.queries) & (j < lengths[:, None])) / self.queries
        return {"attn_query_weights": w.astype(jnp.float32)}

    def draft_prompt(self, prefill, prompt):
        tokens, lengths, inputs = prompt
        T = prefill.tokens.shape[1]
        score = jnp.where(jnp.arange(T)[None] < prefill.lengths[:, None], prefill.attn[:, :T], -jnp.inf)
        top = jnp.sort(jax.lax.top_k(score, self.keep)[1], axis=1)
        return jnp.take_along_axis(prefill.tokens, top, axis=1), jnp.full_like(lengths, self.keep), inputs


def attended(target, prompts, keep=3, queries=2):
    """What `AttendedPrompt` picks, computed on the host from a plain forward (the reference)."""
    from ports.core import cache as kvc
    from ports.core.prompts import normalize_prompt

    tokens, lengths, _ = normalize_prompt(prompts, target.config.vocab_size)
    B, T = tokens.shape
    layers, kvh, hd = target.kv_layout
    cache = kvc.init_cache(layers, B, kvh, T, hd, jnp.float32)
    j = np.arange(T)[None]
    w = (((j >= lengths[:, None] - queries) & (j < lengths[:, None])) / queries).astype(np.float32)
    fo = target.forward(jnp.asarray(tokens), jnp.asarray(np.broadcast_to(j, (B, T))), cache,
                        attn_query_weights=jnp.asarray(w), fresh=True)
    attn = np.asarray(fo.attn)[:, :T]
    out = []
    for b in range(B):
        a = np.where(np.arange(T) < lengths[b], attn[b], -np.inf)
        out.append(tokens[b, np.sort(np.argsort(-a, kind="stable")[:keep])])
    return out



@struct.dataclass
class StopAt(Controller):
    """Plans the plan's whole depth, then ends every row's draft after level `level` (a number: a leaf)."""

    level: jax.Array
    stops = True

    def decide(self, state, key):
        return Decision(depth=jnp.full((key.shape[0],), 99, jnp.int32))

    def stop(self, state, level, aux, limit, key):
        return jnp.where(level >= self.level, jnp.minimum(limit, level), limit)
