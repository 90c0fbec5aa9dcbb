"""Qwen3.5 / Qwen3.5-MoE vision-language models (`qwen3_5`, `qwen3_5_moe`) against transformers 5.23: the
interleaved M-RoPE tables over the partial rotary dims, logits parity (text only, one image, a video with per-frame
timestamps, a ragged batch of two) for dense and MoE through `ports.logits` and the prefill (one pass and
chunked), save_hf -> transformers and load_hf round trips, greedy decoding == HF generate, greedy Chain / Tree SD
== AR on image prompts (a Qwen3-VL draft; a text-only draft accepted in part), the checkpoint's own MTP head over
the VLM target (text prompts), prune_prompt, and bad configs refused naming the field before any weight is read.

Images go through transformers' Qwen2-VL image processor and videos are patchified by hand (tests/test_qwen2_vl.py,
tests/test_qwen3_vl.py: HF's video processor imports torchvision); the prompts are Qwen3-VL's (`build`).
"""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import jspec
import ports
from jspec.core import prefill as PR
from jspec.parts.drafters import mtp as MT
from ports.families import qwen3_5_vl as Q5V
from conftest import hf_batch_logits, assert_masked_parity, perturb, saved_and_loaded
import test_qwen2_vl as T2
import test_qwen3_vl as T3

V, IMG, VID = T2.V, T2.IMG, T2.VID
TOKENS = T2.TOKENS
HIDDEN = 64


def text_config(layers=4, section=(2, 1, 1), **kw):
    """A hybrid text config: head_dim 16 with partial_rotary_factor 0.5 (8 rotary dims: frequencies t, h, w, t)."""
    return dict(vocab_size=V, hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8,
                linear_value_head_dim=12, linear_num_key_heads=2, linear_num_value_heads=4,
                max_position_embeddings=512, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                 "mrope_section": list(section), "mrope_interleaved": True}, **kw)


def vision_config(depth=2):
    return dict(depth=depth, hidden_size=32, intermediate_size=40, num_heads=4, patch_size=T2.PATCH,
                out_hidden_size=HIDDEN, num_position_embeddings=16)


def tiny_dense(seed):
    cfg = transformers.Qwen3_5Config(text_config=text_config(intermediate_size=96), vision_config=vision_config(),
                                     **TOKENS)
    torch.manual_seed(seed)
    return perturb(transformers.Qwen3_5ForConditionalGeneration(cfg).eval(), seed + 1, scale=0.1)


def tiny_moe(seed):
    text = text_config(layers=2, layer_types=["linear_attention", "full_attention"], num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=40)
    cfg = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision_config(), **TOKENS)
    torch.manual_seed(seed)
    return perturb(transformers.Qwen3_5MoeForConditionalGeneration(cfg).eval(), seed + 1, scale=0.1)


build = T3.build


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_5_vl")
    return saved_and_loaded({"dense": tiny_dense(0), "moe": tiny_moe(10),
                             "draft": T3.tiny_dense(20, hidden=32, layers=1, depth=1, width=16, deepstack=(0,),
                                                    head_dim=8, section=(2, 1, 1))}, root)


@pytest.fixture(scope="module")
def hf_models(built):
    return built[0]


@pytest.fixture(scope="module")
def jx_models(built):
    return built[1]


# ------------------------------------------------------------------------------------------ no models


def test_partial_interleaved_mrope_matches_transformers():
    """`Q5V.rope` == Qwen3_5TextRotaryEmbedding for distinct (t, h, w) ids (8 rotary dims of a 16-wide head), and
    transformers' attention rotates only those dims (the rest pass through, as `layers.apply_rope` does)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as M

    hf_cfg = transformers.Qwen3_5TextConfig(**text_config(section=(1, 2, 1)))
    pos = np.random.default_rng(0).integers(0, 50, (3, 2, 7))
    cos, sin = M.Qwen3_5TextRotaryEmbedding(hf_cfg)(torch.zeros(1), torch.tensor(pos))
    cfg = Q5V.config_from_hf(transformers.Qwen3_5Config(text_config=hf_cfg.to_dict(),
                                                        vision_config=vision_config()).to_dict())
    assert cfg.mrope_section == (1, 2, 1)
    ours = Q5V.rope(cfg, jnp.asarray(pos))
    assert ours[0].shape == (2, 7, 8)
    np.testing.assert_allclose(np.asarray(ours[0]), cos.numpy(), atol=1e-6)
    np.testing.assert_allclose(np.asarray(ours[1]), sin.numpy(), atol=1e-6)
    q = np.random.default_rng(1).normal(size=(2, 7, 4, 16)).astype(np.float32)
    ref, _ = M.apply_rotary_pos_emb(torch.tensor(q).transpose(1, 2), torch.tensor(q).transpose(1, 2), cos, sin)
    got = ports.core.layers.apply_rope(jnp.asarray(q), *ours)
    np.testing.assert_allclose(np.asarray(got), ref.transpose(1, 2).numpy(), atol=1e-6)
    same = np.broadcast_to(pos[:1], pos.shape)  # equal ids: the text model's plain rotary
    np.testing.assert_allclose(np.asarray(Q5V.rope(cfg, jnp.asarray(same))[0]),
                               np.asarray(Q5V.rope(cfg, jnp.asarray(pos[0]))[0]), atol=1e-6)


# ------------------------------------------------------------------------------------------ logits

CASES = {
    "text_only": lambda: build(["w1 w2 w3 w4 w5 w6 w7"]),
    "image": lambda: build(["w1 <image> w2 w3"], images=[T2.image(40, 90, 1)]),
    "video": lambda: build(["w1 <video> w2 w3"], videos=[T2.frames(6, seed=4)]),
    "batch_of_two": lambda: build(["w1 <image> w2", "w3 w4 <video> w5 <image> w6 w7 w8"],
                                  images=[T2.image(40, 90, 5), T2.image(60, 30, 6)],
                                  videos=[T2.frames(4, 28, 56, seed=7)]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("name", ["dense", "moe"])
def test_logits_match_transformers(hf_models, jx_models, name, case):
    assert_masked_parity(hf_models[name], jx_models[name], CASES[case](), atol=5e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_prefill_matches_transformers_and_mrope_matters(hf_models, jx_models, name):
    """`jspec.core.prefill` (one pass and 16 tokens at a time) gives HF's logits at each row's last prompt token on
    the ragged image + video batch; the same prompt under plain 1-D positions gives other logits, so the
    M-RoPE ids reach the attention layers."""
    hf, model = hf_models[name], jx_models[name]
    batch = CASES["batch_of_two"]()
    ref = hf_batch_logits(hf, batch)
    lengths = batch["attention_mask"].sum(1)
    last = ref[np.arange(len(lengths)), lengths - 1]
    tokens, lens, extra = ports.core.prompts.normalize_prompt(batch, model.vocab_size, pad_to=1)
    inputs = {k: jnp.asarray(v) for k, v in model.family.prepare_inputs(model.config, tokens, lens, extra).items()}
    for chunk in (None, 16):
        cache = PR.new_cache_for(model, tokens.shape[0], tokens.shape[1] + 4)
        logits, _, _ = PR.prefill(model, jnp.asarray(tokens), jnp.asarray(lens), cache, inputs, chunk=chunk)
        np.testing.assert_allclose(np.asarray(logits), last, atol=5e-5, rtol=1e-5)
    pe = model.family.prompt_embeds(model.config, model.params, jnp.asarray(tokens), inputs)
    flat = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    fo = model.forward(jnp.asarray(tokens), flat, PR.new_cache_for(model, tokens.shape[0], tokens.shape[1]),
                       embeds=pe.embeds, fresh=True)
    mask = batch["attention_mask"].astype(bool)
    assert float(np.max(np.abs(np.asarray(fo.logits)[mask] - ref[mask]))) > 1e-3


# ------------------------------------------------------------------------------------------ checkpoints


def jax_leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_save_hf_round_trip(hf_models, jx_models, tmp_path, name):
    """Params and config_to_hf (no stored HF config) back to a checkpoint transformers loads (same logits) and
    load_hf reads back (same config, same params)."""
    m = jx_models[name]
    ports.save_hf(ports.Model(m.config, m.params), str(tmp_path))
    back = type(hf_models[name]).from_pretrained(str(tmp_path)).eval()
    batch = CASES["batch_of_two"]()
    np.testing.assert_allclose(hf_batch_logits(back, batch), hf_batch_logits(hf_models[name], batch), atol=1e-5)
    again = ports.load_hf(str(tmp_path))
    assert again.config == m.config
    for a, b in zip(jax_leaves(again.params), jax_leaves(m.params)):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------------------------------ decoding


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_greedy_decode_equals_hf_generate(hf_models, jx_models, name):
    """Decode steps continue the M-RoPE positions through the cache's pos_offset (rope deltas), as HF does."""
    batch = build(["w3 w1 <image> w2 w7"], images=[T2.image(40, 90, 11)])
    with torch.no_grad():
        ref = hf_models[name].generate(**{k: torch.tensor(v) for k, v in batch.items()}, max_new_tokens=8,
                                       do_sample=False, pad_token_id=0).numpy()[:, batch["input_ids"].shape[1]:]
    out = jspec.decode(jx_models[name], batch, max_new_tokens=8, eos_token_id=())
    np.testing.assert_array_equal(out.tokens[0], ref[0])


def damped(target):
    """`target` with its layers' branches scaled by 0.003 (the image still enters through them), and a one-layer
    text-only Qwen3 draft with the target's embedding, final norm and head whose branches are zeroed (a bigram
    model): the draft agrees with the target often but not always."""
    lm = dict(target.params["lm"])
    lm["layers"] = [{k: (v * 0.003 if k in ("lin_out", "wo", "w_down") else v) for k, v in layer.items()}
                    for layer in lm["layers"]]
    target = ports.Model(target.config, {**target.params, "lm": lm}, target.hf_config)
    cfg = ports.families.qwen3.config_from_hf(dict(model_type="qwen3", vocab_size=V, hidden_size=HIDDEN, intermediate_size=48,
                                          num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                          head_dim=16))
    draft = ports.random_model(cfg, key=1, std=0.3)
    layer = dict(draft.params["layers"][0], wo=draft.params["layers"][0]["wo"] * 0,
                 w_down=draft.params["layers"][0]["w_down"] * 0)
    draft = ports.Model(cfg, {**draft.params, "layers": [layer], "embed": lm["embed"], "lm_head": lm["lm_head"],
                              "final_norm": 1 + lm["final_norm"]})
    return target, draft


def test_greedy_chain_and_tree_sd_equal_ar(jx_models):
    """On a ragged image / video batch, Chain and Tree give greedy AR's tokens: over the Qwen3.5 target with a
    small Qwen3-VL draft (its own tower, DeepStack and M-RoPE sections; it rarely agrees), and over the damped
    target with its bigram text-only draft (the prompt without the placeholders), which accepts drafts in part."""
    batch = build(["w1 <image> w2", "w3 w4 <video> w5 w6"], images=[T2.image(40, 90, 13)],
                  videos=[T2.frames(4, seed=14)])
    target, bigram_target, bigram = jx_models["dense"], *damped(jx_models["dense"])
    for tgt, draft in ((target, jx_models["draft"]), (bigram_target, bigram)):
        ar = jspec.decode(tgt, batch, strategy=jspec.AR(), max_new_tokens=10, eos_token_id=())
        for strategy in (jspec.Chain(draft, gamma=3), jspec.Tree(draft, tree=[[0], [1], [0, 0]])):
            sd = jspec.decode(tgt, batch, strategy=strategy, max_new_tokens=10, eos_token_id=())
            np.testing.assert_array_equal(sd.tokens, ar.tokens)
            if draft is bigram:  # some rounds accept drafts, some reject them
                assert 0 < sd.stats["accepted_drafts"].sum() < sd.stats["drafted"].sum()


def with_mtp_tensors(model, directory, seed: int = 0):
    """save_hf of `model` with one MTP layer in its config and random `mtp.*` tensors beside its own (the layout a
    published Qwen3.5 checkpoint ships); returns the directory's load_hf."""
    from ports.core.hf_layout import ours_shape_to_hf
    from ports.core.param_paths import get_path
    from ports.core.safetensors_io import SafetensorsFile, write_safetensors

    cfg = dataclasses.replace(model.config, text=dataclasses.replace(model.config.text, mtp_layers=1))
    ports.save_hf(ports.Model(cfg, model.params), str(directory))
    path = sorted(directory.glob("*.safetensors"))[0]
    f = SafetensorsFile(str(path))
    tensors = {n: np.asarray(f.get(n)) for n in f.keys()}
    rng = np.random.default_rng(seed)
    shapes = MT.head_shapes(cfg.text, 1)
    for name, at, tr in MT.key_map(cfg.text, 1):
        tensors[name] = rng.normal(0, 0.2, ours_shape_to_hf(tuple(get_path(shapes, at)), tr)).astype(np.float32)
    write_safetensors(str(path), {n: (a.shape, a.dtype) for n, a in tensors.items()}, tensors.__getitem__)
    return ports.load_hf(str(directory))


def bigram_mtp(target):
    """An MTP head whose fc passes the token embedding on and whose layer's branches are zeroed: it drafts the
    damped target's bigram guess, so its drafts are accepted in part."""
    head = MT.init_head(target, jax.random.key(5), scale=0.3)
    layer = dict(head.params["layers"][0])
    layer.update(wo=layer["wo"] * 0, w_down=layer["w_down"] * 0)
    fc = jnp.zeros((2 * HIDDEN, HIDDEN)).at[:HIDDEN].set(jnp.eye(HIDDEN))
    return head.replace(params=dict(head.params, fc=fc, layers=[layer]))


def test_the_mtp_head_drafts_over_a_vision_language_target(jx_models, tmp_path):
    """load_hf of a VLM checkpoint holding `mtp.*` tensors skips them and reads the same params; the MTP head read
    from those tensors drafts for that target
    on a ragged batch of text prompts: its Chain, and the Tree of a head accepted in part, give greedy AR's tokens;
    an image prompt is refused (the head drafts over token prompts only), naming why."""
    prompts = [np.array([5, 9, 3, 7, 21, 4, 8]), np.array([11, 2, 6])]
    target = with_mtp_tensors(jx_models["dense"], tmp_path / "mtp")
    for a, b in zip(jax_leaves(target.params), jax_leaves(jx_models["dense"].params)):
        np.testing.assert_array_equal(a, b)
    head = MT.load_head(str(tmp_path / "mtp"), target)
    assert head.config.num_layers == 1
    damped_target, _ = damped(jx_models["dense"])
    for tgt, strategy in ((target, jspec.Chain(head, gamma=3)),
                          (damped_target, jspec.Tree(bigram_mtp(damped_target), tree=[[0], [1], [0, 0]]))):
        ar = jspec.decode(tgt, prompts, strategy=jspec.AR(), max_new_tokens=10, eos_token_id=())
        sd = jspec.decode(tgt, prompts, strategy=strategy, max_new_tokens=10, eos_token_id=())
        np.testing.assert_array_equal(sd.tokens, ar.tokens)
        if tgt is damped_target:
            assert 0 < sd.stats["accepted_drafts"].sum() < sd.stats["drafted"].sum()
    with pytest.raises(ValueError, match="token prompts only"):
        jspec.decode(target, CASES["image"](), strategy=jspec.Chain(head, gamma=3), max_new_tokens=2)


def test_prune_prompt_keeping_every_vision_token_is_the_prompt(jx_models):
    """`prune_prompt` (Qwen3-VL's layout: videos split per frame) keeping every vision token gives the full
    prompt's logits; keeping 40% gives a shorter prompt holding the kept placeholders only."""
    model = jx_models["moe"]
    row = build(["w3 w4 <video> w5 <image> w6"], images=[T2.image(40, 56, 15)], videos=[T2.frames(4, seed=14)])
    vis = np.isin(row["input_ids"], [IMG, VID])
    whole = Q5V.prune_prompt(model.config, row, np.ones(int(vis.sum()), bool))
    np.testing.assert_allclose(ports.logits(model, whole), ports.logits(model, row), atol=1e-5)
    keep = vis & (np.random.default_rng(2).random(vis.shape) < 0.4)
    pruned = Q5V.prune_prompt(model.config, row, keep)
    assert pruned["vision_keep"].sum() == keep.sum() and pruned["input_ids"].shape[1] < row["input_ids"].shape[1]


# ------------------------------------------------------------------------------------------ errors


def good_config() -> dict:
    return transformers.Qwen3_5Config(text_config=text_config(intermediate_size=96), vision_config=vision_config(),
                                      **TOKENS).to_dict()


BAD = {
    "mrope_interleaved": lambda d: d["text_config"]["rope_parameters"].update(mrope_interleaved=False),
    "mrope_section": lambda d: d["text_config"]["rope_parameters"].update(mrope_section=[2, 2]),
    "rope_type": lambda d: d["text_config"]["rope_parameters"].update(rope_type="dynamic", factor=2.0),
    "layer_types": lambda d: d["text_config"].update(layer_types=["linear_attention"] * 3),
    "linear_num_value_heads": lambda d: d["text_config"].update(linear_num_value_heads=3),
    "num_position_embeddings": lambda d: d["vision_config"].update(num_position_embeddings=0),
    "hidden_act": lambda d: d["vision_config"].update(hidden_act="swish7"),
    "image_token_id": lambda d: d.update(image_token_id="<|image_pad|>"),
}


@pytest.mark.parametrize("field", sorted(BAD))
def test_bad_configs_are_refused_naming_the_field_before_weights(jx_models, tmp_path, field, monkeypatch):
    d = good_config()
    BAD[field](d)
    with pytest.raises(ValueError, match=field):
        Q5V.config_from_hf(d)
    ports.save_hf(jx_models["dense"], str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(d))
    from ports.core import safetensors_io

    def no_read(*a, **k):
        raise AssertionError("a weight was read")
    monkeypatch.setattr(safetensors_io.SafetensorsFile, "get", no_read)
    with pytest.raises(ValueError, match=field):
        ports.load_hf(str(tmp_path))
