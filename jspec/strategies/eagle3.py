"""EAGLE-3 (Li et al., 2025): a head over the target's fused low, middle and high layers, trained with training-time
test, drafting a dynamic tree (`jspec.parts.drafters.eagle3`)."""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jspec.parts.drafters.eagle3 import Eagle3Head
from jspec.engine.strategy import Strategy
from jspec.strategies.standard import Chain, DynamicTree, Tree


@dataclasses.dataclass(frozen=True)
class Eagle3(Strategy):
    """Speculative decoding with an EAGLE-3 head (`jspec.parts.drafters.eagle3_io.load_head`, or `init_head` to train).

    tree: "dynamic" (EAGLE-3's default: EAGLE-2's dynamic tree, `depth` levels, `top_k` children per expanded node,
    `total` nodes kept), "chain" (`depth` drafts a step) or a static tree (a name or child-rank paths, as `Tree`
    takes). rule: None picks "q1" for the dynamic tree and "residual" otherwise (both exact); controller: as
    `Tree`'s. The defaults are EAGLE-3's (depth 7, top_k 10, 60 nodes)."""

    head: Eagle3Head
    tree: Any = "dynamic"
    depth: int = 7
    top_k: int = 10
    total: int = 60
    rule: Any = None
    controller: Any = None

    def __post_init__(self):
        if not isinstance(self.head, Eagle3Head):
            raise ValueError(f"head must be an Eagle3Head (jspec.parts.drafters.eagle3_io.load_head), got "
                             f"{type(self.head).__name__}")
        if isinstance(self.depth, bool) or not isinstance(self.depth, (int, np.integer)) or not 1 <= self.depth <= 64:
            raise ValueError(f"depth must be an integer in [1, 64], got {self.depth!r}")

    def strategy(self) -> Strategy:
        """The plain strategy this one runs (a `DynamicTree`, `Chain` or `Tree` over the head)."""
        if isinstance(self.tree, str) and self.tree == "dynamic":
            return DynamicTree(self.head, self.depth, self.top_k, self.total, self.rule or "q1", self.controller)
        if isinstance(self.tree, str) and self.tree == "chain":
            return Chain(self.head, int(self.depth), self.rule or "residual", self.controller)
        return Tree(self.head, self.tree, self.rule or "residual", self.controller)

    def parts(self):
        return self.strategy().parts()

    def check(self, target) -> None:
        self.strategy().check(target)
