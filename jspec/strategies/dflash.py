"""DFlash (Chen et al., 2026): a block drafter proposes a whole draft in one forward
(`jspec.parts.drafters.dflash`); the target verifies it as a chain, a DDTree (Ringel et al., arXiv 2604.12989;
`jspec.parts.plans.BlockTreePlan`) or any static tree over the block's per-position distributions."""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jspec.engine.strategy import Speculative, Strategy
from jspec.parts.drafters.dflash import DFlashDrafter, DFlashHead
from jspec.parts.plans import BlockTreePlan, StaticPlan
from jspec.parts.rules import as_rule
from jspec.parts.trees import chain

TREES = ("chain", "ddtree")


def _count(name: str, v, top: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 1 <= v <= top:
        raise ValueError(f"DFlash {name} must be an integer in [1, {top}], got {v!r}")
    return int(v)


@dataclasses.dataclass(frozen=True)
class DFlash(Strategy):
    """Speculative decoding with a block drafter (`jspec.parts.drafters.dflash.DFlashHead`; `dflash_io.load_head`
    or `init_head` to train).

    tree: "chain" (each of `depth` positions drawn from its own distribution, argmax when greedy; the residual rule),
    "ddtree" (the `total` most probable paths over the `top_k` best tokens of each position; the q = 1 rule) or a
    static tree (a name or child-rank paths, as `Tree` takes; a node's children are its depth's best tokens; the
    residual rule). block: query positions per step (the anchor and block - 1 draft positions; default the head's
    own). depth: the deepest draft (default block - 1). rule / controller: as `Tree`'s."""

    head: DFlashHead
    tree: Any = "chain"
    block: int | None = None
    depth: int | None = None
    top_k: int = 8
    total: int = 32
    rule: Any = None
    controller: Any = None

    def __post_init__(self):
        if not isinstance(self.head, DFlashHead):
            raise ValueError(f"head must be a DFlashHead (jspec.parts.drafters.dflash_io.load_head), got "
                             f"{type(self.head).__name__}")
        block = _count("block", self.block if self.block is not None else self.head.block, 64)
        if block < 2:
            raise ValueError(f"DFlash block must hold the anchor and a draft position (>= 2), got {block}")
        if self.depth is not None:
            _count("depth", self.depth, block - 1)
        _count("top_k", self.top_k, 64)
        _count("total", self.total, 512)
        if isinstance(self.tree, str) and self.tree not in TREES:
            raise ValueError(f"DFlash tree must be one of {TREES} or a static tree's paths, got {self.tree!r}")

    @property
    def block_size(self) -> int:
        return int(self.block if self.block is not None else self.head.block)

    @property
    def draft_depth(self) -> int:
        return int(self.depth) if self.depth is not None else self.block_size - 1

    def parts(self) -> Speculative:
        drafter = DFlashDrafter(self.head, self.block_size)
        if isinstance(self.tree, str) and self.tree == "ddtree":
            plan = BlockTreePlan(self.draft_depth, int(self.top_k), int(self.total))
            return Speculative(drafter, plan, as_rule(self.rule or "q1"), self.controller)
        paths = chain(self.draft_depth) if isinstance(self.tree, str) else self.tree
        plan = StaticPlan.from_paths(tuple(tuple(p) for p in paths))
        if plan.max_depth > self.block_size - 1:
            raise ValueError(f"the tree is {plan.max_depth} deep; a block of {self.block_size} drafts "
                             f"{self.block_size - 1} positions")
        return Speculative(drafter, plan, as_rule(self.rule or "residual"), self.controller)
