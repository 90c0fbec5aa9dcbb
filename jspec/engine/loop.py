"""The decode engine: prefill, one jitted step per strategy, and the on-device `lax.while_loop` around it.

State is a `DecodeState` pytree. Every strategy's step takes `(ctx, models, state) -> state` and commits its
tokens through `commit_tokens`, which handles EOS, the `max_new_tokens` budget and finished rows for every method
alike. The host sees the state once, after the loop.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import struct

from ports import cache as kvc
from jspec.engine import rowkeys as RK
from jspec.engine import sampling as SM
from jspec.engine import sharding as SH
from ports import layers as LY
from ports.scanned import is_scanned


@dataclasses.dataclass(frozen=True)
class StepContext:
    """Static facts of one decode call (part of the compilation key)."""

    max_new: int
    max_steps: int
    out_len: int  # output buffer length: max_new + the most tokens one step can commit
    eos: tuple[int, ...]
    sampling: SM.SamplingConfig
    placement: SH.Placement | None = None  # mesh + rules: the target cache's sharding (None: one device)
    prefill_chunk: int | None = None  # the target's prefill fills the cache this many tokens at a time (`prefill`)


@struct.dataclass
class DecodeState:
    out: jax.Array  # [B, out_len] int32 generated tokens (valid up to n_out)
    n_out: jax.Array  # [B] int32
    done: jax.Array  # [B] bool
    last: jax.Array  # [B] int32: newest committed token, not yet written to the target cache
    cache: kvc.KVCache  # target cache; length = committed tokens before `last`
    key: jax.Array
    step: jax.Array  # int32 scalar: decode steps taken (prefill excluded)
    accepted: jax.Array  # [B, max_steps] int32: tokens committed at each decode step (bonus included)
    drafted: jax.Array  # [B] int32: draft tokens proposed to the target, summed over steps
    sp: SM.SamplingParams
    aux: Any = None  # strategy state: draft caches, controller state, ...


def new_cache_for(model, batch: int, max_len: int) -> kvc.KVCache:
    layers, kvh, hd = model.kv_layout
    return kvc.init_cache(layers, batch, kvh, max_len, hd, model.dtype, stacked=is_scanned(model))


def prefill(model, tokens: jax.Array, lengths: jax.Array, cache: kvc.KVCache, inputs=None, chunk: int | None = None,
            **fwd_kwargs):
    """Run right-padded prompts [B, T] (row b valid up to lengths[b]) into an empty cache.

    `inputs`: the model's modality inputs (e.g. pixel_values), spliced into the prompt embeddings by its family;
    a family whose `prompt_embeds` also returns `positions` (M-RoPE ids) and `position_offset` [B] gets those
    positions for the prompt, and the offset becomes the cache's `pos_offset` for every later token.
    Returns (logits at each row's last prompt token [B, V], forward output, cache with length = lengths).
    Right padding needs no pad mask: under the causal mask no real token sees a later pad. The cache must be empty
    (the forward runs with `fresh=True`: it neither reads nor copies the cache's slots past the prompt).
    `chunk`: when T > chunk, fill the cache `chunk` tokens at a time (`prefill_chunked`), so that activations are
    bounded by the chunk, not the prompt; same result.
    A model with its own `prefill` (e.g. `jspec.engine.guidance.Guided`) does it its way, in one pass.
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


CHUNKED_OPTIONS = ("embeds", "hidden_layers", "attn_query_weights", "rope")


def prefill_chunked(model, tokens, positions, lengths, cache: kvc.KVCache, chunk: int, **fwd_kwargs):
    """`prefill`'s forward `chunk` tokens at a time: a scan over the whole chunks, then the remainder, each chunk
    written after the ones before it and attending to them (blockwise when the chunk is long:
    `ports.layers.Prefix`). Returns (logits [B, V], forward output, cache of lengths `lengths`), equal to one pass:
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
        fo = model.forward(piece(tokens, at, size, 1), piece(positions, at, size, positions.ndim - 1), cache,
                           logits_at=jnp.clip(last - at, 0, size - 1)[:, None], **kw)
        inside = (last >= at) & (last < at + size)
        return fo, kvc.commit(fo.cache, jnp.full((B,), size, jnp.int32)), inside

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


def commit_tokens(ctx: StepContext, state: DecodeState, toks: jax.Array, n: jax.Array) -> tuple[DecodeState, jax.Array]:
    """Append toks[b, :n[b]] to each unfinished row, cut at the first EOS and at max_new tokens.

    Returns the new state and n_eff [B], the tokens each row actually committed (0 for finished rows).
    """
    B, K = toks.shape
    idx = jnp.arange(K)[None, :]
    valid = idx < n[:, None]
    if ctx.eos:
        is_eos = jnp.isin(toks, jnp.asarray(ctx.eos, jnp.int32)) & valid
        has_eos = jnp.any(is_eos, axis=1)
        n_eff = jnp.where(has_eos, jnp.argmax(is_eos, axis=1) + 1, n)
    else:
        has_eos = jnp.zeros((B,), bool)
        n_eff = n
    room = ctx.max_new - state.n_out
    hit_eos = has_eos & (n_eff <= room)
    n_eff = jnp.where(state.done, 0, jnp.minimum(n_eff, room)).astype(jnp.int32)
    out = jax.vmap(lambda o, t, s: jax.lax.dynamic_update_slice(o, t, (s,)))(state.out, toks.astype(jnp.int32),
                                                                            state.n_out)
    n_out = state.n_out + n_eff
    done = state.done | hit_eos | (n_out >= ctx.max_new)
    return state.replace(out=out, n_out=n_out, done=done), n_eff


def record_step(state: DecodeState, n_eff: jax.Array, drafted: jax.Array) -> DecodeState:
    acc = state.accepted.at[:, state.step].set(n_eff)
    return state.replace(accepted=acc, drafted=state.drafted + drafted, step=state.step + 1)


def start_state(ctx: StepContext, first: jax.Array, cache: kvc.KVCache, key: jax.Array, sp: SM.SamplingParams,
                aux=None) -> DecodeState:
    """State after prefill: `first` [B] is the token sampled from the prompt."""
    B = first.shape[0]
    state = DecodeState(
        out=jnp.zeros((B, ctx.out_len), jnp.int32), n_out=jnp.zeros((B,), jnp.int32),
        done=jnp.zeros((B,), bool), last=first.astype(jnp.int32), cache=cache, key=key,
        step=jnp.int32(0), accepted=jnp.zeros((B, max(ctx.max_steps, 1)), jnp.int32),
        drafted=jnp.zeros((B,), jnp.int32), sp=sp, aux=aux)
    state, _ = commit_tokens(ctx, state, first[:, None].astype(jnp.int32), jnp.ones((B,), jnp.int32))
    return state


def step_key(state: DecodeState) -> jax.Array:
    """[B] keys of this step, one per row."""
    return RK.fold(state.key, state.step)


def running(ctx: StepContext, state: DecodeState) -> jax.Array:
    """Whether the decode loop takes another step: some row is unfinished and the step budget is not spent."""
    return (state.step < ctx.max_steps) & ~jnp.all(state.done)


def run_loop(ctx: StepContext, step_fn: Callable[[DecodeState], DecodeState], state: DecodeState,
             until: jax.Array | None = None) -> DecodeState:
    """Iterate `step_fn` on device while `running` and, with `until` (a traced step count: one program serves every
    value), while the step counter is below it (the target cache keeps the placement's sharding through the
    loop)."""
    cond = (lambda s: running(ctx, s)) if until is None else (lambda s: running(ctx, s) & (s.step < until))

    def body(s):
        s = step_fn(s)
        return s.replace(cache=SH.constrain(ctx.placement, s.cache))

    return jax.lax.while_loop(cond, body, state)


def one_token_forward(target, state: DecodeState, **kw):
    """The target's forward of `last` at its row's next position (its K/V written, not yet committed)."""
    positions = kvc.positions(state.cache, jnp.zeros((state.last.shape[0], 1), jnp.int32))
    return target.forward(state.last[:, None], positions, state.cache, **kw)


def ar_step(ctx: StepContext, target, state: DecodeState) -> DecodeState:
    """Autoregressive: feed `last`, sample one token, commit it."""
    fo = one_token_forward(target, state)
    tok = SM.sample(step_key(state), fo.logits[:, 0], ctx.sampling, state.sp)
    active = ~state.done
    cache = kvc.commit(fo.cache, active.astype(jnp.int32))
    state = state.replace(cache=cache, last=jnp.where(active, tok, state.last))
    state, n_eff = commit_tokens(ctx, state, tok[:, None], jnp.ones_like(tok))
    return record_step(state, n_eff, jnp.zeros_like(n_eff))
