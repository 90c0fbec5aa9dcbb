"""The plain presets: `AR` (the baseline every strategy reproduces), `Chain`, `Tree` (static trees) and `DynamicTree`
(EAGLE-2), each over a separate draft model, an EAGLE-1 / EAGLE-3 feature head, a DFlash block drafter or any
drafter (`as_drafter`)."""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jspec.engine.strategy import Speculative, Strategy
from jspec.parts.drafters import Drafter, ModelDrafter
from jspec.parts.drafters.dflash import DFlashDrafter, DFlashHead
from jspec.parts.drafters.eagle import EagleDrafter, EagleHead
from jspec.parts.drafters.eagle3 import Eagle3Drafter, Eagle3Head
from jspec.parts.drafters.mtp import MTPDrafter, MTPHead
from jspec.parts.plans import DynamicPlan, StaticPlan
from jspec.parts.rules import as_rule
from jspec.parts.trees import Layout, StaticTree, cached_tree, chain


@dataclasses.dataclass(frozen=True)
class AR(Strategy):
    """Plain autoregressive decoding with the target alone (the baseline every strategy must reproduce)."""

    def parts(self):
        return None

    def check(self, target) -> None:
        pass


def as_drafter(draft) -> Drafter:
    """A `Chain` / `Tree` / `DynamicTree` draft as its drafter: a drafter as is, an EAGLE-1 feature head
    (`jspec.parts.drafters.eagle.EagleHead`), an EAGLE-3 head (`jspec.parts.drafters.eagle3.Eagle3Head`), a Qwen3.5
    MTP head (`jspec.parts.drafters.mtp.MTPHead`) or a block
    drafter (`jspec.parts.drafters.dflash.DFlashHead`) over the target's states, anything else as a separate draft model."""
    if isinstance(draft, Drafter):
        return draft
    if isinstance(draft, Eagle3Head):
        return Eagle3Drafter(draft)
    if isinstance(draft, MTPHead):
        return MTPDrafter(draft)
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
