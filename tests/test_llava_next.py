"""LLaVA-NeXT / LLaVA-OneVision ports: logits parity with transformers on inputs built by the real HF processors
(anyres tiling, unpadding, OneVision's anyres_max_N shrinking, multi-image rows, video, mixed image + video,
batches of differently sized images), both checkpoint layouts, save_hf round trip, greedy AR == HF generate,
greedy Chain SD == AR, the hooks (image positions, per-tile vision features, attention scores), clear errors."""
import dataclasses
import functools
import os

import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
from transformers.models.llava_onevision.image_processing_pil_llava_onevision import LlavaOnevisionImageProcessorPil

import jax
import jspec
import ports
from ports.core import anyres as ANY
from ports.families import llava_next as NX
from conftest import assert_masked_parity, eager_attentions, perturb, saved_and_loaded

V, IMG, VID = 96, 92, 93
# NeXT: CLIP 28 px / patch 7 -> 4 x 4 features per tile ("default" drops the class token).
NEXT_PIN = [[28, 56], [56, 28], [56, 56], [28, 84], [84, 28]]
# OneVision: SigLIP 30 px / patch 6 -> 5 x 5 per tile (videos pool 5 -> 3: a real bilinear mix); anyres_max_2 makes
# images of more than ~2 tiles' worth of features shrink.
OV_PIN = [[30, 30], [30, 60], [60, 30], [60, 60], [30, 90], [90, 30], [60, 90], [90, 60]]
OV_RATIO = "anyres_max_2"


def text_config(kind: str, hidden: int, layers: int):
    cls = transformers.Qwen2Config if kind == "qwen2" else transformers.LlamaConfig
    return cls(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=V, max_position_embeddings=512, initializer_range=0.2,
               bos_token_id=None, eos_token_id=None, pad_token_id=None)


def tiny_next(seed: int, layers: int = 2, hidden: int = 48):
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                           num_attention_heads=4, image_size=28, patch_size=7)
    cfg = transformers.LlavaNextConfig(vision_config=vision, text_config=text_config("llama", hidden, layers),
                                       image_token_index=IMG, image_grid_pinpoints=NEXT_PIN)
    torch.manual_seed(seed)
    return perturb(transformers.LlavaNextForConditionalGeneration(cfg).eval(), seed + 1, scale=0.1)


def tiny_ov(seed: int):
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                             num_attention_heads=4, image_size=30, patch_size=6)
    cfg = transformers.LlavaOnevisionConfig(vision_config=vision, text_config=text_config("qwen2", 48, 2),
                                            image_token_index=IMG, video_token_index=VID, image_grid_pinpoints=OV_PIN,
                                            vision_aspect_ratio=OV_RATIO)
    torch.manual_seed(seed)
    return perturb(transformers.LlavaOnevisionForConditionalGeneration(cfg).eval(), seed + 1, scale=0.1)


def tiny_llava15(seed: int):
    """A LLaVA-1.5 draft with the NeXT tower's geometry (16 features per image)."""
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                           num_attention_heads=4, image_size=28, patch_size=7)
    cfg = transformers.LlavaConfig(vision_config=vision, text_config=text_config("llama", 32, 1),
                                   image_token_index=IMG)
    torch.manual_seed(seed)
    return perturb(transformers.LlavaForConditionalGeneration(cfg).eval(), seed + 1, scale=0.1)


@functools.lru_cache(maxsize=None)
def tokenizer():
    """A word-level tokenizer: "w0".."w89" -> 0..89, <unk> 90, <pad> 91, <image> 92, <video> 93."""
    vocab = {f"w{i}": i for i in range(90)} | {"<unk>": 90, "<pad>": 91, "<image>": IMG, "<video>": VID}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>")
    fast.add_special_tokens({"additional_special_tokens": ["<image>", "<video>"]})
    return fast


class _OVProcessor(transformers.LlavaOnevisionProcessor):
    """LlavaOnevisionProcessor without a video processor (HF's needs torchvision, absent here): video inputs are
    built by hand, their token count by the processor's own `_get_num_multimodal_tokens`."""

    def check_argument_for_proper_class(self, name, arg):
        return None if arg is None else super().check_argument_for_proper_class(name, arg)


@functools.lru_cache(maxsize=None)
def processor(kind: str):
    if kind == "next":
        ip = LlavaNextImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                                        image_grid_pinpoints=NEXT_PIN)
        return transformers.LlavaNextProcessor(image_processor=ip, tokenizer=tokenizer(), patch_size=7,
                                               vision_feature_select_strategy="default",
                                               num_additional_image_tokens=1)
    ip = LlavaOnevisionImageProcessorPil(size={"height": 30, "width": 30}, image_grid_pinpoints=OV_PIN)
    return _OVProcessor(image_processor=ip, tokenizer=tokenizer(), num_image_tokens=25,
                        vision_feature_select_strategy="full", vision_aspect_ratio=OV_RATIO)


def image(h: int, w: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def process(kind: str, texts, images) -> dict:
    return dict(processor(kind)(text=texts, images=images, return_tensors="np", padding=True))


def video_tokens(frames: int) -> int:
    return processor("ov")._get_num_multimodal_tokens(video_sizes=[(frames, 30, 30)])["num_video_tokens"][0]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """({name: HF model}, {name: jspec model loaded from its checkpoint})."""
    root = tmp_path_factory.mktemp("llava_next")
    return saved_and_loaded({"next": tiny_next(0), "ov": tiny_ov(10), "next_draft": tiny_next(20, layers=1, hidden=32),
                             "llava_draft": tiny_llava15(30)}, root)


@pytest.fixture(scope="module")
def hf_models(built):
    return built[0]


@pytest.fixture(scope="module")
def jx_models(built):
    return built[1]


def hf_forward(hf, batch: dict) -> np.ndarray:
    with torch.no_grad():
        return hf(**{k: torch.tensor(v) for k, v in batch.items()}).logits.numpy()


def assert_parity(hf, model, batch: dict):
    assert_masked_parity(hf, model, batch, atol=1e-4, rtol=1e-4)  # the processor right-pads the shorter rows


# ------------------------------------------------------------------------------------------ geometry (no models)


def test_bilinear_taps_match_torch_interpolate():
    rng = np.random.default_rng(0)
    for h, w, oh, ow in [(8, 12, 3, 4), (5, 5, 3, 3), (7, 3, 2, 2), (13, 9, 5, 7), (6, 6, 6, 3), (3, 7, 1, 5)]:
        x = rng.normal(size=(4, h, w)).astype(np.float32)
        ref = torch.nn.functional.interpolate(torch.tensor(x)[None], [oh, ow], mode="bilinear")[0].numpy()
        R, C, W = ANY.resize_taps(h, w, oh, ow)
        np.testing.assert_allclose((x[:, R, C] * W).sum(-1), ref, atol=3e-6)
        np.testing.assert_allclose(W.sum(-1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("model_type", ["llava_next", "llava_onevision"])
def test_token_counts_match_hf_processor_at_real_sizes(model_type):
    """The placeholder count our layout fills equals what HF's processor inserts, for the real checkpoints'
    geometry (CLIP-L/336 + NeXT pinpoints; SigLIP/384 + 36 pinpoints + anyres_max_9) over many image sizes."""
    ov = model_type == "llava_onevision"
    hf_cfg = (transformers.LlavaOnevisionConfig if ov else transformers.LlavaNextConfig)()
    cfg = NX.config_from_hf(hf_cfg.to_dict())
    if ov:
        proc = _OVProcessor(image_processor=LlavaOnevisionImageProcessorPil(), tokenizer=tokenizer(),
                            num_image_tokens=729, vision_feature_select_strategy="full")
    else:
        proc = transformers.LlavaNextProcessor(image_processor=LlavaNextImageProcessorPil(), tokenizer=tokenizer(),
                                               patch_size=14, vision_feature_select_strategy="default",
                                               num_additional_image_tokens=1)
    s = cfg.vision.image_size
    rng = np.random.default_rng(1)
    sizes = [(int(h), int(w)) for h, w in rng.integers(20, 3000, (40, 2))] + [(336, 336), (384, 1000), (1000, 10)]
    for hw in sizes:
        want = proc._get_number_of_features(hw[0], hw[1], s, s) - (0 if ov else 1)
        assert cfg.num_image_tokens(hw) == want, hw
    if ov:
        assert cfg.num_image_tokens((500, 700), tiled=False) == 729 + 1
        assert cfg.num_video_tokens(8) == proc._get_num_multimodal_tokens(
            video_sizes=[(8, 384, 384)])["num_video_tokens"][0]


@pytest.mark.parametrize("model_type", ["llava_next", "llava_onevision"])
def test_config_defaults_are_hfs(model_type):
    """A config.json that leaves fields out parses as HF's config class fills them in; config_to_hf round trips."""
    cls = transformers.LlavaOnevisionConfig if model_type == "llava_onevision" else transformers.LlavaNextConfig
    text = text_config("qwen2" if model_type == "llava_onevision" else "llama", 48, 2).to_dict()
    full = NX.config_from_hf(cls(text_config=text).to_dict())
    sparse = NX.config_from_hf({"model_type": model_type, "text_config": text})
    assert sparse == full
    assert NX.config_from_hf(NX.config_to_hf(full)) == full
    if model_type == "llava_onevision":
        assert (full.vision.model_type, full.vision.image_size, full.vision.patch_size) == ("siglip_vision_model",
                                                                                            384, 14)
        assert (full.feature_layer, full.feature_strategy, full.max_tiles) == (-1, "full", 9)
        assert (full.image_token_id, full.video_token_id, len(full.grid_pinpoints)) == (151646, 151647, 36)
    else:
        assert (full.vision.model_type, full.vision.image_size, full.feature_layer) == ("clip_vision_model", 336, -2)
        assert full.grid_pinpoints[0] == (336, 672) and full.vision_aspect_ratio is None


@pytest.mark.parametrize("cls", [transformers.LlavaConfig, transformers.LlavaNextConfig,
                                 transformers.LlavaOnevisionConfig], ids=lambda c: c.model_type)
def test_tied_embeddings_decided_as_transformers_does(cls):
    """transformers 5 ties lm_head by the top-level flag; LLaVA and OneVision also when the text config ties."""
    for top in (False, True):
        for text_tie in (False, True):
            text = text_config("llama", 48, 1).to_dict() | {"tie_word_embeddings": text_tie}
            d = {"text_config": text, "tie_word_embeddings": top}
            hf_tie = cls(**d).tie_word_embeddings
            ours = ports.model.family(cls.model_type).config_from_hf({"model_type": cls.model_type, **d})
            assert ours.tie_word_embeddings == hf_tie, (top, text_tie)


# ------------------------------------------------------------------------------------------ logits parity

NEXT_CASES = {
    # 40 x 90 -> pinpoint 28 x 84 (1 x 3 tiles), letterboxed: unpadding drops feature columns
    "one_odd_image": (["w1 w2 <image> w3 w4"], [image(40, 90, 1)]),
    "two_images": (["w1 <image> w5 <image> w6"], [image(20, 100, 2), image(33, 33, 3)]),  # 20 x 100: rows cut
    "batch_of_two_sizes": (["w1 <image> w2", "w3 w4 w5 <image> w9 w8 w7"], [image(40, 90, 4), image(70, 20, 5)]),
}


@pytest.mark.parametrize("case", sorted(NEXT_CASES))
def test_next_logits_match_transformers(hf_models, jx_models, case):
    texts, images = NEXT_CASES[case]
    batch = process("next", texts, images)
    assert batch["pixel_values"].ndim == 5
    assert_parity(hf_models["next"], jx_models["next"], batch)


def test_next_case_geometry(jx_models):
    """The odd image really goes through unpadding (and gets more tokens than a square one)."""
    cfg = jx_models["next"].config
    rows, cols = ANY.tile_grid((40, 90), cfg.grid_pinpoints, 28)
    assert (rows, cols) == (1, 3)
    r0, r1, c0, c1 = ANY.unpad_box((40, 90), rows * 4, cols * 4)
    assert (r0, r1, c0, c1) == (0, 4, 1, 11)  # 40 x 90 fills 4 x 9 of the 4 x 12 map: one column cut each side
    assert cfg.num_image_tokens((40, 90)) == 16 + 4 * (10 + 1)


OV_CASES = {
    "one_shrunk_image": (["w1 w2 <image> w3 w4"], [image(40, 90, 1)]),  # 1 x 3 tiles -> unpad -> shrink
    "small_image": (["w1 <image> w3"], [image(20, 20, 2)]),  # 1 tile grid, no shrinking
    "multi_image_row": (["w1 <image> w5 <image> w6"], [[image(50, 30, 3), image(33, 33, 4)]]),  # base + newline
    "batch_of_two_sizes": (["w1 <image> w2", "w3 w4 w5 <image> w9 <image> w8 w7"],
                           [[image(95, 61, 5)], [image(70, 20, 6), image(60, 60, 7)]]),
}


@pytest.mark.parametrize("case", sorted(OV_CASES))
def test_onevision_logits_match_transformers(hf_models, jx_models, case):
    texts, images = OV_CASES[case]
    batch = process("ov", texts, images)
    assert "batch_num_images" in batch
    assert_parity(hf_models["ov"], jx_models["ov"], batch)


def test_onevision_case_geometry(jx_models):
    cfg = jx_models["ov"].config
    rows, cols = ANY.tile_grid((40, 90), cfg.grid_pinpoints, 30)
    r0, r1, c0, c1 = ANY.unpad_box((40, 90), rows * 5, cols * 5)
    h, w = r1 - r0, c1 - c0
    assert ANY.downsampled_shape(h, w, 5, cfg.max_tiles) != (h, w)  # the shrink path runs
    assert ANY.downsampled_shape(5, 5, 5, cfg.max_tiles) == (5, 5)


def ov_video_batch(frames: int = 3, with_image: bool = False, seed: int = 0):
    rng = np.random.default_rng(seed)
    n = video_tokens(frames)
    assert n == frames * 3 * 3 + 1
    if with_image:
        batch = process("ov", ["w1 <image> w2"], [image(40, 70, seed)])
    else:
        batch = {"input_ids": np.array([[1, 2]]), "attention_mask": np.ones((1, 2), np.int64)}
    ids = np.concatenate([batch["input_ids"][0], [VID] * n, [4, 5, 6]])[None]
    batch.update(input_ids=ids, attention_mask=np.ones_like(ids),
                 pixel_values_videos=rng.normal(size=(1, frames, 3, 30, 30)).astype(np.float32))
    return batch


@pytest.mark.parametrize("with_image", [False, True], ids=["video", "image_and_video"])
def test_onevision_video_logits_match_transformers(hf_models, jx_models, with_image):
    assert_parity(hf_models["ov"], jx_models["ov"], ov_video_batch(with_image=with_image, seed=int(with_image)))


# ------------------------------------------------------------------------------------------ checkpoints


def _rename(key: str, layout: str) -> str:
    if layout == "hub":  # older hub checkpoints: the tower under vision_model.
        return key.replace("vision_tower.", "vision_tower.vision_model.", 1)
    for old, new in (("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector."),
                     ("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                     ("image_newline", "model.image_newline")):
        if key.startswith(old):
            return new + key[len(old):]
    return key


@pytest.mark.parametrize("name", ["next", "ov"])
@pytest.mark.parametrize("layout", ["hub", "in_memory"])
def test_other_checkpoint_layouts_load(hf_models, jx_models, tmp_path, name, layout):
    hf_models[name].save_pretrained(str(tmp_path))
    path = os.path.join(tmp_path, "model.safetensors")
    tensors = safetensors.numpy.load_file(path)
    assert "image_newline" in tensors  # transformers 5 writes it at the top level
    renamed = {_rename(k, layout): v for k, v in tensors.items()}
    if layout == "hub":
        renamed["vision_tower.vision_model.embeddings.position_ids"] = np.arange(16 if name == "next" else 25)[None]
    os.remove(path)
    safetensors.numpy.save_file(renamed, path)
    loaded = ports.load_hf(str(tmp_path))
    assert loaded.config == jx_models[name].config
    jax.tree.map(np.testing.assert_array_equal, loaded.params, jx_models[name].params)


@pytest.mark.parametrize("name", ["next", "ov"])
def test_save_hf_round_trip(hf_models, jx_models, tmp_path, name):
    """Params and config_to_hf (no stored HF config) back to a checkpoint transformers loads, same logits."""
    m = jx_models[name]
    ports.save_hf(ports.Model(m.config, m.params), str(tmp_path))
    cls = type(hf_models[name])
    back = cls.from_pretrained(str(tmp_path)).eval()
    assert back.config.image_grid_pinpoints == hf_models[name].config.image_grid_pinpoints
    kind = "next" if name == "next" else "ov"
    batch = process(kind, ["w1 <image> w2"], [image(40, 90, 9)])
    np.testing.assert_allclose(hf_forward(back, batch), hf_forward(hf_models[name], batch), atol=1e-5)


# ------------------------------------------------------------------------------------------ decoding


@pytest.mark.parametrize("name", ["next", "ov"])
def test_greedy_decode_equals_hf_generate(hf_models, jx_models, name):
    kind = "next" if name == "next" else "ov"
    batch = process(kind, ["w3 w1 <image> w2 w7"], [image(40, 90, 11)])
    with torch.no_grad():
        ref = hf_models[name].generate(**{k: torch.tensor(v) for k, v in batch.items()}, max_new_tokens=10,
                                       do_sample=False, pad_token_id=0).numpy()[0, batch["input_ids"].shape[1]:]
    out = jspec.decode(jx_models[name], batch, max_new_tokens=10)
    np.testing.assert_array_equal(out.tokens[0], ref)


def test_greedy_chain_sd_equals_ar(jx_models):
    """NeXT target with (a) a NeXT draft reading the same prepared images, (b) a LLaVA-1.5 draft given its own
    prompt (16 placeholders per image, the base tile as its image): both give greedy AR's tokens, per row."""
    target = jx_models["next"]
    batch = process("next", ["w1 <image> w2", "w3 w4 w5 <image> w9 w8 w7"], [image(40, 90, 12), image(70, 20, 13)])
    ar = jspec.decode(target, batch, max_new_tokens=12)
    sd = jspec.decode(target, batch, strategy=jspec.Chain(jx_models["next_draft"], gamma=3), max_new_tokens=12)
    np.testing.assert_array_equal(sd.tokens, ar.tokens)
    rows = []
    for b in range(2):
        ids = batch["input_ids"][b][batch["attention_mask"][b].astype(bool)]
        first = int(np.flatnonzero(ids == IMG)[0])
        rows.append(np.concatenate([ids[:first], [IMG] * 16, ids[first:][ids[first:] != IMG]]))
    draft_prompt = {"input_ids": rows, "pixel_values": batch["pixel_values"][:, 0]}
    sd15 = jspec.decode(target, batch, strategy=jspec.Chain(jx_models["llava_draft"], gamma=3), max_new_tokens=12,
                        draft_prompt=draft_prompt)
    np.testing.assert_array_equal(sd15.tokens, ar.tokens)


@pytest.mark.slow
def test_text_only_draft_reads_video_prompt_without_placeholders(jx_models):
    """A OneVision target with image + video and a text-only Qwen2 draft: the draft's default view drops both the
    image and the video placeholders, and greedy Chain SD and SAGE give greedy AR's tokens."""
    target = jx_models["ov"]
    draft = ports.random_model(ports.text_config_from_hf(text_config("qwen2", 32, 1).to_dict()), 5, std=0.2)
    batch = ov_video_batch(with_image=True, seed=3)
    ar = jspec.decode(target, batch, max_new_tokens=10)
    for strategy in (jspec.Chain(draft, gamma=3), jspec.SAGE(draft, d_max=5, n_max=30, k=6, w_max=6)):
        sd = jspec.decode(target, batch, strategy=strategy, max_new_tokens=10)
        np.testing.assert_array_equal(sd.tokens, ar.tokens)
    from jspec.parts.drafters.model import default_view
    from ports.core.prompts import model_prompt
    tokens, lengths, inputs = model_prompt(target, batch, "")
    d_tokens, d_lengths, d_inputs = default_view(target, draft, batch, tokens, lengths, inputs)
    assert not d_inputs and not np.isin(d_tokens, [IMG, VID]).any()
    assert int(d_lengths.sum()) == int(lengths.sum()) - int(np.isin(tokens, [IMG, VID]).sum())


# ------------------------------------------------------------------------------------------ hooks


def test_hooks_image_positions_tile_features_attention(hf_models, jx_models):
    """image_mask marks the placeholders; vision_features are the tower's per-tile features before the projector
    (tiles in prepared order); the attention-score hook equals HF eager attentions on the same input."""
    from jspec.core import prefill as PR

    hf, m = hf_models["next"], jx_models["next"]
    cfg = m.config
    batch = process("next", ["w1 <image> w2 w3 w4 w5"], [image(40, 90, 14)])
    ids = batch["input_ids"]
    T = ids.shape[1]
    prep = NX.prepare_inputs(cfg, ids, np.array([T]), {k: batch[k] for k in ("pixel_values", "image_sizes")})
    n_tiles = ANY.num_tiles((40, 90), cfg.grid_pinpoints, 28)
    np.testing.assert_array_equal(prep["vision_tile_source"][:n_tiles], 0)
    assert np.all(prep["vision_tile_source"][n_tiles:] == -1)
    pe = NX.prompt_embeds(cfg, m.params, ids.astype(np.int32), prep)
    np.testing.assert_array_equal(np.asarray(pe.image_mask[0]), ids[0] == IMG)
    with torch.no_grad():
        hs = hf.model.vision_tower(torch.tensor(batch["pixel_values"][0, :n_tiles]), output_hidden_states=True)
    want = hs.hidden_states[-2][:, 1:].numpy()  # feature layer -2, class token dropped
    np.testing.assert_allclose(np.asarray(pe.vision_features[:n_tiles]), want, atol=1e-5)

    last = int(np.flatnonzero(ids[0] == IMG)[-1])
    weights = (np.arange(T) > last).astype(np.float32)
    weights /= weights.sum()
    cache = PR.new_cache_for(m, 1, T + 16)
    fo = m.forward(ids, np.arange(T)[None], cache, embeds=pe.embeds, attn_query_weights=weights[None])
    ref = weights @ eager_attentions(hf, batch)[:, 0].mean(axis=(0, 1))
    np.testing.assert_allclose(np.asarray(fo.attn[0, :T]), ref, atol=1e-5)


# ------------------------------------------------------------------------------------------ bad inputs


def test_bad_inputs_fail_early_with_clear_errors(jx_models):
    nxt, ov = jx_models["next"], jx_models["ov"]
    batch = process("next", ["w1 <image> w2"], [image(40, 90, 15)])
    ids, pv, sizes = batch["input_ids"], batch["pixel_values"], batch["image_sizes"]
    drop_one = np.delete(ids, int(np.flatnonzero(ids[0] == IMG)[0]), axis=1)
    cases = [
        ({"input_ids": drop_one, "pixel_values": pv, "image_sizes": sizes},
         r"59 image tokens .* sizes \[\[40, 90\]\] take 60;"),
        ({"input_ids": ids, "pixel_values": pv}, "needs image_sizes"),
        ({"input_ids": ids, "pixel_values": pv, "image_sizes": np.concatenate([sizes, sizes])},
         "image_sizes has shape"),
        ({"input_ids": ids, "pixel_values": pv[..., :20, :20], "image_sizes": sizes}, r"\(3, 28, 28\)"),
        ({"input_ids": ids, "pixel_values": pv[:, :2], "image_sizes": sizes}, "needs 4 tiles"),
        ({"input_ids": ids}, "no pixel_values"),
        ({"input_ids": ids, "pixel_values": pv, "image_sizes": sizes, "pixel_values_videos": pv}, "unsupported"),
    ]
    for prompt, msg in cases:
        with pytest.raises(ValueError, match=msg):
            jspec.decode(nxt, prompt, max_new_tokens=2)
    vb = ov_video_batch()
    with pytest.raises(ValueError, match=r"video tokens .* 3 frames take 28"):
        jspec.decode(ov, {**vb, "input_ids": vb["input_ids"][:, :-5], "attention_mask": vb["attention_mask"][:, :-5]},
                     max_new_tokens=2)
    ob = process("ov", ["w1 <image> w5 <image>"], [[image(50, 30, 3), image(33, 33, 4)]])
    with pytest.raises(ValueError, match="does not add up"):
        jspec.decode(ov, {**ob, "batch_num_images": np.array([3])}, max_new_tokens=2)
    # inputs laid out for another config (other pinpoints) are refused, not misread
    other = dataclasses.replace(nxt.config, grid_pinpoints=((28, 28), (28, 56), (56, 28)))
    prep = NX.prepare_inputs(nxt.config, ids, np.array([ids.shape[1]]), {"pixel_values": pv, "image_sizes": sizes})
    with pytest.raises(ValueError, match="another model's layout"):
        NX.prompt_embeds(other, nxt.params, ids, prep)
    # a LLaVA-1.5 draft cannot read a NeXT prompt's prepared inputs (nor a NeXT draft raw 1.5 inputs): say so
    with pytest.raises(ValueError, match="prepared for another model.*draft_prompt"):
        jspec.decode(nxt, batch, strategy=jspec.Chain(jx_models["llava_draft"], gamma=2), max_new_tokens=2)
    with pytest.raises(ValueError, match="prepared for another model.*draft_prompt"):
        NX.prompt_embeds(nxt.config, nxt.params, ids, {"pixel_values": pv[:, 0]})


@pytest.mark.parametrize("kind, target, draft, case", [("next", "next", "next_draft", "batch_of_two_sizes"),
                                                        pytest.param("ov", "ov", "ov", "batch_of_two_sizes",
                                                                     marks=pytest.mark.slow)])
def test_tabed_views_over_anyres_drafts(jx_models, kind, target, draft, case):
    """TABED's four views with a LLaVA-NeXT / OneVision draft (the P view pools every tile and lays the image out
    on the pooled grid): shorter image slots, and greedy == AR on a ragged batch with one and two images per row."""
    from jspec.parts.drafters.views import build_views
    from jspec.strategies.tabed import TABED

    texts, images = (NEXT_CASES if kind == "next" else OV_CASES)[case]
    batch = process(kind, texts, images)
    t, d = jx_models[target], jx_models[draft]
    fake = lambda ims: [[5, 6 + i] for i in range(ims["pixel_values"].shape[0])]  # noqa: E731
    (_, m_len, _), (_, p_len, p_in) = build_views(d, t, batch, ("M", "P"), None, 2, None)[0]
    assert np.all(p_len < m_len) and "vision_tiles" in p_in
    flat = {"pixel_values": batch["pixel_values"].reshape((-1,) + batch["pixel_values"].shape[2:]),
            "image_sizes": batch["image_sizes"]}
    with pytest.raises(ValueError, match="per image"):  # tiles of all images in one axis cannot be sliced per image
        jspec.ModelCaptioner(d, [1], [2])(flat)
    ar = jspec.decode(t, batch, max_new_tokens=8, eos_token_id=())
    out = jspec.decode(t, batch, strategy=TABED.method("MTCP*", d, gamma=3, newline_id=3, captioner=fake),
                       max_new_tokens=8, eos_token_id=())
    np.testing.assert_array_equal(out.tokens, ar.tokens)
