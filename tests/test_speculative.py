"""Speculative decoding: greedy SD == greedy AR, draft = target accepts everything, tree buffers, compile once."""
import jax
import numpy as np
import pytest

import jspec
import ports
from jspec import api
from jspec.trees import MC_SIM_7B_63, NAIVE_EXTEND_57, build_tree, chain

CFG = ports.TextConfig(model_type="llama", vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=3,
                       num_heads=4, num_kv_heads=2, head_dim=16)


@pytest.fixture(scope="module")
def pair():
    target = ports.random_model(CFG, key=0, std=0.3)
    # damp the later layers so that a truncated copy (first layer, same embeddings and head) agrees with the
    # target often but not always
    for layer in target.params["layers"][1:]:
        layer["wo"] = layer["wo"] * 0.3
        layer["w_down"] = layer["w_down"] * 0.3
    p = dict(target.params)
    p["layers"] = p["layers"][:1]
    import dataclasses

    draft = ports.Model(dataclasses.replace(CFG, num_layers=1), p)
    return target, draft


PROMPTS = [np.arange(5) % 97, (np.arange(14) * 7) % 97, (np.arange(9) * 3 + 1) % 97]


@pytest.mark.parametrize("make", [
    lambda d: jspec.Chain(d, gamma=1), lambda d: jspec.Chain(d, gamma=3), lambda d: jspec.Chain(d, gamma=6),
    lambda d: jspec.Tree(d, tree="mc_sim_7b_63"), lambda d: jspec.Tree(d, tree="naive_extend_57"),
    lambda d: jspec.Tree(d, tree=[[0], [1], [0, 0], [0, 1], [1, 0]])],
    ids=["chain1", "chain3", "chain6", "mc_sim", "extend57", "custom"])
def test_greedy_sd_equals_greedy_ar(pair, make):
    target, draft = pair
    strat = make(draft)
    for max_new in (23, 8):  # not a multiple of the step
        ar = jspec.decode(target, PROMPTS, max_new_tokens=max_new)
        sd = jspec.decode(target, PROMPTS, strategy=strat, max_new_tokens=max_new)
        np.testing.assert_array_equal(sd.tokens, ar.tokens)
        np.testing.assert_array_equal(sd.lengths, ar.lengths)
    assert np.all(sd.stats["mean_accepted"] >= 1.0)
    # each row alone gives the same as in the batch
    alone = jspec.decode(target, PROMPTS[1], strategy=strat, max_new_tokens=8)
    np.testing.assert_array_equal(alone.tokens[0], sd.tokens[1])


def test_truncated_draft_is_partly_accepted(pair):
    target, draft = pair
    sd = jspec.decode(target, PROMPTS, strategy=jspec.Chain(draft, gamma=4), max_new_tokens=40)
    # real speculation happened: more than the bonus on average, less than everything
    assert np.all(sd.stats["mean_accepted"] > 1.2) and np.all(sd.stats["mean_accepted"] < 5.0)
    assert np.all(sd.stats["acceptance_rate"] > 0) and np.all(sd.stats["acceptance_rate"] < 1)


def test_eos_mid_step(pair):
    target, draft = pair
    free = jspec.decode(target, PROMPTS, max_new_tokens=30, eos_token_id=())
    eos = int(free.tokens[1, 6])
    ar = jspec.decode(target, PROMPTS, max_new_tokens=30, eos_token_id=eos)
    assert ar.lengths[1] <= 7
    for strat in (jspec.Chain(draft, gamma=5), jspec.Tree(draft), jspec.Chain(target, gamma=5)):
        sd = jspec.decode(target, PROMPTS, strategy=strat, max_new_tokens=30, eos_token_id=eos)
        np.testing.assert_array_equal(sd.tokens, ar.tokens)
        np.testing.assert_array_equal(sd.lengths, ar.lengths)


@pytest.mark.parametrize("gamma", [1, 4])
def test_draft_equal_target_accepts_everything(pair, gamma):
    target, _ = pair
    max_new = 1 + 5 * (gamma + 1)  # the prefill token, then 5 full steps
    sd = jspec.decode(target, PROMPTS, strategy=jspec.Chain(target, gamma=gamma), max_new_tokens=max_new)
    assert sd.stats["steps"].tolist() == [5, 5, 5]
    assert np.all(sd.stats["accepted"] == gamma + 1)
    np.testing.assert_allclose(sd.stats["mean_accepted"], gamma + 1)
    np.testing.assert_allclose(sd.stats["acceptance_rate"], 1.0)
    assert sd.stats["drafted"].tolist() == [5 * gamma] * 3
    tree = jspec.decode(target, PROMPTS, strategy=jspec.Tree(target), max_new_tokens=1 + 4 * 6)
    assert np.all(tree.stats["accepted"] == 6)  # depth 5 + bonus


def test_tree_buffers_match_slow_reference():
    for paths in (MC_SIM_7B_63, NAIVE_EXTEND_57, chain(4), [[0], [1], [2], [1, 0], [1, 1], [1, 1, 0]]):
        t = build_tree(paths)
        order = sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p))
        nodes = [()] + order
        assert t.num_nodes == len(nodes)
        for i, p in enumerate(nodes):
            assert t.depth[i] == len(p)
            anc = {nodes.index(p[:k]) for k in range(len(p) + 1)}
            assert set(np.flatnonzero(t.ancestor[i])) == anc
            if p:
                assert t.parent[i] == nodes.index(p[:-1]) and t.rank[i] == p[-1]
                assert t.children[t.parent[i], p[-1]] == i
        leaves = [p for p in nodes if not any(len(q) == len(p) + 1 and q[:-1] == p for q in nodes)]
        got = {tuple(int(x) for x in r if x >= 0) for r in t.retrieve}
        want = {tuple(nodes.index(p[:k]) for k in range(len(p) + 1)) for p in leaves}
        assert got == want
        for d, (s, e) in enumerate(t.levels):
            assert np.all(t.depth[s:e] == d) and (e - s) == sum(len(p) == d for p in nodes)
    assert build_tree("mc_sim_7b_63").num_nodes == 26 and build_tree("naive_extend_57").num_nodes == 58


def test_bad_trees_and_pairs(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="no parent path"):
        build_tree([[0], [0, 0, 0]])
    with pytest.raises(ValueError, match="rank 2 without rank 1"):
        build_tree([[0], [2]])
    with pytest.raises(ValueError, match="gamma"):
        jspec.Chain(draft, gamma=0)
    with pytest.raises(ValueError, match="unknown tree"):
        jspec.decode(target, PROMPTS[0], strategy=jspec.Tree(draft, tree="nope"))
    import dataclasses

    other = ports.random_model(dataclasses.replace(CFG, vocab_size=50, num_layers=1), key=3)
    with pytest.raises(ValueError, match="vocabularies differ"):
        jspec.decode(target, PROMPTS[0], strategy=jspec.Chain(other, gamma=2))


def test_no_recompilation_across_calls(pair):
    target, draft = pair
    strat = jspec.Chain(draft, gamma=3)
    jspec.decode(target, PROMPTS, strategy=strat, max_new_tokens=12)
    n = api._decode_sd._cache_size(), api._prefill_sd._cache_size()
    rng = np.random.default_rng(0)
    jspec.decode(target, [rng.integers(0, 97, len(p)) for p in PROMPTS], strategy=strat, max_new_tokens=12)
    jspec.decode(target, PROMPTS, strategy=jspec.Chain(draft, gamma=3), max_new_tokens=12, key=jax.random.key(1))
    assert (api._decode_sd._cache_size(), api._prefill_sd._cache_size()) == n
