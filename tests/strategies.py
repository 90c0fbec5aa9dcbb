"""The conformance registry: every strategy, present and future, joins tests/test_conformance.py by one
`register` call here. From then on the suite proves for it, with no new test code: greedy == AR on a ragged batch
(each row as if alone), on one device and on a mesh of 8 forced CPU devices; exact sampling when it claims it; no
recompilation after warm-up; a clear error for a draft of another vocabulary.

`make(target, draft)` builds the strategy from a tiny (target, draft) pair: the draft shares the target's
vocabulary and disagrees with it often enough that drafts are both accepted and rejected.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp

import jspec
from jspec.drafters import ModelDrafter
from jspec.plans import StaticPlan
from jspec.trees import Layout, build_tree, chain
from toy_parts import CycleDepth, FixedTrees, TwoViews, per_row_trees


@dataclasses.dataclass(frozen=True)
class Entry:
    make: Callable
    exact: bool  # claims to sample the target's distribution exactly
    separate_draft: bool = True  # drafts with a model of its own (the vocabulary check applies)


REGISTRY: dict[str, Entry] = {}


def register(name: str, make: Callable, exact: bool, separate_draft: bool = True) -> None:
    if name in REGISTRY:
        raise ValueError(f"strategy {name!r} is registered twice")
    REGISTRY[name] = Entry(make, exact, separate_draft)


SMALL_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0]]
BUDGET = Layout(widths=(3, 3, 1), children=(3, 2, 1))

register("chain", lambda t, d: jspec.Chain(d, gamma=3), exact=True)
register("chain_q1", lambda t, d: jspec.Chain(d, gamma=2, rule="q1"), exact=True)
register("tree", lambda t, d: jspec.Tree(d, tree=SMALL_TREE), exact=True)
register("tree_q1", lambda t, d: jspec.Tree(d, tree=[[0], [1], [0, 0], [0, 1], [1, 0]], rule="q1"), exact=True)
register("tree_mc_sim", lambda t, d: jspec.Tree(d, tree="mc_sim_7b_63"), exact=True)
register("tree_in_budget", lambda t, d: jspec.Tree(d, tree=SMALL_TREE, budget=BUDGET), exact=True)
register("dynamic", lambda t, d: jspec.DynamicTree(d, depth=3, top_k=3, total=8), exact=True)
register("chain_depth_controller", lambda t, d: jspec.Chain(d, gamma=4, controller=CycleDepth(jnp.int32(3))),
         exact=True)
register("dynamic_depth_controller",
         lambda t, d: jspec.DynamicTree(d, depth=3, top_k=2, total=5, controller=CycleDepth(jnp.int32(2))),
         exact=True)
register("per_row_trees", lambda t, d: jspec.Speculative(
    ModelDrafter(d), StaticPlan.of(build_tree(chain(1), BUDGET)), "residual",
    FixedTrees(per_row_trees(BUDGET.levels, [[(1, 0, 0), (4, 1, 0), (7, 4, 0)],
                                             [(1, 0, 0), (2, 0, 1), (4, 1, 0), (5, 1, 1), (6, 2, 0)]]))),
    exact=True)
register("two_views", lambda t, d: jspec.Speculative(TwoViews(ModelDrafter(d), ModelDrafter(d), jnp.asarray([.4, .6])),
                                                     StaticPlan.of(build_tree(chain(3)))), exact=True)
