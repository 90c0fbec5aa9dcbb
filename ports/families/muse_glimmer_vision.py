"""Muse Glimmer's vision tower (transformers 5.23's `MuseGlimmerVisionModel`): params, the host-side frame layout, a
fixed-shape forward, HF key map.

transformers runs the tower over one flat sequence of every image's and video's patches: a linear patch embedding
(no bias) plus a learned `pos_emb_height` x `pos_emb_width` position table resampled bilinearly to each frame's
patch grid (`grid_sample`, half-pixel centres, zero padding), `ln_pre`, then `num_hidden_layers` pre-norm blocks
(LayerNorm, q/k/v/proj attention with biases and an axial 2-D rotary embedding of the patch's (column + 1, row + 1),
fc1 / act / fc2) in which "full_attention" layers attend within each frame (a temporal patch group: one image, or
`patch_temporal` video frames) and "window_attention" layers within square windows of `pos_emb_height` patches a
side of that frame, then `ln_post` and a pixel shuffle that joins each `merge_size` x `merge_size` block of patches
into one token of merge^2 x hidden features (channel-major: feature c * merge^2 + k of block patch k).

Every op but attention is per patch and attention never crosses a frame, so here the tower runs on a frame-major
layout [F, L, ...] (`frame_layout`, numpy, from the processor's `pixel_values` / `image_grid_thw`): frame f's
patches in the processor's raster order, padded to L; a full layer masks the padding, a window layer also keeps
each patch to its window (a [L, L] mask per frame, which matches transformers' reordering into windows: attention
inside a window does not depend on the order of its patches). F and L are bucketed so nearby inputs share a
compilation; frames are encoded `ports.core.layers.VISION_BATCH` at a time.

Params (a plain pytree, matrices [in, out]):
    {"patch_embed": [temporal * 3 * p * p, D], "pos_embed": [pos_h * pos_w, D], "ln_pre", "ln_pre_b", "ln_post",
     "ln_post_b": [D],
     "layers": [{"norm1", "norm1_b", "norm2", "norm2_b", "wq", "bq", "wk", "bk", "wv", "bv", "wo", "bo",
                 "w_fc1", "b_fc1", "w_fc2", "b_fc2"}, ...]}
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ports.core import anyres as ANY
from ports.core import layers as LY
from ports.families import qwen2_vl_vision as QV
from ports.core import vision as VIS

LAYER_TYPES = ("full_attention", "window_attention")
BLOCK_NORM_EPS = 1e-5  # transformers hard-codes it for each block's norm1 / norm2 (ln_pre / ln_post: layer_norm_eps)
# transformers 5.23's MuseGlimmerVisionConfig defaults
DEFAULTS = dict(patch_size=14, pos_emb_height=32, pos_emb_width=32, num_attention_heads=16, num_hidden_layers=50,
                hidden_size=1536, intermediate_size=8960, hidden_act="gelu", patch_temporal=2, merge_size=2,
                layer_norm_eps=1e-5)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MuseVisionConfig(QV.FrameTowerConfig):
    """The tower's static config. full_layers: the "full_attention" layers (the others attend within windows of
    `pos_grid` x `pos_grid` patches); pos_grid: the side of the learned position table (transformers reads
    pos_emb_height for both sides: square only). transformers' patch embedding is 3-channel (`in_channels`)."""

    hidden_act: str = "gelu"
    pos_grid: int = 32
    layer_norm_eps: float = 1e-5
    full_layers: tuple[int, ...] = ()

    model_type = "muse_glimmer"
    merge_key = "merge_size"

    @property
    def patch_layout(self) -> str:
        """The factors of `patch_dim` in the order a pixel_values row holds them (temporal, channel, row, column)."""
        return (f"(patch_temporal {self.temporal_patch_size} x {self.in_channels} channels x patch_size "
                f"{self.patch_size}^2)")

    @property
    def out_dim(self) -> int:
        """Features of one merged token (the pixel shuffle's output)."""
        return self.width * self.merge_unit


def _int(d: dict, key: str, minimum: int = 1) -> int:
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"muse_glimmer vision_config: {key} = {v!r}; expected an integer >= {minimum}")
    return v


def vision_config_from_hf(d: dict[str, Any]) -> MuseVisionConfig:
    """A `MuseVisionConfig` of an HF `vision_config` dict (transformers 5.23's defaults for absent fields);
    ValueError naming the field transformers would not run, or jspec cannot."""
    v = {**DEFAULTS, **{k: d[k] for k in DEFAULTS if d.get(k) is not None}}
    ints = {k: _int(v, k) for k in ("patch_size", "pos_emb_height", "pos_emb_width", "num_attention_heads",
                                    "num_hidden_layers", "hidden_size", "intermediate_size", "patch_temporal",
                                    "merge_size")}
    if ints["pos_emb_height"] != ints["pos_emb_width"]:
        raise ValueError(f"muse_glimmer vision_config: pos_emb_height {ints['pos_emb_height']} != pos_emb_width "
                         f"{ints['pos_emb_width']}: transformers 5.23 reads the position table as a square of "
                         "pos_emb_height a side")
    width, heads = ints["hidden_size"], ints["num_attention_heads"]
    if width % heads or (width // heads) % 4:
        raise ValueError(f"muse_glimmer vision_config: hidden_size {width} / num_attention_heads {heads} must be a "
                         "whole head_dim that is a multiple of 4 (the axial rotary embedding splits each head in four)")
    if v["hidden_act"] not in VIS.ACTIVATIONS:
        raise ValueError(f"muse_glimmer vision_config: hidden_act {v['hidden_act']!r} is not supported; jspec "
                         f"supports {sorted(VIS.ACTIVATIONS)}")
    eps = v["layer_norm_eps"]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"muse_glimmer vision_config: layer_norm_eps = {eps!r}; expected a positive number")
    rope = dict(d.get("rope_parameters") or {})
    rope_type = rope.get("rope_type", rope.get("type", "axial"))
    if rope_type not in ("axial", "default"):  # transformers turns "default" into the tower's "axial"
        raise ValueError(f"muse_glimmer vision_config: rope_parameters rope_type {rope_type!r}; the tower supports "
                         "only axial rope (as transformers)")
    theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise ValueError(f"muse_glimmer vision_config: rope_parameters rope_theta = {theta!r}; expected a positive "
                         "number")
    n = ints["num_hidden_layers"]
    types = d.get("layer_types")
    if types is None:
        types = [LAYER_TYPES[not ((i + 1) % 4 == 0 or i == n - 1)] for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in LAYER_TYPES for t in types):
        raise ValueError(f"muse_glimmer vision_config: layer_types = {types!r}; expected {n} entries (one per "
                         f"num_hidden_layers), each one of {LAYER_TYPES}")
    return MuseVisionConfig(depth=n, width=width, mlp_dim=ints["intermediate_size"], num_heads=heads,
                            hidden_act=v["hidden_act"], patch_size=ints["patch_size"],
                            temporal_patch_size=ints["patch_temporal"], merge_size=ints["merge_size"],
                            pos_grid=ints["pos_emb_height"], layer_norm_eps=float(eps), rope_theta=float(theta),
                            full_layers=tuple(i for i, t in enumerate(types) if t == "full_attention"))


def vision_config_to_hf(cfg: MuseVisionConfig) -> dict[str, Any]:
    return {"model_type": "muse_glimmer_vision", "patch_size": cfg.patch_size, "pos_emb_height": cfg.pos_grid,
            "pos_emb_width": cfg.pos_grid, "num_attention_heads": cfg.num_heads, "num_hidden_layers": cfg.depth,
            "hidden_size": cfg.width, "intermediate_size": cfg.mlp_dim, "hidden_act": cfg.hidden_act,
            "rope_parameters": {"rope_type": "axial", "rope_theta": cfg.rope_theta},
            "patch_temporal": cfg.temporal_patch_size, "merge_size": cfg.merge_size,
            "max_position_embeddings": cfg.pos_grid ** 2, "layer_norm_eps": cfg.layer_norm_eps,
            "layer_types": [LAYER_TYPES[i not in cfg.full_layers] for i in range(cfg.depth)]}


# --------------------------------------------------------------------------------------------------- params


def param_shapes(cfg: MuseVisionConfig) -> dict:
    d, f = cfg.width, cfg.mlp_dim
    layer = {"norm1": (d,), "norm1_b": (d,), "norm2": (d,), "norm2_b": (d,)}
    for w in ("wq", "wk", "wv", "wo"):
        layer.update({w: (d, d), "b" + w[1:]: (d,)})
    layer.update(w_fc1=(d, f), b_fc1=(f,), w_fc2=(f, d), b_fc2=(d,))
    return {"patch_embed": (cfg.patch_dim, d), "pos_embed": (cfg.pos_grid ** 2, d), "ln_pre": (d,), "ln_pre_b": (d,),
            "layers": [dict(layer) for _ in range(cfg.depth)], "ln_post": (d,), "ln_post_b": (d,)}


def init_params(cfg: MuseVisionConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> dict:
    """Random params: normal(0, std), unit norm scales, zero norm biases."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(flat))
    out = []
    for k, (path, shape) in zip(keys, flat):
        name = jax.tree_util.keystr(path)
        if name.endswith(("norm1']", "norm2']", "ln_pre']", "ln_post']")):
            out.append(jnp.ones(shape, dtype))
        elif name.endswith("_b']") and ("norm" in name or "ln_" in name):
            out.append(jnp.zeros(shape, dtype))
        else:
            out.append((jax.random.normal(k, shape, jnp.float32) * std).astype(dtype))
    return jax.tree.unflatten(treedef, out)


def hf_key_map(cfg: MuseVisionConfig, prefix: str = "model.vision_tower."):
    """(hf_name, param path, transform) rows of the tower at `prefix` (transformers 5.23 saves its in-memory names)."""
    rows = [(f"{prefix}patch_embedder.patch_embedding.weight", ("patch_embed",), "T"),
            (f"{prefix}patch_embedder.position_embedding_table.weight", ("pos_embed",), None)]
    for ln in ("ln_pre", "ln_post"):
        rows += [(f"{prefix}{ln}.weight", (ln,), None), (f"{prefix}{ln}.bias", (ln + "_b",), None)]
    linears = {"wq": "attn.q_proj", "wk": "attn.k_proj", "wv": "attn.v_proj", "wo": "attn.proj",
               "w_fc1": "mlp.fc1", "w_fc2": "mlp.fc2"}
    for i in range(cfg.depth):
        rows += QV.block_key_rows(f"{prefix}layers.{i}.", i, linears)
    return rows


# --------------------------------------------------------------------------------------------------- host layout


class FrameLayout(NamedTuple):
    """The tower's fixed-shape input, built on the host by `frame_layout`."""

    patches: np.ndarray  # [F, L, patch_dim] float32: frame f's patches in raster order (the processor's)
    rot: np.ndarray  # [F, L, 2] int32: (column + 1, row + 1), the axial rotary positions in transformers' order
    valid: np.ndarray  # [F, L] bool
    window: np.ndarray  # [F, L] int32: each patch's window in its frame (-1: padding)
    interp_index: np.ndarray  # [F, L, 4] int32: the position-table rows each patch's position embedding mixes
    interp_weight: np.ndarray  # [F, L, 4] float32: their bilinear weights
    merge_index: np.ndarray  # [F, L / merge_unit, merge_unit] int32: the frame slots of each merged token's block
    frame_start: np.ndarray  # [num_items + 1] int32: first frame of each item (images, then videos)
    merged_per_frame: int  # L / merge_unit


check_grid = QV.check_grid
check_pixels = QV.check_pixels


def _axis_taps(n: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear taps [n, 2] into a `side`-long axis for the n positions of a grid axis of length n, and their
    weights: transformers' `_interpolation_axis_taps_weights` (align_corners False, zero padding), in float32."""
    f32 = np.float32
    src = (np.arange(n, dtype=f32) + f32(0.5)) * f32(side) / f32(n) - f32(0.5)
    floor = np.floor(src)
    raw = floor.astype(np.int64)[:, None] + np.arange(2)
    dist = np.abs(src[:, None] - floor[:, None] - np.arange(2).astype(f32))
    weights = np.maximum(f32(1) - dist, f32(0)) * ((raw >= 0) & (raw <= side - 1))
    return np.clip(raw, 0, side - 1), weights.astype(f32)


def frame_tables(cfg: MuseVisionConfig, h: int, w: int) -> dict[str, np.ndarray]:
    """One frame's per-patch tables (raster order, h * w patches): rotary positions, windows, position-table taps
    and weights, and the merged tokens' patch slots (block-major, as transformers' pixel shuffle takes them)."""
    rr, cc = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    rr, cc = rr.reshape(-1), cc.reshape(-1)
    ws = cfg.pos_grid
    window = (rr // ws) * (-(-w // ws)) + cc // ws
    ht, hw = _axis_taps(h, cfg.pos_grid)
    wt, ww = _axis_taps(w, cfg.pos_grid)
    index = (ht[rr][:, :, None] * cfg.pos_grid + wt[cc][:, None, :]).reshape(-1, 4)
    weight = (hw[rr][:, :, None] * ww[cc][:, None, :]).reshape(-1, 4)
    m = cfg.merge_size
    merge = np.arange(h * w).reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3).reshape(-1, m * m)
    return dict(rot=np.stack([cc + 1, rr + 1], axis=-1), window=window, index=index, weight=weight, merge=merge)


def frame_layout(cfg: MuseVisionConfig, items: list[tuple[np.ndarray, tuple[int, int, int]]]) -> FrameLayout:
    """Lay out items [(pixel rows [t*h*w, patch_dim], (t, h, w)), ...] frame by frame; F and L are padded to
    `anyres.bucket` sizes (L a multiple of the merge unit)."""
    frames = [(px[f * h * w:(f + 1) * h * w], h, w) for px, (t, h, w) in items for f in range(t)]
    unit = cfg.merge_unit
    Lp = -(-ANY.bucket(max(h * w for _, h, w in frames)) // unit) * unit
    Fp = ANY.bucket(len(frames))
    patches = np.zeros((Fp, Lp, cfg.patch_dim), np.float32)
    rot = np.zeros((Fp, Lp, 2), np.int32)
    valid = np.zeros((Fp, Lp), bool)
    window = np.full((Fp, Lp), -1, np.int32)
    index = np.zeros((Fp, Lp, 4), np.int32)
    weight = np.zeros((Fp, Lp, 4), np.float32)
    merge = np.zeros((Fp, Lp // unit, unit), np.int32)
    tables = {}
    for f, (px, h, w) in enumerate(frames):
        if (h, w) not in tables:
            tables[h, w] = frame_tables(cfg, h, w)
        t = tables[h, w]
        n = h * w
        patches[f, :n] = px
        rot[f, :n], valid[f, :n], window[f, :n] = t["rot"], True, t["window"]
        index[f, :n], weight[f, :n] = t["index"], t["weight"]
        merge[f, :n // unit] = t["merge"]
    starts = np.cumsum([0] + [t for _, (t, _, _) in items]).astype(np.int32)
    return FrameLayout(patches, rot, valid, window, index, weight, merge, starts, Lp // unit)


# --------------------------------------------------------------------------------------------------- forward


class VisionOut(NamedTuple):
    merged: jax.Array  # [F, L / merge_unit, width * merge_unit]: the pixel shuffle's output per frame
    hidden: jax.Array  # [F, L, width]: after ln_post, before the shuffle


def block(cfg: MuseVisionConfig, p: dict, x: jax.Array, cos, sin, visible) -> jax.Array:
    """One tower block on frames x [F, L, D]; visible [F, L, L] says which patches each patch attends to."""
    F, Lp, D = x.shape
    H, Dh = cfg.num_heads, cfg.head_dim
    h = VIS.layer_norm(x, p["norm1"], p["norm1_b"], BLOCK_NORM_EPS)
    q, k, v = (LY.linear(h, p[w], p["b" + w[1:]]).reshape(F, Lp, H, Dh) for w in ("wq", "wk", "wv"))
    dt = q.dtype
    q = LY.apply_rope(q.astype(jnp.float32), cos, sin).astype(dt)  # transformers rotates in float32
    k = LY.apply_rope(k.astype(jnp.float32), cos, sin).astype(dt)
    o = LY.attention(q, LY.kv_rows(k), LY.kv_rows(v), visible)
    x = x + LY.linear(o.reshape(F, Lp, D), p["wo"], p["bo"])
    h = VIS.layer_norm(x, p["norm2"], p["norm2_b"], BLOCK_NORM_EPS)
    return x + LY.linear(VIS.activation(cfg.hidden_act, LY.linear(h, p["w_fc1"], p["b_fc1"])), p["w_fc2"], p["b_fc2"])


def forward(cfg: MuseVisionConfig, params: dict, patches, rot, valid, window, interp_index, interp_weight,
            merge_index) -> VisionOut:
    """Encode frames (a `FrameLayout`'s arrays), `ports.core.layers.VISION_BATCH` frames at a time. Padding patches are
    never attended to; their outputs (and the merged tokens past a frame's own) are junk."""
    return LY.in_batches(lambda *a: _frames_forward(cfg, params, *a),
                         (patches, rot, valid, window, interp_index, interp_weight, merge_index), LY.VISION_BATCH)


def _frames_forward(cfg: MuseVisionConfig, params: dict, patches, rot, valid, window, interp_index, interp_weight,
                    merge_index) -> VisionOut:
    dt = params["patch_embed"].dtype
    F, Lp, _ = patches.shape
    x = LY.linear(patches.astype(dt), params["patch_embed"])
    pos = sum(interp_weight[..., t, None] * jnp.take(params["pos_embed"], interp_index[..., t], axis=0).astype(
        jnp.float32) for t in range(interp_index.shape[-1]))  # one tap at a time: no [F, L, 4, D] gather
    x = x + pos.astype(dt)
    x = VIS.layer_norm(x, params["ln_pre"], params["ln_pre_b"], cfg.layer_norm_eps)
    cos, sin = QV.rotary(cfg, rot)
    full = jnp.broadcast_to(valid[:, None, :], (F, Lp, Lp))
    local = full & (window[:, :, None] == window[:, None, :])
    for i, p in enumerate(params["layers"]):
        x = block(cfg, p, x, cos, sin, full if i in cfg.full_layers else local)
    x = VIS.layer_norm(x, params["ln_post"], params["ln_post_b"], cfg.layer_norm_eps)
    Lm, u = merge_index.shape[1], merge_index.shape[2]
    blocks = jnp.take_along_axis(x, merge_index.reshape(F, Lm * u, 1), axis=1).reshape(F, Lm, u, -1)
    return VisionOut(blocks.transpose(0, 1, 3, 2).reshape(F, Lm, -1), x)
