"""Ensemble weights of a multi-view drafter, re-picked each block from past verification (TABED's policies).

`EnsembleWeights` keeps, per row and per candidate weight vector w^j (rows of `candidates` [J, m]), running sums
over the verified positions of the decode so far (those with a draft distribution: the accepted drafts and the
first rejected one; the bonus position has none) of
    KL(p || q^j),  TVD(p, q^j) = 1/2 sum |p - q^j|,  [argmax q^j == argmax p],     q^j = sum_k w^j_k q^(k),
with p the target's softmax at temperature 1 (also when decoding greedily) and q^(k) view k's softmax at
temperature 1 (the drafter's aux). With a finite `window` h the sums cover the last h verified positions (a ring
of [B, h, J] scalars); never a V-sized history. Before any verified position (the first block) the weights are
uniform. Policies:
    "grid"     w = w^j*, j* by `criterion`: "kld" / "tvd" (least sum), "num-accepted" (most matches, the first on
               ties), "num-accepted-kld" (most matches, least KL among them; TABED's code default);
    "inverse"  candidates are the pure views; e_k the sum of `distance` ("kld" or "tvd"); w_k proportional to
               (1/e_k)^(1/tau) ("normalized", TABED's code) or softmax((1/e_k) / tau) ("softmax", the paper);
               1/e = 1e11 where e = 0;
    "static"   w = `fixed` every block.
Numbers (candidates, fixed, tau) are leaves: new values do not recompile.
"""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec.parts.controllers import Asks, Controller, Decision, Record

POLICIES = ("grid", "inverse", "static")
CRITERIA = ("kld", "tvd", "num-accepted", "num-accepted-kld")
INVERSE_FORMS = ("normalized", "softmax")
INF_INVERSE = 1e11  # 1/e where a view's error is 0


def simplex_grid(m: int, n: int) -> np.ndarray:
    """[J, m] weight vectors with entries in {0, 1/n, ..., 1} summing to 1; for m = 2 the rows are
    [1 - j/n, j/n], j = 0..n (pure first view first)."""
    if m < 1 or n < 1:
        raise ValueError(f"a weight grid needs m >= 1 views and n >= 1 steps, got m={m}, n={n}")
    rows = [c for c in itertools.product(range(n + 1), repeat=m) if sum(c) == n]
    rows.sort(key=lambda c: tuple(-x for x in c))
    return np.asarray(rows, np.float32) / n


@struct.dataclass
class EnsembleWeights(Controller):
    """Per-row ensemble weights of a multi-view drafter (see the module docstring)."""

    candidates: jax.Array  # [J, m]
    fixed: jax.Array  # [m] (policy "static")
    tau: jax.Array  # () temperature of the inverse-error weights
    policy: str = struct.field(pytree_node=False, default="grid")
    criterion: str = struct.field(pytree_node=False, default="num-accepted-kld")
    distance: str = struct.field(pytree_node=False, default="kld")
    inverse: str = struct.field(pytree_node=False, default="normalized")
    window: int | None = struct.field(pytree_node=False, default=None)

    @property
    def asks(self) -> Asks:
        if self.policy == "static":
            return Asks()
        return Asks(target_logits=True, draft_probs=True, draft_aux=True)

    @classmethod
    def make(cls, m: int, policy: str = "grid", n: int = 10, criterion: str = "num-accepted-kld",
             distance: str = "kld", inverse: str = "normalized", tau: float = 1.0, window: int | None = None,
             fixed=None) -> "EnsembleWeights":
        """Checked construction for m views."""
        if policy not in POLICIES:
            raise ValueError(f"unknown weight policy {policy!r}; expected one of {POLICIES}")
        if criterion not in CRITERIA:
            raise ValueError(f"unknown criterion {criterion!r}; expected one of {CRITERIA}")
        if distance not in ("kld", "tvd"):
            raise ValueError(f"unknown distance {distance!r}; expected 'kld' or 'tvd'")
        if inverse not in INVERSE_FORMS:
            raise ValueError(f"unknown inverse-error form {inverse!r}; expected one of {INVERSE_FORMS}")
        if window is not None and (isinstance(window, bool) or not isinstance(window, (int, np.integer))
                                   or window < 1):
            raise ValueError(f"window must be a positive integer (verified positions) or None (all), got {window!r}")
        if not tau > 0:
            raise ValueError(f"tau must be > 0, got {tau}")
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"n must be a positive integer, got {n!r}")
        if policy == "grid":
            cand = simplex_grid(m, int(n))
        else:
            cand = np.eye(m, dtype=np.float32)
        fixed = np.full((m,), 1.0 / m, np.float32) if fixed is None else np.asarray(fixed, np.float32)
        if fixed.shape != (m,) or np.any(fixed < 0) or not fixed.sum() > 0:
            raise ValueError(f"fixed weights must be {m} non-negative numbers, not all 0; got {fixed.tolist()}")
        return cls(jnp.asarray(cand), jnp.asarray(fixed / fixed.sum()), jnp.float32(tau), policy, criterion,
                   distance, inverse, None if window is None else int(window))

    @property
    def m(self) -> int:
        return self.candidates.shape[1]

    def check(self, target, drafter) -> None:
        m = getattr(drafter, "m", None)
        if m is None:
            raise ValueError(f"ensemble weights need a multi-view drafter; got {type(drafter).__name__}")
        if m != self.m:
            raise ValueError(f"the weights are for {self.m} views, the drafter has {m}")

    def init(self, batch: int, max_depth: int):
        J = self.candidates.shape[0]
        h = 1 if self.window is None else self.window
        ring = jnp.zeros((batch, h, 3, J), jnp.float32)  # per verified position: KL, TVD, match of each candidate
        return {"sums": jnp.zeros((batch, 3, J), jnp.float32), "ring": ring, "n": jnp.zeros((batch,), jnp.int32)}

    def _totals(self, state):
        return state["sums"] if self.window is None else state["ring"].sum(axis=1)

    def decide(self, state, key) -> Decision:
        B = state["n"].shape[0]
        kl, tvd, match = jnp.moveaxis(self._totals(state), 1, 0)  # [B, J] each
        if self.policy == "static":
            return Decision(weights=jnp.broadcast_to(self.fixed, (B, self.m)).astype(jnp.float32))
        if self.policy == "grid":
            if self.criterion == "kld":
                j = jnp.argmin(kl, axis=1)
            elif self.criterion == "tvd":
                j = jnp.argmin(tvd, axis=1)
            elif self.criterion == "num-accepted":
                j = jnp.argmax(match, axis=1)
            else:
                best = match >= jnp.max(match, axis=1, keepdims=True)
                j = jnp.argmin(jnp.where(best, kl, jnp.inf), axis=1)
            w = self.candidates[j]
        else:
            e = kl if self.distance == "kld" else tvd
            inv = jnp.where(e > 0, 1.0 / jnp.maximum(e, 1e-30), INF_INVERSE)
            logits = jnp.log(inv) / self.tau if self.inverse == "normalized" else inv / self.tau
            w = jax.nn.softmax(logits, axis=1)
        uniform = jnp.full((B, self.m), 1.0 / self.m)
        return Decision(weights=jnp.where((state["n"] > 0)[:, None], w, uniform).astype(jnp.float32))

    def scores(self, record: Record) -> tuple[jax.Array, jax.Array]:
        """(per verified position and candidate [B, D+1, 3, J]: KL(p || q^j), TVD, match; which positions count
        [B, D+1])."""
        logp = jax.nn.log_softmax(record.target_logits.astype(jnp.float32), axis=-1)  # [B, P, V]
        p = jnp.exp(logp)
        lq = record.draft_aux  # [B, P, m, V]
        top_p = jnp.argmax(logp, axis=-1)

        def one(w):
            logq = jax.nn.logsumexp(lq + jnp.log(w)[None, None, :, None], axis=2)  # [B, P, V]
            kl = jnp.sum(jnp.where(p > 0, p * (logp - jnp.maximum(logq, -1e30)), 0.0), axis=-1)
            tvd = 0.5 * jnp.sum(jnp.abs(p - jnp.exp(logq)), axis=-1)
            return jnp.stack([kl, tvd, (jnp.argmax(logq, axis=-1) == top_p).astype(jnp.float32)], axis=-1)

        per = jnp.moveaxis(jax.lax.map(one, self.candidates), 0, -1)  # [B, P, 3, J]
        j = jnp.arange(record.tokens.shape[1])[None]
        known = record.draft_known if record.draft_known is not None else j <= record.accepted[:, None]
        counts = known & (j <= record.accepted[:, None]) & (j < record.committed[:, None]) & record.active[:, None]
        return per, counts

    def observe(self, state, record: Record):
        if self.policy == "static":
            return {**state, "n": state["n"] + record.committed}
        per, counts = self.scores(record)
        nv = counts.sum(axis=1).astype(jnp.int32)
        if self.window is None:
            sums = state["sums"] + jnp.sum(jnp.where(counts[..., None, None], per, 0.0), axis=1)
            return {**state, "sums": sums, "n": state["n"] + nv}
        h = self.window
        rank = jnp.cumsum(counts, axis=1) - 1  # order among this step's verified positions
        keep = counts & (rank >= nv[:, None] - h)  # more than h new ones: only the last h land
        slot = jnp.where(keep, (state["n"][:, None] + rank) % h, h)  # h: out of range, dropped
        rows = jnp.arange(slot.shape[0])[:, None]
        ring = state["ring"].at[rows, slot].set(per, mode="drop")
        return {**state, "ring": ring, "n": state["n"] + nv}
