"""The committed text a drafter keeps for itself (the prompt and every accepted token, the newest aside), shared by
the drafters that read the token text rather than run a model: prompt lookup and `TokenDrafter`."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.parts.protocols import Catchup


def start_text(tokens: jax.Array, lengths: jax.Array, max_len: int) -> tuple[jax.Array, jax.Array]:
    """(hist [B, max_len], n [B]): the prompts, right padded with 0, as the text so far."""
    B, T = tokens.shape
    hist = jnp.zeros((B, max_len), jnp.int32).at[:, :T].set(tokens.astype(jnp.int32))
    return jnp.where(jnp.arange(max_len)[None] < lengths[:, None], hist, 0), lengths.astype(jnp.int32)


def with_last(hist: jax.Array, n: jax.Array, last: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(seq [B, H + 1], its length [B]): the committed text with the newest token `last` appended."""
    seq = jnp.pad(hist, ((0, 0), (0, 1)))
    return seq.at[jnp.arange(seq.shape[0]), n].set(last), n + 1


def append_accepted(hist: jax.Array, n: jax.Array, c: Catchup) -> tuple[jax.Array, jax.Array]:
    """(hist, n) with the step's root and its accepted drafts appended (the bonus becomes the next `last`)."""
    B, H = hist.shape
    path_tokens = jnp.take_along_axis(c.prop.tokens, c.path, axis=1)  # [B, D + 1], root first
    keep = jnp.where(c.active, c.accepted + 1, 0)
    at = n[:, None] + jnp.arange(path_tokens.shape[1])[None]
    write = (jnp.arange(path_tokens.shape[1])[None] < keep[:, None]) & (at < H)
    hist = hist.at[jnp.arange(B)[:, None], jnp.where(write, at, H)].set(path_tokens, mode="drop")
    return hist, jnp.minimum(n + keep, H)
