"""Strategies: a speculative strategy is a composition of parts, and the paper methods are presets of it.

`Speculative(drafter, plan, rule, controller, prefill)` is the general strategy (see `jspec.parts.drafters`,
`jspec.parts.plans`, `jspec.parts.rules`, `jspec.parts.controllers`; `prefill` is an optional hook over the target prefill's
by-products, below). `Chain`, `Tree` and `DynamicTree` are presets with their familiar arguments; `parts()` turns
any strategy into its `Speculative`, and parts swap with `dataclasses.replace` on either form.

Prefill hook protocol: `asks(tokens, lengths, inputs) -> dict` of forward options for the target's prefill
(e.g. `attn_query_weights`, `hidden_layers`), then `draft_prompt(prefill: TargetPrefill, prompt) -> prompt`
picks the drafter's prompt from what the prefill returned, inside the same program (SpecVLM's pruning).
Optional: `prepare(setup, prepared) -> hook` on the host before any compute (checks of the prompts, static
widths), `draft_len(max_len) -> int`, the drafter's cache length when the hook shortens its prompt, and
`info(prefill) -> dict` of per-row facts [B, ...] that `out.stats` reports (in program).

Inside the jitted programs a strategy travels as `split(parts)`: its array and number leaves are arguments (new
values do not recompile), everything else (shapes, layouts, flags, plain objects) is the static key.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from flax import struct

from jspec.parts.controllers import Controller, asks_of
from jspec.parts.drafters import Drafter, ModelDrafter
from jspec.parts.drafters.dflash import DFlashDrafter, DFlashHead
from jspec.parts.drafters.eagle import EagleDrafter, EagleHead
from jspec.parts.drafters.eagle3 import Eagle3Drafter, Eagle3Head
from jspec.parts.drafters.ngram import NgramDrafter
from jspec.parts.plans import DynamicPlan, Plan, StaticPlan
from jspec.parts.protocols import Needs, PrefillHook
from jspec.parts.trees import Layout, StaticTree, cached_tree, chain
from jspec.parts.rules import Rule, as_rule


class Strategy:
    """Base of every strategy: `parts()` (None for AR) and `check(target)` (host-side validation)."""

    def parts(self) -> "Speculative | None":
        raise TypeError(f"strategy {type(self).__name__} defines no `parts()` (its drafter, plan, rule, controller)")

    def check(self, target) -> None:
        self.parts().check(target)


@dataclasses.dataclass(frozen=True)
class AR(Strategy):
    """Plain autoregressive decoding with the target alone (the baseline every strategy must reproduce)."""

    def parts(self):
        return None

    def check(self, target) -> None:
        pass


def _defines(cls, name: str) -> bool:
    """Whether a part's own class (not the protocol's base) defines `name`."""
    return any(name in vars(c) for c in cls.__mro__ if c.__module__ != "jspec.parts.protocols")


_BASES = {"drafter": (Drafter, "jspec.parts.drafters.Drafter"), "plan": (Plan, "jspec.parts.plans.Plan"),
          "controller": (Controller, "jspec.parts.controllers.Controller"), "prefill": (PrefillHook, "jspec.PrefillHook")}


@struct.dataclass
class Speculative(Strategy):
    """The general speculative strategy: its parts (see the module docstring)."""

    drafter: Any
    plan: Any
    rule: Any = "residual"
    controller: Any = None
    prefill: Any = None

    def parts(self) -> "Speculative":
        return self if isinstance(self.rule, Rule) else self.replace(rule=as_rule(self.rule))

    @property
    def needs(self) -> Needs:
        asks = asks_of(self.controller)
        plan = self.plan
        defer = int(getattr(self.controller, "defers", 0) or 0)
        return Needs(asks, bool(as_rule(self.rule).draws), asks.hidden or bool(self.drafter.verify_hidden),
                     asks.hidden, self.controller is not None and self.controller.stops, plan.max_depth,
                     plan.scratch, plan.pending_width + defer, plan.scratch + plan.max_depth + 1 + defer, defer)

    def check(self, target) -> None:
        for name, (base, called) in _BASES.items():
            part = getattr(self, name)
            if (part is None and name in ("drafter", "plan")) or (part is not None and not isinstance(part, base)):
                raise ValueError(f"the strategy's {name} must be a {called} (a subclass holds the protocol and its "
                                 f"defaults), got {type(part).__name__}")
        renamed = [(part, old, new) for part, old, new in ((self.controller, "plan", "decide"),
                                                            (as_rule(self.rule), "verify", "accept"))
                   if part is not None and hasattr(type(part), old) and not _defines(type(part), new)]
        if renamed:
            part, old, new = renamed[0]
            raise ValueError(f"{type(part).__name__} defines `{old}`, which the engine no longer calls: the method is "
                             f"now `{new}` (same arguments{'' if new == 'decide' else ': key, proposal, logits, ...'})")
        rule = as_rule(self.rule)
        rule.check()
        self.drafter.check(target)
        self.plan.check(rule)
        if self.controller is not None and self.controller.stops and not self.plan.stops:
            raise ValueError(f"the controller {type(self.controller).__name__} ends drafts level by level; the plan "
                             f"{type(self.plan).__name__} cannot stop there (use a chain or a static tree)")
        if self.needs.asks.node_topk and not self.plan.node_outputs:
            raise ValueError(f"the controller {type(self.controller).__name__} reads every drafted node's "
                             f"distribution; the plan {type(self.plan).__name__} does not keep them (use a static "
                             "tree)")
        if self.controller is not None:
            self.controller.check(target, self.drafter)


def as_drafter(draft) -> Drafter:
    """A `Chain` / `Tree` / `DynamicTree` draft as its drafter: a drafter as is, an EAGLE-1 feature head
    (`jspec.parts.drafters.eagle.EagleHead`), an EAGLE-3 head (`jspec.parts.drafters.eagle3.Eagle3Head`) or a block
    drafter (`jspec.parts.drafters.dflash.DFlashHead`) over the target's states, anything else as a separate draft model."""
    if isinstance(draft, Drafter):
        return draft
    if isinstance(draft, Eagle3Head):
        return Eagle3Drafter(draft)
    if isinstance(draft, EagleHead):
        return EagleDrafter(draft)
    if isinstance(draft, DFlashHead):
        return DFlashDrafter(draft)
    return ModelDrafter(draft)


@dataclasses.dataclass(frozen=True)
class Tree(Strategy):
    """Static-tree speculative decoding with a separate draft model, an EAGLE feature head or any drafter
    (`as_drafter`).

    tree: a named tree ("mc_sim_7b_63" = EAGLE-1/SpecVLM/SAGE initial tree, "naive_extend_57" = LANTERN++'s,
    "chain5") or a list of child-rank paths. rule: "residual" (default, min(1, p/q) acceptance over children
    drawn without replacement), "q1" (EAGLE-2's q = 1 rule over the draft's top-ranked children: also exact), or
    a `jspec.parts.rules.Rule`. controller: an optional controller (`jspec.parts.controllers`). budget: a `trees.Layout` to
    pad the tree into (trees of one budget share one compiled program).
    """

    draft: Any
    tree: Any = "mc_sim_7b_63"
    rule: Any = "residual"
    controller: Any = None
    budget: Layout | None = None

    def static_tree(self) -> StaticTree:
        return cached_tree(self.tree, self.budget)

    def parts(self) -> Speculative:
        return Speculative(as_drafter(self.draft), StaticPlan.of(self.static_tree()), as_rule(self.rule),
                           self.controller)


@dataclasses.dataclass(frozen=True)
class Chain(Strategy):
    """Chain speculative decoding: the draft (a model, an EAGLE feature head or any drafter: `as_drafter`) proposes
    `gamma` tokens per step, the target verifies them at once."""

    draft: Any
    gamma: int = 5
    rule: Any = "residual"
    controller: Any = None

    def __post_init__(self):
        if isinstance(self.gamma, bool) or not isinstance(self.gamma, (int, np.integer)) or not 1 <= self.gamma <= 64:
            raise ValueError(f"gamma must be an integer in [1, 64], got {self.gamma!r}")

    @property
    def tree(self) -> tuple:
        return tuple(tuple(p) for p in chain(int(self.gamma)))

    def parts(self) -> Speculative:
        return Speculative(as_drafter(self.draft), StaticPlan.from_paths(self.tree),
                           as_rule(self.rule), self.controller)


def _branches(gamma: int, branches: int) -> tuple:
    """`branches` chains of `gamma` drafts below one root, as child-rank paths."""
    return tuple(tuple([b] + [0] * d) for d in range(gamma) for b in range(branches))


@dataclasses.dataclass(frozen=True)
class PromptLookup(Strategy):
    """Prompt-lookup decoding: drafts copied from earlier occurrences of the text's last `max_ngram` (down to
    `min_ngram`) tokens in the prompt and the tokens generated so far (`jspec.parts.drafters.ngram`); no draft model.
    `gamma` drafts per branch; `branches` > 1 drafts that many distinct continuations side by side (a tree). The
    target verifies only as deep as some row found a copy (a step without one costs an AR step). `depths`: the
    deepest draft after a match of 1, 2, ..., max_ngram tokens (each <= gamma; default gamma for all), so that a
    weak one-token match drafts little and a long match a long copy."""

    max_ngram: int = 3
    gamma: int = 10
    branches: int = 1
    min_ngram: int = 1
    rule: Any = "residual"
    controller: Any = None
    depths: tuple | None = None

    def __post_init__(self):
        for name, top in (("gamma", 64), ("branches", 16), ("max_ngram", 64), ("min_ngram", 64)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 1 <= v <= top:
                raise ValueError(f"PromptLookup {name} must be an integer in [1, {top}], got {v!r}")
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"PromptLookup min_ngram={self.min_ngram} exceeds max_ngram={self.max_ngram}")
        if self.depths is not None:
            d = tuple(self.depths)
            if len(d) != self.max_ngram or any(isinstance(x, bool) or not isinstance(x, (int, np.integer)) or
                                               not 1 <= x <= self.gamma for x in d):
                raise ValueError(f"PromptLookup depths must give a draft depth in [1, gamma={self.gamma}] for each "
                                 f"match length 1 .. max_ngram={self.max_ngram}, got {self.depths!r}")

    @property
    def tree(self) -> tuple:
        return _branches(int(self.gamma), int(self.branches))

    def parts(self) -> Speculative:
        depths = None if self.depths is None else tuple(int(x) for x in self.depths)
        return Speculative(NgramDrafter(int(self.max_ngram), int(self.min_ngram), depths),
                           StaticPlan.from_paths(self.tree, trim=True), as_rule(self.rule),
                           self.controller)


@dataclasses.dataclass(frozen=True)
class DynamicTree(Strategy):
    """EAGLE-2 dynamic-tree speculative decoding with a separate draft model, an EAGLE feature head or any drafter
    (`as_drafter`; see `plans.DynamicPlan`).

    depth: deepest draft level; top_k: children per expanded node and nodes expanded per level; total: draft
    nodes kept per step after reranking. Sampling uses the q = 1 rule, the lossless one for trees whose shape
    depends on the drafted tokens ("residual" would not be: a candidate is kept or dropped according to its own
    draft probability, so the kept siblings are not a plain without-replacement draw).
    """

    draft: Any
    depth: int = 6
    top_k: int = 10
    total: int = 60
    rule: Any = "q1"
    controller: Any = None

    def parts(self) -> Speculative:
        return Speculative(as_drafter(self.draft), DynamicPlan(int(self.depth), int(self.top_k), int(self.total)),
                           as_rule(self.rule), self.controller)

    def check(self, target) -> None:
        for name in ("depth", "top_k", "total"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"DynamicTree {name} must be a positive integer, got {v!r}")
        if self.depth > 64 or self.top_k > 64:
            raise ValueError(f"DynamicTree depth and top_k must be <= 64, got depth={self.depth}, top_k={self.top_k}")
        pool = DynamicPlan(self.depth, self.top_k, self.total).pool_size
        if self.total > pool:
            raise ValueError(f"DynamicTree total={self.total} exceeds the {pool} candidates that depth={self.depth}, "
                             f"top_k={self.top_k} produce (top_k + (depth - 1) * top_k**2)")
        super().check(target)


@dataclasses.dataclass(frozen=True)
class Static:
    """The static half of a split strategy: its tree structure, the class of every node, and its non-array leaves
    (hashable: a jit key). The classes are kept apart because JAX's treedef equality does not tell two dataclass
    node types with equal metadata apart (two rules of different classes would share a program)."""

    treedef: Any
    types: tuple
    leaves: tuple


def _node_types(treedef) -> tuple:
    data = treedef.node_data()
    if data is None:
        return ()
    return (data[0],) + tuple(t for c in treedef.children() for t in _node_types(c))


def _is_number(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex))


def split(parts) -> tuple[Static, list]:
    """(static, dynamic leaves) of a pytree of parts: arrays and Python / NumPy numbers are dynamic."""
    leaves, treedef = jax.tree.flatten(parts)
    dyn = [np.asarray(x) if isinstance(x, (bool, int, float, complex)) else x if _is_number(x) else None
           for x in leaves]
    static = Static(treedef, _node_types(treedef), tuple(None if _is_number(x) else x for x in leaves))
    return static, dyn


def merge(static: Static, dyn: list):
    """Inverse of `split`."""
    return jax.tree.unflatten(static.treedef, [d if s is None else s for s, d in zip(static.leaves, dyn)])


@dataclasses.dataclass(frozen=True)
class Guarded(Strategy):
    """`strategy` (any speculative strategy) under the guard (`jspec.parts.controllers.guard`): each round, per row
    and per batch, it picks the depth that maximises expected tokens per measured second, down to no draft at all
    (an AR step), from the acceptance the rounds so far verified and `costs` (a `jspec.costs.CostTable`; None:
    `decode` measures it on the first call and caches it on disk). The strategy's own controller still runs; the guard
    only lowers its depth. `rate`: the least weight of a new round in the acceptance estimates (they average about
    the last 1 / rate rounds); `prior`: their starting value, worth `prior_rounds` rounds; `drift`: their pull back
    towards it where a drafting row's rounds do not look; `retry`: rounds without drafts before a row that stopped
    tries again (each try waits twice as long, up to `max_wait`, until one holds for `retry` rounds;
    `jspec.parts.controllers.guard`). `force` >= 0 drafts every row to that depth (what the cost measurement
    times). `defer`: AR rounds in a row whose tokens a drafter with a feed of its own (EAGLE heads, EESD, a draft
    model) may leave unread, so that they cost the target's step alone; the next drafting round reads them all."""

    strategy: Any
    costs: Any = None
    rate: float = 0.1
    prior: float = 0.5
    drift: float = 0.01
    force: int = -1
    defer: int = 24
    prior_rounds: float = 2.0
    retry: int = 16
    max_wait: int = 256

    def __post_init__(self):
        if not isinstance(self.defer, int) or self.defer < 0:
            raise ValueError(f"Guarded defer must be an int >= 0 (AR rounds a drafter may leave unread), got "
                             f"{self.defer!r}")
        if isinstance(self.strategy, (Guarded, AR)) or not isinstance(self.strategy, (Strategy, Speculative)):
            raise ValueError(f"Guarded wraps a speculative strategy (Chain, Tree, PromptLookup, EESD, ...), got "
                             f"{type(self.strategy).__name__}")
        for name in ("rate", "prior", "drift"):
            v = getattr(self, name)
            if not 0.0 <= float(v) <= 1.0:
                raise ValueError(f"Guarded {name} must be in [0, 1], got {v!r}")
        if not float(self.prior_rounds) > 0.0:
            raise ValueError(f"Guarded prior_rounds must be > 0 (the rounds the prior counts as), got "
                             f"{self.prior_rounds!r}")
        for name in ("retry", "max_wait"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"Guarded {name} must be an int >= 1 (rounds), got {v!r}")
        if self.max_wait < self.retry:
            raise ValueError(f"Guarded max_wait ({self.max_wait}) must be at least retry ({self.retry})")

    def parts(self) -> Speculative:
        from jspec.parts.controllers.guard import Guard

        if self.costs is None:
            raise ValueError("Guarded has no cost table yet: jspec.decode measures one on its first call, or pass "
                             "costs=jspec.costs.measure(target, strategy, batch=..., prompt_len=...)")
        inner = self.strategy.parts()
        D = inner.plan.max_depth
        if self.costs.max_depth != D:
            raise ValueError(f"the cost table covers depths 0 .. {self.costs.max_depth}; the strategy drafts to depth "
                             f"{D} (measure its own table)")
        guard = Guard(np.asarray(self.costs.step_s, np.float32), inner.controller, self.rate, self.prior, self.drift,
                      self.force, self.defer, self.prior_rounds, self.retry, self.max_wait)
        return inner.replace(controller=guard)

    def drafts(self) -> bool:
        """Whether the guard can ever draft under its cost table: False when no depth's measured round costs less
        than the k + 1 tokens it could at best commit (`CostTable.drafting_can_pay`). The guard would then pick
        depth 0 in every round whatever it observes (E(k) <= k + 1 for every estimate), so `decode` runs the AR
        program instead: the same greedy tokens, exact sampling, and neither the drafter's compile nor its
        prefill. A guard with `force` >= 0 always drafts."""
        if self.costs is None:
            raise ValueError("Guarded has no cost table yet (`measured`)")
        return int(self.force) >= 0 or self.costs.drafting_can_pay()

    def check(self, target) -> None:
        self.strategy.check(target)
        if self.costs is not None:
            self.parts().check(target)

    def measured(self, target, batch: int, prompt_len: int) -> "Guarded":
        """This guard with its cost table for `target` at this batch and prompt length (measured, or from the
        disk cache)."""
        if self.costs is not None:
            return self
        from jspec.engine import costs

        return dataclasses.replace(self, costs=costs.measure(target, self, batch=batch, prompt_len=prompt_len))
