"""Model configurations: the hashable, static description of a decoder-only text model.

`TextConfig` is what the jitted forward closes over (it must be hashable). It is parsed from an HF
config.json dict by `text_config_from_hf`, which accepts both the older hub spellings (`rope_theta`,
`rope_scaling`) and the transformers-5 ones (`rope_parameters`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
# the HF text model_types parsed as LLaMA-family decoders, and the class each one saves as
TEXT_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
MISTRAL_WINDOW = 4096  # transformers' MistralConfig default sliding_window (a config that omits the field)


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters in HF's vocabulary (`rope_type` and its keys)."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    partial_rotary_factor: float = 1.0


@dataclasses.dataclass(frozen=True)
class TextConfig:
    """A LLaMA-family decoder (LLaMA 1/2/3, Vicuna, CodeLLaMA, Qwen2, Mistral).

    sliding_window: Mistral's sliding-window attention: a query sees only the last `sliding_window` tokens of its
    own sequence, itself included (transformers' `kv_idx > q_idx - sliding_window`); None sees them all. A mask over
    the full-length KV cache (`ports.core.layers.attention_window`), not a ring buffer."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    sliding_window: int | None = None

    def __post_init__(self):
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool)
                                                or not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive int or None, got {self.sliding_window!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        if self.rope.rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {self.rope.rope_type!r}; jspec supports {ROPE_TYPES}")

    @property
    def num_params(self) -> int:
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = d * (q + 2 * kv) + q * d + 3 * d * f + 2 * d
        return v * d * (1 if self.tie_word_embeddings else 2) + self.num_layers * per_layer + d


def id_tuple(x) -> tuple[int, ...]:
    """A config's token id field (None, an int or a list) as a tuple of ints."""
    if x is None:
        return ()
    if isinstance(x, (list, tuple)):
        return tuple(int(i) for i in x)
    return (int(x),)


def sizes(ints: dict[str, int], layers: int, heads: int, kv: int) -> dict[str, int]:
    """The size fields every text config shares, from the HF config's checked integers (`vocab_size`,
    `hidden_size`, `intermediate_size`) and its layer and head counts."""
    return dict(vocab_size=ints["vocab_size"], hidden_size=ints["hidden_size"],
                intermediate_size=ints["intermediate_size"], num_layers=layers, num_heads=heads, num_kv_heads=kv)


def token_ids(cfg: dict[str, Any]) -> dict[str, Any]:
    """The special token fields of a text config (`eos_token_id` as a tuple of ids) from an HF config dict."""
    return dict(bos_token_id=cfg.get("bos_token_id"), eos_token_ids=id_tuple(cfg.get("eos_token_id")),
                pad_token_id=cfg.get("pad_token_id"))


def rope_from_hf(cfg: dict[str, Any]) -> RopeConfig:
    """Read RoPE settings from either `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or {})
    if "rope_theta" not in params and "rope_theta" in cfg:
        params["rope_theta"] = cfg["rope_theta"]
    scaling = cfg.get("rope_scaling") or {}
    for k, v in scaling.items():
        params.setdefault(k, v)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "mrope":  # Qwen2-VL writes its multimodal RoPE this way; the frequencies are default ones
        rope_type = "default"
    known = {f.name for f in dataclasses.fields(RopeConfig)}
    kwargs = {k: v for k, v in params.items() if k in known}
    kwargs.pop("rope_type", None)
    for k in ("beta_fast", "beta_slow"):
        if kwargs.get(k) is None:
            kwargs.pop(k, None)
    if "factor" in kwargs and kwargs["factor"] is None:
        kwargs.pop("factor")
    if "partial_rotary_factor" not in kwargs and "partial_rotary_factor" in cfg:
        kwargs["partial_rotary_factor"] = cfg["partial_rotary_factor"]
    return RopeConfig(rope_type=rope_type, theta=float(params.get("rope_theta", 10000.0)), **kwargs)


def text_config_from_hf(cfg: dict[str, Any]) -> TextConfig:
    """Parse an HF `llama` / `qwen2` / `mistral` config.json dict into a `TextConfig`. Mistral is LLaMA's layers
    (no biases) with `sliding_window` (absent: MistralConfig's default 4096; null: no window)."""
    model_type = cfg.get("model_type", "llama")
    if model_type not in TEXT_TYPES:
        raise ValueError(f"text_config_from_hf: model_type {model_type!r} is not a LLaMA-family decoder")
    if cfg.get("use_sliding_window"):
        raise ValueError("Qwen2 sliding-window attention (use_sliding_window=true) is not supported by jspec")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg.get('hidden_act')!r} is not supported (LLaMA-family models use silu)")
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    qwen, mistral = model_type == "qwen2", model_type == "mistral"
    attn_bias = bool(cfg.get("attention_bias", False)) and not mistral  # MistralConfig has no biases
    window = cfg.get("sliding_window", MISTRAL_WINDOW) if mistral else None
    return TextConfig(
        model_type=model_type,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope=rope_from_hf(cfg),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=True if qwen else attn_bias,
        o_bias=False if qwen else attn_bias,
        mlp_bias=False if qwen or mistral else bool(cfg.get("mlp_bias", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=id_tuple(cfg.get("eos_token_id")),
        pad_token_id=cfg.get("pad_token_id"),
        sliding_window=None if window is None else int(window),
    )


def rope_inv_freq(cfg: TextConfig) -> tuple[np.ndarray, float]:
    """Static inverse frequencies [rot_dim/2] and the cos/sin scale, as HF computes them at init.

    `dynamic` RoPE additionally rescales at run time from the current sequence length (see `layers.rope_tables`).
    """
    r = cfg.rope
    dim = int(cfg.head_dim * r.partial_rotary_factor)
    exps = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim
    inv = 1.0 / (r.theta ** exps)
    scale = 1.0
    if r.rope_type == "linear":
        inv = inv / r.factor
    elif r.rope_type == "llama3":
        old = r.original_max_position_embeddings
        low_wl, high_wl = old / r.low_freq_factor, old / r.high_freq_factor
        wl = 2 * math.pi / inv
        scaled = np.where(wl > low_wl, inv / r.factor, inv)
        smooth = (old / wl - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
        smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled
        medium = ~(wl < high_wl) & ~(wl > low_wl)
        inv = np.where(medium, smoothed, scaled)
    elif r.rope_type == "yarn":
        orig = r.original_max_position_embeddings or cfg.max_position_embeddings
        factor = r.factor if r.factor else cfg.max_position_embeddings / orig

        def mscale_of(s, m=1.0):
            return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

        if r.attention_factor is not None:
            scale = r.attention_factor
        elif r.mscale and r.mscale_all_dim:
            scale = mscale_of(factor, r.mscale) / mscale_of(factor, r.mscale_all_dim)
        else:
            scale = mscale_of(factor)

        def corr_dim(rot):
            return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(r.theta))

        low, high = corr_dim(r.beta_fast), corr_dim(r.beta_slow)
        if r.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        extrap = 1 - ramp
        pos = r.theta ** exps
        inv = (1.0 / (factor * pos)) * (1 - extrap) + (1.0 / pos) * extrap
    return inv.astype(np.float32), float(scale)


def text_config_to_hf(cfg: TextConfig) -> dict[str, Any]:
    """An HF config.json dict (transformers-5 spelling) for a `TextConfig`."""
    r = cfg.rope
    rope = {"rope_type": r.rope_type, "rope_theta": r.theta}
    if r.rope_type in ("linear", "dynamic", "llama3", "yarn"):
        rope["factor"] = r.factor
    if r.rope_type == "llama3":
        rope.update(low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor,
                    original_max_position_embeddings=r.original_max_position_embeddings)
    if r.rope_type == "yarn":
        rope.update(beta_fast=r.beta_fast, beta_slow=r.beta_slow, truncate=r.truncate,
                    original_max_position_embeddings=r.original_max_position_embeddings)
        if r.attention_factor is not None:
            rope["attention_factor"] = r.attention_factor
    if r.partial_rotary_factor != 1.0:
        rope["partial_rotary_factor"] = r.partial_rotary_factor
    eos = list(cfg.eos_token_ids)
    out = {
        "model_type": cfg.model_type,
        "architectures": [TEXT_TYPES.get(cfg.model_type, "LlamaForCausalLM")],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": cfg.hidden_act,
        "rope_parameters": rope,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": cfg.pad_token_id,
    }
    if cfg.model_type == "llama":
        out.update(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias)
    if cfg.model_type == "mistral" or cfg.sliding_window is not None:
        out["sliding_window"] = cfg.sliding_window
    return out


class TextFields:
    """Mixin of multimodal configs holding a `text: TextConfig`: the text fields the engine reads."""

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.text.eos_token_ids

    @property
    def bos_token_id(self):
        return self.text.bos_token_id

    @property
    def pad_token_id(self):
        return self.text.pad_token_id

    @property
    def tie_word_embeddings(self) -> bool:
        return self.text.tie_word_embeddings
