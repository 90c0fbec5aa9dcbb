"""Layer skipping: the target with some of its decoder layers left out, as its own draft model (the "Self-SD"
baseline of EESD, after Zhang et al.'s Draft & Verify).

Two ways to draft with it:
- `SkipDrafter(skip)` (`jspec.Chain(SkipDrafter.of(skip_layers(t, s)), gamma=4)`), as Draft & Verify runs it: the
  target drafts for itself in its own KV cache. A kept layer attends to the K/V the full model wrote for the
  committed tokens, and the drafts' K/V go into the scratch slots past the committed length, which the verify
  then overwrites. Nothing is prefilled or read after a verify, and no memory is added, so a round without drafts
  costs the target's step alone.
- `skip_layers(target, skip)`, an ordinary `ports.Model` whose layers are the target's own arrays (nothing is
  copied), drafts through any strategy that takes a draft model (`jspec.Chain(skip_layers(t, s), gamma=4)`). It
  keeps its own KV cache of the layers it runs, filled by its own prefill, so every draft is exactly the reduced
  model's prediction.
No training.

Which layers to skip is searched offline (`jspec.tools.train.layer_skip.search`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec.core import sharding as SH
from jspec.parts.drafters.feed import draft_log_probs
from jspec.parts.protocols import DraftEnv, Drafter, Prepared, Setup, run_level
from ports.core import cache as kvc

FAMILIES = ("llama", "qwen2", "mistral")
SKIPPED = "jspec_skipped_layers"  # the hf_config entry of a `skip_layers` model: the target layers it leaves out


def check_target(target) -> int:
    cfg = target.config
    if getattr(cfg, "model_type", None) not in FAMILIES or not isinstance(target.params.get("layers"), list):
        raise ValueError(f"layer skipping needs a text model of {FAMILIES} with a list of layers; got "
                         f"{getattr(cfg, 'model_type', type(target).__name__)}")
    return cfg.num_layers


def skip_layers(target, skip: Iterable[int]):
    """`target` without the decoder layers `skip` (0-based indices): a model of the remaining layers, in order,
    sharing the target's arrays. ValueError for an index out of range, a repeated one, or skipping every layer."""
    import ports

    n = check_target(target)
    skip = [int(i) for i in skip]
    bad = [i for i in skip if not 0 <= i < n]
    if bad or len(set(skip)) != len(skip) or len(skip) >= n:
        raise ValueError(f"cannot skip layers {skip} of a {n}-layer model: "
                         + (f"{bad} out of range" if bad else "repeated indices" if len(set(skip)) != len(skip)
                            else "at least one layer must remain"))
    keep = [i for i in range(n) if i not in set(skip)]
    params = {**target.params, "layers": [target.params["layers"][i] for i in keep]}
    hf = dict(target.hf_config or {})
    if "num_hidden_layers" in hf:
        hf["num_hidden_layers"] = len(keep)
    hf[SKIPPED] = sorted(skip)
    return ports.Model(dataclasses.replace(target.config, num_layers=len(keep)), params, hf)


def draft_cost(target, n_skip: int) -> float:
    """The reduced model's share of the target's multiply-adds per token (layers + LM head; attention over the
    cache left out): what skipping saves when the LM head is large."""
    cfg = target.config
    layer = sum(a.size for a in jax.tree.leaves(target.params["layers"][0]) if a.ndim >= 2)  # fused: 3-4 dims
    head = cfg.vocab_size * cfg.hidden_size
    return float(((cfg.num_layers - n_skip) * layer + head) / (cfg.num_layers * layer + head))


@struct.dataclass
class SkipState:
    cache: Any = None  # the target's cache while it is lent for a draft (`lend`); None between rounds


@struct.dataclass
class SkipDrafter(Drafter):
    """The target drafting for itself without its decoder layers `skip`, in its own KV cache (module docstring).
    The drafts are the reduced model's predictions over the full model's K/V of the committed text."""

    skip: tuple = struct.field(pytree_node=False, default=())
    borrows_cache = True

    @classmethod
    def of(cls, model) -> "SkipDrafter":
        """The drafter that skips what the `skip_layers` model `model` leaves out."""
        skipped = (model.hf_config or {}).get(SKIPPED)
        if skipped is None:
            raise ValueError("SkipDrafter.of takes a model made by skip_layers(target, skip)")
        return cls(tuple(int(i) for i in skipped))

    def check(self, target) -> None:
        skip_layers(target, self.skip)  # the family, the layer list and the indices

    def prepare(self, setup: Setup) -> Prepared:
        if setup.draft_prompt is not None:
            raise ValueError("SkipDrafter drafts from the target's own cache: draft_prompt= does not apply")
        if setup.guidance is not None or setup.constraint is not None:
            raise ValueError("guidance / constraint with SkipDrafter are not supported: use skip_layers(target, "
                             "skip) as a draft model")
        return Prepared(self, None, int(np.max(setup.lengths)), setup.tokens.shape[1])

    def init(self, env: DraftEnv, prefill, prompt, max_len: int) -> SkipState:
        return SkipState()

    def lend(self, state: SkipState, cache) -> SkipState:
        """The state holding the target's cache (committed tokens before `env.last`) for the draft."""
        return state.replace(cache=cache)

    def give_back(self, state: SkipState):
        """(the state without the cache, the cache with the drafts' K/V past the committed length)."""
        return state.replace(cache=None), state.cache

    def commit(self, env: DraftEnv, state: SkipState, catchup) -> SkipState:
        return state  # the verify wrote every committed token's K/V

    def catch_up(self, env: DraftEnv, state: SkipState) -> SkipState:
        return state

    def _forward(self, env: DraftEnv, cache, tokens, positions, mask=None, offset: int = 0, after_root: int = 0):
        """(logits, the target cache with the kept layers' new K/V written): the reduced model's forward over the
        kept layers of `cache`, seen with `after_root` more committed slots (the root's)."""
        target = env.target
        keep = [i for i in range(len(cache.k)) if i not in set(self.skip)]
        view = cache.replace(k=[cache.k[i] for i in keep], v=[cache.v[i] for i in keep],
                             length=cache.length + after_root)
        fo = skip_layers(target, self.skip).forward(tokens, positions, view, mask, write_offset=offset)
        k, v = list(cache.k), list(cache.v)
        for j, i in enumerate(keep):
            k[i], v[i] = fo.cache.k[j], fo.cache.v[j]
        return fo.logits, SH.constrain(env.ctx.placement, cache.replace(k=k, v=v), replicated=False)

    def root(self, env: DraftEnv, state: SkipState):
        tc = state.cache
        last = env.last.astype(jnp.int32)[:, None]
        logits, tc = self._forward(env, tc, last, kvc.positions(tc, jnp.zeros_like(last)))
        return draft_log_probs(logits, env), None, state.replace(cache=tc)

    def level(self, env: DraftEnv, state: SkipState, tokens, depth, mask, offset: int, run):
        tc = state.cache
        positions = (tc.length + tc.pos_offset)[:, None] + depth

        def go(c):
            return self._forward(env, c, tokens, positions, mask, offset, after_root=1)

        logits, tc = run_level(run, go, tc)
        return draft_log_probs(logits, env), None, state.replace(cache=tc)
