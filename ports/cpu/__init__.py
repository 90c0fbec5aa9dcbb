"""jspec's CPU kernels, behind one door: few-row and packed weight products, attention over the KV cache and
in-place cache row writes, in C++ (`csrc/`) called through XLA's FFI, and the packed weight layout they stream.

One switch, `JSPEC_CPU_KERNELS`, off by default: with "1", on the CPU backend and with a C++ compiler to build the
library, the ops below go to the kernels; otherwise (and always on a GPU or TPU) every one of them returns None and
the callers run XLA's ops, the code GPU and TPU users run. The kernels pay on CPUs with AVX-512; where a CPU has
AVX2 alone their products are several times slower than XLA's (`docs/performance-notes.md`). The kernels compute what XLA computes up to the order of float
sums, and promise more: each row's result is independent of the rows beside it (a verified token's logits equal its
AR step's bit for bit). Nothing outside this package names the kernels or the packed layout; the ports ask the door.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ports.cpu import cache_attention as _attention
from ports.cpu import dot as _dot
from ports.cpu import packed as _packed
from ports.cpu import rows as _rows
from ports.cpu.library import MARCH_ENV, SWITCH, available, enabled
from ports.cpu.packed import is_packed, pack_weights, unpack_weights


def _row_product(spec: str) -> bool | None:
    """For an einsum that contracts x's last axis with w's first (-> False: w is [K, ...]) or with a 2-D w's last
    (-> True: w is [N, K]) and keeps x's other axes then w's in order, which form it is; None for any other."""
    lhs, out = spec.split("->")
    xs, ws = lhs.split(",")
    c = xs[-1]
    if ws[0] == c and c not in ws[1:] and out == xs[:-1] + ws[1:]:
        return False
    if len(ws) == 2 and ws[1] == c and ws[0] != c and out == xs[:-1] + ws[0]:
        return True
    return None


def owns(w) -> bool:
    """Whether `w` is a weight in the kernels' packed layout (only `product` multiplies it)."""
    return isinstance(w, _packed.PackedWeight)


def product(spec: str, x: jax.Array, w, out_dtype=None) -> jax.Array | None:
    """einsum(spec, x, w) of activations x (contracted on their last axis) with a weight w through a kernel, or None
    where none applies. A packed weight (`owns`) always comes back multiplied (by the panel kernel, or by an einsum
    over its panels with the kernels off), for a row-product spec only; x is cast to float32 and the result to
    `out_dtype` (default x's dtype). A plain float32 weight goes to the few-row kernel for 2..MAX_ROWS rows of a
    [K, ...] weight or 1..MAX_ROWS rows of a [N, K] one (one row of [K, N] stays with XLA's matrix-vector product,
    which the kernel matched bit for bit where measured)."""
    if owns(w):
        if _row_product(spec) is not False:
            raise ValueError(f"a packed weight takes row products (x's last axis with the weight's first), not {spec}")
        return _packed.dot(x.astype(jnp.float32), w).astype(out_dtype or x.dtype)
    if not (x.dtype == w.dtype == jnp.float32 and x.ndim >= 1):
        return None
    m = int(np.prod(x.shape[:-1]))
    nk = _row_product(spec)
    if nk is None or m < (1 if nk else 2) or m > _dot.MAX_ROWS or not enabled():
        return None
    x2 = x.reshape(m, x.shape[-1])
    if nk:
        return _dot.dot(x2, w, True).reshape(*x.shape[:-1], w.shape[0])
    return _dot.dot(x2, w.reshape(w.shape[0], -1)).reshape(*x.shape[:-1], *w.shape[1:])


def attention(q: jax.Array, segments, scale: float) -> jax.Array | None:
    """Softmax attention of q ([B, T, H, D], query head h reading cache row b * KVH + h // (H / KVH)) over one or two
    segments (k [N, S, D], v [N, S, D], visible bool [B, T, S]), one softmax over all of them, through the kernel; a
    row that sees nothing gives zeros. None where the kernel does not apply: switched off, not float32, a head width
    not a multiple of 16 or over 256, or more than `ATTENTION_MAX_ROWS` query rows per cache row over two
    segments. The result has q's dtype."""
    arrays = [a for k, v, _ in segments for a in (k, v)]
    if not _attention.attention_applies(q, *arrays):
        return None
    return _attention.attention(q, segments, scale).astype(q.dtype)


def write_rows(bufs: tuple, news: tuple, start: jax.Array) -> tuple | None:
    """The buffers [N, S, D] with news[i] [N, T_i, D] written at slots start[n].. of each row n, in place through the
    kernel (the values `ports.cache.write_rows_xla` writes); None with the kernels off."""
    return _rows.write_rows(bufs, news, start) if enabled() else None


def move_rows(bufs: tuple, src: jax.Array, start: jax.Array) -> tuple | None:
    """In each buffer [N, S, D], slots src[n] of row n copied to slots start[n].., in place through the kernel (the
    values `ports.cache.move_rows_xla` gives); None with the kernels off."""
    return _rows.move_rows(bufs, src, start) if enabled() else None


def pack_matrix(w: jax.Array):
    """A float32 [K, ...] weight in the packed layout (`product` multiplies it)."""
    return _packed.PackedWeight.of(w)


pack_layer = _packed.pack_layer
plain = _packed.plain
plain_layer = _packed.plain_layer


def head(params: dict):
    """The packed LM head ([D, V], for "...d,dv->...v") that `with_head` added to `params`, or None."""
    return params.get(_packed.UNEMBED)


def with_head(params: dict, w: jax.Array) -> dict:
    """`params` with the LM head w [D, V] added packed (a float32 w only; `params` as they are otherwise)."""
    if w.dtype != jnp.float32 or _packed.UNEMBED in params:
        return params
    return {**params, _packed.UNEMBED: _packed.PackedWeight.of(w)}


def without_head(params: dict) -> dict:
    """`params` without the packed LM head `with_head` added."""
    return {k: v for k, v in params.items() if k != _packed.UNEMBED}


def for_backend(model, shardings=None):
    """`model` with its float32 decoder projections packed when the kernels are enabled and nothing is sharded (every
    loader calls this, so `ports.load_hf`, `ports.load_gguf`, `ports.load` and `jspec.models.load` give one CPU
    path); a model whose family does not run the LLaMA forward, or not float32, as it is."""
    if shardings is not None or not enabled() or not getattr(model, "family", None) or not model.family.scans:
        return model
    if model.dtype != jnp.float32 or is_packed(model):
        return model
    return pack_weights(model)


ATTENTION_MAX_ROWS = _attention.ATTENTION_MAX_ROWS
MAX_ROWS = _dot.MAX_ROWS

__all__ = ["ATTENTION_MAX_ROWS", "MARCH_ENV", "MAX_ROWS", "SWITCH", "attention", "available", "enabled",
           "for_backend", "head", "is_packed", "move_rows", "owns", "pack_layer", "pack_matrix", "pack_weights",
           "plain", "plain_layer", "product", "unpack_weights", "with_head", "without_head", "write_rows"]
