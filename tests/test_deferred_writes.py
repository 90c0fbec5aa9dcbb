"""`defer_writes`: a forward that returns its new keys / values instead of writing them (the draft model's catch-up
switch uses it, so that XLA does not copy the cache in and out of the conditional); and a trimmed verify, whose
widths run as loops of zero or one trips, compiles without copying the target's cache."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec import api
from jspec.core import prefill as PR
from ports.core import cache as kvc
from tiny_pairs import CFG, PROMPTS, tiny_pair
from tolerances import assert_layout_close


@pytest.fixture(scope="module")
def prefilled():
    target, _ = tiny_pair()
    lengths = np.array([len(p) for p in PROMPTS])
    toks = np.zeros((len(PROMPTS), 16), np.int32)
    for i, p in enumerate(PROMPTS):
        toks[i, :len(p)] = p
    cache = PR.new_cache_for(target, len(PROMPTS), 48)
    _, _, cache = PR.prefill(target, jnp.asarray(toks), jnp.asarray(lengths), cache, {})
    return target, cache


@pytest.mark.parametrize("tree", [False, True])
def test_deferred_forward_equals_the_writing_one(prefilled, tree):
    """Logits, hidden states, and the cache once the pending rows are written, against the forward that writes:
    equal up to the order of float32 sums; the committed slots are untouched."""
    target, cache = prefilled
    B, T = cache.batch, 5
    toks = jnp.asarray(np.arange(B * T).reshape(B, T) % 97, jnp.int32)
    depth = jnp.asarray([[0, 1, 1, 2, 3]] * B) if tree else jnp.broadcast_to(jnp.arange(T), (B, T))
    mask = None
    if tree:  # node 2 is a sibling of node 1; nodes 3, 4 extend node 2
        anc = np.tril(np.ones((T, T), bool))
        anc[2, 1] = anc[3, 1] = anc[4, 1] = False
        mask = jnp.asarray(np.broadcast_to(anc, (B, T, T)))
    pos = kvc.positions(cache, depth)
    f = jax.jit(lambda c, defer: target.forward(toks, pos, c, mask, hidden_layers=(2,), defer_writes=defer),
                static_argnums=1)
    ref, got = f(cache, False), f(cache, True)
    assert got.cache is not None and got.pending is not None and ref.pending is None
    red = max(CFG.intermediate_size, cache.max_len)
    assert_layout_close(got.logits, ref.logits, reduction=red, depth=CFG.num_layers)
    assert_layout_close(got.hidden[0], ref.hidden[0], reduction=red, depth=2)
    for a, b in zip(got.cache.k + got.cache.v, cache.k + cache.v):  # the cache given is returned unwritten
        np.testing.assert_array_equal(a, b)
    written = kvc.write_pending(cache, *got.pending)
    H = cache.kv_heads
    for a, b, orig in zip(written.k + written.v, ref.cache.k + ref.cache.v, cache.k + cache.v):
        a, b, orig = np.asarray(a), np.asarray(b), np.asarray(orig)
        assert_layout_close(a, b, reduction=red, depth=CFG.num_layers)
        for r in range(B * H):  # committed slots: bit for bit the prefill's; the new ones written at length
            n = int(cache.length[r // H])
            np.testing.assert_array_equal(a[r, :n], orig[r, :n])
            assert not np.array_equal(a[r, n:n + T], orig[r, n:n + T])  # the pending rows were written


def test_deferred_forward_refuses_what_it_cannot_defer(prefilled):
    target, cache = prefilled
    toks = jnp.zeros((cache.batch, 2), jnp.int32)
    pos = kvc.positions(cache, jnp.zeros((cache.batch, 2), jnp.int32))
    for kw in ({"write_offset": 1}, {"attn_query_weights": jnp.ones((cache.batch, 2))}):
        with pytest.raises(ValueError, match="defer_writes"):
            target.forward(toks, pos, cache, defer_writes=True, **kw)


def _cache_copies(started) -> int:
    fn, args = started.loop_call()
    S = started.state.cache.max_len
    text = fn.lower(*args).compile().as_text()
    return sum(1 for line in text.splitlines() if " copy(" in line and f",{S},16]" in line.split("=")[1][:40])


def test_trimmed_verify_copies_no_cache_and_keeps_tokens():
    """A prompt-lookup verify trimmed to what was drafted (one loop of zero or one trips per width) compiles
    without copying the cache, as AR's loop does; greedy tokens equal AR's."""
    target, _ = tiny_pair()
    prompts = [np.tile(np.arange(6), 4), np.tile(np.arange(3, 9), 3)]
    pl = jspec.PromptLookup(3, 6)
    assert _cache_copies(api.start(target, prompts, pl, max_new_tokens=24, eos_token_id=())) == 0
    assert _cache_copies(api.start(target, prompts, None, max_new_tokens=24, eos_token_id=())) == 0
    a = jspec.decode(target, prompts, strategy=pl, max_new_tokens=24, eos_token_id=())
    b = jspec.decode(target, prompts, max_new_tokens=24, eos_token_id=())
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert np.max(a.stats["accepted"]) >= 2  # copies were found and verified


def _llava():
    from sampling_check import tiny_llava
    return tiny_llava(key=1, std=0.3)


def _qwen2_vl():
    import ports
    import transformers
    from test_qwen2_vl import PATCH, TOKENS, text_config
    vision = dict(depth=1, embed_dim=32, hidden_size=48, num_heads=4, mlp_ratio=2, patch_size=PATCH)
    hf = transformers.Qwen2VLConfig(text_config=text_config(48, 2, (2, 2, 2)), vision_config=vision, **TOKENS)
    return ports.random_model(ports.family("qwen2_vl").config_from_hf(hf.to_dict()), key=2, std=0.3)


# (Qwen2-VL's case builds transformers' config and a vision tower: slow; LLaVA's covers the pass-through by default)
@pytest.mark.parametrize("make", [_llava, pytest.param(_qwen2_vl, marks=pytest.mark.slow)], ids=["llava", "qwen2_vl"])
def test_vlm_families_defer_their_writes_too(make):
    """LLaVA's and Qwen2-VL's forwards take defer_writes (they run the LLaMA forward), so their trimmed verifies
    skip the cache copies as well: the deferred forward equals the writing one there too."""
    model = make()
    assert model.defers_writes
    B, P, T = 2, 6, 3
    V = model.vocab_size
    cache = PR.new_cache_for(model, B, 24)
    fwd = jax.jit(lambda t, p, c, defer: model.forward(t, p, c, defer_writes=defer), static_argnums=3)
    prompt = jnp.asarray(np.arange(B * P).reshape(B, P) % (V - 2), jnp.int32)
    fo = fwd(prompt, kvc.positions(cache, jnp.broadcast_to(jnp.arange(P), (B, P))), cache, False)
    cache = kvc.commit(fo.cache, jnp.asarray([P, P - 2]))
    new = jnp.asarray(np.arange(B * T).reshape(B, T) % (V - 2), jnp.int32)
    pos = kvc.positions(cache, jnp.broadcast_to(jnp.arange(T), (B, T)))
    ref, got = fwd(new, pos, cache, False), fwd(new, pos, cache, True)
    assert_layout_close(got.logits, ref.logits, reduction=64, depth=2)
    written = kvc.write_pending(cache, *got.pending)
    for a, b in zip(written.k + written.v, ref.cache.k + ref.cache.v):
        assert_layout_close(a, b, reduction=64, depth=2)
