"""EAGLE-1's feature head as a drafter: f_{t+1} = Dec(W [e(x_{t+1}); f_t] + b), logits = the target's LM head(f).

f_t is the target's feature at position t: its last hidden state after the final norm (what its LM head reads).
The head (`EagleHead`) holds only what is new: `fc` [2D, D] (+ bias) and one decoder layer of the target's family
at the target's width; the token embedding e and the LM head are the target's own, frozen and never copied.

Head entries and slots: the head's entry for the token at target slot j pairs that token with the target's
feature at slot j - 1, and sits at slot j - 1 of the head's own KV cache, so the head's committed length is
always the target's minus one. The prompt's features come from the target's own prefill (the drafter asks for
its last hidden states), so the head's cache is filled without a second target pass. Each step:
- `root` feeds the pending entries (the tokens verification committed, each with the target feature verification
  computed at the token before it) and predicts f-hat at the root;
- each tree level pairs a node's token with its parent's f-hat (the root's, or the one its parent's level wrote
  into the head's scratch: a node's parent is the deepest scratch slot its mask row sees), as EAGLE drafts;
- `commit` queues the accepted tokens with the true features verification returned along the accepted path
  (`verify_hidden`: the engine hands them over in `Catchup.hidden`); the drafted entries, fed with f-hat, are
  never kept.

Classifier-free guidance: a guided target (`jspec.core.guidance.Guided`) runs a conditional and an unconditional
stream per row; the head runs the same two streams (rows b * streams + s of its cache, laid out as the target's
streams are), each fed with that stream's target features, and its logits are combined and constrained by the
target's own guidance (same scale, same image grammar) before the sampler's warpers.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ports.core import cache as kvc
from jspec.core import guidance as GD
from jspec.parts.drafters import heads as H
from jspec.parts.protocols import Catchup, DraftEnv, Prepared, Setup, TargetPrefill, run_level
from jspec.parts.drafters.feed import FeedDrafter, FeedState, draft_log_probs, rep
from jspec.parts.drafters.model import check_vocab_size
from ports.families import chameleon as CH
from ports.core import fused as FU
from ports.core import layers as LY
from ports.families import llama

CONFIG_NAME = "eagle_head.json"
WEIGHTS_NAME = "model.safetensors"
FAMILIES = {"llama": "llama", "qwen2": "llama", "mistral": "llama", "chameleon": "chameleon"}


def text_parts(target) -> tuple[Any, dict]:
    """(text config, language-model params) of a target a feature head can serve (LLaMA, Qwen2, Chameleon /
    Lumina-mGPT, LLaVA's language model), through a guided wrapper; ValueError otherwise."""
    return H.text_model(target, tuple(FAMILIES), "an EAGLE feature head needs a LLaMA, Qwen2, Chameleon or LLaVA "
                                                 "target")


def family_of(cfg) -> str:
    return FAMILIES.get(cfg.model_type, "llama")


class FeatureHeadTarget(NamedTuple):
    """What a head was made for: the target's architecture and a fingerprint of its embedding."""

    model_type: str
    hidden_size: int
    vocab_size: int
    fingerprint: float

    def describe(self) -> str:
        return (f"{self.model_type}, hidden {self.hidden_size}, vocab {self.vocab_size}, "
                f"fingerprint {self.fingerprint:.6g}")


def signature(target) -> FeatureHeadTarget:
    return signature_of(*text_parts(target))


def signature_of(cfg, lm: dict) -> FeatureHeadTarget:
    """The signature of a target of text config `cfg` and language-model params `lm` (a drafter serving other
    families than this module's, as EAGLE-3's, reads them with its own `text_parts`)."""
    corner = np.abs(np.asarray(jax.device_get(lm["embed"][:32, :32]), np.float32)).sum()
    return FeatureHeadTarget(cfg.model_type, cfg.hidden_size, cfg.vocab_size, round(float(corner), 4))


@struct.dataclass
class EagleHead:
    """The trained part of an EAGLE-1 drafter: params = {"fc": [2D, D], "fc_b": [D] (optional), "layer": one
    decoder layer of the target's family, run layout}. `input_norm`: the layer normalises its input (LANTERN's
    Chameleon heads do; EAGLE's LLaMA heads drop that norm in their first layer). `vocab`: the draft vocabulary
    (sorted token ids [Vd]; None: the target's whole vocabulary): the drafter's LM head then scores only these
    tokens (EAGLE-3's reduced draft vocabulary), and the others get no draft probability. Speculative sampling
    stays exact, since acceptance only reads q at drafted tokens."""

    params: dict
    family: str = struct.field(pytree_node=False)
    input_norm: bool = struct.field(pytree_node=False)
    target: FeatureHeadTarget = struct.field(pytree_node=False)
    vocab: jax.Array | None = None

    @property
    def num_params(self) -> int:
        return H.num_params(self.params)

    def with_vocab(self, ids) -> "EagleHead":
        """This head drafting over the token ids `ids` only (sorted and deduplicated; None: every token)."""
        if ids is None:
            return self.replace(vocab=None)
        v = np.unique(np.asarray(ids).reshape(-1))
        if v.size == 0 or not np.issubdtype(v.dtype, np.integer) or v[0] < 0 or v[-1] >= self.target.vocab_size:
            raise ValueError(f"a draft vocabulary holds token ids in [0, {self.target.vocab_size}); got {v.size} ids "
                             f"of dtype {v.dtype}" + (f" in [{v[0]}, {v[-1]}]" if v.size else ""))
        return self.replace(vocab=jnp.asarray(v, jnp.int32))

    def check(self, target) -> None:
        cfg, _ = text_parts(target)
        sig = signature(target)
        if family_of(cfg) != self.family or (sig.hidden_size, sig.vocab_size) != self.target[1:3]:
            raise ValueError(f"this EAGLE head was made for another target ({self.target.describe()}); the target "
                             f"given is {sig.describe()}")
        if not H.same_fingerprint(sig.fingerprint, self.target.fingerprint):
            raise ValueError(f"this EAGLE head was made for another target's weights ({self.target.describe()}); the "
                             f"target given is {sig.describe()}")


def head_config(cfg):
    """The target's text config with one layer (the head's decoder layer runs under it)."""
    return dataclasses.replace(cfg, num_layers=1)


def init_head(target, key: jax.Array, input_norm: bool | None = None, dtype=None, noise: float = 0.02,
              branch_scale: float = 1.0) -> EagleHead:
    """A new head for `target`: its decoder layer a copy of the target's last layer; fc = [noise * N(0, 1) on the
    embedding half; identity on the feature half] with a zero bias, so an untrained head starts as the target's
    last layer over the target's own features (a better start for training than EAGLE's random one).
    `branch_scale` multiplies the layer's output projections (attention's and the MLP's): 0 starts the head as
    the identity on the feature, for targets whose last layer writes far larger values than the normalised
    features it is fed here (SmolLM2's)."""
    cfg, lm = text_parts(target)
    fam = family_of(cfg)
    D = cfg.hidden_size
    dt = dtype or lm["embed"].dtype
    fc = jnp.concatenate([noise * jax.random.normal(key, (D, D), jnp.float32), jnp.eye(D, dtype=jnp.float32)], 0)
    layer = dict(lm["layers"][-1])
    layer = FU.fuse_layer(cfg, layer) if "wq" in layer else layer
    if branch_scale != 1.0:
        layer.update({k: layer[k] * branch_scale for k in ("wo", "bo", "w_down", "b_down") if k in layer})
    params = {"fc": fc, "fc_b": jnp.zeros((D,), jnp.float32), "layer": layer}
    params = jax.tree.map(lambda a: jnp.array(a, dtype=dt), params)
    return EagleHead(params, fam, fam == "chameleon" if input_norm is None else bool(input_norm), signature(target))


# ---------------------------------------------------------------------------------------------- the forward


def features(cfg, lm: dict, h: jax.Array) -> jax.Array:
    """The target's features: its last-layer residual stream h after the final norm."""
    return LY.rms_norm(h, lm["final_norm"], cfg.rms_norm_eps)


def lm_logits(cfg, lm: dict, f: jax.Array, rows: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """The target's LM head over features f [R, T, D] (no norm: f is already normalised), float32 logits. rows:
    (token ids [Vd], their LM-head rows [Vd, D], `vocab_rows`): only those tokens are scored, the others get the
    lowest float32."""
    if rows is not None:
        ids, w = rows
        part = LY.weight_dot("btd,vd->btv", f, w, jnp.float32)
        logits = jnp.full(part.shape[:-1] + (cfg.vocab_size,), jnp.finfo(jnp.float32).min, jnp.float32)
        logits = logits.at[..., ids].set(part)
    elif cfg.tie_word_embeddings:
        logits = LY.weight_dot("btd,vd->btv", f, lm["embed"], jnp.float32)
    else:
        logits = LY.weight_dot("btd,dv->btv", f, lm["lm_head"], jnp.float32)
    if getattr(cfg, "suppress_image_logits", False):
        logits = jnp.where(jnp.asarray(CH.image_logit_mask(cfg)), jnp.finfo(jnp.float32).min, logits)
    return logits


def vocab_rows(cfg, lm: dict, ids: jax.Array) -> jax.Array:
    """The LM-head rows [Vd, D] of token ids [Vd] (a copy, made once per decode)."""
    if cfg.tie_word_embeddings:
        return jnp.take(lm["embed"], ids, axis=0)
    return jnp.take(lm["lm_head"], ids, axis=1).T


def head_forward(cfg, head: EagleHead, emb: jax.Array, feat: jax.Array, positions: jax.Array,
                 cache: kvc.KVCache, new_mask=None, write_offset: int = 0, fresh: bool = False):
    """f-hat [R, T, D] of T new entries (token embeddings emb and the features they pair with, [R, T, D]) and the
    head's cache with their K/V written at slots length + write_offset.. (`ports.families.llama.forward`'s contract)."""
    cfg1 = head_config(cfg)
    p = head.params["layer"]
    eps = cfg.rms_norm_eps
    x = LY.linear(jnp.concatenate([emb, feat.astype(emb.dtype)], axis=-1), head.params["fc"],
                 head.params.get("fc_b"))
    T = x.shape[1]
    visible = LY.prefill_visibility(cache, T, new_mask, write_offset, fresh)
    start = cache.length + write_offset
    cos, sin = LY.rope_tables(cfg1, positions)
    if head.family == "chameleon" and cfg.swin_norm:
        a, kb, vb = CH.attention_block(cfg1, p, x, cos, sin, cache.k[0], cache.v[0], start, visible, fresh)
        x = x + LY.rms_norm(a, p["attn_norm"], eps)
        x = x + LY.rms_norm(LY.swiglu(x, p), p["mlp_norm"], eps)
    else:
        h = LY.rms_norm(x, p["attn_norm"], eps) if head.input_norm else x
        if head.family == "chameleon":
            a, kb, vb = CH.attention_block(cfg1, p, h, cos, sin, cache.k[0], cache.v[0], start, visible, fresh)
        else:
            a, kb, vb = LY.self_attention_layer(cfg1, p, h, cos, sin, cache.k[0], cache.v[0], start, visible,
                                               None, fresh)[:3]
        x = x + a
        x = x + LY.swiglu(LY.rms_norm(x, p["mlp_norm"], eps), p)
    return x, cache.replace(k=[kb], v=[vb])


# ---------------------------------------------------------------------------------------------- the drafter


@struct.dataclass
class Drafts:
    """An EAGLE head's `FeedState.own`: the f-hat the step's drafts pair with."""

    root: jax.Array  # [R, D] f-hat after `last`
    scratch: jax.Array  # [R, plan scratch, D] f-hat of each drafted scratch slot


def _streams(target) -> int:
    return target.streams if isinstance(target, GD.Guided) else 1


def _rows(h: jax.Array, n: int) -> jax.Array:
    """Hidden states per row [B, T, D] or per row and stream [B, T, n, D] -> per stream row [B * n, T, D]."""
    if h.ndim == 3:
        return h
    B, T, S, D = h.shape
    return h.swapaxes(1, 2).reshape(B * S, T, D)


@struct.dataclass
class EagleDrafter(FeedDrafter):
    """Drafts with an `EagleHead` over the target's own features (see the module docstring). Its feed pairs each
    pending token with the target feature verification computed before it (`FeedState.side`); its drafted
    entries, fed with f-hat, are never kept (`keeps_fed` False)."""

    head: EagleHead
    layers: int = struct.field(pytree_node=False, default=0)  # the target's depth (set by `prepare`)
    rows: jax.Array | None = None  # the draft vocabulary's LM-head rows [Vd, D] (set by `prepare`)
    verify_hidden = True
    keeps_fed = False

    what = "EAGLE head"  # what errors call the head (subclasses: their own kind)

    def check(self, target) -> None:
        cfg, _ = self.text_parts(target)
        check_vocab_size(target, cfg.vocab_size, self.what)
        self.head.check(target)

    def text_parts(self, target) -> tuple[Any, dict]:
        """(text config, language-model params) of a target this drafter serves (`text_parts`; an EAGLE-3 drafter
        serves more families)."""
        return text_parts(target)

    def map_models(self, fn) -> "EagleDrafter":
        return self  # the head reads the target as it runs (its embedding, LM head, guidance)

    def prepare(self, setup: Setup) -> Prepared:
        if setup.draft_prompt is not None:
            raise ValueError("an EAGLE head drafts over the target's own prompt and features: draft_prompt does not "
                             "apply")
        if setup.inputs:
            raise ValueError(f"an EAGLE head drafts over token prompts only; got inputs {sorted(setup.inputs)}")
        head = self.head
        if setup.mesh is not None:
            head = head.replace(params=jax.device_put(head.params, jax.sharding.NamedSharding(
                setup.mesh, jax.sharding.PartitionSpec())))
        longest, width = int(np.max(setup.lengths)), setup.tokens.shape[1]
        if setup.guidance is not None or setup.constraint is not None:
            g = GD.guide(setup.target, setup.lengths, setup.guidance, setup.constraint)
            longest, width = int(np.max(np.asarray(g.prompt_end))), max(width, g.uncond.shape[1])
        cfg, lm = self.text_parts(setup.target)
        rows = self.draft_rows(cfg, lm, head)
        if rows is not None:
            if setup.mesh is not None:
                rows = jax.device_put(rows, jax.sharding.NamedSharding(setup.mesh, jax.sharding.PartitionSpec()))
        return Prepared(self.replace(head=head, layers=cfg.num_layers, rows=rows), None, longest, width)

    def prefill_asks(self, tokens, lengths, inputs) -> dict:
        return {"hidden_layers": tuple(self.verify_layers(self.layers))}

    def draft_rows(self, cfg, lm: dict, head) -> jax.Array | None:
        """The target LM head's rows of the head's draft vocabulary (None: it drafts over every token)."""
        return None if head.vocab is None else vocab_rows(cfg, lm, head.vocab)

    # the head's own computation; an EAGLE-3 head (`jspec.parts.drafters.eagle3`) overrides these, and the states,
    # buffers and slots below are shared

    def features(self, cfg, lm: dict, h: jax.Array) -> jax.Array:
        """The head's input features [R, T, D] from the target's states at `verify_layers` [R, T, n * D]."""
        return features(cfg, lm, h)

    def embed(self, lm: dict, tokens: jax.Array) -> jax.Array:
        return llama.embed(lm, tokens)

    def head_cache(self, cfg, rows: int, max_len: int, dtype) -> kvc.KVCache:
        """The head's KV cache: its own decoder config's layers where it has one (EAGLE-3's, an MTP head's), else
        one layer of the target's shape."""
        h = getattr(self.head, "config", None)
        if h is not None:
            return kvc.init_cache(h.num_layers, rows, h.num_kv_heads, max_len, h.head_dim, dtype)
        return kvc.init_cache(1, rows, cfg.num_kv_heads, max_len, cfg.head_dim, dtype)

    def run_head(self, cfg, emb, feat, positions, cache, new_mask=None, write_offset: int = 0, fresh: bool = False):
        """(f-hat [R, T, D], cache): `head_forward`'s contract."""
        return head_forward(cfg, self.head, emb, feat, positions, cache, new_mask, write_offset, fresh)

    def logits(self, cfg, lm: dict, f: jax.Array) -> jax.Array:
        """Float32 draft logits over the target's vocabulary [R, K, V] from f-hat [R, K, D]."""
        return lm_logits(cfg, lm, f, None if self.rows is None else (self.head.vocab, self.rows))

    def streams(self, env: DraftEnv) -> int:
        return _streams(env.target)

    def init(self, env: DraftEnv, prefill: TargetPrefill, prompt, max_len: int) -> FeedState:
        target = env.target
        cfg, lm = self.text_parts(target)
        n = _streams(target)
        if isinstance(target, GD.Guided):
            toks, end, starts = target.inner_prompt(prefill.tokens, prefill.lengths), target.prompt_end, target.starts
        else:
            toks, end, starts = prefill.tokens, prefill.lengths, prefill.cache.start
        R, W = toks.shape
        f = self.features(cfg, lm, jnp.concatenate([prefill.hidden_at(i) for i in self.verify_layers(cfg.num_layers)],
                                                   axis=-1))  # [R, W, D]
        dt = lm["embed"].dtype
        cache = self.head_cache(cfg, R, max_len, dt).replace(start=starts)
        if W > 1:  # entry of target slot j (token j, feature j - 1) at head slot j - 1
            pos = jnp.maximum(jnp.arange(1, W)[None] - starts[:, None], 0)
            _, cache = self.run_head(cfg, self.embed(lm, toks[:, 1:]), f[:, :-1], pos, cache, fresh=True)
        cache = cache.replace(length=jnp.maximum(rep(end, n) - 1, 0))
        D = cfg.hidden_size
        last_in = jnp.take_along_axis(f, (rep(end, n) - 1)[:, None, None], axis=1)[:, 0]
        drafts = Drafts(jnp.zeros((R, D), f.dtype), jnp.zeros((R, max(env.needs.scratch, 1), D), f.dtype))
        return self.fresh(env, cache, side=last_in, own=drafts)

    def _logp(self, env: DraftEnv, f: jax.Array, depth: jax.Array) -> jax.Array:
        """Draft log-probs [B, K, V] from f-hat [R, K, D] of nodes at `depth` [B, K] below the root: the target's
        LM head, its guidance and constraint, then the sampler's processing."""
        cfg, lm = self.text_parts(env.target)
        logits = self.logits(cfg, lm, f)
        if isinstance(env.target, GD.Guided):
            g = env.tcache.length[:, None] + depth + 1 - env.target.prompt_end[:, None]
            logits = env.target._process(logits, g)
        return draft_log_probs(logits, env)

    def read(self, env: DraftEnv, ds: FeedState, width: int):
        cfg, lm = self.text_parts(env.target)
        n = _streams(env.target)
        c = ds.cache
        pos = (c.length + 1 - c.start)[:, None] + jnp.arange(width)[None]
        x, c = self.run_head(cfg, self.embed(lm, rep(ds.pending[:, :width], n)), ds.side[:, :width], pos, c)
        return jnp.take_along_axis(x, rep(ds.n_pending - 1, n)[:, None, None], axis=1)[:, 0], c

    def root(self, env: DraftEnv, ds: FeedState):
        root, ds = self.read_feed(env, ds)
        logp = self._logp(env, root[:, None], jnp.zeros((ds.pending.shape[0], 1), jnp.int32))
        return logp, None, ds.replace(own=ds.own.replace(root=root.astype(ds.own.root.dtype)))

    def level(self, env: DraftEnv, ds: FeedState, tokens, depth, mask, offset: int, run):
        cfg, lm = self.text_parts(env.target)
        n = _streams(env.target)
        mask = mask.astype(bool)
        slot = jnp.arange(mask.shape[-1])[None, None]
        parent = jnp.max(jnp.where(mask & (slot < offset), slot, -1), axis=-1,
                         initial=-1)  # [B, K] the deepest earlier scratch slot a node sees: its parent's
        parent = rep(parent, n)

        def go(ds):
            own = ds.own
            from_scratch = jnp.take_along_axis(own.scratch, jnp.maximum(parent, 0)[..., None], axis=1)
            pf = jnp.where(parent[..., None] >= 0, from_scratch, own.root[:, None])
            c = ds.cache
            pos = (c.length - c.start)[:, None] + rep(depth, n)
            x, c = self.run_head(cfg, self.embed(lm, rep(tokens, n)), pf, pos, c, rep(mask, n), offset)
            scratch = jax.lax.dynamic_update_slice_in_dim(own.scratch, x.astype(own.scratch.dtype), offset, axis=1)
            return x, ds.replace(cache=c, own=own.replace(scratch=scratch))

        x, ds = run_level(run, go, ds)
        return self._logp(env, x, depth), None, ds

    def side_of(self, env: DraftEnv, ds: FeedState, c: Catchup) -> jax.Array:
        """The true features verification computed along the accepted path: the one each committed token pairs
        with."""
        if c.hidden is None:
            raise ValueError("the EAGLE drafter needs the target's hidden states from verification (Catchup.hidden)")
        cfg, lm = self.text_parts(env.target)
        return self.features(cfg, lm, _rows(c.hidden, _streams(env.target)))
