"""One speculative step for every strategy: a drafter, a tree plan, an acceptance rule, a controller.

The step has three phases with one signature, `phase(ctx, parts, target, carry) -> carry` (carry = (state,
proposal, verified)); `sd_step` composes them and the fused loop, the host-timed profile and the in-program
profile all run these same functions (`PHASES`):
  1. `sd_draft`: the controller decides the step (depth limits, weights, a per-row tree); the plan drives the
     drafter level by level into a `plans.Proposal`.
  2. `sd_verify`: one target forward over all N nodes (positions = committed length + depth, ancestor mask).
  3. `sd_accept`: the rule picks the accepted path and the bonus token; the accepted nodes' K/V move into the
     target's committed prefix with one gather; the drafter commits; the controller observes a `Record`.
Where rows may draft nothing (a guard's depth 0, `decode(speculate=)`), a round in which no row drafts is the same
three phases at width one: the drafter only catches up, the plan's `with_skips` widths let the target verify the
root alone, and the rule's verdict on the root (`Rule.accept_root`) replaces the walk. There is one round path.
No method-specific code lives here: a method is a new drafter, plan, rule or controller (see `jspec.engine.strategy`).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from jspec.core import rowkeys as RK
from ports.core import cache as kvc
from jspec.engine import loop
from jspec.parts.controllers import Decision, Record
from jspec.parts.drafters import Catchup, DraftEnv, TargetPrefill
from jspec.parts.protocols import Proposal, when


@struct.dataclass
class SDAux:
    """`DecodeState.aux` of speculative strategies."""

    draft: Any  # the drafter's state
    ctrl: Any  # the controller's state (None without a controller)
    decided: dict  # per-step decisions kept for the stats: name -> [B, max_steps, ...]
    prefilled: dict  # the prefill hook's per-row facts kept for the stats (`PrefillHook.info`): name -> [B, ...]
    speculate: jax.Array | None = None  # [B] bool: rows that may draft (`decode(speculate=)`); None: every row


class Verified(NamedTuple):
    logits: jax.Array  # [B, N, V] the target's logits after each node
    hidden: tuple = ()  # [B, N, (streams,) D] per layer of `verify_layers`: the target's residual streams there


def verify_layers(parts, target) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(every layer whose residual stream the verify forward returns, in `Verified.hidden`'s order; the drafter's
    own, in the order `Catchup.hidden` concatenates them): the drafter's `verify_layers` when it reads hidden
    states, and the last layer when the controller does."""
    last = target.kv_layout[0]
    mine = tuple(int(i) for i in parts.drafter.verify_layers(last)) if parts.drafter.verify_hidden else ()
    return tuple(dict.fromkeys(mine + ((last,) if parts.needs.asks.hidden else ()))), mine


def sd_start(ctx: loop.StepContext, parts, target, state: loop.DecodeState, prefill: TargetPrefill, prompt,
             d_len: int, speculate: jax.Array | None = None) -> loop.DecodeState:
    """After the target's prefill: the prefill hook picks the drafter's prompt from the prefill's by-products, the
    drafter prefills (its cache `d_len` slots: its writes may reach past the target's, `Needs.per_step`), the
    controller starts. `speculate` [B] bool (or None: every row): the rows that may draft; the others take AR steps
    inside the same batch (depth 0)."""
    prefilled = {}
    if parts.prefill is not None:
        prefilled = dict(parts.prefill.info(prefill))
        prompt = parts.prefill.draft_prompt(prefill, prompt)
        d_len = parts.prefill.draft_len(d_len)  # a hook that shortens the draft's prompt shortens its cache
    needs = parts.needs
    env = draft_env(ctx, state, target, needs=needs)
    ds = parts.drafter.init(env, prefill, prompt, d_len)
    B = state.last.shape[0]
    ctrl, decided = None, {}
    if parts.controller is not None:
        ctrl = parts.controller.init(B, needs.depth)
        ctrl = parts.controller.start(ctrl, prefill)
        shapes = jax.eval_shape(parts.controller.decide, ctrl, state.key)
        steps = state.accepted.shape[1]
        made = {"depth": shapes.depth, "weights": shapes.weights, **(shapes.info or {})}
        decided = {name: jnp.zeros((B, steps) + s.shape[1:], s.dtype) for name, s in made.items() if s is not None}
    spec = None if speculate is None else jnp.asarray(speculate, bool)
    return state.replace(aux=SDAux(ds, ctrl, decided, prefilled, spec))


def draft_env(ctx, state, target, decision=None, needs=None, stop=None) -> DraftEnv:
    """The drafter's view of a decode state: the target's cache, `last` and the generated tokens as they stand."""
    return DraftEnv(ctx, state.sp, target, state.cache, state.last, decision, needs, state.out, state.n_out, stop)


def may_skip(parts, aux) -> bool:
    """Whether a round may draft nothing for every row (a guard's depth 0, or `decode(speculate=)`): then `sd_step`
    takes an AR round instead."""
    return aux.speculate is not None or (parts.controller is not None and parts.controller.skips)


def _round_keys(state):
    """[B] keys of this round's draft, controller and per-level stop."""
    ks = RK.split(RK.fold(loop.step_key(state), 1), 3)
    return ks[:, 0], ks[:, 1], ks[:, 2]


def sd_decide(ctx, parts, state) -> Decision:
    """The controller's decision for this round, its depths clipped to the plan's and zero for rows told not to
    speculate."""
    aux: SDAux = state.aux
    needs = parts.needs
    k_ctrl = _round_keys(state)[1]
    ctrl = parts.controller
    decision = Decision() if ctrl is None else ctrl.decide(aux.ctrl, k_ctrl)
    if decision.depth is not None:
        low = 0 if ctrl.skips else 1
        decision = decision._replace(depth=jnp.clip(decision.depth.astype(jnp.int32), low, needs.depth))
    if aux.speculate is not None:  # rows told not to speculate draft nothing: their step is an AR step
        depth = jnp.full(aux.speculate.shape, needs.depth, jnp.int32) if decision.depth is None else decision.depth
        decision = decision._replace(depth=jnp.where(aux.speculate, depth, 0))
    return decision


def _draft_env(ctx, parts, target, state, decision):
    aux: SDAux = state.aux
    needs = parts.needs
    ctrl = parts.controller
    k_stop = _round_keys(state)[2]
    stop = None
    if needs.stops:  # the controller may end a row's draft after any level (from what drafted it)
        stop = lambda level, out, lim: ctrl.stop(aux.ctrl, level, out, lim, RK.fold(k_stop, level))  # noqa: E731
    return draft_env(ctx, state, target, decision, needs, stop)


def _proposal_shapes(ctx, parts, target, state, decision) -> Proposal:
    env = _draft_env(ctx, parts, target, state, decision)
    k_draft = _round_keys(state)[0]
    propose = lambda ds: parts.plan.propose(env, parts.drafter, ds, k_draft, decision)  # noqa: E731
    return jax.eval_shape(lambda s: _propose_in(parts, propose, s)[1], state)


def _propose_in(parts, fn, state):
    """(the state after the draft, the proposal) of `fn(drafter state) -> (proposal, drafter state)`. A drafter
    that `borrows_cache` drafts in the target's cache, which comes back as the draft left it (written past the
    committed length only, where the verify writes next)."""
    ds = state.aux.draft
    if not parts.drafter.borrows_cache:
        prop, ds = fn(ds)
        return state.replace(aux=state.aux.replace(draft=ds)), prop
    prop, ds = fn(parts.drafter.lend(ds, state.cache))
    ds, cache = parts.drafter.give_back(ds)
    return state.replace(cache=cache, aux=state.aux.replace(draft=ds)), prop


def sd_draft(ctx, parts, target, carry):
    """Phase 1: the controller's decision, then the drafted tree (its `decision.depth`: the depth each row drafted
    to, after any per-level stop); where no row drafts (`may_skip`), the root alone while the drafter catches up."""
    state = carry[0]
    aux: SDAux = state.aux
    decision = sd_decide(ctx, parts, state)
    k_draft = _round_keys(state)[0]
    env = _draft_env(ctx, parts, target, state, decision)
    propose = lambda ds: parts.plan.propose(env, parts.drafter, ds, k_draft, decision)  # noqa: E731
    if not may_skip(parts, aux):
        state, prop = _propose_in(parts, propose, state)
    else:  # rows may draft nothing: when none drafts, the drafter only catches up and the tree is the root alone
        drafts = jnp.any((decision.depth > 0) & ~state.done)
        bare = root_only(_proposal_shapes(ctx, parts, target, state, decision), env.last, decision)
        # loops of zero or one trips, not a cond: the caches they carry are updated in place
        state, prop = when(drafts, lambda c: _propose_in(parts, propose, c[0]), (state, bare))
        if not parts.drafter.borrows_cache:  # (one that drafts in the target's cache has nothing to catch up)
            catch = lambda s: s.replace(aux=s.aux.replace(draft=parts.drafter.catch_up(env, s.aux.draft)))  # noqa: E731
            state = when(~drafts, catch, state)
    return state, prop, None


def root_only(shapes: Proposal, last: jax.Array, decision: Decision) -> Proposal:
    """A proposal of `shapes`' structure that offers nothing: the root (`last`) alone is valid, every node its own
    ancestor, no children; distributions zero."""
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    B, N = shapes.tokens.shape
    t = zeros.tree
    tree = t._replace(parent=jnp.full(t.parent.shape, -1, jnp.int32),
                      ancestor=jnp.broadcast_to(jnp.eye(N, dtype=bool), t.ancestor.shape),
                      children=jnp.full(t.children.shape, -1, jnp.int32))
    fed = None if shapes.fed is None else jnp.full(shapes.fed.shape, -1, jnp.int32)
    return zeros._replace(tokens=zeros.tokens.at[:, 0].set(last.astype(jnp.int32)),
                          valid=jnp.zeros((B, N), bool).at[:, 0].set(True), tree=tree, fed=fed, decision=decision)


def sd_verify(ctx, parts, target, carry):
    """Phase 2: one target forward over every node (the nodes' K/V land in the target cache's scratch). Where the
    plan trims the verify to the smallest static width that holds every row's tree (`verify_size`), each width is
    a loop of zero or one trips (`when`), so the forward writes the cache in place whichever width runs."""
    state, prop, _ = carry
    pos = kvc.positions(state.cache, prop.tree.depth)
    layers = verify_layers(parts, target)[0]
    N = prop.tokens.shape[1]

    def forward(n):
        def run(tc):
            kw = {"hidden_layers": layers} if layers else {}
            fo = target.forward(prop.tokens[:, :n], pos[:, :n], tc, prop.tree.ancestor[:, :n, :n], **kw)
            pad = lambda x: jnp.pad(x, ((0, 0), (0, N - n)) + ((0, 0),) * (x.ndim - 2))  # noqa: E731
            return kvc.pad_pending(fo.cache, N), pad(fo.logits), tuple(pad(h) for h in fo.hidden) if layers else ()
        return run

    sizes, pick = parts.plan.verify_size(prop, state.done)
    if pick is None or len(sizes) < 2:
        tc, logits, hid = forward(N)(state.cache)
    else:
        shapes = jax.eval_shape(forward(N), state.cache)
        zeros = lambda t: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), t)  # noqa: E731
        tc = state.cache if shapes[0].rec_new is None else state.cache.replace(rec_new=zeros(shapes[0].rec_new))
        out = (tc, *zeros(shapes[1:]))
        for i, n in enumerate(sizes):
            out = when(pick == i, lambda c, n=n: forward(n)(c[0]), out)
        tc, logits, hid = out
    return state.replace(cache=tc), prop, Verified(logits, hid)


def _along(x: jax.Array, path: jax.Array) -> jax.Array:
    """x [B, N, ...] at the path's nodes [B, P] -> [B, P, ...]."""
    return jnp.take_along_axis(x, path.reshape(path.shape + (1,) * (x.ndim - 2)), axis=1)


def _record(parts, target, prop, ver: Verified, verdict, new, n_eff, active, depth, drafted) -> Record:
    asks = parts.needs.asks
    path, a = verdict.path, verdict.accepted
    B, N = prop.tokens.shape
    on_path = jnp.zeros((B, N), jnp.int32).at[jnp.arange(B)[:, None], path].max(
        (jnp.arange(path.shape[1])[None] <= a[:, None]).astype(jnp.int32)) > 0
    rec = Record(accepted=jnp.where(active, a, 0), committed=n_eff, active=active, depth=depth, drafted=drafted,
                 path=path, on_path=on_path & active[:, None], tokens=new)
    if asks.target_logits:
        rec = rec._replace(target_logits=_along(ver.logits, path))
    if asks.draft_probs and prop.q is not None:
        rec = rec._replace(draft_probs=_along(prop.q, path),
                           draft_known=_along(prop.known, path) & (jnp.arange(path.shape[1])[None] <= a[:, None]))
    if asks.draft_aux and prop.aux is not None:
        rec = rec._replace(draft_aux=jax.tree.map(lambda x: _along(x, path), prop.aux))
    if asks.root_topk:
        rec = rec._replace(root_topk=jax.lax.top_k(jnp.exp(prop.root_logp), asks.root_topk)[0])
    if asks.node_topk:
        rec = rec._replace(node_topk=prop.node_topk, node_known=prop.node_known & active[:, None])
    if asks.hidden:
        end = jnp.take_along_axis(path, a[:, None], axis=1)  # the node the bonus token follows
        last = ver.hidden[verify_layers(parts, target)[0].index(target.kv_layout[0])]
        rec = rec._replace(hidden=_along(last, end)[:, 0])
    return rec


def sd_accept(ctx, parts, target, carry):
    """Phase 3: the verdict, the commit (target cache, output, drafter), the controller's observation. Where no row
    offers a draft, the verdict on the root alone and the commit of one token (an AR step's work)."""
    state, prop, ver = carry
    D = parts.plan.max_depth
    k_verify = RK.fold(loop.step_key(state), 2)
    accept = lambda: parts.rule.accept(k_verify, prop, ver.logits, D, ctx.sampling, state.sp)  # noqa: E731
    offers = None
    if not may_skip(parts, state.aux):
        verdict = accept()
    else:  # when no row offers a draft, the rule's verdict on the root alone: an AR step's cost, the same tokens
        offers = jnp.any(~state.done & jnp.any(prop.valid[:, 1:], axis=1))
        root = lambda: parts.rule.accept_root(k_verify, ver.logits[:, 0], D, prop.tree.children.shape[2],  # noqa: E731
                                              ctx.sampling, state.sp)
        verdict = jax.lax.cond(offers, accept, root)
    active = ~state.done
    n_keep = jnp.where(active, verdict.accepted + 1, 0)
    # a chain's accepted entries already sit in slots length.. in order: no gather and write of every layer; nor
    # the root alone, where no row offered a draft
    if parts.plan.is_chain:
        tc = kvc.commit(state.cache, n_keep)
    elif offers is None:
        tc = kvc.commit_path(state.cache, verdict.path, n_keep)
    else:  # (a hybrid target's recurrent state moves first, the same way in both cases: the root is node 0)
        tc = kvc.commit_state(state.cache, verdict.path, n_keep)
        tc = when(offers, lambda c: kvc.commit_path(c, verdict.path, n_keep), tc)
        tc = when(~offers, lambda c: kvc.commit(c, n_keep), tc)
    return _conclude(ctx, parts, target, state.replace(cache=tc), prop, ver, verdict)


def _conclude(ctx, parts, target, state, prop, ver: Verified, verdict):
    """After the verdict and the target cache's commit: the tokens, the drafter's commit, the controller's
    observation and the step's record."""
    aux: SDAux = state.aux
    plan = parts.plan
    B = state.last.shape[0]
    D = plan.max_depth
    a = verdict.accepted
    path_tokens = jnp.take_along_axis(prop.tokens, verdict.path, axis=1)  # [B, D+1], root first
    new = jnp.concatenate([path_tokens[:, 1:], jnp.zeros((B, 1), jnp.int32)], axis=1)
    new = new.at[jnp.arange(B), a].set(verdict.bonus)  # [accepted drafts..., bonus]
    active = ~state.done
    state = state.replace(last=jnp.where(active, verdict.bonus, state.last))
    state, n_eff = loop.commit_tokens(ctx, state, new, a + 1)
    env = draft_env(ctx, state, target, prop.decision, parts.needs)
    hid = None
    if parts.drafter.verify_hidden:  # the drafter's layers, concatenated on the last axis
        every, mine = verify_layers(parts, target)
        hid = jnp.concatenate([_along(ver.hidden[every.index(i)], verdict.path) for i in mine], axis=-1)
    fed = None if prop.fed is None else jnp.take_along_axis(prop.fed, verdict.path[:, 1:], axis=1)
    logits = ver.logits if parts.drafter.verify_logits else None  # every node's, zeros past a trimmed verify
    ds = parts.drafter.commit(env, aux.draft, Catchup(prop, verdict.path, new, a, active, plan.is_chain, hid, fed,
                                                      logits))
    drafted = jnp.where(active, jnp.sum(prop.valid[:, 1:], axis=1), 0).astype(jnp.int32)
    ctrl, decided = aux.ctrl, aux.decided
    if parts.controller is not None:
        depth = prop.decision.depth
        depth = jnp.full((B,), D, jnp.int32) if depth is None else depth
        ctrl = parts.controller.observe(ctrl, _record(parts, target, prop, ver, verdict, new, n_eff, active, depth, drafted))
        made = {"depth": depth, "weights": prop.decision.weights, **(prop.decision.info or {})}
        decided = {k: v.at[:, state.step].set(made[k].astype(v.dtype)) for k, v in decided.items()}
    state = state.replace(aux=aux.replace(draft=ds, ctrl=ctrl, decided=decided))
    return loop.record_step(state, n_eff, drafted), None, None


PHASES = (("draft", sd_draft), ("verify", sd_verify), ("accept", sd_accept))


def sd_step(ctx, parts, target, state: loop.DecodeState) -> loop.DecodeState:
    """One draft-verify-commit round for every row (`PHASES`), the same path whether or not any row drafts."""
    carry = (state, None, None)
    for _, phase in PHASES:
        carry = phase(ctx, parts, target, carry)
    return carry[0]
