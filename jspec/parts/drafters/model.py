"""A separate draft model that drafts from its own KV cache (Chain, Tree, DynamicTree, SAGE, SpecVLM's Std.-SD):
a `FeedDrafter` whose model part is the draft model's prefill and forward, with the draft's prompt view (its own
processor's, or the target's prompt without image placeholders) and its placement on a mesh.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ports.core import cache as kvc
from jspec.core import guidance as GD
from jspec.core import prefill as PR
from jspec.core import sharding as SH
from jspec.parts.drafters.feed import FeedDrafter, FeedState
from jspec.parts.protocols import DraftEnv, Prepared, Setup, TargetPrefill
from ports.core.prompts import model_prompt, normalize_prompt


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
class ModelDrafter(FeedDrafter):
    """Drafts with `model` (a `ports.Model`, or a guided wrapper of one) over its own prompt view, reading the
    committed text through `FeedDrafter`'s feed. `model=None` drafts with the target itself as it runs (sharded,
    guided: its weights, not a copy) from a cache of its own (SpecVLM's Self-SD, whose draft cache holds a pruned
    prompt)."""

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

    def place(self, env: DraftEnv, cache):
        # a replicated draft keeps a replicated cache; a tensor-parallel one and the target drafting for itself
        # split theirs like the target's
        return SH.constrain(env.ctx.placement, cache, replicated=self.model is not None and not self.tensor_parallel)

    def read_prompt(self, env: DraftEnv, prefill: TargetPrefill, prompt, max_len: int):
        tokens, lengths, inputs = prompt
        model = self.run_model(env)
        return PR.prefill(model, tokens, lengths, PR.new_cache_for(model, tokens.shape[0], max_len), inputs)[2]

    def forward(self, env: DraftEnv, tokens, positions, cache, mask=None, offset=0, logits_at=None):
        kw = {} if logits_at is None else {"logits_at": logits_at}
        fo = self.run_model(env).forward(tokens, positions, cache, mask, write_offset=offset, **kw)
        return fo.logits, fo.cache

    def read(self, env: DraftEnv, ds: FeedState, width: int):
        # a model that can return its new keys / values writes them after the feed's two-width branch
        # (`written`), so its cache is not copied into and out of the branch
        model = self.run_model(env)
        if not getattr(model, "defers_writes", False):
            return super().read(env, ds, width)
        P = ds.pending.shape[1]
        pending = ds.pending[:, :width]
        pos = kvc.positions(ds.cache, jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), pending.shape))
        fo = model.forward(pending, pos, ds.cache, logits_at=(ds.n_pending - 1)[:, None], defer_writes=True)
        pad = lambda x: jnp.pad(x, ((0, 0),) * (x.ndim - 2) + ((0, P - width), (0, 0)))  # noqa: E731
        return fo.logits, jax.tree.map(pad, fo.pending)

    def written(self, env: DraftEnv, ds: FeedState, new) -> FeedState:
        if not getattr(self.run_model(env), "defers_writes", False):
            return ds.replace(cache=new)
        return ds.replace(cache=kvc.write_pending(ds.cache, *new))
