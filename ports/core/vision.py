"""ViT vision towers of the LLaVA family (CLIP and SigLIP) and LLaVA's multimodal projector: params, forward, HF maps.

Params are a plain pytree:
    {"patch_embed": [C, p, p, D], "patch_bias": [D] (SigLIP), "class_embed": [D] (CLIP), "pos_embed": [P, D],
     "pre_norm", "pre_norm_b": [D] (CLIP), "layers": [per-layer dict, ...], "post_norm", "post_norm_b": [D]}
with per-layer keys attn_norm(_b), wq, bq, wk, bk, wv, bv, wo, bo, mlp_norm(_b), w_fc1, b_fc1, w_fc2, b_fc2.
Matrices are stored [in, out]; the patch kernel [C, p, p, D] is HF's Conv2d weight [D, C, p, p] permuted (key-map
transform "conv"), so the stride-p convolution is a patchify + matmul.

Hidden-state indices follow HF's `output_hidden_states`: 0 = embeddings (after CLIP's pre-layernorm), i = output of
encoder layer i, num_layers (= -1) = last layer output before post_layernorm. Negative indices count from the end
of those num_layers + 1 states, so LLaVA's `vision_feature_layer=-2` is the output of the second-to-last layer.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ports.core import layers as LY
from ports.core.hf_layout import hf_shape_to_ours, hf_to_ours, key_mismatch_error, ours_shape_to_hf, ours_to_hf

VISION_TYPES = ("clip_vision_model", "siglip_vision_model")

# What each HF tower type builds (HF configs cannot express other combinations).
_ARCH = {
    "clip_vision_model": dict(class_token=True, pre_layernorm=True, patch_bias=False),
    "siglip_vision_model": dict(class_token=False, pre_layernorm=False, patch_bias=True),
}
# HF's CLIPVisionConfig / SiglipVisionConfig defaults: older hub configs write only the keys that differ from them.
_HF_DEFAULTS = {
    "clip_vision_model": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                              image_size=224, patch_size=32, num_channels=3, layer_norm_eps=1e-5,
                              hidden_act="quick_gelu"),
    "siglip_vision_model": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                                image_size=224, patch_size=16, num_channels=3, layer_norm_eps=1e-6,
                                hidden_act="gelu_pytorch_tanh"),
}


def _quick_gelu(x):
    return x * jax.nn.sigmoid(1.702 * x)


# HF ACT2FN names -> functions (computed in float32 by `activation`).
ACTIVATIONS = {
    "quick_gelu": _quick_gelu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
}


def activation(name: str, x: jax.Array) -> jax.Array:
    """HF activation `name` applied in float32, result in x's dtype."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; jspec supports {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name](x.astype(jnp.float32)).astype(x.dtype)


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """torch.nn.LayerNorm over the last axis (biased variance), computed in float32, result in x's dtype."""
    xf = x.astype(jnp.float32)
    mu = jnp.mean(xf, axis=-1, keepdims=True)
    xc = xf - mu
    y = xc * jax.lax.rsqrt(jnp.mean(xc * xc, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


# --------------------------------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """A CLIP or SigLIP ViT tower (hashable: the jitted forward closes over it)."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"
    class_token: bool = True
    pre_layernorm: bool = True
    patch_bias: bool = False

    def __post_init__(self):
        if self.model_type not in VISION_TYPES:
            raise ValueError(f"unknown vision tower model_type {self.model_type!r}; jspec supports {VISION_TYPES}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported vision hidden_act {self.hidden_act!r}; jspec supports {sorted(ACTIVATIONS)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision hidden_size={self.hidden_size} is not a multiple of "
                             f"num_attention_heads={self.num_heads}")
        if self.patch_size > self.image_size:
            raise ValueError(f"vision patch_size={self.patch_size} exceeds image_size={self.image_size}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def grid(self) -> int:
        """Patches per side (pixels past grid * patch_size are not seen, as in HF's stride-p conv)."""
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid * self.grid

    @property
    def num_positions(self) -> int:
        """Tokens per image in the encoder: patches plus the class token (CLIP)."""
        return self.num_patches + int(self.class_token)

    @property
    def num_params(self) -> int:
        return int(sum(np.prod(s) for s in jax.tree.leaves(param_shapes(self), is_leaf=lambda x: isinstance(x, tuple))))


def vision_config_from_hf(d: dict[str, Any]) -> VisionConfig:
    """Parse an HF `CLIPVisionConfig` / `SiglipVisionConfig` dict (a LLaVA config's "vision_config"); missing keys
    take HF's defaults for that type. SigLIP's pooling head (`vision_use_head`) is not part of the tower here."""
    model_type = d.get("model_type")
    if model_type not in VISION_TYPES:
        raise ValueError(f"unknown vision tower model_type {model_type!r}; jspec supports {VISION_TYPES}")
    v = dict(_HF_DEFAULTS[model_type])
    v.update({k: d[k] for k in v if d.get(k) is not None})
    return VisionConfig(model_type=model_type, hidden_size=int(v["hidden_size"]),
                        intermediate_size=int(v["intermediate_size"]), num_layers=int(v["num_hidden_layers"]),
                        num_heads=int(v["num_attention_heads"]), image_size=int(v["image_size"]),
                        patch_size=int(v["patch_size"]), num_channels=int(v["num_channels"]),
                        layer_norm_eps=float(v["layer_norm_eps"]), hidden_act=v["hidden_act"], **_ARCH[model_type])


def vision_config_to_hf(cfg: VisionConfig) -> dict[str, Any]:
    """The HF vision_config dict that builds this tower (SigLIP without its pooling head)."""
    arch = {k: getattr(cfg, k) for k in _ARCH[cfg.model_type]}
    if arch != _ARCH[cfg.model_type]:
        raise ValueError(f"{cfg.model_type} in HF is {_ARCH[cfg.model_type]}; this config has {arch}")
    out = {"model_type": cfg.model_type, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
           "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads, "image_size": cfg.image_size,
           "patch_size": cfg.patch_size, "num_channels": cfg.num_channels, "layer_norm_eps": cfg.layer_norm_eps,
           "hidden_act": cfg.hidden_act}
    if cfg.model_type == "siglip_vision_model":
        out["vision_use_head"] = False
    return out


# --------------------------------------------------------------------------------------------------- params


def param_shapes(cfg: VisionConfig) -> dict:
    """Shapes of every parameter (the same structure `init_params` and the converters produce)."""
    d, f, c, p = cfg.hidden_size, cfg.intermediate_size, cfg.num_channels, cfg.patch_size
    layer = {"attn_norm": (d,), "attn_norm_b": (d,), "wq": (d, d), "bq": (d,), "wk": (d, d), "bk": (d,),
             "wv": (d, d), "bv": (d,), "wo": (d, d), "bo": (d,), "mlp_norm": (d,), "mlp_norm_b": (d,),
             "w_fc1": (d, f), "b_fc1": (f,), "w_fc2": (f, d), "b_fc2": (d,)}
    shapes = {"patch_embed": (c, p, p, d), "pos_embed": (cfg.num_positions, d)}
    if cfg.patch_bias:
        shapes["patch_bias"] = (d,)
    if cfg.class_token:
        shapes["class_embed"] = (d,)
    if cfg.pre_layernorm:
        shapes.update(pre_norm=(d,), pre_norm_b=(d,))
    shapes["layers"] = [dict(layer) for _ in range(cfg.num_layers)]
    shapes.update(post_norm=(d,), post_norm_b=(d,))
    return shapes


def _init_from_shapes(shapes, key: jax.Array, dtype, std: float):
    is_shape = lambda x: isinstance(x, tuple)
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=is_shape)
    keys = jax.random.split(key, len(flat))
    out = []
    for k, (path, shape) in zip(keys, flat):
        if jax.tree_util.keystr(path).endswith("norm']"):
            out.append(jnp.ones(shape, dtype))
        else:
            out.append((jax.random.normal(k, shape, jnp.float32) * std).astype(dtype))
    return jax.tree.unflatten(treedef, out)


def init_params(cfg: VisionConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> dict:
    """Random params (normal(0, std) everywhere except unit LayerNorm scales)."""
    return _init_from_shapes(param_shapes(cfg), key, dtype, std)


# --------------------------------------------------------------------------------------------------- forward


class VisionOut(NamedTuple):
    hidden: tuple  # the requested hidden states, in request order, each [N, num_positions, D]
    post_norm: jax.Array | None  # post_layernorm(last layer output) [N, num_positions, D] when asked, else None


def resolve_layers(cfg: VisionConfig, feature_layers: int | Sequence[int]) -> tuple[int, ...]:
    """Hidden-state indices (an int or a sequence, negative allowed as in HF) as indices in [0, num_layers]."""
    layers = (feature_layers,) if isinstance(feature_layers, (int, np.integer)) else tuple(feature_layers)
    n = cfg.num_layers + 1
    bad = [i for i in layers if not -n <= int(i) < n]
    if bad:
        raise ValueError(f"vision feature layers {bad} out of range: the {cfg.model_type} tower has {n} hidden "
                         f"states (indices {-n}..{n - 1})")
    return tuple(int(i) % n for i in layers)


def check_pixel_values(cfg: VisionConfig, pixel_values) -> None:
    """Raise ValueError naming the expected shape unless pixel_values is [N, C, image_size, image_size]."""
    want = (cfg.num_channels, cfg.image_size, cfg.image_size)
    shape = tuple(pixel_values.shape)
    if len(shape) != 4 or shape[1:] != want:
        raise ValueError(f"pixel_values has shape {shape}; the {cfg.model_type} tower expects "
                         f"(N, {want[0]}, {want[1]}, {want[2]}) (NCHW, num_channels={cfg.num_channels}, "
                         f"image_size={cfg.image_size})")


def patchify(cfg: VisionConfig, pixel_values: jax.Array) -> jax.Array:
    """[N, C, H, W] -> [N, grid*grid, C*p*p]: patches row-major, each flattened (channel, row, column), which is
    the order of the flattened conv kernel. Pixels past grid * patch_size are dropped, as a 'valid' conv does."""
    n, c = pixel_values.shape[:2]
    g, p = cfg.grid, cfg.patch_size
    x = pixel_values[:, :, : g * p, : g * p].reshape(n, c, g, p, g, p)
    return x.transpose(0, 2, 4, 1, 3, 5).reshape(n, g * g, c * p * p)


def embed(cfg: VisionConfig, params: dict, pixel_values: jax.Array) -> jax.Array:
    """Hidden state 0: patch embedding (+ class token) + position embeddings (+ CLIP's pre-layernorm)."""
    check_pixel_values(cfg, pixel_values)
    dt = params["pos_embed"].dtype
    x = patchify(cfg, jnp.asarray(pixel_values).astype(dt))
    h = LY.einsum_f32("npk,kd->npd", x, params["patch_embed"].reshape(-1, cfg.hidden_size))
    if cfg.patch_bias:
        h = h + params["patch_bias"].astype(jnp.float32)
    h = h.astype(dt)
    if cfg.class_token:
        cls = jnp.broadcast_to(params["class_embed"].astype(dt), (h.shape[0], 1, cfg.hidden_size))
        h = jnp.concatenate([cls, h], axis=1)
    h = h + params["pos_embed"]
    if cfg.pre_layernorm:
        h = layer_norm(h, params["pre_norm"], params["pre_norm_b"], cfg.layer_norm_eps)
    return h


def encoder_layer(cfg: VisionConfig, p: dict, x: jax.Array) -> jax.Array:
    """One pre-norm ViT block: full bidirectional self-attention, then the MLP, each with a residual."""
    B, T, D = x.shape
    H, Dh = cfg.num_heads, cfg.head_dim
    h = layer_norm(x, p["attn_norm"], p["attn_norm_b"], cfg.layer_norm_eps)
    q = LY.linear(h, p["wq"], p["bq"]).reshape(B, T, H, Dh)
    k = LY.kv_rows(LY.linear(h, p["wk"], p["bk"]).reshape(B, T, H, Dh))
    v = LY.kv_rows(LY.linear(h, p["wv"], p["bv"]).reshape(B, T, H, Dh))
    o = LY.attention(q, k, v, jnp.ones((B, T, T), bool))
    x = x + LY.linear(o.reshape(B, T, D), p["wo"], p["bo"])
    h = layer_norm(x, p["mlp_norm"], p["mlp_norm_b"], cfg.layer_norm_eps)
    h = activation(cfg.hidden_act, LY.linear(h, p["w_fc1"], p["b_fc1"]))
    return x + LY.linear(h, p["w_fc2"], p["b_fc2"])


def forward(cfg: VisionConfig, params: dict, pixel_values: jax.Array, *,
            feature_layers: int | Sequence[int] = (-2,), post_norm: bool = False) -> VisionOut:
    """Encode images [N, C, H, W] (float, NCHW as HF processors give them).

    Returns the hidden states at `feature_layers` (HF `output_hidden_states` indexing, see the module docstring)
    and, if `post_norm`, post_layernorm of the last layer output over all tokens (HF SigLIP's last_hidden_state;
    HF CLIP's pooler_output is its token 0). Layers past the deepest one needed are not run.
    """
    idx = resolve_layers(cfg, feature_layers)
    x = embed(cfg, params, pixel_values)
    states = {0: x}
    depth = cfg.num_layers if post_norm else max(idx, default=0)
    for i in range(depth):
        x = encoder_layer(cfg, params["layers"][i], x)
        states[i + 1] = x
    post = layer_norm(x, params["post_norm"], params["post_norm_b"], cfg.layer_norm_eps) if post_norm else None
    return VisionOut(tuple(states[i] for i in idx), post)


FEATURE_STRATEGIES = ("default", "full")


def select_features(cfg: VisionConfig, hidden_states: Sequence[jax.Array] | jax.Array,
                    strategy: str = "default") -> jax.Array:
    """LLaVA's image features from the selected hidden states ([N, T, D] each, in vision_feature_layer order):
    concatenated along features -> [N, T', D * len]. "default" drops token 0 (CLIP's class token; like HF, it does
    so whatever the tower), "full" keeps all tokens."""
    if strategy not in FEATURE_STRATEGIES:
        raise ValueError(f"unknown vision_feature_select_strategy {strategy!r}; expected one of {FEATURE_STRATEGIES}")
    hs = (hidden_states,) if hasattr(hidden_states, "ndim") else tuple(hidden_states)
    if not hs:
        raise ValueError("select_features: no hidden states given")
    for h in hs:
        if h.ndim != 3 or h.shape[1] != cfg.num_positions or h.shape[2] != cfg.hidden_size:
            raise ValueError(f"select_features: hidden state of shape {tuple(h.shape)}, expected "
                             f"(N, {cfg.num_positions}, {cfg.hidden_size})")
    x = hs[0] if len(hs) == 1 else jnp.concatenate(hs, axis=-1)
    return x[:, 1:] if strategy == "default" else x


def num_feature_tokens(cfg: VisionConfig, strategy: str = "default") -> int:
    """Tokens per image that `select_features` keeps."""
    return cfg.num_positions - int(strategy == "default")


def image_features(cfg: VisionConfig, params: dict, pixel_values: jax.Array,
                   feature_layer: int | Sequence[int] = -2, strategy: str = "default") -> jax.Array:
    """Tower features before the projector, as HF LLaVA's get_image_features selects them: [N, T', D * layers];
    `ports.core.layers.VISION_BATCH` images (tiles, frames) at a time, so many frames encode in bounded memory."""
    def encode(pv):
        return select_features(cfg, forward(cfg, params, pv, feature_layers=feature_layer).hidden, strategy)

    return LY.in_batches(encode, (pixel_values,), LY.VISION_BATCH)


# --------------------------------------------------------------------------------------------------- projector


@dataclasses.dataclass(frozen=True)
class ProjectorConfig:
    """LLaVA's multimodal projector (HF LlavaMultiModalProjector): linear_1 -> act -> linear_2."""

    in_dim: int  # vision hidden_size * number of vision feature layers
    out_dim: int  # text hidden_size
    bias: bool = True  # multimodal_projector_bias
    act: str = "gelu"  # projector_hidden_act

    def __post_init__(self):
        if self.act not in ACTIVATIONS:
            raise ValueError(f"unsupported projector_hidden_act {self.act!r}; jspec supports {sorted(ACTIVATIONS)}")


def projector_config_from_hf(d: dict[str, Any], vision: VisionConfig, text_hidden_size: int) -> ProjectorConfig:
    """The projector of an HF llava / llava_next / llava_onevision config dict (vision and text already parsed)."""
    layers = d.get("vision_feature_layer", -2)
    n = 1 if isinstance(layers, int) else len(layers)
    return ProjectorConfig(in_dim=vision.hidden_size * n, out_dim=int(text_hidden_size),
                           bias=bool(d.get("multimodal_projector_bias", True)),
                           act=d.get("projector_hidden_act") or "gelu")


def projector_param_shapes(pc: ProjectorConfig) -> dict:
    shapes = {"w1": (pc.in_dim, pc.out_dim), "w2": (pc.out_dim, pc.out_dim)}
    if pc.bias:
        shapes.update(b1=(pc.out_dim,), b2=(pc.out_dim,))
    return shapes


def init_projector(pc: ProjectorConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> dict:
    return _init_from_shapes(projector_param_shapes(pc), key, dtype, std)


def projector_forward(params: dict, feats: jax.Array, act: str = "gelu") -> jax.Array:
    """linear_1 -> act -> linear_2 over the last axis of feats [..., in_dim], in the params' dtype."""
    x = feats.astype(params["w1"].dtype)
    x = activation(act, LY.linear(x, params["w1"], params.get("b1")))
    return LY.linear(x, params["w2"], params.get("b2"))


def projector_key_map(pc: ProjectorConfig, prefix: str = "multi_modal_projector."):
    """(hf_name, param path, transform) triples of the projector; prefix "model.multi_modal_projector." is the
    transformers-5 in-memory name, "multi_modal_projector." the checkpoint one (both layouts)."""
    rows = [(f"{prefix}linear_1.weight", ("w1",), "T"), (f"{prefix}linear_2.weight", ("w2",), "T")]
    if pc.bias:
        rows += [(f"{prefix}linear_1.bias", ("b1",), None), (f"{prefix}linear_2.bias", ("b2",), None)]
    return rows


# --------------------------------------------------------------------------------------------------- HF key maps


def hf_key_map(cfg: VisionConfig, prefix: str = ""):
    """(hf_name, param path, transform) triples, in the format of `ports.families.llama.hf_key_map`; transform "T" is a
    Linear weight, "conv" the patch Conv2d kernel. prefix is where the tower sits: "" (CLIPVisionModel /
    SiglipVisionModel in transformers 5), "vision_model." (their older layout), "vision_tower." (a LLaVA checkpoint
    written by transformers 5), "vision_tower.vision_model." (older hub LLaVA checkpoints),
    "model.vision_tower." (LlavaForConditionalGeneration.state_dict() in transformers 5)."""
    e = f"{prefix}embeddings."
    rows = [(f"{e}patch_embedding.weight", ("patch_embed",), "conv"),
            (f"{e}position_embedding.weight", ("pos_embed",), None)]
    if cfg.patch_bias:
        rows.append((f"{e}patch_embedding.bias", ("patch_bias",), None))
    if cfg.class_token:
        rows.append((f"{e}class_embedding", ("class_embed",), None))
    if cfg.pre_layernorm:
        rows += [(f"{prefix}pre_layrnorm.weight", ("pre_norm",), None),
                 (f"{prefix}pre_layrnorm.bias", ("pre_norm_b",), None)]
    linears = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.out_proj",
               "_fc1": "mlp.fc1", "_fc2": "mlp.fc2"}
    norms = {"attn_norm": "layer_norm1", "mlp_norm": "layer_norm2"}
    for i in range(cfg.num_layers):
        lp = f"{prefix}encoder.layers.{i}."
        for ours, theirs in norms.items():
            rows += [(f"{lp}{theirs}.weight", ("layers", i, ours), None),
                     (f"{lp}{theirs}.bias", ("layers", i, ours + "_b"), None)]
        for ours, theirs in linears.items():
            rows += [(f"{lp}{theirs}.weight", ("layers", i, "w" + ours), "T"),
                     (f"{lp}{theirs}.bias", ("layers", i, "b" + ours), None)]
    rows += [(f"{prefix}post_layernorm.weight", ("post_norm",), None),
             (f"{prefix}post_layernorm.bias", ("post_norm_b",), None)]
    return rows


# Tower tensors HF checkpoints may carry that the port deliberately does not use (regexes relative to the tower
# prefix; `ignored_hf_keys(prefix)` anchors them): SigLIP's attention-pooling head (LLaVA reads hidden states, never
# the pooled output) and the position_ids buffer that older transformers saved.
VISION_IGNORED_HF_KEYS = (
    r"embeddings\.position_ids$",
    r"head\.probe$",
    r"head\.attention\.(in_proj_weight|in_proj_bias|out_proj\.weight|out_proj\.bias)$",
    r"head\.layernorm\.(weight|bias)$",
    r"head\.mlp\.fc[12]\.(weight|bias)$",
)


def ignored_hf_keys(prefix: str = "") -> tuple[str, ...]:
    """`VISION_IGNORED_HF_KEYS` anchored at a tower prefix (for `Family.ignored_keys`, which uses re.search)."""
    return tuple("^" + re.escape(prefix) + p for p in VISION_IGNORED_HF_KEYS)


def _to_numpy(t) -> np.ndarray:
    if hasattr(t, "detach"):  # a torch tensor (numpy has no bfloat16 view of it: upcast)
        t = t.detach().cpu()
        if str(t.dtype) == "torch.bfloat16":
            t = t.float()
        return t.numpy()
    return np.asarray(t)


def params_from_rows(rows, shapes, state_dict: dict, *, prefix: str = "", ignored: Sequence[str] = (),
                     dtype=jnp.float32, what: str = "params") -> dict:
    """Params from an HF-layout mapping {name: tensor (torch / numpy)} through key-map rows. Every row must be
    present with its shape; every key under `prefix` must be mapped or match `ignored` (re.search). Keys outside
    the prefix are left alone. Raises ValueError listing missing / unexpected / mis-shaped tensors."""
    params = jax.tree.map(lambda s: None, shapes, is_leaf=lambda x: isinstance(x, tuple))
    mapped = {name for name, _, _ in rows}
    pats = [re.compile(p) for p in ignored]
    missing, bad = [], []
    for name, path, tr in rows:
        if name not in state_dict:
            missing.append(name)
            continue
        arr = _to_numpy(state_dict[name])
        want = shapes
        for p in path:
            want = want[p]
        if arr.ndim != len(want) or hf_shape_to_ours(arr.shape, tr) != tuple(want):
            bad.append(f"{name}: {tuple(arr.shape)}, expected {ours_shape_to_hf(want, tr)}")
            continue
        node = params
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = jnp.asarray(hf_to_ours(arr, tr), dtype)
    unexpected = [k for k in state_dict if k.startswith(prefix) and k not in mapped
                  and not any(p.search(k) for p in pats)]
    if missing or unexpected or bad:
        raise key_mismatch_error(f"state dict does not match the {what} (prefix {prefix!r}):", missing, unexpected, bad)
    return params


def params_to_state_dict(rows, params: dict) -> dict[str, np.ndarray]:
    """{hf_name: numpy array in HF layout} for key-map rows (the inverse of `params_from_rows`)."""
    out = {}
    for name, path, tr in rows:
        node = params
        for p in path:
            node = node[p]
        out[name] = np.ascontiguousarray(ours_to_hf(np.asarray(jax.device_get(node)), tr))
    return out


def params_from_state_dict(cfg: VisionConfig, state_dict: dict, prefix: str = "", dtype=jnp.float32) -> dict:
    """Tower params from an HF state dict / checkpoint mapping with the tower at `prefix` (see `hf_key_map`)."""
    return params_from_rows(hf_key_map(cfg, prefix), param_shapes(cfg), state_dict, prefix=prefix,
                            ignored=ignored_hf_keys(prefix), dtype=dtype, what=f"{cfg.model_type} tower")


def state_dict_from_params(cfg: VisionConfig, params: dict, prefix: str = "") -> dict[str, np.ndarray]:
    """The tower's params as an HF-layout {name: numpy array} (loads into transformers with strict=True)."""
    return params_to_state_dict(hf_key_map(cfg, prefix), params)


def projector_params_from_state_dict(pc: ProjectorConfig, state_dict: dict, prefix: str = "multi_modal_projector.",
                                     dtype=jnp.float32) -> dict:
    return params_from_rows(projector_key_map(pc, prefix), projector_param_shapes(pc), state_dict, prefix=prefix,
                            dtype=dtype, what="multimodal projector")
