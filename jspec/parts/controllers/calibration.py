"""EESD's Cali-TS: Thompson sampling of the draft length with a learned acceptance predictor (EESD Alg. 3, Eq. 5-8).

After draft token i (1-based) the predictor scores the chance that it is accepted,
    theta_M = softmax(W_p [W^{min(i, P)} rms(H_t^T); H_{t+i}^D] + b_p)[1]       (Eq. 5; W_p is 2-way, so softmax)
from the target's last-layer hidden state at the node the previous round's bonus token follows (the prompt's last
token in the first round; `rms` is a weightless RMS normalisation, which W^i absorbs) and the draft's post-norm
hidden state that drafted token i. It is blended with the row's running acceptance rate theta_hat by the
Gaussian conjugate update (n = verifications so far):
    mu = (s_S^2 theta_M + n s_M^2 theta_hat) / (n s_M^2 + s_S^2),   sigma^2 = s_M^2 s_S^2 / (s_S^2 + n s_M^2)
(Eq. 6-7), theta ~ N(mu, sigma^2) clipped to [0, 1], and the draft goes on while chi ~ Bernoulli(theta) is 1.
theta_hat: by default (theta0 + sum r) / (1 + sum n) with Beta-TS's per-round successes r = a and trials
n = a + min(2, k - a); `literal_eq8=True` uses Eq. 8 as printed, which counts every committed token as a success
(theta_hat -> 1). Per row; reset per decode.

Weights on disk (`save_calibration`, `calibration.safetensors` next to a head's `eesd_head.json`), PyTorch
layout: `position_proj.{i}.weight` [D, D] (nn.Linear, no bias: W^{i+1}), `classifier.weight` [2, 2D] and
`classifier.bias` [2] (W_p, b_p).
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec.core import rowkeys as RK
from jspec.parts.controllers import Asks, Controller, Decision, Record
from jspec.parts.drafters import heads as H

CALI_WEIGHTS = "calibration.safetensors"
CALI_CONFIG = "calibration.json"


def _rms(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


@struct.dataclass
class CaliPredictor:
    """Eq. 5's predictor: w [P, D_T, D_T] (W^1..W^P, applied as h @ w[i - 1]), wp [D_T + D_D, 2], bp [2]."""

    w: jax.Array
    wp: jax.Array
    bp: jax.Array

    @property
    def positions(self) -> int:
        return self.w.shape[0]

    def logits(self, i, h_target: jax.Array, h_draft: jax.Array) -> jax.Array:
        """2-way logits [..., 2] for draft token i (int or traced, 1-based; i > P uses W^P)."""
        w = self.w[jnp.clip(jnp.asarray(i) - 1, 0, self.positions - 1)].astype(jnp.float32)
        z = jnp.concatenate([_rms(h_target) @ w, h_draft.astype(jnp.float32)], axis=-1)
        return z @ self.wp.astype(jnp.float32) + self.bp.astype(jnp.float32)

    def theta(self, i, h_target: jax.Array, h_draft: jax.Array) -> jax.Array:
        """theta_M: the predicted chance that draft token i is accepted."""
        return jax.nn.softmax(self.logits(i, h_target, h_draft), axis=-1)[..., 1]


def init_predictor(key, target_width: int, draft_width: int | None = None, positions: int = 10) -> CaliPredictor:
    """W^i = identity, W_p small and random, b_p = 0 (theta_M starts near 1/2)."""
    draft_width = target_width if draft_width is None else draft_width
    w = jnp.broadcast_to(jnp.eye(target_width, dtype=jnp.float32), (positions, target_width, target_width))
    wp = 0.02 * jax.random.normal(key, (target_width + draft_width, 2), jnp.float32)
    return CaliPredictor(jnp.array(w), wp, jnp.zeros((2,), jnp.float32))


def blend(theta_m, n, theta_hat, sigma_m, sigma_s):
    """Eq. 6-7: (mu, sigma^2) of the Gaussian theta is drawn from, after n verifications."""
    sm2, ss2 = jnp.square(sigma_m), jnp.square(sigma_s)
    den = n * sm2 + ss2
    return (ss2 * theta_m + n * sm2 * theta_hat) / den, sm2 * ss2 / den


class CaliState(struct.PyTreeNode):
    h_target: jax.Array  # [B, D_T] the target's last hidden state at the newest verified node
    n: jax.Array  # [B] verifications
    succ: jax.Array  # [B] sum of r (accepted drafts)
    trials: jax.Array  # [B] sum of n (Beta-TS trials)
    t: jax.Array  # [B] committed tokens (the literal Eq. 8)
    theta_hat: jax.Array  # [B]
    max_depth: int = struct.field(pytree_node=False)


@struct.dataclass
class CaliTS(Controller):
    """EESD's Cali-TS (module docstring). predictor: a `CaliPredictor` trained for the head it runs with
    (`jspec.tools.train.cali`); sigma_m, sigma_s, theta0 are data (changing them does not recompile)."""

    stops = True  # a row's draft may end after any level

    predictor: CaliPredictor
    sigma_m: jax.Array | float = 0.2
    sigma_s: jax.Array | float = 0.5
    theta0: jax.Array | float = 0.5
    literal_eq8: bool = struct.field(pytree_node=False, default=False)

    asks = Asks(hidden=True)

    def check(self, target, drafter) -> None:
        cfg = getattr(target, "config", None)
        width = getattr(cfg, "hidden_size", None) or getattr(getattr(cfg, "text", None), "hidden_size", None)
        if width is not None and width != self.predictor.w.shape[1]:
            raise ValueError(f"the calibration predictor reads target hidden states of width {self.predictor.w.shape[1]}"
                             f", the target's are {width}")
        if "hidden" not in getattr(drafter, "aux_keys", ()):
            raise ValueError(f"CaliTS reads the drafter's hidden states; {type(drafter).__name__} does not give them "
                             "(an early-exit drafter does)")

    def init(self, batch: int, max_depth: int) -> CaliState:
        z = jnp.zeros((batch,), jnp.float32)
        return CaliState(jnp.zeros((batch, self.predictor.w.shape[1]), jnp.float32), z, z, z, z,
                         jnp.full((batch,), self.theta0, jnp.float32), max_depth)

    def start(self, state: CaliState, prefill) -> CaliState:
        h = prefill.hidden_at(max(prefill.layers))  # the last layer's: the deepest any part can ask for
        last = jnp.take_along_axis(h, (prefill.lengths - 1)[:, None, None].astype(jnp.int32), axis=1)[:, 0]
        return state.replace(h_target=last.astype(jnp.float32))

    def decide(self, state: CaliState, key) -> Decision:
        return Decision(depth=jnp.full(state.n.shape, state.max_depth, jnp.int32))

    def stop(self, state: CaliState, level: int, aux, limit, key):
        """After draft token `level`: rows whose stop bit chi is 0 end their draft there."""
        h_draft = aux["hidden"][:, 0]  # the level's first node: the top-ranked path in a tree
        theta_m = self.predictor.theta(level, state.h_target, h_draft)
        mu, var = blend(theta_m, state.n, state.theta_hat, self.sigma_m, self.sigma_s)
        ks = RK.split(key, 2)
        theta = jnp.clip(mu + jnp.sqrt(var) * RK.normal(ks[:, 0], mu.shape[1:]), 0.0, 1.0)
        go_on = RK.uniform(ks[:, 1], mu.shape[1:]) < theta
        return jnp.where((limit > level) & ~go_on, level, limit).astype(limit.dtype)

    def observe(self, state: CaliState, record: Record) -> CaliState:
        on = record.active
        a = record.accepted.astype(jnp.float32)
        k = jnp.minimum(record.depth, record.drafted).astype(jnp.float32)
        trials = a + jnp.maximum(jnp.minimum(2.0, k - a), 0.0)
        succ, tr = state.succ + a, state.trials + trials
        t = state.t + a + 1.0
        if self.literal_eq8:
            q = a + 1.0
            theta_hat = (state.theta_hat * (t - q + 1.0) + q) / (t + 1.0)
        else:
            theta_hat = (self.theta0 + succ) / (1.0 + tr)
        keep = lambda new, old: jnp.where(on, new, old)  # noqa: E731
        h = state.h_target if record.hidden is None else jnp.where(on[:, None], record.hidden.astype(jnp.float32),
                                                                     state.h_target)
        return state.replace(h_target=h, n=keep(state.n + 1.0, state.n), succ=keep(succ, state.succ),
                             trials=keep(tr, state.trials), t=keep(t, state.t),
                             theta_hat=keep(theta_hat, state.theta_hat))


# --------------------------------------------------------------------------------------------------- storage


def torch_state_dict(pred: CaliPredictor) -> dict[str, np.ndarray]:
    w = np.asarray(jax.device_get(pred.w), np.float32)
    out = {f"position_proj.{i}.weight": w[i].T for i in range(w.shape[0])}
    out["classifier.weight"] = np.asarray(jax.device_get(pred.wp), np.float32).T
    out["classifier.bias"] = np.asarray(jax.device_get(pred.bp), np.float32)
    return out


def from_torch_state_dict(sd: dict) -> CaliPredictor:
    P = len([k for k in sd if k.startswith("position_proj.")])
    missing = [k for k in ("classifier.weight", "classifier.bias") if k not in sd]
    if P == 0 or missing:
        raise ValueError(f"the calibration weights lack {missing or 'position_proj.*'}")
    w = np.stack([np.asarray(sd[f"position_proj.{i}.weight"]).T for i in range(P)])
    return CaliPredictor(jnp.asarray(w, jnp.float32), jnp.asarray(np.asarray(sd["classifier.weight"]).T, jnp.float32),
                         jnp.asarray(sd["classifier.bias"], jnp.float32))


def save_calibration(pred: CaliPredictor, directory: str, dtype=None, extra: dict | None = None) -> None:
    """`directory/calibration.safetensors` (the PyTorch layout above) + `calibration.json`."""
    H.write_weights(os.path.join(directory, CALI_WEIGHTS), torch_state_dict(pred), dtype)
    H.write_meta(os.path.join(directory, CALI_CONFIG),
                 {"format": "jspec-eesd-calibration", "positions": pred.positions, **(extra or {})})


def load_calibration(directory: str) -> CaliPredictor | None:
    """The predictor saved in `directory`, or None when it holds none."""
    if not os.path.exists(os.path.join(directory, CALI_WEIGHTS)):
        return None
    return from_torch_state_dict(H.read_weights(os.path.join(directory, CALI_WEIGHTS), np.float32))
