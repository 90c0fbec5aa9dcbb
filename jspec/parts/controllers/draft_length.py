"""Draft-length controllers (EESD): how many tokens to draft next round, per row, on device.

- `FixedK(k)`: always k.
- `BetaTS(alpha0, beta0)`: Thompson sampling over the chance that the next draft token is accepted. After each
  draft token i a stop bit chi_i ~ Bernoulli(theta_i) is drawn with theta_i ~ Beta(alpha, beta) drawn afresh per
  token; drafting stops at the first chi_i = 0, so a round drafts at least one token. The posterior moves once per
  round (EESD Eq. 3-4): with a accepted of k drafted, alpha += a and beta += min(2, k - a) (all accepted: 0; the
  last rejected: 1; an earlier one: 2), or with `clean=True` beta += min(a + 1, k) - a. Per row; reset per decode.

theta does not depend on the drafted tokens (the posterior changes only between rounds), so the whole round's stop
bits are drawn in `decide`, before drafting: the same distribution of draft lengths as drawing them token by token.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jspec.core import rowkeys as RK
from jspec.parts.controllers import Controller, Decision, Record


@struct.dataclass
class FixedK(Controller):
    """Draft exactly `k` tokens every round (clipped to the plan's depth); k is data (changing it does not
    recompile)."""

    k: jax.Array | int = 5

    def init(self, batch: int, max_depth: int):
        return jnp.zeros((batch,), jnp.int32)

    def decide(self, state, key) -> Decision:
        return Decision(depth=jnp.full(state.shape, self.k, jnp.int32))


class BetaState(struct.PyTreeNode):
    alpha: jax.Array  # [B] float32
    beta: jax.Array  # [B] float32
    max_depth: int = struct.field(pytree_node=False)


def leading_ones(bits: jax.Array) -> jax.Array:
    """[B, K] bool -> [B] number of leading True entries."""
    return jnp.sum(jnp.cumprod(bits.astype(jnp.int32), axis=1), axis=1)


@struct.dataclass
class BetaTS(Controller):
    """EESD's Beta-Thompson-sampling draft length (module docstring); alpha0, beta0 are data."""

    alpha0: jax.Array | float = 1.0
    beta0: jax.Array | float = 1.0
    clean: bool = struct.field(pytree_node=False, default=False)

    def init(self, batch: int, max_depth: int) -> BetaState:
        return BetaState(jnp.full((batch,), self.alpha0, jnp.float32), jnp.full((batch,), self.beta0, jnp.float32),
                         max_depth)

    def decide(self, state: BetaState, key) -> Decision:
        B, K = state.alpha.shape[0], state.max_depth
        ks = RK.split(key, 2)
        theta = RK.beta(ks[:, 0], state.alpha, state.beta, (K,))
        go_on = RK.uniform(ks[:, 1], (K,)) < theta  # chi_i = 1: draft token i + 1 too
        return Decision(depth=jnp.minimum(1 + leading_ones(go_on[:, :K - 1]), K).astype(jnp.int32))

    def observe(self, state: BetaState, record: Record) -> BetaState:
        a = record.accepted.astype(jnp.float32)
        k = jnp.minimum(record.depth, record.drafted).astype(jnp.float32)  # a tree's k: the path's depth
        fails = (jnp.minimum(a + 1.0, k) - a) if self.clean else jnp.minimum(2.0, k - a)
        on = record.active
        return state.replace(alpha=jnp.where(on, state.alpha + a, state.alpha),
                             beta=jnp.where(on, state.beta + jnp.maximum(fails, 0.0), state.beta))


def as_controller(spec, calibration=None):
    """"beta" -> BetaTS(); "cali" -> CaliTS(calibration) (a head's trained predictor); an int k -> FixedK(k); a
    controller object as is."""
    if isinstance(spec, str):
        if spec == "beta":
            return BetaTS()
        if spec == "cali":
            if calibration is None:
                raise ValueError("controller='cali' needs the head's calibration predictor, and this head has none: "
                                 "train one with `jspec train cali` (it is saved beside the head)")
            from jspec.parts.controllers.calibration import CaliTS

            return CaliTS(calibration)
        raise ValueError(f"unknown draft-length controller {spec!r}: use 'beta', 'cali', an int k, or a controller "
                         "object")
    if isinstance(spec, int):
        if spec < 1:
            raise ValueError(f"a fixed draft length must be >= 1, got {spec}")
        return FixedK(spec)
    return spec
