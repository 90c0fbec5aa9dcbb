"""The decode program does not grow with the draft's depth: a plan drafts its levels in one loop and the sampled
tree walk is one loop, so the drafter's `level` and the rule's hooks are traced the same number of times for a
deep draft as for a shallow one (the compile time follows: `scripts/compile_times.py`)."""
import collections
import dataclasses

import jax
import pytest
from flax import struct

import jspec
from jspec.parts.drafters import ModelDrafter
from jspec.parts.rules import Residual
from tiny_pairs import PROMPTS, tiny_pair

TRACED = collections.Counter()


@struct.dataclass
class CountingDrafter(ModelDrafter):
    def level(self, env, ds, tokens, depth, mask, offset, run):
        TRACED["level"] += 1
        return ModelDrafter.level(self, env, ds, tokens, depth, mask, offset, run)


@struct.dataclass
class CountingResidual(Residual):
    def target_mass(self, resid, x):
        TRACED["walk"] += 1
        return Residual.target_mass(self, resid, x)


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


def traced(pair, strategy, sampled: bool) -> dict:
    """How often one decode traced the drafter's level and the walk's acceptance test (its programs are new)."""
    target, draft = pair
    parts = dataclasses.replace(strategy.parts(), drafter=CountingDrafter(draft))
    if sampled:
        parts = dataclasses.replace(parts, rule=CountingResidual())
    TRACED.clear()
    kw = dict(temperature=1.0, key=jax.random.key(0)) if sampled else {}
    jspec.decode(target, PROMPTS[:2], parts, max_new_tokens=6, eos_token_id=(), **kw)
    return dict(TRACED)


@pytest.mark.parametrize("shallow,deep", [
    (jspec.Chain(None, gamma=2), jspec.Chain(None, gamma=8)),
    (jspec.Tree(None, tree=[[0], [1], [0, 0]]), jspec.Tree(None, tree=[[0], [1], [0, 0], [0, 0, 0], [0, 0, 0, 0],
                                                                      [0, 0, 0, 0, 0], [1, 0], [1, 0, 0]])),
], ids=["chain", "tree"])
def test_a_deeper_draft_traces_as_much_as_a_shallow_one(pair, shallow, deep):
    a, b = traced(pair, shallow, True), traced(pair, deep, True)
    assert a["level"] > 0 and a["walk"] > 0
    assert a == b


def test_a_deeper_dynamic_tree_traces_as_much_as_a_shallow_one(pair):
    a = traced(pair, jspec.DynamicTree(None, depth=2, top_k=2, total=4), False)
    b = traced(pair, jspec.DynamicTree(None, depth=7, top_k=2, total=4), False)
    assert a["level"] > 0 and a == b


def test_sages_planner_does_not_grow_with_its_depth_cap():
    """SAGE's per-row planner scans its levels: a depth cap of 8 traces as many operations as one of 3."""
    from jspec.parts.controllers.entropy_tree import TreeSpec

    def ops(d_cap):
        spec = TreeSpec(d_min=2, d_cap=d_cap, init_tree=((0,), (1,), (0, 0)))
        p = jax.numpy.full((spec.k,), 1.0 / spec.k)
        jaxpr = jax.make_jaxpr(spec.plan)(p, jax.numpy.float32(0.5), jax.numpy.int32(d_cap))
        return len(jaxpr.jaxpr.eqns)

    assert ops(3) == ops(8)


def test_sage_verifies_at_a_few_packed_widths():
    """Each packed verify width is one target forward in SAGE's program: 9, 17 and the whole budget."""
    assert jspec.SAGE(None).parts().plan.packed_sizes == (9, 17, 65)
    assert jspec.SAGE(None, n_max=12, init_tree=[[0], [1]]).parts().plan.packed_sizes == (9, 13)
