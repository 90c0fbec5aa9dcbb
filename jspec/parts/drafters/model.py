"""A separate draft model that drafts from its own KV cache (Chain, Tree, DynamicTree, SAGE, SpecVLM's Std.-SD).

The draft cache holds the committed tokens the draft has read. `pending` holds committed tokens it has not read
yet, ending with `last` (the tree's root); `root` feeds them, which also yields the root's distribution, and each
tree level is written into scratch slots past the committed length. After a step, the accepted nodes the draft
fed while drafting are committed from those scratch slots (in place for a chain, with one gather otherwise); only
the rest wait in `pending` for the next `root`.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ports import cache as kvc
from jspec.core import guidance as GD
from jspec.core import sampling as SM
from jspec.core import sharding as SH
from jspec.parts.protocols import Catchup, DraftEnv, Drafter, Prepared, Setup, TargetPrefill, run_level, when
from ports.prompts import model_prompt, normalize_prompt


def check_vocab(target, model, who: str = "draft") -> None:
    if not hasattr(getattr(model, "config", None), "vocab_size"):
        raise ValueError(f"the {who} must be a model (ports.load_hf / ports.load / jspec.tools.zoo.load), got "
                         f"{type(model).__name__}")
    check_vocab_size(target, model.config.vocab_size, who)


def check_vocab_size(target, vocab_size: int, who: str = "draft") -> None:
    """ValueError unless a part with `vocab_size` entries shares the target's vocabulary."""
    tv, dv = target.config.vocab_size, vocab_size
    if tv != dv:
        raise ValueError(f"{who} and target vocabularies differ: target vocab_size={tv}, {who} vocab_size={dv}; "
                         "speculative decoding needs one shared tokenizer")


def draft_log_probs(logits: jax.Array, env: DraftEnv) -> jax.Array:
    """Draft log-probabilities used to rank and draw children: the sampler's distribution when sampling (-inf
    where top-k/top-p filter), the plain softmax when greedy (so lower ranks are the draft's next guesses)."""
    return jax.nn.log_softmax(SM.process_logits(logits, env.ctx.sampling, env.sp), axis=-1)


def default_view(target, draft, prompt, tokens, lengths, inputs):
    """The draft's default prompt: a draft that reads images prepares the raw prompt itself (its own tower and
    layout); a text-only draft gets the prompt without the image / video placeholder tokens."""
    if not inputs:
        return tokens, lengths, inputs
    if draft.family.prompt_embeds is not None:
        try:
            return model_prompt(draft, prompt, "draft ")
        except ValueError as e:
            raise ValueError(f"the draft cannot read the target's prompt: it was prepared for another model ({e}); "
                             "pass draft_prompt= built with the draft's own processor") from e
    placeholders = [t for t in (getattr(target.config, "image_token_id", None),
                                getattr(target.config, "video_token_id", None)) if t is not None]
    rows = [tokens[b, :lengths[b]] for b in range(tokens.shape[0])]
    d_tokens, d_lengths, _ = normalize_prompt([r[~np.isin(r, placeholders)] for r in rows], draft.config.vocab_size)
    return d_tokens, d_lengths, {}


@struct.dataclass
class DraftState:
    cache: kvc.KVCache  # committed length = tokens the draft has read, `last` excluded
    pending: jax.Array  # [B, pending_width] committed tokens the draft has not read yet, ending with `last`
    n_pending: jax.Array  # [B] int32
    deferred: jax.Array | None = None  # [B] bool: this round's `catch_up` left `pending` unread (`read_or_defer`)


@struct.dataclass
class ModelDrafter(Drafter):
    """Drafts with `model` (a `ports.Model`, or a guided wrapper of one) over its own prompt view. `model=None`
    drafts with the target itself as it runs (sharded, guided: its weights, not a copy) from a cache of its own
    (SpecVLM's Self-SD, whose draft cache holds a pruned prompt)."""

    model: Any
    tensor_parallel: bool = struct.field(pytree_node=False, default=False)  # set by `prepare`, see there

    def run_model(self, env: DraftEnv):
        return env.target if self.model is None else self.model

    def check(self, target) -> None:
        if self.model is not None:
            check_vocab(target, self.model)

    def map_models(self, fn) -> "ModelDrafter":
        return self if self.model is None else self.replace(model=fn(self.model))

    def prepare(self, setup: Setup) -> Prepared:
        if self.model is None:
            if setup.draft_prompt is not None:
                raise ValueError("the target drafts for itself (draft=None): it reads the target's prompt, so "
                                 "draft_prompt= does not apply (a prefill hook may prune that prompt)")
            if setup.guidance is not None or setup.constraint is not None:
                raise ValueError("guidance / constraint with the target as its own draft (draft=None) are not "
                                 "supported: pass a separate draft model")
            return Prepared(self, (setup.tokens, setup.lengths, setup.inputs), int(np.max(setup.lengths)),
                            setup.tokens.shape[1])
        if setup.draft_prompt is not None:
            tokens, lengths, inputs = model_prompt(self.model, setup.draft_prompt, "draft ")
            if tokens.shape[0] != setup.tokens.shape[0]:
                raise ValueError(f"draft_prompt has {tokens.shape[0]} rows, the prompt has {setup.tokens.shape[0]}")
        else:
            tokens, lengths, inputs = default_view(setup.target, self.model, setup.prompt, setup.tokens,
                                                   setup.lengths, setup.inputs)
        # on a mesh a draft is replicated, unless it comes sharded over it (`jspec.shard(draft, mesh)`): then its
        # params stay split by the logical axis rules and its cache is split like the target's (tensor parallel)
        tensor_parallel = setup.mesh is not None and SH.is_sharded_on(self.model, setup.mesh)
        model = self.model if setup.mesh is None or tensor_parallel else SH.replicate(self.model, setup.mesh)
        longest, width = int(lengths.max()), tokens.shape[1]
        if setup.guidance is not None or setup.constraint is not None:
            if inputs:
                raise ValueError("guidance / constraint take token prompts only (no image inputs)")
            model = GD.guide(model, lengths, setup.guidance, setup.constraint)
            longest, width = int(np.max(np.asarray(model.prompt_end))), max(width, model.uncond.shape[1])
        return Prepared(self.replace(model=model, tensor_parallel=tensor_parallel), (tokens, lengths, inputs),
                        longest, width)

    def _constrain(self, env: DraftEnv, cache):
        # a replicated draft keeps a replicated cache; a tensor-parallel one and the target drafting for itself
        # split theirs like the target's
        return SH.constrain(env.ctx.placement, cache, replicated=self.model is not None and not self.tensor_parallel)

    def init(self, env: DraftEnv, prefill: TargetPrefill, prompt, max_len: int, pending_width: int) -> DraftState:
        from jspec.core import prefill as PR

        tokens, lengths, inputs = prompt
        model = self.run_model(env)
        cache = PR.new_cache_for(model, tokens.shape[0], max_len)
        _, _, cache = PR.prefill(model, tokens, lengths, cache, inputs)
        B = tokens.shape[0]
        pending = jnp.zeros((B, pending_width), jnp.int32).at[:, 0].set(env.last)
        return DraftState(self._constrain(env, cache), pending, jnp.ones((B,), jnp.int32), jnp.zeros((B,), bool))

    def root_logits(self, env: DraftEnv, ds: DraftState):
        """(logits [B, 1, V] after `last`, state): `root` before the sampler's processing."""
        dc = ds.cache
        model = self.run_model(env)
        P = ds.pending.shape[1]
        # two feed widths are two branches: a model that can return its new keys / values writes them after the
        # branch, so its cache is not copied into and out of it
        defers = getattr(model, "defers_writes", False)

        def read(W):
            pending = ds.pending[:, :W]
            pos = kvc.positions(dc, jnp.broadcast_to(jnp.arange(W, dtype=jnp.int32), pending.shape))
            kw = {"defer_writes": True} if defers else {}
            fo = model.forward(pending, pos, dc, logits_at=(ds.n_pending - 1)[:, None], **kw)
            if not defers:
                return fo.logits, fo.cache
            pad = lambda x: jnp.pad(x, ((0, 0),) * (x.ndim - 2) + ((0, P - W), (0, 0)))  # noqa: E731
            return fo.logits, jax.tree.map(pad, fo.pending)

        logits, out = feed(env, ds, read)
        cache = kvc.write_pending(dc, *out) if defers else out
        ds = ds.replace(cache=kvc.commit(cache, ds.n_pending))
        return logits, ds if ds.deferred is None else ds.replace(deferred=jnp.zeros_like(ds.deferred))

    def level_logits(self, env: DraftEnv, ds: DraftState, tokens, depth, mask, offset: int, run):
        """(logits [B, K, V] of one tree level, state): `level` before the sampler's processing."""
        positions = (ds.cache.length + ds.cache.pos_offset - 1)[:, None] + depth  # the root is committed
        model = self.run_model(env)

        def go(dc):
            fo = model.forward(tokens, positions, dc, mask, write_offset=offset)
            return fo.logits, fo.cache

        logits, dc = run_level(run, go, ds.cache)
        return logits, ds.replace(cache=dc)

    def root(self, env: DraftEnv, ds: DraftState):
        logits, ds = self.root_logits(env, ds)
        return draft_log_probs(logits, env), None, ds

    def level(self, env: DraftEnv, ds: DraftState, tokens, depth, mask, offset: int, run):
        logits, ds = self.level_logits(env, ds, tokens, depth, mask, offset, run)
        return draft_log_probs(logits, env), None, ds

    def catch_up(self, env: DraftEnv, ds: DraftState) -> DraftState:
        if ds.deferred is None:
            return self.root(env, ds)[2]
        return read_or_defer(ds, lambda s: self.root(env, s)[2])

    def commit(self, env: DraftEnv, ds: DraftState, c: Catchup) -> DraftState:
        cache, pending, n = commit_fed(env, ds.cache, ds.pending, c, replicated=self.model is not None,
                                       n_pending=ds.n_pending, deferred=ds.deferred)
        return ds.replace(cache=cache, pending=pending, n_pending=n)


def feed(env: DraftEnv, ds, read):
    """`read(W)` over the first W entries of the pending feed `ds.pending` [B, P]: the feed without the guard's
    `defer` extra slots when every row's unread tokens fit there (a round after a drafting round), else all P (after
    rounds that left tokens unread). The two widths are two branches of one program."""
    P = ds.pending.shape[1]
    defer = int(getattr(env.needs, "defer", 0) or 0)
    if not 0 < defer < P:
        return read(P)
    return jax.lax.cond(jnp.all(ds.n_pending <= P - defer), lambda: read(P - defer), lambda: read(P))


def read_or_defer(ds, read):
    """`catch_up` for a drafter that keeps the committed tokens it has not read in `ds.pending` [B, P] (`n_pending`
    of them, ending with `last`) and a `deferred` flag [B]: when every row has room for one more token, nothing is
    computed and the round's token waits unread (`commit_fed` appends it), so a round without drafts costs the
    target's step alone; otherwise `read(ds)` (the drafter's `root`, which clears the flag) reads them all now. The
    next `root` reads whatever waits, so the drafts that follow are the same as if every round had read."""
    room = jnp.all(ds.n_pending < ds.pending.shape[1])
    ds = when(~room, read, ds)
    return when(room, lambda s: s.replace(deferred=jnp.ones_like(s.deferred)), ds)


def appended(pending: jax.Array, n_pending: jax.Array, new: jax.Array, count: jax.Array) -> jax.Array:
    """`pending` [B, P, ...] with `new`'s first `count` [B] entries written after its first `n_pending` [B]."""
    idx = jnp.arange(pending.shape[1])[None] - n_pending[:, None]  # [B, P]: position in `new`
    take = jnp.take_along_axis(new, jnp.clip(idx, 0, new.shape[1] - 1).reshape(idx.shape + (1,) * (new.ndim - 2)),
                               axis=1)
    put = ((idx >= 0) & (idx < count[:, None])).reshape(idx.shape + (1,) * (new.ndim - 2))
    return jnp.where(put, take, pending)


def commit_fed(env: DraftEnv, dc: kvc.KVCache | None, pending: jax.Array, c: Catchup, replicated: bool = True,
               n_pending: jax.Array | None = None, deferred: jax.Array | None = None):
    """A drafter cache's catch-up after a step: (cache, pending, n_pending). The leading accepted nodes the drafter
    fed (`Catchup.fed`) are committed from its scratch slots; the rest wait in `pending`. A finished row feeds
    nothing new: it re-reads `last` at its slot. A drafter without a cache of its own passes None. Rows whose
    round read nothing (`deferred`, see `read_or_defer`) keep their unread tokens and get the round's appended
    after the `n_pending` already waiting (a finished one keeps what it had)."""
    a, active, new, slots = c.accepted, c.active, c.new, c.fed
    W = pending.shape[1]
    D = c.path.shape[1] - 1
    if slots is None:
        if W < D + 1:
            raise ValueError(f"a proposal without `fed` needs pending_width >= {D + 1} (the whole path), got {W}")
        fed = jnp.zeros_like(a)
    else:
        usable = (slots >= 0) & (jnp.arange(D)[None, :] < a[:, None])
        fed = jnp.sum(jnp.cumprod(usable.astype(jnp.int32), axis=1), axis=1)
    fed = jnp.where(active, fed, 0)
    if dc is not None:
        if slots is not None:
            dc = kvc.commit(dc, fed) if c.is_chain else kvc.commit_path(dc, jnp.maximum(slots, 0), fed)
        read = active if deferred is None else active | deferred  # a finished row that read `last` again undoes it
        dc = SH.constrain(env.ctx.placement, dc.replace(length=jnp.where(read, dc.length, dc.length - 1)),
                          replicated=replicated)
    idx = jnp.minimum(fed[:, None] + jnp.arange(W)[None, :], new.shape[1] - 1)
    nxt = jnp.take_along_axis(new, idx, axis=1)
    last_only = jnp.zeros_like(nxt).at[:, 0].set(env.last)
    out, n = jnp.where(active[:, None], nxt, last_only), jnp.where(active, a + 1 - fed, 1)
    if deferred is None:
        return dc, out, n
    later = appended(pending, n_pending, new, a + 1)
    out = jnp.where(deferred[:, None], jnp.where(active[:, None], later, pending), out)
    return dc, out, jnp.where(deferred, jnp.where(active, n_pending + a + 1, n_pending), n)
