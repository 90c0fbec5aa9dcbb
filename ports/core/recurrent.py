"""Gated DeltaNet state (Qwen3.5's linear attention) under speculative decoding: the short causal convolution and
the gated delta rule over a sequence or a tree of new tokens from a committed state, and the commit of the state
after an accepted path.

The recurrence, per head (transformers' `torch_recurrent_gated_delta_rule`), for a token t whose predecessor is
p(t) (the token before it; in a tree, its parent):

    S_t = e^{g_t} S_p + k_t δ_tᵀ,   δ_t = β_t (v_t - (e^{g_t} S_p)ᵀ k_t),   o_t = S_tᵀ q_t

with S [d_k, d_v]. Unrolled from the committed state S_0 with G_t = the sum of g over t's path (t included):

    S_t = e^{G_t} S_0 + Σ_{s ≤ t} e^{G_t - G_s} k_s δ_sᵀ         (s ≤ t: s on t's path)
    δ_t + β_t Σ_{s < t} e^{G_t - G_s} (k_t·k_s) δ_s = β_t (v_t - e^{G_t} S_0ᵀ k_t)

The second line is one unit-triangular system over the new tokens (`delta_block`; ancestors come first, as the
engine orders every tree): a tree's verify gives every
node the output of its own path by using the ancestor mask where a sequence uses the causal one, with no state per
node. What a commit needs is kept per new token (`Pending`): the conv input x_t, k_t, δ_t and g_t. The state after
an accepted path t_0 .. t_{n-1} is then the first line at t_{n-1}, summed over the path only (`advance`); the
convolution's state is the last K-1 inputs along it. Memory per node and layer: C + H_k d_k + H_v (d_v + 1)
numbers, the size of a KV entry, against H_v d_k d_v for a stored state.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

CHUNK = 64  # tokens per block of a long sequence (the chunked form): transformers' chunk size


@struct.dataclass
class State:
    """The committed recurrent state of every linear-attention layer: conv [L, B, K-1, C] (the last K-1 inputs of
    the convolution, oldest first) and ssm [L, B, H_v, d_k, d_v] float32."""

    conv: jax.Array
    ssm: jax.Array


@struct.dataclass
class Pending:
    """Per new token of the last forward (index = scratch offset), per layer: x [L, B, T, C] the conv input,
    k [L, B, T, H_k, d_k] the normed key, d [L, B, T, H_v, d_v] δ, g [L, B, T, H_v] the log decay."""

    x: jax.Array
    k: jax.Array
    d: jax.Array
    g: jax.Array

    @property
    def width(self) -> int:
        return self.x.shape[2]


def init_state(layers: int, batch: int, kernel: int, channels: int, heads: int, dk: int, dv: int, dtype) -> State:
    return State(jnp.zeros((layers, batch, kernel - 1, channels), dtype),
                 jnp.zeros((layers, batch, heads, dk, dv), jnp.float32))


# ------------------------------------------------------------------------------------------ convolution


def conv_taps(anc: jax.Array, kernel: int) -> jax.Array:
    """idx [B, T, K]: for new token t and tap j (j = K-1: t itself), the row of concat(conv state, x) the tap reads:
    the ancestor K-1-j steps up t's path (ancestor mask anc [B, T, T], self included), or past the first new
    token the committed inputs."""
    depth = jnp.sum(anc, axis=-1).astype(jnp.int32) - 1  # [B, T]
    cols = []
    for back in range(kernel - 1, -1, -1):
        want = depth - back  # [B, T]
        hit = anc & (depth[:, None, :] == want[:, :, None])  # [B, T, S]
        node = jnp.argmax(hit, axis=-1).astype(jnp.int32)
        cols.append(jnp.where(want >= 0, kernel - 1 + node, kernel - 1 + want))
    return jnp.stack(cols, axis=-1)


def causal_conv(x: jax.Array, state: jax.Array, w: jax.Array, anc: jax.Array | None) -> jax.Array:
    """silu of the depthwise causal convolution (weight w [C, K], no bias) of x [B, T, C] continuing `state`
    [B, K-1, C]: along the sequence (anc None) or along each token's tree path."""
    K = w.shape[-1]
    xe = jnp.concatenate([state.astype(x.dtype), x], axis=1)
    T = x.shape[1]
    if anc is None:
        out = sum(xe[:, j:j + T] * w[:, j] for j in range(K))
    else:
        idx = conv_taps(anc, K)  # [B, T, K]
        taps = jnp.take_along_axis(xe, idx.reshape(idx.shape[0], -1)[:, :, None], axis=1)
        taps = taps.reshape(idx.shape + (x.shape[-1],))  # [B, T, K, C]
        out = jnp.einsum("btkc,ck->btc", taps, w.astype(x.dtype))
    return jax.nn.silu(out)


# ------------------------------------------------------------------------------------------ delta rule


def delta_block(S0, q, k, v, g, beta, anc):
    """Outputs o [B, T, H, d_v] and δ [B, T, H, d_v] of T new tokens from state S0 [B, H, d_k, d_v] (module
    docstring). q, k [B, T, H, d_k] (normed, q scaled), v [B, T, H, d_v], g, beta [B, T, H], all float32;
    anc [B, T, T] bool, t's path (itself included), ancestors before their descendants (a sequence's order; the
    engine's trees keep every parent before its children), so that the system is one triangular solve."""
    T = q.shape[1]
    ancf = anc.astype(jnp.float32)
    G = jnp.einsum("bts,bsh->bth", ancf, g)
    diff = G[:, :, None, :] - G[:, None, :, :]  # [B, T, S, H]
    on = anc[..., None]
    dec = jnp.where(on, jnp.exp(jnp.where(on, diff, 0.0)), 0.0)
    strict = (anc & ~jnp.eye(T, dtype=bool))[..., None]
    A = jnp.where(strict, beta[:, :, None, :] * dec * jnp.einsum("bthd,bshd->btsh", k, k), 0.0)
    eG = jnp.exp(G)[..., None]
    rhs = beta[..., None] * (v - eG * jnp.einsum("bthd,bhde->bthe", k, S0))
    system = jnp.eye(T, dtype=jnp.float32) + A.transpose(0, 3, 1, 2)  # [B, H, T, S], unit lower triangular
    d = jax.scipy.linalg.solve_triangular(system, rhs.transpose(0, 2, 1, 3), lower=True,
                                          unit_diagonal=True).transpose(0, 2, 1, 3)
    o = eG * jnp.einsum("bthd,bhde->bthe", q, S0) + jnp.einsum("btsh,bshe->bthe", dec * jnp.einsum(
        "bthd,bshd->btsh", q, k), d)
    return o, d


def end_state(S0, k, d, g):
    """The state after a sequence [B, T, ...] (k [B, T, H, d_k], δ, g as in `Pending`, heads already matched),
    from S0 [B, H, d_k, d_v]: e^{G_T} S_0 + Σ_s e^{G_T - G_s} k_s δ_sᵀ, a block of `CHUNK` tokens at a time."""
    B, T = g.shape[:2]
    pad = -T % CHUNK if T > CHUNK else 0
    if pad:  # inert tokens: no decay, no update
        k, d, g = (jnp.pad(a, ((0, 0), (0, pad)) + ((0, 0),) * (a.ndim - 2)) for a in (k, d, g))
    n = max(1, (T + pad) // CHUNK) if T > CHUNK else 1
    blocks = lambda a: a.reshape((B, n, -1) + a.shape[2:]).swapaxes(0, 1)  # noqa: E731

    def step(S, blk):
        kb, db, gb = blk
        G = jnp.cumsum(gb, axis=1)
        last = G[:, -1]  # [B, H]
        w = jnp.exp(last[:, None] - G)  # [B, t, H]
        S = jnp.exp(last)[..., None, None] * S + jnp.einsum("bth,bthd,bthe->bhde", w, kb, db)
        return S, None

    S, _ = jax.lax.scan(step, S0, (blocks(k), blocks(d), blocks(g)))
    return S


def sequence_rule(S0, q, k, v, g, beta):
    """`delta_block` along a causal sequence of any length, `CHUNK` tokens at a time (a scan over blocks, each
    continuing from the state the one before left): outputs and δ [B, T, H, d_v]."""
    B, T = q.shape[:2]
    if T <= CHUNK:
        return delta_block(S0, q, k, v, g, beta, jnp.tril(jnp.ones((B, T, T), bool)))
    pad = -T % CHUNK
    q, k, v, g, beta = (jnp.pad(a, ((0, 0), (0, pad)) + ((0, 0),) * (a.ndim - 2)) for a in (q, k, v, g, beta))
    n = (T + pad) // CHUNK
    blocks = lambda a: a.reshape((B, n, CHUNK) + a.shape[2:]).swapaxes(0, 1)  # noqa: E731
    causal = jnp.tril(jnp.ones((B, CHUNK, CHUNK), bool))

    def step(S, blk):
        qb, kb, vb, gb, bb = blk
        o, d = delta_block(S, qb, kb, vb, gb, bb, causal)
        return end_state(S, kb, d, gb), (o, d)

    _, (o, d) = jax.lax.scan(step, S0, tuple(blocks(a) for a in (q, k, v, g, beta)))
    unblock = lambda a: a.swapaxes(0, 1).reshape((B, n * CHUNK) + a.shape[3:])[:, :T]  # noqa: E731
    return unblock(o), unblock(d)


def match_heads(k: jax.Array, heads: int) -> jax.Array:
    """Keys [.., H_k, d] for H_v value heads: key head h serves value heads h * r .. h * r + r - 1."""
    r = heads // k.shape[-2]
    return k if r == 1 else jnp.repeat(k, r, axis=-2)


# ------------------------------------------------------------------------------------------ commit


def advance(state: State, new: Pending, src: jax.Array, n: jax.Array) -> State:
    """The state after each row b's accepted path: the new tokens at scratch offsets src[b, :n[b]], in path order
    (rows with n = 0 keep their state). Exact: the unrolled recurrence over the path (module docstring)."""
    P = src.shape[1]
    keep = jnp.arange(P)[None, :] < n[:, None]  # [B, P]

    def take(a):
        idx = src.reshape((1,) + src.shape + (1,) * (a.ndim - 3)).astype(jnp.int32)
        return jnp.take_along_axis(a, idx, axis=2)

    x, k, d, g = take(new.x), take(new.k), take(new.d), take(new.g)
    g = jnp.where(keep[None, :, :, None], g, 0.0)
    d = jnp.where(keep[None, :, :, None, None], d, 0.0)
    k = match_heads(k, d.shape[-2])
    ssm = jax.vmap(end_state)(state.ssm, k, d, g)
    K1 = state.conv.shape[2]
    xe = jnp.concatenate([state.conv, x.astype(state.conv.dtype)], axis=2)  # [L, B, K-1+P, C]
    conv = jax.vmap(lambda rows, at: jax.lax.dynamic_slice_in_dim(rows, at, K1, axis=1), in_axes=(1, 0),
                    out_axes=1)(xe, n.astype(jnp.int32))
    return State(conv, ssm)


def pad_pending(new: Pending, width: int) -> Pending:
    """`new` with its token axis padded to `width` (entries no path reads)."""
    extra = width - new.width
    if extra <= 0:
        return new
    return jax.tree.map(lambda a: jnp.pad(a, ((0, 0), (0, 0), (0, extra)) + ((0, 0),) * (a.ndim - 3)), new)
