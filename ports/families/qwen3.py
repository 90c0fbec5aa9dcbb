"""Qwen3 (`qwen3`) and Qwen3-MoE (`qwen3_moe`) decoders: the LLaMA family's forward (`ports.families.llama.forward`) with
RMSNorm over each head's queries and keys before RoPE, per-layer sliding windows, and, for `qwen3_moe`, the
experts of `ports.core.moe` in the sparse layers.

Params are LLaMA's (`ports.families.llama`) plus per layer q_norm, k_norm [head_dim]; a sparse layer holds router [D, E]
and we_gate, we_up [E, D, F], we_down [E, F, D] (F = moe_intermediate_size) in place of w_gate / w_up / w_down
(in the checkpoint layout each expert matrix is a list of E per-expert matrices; `ports.core.fused`).

Checkpoints: transformers 5.23 writes (and older hub checkpoints hold) one tensor per expert matrix,
`model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`, and the router `model.layers.N.mlp.gate.weight`;
that is the layout `hf_key_map` names and `save_hf` writes. transformers' in-memory layout, which it writes
with `save_original_format=False`, fuses the experts: `mlp.experts.gate_up_proj` [E, 2F, D] (gate rows, then up
rows) and `mlp.experts.down_proj` [E, D, F]; `split_hf_tensor` reads those as the per-expert tensors.

Configs are read as transformers 5.23 reads them (its defaults for absent fields); a config transformers would
not run, or jspec cannot, is a ValueError naming the field, raised before any weight is read.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp

from ports.core import config as PC
from ports.families import llama
from ports.core.config import TextConfig

ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
LAYER_TYPES = ("full_attention", "sliding_attention")
# transformers 5.23's Qwen3Config / Qwen3MoeConfig defaults for the fields jspec reads
DEFAULTS = {
    "qwen3": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, head_dim=128, max_position_embeddings=32768,
                  sliding_window=4096, max_window_layers=28),
    "qwen3_moe": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                      num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=32768,
                      sliding_window=4096, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                      decoder_sparse_step=1),
}


@dataclasses.dataclass(frozen=True)
class Qwen3Config(TextConfig):
    """A `qwen3` / `qwen3_moe` decoder: `TextConfig` plus the fields below.

    full_attention_layers: the layers that attend over everything although `sliding_window` is set (Qwen3's
    `layer_types`); the others see the last `sliding_window` tokens. num_experts > 0: the layers `is_sparse`
    names run `ports.core.moe`'s experts (top num_experts_per_tok of num_experts, each moe_intermediate_size wide)."""

    full_attention_layers: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def is_sparse(self, i: int) -> bool:
        """Whether layer i runs the experts (transformers' `Qwen3MoeDecoderLayer` rule)."""
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def num_params(self) -> int:
        """Every parameter stored, all experts included."""
        shapes = param_shapes(self, stacked_experts=True)
        return sum(_size(s) for s in jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple)))


def _size(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ------------------------------------------------------------------------------------------ config


def _field(d: dict, key: str, defaults: dict, kind: str, minimum: int | None = 1):
    """d[key] (transformers' default when absent) checked: an int >= minimum, a bool, or a number > 0."""
    model_type = d.get("model_type")
    v = d.get(key, defaults.get(key))
    if kind == "bool":
        if not isinstance(v, bool):
            raise ValueError(f"{model_type} config: {key} = {v!r}; expected true or false")
        return v
    if kind == "number":
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"{model_type} config: {key} = {v!r}; expected a positive number")
        return float(v)
    if isinstance(v, bool) or not isinstance(v, int) or (minimum is not None and v < minimum):
        raise ValueError(f"{model_type} config: {key} = {v!r}; expected an integer >= {minimum}")
    return v


def _head_dim(d: dict, defaults: dict, hidden: int, heads: int) -> int:
    """Qwen3Config's head_dim (default 128); Qwen3MoeConfig has none by default: hidden_size / heads then."""
    if "head_dim" in d or "head_dim" in defaults:
        return _field(d, "head_dim", defaults, "int")
    if hidden % heads:
        raise ValueError(f"{d.get('model_type')} config: head_dim is missing and hidden_size {hidden} is not a "
                         f"multiple of num_attention_heads {heads}; give head_dim")
    return hidden // heads


def _windows(d: dict, defaults: dict, layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(sliding_window or None, full_attention_layers) as transformers 5.23 applies them: the window only with
    use_sliding_window; qwen3 slides in the `layer_types` "sliding_attention" layers (default: from
    max_window_layers on), qwen3_moe in every layer."""
    model_type = d.get("model_type")
    use = _field(d, "use_sliding_window", {"use_sliding_window": False}, "bool")
    window = d.get("sliding_window", defaults["sliding_window"]) if use else None
    if window is not None:
        window = _field({**d, "sliding_window": window}, "sliding_window", defaults, "int")
    if model_type == "qwen3_moe":
        return window, ()
    types = d.get("layer_types")
    if types is None:
        start = _field(d, "max_window_layers", defaults, "int", minimum=0)
        types = [LAYER_TYPES[window is not None and i >= start] for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or any(t not in LAYER_TYPES for t in types):
        raise ValueError(f"{model_type} config: layer_types = {types!r}; expected {layers} entries (one per "
                         f"num_hidden_layers), each one of {LAYER_TYPES}")
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if sliding and window is None:
        raise ValueError(f"{model_type} config: layer_types names sliding_attention layers {sliding} but "
                         "use_sliding_window is false or sliding_window is null: there is no window to apply "
                         "(transformers refuses it too)")
    if not sliding:
        return None, ()
    return window, tuple(i for i, t in enumerate(types) if t == "full_attention")


def _experts(d: dict, defaults: dict, layers: int) -> dict:
    """The MoE fields of a qwen3_moe config, checked (empty for qwen3)."""
    if d.get("model_type") != "qwen3_moe":
        return {}
    model_type = d["model_type"]
    if "num_local_experts" in d:  # transformers writes num_experts under this name (its attribute_map); it wins
        d = {**d, "num_experts": d["num_local_experts"]}
    E = _field(d, "num_experts", defaults, "int", minimum=0)
    k = _field(d, "num_experts_per_tok", defaults, "int")
    if E and k > E:
        raise ValueError(f"{model_type} config: num_experts_per_tok = {k} is more than num_experts = {E}")
    only = d.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers
                                         for i in only):
        raise ValueError(f"{model_type} config: mlp_only_layers = {only!r}; expected layer indices in "
                         f"[0, {layers})")
    return dict(num_experts=E, num_experts_per_tok=k,
                moe_intermediate_size=_field(d, "moe_intermediate_size", defaults, "int"),
                norm_topk_prob=_field(d, "norm_topk_prob", {"norm_topk_prob": False}, "bool"),
                decoder_sparse_step=_field(d, "decoder_sparse_step", defaults, "int"),
                mlp_only_layers=tuple(sorted(set(only))))


def config_from_hf(d: dict[str, Any]) -> Qwen3Config:
    """A `Qwen3Config` of an HF `qwen3` / `qwen3_moe` config.json dict (`rope_parameters` or `rope_theta` +
    `rope_scaling`). ValueError naming the field for a value transformers would not run or jspec does not
    support (hidden_act other than silu, a missing head_dim that hidden_size / heads does not give, top-k
    above the number of experts, ...)."""
    model_type = d.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"qwen3 config_from_hf: model_type {model_type!r} is not one of {sorted(ARCHITECTURES)}")
    defaults = DEFAULTS[model_type]
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{model_type} config: hidden_act {d.get('hidden_act')!r} is not supported (Qwen3 "
                         "models use silu)")
    ints = {k: _field(d, k, defaults, "int") for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                       "num_hidden_layers", "num_attention_heads")}
    heads, layers = ints["num_attention_heads"], ints["num_hidden_layers"]
    kv = heads if d.get("num_key_value_heads", defaults["num_key_value_heads"]) is None else \
        _field(d, "num_key_value_heads", defaults, "int")
    if heads % kv:
        raise ValueError(f"{model_type} config: num_attention_heads = {heads} is not a multiple of "
                         f"num_key_value_heads = {kv}")
    window, full = _windows(d, defaults, layers)
    bias = _field(d, "attention_bias", {"attention_bias": False}, "bool")
    return Qwen3Config(
        model_type=model_type,
        **PC.sizes(ints, layers, heads, kv),
        head_dim=_head_dim(d, defaults, ints["hidden_size"], heads),
        rms_norm_eps=_field(d, "rms_norm_eps", {"rms_norm_eps": 1e-6}, "number"),
        rope=PC.rope_from_hf(d),
        max_position_embeddings=_field(d, "max_position_embeddings", defaults, "int"),
        tie_word_embeddings=_field(d, "tie_word_embeddings", {"tie_word_embeddings": False}, "bool"),
        qkv_bias=bias,
        o_bias=bias,
        **PC.token_ids(d),
        sliding_window=window,
        full_attention_layers=full,
        **_experts(d, defaults, layers),
    )


def config_to_hf(cfg: Qwen3Config) -> dict[str, Any]:
    """The HF config.json dict (transformers-5 spelling) transformers builds this model from."""
    out = PC.text_config_to_hf(cfg)
    out.update(architectures=[ARCHITECTURES[cfg.model_type]], attention_bias=cfg.qkv_bias,
               use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window)
    if cfg.model_type == "qwen3":
        full = set(cfg.full_attention_layers) if cfg.sliding_window is not None else set(range(cfg.num_layers))
        out.update(layer_types=[LAYER_TYPES[i not in full] for i in range(cfg.num_layers)],
                   max_window_layers=cfg.num_layers)
    else:
        out.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                   moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
                   decoder_sparse_step=cfg.decoder_sparse_step, mlp_only_layers=list(cfg.mlp_only_layers))
    return out


# ------------------------------------------------------------------------------------------ params


def param_shapes(cfg: Qwen3Config, stacked_experts: bool = False) -> dict:
    """Shapes of every parameter in the checkpoint layout (per-expert lists; stacked [E, ...] arrays, the run
    layout's, with `stacked_experts`)."""
    shapes = llama.param_shapes(cfg)
    D, E, F = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    for i, layer in enumerate(shapes["layers"]):
        layer.update(q_norm=(cfg.head_dim,), k_norm=(cfg.head_dim,))
        if cfg.is_sparse(i):
            for k in ("w_gate", "w_up", "w_down"):
                del layer[k]
            layer["router"] = (D, E)
            for k, shape in (("we_gate", (D, F)), ("we_up", (D, F)), ("we_down", (F, D))):
                layer[k] = (E,) + shape if stacked_experts else [shape] * E
    return shapes


def init_params(cfg: Qwen3Config, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> dict:
    """Random params (`llama.init_from_shapes`; the experts stacked)."""
    return llama.init_from_shapes(param_shapes(cfg, stacked_experts=True), key, dtype, std)


def hf_key_map(cfg: Qwen3Config, prefix: str = "model.", head_key: str = "lm_head.weight") -> list:
    """(hf_name, param path, transform) rows: LLaMA's, the q/k norms, and each sparse layer's router and
    per-expert matrices (transformers 5.23's saved names)."""
    rows = [r for r in llama.hf_key_map(cfg, prefix, head_key)
            if not (r[1][0] == "layers" and cfg.is_sparse(r[1][1]) and r[1][2] in ("w_gate", "w_up", "w_down"))]
    for i in range(cfg.num_layers):
        lp = f"{prefix}layers.{i}."
        rows += [(lp + "self_attn.q_norm.weight", ("layers", i, "q_norm"), None),
                 (lp + "self_attn.k_norm.weight", ("layers", i, "k_norm"), None)]
        if cfg.is_sparse(i):
            rows.append((lp + "mlp.gate.weight", ("layers", i, "router"), "T"))
            for e in range(cfg.num_experts):
                for ours, theirs in (("we_gate", "gate_proj"), ("we_up", "up_proj"), ("we_down", "down_proj")):
                    rows.append((f"{lp}mlp.experts.{e}.{theirs}.weight", ("layers", i, ours, e), "T"))
    return rows


_FUSED_EXPERTS = re.compile(r"(.+\.mlp\.experts)\.(gate_up_proj|down_proj)")


def split_hf_tensor(name: str, shape: tuple):
    """transformers' fused expert tensors as the per-expert tensors `hf_key_map` names: a list of (name, shape,
    take) where take(the whole tensor) is that expert's matrix; None for every other tensor."""
    m = _FUSED_EXPERTS.fullmatch(name)
    if m is None or len(shape) != 3:
        return None
    base, E = m.group(1), shape[0]
    if m.group(2) == "down_proj":  # [E, D, F]
        return [(f"{base}.{e}.down_proj.weight", tuple(shape[1:]), lambda a, e=e: a[e]) for e in range(E)]
    F = shape[1] // 2  # [E, 2F, D]: gate rows, then up rows
    gate = [(f"{base}.{e}.gate_proj.weight", (F, shape[2]), lambda a, e=e: a[e, :F]) for e in range(E)]
    up = [(f"{base}.{e}.up_proj.weight", (shape[1] - F, shape[2]), lambda a, e=e: a[e, F:]) for e in range(E)]
    return gate + up


IGNORED_HF_KEYS = llama.IGNORED_HF_KEYS
