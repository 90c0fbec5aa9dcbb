"""Mistral as a LLaMA-family text model, with sliding-window attention: a query sees the last `sliding_window`
tokens of its own sequence, itself included (transformers' `sliding_window_overlay`: kv_idx > q_idx - window).

Checked against transformers: the window's off-by-one on a tree's ancestors (no models); logits of tiny random
`MistralForCausalLM`s (window shorter than the prompt, and `sliding_window: null`) and the save_hf round trip; greedy
AR == transformers' generate on a ragged batch; greedy Chain / Tree SD == AR with a Mistral draft (the verify
forward's window over the cached prefix and the tree's ancestors); the blockwise and fused prefill paths; LLaVA-NeXT
and LLaVA-NeXT-Video on a Mistral language model; the real LLaVA-NeXT-Video-7B (Mistral-7B-Instruct-v0.2) config.
Each comparison also checks that the window changes the result there, so that ignoring it would fail."""
import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import jspec
import ports
from jspec.core import prefill as PR
from ports.core import blockwise as BW
from ports.core import cache as kvc
from ports.core import layers as LY
from ports.families import llava_next as NX
from conftest import assert_masked_parity, hf_greedy, hf_logits, perturb, save_and_load
from tolerances import assert_clear_margins, assert_layout_close

W = 5  # the window of the tiny models: shorter than every prompt here
REAL = (Path(__file__).resolve().parent.parent.parent / "shared" / "real_layouts"
        / "Mayursoni08__LLaVA-NeXT-Video-7B-32K-finetune-bnb4")


def tiny_mistral(seed: int, window: int | None = W, **over):
    torch.manual_seed(seed)
    base = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=101, initializer_range=0.25, max_position_embeddings=256,
                bos_token_id=None, eos_token_id=None, pad_token_id=None, sliding_window=window)
    base.update(over)
    return transformers.MistralForCausalLM(transformers.MistralConfig(**base)).eval()


def with_window(model, window):
    """`model` (a text model or a LLaVA one) with its language model's sliding_window replaced."""
    cfg = model.config
    if hasattr(cfg, "text"):
        cfg = dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, sliding_window=window))
    else:
        cfg = dataclasses.replace(cfg, sliding_window=window)
    return ports.Model(cfg, model.params)


def close(ours, ref) -> bool:
    return float(np.abs(ours - ref).max()) < 1e-4 * max(1.0, float(np.abs(ref).max()))


# ------------------------------------------------------------------------------------------ the mask (no models)


def test_window_counts_a_tree_nodes_ancestors_as_transformers_counts_positions():
    """Over a committed prefix and a tree of new tokens (siblings between a node and its ancestors in the scratch
    slots), `layers.windowed` keeps key k for query q exactly when q - window < k <= q in sequence positions
    (slot j for a committed key, length + depth for a tree node), for windows 1..9; `Deferred` the same."""
    parent = [-1, 0, 0, 1, 1, 2, 3, 3, 5, 6, 8]  # BFS order: parents precede children
    depth = [0]
    for p in parent[1:]:
        depth.append(depth[p] + 1)
    T = len(parent)
    anc = np.eye(T, dtype=bool)
    for i in range(T):
        p = parent[i]
        while p >= 0:
            anc[i, p] = True
            p = parent[p]
    B, S = 2, 24
    length, start = jnp.asarray([7, 3]), jnp.asarray([0, 1])
    mask = jnp.asarray(np.broadcast_to(anc, (B, T, T)))
    vis = np.asarray(kvc.visibility(length, S, T, mask, 0, start))
    L = np.asarray(length)
    pos = np.tile(np.arange(S), (B, 1))  # a slot's sequence position: its own for committed slots ...
    for b in range(B):
        pos[b, L[b]:L[b] + T] = L[b] + np.asarray(depth)  # ... and length + depth for a tree node
    q_pos = L[:, None] + np.asarray(depth)[None]  # [B, T]
    cache = kvc.init_cache(1, B, 1, S, 4, jnp.float32).replace(length=length, start=start)
    for w in range(1, 10):
        want = vis & (pos[:, None, :] > q_pos[:, :, None] - w)
        np.testing.assert_array_equal(np.asarray(LY.windowed(jnp.asarray(vis), w)), want, err_msg=f"window {w}")
        d = LY.deferred_visibility(cache, T, mask, w)
        got = np.zeros_like(want)
        for b in range(B):
            got[b, :, :L[b]] = np.asarray(d.old)[b, :, :L[b]]
            got[b, :, L[b]:L[b] + T] = np.asarray(d.new)[b]
        np.testing.assert_array_equal(got, want, err_msg=f"deferred, window {w}")
    # with the window counted in slots (not along the tree), deep nodes would lose their prefix: the test can fail
    slots = np.arange(S)[None, None, :] > (L[:, None, None] + np.arange(T)[None, :, None]) - 4
    assert not np.array_equal(vis & slots, vis & (pos[:, None, :] > q_pos[:, :, None] - 4))
    assert LY.attention_window(ports.TextConfig("mistral", 10, 8, 8, 1, 2, 2, 4, sliding_window=S), S) is None
    np.testing.assert_array_equal(np.asarray(LY.windowed(jnp.asarray(vis), None)), vis)
    assert LY.attention_window(object(), S) is None  # a config without the field (Chameleon's, a head's)


# ------------------------------------------------------------------------------------------ text model vs HF


@pytest.mark.parametrize("case", ["window", "window_eager_head_dim", "null"])
def test_logits_match_transformers(case, tmp_path):
    """ports.load_hf of a MistralForCausalLM checkpoint gives transformers' logits on a 17-token prompt, with a
    window of 5 (SDPA, and eager with an explicit head_dim) and with `sliding_window: null`. The window's
    off-by-one is pinned: windows 4, 6 and none all give other logits."""
    window = None if case == "null" else W
    over = dict(head_dim=24) if "head_dim" in case else {}
    hf = tiny_mistral(3, window, **over)
    if "eager" in case:
        hf.set_attn_implementation("eager")
    model = save_and_load(hf, tmp_path)
    assert (model.config.model_type, model.config.sliding_window) == ("mistral", window)
    assert model.config.head_dim == over.get("head_dim", 16) and not model.config.qkv_bias
    tokens = np.random.default_rng(0).integers(0, 101, (2, 17))
    ref = hf_logits(hf, tokens)
    assert close(ports.logits(model, tokens), ref) and np.abs(ref).max() > 0.1
    for other in ((W - 1, W + 1, None) if window else (W,)):
        assert not close(ports.logits(with_window(model, other), tokens), ref), other


def test_save_hf_writes_mistral_with_its_window(tmp_path):
    """save_hf of a model without its source config.json writes `config_to_hf`'s: model_type mistral,
    MistralForCausalLM and the window, which transformers loads to the same logits."""
    hf = tiny_mistral(4)
    model = with_window(save_and_load(hf, tmp_path / "in"), W)  # a Model without hf_config
    ports.save_hf(model, str(tmp_path / "out"))
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (cfg["model_type"], cfg["architectures"], cfg["sliding_window"]) == ("mistral", ["MistralForCausalLM"], W)
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert type(back).__name__ == "MistralForCausalLM" and back.config.sliding_window == W
    tokens = np.random.default_rng(1).integers(0, 101, (1, 13))
    np.testing.assert_allclose(hf_logits(back, tokens), hf_logits(hf, tokens), atol=1e-6)
    assert ports.load_hf(str(tmp_path / "out")).config == model.config
    null = ports.TextConfig("mistral", 10, 8, 8, 1, 2, 2, 4)
    assert ports.text_config_to_hf(null)["sliding_window"] is None
    assert ports.core.config.text_config_from_hf(ports.text_config_to_hf(null)) == null


def test_greedy_decode_equals_transformers_generate(tmp_path):
    """A ragged batch of 2 (17 and 9 tokens, 12 new, window 5): each row's tokens are transformers' cached greedy
    generate's (its sliding-window cache); without the window they differ."""
    hf = tiny_mistral(5, initializer_range=0.3)
    model = save_and_load(hf, tmp_path)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 101, n) for n in (17, 9)]
    out = jspec.decode(model, prompts, max_new_tokens=12, eos_token_id=())
    assert_clear_margins(model, prompts, out.tokens)
    for b, p in enumerate(prompts):
        np.testing.assert_array_equal(out.tokens[b], hf_greedy(hf, p, 12), err_msg=f"row {b}")
    free = jspec.decode(with_window(model, None), prompts, max_new_tokens=12, eos_token_id=())
    assert not np.array_equal(free.tokens, out.tokens)


# ------------------------------------------------------------------------------------------ SD == AR


CFG = ports.TextConfig(model_type="mistral", vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=3,
                       num_heads=4, num_kv_heads=2, head_dim=16, sliding_window=4)
PROMPTS = [np.arange(5) % 97, (np.arange(14) * 7) % 97, (np.arange(9) * 3 + 1) % 97]


@pytest.fixture(scope="module")
def pair():
    """(target, draft): a 3-layer Mistral (window 4) and its first layer as the draft (tests/tiny_pairs.py's way)."""
    target = ports.random_model(CFG, key=0, std=0.3)
    for layer in target.params["layers"][1:]:
        layer["wo"] = layer["wo"] * 0.3
        layer["w_down"] = layer["w_down"] * 0.3
    draft = ports.Model(dataclasses.replace(CFG, num_layers=1), {**target.params, "layers": target.params["layers"][:1]})
    return target, draft


def test_greedy_sd_equals_ar_with_a_window(pair):
    """Chain (gamma 3) and a static tree (mc_sim_7b_63: depth 5 > window 4, so deep nodes see only ancestors) with
    the Mistral draft, and a tree drafted by the target itself (every node accepted: each depth's verify logits
    are AR's): AR's tokens on a ragged batch of 3."""
    target, draft = pair
    ar = jspec.decode(target, PROMPTS, max_new_tokens=20, eos_token_id=())
    # without the window, greedy AR would leave these tokens: its teacher-forced argmax differs from them somewhere
    seqs = [np.concatenate([p, ar.tokens[b]]) for b, p in enumerate(PROMPTS)]
    free = ports.logits(with_window(target, None), np.stack([np.pad(x, (0, 34 - len(x))) for x in seqs]))
    assert any(np.any(free[b, len(p) - 1:len(p) + 19].argmax(-1) != ar.tokens[b]) for b, p in enumerate(PROMPTS))
    for name, strat in (("chain", jspec.Chain(draft, gamma=3)), ("tree", jspec.Tree(draft, tree="mc_sim_7b_63")),
                        ("self_tree", jspec.Tree(target, tree="mc_sim_7b_63"))):
        sd = jspec.decode(target, PROMPTS, strategy=strat, max_new_tokens=20, eos_token_id=())
        np.testing.assert_array_equal(sd.tokens, ar.tokens, err_msg=name)
        assert np.all(sd.stats["mean_accepted"] > (3.0 if name == "self_tree" else 1.0)), (name, sd.stats)


def test_deferred_verify_forward_equals_the_written_one(pair):
    """A tree verify with `defer_writes` (the engine's sized verify) under the window: the same logits as the
    forward that writes into the cache."""
    target, _ = pair
    tokens = jnp.asarray(np.stack([np.arange(8, 20), np.arange(30, 42)]) % 97, jnp.int32)
    cache = jax.jit(lambda m: PR.prefill(m, tokens, jnp.asarray([12, 7]), PR.new_cache_for(m, 2, 32))[2])(target)
    parent = [-1, 0, 0, 1, 2, 3, 4, 6]
    anc = np.eye(8, dtype=bool)
    depth = np.zeros(8, np.int32)
    for i in range(1, 8):
        anc[i] = anc[parent[i]] | anc[i]
        depth[i] = depth[parent[i]] + 1
    mask = jnp.asarray(np.broadcast_to(anc, (2, 8, 8)))
    new = jnp.asarray(np.arange(50, 66).reshape(2, 8) % 97, jnp.int32)
    pos = kvc.positions(cache, jnp.broadcast_to(jnp.asarray(depth), (2, 8)))
    verify = jax.jit(lambda m, cache, defer: m.forward(new, pos, cache, mask, defer_writes=defer).logits,
                     static_argnums=2)
    written = verify(target, cache, False)
    assert_layout_close(verify(target, cache, True), written, reduction=64, depth=3)
    assert not close(np.asarray(verify(with_window(target, None), cache, False)), np.asarray(written))


# ------------------------------------------------------------------------------------------ blockwise and fused


@pytest.mark.parametrize("window", [1, 13, 40])
def test_blockwise_attention_with_a_window_equals_direct(window):
    """`blockwise.causal_attention` (fresh, ragged starts) and `prefix_attention` (a chunk after cached slots) with
    small blocks and a window below, across and above a block: the direct path's outputs and scores under
    `layers.windowed`."""
    rng = np.random.default_rng(window)
    B, T, H, KVH, Dh = 3, 70, 4, 2, 8
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, h, Dh)), jnp.float32) for h in (H, KVH, KVH))
    start = jnp.asarray([0, 5, 23])
    w = np.zeros((B, T), np.float32)
    w[:, -7:] = 1 / 7
    vis = kvc.visibility(jnp.zeros((B,), jnp.int32), T, T, None, 0, start)
    ref, ref_s = LY.attention(q, LY.kv_rows(k), LY.kv_rows(v), LY.windowed(vis, window), jnp.asarray(w))
    out, s = BW.causal_attention(q, k, v, start, jnp.asarray(w), q_block=16, k_block=12, window=window)
    seen = np.arange(T)[None] >= np.asarray(start)[:, None]
    np.testing.assert_allclose(np.asarray(out)[seen], np.asarray(ref)[seen], atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(s), np.asarray(ref_s), atol=1e-8, rtol=1e-5)
    plain = np.asarray(BW.causal_attention(q, k, v, start, q_block=16, k_block=12))
    assert np.abs(plain[seen] - np.asarray(ref)[seen]).max() > 1e-3  # the window changes the result

    S = 150
    kb, vb = (jnp.asarray(rng.normal(size=(B * KVH, S, Dh)), jnp.float32) for _ in range(2))
    length = jnp.asarray([0, 17, S - T - 5])
    vis = kvc.visibility(length, S, T, None, 0, start)
    ref, ref_s = LY.attention(q, kb, vb, LY.windowed(vis, window), jnp.asarray(w))
    out, s = BW.prefix_attention(q, kb, vb, start, length, jnp.asarray(w), q_block=16, k_block=12, window=window)
    seen = np.asarray(length)[:, None] + np.arange(T)[None] >= np.asarray(start)[:, None]
    np.testing.assert_allclose(np.asarray(out)[seen], np.asarray(ref)[seen], atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(s), np.asarray(ref_s), atol=1e-8, rtol=1e-5)


def test_fused_attention_takes_the_window(monkeypatch):
    """`jax.nn.dot_product_attention` (XLA's implementation, standing in for cuDNN's) is asked for
    local_window_size (window - 1, 0) and gives the blockwise pass's result."""
    rng = np.random.default_rng(3)
    B, T, H, KVH, Dh = 2, 60, 4, 2, 8
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, h, Dh)), jnp.float32) for h in (H, KVH, KVH))
    zero = jnp.zeros((B,), jnp.int32)
    monkeypatch.setattr(BW, "FUSED", "off")
    want = np.asarray(BW.causal_attention(q, k, v, zero, q_block=16, k_block=16, window=W))
    calls, real = [], jax.nn.dot_product_attention
    monkeypatch.setattr(jax.nn, "dot_product_attention", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    monkeypatch.setattr(BW, "FUSED", "xla")
    got = np.asarray(BW.causal_attention(q, k, v, zero, q_block=16, k_block=16, window=W))
    assert calls and all(c["local_window_size"] == (W - 1, 0) for c in calls)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)
    assert np.abs(np.asarray(BW.causal_attention(q, k, v, zero)) - want).max() > 1e-3


def test_blockwise_and_chunked_prefill_equal_the_direct_path(pair, monkeypatch):
    """The Mistral target's prefill of a ragged batch with the blockwise path forced (`Causal`), and in chunks of 8
    attending blockwise (`Prefix`): the direct path's last-token logits and cache."""
    target, _ = pair
    rng = np.random.default_rng(4)
    lengths = np.array([30, 19, 26], np.int32)
    tokens = np.zeros((3, 30), np.int32)
    for b, n in enumerate(lengths):
        tokens[b, :n] = rng.integers(0, 97, n)

    def run(model, chunk=None):
        @jax.jit
        def go(model, tokens, lengths):  # traced afresh: the attention path is picked as it traces
            cache = PR.new_cache_for(model, 3, 40)
            logits, _, cache = PR.prefill(model, tokens, lengths, cache, chunk=chunk)
            return logits, cache.k
        return go(model, jnp.asarray(tokens), jnp.asarray(lengths))

    ref_logits, ref_k = run(target)
    free_logits, _ = run(with_window(target, None))
    assert not close(np.asarray(free_logits), np.asarray(ref_logits))
    monkeypatch.setattr(LY, "BLOCKWISE_MIN", 8)
    for chunk in (None, 8):
        logits, ks = run(target, chunk)
        assert_layout_close(logits, ref_logits, reduction=30, depth=3, err_msg=f"chunk {chunk}")
        for layer in range(3):
            for b, n in enumerate(lengths):
                rows = slice(2 * b, 2 * b + 2)
                np.testing.assert_allclose(np.asarray(ks[layer])[rows, :n], np.asarray(ref_k[layer])[rows, :n],
                                           atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------ LLaVA-NeXT(-Video)


def mistral_text(hidden: int = 48, window: int = 8):
    return transformers.MistralConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                      max_position_embeddings=512, initializer_range=0.2, bos_token_id=None,
                                      eos_token_id=None, pad_token_id=None, sliding_window=window)


@pytest.mark.parametrize("kind", ["next", "next_video"])
def test_llava_next_on_mistral_matches_transformers(kind, tmp_path):
    """LLaVA-NeXT (an anyres image) and LLaVA-NeXT-Video (a 3-frame video) with a Mistral language model whose
    window (8) is far shorter than the prompt: transformers' logits on a ragged batch; without the window,
    others. save_hf writes the text config back as Mistral's."""
    import test_llava_next as LN
    import test_llava_next_video as LNV

    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                           num_attention_heads=4, image_size=28, patch_size=7)
    torch.manual_seed(7)
    if kind == "next":
        cfg = transformers.LlavaNextConfig(vision_config=vision, text_config=mistral_text(), image_token_index=LN.IMG,
                                           image_grid_pinpoints=LN.NEXT_PIN)
        hf = transformers.LlavaNextForConditionalGeneration(cfg)
        batch = LN.process("next", ["w1 w2 <image> w3 w4", "w5 <image> w6 w7 w8 w9 w10"],
                           [LN.image(40, 90, 1), LN.image(33, 33, 3)])
    else:
        cfg = transformers.LlavaNextVideoConfig(vision_config=vision, text_config=mistral_text(),
                                                image_token_index=LN.IMG, video_token_index=LN.VID,
                                                image_grid_pinpoints=LN.NEXT_PIN)
        hf = transformers.LlavaNextVideoForConditionalGeneration(cfg)
        batch = LNV.nv_batch(["w1 w2 <video> w3 w4 w5", "w6 <video> w7"], frames=3)
    hf = perturb(hf.eval(), 8, scale=0.1)
    model = save_and_load(hf, tmp_path / "in")
    assert (model.config.text.model_type, model.config.text.sliding_window) == ("mistral", 8)
    assert batch["attention_mask"].sum(1).min() > 12  # every row longer than the window
    assert_masked_parity(hf, model, batch, atol=1e-4, rtol=1e-4)
    with pytest.raises(AssertionError):
        assert_masked_parity(hf, with_window(model, None), batch, atol=1e-4, rtol=1e-4)
    ports.save_hf(with_window(model, 8), str(tmp_path / "out"))  # without its source config.json: config_to_hf's
    text = json.loads((tmp_path / "out" / "config.json").read_text())["text_config"]
    assert (text["model_type"], text["architectures"], text["sliding_window"]) == ("mistral", ["MistralForCausalLM"],
                                                                                   8)
    assert transformers.AutoConfig.from_pretrained(str(tmp_path / "out")).text_config.sliding_window == 8
    assert ports.load_hf(str(tmp_path / "out")).config == model.config


# ------------------------------------------------------------------------------------------ configs


def test_real_llava_next_video_mistral_config_parses():
    """The real LLaVA-NeXT-Video-7B-32K config (Mistral-7B-Instruct-v0.2 text model: `sliding_window: null`,
    `head_dim: null`, GQA 32 / 8, rope_theta 1e6) parses as that Mistral, and round trips; a text config that
    leaves sliding_window out takes MistralConfig's default, as transformers does."""
    if not (REAL / "config.json").exists():
        pytest.skip(f"the real layout {REAL.name} is not at {REAL.parent} (the shared folder of real configs)")
    d = json.loads((REAL / "config.json").read_text())
    d.pop("quantization_config", None)  # a bnb-4bit fine-tune's: the architecture is the config's
    cfg = NX.config_from_hf(d)
    t = cfg.text
    assert (t.model_type, t.sliding_window, t.head_dim, t.num_heads, t.num_kv_heads) == ("mistral", None, 128, 32, 8)
    assert (t.hidden_size, t.intermediate_size, t.num_layers, t.vocab_size) == (4096, 14336, 32, 32064)
    assert (t.rope.theta, t.rms_norm_eps, t.max_position_embeddings) == (1e6, 1e-5, 32768)
    assert not (t.qkv_bias or t.o_bias or t.mlp_bias)
    assert (cfg.model_type, cfg.image_token_id, cfg.video_token_id) == ("llava_next_video", 32001, 32000)
    assert NX.config_from_hf(NX.config_to_hf(cfg)) == cfg
    hf_text = transformers.LlavaNextVideoConfig(**d).text_config
    assert hf_text.sliding_window == t.sliding_window and hf_text.head_dim == t.head_dim
    sparse = {k: v for k, v in d["text_config"].items() if k != "sliding_window"}
    assert NX.config_from_hf({**d, "text_config": sparse}).text.sliding_window == \
        transformers.MistralConfig(**sparse).sliding_window == 4096
    windowed = NX.config_from_hf({**d, "text_config": {**d["text_config"], "sliding_window": 4096}})
    assert windowed.text.sliding_window == 4096 and LY.attention_window(windowed.text, 8192) == 4096
    assert LY.attention_window(windowed.text, 4096) is None


def test_bad_windows_are_named():
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="sliding_window must be a positive int"):
            ports.TextConfig("mistral", 10, 8, 8, 1, 2, 2, 4, sliding_window=bad)
