"""Speculative decoding with a separate draft model: tree drafting, tree-attention verification, commit.

One step has three phases, each a pure function of the decode state (`sd_step` composes them; the profiling
mode of `jspec.decode` times them one by one):
  1. `sd_draft`: the draft reads the tokens it has not seen yet ([accepted drafts..., bonus] of the last step,
     padded to D+1), which also gives the root's distribution; a tree policy then expands the tree level by
     level, writing each level's K/V into the draft cache's scratch slots (static trees: the tree's own levels;
     dynamic trees: EAGLE-2's beam, reranked to a node budget). An optional controller sets each row's depth
     limit first.
  2. `sd_verify`: one target forward over all N nodes (positions = committed length + depth, ancestor mask).
  3. `sd_accept`: a verification rule picks the accepted path and the bonus token; the accepted nodes' K/V move
     into the target's committed prefix with one gather; the draft keeps only committed tokens and re-reads the
     accepted ones at the next step.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec import cache as kvc
from jspec import loop
from jspec import sampling as S
from jspec import sharding as SH
from jspec import verify as V
from jspec.trees import StaticTree, TreeArrays, device_tree, tree_from_pool


class Proposal(NamedTuple):
    """A drafted tree for every row. Node 0 is the root (`last`)."""

    tokens: jax.Array  # [B, N]
    valid: jax.Array  # [B, N] nodes the verifier may accept
    tree: TreeArrays  # [B, ...]
    q: jax.Array | None  # [B, N, V] distribution each node's children were drawn from (residual sampling only)
    fed: jax.Array | None = None  # [B, N] int32: the draft scratch offset (past its committed length) holding node
    # i's K/V, -1 where the draft did not feed node i; the accepted nodes it fed are committed, not fed again


def _fed_levels(fed: jax.Array, start: int, slots, run) -> jax.Array:
    """`fed` with nodes start.. marked as fed at `slots` when the level's forward ran (`run` None: always)."""
    slots = jnp.asarray(slots, jnp.int32)
    if run is not None:
        slots = jnp.where(run, slots, -1)
    return fed.at[:, start:start + slots.shape[-1]].set(jnp.broadcast_to(slots, (fed.shape[0], slots.shape[-1])))


@struct.dataclass
class DraftState:
    cache: kvc.KVCache  # committed length = tokens the draft has read, `last` excluded
    pending: jax.Array  # [B, policy.pending_width] committed tokens the draft has not read yet, ending with `last`
    n_pending: jax.Array  # [B] int32


class Feedback(NamedTuple):
    """What a controller learns from the previous step of each row."""

    accepted: jax.Array  # [B] drafts accepted (bonus excluded)
    limit: jax.Array  # [B] the depth limit that step ran with
    active: jax.Array  # [B] the row was still decoding


class Controller(Protocol):
    """Per-step policy over the draft depth (EESD's Thompson sampling, SAGE-style planners, ...).

    A controller is a hashable object (it is part of the compilation key) whose state is a pytree.
    `step(state, feedback, key) -> (state, limit [B] int32)` runs on device before each draft phase; drafts
    deeper than `limit[b]` are not proposed for row b, and draft levels no row needs are skipped. Shapes never
    change, so a new limit does not recompile.
    """

    def init(self, batch: int, max_depth: int) -> Any: ...

    def step(self, state: Any, feedback: Feedback, key: jax.Array) -> tuple[Any, jax.Array]: ...


@struct.dataclass
class SDState:
    """`DecodeState.aux` of draft-model strategies."""

    draft: DraftState
    ctrl: Any  # controller state (None without a controller)
    feedback: Feedback


def init_draft(draft, tokens, lengths, max_len: int, first: jax.Array, width: int, inputs=None) -> DraftState:
    """Prefill the draft on its prompt (its own view, which may differ from the target's; `inputs` its modality
    inputs); the first target token waits in `pending`."""
    cache = loop.new_cache_for(draft, tokens.shape[0], max_len)
    _, _, cache = loop.prefill(draft, tokens, lengths, cache, inputs)
    pending = jnp.zeros((tokens.shape[0], width), jnp.int32).at[:, 0].set(first)
    return DraftState(cache, pending, jnp.ones((tokens.shape[0],), jnp.int32))


def init_sd_state(draft_state: DraftState, controller, max_depth: int) -> SDState:
    B = draft_state.n_pending.shape[0]
    ctrl = None if controller is None else controller.init(B, max_depth)
    zeros = jnp.zeros((B,), jnp.int32)
    return SDState(draft_state, ctrl, Feedback(zeros, zeros + max_depth, jnp.ones((B,), bool)))


def _read_pending(draft, ds: DraftState):
    """Feed the pending tokens; returns (logits after `last` [B, 1, V], draft cache with `last` committed,
    RoPE position of `last`)."""
    P = ds.pending.shape[1]
    dc = ds.cache
    pos = kvc.positions(dc, jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), ds.pending.shape))
    fo = draft.forward(ds.pending, pos, dc, logits_at=(ds.n_pending - 1)[:, None])
    dc = kvc.commit(fo.cache, ds.n_pending)
    return fo.logits, dc, dc.length + dc.pos_offset - 1


def _log_probs(logits: jax.Array, ctx: loop.StepContext, sp) -> jax.Array:
    """Draft log-probabilities used to rank and draw children: the sampler's distribution when sampling (-inf
    where top-k/top-p filter), the plain softmax when greedy (so lower ranks are the draft's next guesses)."""
    return jax.nn.log_softmax(S.process_logits(logits, ctx.sampling, sp), axis=-1)


def _level_forward(draft, tokens, positions, dc, mask, offset: int, run):
    """Draft forward of one tree level into scratch slots; skipped (zero logits) when `run` is False."""
    def go(dc):
        fo = draft.forward(tokens, positions, dc, mask, write_offset=offset)
        return fo.logits, fo.cache

    if run is None:
        return go(dc)
    B, T = tokens.shape
    skip = lambda dc: (jnp.zeros((B, T, draft.vocab_size), jnp.float32), dc)
    return jax.lax.cond(run, go, skip, dc)


@dataclasses.dataclass(frozen=True)
class StaticPolicy:
    """Expand a fixed tree. Children are the top-ranked draft tokens, or, with `draw` and sampling, draws
    without replacement in draw order (what the residual rule needs to stay lossless)."""

    tree: StaticTree
    draw: bool = True

    @property
    def num_nodes(self) -> int:
        return self.tree.num_nodes

    @property
    def max_depth(self) -> int:
        return self.tree.max_depth

    @property
    def scratch(self) -> int:
        """Cache slots a step uses past the committed tokens, in the target and (after the catch-up feed) in the
        draft."""
        return self.tree.num_nodes

    @property
    def is_chain(self) -> bool:
        return self.tree.is_chain

    @property
    def pending_width(self) -> int:
        """Tokens the draft still has to read after a step: the deepest accepted node when it was not fed (every
        other accepted node has an accepted child, so the draft fed it) and the bonus token."""
        return 2

    def propose(self, ctx, draft, ds: DraftState, last, key, sp, limit) -> tuple[Proposal, kvc.KVCache]:
        tree = self.tree
        B = last.shape[0]
        N, D = tree.num_nodes, tree.max_depth
        sample = self.draw and not ctx.sampling.greedy
        logits, dc, root_pos = _read_pending(draft, ds)
        tokens = jnp.zeros((B, N), jnp.int32).at[:, 0].set(last)
        q_all = jnp.zeros((B, N, draft.vocab_size), jnp.float32) if sample else None
        valid = jnp.ones((B, N), bool)
        fed = jnp.full((B, N), -1, jnp.int32)
        depth = jnp.asarray(tree.depth)
        anc = jnp.asarray(tree.ancestor)
        keys = jax.random.split(key, D)
        for d in range(D):
            s, e = tree.levels[d]
            logp = _log_probs(logits, ctx, sp)  # [B, e - s, V]
            cs, ce = tree.levels[d + 1]
            m = int(max(tree.rank[cs:ce]) + 1)
            if sample:
                q_all = q_all.at[:, s:e].set(jnp.exp(logp))
                logp_choice = logp + jax.random.gumbel(keys[d], logp.shape)
            else:
                logp_choice = logp
            choice = jax.lax.top_k(logp_choice, m)[1].astype(jnp.int32)  # [B, e - s, m]
            par = tree.parent[cs:ce] - s
            kids = choice[:, par, tree.rank[cs:ce]]  # [B, ce - cs]
            tokens = tokens.at[:, cs:ce].set(kids)
            lk = jnp.take_along_axis(logp[:, par], kids[..., None], axis=-1)[..., 0]
            ok = jnp.isfinite(lk) if limit is None else jnp.isfinite(lk) & (d + 1 <= limit[:, None])
            valid = valid.at[:, cs:ce].set(ok)
            if d + 1 < D:
                # level d+1 nodes: node i sits in scratch slot i - 1 (the root is committed)
                mask = jnp.broadcast_to(anc[cs:ce, 1:ce], (B, ce - cs, ce - 1))
                pos = root_pos[:, None] + depth[None, cs:ce]
                run = None if limit is None else jnp.any(limit >= d + 2)
                logits, dc = _level_forward(draft, kids, pos, dc, mask, cs - 1, run)
                fed = _fed_levels(fed, cs, np.arange(cs - 1, ce - 1), run)
        # a node is usable only if its whole path is
        t = device_tree(tree, B)
        valid = jnp.all(valid[:, None, :] | ~t.ancestor, axis=-1)
        return Proposal(tokens, valid, t, q_all, fed), dc


@dataclasses.dataclass(frozen=True)
class DynamicPolicy:
    """EAGLE-2's dynamic tree, per row inside `jit`.

    Level 1 = the root's top_k draft tokens. Each later level expands the `top_k` best nodes of the level above
    (the beam, by cumulative draft log-prob) into top_k children each, one draft forward per level. All
    candidates are then reranked by cumulative log-prob and the best `total` become the tree (parents before
    children). `depth` is the deepest draft level (depth - 1 draft forwards after the root's).
    """

    depth: int
    top_k: int
    total: int

    @property
    def num_nodes(self) -> int:
        return self.total + 1

    @property
    def max_depth(self) -> int:
        return self.depth

    @property
    def scratch(self) -> int:
        return max(self.total + 1, (self.depth - 1) * self.top_k)  # target: the tree; draft: the beam levels

    @property
    def pool_size(self) -> int:
        return self.top_k + (self.depth - 1) * self.top_k ** 2

    @property
    def is_chain(self) -> bool:
        return False

    @property
    def pending_width(self) -> int:
        return 2  # as for static trees: only beam nodes get children, and the draft fed every beam node

    def propose(self, ctx, draft, ds: DraftState, last, key, sp, limit) -> tuple[Proposal, kvc.KVCache]:
        B = last.shape[0]
        K, D = self.top_k, self.depth
        logits, dc, root_pos = _read_pending(draft, ds)
        score, tok = jax.lax.top_k(_log_probs(logits, ctx, sp)[:, 0], K)  # [B, K]
        pool_tok, pool_score = [tok], [score]
        pool_parent = [jnp.full((B, K), -1, jnp.int32)]
        pool_depth = [jnp.ones((B, K), jnp.int32)]
        beam_tok, beam_score, beam_pool = tok, score, jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32), (B, K))
        pool_fed = jnp.full((B, self.pool_size), -1, jnp.int32)  # pool node -> its draft scratch slot
        slots = (D - 1) * K  # beam nodes of level l sit in scratch slots (l-1)K .. lK-1
        beam_anc = jnp.zeros((B, max(slots, 1), max(slots, 1)), bool)
        beam_anc = beam_anc.at[:, jnp.arange(min(K, slots)), jnp.arange(min(K, slots))].set(True)
        for lvl in range(1, D):
            a, b = (lvl - 1) * K, lvl * K
            run = None if limit is None else jnp.any(limit >= lvl + 1)
            pos = jnp.broadcast_to(root_pos[:, None] + lvl, (B, K))
            logits, dc = _level_forward(draft, beam_tok, pos, dc, beam_anc[:, a:b, :b], a, run)
            slot = jnp.broadcast_to(jnp.arange(a, b, dtype=jnp.int32), (B, K))
            slot = slot if run is None else jnp.where(run, slot, -1)
            pool_fed = pool_fed.at[jnp.arange(B)[:, None], beam_pool].set(slot)
            cs, ct = jax.lax.top_k(_log_probs(logits, ctx, sp), K)  # [B, K, K]
            cand_score = (beam_score[:, :, None] + cs).reshape(B, K * K)
            cand_tok = ct.reshape(B, K * K).astype(jnp.int32)
            start = K + (lvl - 1) * K * K
            pool_tok.append(cand_tok)
            pool_score.append(cand_score)
            pool_parent.append(jnp.repeat(beam_pool, K, axis=1))
            pool_depth.append(jnp.full((B, K * K), lvl + 1, jnp.int32))
            if lvl + 1 < D:
                beam_score, pick = jax.lax.top_k(cand_score, K)
                beam_tok = jnp.take_along_axis(cand_tok, pick, axis=1)
                beam_pool = (start + pick).astype(jnp.int32)
                parent_slot = a + pick // K
                new_rows = jnp.take_along_axis(beam_anc, parent_slot[:, :, None], axis=1)  # [B, K, slots]
                new_rows = new_rows | jax.nn.one_hot(b + jnp.arange(K), slots, dtype=bool)[None]
                beam_anc = beam_anc.at[:, b:b + K].set(new_rows)
        pool_score = jnp.concatenate(pool_score, axis=1)
        pool_depth = jnp.concatenate(pool_depth, axis=1)
        if limit is not None:
            pool_score = jnp.where(pool_depth > limit[:, None], -jnp.inf, pool_score)
        sel, valid, tree = tree_from_pool(jnp.concatenate(pool_parent, axis=1), pool_depth, pool_score,
                                          self.total, D, K)
        kids = jnp.take_along_axis(jnp.concatenate(pool_tok, axis=1), sel, axis=1)
        tokens = jnp.concatenate([last[:, None].astype(jnp.int32), kids], axis=1)
        fed = jnp.concatenate([jnp.full((B, 1), -1, jnp.int32), jnp.take_along_axis(pool_fed, sel, axis=1)], axis=1)
        return Proposal(tokens, valid, tree, None, fed), dc


def sd_draft(ctx: loop.StepContext, policy, controller, draft, state: loop.DecodeState):
    """Phase 1: the controller's depth limits, then the drafted tree. Returns (state, proposal)."""
    aux: SDState = state.aux
    k_draft, k_ctrl = jax.random.split(jax.random.fold_in(loop.step_key(state), 1))
    limit, ctrl = None, aux.ctrl
    if controller is not None:
        ctrl, limit = controller.step(aux.ctrl, aux.feedback, k_ctrl)
        limit = jnp.clip(limit.astype(jnp.int32), 1, policy.max_depth)
    prop, dcache = policy.propose(ctx, draft, aux.draft, state.last, k_draft, state.sp, limit)
    if limit is None:
        limit = jnp.full(state.last.shape, policy.max_depth, jnp.int32)
    aux = aux.replace(draft=aux.draft.replace(cache=dcache), ctrl=ctrl, feedback=aux.feedback._replace(limit=limit))
    return state.replace(aux=aux), prop


def sd_verify(target, state: loop.DecodeState, prop: Proposal):
    """Phase 2: one target forward over every node. Returns (state with the nodes' K/V in scratch, logits)."""
    tc = state.cache
    pos = kvc.positions(tc, prop.tree.depth)
    fo = target.forward(prop.tokens, pos, tc, prop.tree.ancestor)
    return state.replace(cache=fo.cache), fo.logits


def sd_accept(ctx: loop.StepContext, policy, rule: str, state: loop.DecodeState, prop: Proposal, logits):
    """Phase 3: verify, commit the accepted path (target cache, output, draft's pending tokens)."""
    aux: SDState = state.aux
    B = state.last.shape[0]
    D = policy.max_depth
    k_verify = jax.random.fold_in(loop.step_key(state), 2)
    if ctx.sampling.greedy:
        verdict = V.greedy(prop.tokens, logits, prop.valid, prop.tree, D)
    else:
        p = S.probs(logits, ctx.sampling, state.sp)
        verdict = V.stochastic(k_verify, prop.tokens, p, prop.q, prop.valid, prop.tree, D, rule)
    a = verdict.accepted
    path_tokens = jnp.take_along_axis(prop.tokens, verdict.path, axis=1)  # [B, D+1], root first
    new = jnp.concatenate([path_tokens[:, 1:], jnp.zeros((B, 1), jnp.int32)], axis=1)
    new = new.at[jnp.arange(B), a].set(verdict.bonus)  # [accepted drafts..., bonus]
    active = ~state.done
    n_keep = jnp.where(active, a + 1, 0)
    # a chain's accepted entries already sit in slots length.. in order: no gather and write of every layer
    tc = kvc.commit(state.cache, n_keep) if policy.is_chain else kvc.commit_path(state.cache, verdict.path, n_keep)
    state = state.replace(cache=tc, last=jnp.where(active, verdict.bonus, state.last))
    state, n_eff = loop.commit_tokens(ctx, state, new, a + 1)
    ds = _draft_catch_up(policy, aux, prop, verdict.path, new, a, active, state.last)
    ds = ds.replace(cache=SH.constrain(ctx.placement, ds.cache, replicated=True))
    feedback = Feedback(jnp.where(active, a, 0), aux.feedback.limit, active)
    state = state.replace(aux=aux.replace(draft=ds, feedback=feedback))
    drafted = jnp.where(active, jnp.sum(prop.valid[:, 1:], axis=1), 0).astype(jnp.int32)
    return loop.record_step(state, n_eff, drafted)


def _draft_catch_up(policy, aux: SDState, prop: Proposal, path, new, a, active, last) -> DraftState:
    """The draft's state after a step that accepted a[b] drafts, `new` [B, D+1] = [accepted drafts..., bonus].

    The leading accepted nodes the draft already fed (`prop.fed`) are committed from its scratch slots: in place
    for a chain, with one gather otherwise. Only the rest wait in `pending` for the next step's first forward.
    A finished row feeds nothing new: it re-reads `last` at its slot."""
    dc = aux.draft.cache
    W = policy.pending_width
    D = path.shape[1] - 1
    if prop.fed is None:
        if W < D + 1:
            raise ValueError(f"a proposal without `fed` needs pending_width >= {D + 1} (the whole path), got {W}")
        fed, slots = jnp.zeros_like(a), None
    else:
        slots = jnp.take_along_axis(prop.fed, path[:, 1:], axis=1)  # [B, D]
        usable = (slots >= 0) & (jnp.arange(D)[None, :] < a[:, None])
        fed = jnp.sum(jnp.cumprod(usable.astype(jnp.int32), axis=1), axis=1)
    fed = jnp.where(active, fed, 0)
    if slots is not None:
        dc = kvc.commit(dc, fed) if policy.is_chain else kvc.commit_path(dc, jnp.maximum(slots, 0), fed)
    idx = jnp.minimum(fed[:, None] + jnp.arange(W)[None, :], new.shape[1] - 1)
    pending = jnp.take_along_axis(new, idx, axis=1)
    last_only = jnp.zeros_like(pending).at[:, 0].set(last)
    return DraftState(dc.replace(length=jnp.where(active, dc.length, dc.length - 1)),
                      jnp.where(active[:, None], pending, last_only), jnp.where(active, a + 1 - fed, 1))


def sd_step(ctx: loop.StepContext, policy, rule: str, controller, target, draft, state: loop.DecodeState):
    """One draft-verify-commit round for every row."""
    state, prop = sd_draft(ctx, policy, controller, draft, state)
    state, logits = sd_verify(target, state, prop)
    return sd_accept(ctx, policy, rule, state, prop, logits)
