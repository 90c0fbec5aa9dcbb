"""Per-row randomness. A decode holds one PRNG key per row ([B] keys) and every draw a row makes comes from its own
key, so a row's sampled tokens do not depend on which other rows share its batch. These helpers are the batched
forms of `jax.random`'s functions over such a [B] key array: draw `shape` per row, stacked to [B, *shape]."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def for_rows(key: jax.Array, batch: int) -> jax.Array:
    """[B] row keys: `key` itself when it already holds one key per row, else row b's key is fold_in(key, b)."""
    if key.shape == (batch,):
        return key
    return jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(batch))


def fold(keys: jax.Array, data) -> jax.Array:
    return jax.vmap(lambda k: jax.random.fold_in(k, data))(keys)


def split(keys: jax.Array, num: int) -> jax.Array:
    """[B, num] keys."""
    return jax.vmap(lambda k: jax.random.split(k, num))(keys)


def uniform(keys: jax.Array, shape: tuple = ()) -> jax.Array:
    return jax.vmap(lambda k: jax.random.uniform(k, shape))(keys)


def normal(keys: jax.Array, shape: tuple = ()) -> jax.Array:
    return jax.vmap(lambda k: jax.random.normal(k, shape))(keys)


def gumbel(keys: jax.Array, shape: tuple = ()) -> jax.Array:
    return jax.vmap(lambda k: jax.random.gumbel(k, shape))(keys)


def beta(keys: jax.Array, a: jax.Array, b: jax.Array, shape: tuple = ()) -> jax.Array:
    """Row r draws Beta(a[r], b[r]) `shape` times (a, b: [B])."""
    return jax.vmap(lambda k, x, y: jax.random.beta(k, x, y, shape))(keys, a, b)


def categorical(keys: jax.Array, logits: jax.Array) -> jax.Array:
    """One draw per leading index of each row's logits [B, ..., V] -> [B, ...]."""
    return jax.vmap(lambda k, x: jax.random.categorical(k, x, axis=-1))(keys, logits)
