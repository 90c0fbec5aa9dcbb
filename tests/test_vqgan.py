"""VQGAN image tokenizer (ports.families.vqgan): encoder codes equal HF ChameleonVQVAE's; the decoder has the taming layout and
learns to reconstruct images; taming-style checkpoints load; the latent neighbour table equals brute force."""
import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers
from safetensors.numpy import save_file

from jspec.parts.neighbours import neighbour_codes
from ports.families import vqgan as VQ
from conftest import perturb

# (a) attention inside the down level at resolution 8 and two blocks per level; (b) no attention at all.
HF_CASES = {
    "attn": dict(embed_dim=8, num_embeddings=32, latent_channels=32, resolution=16, base_channels=32,
                 channel_multiplier=[1, 1, 2], num_res_blocks=2, attn_resolutions=[8]),
    "no_attn": dict(embed_dim=4, num_embeddings=16, latent_channels=8, resolution=16, base_channels=32,
                    channel_multiplier=[1, 2], num_res_blocks=1, attn_type="none"),
}


@functools.lru_cache(maxsize=None)
def hf_vq(name: str):
    """(HF ChameleonVQVAE with every parameter perturbed, our config, our params from its state dict)."""
    torch.manual_seed(0)
    hf = transformers.models.chameleon.modeling_chameleon.ChameleonVQVAE(
        transformers.ChameleonVQVAEConfig(**HF_CASES[name])).eval()
    perturb(hf, seed=1, scale=0.1)
    cfg = VQ.vq_config_from_hf(hf.config.to_dict())
    return hf, cfg, VQ.params_from_state_dict(cfg, hf.state_dict(), parts=VQ.HF_PARTS)


def images(n=3, h=16, w=24, seed=0):
    return np.random.default_rng(seed).uniform(-1, 1, (n, 3, h, w)).astype(np.float32)


@pytest.mark.parametrize("name", sorted(HF_CASES))
def test_encoder_codes_equal_transformers(name):
    hf, cfg, params = hf_vq(name)
    assert cfg.downsample == 2 ** (len(HF_CASES[name]["channel_multiplier"]) - 1)
    assert cfg.level_has_attn(1) == (name == "attn") and not cfg.level_has_attn(0)
    x = images()  # non-square, batch 3
    with torch.no_grad():
        out = hf.encode(torch.tensor(x))
        z_ref = hf.quant_conv(hf.encoder(torch.tensor(x))).permute(0, 2, 3, 1).numpy()
    z = jax.jit(VQ.encode_latents, static_argnums=0)(cfg, params, x)
    np.testing.assert_allclose(np.asarray(z), z_ref, rtol=1e-4, atol=1e-4)
    codes = np.asarray(VQ.encode_jit(cfg, params, x))
    h, w = 16 // cfg.downsample, 24 // cfg.downsample
    assert codes.shape == (3, h, w) and codes.dtype == np.int32
    np.testing.assert_array_equal(codes.reshape(-1), out.image_tokens.numpy())  # HF flattens (B, h, w) row-major
    assert len(np.unique(codes)) > 3  # not a degenerate encoder: the comparison means something
    # our names for the HF parts are exactly HF's state dict names
    assert sorted(n for n, _, _ in VQ.key_map(cfg, "", VQ.HF_PARTS)) == sorted(hf.state_dict())


def taming_decoder_layout(ch, ch_mult, num_res_blocks, resolution, attn_resolutions, z, out_ch, K, D):
    """The state-dict names and shapes of taming's VQModel decoder half, written out from its architecture:
    conv_in, mid (block_1, attn_1, block_2), up[i] with num_res_blocks + 1 ResnetBlocks (+ attention at the listed
    resolutions) and an upsample conv except at level 0, norm_out, conv_out; post_quant_conv; quantize.embedding."""
    out = {}

    def conv(name, cin, cout, k):
        out[f"{name}.weight"], out[f"{name}.bias"] = (cout, cin, k, k), (cout,)

    def norm(name, c):
        out[f"{name}.weight"], out[f"{name}.bias"] = (c,), (c,)

    def res(name, cin, cout):
        norm(f"{name}.norm1", cin), conv(f"{name}.conv1", cin, cout, 3)
        norm(f"{name}.norm2", cout), conv(f"{name}.conv2", cout, cout, 3)
        if cin != cout:
            conv(f"{name}.nin_shortcut", cin, cout, 1)

    def attn(name, c):
        norm(f"{name}.norm", c)
        for p in ("q", "k", "v", "proj_out"):
            conv(f"{name}.{p}", c, c, 1)

    c = ch * ch_mult[-1]
    conv("decoder.conv_in", z, c, 3)
    res("decoder.mid.block_1", c, c), attn("decoder.mid.attn_1", c), res("decoder.mid.block_2", c, c)
    res_now = resolution // 2 ** (len(ch_mult) - 1)
    for i in reversed(range(len(ch_mult))):
        for j in range(num_res_blocks + 1):
            res(f"decoder.up.{i}.block.{j}", c, ch * ch_mult[i])
            c = ch * ch_mult[i]
            if res_now in attn_resolutions:
                attn(f"decoder.up.{i}.attn.{j}", c)
        if i:
            conv(f"decoder.up.{i}.upsample.conv", c, c, 3)
            res_now *= 2
    norm("decoder.norm_out", c), conv("decoder.conv_out", c, out_ch, 3)
    conv("post_quant_conv", D, z, 1)
    out["quantize.embedding.weight"] = (K, D)
    return out


def test_decoder_has_the_taming_layout():
    cfg = VQ.VQConfig(embed_dim=6, num_embeddings=40, latent_channels=12, resolution=16, base_channels=32,
                      channel_multiplier=(1, 2), num_res_blocks=1, attn_resolutions=(8,))
    want = taming_decoder_layout(32, (1, 2), 1, 16, (8,), 12, 3, 40, 6)
    assert "decoder.up.1.attn.1.proj_out.weight" in want and "decoder.up.0.block.0.nin_shortcut.weight" in want
    params = VQ.init_params(cfg, jax.random.key(0), VQ.DECODE_PARTS)
    sd = VQ.state_dict_from_params(cfg, params)
    assert {k: tuple(v.shape) for k, v in sd.items()} == want
    # the Chameleon tokenizer's layout (no attention in the up levels) has 5 levels with 3 blocks each
    chameleon = VQ.param_shapes(VQ.VQConfig(), VQ.DECODE_PARTS)
    assert len(chameleon["decoder"]["up"]) == 5 and all(len(u["block"]) == 3 and not u["attn"]
                                                         for u in chameleon["decoder"]["up"])
    assert chameleon["decoder"]["conv_in"]["weight"] == (512, 256, 3, 3)
    assert chameleon["decoder"]["up"][1]["block"][0]["conv1"]["weight"] == (128, 256, 3, 3)
    assert chameleon["decoder"]["conv_out"]["weight"] == (3, 128, 3, 3)


JANUS = transformers.models.janus.modeling_janus


class TamingDecoder(torch.nn.Module):
    """taming-transformers' Decoder written out from its architecture over transformers' Janus VQ blocks (the same
    ResnetBlock, AttnBlock, mid block and nearest-x2 upsample taming uses): `up[level]` indexed by level and run
    from the lowest resolution up, attention after each block of a level whose resolution is in
    `attn_resolutions`. An independent PyTorch reference for our decoder, at any attention placement."""

    def __init__(self, janus_cfg, resolution: int, attn_resolutions: tuple):
        super().__init__()
        mult, base = janus_cfg.channel_multiplier, janus_cfg.base_channels
        block_in = base * mult[-1]
        self.conv_in = torch.nn.Conv2d(janus_cfg.latent_channels, block_in, 3, padding=1)
        self.mid = JANUS.JanusVQVAEMidBlock(janus_cfg, block_in)
        self.up = torch.nn.ModuleList([torch.nn.Module() for _ in mult])
        for level in reversed(range(len(mult))):
            blocks, attn, out = torch.nn.ModuleList(), torch.nn.ModuleList(), base * mult[level]
            for _ in range(janus_cfg.num_res_blocks + 1):
                blocks.append(JANUS.JanusVQVAEResnetBlock(janus_cfg, block_in, out))
                block_in = out
                if resolution // 2 ** level in attn_resolutions:
                    attn.append(JANUS.JanusVQVAEAttnBlock(out))
            self.up[level].block, self.up[level].attn = blocks, attn
            if level:
                self.up[level].upsample = JANUS.JanusVQVAEConvUpsample(out)
        self.norm_out = torch.nn.GroupNorm(32, block_in, eps=1e-6)
        self.conv_out = torch.nn.Conv2d(block_in, janus_cfg.out_channels, 3, padding=1)

    def forward(self, z):
        h = self.mid(self.conv_in(z))
        for level in reversed(range(len(self.up))):
            up = self.up[level]
            for i, block in enumerate(up.block):
                h = block(h)
                if len(up.attn):
                    h = up.attn[i](h)
            if level:
                h = up.upsample(h)
        h = self.norm_out(h)
        return self.conv_out(h * torch.sigmoid(h))


def janus_config(**kw):
    base = dict(embed_dim=8, num_embeddings=32, latent_channels=32, base_channels=32, channel_multiplier=[1, 1, 2],
                num_res_blocks=2, out_channels=3, dropout=0.0)
    base.update(kw)
    return transformers.models.janus.configuration_janus.JanusVQVAEConfig(**base)


def _decoded(cfg, params, z):
    got = VQ.decoder_forward(cfg, params["decoder"], jnp.asarray(z).transpose(0, 2, 3, 1))
    return np.asarray(got.transpose(0, 3, 1, 2))


def test_decoder_matches_transformers_janus_decoder():
    """transformers' JanusVQVAE decoder is a taming decoder with attention at the lowest resolution, its `up` list
    stored from the lowest resolution up (taming's in reverse): post_quant_conv + decoder agree with ours on
    perturbed weights, through our state-dict loader."""
    jcfg = janus_config()
    torch.manual_seed(3)
    vq = perturb(JANUS.JanusVQVAE(jcfg).eval(), seed=4, scale=0.1)
    n = len(jcfg.channel_multiplier)
    sd = {}
    for k, v in vq.state_dict().items():
        if k.startswith("decoder.up."):
            j, rest = k[len("decoder.up."):].split(".", 1)
            k = f"decoder.up.{n - 1 - int(j)}.{rest}"
        sd[k] = v
    cfg = VQ.VQConfig(embed_dim=8, num_embeddings=32, latent_channels=32, resolution=16, base_channels=32,
                      channel_multiplier=(1, 1, 2), num_res_blocks=2, attn_resolutions=(16 // 2 ** (n - 1),))
    params = VQ.params_from_state_dict(cfg, sd, parts=("post_quant_conv", "decoder"))
    zq = np.random.default_rng(5).normal(size=(2, 8, 4, 6)).astype(np.float32)
    with torch.no_grad():
        want = vq.decoder(vq.post_quant_conv(torch.tensor(zq))).numpy()
    got = VQ.decode_latents(cfg, params, jnp.asarray(zq).transpose(0, 2, 3, 1))
    assert got.shape == want.shape == (2, 3, 16, 24)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("attn_resolutions", [(8,), ()], ids=["attn_mid_level", "chameleon_layout"])
def test_decoder_matches_a_taming_reference(attn_resolutions):
    """Parity with a taming Decoder (`TamingDecoder`) where attention sits in a middle level, and in Chameleon's
    layout (attention in the mid block only); the reference's state dict loads through our taming key map."""
    jcfg = janus_config()
    torch.manual_seed(3)
    dec = perturb(TamingDecoder(jcfg, 16, attn_resolutions).eval(), seed=4, scale=0.1)
    cfg = VQ.VQConfig(embed_dim=8, num_embeddings=32, latent_channels=32, resolution=16, base_channels=32,
                      channel_multiplier=(1, 1, 2), num_res_blocks=2, attn_resolutions=attn_resolutions)
    params = VQ.params_from_state_dict(cfg, {"decoder." + k: v for k, v in dec.state_dict().items()},
                                       parts=("decoder",))
    assert sum(bool(level["attn"]) for level in params["decoder"]["up"]) == len(attn_resolutions)
    z = np.random.default_rng(5).normal(size=(2, 32, 4, 6)).astype(np.float32)
    with torch.no_grad():
        want = dec(torch.tensor(z)).numpy()
    np.testing.assert_allclose(_decoded(cfg, params, z), want, rtol=1e-4, atol=1e-4)


def squares(n: int, rng, size: int = 8) -> np.ndarray:
    """Coloured squares (side 2..5) on a coloured background, NCHW in [-1, 1]."""
    x = np.empty((n, 3, size, size), np.float32)
    x[:] = rng.uniform(-1, 1, (n, 3))[:, :, None, None]
    fg = rng.uniform(-1, 1, (n, 3))
    for i in range(n):
        s = rng.integers(2, 6)
        r, c = rng.integers(0, size - s + 1, 2)
        x[i, :, r:r + s, c:c + s] = fg[i][:, None, None]
    return x


@pytest.mark.slow  # training; the zoo tokenizer is trained and its round trip measured in tests/test_zoo_t2i.py
def test_trained_tokenizer_round_trip():
    """A tiny VQGAN trained through our encoder, quantizer (straight-through) and decoder for 300 Adam steps
    reconstructs held-out images far better than untrained, and better than each image's mean colour."""
    cfg = VQ.VQConfig(embed_dim=8, num_embeddings=64, latent_channels=32, resolution=8, base_channels=32,
                      channel_multiplier=(1, 1), num_res_blocks=1)
    rng = np.random.default_rng(0)
    train, test = squares(512, rng), squares(64, rng)
    params = VQ.init_params(cfg, jax.random.key(0))
    opt = optax.adam(optax.cosine_decay_schedule(4e-3, 300, 0.1))

    def loss_fn(p, x):
        z = VQ.encode_latents(cfg, p, x)
        zq = VQ.lookup(VQ.codebook(p), VQ.quantize(VQ.codebook(p), jax.lax.stop_gradient(z)))
        rec = VQ.decode_latents(cfg, p, z + jax.lax.stop_gradient(zq - z))
        sg = jax.lax.stop_gradient
        return jnp.mean((rec - x) ** 2) + jnp.mean((sg(z) - zq) ** 2) + 0.25 * jnp.mean((z - sg(zq)) ** 2)

    @jax.jit
    def step(p, s, x):
        g = jax.grad(loss_fn)(p, x)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    def rec_err(p):
        codes = VQ.encode_jit(cfg, p, test)
        assert codes.shape == (64, 4, 4)
        return float(np.mean((np.asarray(VQ.decode_jit(cfg, p, codes)) - test) ** 2))

    untrained = rec_err(params)
    state = opt.init(params)
    for _ in range(300):
        params, state = step(params, state, train[rng.integers(0, len(train), 32)])
    trained = rec_err(params)
    mean_colour = float(np.mean((test - test.mean(axis=(2, 3), keepdims=True)) ** 2))
    assert trained < 0.2 * untrained, (trained, untrained)
    assert trained < mean_colour, (trained, mean_colour)


def test_encode_decode_batched_and_jitted():
    cfg = VQ.VQConfig(embed_dim=8, num_embeddings=16, latent_channels=8, resolution=16, base_channels=32,
                      channel_multiplier=(1, 1, 2), num_res_blocks=1, attn_resolutions=(8,))
    params = VQ.init_params(cfg, jax.random.key(1))
    codes = np.random.default_rng(2).integers(0, 16, (3, 2, 5))
    imgs = np.asarray(VQ.decode_jit(cfg, params, codes))
    assert imgs.shape == (3, 3, 8, 20)  # NCHW, f = 4
    for i in range(3):  # rows are independent
        np.testing.assert_allclose(np.asarray(VQ.decode_jit(cfg, params, codes[i:i + 1]))[0], imgs[i], rtol=1e-5,
                                   atol=1e-5)
    assert np.abs(imgs[0] - imgs[1]).max() > 1e-3
    back = np.asarray(VQ.encode_jit(cfg, params, imgs))
    assert back.shape == codes.shape
    u8 = VQ.to_uint8(np.array([[[[-2.0, -1.0], [0.0, 1.0]]]]))
    assert u8.shape == (1, 2, 2, 1) and u8.ravel().tolist() == [0, 0, 127, 255]


def taming_state_dict(cfg, seed=0):
    params = VQ.init_params(cfg, jax.random.key(seed))
    return params, {k: torch.tensor(v) for k, v in VQ.state_dict_from_params(cfg, params).items()}


def test_load_vqgan_decoder_from_taming_checkpoints(tmp_path):
    cfg = VQ.VQConfig(embed_dim=8, num_embeddings=24, latent_channels=16, resolution=16, base_channels=32,
                      channel_multiplier=(1, 2, 2), num_res_blocks=1)
    params, sd = taming_state_dict(cfg)
    assert any(k.startswith("encoder.down.0.") for k in sd) and "decoder.up.2.upsample.conv.weight" in sd
    codes = np.random.default_rng(3).integers(0, 24, (2, 3, 3))
    want = np.asarray(VQ.decode_jit(cfg, params, codes))
    loss = {"loss.discriminator.main.0.weight": torch.zeros(4, 3, 4, 4), "loss.logvar": torch.zeros(())}
    torch.save({"state_dict": {**sd, **loss}, "epoch": 3, "global_step": 100}, tmp_path / "vqgan.ckpt")
    save_file({k: v.numpy() for k, v in sd.items()}, str(tmp_path / "vqgan.safetensors"))
    nested = {"model.vqmodel." + k: v for k, v in sd.items()}
    for src in (tmp_path / "vqgan.ckpt", str(tmp_path / "vqgan.safetensors"), nested):
        got_cfg, dec = VQ.load_vqgan_decoder(src)  # config inferred from the shapes
        assert dataclasses.replace(got_cfg, resolution=cfg.resolution) == cfg
        assert sorted(dec) == ["decoder", "post_quant_conv", "quantize"]
        np.testing.assert_array_equal(np.asarray(VQ.codebook(dec)), np.asarray(VQ.codebook(params)))
        np.testing.assert_allclose(np.asarray(VQ.decode_jit(got_cfg, dec, codes)), want, rtol=1e-5, atol=1e-5)
    # the full tokenizer loads too, and encodes as the original params do
    _, full = VQ.load_vqgan(tmp_path / "vqgan.ckpt", cfg)
    x = images(2, 16, 16, seed=4)
    np.testing.assert_array_equal(np.asarray(VQ.encode_jit(cfg, full, x)), np.asarray(VQ.encode_jit(cfg, params, x)))
    # pickled non-tensor objects need an explicit opt-in
    torch.save({"state_dict": sd, "hyper_parameters": argparse.Namespace(lr=1.0)}, tmp_path / "pickled.ckpt")
    with pytest.raises(ValueError, match="trust_pickle=True"):
        VQ.load_vqgan_decoder(tmp_path / "pickled.ckpt")
    assert VQ.load_vqgan_decoder(tmp_path / "pickled.ckpt", trust_pickle=True)[0] == got_cfg
    # missing / unknown / mis-shaped tensors are named
    short = {k: v for k, v in sd.items() if k != "decoder.conv_out.bias"}
    with pytest.raises(ValueError, match=r"missing keys.*decoder\.conv_out\.bias"):
        VQ.load_vqgan_decoder(short)
    with pytest.raises(ValueError, match=r"unexpected keys.*decoder\.extra"):
        VQ.load_vqgan_decoder({**sd, "decoder.extra": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"wrong shapes.*decoder\.conv_in\.weight"):
        VQ.load_vqgan_decoder(sd, dataclasses.replace(cfg, latent_channels=32))
    with pytest.raises(ValueError, match="not a taming VQGAN checkpoint"):
        VQ.load_vqgan_decoder({"foo.weight": torch.zeros(1)})
    # attention in the up levels depends on the training resolution: the config must be given
    cfg_attn = dataclasses.replace(cfg, attn_resolutions=(8,))
    _, sd_attn = taming_state_dict(cfg_attn)
    with pytest.raises(ValueError, match="pass cfg"):
        VQ.load_vqgan_decoder(sd_attn)
    assert VQ.load_vqgan_decoder(sd_attn, cfg_attn)[0] == cfg_attn


def test_config_from_taming_yaml_and_hf():
    yaml_params = {"model": {"params": {"embed_dim": 256, "n_embed": 8192, "ddconfig": {
        "double_z": False, "z_channels": 256, "resolution": 512, "in_channels": 3, "out_ch": 3, "ch": 128,
        "ch_mult": [1, 1, 2, 2, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}}}}
    cfg = VQ.vq_config_from_taming(yaml_params)
    assert cfg == VQ.VQConfig() == VQ.vq_config_from_hf(transformers.ChameleonVQVAEConfig().to_dict())
    assert cfg.downsample == 16 and cfg.grid(768, 512) == (48, 32)
    assert VQ.vq_config_from_hf(VQ.vq_config_to_hf(cfg)) == cfg


def brute_neighbours(cb: np.ndarray, k: int) -> np.ndarray:
    d = ((cb[:, None, :].astype(np.float64) - cb[None, :, :]) ** 2).sum(-1)
    np.fill_diagonal(d, np.inf)
    return np.argsort(d, axis=1, kind="stable")[:, :k]  # stable: ties in index order


def test_neighbour_table_equals_brute_force():
    rng = np.random.default_rng(0)
    # small-integer codes: distances are exact in float32 and ties (including duplicate rows) are everywhere
    cb = rng.integers(-2, 3, (300, 4)).astype(np.float32)
    cb[7] = cb[3]
    want = brute_neighbours(cb, 12)
    for block in (64, 77, 300, 1000):
        got = neighbour_codes(cb, 12, block=block)
        assert got.dtype == np.int32 and got.shape == (300, 12)
        np.testing.assert_array_equal(got, want)
    assert got[3, 0] == 7 and got[7, 0] == 3  # a duplicate is a neighbour at distance 0; self never is
    assert not (got == np.arange(300)[:, None]).any()
    # a Chameleon-sized codebook (8192 x 256) in chunks; spot-check rows against float64 brute force
    big = rng.normal(size=(8192, 256)).astype(np.float32)
    table = neighbour_codes(big, 10)
    assert table.shape == (8192, 10)
    for r in (0, 4097, 8191):
        d = ((big.astype(np.float64) - big[r]) ** 2).sum(1)
        d[r] = np.inf
        np.testing.assert_array_equal(table[r], np.argsort(d, kind="stable")[:10])


def test_bad_inputs_fail_clearly():
    _, cfg, params = hf_vq("attn")
    with pytest.raises(ValueError, match=r"image size 18x16 is not divisible by the VQ tokenizer's downsampling "
                                         r"factor 4"):
        VQ.encode(cfg, params, np.zeros((1, 3, 18, 16), np.float32))
    with pytest.raises(ValueError, match=r"not divisible"):  # at trace time under jit too
        VQ.encode_jit(cfg, params, np.zeros((1, 3, 16, 22), np.float32))
    with pytest.raises(ValueError, match=r"expects \(B, 3, H, W\)"):
        VQ.encode(cfg, params, np.zeros((1, 1, 16, 16), np.float32))
    with pytest.raises(ValueError, match=r"decode expects a grid \(B, h, w\)"):
        VQ.decode(cfg, params, np.zeros((4, 4), np.int32))
    with pytest.raises(ValueError, match=r"k must be an integer in \[1, 4\]"):
        neighbour_codes(np.zeros((5, 2)), 0)
    with pytest.raises(ValueError, match=r"k must be an integer in \[1, 4\]"):
        neighbour_codes(np.zeros((5, 2)), 5)
    with pytest.raises(ValueError, match="multiples of 32"):
        VQ.VQConfig(base_channels=48)
    with pytest.raises(ValueError, match="double_latent"):
        VQ.vq_config_from_hf({"double_latent": True})
    with pytest.raises(ValueError, match="attn_type 'linear'"):
        VQ.VQConfig(attn_type="linear")
