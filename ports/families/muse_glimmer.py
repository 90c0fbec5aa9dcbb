"""Muse Glimmer (`muse_glimmer`, transformers 5.23's `MuseGlimmerForConditionalGeneration`): a vision tower
(`ports.families.muse_glimmer_vision`) and an adapter in front of a decoder that is LLaMA's (`ports.families.llama.forward`) with
these options of `ports.core.layers` / `ports.families.llama`, each read from `MuseGlimmerTextConfig`:
- the token embedding goes through an RMSNorm without a scale (`embed`; a block drafter reads the table without it,
  as transformers' DFlash candidate generator does);
- decoder norms are Gemma's centered RMSNorm (scale 1 + weight: `centered_norms`), and each block's output is
  normed again before the residual add (`post_attn_norm`, `post_mlp_norm`, eps `post_norm_eps`);
- attention: a scaleless RMSNorm of each head's queries and keys, the queries then multiplied by
  `qk_scale_factor` (on top of 1 / sqrt(head_dim)); rotary positions except in `nope_layers` (transformers'
  `layer_rope_theta` 0); the output gated by sigmoid(gate_proj(x)) per feature before o_proj (`w_attn_gate`);
  "sliding_attention" layers see the last `sliding_window` tokens, the `full_attention_layers` everything;
- logits: cap * tanh(lm_head(x) * output_multiplier / cap), cap = `final_logit_softcapping`.

Params: {"vision": tower params, "adapter": {"fc1" [out_hidden_size, P], "fc2" [P, P], "proj" [P, D]} (P =
projector_hidden_size), "lm": LLaMA's layout with, per layer, post_attn_norm, post_mlp_norm [D] and w_attn_gate
[D, H * Dh]}. The checkpoint layout is transformers 5.23's in-memory one, which its save_pretrained writes:
`model.vision_tower.*`, `model.vision_adapter.fc{1,2}`, `model.vision_projection`, `model.language_model.*`,
`lm_head.weight` (absent when tied).

Images and videos enter at prefill, as in `ports.families.qwen2_vl` but with plain 1-D positions: `prepare_inputs` (host)
checks the processor output (`pixel_values` [patches, patch_temporal * 3 * p * p] + `image_grid_thw` [N_img, 3],
`pixel_values_videos` + `video_grid_thw` [N_vid, 3]) against the prompt's placeholders (`image_token_id`,
`video_token_id`: t * h * w / merge^2 of them per item) and builds the tower's frame layout; `prompt_embeds` runs
the tower, the adapter (fc1, act, fc2, act), the projection and a scaleless RMSNorm, and puts the features over the
placeholders in order (images, then videos; row-major over the batch, as transformers' masked_scatter).

Configs are read as transformers 5.23 reads them (its defaults for absent fields); a config transformers would not
run, or jspec cannot, is a ValueError naming the field, raised before any weight is read.
"""
from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ports.core import config as PC
from ports.core import layers as LY
from ports.core import prompts as PR
from ports.families import llama
from ports.families import muse_glimmer_vision as MV
from ports.core import vision as VIS
from ports.core.config import TextConfig

ARCHITECTURE = "MuseGlimmerForConditionalGeneration"
LAYER_TYPES = ("full_attention", "sliding_attention")
# transformers 5.23's MuseGlimmerTextConfig defaults for the fields jspec reads
TEXT_DEFAULTS = dict(vocab_size=202048, hidden_size=6656, intermediate_size=19968, num_hidden_layers=52,
                     num_attention_heads=32, num_key_value_heads=2, head_dim=128, hidden_activation="silu",
                     max_position_embeddings=131072, rms_norm_eps=1e-5, eos_token_id=200001, bos_token_id=200000,
                     pad_token_id=None, tie_word_embeddings=False, attention_bias=False, sliding_window=2048,
                     final_logit_softcapping=20.0, qk_scale_factor=3.87, output_multiplier=0.19611613513818404,
                     post_norm_eps=1e-8)
DEFAULT_THETA = 10000.0  # transformers' default rope_theta (MuseGlimmerTextConfig sets none of its own)
# MuseGlimmerConfig's own defaults
TOP_DEFAULTS = dict(image_token_id=200092, video_token_id=200091, out_hidden_size=6144, projector_hidden_size=4096,
                    projector_hidden_act="gelu")


@dataclasses.dataclass(frozen=True)
class MuseGlimmerTextConfig(TextConfig):
    """The decoder: `TextConfig` plus the options of the module docstring (the names `ports.core.layers` and
    `ports.families.llama` read)."""

    full_attention_layers: tuple[int, ...] = ()
    nope_layers: tuple[int, ...] = ()
    qk_scale_factor: float | None = 3.87
    post_norm_eps: float = 1e-8
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    centered_norms: bool = True

    @property
    def num_params(self) -> int:
        d, q = self.hidden_size, self.num_heads * self.head_dim
        return super().num_params + self.num_layers * (d * q + 2 * d)  # the gate and the two post-norms


@dataclasses.dataclass(frozen=True)
class MuseGlimmerConfig(PC.TextFields):
    """Static, hashable config of a Muse Glimmer model; exposes the text fields the engine reads."""

    text: MuseGlimmerTextConfig
    vision: MV.MuseVisionConfig
    projector_hidden_size: int = 4096
    projector_hidden_act: str = "gelu"
    image_token_id: int = 200092
    video_token_id: int = 200091
    model_type: str = "muse_glimmer"

    def tokens_per_item(self, grid_thw) -> int:
        """Placeholder tokens one image / video of patch grid (t, h, w) takes (what the processor inserts)."""
        t, h, w = (int(x) for x in grid_thw)
        return t * h * w // self.vision.merge_unit


# ------------------------------------------------------------------------------------------ config


def _check(d: dict, key: str, kind: str, where: str = "text_config", minimum: int = 1):
    """d[key] checked: an int >= minimum, a bool, a number (finite), a positive number, or a number >= 0."""
    v = d[key]
    bad = None
    if kind == "bool":
        bad = None if isinstance(v, bool) else "true or false"
    elif kind == "int":
        bad = None if (isinstance(v, int) and not isinstance(v, bool) and v >= minimum) else \
            f"an integer >= {minimum}"
    else:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v)
        ok = ok and (kind == "number" or (v > 0 if kind == "positive" else v >= 0))
        bad = None if ok else {"number": "a finite number", "positive": "a positive number",
                               "nonneg": "a number >= 0"}[kind]
    if bad:
        raise ValueError(f"muse_glimmer {where}: {key} = {v!r}; expected {bad}")
    return float(v) if kind in ("number", "positive", "nonneg") else v


def _rope(t: dict, layers: int) -> tuple[PC.RopeConfig, tuple[int, ...]]:
    """(RoPE settings, NoPE layers) of the text config. transformers 5.23 rotates every layer whose
    `layer_rope_theta` is not 0 with the global `rope_parameters` theta (its docstring says the list overrides
    the global theta, its code does not): a list with another nonzero theta is refused, so no model runs other
    than it was meant to."""
    rp = t.get("rope_parameters") or {}
    if not isinstance(rp, dict) or any(k in LAYER_TYPES for k in rp):
        raise ValueError(f"muse_glimmer text_config: rope_parameters = {rp!r}; expected one dict (transformers' "
                         "Muse Glimmer rotary reads no per-layer-type parameters)")
    d = {**t, "rope_parameters": {"rope_theta": t.get("rope_theta", DEFAULT_THETA), **rp}}
    rope = PC.rope_from_hf(d)
    if rope.rope_type not in PC.ROPE_TYPES:
        raise ValueError(f"muse_glimmer text_config: rope_parameters rope_type {rope.rope_type!r} is not supported; "
                         f"jspec supports {PC.ROPE_TYPES}")
    if not rope.theta > 0:
        raise ValueError(f"muse_glimmer text_config: rope_parameters rope_theta = {rope.theta!r}; expected a "
                         "positive number")
    thetas = t.get("layer_rope_theta")
    if thetas is None:
        return rope, tuple(i for i in range(layers) if (layers - 1 - i) % 4 == 0)
    if not isinstance(thetas, list) or len(thetas) != layers or any(
            isinstance(x, bool) or not isinstance(x, (int, float)) or x < 0 for x in thetas):
        raise ValueError(f"muse_glimmer text_config: layer_rope_theta = {thetas!r}; expected {layers} numbers >= 0 "
                         "(one per num_hidden_layers; 0: no rotary embedding)")
    other = sorted({float(x) for x in thetas if x and float(x) != rope.theta})
    if other:
        raise ValueError(f"muse_glimmer text_config: layer_rope_theta holds {other}, not 0 or the global "
                         f"rope_theta {rope.theta}: transformers 5.23 rotates every such layer with the global "
                         "theta, so this checkpoint's meaning is ambiguous")
    return rope, tuple(i for i, x in enumerate(thetas) if not x)


def text_config_from_hf(t: dict, top: dict | None = None) -> MuseGlimmerTextConfig:
    """The decoder of an HF `text_config` dict (transformers 5.23's defaults for absent fields; the token ids of
    `top`, the whole config, win where set, and its tie_word_embeddings is the one read)."""
    top = top or {}
    t = {**TEXT_DEFAULTS, **t}
    for k in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if top.get(k) is not None:
            t[k] = top[k]
    # transformers 5.23 ties lm_head to the embedding by the top-level field alone (the text config's is not read)
    t["tie_word_embeddings"] = top.get("tie_word_embeddings", False)
    ints = {k: _check(t, k, "int") for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                             "num_attention_heads", "num_key_value_heads", "head_dim",
                                             "max_position_embeddings")}
    heads, kv, layers = ints["num_attention_heads"], ints["num_key_value_heads"], ints["num_hidden_layers"]
    if ints["hidden_size"] % heads:
        raise ValueError(f"muse_glimmer text_config: hidden_size {ints['hidden_size']} is not a multiple of "
                         f"num_attention_heads {heads} (transformers refuses it)")
    if heads % kv:
        raise ValueError(f"muse_glimmer text_config: num_attention_heads {heads} is not a multiple of "
                         f"num_key_value_heads {kv}")
    if t["hidden_activation"] not in LY.GATE_ACTIVATIONS:
        raise ValueError(f"muse_glimmer text_config: hidden_activation {t['hidden_activation']!r} is not supported; "
                         f"jspec supports {sorted(LY.GATE_ACTIVATIONS)}")
    types = t.get("layer_types")
    if types is None:
        types = [LAYER_TYPES[(layers - 1 - i) % 4 != 0] for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or any(x not in LAYER_TYPES for x in types):
        raise ValueError(f"muse_glimmer text_config: layer_types = {types!r}; expected {layers} entries (one per "
                         f"num_hidden_layers), each one of {LAYER_TYPES}")
    window = t.get("sliding_window")
    if window is not None:
        window = _check(t, "sliding_window", "int")
    elif "sliding_attention" in types:
        raise ValueError("muse_glimmer text_config: sliding_window is null but layer_types names sliding_attention "
                         "layers: there is no window to apply")
    rope, nope = _rope(t, layers)
    cap = t["final_logit_softcapping"]
    if cap is None:
        raise ValueError("muse_glimmer text_config: final_logit_softcapping is null; transformers divides the logits "
                         "by it")
    return MuseGlimmerTextConfig(
        model_type="muse_glimmer_text",
        **PC.sizes(ints, layers, heads, kv),
        head_dim=ints["head_dim"],
        rms_norm_eps=_check(t, "rms_norm_eps", "positive"),
        rope=rope,
        max_position_embeddings=ints["max_position_embeddings"],
        tie_word_embeddings=_check(t, "tie_word_embeddings", "bool"),
        qkv_bias=_check(t, "attention_bias", "bool"),
        o_bias=t["attention_bias"],
        hidden_act=t["hidden_activation"],
        **PC.token_ids(t),
        sliding_window=window,
        full_attention_layers=tuple(i for i, x in enumerate(types) if x == "full_attention"),
        nope_layers=nope,
        qk_scale_factor=_check(t, "qk_scale_factor", "number"),
        post_norm_eps=_check(t, "post_norm_eps", "nonneg"),
        output_multiplier=_check(t, "output_multiplier", "number"),
        final_logit_softcapping=_check(t, "final_logit_softcapping", "positive"),
    )


def config_from_hf(d: dict) -> MuseGlimmerConfig:
    """A `MuseGlimmerConfig` of an HF `muse_glimmer` config.json dict (generation_config's token ids merged at the
    top win). ValueError naming the field for a value transformers would not run or jspec does not support."""
    if d.get("model_type") != "muse_glimmer":
        raise ValueError(f"muse_glimmer config_from_hf: model_type {d.get('model_type')!r} is not 'muse_glimmer'")
    text = text_config_from_hf(dict(d.get("text_config") or {}), d)
    vision = MV.vision_config_from_hf(dict(d.get("vision_config") or {}))
    top = {**TOP_DEFAULTS, **{k: d[k] for k in TOP_DEFAULTS if d.get(k) is not None}}
    for k in ("image_token_id", "video_token_id"):
        _check(top, k, "int", "config", minimum=0)
    out_hidden, proj = (_check(top, k, "int", "config") for k in ("out_hidden_size", "projector_hidden_size"))
    if out_hidden != vision.out_dim:
        raise ValueError(f"muse_glimmer config: out_hidden_size = {out_hidden}, but the tower's pixel shuffle gives "
                         f"vision hidden_size x merge_size^2 = {vision.out_dim} features per token (the adapter's "
                         "input)")
    if top["projector_hidden_act"] not in VIS.ACTIVATIONS:
        raise ValueError(f"muse_glimmer config: projector_hidden_act {top['projector_hidden_act']!r} is not "
                         f"supported; jspec supports {sorted(VIS.ACTIVATIONS)}")
    return MuseGlimmerConfig(text=text, vision=vision, projector_hidden_size=proj,
                             projector_hidden_act=top["projector_hidden_act"], image_token_id=top["image_token_id"],
                             video_token_id=top["video_token_id"])


def text_config_to_hf(c: MuseGlimmerTextConfig) -> dict[str, Any]:
    out = PC.text_config_to_hf(c)
    out.pop("architectures", None)
    out["hidden_activation"] = out.pop("hidden_act")
    full = set(c.full_attention_layers)
    out.update(model_type="muse_glimmer_text", attention_bias=c.qkv_bias, sliding_window=c.sliding_window,
               layer_types=[LAYER_TYPES[i not in full] for i in range(c.num_layers)],
               layer_rope_theta=[0 if i in c.nope_layers else c.rope.theta for i in range(c.num_layers)],
               qk_scale_factor=c.qk_scale_factor, post_norm_eps=c.post_norm_eps,
               output_multiplier=c.output_multiplier, final_logit_softcapping=c.final_logit_softcapping)
    return out


def config_to_hf(cfg: MuseGlimmerConfig) -> dict[str, Any]:
    """The HF config.json dict transformers builds this model from."""
    text = text_config_to_hf(cfg.text)
    return {"model_type": "muse_glimmer", "architectures": [ARCHITECTURE], "text_config": text,
            "vision_config": MV.vision_config_to_hf(cfg.vision), "image_token_id": cfg.image_token_id,
            "video_token_id": cfg.video_token_id, "out_hidden_size": cfg.vision.out_dim,
            "projector_hidden_size": cfg.projector_hidden_size, "projector_hidden_act": cfg.projector_hidden_act,
            "tie_word_embeddings": cfg.text.tie_word_embeddings, "eos_token_id": text["eos_token_id"],
            "bos_token_id": text["bos_token_id"], "pad_token_id": text["pad_token_id"]}


# ------------------------------------------------------------------------------------------ params


def text_param_shapes(c: MuseGlimmerTextConfig) -> dict:
    shapes = llama.param_shapes(c)
    for layer in shapes["layers"]:
        layer.update(post_attn_norm=(c.hidden_size,), post_mlp_norm=(c.hidden_size,),
                     w_attn_gate=(c.hidden_size, c.num_heads * c.head_dim))
    return shapes


def param_shapes(cfg: MuseGlimmerConfig) -> dict:
    P = cfg.projector_hidden_size
    return {"vision": MV.param_shapes(cfg.vision), "lm": text_param_shapes(cfg.text),
            "adapter": {"fc1": (cfg.vision.out_dim, P), "fc2": (P, P), "proj": (P, cfg.text.hidden_size)}}


def init_params(cfg: MuseGlimmerConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> dict:
    """Random params; the decoder's centered norms start at 0 (scale 1), the final norm at 1."""
    kv, kl, ka = jax.random.split(key, 3)
    lm = llama.init_from_shapes(text_param_shapes(cfg.text), kl, dtype, std)
    lm["layers"] = [{k: jnp.zeros_like(v) if k.endswith("norm") else v for k, v in p.items()} for p in lm["layers"]]
    adapter = llama.init_from_shapes(param_shapes(cfg)["adapter"], ka, dtype, std)
    return {"vision": MV.init_params(cfg.vision, kv, dtype, std), "lm": lm, "adapter": adapter}


def hf_key_map(cfg: MuseGlimmerConfig):
    """(hf_name, param path, transform) rows in transformers 5.23's layout (module docstring)."""
    rows = [(n, ("vision",) + p, t) for n, p, t in MV.hf_key_map(cfg.vision, "model.vision_tower.")]
    rows += [("model.vision_adapter.fc1.weight", ("adapter", "fc1"), "T"),
             ("model.vision_adapter.fc2.weight", ("adapter", "fc2"), "T"),
             ("model.vision_projection.weight", ("adapter", "proj"), "T")]
    prefix = "model.language_model."
    for name, path, tr in llama.hf_key_map(cfg.text, prefix, "lm_head.weight"):
        if name.endswith(".post_attention_layernorm.weight"):  # LLaMA's pre-MLP norm is Muse's pre_feedforward one
            name = name.replace(".post_attention_layernorm.", ".pre_feedforward_layernorm.")
        rows.append((name, ("lm",) + path, tr))
    for i in range(cfg.text.num_layers):
        lp = f"{prefix}layers.{i}."
        rows += [(lp + "post_attention_layernorm.weight", ("lm", "layers", i, "post_attn_norm"), None),
                 (lp + "post_feedforward_layernorm.weight", ("lm", "layers", i, "post_mlp_norm"), None),
                 (lp + "self_attn.gate_proj.weight", ("lm", "layers", i, "w_attn_gate"), "T")]
    return rows


IGNORED_HF_KEYS = llama.IGNORED_HF_KEYS


def kv_layout(cfg: MuseGlimmerConfig) -> tuple[int, int, int]:
    return llama.kv_layout(cfg.text)


def embed(cfg: MuseGlimmerConfig, params: dict, tokens: jax.Array) -> jax.Array:
    """The decoder's input embeddings: the table's rows through a scaleless RMSNorm (transformers'
    `MuseGlimmerTextNormedEmbedding`)."""
    return LY.rms_norm(llama.embed(params["lm"], tokens), 1.0, cfg.text.rms_norm_eps)


def unembed(cfg: MuseGlimmerConfig, params: dict, h: jax.Array) -> jax.Array:
    return llama.unembed(cfg.text, params["lm"], h)


def forward(cfg: MuseGlimmerConfig, params: dict, tokens, positions: jax.Array, cache, new_mask=None, *,
            embeds: jax.Array | None = None, **kwargs) -> llama.ForwardOut:
    """The decoder's forward (see `ports.families.llama.forward`): tokens are embedded by `embed` unless `embeds` (e.g. the
    prompt with its vision features, `prompt_embeds`) are given."""
    if embeds is None:
        embeds = embed(cfg, params, tokens)
    return llama.forward(cfg.text, params["lm"], tokens, positions, cache, new_mask, embeds=embeds, **kwargs)


# ------------------------------------------------------------------------------------------- images and videos

RAW_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
PREPARED_KEYS = ("vision_patches", "vision_rot", "vision_valid", "vision_window", "vision_interp_index",
                 "vision_interp_weight", "vision_merge_index", "vision_src", "vision_mask", "vision_layout")


def layout_key(cfg: MuseGlimmerConfig) -> int:
    """A small int naming everything the prepared inputs depend on (see `vision_layout`)."""
    v = cfg.vision
    sig = ("muse_glimmer", v.patch_size, v.temporal_patch_size, v.merge_size, v.pos_grid, cfg.image_token_id,
           cfg.video_token_id)
    return zlib.crc32(repr(sig).encode()) % 65521 + 1


def prepare_inputs(cfg: MuseGlimmerConfig, tokens: np.ndarray, lengths: np.ndarray, inputs: Mapping[str, Any]) -> dict:
    """Host-side checks and layout (module docstring): processor output -> device inputs ({} without images or
    videos). ValueError naming the problem: a key the model does not take, pixels without their grid, rows that do
    not match the grid, placeholder counts that do not match the items."""
    PR.check_input_keys("muse_glimmer", inputs, RAW_KEYS, PREPARED_KEYS)
    tokens = np.asarray(tokens)
    B, T = tokens.shape
    valid = np.arange(T)[None, :] < np.asarray(lengths).reshape(B)[:, None]
    items, n_feat = [], {}
    for kind, pv_key, grid_key, tok in (("image", "pixel_values", "image_grid_thw", cfg.image_token_id),
                                        ("video", "pixel_values_videos", "video_grid_thw", cfg.video_token_id)):
        pv, grid = inputs.get(pv_key), inputs.get(grid_key)
        if (pv is None) != (grid is None):
            raise ValueError(f"{pv_key} given without {grid_key}" if grid is None else
                             f"{grid_key} given without {pv_key}")
        if pv is not None:
            grid = MV.check_grid(cfg.vision, grid, grid_key)
            pv = MV.check_pixels(cfg.vision, pv, grid, pv_key, grid_key)
            offs = np.concatenate([[0], np.cumsum(np.prod(grid, axis=1))])
            items += [(pv[offs[i]:offs[i + 1]], tuple(int(x) for x in g)) for i, g in enumerate(grid)]
        want = 0 if grid is None else sum(cfg.tokens_per_item(g) for g in grid)
        have = int(np.sum(valid & (tokens == tok)))
        if have != want:
            given = f"{grid_key} {grid.tolist()} take {want}" if grid is not None else f"no {grid_key} was given"
            raise ValueError(f"prompt has {have} {kind} tokens (id {tok}) but {given}; build the prompt with the "
                             "model's processor")
        n_feat[kind] = want
    if not items:
        return {}
    lay = MV.frame_layout(cfg.vision, items)
    # per feature (images' first, then videos', each item's frames in order): its row of the merged table
    per_item = [cfg.tokens_per_item(g) for _, g in items]
    f_item = np.repeat(np.arange(len(items)), per_item)
    j = np.arange(len(f_item)) - np.repeat(np.cumsum(per_item) - per_item, per_item)
    per_frame = np.array([g[1] * g[2] // cfg.vision.merge_unit for _, g in items])[f_item]
    table = (lay.frame_start[f_item] + j // per_frame) * lay.merged_per_frame + j % per_frame
    src = np.zeros((B, T), np.int32)
    src[valid & (tokens == cfg.image_token_id)] = table[:n_feat["image"]]
    src[valid & (tokens == cfg.video_token_id)] = table[n_feat["image"]:]
    mask = valid & ((tokens == cfg.image_token_id) | (tokens == cfg.video_token_id))
    return dict(vision_patches=lay.patches, vision_rot=lay.rot, vision_valid=lay.valid, vision_window=lay.window,
                vision_interp_index=lay.interp_index, vision_interp_weight=lay.interp_weight,
                vision_merge_index=lay.merge_index, vision_src=src, vision_mask=mask,
                vision_layout=np.zeros((0, layout_key(cfg)), np.int8))


class PromptEmbeds(NamedTuple):
    embeds: jax.Array  # [B, T, D] the prompt's embeddings with the vision features over the placeholders
    image_mask: jax.Array  # [B, T] bool: image and video placeholder positions
    vision_features: jax.Array  # [F * L, width] the tower's output per patch slot (after ln_post, before merging)
    positions: None = None  # plain 1-D positions
    position_offset: None = None


def vision_tokens(cfg: MuseGlimmerConfig, params: dict, inputs: Mapping[str, jax.Array]):
    """(merged-token features [F * L / merge_unit, D] as the decoder reads them, the tower's output): the tower, the
    adapter (fc1, act, fc2, act), the projection and transformers' `perception_emb_norm` (scaleless RMSNorm)."""
    vo = MV.forward(cfg.vision, params["vision"], inputs["vision_patches"], inputs["vision_rot"],
                    inputs["vision_valid"], inputs["vision_window"], inputs["vision_interp_index"],
                    inputs["vision_interp_weight"], inputs["vision_merge_index"])
    a = params["adapter"]
    act = lambda x: VIS.activation(cfg.projector_hidden_act, x)  # noqa: E731
    h = LY.linear(act(LY.linear(act(LY.linear(vo.merged, a["fc1"])), a["fc2"])), a["proj"])
    h = LY.rms_norm(h, 1.0, cfg.text.rms_norm_eps)
    return h.reshape(-1, h.shape[-1]), vo


def prompt_embeds(cfg: MuseGlimmerConfig, params: dict, tokens: jax.Array, inputs: Mapping[str, jax.Array]
                  ) -> PromptEmbeds:
    """Prompt embeddings from `prepare_inputs`' output (empty: text only)."""
    x = embed(cfg, params, tokens)
    B, T = tokens.shape
    if "vision_layout" not in inputs:
        if inputs:
            raise ValueError(f"muse_glimmer: prompt_embeds takes the output of its prepare_inputs, got "
                             f"{sorted(inputs)} (inputs prepared for another model? for a draft: pass draft_prompt=)")
        return PromptEmbeds(x, jnp.zeros((B, T), bool), jnp.zeros((0, cfg.vision.width), x.dtype))
    if inputs["vision_layout"].shape != (0, layout_key(cfg)):
        raise ValueError("these vision inputs were prepared for another model's layout (tower geometry or token ids "
                         "differ from this muse_glimmer); run this model's prepare_inputs on the processor output")
    table, vo = vision_tokens(cfg, params, inputs)
    mask = inputs["vision_mask"]
    x = jnp.where(mask[..., None], jnp.take(table.astype(x.dtype), inputs["vision_src"], axis=0), x)
    return PromptEmbeds(x, mask, vo.hidden.reshape(-1, vo.hidden.shape[-1]))
