"""LLaVA-NeXT-Video port: each frame's tower features pooled on the patch grid (average, max or a conv kernel) before
the projector, no newline after a video; logits parity with transformers on videos, an image beside a video and
ragged batches; placeholder counts equal HF's processor's at the real checkpoint's geometry; config defaults, both
checkpoint layouts and the save_hf round trip; greedy AR == HF generate; clear errors."""
import functools
import os

import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers
from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

import jax
import jspec
import ports
from ports.families import llava_next as NX
from conftest import assert_masked_parity, perturb, saved_and_loaded

import test_llava_next as LN

IMG, VID = LN.IMG, LN.VID
FRAME_TOKENS = 4  # CLIP 28 px / patch 7: a 4 x 4 grid (class token dropped), pooled 2 x 2 -> 2 x 2 per frame


def tiny_nv(seed: int, pool: str = "average", layers: int = 2, hidden: int = 48):
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                           num_attention_heads=4, image_size=28, patch_size=7)
    cfg = transformers.LlavaNextVideoConfig(vision_config=vision, text_config=LN.text_config("llama", hidden, layers),
                                            image_token_index=IMG, video_token_index=VID,
                                            image_grid_pinpoints=LN.NEXT_PIN, spatial_pool_mode=pool)
    torch.manual_seed(seed)
    return perturb(transformers.LlavaNextVideoForConditionalGeneration(cfg).eval(), seed + 1, scale=0.1)


class _NVProcessor(transformers.LlavaNextVideoProcessor):
    """LlavaNextVideoProcessor without a video processor (HF's needs torchvision, absent here): the video's frames
    are built by hand, its placeholder count by the processor's own `replace_video_token`."""

    def check_argument_for_proper_class(self, name, arg):
        return None if arg is None else super().check_argument_for_proper_class(name, arg)


@functools.lru_cache(maxsize=None)
def processor(real: bool = False):
    if real:
        ip, patch = LlavaNextImageProcessorPil(), 14
    else:
        ip, patch = LlavaNextImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                                               image_grid_pinpoints=LN.NEXT_PIN), 7
    return _NVProcessor(image_processor=ip, tokenizer=LN.tokenizer(), patch_size=patch,
                        vision_feature_select_strategy="default", num_additional_image_tokens=1)


def hf_video_tokens(frames: int, side: int, real: bool = False) -> int:
    text = processor(real).replace_video_token({"pixel_values_videos": np.zeros((1, frames, 3, side, side))})
    return text.count("<video>")


def nv_batch(texts, frames: int, images=(), seed: int = 0) -> dict:
    """A processor batch: `texts` with one "<video>" per row (a clip of `frames` random frames each) and their
    "<image>"s; rows right-padded as the processor pads them."""
    n = hf_video_tokens(frames, 28)
    assert n == frames * FRAME_TOKENS
    proc = processor()
    out = dict(proc(text=[t.replace("<video>", "w89") for t in texts], images=list(images) or None,
                    return_tensors="np", padding=True))
    rows = []
    for ids, m in zip(out["input_ids"], out["attention_mask"]):
        ids = ids[m.astype(bool)]
        at = int(np.flatnonzero(ids == 89)[0])
        rows.append(np.concatenate([ids[:at], [VID] * n, ids[at + 1:]]))
    T = max(map(len, rows))
    out["input_ids"] = np.stack([np.pad(r, (0, T - len(r))) for r in rows])
    out["attention_mask"] = np.stack([np.arange(T) < len(r) for r in rows]).astype(np.int64)
    rng = np.random.default_rng(seed)
    out["pixel_values_videos"] = rng.normal(size=(len(texts), frames, 3, 28, 28)).astype(np.float32)
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """({name: HF model}, {name: jspec model loaded from its checkpoint})."""
    return saved_and_loaded({"nv": tiny_nv(40), "nv_conv": tiny_nv(42, "conv"), "nv_max": tiny_nv(40, "max")},
                            tmp_path_factory.mktemp("llava_next_video"))


# ------------------------------------------------------------------------------------------ config and geometry


def test_config_defaults_are_hfs():
    text = LN.text_config("llama", 48, 2).to_dict()
    full = NX.config_from_hf(transformers.LlavaNextVideoConfig(text_config=text).to_dict())
    assert NX.config_from_hf({"model_type": "llava_next_video", "text_config": text}) == full
    assert NX.config_from_hf(NX.config_to_hf(full)) == full
    assert (full.image_token_id, full.video_token_id, full.video_pool, full.video_pool_stride) == (32001, 32000,
                                                                                                    "average", 2)
    assert (full.vision.image_size, full.feature_layer, full.feature_strategy) == (336, -2, "default")
    for top, text_tie in ((False, True), (True, False), (False, False)):
        d = {"text_config": text | {"tie_word_embeddings": text_tie}, "tie_word_embeddings": top}
        hf_tie = transformers.LlavaNextVideoConfig(**d).tie_word_embeddings
        assert NX.config_from_hf({"model_type": "llava_next_video", **d}).tie_word_embeddings == hf_tie


def test_token_counts_match_hf_processor_at_real_sizes():
    """CLIP-L/336: 144 placeholders per frame (24 x 24 pooled to 12 x 12), as HF's processor inserts; images as
    LLaVA-NeXT counts them."""
    cfg = NX.config_from_hf(transformers.LlavaNextVideoConfig().to_dict())
    for frames in (1, 8, 32):
        assert cfg.num_video_tokens(frames) == hf_video_tokens(frames, 336, real=True) == frames * 144
    proc = processor(real=True)
    for hw in [(336, 336), (500, 700), (1000, 200), (90, 2000)]:
        assert cfg.num_image_tokens(hw) == proc._get_number_of_features(hw[0], hw[1], 336, 336) - 1


def test_pool_frames_matches_torch_pooling():
    """average / max / conv over a grid the stride divides and one it does not (torch drops the remainder)."""
    rng = np.random.default_rng(0)
    text = LN.text_config("llama", 16, 1).to_dict()
    for side, stride in ((6, 2), (7, 2), (6, 3)):
        vision = {"model_type": "clip_vision_model", "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
                  "num_attention_heads": 2, "image_size": side * 4, "patch_size": 4}
        for mode in NX.VIDEO_POOLS:
            cfg = NX.config_from_hf({"model_type": "llava_next_video", "text_config": text, "vision_config": vision,
                                     "spatial_pool_mode": mode, "spatial_pool_stride": stride})
            feats = rng.normal(size=(3, side * side, 8)).astype(np.float32)
            grid = torch.tensor(feats).reshape(3, side, side, 8).permute(0, 3, 1, 2)
            params = {}
            if mode == "conv":
                conv = torch.nn.Conv2d(8, 8, stride, stride)
                params = {"video_pool": {"w": conv.weight.detach().numpy().transpose(1, 2, 3, 0),
                                         "b": conv.bias.detach().numpy()}}
                ref = conv(grid)
            else:
                ref = (torch.nn.AvgPool2d if mode == "average" else torch.nn.MaxPool2d)(stride, stride)(grid)
            ref = ref.flatten(2).transpose(1, 2).detach().numpy()
            assert cfg.frame_tokens == ref.shape[1] == (side // stride) ** 2
            np.testing.assert_allclose(np.asarray(NX.pool_frames(cfg, params, feats)), ref, atol=1e-5)


# ------------------------------------------------------------------------------------------ logits parity


@pytest.mark.parametrize("name", ["nv", "nv_max", "nv_conv"])
def test_video_logits_match_transformers(built, name):
    hf_models, jx_models = built
    batch = nv_batch(["w1 w2 <video> w3 w4 w5", "w6 <video> w7"], frames=3, seed=1)
    assert_masked_parity(hf_models[name], jx_models[name], batch, atol=1e-4, rtol=1e-4)


def test_image_and_video_logits_match_transformers(built):
    """Ragged rows, each with an anyres image (unpadded, newlines) before its clip: images and frames in one
    prompt, the frames pooled and the tiles not."""
    hf_models, jx_models = built
    batch = nv_batch(["w1 <image> w2 <video> w3", "w4 w5 <video> w6 <image> w7 w8 w9"], frames=2,
                     images=[LN.image(40, 90, 1), LN.image(70, 20, 2)], seed=2)
    assert batch["pixel_values"].ndim == 5
    assert_masked_parity(hf_models["nv"], jx_models["nv"], batch, atol=1e-4, rtol=1e-4)


def test_prepared_layout(built):
    """Frames go to their own section (pooled rows after the tiles' rows), no newline row for a video, sources
    name each frame's video; vision_features are the tower's, tiles then frames."""
    jx_models = built[1]
    m = jx_models["nv"]
    batch = nv_batch(["w1 <image> w2 <video> w3"], frames=3, images=[LN.image(40, 90, 3)])
    ids = batch["input_ids"]
    raw = {k: batch[k] for k in ("pixel_values", "image_sizes", "pixel_values_videos")}
    prep = NX.prepare_inputs(m.config, ids, np.array([ids.shape[1]]), raw)
    n_tiles = len(prep["vision_tiles"])
    assert prep["vision_frames"].shape == (3, 3, 28, 28)
    np.testing.assert_array_equal(prep["vision_tile_source"][n_tiles:], [1, 1, 1])
    vid = ids[0] == VID
    taps = prep["vision_taps"][0][vid]
    np.testing.assert_array_equal(taps[:, 0], n_tiles * 16 + np.arange(3 * FRAME_TOKENS))
    assert np.all(prep["vision_weights"][0][vid] == [1, 0, 0, 0])
    pe = NX.prompt_embeds(m.config, m.params, ids.astype(np.int32), jax.tree.map(np.asarray, prep))
    assert pe.vision_features.shape == (n_tiles + 3, 16, 32)
    video_only = NX.prepare_inputs(m.config, ids[:, ids[0] != IMG], np.array([int((ids[0] != IMG).sum())]),
                                   {"pixel_values_videos": batch["pixel_values_videos"]})
    assert "vision_tiles" not in video_only and video_only["vision_frames"].shape[0] == 3


# ------------------------------------------------------------------------------------------ checkpoints


def _legacy(key: str) -> str:
    """transformers 5 writes the pooler under model.; the other weights in the older (hub) names."""
    return key[len("model."):] if key.startswith("model.vision_resampler.") else key


def test_checkpoint_layouts_and_save_hf_round_trip(built, tmp_path):
    """The conv pooler's kernel loads from transformers 5's layout (the fixture) and without the model. prefix;
    save_hf writes a checkpoint transformers loads with the same logits."""
    hf_models, jx_models = built
    hf, m = hf_models["nv_conv"], jx_models["nv_conv"]
    hf.save_pretrained(str(tmp_path / "mem"))
    path = os.path.join(tmp_path, "mem", "model.safetensors")
    tensors = safetensors.numpy.load_file(path)
    assert "model.vision_resampler.pool.weight" in tensors
    safetensors.numpy.save_file({_legacy(k): v for k, v in tensors.items()}, path)
    loaded = ports.load_hf(str(tmp_path / "mem"))
    assert loaded.config == m.config
    jax.tree.map(np.testing.assert_array_equal, loaded.params, m.params)
    ports.save_hf(ports.Model(m.config, m.params), str(tmp_path / "back"))
    back = transformers.LlavaNextVideoForConditionalGeneration.from_pretrained(str(tmp_path / "back")).eval()
    assert back.config.spatial_pool_mode == "conv"
    batch = nv_batch(["w1 <video> w2"], frames=2, seed=5)
    with torch.no_grad():
        a, b = (x(**{k: torch.tensor(v) for k, v in batch.items()}).logits.numpy() for x in (back, hf))
    np.testing.assert_allclose(a, b, atol=1e-5)


# ------------------------------------------------------------------------------------------ decoding


def test_greedy_decode_equals_hf_generate(built):
    hf_models, jx_models = built
    batch = nv_batch(["w3 w1 <video> w2 w7"], frames=3, seed=6)
    with torch.no_grad():
        ref = hf_models["nv"].generate(**{k: torch.tensor(v) for k, v in batch.items()}, max_new_tokens=10,
                                       do_sample=False, pad_token_id=0).numpy()[0, batch["input_ids"].shape[1]:]
    np.testing.assert_array_equal(jspec.decode(jx_models["nv"], batch, max_new_tokens=10).tokens[0], ref)


def test_bad_inputs_fail_early_with_clear_errors(built):
    jx_models = built[1]
    m = jx_models["nv"]
    batch = nv_batch(["w1 <video> w2"], frames=3)
    ids, pvv = batch["input_ids"], batch["pixel_values_videos"]
    cases = [
        ({"input_ids": ids[:, :-2]}, r"video tokens .* but no pixel_values_videos"),
        ({"input_ids": np.delete(ids, 2, axis=1), "pixel_values_videos": pvv}, r"11 video tokens .* 3 frames take 12"),
        ({"input_ids": ids, "pixel_values_videos": pvv[0]}, "expected \\(num_videos, frames, C, H, W\\)"),
        ({"input_ids": ids, "pixel_values_videos": pvv[..., :20, :20]}, r"\(3, 28, 28\)"),
        ({"input_ids": ids, "pixel_values_videos": pvv, "batch_num_images": np.array([1])}, "unsupported"),
    ]
    for prompt, msg in cases:
        with pytest.raises(ValueError, match=msg):
            jspec.decode(m, prompt, max_new_tokens=2)
    with pytest.raises(ValueError, match="spatial_pool_mode 'bilinear'"):
        NX.config_from_hf({**NX.config_to_hf(m.config), "spatial_pool_mode": "bilinear"})
