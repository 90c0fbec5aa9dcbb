"""Muse Glimmer (`muse_glimmer`) through `ports`, against transformers 5.23's MuseGlimmerForConditionalGeneration on
a tiny random model (f32): logits through `load_hf` for text, images and a video (each feature the config names
matters: dropping it changes the logits); `save_hf` read back by transformers; greedy `jspec.decode` against
transformers' generate on a ragged text batch, on image prompts and on video prompts; greedy DFlash with a random head in the Muse
Glimmer assistant's layout (transformers' MuseGlimmerAssistantModel, saved) equals AR; bad configs refused before
any weight is read, naming the field; bad vision inputs refused; the shipped `jspec memory` config plans at
transformers' parameter count.

transformers' image and video processors for this model need torchvision, which is not installed: pixels are
patchified here by hand exactly as `MuseGlimmerImageProcessor.patchify` / `MuseGlimmerVideoProcessor.patchify` do
(rescale, normalise, then (temporal, channel, row, column) patches in raster order), at sizes its resize keeps, and
the prompts hold the placeholders its processor inserts (t * h * w / merge^2 per item).
"""
import dataclasses
import json

import numpy as np
import pytest
import torch
import transformers

import jspec
import ports
from conftest import hf_batch_logits, perturb
from ports.families import muse_glimmer as MG
from tolerances import assert_clear_margins, assert_layout_close

V = 128
IMG_START, IMG_END, PATCH, VID_START, VID_END, VIDEO, VID_SEP, MASK = 100, 101, 102, 103, 104, 105, 106, 110
P, TP = 4, 2  # patch size, temporal patch
TEXT = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=5,
            final_logit_softcapping=4.0, output_multiplier=0.7, qk_scale_factor=2.5, post_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, bos_token_id=None, eos_token_id=None,
            pad_token_id=None)
VISION = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=48, patch_size=P,
              pos_emb_height=3, pos_emb_width=3, patch_temporal=TP, merge_size=2)
TOP = dict(image_token_id=PATCH, video_token_id=VIDEO, out_hidden_size=128, projector_hidden_size=48)


def tiny_muse(seed: int = 0, tie: bool = False, **text):
    """A tiny random MuseGlimmerForConditionalGeneration: 4 layers (0-2 slide over 5 tokens with RoPE, 3 global
    without), a 2-layer tower (a window layer, a full one) with a 3 x 3 position table, every weight perturbed.
    `tie`: the LM head is the embedding table; `text` overrides fields of the text config."""
    cfg = transformers.MuseGlimmerConfig(text_config={**TEXT, **text}, vision_config=VISION, tie_word_embeddings=tie,
                                         **TOP)
    torch.manual_seed(seed)
    return perturb(transformers.MuseGlimmerForConditionalGeneration(cfg).eval(), seed + 1, scale=0.1)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers model, its checkpoint directory, the jspec model loaded from it)."""
    hf = tiny_muse()
    d = tmp_path_factory.mktemp("muse") / "hf"
    hf.save_pretrained(str(d))
    return hf, d, ports.load_hf(str(d))


# ------------------------------------------------------------------------------------------ inputs


def image_pixels(img: np.ndarray):
    """(pixel_values rows, (1, h, w)) of an RGB uint8 image [H, W, 3] as the image processor gives them."""
    x = (img.astype(np.float32) / 255 - 0.5) / 0.5  # IMAGENET_STANDARD mean / std
    H, W, C = x.shape
    gh, gw = H // P, W // P
    x = x.transpose(2, 0, 1).reshape(C, gh, P, gw, P).transpose(1, 3, 0, 2, 4)  # [gh, gw, C, p, p]
    x = np.broadcast_to(x[:, :, None], (gh, gw, TP, C, P, P))  # the image repeated over the temporal patch
    return x.reshape(gh * gw, -1), (1, gh, gw)


def video_pixels(frames: np.ndarray):
    """(pixel_values_videos rows, (t, h, w)) of uint8 frames [N, H, W, 3] as the video processor gives them."""
    if len(frames) % TP:
        frames = np.concatenate([frames, frames[-1:].repeat(TP - len(frames) % TP, 0)])
    x = (frames.astype(np.float32) / 255 - 0.5) / 0.5
    N, H, W, C = x.shape
    gt, gh, gw = N // TP, H // P, W // P
    x = x.transpose(0, 3, 1, 2).reshape(gt, TP, C, gh, P, gw, P).transpose(0, 3, 5, 1, 2, 4, 6)
    return x.reshape(gt * gh * gw, -1), (gt, gh, gw)


def rgb(h: int, w: int, seed: int, frames: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, ((frames,) if frames else ()) + (h, w, 3)).astype(np.uint8)


def image_tokens(grid) -> list:
    return [IMG_START] + [PATCH] * (grid[1] * grid[2] // 4) + [IMG_END]


def video_tokens(grid) -> list:
    out = [VID_START]
    for g in range(grid[0]):  # a timestamp's text, the frame's tokens, a separator (the last: the end)
        out += [60 + g, 61] + [VIDEO] * (grid[1] * grid[2] // 4) + [VID_SEP if g < grid[0] - 1 else VID_END]
    return out


def prompt(images=(), video=None, text=(5, 9, 33)) -> dict:
    """A processor-style batch of one row: text, then each image, then the video, then text."""
    ids, out = list(text), {}
    if images:
        px = [image_pixels(im) for im in images]
        out.update(pixel_values=np.concatenate([p for p, _ in px]), image_grid_thw=np.array([g for _, g in px]))
        for _, g in px:
            ids += image_tokens(g) + [7]
    if video is not None:
        px, g = video_pixels(video)
        out.update(pixel_values_videos=px, video_grid_thw=np.array([g]))
        ids += video_tokens(g)
    ids += [11, 42]
    return {"input_ids": np.array([ids]), "attention_mask": np.ones((1, len(ids)), np.int64), **out}


IMAGES = (rgb(16, 24, 1), rgb(24, 16, 2))  # 4 x 6 and 6 x 4 patches: windows of 3 x 3, a resampled position table
VIDEO_FRAMES = rgb(16, 16, 3, frames=3)  # padded to 4 frames: 2 temporal groups of 4 x 4 patches
TOKENS = np.random.default_rng(0).integers(0, 100, (2, 19))


def close_to(ours, ref):
    assert_layout_close(ours, ref, reduction=128, depth=6)


def differs(ours, ref) -> bool:
    return float(np.abs(np.asarray(ours) - ref).max()) > 1e-3 * float(np.abs(ref).max())


def with_text(model, **changes):
    return ports.Model(dataclasses.replace(model.config, text=dataclasses.replace(model.config.text, **changes)),
                       model.params)


# ------------------------------------------------------------------------------------------ logits


def test_text_logits_match_transformers(pair):
    """A 2 x 19 text batch: transformers' logits. The config's every option is read: the NoPE layer (3), the
    windows of layers 0-2, the scaleless QK-norm's factor, the soft-cap and its multiplier, the post-norms' eps
    (1e-6, not the decoder's 1e-5), and the weights of the attention gate each change the logits."""
    hf, _, model = pair
    cfg = model.config.text
    assert (cfg.nope_layers, cfg.full_attention_layers, cfg.sliding_window) == ((3,), (3,), 5)
    assert (cfg.qk_scale_factor, cfg.output_multiplier, cfg.final_logit_softcapping) == (2.5, 0.7, 4.0)
    ref = hf_batch_logits(hf, {"input_ids": TOKENS})
    close_to(ports.logits(model, TOKENS), ref)
    for change in (dict(nope_layers=()), dict(sliding_window=None), dict(qk_scale_factor=1.0),
                   dict(final_logit_softcapping=None), dict(output_multiplier=1.0), dict(post_norm_eps=1.0)):
        assert differs(ports.logits(with_text(model, **change), TOKENS), ref), change
    layers = [{k: v for k, v in p.items() if k != "w_attn_gate"} for p in model.params["lm"]["layers"]]
    ungated = ports.Model(model.config, {**model.params, "lm": {**model.params["lm"], "layers": layers}})
    assert differs(ports.logits(ungated, TOKENS), ref)


@pytest.mark.parametrize("case", ["images", "image_and_video"])
def test_vision_logits_match_transformers(pair, case):
    """Two images of other shapes than the position table (4 x 6 and 6 x 4 patches, windows of 3 x 3), and an
    image with a 3-frame video (2 temporal groups): transformers' logits at every position. The features matter
    (the placeholders' own embeddings give other logits), and so do the tower's windows (its window layer run as
    a full one gives others)."""
    hf, _, model = pair
    batch = prompt(IMAGES) if case == "images" else prompt(IMAGES[:1], VIDEO_FRAMES)
    ref = hf_batch_logits(hf, batch)
    ours = ports.logits(model, batch)
    close_to(ours, ref)
    text_only = ports.logits(model, batch["input_ids"])  # the placeholders' own embeddings instead
    assert differs(text_only, ref)
    if case == "images":
        vision = dataclasses.replace(model.config.vision, full_layers=(0, 1))
        assert differs(ports.logits(ports.Model(dataclasses.replace(model.config, vision=vision), model.params),
                                    batch), ref)


# ------------------------------------------------------------------------------------------ save_hf


def test_save_hf_loads_in_transformers_with_equal_logits(pair, tmp_path):
    """save_hf of the loaded model, and of a Model without its source config (config_to_hf's), load in
    transformers as MuseGlimmerForConditionalGeneration with the source model's logits on an image prompt, and
    read back to the same config."""
    hf, _, model = pair
    batch = prompt(IMAGES[:1])
    ref = hf_batch_logits(hf, batch)
    for name, m in (("loaded", model), ("bare", ports.Model(model.config, model.params))):
        ports.save_hf(m, str(tmp_path / name))
        back = transformers.MuseGlimmerForConditionalGeneration.from_pretrained(str(tmp_path / name)).eval()
        np.testing.assert_allclose(hf_batch_logits(back, batch), ref, rtol=0, atol=1e-6, err_msg=name)
        assert ports.load_hf(str(tmp_path / name)).config == model.config
    assert MG.config_from_hf(MG.config_to_hf(model.config)) == model.config


# ------------------------------------------------------------------------------------------ decoding


def hf_generate(hf, batch: dict, n: int) -> np.ndarray:
    with torch.no_grad():
        out = hf.generate(**{k: torch.tensor(v) for k, v in batch.items()}, max_new_tokens=n, do_sample=False,
                          pad_token_id=0, eos_token_id=None)
    return out[0, batch["input_ids"].shape[1]:].numpy()


RAGGED = [np.random.default_rng(5).integers(0, 100, n) for n in (17, 9, 12)]


def test_greedy_decode_equals_transformers_generate_on_text(pair):
    """A ragged batch of 3 prompts (17, 9 and 12 tokens), 10 new tokens: each row is transformers' cached greedy
    generate's (windows of 5 slide during decoding)."""
    hf, _, model = pair
    out = jspec.decode(model, RAGGED, max_new_tokens=10, eos_token_id=())
    assert_clear_margins(model, RAGGED, out.tokens)
    for b, p in enumerate(RAGGED):
        want = hf_generate(hf, {"input_ids": p[None], "attention_mask": np.ones((1, len(p)), np.int64)}, 10)
        np.testing.assert_array_equal(out.tokens[b], want, err_msg=f"row {b}")


def left_padded(rows: list) -> dict:
    """One batch of single-row prompts (`prompt`'s), left-padded as a processor pads for generation; each kind's
    pixels and grids concatenated in row order."""
    T = max(r["input_ids"].shape[1] for r in rows)
    pad = lambda k: np.stack([np.pad(r[k][0], (T - r[k].shape[1], 0)) for r in rows])  # noqa: E731
    batch = {"input_ids": pad("input_ids"), "attention_mask": pad("attention_mask")}
    for k in MG.RAW_KEYS:
        if any(k in r for r in rows):
            batch[k] = np.concatenate([r[k] for r in rows if k in r])
    return batch


def test_greedy_decode_equals_transformers_generate_on_images(pair):
    """A batch of two image prompts of different lengths, left-padded as a processor pads for generation (row 0
    two images, row 1 one), 8 new tokens: each row is transformers' greedy generate's for that prompt alone."""
    hf, _, model = pair
    rows = [prompt(IMAGES), prompt(IMAGES[1:], text=(3,))]
    out = jspec.decode(model, left_padded(rows), max_new_tokens=8, eos_token_id=())
    for b, r in enumerate(rows):
        np.testing.assert_array_equal(out.tokens[b], hf_generate(hf, r, 8), err_msg=f"row {b}")


def test_greedy_decode_equals_transformers_generate_on_a_video(pair):
    """A batch of a video prompt (3 frames: 2 temporal groups) and a longer one with an image and a 2-frame video,
    left-padded, 8 new tokens: each row is transformers' greedy generate's for that prompt alone."""
    hf, _, model = pair
    rows = [prompt(video=VIDEO_FRAMES), prompt(IMAGES[1:], VIDEO_FRAMES[1:], text=(3,))]
    out = jspec.decode(model, left_padded(rows), max_new_tokens=8, eos_token_id=())
    for b, r in enumerate(rows):
        np.testing.assert_array_equal(out.tokens[b], hf_generate(hf, r, 8), err_msg=f"row {b}")


def assistant_dir(path, seed: int = 0):
    """A random transformers MuseGlimmerAssistantModel for the tiny target (its layers 0 and 2 as context, a
    window of 6, blocks of 4, MASK as the mask token), saved: the assistant's published layout."""
    cfg = transformers.MuseGlimmerAssistantConfig(
        hidden_size=TEXT["hidden_size"], intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, block_size=4, mask_token_id=MASK, target_layer_ids=[0, 2],
        sliding_window=6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(seed)
    model = perturb(transformers.MuseGlimmerAssistantModel(cfg).eval(), seed + 1, scale=0.3)
    model.save_pretrained(str(path))
    return str(path)


def test_greedy_dflash_with_the_assistant_layout_equals_ar(pair, tmp_path):
    """A random head in the assistant's layout loads on the Muse Glimmer target (context layers 1 and 3 in jspec's
    count, its mask token and block) and decodes the ragged batch (as DFlash's chain and as a DDTree) and an image
    prompt (as a chain) to AR's tokens."""
    from jspec.parts.drafters import dflash_io as IO

    _, _, model = pair
    head = IO.load_head(assistant_dir(tmp_path / "assistant"), model)
    assert (head.target_layers, head.mask_token, head.block) == ((1, 3), MASK, 4)
    for p, strategies in ((RAGGED, (jspec.DFlash(head), jspec.DFlash(head, tree="ddtree", top_k=3, total=8))),
                          (prompt(IMAGES[:1]), (jspec.DFlash(head),))):
        ar = jspec.decode(model, p, max_new_tokens=12, eos_token_id=())
        for strategy in strategies:
            sd = jspec.decode(model, p, strategy=strategy, max_new_tokens=12, eos_token_id=())
            np.testing.assert_array_equal(sd.tokens, ar.tokens)


# ------------------------------------------------------------------------------------------ bad input


BAD = {
    "hidden_activation": ("text_config", {"hidden_activation": "relu"}, "hidden_activation"),
    "text_layer_types": ("text_config", {"layer_types": ["full_attention"]}, "layer_types"),
    "layer_rope_theta": ("text_config", {"layer_rope_theta": [10000.0, 5000.0, 10000.0, 0]}, "layer_rope_theta"),
    "rope_nested": ("text_config", {"rope_parameters": {"full_attention": {"rope_theta": 1.0}}}, "rope_parameters"),
    "softcap_null": ("text_config", {"final_logit_softcapping": None}, "final_logit_softcapping"),
    "kv_heads": ("text_config", {"num_key_value_heads": 3}, "num_key_value_heads"),
    "window_null": ("text_config", {"sliding_window": None}, "sliding_window"),
    "eps": ("text_config", {"rms_norm_eps": -1e-5}, "rms_norm_eps"),
    "head_dim_null": ("text_config", {"head_dim": None}, "head_dim"),
    "pos_emb_width": ("vision_config", {"pos_emb_width": 4}, "pos_emb_width"),
    "vision_layer_types": ("vision_config", {"layer_types": ["window_attention"] * 3}, "layer_types"),
    "vision_act": ("vision_config", {"hidden_act": "swish2"}, "hidden_act"),
    "out_hidden_size": (None, {"out_hidden_size": 96}, "out_hidden_size"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_configs_are_refused_before_any_weight_is_read(pair, case, tmp_path, monkeypatch):
    """The checkpoint's config.json with one bad field: load_hf raises ValueError naming it, and no tensor is read
    (reading one would raise AssertionError)."""
    import shutil

    from ports.core import safetensors_io

    _, d, _ = pair
    shutil.copytree(d, tmp_path / "ckpt")
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    where, over, field = BAD[case]
    (cfg[where] if where else cfg).update(over)
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr(safetensors_io.SafetensorsFile, "get", lambda *a: (_ for _ in ()).throw(AssertionError))
    with pytest.raises(ValueError, match=field):
        ports.load_hf(str(tmp_path / "ckpt"))


def test_bad_vision_inputs_are_refused(pair):
    """Placeholders that do not match the grid, pixel rows that do not match it, a grid without its pixels and a
    key the model does not take: ValueErrors naming the problem, before any compute."""
    _, _, model = pair
    good = prompt(IMAGES[:1])
    cases = {"prompt has 2 image tokens .* take 6": dict(input_ids=good["input_ids"][:, :-8],
                                               attention_mask=good["attention_mask"][:, :-8]),
             "describes": dict(pixel_values=good["pixel_values"][:-1]),
             "without pixel_values": dict(pixel_values=None),
             "unsupported": dict(image_sizes=np.array([[16, 24]]))}
    for match, change in cases.items():
        bad = {k: v for k, v in {**good, **change}.items() if v is not None}
        with pytest.raises(ValueError, match=match):
            jspec.decode(model, bad, max_new_tokens=2)


def test_the_shipped_memory_config_plans_at_transformers_parameter_count():
    """`jspec memory --config muse-glimmer-30b`'s config counts the parameters transformers builds from it (on the
    meta device: no memory), about 30B."""
    from jspec.tools import memory as MEM

    conf = MEM.load_config("muse-glimmer-30b")
    plan = MEM.estimate(conf, {"tensor": 8}, batch=1, max_len=4096, dtype="bf16")
    with torch.device("meta"):
        hf = transformers.MuseGlimmerForConditionalGeneration(transformers.MuseGlimmerConfig(**{
            k: v for k, v in conf.items() if k not in ("architectures", "model_type", "dtype", "torch_dtype")}))
    assert plan["target"]["params"] == sum(p.numel() for p in hf.parameters())
    assert 29e9 < plan["target"]["params"] < 31e9
