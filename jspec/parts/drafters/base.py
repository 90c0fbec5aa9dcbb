"""The types the engine and every drafter share: the step's `DraftEnv`, the host-side `Setup` / `Prepared`, the
target prefill's by-products and a step's `Catchup` (the protocol itself: `jspec.parts.drafters`)."""
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
    needs: Any = None  # the strategy's `Needs` (plan depth and scratch, what the controller and rule ask for)
    out: jax.Array | None = None  # [B, out_len] the tokens generated so far: each row's first n_out, `last` the newest
    n_out: jax.Array | None = None  # [B] int32
    stop: Any = None  # the controller's per-level `stop(level, aux, limit) -> limit` this step (None: never stops)


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
    hidden: jax.Array | None = None  # [B, D+1, (streams,) n * D_model] the target's residual streams at the
    # drafter's `verify_layers` (concatenated on the last axis, in that order) at the accepted path's nodes (root
    # first), for a drafter with `verify_hidden = True`


class Drafter:
    """Base of drafters (the protocol: `jspec.parts.drafters`). A drafter subclasses it (as a `flax.struct` dataclass)
    and defines `prepare`, `init`, `root`, `level` and `commit`; the optional hooks default to doing nothing."""

    verify_hidden = False  # reads the target's hidden states at the accepted nodes (`Catchup.hidden`)

    def check(self, target) -> None:
        """ValueError before any compute when the drafter cannot serve `target` (default: nothing to check)."""

    def map_models(self, fn) -> "Drafter":
        """The drafter with `fn` applied to every model it runs (default: it runs none of its own)."""
        return self

    def verify_layers(self, num_layers: int) -> tuple[int, ...]:
        """With `verify_hidden`: the target layers i (the residual stream after its first i of `num_layers`
        layers) whose states `Catchup.hidden` concatenates, in that order (default: the last layer's)."""
        return (num_layers,)

    def prefill_asks(self, tokens, lengths, inputs) -> dict:
        """Forward options of the target's prefill whose by-products `init` reads (default: none)."""
        return {}

    def prepare(self, setup: Setup) -> Prepared:
        raise NotImplementedError(f"{type(self).__name__} defines no `prepare`")

    def init(self, env: DraftEnv, prefill: TargetPrefill, prompt, max_len: int, pending_width: int):
        raise NotImplementedError(f"{type(self).__name__} defines no `init`")

    def root(self, env: DraftEnv, state):
        raise NotImplementedError(f"{type(self).__name__} defines no `root`")

    def level(self, env: DraftEnv, state, tokens, depth, mask, offset, run):
        raise NotImplementedError(f"{type(self).__name__} defines no `level`")

    def commit(self, env: DraftEnv, state, catchup: Catchup):
        raise NotImplementedError(f"{type(self).__name__} defines no `commit`")
