"""EAGLE-3's head as a drafter: the target's low, middle and high layers fused, a reduced draft vocabulary.

The head (`Eagle3Head`) reads g_t = fc([h_a; h_b; h_c]_t), the target's residual streams at three layers (the
layer ids count as `TargetPrefill.hidden_at` does: id i is the stream after the target's first i layers, what
vLLM, SGLang and `speculators` call `eagle_aux_hidden_state_layer_ids`; default [2, L // 2, L - 3]). Its first
decoder layer attends over [norm_e(e(x_{t+1})); norm_h(g_t)] (q, k and v project 2D -> heads) and adds the
attention to g_t (or to norm_h(g_t) with `norm_before_residual`); further layers, if any, are plain decoder
layers. Its own final norm and LM head score a draft vocabulary of Vd tokens, mapped to the target's ids by
`vocab` (`speculators`' d2t: target id = d + d2t[d]).

Drafting deeper than one token feeds the head's own output hidden state back in place of g (training-time test
trains the head for exactly that), so the head's entries, slots and steps are EAGLE-1's (`jspec.parts.drafters.eagle`):
the drafter reuses that drafter's feed, tree walk and commit, and overrides only the head's computation.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec.parts.drafters import eagle as EG
from jspec.parts.drafters import heads as H
from jspec.parts.protocols import Prepared, Setup
from ports.core import cache as kvc
from ports.core import fused as FU
from ports.core import layers as LY
from ports.families import llama
from ports.core.config import TextConfig

FAMILIES = ("llama", "qwen2", "mistral", "qwen3", "qwen3_moe", "qwen3_5_text", "qwen3_5_moe_text")


def text_parts(target):
    """(text config, language-model params) of a target an EAGLE-3 head can serve (LLaMA, Qwen2, Mistral, Qwen3,
    Qwen3-MoE, LLaVA's language model); ValueError otherwise. The head reads only the target's residual streams,
    embedding and vocabulary, so the target's own layers (q/k norms, experts, windows) do not matter to it."""
    return H.text_model(target, FAMILIES, "an EAGLE-3 head needs a LLaMA, Qwen2, Mistral, Qwen3, Qwen3-MoE or "
                                          "LLaVA target")


def signature(target) -> EG.FeatureHeadTarget:
    """What a head records of its target (`eagle.signature_of`)."""
    return EG.signature_of(*text_parts(target))


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's layers for a target of `num_layers`: (2, L // 2, L - 3), as EAGLE, vLLM and `speculators` pick
    them; ValueError when they are not three distinct layers."""
    ids = (2, num_layers // 2, num_layers - 3)
    if len(set(ids)) != 3 or min(ids) < 0:
        raise ValueError(f"EAGLE-3's default layers {ids} are not three distinct layers of a {num_layers}-layer "
                         "target: pass aux_layers")
    return ids


@struct.dataclass
class Eagle3Head:
    """An EAGLE-3 head. params (run layout):
    - "fc": [n * D, D] (n = len(aux_layers)), no bias; "fc_norm": [n, D] (a norm per fused layer) or
      "input_norm": [n * D] (one norm over the concatenation), when the head has one;
    - "layers": decoder layers of `config`; the first also holds "hidden_norm" [D], its q / k / v read 2D;
    - "norm": [D]; "lm_head": [Vd, D] (a row per draft token); "embed": [V, D] only when the head's token
      embedding differs from the target's.
    vocab: the target id of each draft token [Vd] (None: Vd is the target's vocabulary, in order).
    norm_before_residual: the first layer adds its attention to norm_h(g) rather than g. norm_output: the final
    norm is applied before the hidden state is fed back (EAGLE 3.1's variant)."""

    params: dict
    config: TextConfig = struct.field(pytree_node=False)  # the head's decoder config (num_layers: its own layers)
    aux_layers: tuple = struct.field(pytree_node=False)
    target: EG.FeatureHeadTarget = struct.field(pytree_node=False)
    vocab: jax.Array | None = None
    norm_before_residual: bool = struct.field(pytree_node=False, default=False)
    norm_output: bool = struct.field(pytree_node=False, default=False)

    @property
    def num_params(self) -> int:
        return H.num_params(self.params)

    @property
    def draft_vocab_size(self) -> int:
        return int(self.params["lm_head"].shape[0])

    def check(self, target) -> None:
        cfg, _ = text_parts(target)
        sig = signature(target)
        if cfg.hidden_size != self.config.hidden_size:
            raise ValueError(f"this EAGLE-3 head was made for another target ({self.target.describe()}); the target "
                             f"given is {sig.describe()}")
        H.check_made_for("EAGLE-3 head", self.target, sig)
        bad = [i for i in self.aux_layers if not 0 <= i <= cfg.num_layers]
        if bad:
            raise ValueError(f"this EAGLE-3 head reads target layers {list(self.aux_layers)}; the target has "
                             f"{cfg.num_layers} layers (ids 0..{cfg.num_layers})")


def head_config(target_cfg: TextConfig, num_layers: int = 1, **over) -> TextConfig:
    """The head's decoder config: LLaMA layers of the target's shapes and RoPE (head_dim, heads, widths), no
    biases and no sliding window, as the published heads are for LLaMA, Qwen2 and Qwen3 targets alike (a plain
    `TextConfig`: a Qwen3 target's q/k norms, experts and per-layer windows are not the head's), `num_layers` of
    them (and any field of `over`)."""
    plain = TextConfig(**{f.name: getattr(target_cfg, f.name) for f in dataclasses.fields(TextConfig)})
    base = dict(model_type="llama", num_layers=num_layers, qkv_bias=False, o_bias=False, mlp_bias=False,
                sliding_window=None)
    return dataclasses.replace(plain, **{**base, **over})


def init_head(target, key: jax.Array, aux_layers=None, draft_vocab=None, num_layers: int = 1, dtype=None,
              scale: float = 0.02, norm_before_residual: bool = False) -> Eagle3Head:
    """A new head for `target` with random weights (N(0, scale) matrices, unit norms): the start of training, and
    the random heads the parity tests compare. draft_vocab: target ids of the draft vocabulary (None: all)."""
    cfg, lm = text_parts(target)
    hcfg = head_config(cfg, num_layers)
    aux = tuple(int(i) for i in (aux_layers if aux_layers is not None else default_aux_layers(cfg.num_layers)))
    ids = None if draft_vocab is None else np.unique(np.asarray(draft_vocab))
    Vd = cfg.vocab_size if ids is None else ids.size
    D = cfg.hidden_size
    shapes = llama.param_shapes(hcfg)["layers"]
    keys = iter(jax.random.split(key, 64))
    rnd = lambda shape: scale * jax.random.normal(next(keys), shape, jnp.float32)  # noqa: E731
    layers = []
    for i, sh in enumerate(shapes):
        layer = {k: (jnp.ones(s, jnp.float32) if k.endswith("norm") else rnd(s)) for k, s in sh.items()}
        if i == 0:
            layer.update({k: rnd((2 * D,) + tuple(sh[k][1:])) for k in ("wq", "wk", "wv")})
            layer["hidden_norm"] = jnp.ones((D,), jnp.float32)
        layers.append(FU.fuse_layer(hcfg, layer))
    params = {"fc": rnd((len(aux) * D, D)), "layers": layers, "norm": jnp.ones((D,), jnp.float32),
              "lm_head": rnd((Vd, D))}
    dt = dtype or lm["embed"].dtype
    params = jax.tree.map(lambda a: jnp.asarray(a, dt), params)
    return Eagle3Head(params, hcfg, aux, signature(target), None if ids is None else jnp.asarray(ids, jnp.int32),
                      norm_before_residual)


# ---------------------------------------------------------------------------------------------- the forward


def fuse(head: Eagle3Head, h: jax.Array) -> jax.Array:
    """g = fc(the target's states at the head's layers, concatenated [R, T, n * D]) -> [R, T, D]."""
    p, eps = head.params, head.config.rms_norm_eps
    if "fc_norm" in p:
        parts = jnp.split(h, len(head.aux_layers), axis=-1)
        h = jnp.concatenate([LY.rms_norm(x, w, eps) for x, w in zip(parts, p["fc_norm"])], axis=-1)
    elif "input_norm" in p:
        h = LY.rms_norm(h, p["input_norm"], eps)
    return LY.linear(h.astype(p["fc"].dtype), p["fc"])


def head_forward(head: Eagle3Head, emb: jax.Array, g: jax.Array, positions: jax.Array, cache: kvc.KVCache,
                 new_mask=None, write_offset: int = 0, fresh: bool = False):
    """(the hidden state each of T new entries feeds forward [R, T, D], the head's cache with their K/V written at
    slots length + write_offset..): entries of token embeddings `emb` and the states `g` they pair with (fused
    target states, or the head's own from a shallower level) [R, T, D] (`ports.families.llama.forward`'s cache contract)."""
    cfg = head.config
    eps = cfg.rms_norm_eps
    layers = head.params["layers"]
    T = emb.shape[1]
    visible = LY.prefill_visibility(cache, T, new_mask, write_offset, fresh)
    start = cache.length + write_offset
    cos, sin = LY.rope_tables(cfg, positions)
    p = layers[0]
    g = g.astype(emb.dtype)
    hn = LY.rms_norm(g, p["hidden_norm"], eps)
    h = jnp.concatenate([LY.rms_norm(emb, p["attn_norm"], eps), hn], axis=-1)
    ks, vs = [], []
    x = hn if head.norm_before_residual else g
    for i, p in enumerate(layers):
        if i:
            h = LY.rms_norm(x, p["attn_norm"], eps)
        a, kb, vb = LY.self_attention_layer(cfg, p, h, cos, sin, cache.k[i], cache.v[i], start, visible, None,
                                            fresh)[:3]
        ks.append(kb)
        vs.append(vb)
        x = x + a
        x = x + LY.swiglu(LY.rms_norm(x, p["mlp_norm"], eps), p)
    if head.norm_output:
        x = LY.rms_norm(x, head.params["norm"], eps)
    return x, cache.replace(k=ks, v=vs)


def draft_logits(head: Eagle3Head, x: jax.Array) -> jax.Array:
    """Float32 logits over the draft vocabulary [R, K, Vd] of the fed-forward states x [R, K, D]: the head's norm
    (unless `norm_output` applied it already) and its LM head."""
    if not head.norm_output:
        x = LY.rms_norm(x, head.params["norm"], head.config.rms_norm_eps)
    return LY.weight_dot("btd,vd->btv", x, head.params["lm_head"], jnp.float32)


def head_logits(head: Eagle3Head, x: jax.Array, vocab_size: int) -> jax.Array:
    """`draft_logits` over the target's vocabulary [R, K, V]: tokens outside the draft vocabulary get the lowest
    float32."""
    part = draft_logits(head, x)
    if head.vocab is None:
        return part
    logits = jnp.full(part.shape[:-1] + (vocab_size,), jnp.finfo(jnp.float32).min, jnp.float32)
    return logits.at[..., head.vocab].set(part)


def ttt_states(head: Eagle3Head, embeds, g: jax.Array, positions: jax.Array, visible: jax.Array, steps: int,
               dtype=jnp.float32) -> list[jax.Array]:
    """Training-time test unrolled over T positions: per step s < `steps`, the states [B, T, D] the head feeds
    forward. Step 0's entry t pairs embeds(0)[:, t] with g[:, t] at positions[:, t] and sees the step-0 entries
    `visible` [B, T, T] allows; step s's entry t pairs embeds(s)[:, t] with step s - 1's state at t, sits at
    positions + s, and sees the same step-0 entries plus its own entries at t of steps 1..s (the keys a chain
    draft sees when its drafts were those tokens)."""
    B, T = positions.shape
    cfg = head.config
    cache = kvc.init_cache(cfg.num_layers, B, cfg.num_kv_heads, T * steps, cfg.head_dim, dtype)
    eye = jnp.broadcast_to(jnp.eye(T, dtype=bool)[None], (B, T, T))
    out = []
    for s in range(steps):
        mask = jnp.concatenate([visible] + [eye] * s, axis=2)
        g, cache = head_forward(head, embeds(s), g, positions + s, cache, mask, write_offset=T * s)
        out.append(g)
    return out


def ttt_logits(head: Eagle3Head, embed: jax.Array, h: jax.Array, tokens: jax.Array, steps: int) -> list[jax.Array]:
    """Training-time test unrolled (`ttt_states`) on one causal sequence: per step s < `steps`, the logits [B, T, V]
    at each position t of a sequence whose entries 0..t are (tokens[t + 1], fused target state h[t]) and whose s
    further entries pair tokens[t + 2 .. t + 1 + s] with the head's own states (EAGLE-3's training forward, and
    what a chain draft computes when its drafts are those tokens). embed: the token embedding [V, D];
    h [B, T, n * D]; tokens [B, T + steps]."""
    B, T = h.shape[:2]
    ar = jnp.arange(T)
    causal = jnp.broadcast_to((ar[None, :] <= ar[:, None])[None], (B, T, T))
    xs = ttt_states(head, lambda s: jnp.take(embed, tokens[:, 1 + s:1 + s + T], axis=0), fuse(head, h),
                    jnp.broadcast_to(ar + 1, (B, T)), causal, steps, embed.dtype)
    return [head_logits(head, x, head.target.vocab_size) for x in xs]


# ---------------------------------------------------------------------------------------------- the drafter


@struct.dataclass
class Eagle3Drafter(EG.EagleDrafter):
    """Drafts with an `Eagle3Head` (module docstring); state and steps are `EagleDrafter`'s."""

    def text_parts(self, target):
        return text_parts(target)

    what = "EAGLE-3 head"

    def prepare(self, setup: Setup) -> Prepared:
        if setup.guidance is not None or setup.constraint is not None:
            raise ValueError("an EAGLE-3 head drafts for text targets: guidance and constraints do not apply")
        return super().prepare(setup)

    def draft_rows(self, cfg, lm: dict, head) -> None:
        return None  # the head's own LM head scores its draft vocabulary

    def verify_layers(self, num_layers: int) -> tuple[int, ...]:
        return tuple(self.head.aux_layers)

    def features(self, cfg, lm: dict, h: jax.Array) -> jax.Array:
        return fuse(self.head, h)

    def embed(self, lm: dict, tokens: jax.Array) -> jax.Array:
        own = self.head.params.get("embed")
        return llama.embed(lm, tokens) if own is None else jnp.take(own, tokens, axis=0)

    def run_head(self, cfg, emb, feat, positions, cache, new_mask=None, write_offset: int = 0, fresh: bool = False):
        return head_forward(self.head, emb, feat, positions, cache, new_mask, write_offset, fresh)

    def logits(self, cfg, lm: dict, f: jax.Array) -> jax.Array:
        return head_logits(self.head, f, cfg.vocab_size)
