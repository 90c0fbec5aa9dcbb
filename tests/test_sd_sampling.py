"""Sampling rules compared with each other (every registered strategy's exactness is proven in
tests/test_conformance.py with the checks of tests/sampling_check.py)."""
import jax
import pytest

import jspec
from sampling_check import exactness, tiny_vocab_pair


@pytest.fixture(scope="module")
def models():
    return tiny_vocab_pair()


def test_q1_rule_is_exact_but_accepts_less(models):
    """EAGLE-2's q=1 rule: offering a sampled draft and accepting it with probability p(x) (else renormalising p
    without x) still samples p exactly, but accepts less than min(1, p/q). Both facts are measured here."""
    target, draft = models
    pval, _, q1 = exactness(target, jspec.Chain(draft, gamma=2, rule="q1"), jax.random.key(1))
    _, _, res = exactness(target, jspec.Chain(draft, gamma=2), jax.random.key(1))
    assert pval > 1e-3
    assert q1.stats["acceptance_rate"].mean() < 0.9 * res.stats["acceptance_rate"].mean()
