"""Scanned decoder layers: a model whose per-layer params are stacked ([num_layers, ...] per weight) runs its
layers as one `lax.scan` over them, with a stacked KV cache (keys and values [num_layers, B * KVH, S, Dh]).

A program then holds one decoder layer whatever the depth, so its compile time no longer grows with the depth;
each step reads every layer's weights and cache through the scan's per-layer slices; the new keys and values
come out of the scan and are written into the stacked cache once after it (`run_layers`). The layer body is the
unrolled forward's, so logits agree up to the order of float32 sums and greedy tokens are the same.
`scan_layers(model)` and `unscan_layers(model)` convert between the layouts; `ports.families.llama.forward` (and the
families that run it: LLaVA, LLaVA-NeXT, Qwen2-VL) takes either, the engine's caches follow the model's layout
(`ports.core.cache.init_cache(stacked=...)`). `scripts/probe_scan_layers.py` measures what it buys and costs.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ports.core import cache as kvc
from ports.core import layers as LY
from ports.core.fused import layers_path
from ports.core.param_paths import get_path, set_path


def is_stacked(layers) -> bool:
    """Whether a params' "layers" entry is the stacked layout (a dict of [L, ...] arrays, not a list of dicts)."""
    return isinstance(layers, dict)


def num_layers(layers) -> int:
    """How many decoder layers a params' "layers" entry holds (a list, or the stacked layout)."""
    return len(jax.tree.leaves(layers)[0]) if is_stacked(layers) else len(layers)


def stack_layers(layers: list) -> dict:
    """[per-layer dict, ...] -> {name: [L, ...]} (every layer must hold the same names and shapes)."""
    if not layers:
        raise ValueError("a model without decoder layers has nothing to scan")
    keys = {tuple(sorted(p)) for p in layers}
    if len(keys) != 1:
        raise ValueError(f"the layers hold different weights ({sorted(keys)}); they cannot be stacked")
    return jax.tree.map(lambda *xs: jnp.stack(xs), *layers)


def unstack_layers(layers: dict) -> list:
    """{name: [L, ...]} -> [per-layer dict, ...]."""
    n = len(jax.tree.leaves(layers)[0])
    return [jax.tree.map(lambda a: a[i], layers) for i in range(n)]


def is_scanned(model) -> bool:
    """Whether `model` (a `ports.Model`, or a wrapper of one in its `model` field) runs stacked layers."""
    while not hasattr(model, "params") and hasattr(model, "model"):
        model = model.model
    params = getattr(model, "params", None)
    if not isinstance(params, dict):
        return False
    try:
        return is_stacked(get_path(params, layers_path(params)))
    except (KeyError, TypeError):
        return False


def _with_layers(model, fn):
    if not model.family.scans:
        raise ValueError(f"{model.config.model_type} models do not run scanned layers (the LLaMA forward and the "
                         "families built on it do)")
    lp = layers_path(model.params)
    params = dict(model.params)
    if len(lp) == 2:  # a VLM's language model: copy the dict the layers sit in, not the caller's
        params[lp[0]] = dict(params[lp[0]])
    set_path(params, lp, fn(get_path(params, lp)))
    return dataclasses.replace(model, params=params)


def scan_layers(model):
    """The model with its decoder layers stacked (a new copy of their weights): its forward runs them as one
    `lax.scan`, with the same results."""
    return _with_layers(model, lambda ls: ls if is_stacked(ls) else stack_layers(ls))


def unscan_layers(model):
    """The model with its decoder layers as a list again (the unrolled forward)."""
    return _with_layers(model, lambda ls: unstack_layers(ls) if is_stacked(ls) else ls)


def run_layers(cfg, layers: dict, x, k_all, v_all, cos, sin, start, visible, score_weights, fresh: bool,
               keep_hidden: bool):
    """The decoder layers over x [B, T, D] as one scan. k_all, v_all [L, N, S, Dh]; the new keys / values go at
    slots start[b].. Returns (x, ks, vs, hiddens, attn): ks / vs the stacked buffers after the writes (only the new
    rows [L, N, T, Dh] under a `Deferred` visibility, which writes nothing); hiddens [L, B, T, D] the residual
    stream after each layer (None unless `keep_hidden`); attn the attention scores summed over layers (None unless
    `score_weights`).

    The cache is read by the scan, never written inside it: a forward over a filled cache attends each layer's old
    slots and its new keys apart (`layers.split_visibility`), the scan gives out only the new rows, and they are
    written into the stacked buffers once after it. (A write inside the scan made it give out every layer's whole
    buffer: the stacked cache copied in and out each forward.) A prefill (`fresh`, `Causal`, `Prefix`) and a
    forward asked for attention scores still write as the unrolled layers do."""
    held = isinstance(visible, jax.Array) and score_weights is None and not fresh
    if held:
        visible = LY.split_visibility(visible, start)

    def body(carry, xs):
        x, attn = carry
        p, kb, vb = xs
        x, kb, vb, scores = LY.decoder_layer(cfg, p, x, cos, sin, kb, vb, start, visible, score_weights, fresh)
        if scores is not None:
            attn = attn + scores
        return (x, attn), (kb, vb, x if keep_hidden else None)

    B = x.shape[0]
    attn0 = None if score_weights is None else jnp.zeros((B, k_all.shape[2]), jnp.float32)
    (x, attn), (ks, vs, hiddens) = jax.lax.scan(body, (x, attn0), (layers, k_all, v_all))
    if held:
        ks, vs = kvc.write_new_rows(k_all, v_all, ks, vs, start)
    return x, ks, vs, hiddens, attn


__all__ = ["is_scanned", "is_stacked", "run_layers", "scan_layers", "stack_layers", "unscan_layers", "unstack_layers"]
