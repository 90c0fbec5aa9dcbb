"""LLaMA-family decoder port (LLaMA 1/2/3, Vicuna, CodeLLaMA, Qwen2, Mistral): params, forward, HF key map.

Params are a plain pytree:
    {"embed": [V, D], "layers": [per-layer dict, ...], "final_norm": [D], "lm_head": [D, V] (absent if tied)}
with per-layer keys attn_norm, wq, wk, wv, wo (+ bq, bk, bv, bo), mlp_norm, w_gate, w_up, w_down (+ b_*): the
checkpoint layout `param_shapes`, `init_params` and `hf_key_map` describe. The loaders hand out the run layout
(`ports.core.fused`: wqkv and w_gate_up in place of the q/k/v and gate/up matrices); `forward` takes either.
Matrices are stored [in, out]. Layers are a Python list, unrolled in the jitted forward, or stacked
(`ports.core.scanned.scan_layers`: one `lax.scan` over them, with a stacked KV cache; `forward` takes either).
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from ports.core import cache as kvc
from ports.core.cache import ForwardOut
from ports.core import layers as LY
from ports.core import scanned as SC
from ports.core.config import TextConfig


def param_shapes(cfg: TextConfig) -> dict:
    """Shapes of every parameter (the same structure `init_params` and the converters produce)."""
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer = {"attn_norm": (d,), "wq": (d, q), "wk": (d, kv), "wv": (d, kv), "wo": (q, d),
             "mlp_norm": (d,), "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d)}
    if cfg.qkv_bias:
        layer.update(bq=(q,), bk=(kv,), bv=(kv,))
    if cfg.o_bias:
        layer.update(bo=(d,))
    if cfg.mlp_bias:
        layer.update(b_gate=(f,), b_up=(f,), b_down=(d,))
    shapes = {"embed": (v, d), "layers": [dict(layer) for _ in range(cfg.num_layers)], "final_norm": (d,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (d, v)
    return shapes


def init_params(cfg: TextConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> dict:
    """Random params (normal(0, std) matrices, unit norms, zero-mean small biases)."""
    return init_from_shapes(param_shapes(cfg), key, dtype, std)


def init_from_shapes(shapes, key: jax.Array, dtype=jnp.float32, std: float = 0.02):
    """Random arrays in a tree of shape tuples: ones for leaves named *norm, normal(0, std) for the others."""
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        shapes, is_leaf=lambda x: isinstance(x, tuple))[0]]
    keys = jax.random.split(key, len(leaves))
    out = []
    for k, shape, path in zip(keys, leaves, paths):
        if path.endswith("norm']"):
            out.append(jnp.ones(shape, dtype))
        else:
            out.append((jax.random.normal(k, shape, jnp.float32) * std).astype(dtype))
    return jax.tree.unflatten(treedef, out)


def embed(params: dict, tokens: jax.Array) -> jax.Array:
    return jnp.take(params["embed"], tokens, axis=0)


def unembed(cfg: TextConfig, params: dict, h: jax.Array) -> jax.Array:
    """Final norm + LM head (tied or not), logits in float32."""
    h = LY.rms_norm(h, params["final_norm"], cfg.rms_norm_eps)
    if cfg.tie_word_embeddings:  # contract with the stored [V, D] table: a transposed view made XLA:CPU copy it
        logits = LY.weight_dot("btd,vd->btv", h, params["embed"], jnp.float32)
    else:
        logits = LY.weight_dot("btd,dv->btv", h, params["lm_head"], jnp.float32)
    return soft_cap(cfg, logits)


def soft_cap(cfg, logits: jax.Array) -> jax.Array:
    """cap * tanh(logits * output_multiplier / cap) where the config has a `final_logit_softcapping` cap (Muse
    Glimmer; its `output_multiplier` scales first), else the logits as they are."""
    mult, cap = getattr(cfg, "output_multiplier", 1.0), getattr(cfg, "final_logit_softcapping", None)
    if mult != 1.0:
        logits = logits * mult
    return logits if cap is None else jnp.tanh(logits / cap) * cap


def forward(cfg: TextConfig, params: dict, tokens: jax.Array | None, positions: jax.Array, cache: kvc.KVCache,
            new_mask: jax.Array | None = None, *, embeds: jax.Array | None = None,
            hidden_layers: Sequence[int] = (), logits_at: jax.Array | None = None,
            compute_logits: bool = True, write_offset: int = 0,
            attn_query_weights: jax.Array | None = None, rope: tuple | None = None, fresh: bool = False,
            defer_writes: bool = False, layer_adds: jax.Array | None = None) -> ForwardOut:
    """Run T new tokens per row against the cache.

    tokens [B, T] (or embeds [B, T, D]); positions [B, T] RoPE positions; the new K/V are written at slots
    cache.length[b] + write_offset .. +T-1 (length itself is not advanced: the caller commits). new_mask
    [B, T, write_offset + T] says which scratch slots (earlier scratch, then the new tokens) each new token sees
    (default causal over the new tokens; a tree passes its ancestor mask); a config's `sliding_window` shorter than
    the cache hides, from each token, what lies more than that many tokens back in its sequence
    (`layers.windowed`), in every layer but the config's `full_attention_layers` (`layers.layer_windows`).
    hidden_layers: indices i in [0, num_layers], the residual stream after the first i layers (0 = embeddings).
    logits_at [B, K]: compute logits only at these new-token indices (default all T). attn_query_weights [B, T]:
    also return `attn` [B, S], the attention probabilities over cache slots averaged over layers and heads and
    summed over the new tokens with these weights (e.g. 1/|L| on the queries L of SpecVLM's language-to-vision
    scores). rope: precomputed (cos, sin)
    [B, T, rot_dim] tables that replace the ones of `positions` (e.g. Qwen2-VL's M-RoPE, `layers.mrope_tables`).
    fresh: the cache is empty (every row's length is 0; a prefill): same result, computed without the cache's
    empty slots (`layers.write_and_attend`).
    defer_writes: write nothing into the cache; the new keys and values come back as `ForwardOut.pending` (for
    `ports.core.cache.write_pending`) and `cache` is the one given. For a forward whose writes would go at the committed
    length (write_offset 0, not fresh, no attention scores asked): inside a conditional, a write into the cache
    makes XLA copy every layer's buffers in and out.
    layer_adds [n, B, T, D]: added to the residual stream after each of the first n layers (Qwen3-VL's DeepStack
    vision features at the placeholder positions of a prompt, zero elsewhere); `hidden_layers` report each layer's
    output before its addition, as transformers records them. Unrolled layers only.
    """
    check_fresh(fresh, write_offset)
    x = embed(params, tokens) if embeds is None else embeds
    B, T, _ = x.shape
    if defer_writes:
        if fresh or write_offset or attn_query_weights is not None:
            raise ValueError("defer_writes is for a forward at the committed length over a filled cache "
                             "(not fresh, write_offset 0, no attn_query_weights)")
        visible = LY.deferred_visibility(cache, T, new_mask)
    else:
        visible = LY.prefill_visibility(cache, T, new_mask, write_offset, fresh)
    # each layer's sliding window (Mistral's, Qwen3's), where shorter than the cache
    windows = LY.layer_windows(cfg, cache.max_len, SC.num_layers(params["layers"]))
    seen = {w: LY.windowed(visible, w) for w in set(windows)}
    start = cache.length + write_offset
    cos, sin = LY.rope_tables(cfg, positions, LY.whole_sequence_len(cfg, positions, fresh)) if rope is None else rope
    want = set(hidden_layers)
    hidden = {0: x} if 0 in want else {}
    if SC.is_stacked(params["layers"]):
        if len(seen) > 1:
            raise ValueError(f"stacked layers run under one attention window; these layers have {windows}")
        if getattr(cfg, "nope_layers", ()):
            raise ValueError(f"stacked layers all take rotary positions; layers {list(cfg.nope_layers)} take none")
        if layer_adds is not None:
            raise ValueError("layer_adds (DeepStack features) need unrolled layers, not stacked ones")
        x, ks, vs, hs, attn = SC.run_layers(cfg, params["layers"], x, cache.k, cache.v, cos, sin, start,
                                            seen[windows[0]], attn_query_weights, fresh,
                                            keep_hidden=bool(want - {0}))
        hidden.update({i: hs[i - 1] for i in want - {0}})
        num_layers = ks.shape[0]
    else:
        ks, vs = [], []
        attn = None
        nope = set(getattr(cfg, "nope_layers", ()))  # layers without rotary positions (Muse Glimmer's global ones)
        for i, p in enumerate(params["layers"]):
            c, s = (None, None) if i in nope else (cos, sin)
            x, kb, vb, scores = LY.decoder_layer(cfg, p, x, c, s, cache.k[i], cache.v[i], start,
                                                 seen[windows[i]], attn_query_weights, fresh)
            if scores is not None:
                attn = scores if attn is None else attn + scores
            ks.append(kb)
            vs.append(vb)
            if i + 1 in want:
                hidden[i + 1] = x
            if layer_adds is not None and i < layer_adds.shape[0]:
                x = x + layer_adds[i].astype(x.dtype)
        num_layers = len(params["layers"])
        if defer_writes:
            ks, vs = tuple(ks), tuple(vs)
    if attn is not None:
        attn = attn / num_layers
    head = (lambda xs: unembed(cfg, params, xs)) if compute_logits else None
    if defer_writes:
        return finish_forward(x, cache.k, cache.v, cache, hidden, hidden_layers, logits_at, head)._replace(
            pending=(ks, vs))
    return finish_forward(x, ks, vs, cache, hidden, hidden_layers, logits_at, head, attn)


def check_fresh(fresh: bool, write_offset: int) -> None:
    if fresh and write_offset:
        raise ValueError(f"a fresh (empty) cache is written from slot 0; got write_offset={write_offset}")


def finish_forward(x, ks, vs, cache: kvc.KVCache, hidden: dict, hidden_layers: Sequence[int], logits_at, head,
                   attn=None) -> ForwardOut:
    """The end of every decoder forward: the new cache (length not advanced), the requested hidden states, and
    `head(x)` logits at `logits_at` (all positions when None; no logits when head is None)."""
    logits = None
    if head is not None:
        xs = x if logits_at is None else jnp.take_along_axis(x, logits_at[..., None].astype(jnp.int32), axis=1)
        logits = head(xs)
    return ForwardOut(logits, tuple(hidden[i] for i in hidden_layers), cache.replace(k=ks, v=vs),
                      attn)


def hf_key_map(cfg: TextConfig, prefix: str = "model.", head_key: str = "lm_head.weight"):
    """(hf_name, param path, transform) triples; transform "T" means the HF tensor is [out, in]."""
    rows = [(f"{prefix}embed_tokens.weight", ("embed",), None), (f"{prefix}norm.weight", ("final_norm",), None)]
    if not cfg.tie_word_embeddings:
        rows.append((head_key, ("lm_head",), "T"))
    names = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
             "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}
    for i in range(cfg.num_layers):
        lp = f"{prefix}layers.{i}."
        rows.append((lp + "input_layernorm.weight", ("layers", i, "attn_norm"), None))
        rows.append((lp + "post_attention_layernorm.weight", ("layers", i, "mlp_norm"), None))
        for ours, theirs in names.items():
            rows.append((lp + theirs + ".weight", ("layers", i, ours), "T"))
        bias = []
        if cfg.qkv_bias:
            bias += [("bq", "wq"), ("bk", "wk"), ("bv", "wv")]
        if cfg.o_bias:
            bias += [("bo", "wo")]
        if cfg.mlp_bias:
            bias += [("b_gate", "w_gate"), ("b_up", "w_up"), ("b_down", "w_down")]
        for b, w in bias:
            rows.append((lp + names[w] + ".bias", ("layers", i, b), None))
    return rows


# Tensors that HF checkpoints may carry but the model does not use (named, never silently dropped).
IGNORED_HF_KEYS = ("rotary_emb.inv_freq",)


def kv_layout(cfg: TextConfig) -> tuple[int, int, int]:
    """(num_layers, kv_heads, head_dim) of the KV cache this model needs."""
    return cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
