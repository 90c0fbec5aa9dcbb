"""Qwen3-VL / Qwen3-VL-MoE ports against transformers 5.23: interleaved M-RoPE tables, logits parity (text only,
one image, two images of different sizes, a video with per-frame timestamps, a ragged batch) through `ports.logits`
and the prefill, DeepStack (shown to matter), save_hf / load_hf round trips that transformers loads, greedy
decoding == HF generate, greedy Chain / Tree SD == AR, and bad configs refused naming the field.

Images go through transformers' Qwen2-VL image processor (the one Qwen3-VL's processor uses); videos are
patchified by hand as in tests/test_qwen2_vl.py (HF's video processor imports torchvision), with the prompt
Qwen3VLProcessor.replace_video_token writes: a timestamp word before each temporal patch group's
<|vision_start|> ... <|vision_end|> run.
"""
import copy
import json

import numpy as np
import pytest
import torch
import transformers

import jax.numpy as jnp
import jspec
import ports
from jspec.core import prefill as PR
from ports.core import layers as LY
from ports.families import qwen3_vl as Q3
from conftest import hf_batch_logits, assert_masked_parity, perturb, saved_and_loaded
import test_qwen2_vl as T2

V, VS, VE, IMG, VID, MERGE = T2.V, T2.VS, T2.VE, T2.IMG, T2.VID, T2.MERGE
TOKENS = T2.TOKENS
TIMESTAMP = "w8"  # the word standing for "<t seconds>" before each frame group


def text_config(hidden=48, layers=3, head_dim=12, section=(2, 2, 2), **kw):
    return dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, head_dim=head_dim, vocab_size=V, max_position_embeddings=512,
                bos_token_id=None, eos_token_id=None, pad_token_id=None,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": list(section),
                                 "mrope_interleaved": True}, **kw)


def vision_config(out=48, depth=3, width=32, deepstack=(0, 1)):
    return dict(depth=depth, hidden_size=width, intermediate_size=40, num_heads=4, patch_size=T2.PATCH,
                out_hidden_size=out, num_position_embeddings=16, deepstack_visual_indexes=list(deepstack))


def tiny_dense(seed, hidden=48, layers=3, depth=3, width=32, deepstack=(0, 1), head_dim=12, section=(2, 2, 2)):
    cfg = transformers.Qwen3VLConfig(text_config=text_config(hidden, layers, head_dim, section),
                                     vision_config=vision_config(hidden, depth, width, deepstack), **TOKENS)
    torch.manual_seed(seed)
    return perturb(transformers.Qwen3VLForConditionalGeneration(cfg).eval(), seed + 1, scale=0.1)


def tiny_moe(seed):
    text = text_config(48, 2, 12, (2, 2, 2), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=20,
                       decoder_sparse_step=1)
    cfg = transformers.Qwen3VLMoeConfig(text_config=text, vision_config=vision_config(48, 2, 32, (1,)), **TOKENS)
    torch.manual_seed(seed)
    return perturb(transformers.Qwen3VLMoeForConditionalGeneration(cfg).eval(), seed + 1, scale=0.1)


def build(texts, images=(), videos=()) -> dict:
    """Processor-style batch from texts with "<image>" / "<video>" markers (right padded)."""
    out = {}
    grids = {"<image>": [], "<video>": []}
    if images:
        ib = T2.processor().image_processor(images=list(images), return_tensors="np")
        out.update(pixel_values=ib["pixel_values"], image_grid_thw=ib["image_grid_thw"])
        grids["<image>"] = list(ib["image_grid_thw"])
    if videos:
        px, gr = zip(*[T2.video_pixels(v) for v in videos])
        out.update(pixel_values_videos=np.concatenate(px), video_grid_thw=np.stack(gr))
        grids["<video>"] = list(gr)
    words_of = {"<image>": lambda g: ["<|vision_start|>" + "<|image_pad|>" * int(np.prod(g) // MERGE ** 2)
                                      + "<|vision_end|>"],
                "<video>": lambda g: [f"{TIMESTAMP} <|vision_start|>" + "<|video_pad|>" * int(g[1] * g[2] // MERGE ** 2)
                                      + "<|vision_end|>" for _ in range(int(g[0]))]}
    expanded = []
    for t in texts:
        words = []
        for w in t.split():
            words += words_of[w](grids[w].pop(0)) if w in words_of else [w]
        expanded.append(" ".join(words))
    enc = T2.tokenizer()(expanded, padding=True, return_tensors="np")
    out.update(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
               mm_token_type_ids=np.array(T2.processor().create_mm_token_type_ids(enc["input_ids"])))
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_vl")
    return saved_and_loaded({"dense": tiny_dense(0), "moe": tiny_moe(10),
                             "draft": tiny_dense(20, hidden=32, layers=1, depth=1, width=16, deepstack=(0,),
                                                 head_dim=8, section=(2, 1, 1))}, root)


@pytest.fixture(scope="module")
def hf_models(built):
    return built[0]


@pytest.fixture(scope="module")
def jx_models(built):
    return built[1]


# ------------------------------------------------------------------------------------------ no models


def test_interleaved_mrope_tables_match_transformers():
    """`mrope_tables(interleaved=True)` == Qwen3VLTextRotaryEmbedding for distinct (t, h, w) ids, with a section
    whose h / w runs stop before the half dimension ends (the tail reads t)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    hf_cfg = transformers.Qwen3VLTextConfig(**text_config(head_dim=16, section=(4, 2, 2)))
    pos = np.random.default_rng(0).integers(0, 50, (3, 2, 7))
    cos, sin = Qwen3VLTextRotaryEmbedding(hf_cfg)(torch.zeros(1), torch.tensor(pos))
    cfg = Q3.config_from_hf(transformers.Qwen3VLConfig(text_config=hf_cfg.to_dict(),
                                                       vision_config=vision_config()).to_dict())
    ours = LY.mrope_tables(cfg.text, jnp.asarray(pos), cfg.mrope_section, interleaved=True)
    np.testing.assert_allclose(np.asarray(ours[0]), cos.numpy(), atol=1e-6)
    np.testing.assert_allclose(np.asarray(ours[1]), sin.numpy(), atol=1e-6)
    plain = LY.mrope_tables(cfg.text, jnp.asarray(pos), cfg.mrope_section)
    assert not np.allclose(np.asarray(plain[0]), cos.numpy(), atol=1e-3)  # the interleaving is what matches


# ------------------------------------------------------------------------------------------ logits

CASES = {
    "text_only": lambda: build(["w1 w2 w3 w4 w5 w6 w7"]),
    "image": lambda: build(["w1 <image> w2 w3"], images=[T2.image(40, 90, 1)]),
    "two_images": lambda: build(["w1 <image> w2 <image> w3"], images=[T2.image(40, 90, 2), T2.image(50, 30, 3)]),
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
def test_prefill_matches_transformers_and_deepstack_matters(hf_models, jx_models, name):
    """`jspec.core.prefill` gives HF's logits at each row's last prompt token on the ragged image + video batch;
    with the DeepStack mergers zeroed HF's logits move far beyond the tolerance, so DeepStack is exercised."""
    hf, model = hf_models[name], jx_models[name]
    batch = CASES["batch_of_two"]()
    ref = hf_batch_logits(hf, batch)
    lengths = batch["attention_mask"].sum(1)
    last = ref[np.arange(len(lengths)), lengths - 1]
    tokens, lens, extra = ports.core.prompts.normalize_prompt(batch, model.vocab_size, pad_to=1)
    inputs = {k: jnp.asarray(v) for k, v in model.family.prepare_inputs(model.config, tokens, lens, extra).items()}
    cache = PR.new_cache_for(model, tokens.shape[0], tokens.shape[1] + 4)
    logits, _, cache = PR.prefill(model, jnp.asarray(tokens), jnp.asarray(lens), cache, inputs)
    np.testing.assert_allclose(np.asarray(logits), last, atol=5e-5, rtol=1e-5)
    chunked, _, _ = PR.prefill(model, jnp.asarray(tokens), jnp.asarray(lens), PR.new_cache_for(
        model, tokens.shape[0], tokens.shape[1] + 4), inputs, chunk=16)
    np.testing.assert_allclose(np.asarray(chunked), last, atol=5e-5, rtol=1e-5)
    flat = copy.deepcopy(hf)
    with torch.no_grad():
        for m in flat.model.visual.deepstack_merger_list:
            m.linear_fc2.weight.zero_()
            m.linear_fc2.bias.zero_()
    mask = batch["attention_mask"].astype(bool)
    assert float(np.max(np.abs(hf_batch_logits(flat, batch)[mask] - ref[mask]))) > 1e-2


# ------------------------------------------------------------------------------------------ checkpoints


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


def jax_leaves(tree):
    import jax
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


# ------------------------------------------------------------------------------------------ decoding


def test_greedy_decode_equals_hf_generate(hf_models, jx_models):
    batch = build(["w3 w1 <image> w2 w7"], images=[T2.image(40, 90, 11)])
    with torch.no_grad():
        ref = hf_models["dense"].generate(**{k: torch.tensor(v) for k, v in batch.items()}, max_new_tokens=8,
                                          do_sample=False, pad_token_id=0).numpy()[:, batch["input_ids"].shape[1]:]
    out = jspec.decode(jx_models["dense"], batch, max_new_tokens=8)
    np.testing.assert_array_equal(out.tokens[0], ref[0])


def test_greedy_chain_and_tree_sd_equal_ar(jx_models):
    """A Qwen3-VL target with a smaller Qwen3-VL draft (own tower, own DeepStack, own M-RoPE sections) on a ragged
    image / video batch: Chain and Tree give greedy AR's tokens."""
    target, draft = jx_models["dense"], jx_models["draft"]
    batch = build(["w1 <image> w2", "w3 w4 <video> w5 w6"], images=[T2.image(40, 90, 13)],
                  videos=[T2.frames(4, seed=14)])
    ar = jspec.decode(target, batch, strategy=jspec.AR(), max_new_tokens=10)
    for strategy in (jspec.Chain(draft, gamma=3), jspec.Tree(draft, tree=T2.SMALL_TREE)):
        sd = jspec.decode(target, batch, strategy=strategy, max_new_tokens=10)
        np.testing.assert_array_equal(sd.tokens, ar.tokens)


def test_pruned_draft_prompts(jx_models):
    """`prune_prompt` keeping every vision token gives the full prompt's logits (videos split per frame, DeepStack
    rows followed); a SpecVLM-style draft prefilled on 40% of the vision tokens keeps greedy Tree SD == AR."""
    target, draft = jx_models["dense"], jx_models["draft"]
    batch = build(["w1 <image> w2", "w3 w4 <video> w5 w6"], images=[T2.image(40, 90, 13)],
                  videos=[T2.frames(4, seed=14)])
    vis = np.isin(batch["input_ids"], [IMG, VID]) & batch["attention_mask"].astype(bool)
    row = build(["w3 w4 <video> w5 w6"], videos=[T2.frames(4, seed=14)])
    whole = Q3.prune_prompt(draft.config, row, np.ones(int(vis[1].sum()), bool))
    np.testing.assert_allclose(ports.logits(draft, whole), ports.logits(draft, row), atol=1e-5)
    keep = vis & (np.random.default_rng(2).random(vis.shape) < 0.4)
    pruned = Q3.prune_prompt(draft.config, batch, keep, positions="original")
    assert pruned["vision_keep"].sum() == keep.sum() and pruned["input_ids"].shape[1] < batch["input_ids"].shape[1]
    ar = jspec.decode(target, batch, strategy=jspec.AR(), max_new_tokens=8)
    sd = jspec.decode(target, batch, strategy=jspec.Tree(draft, tree=T2.SMALL_TREE), max_new_tokens=8,
                      draft_prompt=pruned)
    np.testing.assert_array_equal(sd.tokens, ar.tokens)


# ------------------------------------------------------------------------------------------ errors


def good_config() -> dict:
    return transformers.Qwen3VLConfig(text_config=text_config(), vision_config=vision_config(), **TOKENS).to_dict()


BAD = {
    "mrope_interleaved": lambda d: d["text_config"]["rope_parameters"].update(mrope_interleaved=False),
    "mrope_section": lambda d: d["text_config"]["rope_parameters"].update(mrope_section=[2, 2]),
    "deepstack_visual_indexes": lambda d: d["vision_config"].update(deepstack_visual_indexes=[0, 3]),
    "num_position_embeddings": lambda d: d["vision_config"].update(num_position_embeddings=0),
    "rope_type": lambda d: d["text_config"]["rope_parameters"].update(rope_type="dynamic", factor=2.0),
    "hidden_act": lambda d: d["vision_config"].update(hidden_act="swish7"),
    "image_token_id": lambda d: d.update(image_token_id="<|image_pad|>"),
    "num_key_value_heads": lambda d: d["text_config"].update(num_key_value_heads=3),
}


@pytest.mark.parametrize("field", sorted(BAD))
def test_bad_configs_are_refused_naming_the_field_before_weights(jx_models, tmp_path, field, monkeypatch):
    d = good_config()
    BAD[field](d)
    with pytest.raises(ValueError, match=field):
        Q3.config_from_hf(d)
    ports.save_hf(jx_models["dense"], str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(d))
    from ports.core import safetensors_io

    def no_read(*a, **k):
        raise AssertionError("a weight was read")
    monkeypatch.setattr(safetensors_io.SafetensorsFile, "get", no_read)
    with pytest.raises(ValueError, match=field):
        ports.load_hf(str(tmp_path))


def test_bad_inputs_fail_early(jx_models):
    m = jx_models["dense"]
    batch = build(["w1 <video> w2"], videos=[T2.frames(4, seed=1)])
    with pytest.raises(ValueError, match="second_per_grid_ts"):
        ports.logits(m, {**batch, "second_per_grid_ts": np.ones(1, np.float32)})
    short = dict(batch, input_ids=batch["input_ids"][:, :-3], attention_mask=batch["attention_mask"][:, :-3],
                 mm_token_type_ids=batch["mm_token_type_ids"][:, :-3])
    short["input_ids"][0, -1] = 1
    with pytest.raises(ValueError, match="video tokens"):
        ports.logits(m, short)


def test_moe_experts_load_from_the_published_layout(hf_models, jx_models, tmp_path):
    """The published checkpoints store the fused experts transposed from transformers' in-memory layout
    (gate_up_proj [E, D, 2F], down_proj [E, F, D]); both load to the same params, and a wrong shape is named."""
    from ports.core.safetensors_io import write_safetensors

    hf = hf_models["moe"]
    tensors = {}
    for n, t in hf.state_dict().items():
        a = t.detach().numpy()
        tensors[n] = a.transpose(0, 2, 1).copy() if n.endswith(("experts.gate_up_proj", "experts.down_proj")) else a
    assert tensors["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 48, 40)

    def write(ts, d):
        d.mkdir()
        write_safetensors(str(d / "model.safetensors"), {n: (a.shape, a.dtype) for n, a in ts.items()},
                          ts.__getitem__)
        (d / "config.json").write_text(json.dumps(hf.config.to_dict()))

    write(tensors, tmp_path / "published")
    got = ports.load_hf(str(tmp_path / "published"))
    for a, b in zip(jax_leaves(got.params), jax_leaves(jx_models["moe"].params)):
        np.testing.assert_array_equal(a, b)
    bad = dict(tensors)
    bad["model.language_model.layers.1.mlp.experts.down_proj"] = np.zeros((4, 20, 40), np.float32)
    write(bad, tmp_path / "bad")
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts\.down_proj"):
        ports.load_hf(str(tmp_path / "bad"))
