"""Ports match transformers' logits on tiny random LLaMA / Qwen2 configs."""
import json

import numpy as np
import pytest

import ports
from conftest import hf_logits, save_and_load, tiny_hf

CASES = {
    "llama_gqa_tied": ("llama", dict(tie_word_embeddings=True)),
    "llama_mha_bias": ("llama", dict(num_key_value_heads=4, attention_bias=True, mlp_bias=True)),
    "llama_mqa_odd": ("llama", dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=1,
                                    intermediate_size=80, vocab_size=97)),
    "llama_head_dim": ("llama", dict(head_dim=24)),
    "llama_linear": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "llama_dynamic": ("llama", dict(max_position_embeddings=16, rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    "llama3_scaling": ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                                     rope_theta=500000.0)),
    "llama_yarn": ("llama", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 32})),
    "qwen2": ("qwen2", dict(num_key_value_heads=1)),
    "qwen2_tied": ("qwen2", dict(tie_word_embeddings=True, rope_theta=1e6)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, tmp_path):
    kind, over = CASES[case]
    hf = tiny_hf(kind, seed=3, **over)
    model = save_and_load(hf, tmp_path)
    vocab = hf.config.vocab_size
    tokens = np.random.default_rng(0).integers(0, vocab, (2, 40))
    ref = hf_logits(hf, tokens)
    ours = ports.logits(model, tokens)
    assert ours.shape == ref.shape
    err = np.abs(ours - ref).max()
    assert err < 1e-4 * max(1.0, np.abs(ref).max()), (case, err)
    # the logits are not trivially flat: the comparison means something
    assert np.abs(ref).max() > 0.1


def test_legacy_rope_spelling_equals_rope_parameters(tmp_path):
    """An older hub config.json (rope_theta + rope_scaling with "type") loads to the same model."""
    hf = tiny_hf("llama", seed=4, rope_scaling={"rope_type": "linear", "factor": 2.0}, rope_theta=20000.0)
    new = save_and_load(hf, tmp_path / "new")
    hf.save_pretrained(str(tmp_path / "old"))
    cfg = json.loads((tmp_path / "old" / "config.json").read_text())
    rp = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rp["rope_theta"]
    cfg["rope_scaling"] = {"type": "linear", "factor": rp["factor"]}
    (tmp_path / "old" / "config.json").write_text(json.dumps(cfg))
    old = ports.load_hf(str(tmp_path / "old"))
    assert old.config == new.config
    assert old.config.rope.rope_type == "linear" and old.config.rope.factor == 2.0
    assert old.config.rope.theta == 20000.0


def test_hidden_states_match_transformers(llama_pair):
    import torch

    hf, model = llama_pair
    tokens = np.random.default_rng(1).integers(0, 101, (1, 12))
    with torch.no_grad():
        ref = hf(torch.tensor(tokens), output_hidden_states=True).hidden_states
    import jax.numpy as jnp
    from jspec.core import prefill as PR

    cache = PR.new_cache_for(model, 1, 16)
    pos = jnp.arange(12)[None]
    fo = model.forward(jnp.asarray(tokens), pos, cache, hidden_layers=(0, 1))
    for got, i in zip(fo.hidden, (0, 1)):
        np.testing.assert_allclose(np.asarray(got), ref[i].numpy(), rtol=1e-5, atol=1e-4)


def test_prefill_of_an_empty_cache_equals_the_cache_forward(llama_pair):
    """`fresh=True` (what `PR.prefill` runs) attends over the prompt alone and pads it into the cache; logits,
    the attention scores and every layer's cache equal the general forward's, which reads all S slots."""
    import jax.numpy as jnp
    import pytest as _pytest
    from jspec.core import prefill as PR

    _, model = llama_pair
    rng = np.random.default_rng(5)
    tokens = jnp.asarray(rng.integers(0, 101, (2, 13)))
    lengths = jnp.asarray([13, 7])
    cache = PR.new_cache_for(model, 2, 48)
    pos = jnp.broadcast_to(jnp.arange(13), (2, 13))
    w = jnp.asarray(rng.random((2, 13)), jnp.float32)
    kw = dict(logits_at=(lengths - 1)[:, None], attn_query_weights=w)
    ref = model.forward(tokens, pos, cache, **kw)
    got = model.forward(tokens, pos, cache, fresh=True, **kw)
    np.testing.assert_allclose(np.asarray(got.logits), np.asarray(ref.logits), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got.attn), np.asarray(ref.attn), rtol=1e-5, atol=1e-6)
    assert got.attn.shape == (2, 48) and float(jnp.abs(got.attn[:, 13:]).max()) == 0.0
    for a, b in zip(got.cache.k + got.cache.v, ref.cache.k + ref.cache.v):
        assert a.shape == b.shape
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    logits, _, c = PR.prefill(model, tokens, lengths, cache)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref.logits[:, 0]), rtol=1e-5, atol=1e-5)
    assert np.asarray(c.length).tolist() == [13, 7]
    with _pytest.raises(ValueError, match="write_offset"):
        model.forward(tokens, pos, cache, fresh=True, write_offset=1)
