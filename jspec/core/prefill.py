"""A target's (or a draft model's) prefill: an empty cache sized for it, and the prompt run into it, in one pass
or a chunk at a time (same logits and cache)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ports.core import cache as kvc
from ports.core import layers as LY
from ports import model as PM
from ports.core.scanned import is_scanned


def new_cache_for(model, batch: int, max_len: int) -> kvc.KVCache:
    """An empty cache for `model` (a hybrid model's recurrent state included: `ports.model.new_cache`)."""
    if getattr(model, "recurrent", False):
        return PM.new_cache(model, batch, max_len, stacked=is_scanned(model))
    layers, kvh, hd = model.kv_layout
    return kvc.init_cache(layers, batch, kvh, max_len, hd, model.dtype, stacked=is_scanned(model))


def prefill(model, tokens: jax.Array, lengths: jax.Array, cache: kvc.KVCache, inputs=None, chunk: int | None = None,
            **fwd_kwargs):
    """Run right-padded prompts [B, T] (row b valid up to lengths[b]) into an empty cache.

    `inputs`: the model's modality inputs (e.g. pixel_values), spliced into the prompt embeddings by its family;
    a family whose `prompt_embeds` also returns `positions` (M-RoPE ids) and `position_offset` [B] gets those
    positions for the prompt, and the offset becomes the cache's `pos_offset` for every later token; its
    `forward_inputs` (a dict of forward options, e.g. DeepStack's `layer_adds`) go to the prompt's forward.
    Returns (logits at each row's last prompt token [B, V], forward output, cache with length = lengths).
    Right padding needs no pad mask: under the causal mask no real token sees a later pad. The cache must be empty
    (the forward runs with `fresh=True`: it neither reads nor copies the cache's slots past the prompt).
    `chunk`: when T > chunk, fill the cache `chunk` tokens at a time (`prefill_chunked`), so that activations are
    bounded by the chunk, not the prompt; same result.
    A model with its own `prefill` (e.g. `jspec.core.guidance.Guided`) does it its way, in one pass.
    """
    if hasattr(model, "prefill"):
        return model.prefill(tokens, lengths, cache, inputs, **fwd_kwargs)
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    offset = None
    if inputs:
        pe = model.family.prompt_embeds(model.config, model.params, tokens, inputs)
        fwd_kwargs["embeds"] = pe.embeds
        if getattr(pe, "positions", None) is not None:  # e.g. M-RoPE [3, B, T] ids and their rope deltas
            positions, offset = pe.positions, pe.position_offset
        fwd_kwargs.update(getattr(pe, "forward_inputs", None) or {})  # e.g. Qwen3-VL's DeepStack layer_adds
    text = getattr(model.config, "text", model.config)
    if getattr(getattr(text, "rope", None), "rope_type", None) == "dynamic" and positions.ndim == 2:
        fwd_kwargs["rope"] = LY.rope_tables(text, positions, lengths)  # prompt tokens scaled by their row's length
    if chunk is not None and T > chunk:
        logits, fo, cache = prefill_chunked(model, tokens, positions, lengths, cache, chunk, **fwd_kwargs)
    else:
        fo = model.forward(tokens, positions, cache, logits_at=(lengths - 1)[:, None], fresh=True, **fwd_kwargs)
        logits, cache = fo.logits[:, 0], kvc.rollback(fo.cache, lengths)
    if offset is not None:
        cache = cache.replace(pos_offset=offset.astype(jnp.int32))
    return logits, fo, cache


CHUNKED_OPTIONS = ("embeds", "hidden_layers", "attn_query_weights", "rope", "layer_adds")


def prefill_chunked(model, tokens, positions, lengths, cache: kvc.KVCache, chunk: int, **fwd_kwargs):
    """`prefill`'s forward `chunk` tokens at a time: a scan over the whole chunks, then the remainder, each chunk
    written after the ones before it and attending to them (blockwise when the chunk is long:
    `ports.core.layers.Prefix`). Returns (logits [B, V], forward output, cache of lengths `lengths`), equal to one pass:
    hidden states asked for are the chunks' concatenated, attention scores (`attn_query_weights`) their sum."""
    unsupported = sorted(set(fwd_kwargs) - set(CHUNKED_OPTIONS))
    if unsupported:
        raise ValueError(f"a chunked prefill does not take the forward option(s) {unsupported}")
    if chunk < 1:
        raise ValueError(f"prefill chunk must be a positive number of tokens, got {chunk}")
    B, T = tokens.shape
    n, rem = divmod(T, chunk)
    last = (lengths - 1).astype(jnp.int32)
    hidden_layers = tuple(fwd_kwargs.get("hidden_layers", ()))
    weights = fwd_kwargs.get("attn_query_weights")
    embeds = fwd_kwargs.get("embeds")
    rope = fwd_kwargs.get("rope")
    adds = fwd_kwargs.get("layer_adds")

    def piece(x, at, size, axis):
        return None if x is None else jax.lax.dynamic_slice_in_dim(x, at, size, axis=axis)

    def run(cache, at, size):
        """Chunk [at, at + size): its forward, the committed cache, and its logits at rows ending inside it."""
        kw = {"hidden_layers": hidden_layers}
        if embeds is not None:
            kw["embeds"] = piece(embeds, at, size, 1)
        if weights is not None:
            kw["attn_query_weights"] = piece(weights, at, size, 1)
        if rope is not None:
            kw["rope"] = tuple(piece(t, at, size, 1) for t in rope)
        if adds is not None:
            kw["layer_adds"] = piece(adds, at, size, 2)
        fo = model.forward(piece(tokens, at, size, 1), piece(positions, at, size, positions.ndim - 1), cache,
                           logits_at=jnp.clip(last - at, 0, size - 1)[:, None], **kw)
        inside = (last >= at) & (last < at + size)
        n = jnp.full((B,), size, jnp.int32)
        if cache.rec is not None:  # a recurrent state takes no padding: each row commits up to its prompt's end
            n = jnp.clip(lengths - at, 0, size).astype(jnp.int32)
        return fo, kvc.commit(fo.cache, n), inside

    def body(carry, c):
        cache, logits, attn = carry
        fo, cache, inside = run(cache, c * chunk, chunk)
        logits = jnp.where(inside[:, None], fo.logits[:, 0], logits)
        attn = attn if fo.attn is None else attn + fo.attn
        return (cache, logits, attn), fo.hidden

    V = model.vocab_size
    init = (cache, jnp.zeros((B, V), jnp.float32), jnp.zeros((B, cache.max_len), jnp.float32))
    (cache, logits, attn), hidden = jax.lax.scan(body, init, jnp.arange(n))
    hidden = [h.transpose(1, 0, 2, 3).reshape(B, n * chunk, -1) for h in hidden]  # [n, B, C, D] -> [B, n C, D]
    if rem:
        fo, cache, inside = run(cache, n * chunk, rem)
        logits = jnp.where(inside[:, None], fo.logits[:, 0], logits)
        attn = attn if fo.attn is None else attn + fo.attn
        hidden = [jnp.concatenate([h, t], axis=1) for h, t in zip(hidden, fo.hidden)]
    cache = kvc.rollback(cache, lengths)
    out = kvc.ForwardOut(logits[:, None], tuple(hidden), cache, attn if weights is not None else None)
    return logits, out, cache
