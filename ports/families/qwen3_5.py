"""Qwen3.5's language models (`qwen3_5_text`, `qwen3_5_moe_text`): a hybrid decoder, three of every four layers
Gated DeltaNet linear attention (`ports.core.recurrent`), the fourth gated full attention.

Per layer (transformers 5.23's `Qwen3_5DecoderLayer`), with RMSNorms that scale by 1 + weight:
  linear attention: in_proj_qkv -> the depthwise causal conv (kernel K, silu) -> q, k (L2-normed, q scaled by
      d_k^-1/2), v; beta = sigmoid(in_proj_b), g = -exp(A_log) softplus(in_proj_a + dt_bias); the gated delta rule;
      an RMSNorm of each head's output (plain weight) times silu(in_proj_z); out_proj.
  full attention: q_proj gives each head's query and an output gate; q/k RMSNorm; partial RoPE; attention; the
      output times sigmoid(gate); o_proj.
  then the MLP (SwiGLU), or for `qwen3_5_moe_text` the experts of `ports.core.moe` (top-k, renormalised) plus a shared
  expert scaled by sigmoid(shared_expert_gate(x)).
The KV cache holds the full-attention layers only; the linear layers' conv and delta-rule states live in the
cache's `rec` (`ports.core.cache`), advanced by every commit along the accepted tokens only. A forward over a tree (the
ancestor mask) gives each node the state of its own path (`ports.core.recurrent.delta_block`); a prefill runs in the
chunked form (blocks of 64 tokens in a scan, no loop over tokens).

Params: embed, final_norm, lm_head (untied), layers: a list of dicts, each with attn_norm, mlp_norm and either
  linear: lin_qkv [D, C], lin_z [D, H_v d_v], lin_b, lin_a [D, H_v], conv [C, 1, K], dt_bias, A_log [H_v],
          lin_norm [d_v], lin_out [H_v d_v, D]      (C = 2 H_k d_k + H_v d_v)
  attention: wqg [D, H 2Dh] (per head: its query, then its gate), wk, wv [D, KVH Dh], wo, q_norm, k_norm [Dh]
  and w_gate, w_up, w_down (dense), or router [D, E], we_gate/we_up/we_down, shared {w_gate, w_up, w_down},
  shared_gate [D, 1] (MoE).
Checkpoints: `Qwen3_5ForCausalLM` / `Qwen3_5MoeForCausalLM` names (`model.layers.N...`); the language model of a
conditional-generation checkpoint (`model.language_model.`) is read under the same names; `mtp.*` (the
multi-token-prediction head) is named as unused.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from ports.core import cache as kvc
from ports.core import config as PC
from ports.core import layers as LY
from ports.families import llama
from ports.core import moe
from ports.families import qwen3
from ports.core import recurrent as RC
from ports.core.config import TextConfig

ARCHITECTURES = {"qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}
LAYER_TYPES = ("linear_attention", "full_attention")
_COMMON = dict(vocab_size=248320, num_attention_heads=16, head_dim=256, max_position_embeddings=32768,
               linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
               linear_num_key_heads=16, linear_num_value_heads=32)
DEFAULTS = {  # transformers 5.23's Qwen3_5TextConfig / Qwen3_5MoeTextConfig defaults for the fields read here
    "qwen3_5_text": dict(_COMMON, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                         num_key_value_heads=4),
    "qwen3_5_moe_text": dict(_COMMON, hidden_size=2048, num_hidden_layers=40, num_key_value_heads=2,
                             moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts_per_tok=8,
                             num_experts=256),
}
IGNORED_HF_KEYS = llama.IGNORED_HF_KEYS + (r"mtp\..*", r"model\.visual\..*")


@dataclasses.dataclass(frozen=True)
class Qwen35Config(TextConfig):
    """A Qwen3.5 hybrid decoder: `TextConfig` (its attention fields are the full-attention layers') plus the
    linear-attention layers and, with num_experts > 0, the experts."""

    linear_layers: tuple[int, ...] = ()
    conv_kernel: int = 4
    linear_key_heads: int = 16
    linear_value_heads: int = 32
    linear_key_dim: int = 128
    linear_value_dim: int = 128
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    mtp_layers: int = 0

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if i not in self.linear_layers)

    @property
    def conv_channels(self) -> int:
        return 2 * self.linear_key_heads * self.linear_key_dim + self.linear_value_heads * self.linear_value_dim

    @property
    def num_params(self) -> int:
        shapes = param_shapes(self, stacked_experts=True)
        return sum(math.prod(s) for s in jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple)))


# ------------------------------------------------------------------------------------------ config


def config_from_hf(d: dict[str, Any]) -> Qwen35Config:
    """A `Qwen35Config` of an HF `qwen3_5_text` / `qwen3_5_moe_text` config dict (also the `text_config` of a
    `qwen3_5` / `qwen3_5_moe` one). ValueError naming the field for what transformers would not run or jspec does
    not support, before any weight is read."""
    model_type = d.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"qwen3_5 config_from_hf: model_type {model_type!r} is not one of {sorted(ARCHITECTURES)}")
    df = DEFAULTS[model_type]
    field = lambda k, kind="int", lo=1: qwen3._field(d, k, df, kind, lo)  # noqa: E731
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{model_type} config: hidden_act {d.get('hidden_act')!r} is not supported (Qwen3.5 uses "
                         "silu)")
    if d.get("attn_output_gate", True) is not True:
        raise ValueError(f"{model_type} config: attn_output_gate = {d.get('attn_output_gate')!r}; transformers' "
                         "Qwen3.5 attention always gates its output")
    layers, heads = field("num_hidden_layers"), field("num_attention_heads")
    kv = field("num_key_value_heads")
    if heads % kv:
        raise ValueError(f"{model_type} config: num_attention_heads = {heads} is not a multiple of "
                         f"num_key_value_heads = {kv}")
    types = d.get("layer_types")
    if types is None:
        every = field("full_attention_interval", lo=1) if "full_attention_interval" in d else 4
        types = [LAYER_TYPES[(i + 1) % every == 0] for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or any(t not in LAYER_TYPES for t in types):
        raise ValueError(f"{model_type} config: layer_types = {types!r}; expected {layers} entries (one per "
                         f"num_hidden_layers), each one of {LAYER_TYPES}")
    hk, hv = field("linear_num_key_heads"), field("linear_num_value_heads")
    if hv % hk:
        raise ValueError(f"{model_type} config: linear_num_value_heads = {hv} is not a multiple of "
                         f"linear_num_key_heads = {hk}")
    rope = d.get("rope_parameters") or {}
    d = {**d, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, **rope}}
    if "partial_rotary_factor" not in d["rope_parameters"]:
        d["rope_parameters"]["partial_rotary_factor"] = d.get("partial_rotary_factor", 0.25)
    moe_fields = {}
    if model_type == "qwen3_5_moe_text":
        E, k = field("num_experts"), field("num_experts_per_tok")
        if k > E:
            raise ValueError(f"{model_type} config: num_experts_per_tok = {k} is more than num_experts = {E}")
        if d.get("mlp_only_layers"):
            raise ValueError(f"{model_type} config: mlp_only_layers = {d['mlp_only_layers']!r}; transformers' "
                             "Qwen3.5-MoE runs the experts in every layer")
        moe_fields = dict(num_experts=E, num_experts_per_tok=k, moe_intermediate_size=field("moe_intermediate_size"),
                          shared_expert_intermediate_size=field("shared_expert_intermediate_size"))
    hidden = field("hidden_size")
    return Qwen35Config(
        model_type=model_type, vocab_size=field("vocab_size"), hidden_size=hidden,
        intermediate_size=field("intermediate_size") if model_type == "qwen3_5_text" else 0,
        num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=field("head_dim"),
        rms_norm_eps=qwen3._field(d, "rms_norm_eps", {"rms_norm_eps": 1e-6}, "number"),
        rope=PC.rope_from_hf(d), max_position_embeddings=field("max_position_embeddings"),
        tie_word_embeddings=qwen3._field(d, "tie_word_embeddings", {"tie_word_embeddings": False}, "bool"),
        qkv_bias=qwen3._field(d, "attention_bias", {"attention_bias": False}, "bool"),
        o_bias=qwen3._field(d, "attention_bias", {"attention_bias": False}, "bool"),
        **PC.token_ids(d),
        linear_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        conv_kernel=field("linear_conv_kernel_dim", lo=2), linear_key_heads=hk, linear_value_heads=hv,
        linear_key_dim=field("linear_key_head_dim"), linear_value_dim=field("linear_value_head_dim"),
        mtp_layers=qwen3._field(d, "mtp_num_hidden_layers", {"mtp_num_hidden_layers": 0}, "int", 0),
        **moe_fields)


def config_to_hf(cfg: Qwen35Config) -> dict[str, Any]:
    """The HF config dict transformers builds this model from."""
    out = PC.text_config_to_hf(cfg)
    out["rope_parameters"]["partial_rotary_factor"] = cfg.rope.partial_rotary_factor
    out.update(architectures=[ARCHITECTURES[cfg.model_type]], attention_bias=cfg.qkv_bias, head_dim=cfg.head_dim,
               layer_types=[LAYER_TYPES[i not in cfg.linear_layers] for i in range(cfg.num_layers)],
               linear_conv_kernel_dim=cfg.conv_kernel, linear_num_key_heads=cfg.linear_key_heads,
               linear_num_value_heads=cfg.linear_value_heads, linear_key_head_dim=cfg.linear_key_dim,
               linear_value_head_dim=cfg.linear_value_dim)
    if cfg.mtp_layers:
        out["mtp_num_hidden_layers"] = cfg.mtp_layers
    if cfg.num_experts:
        out.pop("intermediate_size", None)
        out.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                   moe_intermediate_size=cfg.moe_intermediate_size,
                   shared_expert_intermediate_size=cfg.shared_expert_intermediate_size)
    return out


# ------------------------------------------------------------------------------------------ params


def param_shapes(cfg: Qwen35Config, stacked_experts: bool = False) -> dict:
    """Shapes of every parameter in the checkpoint layout (per-expert lists; stacked [E, ...] arrays, the run
    layout's, with `stacked_experts`)."""
    D, V = cfg.hidden_size, cfg.vocab_size
    H, KVH, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    hv, dv = cfg.linear_value_heads, cfg.linear_value_dim
    layers = []
    for i in range(cfg.num_layers):
        p = {"attn_norm": (D,), "mlp_norm": (D,)}
        if i in cfg.linear_layers:
            C = cfg.conv_channels
            p.update(lin_qkv=(D, C), lin_z=(D, hv * dv), lin_b=(D, hv), lin_a=(D, hv), conv=(C, 1, cfg.conv_kernel),
                     dt_bias=(hv,), A_log=(hv,), lin_norm=(dv,), lin_out=(hv * dv, D))
        else:
            p.update(wqg=(D, H * 2 * Dh), wk=(D, KVH * Dh), wv=(D, KVH * Dh), wo=(H * Dh, D), q_norm=(Dh,),
                     k_norm=(Dh,))
            if cfg.qkv_bias:
                p.update(bqg=(H * 2 * Dh,), bk=(KVH * Dh,), bv=(KVH * Dh,), bo=(D,))
        if cfg.num_experts:
            E, F, S = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
            p["router"] = (D, E)
            for k, shape in (("we_gate", (D, F)), ("we_up", (D, F)), ("we_down", (F, D))):
                p[k] = (E,) + shape if stacked_experts else [shape] * E
            p["shared"] = {"w_gate": (D, S), "w_up": (D, S), "w_down": (S, D)}
            p["shared_gate"] = (D, 1)
        else:
            F = cfg.intermediate_size
            p.update(w_gate=(D, F), w_up=(D, F), w_down=(F, D))
        layers.append(p)
    out = {"embed": (V, D), "final_norm": (D,), "layers": layers}
    if not cfg.tie_word_embeddings:
        out["lm_head"] = (D, V)
    return out


def init_params(cfg: Qwen35Config, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> dict:
    """Random params: normal(std) matrices; norms 0 (the 1 + weight norms' identity) except the gated head norm
    (1); A_log log U(0.01, 16) and dt_bias 1 as transformers initialises them."""
    params = llama.init_from_shapes(param_shapes(cfg, stacked_experts=True), key, dtype, std)
    hv = cfg.linear_value_heads
    for i, p in enumerate(params["layers"]):
        for k in ("attn_norm", "mlp_norm", "q_norm", "k_norm"):
            if k in p:
                p[k] = jnp.zeros_like(p[k])
        if "A_log" in p:
            u = jax.random.uniform(jax.random.fold_in(key, 10_000 + i), (hv,), jnp.float32, 0.01, 16.0)
            p.update(A_log=jnp.log(u).astype(dtype), dt_bias=jnp.ones((hv,), dtype),
                     lin_norm=jnp.ones_like(p["lin_norm"]))
    params["final_norm"] = jnp.zeros_like(params["final_norm"])
    return params


def hf_key_map(cfg: Qwen35Config, prefix: str = "model.", head_key: str = "lm_head.weight") -> list:
    """(hf_name, param path, transform) rows under `Qwen3_5ForCausalLM`'s names (experts per expert, as
    `ports.families.qwen3` names them)."""
    rows = [(f"{prefix}embed_tokens.weight", ("embed",), None), (f"{prefix}norm.weight", ("final_norm",), None)]
    if not cfg.tie_word_embeddings:
        rows.append((head_key, ("lm_head",), "T"))
    for i in range(cfg.num_layers):
        lp, at = f"{prefix}layers.{i}.", ("layers", i)
        rows += [(lp + "input_layernorm.weight", at + ("attn_norm",), None),
                 (lp + "post_attention_layernorm.weight", at + ("mlp_norm",), None)]
        if i in cfg.linear_layers:
            la = lp + "linear_attn."
            rows += [(la + "in_proj_qkv.weight", at + ("lin_qkv",), "T"), (la + "in_proj_z.weight", at + ("lin_z",), "T"),
                     (la + "in_proj_b.weight", at + ("lin_b",), "T"), (la + "in_proj_a.weight", at + ("lin_a",), "T"),
                     (la + "conv1d.weight", at + ("conv",), None), (la + "dt_bias", at + ("dt_bias",), None),
                     (la + "A_log", at + ("A_log",), None), (la + "norm.weight", at + ("lin_norm",), None),
                     (la + "out_proj.weight", at + ("lin_out",), "T")]
        else:
            sa = lp + "self_attn."
            rows += [(sa + "q_proj.weight", at + ("wqg",), "T"), (sa + "k_proj.weight", at + ("wk",), "T"),
                     (sa + "v_proj.weight", at + ("wv",), "T"), (sa + "o_proj.weight", at + ("wo",), "T"),
                     (sa + "q_norm.weight", at + ("q_norm",), None), (sa + "k_norm.weight", at + ("k_norm",), None)]
            if cfg.qkv_bias:
                rows += [(sa + "q_proj.bias", at + ("bqg",), None), (sa + "k_proj.bias", at + ("bk",), None),
                         (sa + "v_proj.bias", at + ("bv",), None), (sa + "o_proj.bias", at + ("bo",), None)]
        if cfg.num_experts:
            rows.append((lp + "mlp.gate.weight", at + ("router",), "T"))
            for e in range(cfg.num_experts):
                for ours, theirs in (("we_gate", "gate_proj"), ("we_up", "up_proj"), ("we_down", "down_proj")):
                    rows.append((f"{lp}mlp.experts.{e}.{theirs}.weight", at + (ours, e), "T"))
            for ours, theirs in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
                rows.append((f"{lp}mlp.shared_expert.{theirs}.weight", at + ("shared", ours), "T"))
            rows.append((lp + "mlp.shared_expert_gate.weight", at + ("shared_gate",), "T"))
        else:
            for ours, theirs in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
                rows.append((f"{lp}mlp.{theirs}.weight", at + (ours,), "T"))
    return rows


def rename_hf_key(name: str) -> str:
    """A conditional-generation checkpoint's language model under the causal LM's names."""
    return "model." + name[len("model.language_model."):] if name.startswith("model.language_model.") else name


# ------------------------------------------------------------------------------------------ forward


def kv_layout(cfg: Qwen35Config) -> tuple[int, int, int]:
    """(full-attention layers, kv_heads, head_dim): the KV cache holds those layers only."""
    return len(cfg.attention_layers), cfg.num_kv_heads, cfg.head_dim


def init_recurrent(cfg: Qwen35Config, batch: int, dtype) -> RC.State:
    """The empty recurrent state of every linear-attention layer (zeros, as transformers starts a sequence)."""
    return RC.init_state(len(cfg.linear_layers), batch, cfg.conv_kernel, cfg.conv_channels, cfg.linear_value_heads,
                         cfg.linear_key_dim, cfg.linear_value_dim, dtype)


def embed(cfg: Qwen35Config, params: dict, tokens: jax.Array) -> jax.Array:
    return llama.embed(params, tokens)


def unembed(cfg: Qwen35Config, params: dict, h: jax.Array) -> jax.Array:
    """The final (1 + weight) norm and the LM head, float32 logits."""
    h = LY.centered_rms_norm(h, params["final_norm"], cfg.rms_norm_eps)
    if cfg.tie_word_embeddings:
        return LY.weight_dot("btd,vd->btv", h, params["embed"], jnp.float32)
    return LY.weight_dot("btd,dv->btv", h, params["lm_head"], jnp.float32)


def _l2norm(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def linear_attention(cfg: Qwen35Config, p: dict, x: jax.Array, conv_state: jax.Array, ssm: jax.Array,
                     anc: jax.Array | None) -> tuple[jax.Array, RC.Pending]:
    """One Gated DeltaNet block over x [B, T, D] (normed) from the committed conv / delta-rule state, along the
    sequence (anc None) or each node's tree path. Returns (its output [B, T, D], what each token adds to the
    state, for one layer: `RC.Pending` without the layer axis)."""
    B, T, _ = x.shape
    hk, hv, dk, dv = cfg.linear_key_heads, cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim
    mixed = LY.linear(x, p["lin_qkv"])
    z = LY.linear(x, p["lin_z"]).reshape(B, T, hv, dv)
    beta = jax.nn.sigmoid(LY.linear(x, p["lin_b"])).astype(jnp.float32)
    a = LY.linear(x, p["lin_a"]).astype(jnp.float32)
    g = -jnp.exp(p["A_log"].astype(jnp.float32)) * jax.nn.softplus(a + p["dt_bias"].astype(jnp.float32))
    y = RC.causal_conv(mixed, conv_state, p["conv"][:, 0, :].astype(mixed.dtype), anc)
    q = _l2norm(y[..., :hk * dk].reshape(B, T, hk, dk).astype(jnp.float32)) * dk ** -0.5
    k = _l2norm(y[..., hk * dk:2 * hk * dk].reshape(B, T, hk, dk).astype(jnp.float32))
    v = y[..., 2 * hk * dk:].reshape(B, T, hv, dv).astype(jnp.float32)
    qr, kr = RC.match_heads(q, hv), RC.match_heads(k, hv)
    if anc is None:
        o, d = RC.sequence_rule(ssm, qr, kr, v, g, beta)
    else:
        o, d = RC.delta_block(ssm, qr, kr, v, g, beta, anc)
    o = o.astype(x.dtype).astype(jnp.float32)  # transformers hands the rule's output back in the model dtype
    o = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + cfg.rms_norm_eps)
    o = p["lin_norm"] * o.astype(x.dtype)
    o = (o.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)
    return LY.linear(o.reshape(B, T, hv * dv), p["lin_out"]), RC.Pending(mixed, k, d, g)


def gated_attention(cfg: Qwen35Config, p: dict, x: jax.Array, cos, sin, k_buf, v_buf, start, visible, fresh):
    """One gated full-attention block over x [B, T, D] (normed): returns (output, k_buf, v_buf)."""
    B, T, _ = x.shape
    H, KVH, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qg = LY.linear(x, p["wqg"], p.get("bqg")).reshape(B, T, H, 2 * Dh)
    q, gate = qg[..., :Dh], qg[..., Dh:].reshape(B, T, H * Dh)
    k = LY.linear(x, p["wk"], p.get("bk")).reshape(B, T, KVH, Dh)
    v = LY.linear(x, p["wv"], p.get("bv")).reshape(B, T, KVH, Dh)
    q = LY.centered_rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
    k = LY.centered_rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    q, k = LY.apply_rope(q, cos, sin), LY.apply_rope(k, cos, sin)
    o, k_buf, v_buf = LY.write_and_attend(q, k, v, k_buf, v_buf, start, visible, None, fresh)
    o = o.reshape(B, T, H * Dh) * jax.nn.sigmoid(gate)
    return LY.linear(o, p["wo"], p.get("bo")), k_buf, v_buf


def feed_forward(cfg: Qwen35Config, p: dict, x: jax.Array) -> jax.Array:
    """The dense SwiGLU, or the routed experts plus the gated shared expert."""
    if "router" not in p:
        return LY.swiglu(x, p)
    shared = LY.swiglu(x, p["shared"]) * jax.nn.sigmoid(LY.linear(x, p["shared_gate"]))
    return moe.sparse_moe(cfg, p, x) + shared


def forward(cfg: Qwen35Config, params: dict, tokens: jax.Array | None, positions: jax.Array, cache: kvc.KVCache,
            new_mask: jax.Array | None = None, *, embeds: jax.Array | None = None,
            hidden_layers: Sequence[int] = (), logits_at: jax.Array | None = None, compute_logits: bool = True,
            write_offset: int = 0, attn_query_weights: jax.Array | None = None, rope: tuple | None = None,
            fresh: bool = False, defer_writes: bool = False) -> kvc.ForwardOut:
    """`ports.families.llama.forward`'s contract for a hybrid model: the new tokens' K/V land in the full-attention layers'
    scratch slots, and the returned cache's `rec_new` holds what each new token adds to the recurrent state; the
    state itself moves only when the caller commits (`ports.core.cache.commit` / `commit_path` / `rollback`). The new
    tokens follow the committed ones (write_offset 0): a tree (new_mask, the ancestor mask) is computed per path.
    Not taken: write_offset, defer_writes, attn_query_weights (a ValueError names it)."""
    for name, given in (("write_offset", write_offset), ("defer_writes", defer_writes),
                        ("attn_query_weights", attn_query_weights is not None)):
        if given:
            raise ValueError(f"{cfg.model_type}: the hybrid forward runs right after the committed tokens and takes "
                             f"no {name}")
    if cache.rec is None:
        raise ValueError(f"{cfg.model_type}: the cache has no recurrent state (build it with "
                         "ports.model.new_cache)")
    x = embed(cfg, params, tokens) if embeds is None else embeds
    B, T, _ = x.shape
    visible = LY.prefill_visibility(cache, T, new_mask, 0, fresh)
    if rope is None:
        if positions.ndim != 2:
            raise ValueError(f"{cfg.model_type}: text positions [B, T] expected, got shape {positions.shape}")
        rope = LY.rope_tables(cfg, positions)
    cos, sin = rope
    anc = None if new_mask is None else new_mask[:, :, :T].astype(bool)
    ks, vs, pending = list(cache.k), list(cache.v), []
    want = set(hidden_layers)
    hidden = {0: x} if 0 in want else {}
    ai = li = 0
    for i, p in enumerate(params["layers"]):
        h = LY.centered_rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
        if "lin_qkv" in p:
            out, pd = linear_attention(cfg, p, h, cache.rec.conv[li], cache.rec.ssm[li], anc)
            pending.append(pd)
            li += 1
        else:
            out, ks[ai], vs[ai] = gated_attention(cfg, p, h, cos, sin, cache.k[ai], cache.v[ai], cache.length,
                                                  visible, fresh)
            ai += 1
        x = x + out
        x = x + feed_forward(cfg, p, LY.centered_rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps))
        if i + 1 in want:
            hidden[i + 1] = x
    new = RC.Pending(*(jnp.stack([getattr(pd, f) for pd in pending]) for f in ("x", "k", "d", "g"))) if pending \
        else None  # (a config of full-attention layers only has no state to advance)
    head = (lambda xs: unembed(cfg, params, xs)) if compute_logits else None
    fo = llama.finish_forward(x, ks, vs, cache, hidden, hidden_layers, logits_at, head)
    return fo._replace(cache=fo.cache.replace(rec_new=new))
