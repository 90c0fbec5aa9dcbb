"""LLaVA-1.5 port: logits parity with transformers (images spliced at prefill), both checkpoint layouts, greedy AR
== HF generate, greedy SD with a VLM draft and with a text-only draft == greedy AR, clear errors on bad inputs."""
import functools
import os

import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

import jspec
import ports
from conftest import eager_attentions, perturb

V = 96
IMG = V - 1  # image placeholder id
PATCHES = 16  # 28 px / patch 7 = 4 x 4 patches; "default" drops CLIP's class token


def tiny_llava(seed: int, layers: int = 2, hidden: int = 48, tower: str = "clip", vision_layers: int = 3):
    text = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
                                    max_position_embeddings=256, initializer_range=0.2,
                                    bos_token_id=None, eos_token_id=None, pad_token_id=None)
    vcls = transformers.CLIPVisionConfig if tower == "clip" else transformers.SiglipVisionConfig
    vision = vcls(hidden_size=32, intermediate_size=48, num_hidden_layers=vision_layers, num_attention_heads=4,
                  image_size=28, patch_size=7)
    cfg = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMG,
                                   vision_feature_layer=-2, vision_feature_select_strategy="default")
    torch.manual_seed(seed)
    return perturb(transformers.LlavaForConditionalGeneration(cfg).eval(), seed + 1, scale=0.1)


@functools.lru_cache(maxsize=None)
def pair(tmp_root: str):
    hf = tiny_llava(0)
    hf.save_pretrained(os.path.join(tmp_root, "target"))
    hf_draft = tiny_llava(5, layers=1, hidden=32, vision_layers=2)
    hf_draft.save_pretrained(os.path.join(tmp_root, "draft"))
    return hf, ports.load_hf(os.path.join(tmp_root, "target")), ports.load_hf(os.path.join(tmp_root, "draft"))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return pair(str(tmp_path_factory.mktemp("llava")))


def image_prompt(n_images: int, seed: int, pre: int = 3, post: int = 4):
    rng = np.random.default_rng(seed)
    ids = [int(x) for x in rng.integers(0, IMG, pre)]
    for _ in range(n_images):
        ids += [IMG] * PATCHES + [int(x) for x in rng.integers(0, IMG, 2)]
    ids += [int(x) for x in rng.integers(0, IMG, post)]
    return np.array(ids), rng.normal(size=(n_images, 3, 28, 28)).astype(np.float32)


def hf_logits(hf, ids, pixels):
    with torch.no_grad():
        kw = {} if pixels is None else {"pixel_values": torch.tensor(pixels)}
        return hf(input_ids=torch.tensor(ids), **kw).logits.numpy()


@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_logits_match_transformers(models, n_images):
    hf, target, _ = models
    ids, pix = image_prompt(n_images, seed=n_images)
    prompt = {"input_ids": ids[None]} | ({"pixel_values": pix} if n_images else {})
    ours = ports.logits(target, prompt)
    np.testing.assert_allclose(ours, hf_logits(hf, ids[None], pix if n_images else None), atol=2e-4, rtol=1e-4)


def test_batch_of_two_with_images(models):
    hf, target, _ = models
    a, pa = image_prompt(1, seed=7)
    b, pb = image_prompt(1, seed=8)
    ids = np.stack([a, b])
    pix = np.concatenate([pa, pb])
    np.testing.assert_allclose(ports.logits(target, {"input_ids": ids, "pixel_values": pix}), hf_logits(hf, ids, pix),
                               atol=2e-4, rtol=1e-4)


def test_config_and_keys(models):
    _, target, draft = models
    cfg = target.config
    assert cfg.model_type == "llava" and cfg.image_token_id == IMG and cfg.tokens_per_image == PATCHES
    assert cfg.vision.model_type == "clip_vision_model" and cfg.vision.num_layers == 3
    assert draft.config.text.num_layers == 1 and draft.config.vision.num_layers == 2


@pytest.mark.parametrize("layout", ["hub", "in_memory"])
def test_other_checkpoint_layouts_load(models, tmp_path, layout):
    hf, target, _ = models
    src = os.path.join(tmp_path, "src")
    hf.save_pretrained(src)
    tensors = safetensors.numpy.load_file(os.path.join(src, "model.safetensors"))
    renamed = {}
    for k, v in tensors.items():
        if layout == "hub":  # older hub checkpoints: the tower under vision_model., plus its position_ids buffer
            k = k.replace("vision_tower.", "vision_tower.vision_model.", 1)
        else:  # transformers-5 module names
            for old, new in (("vision_tower.", "model.vision_tower."),
                             ("multi_modal_projector.", "model.multi_modal_projector."),
                             ("language_model.model.", "model.language_model."),
                             ("language_model.lm_head.", "lm_head.")):
                if k.startswith(old):
                    k = new + k[len(old):]
                    break
        renamed[k] = v
    if layout == "hub":
        renamed["vision_tower.vision_model.embeddings.position_ids"] = np.arange(17)[None]
    os.remove(os.path.join(src, "model.safetensors"))
    safetensors.numpy.save_file(renamed, os.path.join(src, "model.safetensors"))
    loaded = ports.load_hf(src)
    ids, pix = image_prompt(1, seed=1)
    prompt = {"input_ids": ids[None], "pixel_values": pix}
    np.testing.assert_array_equal(ports.logits(loaded, prompt), ports.logits(target, prompt))


def test_save_hf_round_trip(models, tmp_path):
    hf, target, _ = models
    ports.save_hf(target, str(tmp_path / "out"))
    back = transformers.LlavaForConditionalGeneration.from_pretrained(str(tmp_path / "out")).eval()
    ids, pix = image_prompt(2, seed=3)
    np.testing.assert_allclose(hf_logits(back, ids[None], pix), hf_logits(hf, ids[None], pix), atol=1e-5)


def test_greedy_decode_equals_hf_generate(models):
    hf, target, _ = models
    ids, pix = image_prompt(1, seed=11)
    with torch.no_grad():
        ref = hf.generate(input_ids=torch.tensor(ids[None]), pixel_values=torch.tensor(pix), max_new_tokens=12,
                          do_sample=False).numpy()[0, len(ids):]
    out = jspec.decode(target, {"input_ids": ids[None], "pixel_values": pix}, max_new_tokens=12)
    np.testing.assert_array_equal(out.tokens[0], ref)


def test_processor_style_padded_batch(models):
    """Left-padded processor output with an attention_mask: each row equals decoding it alone."""
    _, target, _ = models
    a, pa = image_prompt(1, seed=20, post=6)
    b, pb = image_prompt(1, seed=21, post=1)
    ids = np.zeros((2, len(a)), np.int64)
    mask = np.zeros_like(ids)
    ids[0], mask[0] = a, 1
    ids[1, len(a) - len(b):], mask[1, len(a) - len(b):] = b, 1
    both = jspec.decode(target, {"input_ids": ids, "attention_mask": mask, "pixel_values": np.concatenate([pa, pb])},
                        max_new_tokens=8)
    alone = jspec.decode(target, {"input_ids": b[None], "pixel_values": pb}, max_new_tokens=8)
    np.testing.assert_array_equal(both.tokens[1], alone.tokens[0])


CHAIN, TREE = (lambda d: jspec.Chain(d, gamma=3)), (lambda d: jspec.Tree(d, tree="mc_sim_7b_63"))


@pytest.mark.parametrize("make, draft_kind", [(CHAIN, "vlm"), (CHAIN, "text"),  # trees: test_qwen2_vl (default)
                                              pytest.param(TREE, "vlm", marks=pytest.mark.slow),
                                              pytest.param(TREE, "text", marks=pytest.mark.slow)],
                         ids=["chain-vlm", "chain-text", "tree-vlm", "tree-text"])
def test_greedy_sd_with_vlm_target_equals_ar(models, draft_kind, make):
    _, target, draft = models
    if draft_kind == "text":  # the VLM draft's language model alone: it reads the prompt without image tokens
        draft = ports.Model(draft.config.text, draft.params["lm"])
    a, pa = image_prompt(1, seed=30)
    b, pb = image_prompt(2, seed=31, post=2)
    batch = {"input_ids": [a, b], "pixel_values": np.concatenate([pa, pb])}
    ar = jspec.decode(target, batch, max_new_tokens=14)
    sd = jspec.decode(target, batch, strategy=make(draft), max_new_tokens=14)
    np.testing.assert_array_equal(sd.tokens, ar.tokens)
    alone = jspec.decode(target, {"input_ids": b[None], "pixel_values": pb}, strategy=make(draft), max_new_tokens=14)
    np.testing.assert_array_equal(alone.tokens[0], ar.tokens[1])


@pytest.mark.slow  # SAGE over LLaVA-1.5 runs by default in tests/test_specvlm.py (zoo pair, pruned images)
def test_greedy_sage_with_vlm_target_equals_ar(models):
    """SAGE's per-row re-planned trees with a LLaVA-1.5 target and draft on a ragged two-image batch."""
    _, target, draft = models
    a, pa = image_prompt(1, seed=32)
    b, pb = image_prompt(2, seed=33, post=2)
    batch = {"input_ids": [a, b], "pixel_values": np.concatenate([pa, pb])}
    ar = jspec.decode(target, batch, max_new_tokens=14)
    sd = jspec.decode(target, batch, strategy=jspec.SAGE(draft, d_max=5, n_max=30, k=6, w_max=6), max_new_tokens=14)
    np.testing.assert_array_equal(sd.tokens, ar.tokens)


def test_vlm_draft_reads_the_images(models):
    """draft = target: every draft is accepted only if the draft's prefill spliced the same image features."""
    _, target, _ = models
    ids, pix = image_prompt(2, seed=50)
    sd = jspec.decode(target, {"input_ids": ids[None], "pixel_values": pix}, strategy=jspec.Chain(target, gamma=3),
                      max_new_tokens=13)
    np.testing.assert_allclose(sd.stats["acceptance_rate"], 1.0)
    blind = jspec.decode(target, {"input_ids": ids[None], "pixel_values": pix}, strategy=jspec.Chain(target, gamma=3),
                         max_new_tokens=13, draft_prompt={"input_ids": ids[None], "pixel_values": pix[::-1]})
    assert blind.stats["acceptance_rate"][0] < 1.0  # other images for the draft: it disagrees


def test_bad_image_inputs(models):
    _, target, _ = models
    ids, pix = image_prompt(1, seed=40)
    with pytest.raises(ValueError, match="16 image tokens .* but 2 image"):
        jspec.decode(target, {"input_ids": ids[None], "pixel_values": np.concatenate([pix, pix])})
    with pytest.raises(ValueError, match="no pixel_values"):
        jspec.decode(target, {"input_ids": ids[None]})
    with pytest.raises(ValueError, match="28"):
        jspec.decode(target, {"input_ids": ids[None], "pixel_values": pix[:, :, :20, :20]})
    text_only = ports.Model(target.config.text, target.params["lm"])
    with pytest.raises(ValueError, match="takes text only"):
        jspec.decode(text_only, {"input_ids": ids[None], "pixel_values": pix})


def test_attention_score_hook_matches_hf_eager(models):
    """SpecVLM's language-to-vision scores: attention probabilities of the text after the image over every key,
    averaged over layers and heads and over those queries, equal HF's eager attentions."""
    from jspec.core import prefill as PR
    from ports.families import llava

    hf, target, _ = models
    ids, pix = image_prompt(1, seed=60, post=5)
    T = len(ids)
    last_img = int(np.flatnonzero(ids == IMG)[-1])
    queries = (np.arange(T) > last_img).astype(np.float32)
    weights = queries / queries.sum()
    cfg = target.config
    pe = llava.prompt_embeds(cfg, target.params, np.asarray(ids[None], np.int32), {"pixel_values": pix})
    cache = PR.new_cache_for(target, 1, 64)
    fo = target.forward(ids[None], np.arange(T)[None], cache, embeds=pe.embeds, attn_query_weights=weights[None])
    assert fo.attn.shape == (1, 64)
    np.testing.assert_array_equal(np.asarray(pe.image_mask[0]), ids == IMG)  # the image-position hook
    att = eager_attentions(hf, {"input_ids": ids[None], "pixel_values": pix})
    want = att[:, 0].mean(axis=(0, 1))  # [T, T], layers and heads averaged
    want = weights @ want
    np.testing.assert_allclose(np.asarray(fo.attn[0, :T]), want, atol=1e-5)
    assert np.all(np.asarray(fo.attn[0, T:]) == 0)  # unused cache slots get nothing
    np.testing.assert_allclose(float(fo.attn.sum()), 1.0, rtol=1e-5)  # probabilities: each query's row sums to 1


def test_sparse_hub_config_gets_transformers_defaults():
    """llava-hf's llava-1.5-7b config.json omits LLaMA's default fields in text_config: they come from
    transformers' defaults, as LlavaConfig fills them."""
    d = {"model_type": "llava", "text_config": {"model_type": "llama", "vocab_size": 32064},
         "vision_config": {"model_type": "clip_vision_model", "hidden_size": 1024, "image_size": 336,
                           "intermediate_size": 4096, "num_attention_heads": 16, "num_hidden_layers": 24,
                           "patch_size": 14, "projection_dim": 768},
         "image_token_index": 32000, "projector_hidden_act": "gelu"}
    cfg = ports.family("llava").config_from_hf(d)
    ref = transformers.LlavaConfig(**d)
    t = ref.text_config
    assert (cfg.text.hidden_size, cfg.text.num_layers, cfg.text.num_heads, cfg.text.intermediate_size,
            cfg.text.vocab_size, cfg.text.rms_norm_eps) == (t.hidden_size, t.num_hidden_layers, t.num_attention_heads,
                                                            t.intermediate_size, t.vocab_size, t.rms_norm_eps)
    assert cfg.vision.hidden_size == ref.vision_config.hidden_size == 1024
