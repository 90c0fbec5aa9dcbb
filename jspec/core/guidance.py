"""Classifier-free guidance and per-position logit constraints, as a model wrapper the one engine decodes.

`Guided` looks like a model to the engine (`forward`, `prefill`, `kv_layout`, `vocab_size`, `dtype`), so AR and
every speculative strategy get guidance and constraints without a second decode loop; a draft is wrapped the same
way, so it drafts from the same guided, constrained distribution the target verifies.

Streams: with CFG each row runs a conditional and an unconditional sequence. Both live in the row's KV cache, the
unconditional one in extra kv heads ([B, 2 * kv_heads, S, Dh], one free reshape from [2B, kv_heads, S, Dh]), and
both prompts are placed right-aligned so that they end at the same slot: the row has one committed length, every
cache operation of the engine (commit, rollback, tree-path gather) moves both streams together, and the stream
with the shorter prompt simply starts later (`KVCache.start`). A token at slot j of a stream has RoPE position
j - start. Logits are combined as uncond + scale * (cond - uncond), then the constraint masks them.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ports.core.prompts import normalize_prompt
from ports.core.cache import ForwardOut


@dataclasses.dataclass(frozen=True)
class CFG:
    """Classifier-free guidance: logits = uncond + scale * (cond - uncond).

    uncond_prompt: the unconditional prompt, one for all rows ([T] ids) or one per row (any prompt form
    `jspec.decode` accepts, same number of rows). Lumina-mGPT's unconditional prompt is the image prefix alone
    (image start + size tokens); `jspec.generate_image` builds it.
    """

    scale: float = 3.0
    uncond_prompt: Any = None


@struct.dataclass
class ImageGrammar:
    """Lumina-mGPT's image grammar over generated positions g = 0, 1, ...: `height` rows of `width` image tokens,
    each row followed by `eol`; then `eoi` at g = height * (width + 1); unconstrained afterwards.

    Inside a row only `image_tokens` may be drawn (a [V] bool mask); at an end-of-row or end-of-image position the
    grammar token is forced (every other logit is -inf).
    """

    image_tokens: jax.Array  # [V] bool
    height: int = struct.field(pytree_node=False)
    width: int = struct.field(pytree_node=False)
    eol: int = struct.field(pytree_node=False)
    eoi: int = struct.field(pytree_node=False)

    @property
    def length(self) -> int:
        """Tokens of the grid including every end-of-row and the end-of-image token."""
        return self.height * (self.width + 1) + 1

    def apply(self, logits: jax.Array, g: jax.Array) -> jax.Array:
        """Mask logits [B, K, V] of the tokens at generated positions g [B, K]."""
        row = self.width + 1
        grid = self.height * row
        in_grid = (g >= 0) & (g < grid)
        image_slot = in_grid & (g % row < self.width)
        forced = jnp.where(in_grid & ~image_slot, self.eol, jnp.where(g == grid, self.eoi, -1))
        ids = jnp.arange(logits.shape[-1])
        allow = jnp.where(image_slot[..., None], self.image_tokens[None, None, :],
                          (forced[..., None] < 0) | (ids == forced[..., None]))
        return jnp.where(allow, logits, -jnp.inf)


@struct.dataclass
class Guided:
    """A model decoded with CFG streams and/or a logit constraint (see the module docstring).

    Built by `guide` for one prompt batch: `prompt_end[b]` is the committed length after the prefill (the longer of
    the row's two prompts), `starts` [B * streams] the first slot of each stream (row-major: row b's conditional
    stream, then its unconditional one).
    """

    model: Any
    scale: jax.Array  # f32 scalar
    uncond: jax.Array  # [B, Tu] unconditional prompts, right-padded ([B, 0] without CFG)
    uncond_len: jax.Array  # [B]
    starts: jax.Array  # [B * streams]
    prompt_end: jax.Array  # [B]
    constraint: Any = None  # an object with apply(logits [B, K, V], g [B, K]) (e.g. ImageGrammar), or None
    streams: int = struct.field(pytree_node=False, default=1)

    @property
    def config(self):
        return self.model.config

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def dtype(self):
        return self.model.dtype

    @property
    def kv_layout(self) -> tuple[int, int, int]:
        layers, kvh, hd = self.model.kv_layout
        return layers, kvh * self.streams, hd

    def _inner(self, cache):
        """The streams' view: B * streams rows of the inner model's kv heads. The flat cache rows are the same
        buffer either way (row b of `streams * KVH` heads = rows b * streams + s of KVH heads), so only the per-row
        fields repeat."""
        n = self.streams
        return cache.replace(length=jnp.repeat(cache.length, n), start=self.starts,
                             pos_offset=jnp.repeat(cache.pos_offset, n))

    def _outer(self, inner, cache):
        return cache.replace(k=inner.k, v=inner.v)

    def _process(self, logits: jax.Array, g: jax.Array) -> jax.Array:
        """Inner logits [B * streams, K, V] -> guided, constrained logits [B, K, V] (next tokens at positions g)."""
        B = g.shape[0]
        x = logits.reshape(B, self.streams, *logits.shape[1:])
        x = x[:, 0] if self.streams == 1 else x[:, 1] + self.scale * (x[:, 0] - x[:, 1])
        return x if self.constraint is None else self.constraint.apply(x, g)

    def forward(self, tokens, positions, cache, new_mask=None, *, logits_at=None, write_offset: int = 0,
                hidden_layers=(), **unsupported) -> ForwardOut:
        """The engine's forward contract (`ports.families.llama.forward`) on both streams; positions are slots. Hidden
        states asked for come back per stream: [B, T, D] with one stream, [B, T, streams, D] with CFG."""
        if unsupported:
            raise ValueError(f"guided decoding does not support forward options {sorted(unsupported)}")
        rep = lambda x: None if x is None else jnp.repeat(x, self.streams, axis=0)
        fo = self.model.forward(rep(tokens), rep(positions) - self.starts[:, None], self._inner(cache),
                                rep(new_mask), logits_at=rep(logits_at), write_offset=write_offset,
                                hidden_layers=tuple(hidden_layers))
        at = positions if logits_at is None else jnp.take_along_axis(positions, logits_at, axis=1)
        logits = self._process(fo.logits, at + 1 - self.prompt_end[:, None])
        return ForwardOut(logits, tuple(self._per_row(h) for h in fo.hidden), self._outer(fo.cache, cache))

    def _per_row(self, h: jax.Array) -> jax.Array:
        """Inner rows [B * streams, T, D] -> [B, T, D] (one stream) or [B, T, streams, D]."""
        if self.streams == 1:
            return h
        B = h.shape[0] // self.streams
        return h.reshape(B, self.streams, *h.shape[1:]).swapaxes(1, 2)

    def inner_prompt(self, tokens, lengths) -> jax.Array:
        """The streams' prompts as the prefill lays them out: [B * streams, W] ids, row b * streams + s holding
        stream s of row b right-aligned to end at slot prompt_end[b] (slots before `starts` are 0)."""
        B, T = tokens.shape
        W = max(T, self.uncond.shape[1])
        j = jnp.arange(W)[None]

        def place(src, n):
            src = jnp.pad(src, ((0, 0), (0, W - src.shape[1])))
            shift = (self.prompt_end - n)[:, None]
            return jnp.where(j >= shift, jnp.take_along_axis(src, jnp.clip(j - shift, 0, W - 1), axis=1), 0)

        rows = [place(tokens, lengths)]
        if self.streams == 2:
            rows.append(place(self.uncond, self.uncond_len))
        return jnp.stack(rows, axis=1).reshape(B * self.streams, W)

    def prefill(self, tokens, lengths, cache, inputs=None, hidden_layers=(), **unsupported):
        """`jspec.core.prefill.prefill` for both streams: each prompt right-aligned to end at slot prompt_end[b]
        (`inner_prompt`). Hidden states asked for come back per inner row, [B * streams, W, D] in that layout."""
        if inputs or unsupported:
            raise ValueError("guided decoding takes token prompts only (no images or forward options)")
        B = tokens.shape[0]
        inner_tokens = self.inner_prompt(tokens, lengths)
        W = inner_tokens.shape[1]
        positions = jnp.maximum(jnp.arange(W)[None] - self.starts[:, None], 0)
        last = jnp.repeat(self.prompt_end - 1, self.streams)[:, None]
        fo = self.model.forward(inner_tokens, positions, self._inner(cache), logits_at=last, fresh=True,
                                hidden_layers=tuple(hidden_layers))
        logits = self._process(fo.logits, jnp.zeros((B, 1), jnp.int32))
        out_cache = self._outer(fo.cache, cache).replace(length=self.prompt_end)
        return logits[:, 0], ForwardOut(logits, fo.hidden, out_cache), out_cache


def guide(model, lengths: np.ndarray, guidance: CFG | None, constraint=None) -> Guided:
    """Wrap `model` for prompts of `lengths` [B] (host arrays, checked here)."""
    B = len(lengths)
    lengths = np.asarray(lengths, np.int32)
    if guidance is None:
        uncond, ulen, streams = np.zeros((B, 0), np.int32), np.zeros((B,), np.int32), 1
        end = lengths
        starts = np.zeros((B,), np.int32)
        scale = 1.0
    else:
        if guidance.uncond_prompt is None:
            raise ValueError("CFG needs an uncond_prompt (e.g. the image prefix alone for Lumina-mGPT)")
        raw = guidance.uncond_prompt
        uncond, ulen, extra = normalize_prompt(raw, model.vocab_size)
        if extra:
            raise ValueError(f"CFG uncond_prompt takes token ids only; got inputs {sorted(extra)}")
        if uncond.shape[0] == 1 and B > 1:
            uncond, ulen = np.repeat(uncond, B, axis=0), np.repeat(ulen, B)
        if uncond.shape[0] != B:
            raise ValueError(f"CFG uncond_prompt has {uncond.shape[0]} rows, the prompt has {B}")
        streams = 2
        end = np.maximum(lengths, ulen)
        starts = np.stack([end - lengths, end - ulen], axis=1).reshape(-1)
        scale = float(guidance.scale)
    return Guided(model, jnp.float32(scale), jnp.asarray(uncond, jnp.int32), jnp.asarray(ulen, jnp.int32),
                  jnp.asarray(starts, jnp.int32), jnp.asarray(end, jnp.int32), constraint, streams)
