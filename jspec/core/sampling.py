"""Logit processing and sampling: temperature, top-k, top-p with transformers' semantics, inside jit.

`SamplingConfig` holds the static choices (greedy or not, whether top-k / top-p are active) so that changing the
numeric values does not recompile; the values travel as arrays in `SamplingParams`.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec.core import rowkeys as RK

NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    greedy: bool = True
    use_top_k: bool = False
    use_top_p: bool = False


@struct.dataclass
class SamplingParams:
    temperature: jax.Array  # scalar float32
    top_k: jax.Array  # scalar int32
    top_p: jax.Array  # scalar float32


def make_sampling(temperature: float | None, top_k: int | None, top_p: float | None) -> tuple[SamplingConfig, SamplingParams]:
    """Validate the user's sampling arguments; temperature 0 (or None) means greedy."""
    try:
        t = 0.0 if temperature is None else float(temperature)
    except (TypeError, ValueError):
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}") from None
    if not np.isfinite(t) or t < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer, float))
                              or not float(top_k).is_integer() or top_k < 1):
        raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, (bool, str)) or not 0.0 < float(top_p) <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    greedy = t == 0.0
    cfg = SamplingConfig(greedy=greedy, use_top_k=(top_k is not None and not greedy),
                         use_top_p=(top_p is not None and float(top_p) < 1.0 and not greedy))
    # numpy scalars: jit takes them as they are (a jnp scalar is a device op per value, ~0.2 ms each on a CPU)
    params = SamplingParams(temperature=np.float32(t if t > 0 else 1.0), top_k=np.int32(top_k or 0),
                            top_p=np.float32(1.0 if top_p is None else top_p))
    return cfg, params


def largest(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k(x, k)` (values, indices over the last axis), its outputs behind an optimization barrier:
    XLA:CPU otherwise rewrites a top-k whose results feed further ops into a full sort of the last axis, 150x
    slower over a 49k vocabulary (the barrier keeps its own top-k; other backends compile the same results)."""
    return jax.lax.optimization_barrier(jax.lax.top_k(x, k))


def top_k_mask(logits: jax.Array, k: jax.Array) -> jax.Array:
    """Keep logits >= the k-th largest (ties with it kept, as transformers' TopKLogitsWarper)."""
    v = logits.shape[-1]
    k = jnp.clip(k, 1, v)
    kth = jnp.take_along_axis(jnp.sort(logits, axis=-1), jnp.full(logits.shape[:-1] + (1,), v - k), axis=-1)
    return jnp.where(logits < kth, NEG_INF, logits)


def top_p_mask(logits: jax.Array, p: jax.Array) -> jax.Array:
    """Nucleus filter as transformers' TopPLogitsWarper: drop the low tail whose mass is <= 1 - p, keep >= 1 token."""
    order = jnp.argsort(logits, axis=-1, stable=True)  # ascending
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
    remove_sorted = cum <= (1.0 - p)
    remove_sorted = remove_sorted.at[..., -1].set(False)
    inv = jnp.argsort(order, axis=-1)
    remove = jnp.take_along_axis(remove_sorted, inv, axis=-1)
    return jnp.where(remove, NEG_INF, logits)


def process_logits(logits: jax.Array, cfg: SamplingConfig, params: SamplingParams) -> jax.Array:
    """Temperature, then top-k, then top-p (transformers' order). Float32 logits with -inf where filtered."""
    x = logits.astype(jnp.float32)
    if cfg.greedy:
        return x
    x = x / params.temperature
    if cfg.use_top_k:
        x = top_k_mask(x, params.top_k)
    if cfg.use_top_p:
        x = top_p_mask(x, params.top_p)
    return x


def probs(logits: jax.Array, cfg: SamplingConfig, params: SamplingParams) -> jax.Array:
    """The distribution the sampler draws from: softmax of processed logits, or one-hot argmax when greedy."""
    x = process_logits(logits, cfg, params)
    if cfg.greedy:
        return jax.nn.one_hot(jnp.argmax(x, axis=-1), x.shape[-1], dtype=jnp.float32)
    return jax.nn.softmax(x, axis=-1)


def sample(keys: jax.Array, logits: jax.Array, cfg: SamplingConfig, params: SamplingParams) -> jax.Array:
    """One token per leading index of logits [B, ..., V]: argmax when greedy, else a categorical draw from the
    processed logits, row b from its own key `keys[b]` (`jspec.core.rowkeys`)."""
    x = process_logits(logits, cfg, params)
    if cfg.greedy:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    return RK.categorical(keys, x).astype(jnp.int32)
