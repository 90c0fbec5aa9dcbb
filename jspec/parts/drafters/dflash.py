"""A block drafter (DFlash, Chen et al., 2026): a whole draft in one forward of a few layers over the target's states.

The head (`DFlashHead`) holds a few decoder layers (Qwen3's, as the authors': LLaMA layers with an RMSNorm of each
head's queries and keys before RoPE, and no biases), a projection `fc` and two norms; the token embedding and the
LM head are the target's own, frozen and never copied. Its context is the target's residual
streams at a few layers (`target_layers`; id i is the stream after the target's first i layers, as
`TargetPrefill.hidden_at` counts), concatenated and projected: c_j = norm_h(fc([h_a; h_b; ...]_j)) for every
committed token j. Each layer's keys and values of the context are its own projections of c_j (no attention runs
over the context: "KV injection"), written into the head's cache at the target prefill and, after each verify, for
the committed tokens only.

A step drafts a block: the query is the newest committed token (the anchor, at position L = the committed length)
followed by `block - 1` mask entries at positions L + 1 .. (each the target's embedding of the head's mask token
id, as the authors feed them), attending to every context entry and to each other in both directions (within the
head's sliding window, when it has one). The output at block position i (i >= 1), through the head's final norm and
the target's LM head (over the head's draft vocabulary, when it has one), is the distribution of the token at
position L + i given the committed text alone: one forward gives every draft position's distribution, none of them
conditioned on the drafts before it. So a tree over the block is a choice of tokens per position
(`jspec.parts.plans.BlockTreePlan`), and a chain draws each position from its own distribution, which is the one
the residual rule then reads (sampling stays exact).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec.core import sharding as SH
from jspec.parts.drafters import eagle as EG
from jspec.parts.drafters import heads as H
from jspec.parts.drafters.feed import draft_log_probs
from jspec.parts.drafters.model import check_vocab_size
from jspec.parts.protocols import Catchup, DraftEnv, Drafter, Prepared, Setup, TargetPrefill
from ports.core import cache as kvc
from ports.core import layers as LY
from ports.families import llama
from ports.core.config import TextConfig

FAMILIES = ("llama", "qwen2", "mistral", "qwen3", "qwen3_moe", "qwen3_5_text", "qwen3_5_moe_text")


def text_parts(target):
    """(text config, language-model params) of a target a block drafter serves: LLaMA, Qwen2, Mistral, Qwen3 and
    Qwen3-MoE, and the language models of LLaVA, Qwen2-VL / Qwen2.5-VL and Muse Glimmer (whose block inputs are
    its table's rows without the embedding norm, as transformers' DFlash candidate generator takes them);
    ValueError otherwise."""
    model = getattr(target, "model", target)
    cfg = getattr(model, "config", None)
    if getattr(cfg, "model_type", None) in ("qwen2_vl", "qwen2_5_vl", "muse_glimmer"):
        return cfg.text, model.params["lm"]
    return H.text_model(target, FAMILIES, "a block drafter needs a LLaMA, Qwen2, Mistral, Qwen3, LLaVA, Qwen2-VL "
                                          "or Muse Glimmer target")


def default_target_layers(num_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """DFlash's context layers for a target of `num_layers`: one per draft layer, evenly spaced from the stream
    after layer 2 to the one after layer L - 2 (the middle one for a single draft layer), as the authors pick
    them; ValueError when they do not give distinct layers."""
    n = num_draft_layers
    if n == 1:
        ids = (num_layers // 2 + 1,)
    else:
        lo, hi = 2, num_layers - 2
        ids = tuple(int(round(lo + i * (hi - lo) / (n - 1))) for i in range(n))
    if len(set(ids)) != len(ids) or min(ids) < 1 or max(ids) > num_layers:
        raise ValueError(f"DFlash's default context layers {ids} are not {n} distinct layers of a {num_layers}-layer "
                         "target: pass target_layers")
    return ids


@struct.dataclass
class DFlashHead:
    """A block drafter's trained part. params (plain layout, no fused projections):
    - "fc": [n * D, D] over the n context layers' states, no bias; "hidden_norm": [D];
    - "layers": decoder layers of `config` (wq, wk, wv, wo, w_gate, w_up, w_down, attn_norm, mlp_norm; "q_norm" and
      "k_norm" [Dh] where the layers norm each head's queries and keys, as Qwen3's do; biases where `config` has
      them);
    - "norm": [D] (before the target's LM head).
    config.sliding_window: a block position at p sees the entries at q with |p - q| < window (None: all).
    vocab: the draft vocabulary (sorted target ids [Vd]; None: every token): the LM head then scores only these
    rows of the target's. block: the block the head was trained on (the anchor and block - 1 mask positions).
    mask_token: the target token id whose embedding is every mask position's input (the authors' mask token)."""

    params: dict
    config: TextConfig = struct.field(pytree_node=False)  # the head's decoder config (num_layers: its own)
    target_layers: tuple = struct.field(pytree_node=False)
    target: EG.FeatureHeadTarget = struct.field(pytree_node=False)
    block: int = struct.field(pytree_node=False, default=16)
    vocab: jax.Array | None = None
    mask_token: int | None = struct.field(pytree_node=False, default=None)

    @property
    def num_params(self) -> int:
        return H.num_params(self.params)

    @property
    def draft_vocab_size(self) -> int:
        return self.target.vocab_size if self.vocab is None else int(self.vocab.shape[0])

    def check(self, target) -> None:
        cfg, lm = text_parts(target)
        H.check_made_for("block drafter", self.target, signature(target))
        bad = [i for i in self.target_layers if not 1 <= i <= cfg.num_layers]
        if bad:
            raise ValueError(f"this block drafter reads target layers {list(self.target_layers)}; the target has "
                             f"{cfg.num_layers} layers (ids 1..{cfg.num_layers})")
        check_mask_token(self.mask_token, lm["embed"].shape[0])
        if self.config.hidden_size != cfg.hidden_size:
            raise ValueError(f"this block drafter is {self.config.hidden_size} wide; the target's states are "
                             f"{cfg.hidden_size} wide")


def check_mask_token(mask_token, rows: int) -> None:
    """ValueError unless `mask_token` is a row of a target embedding of `rows` rows."""
    if isinstance(mask_token, bool) or not isinstance(mask_token, (int, np.integer)) or not 0 <= mask_token < rows:
        raise ValueError(f"a block drafter's mask token must be a row of the target's embedding (0 .. {rows - 1}), "
                         f"got {mask_token!r}")


def signature(target) -> EG.FeatureHeadTarget:
    """What a head records of its target: architecture and a fingerprint of its token embedding."""
    cfg, lm = text_parts(target)
    corner = np.abs(np.asarray(jax.device_get(lm["embed"][:32, :32]), np.float32)).sum()
    return EG.FeatureHeadTarget(cfg.model_type, cfg.hidden_size, cfg.vocab_size, round(float(corner), 4))


def head_config(target_cfg: TextConfig, num_layers: int) -> TextConfig:
    """The head's decoder config: the target's widths and RoPE with `num_layers` layers, no biases (the authors'
    Qwen3 layers) and no sliding window (a block sees its whole context)."""
    base = TextConfig(**{f.name: getattr(target_cfg, f.name) for f in dataclasses.fields(TextConfig)})
    return dataclasses.replace(base, model_type="qwen3", num_layers=num_layers, sliding_window=None,
                               qkv_bias=False, o_bias=False, mlp_bias=False)


def init_head(target, key: jax.Array, num_layers: int = 1, block: int = 16, target_layers=None, draft_vocab=None,
              dtype=None, scale: float = 0.02, mask_token: int | None = None) -> DFlashHead:
    """A new head for `target` with random weights (N(0, scale) matrices, unit norms, q / k norms included): the
    start of training and the random heads the tests decode with. draft_vocab: target ids of the draft vocabulary
    (None: all). mask_token: the id whose target embedding feeds the mask positions (default the embedding's last
    row: a spare row where the target pads its vocabulary, as Qwen3's does)."""
    if not 2 <= int(block) <= 64:
        raise ValueError(f"block must be in [2, 64] (the anchor and at least one draft position), got {block}")
    cfg, lm = text_parts(target)
    mask_token = int(lm["embed"].shape[0] - 1) if mask_token is None else mask_token
    check_mask_token(mask_token, lm["embed"].shape[0])
    hcfg = head_config(cfg, int(num_layers))
    ids = tuple(int(i) for i in (target_layers if target_layers is not None
                                 else default_target_layers(cfg.num_layers, int(num_layers))))
    D = cfg.hidden_size
    keys = iter(jax.random.split(key, 16 * (num_layers + 1)))
    rnd = lambda shape: scale * jax.random.normal(next(keys), shape, jnp.float32)  # noqa: E731
    layers = []
    for sh in llama.param_shapes(hcfg)["layers"]:
        sh = dict(sh, q_norm=(hcfg.head_dim,), k_norm=(hcfg.head_dim,))
        layers.append({k: (jnp.ones(s, jnp.float32) if k.endswith("norm") else rnd(s)) for k, s in sh.items()})
    params = {"fc": rnd((len(ids) * D, D)), "hidden_norm": jnp.ones((D,), jnp.float32), "layers": layers,
              "norm": jnp.ones((D,), jnp.float32)}
    params = jax.tree.map(lambda a: jnp.asarray(a, dtype or lm["embed"].dtype), params)
    vocab = None if draft_vocab is None else jnp.asarray(np.unique(np.asarray(draft_vocab)), jnp.int32)
    return DFlashHead(params, hcfg, ids, signature(target), int(block), vocab, int(mask_token))


# ---------------------------------------------------------------------------------------------- the forward


def context(head: DFlashHead, h: jax.Array) -> jax.Array:
    """c = norm_h(fc(h)) [R, T, D] of the target's states at the head's layers, concatenated [R, T, n * D]."""
    p = head.params
    return LY.rms_norm(LY.linear(h.astype(p["fc"].dtype), p["fc"]), p["hidden_norm"], head.config.rms_norm_eps)


def context_kv(head: DFlashHead, c: jax.Array, positions: jax.Array) -> tuple[list, list]:
    """Each layer's keys and values of context entries c [R, T, D] at `positions` [R, T]: ([R, T, KVH, Dh], ...)
    per layer, keys rotated."""
    cfg = head.config
    R, T, _ = c.shape
    cos, sin = LY.rope_tables(cfg, positions)
    ks, vs = [], []
    for p in head.params["layers"]:
        k = LY.linear(c, p["wk"], p.get("bk")).reshape(R, T, cfg.num_kv_heads, cfg.head_dim)
        v = LY.linear(c, p["wv"], p.get("bv")).reshape(R, T, cfg.num_kv_heads, cfg.head_dim)
        if "k_norm" in p:  # as the layer's own keys: each head's features RMS-normed before RoPE (Qwen3's k_norm)
            k = LY.rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
        ks.append(LY.apply_rope(k, cos, sin))
        vs.append(v)
    return ks, vs


def query_embeds(head: DFlashHead, lm: dict, anchor: jax.Array, width: int) -> jax.Array:
    """The block's inputs [R, width, D]: the target's embeddings of the anchor token, then of the mask token."""
    ids = jnp.concatenate([anchor[:, None], jnp.full((anchor.shape[0], width - 1), head.mask_token, anchor.dtype)],
                          axis=1)
    return llama.embed(lm, ids)


def block_states(head: DFlashHead, x: jax.Array, positions: jax.Array, layer_kv) -> jax.Array:
    """The head's final-normed states [R, Q, D] of query entries x [R, Q, D] at `positions` [R, Q]: each layer is
    the ports' decoder layer (`ports.core.layers.decoder_layer`: q / k norms, RoPE, attention, MLP). layer_kv(i) ->
    (k_buf, v_buf, start, visible): layer i's context keys / values (flat cache rows), the slots start [R].. where
    the queries' own go, and what each query sees (a `Deferred` visibility writes nothing)."""
    cfg = head.config
    cos, sin = LY.rope_tables(cfg, positions)
    for i, p in enumerate(head.params["layers"]):
        x = LY.decoder_layer(cfg, p, x, cos, sin, *layer_kv(i))[0]
    return LY.rms_norm(x, head.params["norm"], cfg.rms_norm_eps)


def block_visibility(head: DFlashHead, cache: kvc.KVCache, width: int) -> LY.Deferred:
    """What each of a block's `width` query positions (after the committed length) sees: every committed context
    entry, and the whole block in both directions; with the head's sliding window w, only those less than w
    positions away."""
    old = kvc.committed_visibility(cache, width)
    new = jnp.ones((cache.batch, width, width), bool)
    w = head.config.sliding_window
    if w is not None:
        i = jnp.arange(width)
        slot = jnp.arange(cache.max_len)[None, None, :]
        old = old & (cache.length[:, None, None] + i[None, :, None] - slot < w)
        new = new & (jnp.abs(i[:, None] - i[None, :]) < w)[None]
    return LY.Deferred(old, new)


def block_forward(head: DFlashHead, lm: dict, anchor: jax.Array, cache: kvc.KVCache, width: int) -> jax.Array:
    """The final-normed states [R, width, D] of one block per row: the anchor `anchor` [R] at position
    length - start of the head's cache and `width - 1` mask entries after it, each seeing every committed context
    entry and the whole block; nothing is written to the cache."""
    pos = (cache.length - cache.start)[:, None] + jnp.arange(width)[None]
    vis = block_visibility(head, cache, width)
    return block_states(head, query_embeds(head, lm, anchor, width), pos,
                        lambda i: (cache.k[i], cache.v[i], cache.length, vis))


def write_context(head: DFlashHead, cache: kvc.KVCache, h: jax.Array) -> kvc.KVCache:
    """The cache with the context entries of the target states h [R, T, n * D] written at slots length.. (their
    positions slot - start; length not advanced)."""
    T = h.shape[1]
    pos = (cache.length - cache.start)[:, None] + jnp.arange(T)[None]
    ks, vs = context_kv(head, context(head, h).astype(cache.k[0].dtype), pos)
    k, v = kvc.write_new_rows(cache.k, cache.v, [LY.kv_rows(x) for x in ks], [LY.kv_rows(x) for x in vs],
                              cache.length)
    return cache.replace(k=k, v=v)


def block_logits(head: DFlashHead, cfg, lm: dict, f: jax.Array, rows=None) -> jax.Array:
    """Float32 logits over the target's vocabulary [R, Q, V] of final-normed states f: the target's LM head (only
    the draft vocabulary's `rows` = (ids, their LM-head rows) when given; the other tokens get the lowest
    float32)."""
    return EG.lm_logits(cfg, lm, f, rows)


# ---------------------------------------------------------------------------------------------- the drafter


@struct.dataclass
class DFlashState:
    cache: kvc.KVCache  # the head's context entries: slots start .. length - 1 hold the committed tokens'
    logp: jax.Array  # [B, G, V] this step's per-position draft log-distributions (position 1 .. G after `last`)


@struct.dataclass
class DFlashDrafter(Drafter):
    """Drafts a block per step with a `DFlashHead` (module docstring). `block`: query positions per step (the
    anchor and block - 1 drafts; default the head's). `rows`: the draft vocabulary's LM-head rows (set by
    `prepare`)."""

    head: DFlashHead
    block: int = struct.field(pytree_node=False, default=0)
    rows: jax.Array | None = None
    verify_hidden = True

    @property
    def block_size(self) -> int:
        return int(self.block or self.head.block)

    def check(self, target) -> None:
        cfg, _ = text_parts(target)
        check_vocab_size(target, cfg.vocab_size, "block drafter")
        self.head.check(target)
        if not 2 <= self.block_size <= 64:
            raise ValueError(f"a block drafter's block must be in [2, 64], got {self.block_size}")

    def verify_layers(self, num_layers: int) -> tuple[int, ...]:
        return tuple(self.head.target_layers)

    def prefill_asks(self, tokens, lengths, inputs) -> dict:
        return {"hidden_layers": tuple(self.head.target_layers)}

    def prepare(self, setup: Setup) -> Prepared:
        if setup.draft_prompt is not None:
            raise ValueError("a block drafter drafts over the target's own prompt and states: draft_prompt does not "
                             "apply")
        if setup.guidance is not None or setup.constraint is not None:
            raise ValueError("a block drafter drafts for text output: guidance and constraints do not apply")
        head = self.head
        rows = None
        if head.vocab is not None:
            cfg, lm = text_parts(setup.target)
            rows = EG.vocab_rows(cfg, lm, head.vocab)
        if setup.mesh is not None:
            put = lambda x: jax.device_put(x, jax.sharding.NamedSharding(  # noqa: E731
                setup.mesh, jax.sharding.PartitionSpec()))
            head = head.replace(params=put(head.params))
            rows = None if rows is None else put(rows)
        return Prepared(self.replace(head=head, rows=rows), None, int(np.max(setup.lengths)), setup.tokens.shape[1])

    def _rows(self):
        return None if self.rows is None else (self.head.vocab, self.rows)

    def init(self, env: DraftEnv, prefill: TargetPrefill, prompt, max_len: int) -> DFlashState:
        cfg, lm = text_parts(env.target)
        h = jnp.concatenate([prefill.hidden_at(i) for i in self.head.target_layers], axis=-1)
        R = h.shape[0]
        hc = self.head.config
        cache = kvc.init_cache(hc.num_layers, R, hc.num_kv_heads, max_len, hc.head_dim, lm["embed"].dtype)
        cache = write_context(self.head, cache.replace(start=prefill.cache.start), h)
        cache = SH.constrain(env.ctx.placement, cache.replace(length=prefill.lengths.astype(jnp.int32)),
                             replicated=True)
        G = self.block_size - 1
        return DFlashState(cache, jnp.zeros((R, G, cfg.vocab_size), jnp.float32))

    def block_logp(self, env: DraftEnv, ds: DFlashState) -> tuple[jax.Array, DFlashState]:
        """(log-distributions [B, G, V] of the G = block - 1 positions after `env.last`, each given the committed
        text alone; the state holding them for `level`)."""
        cfg, lm = text_parts(env.target)
        f = block_forward(self.head, lm, env.last, ds.cache, self.block_size)[:, 1:]
        logp = draft_log_probs(block_logits(self.head, cfg, lm, f, self._rows()), env)
        return logp, ds.replace(logp=logp)

    def root(self, env: DraftEnv, ds: DFlashState):
        logp, ds = self.block_logp(env, ds)
        return logp[:, :1], None, ds

    def level(self, env: DraftEnv, ds: DFlashState, tokens, depth, mask, offset, run):
        """A node at depth d draws its children from block position d + 1's distribution, whatever its path."""
        G = ds.logp.shape[1]
        at = jnp.clip(depth, 0, G - 1)  # a depth past the block drafts nothing a plan keeps (plans stop at G)
        return jnp.take_along_axis(ds.logp, at[..., None], axis=1), None, ds

    def catch_up(self, env: DraftEnv, ds: DFlashState) -> DFlashState:
        return ds  # the context is written at commit: a step without drafts reads nothing more

    def commit(self, env: DraftEnv, ds: DFlashState, c: Catchup) -> DFlashState:
        if c.hidden is None:
            raise ValueError("the block drafter needs the target's hidden states from verification (Catchup.hidden)")
        if c.hidden.ndim != 3:
            raise ValueError("a block drafter serves unguided targets (one stream per row)")
        cache = write_context(self.head, ds.cache, c.hidden)
        n = jnp.where(c.active, c.accepted + 1, 0).astype(jnp.int32)
        return ds.replace(cache=cache.replace(length=cache.length + n))
