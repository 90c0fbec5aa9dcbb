"""Sampling SD follows the target distribution: empirical vs exact enumeration on a tiny vocabulary.

Each of many identical rows draws independently, so one batched decode gives thousands of samples of the first
three generated tokens. Their joint distribution is compared by a chi-square test with the exact distribution
computed from the target's logits. A wrong residual rule (e.g. resampling from p instead of norm(max(0, p - q)))
fails this test.
"""
import itertools

import jax
import numpy as np
import pytest
from scipy import stats

import jspec
import ports

V = 6
T_CFG = ports.TextConfig(model_type="llama", vocab_size=V, hidden_size=16, intermediate_size=24, num_layers=1,
                         num_heads=2, num_kv_heads=1, head_dim=8)
PROMPT = np.array([1, 4, 2])
ROWS = 12000


@pytest.fixture(scope="module")
def models():
    target = ports.random_model(T_CFG, key=10, std=0.4)
    draft = ports.random_model(T_CFG, key=11, std=0.6)
    return target, draft


def exact_joint(target, n=3):
    """P(t1..tn | prompt) by enumeration over all V^n continuations."""
    seqs = np.array(list(itertools.product(range(V), repeat=n)))
    full = np.concatenate([np.tile(PROMPT, (len(seqs), 1)), seqs], axis=1)
    logp = jax.nn.log_softmax(ports.logits(target, full), axis=-1)
    L = len(PROMPT)
    lp = sum(np.take_along_axis(np.asarray(logp[:, L - 1 + i]), seqs[:, i:i + 1], axis=1)[:, 0] for i in range(n))
    p = np.exp(lp.astype(np.float64))
    return p / p.sum()


def empirical(target, strategy, key):
    out = jspec.decode(target, np.tile(PROMPT, (ROWS, 1)), strategy=strategy, max_new_tokens=3, temperature=1.0,
                       key=key, eos_token_id=())
    idx = out.tokens[:, 0] * V * V + out.tokens[:, 1] * V + out.tokens[:, 2]
    return np.bincount(idx, minlength=V ** 3), out


def chi2_pvalue(counts, p):
    keep = p * counts.sum() >= 5  # pool the rare cells
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(p[keep], p[~keep].sum()) * counts.sum()
    return stats.chisquare(obs, exp).pvalue


@pytest.mark.parametrize("make", [
    lambda d: jspec.Chain(d, gamma=2), lambda d: jspec.Tree(d, tree=[[0], [1], [2], [0, 0], [0, 1], [1, 0]]),
    lambda d: jspec.Tree(d, tree=[[0], [1], [0, 0], [0, 1], [1, 0]], rule="q1"),
    lambda d: jspec.DynamicTree(d, depth=2, top_k=3, total=6)],
    ids=["chain", "tree", "tree_q1_topk", "dynamic"])
def test_lossless_rules_match_target_distribution(models, make):
    target, draft = models
    p = exact_joint(target)
    counts, out = empirical(target, make(draft), jax.random.key(0))
    assert out.stats["mean_accepted"].mean() > 1.1  # drafts were really accepted (and rejected) on the way
    pval = chi2_pvalue(counts, p)
    tv = 0.5 * np.abs(counts / counts.sum() - p).sum()
    assert pval > 1e-3, (pval, tv)


def test_q1_rule_is_exact_but_accepts_less(models):
    """EAGLE-2's q=1 rule: offering a sampled draft and accepting it with probability p(x) (else renormalising p
    without x) still samples p exactly, but accepts less than min(1, p/q). Both facts are measured here."""
    target, draft = models
    p = exact_joint(target)
    counts, q1 = empirical(target, jspec.Chain(draft, gamma=2, rule="q1"), jax.random.key(1))
    _, res = empirical(target, jspec.Chain(draft, gamma=2), jax.random.key(1))
    assert chi2_pvalue(counts, p) > 1e-3
    assert q1.stats["acceptance_rate"].mean() < 0.9 * res.stats["acceptance_rate"].mean()
