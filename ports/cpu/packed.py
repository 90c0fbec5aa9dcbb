"""Weights packed for the CPU: a LLaMA-family model whose projection matrices are stored as column panels
(`ports.cpu.dot.pack`), so every product with them, one row or many, runs through `ports.cpu.dot.packed_dot`.

On XLA:CPU a float32 product of a few rows (a speculative verify) costs 1.3-1.9 times its one-row form with a
weight stored [K, N]; with the weight packed into 32-column panels the kernel streams it front to back once and keeps
each row's sums in registers, so 1-8 rows cost what reading the weights does, and one row (an AR step) less than
XLA's matrix-vector product (`docs/performance-notes.md`). Each output sums in the same order whatever the number of
rows, so a verified token's logits equal the AR step's bit for bit.

`pack_weights(model)` packs the float32 decoder projections in place and adds the LM head, packed, as
params["unembed"] (the tied embedding or `lm_head` stay as they are, for lookups and drafters that read them);
`unpack_weights` undoes it, and the checkpoint writers unpack. The forwards take either layout.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ports.cpu import dot as CD
from ports.fused import layers_path
from ports.param_paths import get_path

PROJECTIONS = ("wqkv", "wq", "wk", "wv", "wo", "w_gate_up", "w_gate", "w_up", "w_down")  # contracted on axis 0
UNEMBED = "unembed"  # the packed LM head's params key, beside the layers


@jax.tree_util.register_pytree_node_class
class PackedWeight:
    """A weight of shape (K, *out) stored as `ports.cpu.dot.pack` panels of its [K, prod(out)] matrix. `shape`,
    `ndim` and `dtype` are the unpacked weight's; `data` [P, K, PANEL] (or [L, P, K, PANEL] stacked by
    `ports.scanned`) is what the product reads."""

    def __init__(self, data, shape: tuple):
        self.data = data
        self.shape = tuple(shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def columns(self) -> int:
        return int(np.prod(self.shape[1:]))

    def tree_flatten(self):
        return (self.data,), self.shape

    @classmethod
    def tree_unflatten(cls, shape, children):
        return cls(children[0], shape)

    def __repr__(self):
        return f"PackedWeight(shape={self.shape}, dtype={self.dtype})"

    @classmethod
    def of(cls, w) -> "PackedWeight":
        """`w` [K, ...] packed."""
        return cls(CD.pack(w.reshape(w.shape[0], -1)), w.shape)

    def unpacked(self):
        """The [K, ...] weight."""
        return CD.unpack(self.data, self.columns).reshape(self.shape)


def dot(x: jax.Array, w: PackedWeight) -> jax.Array:
    """x [..., K] . w -> [..., *w.shape[1:]] in float32."""
    if x.shape[-1] != w.shape[0]:
        raise ValueError(f"activations {x.shape} do not contract with a packed weight of shape {w.shape}")
    m = int(np.prod(x.shape[:-1]))
    y = CD.packed_dot(x.reshape(m, x.shape[-1]), w.data, w.columns)
    return y.reshape(*x.shape[:-1], *w.shape[1:])


def is_packed(model) -> bool:
    """Whether `model` (a `ports.Model`, or a wrapper of one in its `model` field) holds packed weights."""
    while not hasattr(model, "params") and hasattr(model, "model"):
        model = model.model
    params = getattr(model, "params", None)
    return isinstance(params, dict) and any(isinstance(a, PackedWeight) for a in jax.tree.leaves(
        params, is_leaf=lambda a: isinstance(a, PackedWeight)))


def _map_text(model, layer_fn, head_fn):
    lp = layers_path(model.params)
    params = dict(model.params)
    text = params
    if len(lp) == 2:
        text = params[lp[0]] = dict(params[lp[0]])
    layers = get_path(params, lp)
    if isinstance(layers, dict):  # stacked (`ports.scanned`): one dict of [L, ...] leaves
        text[lp[-1]] = layer_fn(layers)
    else:
        text[lp[-1]] = [layer_fn(p) for p in layers]
    head_fn(text)
    return dataclasses.replace(model, params=params)


def pack_weights(model):
    """`model` with its float32 decoder projections packed and its LM head added packed as params["unembed"]: the
    same logits, through `ports.cpu.dot.packed_dot`. Only for the families that run the LLaMA forward; a model
    already packed comes back as it is."""
    if not model.family.scans:
        raise ValueError(f"{model.config.model_type} models do not run packed weights (the LLaMA forward and the "
                         "families built on it do)")
    if is_packed(model):
        return model
    text_cfg = getattr(model.config, "text", model.config)
    stacked = isinstance(get_path(model.params, layers_path(model.params)), dict)

    def layer(p: dict) -> dict:
        return pack_layer(p, stacked)

    def head(text: dict):
        w = text["embed"].T if text_cfg.tie_word_embeddings else text["lm_head"]
        if w.dtype == jnp.float32:
            text[UNEMBED] = PackedWeight.of(w)

    return _map_text(model, layer, head)


def pack_layer(p: dict, stacked: bool = False) -> dict:
    """A decoder layer's params with its float32 projections packed (`stacked`: [L, ...] leaves of scanned
    layers, packed per layer)."""
    def pack(w):
        if not stacked:
            return PackedWeight.of(w)
        return PackedWeight(jax.vmap(lambda a: PackedWeight.of(a).data)(w), w.shape[1:])

    return {name: pack(w) if name in PROJECTIONS and not isinstance(w, PackedWeight) and w.dtype == jnp.float32
            else w for name, w in p.items()}


def plain(w):
    """`w` as a plain array: a `PackedWeight` unpacked ([L, K, ...] when stacked), anything else as it is."""
    if not isinstance(w, PackedWeight):
        return w
    if w.data.ndim == 4:
        return jax.vmap(lambda d: CD.unpack(d, w.columns))(w.data).reshape(w.data.shape[0], *w.shape)
    return w.unpacked()


def plain_layer(p: dict) -> dict:
    """A decoder layer's params with every packed weight unpacked."""
    return {name: plain(w) for name, w in p.items()}


def unpack_weights(model):
    """Inverse of `pack_weights`: plain arrays, no params["unembed"]."""
    if not is_packed(model):
        return model
    return _map_text(model, plain_layer, lambda text: text.pop(UNEMBED, None))


__all__ = ["PROJECTIONS", "PackedWeight", "dot", "is_packed", "pack_layer", "pack_weights", "plain", "plain_layer",
           "unpack_weights"]
