"""LLaVA (1.5): a CLIP/SigLIP tower + multimodal projector in front of a LLaMA/Qwen2 language model.

Params: {"vision": tower params (ports.core.vision), "projector": projector params, "lm": language-model params
(ports.families.llama)}. Decoding runs the language model alone; images enter once, at prefill, through `prompt_embeds`,
which replaces the embedding of every image placeholder token (`image_token_id`) by the projected image features,
in order (row-major over the batch, as HF's masked_scatter does).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ports.core import config as PC
from ports.families import llama
from ports.core import vision as VIS

# HF's LlavaConfig builds this tower when config.json has no vision_config (CLIP ViT-L/14 at 336 px).
_DEFAULT_VISION = {"model_type": "clip_vision_model", "hidden_size": 1024, "intermediate_size": 4096,
                   "num_hidden_layers": 24, "num_attention_heads": 16, "image_size": 336, "patch_size": 14,
                   "projection_dim": 768, "vocab_size": 32000}


@dataclasses.dataclass(frozen=True)
class LlavaConfig(PC.TextFields):
    """Static, hashable config of a LLaVA model; exposes the text fields the engine reads."""

    model_type: str
    text: PC.TextConfig
    vision: VIS.VisionConfig
    projector: VIS.ProjectorConfig
    image_token_id: int
    feature_layer: int | tuple[int, ...] = -2
    feature_strategy: str = "default"
    image_pool: int = 1  # >1: the tower's patch grid is average-pooled by this factor before the projector (TABED's P)

    @property
    def tokens_per_image(self) -> int:
        if self.image_pool > 1:
            return pooled_side(self.vision.grid, self.image_pool) ** 2
        return VIS.num_feature_tokens(self.vision, self.feature_strategy)

    def pooled(self, pool: int) -> "LlavaConfig":
        """This config with its image features pooled `pool` x `pool` before the projector (a shorter image slot;
        for anyres models every tile is pooled and the layout is computed on the pooled grid)."""
        if isinstance(pool, bool) or not isinstance(pool, (int, np.integer)) or pool < 1:
            raise ValueError(f"pool must be a positive integer, got {pool!r}")
        g = self.vision.grid
        if pool > 1 and VIS.num_feature_tokens(self.vision, self.feature_strategy) != g * g:
            raise ValueError(f"pooling reads a square {g} x {g} patch grid; vision_feature_select_strategy "
                             f"{self.feature_strategy!r} of this {self.vision.model_type} tower keeps a class token")
        return dataclasses.replace(self, image_pool=int(pool))


def pooled_side(side: int, pool: int) -> int:
    """Side of a `side` x `side` grid after `pool` x `pool` average pooling (ceil: a partial window is a window)."""
    return max(1, -(-side // pool))


def pool_matrix(side: int, out: int) -> np.ndarray:
    """[out, side] averaging weights of adaptive average pooling (torch's adaptive_avg_pool1d bins)."""
    m = np.zeros((out, side), np.float32)
    for i in range(out):
        a, b = (i * side) // out, -(-((i + 1) * side) // out)
        m[i, a:b] = 1.0 / (b - a)
    return m


def pool_features(feats: jax.Array, side: int, pool: int) -> jax.Array:
    """Patch features [N, side * side, D] (row-major grid) average-pooled to [N, s' * s', D], s' = ceil(side / pool),
    by adaptive pooling (exactly `pool` x `pool` windows when `pool` divides `side`)."""
    out = pooled_side(side, pool)
    a = jnp.asarray(pool_matrix(side, out), feats.dtype)
    g = feats.reshape(feats.shape[0], side, side, feats.shape[-1])
    return jnp.einsum("ij,njkd,lk->nild", a, g, a).reshape(feats.shape[0], out * out, feats.shape[-1])


_SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "max_position_embeddings", "rms_norm_eps", "image_size", "patch_size", "layer_norm_eps",
               "hidden_act")


def with_hf_defaults(sub: dict) -> dict:
    """A sub-config (text_config / vision_config) with the shape fields it leaves out filled from its transformers
    config class's defaults, as HF does (llava-hf's llava-1.5 config.json omits LLaMA's default fields)."""
    import transformers

    if sub.get("model_type") not in transformers.CONFIG_MAPPING:
        return dict(sub)
    cls = transformers.CONFIG_MAPPING[sub["model_type"]]
    defaults = cls().to_dict()
    return {**{k: defaults[k] for k in _SHAPE_KEYS if k in defaults and k not in sub}, **sub}


def config_fields_from_hf(d: dict, *, vision_default: dict = _DEFAULT_VISION, text_type: str = "llama",
                          feature_layer: int = -2, strategy: str = "default", image_token: int = 32000,
                          tie_from_text: bool = True) -> dict:
    """The `LlavaConfig` fields of an HF llava / llava_next / llava_onevision config dict (config.json, with
    generation_config's token ids merged at the top); the keyword arguments are that HF config class's defaults.
    Tied embeddings as transformers 5 decides: the top-level tie_word_embeddings, or (tie_from_text: LlavaConfig,
    LlavaOnevisionConfig) the text config's when that one is true."""
    text_d = dict(d.get("text_config") or {})
    text_d.setdefault("model_type", text_type)
    for k in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if d.get(k) is not None:
            text_d[k] = d[k]
    tie = bool(d.get("tie_word_embeddings", False))
    text_d["tie_word_embeddings"] = tie or (tie_from_text and bool(text_d.get("tie_word_embeddings", False)))
    text = PC.text_config_from_hf(with_hf_defaults(text_d))
    vision_d = dict(d.get("vision_config") or vision_default)
    vision_d.setdefault("model_type", vision_default["model_type"])
    vision = VIS.vision_config_from_hf(with_hf_defaults(vision_d))
    layer = d.get("vision_feature_layer", feature_layer)
    layer = int(layer) if isinstance(layer, int) else tuple(int(x) for x in layer)
    strategy = d.get("vision_feature_select_strategy", strategy)
    if strategy not in VIS.FEATURE_STRATEGIES:
        raise ValueError(f"unknown vision_feature_select_strategy {strategy!r}; expected {VIS.FEATURE_STRATEGIES}")
    image_token = d.get("image_token_id", d.get("image_token_index", image_token))
    return dict(model_type=d.get("model_type", "llava"), text=text, vision=vision,
                projector=VIS.projector_config_from_hf(d, vision, text.hidden_size),
                image_token_id=int(image_token), feature_layer=layer, feature_strategy=strategy)


def config_from_hf(d: dict) -> LlavaConfig:
    """Parse an HF `LlavaConfig` dict (config.json, with generation_config's token ids merged at the top)."""
    return LlavaConfig(**config_fields_from_hf(d))


def config_to_hf(cfg: LlavaConfig) -> dict:
    text = PC.text_config_to_hf(cfg.text)
    return {"model_type": cfg.model_type, "architectures": ["LlavaForConditionalGeneration"],
            "text_config": text, "vision_config": VIS.vision_config_to_hf(cfg.vision),
            "image_token_index": cfg.image_token_id, "image_seq_length": cfg.tokens_per_image,
            "vision_feature_layer": cfg.feature_layer if isinstance(cfg.feature_layer, int) else list(cfg.feature_layer),
            "vision_feature_select_strategy": cfg.feature_strategy, "projector_hidden_act": cfg.projector.act,
            "multimodal_projector_bias": cfg.projector.bias, "tie_word_embeddings": cfg.text.tie_word_embeddings,
            "eos_token_id": text.get("eos_token_id"), "bos_token_id": text.get("bos_token_id"),
            "pad_token_id": text.get("pad_token_id")}


def param_shapes(cfg: LlavaConfig) -> dict:
    return {"vision": VIS.param_shapes(cfg.vision), "projector": VIS.projector_param_shapes(cfg.projector),
            "lm": llama.param_shapes(cfg.text)}


def init_params(cfg: LlavaConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> dict:
    kv, kp, kl = jax.random.split(key, 3)
    return {"vision": VIS.init_params(cfg.vision, kv, dtype, std), "projector": VIS.init_projector(cfg.projector, kp, dtype, std),
            "lm": llama.init_params(cfg.text, kl, dtype, std)}


def forward(cfg: LlavaConfig, params: dict, *args, **kwargs) -> llama.ForwardOut:
    """The language model's forward (see `ports.families.llama.forward`); images come in through `embeds`."""
    return llama.forward(cfg.text, params["lm"], *args, **kwargs)


def embed(cfg: LlavaConfig, params: dict, tokens: jax.Array) -> jax.Array:
    return llama.embed(params["lm"], tokens)


def unembed(cfg: LlavaConfig, params: dict, h: jax.Array) -> jax.Array:
    return llama.unembed(cfg.text, params["lm"], h)


def kv_layout(cfg: LlavaConfig) -> tuple[int, int, int]:
    return llama.kv_layout(cfg.text)


# ------------------------------------------------------------------------------------------------ images


class PromptEmbeds(NamedTuple):
    embeds: jax.Array  # [B, T, D] text embeddings with image features spliced in
    image_mask: jax.Array  # [B, T] bool: which prompt positions hold image features
    vision_features: jax.Array  # [N, P, Dv] tower features before the projector (TABED's pooled view reads them)


def image_features(cfg: LlavaConfig, params: dict, pixel_values: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(tower features before the projector [N, P, Dv], projected features [N, P, D]) for images [N, C, H, W];
    with `image_pool` > 1 the features are pooled on the patch grid first (P = the pooled grid's cells)."""
    feats = VIS.image_features(cfg.vision, params["vision"], pixel_values, cfg.feature_layer, cfg.feature_strategy)
    if cfg.image_pool > 1:
        feats = pool_features(feats, cfg.vision.grid, cfg.image_pool)
    return feats, VIS.projector_forward(params["projector"], feats, cfg.projector.act)


def prepare_inputs(cfg: LlavaConfig, tokens: np.ndarray, lengths: np.ndarray, inputs: Mapping[str, Any]) -> dict:
    """Host-side checks before any compute: known inputs, pixel_values shape, one image per placeholder run.
    Returns the inputs for the device (unchanged)."""
    unknown = sorted(set(inputs) - {"pixel_values"})
    if unknown:
        raise ValueError(f"{cfg.model_type} takes pixel_values only; got {unknown}")
    n_tok = int(sum(np.sum(tokens[b, :lengths[b]] == cfg.image_token_id) for b in range(tokens.shape[0])))
    pv = inputs.get("pixel_values")
    if pv is None:
        if n_tok:
            raise ValueError(f"prompt has {n_tok} image tokens (id {cfg.image_token_id}) but no pixel_values")
        return dict(inputs)
    pv = np.asarray(pv)
    VIS.check_pixel_values(cfg.vision, pv)
    want = pv.shape[0] * cfg.tokens_per_image
    if n_tok != want:
        raise ValueError(f"prompt has {n_tok} image tokens (id {cfg.image_token_id}) but {pv.shape[0]} image(s) "
                         f"x {cfg.tokens_per_image} features = {want}; build the prompt with the model's processor")
    return dict(inputs)


def prompt_embeds(cfg: LlavaConfig, params: dict, tokens: jax.Array, inputs: Mapping[str, jax.Array]) -> PromptEmbeds:
    """Embeddings of right-padded prompts [B, T] with the i-th image placeholder (row-major) replaced by the i-th
    image feature vector. Counts are checked on the host by `prepare_inputs`."""
    x = llama.embed(params["lm"], tokens)
    is_img = tokens == cfg.image_token_id
    other = sorted(set(inputs) - {"pixel_values", "vision_src"})
    if other:
        raise ValueError(f"{cfg.model_type} takes pixel_values; got {other}, inputs prepared for another model "
                         f"(for a draft: pass draft_prompt= with its own processor output)")
    pv = inputs.get("pixel_values")
    if pv is None:
        return PromptEmbeds(x, is_img, jnp.zeros((0, cfg.tokens_per_image, cfg.projector.in_dim), x.dtype))
    feats, proj = image_features(cfg, params, pv.astype(x.dtype))
    flat = proj.reshape(-1, proj.shape[-1]).astype(x.dtype)
    idx = inputs["vision_src"] if "vision_src" in inputs else jnp.cumsum(is_img.reshape(-1)) - 1
    spliced = jnp.take(flat, jnp.clip(idx, 0, flat.shape[0] - 1), axis=0).reshape(x.shape)
    return PromptEmbeds(jnp.where(is_img[..., None], spliced, x), is_img, feats)


def compact_prompt(cfg: LlavaConfig, tokens: jax.Array, inputs: Mapping[str, jax.Array], idx: jax.Array,
                   lengths: jax.Array, new_lengths: jax.Array, positions: str = "renumbered") -> dict:
    """Inputs of the [B, D] prompt made of the positions idx [B, D] of the [B, T] prompt `tokens` (ascending, -1
    past each row's new_lengths[b]): every image is still encoded; `vision_src` names the feature row of each kept
    placeholder. Positions are renumbered (LLaVA numbers a prompt by sequence index)."""
    if positions != "renumbered":
        raise ValueError(f"{cfg.model_type} numbers a prompt's positions by sequence index: a pruned prompt can only "
                         f"be renumbered (positions='renumbered'), got {positions!r}")
    is_img = tokens == cfg.image_token_id
    src = inputs["vision_src"] if "vision_src" in inputs else \
        (jnp.cumsum(is_img.reshape(-1)) - 1).reshape(tokens.shape)
    kept = jnp.where(idx >= 0, jnp.take_along_axis(src, jnp.maximum(idx, 0), axis=1), 0)
    return {**inputs, "vision_src": kept.astype(jnp.int32)}


def hf_key_map(cfg: LlavaConfig):
    """Rows in the layout transformers 5 writes to disk; `rename_hf_key` maps the other layouts onto it."""
    rows = [(n, ("vision",) + p, t) for n, p, t in VIS.hf_key_map(cfg.vision, "vision_tower.")]
    rows += [(n, ("projector",) + p, t) for n, p, t in VIS.projector_key_map(cfg.projector, "multi_modal_projector.")]
    rows += [(n, ("lm",) + p, t) for n, p, t in llama.hf_key_map(cfg.text, "language_model.model.",
                                                                  "language_model.lm_head.weight")]
    return rows


_RENAMES = (("model.vision_tower.", "vision_tower."),  # transformers-5 in-memory names
            ("model.multi_modal_projector.", "multi_modal_projector."),
            ("model.language_model.", "language_model.model."),
            ("lm_head.", "language_model.lm_head."),
            ("vision_tower.vision_model.", "vision_tower."))  # older hub checkpoints


def rename_hf_key(name: str) -> str:
    """Any accepted LLaVA checkpoint name -> the name `hf_key_map` uses."""
    for old, new in _RENAMES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


IGNORED_HF_KEYS = tuple(VIS.ignored_hf_keys("vision_tower.")) + tuple(
    r"^language_model\.model\." + p for p in llama.IGNORED_HF_KEYS)
