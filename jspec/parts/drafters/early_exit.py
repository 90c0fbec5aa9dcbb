"""EESD's early-exit drafter: the target's own first N layers (shared, frozen, never copied) + a small head.

The head (`EarlyExitHead`) holds only what is new: k decoder layers of the target's family (initialised from the
target's last k layers; k = 0 is the paper's head-only ablation), a final RMSNorm (from the target's) and an
untied LM head [D, V] (from the target's), or none: a head that shares the target's LM head (frozen, never
copied) is a tenth of the size on a small-hidden, large-vocabulary target. Drafting a token runs the target's
layers 1..N on it, reading the target's KV cache for every committed token (so the shared layers are never
recomputed for them), then the head's layers over their own KV cache, the norm and the head.

Where the K/V of layers 1..N go while drafting: the target's cache is read only here (verification writes those
slots itself), so the drafter keeps a small scratch per shared layer, `pending_width + plan scratch` slots, and
its attention at those layers reads two sources under one softmax: the target cache's committed slots and the
scratch (`two_source_attention`). No cache is copied. The head's layers have an ordinary cache whose committed
prefix follows the accepted tokens exactly as a separate draft model's does (`jspec.parts.drafters.feed`).

The prompt's hidden states at layer N come from the target's own prefill (the drafter asks for them), so the
head's cache is filled without running layers 1..N again.
"""
from __future__ import annotations

import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ports.core import cache as kvc
from jspec.parts.drafters import heads as H
from jspec.parts.protocols import DraftEnv, Prepared, Setup, TargetPrefill, run_level
from jspec.parts.drafters.feed import FeedDrafter, FeedState, draft_log_probs
from jspec.parts.drafters.model import check_vocab_size
from ports.core import fused as FU
from ports.core import layers as LY
from ports.families import llama

CONFIG_NAME = "eesd_head.json"
WEIGHTS_NAME = "model.safetensors"
FORMAT = "jspec-eesd-head"


class ExitHeadTarget(NamedTuple):
    """What a head was made for: the target's architecture and a fingerprint of its weights."""

    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    fingerprint: float  # `fingerprint(target)` at the head's creation

    def describe(self) -> str:
        return (f"{self.model_type}, {self.num_layers} layers, hidden {self.hidden_size}, vocab {self.vocab_size}, "
                f"fingerprint {self.fingerprint:.6g}")


def text_model(target) -> tuple[Any, dict]:
    """(text config, language-model params) of a LLaMA-family target (LLaMA, Qwen2, LLaVA's LM), or ValueError."""
    return H.text_model(target, ("llama", "qwen2", "mistral"), "an early-exit head needs a LLaMA-family language "
                                                               "model (llama, qwen2, mistral, llava*)")


def fingerprint(target) -> float:
    """A number that tells one target's weights from another's: sums over a corner of its embedding and of its
    first layer's first matrix (stable across float32 / bfloat16 storage to ~1e-2)."""
    _, lm = text_model(target)
    first = lm["layers"][0]
    w = first["wqkv"] if "wqkv" in first else first["wq"]
    corner = lambda a: float(np.abs(np.asarray(jax.device_get(a.reshape(a.shape[0], -1)[:16, :16]),  # noqa: E731
                                               np.float32)).sum())
    return round(corner(lm["embed"]) + corner(w), 4)


def check_exit_layer(target, exit_layer: int):
    """(text config, LM params) of `target`, or ValueError when no head can exit after `exit_layer` layers."""
    cfg, lm = text_model(target)
    if not isinstance(lm["layers"], list):
        raise ValueError("an early-exit head runs the target's first layers one by one: pass the target with its "
                         "layers unscanned (ports.core.scanned.unscan_layers)")
    if not 1 <= exit_layer < cfg.num_layers:
        raise ValueError(f"exit layer N={exit_layer} is out of range: the target has {cfg.num_layers} layers "
                         f"(1 <= N < {cfg.num_layers})")
    return cfg, lm


def signature(target) -> ExitHeadTarget:
    cfg, _ = text_model(target)
    return ExitHeadTarget(target.config.model_type, cfg.num_layers, cfg.hidden_size, cfg.vocab_size, fingerprint(target))


@struct.dataclass
class EarlyExitHead:
    """The trained part of an early-exit drafter: `params` = {"layers": [k decoder layers, run layout], "norm": [D],
    "lm_head": [D, V]} (no "lm_head": the head uses the target's, `shares_lm_head`); it exits the target after
    layer `exit_layer` (N, 1-based count of shared layers)."""

    params: dict
    exit_layer: int = struct.field(pytree_node=False)
    target: ExitHeadTarget = struct.field(pytree_node=False)
    calibration: Any = None  # a Cali-TS predictor trained for this head (`jspec.parts.controllers.calibration`), or None

    @property
    def num_layers(self) -> int:
        return len(self.params["layers"])

    @property
    def shares_lm_head(self) -> bool:
        return "lm_head" not in self.params

    @property
    def num_params(self) -> int:
        return H.num_params(self.params)

    @property
    def nbytes(self) -> int:
        return int(sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(self.params)))

    def check(self, target) -> None:
        check_exit_layer(target, self.exit_layer)
        sig = signature(target)
        same = (sig.model_type, sig.num_layers, sig.hidden_size, sig.vocab_size) == self.target[:4]
        if not same or not H.same_fingerprint(sig.fingerprint, self.target.fingerprint):
            raise ValueError(f"this early-exit head was made for another target ({self.target.describe()}); the "
                             f"target given is {sig.describe()}")


def init_head(target, exit_layer: int, num_layers: int = 1, dtype=None, share_lm_head: bool = False) -> EarlyExitHead:
    """A new head for `target` exiting after layer `exit_layer`: `num_layers` decoder layers copied from the
    target's last ones (0: head only), the final norm and the LM head copied (untied), all owned by the head;
    `share_lm_head`: no LM head of its own (drafting and training use the target's, frozen)."""
    cfg, lm = check_exit_layer(target, exit_layer)
    if not 0 <= num_layers <= cfg.num_layers:
        raise ValueError(f"num_layers must be in [0, {cfg.num_layers}], got {num_layers}")
    head = lm["embed"].T if cfg.tie_word_embeddings else lm["lm_head"]
    layers = [FU.fuse_layer(cfg, p) if "wqkv" not in p else p for p in lm["layers"][cfg.num_layers - num_layers:]]
    params = {"layers": layers, "norm": lm["final_norm"], **({} if share_lm_head else {"lm_head": head})}
    params = jax.tree.map(lambda a: jnp.array(a, dtype=dtype or a.dtype), params)  # copies: the head owns them
    return EarlyExitHead(params, exit_layer, signature(target))


# ---------------------------------------------------------------------------------------------- the forward


def two_source_attention(q, k_a, v_a, vis_a, k_b, v_b, vis_b):
    """Attention of q [B, T, H, Dh] over two caches at once (one softmax over both): k_a, v_a [B * KVH, S_a, Dh]
    with vis_a [B, T, S_a], and k_b, v_b [B * KVH, S_b, Dh] with vis_b [B, T, S_b]. Equals `layers.attention`
    over the concatenated cache without building it."""
    B, T, H, Dh = q.shape
    N = k_a.shape[0]
    kvh = N // B
    G = H // kvh
    qg = q.reshape(B, T, kvh, G, Dh).transpose(0, 2, 3, 1, 4).reshape(N, G * T, Dh)
    low = jnp.finfo(jnp.float32).min

    def scores(k, vis):
        s = LY.einsum_f32("nqd,nsd->nqs", qg, k).reshape(B, kvh, G, T, k.shape[1]) * (Dh ** -0.5)
        return jnp.where(vis[:, None, None], s, low)

    sa, sb = scores(k_a, vis_a), scores(k_b, vis_b)
    m = jnp.maximum(sa.max(-1, keepdims=True), sb.max(-1, keepdims=True))
    ea, eb = jnp.exp(sa - m), jnp.exp(sb - m)
    z = ea.sum(-1, keepdims=True) + eb.sum(-1, keepdims=True)

    def mix(e, v):
        p = (e / z).astype(v.dtype).reshape(N, G * T, v.shape[1])
        return LY.einsum_f32("nqs,nsd->nqd", p, v)

    out = (mix(ea, v_a) + mix(eb, v_b)).reshape(B, kvh, G, T, Dh)
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, H, Dh).astype(q.dtype)


def shared_layers(cfg, lm: dict, n: int, x, positions, tcache: kvc.KVCache, base, scratch_k, scratch_v,
                  at: int, scratch_vis):
    """The target's layers 1..n on new tokens x [B, T, D]: each attends to the target cache's committed slots
    [start, base[b]) and to the scratch slots `scratch_vis` [B, T, S_b] allows; the new K/V are written into the
    scratch (lists of n [B * KVH, S_b, Dh]) at slot `at`. Returns (H^n [B, T, D], scratch_k, scratch_v)."""
    B, T, _ = x.shape
    cos, sin = LY.rope_tables(cfg, positions)
    j = jnp.arange(tcache.max_len)[None, None, :]
    vis_a = jnp.broadcast_to((j >= tcache.start[:, None, None]) & (j < base[:, None, None]), (B, T, tcache.max_len))
    ks, vs = [], []
    for i in range(n):
        p = lm["layers"][i]
        h = LY.rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
        q, k, v = LY.project_qkv(cfg, p, h)
        q, k = LY.apply_rope(q, cos, sin), LY.apply_rope(k, cos, sin)
        kb, vb = kvc.write_layer(scratch_k[i], scratch_v[i], k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
                                 jnp.full((B,), at, jnp.int32))
        o = two_source_attention(q, tcache.k[i], tcache.v[i], vis_a, kb, vb, scratch_vis)
        x = x + LY.linear(o.reshape(B, T, -1), p["wo"], p.get("bo"))
        x = x + LY.swiglu(LY.rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps), p)
        ks.append(kb)
        vs.append(vb)
    return x, ks, vs


def head_states(cfg, params: dict, h, positions, cache: kvc.KVCache | None, new_mask=None, write_offset: int = 0,
                fresh: bool = False, logits_at=None):
    """The head's layers over their own cache and its norm: (the draft's last hidden states after the norm
    [B, T or K, D], the new cache). A head without layers (the head-only ablation) has no cache (None)."""
    if params["layers"]:
        fo = llama.forward(cfg, {"layers": params["layers"]}, None, positions, cache, new_mask, embeds=h,
                           hidden_layers=(len(params["layers"]),), compute_logits=False, write_offset=write_offset,
                           fresh=fresh)
        h, cache = fo.hidden[0], fo.cache
    if logits_at is not None:
        h = jnp.take_along_axis(h, logits_at[..., None].astype(jnp.int32), axis=1)
    return LY.rms_norm(h, params["norm"], cfg.rms_norm_eps), cache


def head_logits(params: dict, states, lm: dict | None = None) -> jax.Array:
    """The head's LM head over `head_states`' output: logits [B, T, V] f32. A head that shares the target's LM head
    uses `lm`'s (the target's LM params: its untied head, else its embedding table)."""
    if "lm_head" in params:
        return LY.einsum_f32("btd,dv->btv", states, params["lm_head"])
    if lm is None:
        raise ValueError("this early-exit head shares the target's LM head: pass the target's LM params (lm=)")
    if "lm_head" in lm:
        return LY.weight_dot("btd,dv->btv", states, lm["lm_head"], jnp.float32)
    return LY.weight_dot("btd,vd->btv", states, lm["embed"], jnp.float32)


def head_forward(cfg, params: dict, h, positions, cache: kvc.KVCache | None, new_mask=None, write_offset: int = 0,
                 fresh: bool = False, logits_at=None, lm: dict | None = None):
    """`head_states` then `head_logits`: (logits [B, T or K, V] f32, the new cache)."""
    states, cache = head_states(cfg, params, h, positions, cache, new_mask, write_offset, fresh, logits_at)
    return head_logits(params, states, lm), cache


# ---------------------------------------------------------------------------------------------- the drafter


@struct.dataclass
class Shared:
    """An early-exit drafter's `FeedState.own`: this step's K/V of the shared layers 1..N, per layer
    [B * KVH, P + plan scratch, Dh] (the feed's P slots first, then the drafts')."""

    k: list
    v: list


@struct.dataclass
class EarlyExitDrafter(FeedDrafter):
    """Drafts with the target's first `head.exit_layer` layers and `head` (see the module docstring); its cache is
    the head's layers' (None for a head without layers)."""

    head: EarlyExitHead
    aux_keys = ("hidden",)  # per-node outputs: the head's post-norm hidden states (Cali-TS reads them)

    def check(self, target) -> None:
        if not self.head.shares_lm_head:
            check_vocab_size(target, self.head.params["lm_head"].shape[1], "early-exit head")
        self.head.check(target)

    def map_models(self, fn) -> "EarlyExitDrafter":
        return self  # the shared layers are the target's (placed with it); the head is placed in `prepare`

    def prepare(self, setup: Setup) -> Prepared:
        if setup.guidance is not None or setup.constraint is not None:
            raise ValueError("the early-exit drafter does not take guidance / constraint (it reads the target's own "
                             "cache, which a guided target splits into streams)")
        if setup.draft_prompt is not None:
            raise ValueError("the early-exit drafter reads the target's own prompt: draft_prompt does not apply")
        head = self.head
        if setup.mesh is not None:
            head = head.replace(params=jax.device_put(head.params, jax.sharding.NamedSharding(
                setup.mesh, jax.sharding.PartitionSpec())))
        return Prepared(self.replace(head=head), None, int(setup.lengths.max()), setup.tokens.shape[1])

    def prefill_asks(self, tokens, lengths, inputs) -> dict:
        return {"hidden_layers": (self.head.exit_layer,)}

    def _shapes(self, env: DraftEnv):
        cfg, lm = text_model(env.target)
        return cfg, lm, env.tcache.k[0].shape[0], cfg.head_dim

    def init(self, env: DraftEnv, prefill: TargetPrefill, prompt, max_len: int) -> FeedState:
        cfg, lm, rows, hd = self._shapes(env)
        B, T = prefill.tokens.shape
        h = prefill.hidden_at(self.head.exit_layer)
        cache = None
        if self.head.params["layers"]:
            cache = kvc.init_cache(self.head.num_layers, B, cfg.num_kv_heads, max_len, hd,
                                   self.head.params["norm"].dtype)
            pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)) + prefill.cache.pos_offset[:, None]
            _, cache = head_forward(cfg, self.head.params, h, pos, cache, fresh=True,
                                    logits_at=jnp.zeros((B, 1), jnp.int32), lm=lm)
            cache = kvc.rollback(cache, prefill.lengths).replace(pos_offset=prefill.cache.pos_offset)
        width = self.feed_width(env) + env.needs.scratch
        dt = env.tcache.k[0].dtype
        zeros = [jnp.zeros((rows, width, hd), dt) for _ in range(self.head.exit_layer)]
        return self.fresh(env, cache, own=Shared(zeros, list(zeros)))

    def read(self, env: DraftEnv, ds: FeedState, width: int):
        """The first `width` pending tokens through the shared layers (their K/V into the shared scratch, slots
        0..) and the head's: (the head's states after `last`, (the head's cache, the shared scratch))."""
        cfg, lm, _, _ = self._shapes(env)
        tc = env.tcache
        base = tc.length - (ds.n_pending - 1)  # target slot of pending[0]; `last` sits at tc.length
        S = ds.own.k[0].shape[1]
        pos = (base + tc.pos_offset)[:, None] + jnp.arange(width, dtype=jnp.int32)[None]
        t, s = jnp.arange(width)[:, None], jnp.arange(S)[None, :]
        vis = jnp.broadcast_to(s <= t, (tc.batch, width, S))  # causal over the pending tokens
        x = llama.embed(lm, ds.pending[:, :width])
        h, sk, sv = shared_layers(cfg, lm, self.head.exit_layer, x, pos, tc, base, ds.own.k, ds.own.v, 0, vis)
        states, cache = head_states(cfg, self.head.params, h, pos, ds.cache, logits_at=(ds.n_pending - 1)[:, None])
        return states, (cache, Shared(sk, sv))

    def written(self, env: DraftEnv, ds: FeedState, new) -> FeedState:
        cache, shared = new
        return ds.replace(cache=cache, own=shared)

    def root(self, env: DraftEnv, ds: FeedState):
        _, lm, _, _ = self._shapes(env)
        states, ds = self.read_feed(env, ds)
        logp = draft_log_probs(head_logits(self.head.params, states, lm), env)
        return logp, {"hidden": states}, ds

    def level(self, env: DraftEnv, ds: FeedState, tokens, depth, mask, offset: int, run):
        cfg, lm, _, _ = self._shapes(env)
        tc = env.tcache
        B, K = tokens.shape
        P = ds.pending.shape[1]
        W = ds.own.k[0].shape[1]
        positions = (tc.length + tc.pos_offset)[:, None] + depth
        base = tc.length - (ds.n_pending - 1)
        seen = jnp.arange(P)[None, None, :] < ds.n_pending[:, None, None]  # the pending tokens, root included
        vis = jnp.concatenate([jnp.broadcast_to(seen, (B, K, P)), mask.astype(bool),
                               jnp.zeros((B, K, W - P - mask.shape[-1]), bool)], axis=-1)

        def go(ds):
            x = llama.embed(lm, tokens)
            h, sk, sv = shared_layers(cfg, lm, self.head.exit_layer, x, positions, tc, base, ds.own.k, ds.own.v,
                                      P + offset, vis)
            states, cache = head_states(cfg, self.head.params, h, positions, ds.cache, mask, offset)
            return (head_logits(self.head.params, states, lm), states), ds.replace(cache=cache, own=Shared(sk, sv))

        (logits, states), ds = run_level(run, go, ds)
        return draft_log_probs(logits, env), {"hidden": states}, ds


# --------------------------------------------------------------------------------------------------- storage


def _head_text_cfg(target_cfg, num_layers: int):
    import dataclasses as dc

    return dc.replace(target_cfg, num_layers=num_layers)


def torch_state_dict(head: EarlyExitHead, cfg) -> dict[str, np.ndarray]:
    """The head as a PyTorch user holds it: `layers.{i}.` + the LlamaDecoderLayer names ([out, in] matrices),
    `norm.weight`, `lm_head.weight` [V, D] (none for a head that shares the target's)."""
    unf = [FU.unfuse_layer(cfg, p) for p in head.params["layers"]]
    out = {}
    hcfg = _head_text_cfg(cfg, head.num_layers)
    for name, path, tr in llama.hf_key_map(hcfg, prefix=""):
        if path[0] != "layers":
            continue
        a = np.asarray(jax.device_get(unf[path[1]][path[2]]))
        out[name] = a.T if tr == "T" else a
    out["norm.weight"] = np.asarray(jax.device_get(head.params["norm"]))
    if not head.shares_lm_head:
        out["lm_head.weight"] = np.asarray(jax.device_get(head.params["lm_head"])).T
    return out


def from_torch_state_dict(sd: dict, cfg, exit_layer: int, target: ExitHeadTarget,
                          shares_lm_head: bool = False) -> EarlyExitHead:
    """The inverse of `torch_state_dict` (missing or unexpected tensors raise ValueError; `shares_lm_head`: the
    weights hold no LM head)."""
    k = len({n.split(".")[1] for n in sd if n.startswith("layers.")})
    hcfg = _head_text_cfg(cfg, k)
    layers = [{} for _ in range(k)]
    used = {"norm.weight"} | (set() if shares_lm_head else {"lm_head.weight"})
    for name, path, tr in llama.hf_key_map(hcfg, prefix=""):
        if path[0] != "layers":
            continue
        if name not in sd:
            raise ValueError(f"the head's weights lack {name}")
        layers[path[1]][path[2]] = jnp.asarray(sd[name].T if tr == "T" else sd[name])
        used.add(name)
    extra = sorted(set(sd) - used)
    if extra or not used <= set(sd):
        raise ValueError(f"unexpected head weights {extra[:5]}" + (" (this head shares the target's LM head)"
                                                                   if shares_lm_head else "")
                         if extra else f"the head's weights lack {sorted(used - set(sd))}")
    params = {"layers": [FU.fuse_layer(cfg, p) for p in layers], "norm": jnp.asarray(sd["norm.weight"])}
    if not shares_lm_head:
        params["lm_head"] = jnp.asarray(sd["lm_head.weight"]).T
    return EarlyExitHead(params, exit_layer, target)


def save_head(head: EarlyExitHead, target, directory: str, dtype=None, extra: dict | None = None) -> None:
    """`directory/model.safetensors` (the `torch_state_dict` layout) + `eesd_head.json` naming the target."""
    cfg, _ = text_model(target)
    H.write_weights(os.path.join(directory, WEIGHTS_NAME), torch_state_dict(head, cfg), dtype)
    H.write_meta(os.path.join(directory, CONFIG_NAME), {
        "format": FORMAT, "exit_layer": head.exit_layer, "num_layers": head.num_layers,
        "shares_lm_head": head.shares_lm_head, "target": head.target._asdict(), **(extra or {})})


def load_head(directory: str, target, dtype=None) -> EarlyExitHead:
    """A head saved by `save_head` (in `dtype`, default the target's), checked against `target` (ValueError when it
    was made for another), with its Cali-TS predictor when one was saved beside it (`calibration`)."""
    meta = H.read_meta(os.path.join(directory, CONFIG_NAME), FORMAT, "early-exit head")
    cfg, _ = text_model(target)
    sd = H.read_weights(os.path.join(directory, WEIGHTS_NAME), np.dtype(dtype or getattr(target, "dtype", np.float32)))
    head = from_torch_state_dict(sd, cfg, int(meta["exit_layer"]), ExitHeadTarget(**meta["target"]),
                                 bool(meta.get("shares_lm_head", False)))
    head.check(target)
    from jspec.parts.controllers.calibration import load_calibration

    return head.replace(calibration=load_calibration(directory))
