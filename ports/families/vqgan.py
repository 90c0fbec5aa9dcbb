"""Chameleon's VQGAN image tokenizer (the taming-transformers `VQModel`): encoder, quantizer and decoder.

The encoder + quantizer match HF `ChameleonVQVAE` (transformers ships no decoder); the decoder is the taming
`Decoder` of the same architecture, the half that Lumina-mGPT / Anole load from Meta's `tokenizer/vqgan.ckpt`.

Params are a plain pytree that mirrors the taming state-dict names one to one, so a checkpoint key is its path
joined with dots (`decoder.up.1.block.0.conv1.weight` is params["decoder"]["up"][1]["block"][0]["conv1"]["weight"]):

    encoder:  conv_in, down[i] {block[j], attn[j], downsample.conv}, mid {block_1, attn_1, block_2}, norm_out, conv_out
    quant_conv, quantize.embedding.weight [K, D] (the codebook), post_quant_conv
    decoder:  conv_in, mid {block_1, attn_1, block_2}, up[i] {block[j], attn[j], upsample.conv}, norm_out, conv_out

A ResnetBlock holds norm1, conv1, norm2, conv2 (+ nin_shortcut when channels change); an attention block holds
norm, q, k, v, proj_out. Kernels keep PyTorch's [out, in, kh, kw] layout (no key-map transform); activations run
NHWC inside. Images are NCHW in [-1, 1] (what HF's Chameleon processor produces); codes are [B, h, w] int32 with
h = H / f, w = W / f, f = 2 ** (len(channel_multiplier) - 1), row-major as HF flattens them.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

GROUPS = 32  # taming's Normalize: GroupNorm(32, C, eps=1e-6)
NORM_EPS = 1e-6
ATTN_TYPES = ("vanilla", "none")
# f32 convolutions and matmuls at full precision on every backend (TF32 would flip near-tied codes)
PRECISION = jax.lax.Precision.HIGHEST

# Parts of the model, as top-level param keys. HF's ChameleonVQVAE has all but the decoder.
ALL_PARTS = ("encoder", "quant_conv", "quantize", "post_quant_conv", "decoder")
HF_PARTS = ("encoder", "quant_conv", "quantize", "post_quant_conv")
ENCODE_PARTS = ("encoder", "quant_conv", "quantize")
DECODE_PARTS = ("quantize", "post_quant_conv", "decoder")


# --------------------------------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class VQConfig:
    """A taming VQGAN (hashable). Field names follow HF's ChameleonVQVAEConfig; defaults are Chameleon's tokenizer."""

    embed_dim: int = 256  # codebook vector size D
    num_embeddings: int = 8192  # codebook size K
    latent_channels: int = 256  # z_channels of the encoder output / decoder input
    resolution: int = 512  # nominal image size: decides where attn_resolutions put attention (as in taming / HF)
    in_channels: int = 3
    out_channels: int = 3  # decoder out_ch
    base_channels: int = 128
    channel_multiplier: tuple[int, ...] = (1, 1, 2, 2, 4)
    num_res_blocks: int = 2
    attn_resolutions: tuple[int, ...] = ()
    attn_type: str = "vanilla"  # "vanilla": mid blocks have attention; "none": identity
    tanh_out: bool = False  # taming Decoder option (off in Chameleon)

    def __post_init__(self):
        object.__setattr__(self, "channel_multiplier", tuple(int(m) for m in self.channel_multiplier))
        object.__setattr__(self, "attn_resolutions", tuple(int(r) for r in self.attn_resolutions or ()))
        if not self.channel_multiplier:
            raise ValueError("VQGAN channel_multiplier is empty")
        if self.attn_type not in ATTN_TYPES:
            raise ValueError(f"VQGAN attn_type {self.attn_type!r} is not supported; jspec supports {ATTN_TYPES}")
        bad = [c for c in self.level_channels + (self.base_channels,) if c % GROUPS]
        if bad:
            raise ValueError(f"VQGAN channel counts {sorted(set(bad))} are not multiples of {GROUPS} "
                             "(GroupNorm groups)")

    @property
    def num_levels(self) -> int:
        return len(self.channel_multiplier)

    @property
    def downsample(self) -> int:
        """Pixels per code along each axis."""
        return 2 ** (self.num_levels - 1)

    @property
    def level_channels(self) -> tuple[int, ...]:
        return tuple(self.base_channels * m for m in self.channel_multiplier)

    def level_has_attn(self, level: int) -> bool:
        """Whether the ResnetBlocks of `level` are followed by attention (taming: curr_res in attn_resolutions)."""
        return self.attn_type == "vanilla" and self.resolution // 2 ** level in self.attn_resolutions

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """Code grid (h, w) of an image of height x width pixels (ValueError unless divisible by `downsample`)."""
        f = self.downsample
        if height % f or width % f:
            raise ValueError(f"image size {height}x{width} is not divisible by the VQ tokenizer's downsampling "
                             f"factor {f} (2 ** (len(channel_multiplier) - 1))")
        return height // f, width // f


def vq_config_from_hf(d: Mapping[str, Any] | None) -> VQConfig:
    """Parse an HF ChameleonVQVAEConfig dict (a chameleon config's "vq_config"); missing keys take HF's defaults."""
    d = dict(d or {})
    if d.get("double_latent"):
        raise ValueError("vq_config.double_latent=true is not supported (HF's ChameleonVQVAE cannot run it either: "
                         "its quant_conv expects latent_channels inputs)")
    base = VQConfig()
    kw = {f.name: d[f.name] for f in dataclasses.fields(VQConfig) if d.get(f.name) is not None}
    kw.pop("out_channels", None)
    kw.pop("tanh_out", None)
    return dataclasses.replace(base, **kw)


def vq_config_to_hf(cfg: VQConfig) -> dict[str, Any]:
    """The HF vq_config dict for this tokenizer (the decoder-only fields out_channels / tanh_out have no HF key)."""
    return {"model_type": "chameleon_vqgan", "embed_dim": cfg.embed_dim, "num_embeddings": cfg.num_embeddings,
            "double_latent": False, "latent_channels": cfg.latent_channels, "resolution": cfg.resolution,
            "in_channels": cfg.in_channels, "base_channels": cfg.base_channels,
            "channel_multiplier": list(cfg.channel_multiplier), "num_res_blocks": cfg.num_res_blocks,
            "attn_resolutions": list(cfg.attn_resolutions) or None, "dropout": 0.0, "attn_type": cfg.attn_type}


def vq_config_from_taming(params: Mapping[str, Any]) -> VQConfig:
    """From a taming / Chameleon `vqgan.yaml`'s `model.params` (embed_dim, n_embed, ddconfig{...}), or the whole
    yaml dict."""
    if "model" in params:
        params = params["model"]["params"]
    dd = params["ddconfig"]
    if dd.get("double_z"):
        raise ValueError("ddconfig.double_z=true is not supported (VQGAN tokenizers use double_z=false)")
    return VQConfig(embed_dim=int(params["embed_dim"]), num_embeddings=int(params["n_embed"]),
                    latent_channels=int(dd["z_channels"]), resolution=int(dd["resolution"]),
                    in_channels=int(dd.get("in_channels", 3)), out_channels=int(dd.get("out_ch", 3)),
                    base_channels=int(dd["ch"]), channel_multiplier=tuple(dd["ch_mult"]),
                    num_res_blocks=int(dd["num_res_blocks"]), attn_resolutions=tuple(dd.get("attn_resolutions") or ()),
                    attn_type=dd.get("attn_type", "vanilla"), tanh_out=bool(dd.get("tanh_out", False)))


# --------------------------------------------------------------------------------------------------- params


def _conv(cin: int, cout: int, k: int) -> dict:
    return {"weight": (cout, cin, k, k), "bias": (cout,)}


def _norm(c: int) -> dict:
    return {"weight": (c,), "bias": (c,)}


def _resblock(cin: int, cout: int) -> dict:
    p = {"norm1": _norm(cin), "conv1": _conv(cin, cout, 3), "norm2": _norm(cout), "conv2": _conv(cout, cout, 3)}
    if cin != cout:
        p["nin_shortcut"] = _conv(cin, cout, 1)
    return p


def _attn(c: int) -> dict:
    return {"norm": _norm(c), "q": _conv(c, c, 1), "k": _conv(c, c, 1), "v": _conv(c, c, 1), "proj_out": _conv(c, c, 1)}


def _mid(cfg: VQConfig, c: int) -> dict:
    mid = {"block_1": _resblock(c, c), "block_2": _resblock(c, c)}
    if cfg.attn_type == "vanilla":
        mid["attn_1"] = _attn(c)
    return mid


def encoder_shapes(cfg: VQConfig) -> dict:
    chans = cfg.level_channels
    down, cin = [], cfg.base_channels
    for i, cout in enumerate(chans):
        blocks, attn = [], []
        for _ in range(cfg.num_res_blocks):
            blocks.append(_resblock(cin, cout))
            cin = cout
            if cfg.level_has_attn(i):
                attn.append(_attn(cout))
        level = {"block": blocks, "attn": attn}
        if i != cfg.num_levels - 1:
            level["downsample"] = {"conv": _conv(cout, cout, 3)}
        down.append(level)
    return {"conv_in": _conv(cfg.in_channels, cfg.base_channels, 3), "down": down, "mid": _mid(cfg, cin),
            "norm_out": _norm(cin), "conv_out": _conv(cin, cfg.latent_channels, 3)}


def decoder_shapes(cfg: VQConfig) -> dict:
    chans = cfg.level_channels
    cin = chans[-1]
    top = {"conv_in": _conv(cfg.latent_channels, cin, 3), "mid": _mid(cfg, cin)}
    up = [None] * cfg.num_levels
    for i in reversed(range(cfg.num_levels)):
        blocks, attn = [], []
        for _ in range(cfg.num_res_blocks + 1):
            blocks.append(_resblock(cin, chans[i]))
            cin = chans[i]
            if cfg.level_has_attn(i):
                attn.append(_attn(cin))
        level = {"block": blocks, "attn": attn}
        if i != 0:
            level["upsample"] = {"conv": _conv(cin, cin, 3)}
        up[i] = level
    top.update(up=up, norm_out=_norm(cin), conv_out=_conv(cin, cfg.out_channels, 3))
    return top


def param_shapes(cfg: VQConfig, parts: Sequence[str] = ALL_PARTS) -> dict:
    """Shapes of the requested parts (see ALL_PARTS), in the taming state-dict structure."""
    unknown = [p for p in parts if p not in ALL_PARTS]
    if unknown:
        raise ValueError(f"unknown VQGAN parts {unknown}; expected some of {ALL_PARTS}")
    table = {
        "encoder": lambda: encoder_shapes(cfg),
        "quant_conv": lambda: _conv(cfg.latent_channels, cfg.embed_dim, 1),
        "quantize": lambda: {"embedding": {"weight": (cfg.num_embeddings, cfg.embed_dim)}},
        "post_quant_conv": lambda: _conv(cfg.embed_dim, cfg.latent_channels, 1),
        "decoder": lambda: decoder_shapes(cfg),
    }
    return {p: table[p]() for p in ALL_PARTS if p in parts}


def _is_shape(x) -> bool:
    return isinstance(x, tuple)


def leaf_paths(shapes) -> list[tuple]:
    """Every leaf path of a shapes / params tree, as tuples of dict keys and list indices."""
    flat = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=_is_shape)[0]
    return [tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path) for path, _ in flat]


def init_params(cfg: VQConfig, key: jax.Array, parts: Sequence[str] = ALL_PARTS, dtype=jnp.float32) -> dict:
    """Random params: He-normal kernels, zero biases, unit norm scales, a normal(0, 1) codebook. One random draw
    split on the host (no per-leaf compilation)."""
    shapes = param_shapes(cfg, parts)
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=_is_shape)
    sizes = [int(np.prod(shape)) for _, shape in flat]
    noise = np.asarray(jax.random.normal(key, (sum(sizes),), jnp.float32))
    out, offset = [], 0
    for (path, shape), n in zip(flat, sizes):
        name = jax.tree_util.keystr(path)
        z = noise[offset:offset + n].reshape(shape)
        offset += n
        if len(shape) == 4:
            arr = z * (shape[1] * shape[2] * shape[3]) ** -0.5
        elif "embedding" in name:
            arr = z
        elif name.endswith("['weight']"):  # GroupNorm scale
            arr = np.ones(shape, np.float32)
        else:
            arr = np.zeros(shape, np.float32)
        out.append(jnp.asarray(arr, dtype))
    return jax.tree.unflatten(treedef, out)


def codebook(params: dict) -> jax.Array:
    """The codebook [K, D] (taming `quantize.embedding.weight`)."""
    return params["quantize"]["embedding"]["weight"]


# --------------------------------------------------------------------------------------------------- layers


def conv2d(x: jax.Array, p: dict, stride: int = 1, padding=None) -> jax.Array:
    """PyTorch Conv2d on NHWC activations with an [out, in, kh, kw] kernel; default padding is kh // 2 per side."""
    w = p["weight"]
    if padding is None:
        ph, pw = w.shape[2] // 2, w.shape[3] // 2
        padding = ((ph, ph), (pw, pw))
    y = jax.lax.conv_general_dilated(x, w.astype(x.dtype), (stride, stride), padding,
                                     dimension_numbers=("NHWC", "OIHW", "NHWC"), precision=PRECISION)
    return y + p["bias"].astype(x.dtype)


def group_norm(x: jax.Array, p: dict) -> jax.Array:
    """torch.nn.GroupNorm(32, C, eps=1e-6) over NHWC, statistics in float32, result in x's dtype."""
    B, H, W, C = x.shape
    xf = x.astype(jnp.float32).reshape(B, H, W, GROUPS, C // GROUPS)
    mu = jnp.mean(xf, axis=(1, 2, 4), keepdims=True)
    xc = xf - mu
    var = jnp.mean(xc * xc, axis=(1, 2, 4), keepdims=True)
    y = (xc * jax.lax.rsqrt(var + NORM_EPS)).reshape(B, H, W, C)
    return (y * p["weight"].astype(jnp.float32) + p["bias"].astype(jnp.float32)).astype(x.dtype)


def swish(x: jax.Array) -> jax.Array:
    return x * jax.nn.sigmoid(x)


def resblock(p: dict, x: jax.Array) -> jax.Array:
    h = conv2d(swish(group_norm(x, p["norm1"])), p["conv1"])
    h = conv2d(swish(group_norm(h, p["norm2"])), p["conv2"])
    if "nin_shortcut" in p:
        x = conv2d(x, p["nin_shortcut"])
    return x + h


def attn_block(p: dict, x: jax.Array) -> jax.Array:
    """Single-head self-attention over all H*W positions, channels as features, scale C ** -0.5; residual."""
    B, H, W, C = x.shape
    h = group_norm(x, p["norm"])
    q, k, v = (conv2d(h, p[n]).reshape(B, H * W, C) for n in ("q", "k", "v"))
    s = jnp.einsum("bic,bjc->bij", q, k, precision=PRECISION, preferred_element_type=jnp.float32) * C ** -0.5
    a = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    o = jnp.einsum("bij,bjc->bic", a, v, precision=PRECISION).reshape(B, H, W, C)
    return x + conv2d(o, p["proj_out"])


def _mid_forward(p: dict, h: jax.Array) -> jax.Array:
    h = resblock(p["block_1"], h)
    if "attn_1" in p:
        h = attn_block(p["attn_1"], h)
    return resblock(p["block_2"], h)


# --------------------------------------------------------------------------------------------------- encode


def check_images(cfg: VQConfig, pixel_values) -> tuple[int, int]:
    """Raise ValueError unless pixel_values is [B, in_channels, H, W] with H, W divisible by the downsampling
    factor; returns the code grid (h, w)."""
    shape = tuple(pixel_values.shape)
    if len(shape) != 4 or shape[1] != cfg.in_channels:
        raise ValueError(f"pixel_values has shape {shape}; the VQ tokenizer expects (B, {cfg.in_channels}, H, W) "
                         f"(NCHW in [-1, 1])")
    return cfg.grid(shape[2], shape[3])


def encoder_forward(cfg: VQConfig, p: dict, x: jax.Array) -> jax.Array:
    """taming Encoder on NHWC input -> latents [B, h, w, latent_channels]."""
    h = conv2d(x, p["conv_in"])
    for i, level in enumerate(p["down"]):
        for j, block in enumerate(level["block"]):
            h = resblock(block, h)
            if level["attn"]:
                h = attn_block(level["attn"][j], h)
        if i != cfg.num_levels - 1:  # asymmetric padding: one zero row / column after, none before
            h = conv2d(h, level["downsample"]["conv"], stride=2, padding=((0, 1), (0, 1)))
    h = _mid_forward(p["mid"], h)
    return conv2d(swish(group_norm(h, p["norm_out"])), p["conv_out"])


def encode_latents(cfg: VQConfig, params: dict, pixel_values: jax.Array) -> jax.Array:
    """Continuous pre-quantisation latents [B, h, w, D] (encoder, then quant_conv) of images [B, C, H, W]."""
    check_images(cfg, pixel_values)
    dt = params["quant_conv"]["weight"].dtype
    x = jnp.asarray(pixel_values).astype(dt).transpose(0, 2, 3, 1)
    return conv2d(encoder_forward(cfg, params["encoder"], x), params["quant_conv"])


def quantize(codebook: jax.Array, z: jax.Array) -> jax.Array:
    """Index of the nearest codebook row for every latent vector z [..., D] (L2; ties to the lower index), computed
    as |z|^2 + |e|^2 - 2 z.e in float32 like taming / HF. Returns int32 [...]."""
    e = codebook.astype(jnp.float32)
    zf = z.astype(jnp.float32).reshape(-1, e.shape[1])
    d = (jnp.sum(zf * zf, axis=1, keepdims=True) + jnp.sum(e * e, axis=1)[None]
         - 2.0 * jnp.dot(zf, e.T, precision=PRECISION))
    return jnp.argmin(d, axis=1).astype(jnp.int32).reshape(z.shape[:-1])


def encode(cfg: VQConfig, params: dict, pixel_values: jax.Array) -> jax.Array:
    """Images [B, C, H, W] (NCHW, [-1, 1]) -> code grid [B, H/f, W/f] int32 (HF ChameleonVQVAE's image_tokens)."""
    return quantize(codebook(params), encode_latents(cfg, params, pixel_values))


# --------------------------------------------------------------------------------------------------- decode


def lookup(codebook: jax.Array, codes: jax.Array) -> jax.Array:
    """Codebook vectors [..., D] of integer codes [...] (taming get_codebook_entry, channels last)."""
    return jnp.take(codebook, codes.astype(jnp.int32), axis=0)


def decoder_forward(cfg: VQConfig, p: dict, z: jax.Array) -> jax.Array:
    """taming Decoder on NHWC latents [B, h, w, latent_channels] -> images NHWC."""
    h = conv2d(z, p["conv_in"])
    h = _mid_forward(p["mid"], h)
    for i in reversed(range(cfg.num_levels)):
        level = p["up"][i]
        for j, block in enumerate(level["block"]):
            h = resblock(block, h)
            if level["attn"]:
                h = attn_block(level["attn"][j], h)
        if i != 0:  # nearest-neighbour x2, then a 3x3 conv
            h = jnp.repeat(jnp.repeat(h, 2, axis=1), 2, axis=2)
            h = conv2d(h, level["upsample"]["conv"])
    h = conv2d(swish(group_norm(h, p["norm_out"])), p["conv_out"])
    return jnp.tanh(h) if cfg.tanh_out else h


def decode_latents(cfg: VQConfig, params: dict, zq: jax.Array) -> jax.Array:
    """Quantised latents [B, h, w, D] -> images [B, out_channels, h*f, w*f] (post_quant_conv, then the decoder)."""
    dt = params["post_quant_conv"]["weight"].dtype
    z = conv2d(zq.astype(dt), params["post_quant_conv"])
    return decoder_forward(cfg, params["decoder"], z).transpose(0, 3, 1, 2)


def decode(cfg: VQConfig, params: dict, codes: jax.Array) -> jax.Array:
    """Code grids [B, h, w] -> images [B, C, h*f, w*f] (NCHW, nominally [-1, 1]; not clamped)."""
    codes = jnp.asarray(codes)
    if codes.ndim != 3:
        raise ValueError(f"codes has shape {tuple(codes.shape)}; decode expects a grid (B, h, w)")
    return decode_latents(cfg, params, lookup(codebook(params), codes))


encode_jit = jax.jit(encode, static_argnums=0)
decode_jit = jax.jit(decode, static_argnums=0)


def to_uint8(images) -> np.ndarray:
    """Images [B, C, H, W] in [-1, 1] -> uint8 [B, H, W, C] (clamped, then truncated as Chameleon's tokenizer does)."""
    x = np.clip(np.asarray(images, np.float32), -1.0, 1.0)
    return ((x + 1.0) / 2.0 * 255.0).astype(np.uint8).transpose(0, 2, 3, 1)


# --------------------------------------------------------------------------------------------------- checkpoints


def key_map(cfg: VQConfig, prefix: str = "", parts: Sequence[str] = ALL_PARTS, path_prefix: tuple = ()):
    """(checkpoint name, param path, transform) rows: the name is prefix + the path joined with dots (taming and
    HF share these names). HF chameleon checkpoints hold HF_PARTS under "model.vqmodel."; a taming / Chameleon
    `vqgan.ckpt` holds ALL_PARTS at the top level (plus its training loss, `loss.*`)."""
    return [(prefix + ".".join(str(x) for x in path), path_prefix + path, None)
            for path in leaf_paths(param_shapes(cfg, parts))]


def _find_prefix(names, anchor: str) -> str:
    hits = sorted(n[: -len(anchor)] for n in names if n.endswith(anchor))
    if not hits:
        raise ValueError(f"state dict has no '*{anchor}' tensor: not a taming VQGAN checkpoint "
                         f"(first keys: {sorted(names)[:8]})")
    return min(hits, key=len)


def _read_state_dict(src, trust_pickle: bool) -> Mapping[str, Any]:
    if not isinstance(src, (str, os.PathLike)):
        sd = src
    else:
        path = os.fspath(src)
        if path.endswith(".safetensors"):
            from ports.core.safetensors_io import SafetensorsFile

            f = SafetensorsFile(path)
            sd = {k: f.get(k) for k in f.keys()}
        else:
            try:
                import torch
            except ImportError as e:
                raise ImportError(f"{path}: reading a PyTorch checkpoint needs torch (pip install torch), or convert "
                                  "it to safetensors") from e
            try:
                sd = torch.load(path, map_location="cpu", weights_only=not trust_pickle)
            except Exception as e:  # pickled non-tensor objects (e.g. OmegaConf hyper-parameters)
                if trust_pickle:
                    raise
                raise ValueError(f"{path}: torch.load(weights_only=True) failed ({type(e).__name__}: {e}); if you "
                                 "trust this file, pass trust_pickle=True") from e
    if isinstance(sd, Mapping) and isinstance(sd.get("state_dict"), Mapping):  # Lightning checkpoint
        sd = sd["state_dict"]
    if not isinstance(sd, Mapping):
        raise ValueError(f"expected a state dict (name -> tensor), got {type(sd).__name__}")
    return sd


def _infer_config(sd: Mapping[str, Any], prefix: str) -> VQConfig:
    """A VQConfig from the tensor shapes of a taming state dict (decoder + quantizer + post_quant_conv)."""
    shape = lambda n: tuple(sd[prefix + n].shape)
    K, D = shape("quantize.embedding.weight")
    z = shape("post_quant_conv.weight")[0]
    names = [n[len(prefix):] for n in sd if n.startswith(prefix)]
    levels = sorted({int(m.group(1)) for n in names if (m := re.match(r"decoder\.up\.(\d+)\.", n))})
    blocks = sorted({int(m.group(1)) for n in names if (m := re.match(r"decoder\.up\.0\.block\.(\d+)\.", n))})
    chans = [shape(f"decoder.up.{i}.block.0.conv1.weight")[0] for i in levels]
    base = chans[0]
    if any(c % base for c in chans):
        raise ValueError(f"cannot infer the VQGAN channel multipliers from level channels {chans}; pass cfg")
    if any(re.match(r"decoder\.up\.\d+\.attn\.", n) for n in names):
        raise ValueError("the decoder has attention inside its up levels, whose placement depends on the training "
                         "resolution; pass cfg (e.g. vq_config_from_taming(yaml) or the model's config.vq)")
    enc_in = prefix + "encoder.conv_in.weight"
    return VQConfig(embed_dim=D, num_embeddings=K, latent_channels=z,
                    in_channels=int(sd[enc_in].shape[1]) if enc_in in sd else 3,
                    out_channels=shape("decoder.conv_out.weight")[0], base_channels=base,
                    channel_multiplier=tuple(c // base for c in chans), num_res_blocks=len(blocks) - 1,
                    attn_type="vanilla" if prefix + "decoder.mid.attn_1.q.weight" in sd else "none")


def params_from_state_dict(cfg: VQConfig, state_dict: Mapping[str, Any], prefix: str = "",
                           parts: Sequence[str] = ALL_PARTS, dtype=jnp.float32) -> dict:
    """Params of `parts` from a taming / HF-layout mapping {name: tensor} with the model at `prefix`. Tensors of
    other parts and the training loss (`loss.*`) are skipped; anything else unknown under the prefix, a missing
    tensor or a wrong shape is a ValueError naming it."""
    from ports.core.vision import params_from_rows

    skip = [p for p in ALL_PARTS if p not in parts] + ["loss"]
    ignored = [rf"^{re.escape(prefix)}{re.escape(p)}\." for p in skip]
    return params_from_rows(key_map(cfg, prefix, parts), param_shapes(cfg, parts), state_dict, prefix=prefix,
                            ignored=ignored, dtype=dtype, what=f"VQGAN {'/'.join(parts)}")


def state_dict_from_params(cfg: VQConfig, params: dict, prefix: str = "") -> dict[str, np.ndarray]:
    """{taming name: numpy array} for every part present in params."""
    from ports.core.vision import params_to_state_dict

    parts = tuple(p for p in ALL_PARTS if p in params)
    return params_to_state_dict(key_map(cfg, prefix, parts), params)


def load_vqgan(src, cfg: VQConfig | None = None, *, parts: Sequence[str] = ALL_PARTS, prefix: str | None = None,
               trust_pickle: bool = False, dtype=jnp.float32) -> tuple[VQConfig, dict]:
    """(config, params of `parts`) from a taming-layout VQGAN: a path to .safetensors or a torch .ckpt / .pth
    (a Lightning checkpoint's "state_dict" is used), or an in-memory mapping {name: tensor / array}.

    `prefix` is where the model sits in the state dict (found from `decoder.conv_in.weight` /
    `encoder.conv_in.weight` when None). `cfg=None` infers the config from tensor shapes (decoder checkpoints
    without attention in their up levels, like Chameleon's); pass it otherwise, or to check shapes against it."""
    sd = _read_state_dict(src, trust_pickle)
    if prefix is None:
        anchor = "decoder.conv_in.weight" if "decoder" in parts else "encoder.conv_in.weight"
        prefix = _find_prefix(list(sd), anchor)
    if cfg is None:
        cfg = _infer_config(sd, prefix)
    return cfg, params_from_state_dict(cfg, sd, prefix, parts, dtype)


def load_vqgan_decoder(src, cfg: VQConfig | None = None, **kwargs) -> tuple[VQConfig, dict]:
    """The decoding half of a VQGAN tokenizer checkpoint: (config, {"quantize", "post_quant_conv", "decoder"}),
    ready for `decode(cfg, params, codes)`. See `load_vqgan` for `src`, `cfg` and keyword options.

    Lumina-mGPT / Anole: the language model and the VQ encoder load from the HF checkpoint directory with
    `ports.load_hf(dir)` (model_type "chameleon", whatever the config class name, e.g. ChameleonXLLMXConfig);
    the decoder comes from Meta's Chameleon tokenizer files that these projects ship next to it
    (`ckpts/chameleon/tokenizer/vqgan.ckpt` + `vqgan.yaml` in Lumina-mGPT, `tokenizer/vqgan.ckpt` in Anole):

        model = ports.load_hf("Lumina-mGPT-7B-768")
        vq_cfg, dec = vqgan.load_vqgan_decoder("vqgan.ckpt", model.config.vq, trust_pickle=True)
        images = vqgan.decode_jit(vq_cfg, dec, codes)          # codes [B, h, w] = BPE ids mapped back
                                                                # with ports.families.chameleon.bpe_to_codes
    """
    return load_vqgan(src, cfg, parts=DECODE_PARTS, **kwargs)
