"""Building blocks shared by every port: RMSNorm, rotary embeddings, masked attention over a KV cache, SwiGLU."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ports.core import cache as kvc
from ports.core import blockwise as BW
from ports.core import moe
from ports.core.config import TextConfig, rope_inv_freq


def einsum_f32(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """einsum with a float32 result. Accelerators accumulate low-precision inputs in f32 directly; XLA:CPU has no
    bf16 x bf16 -> f32 dot, so there the inputs are upcast first."""
    if a.dtype == jnp.float32 and b.dtype == jnp.float32:
        return jnp.einsum(spec, a, b)
    if jax.default_backend() == "cpu":
        return jnp.einsum(spec, a.astype(jnp.float32), b.astype(jnp.float32))
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def weight_dot(spec: str, x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """einsum(spec, x, w) of activations x (contracted on their last axis) with a weight w; `out_dtype` float32
    asks for a float32 result (`einsum_f32`), else the einsum's own dtype.

    On XLA:CPU, bf16 / f16 activations and weights multiply in their dtype with float32 accumulation, a one-row
    product computed as two: XLA:CPU's one-row bf16 dot took 72 ms on 30 [576, 3072] matrices against 8 ms for two
    rows (jax 0.10.2), and its 2-8 row bf16 dots run at about its float32 one-row speed. Everywhere else this is the
    plain einsum."""
    low = x.dtype == w.dtype and w.dtype in (jnp.bfloat16, jnp.float16)
    if not (low and jax.default_backend() == "cpu"):
        return einsum_f32(spec, x, w) if out_dtype == jnp.float32 else jnp.einsum(spec, x, w)
    one = x.ndim >= 2 and int(np.prod(x.shape[:-1])) == 1
    xw = jnp.concatenate([x, x], axis=0) if one else x
    y = jnp.einsum(spec, xw, w, preferred_element_type=jnp.float32)
    return (y[:1] if one else y).astype(x.dtype if out_dtype is None else out_dtype)


def rms_norm(x: jax.Array, weight: jax.Array | float, eps: float) -> jax.Array:
    """HF LlamaRMSNorm: normalise in float32, cast back, then scale (weight 1.0: a norm without a scale)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def centered_rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Gemma's RMSNorm (Muse Glimmer's decoder norms): the scale is 1 + weight (stored as an offset from 1),
    applied in float32 before the cast back."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def layer_norm_fn(cfg):
    """The decoder's layer norm (x, weight, eps) -> normed x: `centered_rms_norm` where the config says
    `centered_norms` (Muse Glimmer), else `rms_norm`."""
    return centered_rms_norm if getattr(cfg, "centered_norms", False) else rms_norm


def rope_tables(cfg: TextConfig, positions: jax.Array, prompt_len: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, rot_dim] in HF's half-rotation layout for integer positions [B, T].

    Dynamic-NTK RoPE grows its base with the sequence length a token is computed at, per token: a prompt token
    takes its row's prompt length `prompt_len` [B] (transformers' prefill of that row), a later token its own
    position + 1 (transformers' cached generate, one token per forward). So a multi-token verification rotates
    each token as token-by-token decoding did, a chunked prefill as a one-pass one, and no row reads another's
    length (transformers' batched forward takes the batch's longest)."""
    inv, scale = rope_inv_freq(cfg)
    inv = jnp.asarray(inv)
    r = cfg.rope
    if r.rope_type == "dynamic":
        dim = inv.shape[0] * 2
        orig = cfg.max_position_embeddings
        seq = positions + 1 if prompt_len is None else jnp.maximum(positions + 1, prompt_len[:, None])
        seq_len = jnp.maximum(seq, orig).astype(jnp.float32)[..., None]  # [B, T, 1]
        base = r.theta * ((r.factor * seq_len / orig) - (r.factor - 1)) ** (dim / (dim - 2))
        exps = jnp.asarray(np.arange(0, dim, 2, dtype=np.float32) / dim)
        inv = 1.0 / (base ** exps)  # [B, T, dim / 2]
    freqs = positions.astype(jnp.float32)[..., None] * inv
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb) * scale, jnp.sin(emb) * scale


def whole_sequence_len(cfg: TextConfig, positions: jax.Array, fresh: bool) -> jax.Array | None:
    """The `prompt_len` of a forward over whole sequences (into an empty cache, e.g. `ports.logits`): each row's
    last position + 1, so that dynamic-NTK RoPE scales every token by the sequence length as transformers' forward
    does. None otherwise."""
    if not fresh or cfg.rope.rope_type != "dynamic":
        return None
    return jnp.max(positions, axis=-1) + 1


def mrope_tables(cfg: TextConfig, positions: jax.Array, section,
                 interleaved: bool = False) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, rot_dim] of multimodal RoPE (Qwen2-VL's M-RoPE) for positions [3, B, T] (t, h, w ids).

    Frequency j of the half dimension rotates by component c(j) of the position: the half dimension is cut into
    `section` runs (e.g. (16, 24, 24)) and run i reads component i % 3, as HF's mrope_section does. interleaved
    (Qwen3-VL): c(j) = j % 3 where j < 3 * section[j % 3] for the h and w components (1, 2), else 0 (t). When the
    three components are equal this is exactly `rope_tables` of that position."""
    inv, scale = rope_inv_freq(cfg)
    if interleaved:
        j = np.arange(inv.shape[0])
        comp = np.where((j % 3 > 0) & (j < 3 * np.asarray(section)[j % 3]), j % 3, 0)
    else:
        comp = np.repeat(np.arange(len(section)) % 3, section)
    if comp.size != inv.shape[0]:
        raise ValueError(f"mrope_section {tuple(section)} sums to {comp.size}, but the rotary half dimension is "
                         f"{inv.shape[0]}")
    pos = jnp.take(positions, jnp.asarray(comp), axis=0)  # [rot/2, B, T]
    freqs = jnp.moveaxis(pos, 0, -1).astype(jnp.float32) * jnp.asarray(inv)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb) * scale, jnp.sin(emb) * scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, H, Dh]; rotates the first rot_dim features (partial rotary leaves the rest)."""
    rot = cos.shape[-1]
    xr, xp = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = jnp.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
    c, s = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    out = xr * c + rotated * s
    return jnp.concatenate([out, xp], axis=-1) if xp.shape[-1] else out


def _group_queries(q: jax.Array, rows: int) -> tuple[int, int, jax.Array]:
    """(kv heads, queries per kv head G, q [B, T, H, Dh] as [B * KVH, G * T, Dh]) for `rows` = B * KVH cache rows."""
    B, T, H, Dh = q.shape
    kvh = rows // B
    G = H // kvh
    return kvh, G, q.reshape(B, T, kvh, G, Dh).transpose(0, 2, 3, 1, 4).reshape(rows, G * T, Dh)


def _ungroup(out: jax.Array, q: jax.Array) -> jax.Array:
    """Attention outputs [B * KVH, G * T, Dh] back to q's [B, T, H, Dh] layout and dtype."""
    B, T, H, Dh = q.shape
    kvh = out.shape[0] // B
    return out.reshape(B, kvh, H // kvh, T, Dh).transpose(0, 3, 1, 2, 4).reshape(B, T, H, Dh).astype(q.dtype)


def _seen(out: jax.Array, seen: jax.Array) -> jax.Array:
    """out [B, T, H, Dh] with zeros at the query rows that see no slot (seen [B, T] False)."""
    return jnp.where(seen[:, :, None, None], out, jnp.zeros((), out.dtype))


def attention(q: jax.Array, k_buf: jax.Array, v_buf: jax.Array, visible: jax.Array,
              score_weights: jax.Array | None = None):
    """Grouped-query attention of new queries over the whole cache.

    q [B, T, H, Dh]; k_buf, v_buf [B * KVH, S, Dh] (the flat cache rows of `ports.core.cache`); visible bool [B, T, S].
    Returns [B, T, H, Dh]; a query that sees no slot gets zeros. Scores and softmax run in float32 whatever the
    parameter dtype. With `score_weights` [B, T] it returns (out, scores [B, S]): the attention probabilities
    averaged over heads and summed over queries with those weights (full softmax denominators; SpecVLM's
    language-to-vision scores).
    """
    B, T, H, Dh = q.shape
    N, S, _ = k_buf.shape
    kvh, G, qg = _group_queries(q, N)
    scores = einsum_f32("nqd,nsd->nqs", qg, k_buf).reshape(B, kvh, G, T, S) * (Dh ** -0.5)
    scores = jnp.where(visible[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs32 = jax.nn.softmax(scores, axis=-1)
    probs = probs32.astype(v_buf.dtype).reshape(N, G * T, S)
    out = _seen(_ungroup(einsum_f32("nqs,nsd->nqd", probs, v_buf), q), jnp.any(visible, axis=-1))
    if score_weights is None:
        return out
    return out, jnp.einsum("bkgts,bt->bs", probs32, score_weights.astype(jnp.float32)) / H


def attention_deferred(q: jax.Array, k_buf: jax.Array, v_buf: jax.Array, k_new: jax.Array, v_new: jax.Array,
                       visible: "Deferred") -> jax.Array:
    """`attention` over the cache's committed slots and T new keys / values not written into it: k_new, v_new
    [B * KVH, T, Dh] (`kv_rows`); one softmax over both, so the result is `attention` after the write up to the
    order of its float32 sums. Returns [B, T, H, Dh]."""
    B, T, H, Dh = q.shape
    N, S, _ = k_buf.shape
    scale = Dh ** -0.5
    kvh, G, qg = _group_queries(q, N)
    s_old = einsum_f32("nqd,nsd->nqs", qg, k_buf).reshape(B, kvh, G, T, S) * scale
    s_new = einsum_f32("nqd,nsd->nqs", qg, k_new).reshape(B, kvh, G, T, T) * scale
    vis = jnp.concatenate([visible.old, visible.new], axis=-1)[:, None, None]
    scores = jnp.where(vis, jnp.concatenate([s_old, s_new], axis=-1), jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    p_old = probs[..., :S].astype(v_buf.dtype).reshape(N, G * T, S)
    p_new = probs[..., S:].astype(v_new.dtype).reshape(N, G * T, T)
    out = _ungroup(einsum_f32("nqs,nsd->nqd", p_old, v_buf) + einsum_f32("nqs,nsd->nqd", p_new, v_new), q)
    return _seen(out, jnp.any(visible.old, axis=-1) | jnp.any(visible.new, axis=-1))


def kv_rows(x: jax.Array) -> jax.Array:
    """Keys or values [B, T, KVH, Dh] as the flat rows `attention` reads: [B * KVH, T, Dh]."""
    B, T, H, D = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B * H, T, D)


def linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    y = weight_dot("...d,dn->...n", x, w) if x.dtype == w.dtype and w.ndim == 2 else x @ w
    return y + b if b is not None else y


def gate_up(x: jax.Array, p: dict) -> tuple[jax.Array, jax.Array]:
    """(gate, up) projections [..., F] of x [..., D], from either layout (`ports.core.fused`)."""
    if "w_gate_up" not in p:
        return linear(x, p["w_gate"], p.get("b_gate")), linear(x, p["w_up"], p.get("b_up"))
    y = weight_dot("...d,dif->...if", x, p["w_gate_up"])
    if "b_gate_up" in p:
        y = y + p["b_gate_up"]
    return y[..., 0, :], y[..., 1, :]


# the gate activations of a gated MLP (HF's ACT2FN names)
GATE_ACTIVATIONS = {"silu": jax.nn.silu, "gelu": lambda x: jax.nn.gelu(x, approximate=False),
                    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
                    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True)}


def swiglu(x: jax.Array, p: dict, act: str = "silu") -> jax.Array:
    """down(act(gate(x)) * up(x)): SwiGLU with the default silu, GeGLU with a gelu (`GATE_ACTIVATIONS`)."""
    g, u = gate_up(x, p)
    return linear(GATE_ACTIVATIONS[act](g) * u, p["w_down"], p.get("b_down"))


def mlp(cfg, p: dict, x: jax.Array) -> jax.Array:
    """A decoder layer's feed-forward block over x [..., D]: the experts of `ports.core.moe` where the layer holds a
    router (Qwen3-MoE's sparse layers), else the gated MLP of the config's `hidden_act`."""
    return moe.sparse_moe(cfg, p, x) if "router" in p else swiglu(x, p, getattr(cfg, "hidden_act", "silu"))


def project_qkv(cfg: TextConfig, p: dict, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [B, T, H, Dh], k and v [B, T, KVH, Dh] of x [B, T, D], from either layout (`ports.core.fused`)."""
    B, T, _ = x.shape
    H, KVH, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if "wqkv" not in p:
        return (linear(x, p["wq"], p.get("bq")).reshape(B, T, H, Dh),
                linear(x, p["wk"], p.get("bk")).reshape(B, T, KVH, Dh),
                linear(x, p["wv"], p.get("bv")).reshape(B, T, KVH, Dh))
    G = H // KVH
    y = weight_dot("btd,dkgh->btkgh", x, p["wqkv"])
    if "bqkv" in p:
        y = y + p["bqkv"]
    return y[:, :, :, :G].reshape(B, T, H, Dh), y[:, :, :, G], y[:, :, :, G + 1]


VISION_BATCH = 8  # vision towers encode this many images / frames at a time (`in_batches`): bounded on long videos


def in_batches(fn, arrays: tuple, size: int):
    """fn(*arrays) over their leading axis (the same N for each), `size` items at a time under `lax.map`, so that
    what fn holds at once is bounded by `size` items, not N. Equal to fn(*arrays) when fn treats the items
    independently (a vision tower's images or frames). Pads N to a multiple of size with zeros; the padding items'
    outputs are dropped. fn returns a pytree of arrays with leading axis N."""
    N = arrays[0].shape[0]
    if N <= size:
        return fn(*arrays)
    n = -(-N // size)

    def split(a):
        a = jnp.pad(a, [(0, n * size - N)] + [(0, 0)] * (a.ndim - 1))
        return a.reshape((n, size) + a.shape[1:])

    out = jax.lax.map(lambda xs: fn(*xs), tuple(split(a) for a in arrays))
    return jax.tree.map(lambda o: o.reshape((n * size,) + o.shape[2:])[:N], out)


BLOCKWISE_MIN = 1024  # prefills (or prefill chunks) of at least this many tokens attend blockwise (`ports.core.blockwise`)


class Causal(NamedTuple):
    """A fresh prefill's visibility by its structure: query t of row b sees key j when start[b] <= j <= t (what
    `ports.core.cache.visibility` gives for an empty cache without a tree mask), without a [B, T, S] boolean; with a
    `window` also only when j > t - window."""

    start: jax.Array  # [B]
    window: int | None = None  # static: a sliding window (`attention_window`)


class Prefix(NamedTuple):
    """A prefill chunk's visibility by its structure: the cache holds length[b] committed slots and the T new
    tokens go after them, causally; new token t of row b sees slot j when start[b] <= j <= length[b] + t (and
    j > length[b] + t - window with a `window`)."""

    start: jax.Array  # [B]
    length: jax.Array  # [B]
    window: int | None = None  # static: a sliding window (`attention_window`)


class Deferred(NamedTuple):
    """The visibility of a forward that does not write its keys / values into the cache (`defer_writes`): the
    committed slots each new token sees, bool [B, T, S], and the new tokens each sees, bool [B, T, T]."""

    old: jax.Array
    new: jax.Array


def attention_window(cfg, max_len: int) -> int | None:
    """The sliding window a forward over a cache of `max_len` slots attends under (static): the config's
    `sliding_window` when it is shorter than the cache, else None (a window that long hides nothing)."""
    w = getattr(cfg, "sliding_window", None)
    return w if w is not None and w < max_len else None


def layer_windows(cfg, max_len: int, num_layers: int) -> tuple[int | None, ...]:
    """The `attention_window` of each of `num_layers` decoder layers (static): the config's window, except in the
    layers its `full_attention_layers` names (Qwen3's `layer_types`), which attend over everything."""
    w = attention_window(cfg, max_len)
    full = set(getattr(cfg, "full_attention_layers", ()))
    return tuple(None if i in full else w for i in range(num_layers))


def _after(vis: jax.Array) -> jax.Array:
    """int32 [..., S]: how many visible slots come after each slot (in slot order) in its query's row."""
    v = vis.astype(jnp.int32)
    return jnp.sum(v, axis=-1, keepdims=True) - jnp.cumsum(v, axis=-1)


def windowed(visible, window: int | None):
    """`visible` (a [B, T, S] boolean, `Deferred`, `Causal` or `Prefix`) under a sliding window: each query keeps
    the last `window` slots it sees, itself included. The slots a query sees, in slot order, are its sequence in
    order (the committed prefix, then its tree ancestors, which precede it, then itself), so the key j slots back in
    that sequence is the one with j visible slots after it: the window keeps kv_idx > q_idx - window in sequence
    indices, transformers' `sliding_window_overlay`, and a tree node's window counts its ancestors, not the
    siblings between them in the scratch slots. None: `visible` unchanged."""
    if window is None:
        return visible
    if isinstance(visible, (Causal, Prefix)):
        return visible._replace(window=window)
    if isinstance(visible, Deferred):
        n_new = jnp.sum(visible.new.astype(jnp.int32), axis=-1, keepdims=True)
        return Deferred(visible.old & (_after(visible.old) + n_new < window),
                        visible.new & (_after(visible.new) < window))
    return visible & (_after(visible) < window)


def deferred_visibility(cache, num_new: int, new_mask, window: int | None = None) -> Deferred:
    """`Deferred` of T new tokens after the committed ones; new_mask [B, T, T] (default causal); `windowed` by a
    sliding window."""
    new = jnp.tril(jnp.ones((num_new, num_new), bool))[None] if new_mask is None else new_mask[..., :num_new]
    return windowed(Deferred(kvc.committed_visibility(cache, num_new),
                             jnp.broadcast_to(new.astype(bool), (cache.batch, num_new, num_new))), window)


def split_visibility(visible: jax.Array, start: jax.Array) -> Deferred:
    """A [B, T, S] boolean visibility of T new tokens that go at slots start[b] .. start[b] + T - 1, as the
    `Deferred` one of the same forward with its writes held back: `old` the slots outside the new tokens' (what the
    cache holds before the write), `new` [B, T, T] the new tokens each sees. Same slots seen, nothing lost."""
    B, T, S = visible.shape
    j = jnp.arange(S)[None, None, :]
    own = (j >= start[:, None, None]) & (j < start[:, None, None] + T)
    slots = jnp.clip(start[:, None, None] + jnp.arange(T)[None, None, :], 0, S - 1)
    return Deferred(visible & ~own, jnp.take_along_axis(visible, jnp.broadcast_to(slots, (B, T, T)), axis=2))


def prefill_visibility(cache, num_new: int, new_mask, write_offset: int, fresh: bool, window: int | None = None):
    """The visibility a forward attends under: `Causal` for a fresh prefill and `Prefix` for a chunk of a prefill
    (new tokens after the committed ones, no tree mask) when they are long enough to take the blockwise path, else
    the [B, T, S] boolean of `ports.core.cache.cache_visibility`; `windowed` by a sliding window."""
    if new_mask is None and write_offset == 0 and num_new >= BLOCKWISE_MIN:
        return Causal(cache.start, window) if fresh else Prefix(cache.start, cache.length, window)
    return windowed(kvc.cache_visibility(cache, num_new, new_mask, write_offset), window)


def write_and_attend(q, k, v, k_buf, v_buf, start, visible, score_weights: jax.Array | None = None,
                     fresh: bool = False):
    """Write the new keys / values k, v [B, T, KVH, Dh] at slots start[b].. of k_buf, v_buf and attend over the
    cache (see `attention`). Returns (out, k_buf, v_buf), or (out, scores [B, S], k_buf, v_buf) when
    `score_weights` is given.

    fresh: the cache holds nothing yet (every row's length is 0, the writes start at slot 0), as in a prefill. Then
    only slots < T can be visible, so attention runs over the new keys alone and the buffers are the new rows padded
    to S: the same result without reading, masking or copying the S - T empty slots (a prefill's cost no longer
    grows with the cache length). A `Causal` visibility (a long fresh prefill) attends blockwise: no [T, T] scores;
    so does a `Prefix` one (a long chunk of a chunked prefill): no [T, S] scores. A `Deferred` one writes nothing:
    it returns the new rows [B * KVH, T, Dh] in place of the buffers (`attention_deferred`).
    """
    if isinstance(visible, Deferred):
        if score_weights is not None or fresh:
            raise ValueError("a deferred write attends over a filled cache and returns no scores")
        kr, vr = kv_rows(k).astype(k_buf.dtype), kv_rows(v).astype(v_buf.dtype)
        return attention_deferred(q, k_buf, v_buf, kr, vr, visible), kr, vr
    if isinstance(visible, Causal):
        if not fresh:
            raise ValueError("a Causal (structural) visibility is for fresh prefills")
        T, S = q.shape[1], k_buf.shape[1]
        out = _as_tuple(BW.causal_attention(q, k, v, visible.start, score_weights, window=visible.window))
        if score_weights is not None:
            out = (out[0], jnp.pad(out[1], ((0, 0), (0, S - T))))
        pad = ((0, 0), (0, S - T), (0, 0))
        return (*out, jnp.pad(kv_rows(k).astype(k_buf.dtype), pad), jnp.pad(kv_rows(v).astype(v_buf.dtype), pad))
    if not fresh:
        k_buf, v_buf = kvc.write_layer(k_buf, v_buf, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), start)
        if isinstance(visible, Prefix):
            out = BW.prefix_attention(q, k_buf, v_buf, visible.start, visible.length, score_weights,
                                      window=visible.window)
        else:
            out = attention(q, k_buf, v_buf, visible, score_weights)
        return (*_as_tuple(out), k_buf, v_buf)
    T, S = q.shape[1], k_buf.shape[1]
    kr, vr = kv_rows(k).astype(k_buf.dtype), kv_rows(v).astype(v_buf.dtype)
    out = _as_tuple(attention(q, kr, vr, visible[:, :, :T], score_weights))
    if score_weights is not None:
        out = (out[0], jnp.pad(out[1], ((0, 0), (0, S - T))))
    pad = ((0, 0), (0, S - T), (0, 0))
    return (*out, jnp.pad(kr, pad), jnp.pad(vr, pad))


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def self_attention_layer(cfg: TextConfig, p: dict, x: jax.Array, cos, sin, k_buf, v_buf, start, visible,
                         score_weights: jax.Array | None = None, fresh: bool = False):
    """One attention block: project, rotate, write the new K/V at slots start[b].., attend (`write_and_attend`).
    Returns (out, k, v), and the attention scores of `attention` as a 4th item when `score_weights` is given."""
    B, T, _ = x.shape
    q, k, v = project_qkv(cfg, p, x)
    if "q_norm" in p:  # Qwen3: RMSNorm over each head's features, before RoPE
        q, k = rms_norm(q, p["q_norm"], cfg.rms_norm_eps), rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    elif getattr(cfg, "qk_scale_factor", None) is not None:  # Muse Glimmer: scaleless QK-norm, queries scaled
        q = rms_norm(q, 1.0, cfg.rms_norm_eps) * jnp.asarray(cfg.qk_scale_factor, q.dtype)
        k = rms_norm(k, 1.0, cfg.rms_norm_eps)
    if cos is not None:  # None: a layer without positions (NoPE)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    o, *rest = write_and_attend(q, k, v, k_buf, v_buf, start, visible, score_weights, fresh)
    o = o.reshape(B, T, -1)
    if "w_attn_gate" in p:  # Muse Glimmer: each head's output gated by sigmoid(gate(x))
        o = o * jax.nn.sigmoid(linear(x, p["w_attn_gate"]))
    if score_weights is not None:
        scores, k_buf, v_buf = rest
        return linear(o, p["wo"], p.get("bo")), k_buf, v_buf, scores
    k_buf, v_buf = rest
    return linear(o, p["wo"], p.get("bo")), k_buf, v_buf


def decoder_layer(cfg: TextConfig, p: dict, x: jax.Array, cos, sin, k_buf, v_buf, start, visible,
                  score_weights: jax.Array | None = None, fresh: bool = False):
    """One pre-norm LLaMA decoder layer over x [B, T, D] (`self_attention_layer`, then the MLP, `mlp`, each added
    to the residual stream). A layer holding post_attn_norm / post_mlp_norm also norms each block's output before
    the residual add (Muse Glimmer's sandwich, eps `cfg.post_norm_eps`); the norms are `layer_norm_fn`'s. cos, sin
    None: no rotary embedding (a NoPE layer). Returns (x, k, v, scores or None)."""
    norm = layer_norm_fn(cfg)
    out = self_attention_layer(cfg, p, norm(x, p["attn_norm"], cfg.rms_norm_eps), cos, sin, k_buf, v_buf,
                               start, visible, score_weights, fresh)
    a = out[0]
    if "post_attn_norm" in p:
        a = norm(a, p["post_attn_norm"], cfg.post_norm_eps)
    x = x + a
    m = mlp(cfg, p, norm(x, p["mlp_norm"], cfg.rms_norm_eps))
    if "post_mlp_norm" in p:
        m = norm(m, p["post_mlp_norm"], cfg.post_norm_eps)
    x = x + m
    return x, out[1], out[2], (out[3] if score_weights is not None else None)
