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
    warpers, in its order (an independent reference for jspec.core.sampling)."""
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


def noisy_copy(model, scale=0.4, seed=5):
    """`model` with Gaussian noise of std `scale` added to every weight: a draft close to its target."""
    leaves, tree = jax.tree.flatten(model.params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [a + scale * jax.random.normal(k, a.shape, a.dtype) for a, k in zip(leaves, keys)]
    return dataclasses.replace(model, params=jax.tree.unflatten(tree, noisy))


def close_pair(cfg=T_CFG):
    """(target, draft) over a tiny vocabulary where the draft is the target plus noise of the weights' own scale:
    close enough that whole depth-3 paths are accepted under every warper, far enough that every depth also
    rejects."""
    target = ports.random_model(cfg, key=10, std=0.4)
    return target, noisy_copy(target)


def joint_from_logprobs(logp: np.ndarray, seqs: np.ndarray, first: int) -> np.ndarray:
    """P(seqs) from log-probabilities [N, T, V] of full sequences whose continuation `seqs` [N, n] starts at
    position `first` (the conditional of token i is read at first - 1 + i), normalised over the enumerated rows."""
    n = seqs.shape[1]
    lp = sum(np.take_along_axis(logp[:, first - 1 + i], seqs[:, i:i + 1], axis=1)[:, 0] for i in range(n))
    p = np.exp(lp)
    return p / p.sum()


def exact_joint(target, n=3, prompt=PROMPT, **warpers):
    """P(t1..tn | prompt) by enumeration over all V^n continuations, under `warpers` (temperature, top_k, top_p)
    applied to every conditional."""
    seqs = np.array(list(itertools.product(range(target.vocab_size), repeat=n)))
    full = np.concatenate([np.tile(prompt, (len(seqs), 1)), seqs], axis=1)
    return joint_from_logprobs(warped_logprobs(np.asarray(ports.logits(target, full)), **warpers), seqs, len(prompt))


def joint_index(tokens: np.ndarray, n: int, vocab: int = V) -> np.ndarray:
    """Each row's first n tokens as one cell index of the vocab^n joint (first token most significant)."""
    return sum(tokens[:, i] * vocab ** (n - 1 - i) for i in range(n))


def empirical(target, strategy, key, n=3, rows=ROWS, prompt=PROMPT, **sampling):
    out = jspec.decode(target, np.tile(prompt, (rows, 1)), strategy=strategy, max_new_tokens=n,
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


def tv_bound(p, rows: int, seed: int = 0) -> float:
    """The 99.5th percentile of the total variation between `p` and the histogram of `rows` exact draws from it:
    what an exact sampler of this size shows."""
    draws = np.random.default_rng(seed).multinomial(rows, p, size=400)
    return float(np.quantile(0.5 * np.abs(draws / rows - p).sum(1), 0.995))


def check(counts, p, exact=True):
    """Assert (or, exact=False, refute) that `counts` are draws from `p`: p-value and total variation. Returns
    (p-value, total variation, its bound)."""
    pval, tv, bound = chi2_pvalue(counts, p), total_variation(counts, p), tv_bound(p, int(counts.sum()))
    if exact:
        assert pval > 1e-3 and tv <= bound, (pval, tv, bound)
        assert counts[p == 0].sum() == 0  # nothing the warpers filter out is ever drawn
    else:
        assert pval < 1e-6 and tv > bound, (pval, tv, bound)
    return pval, tv, bound


def exactness(target, strategy, key=jax.random.key(0), n=3, rows=ROWS, prompt=PROMPT, **sampling):
    """(chi-square p-value, total variation, decode output) of `strategy`'s first n sampled tokens after `prompt`
    against the target's exact joint distribution under the same sampling settings (temperature, top_k, top_p)."""
    p = exact_joint(target, n, np.asarray(prompt), **sampling)
    counts, out = empirical(target, strategy, key, n, rows, prompt=prompt, **sampling)
    return chi2_pvalue(counts, p), total_variation(counts, p), out


CH_IMAGE_PREFIX = [4, 8, 8]  # a tiny Chameleon's image start and size tokens


def tiny_chameleon_config(V=48, img0=16, K=8, **over):
    """A dict for ports.families.chameleon.config_from_hf: K image codes at token ids img0.., Lumina-mGPT's grammar tokens."""
    from ports.families import chameleon as CH

    vm = {f"tok{i}": i for i in range(V)}
    for name, i in (("<image>", 3), ("<racm3:break>", 4), ("<eoss>", 5), ("<reserved08799>", 6),
                    ("<reserved08800>", 7)):
        del vm[f"tok{i}"]
        vm[name] = i
    for c in range(K):
        del vm[f"tok{img0 + c}"]
        vm[CH.code_name(c)] = img0 + c
    d = dict(model_type="chameleon", vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, attention_bias=True, mask_image_logits=False,
             vq_config=dict(embed_dim=4, num_embeddings=K, latent_channels=32, resolution=16, base_channels=32,
                            channel_multiplier=[1, 1, 2], num_res_blocks=1, attn_resolutions=[]),
             vocabulary_map=vm)
    d.update(over)
    return d


def tiny_chameleon(key: int = 0, std: float = 0.15, **over) -> ports.Model:
    """A random Chameleon of `tiny_chameleon_config(**over)`; std 0.15 spreads a guided target's distribution."""
    from ports.families import chameleon as CH

    d = tiny_chameleon_config(**over)
    cfg = CH.config_from_hf(d)
    return ports.Model(cfg, CH.init_params(cfg, jax.random.key(key), std=std), d)


def guided_joint(target, cond, uncond, scale, gram, n=3, **warpers):
    """(seqs [N, n], P(seqs)) of the guided, grammar-constrained target over the continuations the grammar allows,
    by enumeration from full-sequence forwards of both streams: logits uncond + scale * (cond - uncond), the
    grammar's mask, then `warpers` (temperature, top_k, top_p) as transformers applies them."""
    import jax.numpy as jnp

    probe = np.asarray(gram.apply(jnp.zeros((1, n, target.vocab_size)), jnp.arange(n)[None]))[0]
    allowed = [np.flatnonzero(probe[g] > -np.inf) for g in range(n)]
    seqs = np.array(list(itertools.product(*allowed)))
    width = max(len(cond), len(uncond)) + n
    batch = np.zeros((2 * len(seqs), width), np.int64)
    batch[0::2, :len(cond) + n] = np.concatenate([np.tile(cond, (len(seqs), 1)), seqs], 1)
    batch[1::2, :len(uncond) + n] = np.concatenate([np.tile(uncond, (len(seqs), 1)), seqs], 1)
    lg = np.asarray(ports.logits(target, batch), np.float64)  # right padding: causal, so never read
    c = lg[0::2, len(cond) - 1:len(cond) - 1 + n]
    u = lg[1::2, len(uncond) - 1:len(uncond) - 1 + n]
    x = np.where(probe[None] > -np.inf, u + scale * (c - u), -np.inf)  # [N, n, V], token i's conditional at i
    logp = warped_logprobs(x, **warpers)
    return seqs, joint_from_logprobs(logp, seqs, 1)


VLM_V, IMG = 8, 7  # a tiny LLaVA's vocabulary and image token id
IMAGE_PROMPT = np.array([1, IMG, IMG, IMG, IMG, 4, 2])  # four patch features of one 14 x 14 image
PIXELS = np.random.default_rng(0).normal(size=(1, 3, 14, 14)).astype(np.float32)


def tiny_llava(key: int, std: float, pool_grid: int = 2) -> ports.Model:
    """A LLaVA-1.5 of one text layer over an 8-token vocabulary (image token 7), a one-layer CLIP tower of
    pool_grid^2 patches."""
    from ports.families import llava
    from ports.core import vision as VIS

    text = ports.TextConfig(model_type="llama", vocab_size=VLM_V, hidden_size=16, intermediate_size=24,
                            num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8)
    vis = VIS.VisionConfig("clip_vision_model", hidden_size=16, intermediate_size=24, num_layers=1, num_heads=2,
                          image_size=7 * pool_grid, patch_size=7)
    cfg = llava.LlavaConfig("llava", text, vis, VIS.ProjectorConfig(16, 16), IMG, feature_layer=-1)
    return ports.random_model(cfg, key=key, std=std)


def image_joint(target, prompt=IMAGE_PROMPT, pixels=PIXELS, n=3, **warpers):
    """P(t1..tn | prompt with its image) of a LLaVA target by enumeration over all V^n continuations, from
    full-sequence forwards: the prompt's image run gets the image's features, and a generated image-token id is
    text (as in decoding)."""
    seqs = np.array(list(itertools.product(range(target.vocab_size), repeat=n)))
    logits = llava_logits(target, prompt, pixels, seqs)
    return joint_from_logprobs(warped_logprobs(np.asarray(logits), **warpers), seqs, len(prompt))


def llava_logits(model, prompt, pixels, seqs) -> np.ndarray:
    """float32 logits [N, T, V] of a LLaVA `model` over `prompt` [P] followed by each continuation of `seqs`
    [N, n], from one full forward without a persistent cache: the prompt's image runs get the features of `pixels`
    (None: a text-only prompt), and a continuation's image-token id is text, as in decoding."""
    import jax.numpy as jnp

    from ports.core import cache as kvc
    from ports.families import llava

    seqs = np.asarray(seqs).reshape(len(seqs), -1)
    full = np.concatenate([np.tile(prompt, (len(seqs), 1)), seqs], axis=1)
    N, T = full.shape
    inputs = {} if pixels is None else {"pixel_values": jnp.asarray(pixels)}
    pe = llava.prompt_embeds(model.config, model.params, jnp.asarray(np.asarray(prompt)[None]), inputs).embeds
    emb = jnp.concatenate([jnp.broadcast_to(pe, (N,) + pe.shape[1:]),
                           llava.embed(model.config, model.params, jnp.asarray(seqs))], axis=1)
    layers, kvh, hd = model.kv_layout
    cache = kvc.init_cache(layers, N, kvh, T, hd, jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (N, T))
    return np.asarray(model.forward(jnp.asarray(full), pos, cache, embeds=emb).logits, np.float32)
