"""Chameleon port (ports.families.chameleon) matches transformers' ChameleonForConditionalGeneration on tiny random configs:
text and image prompts, both norm placements, the image-token vocabulary and logit suppression, the KV cache,
load_hf / save_hf in both directions, Lumina-mGPT's own QK-norm layout ([model_parallel_size, head_dim] rows) in and
out, and clear errors for bad input."""
import dataclasses
import functools
import json
import pathlib
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.numpy import save_file

import ports
from ports.core import cache as kvc
from ports.families import chameleon as CH
from ports.families import vqgan as VQ
from conftest import perturb

V, K = 96, 32  # vocabulary, codebook
IMG0 = 40  # BPE id of VQ code 0 (codes occupy 40..71, like Chameleon's 4..8195)
PLACEHOLDER, BOI, EOI, NEWLINE, SIZE0 = 3, 4, 5, 6, 7
VQ_CFG = dict(embed_dim=8, num_embeddings=K, latent_channels=32, resolution=16, base_channels=32,
              channel_multiplier=[1, 1, 2], num_res_blocks=1, attn_resolutions=[8])  # f = 4: 16x16 -> 16 tokens


def vocab_map() -> dict:
    vm = {f"tok{i}": i for i in range(V)}
    for name, i in (("<image>", PLACEHOLDER), ("<racm3:break>", BOI), ("<eoss>", EOI),
                    ("<reserved08799>", NEWLINE), ("<reserved08800>", SIZE0)):
        del vm[f"tok{i}"]
        vm[name] = i
    for c in range(K):  # IMGIMG + digits written A..J + Z, as in Chameleon's tokenizer
        del vm[f"tok{IMG0 + c}"]
        vm["IMGIMG" + "".join("ABCDEFGHIJ"[int(d)] for d in str(c)) + "Z"] = IMG0 + c
    return vm


def hf_config(**over) -> transformers.ChameleonConfig:
    base = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, attention_bias=True, vq_config=VQ_CFG, vocabulary_map=vocab_map(),
                bos_token_id=None, eos_token_id=None, pad_token_id=None)
    base.update(over)
    return transformers.ChameleonConfig(**base)


@functools.lru_cache(maxsize=None)
def pair(swin: bool, directory: str):
    """(perturbed HF model, jspec model loaded from its save_pretrained directory)."""
    torch.manual_seed(0)
    hf = perturb(transformers.ChameleonForConditionalGeneration(hf_config(swin_norm=swin)).eval(), seed=1)
    hf.save_pretrained(directory)
    return hf, ports.load_hf(directory)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return lambda swin=False: pair(swin, str(tmp_path_factory.getbasetemp() / f"chameleon_swin{int(swin)}"))


def text_tokens(b=2, t=20, seed=0):
    return np.random.default_rng(seed).integers(8, IMG0, (b, t))


def image_prompt(seed=0):
    """Two rows, each text + <racm3:break> + 16 placeholders + <eoss> + text, and two different images."""
    txt = text_tokens(2, 9, seed)
    ids = np.concatenate([txt[:, :5], np.full((2, 1), BOI), np.full((2, 16), PLACEHOLDER), np.full((2, 1), EOI),
                          txt[:, 5:]], axis=1)
    px = np.random.default_rng(seed + 1).uniform(-1, 1, (2, 3, 16, 16)).astype(np.float32)
    return ids, px


def split_masked(ref):
    fin = ref > np.finfo(np.float32).min / 2
    return fin, ~fin


def test_config_and_vocabulary(models):
    hf, model = models()
    cfg = model.config
    assert isinstance(cfg, CH.ChameleonConfig) and cfg.model_type == "chameleon"
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.qkv_bias, cfg.o_bias, cfg.swin_norm) == (8, 2, True, True, False)
    assert cfg.image_token_ids == tuple(range(IMG0, IMG0 + K))
    assert (cfg.image_token_id, cfg.image_start_token_id, cfg.image_end_token_id, cfg.image_newline_token_id,
            cfg.size_token_base) == (PLACEHOLDER, BOI, EOI, NEWLINE, SIZE0)
    assert cfg.suppress_image_logits and cfg.vq == VQ.vq_config_from_hf(VQ_CFG)
    # the mapping is HF's, in both directions
    vm = hf.model.vocabulary_mapping
    assert [vm.img2bpe[c] for c in range(K)] == list(cfg.image_token_ids)
    ids = np.array([[0, IMG0, IMG0 + 13, IMG0 + K - 1, EOI]])
    np.testing.assert_array_equal(np.asarray(CH.bpe_to_codes(cfg, ids)), [[-1, 0, 13, K - 1, -1]])
    np.testing.assert_array_equal(np.asarray(CH.codes_to_bpe(cfg, np.array([31, 0, 5]))), [IMG0 + 31, IMG0, IMG0 + 5])
    assert np.flatnonzero(CH.image_logit_mask(cfg)).tolist() == sorted(vm.image_tokens)
    # our HF dict builds the same transformers config, which parses back to the same config
    back = transformers.ChameleonConfig(**CH.config_to_hf(cfg))
    assert CH.config_from_hf(back.to_dict()) == cfg
    # Lumina-mGPT's config key turns the suppression off
    assert not CH.config_from_hf({**hf.config.to_dict(), "mask_image_logits": False}).suppress_image_logits


@pytest.mark.parametrize("swin", [False, True])
def test_text_logits_match_transformers(models, swin):
    hf, model = models(swin)
    assert model.config.swin_norm == swin
    tokens = text_tokens()
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)).logits.numpy()
    ours = ports.logits(model, tokens)
    assert ours.shape == ref.shape == (2, 20, V)
    fin, masked = split_masked(ref)
    np.testing.assert_allclose(ours[fin], ref[fin], rtol=1e-4, atol=1e-4)
    # HF suppresses exactly the image-code tokens (not <racm3:break> / <eoss>), with float32 min
    assert (masked.sum(-1) == K).all() and masked[..., IMG0:IMG0 + K].all()
    assert (ours[masked] == np.finfo(np.float32).min).all()
    assert np.abs(ref[fin]).max() > 1.0
    # the QK-norm biases matter at this scale: dropping them moves the logits far beyond the tolerance
    p = jax.tree.map(lambda a: a, model.params)
    for layer in p["layers"]:
        layer["q_norm_b"] = jnp.zeros_like(layer["q_norm_b"])
    off = ports.logits(dataclasses.replace(model, params=p), tokens)
    assert np.abs(off[fin] - ref[fin]).max() > 1e-2


def test_unsuppressed_logits_are_the_lm_head(models):
    """suppress_image_logits=False (image generation) gives the raw LM-head logits HF computes before masking."""
    hf, model = models()
    tokens = text_tokens(seed=1)
    with torch.no_grad():
        raw = hf.lm_head(hf.model(torch.tensor(tokens)).last_hidden_state).numpy()
    free = dataclasses.replace(model, config=dataclasses.replace(model.config, suppress_image_logits=False))
    ours = ports.logits(free, tokens)
    np.testing.assert_allclose(ours, raw, rtol=1e-4, atol=1e-4)
    assert np.isfinite(ours[..., IMG0:IMG0 + K]).all()


def test_image_prompt_matches_transformers(models):
    """Image -> VQ codes (our encoder) -> BPE ids in place of the placeholders -> LM, batch 2, equals HF's forward
    with pixel_values; the image tokens equal HF's get_image_tokens."""
    hf, model = models()
    ids, px = image_prompt()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids), pixel_values=torch.tensor(px)).logits.numpy()
        hf_img = hf.model.get_image_tokens(torch.tensor(px)).numpy()
        hf_codes = hf.model.vqmodel.encode(torch.tensor(px)).image_tokens.numpy()
    cfg = model.config
    codes = np.asarray(VQ.encode_jit(cfg.vq, model.params["vqmodel"], px))
    np.testing.assert_array_equal(codes.reshape(-1), hf_codes)
    img = np.asarray(jax.jit(CH.image_tokens, static_argnums=0)(cfg, model.params, px))
    np.testing.assert_array_equal(img, hf_img)
    assert img.shape == (2, 16) and len(np.unique(img)) > 4 and (img[0] != img[1]).any()
    ours = ports.logits(model, {"input_ids": ids, "pixel_values": px})
    fin, masked = split_masked(ref)
    np.testing.assert_allclose(ours[fin], ref[fin], rtol=1e-4, atol=1e-4)
    assert (ours[masked] == np.finfo(np.float32).min).all()
    # the same as feeding the merged token ids as a plain text prompt
    merged = np.asarray(CH.merge_image_tokens(cfg, jnp.asarray(ids), jnp.asarray(img)))
    assert (merged[:, 6:22] == img).all() and (merged[:, :6] == ids[:, :6]).all()
    np.testing.assert_allclose(ports.logits(model, merged), ours, rtol=1e-5, atol=1e-5)
    # and the image changes the logits after it (the comparison is not image-blind)
    other = ports.logits(model, {"input_ids": ids, "pixel_values": px[::-1].copy()})
    assert np.abs(other[0, -1] - ours[0, -1])[fin[0, -1]].max() > 1e-2


def test_incremental_decoding_equals_full_forward(models):
    _, model = models(True)
    tokens = jnp.asarray(text_tokens(2, 14, seed=2))
    fwd = jax.jit(lambda m, t, pos, c: m.forward(t, pos, c))
    full = np.asarray(fwd(model, tokens, jnp.broadcast_to(jnp.arange(14), (2, 14)),
                          kvc.init_cache(2, 2, 2, 14, 8, jnp.float32)).logits)
    cache = kvc.init_cache(2, 2, 2, 16, 8, jnp.float32)
    got = []
    for a, b in [(0, 7), (7, 8), (8, 11), (11, 12), (12, 13), (13, 14)]:  # prefill, single tokens, a chunk of 3
        pos = jnp.broadcast_to(jnp.arange(a, b), (2, b - a))
        fo = fwd(model, tokens[:, a:b], pos, cache)
        cache = kvc.commit(fo.cache, jnp.full((2,), b - a))
        got.append(np.asarray(fo.logits))
    got = np.concatenate(got, axis=1)
    fin, _ = split_masked(full)
    np.testing.assert_allclose(got[fin], full[fin], rtol=1e-5, atol=1e-5)
    assert int(cache.length[0]) == 14


def test_hf_key_layout_and_save_hf_round_trip(models, tmp_path):
    hf, model = models()
    # transformers 5 writes the in-memory names to disk; our key map names exactly those tensors
    directory = tmp_path / "hf"
    hf.save_pretrained(str(directory))
    with safe_open(str(directory / "model.safetensors"), "np") as f:
        disk = set(f.keys())
    assert disk == set(hf.state_dict())
    assert {"model.vqmodel.quantize.embedding.weight", "model.layers.0.self_attn.q_norm.bias",
            "model.vqmodel.post_quant_conv.weight", "lm_head.weight"} <= disk
    assert {n for n, _, _ in CH.hf_key_map(model.config)} == disk
    # save_hf -> transformers from_pretrained computes what the original computes
    ports.save_hf(model, str(tmp_path / "out"))
    back = transformers.ChameleonForConditionalGeneration.from_pretrained(str(tmp_path / "out")).eval()
    ids, px = image_prompt(seed=3)
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(ids), pixel_values=torch.tensor(px)).logits.numpy()
        got = back(input_ids=torch.tensor(ids), pixel_values=torch.tensor(px)).logits.numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    again = ports.load_hf(str(tmp_path / "out"))
    assert again.config == model.config
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), again.params, model.params)


def test_random_model_loads_in_transformers(models, tmp_path):
    """A random jspec Chameleon (config_to_hf's reconstructed vocabulary_map, swin norms, no image suppression)
    saves to a checkpoint transformers loads strictly and runs to our logits."""
    _, model = models()
    cfg = dataclasses.replace(model.config, swin_norm=True, suppress_image_logits=False)
    rnd = ports.random_model(cfg, key=5, std=0.3)
    ports.save_hf(rnd, str(tmp_path))
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["mask_image_logits"] is False and saved["swin_norm"] is True
    back = transformers.ChameleonForConditionalGeneration.from_pretrained(str(tmp_path)).eval()
    assert sorted(back.model.vocabulary_mapping.image_tokens) == list(range(IMG0, IMG0 + K))
    tokens = text_tokens(seed=4)
    with torch.no_grad():
        raw = back.lm_head(back.model(torch.tensor(tokens)).last_hidden_state).numpy()
    ours = ports.logits(rnd, tokens)
    np.testing.assert_allclose(ours, raw, rtol=1e-4, atol=1e-4)
    assert np.abs(raw).max() > 0.5
    assert ports.load_hf(str(tmp_path)).config == cfg


def test_bad_inputs_fail_clearly(models, tmp_path):
    hf, model = models()
    d = hf.config.to_dict()
    with pytest.raises(ValueError, match="no vocabulary_map"):
        CH.config_from_hf({**d, "vocabulary_map": None})
    no_code = {k: v for k, v in d["vocabulary_map"].items() if k != "IMGIMGBDZ"}  # code 13
    with pytest.raises(ValueError, match=r"do not cover the codebook of 32 codes: missing codes \[13\]"):
        CH.config_from_hf({**d, "vocabulary_map": no_code})
    # a checkpoint whose config.json lost its vocabulary_map fails at load, naming it
    hf.save_pretrained(str(tmp_path))
    cj = json.loads((tmp_path / "config.json").read_text())
    cj.pop("vocabulary_map")
    (tmp_path / "config.json").write_text(json.dumps(cj))
    with pytest.raises(ValueError, match="no vocabulary_map"):
        ports.load_hf(str(tmp_path))
    ids, px = image_prompt()
    with pytest.raises(ValueError, match=r"image size 18x16 is not divisible by the VQ tokenizer's downsampling "
                                         r"factor 4"):
        ports.logits(model, {"input_ids": ids, "pixel_values": np.zeros((2, 3, 18, 16), np.float32)})
    with pytest.raises(ValueError, match=r"32 '<image>' placeholders .* 1 image\(s\) x 16 tokens = 16"):
        ports.logits(model, {"input_ids": ids, "pixel_values": px[:1]})
    with pytest.raises(ValueError, match="placeholders .* but no pixel_values"):
        CH.prepare_inputs(model.config, ids, np.array([ids.shape[1]] * 2), {})
    with pytest.raises(ValueError, match=r"pixel_values only; got \['image_sizes'\]"):
        CH.prepare_inputs(model.config, ids, np.array([ids.shape[1]] * 2), {"pixel_values": px, "image_sizes": 1})


def test_greedy_decode_matches_transformers_generate(models):
    """The engine runs the port unchanged: greedy AR on an image prompt equals HF generate (which suppresses image
    tokens), and greedy Chain SD with the model as its own draft equals AR."""
    import jspec

    hf, model = models()
    ids, px = image_prompt(seed=5)
    prompt = {"input_ids": ids, "pixel_values": px}
    with torch.no_grad():
        want = hf.generate(input_ids=torch.tensor(ids), pixel_values=torch.tensor(px), max_new_tokens=6,
                           do_sample=False, eos_token_id=None, pad_token_id=0)[:, ids.shape[1]:].numpy()
    ar = jspec.decode(model, prompt, strategy=jspec.AR(), max_new_tokens=6, temperature=0.0, eos_token_id=None)
    np.testing.assert_array_equal(ar.tokens, want)
    assert not np.isin(ar.tokens, np.arange(IMG0, IMG0 + K)).any()
    sd = jspec.decode(model, prompt, strategy=jspec.Chain(model, gamma=3), max_new_tokens=6, temperature=0.0,
                      eos_token_id=None)
    np.testing.assert_array_equal(sd.tokens, want)


def test_lumina_style_config_loads(models, tmp_path):
    """An older-spelling config.json as Lumina-mGPT ships it (its own config class, rope_theta, mask_image_logits,
    extra training keys) loads through load_hf; only the suppression switch differs."""
    hf, model = models()
    hf.save_pretrained(str(tmp_path))
    cj = json.loads((tmp_path / "config.json").read_text())
    rope = cj.pop("rope_parameters")
    cj.update(architectures=["ChameleonXLLMXForConditionalGeneration"], rope_theta=rope["rope_theta"],
              rope_scaling=None, mask_image_logits=False, z_loss_weight=1e-5)
    cj.pop("image_token_id")
    (tmp_path / "config.json").write_text(json.dumps(cj))
    lumina = ports.load_hf(str(tmp_path))
    # per-head QK norms load as they are; the class name says save_hf should write model_parallel_size rows
    assert lumina.config == dataclasses.replace(model.config, suppress_image_logits=False, qk_norm_rows=1)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), lumina.params, model.params)
    # ... which these differing per-head values cannot be: written per head, and the config says so
    with pytest.warns(UserWarning, match=r"cannot be written as model_parallel_size=1 rows .* writing them per head"):
        ports.save_hf(lumina, str(tmp_path / "out"))
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["architectures"] == ["ChameleonForConditionalGeneration"] and saved["z_loss_weight"] == 1e-5
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "np") as f:
        assert f.get_slice("model.layers.1.self_attn.q_norm.bias").get_shape() == [4, 8]
        assert f.get_slice("model.layers.1.self_attn.k_norm.weight").get_shape() == [2, 8]
    again = ports.load_hf(str(tmp_path / "out"))
    assert again.config == dataclasses.replace(lumina.config, qk_norm_rows=0)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), again.params, model.params)


# ------------------------------------------------------------------ Lumina-mGPT's own checkpoint layout
# Lumina-mGPT (ChameleonXLLMXForConditionalGeneration) stores q_norm / k_norm weight and bias as
# [model_parallel_size, head_dim] and repeat-interleaves them over the heads at run time (../shared/real_layouts/
# SOURCES.md, "Derived, not a real layout"). The reference is a transformers model whose per-head norms are those
# rows repeated; the checkpoint is its save_pretrained output with the norms cut back to the rows.

H, KVH, DH = 4, 2, 8
NORM_KEY = re.compile(r"self_attn\.([qk])_norm\.(weight|bias)$")


@functools.lru_cache(maxsize=None)
def lumina_checkpoint(mp: int, directory: str):
    """(transformers reference model, directory of its weights in Lumina-mGPT's layout with mp rows)."""
    torch.manual_seed(0)
    hf = perturb(transformers.ChameleonForConditionalGeneration(hf_config()).eval(), seed=1)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for layer in hf.model.layers:
            for norm, heads in ((layer.self_attn.q_norm, H), (layer.self_attn.k_norm, KVH)):
                norm.weight.copy_((1 + 0.5 * torch.randn(mp, DH, generator=g)).repeat_interleave(heads // mp, 0))
                norm.bias.copy_((0.5 * torch.randn(mp, DH, generator=g)).repeat_interleave(heads // mp, 0))
    d = pathlib.Path(directory)
    hf.save_pretrained(str(d))
    with safe_open(str(d / "model.safetensors"), "np") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    for k, a in tensors.items():
        m = NORM_KEY.search(k)
        if m:
            heads = H if m.group(1) == "q" else KVH
            rows = a[::heads // mp]
            assert (np.repeat(rows, heads // mp, axis=0) == a).all()
            tensors[k] = np.ascontiguousarray(rows)
    save_file(tensors, str(d / "model.safetensors"), metadata=meta)
    cj = json.loads((d / "config.json").read_text())
    cj.update(architectures=["ChameleonXLLMXForConditionalGeneration"], model_parallel_size=mp, mask_image_logits=True,
              dropout=0.05, z_loss_weight=1e-5)  # ChameleonXLLMXConfig's own keys, unused at inference
    (d / "config.json").write_text(json.dumps(cj, indent=2))
    return hf, d


def read_tensors(path) -> dict:
    with safe_open(str(path), "np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("mp", [1, 2])
def test_lumina_layout_loads_like_its_model_and_saves_back(tmp_path_factory, tmp_path, mp):
    hf, src = lumina_checkpoint(mp, str(tmp_path_factory.getbasetemp() / f"lumina_mp{mp}"))
    disk = read_tensors(src / "model.safetensors")
    assert disk["model.layers.0.self_attn.q_norm.weight"].shape == disk["model.layers.1.self_attn.k_norm.bias"].shape \
        == (mp, DH)
    model = ports.load_hf(str(src))
    assert model.config.qk_norm_rows == mp and model.config.num_heads == H and model.config.num_kv_heads == KVH
    for layer in model.params["layers"]:  # in memory one row per head, as ever
        assert layer["q_norm"].shape == layer["q_norm_b"].shape == (H, DH)
        assert layer["k_norm"].shape == layer["k_norm_b"].shape == (KVH, DH)
    # logits equal the transformers model whose per-head norms are the rows repeated over the heads
    tokens = text_tokens(seed=6)
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)).logits.numpy()
    ours = ports.logits(model, tokens)
    fin, masked = split_masked(ref)
    np.testing.assert_allclose(ours[fin], ref[fin], rtol=1e-4, atol=1e-4)
    assert (ours[masked] == np.finfo(np.float32).min).all()
    if mp > 1:  # the grouping matters: the rows tiled over the heads (r0 r1 r0 r1) are far off
        p = jax.tree.map(lambda a: a, model.params)
        for i, layer in enumerate(p["layers"]):
            for k, heads in (("q_norm", H), ("q_norm_b", H), ("k_norm", KVH), ("k_norm_b", KVH)):
                rows = disk[f"model.layers.{i}.self_attn.{k[:6]}.{'bias' if k.endswith('_b') else 'weight'}"]
                layer[k] = jnp.asarray(np.tile(rows, (heads // mp, 1)))
        tiled = ports.logits(dataclasses.replace(model, params=p), tokens)
        assert np.abs(tiled[fin] - ref[fin]).max() > 1e-2
    # save_hf writes the layout it read: the same tensors byte for byte, the same config
    out = tmp_path / "out"
    ports.save_hf(model, str(out))
    back = read_tensors(out / "model.safetensors")
    assert back.keys() == disk.keys()
    for k, a in disk.items():
        assert back[k].dtype == a.dtype and back[k].shape == a.shape and back[k].tobytes() == a.tobytes(), k
    assert back["model.layers.1.self_attn.q_norm.bias"].shape == back["model.layers.0.self_attn.k_norm.weight"].shape \
        == (mp, DH)
    want_cfg, got_cfg = (json.loads((d / "config.json").read_text()) for d in (src, out))
    assert got_cfg["dtype"] == "float32"
    for c in (want_cfg, got_cfg):
        c.pop("dtype", None), c.pop("torch_dtype", None)
    assert got_cfg == want_cfg
    again = ports.load_hf(str(out))
    assert again.config == model.config
    np.testing.assert_array_equal(ports.logits(again, tokens), ours)


def test_lumina_layout_config(models, tmp_path):
    """qk_norm_rows in and out of an HF config, a random model in Lumina-mGPT's layout, and bad row counts."""
    hf, model = models()
    d = hf.config.to_dict()
    lumina = {**d, "architectures": ["ChameleonXLLMXForConditionalGeneration"], "model_parallel_size": 2}
    cfg = CH.config_from_hf(lumina)
    assert cfg == dataclasses.replace(model.config, qk_norm_rows=2)
    assert CH.config_from_hf({**d, "model_parallel_size": 2}).qk_norm_rows == 0  # transformers' class: per head
    assert CH.config_from_hf({k: v for k, v in lumina.items() if k != "model_parallel_size"}).qk_norm_rows == 1
    back = transformers.ChameleonConfig(**CH.config_to_hf(cfg))
    assert CH.config_from_hf(back.to_dict()) == cfg
    # a random model (unit norms: equal rows) saves as rows and loads back
    rnd = ports.random_model(cfg, key=3, std=0.3)
    ports.save_hf(rnd, str(tmp_path))
    with safe_open(str(tmp_path / "model.safetensors"), "np") as f:
        assert f.get_slice("model.layers.0.self_attn.q_norm.weight").get_shape() == [2, DH]
    again = ports.load_hf(str(tmp_path))
    assert again.config == cfg
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), again.params, rnd.params)
    for mp in (3, 4):  # 3 does not divide 4 heads; 4 does not divide 2 kv heads
        with pytest.raises(ValueError, match=rf"model_parallel_size={mp} .* must divide num_attention_heads=4 and "
                                             r"num_key_value_heads=2"):
            CH.config_from_hf({**lumina, "model_parallel_size": mp})


def test_lumina_layout_bad_norm_rows_fail(tmp_path_factory, tmp_path):
    """A [3, Dh] q_norm with 4 heads is neither layout: load_hf fails naming the tensor and both shapes."""
    _, src = lumina_checkpoint(1, str(tmp_path_factory.getbasetemp() / "lumina_mp1"))
    for f in ("config.json", "generation_config.json"):
        if (src / f).exists():
            shutil.copy(src / f, tmp_path / f)
    tensors = read_tensors(src / "model.safetensors")
    tensors["model.layers.1.self_attn.q_norm.weight"] = np.ones((3, DH), np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"wrong shapes \(1\).*model\.layers\.1\.self_attn\.q_norm\.weight: checkpoint "
                                         r"\(3, 8\), expected \(4, 8\) or \[r, 8\] with r dividing 4"):
        ports.load_hf(str(tmp_path))
