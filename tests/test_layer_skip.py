"""Layer skipping (EESD's Self-SD baseline): the reduced model shares the target's arrays and drafts through any
strategy (greedy == AR; skipping nothing drafts what the target says), bad layer sets are refused by name, and the
greedy search finds the layer that does nothing."""
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
import ports
from jspec.parts.drafters import layer_skip as LS
from jspec.tools.train import layer_skip as LSS
from jspec.tools.train import eesd as EST
from tiny_pairs import CFG, PROMPTS


@pytest.fixture(scope="module")
def target():
    return ports.random_model(CFG, key=0, std=0.3)


def test_skipped_model_shares_the_target_and_drafts_exactly(target):
    small = LS.skip_layers(target, [1])
    assert small.config.num_layers == 2
    assert small.params["layers"][0] is target.params["layers"][0]
    assert small.params["layers"][1] is target.params["layers"][2] and small.params["embed"] is target.params["embed"]
    ar = jspec.decode(target, PROMPTS, max_new_tokens=16, eos_token_id=())
    out = jspec.decode(target, PROMPTS, jspec.Chain(small, gamma=3), max_new_tokens=16, eos_token_id=())
    np.testing.assert_array_equal(out.tokens, ar.tokens)
    same = jspec.decode(target, PROMPTS, jspec.Chain(LS.skip_layers(target, []), gamma=3), max_new_tokens=16,
                        eos_token_id=())
    np.testing.assert_array_equal(same.tokens, ar.tokens)
    assert (same.stats["accepted"][:, :3] == 4).all()  # the full model drafts what the target says


def test_drafting_in_the_targets_cache_skipping_nothing_drafts_what_the_target_says(target):
    """SkipDrafter drafts in the target's own cache: with no layer skipped its drafts are the target's own greedy
    tokens (every draft accepted), which fails if it read or wrote the wrong slots or positions; with a layer
    skipped it stays AR's tokens, and it holds no cache of its own."""
    ar = jspec.decode(target, PROMPTS, max_new_tokens=16, eos_token_id=())
    whole = jspec.decode(target, PROMPTS, jspec.Chain(LS.SkipDrafter(()), gamma=3), max_new_tokens=16,
                         eos_token_id=())
    np.testing.assert_array_equal(whole.tokens, ar.tokens)
    assert (whole.stats["accepted"][:, :3] == 4).all()
    small = LS.skip_layers(target, [1])
    drafter = LS.SkipDrafter.of(small)
    assert drafter.skip == (1,)
    out = jspec.decode(target, PROMPTS, jspec.Chain(drafter, gamma=3), max_new_tokens=16, eos_token_id=())
    np.testing.assert_array_equal(out.tokens, ar.tokens)
    rounds = lambda o: int((o.stats["accepted"] > 0).sum())  # noqa: E731
    assert (out.stats["accepted"] >= 2).any() and rounds(out) > rounds(whole)  # it drafts, less well
    with pytest.raises(ValueError, match="made by skip_layers"):
        LS.SkipDrafter.of(target)
    with pytest.raises(ValueError, match="out of range"):
        jspec.decode(target, PROMPTS, jspec.Chain(LS.SkipDrafter((5,)), gamma=3), max_new_tokens=4)


def test_bad_layer_sets_are_refused(target):
    for skip, msg in (([3], r"\[3\] out of range"), ([-1], "out of range"), ([1, 1], "repeated"),
                      ([0, 1, 2], "at least one layer must remain")):
        with pytest.raises(ValueError, match=msg):
            LS.skip_layers(target, skip)
    with pytest.raises(ValueError, match="n_skip must be in"):
        LSS.search(target, [], 3)


def test_search_drops_the_layer_that_does_nothing(target):
    """Layer 1 with zeroed output projections adds nothing to the residual stream: skipping it keeps every top-1,
    so the search drops it first, at agreement 1, and a second round then costs agreement."""
    layers = [dict(p) for p in target.params["layers"]]
    for k in ("wo", "w_down"):
        layers[1][k] = jnp.zeros_like(layers[1][k])
    idle = ports.Model(target.config, {**target.params, "layers": layers}, target.hf_config)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, CFG.vocab_size, 24) for _ in range(6)]
    batches = [b for b, _ in (next(it) for it in [EST.pack(seqs, 3, 32)] * 2)]
    skipped, rounds = LSS.search(idle, batches, 2, protect=())
    assert skipped[0] == 1 and rounds[0]["agreement"] == pytest.approx(1.0)
    assert rounds[0]["candidates"][0] < 1.0 and rounds[0]["candidates"][2] < 1.0
    assert rounds[1]["agreement"] < 1.0 and rounds[1]["skip"] == skipped
    assert LSS.agreement(target, [], LSS.reference_top1(target, batches)) == pytest.approx(1.0)
    D, V, Q, KV, F = CFG.hidden_size, CFG.vocab_size, 4 * 16, 2 * 16, CFG.intermediate_size
    layer = D * (Q + 2 * KV) + Q * D + 3 * D * F  # q/k/v, o, gate/up/down: every matrix of a layer
    assert LS.draft_cost(target, 1) == pytest.approx((2 * layer + V * D) / (3 * layer + V * D))
    assert LS.draft_cost(target, 0) == 1.0 and LS.draft_cost(target, 2) < LS.draft_cost(target, 1)


def test_a_shipped_layer_set_loads_by_name(target, tmp_path, monkeypatch):
    import json

    from jspec.tools import models

    monkeypatch.setattr(models, "HEADS_DIR", str(tmp_path))
    d = tmp_path / "smollm2-135m-instruct" / "layer-skip"
    d.mkdir(parents=True)
    (d / "layers.json").write_text(json.dumps({"format": "jspec-layer-skip", "model": "smollm2-135m-instruct",
                                               "skip": [1]}))
    assert ("smollm2-135m-instruct", "layer-skip") in models.heads()
    small = models.head("smollm2-135m-instruct", "layer-skip", target)
    assert small.config.num_layers == 2 and small.params["layers"][1] is target.params["layers"][2]
    (d / "layers.json").write_text(json.dumps({"format": "jspec-layer-skip", "model": "other", "skip": [1]}))
    with pytest.raises(ValueError, match="not a layer-skip set for smollm2-135m-instruct"):
        models.head("smollm2-135m-instruct", "layer-skip", target)
