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
from ports.core import cache as kvc
from jspec.core import prefill as PR
from ports.core.prompts import model_prompt
from ports.core import blockwise as BW
from ports.core import layers as LY
from tolerances import assert_layout_close


@pytest.mark.parametrize("T, qb, kb", [(300, 64, 48), (129, 128, 128), (70, 512, 512)])
def test_blockwise_equals_direct_attention(T, qb, kb):
    rng = np.random.default_rng(T)
    B, H, KVH, Dh = 3, 6, 2, 8
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, h, Dh)), jnp.float32) for h in (H, KVH, KVH))
    start = jnp.asarray([0, 5, T // 3])
    vis = kvc.visibility(jnp.zeros((B,), jnp.int32), T, T, None, 0, start)
    w = np.zeros((B, T), np.float32)
    w[:, -7:] = 1 / 7  # the last queries' probabilities, as SpecVLM's scores read them
    ref, ref_s = LY.attention(q, LY.kv_rows(k), LY.kv_rows(v), vis, jnp.asarray(w))
    out, s = BW.causal_attention(q, k, v, start, jnp.asarray(w), q_block=qb, k_block=kb)
    seen = np.arange(T)[None] >= np.asarray(start)[:, None]
    np.testing.assert_allclose(np.asarray(out)[seen], np.asarray(ref)[seen], atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(s), np.asarray(ref_s), atol=1e-8, rtol=1e-5)
    assert_layout_close(np.asarray(BW.causal_attention(q, k, v, start, q_block=qb, k_block=kb))[seen],
                        np.asarray(out)[seen], reduction=T)  # another program: without the score outputs


def test_fused_path_is_taken_only_where_its_mask_is_the_prefill_s(monkeypatch):
    """`jax.nn.dot_product_attention` (its XLA implementation here; cuDNN's on a GPU) equals the blockwise pass on
    grouped-query rows that all start at slot 0; a batch with a later start, or asking for scores, attends
    blockwise; "auto" off a GPU and an implementation that cannot trace (cuDNN on this CPU) fall back."""
    rng = np.random.default_rng(1)
    B, T, H, KVH, Dh = 2, 200, 6, 2, 8
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, h, Dh)), jnp.float32) for h in (H, KVH, KVH))
    zero, later = jnp.zeros((B,), jnp.int32), jnp.asarray([0, 9])
    monkeypatch.setattr(BW, "FUSED", "off")
    want = {name: np.asarray(BW.causal_attention(q, k, v, s, q_block=64, k_block=64))
            for name, s in (("zero", zero), ("later", later))}
    monkeypatch.setattr(BW, "FUSED", "xla")
    run = jax.jit(lambda q, k, v, s: BW.causal_attention(q, k, v, s, q_block=64, k_block=64))
    np.testing.assert_allclose(np.asarray(run(q, k, v, zero)), want["zero"], atol=2e-6, rtol=1e-5)
    # which branch ran, decided on the device: a stand-in kernel that returns zeros
    calls = []
    monkeypatch.setattr(jax.nn, "dot_product_attention", lambda q, *a, **kw: calls.append(kw) or jnp.zeros_like(q))
    run = jax.jit(lambda q, k, v, s: BW.causal_attention(q, k, v, s, q_block=64, k_block=64))
    assert not np.any(np.asarray(run(q, k, v, zero)))
    seen = np.arange(T)[None] >= np.asarray(later)[:, None]
    assert_layout_close(np.asarray(run(q, k, v, later))[seen], want["later"][seen], reduction=T)
    assert calls and all(c["is_causal"] and c["implementation"] == "xla" for c in calls)
    n = len(calls)
    out, _ = BW.causal_attention(q, k, v, zero, jnp.ones((B, T)), q_block=64, k_block=64)
    assert len(calls) == n and np.any(np.asarray(out))  # scores need the blockwise pass's log-sum-exp
    for mode in ("auto", "off"):
        monkeypatch.setattr(BW, "FUSED", mode)
        assert BW.fused_attention(q, k, v) is None and len(calls) == n
    monkeypatch.undo()
    monkeypatch.setattr(BW, "FUSED", "cudnn")
    if jax.default_backend() != "gpu":
        assert BW.fused_attention(q.astype(jnp.bfloat16), k, v) is None  # "cuDNN is not detected": blockwise
    monkeypatch.setattr(BW, "FUSED", "flash")
    with pytest.raises(ValueError, match="FUSED must be one of"):
        BW.causal_attention(q, k, v, zero)


def _spy_on_fused_kernel(monkeypatch) -> list:
    """Wrap `jax.nn.dot_product_attention`; the returned list gets the keyword arguments of each call that returned
    a result (a raising kernel falls back to blockwise and is not recorded)."""
    calls = []
    real = jax.nn.dot_product_attention

    def spy(*a, **kw):
        out = real(*a, **kw)
        calls.append(kw)
        return out

    monkeypatch.setattr(jax.nn, "dot_product_attention", spy)
    return calls


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN's flash attention needs a CUDA GPU")
def test_cudnn_prefill_attention_on_a_gpu():
    """On a GPU, "auto" runs cuDNN's kernel for a bf16 prefill and it agrees with the blockwise pass within bf16
    rounding (`jspec bench gpu` runs the same check from an installed package)."""
    from jspec.tools.bench import gpu

    gpu.cudnn_check()


def test_prefill_through_the_fused_path_gives_the_same_logits(monkeypatch):
    """A long prefill's layers through `jax.nn.dot_product_attention` (XLA's, standing in for cuDNN's): the same
    logits and cache as the blockwise pass."""
    cfg = ports.TextConfig(model_type="llama", vocab_size=101, hidden_size=32, intermediate_size=48, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=4096)
    model = ports.random_model(cfg, key=2, std=0.3)
    tokens = np.random.default_rng(2).integers(0, 101, (2, LY.BLOCKWISE_MIN + 5)).astype(np.int32)
    lengths = np.array([LY.BLOCKWISE_MIN + 5, LY.BLOCKWISE_MIN - 40], np.int32)
    calls = _spy_on_fused_kernel(monkeypatch)
    monkeypatch.setattr(BW, "FUSED", "xla")
    fused_logits, _, fused_k = _prefill(model, tokens, lengths)
    assert len(calls) >= cfg.num_layers
    monkeypatch.setattr(BW, "FUSED", "off")
    logits, _, k = _prefill(model, tokens, lengths)
    assert_layout_close(fused_logits, logits, reduction=tokens.shape[1], depth=cfg.num_layers)
    np.testing.assert_allclose(np.asarray(fused_k), np.asarray(k), atol=1e-6)


def _prefill(model, tokens, lengths, inputs=None, **kw):
    """A fresh jitted prefill (the attention path is picked when it is traced)."""
    @jax.jit
    def run(model, tokens, lengths, inputs):
        cache = PR.new_cache_for(model, tokens.shape[0], tokens.shape[1] + 8)
        logits, fo, cache = PR.prefill(model, tokens, lengths, cache, inputs, **kw)
        return logits, fo.attn, cache.k[0]
    return run(model, jnp.asarray(tokens), jnp.asarray(lengths), inputs or {})


@pytest.fixture
def direct(monkeypatch):
    """Turns the blockwise path off (every prefill attends directly)."""
    return functools.partial(monkeypatch.setattr, LY, "BLOCKWISE_MIN", 10 ** 9)


def test_long_prefill_takes_the_blockwise_path_with_the_same_logits(direct):
    cfg = ports.TextConfig(model_type="llama", vocab_size=101, hidden_size=32, intermediate_size=48, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=4096)
    model = ports.random_model(cfg, key=1, std=0.3)
    rng = np.random.default_rng(0)
    lengths = np.array([LY.BLOCKWISE_MIN + 77, LY.BLOCKWISE_MIN - 300, 901], np.int32)
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
    assert_layout_close(long_logits, ref_logits, reduction=tokens.shape[1], depth=model.config.num_layers)
    np.testing.assert_allclose(np.asarray(long_k), np.asarray(ref_k), atol=1e-6)
    jax.clear_caches()
    np.testing.assert_array_equal(jspec.decode(model, prompts, max_new_tokens=8, eos_token_id=()).tokens, ar.tokens)


@pytest.mark.slow  # (the long path's logits: test_long_prefill_takes_the_blockwise_path_with_the_same_logits)
def test_video_prompt_and_specvlm_scores_from_the_long_path(monkeypatch):
    """The zoo's Qwen2.5-VL video pair (M-RoPE positions) with the blockwise path forced on its ~300-token prompts,
    in one pass and in chunks of 100: the prefill logits and SpecVLM's language-to-video scores equal the direct
    path's, and decoding in blockwise chunks gives the same tokens."""
    from jspec.tools import zoo
    from jspec.tools.zoo import video as ZV

    if not {"video-target", "video-draft"} <= set(zoo.available()):
        pytest.skip("the zoo video pair is not shipped")
    target, draft = zoo.load("video-target"), zoo.load("video-draft")
    prompt = ZV.VideoEncoder().prompts(ZV.eval_set(2, tasks=("video_describe",)))
    strat = jspec.SpecVLM(draft, ratio=0.8, tree="chain5")
    direct_out = jspec.decode(target, prompt, strat, max_new_tokens=12)
    tokens, lengths, inputs = model_prompt(target, prompt)
    j = np.arange(tokens.shape[1])[None]
    last_video = np.max(np.where(tokens == target.config.video_token_id, j, -1), axis=1)
    after = (j > last_video[:, None]) & (j < lengths[:, None])  # the text after the video: SpecVLM's queries
    w = jnp.asarray(after / after.sum(1, keepdims=True), jnp.float32)
    ref = _prefill(target, tokens, lengths, inputs, attn_query_weights=w)
    monkeypatch.setattr(LY, "BLOCKWISE_MIN", 64)
    jax.clear_caches()
    got = _prefill(target, tokens, lengths, inputs, attn_query_weights=w)
    assert_layout_close(got[0], ref[0], reduction=tokens.shape[1], depth=target.kv_layout[0])
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(ref[1]), atol=1e-7, rtol=1e-4)
    chunked = _prefill(target, tokens, lengths, inputs, attn_query_weights=w, chunk=100)  # M-RoPE ids, in pieces
    assert_layout_close(chunked[0], ref[0], reduction=tokens.shape[1], depth=target.kv_layout[0])
    np.testing.assert_allclose(np.asarray(chunked[1]), np.asarray(ref[1]), atol=1e-7, rtol=1e-4)
    chunk_out = jspec.decode(target, prompt, jspec.SpecVLM(draft, ratio=0.8, tree="chain5"), max_new_tokens=12,
                             prefill_chunk=100)
    np.testing.assert_array_equal(chunk_out.tokens, direct_out.tokens)


@pytest.mark.parametrize("T, S, qb, kb", [(300, 700, 64, 48), (129, 300, 128, 128), (64, 1000, 32, 96)])
def test_prefix_attention_equals_direct_attention(T, S, qb, kb):
    """A chunk of new queries after `length` cached slots (ragged, with hidden starts), blockwise: the direct path's
    output and SpecVLM-style scores, including a last key block that overlaps the one before it."""
    rng = np.random.default_rng(T)
    B, H, KVH, Dh = 3, 6, 2, 8
    q = jnp.asarray(rng.normal(size=(B, T, H, Dh)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B * KVH, S, Dh)), jnp.float32) for _ in range(2))
    length, start = jnp.asarray([0, 17, S - T - 5]), jnp.asarray([0, 5, 40])
    vis = kvc.visibility(length, S, T, None, 0, start)
    w = np.zeros((B, T), np.float32)
    w[:, -7:] = 1 / 7
    ref, ref_s = LY.attention(q, k, v, vis, jnp.asarray(w))
    out, s = BW.prefix_attention(q, k, v, start, length, jnp.asarray(w), q_block=qb, k_block=kb)
    seen = np.asarray(length)[:, None] + np.arange(T)[None] >= np.asarray(start)[:, None]
    np.testing.assert_allclose(np.asarray(out)[seen], np.asarray(ref)[seen], atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(s), np.asarray(ref_s), atol=1e-8, rtol=1e-5)


def _tiny_llama():
    cfg = ports.TextConfig(model_type="llama", vocab_size=101, hidden_size=32, intermediate_size=48, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=4096)
    return ports.random_model(cfg, key=1, std=0.3)


@pytest.mark.parametrize("blockwise", [False, True])
def test_chunked_prefill_equals_one_pass(blockwise, monkeypatch):
    """Chunks of 64 (four whole ones and a remainder) on a ragged batch: the same last-token logits, cache, hidden
    states and attention scores as one pass, on the direct path and with the chunks attending blockwise."""
    model = _tiny_llama()
    rng = np.random.default_rng(1)
    lengths = np.array([300, 170, 257], np.int32)
    tokens = np.zeros((3, 300), np.int32)
    for b, n in enumerate(lengths):
        tokens[b, :n] = rng.integers(0, 101, n)
    w = np.zeros((3, 300), np.float32)
    for b, n in enumerate(lengths):
        w[b, n - 9:n] = 1 / 9

    @functools.partial(jax.jit, static_argnames="chunk")
    def run(tokens, lengths, w, chunk):
        cache = PR.new_cache_for(model, 3, 320)
        logits, fo, cache = PR.prefill(model, tokens, lengths, cache, chunk=chunk, hidden_layers=(1, 2),
                                         attn_query_weights=w)
        return logits, fo.hidden, fo.attn, cache

    ref = run(tokens, lengths, w, None)
    if blockwise:
        monkeypatch.setattr(LY, "BLOCKWISE_MIN", 64)
    got = run(tokens, lengths, w, 64)
    assert_layout_close(got[0], ref[0], reduction=tokens.shape[1], depth=model.config.num_layers)
    for h, r in zip(got[1], ref[1]):  # activations of a few units to tens (std 0.3 weights): float32 rounding
        np.testing.assert_allclose(np.asarray(h), np.asarray(r), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(ref[2]), atol=1e-7, rtol=1e-4)
    np.testing.assert_array_equal(np.asarray(got[3].length), lengths)
    for layer in range(2):
        for b, n in enumerate(lengths):
            rows = slice(b * 2, b * 2 + 2)
            assert_layout_close(got[3].k[layer][rows, :n], ref[3].k[layer][rows, :n],
                                reduction=model.config.hidden_size, depth=layer + 1)  # keys of a few units


def test_decode_with_prefill_chunks_gives_the_same_tokens():
    """AR and Chain decode the same tokens whatever the prefill chunk; bad chunks are named before any compute."""
    model = _tiny_llama()
    draft = ports.Model(dataclasses.replace(model.config, num_layers=1),
                        {**model.params, "layers": model.params["layers"][:1]})
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 101, n) for n in (150, 97)]
    for strat in (None, jspec.Chain(draft, gamma=3)):
        ref = jspec.decode(model, prompts, strat, max_new_tokens=8, eos_token_id=(), prefill_chunk=None)
        got = jspec.decode(model, prompts, strat, max_new_tokens=8, eos_token_id=(), prefill_chunk=40)
        np.testing.assert_array_equal(got.tokens, ref.tokens)
    for bad in (0, -3, 2.5, True, "half"):
        with pytest.raises(ValueError, match="prefill_chunk must be"):
            jspec.decode(model, prompts, max_new_tokens=2, prefill_chunk=bad)
