"""Dynamic-NTK RoPE past max_position_embeddings (the base grows with the sequence length).

transformers computes the base from the longest position of each forward: its prefill scales the whole prompt by
the prompt's length, and its cached generate then scales each new token by its own position, while the keys
already cached keep the bases they were rotated with; so its cached generate is not a full recompute. jspec
scales per token the way that cached generate does, per row (`ports.core.layers.rope_tables`). What holds, tested here:
jspec's greedy AR equals transformers' cached greedy generate past the limit; speculative verification of several
tokens at once and a chunked prefill give AR's tokens; each row decodes as if alone.
"""
import dataclasses

import numpy as np
import pytest

import jspec
import ports
from conftest import hf_greedy, tiny_hf

LIMIT = 32
ROPE = {"rope_type": "dynamic", "factor": 2.0}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("ntk")
    out = {}
    hf = tiny_hf("llama", seed=1, num_hidden_layers=3, max_position_embeddings=LIMIT, rope_scaling=ROPE)
    hf.save_pretrained(str(root))
    return hf, ports.load_hf(str(root))


def _pair(model):
    """(target, draft): later layers damped so that the first layer alone, the draft, agrees often."""
    params = dict(model.params)
    params["layers"] = [dict(p) for p in params["layers"]]
    for p in params["layers"][1:]:
        p["wo"], p["w_down"] = p["wo"] * 0.3, p["w_down"] * 0.3
    target = dataclasses.replace(model, params=params)
    draft = ports.Model(dataclasses.replace(model.config, num_layers=1), dict(params, layers=params["layers"][:1]))
    return target, draft


def _prompt(seed, n):
    return np.random.default_rng(seed).integers(0, 101, n)


def test_ar_equals_transformers_cached_generate_past_the_limit(checkpoint):
    hf, model = checkpoint
    diverged = 0
    for seed in range(3):
        prompt = _prompt(seed, 24)
        want = hf_greedy(hf, prompt, 30)  # 22 tokens past the 32 positions
        np.testing.assert_array_equal(jspec.decode(model, prompt, max_new_tokens=30, eos_token_id=()).tokens[0], want)
        diverged += not np.array_equal(hf_greedy(hf, prompt, 30, use_cache=False), want)
    assert diverged  # transformers' own recompute (no cache) differs from its cached generate past the limit


def test_speculative_and_chunked_prefill_equal_ar_past_the_limit(checkpoint):
    """A ragged batch whose rows cross the limit during decoding (prompts of 9-30 tokens, 28 new): Chain and a
    tree verify several positions past the limit at once and give AR's tokens; a chunked prefill too; row 1
    alone gives the batch's row 1."""
    target, draft = _pair(checkpoint[1])
    prompts = [_prompt(10 + i, n) for i, n in enumerate((30, 9, 21))]
    ar = jspec.decode(target, prompts, max_new_tokens=28, eos_token_id=())
    for strat in (jspec.Chain(draft, gamma=4), jspec.Tree(draft, tree="mc_sim_7b_63")):
        sd = jspec.decode(target, prompts, strategy=strat, max_new_tokens=28, eos_token_id=())
        np.testing.assert_array_equal(sd.tokens, ar.tokens)
        assert sd.stats["mean_accepted"].max() > 1.0
    chunked = jspec.decode(target, prompts, max_new_tokens=28, eos_token_id=(), prefill_chunk=8)
    np.testing.assert_array_equal(chunked.tokens, ar.tokens)
    alone = jspec.decode(target, prompts[1], max_new_tokens=28, eos_token_id=())
    np.testing.assert_array_equal(alone.tokens[0], ar.tokens[1])
