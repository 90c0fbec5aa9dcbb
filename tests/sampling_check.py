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


def warped_logprobs(logits: np.ndarray, temperature=1.0, top_k=None, top_p=None) -> np.ndarray:
    """log-probabilities of the distribution transformers samples from: its own temperature, top-k and top-p
    warpers, in its order (an independent reference for jspec.sampling)."""
    import torch
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    shape = np.shape(logits)
    x = torch.tensor(np.asarray(logits, np.float32).reshape(-1, shape[-1]))  # the warpers take [batch, vocab]
    if temperature != 1.0:
        x = TemperatureLogitsWarper(temperature)(None, x)
    if top_k is not None:
        x = TopKLogitsWarper(top_k)(None, x)
    if top_p is not None:
        x = TopPLogitsWarper(top_p)(None, x)
    return torch.log_softmax(x.double(), dim=-1).numpy().reshape(shape)


def close_pair():
    """(target, draft) over the 6-token vocabulary where the draft is the target plus noise of the weights' own
    scale: close enough that whole depth-3 paths are accepted under every warper, far enough that every depth also
    rejects."""
    target = ports.random_model(T_CFG, key=10, std=0.4)
    leaves, tree = jax.tree.flatten(target.params)
    keys = jax.random.split(jax.random.key(5), len(leaves))
    noisy = [a + 0.4 * jax.random.normal(k, a.shape, a.dtype) for a, k in zip(leaves, keys)]
    return target, dataclasses.replace(target, params=jax.tree.unflatten(tree, noisy))


def exact_joint(target, n=3, prompt=PROMPT, **warpers):
    """P(t1..tn | prompt) by enumeration over all V^n continuations, under `warpers` (temperature, top_k, top_p)
    applied to every conditional."""
    seqs = np.array(list(itertools.product(range(V), repeat=n)))
    full = np.concatenate([np.tile(prompt, (len(seqs), 1)), seqs], axis=1)
    logp = warped_logprobs(np.asarray(ports.logits(target, full)), **warpers)
    L = len(prompt)
    lp = sum(np.take_along_axis(logp[:, L - 1 + i], seqs[:, i:i + 1], axis=1)[:, 0] for i in range(n))
    p = np.exp(lp)
    return p / p.sum()


def joint_index(tokens: np.ndarray, n: int) -> np.ndarray:
    """Each row's first n tokens as one cell index of the V^n joint (first token most significant)."""
    return sum(tokens[:, i] * V ** (n - 1 - i) for i in range(n))


def empirical(target, strategy, key, n=3, rows=ROWS, **sampling):
    out = jspec.decode(target, np.tile(PROMPT, (rows, 1)), strategy=strategy, max_new_tokens=n,
                       temperature=sampling.pop("temperature", 1.0), key=key, eos_token_id=(), **sampling)
    return np.bincount(joint_index(out.tokens, n), minlength=V ** n), out


def chi2_pvalue(counts, p):
    """Chi-square p-value of `counts` against `p`, rare cells pooled; 0 when a draw lands where p is 0."""
    if counts[p == 0].sum():
        return 0.0
    keep = p * counts.sum() >= 5  # pool the rare cells
    obs, exp = counts[keep], p[keep] * counts.sum()
    if p[~keep].sum() > 0:
        obs, exp = np.append(obs, counts[~keep].sum()), np.append(exp, p[~keep].sum() * counts.sum())
    return stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def total_variation(counts, p) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - p).sum())


def exactness(target, strategy, key=jax.random.key(0), n=3, rows=ROWS, **sampling):
    """(chi-square p-value, total variation, decode output) of `strategy`'s first n sampled tokens against the
    target's exact joint distribution under the same sampling settings (temperature, top_k, top_p)."""
    p = exact_joint(target, n, **sampling)
    counts, out = empirical(target, strategy, key, n, rows, **sampling)
    return chi2_pvalue(counts, p), total_variation(counts, p), out
