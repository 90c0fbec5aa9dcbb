"""The guard: how deep each row drafts next round, from what the rounds verified so far and what a round costs on
this device, so that speculating never costs more than it returns.

Per row it keeps `alpha[d]`, the chance that draft position d + 1 is accepted once position d was (the root's
children at d = 0): the mean of the rounds that reached the position, the prior counting as `prior_rounds` of them,
until the weight of a new round falls to `rate`; from there an exponential average over the last ~1 / `rate` rounds.
The first rounds after a reset move it fast, a long run slowly. Where a drafting row's rounds do not reach a position
it drifts back towards `prior` (`drift`). The expected tokens of a round drafted to depth k are
E(k) = 1 + sum_{d<=k} prod_{j<=d} alpha[j] (E(0) = 1: the round is an AR step). With `step_s[k]` the measured seconds
of a round at depth k (`jspec.costs`), a row's own choice is k_b = argmax_k E_b(k) / step_s[k]; the batch pays one
width, so it drafts to the K that maximises sum_b E_b(min(k_b, K)) / step_s[K] over its decoding rows, and row b to
min(k_b, K). Depth 0 for every row makes the step verify the root alone and the drafter only catch up
(`Drafter.catch_up`).

A position a row has not observed since its estimates (re)started counts as certain in the choice (alpha 1: the
optimistic start of a bandit), so a row's first round, and each try, drafts to the depth that would pay were every
draft accepted, and learns from what the target verifies. Without it, a drafter whose worth the prior understates
is never tried (a prior of 0.5 makes one dear round look worse than an AR step however good the drafter), and a row
that drafts shallow never learns its deeper positions. Unobserved positions behind a rejected one cost nothing: the
reach of position d is the product of the estimates before it.

A row that stopped drafting tries again after `retry` rounds without drafts: its estimates restart from the prior.
Each try waits twice as long as the last (up to `max_wait` rounds), until a try holds: `retry` drafting rounds in a
row set the wait back to `retry`. So a text the drafter cannot follow costs a few tries, logarithmically many in
its length, and a run of bad luck on a text it follows costs at most `retry` AR rounds.

Lossless: a decision reads only rounds already verified, never the drafts it limits, so greedy stays AR's tokens
and sampling stays exact (the depth of a round is fixed before its drafts are drawn).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jspec.parts.controllers import Asks, Controller, Decision, Record, asks_of


class GuardState(struct.PyTreeNode):
    inner: Any  # the wrapped controller's state
    alpha: jax.Array  # [B, D] float32: acceptance estimate at each draft position
    active: jax.Array  # [B] bool: the row was decoding at the last round
    seen: jax.Array  # [B, D] float32: rounds that reached each position since the row's estimates last restarted
    idle: jax.Array  # [B] int32: rounds in a row without drafts
    streak: jax.Array  # [B] int32: drafting rounds in a row
    wait: jax.Array  # [B] int32: rounds without drafts before the row tries again


def expected_tokens(alpha: jax.Array) -> jax.Array:
    """[B, D + 1]: the expected tokens a round commits when it drafts to depth k = 0 .. D (the bonus included)."""
    reach = jnp.cumprod(alpha, axis=-1)
    return jnp.concatenate([jnp.ones(alpha.shape[:-1] + (1,), alpha.dtype), 1.0 + jnp.cumsum(reach, axis=-1)], -1)


@struct.dataclass
class Guard(Controller):
    """Picks each round's depth per row (0: an AR step) from measured costs and running acceptance estimates (the
    module docstring). `step_s` [D + 1]: seconds of a round that drafts to depth 0 .. D; `inner`: the strategy's own
    controller (its decision runs first; the guard only lowers its depth); `force` >= 0 makes every row draft to
    that depth (what `jspec.costs.measure` times); `rate`, `prior`, `prior_rounds`, `drift`, `retry`, `max_wait`:
    the estimates and the tries of the module docstring. The numbers are data: new costs do not recompile."""

    step_s: jax.Array
    inner: Any = None
    rate: jax.Array | float = 0.1
    prior: jax.Array | float = 0.5
    drift: jax.Array | float = 0.01
    force: jax.Array | int = -1
    defers: int = struct.field(pytree_node=False, default=24)  # AR rounds a drafter may leave unread (`Controller`)
    prior_rounds: jax.Array | float = 2.0
    retry: jax.Array | int = 16
    max_wait: jax.Array | int = 256

    skips = True

    @property
    def asks(self) -> Asks:
        return asks_of(self.inner)

    @property
    def stops(self) -> bool:
        return self.inner is not None and self.inner.stops

    def init(self, batch: int, max_depth: int) -> GuardState:
        if jnp.shape(self.step_s) != (max_depth + 1,):
            raise ValueError(f"the guard's costs give {jnp.shape(self.step_s)} round times; the plan drafts to depth "
                             f"{max_depth}, so it needs {max_depth + 1} (depth 0 .. {max_depth})")
        inner = None if self.inner is None else self.inner.init(batch, max_depth)
        zeros = jnp.zeros((batch,), jnp.int32)
        return GuardState(inner, jnp.full((batch, max_depth), self.prior, jnp.float32), jnp.ones((batch,), bool),
                          jnp.zeros((batch, max_depth), jnp.float32), zeros, zeros,
                          jnp.full((batch,), self.retry, jnp.int32))

    def choose(self, state: GuardState, cap: jax.Array | None = None) -> jax.Array:
        """[B] int32 depths: each row's own best, capped by the batch's best shared depth (and by `cap`); positions
        not observed since the row's estimates (re)started count as accepted (the module docstring)."""
        E = expected_tokens(jnp.where(state.seen > 0, state.alpha, 1.0))  # [B, D + 1]
        cost = jnp.maximum(jnp.asarray(self.step_s, jnp.float32), 1e-12)
        D = E.shape[1] - 1
        own = jnp.argmax(E / cost[None], axis=1).astype(jnp.int32)
        if cap is not None:
            own = jnp.minimum(own, cap)
        K = jnp.arange(D + 1, dtype=jnp.int32)
        at = jnp.minimum(own[:, None], K[None])  # [B, K]: the depth row b drafts to when the batch drafts to K
        gain = jnp.sum(jnp.where(state.active[:, None], jnp.take_along_axis(E, at, axis=1), 0.0), axis=0)
        best = jnp.argmax(gain / cost).astype(jnp.int32)
        return jnp.minimum(own, best)

    def decide(self, state: GuardState, key) -> Decision:
        if self.inner is None:
            d = Decision()
        else:  # the inner controller decides only when some row would draft (its cap only lowers depths)
            wanted = jnp.any(self.choose(state) > 0) | (jnp.asarray(self.force) > 0)
            shapes = jax.eval_shape(self.inner.decide, state.inner, key)
            nothing = lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)  # noqa: E731
            d = jax.lax.cond(wanted, lambda: self.inner.decide(state.inner, key), nothing)
        cap = None if d.depth is None else d.depth.astype(jnp.int32)
        depth = self.choose(state, cap)
        depth = jnp.where(jnp.asarray(self.force) >= 0, jnp.asarray(self.force, jnp.int32), depth)
        return d._replace(depth=depth, info={**(d.info or {}), "speculated": depth > 0})

    def observe(self, state: GuardState, record: Record) -> GuardState:
        D = state.alpha.shape[1]
        pos = jnp.arange(1, D + 1)[None]
        a = record.accepted[:, None]
        live = record.active[:, None]
        drafted = record.active & (record.depth > 0)
        reached = (a >= pos - 1) & (pos <= record.depth[:, None]) & live
        hit = (a >= pos).astype(jnp.float32)
        rate, prior, drift, m = (jnp.asarray(x, jnp.float32) for x in (self.rate, self.prior, self.drift,
                                                                      self.prior_rounds))
        seen = state.seen + reached
        weight = jnp.maximum(rate, 1.0 / (seen + m))  # the prior counts as m rounds until a round weighs `rate`
        alpha = jnp.where(reached, state.alpha + weight * (hit - state.alpha),
                          jnp.where(drafted[:, None] & live, state.alpha + drift * (prior - state.alpha), state.alpha))
        streak = jnp.where(drafted, state.streak + 1, jnp.where(record.active, 0, state.streak))
        idle = jnp.where(drafted, 0, state.idle + record.active)
        wait = jnp.where(streak >= jnp.asarray(self.retry), jnp.asarray(self.retry, jnp.int32), state.wait)
        tries = record.active & (idle >= wait)  # restart from the prior; the next try waits twice as long
        alpha = jnp.where(tries[:, None], prior, alpha)
        seen = jnp.where(tries[:, None], 0.0, seen)
        wait = jnp.where(tries, jnp.minimum(2 * wait, jnp.asarray(self.max_wait, jnp.int32)), wait)
        idle = jnp.where(tries, 0, idle)
        inner = state.inner if self.inner is None else self.inner.observe(state.inner, record)
        return GuardState(inner, alpha, record.active, seen, idle.astype(jnp.int32), streak.astype(jnp.int32),
                          wait.astype(jnp.int32))

    def start(self, state: GuardState, prefill) -> GuardState:
        return state if self.inner is None else state.replace(inner=self.inner.start(state.inner, prefill))

    def stop(self, state: GuardState, level, aux, limit, key):
        return self.inner.stop(state.inner, level, aux, limit, key)

    def check(self, target, drafter) -> None:
        if self.inner is not None:
            self.inner.check(target, drafter)
