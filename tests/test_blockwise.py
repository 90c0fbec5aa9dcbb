"""The blockwise (memory-efficient) attention of long prefills: equal to the direct path on ragged, right-aligned and
grouped-query inputs, in a model's prefill, in greedy decoding, and for SpecVLM's language-to-video scores."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
import ports
from jspec import cache as kvc
from jspec import loop
from jspec.prompts import model_prompt
from ports import blockwise as BW
from ports import layers as L


@pytest.mark.parametrize("T, qb, kb", [(300, 64, 48), (129, 128, 128), (70, 512, 512)])
def test_blockwise_equals_direct_attention(T, qb, kb):
    rng = np.random.default_rng(T)
    B, H, KVH, Dh = 3, 6, 2, 8
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, h, Dh)), jnp.float32) for h in (H, KVH, KVH))
    start = jnp.asarray([0, 5, T // 3])
    vis = kvc.visibility(jnp.zeros((B,), jnp.int32), T, T, None, 0, start)
    w = np.zeros((B, T), np.float32)
    w[:, -7:] = 1 / 7  # the last queries' probabilities, as SpecVLM's scores read them
    ref, ref_s = L.attention(q, L.kv_rows(k), L.kv_rows(v), vis, jnp.asarray(w))
    out, s = BW.causal_attention(q, k, v, start, jnp.asarray(w), q_block=qb, k_block=kb)
    seen = np.arange(T)[None] >= np.asarray(start)[:, None]
    np.testing.assert_allclose(np.asarray(out)[seen], np.asarray(ref)[seen], atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(s), np.asarray(ref_s), atol=1e-8, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(BW.causal_attention(q, k, v, start, q_block=qb, k_block=kb))[seen],
                               np.asarray(out)[seen], atol=1e-7)


def _prefill(model, tokens, lengths, inputs=None, **kw):
    """A fresh jitted prefill (the attention path is picked when it is traced)."""
    @jax.jit
    def run(model, tokens, lengths, inputs):
        cache = loop.new_cache_for(model, tokens.shape[0], tokens.shape[1] + 8)
        logits, fo, cache = loop.prefill(model, tokens, lengths, cache, inputs, **kw)
        return logits, fo.attn, cache.k[0]
    return run(model, jnp.asarray(tokens), jnp.asarray(lengths), inputs or {})


@pytest.fixture
def direct(monkeypatch):
    """Turns the blockwise path off (every prefill attends directly)."""
    return functools.partial(monkeypatch.setattr, L, "BLOCKWISE_MIN", 10 ** 9)


def test_long_prefill_takes_the_blockwise_path_with_the_same_logits(direct):
    cfg = ports.TextConfig(model_type="llama", vocab_size=101, hidden_size=32, intermediate_size=48, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=4096)
    model = ports.random_model(cfg, key=1, std=0.3)
    rng = np.random.default_rng(0)
    lengths = np.array([L.BLOCKWISE_MIN + 77, L.BLOCKWISE_MIN - 300, 901], np.int32)
    tokens = np.zeros((3, lengths.max()), np.int32)
    for b, n in enumerate(lengths):
        tokens[b, :n] = rng.integers(0, 101, n)
    prompts = [tokens[b, :n] for b, n in enumerate(lengths)]
    draft = ports.Model(dataclasses.replace(cfg, num_layers=1), {**model.params, "layers": model.params["layers"][:1]})
    jax.clear_caches()
    ar = jspec.decode(model, prompts, max_new_tokens=8, eos_token_id=())
    sd = jspec.decode(model, prompts, strategy=jspec.Chain(draft, gamma=3), max_new_tokens=8, eos_token_id=())
    np.testing.assert_array_equal(sd.tokens, ar.tokens)
    long_logits, _, long_k = _prefill(model, tokens, lengths)
    direct()
    ref_logits, _, ref_k = _prefill(model, tokens, lengths)
    np.testing.assert_allclose(np.asarray(long_logits), np.asarray(ref_logits), atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(long_k), np.asarray(ref_k), atol=1e-6)
    jax.clear_caches()
    np.testing.assert_array_equal(jspec.decode(model, prompts, max_new_tokens=8, eos_token_id=()).tokens, ar.tokens)


def test_video_prompt_and_specvlm_scores_from_the_long_path(monkeypatch):
    """The zoo's Qwen2.5-VL video pair (M-RoPE positions) with the blockwise path forced on its ~300-token prompts:
    the prefill logits and SpecVLM's language-to-video scores equal the direct path's, and decoding is unchanged."""
    from jspec import zoo
    from jspec.zoo import video as V

    if not {"video-target", "video-draft"} <= set(zoo.available()):
        pytest.skip("the zoo video pair is not shipped")
    target, draft = zoo.load("video-target"), zoo.load("video-draft")
    prompt = V.VideoEncoder().prompts(V.eval_set(2, tasks=("video_describe",)))
    strat = jspec.SpecVLM(draft, ratio=0.8, tree="chain5")
    direct_out = jspec.decode(target, prompt, strat, max_new_tokens=12)
    tokens, lengths, inputs = model_prompt(target, prompt)
    j = np.arange(tokens.shape[1])[None]
    last_video = np.max(np.where(tokens == target.config.video_token_id, j, -1), axis=1)
    after = (j > last_video[:, None]) & (j < lengths[:, None])  # the text after the video: SpecVLM's queries
    w = jnp.asarray(after / after.sum(1, keepdims=True), jnp.float32)
    ref = _prefill(target, tokens, lengths, inputs, attn_query_weights=w)
    monkeypatch.setattr(L, "BLOCKWISE_MIN", 64)
    jax.clear_caches()
    got = _prefill(target, tokens, lengths, inputs, attn_query_weights=w)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(ref[0]), atol=3e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(ref[1]), atol=1e-7, rtol=1e-4)
    long_out = jspec.decode(target, prompt, jspec.SpecVLM(draft, ratio=0.8, tree="chain5"), max_new_tokens=12)
    np.testing.assert_array_equal(long_out.tokens, direct_out.tokens)
