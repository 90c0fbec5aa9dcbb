"""`FeedDrafter`: the base of drafters that read the committed text into a cache of their own.

Its state (`FeedState`) holds the drafter's cache, whose committed length counts the tokens it has read (`last`
excluded), and a pending feed of committed tokens it has not read yet, ending with `last` (the tree's root),
optionally each with a per-token side input (an EAGLE head's target feature). The base implements, once:
- `root`: read the feed (`read_feed`: at the narrow width when every row's unread tokens fit there, else whole),
  commit the cache by the feed's length, and return the distribution after `last`;
- `catch_up` (a round in which no row drafts): nothing is read while every row has room for one more token (the
  round's token waits, so the round costs the target's step alone), else the feed is read now;
- `commit`: the accepted nodes the drafter fed while drafting are committed from their scratch slots (in place for
  a chain, with one gather otherwise; `keeps_fed`), the rest wait in the feed; a round that read nothing appends
  its tokens after those already waiting.
A subclass supplies its model's part: `read_prompt` (the cache after the prompt) and `forward` (new tokens at
given positions into the cache, their logits), or for a model that reads its feed differently `read` and `level`.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec.core import sampling as SM
from jspec.core import sharding as SH
from jspec.parts.protocols import Catchup, DraftEnv, Drafter, Prepared, Setup, TargetPrefill, run_level, when
from ports.core import cache as kvc


def draft_log_probs(logits: jax.Array, env: DraftEnv) -> jax.Array:
    """Draft log-probabilities used to rank and draw children: the sampler's distribution when sampling (-inf
    where top-k/top-p filter), the plain softmax when greedy (so lower ranks are the draft's next guesses)."""
    return jax.nn.log_softmax(SM.process_logits(logits, env.ctx.sampling, env.sp), axis=-1)


@struct.dataclass
class FeedState:
    cache: Any  # the drafter's cache [R rows]: committed length = tokens read, `last` excluded (None: it has none)
    pending: jax.Array  # [B, P] committed tokens not read yet, ending with `last`
    n_pending: jax.Array  # [B] int32
    deferred: jax.Array  # [B] bool: this round's `catch_up` left the feed unread
    side: jax.Array | None = None  # [R, P, ...] each pending token's side input (`side_of`), or None
    own: Any = None  # the subclass's own state (e.g. buffers of the step's drafts)


def rep(x, n: int):
    """Per batch row [B, ...] -> per cache row [B * n, ...] (n cache rows a batch row, `FeedDrafter.streams`)."""
    return x if x is None or n == 1 else jnp.repeat(x, n, axis=0)


def appended(pending: jax.Array, n_pending: jax.Array, new: jax.Array, count: jax.Array) -> jax.Array:
    """`pending` [B, P, ...] with `new`'s first `count` [B] entries written after its first `n_pending` [B]."""
    idx = jnp.arange(pending.shape[1])[None] - n_pending[:, None]  # [B, P]: position in `new`
    take = jnp.take_along_axis(new, jnp.clip(idx, 0, new.shape[1] - 1).reshape(idx.shape + (1,) * (new.ndim - 2)),
                               axis=1)
    put = ((idx >= 0) & (idx < count[:, None])).reshape(idx.shape + (1,) * (new.ndim - 2))
    return jnp.where(put, take, pending)


def _along(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [R, W, ...] at token indices idx [R, K] -> [R, K, ...]."""
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


class FeedDrafter(Drafter):
    """Base of drafters with a cache of the committed tokens they have read and a feed of those they have not
    (module docstring). A subclass (a `flax.struct` dataclass) defines `read_prompt` and `forward`, or `init`,
    `read` and `level` where its model reads the text its own way; the hooks below say what each must do."""

    keeps_fed = True  # accepted nodes fed while drafting are committed from their scratch slots (False: their
    # entries differ from what reading them as committed text writes, so the whole accepted path waits in the feed)

    # ------------------------------------------------------------------------------------------ the model's part

    def read_prompt(self, env: DraftEnv, prefill: TargetPrefill, prompt, max_len: int):
        """The drafter's cache after reading its prompt (`prompt`: what `prepare` handed over), `max_len` slots."""
        raise NotImplementedError(f"{type(self).__name__} defines no `read_prompt` (or `init`)")

    def forward(self, env: DraftEnv, tokens, positions, cache, mask=None, offset=0, logits_at=None):
        """(logits [B, T or len(logits_at), V], cache): tokens [B, T] at `positions` written at slots
        length + offset.., each seeing the committed slots and the new ones `mask` [B, T, S] allows (None:
        causal), as `ports.families.llama.forward`."""
        raise NotImplementedError(f"{type(self).__name__} defines no `forward` (or `read` and `level`)")

    def read(self, env: DraftEnv, state: FeedState, width: int):
        """(output at each row's newest pending token, `new`): the first `width` pending tokens (and side inputs)
        read into the cache after its committed slots; `written` folds `new` into the state. Default: `forward`
        at the cache's next positions, its logits, `new` the cache."""
        tokens = state.pending[:, :width]
        positions = kvc.positions(state.cache, jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), tokens.shape))
        return self.forward(env, tokens, positions, state.cache, logits_at=(state.n_pending - 1)[:, None])

    def written(self, env: DraftEnv, state: FeedState, new) -> FeedState:
        """The state after a `read` that returned `new` (default: `new` is the cache, uncommitted)."""
        return state.replace(cache=new)

    def side_of(self, env: DraftEnv, state: FeedState, c: Catchup):
        """[R, D+1, ...] the side input of each token of `c.new`, for a drafter that feeds one (default: None)."""
        return None

    def streams(self, env: DraftEnv) -> int:
        """Cache rows per batch row (default 1; an EAGLE head under guidance runs one per guidance stream)."""
        return 1

    def place(self, env: DraftEnv, cache):
        """The cache constrained to its placement on a mesh (default: replicated)."""
        return None if cache is None else SH.constrain(env.ctx.placement, cache, replicated=True)

    # ------------------------------------------------------------------------------------------- the protocol

    def prepare(self, setup: Setup) -> Prepared:
        """Default: the target's prompt (tokens, lengths, inputs), the drafter's models replicated on a mesh."""
        if setup.draft_prompt is not None or setup.guidance is not None or setup.constraint is not None:
            raise ValueError(f"{type(self).__name__} reads the target's prompt: draft_prompt, guidance and "
                             "constraint need a `prepare` of its own")
        me = self if setup.mesh is None else self.map_models(lambda m: SH.replicate(m, setup.mesh))
        return Prepared(me, (setup.tokens, setup.lengths, setup.inputs), int(np.max(setup.lengths)),
                        setup.tokens.shape[1])

    def feed_width(self, env: DraftEnv) -> int:
        """P: the plan's feed width, or with `keeps_fed` False the whole path and the deferred rounds' tokens."""
        needs = env.needs
        return needs.pending_width if self.keeps_fed else max(needs.pending_width, needs.depth + 1 + needs.defer)

    def fresh(self, env: DraftEnv, cache, side=None, own=None) -> FeedState:
        """The state after the prompt: `cache` holds the prompt, the feed holds `last` alone (with `side` [R, ...],
        its side input, where the drafter feeds one)."""
        B, P = env.last.shape[0], self.feed_width(env)
        pending = jnp.zeros((B, P), jnp.int32).at[:, 0].set(env.last)
        if side is not None:
            side = jnp.zeros((side.shape[0], P) + side.shape[1:], side.dtype).at[:, 0].set(side)
        return FeedState(self.place(env, cache), pending, jnp.ones((B,), jnp.int32), jnp.zeros((B,), bool), side,
                         own)

    def init(self, env: DraftEnv, prefill: TargetPrefill, prompt, max_len: int) -> FeedState:
        return self.fresh(env, self.read_prompt(env, prefill, prompt, max_len))

    def read_feed(self, env: DraftEnv, state: FeedState):
        """(`read`'s output after `last`, the state with the feed read and committed, `deferred` cleared). The feed
        is read without the guard's `defer` extra slots when every row's unread tokens fit there (a round after a
        drafting round), else whole: two branches of one program."""
        P = state.pending.shape[1]
        defer = int(getattr(env.needs, "defer", 0) or 0)
        read = lambda W: self.read(env, state, W)  # noqa: E731
        if 0 < defer < P:
            out, new = jax.lax.cond(jnp.all(state.n_pending <= P - defer), lambda: read(P - defer), lambda: read(P))
        else:
            out, new = read(P)
        state = self.written(env, state, new)
        cache = state.cache
        if cache is not None:
            cache = self.place(env, kvc.commit(cache, rep(state.n_pending, self.streams(env))))
        return out, state.replace(cache=cache, deferred=jnp.zeros_like(state.deferred))

    def root(self, env: DraftEnv, state: FeedState):
        logits, state = self.read_feed(env, state)
        return draft_log_probs(logits, env), None, state

    def level_logits(self, env: DraftEnv, state: FeedState, tokens, depth, mask, offset, run):
        """(`forward`'s logits [B, K, V] of one tree level, state): `level` before the sampler's processing."""
        cache = state.cache
        positions = (cache.length + cache.pos_offset - 1)[:, None] + depth  # the root is committed

        def go(c):
            return self.forward(env, tokens, positions, c, mask, offset)

        logits, cache = run_level(run, go, cache)
        return logits, state.replace(cache=cache)

    def level(self, env: DraftEnv, state: FeedState, tokens, depth, mask, offset, run):
        logits, state = self.level_logits(env, state, tokens, depth, mask, offset, run)
        return draft_log_probs(logits, env), None, state

    def catch_up(self, env: DraftEnv, state: FeedState) -> FeedState:
        """When every row has room for one more token, nothing is computed: the round's token waits unread and
        `commit` appends it (`deferred`), so a round without drafts costs the target's step alone; otherwise `root`
        reads the feed now. The next `root` reads whatever waits, so later drafts are those of reading at once."""
        room = jnp.all(state.n_pending < state.pending.shape[1])
        state = when(~room, lambda s: self.root(env, s)[2], state)
        return when(room, lambda s: s.replace(deferred=jnp.ones_like(s.deferred)), state)

    def commit(self, env: DraftEnv, state: FeedState, c: Catchup) -> FeedState:
        """The leading accepted nodes the drafter fed (`Catchup.fed`, with `keeps_fed`) are committed from its
        scratch slots; the rest wait in the feed. A finished row feeds nothing new: it re-reads `last` at its slot.
        Rows whose round read nothing (`deferred`) keep their unread tokens and get the round's appended after them
        (a finished one keeps what it had)."""
        a, active, new, slots, dfr = c.accepted, c.active, c.new, c.fed, state.deferred
        n = self.streams(env)
        P, D = state.pending.shape[1], c.path.shape[1] - 1
        if slots is None or not self.keeps_fed:
            if P < D + 1:
                raise ValueError(f"a proposal without `fed` needs pending_width >= {D + 1} (the whole path), got {P}")
            fed = jnp.zeros_like(a)
        else:
            usable = (slots >= 0) & (jnp.arange(D)[None, :] < a[:, None])
            fed = jnp.sum(jnp.cumprod(usable.astype(jnp.int32), axis=1), axis=1)
        fed = jnp.where(active, fed, 0)
        cache = state.cache
        if cache is not None:
            if slots is not None and self.keeps_fed:
                cache = (kvc.commit(cache, rep(fed, n)) if c.is_chain
                         else kvc.commit_path(cache, rep(jnp.maximum(slots, 0), n), rep(fed, n)))
            read = rep(active | dfr, n)  # a finished row that read `last` again undoes it
            cache = self.place(env, cache.replace(length=jnp.where(read, cache.length, cache.length - 1)))
        idx = jnp.minimum(fed[:, None] + jnp.arange(P)[None, :], new.shape[1] - 1)
        nxt = jnp.take_along_axis(new, idx, axis=1)
        pending = jnp.where(active[:, None], nxt, jnp.zeros_like(nxt).at[:, 0].set(env.last))
        n_pending = jnp.where(active, a + 1 - fed, 1)
        later = appended(state.pending, state.n_pending, new, a + 1)
        pending = jnp.where(dfr[:, None], jnp.where(active[:, None], later, state.pending), pending)
        n_pending_d = jnp.where(active, state.n_pending + a + 1, state.n_pending)
        side = state.side
        if side is not None:
            new_side = self.side_of(env, state, c).astype(side.dtype)  # [R, D+1, ...]
            act, dfr_r = rep(active, n), rep(dfr, n)
            shape = lambda m: m.reshape(m.shape + (1,) * (side.ndim - m.ndim))  # noqa: E731
            last_side = _along(side, rep(state.n_pending - 1, n)[:, None])[:, 0]  # what `last` was read with
            nxt_side = _along(new_side, rep(idx, n))
            now = jnp.where(shape(act[:, None]), nxt_side, jnp.zeros_like(nxt_side).at[:, 0].set(last_side))
            later_side = appended(side, rep(state.n_pending, n), new_side, rep(a + 1, n))
            side = jnp.where(shape(dfr_r[:, None]), jnp.where(shape(act[:, None]), later_side, side), now)
        return state.replace(cache=cache, pending=pending, n_pending=jnp.where(dfr, n_pending_d, n_pending),
                             side=side)
