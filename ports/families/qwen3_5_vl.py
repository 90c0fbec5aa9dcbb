"""Qwen3.5 and Qwen3.5-MoE vision-language models (model types "qwen3_5", "qwen3_5_moe"; transformers 5.23's
`Qwen3_5ForConditionalGeneration` / `Qwen3_5MoeForConditionalGeneration`): the Qwen3-VL vision tower
(`ports.families.qwen3_vl_vision`) without DeepStack in front of the Qwen3.5 hybrid language model (`ports.families.qwen3_5`:
Gated DeltaNet linear attention beside gated full attention, its recurrent state in the cache's `rec`).

Params: {"vision": tower params (no "deepstack" entry), "lm": `ports.families.qwen3_5` params}.

Rotary positions: the prompt's (t, h, w) ids [3, B, T] go through interleaved M-RoPE over the partial rotary
dimensions only (`layers.mrope_tables(interleaved=True)` of the text config, whose inverse frequencies span
head_dim * partial_rotary_factor; `layers.apply_rope` rotates that many leading features and passes the rest), as
transformers' Qwen3_5TextRotaryEmbedding / apply_rotary_pos_emb do. Every later token is slot + rope delta in
all three components (the cache's `pos_offset`), which is the plain 1-D rotary of the text model.

The host layout (`prepare_inputs`: videos split per temporal patch group, their timestamps in the prompt),
`prompt_embeds` and `compact_prompt` are Qwen3-VL's (`ports.families.qwen3_vl`): transformers' Qwen3.5 computes the same
rope index and splices the merger's features over the placeholders the same way. Checkpoints: transformers'
names (`model.visual.*`, `model.language_model.*`, `lm_head.weight`); `mtp.*` (the multi-token-prediction head)
is named as unused; MoE experts per expert or fused, as `ports.families.qwen3_5` reads them.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ports.core import layers as LY
from ports.families import llama
from ports.families import qwen2_vl as QW
from ports.families import qwen3_5 as Q5
from ports.families import qwen3_vl as Q3VL
from ports.families import qwen3_vl_vision as V3

ARCHITECTURES = {"qwen3_5": "Qwen3_5ForConditionalGeneration",
                 "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}
_TEXT_TYPE = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
_DEFAULT_SECTION = (11, 11, 10)  # transformers 5.23's Qwen3_5TextRotaryEmbedding default
# transformers 5.23's Qwen3_5Config / Qwen3_5MoeConfig defaults
_TOKEN_DEFAULTS = dict(image_token_id=248056, video_token_id=248057, vision_start_token_id=248053,
                       vision_end_token_id=248054)
IGNORED_HF_KEYS = llama.IGNORED_HF_KEYS + (r"mtp\..*",)


@dataclasses.dataclass(frozen=True)
class Qwen35VLConfig(QW.MRopeVLConfig):
    """Static, hashable config of a Qwen3.5 (-MoE) VLM; exposes the text fields the engine reads and the fields
    Qwen3-VL's host layout reads (`vision`, token ids, `tokens_per_item`, `num_deepstack` = 0)."""

    architectures = ARCHITECTURES
    mrope_interleaved = True
    num_deepstack = 0  # no DeepStack: the prompt's forward takes no layer additions

    def __post_init__(self):
        super().__post_init__()
        if self.vision.deepstack_indexes:
            raise ValueError("Qwen35VLConfig: the Qwen3.5 vision tower has no DeepStack (deepstack_indexes must be "
                             "empty)")


def config_from_hf(d: dict) -> Qwen35VLConfig:
    """Parse an HF `Qwen3_5Config` / `Qwen3_5MoeConfig` dict (text under `text_config`, read by
    `ports.families.qwen3_5.config_from_hf`; the tower under `vision_config`, any deepstack_visual_indexes there ignored as
    transformers ignores them; generation_config's token ids merged at the top win). ValueError naming the field
    for what transformers would not run or jspec does not support, before any weight is read."""
    mt = d.get("model_type")
    if mt not in ARCHITECTURES:
        raise ValueError(f"qwen3_5_vl.config_from_hf: model_type {mt!r} is not one of {sorted(ARCHITECTURES)}")
    text_d = dict(d.get("text_config") or {})
    for k in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if d.get(k) is not None:
            text_d[k] = d[k]
    rope = dict(text_d.get("rope_parameters") or {})
    if rope.pop("mrope_interleaved", True) is not True:
        raise ValueError(f"{mt} text_config: rope_parameters.mrope_interleaved = false; Qwen3.5's rotary embedding "
                         "is always interleaved (transformers ignores the flag), so jspec refuses a config saying "
                         "otherwise")
    section = Q3VL.mrope_section_from_hf(mt, rope, _DEFAULT_SECTION)
    if rope.get("rope_type", "default") == "dynamic":
        raise ValueError(f"{mt} text_config: rope_parameters.rope_type 'dynamic' with M-RoPE is not supported by "
                         "jspec")
    text_d.update(model_type=_TEXT_TYPE[mt], rope_parameters=rope,
                  tie_word_embeddings=bool(d.get("tie_word_embeddings", False)))
    text = Q5.config_from_hf(text_d)
    vision = V3.vision_config_from_hf({**dict(d.get("vision_config") or {}), "deepstack_visual_indexes": []})
    tok = Q3VL.token_ids_from_hf(mt, d, _TOKEN_DEFAULTS)
    return Qwen35VLConfig(model_type=mt, text=text, vision=vision, mrope_section=section, **tok)


def config_to_hf(cfg: Qwen35VLConfig) -> dict:
    """An HF config.json dict transformers builds this model from (text under text_config)."""
    text = Q5.config_to_hf(cfg.text)
    for k in ("architectures", "tie_word_embeddings"):
        text.pop(k, None)
    text["model_type"] = _TEXT_TYPE[cfg.model_type]
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": list(cfg.mrope_section),
                               "mrope_interleaved": True}
    vision = V3.vision_config_to_hf(cfg.vision, cfg.model_type)
    vision.pop("deepstack_visual_indexes")
    return {"model_type": cfg.model_type, "architectures": [ARCHITECTURES[cfg.model_type]], "text_config": text,
            "vision_config": vision, "image_token_id": cfg.image_token_id, "video_token_id": cfg.video_token_id,
            "vision_start_token_id": cfg.vision_start_token_id, "vision_end_token_id": cfg.vision_end_token_id,
            "tie_word_embeddings": cfg.text.tie_word_embeddings}


# ------------------------------------------------------------------------------------------------ params


def _no_deepstack(tree: dict) -> dict:
    out = dict(tree)
    out.pop("deepstack", None)
    return out


def param_shapes(cfg: Qwen35VLConfig) -> dict:
    """Shapes of every parameter in the checkpoint layout (per-expert lists for MoE)."""
    return {"vision": _no_deepstack(V3.param_shapes(cfg.vision)), "lm": Q5.param_shapes(cfg.text)}


def init_params(cfg: Qwen35VLConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> dict:
    """Random params (the tower's and `ports.families.qwen3_5.init_params`' conventions)."""
    kv, kl = jax.random.split(key)
    return {"vision": _no_deepstack(V3.init_params(cfg.vision, kv, dtype, std)),
            "lm": Q5.init_params(cfg.text, kl, dtype, std)}


def hf_key_map(cfg: Qwen35VLConfig) -> list:
    """Rows in transformers 5.23's layout: `model.visual.*`, `model.language_model.*` (the hybrid's names, experts
    per expert), `lm_head.weight`."""
    rows = [(n, ("vision",) + p, t) for n, p, t in V3.hf_key_map(cfg.vision, "model.visual.")]
    rows += [(n, ("lm",) + p, t) for n, p, t in Q5.hf_key_map(cfg.text, "model.language_model.", "lm_head.weight")]
    return rows


# ------------------------------------------------------------------------------------------------ forward


def kv_layout(cfg: Qwen35VLConfig) -> tuple[int, int, int]:
    return Q5.kv_layout(cfg.text)


def init_recurrent(cfg: Qwen35VLConfig, batch: int, dtype):
    return Q5.init_recurrent(cfg.text, batch, dtype)


def embed(cfg: Qwen35VLConfig, params: dict, tokens: jax.Array) -> jax.Array:
    return Q5.embed(cfg.text, params["lm"], tokens)


def unembed(cfg: Qwen35VLConfig, params: dict, h: jax.Array) -> jax.Array:
    return Q5.unembed(cfg.text, params["lm"], h)


def rope(cfg: Qwen35VLConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, rot] for (t, h, w) ids [3, B, T] (interleaved M-RoPE over the partial rotary dims) or
    positions [B, T] (plain RoPE, what M-RoPE gives when the three ids are equal)."""
    if positions.ndim == 3:
        return LY.mrope_tables(cfg.text, positions, cfg.mrope_section, interleaved=cfg.mrope_interleaved)
    return LY.rope_tables(cfg.text, positions)


def forward(cfg: Qwen35VLConfig, params: dict, tokens, positions: jax.Array, cache, new_mask=None, **kwargs):
    """`ports.families.qwen3_5.forward` of the language model, positions either M-RoPE ids [3, B, T] (the prompt) or
    [B, T] (every later token); a given `rope` (cos, sin) wins."""
    if positions.ndim == 3:
        if kwargs.get("rope") is None:
            kwargs["rope"] = rope(cfg, positions)
        positions = positions[0]
    return Q5.forward(cfg.text, params["lm"], tokens, positions, cache, new_mask, **kwargs)


prepare_inputs = Q3VL.prepare_inputs
prompt_embeds = Q3VL.prompt_embeds
prune_prompt = Q3VL.prune_prompt
compact_prompt = Q3VL.compact_prompt
