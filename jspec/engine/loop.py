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

from ports.core import cache as kvc
from jspec.core import rowkeys as RK
from jspec.core import sampling as SM
from jspec.core import sharding as SH


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
