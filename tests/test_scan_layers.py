"""Scanned layers (`ports.core.scanned`): a model with stacked layers gives the unrolled model's logits, caches and
tokens, for every forward the engine runs and for the strategies that read the target's hidden states or defer
its writes; what cannot run scanned says so."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
import ports
from ports.core import cache as kvc
from ports.core import scanned as SC
from strategies import REGISTRY
from tiny_pairs import PROMPTS, tiny_pair


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


def caches(model, B=2, S=24):
    layers, kvh, hd = model.kv_layout
    return (kvc.init_cache(layers, B, kvh, S, hd, model.dtype),
            kvc.init_cache(layers, B, kvh, S, hd, model.dtype, stacked=True))


def same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert np.array_equal(np.asarray(x), np.asarray(y))


def close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)


def stacked_as_list(cache):
    return cache.replace(k=list(cache.k), v=list(cache.v))


def test_layouts_convert_both_ways_and_save_as_checkpoints_do(pair, tmp_path):
    target, _ = pair
    s = SC.scan_layers(target)
    assert SC.is_scanned(s) and not SC.is_scanned(target)
    assert jax.tree.leaves(s.params["layers"])[0].shape[0] == target.config.num_layers
    same(SC.unscan_layers(s).params, target.params)
    assert SC.is_scanned(SC.scan_layers(s))
    ports.save_hf(s, str(tmp_path / "hf"))
    ports.save(s, str(tmp_path / "orbax"))
    same(ports.load(str(tmp_path / "orbax")).params, target.params)
    same(ports.load_hf(str(tmp_path / "hf")).params, target.params)


def fwd(model):
    """The model's forward, jitted (its keyword options static), as the engine runs it."""
    run = jax.jit(lambda m, *a, **kw: m.forward(*a, **kw), static_argnames=("fresh", "hidden_layers", "defer_writes"))
    return lambda *a, **kw: run(model, *a, **kw)


def test_every_forward_matches_the_unrolled_one(pair):
    """Prefill, a tree verify with hidden states and a mask, attention scores, a deferred write and a forward
    after earlier scratch, each jitted: the same logits, hidden states, scores and cache contents (bit for bit, or
    to float32 sum order where the scan holds its writes back)."""
    model, _ = pair
    target, s = fwd(model), fwd(SC.scan_layers(model))
    c0, c1 = caches(model)
    tok = jnp.asarray(np.random.default_rng(0).integers(0, model.vocab_size, (2, 6)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
    a = target(tok, pos, c0, fresh=True, hidden_layers=(0, 1, 2))
    b = s(tok, pos, c1, fresh=True, hidden_layers=(0, 1, 2))
    same((a.logits, a.hidden, a.cache.k, a.cache.v), (b.logits, b.hidden, list(b.cache.k), list(b.cache.v)))
    c0, c1 = kvc.commit(a.cache, jnp.array([6, 4])), kvc.commit(b.cache, jnp.array([6, 4]))
    nxt, npos = tok[:, :3], kvc.positions(c0, jnp.broadcast_to(jnp.arange(3), (2, 3)))
    tree = jnp.asarray([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]] * 2, bool)
    a = target(nxt, npos, c0, tree, attn_query_weights=jnp.ones((2, 3)))
    b = s(nxt, npos, c1, tree, attn_query_weights=jnp.ones((2, 3)))
    same((a.logits, a.attn, a.cache.k), (b.logits, b.attn, list(b.cache.k)))
    for kw in ({}, {"hidden_layers": (model.config.num_layers,)}):
        # the scan holds its writes back (`run_layers`): the unrolled forward with deferred writes, bit for bit,
        # and the unrolled forward that writes as it goes up to the order of float32 sums
        a = target(nxt, npos, c0, tree, defer_writes=True, **kw)
        b = s(nxt, npos, c1, tree, **kw)
        same((a.logits, a.hidden), (b.logits, b.hidden))
        same(kvc.write_pending(c0, *a.pending), stacked_as_list(b.cache))
        a = target(nxt, npos, c0, tree, **kw)
        close((a.logits, a.hidden, a.cache), (b.logits, b.hidden, stacked_as_list(b.cache)))
        assert np.argmax(a.logits, -1).tolist() == np.argmax(b.logits, -1).tolist()
    # a forward after earlier scratch (a draft level at write_offset 3, seeing the tree's first node)
    a0 = target(nxt, npos, c0, tree)
    b0 = s(nxt, npos, c1, tree)
    lvl = jnp.zeros((2, 2, 5), bool).at[:, :, 0].set(True).at[:, 0, 3].set(True).at[:, 1, 3:].set(True)
    a = target(nxt[:, :2], npos[:, :2] + 1, a0.cache, lvl, write_offset=3)
    b = s(nxt[:, :2], npos[:, :2] + 1, b0.cache, lvl, write_offset=3)
    close((a.logits, a.cache), (b.logits, stacked_as_list(b.cache)))
    assert not np.allclose(np.asarray(b.logits), np.asarray(
        s(nxt[:, :2], npos[:, :2] + 1, b0.cache, lvl.at[:, :, 0].set(False), write_offset=3).logits))
    a = target(nxt, npos, c0, tree, defer_writes=True)
    b = s(nxt, npos, c1, tree, defer_writes=True)
    same((a.logits, a.pending[0]), (b.logits, list(b.pending[0])))
    same(kvc.write_pending(c0, *a.pending), stacked_as_list(kvc.write_pending(c1, *b.pending)))
    src = jnp.asarray([[2, 0, 1], [1, 2, 0]], jnp.int32)
    same(kvc.commit_path(c0, src, jnp.array([2, 1])), stacked_as_list(kvc.commit_path(c1, src, jnp.array([2, 1]))))


@pytest.mark.parametrize("name", ["prompt_lookup", "eagle_head"] + [
    pytest.param(n, marks=pytest.mark.slow) for n in ("sage", "chain", "tree", "dynamic", "eagle3_chain")])
def test_a_scanned_target_decodes_the_same_tokens(pair, name):
    """Greedy and sampled (same key): the scanned target's tokens are the unrolled target's, through the deferred
    verify switch (prompt lookup; SAGE under -m slow) and the hidden states EAGLE heads read."""
    target, draft = pair
    s = SC.scan_layers(target)
    strategy = REGISTRY[name].make(target, draft)
    for temperature in (0.0, 1.0):
        kw = dict(max_new_tokens=10, eos_token_id=(), temperature=temperature, key=jax.random.key(3))
        a = jspec.decode(target, PROMPTS[:2], strategy, **kw)
        b = jspec.decode(s, PROMPTS[:2], strategy, **kw)
        assert np.array_equal(np.asarray(a.tokens), np.asarray(b.tokens)), (name, temperature)


def test_a_scanned_draft_guidance_a_chunked_prefill_and_a_scanned_vlm(pair):
    """A draft model may be scanned too (its tree levels write at an offset), under classifier-free guidance (the
    guided wrapper's caches follow the layout); a chunked prefill; a LLaVA target runs its language model scanned."""
    from sampling_check import IMAGE_PROMPT, PIXELS, tiny_llava

    target, draft = pair
    scanned = SC.scan_layers(target)
    kw = dict(max_new_tokens=8, eos_token_id=())
    a = jspec.decode(target, PROMPTS[:2], jspec.Tree(draft, tree=[[0], [1], [0, 0]]), **kw)
    b = jspec.decode(target, PROMPTS[:2], jspec.Tree(SC.scan_layers(draft), tree=[[0], [1], [0, 0]]), **kw)
    assert np.array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    cfg = dict(kw, guidance=jspec.CFG(2.0, [np.asarray([1, 2])]))
    a = jspec.decode(target, PROMPTS[:2], jspec.Chain(draft, gamma=3), **cfg)
    b = jspec.decode(scanned, PROMPTS[:2], jspec.Chain(SC.scan_layers(draft), gamma=3), **cfg)
    assert np.array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    a = jspec.decode(target, PROMPTS[:2], None, prefill_chunk=2, **kw)
    b = jspec.decode(scanned, PROMPTS[:2], None, prefill_chunk=2, **kw)
    assert np.array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    vlm = tiny_llava(10, 0.4)
    prompt = {"input_ids": IMAGE_PROMPT[None], "pixel_values": PIXELS[:1]}
    a = jspec.decode(vlm, prompt, None, **kw)
    b = jspec.decode(SC.scan_layers(vlm), prompt, None, **kw)
    assert np.array_equal(np.asarray(a.tokens), np.asarray(b.tokens))


def test_what_cannot_run_scanned_says_so(pair):
    from strategies import eesd_head
    from jspec.parts.drafters.layer_skip import skip_layers
    from sampling_check import tiny_chameleon

    target, _ = pair
    s = SC.scan_layers(target)
    with pytest.raises(ValueError, match="unscan"):
        jspec.decode(s, PROMPTS[:1], jspec.EESD(eesd_head(target), k_max=3), max_new_tokens=4)
    with pytest.raises(ValueError, match="list of layers"):
        skip_layers(s, [0])
    with pytest.raises(ValueError, match="cannot be sharded"):
        jspec.shard(s, jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tensor",)))
    with pytest.raises(ValueError, match="do not run scanned layers"):
        SC.scan_layers(tiny_chameleon())
    with pytest.raises(ValueError, match="nothing to scan"):
        SC.stack_layers([])
    assert isinstance(ports.core.scanned.unscan_layers(s).params["layers"], list)
