"""The decoder layers' run layout: q/k/v and gate/up projections fused, as gpt-fast does at load time.

Checkpoints (HF and the key maps) hold one matrix per projection: wq [D, H*Dh], wk / wv [D, KVH*Dh], w_gate /
w_up [D, F]. A decode step runs one matmul per fused matrix instead of three and two (measured on the 2-core CPU
with the zoo text target: a decode step 15% and a 48-token prefill 14% faster; fewer kernels on a GPU too):

    wqkv [D, KVH, G + 2, Dh]: for each KV head, its G = H / KVH query heads, then its key, then its value
    bqkv [KVH, G + 2, Dh]   (with qkv biases)
    w_gate_up [D, 2, F]      (gate, then up)
    b_gate_up [2, F]         (with MLP biases)

Grouping by KV head keeps a tensor-parallel split whole: each device holds complete groups (query heads with the
key and value they read), so the split needs no communication. Where the KV heads cannot split over the tensor
axes but the query heads can (8 KV heads, 16-way), `jspec.core.sharding.shard` puts q/k/v back as separate matrices,
so wq still splits by heads. Query head h = kv * G + g: the order of wq's columns and of HF's `repeat_kv`.

A mixture-of-experts layer's expert matrices (`ports.core.moe`: we_gate, we_up, we_down) are a list of per-expert
matrices in the checkpoint layout and one stacked [E, ...] array in the run layout; a config whose
`joined_experts` is true (Qwen3-VL-MoE, which stores them so) keeps gate and up as one stacked
we_gate_up [E, D, 2F] (gate columns, then up) in its checkpoint layout.

`fuse_params` / `unfuse_params` convert the decoder layers of a params tree (other leaves, vision towers and
already converted layers pass through); the loaders fuse, `save_hf` unfuses. The forwards accept both layouts.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

SEPARATE_QKV = ("wq", "wk", "wv")
SEPARATE_MLP = ("w_gate", "w_up")
EXPERTS = ("we_gate", "we_up", "we_down")  # `ports.core.moe`'s expert matrices: per-expert lists <-> stacked [E, ...]


def _xp(a):
    return np if isinstance(a, np.ndarray) else jnp


def _groups(cfg) -> tuple[int, int, int]:
    """(KVH, G, Dh) of the text decoder of `cfg`."""
    text = getattr(cfg, "text", cfg)
    H, KVH, Dh = text.num_heads, text.num_kv_heads, text.head_dim
    if H % KVH:
        raise ValueError(f"num_heads={H} is not a multiple of num_kv_heads={KVH}")
    return KVH, H // KVH, Dh


def fuse_layer(cfg, layer: dict) -> dict:
    """One decoder layer's params in the run layout (numpy in, numpy out; jax arrays likewise); parts already
    fused pass through."""
    out = dict(layer)
    if "wq" in layer:
        KVH, G, Dh = _groups(cfg)
        wq, wk, wv = (out.pop(k) for k in SEPARATE_QKV)
        xp, D = _xp(wq), wq.shape[0]
        out["wqkv"] = xp.concatenate([wq.reshape(D, KVH, G, Dh), wk.reshape(D, KVH, 1, Dh),
                                      wv.reshape(D, KVH, 1, Dh)], axis=2)
        if "bq" in layer:
            bq, bk, bv = (out.pop(k) for k in ("bq", "bk", "bv"))
            out["bqkv"] = xp.concatenate([bq.reshape(KVH, G, Dh), bk.reshape(KVH, 1, Dh), bv.reshape(KVH, 1, Dh)],
                                         axis=1)
    if "w_gate" in layer:
        g, u = out.pop("w_gate"), out.pop("w_up")
        out["w_gate_up"] = _xp(g).stack([g, u], axis=1)
        if "b_gate" in layer:
            bg, bu = out.pop("b_gate"), out.pop("b_up")
            out["b_gate_up"] = _xp(bg).stack([bg, bu], axis=0)
    for k in EXPERTS:
        if isinstance(layer.get(k), list):
            out[k] = _xp(layer[k][0]).stack(layer[k])
    if "we_gate_up" in layer:
        w = out.pop("we_gate_up")
        F = w.shape[-1] // 2
        out.update(we_gate=w[..., :F], we_up=w[..., F:])
    return out


def unfuse_layer(cfg, layer: dict, qkv: bool = True, mlp: bool = True) -> dict:
    """Inverse of `fuse_layer` (the checkpoint layout); `qkv` / `mlp` False keep that part fused."""
    out = dict(layer)
    if qkv and "wqkv" in layer:
        KVH, G, Dh = _groups(cfg)
        w = out.pop("wqkv")
        D = w.shape[0]
        out.update(wq=w[:, :, :G].reshape(D, KVH * G * Dh), wk=w[:, :, G].reshape(D, KVH * Dh),
                   wv=w[:, :, G + 1].reshape(D, KVH * Dh))
        if "bqkv" in layer:
            b = out.pop("bqkv")
            out.update(bq=b[:, :G].reshape(-1), bk=b[:, G].reshape(-1), bv=b[:, G + 1].reshape(-1))
    if mlp and "w_gate_up" in layer:
        w = out.pop("w_gate_up")
        out.update(w_gate=w[:, 0], w_up=w[:, 1])
        if "b_gate_up" in layer:
            b = out.pop("b_gate_up")
            out.update(b_gate=b[0], b_up=b[1])
    if mlp and getattr(cfg, "joined_experts", False) and "we_gate" in layer:
        out["we_gate_up"] = _xp(layer["we_gate"]).concatenate([out.pop("we_gate"), out.pop("we_up")], axis=-1)
        return out
    for k in EXPERTS:
        if mlp and k in layer and not isinstance(layer[k], list):
            out[k] = [layer[k][e] for e in range(layer[k].shape[0])]
    return out


def fused_layer_shapes(cfg, layer: dict) -> dict:
    """`fuse_layer` on a dict of shape tuples (computed, nothing allocated: a 70B layer's would be 0.5 GB)."""
    out = dict(layer)
    if "wq" in layer:
        KVH, G, Dh = _groups(cfg)
        D = layer["wq"][0]
        for k in SEPARATE_QKV:
            del out[k]
        out["wqkv"] = (D, KVH, G + 2, Dh)
        if "bq" in layer:
            for k in ("bq", "bk", "bv"):
                del out[k]
            out["bqkv"] = (KVH, G + 2, Dh)
    if "w_gate" in layer:
        D, F = layer["w_gate"]
        del out["w_gate"], out["w_up"]
        out["w_gate_up"] = (D, 2, F)
        if "b_gate" in layer:
            del out["b_gate"], out["b_up"]
            out["b_gate_up"] = (2, F)
    for k in EXPERTS:
        if isinstance(layer.get(k), list):
            out[k] = (len(layer[k]),) + tuple(layer[k][0])
    if "we_gate_up" in layer:
        E, D, F2 = out.pop("we_gate_up")
        out.update(we_gate=(E, D, F2 // 2), we_up=(E, D, F2 - F2 // 2))
    return out


def layers_path(params: dict) -> tuple:
    """Path of the decoder's layer list in a params tree (under "lm" for VLMs)."""
    return ("lm", "layers") if "lm" in params else ("layers",)


def has_decoder(cfg) -> bool:
    """Whether `cfg` has a text decoder to fuse (a vision-tower model's layers keep their own layout: its forward
    reads their projections by name)."""
    return hasattr(getattr(cfg, "text", cfg), "num_kv_heads")


def _map_layers(params: dict, fn, cfg) -> dict:
    """fn over the decoder layers (the tree as it is when there is no decoder)."""
    if not has_decoder(cfg):
        return params
    lp = layers_path(params)
    out = dict(params)
    if len(lp) == 2:
        out[lp[0]] = dict(out[lp[0]])
        out[lp[0]][lp[1]] = [fn(layer) for layer in out[lp[0]][lp[1]]]
    else:
        out[lp[0]] = [fn(layer) for layer in out[lp[0]]]
    return out


def fuse_params(cfg, params: dict) -> dict:
    """The params tree with every decoder layer in the run layout (a new tree; arrays not fused are shared)."""
    return _map_layers(params, lambda layer: fuse_layer(cfg, layer), cfg)


def unfuse_params(cfg, params: dict, qkv: bool = True, mlp: bool = True) -> dict:
    """The params tree in the checkpoint layout (`qkv` / `mlp` False: keep that part fused)."""
    return _map_layers(params, lambda layer: unfuse_layer(cfg, layer, qkv, mlp), cfg)


def fused_shapes(cfg, shapes: dict) -> dict:
    """`fuse_params` on a tree of shape tuples (what `param_shapes` returns)."""
    return _map_layers(shapes, lambda layer: fused_layer_shapes(cfg, layer), cfg)
