"""Jacobi self-drafting: the target drafts a window of its own future tokens, one Jacobi iteration per round.

Speculative Jacobi decoding (SJD; Teng et al., arXiv 2410.01699) keeps a window of G draft tokens after the newest
committed token, and with each the distribution q it was drawn from. A round's verify forward over the window
gives, at every window position, the target's distribution conditioned on the committed text and the window's
earlier tokens as they stood (a Jacobi iteration). The rule accepts a prefix of the window with min(1, p/q) and
draws the token after it from the residual; the window then slides past the committed tokens, and each position
it still covers is drawn anew from the distribution the last verify gave it: that is the next round's draft, so a
round costs the one target forward that verifies it. Positions with no distribution yet (the window's new end)
are initialised (`init`):
- "random" (SJD's code): a token drawn uniformly from those the constraint allows there (the image grammar's
  image codes; the whole vocabulary without one), offered with q = one-hot at that token, which the rule then
  accepts with probability p(x) (the q = 1 rule, exact whatever token is offered);
- "uniform": the same draw, offered with q = the uniform distribution it came from (accepted with min(1, |A|
  p(x)) over the allowed set A: still exact, never less).
How a position's new token is drawn from its new distribution p' (`coupling`):
- "independent" (SJD): a fresh draw from p';
- "maximal" (MC-SJD; So et al., arXiv 2510.24211): a maximal coupling with the previous round's token x at that
  position, drawn from q: keep x with probability min(1, p'(x) / q(x)), else draw from norm(max(0, p' - q)). The
  new token is distributed as p' all the same, and stays x whenever the two distributions allow it, which raises
  acceptance where consecutive iterations agree.
Both are exact: a position's draft is drawn, given everything that decides the positions before it, from the q
the rule reads (a token at position j never influences the distributions of positions before j), so the chain
rule's output follows the target. Greedy decoding draws every distribution's argmax (Jacobi decoding proper) and
equals AR. Positions whose distribution a round did not compute (a row that drafted nothing, an AR round) keep
their token and q. The distributions are the sampler's (`jspec.core.sampling.probs` of the verify's logits:
temperature, top-k, top-p, and CFG and the constraint where the target is guided), so what a window offers is
what the rule compares it with.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec.core import rowkeys as RK
from jspec.core import sampling as SM
from jspec.parts.protocols import Catchup, DraftEnv, Drafter, Prepared, Setup, TargetPrefill

COUPLINGS = ("independent", "maximal")
INITS = ("random", "uniform")


@struct.dataclass
class JacobiState:
    tok: jax.Array  # [B, G] the window's drafts, position i the (i + 1)-th token after `last`
    q: jax.Array  # [B, G, V] the distribution each was drawn from
    drawn: jax.Array  # [B, G] bool: tok / q hold a draft there
    p: jax.Array  # [B, G, V] the target's distribution there from the last verify, not yet drawn from
    fresh: jax.Array  # [B, G] bool: p holds one there


def _log(x: jax.Array) -> jax.Array:
    return jnp.where(x > 0, jnp.log(jnp.maximum(x, 1e-38)), -jnp.inf)


def maximal_coupling(key: jax.Array, p: jax.Array, x: jax.Array, q: jax.Array, has_x: jax.Array) -> jax.Array:
    """[B, G] tokens distributed as p [B, G, V], each coupled maximally with x [B, G] drawn from q [B, G, V]: x is
    kept with probability min(1, p(x) / q(x)), else the token comes from norm(max(0, p - q)); where `has_x` is
    False, a plain draw from p. `key`: [B] row keys."""
    keys = RK.split(key, 2)
    k_keep, k_draw = keys[:, 0], keys[:, 1]
    at = lambda d: jnp.take_along_axis(d, x[..., None], axis=-1)[..., 0]  # noqa: E731
    u = RK.uniform(k_keep, x.shape[1:])
    keep = has_x & (u * at(q) <= at(p))
    resid = jnp.maximum(p - q, 0.0)
    resid = jnp.where(has_x[..., None] & (resid.sum(-1, keepdims=True) > 1e-30), resid, p)
    return jnp.where(keep, x, RK.categorical(k_draw, _log(resid))).astype(jnp.int32)


def independent_draw(key: jax.Array, p: jax.Array, x: jax.Array, q: jax.Array, has_x: jax.Array) -> jax.Array:
    """[B, G] tokens drawn from p [B, G, V] afresh, whatever the previous round drew (SJD)."""
    return RK.categorical(RK.split(key, 2)[:, 1], _log(p)).astype(jnp.int32)


@struct.dataclass
class JacobiDrafter(Drafter):
    """Jacobi self-drafting (see the module docstring) under `jspec.parts.plans.WindowPlan`: no model of its own,
    its window (the plan's depth) carried from round to round."""

    coupling: str = struct.field(pytree_node=False, default="maximal")
    fill: str = struct.field(pytree_node=False, default="random")  # how new positions start (the module's `init`)
    constraint: Any = None  # the decode's logit constraint (its allowed tokens are what "random" draws from)

    verify_logits = True

    def check(self, target) -> None:
        if self.coupling not in COUPLINGS:
            raise ValueError(f"Jacobi coupling must be one of {COUPLINGS}, got {self.coupling!r}")
        if self.fill not in INITS:
            raise ValueError(f"Jacobi init must be one of {INITS}, got {self.fill!r}")

    def prepare(self, setup: Setup) -> Prepared:
        """Reads nothing of the prompt (any prompt the target takes, images included); keeps the constraint."""
        drafter = self.replace(constraint=setup.constraint)
        return Prepared(drafter, None, int(np.max(setup.lengths)), setup.tokens.shape[1])

    def init(self, env: DraftEnv, prefill: TargetPrefill, prompt, max_len: int) -> JacobiState:
        B, G, V = env.last.shape[0], env.needs.depth, env.target.vocab_size
        zeros = jnp.zeros((B, G, V), jnp.float32)
        return JacobiState(jnp.zeros((B, G), jnp.int32), zeros, jnp.zeros((B, G), bool), zeros,
                           jnp.zeros((B, G), bool))

    def _allowed(self, env: DraftEnv, G: int, V: int) -> jax.Array:
        """[B, G, V] bool: the tokens the constraint allows at the window's positions (every token without one)."""
        B = env.last.shape[0]
        if self.constraint is None:
            return jnp.ones((B, G, V), bool)
        g = env.n_out[:, None] + jnp.arange(G)[None]  # `last` is generated token n_out - 1
        ok = jnp.isfinite(self.constraint.apply(jnp.zeros((B, G, V), jnp.float32), g))
        return ok | ~jnp.any(ok, axis=-1, keepdims=True)

    def window(self, env: DraftEnv, st: JacobiState, key: jax.Array):
        """This round's window: each position drawn from its new distribution (coupled with its previous draft
        under "maximal"), kept where it has none, initialised where it has no draft either."""
        B, G, V = st.q.shape
        keys = RK.split(key, 2)
        k_init, k_new = keys[:, 0], keys[:, 1]
        allowed = self._allowed(env, G, V)
        init_tok = RK.categorical(k_init, jnp.where(allowed, 0.0, -jnp.inf)).astype(jnp.int32)
        if self.fill == "random":
            init_q = jax.nn.one_hot(init_tok, V, dtype=jnp.float32)
        else:
            init_q = allowed / jnp.sum(allowed, axis=-1, keepdims=True)
        draw = maximal_coupling if self.coupling == "maximal" else independent_draw
        new = draw(k_new, st.p, st.tok, st.q, st.drawn)
        tok = jnp.where(st.fresh, new, jnp.where(st.drawn, st.tok, init_tok))
        pick = lambda a, b, c: jnp.where(st.fresh[..., None], a, jnp.where(st.drawn[..., None], b, c))  # noqa: E731
        q = pick(st.p, st.q, init_q)
        return tok, q, st.replace(tok=tok, q=q, drawn=jnp.ones_like(st.drawn), fresh=jnp.zeros_like(st.fresh))

    def catch_up(self, env: DraftEnv, st: JacobiState) -> JacobiState:
        return st  # nothing to read: `commit` slides the window

    def commit(self, env: DraftEnv, st: JacobiState, c: Catchup) -> JacobiState:
        """The window slid past the step's committed tokens (the accepted drafts and the bonus): position i now
        holds old position a + 1 + i; its new distribution is the verify's at node a + 1 + i (the token after it),
        where the verify computed that node."""
        B, G, V = st.q.shape
        m = c.accepted[:, None] + 1 + jnp.arange(G)[None]  # [B, G] the old position each new one was
        inside = m < G
        mi = jnp.minimum(m, G - 1)
        node = jnp.minimum(m, G)
        rows = lambda x, i: jnp.take_along_axis(x, i.reshape(i.shape + (1,) * (x.ndim - 2)), axis=1)  # noqa: E731
        probs = SM.probs(rows(c.logits, node), env.ctx.sampling, env.sp)  # [B, G, V]
        has_p = rows(c.prop.valid, node) & (m <= G)
        old_fresh = rows(st.fresh, mi) & inside
        p = jnp.where(has_p[..., None], probs, rows(st.p, mi))
        slid = st.replace(tok=rows(st.tok, mi), q=rows(st.q, mi), drawn=rows(st.drawn, mi) & inside, p=p,
                          fresh=has_p | old_fresh)
        return jax.tree.map(lambda new, old: jnp.where(c.active.reshape((B,) + (1,) * (new.ndim - 1)), new, old),
                            slid, st)
