"""jspec.decode (AR): greedy parity with transformers' generate, ragged batches, EOS, sampling, compile-once."""
import jax
import numpy as np
import pytest
import torch
import transformers

import jspec
from sampling_check import warped_logprobs
from conftest import hf_greedy
from jspec import api
from jspec.core import sampling


def test_greedy_matches_hf_generate_batch1(llama_pair):
    hf, model = llama_pair
    prompt = np.random.default_rng(0).integers(0, 101, 9)
    out = jspec.decode(model, prompt, max_new_tokens=24)
    ref = hf_greedy(hf, prompt, 24)
    assert out.tokens.shape == (1, 24)
    np.testing.assert_array_equal(out.tokens[0], ref)
    assert out.lengths.tolist() == [24]
    assert out.stats["steps"].tolist() == [23]


def test_ragged_batch_rows_equal_hf_alone(llama_pair):
    hf, model = llama_pair
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 101, n) for n in (3, 17, 8)]
    out = jspec.decode(model, prompts, max_new_tokens=16)
    for b, p in enumerate(prompts):
        np.testing.assert_array_equal(out.tokens[b], hf_greedy(hf, p, 16), err_msg=f"row {b}")


def test_left_padded_mapping_prompt(llama_pair):
    """An HF-style {input_ids, attention_mask} with left padding gives the same rows as unpadded prompts."""
    _, model = llama_pair
    rng = np.random.default_rng(2)
    a, b = rng.integers(0, 101, 5), rng.integers(0, 101, 11)
    ids = np.zeros((2, 11), np.int64)
    mask = np.zeros((2, 11), np.int64)
    ids[0, 6:], mask[0, 6:] = a, 1
    ids[1], mask[1] = b, 1
    out = jspec.decode(model, {"input_ids": ids, "attention_mask": mask}, max_new_tokens=10)
    ref = jspec.decode(model, [a, b], max_new_tokens=10)
    np.testing.assert_array_equal(out.tokens, ref.tokens)


def test_eos_stops_row_and_pads(llama_pair):
    hf, model = llama_pair
    prompts = [np.random.default_rng(3).integers(0, 101, n) for n in (6, 10)]
    free = jspec.decode(model, prompts, max_new_tokens=20, eos_token_id=())
    eos = int(free.tokens[0, 4])  # a token row 0 emits mid-way
    out = jspec.decode(model, prompts, max_new_tokens=20, eos_token_id=eos)
    for b, p in enumerate(prompts):
        ref = hf_greedy(hf, p, 20, eos=eos)
        n = out.lengths[b]
        np.testing.assert_array_equal(out.tokens[b, :n], ref[:n])
        if n < 20:
            assert out.tokens[b, n - 1] == eos
            assert np.all(out.tokens[b, n:] == eos)  # no pad id in the config: pad with EOS, as transformers does
            assert len(ref) == n or np.all(ref[n:] == eos)
    assert out.lengths[0] <= 5


def test_checkpoint_eos_is_default(tmp_path):
    from conftest import save_and_load, tiny_hf

    hf = tiny_hf("llama", seed=5)
    model0 = save_and_load(hf, tmp_path / "a")
    prompt = np.arange(4)
    free = jspec.decode(model0, prompt, max_new_tokens=12)
    eos = int(free.tokens[0, 3])
    hf.config.eos_token_id = eos
    hf.generation_config.eos_token_id = eos
    model = save_and_load(hf, tmp_path / "b")
    out = jspec.decode(model, prompt, max_new_tokens=12)
    n = int(np.flatnonzero(free.tokens[0] == eos)[0]) + 1
    assert out.lengths[0] == n
    np.testing.assert_array_equal(out.tokens[0, :n], free.tokens[0, :n])


def test_sampling_reproducible_and_key_dependent(llama_pair):
    _, model = llama_pair
    prompt = np.arange(5)
    kw = dict(max_new_tokens=16, temperature=1.0, top_k=20, top_p=0.9)
    a = jspec.decode(model, prompt, key=jax.random.key(7), **kw)
    b = jspec.decode(model, prompt, key=jax.random.key(7), **kw)
    c = jspec.decode(model, prompt, key=jax.random.key(8), **kw)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens, c.tokens)


def test_top_k_one_is_greedy(llama_pair):
    _, model = llama_pair
    prompt = np.arange(6)
    greedy = jspec.decode(model, prompt, max_new_tokens=12)
    k1 = jspec.decode(model, prompt, max_new_tokens=12, temperature=0.7, top_k=1, key=jax.random.key(3))
    np.testing.assert_array_equal(greedy.tokens, k1.tokens)


@pytest.mark.parametrize("top_k,top_p,temp", [(5, None, 1.0), (None, 0.8, 1.0), (7, 0.6, 0.7), (1, 0.3, 1.3)])
def test_masks_match_transformers_warpers(top_k, top_p, temp):
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((4, 50)) * 3).astype(np.float32)
    procs = transformers.LogitsProcessorList()
    if temp != 1.0:
        procs.append(transformers.TemperatureLogitsWarper(temp))
    if top_k is not None:
        procs.append(transformers.TopKLogitsWarper(top_k))
    if top_p is not None:
        procs.append(transformers.TopPLogitsWarper(top_p))
    ref = procs(None, torch.tensor(logits)).numpy()
    cfg, sp = sampling.make_sampling(temp, top_k, top_p)
    ours = np.asarray(sampling.process_logits(jax.numpy.asarray(logits), cfg, sp))
    np.testing.assert_array_equal(np.isinf(ours), np.isinf(ref))
    finite = ~np.isinf(ref)
    np.testing.assert_allclose(ours[finite], ref[finite], rtol=1e-6)
    assert np.isinf(ref).any()  # the filters removed something


def test_sampling_follows_processed_distribution():
    """Empirical frequencies of `sample` match the distribution transformers' warpers give (temperature, top-k,
    top-p); the filtered tokens are never drawn."""
    logits = jax.numpy.asarray(np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], np.float32)))
    cfg, sp = sampling.make_sampling(0.8, 4, 0.9)
    p = np.exp(warped_logprobs(np.asarray(logits)[None], temperature=0.8, top_k=4, top_p=0.9)[0])  # transformers'
    keys = jax.random.split(jax.random.key(0), 20000)
    draws = np.asarray(sampling.sample(keys, jax.numpy.broadcast_to(logits, (20000, 6)), cfg, sp))
    freq = np.bincount(draws, minlength=6) / draws.size
    assert p[4] == 0 and p[5] == 0 and freq[4] == 0 and freq[5] == 0
    np.testing.assert_allclose(freq, p, atol=0.015)


def test_no_recompilation_across_calls(llama_pair):
    _, model = llama_pair
    rng = np.random.default_rng(4)
    jspec.decode(model, rng.integers(0, 101, (2, 7)), max_new_tokens=8)
    n_pre, n_dec = api._prefill_ar._cache_size(), api._decode_ar._cache_size()
    # same shapes, other tokens; a nearby prompt length shares the padded bucket; other sampling values
    jspec.decode(model, rng.integers(0, 101, (2, 7)), max_new_tokens=8)
    jspec.decode(model, rng.integers(0, 101, (2, 9)), max_new_tokens=8)
    assert api._prefill_ar._cache_size() == n_pre
    assert api._decode_ar._cache_size() == n_dec


def test_bad_inputs_fail_early(llama_pair):
    _, model = llama_pair
    with pytest.raises(ValueError, match="longer than max_cache_len"):
        jspec.decode(model, np.arange(30), max_new_tokens=10, max_cache_len=32)
    with pytest.raises(ValueError, match="outside the model vocabulary"):
        jspec.decode(model, np.array([1, 2, 500]), max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        jspec.decode(model, np.arange(3), max_new_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        jspec.decode(model, np.arange(3), temperature=1.0, top_p=1.5)
    with pytest.raises(ValueError, match="holes"):
        jspec.decode(model, {"input_ids": np.ones((1, 4), int), "attention_mask": np.array([[1, 0, 1, 1]])})
    with pytest.raises(ValueError, match="pixel_values"):
        jspec.decode(model, {"input_ids": np.ones((1, 4), int), "pixel_values": np.zeros((1, 3, 8, 8))})
