"""Qwen2-VL / Qwen2.5-VL ports: the vision tower (2-D rotary, Qwen2.5 window + full-attention blocks, merger),
M-RoPE position ids (transformers 5.23's get_rope_index, second_per_grid_ts), logits parity for images of
different sizes, video, text only and ragged batches, greedy AR == HF generate, greedy Chain / Tree SD == AR (M-RoPE
continuation through the cache's pos_offset), pruned draft prompts (original vs renumbered positions), both
checkpoint layouts, save_hf round trip, config parsing, hooks and clear errors.

Images go through transformers' Qwen2-VL processor (Pillow image processor). HF's video processor imports
torchvision, which is not installed: video pixels are patchified here by hand exactly as
`Qwen2VLVideoProcessor.patchify` does (checked against the image processor on a still video), with the token
count t * h * w / merge^2 of HF's `replace_video_token`, and `mm_token_type_ids` from the processor's own helper.
"""
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
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

import jax
import jax.numpy as jnp
import jspec
import ports
from jspec.core import prefill as PR
from ports.core import layers as LY
from ports.families import qwen2_vl as QW
from ports.families import qwen2_vl_vision as QV
from conftest import assert_masked_parity, eager_attentions, perturb, saved_and_loaded

V = 100
VS, VE, IMG, VID = 93, 94, 95, 96
PATCH, MERGE = 7, 2
MEAN = np.array([0.48145466, 0.4578275, 0.40821073], np.float32)
STD = np.array([0.26862954, 0.26130258, 0.27577711], np.float32)


def text_config(hidden: int, layers: int, section):
    return dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=V, max_position_embeddings=512, bos_token_id=None,
                eos_token_id=None, pad_token_id=None,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": list(section)})


TOKENS = dict(image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS, vision_end_token_id=VE)


def tiny_q2(seed: int):
    vision = dict(depth=2, embed_dim=32, hidden_size=48, num_heads=4, mlp_ratio=2, patch_size=PATCH)
    cfg = transformers.Qwen2VLConfig(text_config=text_config(48, 2, (2, 2, 2)), vision_config=vision, **TOKENS)
    torch.manual_seed(seed)
    return perturb(transformers.Qwen2VLForConditionalGeneration(cfg).eval(), seed + 1, scale=0.1)


def tiny_q25(seed: int, hidden: int = 48, layers: int = 2, section=(2, 2, 2), depth: int = 3, width: int = 32,
             full=(1,)):
    # window 28 px = 2 x 2 merged patches: a 6 x 12 patch image has 2 x 3 windows
    vision = dict(depth=depth, hidden_size=width, out_hidden_size=hidden, intermediate_size=40, num_heads=4,
                  patch_size=PATCH, window_size=28, fullatt_block_indexes=list(full), tokens_per_second=2)
    cfg = transformers.Qwen2_5_VLConfig(text_config=text_config(hidden, layers, section), vision_config=vision,
                                        **TOKENS)
    torch.manual_seed(seed)
    return perturb(transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval(), seed + 1, scale=0.1)


@functools.lru_cache(maxsize=None)
def tokenizer():
    vocab = {f"w{i}": i for i in range(90)} | {"<unk>": 90, "<pad>": 91, "<|vision_start|>": VS,
                                               "<|vision_end|>": VE, "<|image_pad|>": IMG, "<|video_pad|>": VID}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>")
    fast.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                                                           "<|video_pad|>"]})
    return fast


class _Processor(transformers.Qwen2VLProcessor):
    """Qwen2VLProcessor without a video processor (HF's imports torchvision, absent here)."""

    def check_argument_for_proper_class(self, name, arg):
        return None if arg is None else super().check_argument_for_proper_class(name, arg)


@functools.lru_cache(maxsize=None)
def processor():
    ip = Qwen2VLImageProcessorPil(size={"shortest_edge": 28 * 28, "longest_edge": 56 * 84}, patch_size=PATCH,
                                  merge_size=MERGE, temporal_patch_size=2)
    return _Processor(image_processor=ip, tokenizer=tokenizer(), video_processor=None)


def image(h: int, w: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def video_pixels(frames: np.ndarray):
    """(pixel rows, grid) of uint8 frames [N, H, W, 3] (H, W multiples of patch * merge: no resize), as
    Qwen2VLVideoProcessor rescales, normalises and patchifies them (last frame repeated to an even count)."""
    x = (frames.astype(np.float32) / 255.0 - MEAN) / STD
    x = x.transpose(0, 3, 1, 2)
    if len(x) % 2:
        x = np.concatenate([x, x[-1:]])
    n, c, h, w = x.shape
    gt, gh, gw, p, m = n // 2, h // PATCH, w // PATCH, PATCH, MERGE
    x = x.reshape(gt, 2, c, gh // m, m, p, gw // m, m, p).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, c * 2 * p * p), np.array([gt, gh, gw])


def build(texts, images=(), videos=(), seconds=None) -> dict:
    """Processor-style batch from texts with "<image>" / "<video>" markers: images through the HF image
    processor, videos by hand; placeholders expanded to grid.prod() / merge^2 tokens (HF's replace_*_token)."""
    out = {}
    grids = {"<image>": [], "<video>": []}
    if images:
        ib = processor().image_processor(images=list(images), return_tensors="np")
        out.update(pixel_values=ib["pixel_values"], image_grid_thw=ib["image_grid_thw"])
        grids["<image>"] = list(ib["image_grid_thw"])
    if videos:
        px, gr = zip(*[video_pixels(v) for v in videos])
        out.update(pixel_values_videos=np.concatenate(px), video_grid_thw=np.stack(gr))
        grids["<video>"] = list(gr)
        if seconds is not None:
            out["second_per_grid_ts"] = np.asarray(seconds, np.float32)
    pads = {"<image>": "<|image_pad|>", "<video>": "<|video_pad|>"}
    expanded = []
    for t in texts:
        words = []
        for w in t.split():
            if w in pads:
                g = grids[w].pop(0)
                words.append("<|vision_start|>" + pads[w] * int(np.prod(g) // MERGE ** 2) + "<|vision_end|>")
            else:
                words.append(w)
        expanded.append(" ".join(words))
    enc = tokenizer()(expanded, padding=True, return_tensors="np")
    out.update(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
               mm_token_type_ids=np.array(processor().create_mm_token_type_ids(enc["input_ids"])))
    return out


def frames(n: int, h: int = 28, w: int = 42, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, h, w, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """({name: HF model}, {name: jspec model loaded from its checkpoint})."""
    root = tmp_path_factory.mktemp("qwen2_vl")
    return saved_and_loaded({"q2": tiny_q2(0), "q25": tiny_q25(10), "q25_draft": tiny_q25(
        20, hidden=32, layers=1, section=(2, 1, 1), depth=1, width=16, full=(0,))}, root)


@pytest.fixture(scope="module")
def hf_models(built):
    return built[0]


@pytest.fixture(scope="module")
def jx_models(built):
    return built[1]


def torch_batch(batch: dict) -> dict:
    return {k: torch.tensor(v) for k, v in batch.items()}


def hf_forward(hf, batch: dict, **kw):
    with torch.no_grad():
        return hf(**torch_batch(batch), **kw)


def assert_parity(hf, model, batch: dict):
    assert_masked_parity(hf, model, batch, atol=5e-5, rtol=1e-5)  # right padding


# ------------------------------------------------------------------------------------------ inputs (no models)


def test_hand_patchified_video_matches_image_processor():
    """A still 2-frame video patchified by hand equals the image processor's output for that frame (which
    repeats the frame over the temporal patch): the by-hand video path uses the processor's layout."""
    f = frames(1, seed=3)
    px, grid = video_pixels(np.concatenate([f, f]))
    ib = processor().image_processor(images=[Image.fromarray(f[0])], return_tensors="np")
    np.testing.assert_array_equal(grid, ib["image_grid_thw"][0])
    np.testing.assert_allclose(px, ib["pixel_values"], atol=1e-6)


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl"])
def test_rope_index_matches_transformers(hf_models, jx_models, model_type):
    """Our host get_rope_index == HF's on rows mixing images, videos (t > max(h, w) / merge, where transformers
    5.23's rule differs from 4.x) and text, ragged with left padding, with float32 and float64
    second_per_grid_ts whose products are not integers."""
    hf = hf_models["q2" if model_type == "qwen2_vl" else "q25"]
    cfg = jx_models["q2" if model_type == "qwen2_vl" else "q25"].config
    batch = build(["w1 <image> w2 w3 <video> w4", "w5 <video> w6 <image> <image> w7 w8 w9 w10 w11 w12 w13"],
                  images=[image(40, 90, 1), image(50, 30, 2), image(28, 28, 3)],
                  videos=[frames(8), frames(3, 56, 28, seed=1)])
    left = {k: v for k, v in batch.items()}
    ids, am = batch["input_ids"], batch["attention_mask"]
    n = am.sum(1)
    left["input_ids"] = np.stack([np.roll(r, len(r) - k) for r, k in zip(ids, n)])
    left["attention_mask"] = np.stack([np.roll(r, len(r) - k) for r, k in zip(am, n)])
    left["mm_token_type_ids"] = np.stack([np.roll(r, len(r) - k) for r, k in zip(batch["mm_token_type_ids"], n)])
    for seconds in (None, np.array([1 / 3, 0.75], np.float32), np.array([1 / 3, 0.7], np.float64)):
        kw = {} if seconds is None or model_type == "qwen2_vl" else {"second_per_grid_ts": torch.tensor(seconds)}
        with torch.no_grad():
            ref, ref_delta = hf.model.get_rope_index(
                torch.tensor(left["input_ids"]), torch.tensor(left["mm_token_type_ids"]),
                image_grid_thw=torch.tensor(batch["image_grid_thw"]),
                video_grid_thw=torch.tensor(batch["video_grid_thw"]),
                attention_mask=torch.tensor(left["attention_mask"]),
                **kw)
        inputs = {k: batch[k] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")}
        if kw:
            inputs["second_per_grid_ts"] = seconds
        prep = QW.prepare_inputs(cfg, ids, n, inputs)
        for b in range(2):
            want = ref[:, b].numpy()[:, left["attention_mask"][b].astype(bool)]
            np.testing.assert_array_equal(prep["mrope_positions"][:, b, :n[b]], want)
        np.testing.assert_array_equal(prep["mrope_offset"], ref_delta.numpy().reshape(-1))
    # the video (4 temporal groups, 2 x 3 merged) really takes 5.23's rule: the token after it sits at
    # start + max(h, w) / merge, not past the video's temporal ids as in transformers 4.x; and float32 vs float64
    # seconds really round differently here
    at = np.flatnonzero(ids[0] == VID)
    pos = prep["mrope_positions"][:, 0]
    assert pos[1, at[0]] + 3 == pos[0, at[-1] + 1]  # 4.x: start + 4 for Qwen2-VL (t ids run to start + 3)
    if model_type == "qwen2_5_vl":  # 45 * (2 * 0.7): 63 in float32, 62.99999999999999 -> 62 in float64
        got = {}
        for dt in (np.float32, np.float64):
            got[dt] = QW._vision_ids(cfg, (46, 2, 2), 0, QW._interval(cfg, dt(0.7)))
            ref = hf.model.get_vision_position_ids(0, torch.tensor([46, 2, 2]), 1, MERGE,
                                                   2 * torch.tensor(dt(0.7)))
            np.testing.assert_array_equal(got[dt], ref.numpy())
        assert not np.array_equal(got[np.float32], got[np.float64])


# ------------------------------------------------------------------------------------------ vision tower


@pytest.mark.parametrize("name", ["q2", "q25"])
def test_vision_tower_and_features_match_transformers(hf_models, jx_models, name, monkeypatch):
    """Merged features (spliced into the prompt) and the pre-merger hook equal HF's tower on two images of
    different sizes and a video; Qwen2.5's window layers are real (treating them as full attention breaks it); the
    frames encoded a few at a time give the same features."""
    hf, m = hf_models[name], jx_models[name]
    cfg = m.config
    batch = build(["w1 <image> w2 <image> w3 <video> w4"], images=[image(40, 90, 4), image(50, 30, 5)],
                  videos=[frames(4, seed=6)])
    ids = batch["input_ids"].astype(np.int32)
    prep = QW.prepare_inputs(cfg, ids, np.array([ids.shape[1]]),
                             {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask")})
    pe = jax.jit(lambda p, i: QW.prompt_embeds(cfg, p, ids, i))(m.params, prep)
    grids = np.concatenate([batch["image_grid_thw"], batch["video_grid_thw"]])
    pix = np.concatenate([batch["pixel_values"], batch["pixel_values_videos"]])
    with torch.no_grad():
        out = hf.model.visual(torch.tensor(pix), grid_thw=torch.tensor(grids))
    mask = np.asarray(pe.image_mask[0])
    np.testing.assert_array_equal(mask, np.isin(ids[0], [IMG, VID]))
    np.testing.assert_allclose(np.asarray(pe.embeds[0])[mask], out.pooler_output.numpy(), atol=2e-5)
    hidden = out.last_hidden_state.numpy()
    if name == "q25":  # HF leaves the last hidden state in window order (groups of merge^2 patches)
        from transformers.vision_utils import get_vision_window_index
        win, _ = get_vision_window_index(torch.tensor(grids), MERGE, 28, PATCH)
        hidden = hidden.reshape(-1, 4, hidden.shape[-1])[np.argsort(win.numpy())].reshape(hidden.shape)
    n = hidden.shape[0]
    np.testing.assert_allclose(np.asarray(pe.vision_features[:n]), hidden, atol=2e-5)
    if name == "q25":
        import dataclasses
        full = dataclasses.replace(cfg.vision, fullatt_blocks=tuple(range(cfg.vision.depth)))
        vo = QV.forward(full, m.params["vision"], prep["vision_patches"], prep["vision_rot"], prep["vision_valid"],
                        prep["vision_window_index"], prep["vision_window_slot"])
        assert np.abs(np.asarray(vo.hidden).reshape(-1, hidden.shape[-1])[prep["vision_patch_index"][:n]]
                      - hidden).max() > 1e-2
    monkeypatch.setattr(LY, "VISION_BATCH", 3)  # the 4 frames in batches of 3 (one padded): the same features
    pe3 = jax.jit(lambda p, i: QW.prompt_embeds(cfg, p, ids, i))(m.params, prep)
    np.testing.assert_allclose(np.asarray(pe3.embeds), np.asarray(pe.embeds), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(pe3.vision_features), np.asarray(pe.vision_features), atol=1e-5, rtol=1e-5)


def test_window_layers_attend_inside_gathered_windows():
    """Qwen2.5-VL's window layers gather each window's patches and attend inside them: the same output as one
    masked [L, L] product per frame (query and key in the same window), on frames of other sizes, with padding,
    with windows cut at the frame's edges; a 112-pixel window (8 x 8 patches) holds at most 64 patches."""
    cfg = QV.QwenVisionConfig("qwen2_5_vl", depth=1, width=16, mlp_dim=24, num_heads=2, out_dim=16,
                              hidden_act="silu", patch_size=PATCH, merge_size=MERGE, window_size=28)
    assert cfg.window_blocks == 2
    sizes = [(6, 12), (10, 10), (4, 2)]  # 2 x 3 windows; 3 x 3 with 16-, 8- and 4-patch ones; one window
    lay = QV.frame_layout(cfg, [(np.zeros((h * w, cfg.patch_dim), np.float32), (1, h, w)) for h, w in sizes])
    F, Lp = lay.valid.shape
    ids = np.full((F, Lp), -1)
    for f, (h, w) in enumerate(sizes):
        ids[f, :h * w] = QV.frame_windows(cfg, QV.frame_rot(cfg, h, w), w)
    assert lay.window_index.shape[1:] == (QV.ANY.bucket(9), 16)  # 9 windows, bucketed
    # every patch is in exactly one window slot, and reads itself back
    flat = lay.window_index.reshape(F, -1)
    np.testing.assert_array_equal(np.take_along_axis(flat, lay.window_slot, 1)[lay.valid],
                                  np.broadcast_to(np.arange(Lp), (F, Lp))[lay.valid])
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(F, Lp, 2, 8)), jnp.float32) for _ in range(3))
    got = QV.window_attention(q, k, v, jnp.asarray(lay.window_index), jnp.asarray(lay.window_slot))
    mask = (ids[:, :, None] == ids[:, None, :]) & (ids[:, None, :] >= 0)
    want = LY.attention(q, LY.kv_rows(k), LY.kv_rows(v), jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(got)[lay.valid], np.asarray(want)[lay.valid], atol=1e-6, rtol=1e-6)
    big = dataclasses.replace(cfg, patch_size=14, window_size=112)
    assert QV.frame_layout(big, [(np.zeros((52 * 92, big.patch_dim), np.float32), (1, 52, 92))]
                           ).window_index.shape[1:] == (QV.ANY.bucket(7 * 12), 64)


# ------------------------------------------------------------------------------------------ logits parity

CASES = {
    "one_image": lambda: build(["w1 w2 <image> w3 w4"], images=[image(40, 90, 1)]),
    "two_images_of_different_sizes": lambda: dict(processor()(
        text=["w1 <|vision_start|><|image_pad|><|vision_end|> w5 <|vision_start|><|image_pad|><|vision_end|> w6"],
        images=[image(40, 90, 2), image(50, 30, 3)], return_tensors="np")),
    "video": lambda: build(["w1 <video> w2 w3"], videos=[frames(8, seed=4)], seconds=[0.75]),
    "text_only": lambda: build(["w1 w2 w3 w4 w5 w6 w7"]),
    "batch_of_two": lambda: build(["w1 <image> w2", "w3 w4 <video> w5 <image> w6 w7 w8"],
                                  images=[image(40, 90, 5), image(60, 30, 6)], videos=[frames(5, 28, 56, seed=7)],
                                  seconds=[0.5]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("name", ["q2", "q25"])
def test_logits_match_transformers(hf_models, jx_models, name, case):
    batch = CASES[case]()
    if name == "q2":
        batch.pop("second_per_grid_ts", None)
    assert_parity(hf_models[name], jx_models[name], batch)


# ------------------------------------------------------------------------------------------ decoding


def hf_generate(hf, batch: dict, n: int) -> np.ndarray:
    with torch.no_grad():
        out = hf.generate(**torch_batch(batch), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out.numpy()[:, batch["input_ids"].shape[1]:]


@pytest.mark.parametrize("name,case", [("q2", "image"), ("q25", "image"), ("q25", "video")])
def test_greedy_decode_equals_hf_generate(hf_models, jx_models, name, case):
    batch = (build(["w3 w1 <image> w2 w7"], images=[image(40, 90, 11)]) if case == "image" else
             build(["w3 <video> w2 w7"], videos=[frames(8, seed=12)], seconds=[0.75]))
    ref = hf_generate(hf_models[name], batch, 10)
    out = jspec.decode(jx_models[name], batch, max_new_tokens=10)
    np.testing.assert_array_equal(out.tokens[0], ref[0])


def sd_batch():
    return build(["w1 <image> w2", "w3 w4 <video> w5 w6 w8"], images=[image(40, 90, 13)],
                 videos=[frames(8, seed=14)], seconds=[0.75])


SMALL_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]


def test_greedy_chain_and_tree_sd_equal_ar(jx_models):
    """A Qwen2.5-VL target with a smaller Qwen2.5-VL draft (its own tower, its own M-RoPE sections) on a ragged
    image / video batch: Chain and Tree give greedy AR's tokens (SAGE in its own test); per-row prompts alone
    give the same."""
    target, draft = jx_models["q25"], jx_models["q25_draft"]
    batch = sd_batch()
    ar = jspec.decode(target, batch, max_new_tokens=12)
    for strategy in (jspec.Chain(draft, gamma=3), jspec.Tree(draft, tree=SMALL_TREE)):
        sd = jspec.decode(target, batch, strategy=strategy, max_new_tokens=12)
        np.testing.assert_array_equal(sd.tokens, ar.tokens)
    # the self-draft (target as its own draft) accepts everything: tree positions are right in the target cache
    self_sd = jspec.decode(target, batch, strategy=jspec.Tree(target, tree=SMALL_TREE), max_new_tokens=12)
    np.testing.assert_array_equal(self_sd.tokens, ar.tokens)
    assert np.all(self_sd.stats["mean_accepted"] > 3.0)
    video_row = build(["w3 w4 <video> w5 w6 w8"], videos=[frames(8, seed=14)], seconds=[0.75])
    alone = jspec.decode(target, video_row, max_new_tokens=12)
    np.testing.assert_array_equal(alone.tokens[0], ar.tokens[1])


@pytest.mark.parametrize("prune", [0.5, pytest.param(None, marks=pytest.mark.slow)], ids=["pruned", "full"])
def test_greedy_sage_equals_ar(jx_models, prune):
    """SAGE's per-row trees over the same Qwen2.5-VL pair and ragged image / video batch give greedy AR's tokens, with
    the draft's video tokens pruned (the paper's setting) or not; the engine drafts the trees it planned."""
    target, draft = jx_models["q25"], jx_models["q25_draft"]
    batch = sd_batch()
    ar = jspec.decode(target, batch, max_new_tokens=10)
    sage = jspec.SAGE(draft, d_min=2, d_max=4, k=4, w_max=4, n_max=16, init_tree=[[0], [1], [0, 0], [1, 0], [0, 0, 0]],
                      prune_ratio=prune)
    sd = jspec.decode(target, batch, strategy=sage, max_new_tokens=10)
    np.testing.assert_array_equal(sd.tokens, ar.tokens)
    st = sd.stats
    assert st["drafted"].tolist() == [int(st["nodes"][b, :n].sum()) for b, n in enumerate(st["steps"])]


# ------------------------------------------------------------------------------------------ pruned drafts


def _keep(batch, seed=0, frac=0.5):
    n = int(np.isin(batch["input_ids"][batch["attention_mask"].astype(bool)], [IMG, VID]).sum())
    keep = np.random.default_rng(seed).random(n) < frac
    keep[:2] = True
    return keep


def _embeds_and_positions(m, batch):
    tokens = batch["input_ids"].astype(np.int32)
    lengths = batch["attention_mask"].sum(1)
    prep = QW.prepare_inputs(m.config, tokens, lengths,
                             {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask")})
    pe = QW.prompt_embeds(m.config, m.params, jnp.asarray(tokens), prep)
    return tokens, lengths, pe


def test_pruned_prompt_original_positions(jx_models):
    """Original ids: the pruned draft prefill's logits equal the full prompt's with the pruned tokens hidden
    (the kept tokens depend only on kept tokens and their original ids); keeping all is the full prompt; decoding
    continues where the full prompt does."""
    m = jx_models["q25"]
    batch = sd_batch()
    keep = _keep(batch)
    pruned = QW.prune_prompt(m.config, batch, keep, positions="original")
    assert pruned["input_ids"].shape[1] < batch["input_ids"].shape[1]
    ours = ports.logits(m, pruned)
    tokens, lengths, pe = _embeds_and_positions(m, batch)
    B, T = tokens.shape
    stay = ~np.asarray(pe.image_mask)
    stay[np.asarray(pe.image_mask)] = keep
    for b in range(B):
        stay[b, lengths[b]:] = False
    mask = np.tril(np.ones((T, T), bool))[None] & stay[:, None, :]
    cache = PR.new_cache_for(m, B, T)
    ref = np.asarray(m.forward(tokens, pe.positions, cache, jnp.asarray(mask), embeds=pe.embeds).logits)
    for b in range(B):
        d = int(pruned["attention_mask"][b].sum())
        np.testing.assert_allclose(ours[b, :d], ref[b][stay[b]], atol=5e-5, rtol=1e-5)
        full_next = lengths[b] + np.asarray(pe.position_offset)[b]
        assert d + pruned["rope_deltas"][b] == full_next
    everything = QW.prune_prompt(m.config, batch, np.ones_like(keep), positions="original")
    np.testing.assert_allclose(ports.logits(m, everything)[batch["attention_mask"].astype(bool)],
                               ports.logits(m, batch)[batch["attention_mask"].astype(bool)], atol=1e-6)


def test_pruned_prompt_renumbered_positions(jx_models):
    """Renumbered: the pruned prefill equals a prompt of only the kept tokens (their embeddings) at plain
    positions 0..D-1, and differs from the original-position prefill."""
    m = jx_models["q25"]
    batch = sd_batch()
    keep = _keep(batch, seed=1)
    pruned = QW.prune_prompt(m.config, batch, keep, positions="renumbered")
    ours = ports.logits(m, pruned)
    tokens, lengths, pe = _embeds_and_positions(m, batch)
    vis = np.asarray(pe.image_mask)
    stay = ~vis
    stay[vis] = keep
    for b in range(tokens.shape[0]):
        idx = np.flatnonzero(stay[b, :lengths[b]])
        d = len(idx)
        emb = pe.embeds[b:b + 1, idx]
        cache = PR.new_cache_for(m, 1, d)
        ref = m.forward(None, jnp.arange(d)[None], cache, embeds=emb).logits
        np.testing.assert_allclose(ours[b, :d], np.asarray(ref[0]), atol=5e-5, rtol=1e-5)
        assert pruned["rope_deltas"][b] == 0
    orig = ports.logits(m, QW.prune_prompt(m.config, batch, keep, positions="original"))
    assert np.abs(orig[0, 5:8] - ours[0, 5:8]).max() > 1e-3


@pytest.mark.parametrize("mode", ["original", "renumbered"])
def test_sd_with_pruned_draft_prompt_equals_ar(jx_models, mode):
    """SpecVLM-style: the draft prefilled on a pruned prompt (keep mask given as [B, T] positions), greedy Tree SD
    still gives the target's greedy tokens."""
    target, draft = jx_models["q25"], jx_models["q25_draft"]
    batch = sd_batch()
    vis = np.isin(batch["input_ids"], [IMG, VID]) & batch["attention_mask"].astype(bool)
    keep_bt = vis & (np.random.default_rng(2).random(vis.shape) < 0.4)
    pruned = QW.prune_prompt(draft.config, batch, keep_bt, positions=mode)
    assert pruned["vision_keep"].sum() == keep_bt.sum()
    ar = jspec.decode(target, batch, max_new_tokens=10)
    sd = jspec.decode(target, batch, strategy=jspec.Tree(draft, tree=SMALL_TREE), max_new_tokens=10,
                      draft_prompt=pruned)
    np.testing.assert_array_equal(sd.tokens, ar.tokens)


# ------------------------------------------------------------------------------------------ hooks


def test_hooks_grid_table_and_attention_scores(hf_models, jx_models):
    """vision_grid_pos gives each placeholder's (item, frame, row, col), consistent with the M-RoPE ids HF
    assigns; the language-to-vision attention hook equals HF eager attentions."""
    hf, m = hf_models["q2"], jx_models["q2"]
    batch = build(["w1 <image> w2 <video> w3 w4 w5 w6"], images=[image(40, 90, 15)], videos=[frames(6, seed=16)])
    tokens, lengths, pe = _embeds_and_positions(m, batch)
    gp = np.asarray(pe.vision_grid_pos[0])
    pos = np.asarray(pe.positions[:, 0])
    ids = tokens[0]
    for tok, item, grid in ((IMG, 0, batch["image_grid_thw"][0]), (VID, 1, batch["video_grid_thw"][0])):
        at = ids == tok
        t, lh, lw = grid[0], grid[1] // MERGE, grid[2] // MERGE
        k = np.arange(t * lh * lw)
        np.testing.assert_array_equal(gp[at], np.stack([np.full_like(k, item), k // (lh * lw), k % (lh * lw) // lw,
                                                        k % lw], -1))
        start = pos[1][at].min()
        np.testing.assert_array_equal(pos[:, at] - start, gp[at][:, 1:].T)  # Qwen2-VL: t id step 1
    assert np.all(gp[~np.isin(ids, [IMG, VID])] == -1)

    T = tokens.shape[1]
    last = int(np.flatnonzero(np.isin(ids, [IMG, VID]))[-1])
    weights = (np.arange(T) > last).astype(np.float32)
    weights /= weights.sum()
    cache = PR.new_cache_for(m, 1, T + 16)
    fo = m.forward(tokens, pe.positions, cache, embeds=pe.embeds, attn_query_weights=jnp.asarray(weights[None]))
    ref = weights @ eager_attentions(hf, batch)[:, 0].mean(axis=(0, 1))
    np.testing.assert_allclose(np.asarray(fo.attn[0, :T]), ref, atol=1e-5)


# ------------------------------------------------------------------------------------------ checkpoints, config


def _in_memory_name(key: str) -> str:
    for old, new in (("visual.", "model.visual."), ("model.", "model.language_model.")):
        if key.startswith(old):
            return new + key[len(old):]
    return key


@pytest.mark.parametrize("name", ["q2", "q25"])
def test_in_memory_key_layout_loads(hf_models, jx_models, tmp_path, name):
    """transformers 5 writes `visual.*` / `model.layers.*` to disk; its in-memory names (`model.visual.*`,
    `model.language_model.*`, as `state_dict()` gives them) load too, to the same params."""
    hf_models[name].save_pretrained(str(tmp_path))
    path = os.path.join(tmp_path, "model.safetensors")
    tensors = safetensors.numpy.load_file(path)
    assert "visual.merger.mlp.0.weight" in tensors and "model.layers.0.self_attn.q_proj.bias" in tensors
    renamed = {_in_memory_name(k): v for k, v in tensors.items()}
    assert set(renamed) == set(hf_models[name].state_dict())
    os.remove(path)
    safetensors.numpy.save_file(renamed, path)
    loaded = ports.load_hf(str(tmp_path))
    assert loaded.config == jx_models[name].config
    jax.tree.map(np.testing.assert_array_equal, loaded.params, jx_models[name].params)
    tensors = {k: v for k, v in renamed.items() if "merger.ln_q" not in k}
    safetensors.numpy.save_file(tensors, path)
    with pytest.raises(ValueError, match="missing keys.*merger.ln_q"):
        ports.load_hf(str(tmp_path))


@pytest.mark.parametrize("name", ["q2", "q25"])
def test_save_hf_round_trip(hf_models, jx_models, tmp_path, name):
    """Params and config_to_hf (no stored HF config) back to a checkpoint transformers loads, same logits."""
    m = jx_models[name]
    ports.save_hf(ports.Model(m.config, m.params), str(tmp_path))
    cls = type(hf_models[name])
    back = cls.from_pretrained(str(tmp_path)).eval()
    assert back.config.text_config.rope_parameters["mrope_section"] == [2, 2, 2]
    batch = CASES["batch_of_two"]()
    if name == "q2":
        batch.pop("second_per_grid_ts")
    np.testing.assert_allclose(hf_forward(back, batch).logits.numpy(),
                               hf_forward(hf_models[name], batch).logits.numpy(), atol=1e-5)
    assert ports.load_hf(str(tmp_path)).config == m.config


@pytest.mark.parametrize("cls", [transformers.Qwen2VLConfig, transformers.Qwen2_5_VLConfig],
                         ids=lambda c: c.model_type)
def test_config_spellings_and_defaults_are_hfs(cls):
    """Sparse, nested (transformers 5) and flat (older hub: text fields at the top, rope_scaling with type mrope,
    rope_theta, in_chans) configs parse as HF fills them in; tied embeddings as HF decides; config_to_hf round
    trips."""
    mt = cls.model_type
    full = QW.config_from_hf(cls().to_dict())
    assert QW.config_from_hf({"model_type": mt}) == full
    assert full.mrope_section == (16, 24, 24) and full.text.rope.theta == 1e6 and full.text.head_dim == 128
    assert (full.image_token_id, full.video_token_id) == (151655, 151656)
    text = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 120, "rms_norm_eps": 1e-6, "rope_theta": 50000.0,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}
    vision = {"depth": 2, "num_heads": 4, "in_chans": 3, "patch_size": 14, "spatial_merge_size": 2}
    vision |= {"embed_dim": 32, "hidden_size": 64, "mlp_ratio": 2} if mt == "qwen2_vl" else {
        "hidden_size": 32, "out_hidden_size": 64, "intermediate_size": 48}
    flat = QW.config_from_hf({"model_type": mt, **text, "vision_config": vision})
    hf = cls(**text, vision_config=vision)
    assert QW.config_from_hf(hf.to_dict()) == flat
    assert flat.text.rope.theta == 50000.0 and flat.mrope_section == (2, 3, 3) and flat.text.hidden_size == 64
    assert QW.config_from_hf(QW.config_to_hf(flat)) == flat
    for top in (False, True):
        for text_tie in (False, True):
            d = {"text_config": dict(text, tie_word_embeddings=text_tie), "tie_word_embeddings": top,
                 "vision_config": vision}
            assert QW.config_from_hf({"model_type": mt, **d}).tie_word_embeddings == cls(**d).tie_word_embeddings


# ------------------------------------------------------------------------------------------ bad inputs


def test_bad_inputs_fail_early_with_clear_errors(jx_models):
    m, m2 = jx_models["q25"], jx_models["q2"]
    batch = build(["w1 <image> w2 <image> w3"], images=[image(40, 90, 17), image(50, 30, 18)])
    ids, pv, grid = batch["input_ids"], batch["pixel_values"], batch["image_grid_thw"]
    first = int(np.flatnonzero(ids[0] == IMG)[0])
    drop_one = np.delete(ids, first, axis=1)
    swapped = grid[::-1].copy()  # same token total, but each run meets the other image's grid
    cases = [
        ({"input_ids": ids, "pixel_values": pv[:-4], "image_grid_thw": grid},
         r"pixel_values holds 100 patches but image_grid_thw \[\[1, 6, 12\], \[1, 8, 4\]\] describes 104"),
        ({"input_ids": drop_one, "pixel_values": pv, "image_grid_thw": grid},
         r"prompt has 25 image tokens \(id 95\) but image_grid_thw \[\[1, 6, 12\], \[1, 8, 4\]\] take 26"),
        ({"input_ids": ids, "pixel_values": pv}, "pixel_values given without image_grid_thw"),
        ({"input_ids": ids}, r"prompt has 26 image tokens \(id 95\) but no image_grid_thw"),
        ({"input_ids": ids, "pixel_values": pv[:, :100], "image_grid_thw": grid}, r"expects \(num_patches, 294\)"),
        ({"input_ids": ids, "pixel_values": pv, "image_grid_thw": swapped}, "a run of 18 image tokens"),
        ({"input_ids": ids, "pixel_values": pv, "image_grid_thw": grid + [[0, 1, 0], [0, 0, 0]]},
         "multiples of spatial_merge_size=2"),
        ({**batch, "second_per_grid_ts": np.array([1.0])}, "second_per_grid_ts given without videos"),
        ({**batch, "vision_keep": np.ones(26, bool)}, "vision_keep needs position_ids"),
        ({**batch, "mm_token_type_ids": np.zeros_like(ids)}, "mm_token_type_ids mark 0 image"),
        ({**batch, "image_sizes": np.array([[40, 90]])}, r"unsupported \['image_sizes'\]"),
    ]
    for prompt, msg in cases:
        with pytest.raises(ValueError, match=msg):
            jspec.decode(m, prompt, max_new_tokens=2)
    vb = build(["w1 <video> w2"], videos=[frames(4)], seconds=[0.5, 0.5])
    with pytest.raises(ValueError, match="second_per_grid_ts has 2 entries for 1 video"):
        jspec.decode(m, vb, max_new_tokens=2)
    # inputs prepared for another tower geometry are refused at trace time, not misread
    prep = QW.prepare_inputs(m.config, ids, np.array([ids.shape[1]]), {"pixel_values": pv, "image_grid_thw": grid})
    with pytest.raises(ValueError, match="another model's layout"):
        QW.prompt_embeds(m2.config, m2.params, ids, prep)
    with pytest.raises(ValueError, match="takes the output of its prepare_inputs"):
        QW.prompt_embeds(m.config, m.params, ids, {"pixel_values": pv})
    with pytest.raises(ValueError, match="keep has 3 entries; the prompt has 26 vision tokens"):
        QW.prune_prompt(m.config, batch, np.ones(3, bool))
    with pytest.raises(ValueError, match="positions must be one of"):
        QW.prune_prompt(m.config, batch, np.ones(26, bool), positions="sequential")


def test_a_scanned_qwen25_vl_target_decodes_the_same_tokens(jx_models):
    """`ports.scan_layers` on a Qwen2.5-VL target (M-RoPE tables into the LLaMA forward, its layers as one scan):
    greedy AR's tokens on the ragged image / video batch."""
    target = jx_models["q25"]
    batch = sd_batch()
    ar = jspec.decode(target, batch, max_new_tokens=8)
    scanned = jspec.decode(ports.scan_layers(target), batch, max_new_tokens=8)
    np.testing.assert_array_equal(scanned.tokens, ar.tokens)
