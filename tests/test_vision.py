"""Vision towers (CLIP, SigLIP) and LLaVA's projector match transformers on tiny random configs; key maps in every
layout round-trip; bad input fails with a clear message."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file

from ports.io import hf_checkpoint as HC
from ports import model as PM
from ports.core import vision as VIS
from conftest import perturb

# CLIP: 4 layers so feature layers [-2, -5] both exist. SigLIP: image 30 with patch 7, so the stride-7 conv drops the
# last 2 pixel rows / columns (as siglip-so400m-patch14-384 does: 384 = 27 * 14 + 6).
TOWERS = {
    "clip": (transformers.CLIPVisionModel, transformers.CLIPVisionConfig,
             dict(hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, image_size=28,
                  patch_size=7)),
    "siglip": (transformers.SiglipVisionModel, transformers.SiglipVisionConfig,
               dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, image_size=30,
                    patch_size=7)),
}


def pixels(cfg: VIS.VisionConfig, n: int = 2, seed: int = 0) -> np.ndarray:
    s = cfg.image_size
    return np.random.default_rng(seed).normal(size=(n, cfg.num_channels, s, s)).astype(np.float32)


@functools.lru_cache(maxsize=None)
def tower(name: str):
    """(hf model, our config, our params loaded from its state dict) for one tiny random tower."""
    model_cls, cfg_cls, base = TOWERS[name]
    torch.manual_seed(0)
    hf = perturb(model_cls(cfg_cls(**base)).eval(), seed=1)
    cfg = VIS.vision_config_from_hf(hf.config.to_dict())
    return hf, cfg, VIS.params_from_state_dict(cfg, hf.state_dict())


def hf_states(hf, x: np.ndarray):
    with torch.no_grad():
        return hf(pixel_values=torch.tensor(x), output_hidden_states=True)


def close(a, b, atol=1e-4):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=atol)


@pytest.mark.parametrize("name", sorted(TOWERS))
def test_config_from_and_to_hf(name):
    hf, cfg, _ = tower(name)
    model_cls, cfg_cls, base = TOWERS[name]
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.image_size, cfg.patch_size) == (32, base[
        "num_hidden_layers"], 4, base["image_size"], 7)
    assert cfg.class_token == (name == "clip") and cfg.pre_layernorm == (name == "clip")
    assert cfg.patch_bias == (name == "siglip")
    assert cfg.hidden_act == ("quick_gelu" if name == "clip" else "gelu_pytorch_tanh")
    assert cfg.num_positions == 16 + (name == "clip")
    # our dict builds the same HF tower, which parses back to the same config
    back = cfg_cls(**VIS.vision_config_to_hf(cfg))
    assert VIS.vision_config_from_hf(back.to_dict()) == cfg
    # keys missing from an old hub config take HF's defaults for that tower type
    assert VIS.vision_config_from_hf({"model_type": cfg.model_type}) == VIS.vision_config_from_hf(cfg_cls().to_dict())


def test_llava_default_vision_config_is_clip_l_336():
    """The tower a LLaVA config without vision_config gets (what the LLaVA loader must fill in)."""
    cfg = VIS.vision_config_from_hf(transformers.LlavaConfig().vision_config.to_dict())
    assert (cfg.model_type, cfg.hidden_size, cfg.num_layers, cfg.image_size, cfg.patch_size) == (
        "clip_vision_model", 1024, 24, 336, 14)
    assert cfg.num_positions == 577 and VIS.num_feature_tokens(cfg, "default") == 576


@pytest.mark.parametrize("name", sorted(TOWERS))
def test_params_structure_and_key_map(name):
    _, cfg, params = tower(name)
    is_shape = lambda x: isinstance(x, tuple)
    shapes = VIS.param_shapes(cfg)
    assert jax.tree.map(lambda a: a.shape, params) == jax.tree.map(tuple, shapes, is_leaf=is_shape)
    init = VIS.init_params(cfg, jax.random.key(0))
    assert jax.tree.map(lambda a: a.shape, init) == jax.tree.map(tuple, shapes, is_leaf=is_shape)
    # every param is named exactly once, every HF name is distinct
    rows = VIS.hf_key_map(cfg, "model.vision_tower.")
    flat = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=is_shape)[0]
    paths = sorted(tuple(getattr(k, "key", getattr(k, "idx", None)) for k in p) for p, _ in flat)
    assert sorted(path for _, path, _ in rows) == paths
    assert len({n for n, _, _ in rows}) == len(rows)


@pytest.mark.parametrize("name", sorted(TOWERS))
def test_hidden_states_match_transformers(name):
    hf, cfg, params = tower(name)
    x = pixels(cfg)
    ref = hf_states(hf, x)
    n = cfg.num_layers
    assert len(ref.hidden_states) == n + 1
    out = VIS.forward(cfg, params, x, feature_layers=range(n + 1), post_norm=True)
    for i, (got, want) in enumerate(zip(out.hidden, ref.hidden_states)):
        assert got.shape == (2, cfg.num_positions, 32), i
        close(got, want.numpy())
    # the states change from layer to layer: the comparison is not vacuous
    assert np.abs(ref.hidden_states[-1].numpy() - ref.hidden_states[-2].numpy()).max() > 0.1
    # negative indices as HF's: -1 is the last layer before post_layernorm, -2 the one before
    sel = VIS.forward(cfg, params, x, feature_layers=[-2, -n - 1, -1])
    for got, i in zip(sel.hidden, (-2, -n - 1, -1)):
        close(got, ref.hidden_states[i].numpy())
    if name == "siglip":  # post_layernorm over every token is SigLIP's last_hidden_state
        close(out.post_norm, ref.last_hidden_state.numpy())
    else:  # CLIP's last_hidden_state is the raw last layer; its pooler is post_layernorm of the class token
        close(out.hidden[-1], ref.last_hidden_state.numpy())
        close(out.post_norm[:, 0], ref.pooler_output.numpy())


@functools.lru_cache(maxsize=None)
def llava(name: str, feature_layer, strategy: str, bias: bool = True, act: str = "gelu"):
    """A tiny random LlavaForConditionalGeneration with the `name` tower."""
    _, cfg_cls, base = TOWERS[name]
    text = transformers.LlamaConfig(hidden_size=24, intermediate_size=40, num_hidden_layers=1, num_attention_heads=2,
                                    num_key_value_heads=1, vocab_size=64)
    lc = transformers.LlavaConfig(vision_config=cfg_cls(**base), text_config=text, image_token_index=3,
                                  vision_feature_layer=list(feature_layer) if isinstance(feature_layer, tuple)
                                  else feature_layer, vision_feature_select_strategy=strategy,
                                  multimodal_projector_bias=bias, projector_hidden_act=act)
    torch.manual_seed(2)
    return perturb(transformers.LlavaForConditionalGeneration(lc).eval(), seed=3)


LLAVA_CASES = [("clip", -2, "default"), ("clip", (-2, -5), "default"), ("clip", (-1, -3), "full"),
               ("siglip", -1, "full"), ("siglip", (-1, -3), "full"), ("siglip", -2, "default")]


@pytest.mark.parametrize("name,feature_layer,strategy", LLAVA_CASES)
def test_llava_image_features_match_transformers(name, feature_layer, strategy):
    """Tower + feature selection (int or list of layers, default / full) + projector equal HF get_image_features."""
    hf = llava(name, feature_layer, strategy)
    d = hf.config.to_dict()
    cfg = VIS.vision_config_from_hf(d["vision_config"])
    pc = VIS.projector_config_from_hf(d, cfg, hf.config.text_config.hidden_size)
    n_layers = 1 if isinstance(feature_layer, int) else len(feature_layer)
    assert (pc.in_dim, pc.out_dim, pc.bias, pc.act) == (32 * n_layers, 24, True, "gelu")
    sd = hf.state_dict()
    params = VIS.params_from_state_dict(cfg, sd, "model.vision_tower.")
    proj = VIS.projector_params_from_state_dict(pc, sd, "model.multi_modal_projector.")
    x = pixels(cfg, seed=4)
    with torch.no_grad():
        ref = hf.model.get_image_features(pixel_values=torch.tensor(x),
                                          vision_feature_layer=hf.config.vision_feature_layer,
                                          vision_feature_select_strategy=strategy).pooler_output
    ref = np.stack([r.numpy() for r in ref])
    feats = VIS.image_features(cfg, params, x, feature_layer, strategy)
    assert feats.shape == (2, VIS.num_feature_tokens(cfg, strategy), 32 * n_layers)
    got = VIS.projector_forward(proj, feats, pc.act)
    assert got.shape == ref.shape
    close(got, ref)


@pytest.mark.parametrize("bias,act", [(True, "gelu"), (False, "quick_gelu"), (True, "gelu_pytorch_tanh")])
def test_projector_matches_transformers(bias, act):
    lc = transformers.LlavaConfig(vision_config=transformers.CLIPVisionConfig(hidden_size=20, num_attention_heads=4),
                                  text_config=transformers.LlamaConfig(hidden_size=32, num_attention_heads=4),
                                  vision_feature_layer=[-2, -3],
                                  multimodal_projector_bias=bias, projector_hidden_act=act)
    torch.manual_seed(5)
    hp = perturb(transformers.models.llava.modeling_llava.LlavaMultiModalProjector(lc).eval(), seed=6, scale=0.3)
    pc = VIS.projector_config_from_hf(lc.to_dict(), VIS.vision_config_from_hf(lc.vision_config.to_dict()), 32)
    assert (pc.in_dim, pc.bias, pc.act) == (40, bias, act)
    params = VIS.projector_params_from_state_dict(pc, hp.state_dict(), prefix="")
    assert ("b1" in params) == bias
    x = np.random.default_rng(7).normal(size=(2, 5, 40)).astype(np.float32) * 2
    with torch.no_grad():
        ref = hp(torch.tensor(x)).numpy()
    close(VIS.projector_forward(params, x, act), ref, atol=1e-5)
    # the round trip through the HF layout gives back the same params
    rows = VIS.projector_key_map(pc, "multi_modal_projector.")
    back = VIS.params_from_rows(rows, VIS.projector_param_shapes(pc), VIS.params_to_state_dict(rows, params),
                              prefix="multi_modal_projector.")
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, back)


@pytest.mark.parametrize("name", sorted(TOWERS))
def test_llava_key_layouts(name, tmp_path):
    """The tower and projector load from transformers-5 memory names, transformers-5 checkpoint names and older hub
    names alike, with every tower tensor either consumed or on the explicit ignore list."""
    hf = llava(name, -2, "default")
    cfg = VIS.vision_config_from_hf(hf.config.to_dict()["vision_config"])
    pc = VIS.projector_config_from_hf(hf.config.to_dict(), cfg, 24)
    mem = hf.state_dict()
    ref = VIS.params_from_state_dict(cfg, mem, "model.vision_tower.")
    hf.save_pretrained(str(tmp_path))
    disk = load_file(str(tmp_path / "model.safetensors"))
    assert any(k.startswith("vision_tower.encoder.layers.0.") for k in disk)  # what transformers 5 writes
    assert any(k.startswith("multi_modal_projector.linear_1.") for k in disk)
    old = {("vision_tower.vision_model." + k[len("vision_tower."):] if k.startswith("vision_tower.") else k): v
           for k, v in disk.items()}
    old["vision_tower.vision_model.embeddings.position_ids"] = torch.arange(cfg.num_positions)[None]  # old buffer
    if name == "siglip":  # the pooling head is in the checkpoint and deliberately unused
        assert any(k.startswith("vision_tower.head.") for k in disk)
    for sd, prefix in ((disk, "vision_tower."), (old, "vision_tower.vision_model.")):
        got = VIS.params_from_state_dict(cfg, sd, prefix)
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, ref)
    p_mem = VIS.projector_params_from_state_dict(pc, mem, "model.multi_modal_projector.")
    p_disk = VIS.projector_params_from_state_dict(pc, disk, "multi_modal_projector.")
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), p_mem, p_disk)
    # the ignore list is explicit: an unknown tower tensor, or a missing one, is an error naming it
    with pytest.raises(ValueError, match="unexpected keys.*vision_tower.encoder.layers.0.extra"):
        VIS.params_from_state_dict(cfg, {**disk, "vision_tower.encoder.layers.0.extra": torch.zeros(1)}, "vision_tower.")
    short = {k: v for k, v in disk.items() if k != "vision_tower.post_layernorm.bias"}
    with pytest.raises(ValueError, match="missing keys.*vision_tower.post_layernorm.bias"):
        VIS.params_from_state_dict(cfg, short, "vision_tower.")
    bad = {**disk, "vision_tower.embeddings.patch_embedding.weight": torch.zeros(32, 3, 8, 8)}
    with pytest.raises(ValueError, match=r"wrong shapes.*patch_embedding.weight: \(32, 3, 8, 8\), "
                                         r"expected \(32, 3, 7, 7\)"):
        VIS.params_from_state_dict(cfg, bad, "vision_tower.")


@pytest.mark.parametrize("name", sorted(TOWERS))
def test_params_round_trip_and_load_in_transformers(name):
    """Random jspec params -> HF layout -> the same params, and transformers (strict) computes what we compute."""
    model_cls, cfg_cls, base = TOWERS[name]
    _, cfg, _ = tower(name)
    params = VIS.init_params(cfg, jax.random.key(3), std=0.3)
    sd = VIS.state_dict_from_params(cfg, params, "vision_model.")
    assert sd["vision_model.embeddings.patch_embedding.weight"].shape == (32, 3, 7, 7)
    back = VIS.params_from_state_dict(cfg, sd, "vision_model.")
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, back)
    hf = model_cls(cfg_cls(**VIS.vision_config_to_hf(cfg))).eval()
    hf.load_state_dict({k: torch.tensor(v) for k, v in VIS.state_dict_from_params(cfg, params).items()}, strict=True)
    x = pixels(cfg, seed=8)
    ref = hf_states(hf, x)
    out = VIS.forward(cfg, params, x, feature_layers=-2)
    close(out.hidden[0], ref.hidden_states[-2].numpy())


def test_load_hf_save_hf_apply_conv_transform(tmp_path, monkeypatch):
    """ports.load_hf / save_hf handle the "conv" transform: a CLIPVisionModel checkpoint loads, saves and reloads
    in transformers with the same outputs."""
    fam = PM.Family(VIS.vision_config_from_hf, VIS.vision_config_to_hf, VIS.param_shapes, VIS.init_params, VIS.forward,
                   lambda cfg: VIS.hf_key_map(cfg, ""), VIS.ignored_hf_keys(""), None, None, None)
    monkeypatch.setitem(PM.FAMILIES, "clip_vision_model", fam)
    hf, cfg, params = tower("clip")
    hf.save_pretrained(str(tmp_path / "in"))
    model = HC.load_hf(str(tmp_path / "in"))
    assert model.config == cfg
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), model.params, params)
    HC.save_hf(model, str(tmp_path / "out"))
    back = transformers.CLIPVisionModel.from_pretrained(str(tmp_path / "out")).eval()
    x = pixels(cfg, seed=9)
    close(hf_states(back, x).pooler_output.numpy(), hf_states(hf, x).pooler_output.numpy(), atol=1e-6)
    # a kernel of the wrong shape is reported in HF's layout
    from safetensors.torch import save_file

    sd = load_file(str(tmp_path / "in" / "model.safetensors"))
    sd["embeddings.patch_embedding.weight"] = torch.zeros(32, 3, 7, 6)
    save_file(sd, str(tmp_path / "in" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"patch_embedding.weight: checkpoint \(32, 3, 7, 6\), "
                                         r"expected \(32, 3, 7, 7\)"):
        HC.load_hf(str(tmp_path / "in"))


@pytest.mark.parametrize("name", sorted(TOWERS))
def test_jitted_bf16_close_to_f32(name):
    _, cfg, params = tower(name)
    x = pixels(cfg, seed=10)
    fwd = jax.jit(lambda p, x: VIS.forward(cfg, p, x, feature_layers=(-2, -1), post_norm=True))
    f32 = fwd(params, x)
    eager = VIS.forward(cfg, params, x, feature_layers=(-2, -1), post_norm=True)
    close(f32.hidden[0], eager.hidden[0], atol=1e-5)
    bf = fwd(jax.tree.map(lambda a: a.astype(jnp.bfloat16), params), x)
    for lo, hi in zip(bf.hidden + (bf.post_norm,), f32.hidden + (f32.post_norm,)):
        assert lo.dtype == jnp.bfloat16
        lo, hi = np.asarray(lo, np.float32), np.asarray(hi)
        assert np.isfinite(lo).all()
        assert np.linalg.norm(lo - hi) < 0.03 * np.linalg.norm(hi)
        assert np.abs(lo - hi).max() > 0  # it really ran in bf16


@pytest.mark.parametrize("name", sorted(TOWERS))
def test_bad_inputs_fail_clearly(name):
    _, cfg, params = tower(name)
    s = cfg.image_size
    want = rf"\(N, 3, {s}, {s}\)"
    for shape in [(2, 3, s + 4, s + 4), (2, 1, s, s), (3, s, s), (2, 3, s, s - 1)]:
        with pytest.raises(ValueError, match=want):
            VIS.forward(cfg, params, np.zeros(shape, np.float32))
    with pytest.raises(ValueError, match=want):  # also at trace time under jit
        jax.jit(lambda p, x: VIS.forward(cfg, p, x).hidden)(params, np.zeros((1, 3, s, s + 2), np.float32))
    n = cfg.num_layers + 1
    with pytest.raises(ValueError, match=rf"out of range.*{n} hidden states"):
        VIS.forward(cfg, params, pixels(cfg), feature_layers=[-2, -n - 1])
    out = VIS.forward(cfg, params, pixels(cfg), feature_layers=-1)
    with pytest.raises(ValueError, match="vision_feature_select_strategy 'cls_patch'"):
        VIS.select_features(cfg, out.hidden, "cls_patch")
    with pytest.raises(ValueError, match="model_type 'vit'"):
        VIS.vision_config_from_hf({"model_type": "vit"})
    with pytest.raises(ValueError, match="hidden_act 'swish2'"):
        VIS.vision_config_from_hf({"model_type": cfg.model_type, "hidden_act": "swish2"})


@pytest.mark.parametrize("name", ["clip", "siglip"])
def test_image_features_in_batches_equal_all_at_once(name, monkeypatch):
    """Many images (frames) are encoded `ports.core.layers.VISION_BATCH` at a time: 5 images in batches of 2 (the last
    padded) give the features of all 5 at once."""
    from ports.core import layers as LY

    _, cfg, params = tower(name)
    x = pixels(cfg, n=5, seed=7)
    whole = np.asarray(VIS.image_features(cfg, params, x, -2, "full"))
    monkeypatch.setattr(LY, "VISION_BATCH", 2)
    np.testing.assert_allclose(np.asarray(VIS.image_features(cfg, params, x, -2, "full")), whole, atol=1e-5,
                               rtol=1e-5)  # float32 rounding of differently batched matmuls
