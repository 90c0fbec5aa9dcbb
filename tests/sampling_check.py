"""Exact-distribution checks for sampling strategies: empirical vs exact enumeration on a tiny vocabulary.

Each of many identical rows draws independently, so one batched decode gives thousands of samples of the first
three generated tokens. Their joint distribution is compared by a chi-square test with the exact distribution
computed from the target's logits. A wrong residual rule (e.g. resampling from p instead of norm(max(0, p - q)))
fails this check (tests/test_parts.py shows one failing).
"""
import dataclasses
import itertools

import jax
import numpy as np
from scipy import stats

import jspec
import ports

V = 6
T_CFG = ports.TextConfig(model_type="llama", vocab_size=V, hidden_size=16, intermediate_size=24, num_layers=1,
                         num_heads=2, num_kv_heads=1, head_dim=8)
PROMPT = np.array([1, 4, 2])
ROWS = 12000


def tiny_vocab_pair(target_layers: int = 1):
    """(target, draft) over a 6-token vocabulary, different enough that drafts are accepted and rejected. A
    two-layer target (`target_layers=2`) is for drafters that exit after its first layer."""
    if target_layers == 1:
        return ports.random_model(T_CFG, key=10, std=0.4), ports.random_model(T_CFG, key=11, std=0.6)
    return (ports.random_model(dataclasses.replace(T_CFG, num_layers=target_layers), key=13, std=0.4),
            ports.random_model(T_CFG, key=11, std=0.6))


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


def exactness(target, strategy, key=jax.random.key(0)):
    """(chi-square p-value, total variation, decode output) of `strategy`'s first three sampled tokens against the
    target's exact joint distribution."""
    p = exact_joint(target)
    counts, out = empirical(target, strategy, key)
    return chi2_pvalue(counts, p), 0.5 * np.abs(counts / counts.sum() - p).sum(), out
