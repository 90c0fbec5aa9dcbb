"""`TokenDrafter(propose)`: a drafter from one function over the token text.

    def propose(tokens, lengths):   # tokens [B, L] int32: each row's prompt and generated text, right padded
        ...                         # lengths [B]: how many of them are real (the newest token is tokens[b, n - 1])
        return draft, valid         # draft [B, G] int32: the next G tokens it guesses; valid [B, G] bool

`propose` is traced inside the jitted step (jax.numpy only; G fixed), once per step, before the target verifies.
It is part of the compiled programs' key: the same function object reuses them, a new closure compiles anew.
The adapter keeps the text (the prompt, then every accepted token), drafts `draft[:, :G]` as a chain (the
plan's depth caps it; a draft stops at its first invalid token), and gives each drafted token a one-hot
distribution: the rule then reads q(x) = 1 for the token proposed, which is the distribution it came from, so
greedy decoding equals AR and sampling draws from the target's distribution exactly. Under a tree plan only the
chain is drafted (a one-hot distribution has one child per node). No draft model, no cache.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec.parts.protocols import Catchup, DraftEnv, Drafter, Prepared, Setup, TargetPrefill
from jspec.parts.drafters.text import append_accepted, start_text, with_last


@struct.dataclass
class TokenState:
    hist: jax.Array  # [B, H] committed tokens before `last`, in order
    n: jax.Array  # [B] how many
    draft: jax.Array  # [B, G + 1] this step's proposal, a never-valid column appended
    valid: jax.Array  # [B, G + 1]


def one_hot_logp(tok: jax.Array, ok: jax.Array, vocab: int) -> jax.Array:
    """log of the one-hot distribution at `tok` [...] where `ok`, all -inf (no child) elsewhere: [..., vocab]."""
    return jnp.where(ok[..., None] & (jnp.arange(vocab) == tok[..., None]), 0.0, -jnp.inf)


@struct.dataclass
class TokenDrafter(Drafter):
    """A drafter from `propose(tokens [B, L], lengths [B]) -> (draft [B, G], valid [B, G])` (module docstring):
    `jspec.Chain(jspec.TokenDrafter(propose), gamma=G)`."""

    propose: Callable = struct.field(pytree_node=False)

    def check(self, target) -> None:
        if not callable(self.propose):
            raise ValueError(f"TokenDrafter needs a function propose(tokens, lengths) -> (draft, valid), got "
                             f"{type(self.propose).__name__}")

    def prepare(self, setup: Setup) -> Prepared:
        if setup.inputs:
            raise ValueError(f"TokenDrafter proposes from the token text; the prompt has {sorted(setup.inputs)} "
                             "inputs it cannot read (use a draft model)")
        return Prepared(self, (setup.tokens, setup.lengths), int(np.max(setup.lengths)), setup.tokens.shape[1])

    def _proposal(self, seq: jax.Array, n: jax.Array, vocab: int) -> tuple[jax.Array, jax.Array]:
        draft, valid = self.propose(seq, n)
        B = seq.shape[0]
        if draft.ndim != 2 or draft.shape[0] != B or valid.shape != draft.shape:
            raise ValueError(f"TokenDrafter: propose must return draft [B, G] and valid [B, G] for B = {B}; got "
                             f"{draft.shape} and {valid.shape}")
        draft = draft.astype(jnp.int32)
        valid = valid.astype(bool) & (draft >= 0) & (draft < vocab)
        valid = jnp.cumprod(valid, axis=1).astype(bool)  # a chain: nothing after the first invalid token
        return jnp.pad(draft, ((0, 0), (0, 1))), jnp.pad(valid, ((0, 0), (0, 1)))

    def init(self, env: DraftEnv, prefill: TargetPrefill, prompt, max_len: int) -> TokenState:
        hist, n = start_text(*prompt, max_len)
        seq, m = with_last(hist, n, jnp.zeros_like(n))
        shape = jax.eval_shape(self._proposal, seq, m, env.target.vocab_size)[0].shape
        return TokenState(hist, n, jnp.zeros(shape, jnp.int32), jnp.zeros(shape, bool))

    def root(self, env: DraftEnv, st: TokenState):
        draft, valid = self._proposal(*with_last(st.hist, st.n, env.last), env.target.vocab_size)
        return one_hot_logp(draft[:, :1], valid[:, :1], env.target.vocab_size), None, st.replace(draft=draft,
                                                                                                   valid=valid)

    def level(self, env: DraftEnv, st: TokenState, tokens, depth, mask, offset, run):
        """A node at depth d >= 1 is on the chain when it is the proposal's d-th token; its child is the next."""
        col = jnp.clip(depth, 1, st.draft.shape[1] - 1)
        here = jnp.take_along_axis(st.draft, col - 1, axis=1)
        on = jnp.take_along_axis(st.valid, col - 1, axis=1) & (tokens == here) & (depth >= 1)
        nxt, ok = jnp.take_along_axis(st.draft, col, axis=1), jnp.take_along_axis(st.valid, col, axis=1)
        return one_hot_logp(nxt, on & ok, env.target.vocab_size), None, st

    def commit(self, env: DraftEnv, st: TokenState, c: Catchup) -> TokenState:
        hist, n = append_accepted(st.hist, st.n, c)
        return st.replace(hist=hist, n=n)
