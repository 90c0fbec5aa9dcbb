"""Exact sampling through the engine's deep paths, against exact enumeration.

The first generated token is drawn at prefill from the target alone, so these tests count the joint of the first
four tokens: tokens 2-4 are decided by speculative verification, whole depth-3 paths of chains, static and dynamic
trees accepted or rejected, under temperature, top-k and top-p (the reference warps with transformers' own
warpers). Each check asserts a chi-square p-value and a total-variation distance within what exact sampling of the
same size gives; each family has a negative control that the same check rejects.
"""
import jax
import numpy as np
import pytest

import jspec
from sampling_check import (PROMPT, V, chi2_pvalue, close_pair, empirical, exact_joint, joint_index,
                            total_variation)
from toy_parts import ResampleFromTarget

N = 4  # tokens counted: the prefill's, then three or more decided by speculative verification
ROWS = 20000
DEEP_TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]

STRATEGIES = {
    "chain3": lambda d: jspec.Chain(d, gamma=3),
    "tree_depth3": lambda d: jspec.Tree(d, tree=DEEP_TREE),
    "dynamic_depth3": lambda d: jspec.DynamicTree(d, depth=3, top_k=3, total=8),
}
SETTINGS = {
    "T1": {},
    "T0.6": dict(temperature=0.6),
    "T1.5_topk3": dict(temperature=1.5, top_k=3),
    "topp0.8": dict(top_p=0.8),
    "T0.8_topk4_topp0.9": dict(temperature=0.8, top_k=4, top_p=0.9),
}
DEFAULT = {("chain3", "topp0.8"), ("tree_depth3", "T0.8_topk4_topp0.9"), ("dynamic_depth3", "T1.5_topk3")}
CASES = [pytest.param(s, w, marks=() if (s, w) in DEFAULT else pytest.mark.slow, id=f"{s}-{w}")
         for s in STRATEGIES for w in SETTINGS]


@pytest.fixture(scope="module")
def models():
    return close_pair()


def tv_bound(p, rows: int, seed: int = 0) -> float:
    """The 99.5th percentile of the total variation between `p` and the histogram of `rows` exact draws from it:
    what an exact sampler of this size shows."""
    draws = np.random.default_rng(seed).multinomial(rows, p, size=400)
    return float(np.quantile(0.5 * np.abs(draws / rows - p).sum(1), 0.995))


def check(counts, p, exact=True):
    """Assert (or, exact=False, refute) that `counts` are draws from `p`: p-value and total variation."""
    pval, tv, bound = chi2_pvalue(counts, p), total_variation(counts, p), tv_bound(p, int(counts.sum()))
    if exact:
        assert pval > 1e-3 and tv <= bound, (pval, tv, bound)
        assert counts[p == 0].sum() == 0  # nothing the warpers filter out is ever drawn
    else:
        assert pval < 1e-6 and tv > bound, (pval, tv, bound)
    return pval, tv


def _verified_depth(out) -> np.ndarray:
    """Tokens the first speculative step committed per row (accepted drafts plus the target's own token)."""
    return np.asarray(out.stats["accepted"])[:, 0]


@pytest.mark.parametrize("strategy,setting", CASES)
def test_three_verified_tokens_are_exact(models, strategy, setting):
    target, draft = models
    warpers = SETTINGS[setting]
    p = exact_joint(target, N, **warpers)
    counts, out = empirical(target, STRATEGIES[strategy](draft), jax.random.key(7), N, ROWS, **dict(warpers))
    depth = _verified_depth(out)
    assert (depth >= 3).sum() >= 200 and (depth == 1).sum() >= 200  # whole depth-3 paths accepted, and rejections
    check(counts, p)


def test_negative_controls(models):
    """The same check rejects (a) a residual that resamples from the target after a rejection, under warpers, and
    (b) exact SD counts against a reference that omits the top-k warper: it sees both."""
    target, draft = models
    warpers = dict(temperature=0.8, top_k=4, top_p=0.9)
    wrong = jspec.Chain(draft, gamma=3, rule=ResampleFromTarget())
    counts, _ = empirical(target, wrong, jax.random.key(7), N, ROWS, **dict(warpers))
    check(counts, exact_joint(target, N, **warpers), exact=False)
    counts, _ = empirical(target, jspec.Chain(draft, gamma=3), jax.random.key(7), N, ROWS, top_k=3)
    check(counts, exact_joint(target, N, top_k=3))
    check(counts, exact_joint(target, N), exact=False)


def test_ragged_batch_every_row_is_exact(models):
    """Three prompts of lengths 1, 3 and 5 interleaved in one batch: each prompt's rows sample its own joint."""
    target, draft = models
    prompts = [np.array([3]), PROMPT, np.array([5, 0, 2, 2, 1])]
    rows = 7000
    batch = [prompts[i % 3] for i in range(3 * rows)]
    warpers = dict(temperature=0.9, top_k=5)
    out = jspec.decode(target, batch, strategy=jspec.Tree(draft, tree=DEEP_TREE), max_new_tokens=N,
                       key=jax.random.key(3), eos_token_id=(), **warpers)
    assert (_verified_depth(out) >= 3).sum() >= 200
    idx = joint_index(out.tokens, N)
    for i, prompt in enumerate(prompts):
        counts = np.bincount(idx[i::3], minlength=V ** N)
        check(counts, exact_joint(target, N, prompt=prompt, **warpers))
    # and a row's draws are not another prompt's: row 0's prompt against row 1's joint is rejected
    check(np.bincount(idx[0::3], minlength=V ** N), exact_joint(target, N, prompt=prompts[1], **warpers), exact=False)
