"""Drafters: who proposes tokens, and with which distribution.

A drafter is a pytree object (its models' params and any numbers are leaves). The engine calls it on the host
once per decode (`check`, `prepare`) and on the device inside the jitted step:

- `check(target)`: raise ValueError before any compute (e.g. a vocabulary that differs from the target's).
- `map_models(fn)`: the drafter with `fn` applied to every model it runs (placement on a mesh, image mode).
- `prepare(setup: Setup) -> Prepared`: the drafter as it will run (guided, replicated) and its prompt, a pytree
  of host or device arrays handed to `init` inside the prefill program, with the cache extent it needs.
- optional `prefill_asks(tokens, lengths, inputs) -> dict`: forward options for the target's prefill whose
  by-products `init` reads (e.g. `{"hidden_layers": (N,)}`: an early-exit drafter's prompt states at layer N).
- `init(env, prefill: TargetPrefill, prompt, max_len, pending_width) -> state`: prefill; `prefill` holds the
  target prefill's by-products (logits, requested hidden states and attention, its cache).
- `root(env, state) -> (logp [B, 1, V], aux, state)`: the distribution after the newest committed token
  (`env.last`), after reading whatever committed tokens the drafter has not seen.
- `level(env, state, tokens [B, K], depth [B, K], mask [B, K, S], offset, run) -> (logp [B, K, V], aux, state)`:
  one tree level: K new nodes at `depth` below the root (the drafter places them at its own positions), written
  at scratch offsets offset.. past the committed tokens, each seeing the committed tokens and the scratch slots
  its `mask` row allows (S >= offset + K; nothing past offset + K is set); `run` (a traced bool or None) lets a
  level no row needs be skipped. `offset` is traced (a plan drafts its levels in a loop), and a level may carry
  padding nodes past the tree's: they may write scratch slots up to the plan's `scratch`, which later levels
  overwrite and no node reads.
- `commit(env, state, catchup: Catchup) -> state`: the state after verification accepted a path; the committed
  tokens are the path's (`catchup.prop.tokens` along `catchup.path`, root first), so a drafter that reads the
  generated text keeps it from here (`jspec.drafters.ngram`, prompt lookup).
- optional class attribute `verify_hidden = True`: the drafter reads the target's last-layer hidden states at the
  accepted path's nodes from verification (`Catchup.hidden`; an EAGLE feature head).

logp is the log of the distribution the plan ranks and draws children from (the sampler's processed distribution
when sampling, the plain softmax when greedy); aux is a per-node pytree [B, K, ...] of the drafter's own
(e.g. per-view probabilities of a multi-view drafter, for its controller) or None.
`env` is a `DraftEnv`: the static step context, sampling params, the target (as run), its cache at the step's
start (read only) and the controller's decision for this step.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax


class DraftEnv(NamedTuple):
    ctx: Any  # loop.StepContext
    sp: Any  # sampling.SamplingParams
    target: Any
    tcache: Any  # the target's KV cache at the step's start (committed tokens before `last`)
    last: jax.Array  # [B] the newest committed token (the tree's root)
    decision: Any = None  # controllers.Decision of this step
    plan_scratch: int = 0  # the plan's draft scratch slots (set for `init`: a drafter may size buffers by it)
    plan_depth: int = 0  # the plan's deepest draft level (set for `init`)


class Setup(NamedTuple):
    """Host-side facts a drafter prepares from (before any compute)."""

    target: Any  # the target as given (unsharded, unguided)
    prompt: Any  # the user's prompt, as given
    tokens: Any  # [B, T] the target's prompt tokens (right padded)
    lengths: Any  # [B]
    inputs: dict  # the target's modality inputs
    draft_prompt: Any  # the user's draft_prompt= or None
    mesh: Any
    guidance: Any
    constraint: Any


class Prepared(NamedTuple):
    drafter: Any  # as it runs (guided, placed)
    prompt: Any  # handed to `init`
    longest: int  # the longest prompt it caches
    width: int  # its prompt arrays' width
    stats: dict | None = None  # host-side numbers of the preparation (e.g. a captioner's seconds) for `out.stats`


class TargetPrefill(NamedTuple):
    """The target prefill's by-products, handed to the prefill hook and the drafter's `init`."""

    logits: jax.Array  # [B, V] at each row's last prompt token
    hidden: tuple  # hidden states the hook and the drafter asked for, each [B, T, D], in the order of `layers`
    attn: jax.Array | None  # [B, S] attention over prompt slots when the hook asked (`attn_query_weights`)
    tokens: jax.Array  # [B, T]
    lengths: jax.Array  # [B]
    cache: Any  # the target's cache after the prefill
    layers: tuple = ()  # the layer index of each entry of `hidden`

    def hidden_at(self, layer: int) -> jax.Array:
        """The residual stream after the target's first `layer` layers, [B, T, D] (it must have been asked for)."""
        if layer not in self.layers:
            raise ValueError(f"the target prefill kept hidden states of layers {self.layers}, not {layer}")
        return self.hidden[self.layers.index(layer)]


class Catchup(NamedTuple):
    """What a step decided, for the drafter's `commit`."""

    prop: Any  # the step's Proposal
    path: jax.Array  # [B, D+1] node ids of the accepted path by depth
    new: jax.Array  # [B, D+1] [accepted drafts..., bonus, 0...]
    accepted: jax.Array  # [B] drafts accepted (bonus excluded)
    active: jax.Array  # [B] the row was decoding this step
    is_chain: bool  # the plan's nodes sit in depth order (accepted scratch entries are already a prefix)
    hidden: jax.Array | None = None  # [B, D+1, (streams,) D_model] the target's last-layer residual stream at the
    # accepted path's nodes (root first), for a drafter with `verify_hidden = True`


from jspec.drafters.model import ModelDrafter  # noqa: E402

__all__ = ["Catchup", "DraftEnv", "ModelDrafter", "Prepared", "Setup", "TargetPrefill"]
