"""Qwen3-VL and Qwen3-VL-MoE (model types "qwen3_vl", "qwen3_vl_moe"): the Qwen3-VL vision tower
(`ports.families.qwen3_vl_vision`) in front of a Qwen3 / Qwen3-MoE language model (`ports.families.qwen3`: q/k norms, experts) with
interleaved multimodal rotary positions and DeepStack.

Params: {"vision": tower params, "lm": `ports.families.qwen3` params}. In the checkpoint layout a sparse layer of
qwen3_vl_moe holds its experts fused as the published checkpoints do: we_gate_up [E, D, 2F] (gate columns, then
up) and we_down [E, F, D] (`ports.core.fused` splits gate and up for the run layout; `joined_experts`);
`ExpertsLayout` also reads transformers' in-memory layout, which is what its save_pretrained writes.

What differs from Qwen2.5-VL (`ports.families.qwen2_vl`, whose host layout this module reuses):
* M-RoPE is interleaved: rotary frequency j reads the h (w) id when j % 3 == 1 (2) and j < 3 * mrope_section[1]
  ([2]), the t id otherwise (`layers.mrope_tables(interleaved=True)`).
* The processor writes a timestamp before every temporal patch group of a video, so each group is its own run of
  video tokens; the position ids are those of a video split into one-frame videos (transformers 5.23's
  get_rope_index for qwen3_vl), which is how `prepare_inputs` hands videos to the shared layout.
* DeepStack: the features of the tower's `deepstack_visual_indexes` blocks, each through its own merger, are
  added to the residual stream at the image / video placeholders after each of the first len(deepstack) decoder
  layers. `prompt_embeds` returns them as `forward_inputs={"layer_adds": [n, B, T, D]}`, which the prefill passes
  to `ports.families.llama.forward`; decode steps carry no vision tokens and run the plain forward.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ports.families import llama
from ports.families import qwen2_vl as QW
from ports.families import qwen3
from ports.families import qwen3_vl_vision as V3

ARCHITECTURES = {"qwen3_vl": "Qwen3VLForConditionalGeneration",
                 "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration"}
_TEXT_TYPE = {"qwen3_vl": "qwen3", "qwen3_vl_moe": "qwen3_moe"}
# transformers 5.23's Qwen3VLTextConfig / Qwen3VLMoeTextConfig defaults
_TEXT_DEFAULTS = {
    "qwen3_vl": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=32, head_dim=128, max_position_embeddings=128000,
                     rms_norm_eps=1e-6, attention_bias=False),
    "qwen3_vl_moe": dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                         num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=128000,
                         rms_norm_eps=1e-6, attention_bias=False, decoder_sparse_step=1, moe_intermediate_size=1408,
                         num_experts_per_tok=4, num_experts=60),
}
_DEFAULT_THETA = 500000.0
_DEFAULT_SECTION = (24, 20, 20)
_TOKEN_DEFAULTS = QW._TOKEN_DEFAULTS


@dataclasses.dataclass(frozen=True)
class Qwen3VLConfig(QW.MRopeVLConfig):
    """Static, hashable config of a Qwen3-VL / Qwen3-VL-MoE model; exposes the text fields the engine reads."""

    architectures = ARCHITECTURES
    mrope_interleaved = True

    @property
    def joined_experts(self) -> bool:
        """Whether the checkpoint layout keeps each sparse layer's gate and up experts as one we_gate_up."""
        return self.model_type == "qwen3_vl_moe"

    @property
    def num_deepstack(self) -> int:
        """Decoder layers that take DeepStack features (transformers adds only as many as there are layers)."""
        return min(len(self.vision.deepstack_indexes), self.text.num_layers)


def mrope_section_from_hf(mt: str, rope: dict, default: tuple[int, ...]) -> tuple[int, ...]:
    """The (t, h, w) mrope_section popped from `rope` (`default` when absent); ValueError naming the field unless it
    is three non-negative integers."""
    s = rope.pop("mrope_section", default)
    if not isinstance(s, (list, tuple)) or len(s) != 3 or any(
            isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in s):
        raise ValueError(f"{mt} text_config: rope_parameters.mrope_section = {s!r}; expected three non-negative "
                         "integers (t, h, w)")
    return tuple(s)


def token_ids_from_hf(mt: str, d: dict, defaults: Mapping[str, int]) -> dict[str, int]:
    """Each of `defaults`' token-id fields read from the top of `d` (the default when absent or None); ValueError
    naming the field unless it is an integer >= 0."""
    tok = {}
    for k, v in defaults.items():
        x = d.get(k) if d.get(k) is not None else v
        if isinstance(x, bool) or not isinstance(x, int) or x < 0:
            raise ValueError(f"{mt} config: {k} = {x!r}; expected a token id (an integer >= 0)")
        tok[k] = x
    return tok


def config_from_hf(d: dict) -> Qwen3VLConfig:
    """Parse an HF `Qwen3VLConfig` / `Qwen3VLMoeConfig` dict (text fields under `text_config`, `rope_parameters` or
    `rope_scaling` + `rope_theta`; generation_config's token ids merged at the top win; missing fields take
    transformers 5.23's defaults). ValueError naming the field for what transformers would not run or jspec
    does not support, before any weight is read."""
    mt = d.get("model_type")
    if mt not in ARCHITECTURES:
        raise ValueError(f"qwen3_vl.config_from_hf: model_type {mt!r} is not one of {sorted(ARCHITECTURES)}")
    text_d, rope = QW.text_fields_from_hf(d, _TEXT_DEFAULTS[mt], _DEFAULT_THETA)
    if rope.pop("mrope_interleaved", True) is not True:
        raise ValueError(f"{mt} text_config: rope_parameters.mrope_interleaved = false; Qwen3-VL's rotary embedding "
                         "is always interleaved (transformers ignores the flag), so jspec refuses a config saying "
                         "otherwise")
    section = mrope_section_from_hf(mt, rope, _DEFAULT_SECTION)
    if rope["rope_type"] == "dynamic":
        raise ValueError(f"{mt} text_config: rope_parameters.rope_type 'dynamic' with M-RoPE is not supported by "
                         "jspec")
    if text_d.get("head_dim", 0) is None:
        text_d.pop("head_dim")
    for k in ("use_sliding_window", "sliding_window", "layer_types", "max_window_layers"):
        text_d.pop(k, None)  # transformers' Qwen3-VL text models attend over everything
    text_d.update(model_type=_TEXT_TYPE[mt], rope_parameters=rope,
                  tie_word_embeddings=bool(d.get("tie_word_embeddings", False)))
    if mt == "qwen3_vl_moe":
        text_d["norm_topk_prob"] = True  # its router always renormalises the top-k weights
    text = qwen3.config_from_hf(text_d)
    vision = V3.vision_config_from_hf(dict(d.get("vision_config") or {}))
    # (transformers' default configs pair a 3584-wide merger with a 4096-wide language model; like transformers,
    # only inputs with images or videos fail on that, in `prepare_inputs`)
    tok = token_ids_from_hf(mt, d, _TOKEN_DEFAULTS)
    return Qwen3VLConfig(model_type=mt, text=text, vision=vision, mrope_section=section, **tok)


def config_to_hf(cfg: Qwen3VLConfig) -> dict:
    """An HF config.json dict (transformers-5 layout: text under text_config)."""
    text = qwen3.config_to_hf(cfg.text)
    for k in ("architectures", "use_sliding_window", "sliding_window", "layer_types", "max_window_layers",
              "tie_word_embeddings", "norm_topk_prob"):
        text.pop(k, None)
    text["model_type"] = f"{cfg.model_type}_text"
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": list(cfg.mrope_section),
                               "mrope_interleaved": True}
    return {"model_type": cfg.model_type, "architectures": [ARCHITECTURES[cfg.model_type]], "text_config": text,
            "vision_config": V3.vision_config_to_hf(cfg.vision, cfg.model_type),
            "image_token_id": cfg.image_token_id, "video_token_id": cfg.video_token_id,
            "vision_start_token_id": cfg.vision_start_token_id, "vision_end_token_id": cfg.vision_end_token_id,
            "tie_word_embeddings": cfg.text.tie_word_embeddings}


# ------------------------------------------------------------------------------------------------ params


def _lm_shapes(cfg: Qwen3VLConfig) -> dict:
    shapes = qwen3.param_shapes(cfg.text, stacked_experts=True)
    for layer in shapes["layers"]:
        if "we_gate" in layer:
            E, D, F = layer.pop("we_gate")
            layer.pop("we_up")
            layer["we_gate_up"] = (E, D, 2 * F)
    return shapes


def param_shapes(cfg: Qwen3VLConfig) -> dict:
    """Shapes of every parameter in the checkpoint layout."""
    return {"vision": V3.param_shapes(cfg.vision), "lm": _lm_shapes(cfg)}


def init_params(cfg: Qwen3VLConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> dict:
    kv, kl = jax.random.split(key)
    return {"vision": V3.init_params(cfg.vision, kv, dtype, std), "lm": qwen3.init_params(cfg.text, kl, dtype, std)}


class ExpertsLayout:
    """Key-map transform (`ports.core.hf_layout`) of a fused expert tensor: transformers 5.23 keeps `gate_up_proj`
    [E, 2F, D] and `down_proj` [E, D, F] in memory and writes them so, while the published checkpoints hold them
    transposed ([E, D, 2F], [E, F, D]: our layout). Like transformers' loader, a tensor of the in-memory shape is
    read as such and any other one as transposed; save_hf writes the in-memory layout."""

    def __init__(self, memory_shape: tuple):
        self.memory_shape = tuple(memory_shape)

    def _flip(self, shape):
        return (shape[0], shape[2], shape[1])

    def to_ours(self, arr):
        return arr.transpose(0, 2, 1) if tuple(arr.shape) == self.memory_shape else arr

    def to_hf(self, arr):
        return arr.transpose(0, 2, 1)

    def shape_to_ours(self, shape):
        shape = tuple(shape)
        return self._flip(shape) if shape == self.memory_shape else shape

    def shape_to_hf(self, shape):
        return self._flip(tuple(shape))

    def describe(self, shape):
        return f"{self.memory_shape} or {tuple(shape)}"


def hf_key_map(cfg: Qwen3VLConfig):
    """Rows in transformers 5.23's saved layout (`model.visual.*`, `model.language_model.*`, `lm_head.weight`;
    qwen3_vl_moe's experts fused per layer: `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`, read as our
    we_gate_up [E, D, 2F] / we_down [E, F, D] through `ExpertsLayout`)."""
    rows = [(n, ("vision",) + p, t) for n, p, t in V3.hf_key_map(cfg.vision, "model.visual.")]
    lm = [r for r in qwen3.hf_key_map(cfg.text, "model.language_model.", "lm_head.weight")
          if not (r[1][0] == "layers" and r[1][2] in ("we_gate", "we_up", "we_down"))]
    for i in range(cfg.text.num_layers):
        if cfg.text.is_sparse(i):
            lp = f"model.language_model.layers.{i}.mlp.experts."
            E, D, F = cfg.text.num_experts, cfg.text.hidden_size, cfg.text.moe_intermediate_size
            lm += [(lp + "gate_up_proj", ("layers", i, "we_gate_up"), ExpertsLayout((E, 2 * F, D))),
                   (lp + "down_proj", ("layers", i, "we_down"), ExpertsLayout((E, D, F)))]
    return rows + [(n, ("lm",) + p, t) for n, p, t in lm]


IGNORED_HF_KEYS = llama.IGNORED_HF_KEYS


kv_layout = QW.kv_layout
embed = QW.embed
unembed = QW.unembed
forward = QW.forward  # interleaved M-RoPE ids for the prompt; DeepStack's layer_adds pass through to llama.forward


# ------------------------------------------------------------------------------------------- host-side layout

PREPARED_KEYS = QW.PREPARED_KEYS + ("vision_interp_index", "vision_interp_weight")


def _per_frame(inputs: Mapping[str, Any]) -> dict:
    """The processor output with every video split into one-frame videos (a timestamp precedes each of its
    temporal patch groups in the prompt, so each is a run of its own); pixel rows are frame-major already."""
    if inputs.get("second_per_grid_ts") is not None:
        raise ValueError("second_per_grid_ts is Qwen2.5-VL's; Qwen3-VL's processor writes frame timestamps into "
                         "the prompt instead")
    out = dict(inputs)
    grid = inputs.get("video_grid_thw")
    if grid is not None:
        g = np.asarray(grid)
        if g.ndim == 2 and g.shape[1] == 3 and np.issubdtype(g.dtype, np.integer) and np.all(g > 0):
            g = np.repeat(g, g[:, 0], axis=0)
            g[:, 0] = 1
            out["video_grid_thw"] = g
    return out


def _frame_sizes(inputs: Mapping[str, Any]) -> np.ndarray:
    """(h, w) [frames, 2] of every tower frame, images then videos, in the layout's order."""
    grids = [np.asarray(inputs[k]).reshape(-1, 3) for k in ("image_grid_thw", "video_grid_thw")
             if inputs.get(k) is not None]
    g = np.concatenate(grids).astype(np.int64) if grids else np.zeros((0, 3), np.int64)
    return np.repeat(g[:, 1:], g[:, 0], axis=0)


def prepare_inputs(cfg: Qwen3VLConfig, tokens: np.ndarray, lengths: np.ndarray, inputs: Mapping[str, Any]) -> dict:
    """Host-side checks and layout: `qwen2_vl.prepare_inputs`' arrays (videos split per frame) plus each tower
    slot's position-embedding taps `vision_interp_index` / `vision_interp_weight` [F, L, 4] ({} for a text-only
    prompt, which then runs with plain positions, as transformers' does)."""
    split = _per_frame(inputs)
    prepared = dict(QW._layout(cfg, tokens, lengths, split).prepared)
    if "vision_patches" in prepared:
        rot, valid = prepared["vision_rot"], prepared["vision_valid"]
        hw = np.ones(rot.shape, np.int64)
        sizes = _frame_sizes(split)
        hw[:len(sizes)] = sizes[:, None, :]
        index, weight = V3.interpolation(cfg.vision, rot, hw)
        prepared.update(vision_interp_index=index, vision_interp_weight=weight * valid[..., None])
    return prepared


PromptEmbeds = QW.PromptEmbeds  # forward_inputs: {"layer_adds": [n, B, T, D]} with vision inputs, else {}


def prompt_embeds(cfg: Qwen3VLConfig, params: dict, tokens: jax.Array, inputs: Mapping[str, jax.Array]) -> PromptEmbeds:
    """Prompt embeddings, positions, DeepStack additions and hooks from `prepare_inputs`' output (empty: text
    only)."""
    x = embed(cfg, params, tokens)
    B, T = tokens.shape
    no_grid = jnp.full((B, T, 4), -1, jnp.int32)
    empty = jnp.zeros((0, cfg.vision.width), x.dtype)
    pos = QW.prepared_positions(cfg, inputs, B, T)
    if pos is None:
        return PromptEmbeds(x, jnp.zeros((B, T), bool), empty, None, None, no_grid, {})
    if "vision_patches" not in inputs:
        return PromptEmbeds(x, jnp.zeros((B, T), bool), empty, pos, inputs["mrope_offset"], no_grid, {})
    vo = V3.forward(cfg.vision, params["vision"], inputs["vision_patches"], inputs["vision_rot"],
                    inputs["vision_valid"], inputs["vision_interp_index"], inputs["vision_interp_weight"])
    out = vo.merged.shape[-1]
    mask, src = inputs["vision_mask"], inputs["vision_src"]
    x = jnp.where(mask[..., None], jnp.take(vo.merged.reshape(-1, out).astype(x.dtype), src, axis=0), x)
    extra = {}
    n = cfg.num_deepstack
    if n:
        deep = jnp.moveaxis(vo.deepstack[:, :n], 1, 0).reshape(n, -1, out).astype(x.dtype)  # [n, F * L/4, D]
        extra["layer_adds"] = jnp.where(mask[None, ..., None], jnp.take(deep, src, axis=1), 0).astype(x.dtype)
    feats = jnp.take(vo.hidden.reshape(-1, vo.hidden.shape[-1]), inputs["vision_patch_index"], axis=0)
    return PromptEmbeds(x, mask, feats, pos, inputs["mrope_offset"], inputs["vision_grid_pos"], extra)


def prune_prompt(cfg: Qwen3VLConfig, prompt: Mapping[str, Any], keep, positions: str = "original") -> dict:
    """`qwen2_vl.prune_prompt` for Qwen3-VL (videos split per frame first; see there)."""
    return QW.prune_prompt(cfg, _per_frame(prompt), keep, positions)


compact_prompt = QW.compact_prompt  # the tower's tables stay whole; placeholders keep their feature rows
