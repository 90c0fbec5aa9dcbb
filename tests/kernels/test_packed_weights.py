"""Weights packed for the CPU (`ports.cpu.packed`, `ports.cpu.dot.packed_dot`): the panel kernel against a float64
reference, a row's result independent of the rows beside it, the model layout converting both ways and saving as
the checkpoint layout, the same logits as the plain model, and speculative decoding over a packed target giving
AR's tokens."""
import shutil
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
import ports
from jspec.engine import sharding as SH
from ports import cache as kvc
from ports import cpu
from ports.cpu import dot as CD
from ports import layers as LY
from ports.cpu import packed as PK
from ports import scanned as SC
from strategies import REGISTRY
from tiny_pairs import PROMPTS, tiny_pair

compiler = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                              reason="no C++ compiler here: the kernel cannot build and the einsum form is used")


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


def same(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert np.array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("k,n", [(64, 96), (37, 45), (576, 300), (48, 256), (200, 1030)])
def test_pack_round_trips_and_pads_the_last_panel(k, n):
    w = np.random.default_rng(k + n).standard_normal((k, n)).astype(np.float32)
    wp = CD.pack(w)
    assert wp.shape == (-(-n // CD.PANEL), k, CD.PANEL)
    assert np.array_equal(CD.unpack(wp, n), w)
    assert not wp[-1, :, n - (wp.shape[0] - 1) * CD.PANEL:].any()


@compiler
@pytest.mark.parametrize("m,k,n", [(1, 64, 96), (3, 37, 45), (7, 576, 300), (12, 48, 256), (13, 130, 17),
                                   (40, 200, 1030)])
def test_packed_kernel_matches_float64_reference(m, k, n):
    """Column tails inside a panel, row counts below, at and above the 12 rows a panel pass holds, any K."""
    rng = np.random.default_rng(m * 1000 + k + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    f = jax.jit(CD.packed_dot, static_argnums=2)
    assert CD.PACKED_TARGET in f.lower(jnp.asarray(x), CD.pack(jnp.asarray(w)), n).as_text()
    y = np.asarray(f(jnp.asarray(x), CD.pack(jnp.asarray(w)), n))
    ref = x.astype(np.float64) @ w.astype(np.float64)
    bound = 4 * k * np.finfo(np.float32).eps * (np.abs(x) @ np.abs(w))
    assert y.shape == (m, n)
    assert np.all(np.abs(y - ref) <= bound + 1e-30)


@compiler
def test_a_packed_row_does_not_depend_on_its_neighbours():
    """Each row of a 30-row call (three panel passes) equals the row alone and in a 5-row call, bit for bit: a
    verified token's product is the AR step's."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((30, 576)).astype(np.float32))
    wp = CD.pack(jnp.asarray(rng.standard_normal((576, 1000)).astype(np.float32)))
    f = jax.jit(CD.packed_dot, static_argnums=2)
    full = np.asarray(f(x, wp, 1000))
    for i in (0, 11, 12, 29):
        np.testing.assert_array_equal(np.asarray(f(x[i:i + 1], wp, 1000))[0], full[i])
    np.testing.assert_array_equal(np.asarray(f(x[3:8], wp, 1000)), full[3:8])


def test_packed_dot_gradients_vmap_and_bad_operands():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((3, 40)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal((40, 24)).astype(np.float32))
    wp = CD.pack(w)
    loss = lambda x, wp: jnp.sum(jnp.sin(CD.packed_dot(x, wp, 24)))  # noqa: E731
    gx, gwp = jax.grad(loss, (0, 1))(x, wp)
    rx, rw = jax.grad(lambda x, w: jnp.sum(jnp.sin(x @ w)), (0, 1))(x, w)
    np.testing.assert_allclose(gx, rx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(CD.unpack(gwp, 24), rw, rtol=1e-5, atol=1e-5)
    xs = jnp.stack([x, 2 * x])
    np.testing.assert_allclose(jax.vmap(CD.packed_dot, (0, None, None))(xs, wp, 24), jnp.einsum("bmk,kn->bmn", xs, w),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="do not contract"):
        CD.packed_dot(jnp.ones((2, 8)), wp, 24)
    with pytest.raises(ValueError, match="cannot hold 40 columns"):
        CD.packed_dot(x, wp, 40)
    pw = PK.PackedWeight.of(w)
    with pytest.raises(ValueError, match="row products"):
        LY.weight_dot("btd,vd->btv", x[None], pw)


def test_the_layout_converts_both_ways_and_saves_as_checkpoints_do(pair, tmp_path):
    target, _ = pair
    p = ports.pack_weights(target)
    assert PK.is_packed(p) and not PK.is_packed(target)
    assert isinstance(p.params["layers"][0]["wqkv"], PK.PackedWeight)
    assert p.params["layers"][0]["wqkv"].shape == target.params["layers"][0]["wqkv"].shape
    assert isinstance(p.params[PK.UNEMBED], PK.PackedWeight)  # the tied embedding, as the LM head
    same(ports.unpack_weights(p).params, target.params)
    assert ports.pack_weights(p) is p
    ports.save_hf(p, str(tmp_path / "hf"))
    ports.save(p, str(tmp_path / "orbax"))
    for loaded in (ports.load(str(tmp_path / "orbax")), ports.load_hf(str(tmp_path / "hf"))):
        assert PK.is_packed(loaded)  # with the kernels on, every loader packs
        same(ports.unpack_weights(loaded).params, target.params)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(cpu.SWITCH, "0")
        same(ports.load_hf(str(tmp_path / "hf")).params, target.params)  # off: the plain layout
    sp = ports.pack_weights(SC.scan_layers(target))  # stacked layers pack per layer; scanning a packed model too
    same(ports.unpack_weights(sp).params, SC.scan_layers(target).params)
    same(SC.scan_layers(p).params, sp.params)


def test_packed_logits_match_the_plain_model(pair):
    """A prefill into an empty cache, then a 3-token tree verify with hidden states and a deferred write: the plain
    model's logits, hidden states and new cache rows, to float32 rounding (the products sum in another order)."""
    target, _ = pair
    toks = jnp.asarray(np.stack([PROMPTS[1][:9], PROMPTS[2][:9]]).astype(np.int32))
    np.testing.assert_allclose(ports.logits(ports.pack_weights(target), toks), ports.logits(target, toks),
                               rtol=2e-5, atol=2e-5)
    layers, kvh, hd = target.kv_layout
    fwd = jax.jit(lambda m, *a, **kw: m.forward(*a, **kw), static_argnames=("fresh", "hidden_layers",
                                                                           "defer_writes"))

    def run(model):
        cache = kvc.init_cache(layers, 2, kvh, 24, hd, target.dtype)
        out = fwd(model, toks, jnp.broadcast_to(jnp.arange(9), (2, 9)), cache, fresh=True, hidden_layers=(1,))
        cache = kvc.commit(out.cache, jnp.array([9, 6]))
        pos = kvc.positions(cache, jnp.broadcast_to(jnp.arange(3), (2, 3)))
        tree = jnp.asarray([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]] * 2, bool)
        ver = fwd(model, toks[:, :3], pos, cache, tree, hidden_layers=(1,), defer_writes=True)
        return out.logits, out.hidden, ver.logits, ver.hidden, ver.pending

    for a, b in zip(jax.tree.leaves(run(ports.pack_weights(target))), jax.tree.leaves(run(target))):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("name", ["prompt_lookup", "chain", "eagle_head"])
def test_a_packed_target_decodes_ar_tokens(pair, name):
    """Greedy speculative decoding over the packed target gives the packed target's AR tokens (its verify rows are
    its AR steps bit for bit), in a ragged batch, with a packed draft too."""
    target, draft = pair
    p = ports.pack_weights(target)
    kw = dict(max_new_tokens=12, eos_token_id=())
    ar = jspec.decode(p, PROMPTS, jspec.AR(), **kw)
    for d in (draft, ports.pack_weights(draft)):
        sd = jspec.decode(p, PROMPTS, REGISTRY[name].make(p, d), **kw)
        assert np.array_equal(np.asarray(ar.tokens), np.asarray(sd.tokens)), name


def test_a_packed_model_shards_as_its_plain_one(pair):
    target, _ = pair
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    same(SH.shard(ports.pack_weights(target), mesh).params, SH.shard(target, mesh).params)


def test_a_packed_vlm_gives_the_plain_models_logits():
    """A LLaVA target packs its language model (the vision tower stays as it is): the same logits as the plain
    model, a decode's first token, and it unpacks to the same params."""
    from sampling_check import IMAGE_PROMPT, PIXELS, tiny_llava

    vlm = tiny_llava(10, 0.4)
    p = ports.pack_weights(vlm)
    assert PK.is_packed(p) and isinstance(p.params["lm"][PK.UNEMBED], PK.PackedWeight)
    prompt = {"input_ids": IMAGE_PROMPT[None], "pixel_values": PIXELS[:1]}
    np.testing.assert_allclose(ports.logits(p, prompt), ports.logits(vlm, prompt), rtol=2e-5, atol=2e-5)
    last = np.sort(np.asarray(ports.logits(vlm, prompt))[0, -1])
    out = jspec.decode(p, prompt, None, max_new_tokens=8, eos_token_id=())
    ref = jspec.decode(vlm, prompt, None, max_new_tokens=8, eos_token_id=())
    if last[-1] - last[-2] > 1e-3:  # not a near-tie: the first token is the plain model's
        assert np.asarray(out.tokens)[0, 0] == np.asarray(ref.tokens)[0, 0]
    same(ports.unpack_weights(p).params, vlm.params)


def test_a_packed_eagle3_head_drafts_as_the_plain_one(pair, tmp_path):
    """An EAGLE-3 head packed like its target (fc, its layer, its LM head): the plain head's draft logits to
    float32 rounding, greedy decoding equal to AR, loaded packed beside a packed target, saved plain."""
    from jspec.parts.drafters import eagle3 as E3
    from jspec.parts.drafters import eagle3_io as IO3
    from strategies import eagle3_head

    target, _ = pair
    p = ports.pack_weights(target)
    head = eagle3_head(target)
    packed = head.packed()
    assert isinstance(packed.params["fc"], PK.PackedWeight) and PK.UNEMBED in packed.params
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, target.config.hidden_size)), jnp.float32)
    np.testing.assert_allclose(E3.draft_logits(packed, x), E3.draft_logits(head, x), rtol=2e-5, atol=2e-5)
    kw = dict(max_new_tokens=12, eos_token_id=())
    ar = jspec.decode(p, PROMPTS, jspec.AR(), **kw)
    sd = jspec.decode(p, PROMPTS, jspec.Eagle3(packed, tree="chain", depth=3), **kw)
    np.testing.assert_array_equal(np.asarray(sd.tokens), np.asarray(ar.tokens))
    IO3.save_head(packed, str(tmp_path / "h"), target=target)
    loaded = IO3.load_head(str(tmp_path / "h"), target)
    assert not PK.is_packed(SimpleNamespace(params=loaded.params))
    same(loaded.params, head.params)
    assert PK.UNEMBED in IO3.load_head(str(tmp_path / "h"), p).params  # beside a packed target it comes packed
